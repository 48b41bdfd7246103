//! The pool writer: releases batched into one JSON patch per pool, each entry pinned by `test`
//! operations on its `id` and `podref` before its `remove`, so concurrent allocations of other
//! offsets are never lost and never conflict. Reservations go with a uid precondition, on their
//! own queue and budget, after the pool entries they belong to. A fence writes its record (an
//! `IPFence` object) before it rewrites the entry, and a lift removes the entry before the
//! record (see `ipam::fence` for why that order is crash-safe).

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use tokio::sync::{mpsc, oneshot};

use super::batch::{Answer, one_write_per_entry, settle_against, split};
use super::budget::{Budgets, Paid, WriteKind};
use super::events::Events;
use super::patch;
use super::types::ReservationDelete;
use super::types::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::api::{IPPool, ObjectId};
use crate::index::{Index, SharedIndex};
use crate::telemetry::WriteMetrics;

/// Patches one batch may take while refused writes are split apart (each refusal costs a
/// patch and a read); what is left then is retried later, with backoff.
const MAX_PATCHES_PER_BATCH: usize = 64;
/// Reservation deletes sent at once at most (the shared in-flight cap may allow fewer).
pub(super) const RESERVATION_DELETERS: usize = 16;

type Outcome = Result<ReleaseOutcome, ReleaseError>;
pub(super) type Reply = oneshot::Sender<Outcome>;

/// An object to delete after the pool entries it belongs to, with its uid as precondition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectDelete {
    /// An OverlappingRangeIPReservation, unless a live allocation holds its address.
    Reservation(ReservationDelete),
    /// An `IPFence` record whose entry was released or is gone.
    Fence(ObjectId),
}

/// An allocation reported under `--dry-run`: its pool, key and sandbox id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Reported {
    pool: String,
    key: String,
    id: String,
}

/// Everything the writer needs.
pub struct Writer {
    pub(crate) client: Client,
    pub(crate) namespace: String,
    pub(crate) budgets: Budgets,
    /// Least time between two patches of one pool: what arrives meanwhile joins the next.
    pub(crate) patch_interval: Duration,
    pub(crate) metrics: WriteMetrics,
    pub(crate) events: Events,
    pub(crate) dry_run: bool,
    /// The controller's index, kept in step with what is written (the node agent has none).
    pub(crate) index: Option<SharedIndex>,
    /// Under `--dry-run`, the allocations already reported: nothing is written, so they come
    /// back on every sweep, and each is reported once.
    pub(crate) dry_run_reported: std::sync::Mutex<HashSet<Reported>>,
    /// `--release-cooldown`: how long a released address stays out of the pool (zero: off).
    pub(crate) cooldown: Duration,
    /// Fresh pool reads are GETs, not LISTs by name (see `fresh_pool`): RBAC refused the list,
    /// or the program is granted none.
    pub(crate) pools_read_by_get: std::sync::atomic::AtomicBool,
    /// Reservation deletes queued or under way: the sweep finds a reservation it queued again
    /// until the delete is done, and it is queued once.
    pub(crate) pending_deletes: std::sync::Mutex<HashSet<ObjectId>>,
    /// This run's identity in the signature of its writes of marked entries, and how many it
    /// signed (see `ipam::own_write`).
    pub(crate) run: String,
    pub(crate) signed: std::sync::atomic::AtomicU64,
}

/// Delete parameters that touch only the object of uid `uid`: one replaced since (another
/// pod's, another fence's) is left alone.
pub(super) fn delete_only_uid(uid: String) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}

