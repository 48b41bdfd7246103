//! The release path, shared by the controller and the node agent: the batching pool writer
//! (releases, fences, reservation deletes), the Event publisher, and the types they share.
//!
//! Its pure parts: the pool schedule (`schedule`), the batch's shape (`batch`) and the patch
//! builder (`patch`); the rest is the async shell that sends them.
//!
//! Imports everything below it (`index`, `reclaim`, `ipam`, `telemetry`, `watch_retry`,
//! `api`); imported by the programs (`controller`, `node`), never the other way.

pub mod audit;
pub mod batch;
mod batcher;
pub mod budget;
pub mod cooling;
mod deletes;
pub mod events;
mod fence_records;
#[cfg(test)]
mod fixtures;
mod fresh_pool;
pub mod inventories;
pub mod manual;
pub mod patch;
pub mod recorder;
pub mod repair;
pub mod reservation;
pub mod schedule;
pub mod types;
pub mod writer;

pub use budget::{BudgetConfig, Budgets, WriteKind};
pub use events::Events;
pub use types::{EntryWrite, Judged, PodRef, ReleaseError, ReleaseOutcome, ReleaseRequest};
pub use writer::{Writer, WriterHandle};

/// Sleeps until `next`, or for ever when there is none (the wake-up arm of a writer's
/// `select!` loop).
async fn sleep_until(next: Option<std::time::Instant>) {
    match next {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}
