//! ipreclaim: reclaims leaked IP addresses from whereabouts-style IPAM pools.
//!
//! The binary's subcommands are wired in `main.rs`; the shared pod lifecycle core lives in
//! the `podlife` crate.

pub mod api;
pub mod controller;
pub mod flags;
pub mod index;
pub mod ipam;
pub mod node;
pub mod reclaim;
pub mod release;
pub mod scan;
pub mod telemetry;
pub mod watch_retry;

pub use podlife;