impl Writer {
    /// Sends one write of a reservation or fence record under their budget, counted as an API
    /// write of `verb`.
    pub(super) async fn send_object_write<T, F, Fut>(
        &self,
        verb: &str,
        write: F,
    ) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let metrics = &self.metrics;
        self.budgets
            .send_counted(WriteKind::Reservation, Paid::No, metrics, verb, write)
            .await
    }

    /// A reservation create past the leadership gate: putting back one this replica deleted,
    /// for an allocation that appeared meanwhile (no other replica knows it is due; a create
    /// decides nothing and is refused if one exists).
    pub(super) async fn send_restore<T, F, Fut>(&self, write: F) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let write = super::budget::counted(&self.metrics, "create", write);
        self.budgets
            .send_ungated(WriteKind::Reservation, write)
            .await
    }

    /// A writer to the pools of `namespace` within `budgets`, reporting with `events`:
    /// patches spaced by 200 ms, writing, and without an index until told otherwise.
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
            patch_interval: Duration::from_millis(200),
            metrics,
            events,
            dry_run: false,
            index: None,
            dry_run_reported: Default::default(),
            cooldown: Duration::ZERO,
            pools_read_by_get: Default::default(),
            pending_deletes: Default::default(),
            run: crate::ipam::own_write::run_id(std::process::id(), jiff::Timestamp::now()),
            signed: Default::default(),
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
    pub fn pools_read_by_get(self) -> Writer {
        self.pools_read_by_get
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// The controller's index, kept in step with what is written.
    pub fn index(mut self, index: SharedIndex) -> Writer {
        self.index = Some(index);
        self
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
    /// allocation of its address (see `reservation`; nothing under `--dry-run`). One queued or
    /// under way already is not queued again.
    pub fn delete_reservations(&self, reservations: Vec<ReservationDelete>) {
        if self.writer.dry_run {
            return;
        }
        for d in reservations {
            let id = ObjectId {
                name: d.name.clone(),
                uid: d.uid.clone(),
            };
            if !self
                .writer
                .pending_deletes
                .lock()
                .expect("pending lock")
                .insert(id)
            {
                continue;
            }
            // The receiver lives as long as any handle.
            let _ = self.deletes.send(ObjectDelete::Reservation(d));
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
        let pools = self.writer.pools();
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

pub use super::batcher::{spawn, spawn_drained};

impl Writer {
    pub(super) fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Writes one batch and answers each request; returns the objects to delete after it
    /// (reservations of what was released, records of lifted fences). `paid`: whether its
    /// first patch's token was taken already.
    pub(super) async fn release_pool(
        &self,
        pool: &str,
        items: Vec<(ReleaseRequest, Reply)>,
        paid: Paid,
    ) -> Vec<ObjectDelete> {
        if self.dry_run {
            self.report_dry_run(pool, items).await;
            return Vec::new();
        }
        let (mut reqs, replies) = one_write_per_entry(items);
        super::types::set_cooldowns(&mut reqs, self.cooldown, jiff::Timestamp::now());
        // Fences: the record first. An entry whose record cannot be written is not touched.
        let records = self.write_fence_records(pool, &reqs).await;
        let ready: Vec<usize> = (0..reqs.len())
            .filter(|&i| !matches!(records[i], Some(Err(_))))
            .collect();
        let batch: Vec<ReleaseRequest> = ready.iter().map(|&i| reqs[i].clone()).collect();
        let mut outcomes: Vec<Option<Outcome>> = records
            .iter()
            .map(|r| match r {
                Some(Err(e)) => Some(Err(e.clone())),
                _ => None,
            })
            .collect();
        for (&i, o) in ready
            .iter()
            .zip(self.patch_with_retry(pool, &batch, paid).await)
        {
            outcomes[i] = Some(o);
        }
        let mut after = Vec::new();
        let mut answers: Vec<Outcome> = Vec::with_capacity(reqs.len());
        // One write of the index for the whole patch.
        let mut index = self.index.as_ref().map(|i| i.write().expect("index lock"));
        for (i, (req, outcome)) in reqs.iter().zip(outcomes).enumerate() {
            let mut outcome = outcome.unwrap_or(Err(ReleaseError::Stopped));
            match (&outcome, &records[i]) {
                (Ok(ReleaseOutcome::Released), Some(Ok(object))) => {
                    let object = ObjectId {
                        name: object.name.clone(),
                        uid: object.uid.clone(),
                    };
                    self.record_fence(index.as_deref_mut(), req, object);
                    outcome = Ok(ReleaseOutcome::Fenced);
                }
                (Ok(ReleaseOutcome::Released), _) if req.cooldown.is_some() => {
                    after.extend(self.record_cooling(index.as_deref_mut(), req));
                    outcome = Ok(req
                        .cooldown
                        .map_or(ReleaseOutcome::Released, ReleaseOutcome::Cooling));
                }
                (Ok(ReleaseOutcome::Released), _) if req.write == EntryWrite::EndCooldown => {
                    after.extend(self.record_cooldown_end(index.as_deref_mut(), req))
                }
                (Ok(ReleaseOutcome::Released), _) => {
                    after.extend(self.record_release(index.as_deref_mut(), req))
                }
                // The entry went or changed before its fence: the record this write created is
                // left over (one it found is another writer's, and the left-over check judges it).
                (Ok(ReleaseOutcome::AlreadyGone | ReleaseOutcome::Changed), Some(Ok(o)))
                    if o.created =>
                {
                    after.push(ObjectDelete::Fence(ObjectId {
                        name: o.name.clone(),
                        uid: o.uid.clone(),
                    }))
                }
                (Err(e), _) => self.metrics.failed(e.label()),
                _ => {}
            }
            answers.push(outcome);
        }
        drop(index);
        send_answers(pool, replies, &answers);
        after
    }

    /// `--dry-run`: reports each decision once (Event, metric) and writes nothing.
    async fn report_dry_run(&self, pool: &str, items: Vec<(ReleaseRequest, Reply)>) {
        for (req, reply) in items {
            let j = &req.judged;
            if let EntryWrite::Fence(record) = &req.write {
                if self.first_dry_run_report(pool, &j.entry.key, &j.entry.id) {
                    self.events.fenced(&j.pod, j.entry.ip, record, true).await;
                }
            } else if req.write == EntryWrite::EndCooldown {
                // Not a release: nothing to report (no cooldown starts or ends in a dry run).
            } else if self.first_dry_run_report(pool, &j.entry.key, &j.entry.id) {
                self.events
                    .dry_run(&j.pod, j.entry.ip, &j.network, req.reason, self.cooldown)
                    .await;
                self.metrics
                    .dry_run_releases
                    .get_or_create(&req.reason.as_str().to_string().into())
                    .inc();
            }
            let _ = reply.send(Ok(ReleaseOutcome::DryRun));
        }
    }

    /// Whether this allocation's dry-run decision is new (and remembers it). Allocations gone
    /// from the controller's index are forgotten, so a new one at the same key is reported.
    fn first_dry_run_report(&self, pool: &str, key: &str, id: &str) -> bool {
        let mut reported = self.dry_run_reported.lock().expect("dry-run lock");
        if let Some(index) = &self.index {
            let index = index.read().expect("index lock");
            reported.retain(|r| index.holds(&r.pool, &r.key, &r.id));
        }
        reported.insert(Reported {
            pool: pool.to_owned(),
            key: key.to_owned(),
            id: id.to_owned(),
        })
    }

    /// Writes `reqs`, one patch while it goes through. A refused patch (422 or 400) is looked
    /// into: the pool is read again, entries that changed are settled (not ours any more), and
    /// when nothing changed the patch itself was refused (too large, invalid), so it is split
    /// until only the entries concerned fail. Other errors fail the patch's entries. No patch
    /// for no entries (every fence record failed); `paid`: the first patch's token was taken.
    async fn patch_with_retry(
        &self,
        pool: &str,
        reqs: &[ReleaseRequest],
        mut paid: Paid,
    ) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; reqs.len()];
        let mut groups: Vec<Vec<usize>> = vec![(0..reqs.len()).collect()];
        groups.retain(|g| !g.is_empty());
        let mut annotations = None;
        let mut patches = 0;
        while let Some(group) = groups.pop() {
            if patches == MAX_PATCHES_PER_BATCH {
                // Refused again and again: what is left is retried later, with backoff.
                for i in group.into_iter().chain(groups.drain(..).flatten()) {
                    outcomes[i] = Some(Err(ReleaseError::Conflict { pool: pool.into() }));
                }
                break;
            }
            patches += 1;
            let batch: Vec<&ReleaseRequest> = group.iter().map(|&i| &reqs[i]).collect();
            let settle_all = |outcomes: &mut Vec<Option<Outcome>>, o: Outcome| {
                for &i in &group {
                    outcomes[i] = Some(o.clone());
                }
            };
            let paid = std::mem::replace(&mut paid, Paid::No);
            let used = annotations.unwrap_or_else(|| self.index_has_annotations(pool));
            let refusal = match self.patch(pool, &batch, used, paid).await {
                Ok(()) => {
                    settle_all(&mut outcomes, Ok(ReleaseOutcome::Released));
                    continue;
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    settle_all(&mut outcomes, Ok(ReleaseOutcome::AlreadyGone));
                    continue;
                }
                Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => s.message,
                Err(e) => {
                    settle_all(&mut outcomes, Err(api_error(pool, &e)));
                    continue;
                }
            };
            let current = match self
                .budgets
                .send(WriteKind::Pool, || self.read_pool(pool))
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    settle_all(&mut outcomes, Err(api_error(pool, &e)));
                    continue;
                }
            };
            let fresh = current
                .as_ref()
                .is_some_and(|p| p.metadata.annotations.is_some());
            annotations = Some(fresh);
            let allocations = current.map(|p| p.spec.allocations).unwrap_or_default();
            let still = settle_against(reqs, &group, &allocations, &mut outcomes);
            match (still.len() == group.len(), still.len()) {
                (_, 0) => {}
                // The pool's annotations map came or went since it was read: the patch's
                // signature (or a legacy record's removal) missed it; again, as it is now.
                (true, _) if fresh != used && patch::reads_annotations(&batch) => {
                    groups.push(still)
                }
                // Something changed: the rest goes again, as it is.
                (false, _) => groups.push(still),
                // Nothing changed: this write itself was refused.
                (true, 1) => {
                    outcomes[still[0]] = Some(Err(ReleaseError::Refused {
                        pool: pool.into(),
                        message: refusal,
                    }))
                }
                (true, _) => groups.extend(split(reqs, still)),
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Err(ReleaseError::Conflict { pool: pool.into() })))
            .collect()
    }

    /// Whether the index knows `pool` to have an annotations map.
    fn index_has_annotations(&self, pool: &str) -> bool {
        let index = self.index.as_ref();
        index.is_some_and(|i| i.read().expect("index lock").has_annotations(pool))
    }

    /// The signature of the next write of marked entries (see `ipam::own_write`).
    fn signature(&self) -> String {
        let n = self
            .signed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        crate::ipam::own_write::own_write_value(&self.run, n, jiff::Timestamp::now())
    }

    /// One patch of `batch`; `has_annotations`: whether the pool has an annotations map.
    async fn patch(
        &self,
        pool: &str,
        batch: &[&ReleaseRequest],
        has_annotations: bool,
        paid: Paid,
    ) -> Result<(), kube::Error> {
        let patch = patch::entries_patch(batch, has_annotations, &self.signature());
        let patch = patch::typed(patch).map_err(kube::Error::SerdeError)?;
        let pools = self.pools();
        self.metrics.pool_patch_entries.observe(batch.len() as f64);
        self.budgets
            .send_counted(WriteKind::Pool, paid, &self.metrics, "patch", || {
                let patch = Patch::<()>::Json(patch.clone());
                let (pools, metrics) = (pools.clone(), self.metrics.clone());
                async move {
                    let started = Instant::now();
                    let result = pools.patch(pool, &PatchParams::default(), &patch).await;
                    metrics
                        .pool_patch_seconds
                        .observe(started.elapsed().as_secs_f64());
                    result
                }
            })
            .await
            .map(|_| ())
    }

    /// Updates the index for a written fence.
    fn record_fence(&self, index: Option<&mut Index>, req: &ReleaseRequest, object: ObjectId) {
        let (j, EntryWrite::Fence(record)) = (&req.judged, &req.write) else {
            return;
        };
        self.metrics.fences.inc();
        if let Some(index) = index {
            index.fence_written(&j.pool, &j.entry.key, &j.entry.id, record, object);
        }
        tracing::info!(pool = %j.pool, ip = %j.entry.ip, podref = %record.podref, node = %record.node, why = %record.why, "fenced");
    }

    /// Updates the index and metrics for a written release; returns what to delete after it
    /// (its reservations, a lifted fence's record).
    fn record_release(&self, index: Option<&mut Index>, req: &ReleaseRequest) -> Vec<ObjectDelete> {
        let j = &req.judged;
        // A fenced entry's reservations still name the pod it was fenced for.
        let podref = req.podref();
        let mut after: Vec<ObjectDelete> = match index {
            Some(index) => index.released(&j.pool, &j.entry.key, podref, j.entry.ip),
            None => Vec::new(),
        }
        .into_iter()
        .map(|r| ObjectDelete::Reservation(ReservationDelete::after_release(r, podref, j)))
        .collect();
        if let EntryWrite::Unfence(_, object) = &req.write {
            after.push(ObjectDelete::Fence(object.clone()));
        }
        self.metrics.released(req.reason.as_str());
        if let Some(at) = req.deleted_at {
            self.metrics
                .deletion_to_release_seconds
                .observe(at.elapsed().as_secs_f64());
        }
        tracing::info!(pool = %j.pool, ip = %j.entry.ip, %podref, reason = %req.reason, "released");
        after
    }
}

/// Answers each request of a batch: with its own write's outcome, or (a second request for an
/// entry) a conflict.
fn send_answers(pool: &str, replies: Vec<(Answer, Reply)>, answers: &[Outcome]) {
    for (answer, reply) in replies {
        let outcome = match answer {
            Answer::By(i) => answers[i].clone(),
            // Not written now: its owner tries again (a fence is never dropped this way).
            Answer::Other => Err(ReleaseError::Conflict {
                pool: pool.to_owned(),
            }),
        };
        let _ = reply.send(outcome);
    }
}

pub(super) fn api_error(pool: &str, e: &kube::Error) -> ReleaseError {
    if super::budget::is_not_leader(e) {
        return ReleaseError::NotLeader;
    }
    ReleaseError::Api {
        pool: pool.into(),
        message: e.to_string(),
    }
}
