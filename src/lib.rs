//! ipreclaim: reclaims leaked IP addresses from whereabouts-style IPAM pools.
//!
//! The binary's subcommands are wired in `main.rs`. The pure core (resources, the whereabouts
//! domain, the rules that decide, the index) is the `ipreclaim-core` crate, re-exported here;
//! the shared pod lifecycle core is the `podlife` crate.

pub use ipreclaim_core::{api, clock, index, ipam, lifts, rules, seen};

mod client_layer;
pub mod controller;
pub mod flags;
pub mod node;
pub mod paged;
pub mod protobuf_lists;
pub mod release;
pub mod request_deadline;
pub mod scan;
pub mod telemetry;
pub mod watch_retry;

pub use podlife;
