//! ipreclaim's pure core: what the programs decide with, never how they talk to the API.
//!
//! From the ground up, each module importing only those before it:
//! - `api`: the custom resources, wire-compatible with whereabouts and Multus;
//! - `ipam`: the whereabouts domain (pools, naming, config, network-status, fence and
//!   cooldown marks, sandbox inventories);
//! - `rules`: the decisions (is this allocation garbage and why; the grace clock, the
//!   breaker, when a fence lifts, when a cooldown ends, other writers);
//! - `index`: what the controller knows, stripped to what the rules need;
//! - `lifts`: which fences lift now, over one pass of the index (the lifter's decisions);
//! - `clock` and `seen`: where the rules read the time (the programs pass theirs), and the
//!   one home of "first seen, due after a wait" and "report once per episode".
//!
//! No async runtime and no API client: the crate depends on neither.

pub mod api;
pub mod clock;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod index;
pub mod ipam;
pub mod lifts;
pub mod rules;
pub mod seen;
