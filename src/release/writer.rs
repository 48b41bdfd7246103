//! The writer: what its three jobs share (the client, the budgets, the metrics, the ledger)
//! and the handle that hands it work. Its jobs have a folder each: pool writes (`pools`:
//! releases batched into one `test`-pinned JSON patch per pool), object writes (`objects`:
//! fence records before their entries, reservation deletes after them, their re-checks and
//! repairs) and reports (`reports`: Events, the audit trail, what a dry run reported). It asks
//! what it needs to know, and tells what it wrote, only through its [`Ledger`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use tokio::sync::{mpsc, oneshot};

use super::budget::{Budgets, Paid, WriteKind};
use super::ledger::{FreshReads, Ledger};
use super::objects::{ObjectDelete, PendingDeletes};
use super::pools::PoolWrites;
use super::pools::patch;
use super::reports::DryRunReports;
use super::reports::events::Events;
use super::types::ReservationDelete;
use super::types::{ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::api::{IPPool, ObjectId};
use crate::telemetry::WriteMetrics;

pub(super) type Outcome = Result<ReleaseOutcome, ReleaseError>;
pub(super) type Reply = oneshot::Sender<Outcome>;

/// Everything the writer needs.
pub struct Writer {
    pub(crate) client: Client,
    pub(crate) namespace: String,
    pub(crate) budgets: Budgets,
    pub(crate) metrics: WriteMetrics,
    pub(crate) events: Events,
    /// `--dry-run`: reports, writes nothing.
    pub(crate) dry_run: bool,
    /// What it knows of the allocations, and where it tells what it wrote.
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) pools: PoolWrites,
    pub(crate) pending_deletes: PendingDeletes,
    pub(crate) dry_run_reports: DryRunReports,
}

impl Writer {
    /// A writer to the pools of `namespace` within `budgets`, reporting with `events`:
    /// patches spaced by 200 ms, writing, and reading fresh (no ledger) until told otherwise.
    pub fn new(
        client: Client,
        namespace: &str,
        budgets: Budgets,
        events: Events,
        metrics: WriteMetrics,
    ) -> Writer {
        Writer {
            client,
            namespace: namespace.to_owned(),
            budgets,
            metrics,
            events,
            dry_run: false,
            ledger: Arc::new(FreshReads),
            pools: PoolWrites::new(Duration::from_millis(200)),
            pending_deletes: Default::default(),
            dry_run_reports: Default::default(),
        }
    }

    /// Least time between two patches of one pool.
    pub fn patch_interval(mut self, interval: Duration) -> Writer {
        self.pools.patch_interval = interval;
        self
    }

    /// `--dry-run`: reports, writes nothing.
    pub fn dry_run(mut self, dry_run: bool) -> Writer {
        self.dry_run = dry_run;
        self
    }

    /// `--release-cooldown`: releases keep the address out of the pool this long (zero: off).
    pub fn cooldown(mut self, cooldown: Duration) -> Writer {
        self.pools.cooldown = cooldown;
        self
    }

    /// Reads pools with GET only: for a program whose RBAC grants no `list` on them.
    pub fn pools_read_by_get(self) -> Writer {
        self.pools.read_by_get();
        self
    }

    /// What the writer knows and where it tells what it wrote (the controller's index).
    pub fn ledger(mut self, ledger: Arc<dyn Ledger>) -> Writer {
        self.ledger = ledger;
        self
    }

    pub(super) fn pools_api(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }
}

/// A handle to submit releases to the batching writer.
#[derive(Clone)]
pub struct WriterHandle {
    pub(super) tx: mpsc::Sender<(ReleaseRequest, Reply)>,
    pub(super) deletes: mpsc::UnboundedSender<ObjectDelete>,
    pub(super) writer: Arc<Writer>,
}

impl WriterHandle {
    /// Whether it writes nothing (`--dry-run`).
    pub fn is_dry_run(&self) -> bool {
        self.writer.dry_run
    }

    /// Queues reservations for deletion on their own budget, each guarded against a live
    /// allocation of its address (see `objects::reservation`; nothing under `--dry-run`). One
    /// queued or under way already is not queued again.
    pub fn delete_reservations(&self, reservations: Vec<ReservationDelete>) {
        if self.writer.dry_run {
            return;
        }
        for d in reservations {
            let id = ObjectId {
                name: d.name.clone(),
                uid: d.uid.clone(),
            };
            if self.writer.pending_deletes.queue(id) {
                // The receiver lives as long as any handle.
                let _ = self.deletes.send(ObjectDelete::Reservation(d));
            }
        }
    }

    /// Queues left-over `IPFence` records for deletion with a uid precondition (nothing under
    /// `--dry-run`).
    pub fn delete_fence_records(&self, records: Vec<ObjectId>) {
        if self.writer.dry_run {
            return;
        }
        for record in records {
            let _ = self.deletes.send(ObjectDelete::Fence(record));
        }
    }

    /// Removes annotations `(name, value)` of `pool`, each pinned by a `test` of its value, as
    /// a pool write (nothing under `--dry-run`).
    pub async fn remove_annotations(
        &self,
        pool: &str,
        annotations: Vec<(String, String)>,
    ) -> Result<(), kube::Error> {
        if self.writer.dry_run || annotations.is_empty() {
            return Ok(());
        }
        let patch = patch::typed(patch::annotations_patch(&annotations)).expect("a JSON patch");
        let pools = self.writer.pools_api();
        let metrics = &self.writer.metrics;
        self.writer
            .budgets
            .send_counted(WriteKind::Pool, Paid::No, metrics, "patch", || {
                let patch = Patch::<()>::Json(patch.clone());
                let pools = pools.clone();
                async move { pools.patch(pool, &PatchParams::default(), &patch).await }
            })
            .await
            .map(|_| ())
    }

    /// Hands `reqs` to the writer (batched with whatever else is pending) and returns a future
    /// of each outcome: the caller need not wait for the write to hand in more.
    pub async fn submit(
        &self,
        reqs: Vec<ReleaseRequest>,
    ) -> impl Future<Output = Vec<Outcome>> + Send + use<> {
        let mut waits = Vec::with_capacity(reqs.len());
        for r in reqs {
            let (tx, rx) = oneshot::channel();
            waits.push(self.tx.send((r, tx)).await.ok().map(|()| rx));
        }
        async move {
            let mut out = Vec::with_capacity(waits.len());
            for w in waits {
                out.push(match w {
                    Some(rx) => rx.await.unwrap_or(Err(ReleaseError::Stopped)),
                    None => Err(ReleaseError::Stopped),
                });
            }
            out
        }
    }

    /// Releases `reqs` (batched with whatever else is pending) and returns each outcome.
    pub async fn release(&self, reqs: Vec<ReleaseRequest>) -> Vec<Outcome> {
        self.submit(reqs).await.await
    }
}

pub use super::pools::batcher::{spawn, spawn_drained};

pub(super) fn api_error(pool: &str, e: &kube::Error) -> ReleaseError {
    if super::budget::is_not_leader(e) {
        return ReleaseError::NotLeader;
    }
    ReleaseError::Api {
        pool: pool.into(),
        message: e.to_string(),
    }
}
