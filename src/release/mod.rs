//! The release path, shared by the controller, the node agent and the manual commands: the
//! writer (`writer`) and its three jobs, a folder each: pool writes (`pools`), object writes
//! (`objects`: fence records, reservation deletes, their re-checks and repairs) and reports
//! (`reports`: Events, audit, dry-run memory). It learns what it must know and tells what it
//! wrote through a [`ledger::Ledger`]: the controller's index, or fresh reads. `manual` plans
//! the manual commands' writes; `inventories` reads the node agents' sandbox inventories.
//!
//! Imports the core (`index`, `rules`, `ipam`, `api`), `telemetry` and `watch_retry`;
//! imported by the programs (`controller`, `node`, `cli`), never the other way.

pub mod budget;
pub mod context;
#[cfg(test)]
mod fixtures;
pub mod inventories;
pub mod ledger;
pub mod manual;
pub mod objects;
pub mod pools;
pub mod reports;
pub mod types;
pub mod writer;

pub use budget::{
    BudgetConfig, Budgets, DEFAULT_POOL_WRITE_BURST, DEFAULT_POOL_WRITE_QPS, WriteKind,
};
pub use reports::events::Events;
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
