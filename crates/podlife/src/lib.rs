//! podlife: the pod lifecycle core shared by ipreclaim's controller and node agent.
//!
//! - [`pleg`]: a kubelet-style relisting pod lifecycle event generator over a [`PodSource`].
//! - [`cache`]: the pod status cache it fills, with the kubelet's IP preservation.
//! - [`lifecycle`]: a pod lifecycle tracker (syncing, terminating, terminated, finished).
//! - [`queue`]: a keyed work queue with client-go semantics and rate limiters.
//! - [`backoff`] and [`throttle`]: per-key backoff, QPS/burst and max-in-flight limits;
//!   [`priority`]: one such budget shared by work of different urgency.
//! - [`clock`]: injected time, so that nothing here needs a real sleep to be tested.
//!
//! Everything here is pure: no I/O, and no time but the injected [`clock::Clock`].
//!
//! # Driving the PLEG
//!
//! ```
//! use std::sync::Arc;
//! use podlife::clock::FakeClock;
//! use podlife::pleg::{EventKind, Pleg, PlegConfig, PodSource};
//! use podlife::{Container, ContainerState, PodStatus, PodStatusCache, RuntimePod, SourceError};
//!
//! /// A runtime with one pod whose sandbox runs.
//! struct OnePod;
//!
//! impl PodSource for OnePod {
//!     async fn list_pods(&self) -> Result<Vec<RuntimePod>, SourceError> {
//!         let mut pod = RuntimePod::new("uid-1");
//!         pod.sandboxes.push(Container::new("sandbox-1", ContainerState::Running));
//!         Ok(vec![pod])
//!     }
//!     async fn pod_status(&self, pod: &RuntimePod) -> Result<PodStatus, SourceError> {
//!         Ok(PodStatus { ips: vec!["192.0.2.10".into()], ..PodStatus::empty(&pod.uid) })
//!     }
//! }
//!
//! # tokio_test::block_on(async {
//! let cache = Arc::new(PodStatusCache::new());
//! let (mut pleg, mut events) =
//!     Pleg::new(OnePod, Some(cache.clone()), FakeClock::new(), PlegConfig::default());
//! pleg.relist().await;
//! let event = events.try_recv().unwrap();
//! assert_eq!(event.kind, EventKind::ContainerStarted);
//! assert_eq!(cache.get("uid-1").0.ips, ["192.0.2.10"]);
//! assert!(pleg.handle().healthy().is_ok());
//! # });
//! ```
//!
//! In a program, `pleg.run(shutdown)` relists every period on tokio instead.

#![warn(missing_docs)]

pub mod backoff;
pub mod cache;
pub mod clock;
pub mod lifecycle;
pub mod pleg;
pub mod pod;
pub mod priority;
pub mod queue;
pub mod throttle;

pub use cache::PodStatusCache;
pub use pleg::{PodLifecycleEvent, PodSource};
pub use pod::{
    Container, ContainerId, ContainerState, ContainerStatus, PodStatus, PodUid, RuntimePod,
    SandboxState, SandboxStatus, SourceError,
};
