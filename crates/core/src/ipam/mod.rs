//! The whereabouts domain, pure: IPAM config parsing, pool and reservation naming,
//! offset <-> IP, pool allocations, and the pod network-status annotation.
//!
//! Pure (no runtime, no client). Imports only `api`; `reclaim`, `index` and everything above
//! import it.

pub mod attachment_ips;
pub mod capacity;
pub mod config;
pub mod cooldown;
pub mod entry_key;
pub mod fence;
pub mod inventory;
pub mod naming;
pub mod network_status;
pub mod networks;
pub mod own_write;
pub mod pod_key;
pub mod pool;

pub use config::{IpRange, IpamConfig, NadConfigError, parse_nad_config};
pub use naming::{ippool_name, is_node_slice_pool, reservation_name, reservation_prefixes};
pub use network_status::{
    MAX_ATTACHMENTS, MAX_IPS_PER_ATTACHMENT, MAX_NETWORK_STATUS_BYTES, NETWORK_STATUS_ANNOTATION,
    NetworkAttachment, NetworkStatusError, parse_network_status, qualified_network,
};
pub use networks::{NETWORKS_ANNOTATION, NetworksError, parse_networks};
pub use pod_key::{PodKey, PodKeyError};
pub use pool::{
    PoolAllocations, PoolEntry, PoolProblem, holds_address, ip_at, offset_of, pool_allocations,
};
