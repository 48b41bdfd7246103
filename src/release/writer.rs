//! The writer: its settings, the tasks it starts, and the handle that hands it work. Its jobs
//! are types of their own, a folder each, over what they share (`context`): pool writes
//! (`pools::PoolWriter`: releases batched into one `test`-pinned JSON patch per pool), object
//! writes (`objects::ObjectWriter`: fence records before their entries, reservation deletes
//! after them, their re-checks and repairs) and reports (`reports`: Events, the audit trail,
//! what a dry run reported). They ask what they need to know, and tell what they wrote, only
//! through the [`Ledger`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::api::{Patch, PatchParams};
use tokio::sync::{mpsc, oneshot};

use super::budget::{Budgets, Paid, WriteKind};
use super::context::WriteContext;
use super::ledger::{FreshReads, Ledger};
use super::objects::repair::Repaired;
use super::objects::{ObjectDelete, ObjectWriter};
use super::pools::schedule::MAX_BATCH;
use super::pools::{PoolWriter, batcher, patch};
use super::reports::events::Events;
use super::types::{Outcome, ReleaseError, ReleaseRequest, ReservationDelete};
use crate::api::ObjectId;
use crate::index::MissingReservation;
use crate::telemetry::WriteMetrics;

/// The writer's settings, before it is started ([`spawn`]).
pub struct Writer {
    client: Client,
    namespace: String,
    budgets: Budgets,
    metrics: WriteMetrics,
    events: Events,
    dry_run: bool,
    ledger: Arc<dyn Ledger>,
    patch_interval: Duration,
    cooldown: Duration,
    read_by_get: bool,
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
            patch_interval: Duration::from_millis(200),
            cooldown: Duration::ZERO,
            read_by_get: false,
        }
    }

    /// Least time between two patches of one pool.
    pub fn patch_interval(mut self, interval: Duration) -> Writer {
        self.patch_interval = interval;
        self
    }

    /// `--dry-run`: reports, writes nothing.
    pub fn dry_run(mut self, dry_run: bool) -> Writer {
        self.dry_run = dry_run;
        self
    }

    /// `--release-cooldown`: releases keep the address out of the pool this long (zero: off).
    pub fn cooldown(mut self, cooldown: Duration) -> Writer {
        self.cooldown = cooldown;
        self
    }

    /// Reads pools with GET only: for a program whose RBAC grants no `list` on them.
    pub fn pools_read_by_get(mut self) -> Writer {
        self.read_by_get = true;
        self
    }

    /// What the writer knows and where it tells what it wrote (the controller's index).
    pub fn ledger(mut self, ledger: Arc<dyn Ledger>) -> Writer {
        self.ledger = ledger;
        self
    }

    fn context(&self) -> WriteContext {
        WriteContext {
            client: self.client.clone(),
            namespace: self.namespace.clone(),
            budgets: self.budgets.clone(),
            metrics: self.metrics.clone(),
            events: self.events.clone(),
            dry_run: self.dry_run,
            ledger: self.ledger.clone(),
            read_by_get: self.read_by_get.into(),
        }
    }
}

/// Starts the batcher and the object deleter; they run until every handle is dropped.
pub fn spawn(writer: Arc<Writer>) -> WriterHandle {
    spawn_drained(writer).0
}

/// Like [`spawn`], with a task that ends once every handle is dropped and everything handed in
/// is written: the patches, the deletes after them and the re-checks after those (see
/// `objects::rechecks`). For a command that exits after its writes.
pub fn spawn_drained(writer: Arc<Writer>) -> (WriterHandle, tokio::task::JoinHandle<()>) {
    let cx = Arc::new(writer.context());
    let objects = Arc::new(ObjectWriter::new(cx.clone()));
    let pools = PoolWriter::new(
        cx.clone(),
        objects.clone(),
        writer.patch_interval,
        writer.cooldown,
    );
    let (tx, rx) = mpsc::channel::<(ReleaseRequest, super::types::Reply)>(4 * MAX_BATCH);
    let (del_tx, del_rx) = mpsc::unbounded_channel();
    let handle = WriterHandle {
        tx,
        deletes: del_tx.clone(),
        cx,
        objects: objects.clone(),
    };
    let drained = tokio::spawn(objects.delete_queued(del_rx));
    tokio::spawn(batcher::batch(Arc::new(pools), rx, del_tx));
    (handle, drained)
}

/// A handle to submit releases to the batching writer.
#[derive(Clone)]
pub struct WriterHandle {
    tx: mpsc::Sender<(ReleaseRequest, super::types::Reply)>,
    deletes: mpsc::UnboundedSender<ObjectDelete>,
    cx: Arc<WriteContext>,
    objects: Arc<ObjectWriter>,
}

impl WriterHandle {
    /// Whether it writes nothing (`--dry-run`).
    pub fn is_dry_run(&self) -> bool {
        self.cx.dry_run
    }

    /// Queues reservations for deletion on their own budget, each guarded against a live
    /// allocation of its address (see `objects::reservation`; nothing under `--dry-run`). One
    /// queued or under way already is not queued again.
    pub fn delete_reservations(&self, reservations: Vec<ReservationDelete>) {
        if self.cx.dry_run {
            return;
        }
        for d in reservations {
            let id = ObjectId {
                name: d.name.clone(),
                uid: d.uid.clone(),
            };
            if self.objects.pending.queue(id) {
                // The receiver lives as long as any handle.
                let _ = self.deletes.send(ObjectDelete::Reservation(d));
            }
        }
    }

    /// Queues left-over `IPFence` records for deletion with a uid precondition (nothing under
    /// `--dry-run`).
    pub fn delete_fence_records(&self, records: Vec<ObjectId>) {
        if self.cx.dry_run {
            return;
        }
        for record in records {
            let _ = self.deletes.send(ObjectDelete::Fence(record));
        }
    }

    /// Creates the missing reservation `m`, guarded (see `objects::repair`).
    pub async fn repair_reservation(
        &self,
        m: &MissingReservation,
    ) -> Result<Repaired, kube::Error> {
        self.objects.repair_reservation(m).await
    }

    /// Removes annotations `(name, value)` of `pool`, each pinned by a `test` of its value, as
    /// a pool write (nothing under `--dry-run`).
    pub async fn remove_annotations(
        &self,
        pool: &str,
        annotations: Vec<(String, String)>,
    ) -> Result<(), kube::Error> {
        if self.cx.dry_run || annotations.is_empty() {
            return Ok(());
        }
        let patch = patch::typed(patch::annotations_patch(&annotations)).expect("a JSON patch");
        let pools = self.cx.pools_api();
        let metrics = &self.cx.metrics;
        self.cx
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
