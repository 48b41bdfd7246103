//! The pool writer: releases batched into one JSON patch per pool, each entry pinned by `test`
//! operations on its `id` and `podref` before its `remove`, so concurrent allocations of other
//! offsets are never lost and never conflict. Reservations go with a uid precondition, on their
//! own queue and budget, after the pool entries they belong to. A fence writes its record (an
//! `IPFence` object) before it rewrites the entry, and a lift removes the entry before the
//! record (see `ipam::fence` for why that order is crash-safe).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use tokio::sync::{mpsc, oneshot};

use super::budget::{Budgets, WriteKind};
use super::events::Events;
use super::patch;
use super::schedule::{MAX_BATCH, PoolSchedule};
use super::types::{Deleted, ReservationDelete};
use super::types::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::api::{IPFence, IPPool};
use crate::index::{Index, SharedIndex};
use crate::ipam::fence::{FenceRecord, FenceSource, fence_object_name, fence_spec, fenced_podref};
use crate::telemetry::WriteMetrics;

/// Patches one batch may take while refused writes are split apart (each refusal costs a
/// patch and a read); what is left then is retried later, with backoff.
const MAX_PATCHES_PER_BATCH: usize = 64;
/// Reservation deletes sent at once at most (the shared in-flight cap may allow fewer).
const RESERVATION_DELETERS: usize = 16;

type Outcome = Result<ReleaseOutcome, ReleaseError>;
type Reply = oneshot::Sender<Outcome>;

/// A fence record as a fence's write found or made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceObjectWritten {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// This write created it (else it was there: a retry, or another writer's).
    pub created: bool,
}

/// An object to delete after the pool entries it belongs to, with its uid as precondition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectDelete {
    /// An OverlappingRangeIPReservation, unless a live allocation holds its address.
    Reservation(ReservationDelete),
    /// An `IPFence` record (name, uid) whose entry was released or is gone.
    Fence(String, String),
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
    /// Under `--dry-run`, the allocations (pool, key, id) already reported: nothing is
    /// written, so they come back on every sweep, and each is reported once.
    pub(crate) dry_run_reported: std::sync::Mutex<HashSet<(String, String, String)>>,
}

impl Writer {
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

    /// The controller's index, kept in step with what is written.
    pub fn index(mut self, index: SharedIndex) -> Writer {
        self.index = Some(index);
        self
    }
}

/// A handle to submit releases to the batching writer.
#[derive(Clone)]
pub struct WriterHandle {
    tx: mpsc::Sender<(ReleaseRequest, Reply)>,
    deletes: mpsc::UnboundedSender<ObjectDelete>,
    writer: Arc<Writer>,
}

impl WriterHandle {
    /// Queues reservations for deletion on their own budget, each guarded against a live
    /// allocation of its address (see `reservation`; nothing under `--dry-run`).
    pub fn delete_reservations(&self, reservations: Vec<ReservationDelete>) {
        if self.writer.dry_run {
            return;
        }
        for d in reservations {
            // The receiver lives as long as any handle.
            let _ = self.deletes.send(ObjectDelete::Reservation(d));
        }
    }

    /// Queues left-over `IPFence` records `(name, uid)` for deletion with a uid precondition
    /// (nothing under `--dry-run`).
    pub fn delete_fence_records(&self, records: Vec<(String, String)>) {
        if self.writer.dry_run {
            return;
        }
        for (name, uid) in records {
            let _ = self.deletes.send(ObjectDelete::Fence(name, uid));
        }
    }

    /// Removes fence annotations `(key, value)` of `pool` whose entry is no longer fenced,
    /// each pinned by a `test` of its value (nothing under `--dry-run`).
    pub async fn clear_fences(&self, pool: &str, annotations: Vec<(String, String)>) {
        if self.writer.dry_run || annotations.is_empty() {
            return;
        }
        let patch = patch::typed(patch::annotations_patch(&annotations)).expect("a JSON patch");
        let pools = self.writer.pools();
        let result = self
            .writer
            .budgets
            .send(WriteKind::Pool, || {
                self.writer.metrics.write("patch");
                let patch = Patch::<()>::Json(patch.clone());
                let pools = pools.clone();
                async move { pools.patch(pool, &PatchParams::default(), &patch).await }
            })
            .await;
        if let Err(e) = result {
            // Changed or gone meanwhile: the next pass sees the pool as it is now.
            tracing::debug!(%pool, error = %e, "could not clear fence records");
        }
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

/// Starts the batcher and the reservation deleter; they run until every handle is dropped.
/// At most one patch per pool is in flight, and a pool's patches are spaced by `spacing`;
/// what arrives meanwhile for that pool goes out as the next patch, so a burst of deletions
/// becomes a few large patches while a lone deletion goes out at once.
pub fn spawn(writer: Arc<Writer>) -> WriterHandle {
    let (tx, rx) = mpsc::channel::<(ReleaseRequest, Reply)>(4 * MAX_BATCH);
    let (del_tx, del_rx) = mpsc::unbounded_channel();
    let handle = WriterHandle {
        tx,
        deletes: del_tx.clone(),
        writer: writer.clone(),
    };
    tokio::spawn(delete_objects(writer.clone(), del_rx));
    tokio::spawn(batch(writer, rx, del_tx));
    handle
}

/// The batcher: collects requests per pool and sends each pool's patch when its
/// [`PoolSchedule`] says it may.
async fn batch(
    writer: Arc<Writer>,
    mut rx: mpsc::Receiver<(ReleaseRequest, Reply)>,
    deletes: mpsc::UnboundedSender<ObjectDelete>,
) {
    let mut schedule = PoolSchedule::new(writer.patch_interval);
    // Each finished patch: its pool and how long it took.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(String, Duration)>();
    let mut open = true;
    loop {
        let now = Instant::now();
        for (pool, items) in schedule.ready(now) {
            let (w, done, res) = (writer.clone(), done_tx.clone(), deletes.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                for r in w.release_pool(&pool, items).await {
                    let _ = res.send(r);
                }
                let _ = done.send((pool, started.elapsed()));
            });
        }
        if !open && schedule.idle() {
            return;
        }
        let next = schedule.next_wake(now);
        let wake = async {
            match next {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            item = rx.recv(), if open => match item {
                Some(item) => {
                    schedule.push(item.0.judged.pool.clone(), item);
                    // Let whatever else is already queued join this batch.
                    while let Ok(item) = rx.try_recv() {
                        schedule.push(item.0.judged.pool.clone(), item);
                    }
                }
                None => open = false,
            },
            Some((pool, took)) = done_rx.recv() => schedule.finished(&pool, took, Instant::now()),
            () = wake => {}
        }
    }
}

/// Deletes queued objects, as many at once as the budgets allow.
async fn delete_objects(writer: Arc<Writer>, rx: mpsc::UnboundedReceiver<ObjectDelete>) {
    let looks = writer.spawn_looks();
    let queued =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
    queued
        .for_each_concurrent(RESERVATION_DELETERS, |d| {
            let (w, looks) = (writer.clone(), looks.clone());
            async move {
                match d {
                    ObjectDelete::Reservation(d) => {
                        if w.delete_reservation(d.clone()).await == Deleted::Deleted {
                            let _ = looks.send(d);
                        }
                    }
                    other => w.delete_object(other).await,
                }
            }
        })
        .await;
}

impl Writer {
    fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Writes one batch and answers each request; returns the objects to delete after it
    /// (reservations of what was released, records of lifted fences).
    async fn release_pool(
        &self,
        pool: &str,
        items: Vec<(ReleaseRequest, Reply)>,
    ) -> Vec<ObjectDelete> {
        if self.dry_run {
            for (req, reply) in items {
                let j = &req.judged;
                if let EntryWrite::Fence(record) = &req.write {
                    if self.first_dry_run_report(pool, &j.entry.key, &j.entry.id) {
                        self.events.fenced(&j.pod, j.entry.ip, record, true).await;
                    }
                } else if self.first_dry_run_report(pool, &j.entry.key, &j.entry.id) {
                    self.events
                        .dry_run(&j.pod, j.entry.ip, &j.network, req.reason)
                        .await;
                    self.metrics
                        .dry_run_releases
                        .get_or_create(&req.reason.as_str().to_string().into())
                        .inc();
                }
                let _ = reply.send(Ok(ReleaseOutcome::DryRun));
            }
            return Vec::new();
        }
        let (reqs, replies) = one_write_per_entry(items);
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
        for (&i, o) in ready.iter().zip(self.patch_with_retry(pool, &batch).await) {
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
                    let object = (object.name.clone(), object.uid.clone());
                    self.record_fence(index.as_deref_mut(), req, object);
                    outcome = Ok(ReleaseOutcome::Fenced);
                }
                (Ok(ReleaseOutcome::Released), _) => {
                    after.extend(self.record_release(index.as_deref_mut(), req))
                }
                // The entry went or changed before its fence: the record this write created is
                // left over (one it found is another writer's, and the left-over check judges it).
                (Ok(ReleaseOutcome::AlreadyGone | ReleaseOutcome::Changed), Some(Ok(o)))
                    if o.created =>
                {
                    after.push(ObjectDelete::Fence(o.name.clone(), o.uid.clone()))
                }
                (Err(e), _) => self.metrics.failed(e.cause()),
                _ => {}
            }
            answers.push(outcome);
        }
        drop(index);
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
        after
    }

    /// Writes the `IPFence` record of each fence in `reqs` (`None` for other writes): its
    /// (name, uid), or why it could not be written.
    async fn write_fence_records(
        &self,
        pool: &str,
        reqs: &[ReleaseRequest],
    ) -> Vec<Option<Result<FenceObjectWritten, ReleaseError>>> {
        let mut writes = Vec::with_capacity(reqs.len());
        for r in reqs {
            writes.push(self.fence_record_of(pool, r));
        }
        futures::stream::iter(writes)
            .buffered(RESERVATION_DELETERS)
            .collect()
            .await
    }

    async fn fence_record_of(
        &self,
        pool: &str,
        req: &ReleaseRequest,
    ) -> Option<Result<FenceObjectWritten, ReleaseError>> {
        let EntryWrite::Fence(record) = &req.write else {
            return None;
        };
        Some(self.write_fence_record(pool, req, record).await)
    }

    /// Creates the `IPFence` record of one fence. One already there for the same entry (a
    /// retry, or a pending fence being completed) is used; one left over from an earlier
    /// fence of the same address is replaced.
    async fn write_fence_record(
        &self,
        pool: &str,
        req: &ReleaseRequest,
        record: &FenceRecord,
    ) -> Result<FenceObjectWritten, ReleaseError> {
        let e = &req.judged.entry;
        let name = fence_object_name(pool, &e.key);
        let spec = fence_spec(pool, &e.key, e.ip, &e.id, record);
        let api: Api<IPFence> = Api::namespaced(self.client.clone(), &self.namespace);
        let refused = |err: &kube::Error| match err {
            e if super::budget::is_not_leader(e) => ReleaseError::NotLeader,
            kube::Error::Api(s) if (400..500).contains(&s.code) => ReleaseError::Refused {
                pool: pool.into(),
                message: format!("fence record {name}: {}", s.message),
            },
            other => api_error(pool, other),
        };
        let params = PostParams::default();
        for _ in 0..2 {
            let mut object = IPFence::new(&name, spec.clone());
            object.metadata.labels = Some(BTreeMap::from([(
                crate::ipam::fence::NODE_LABEL.to_owned(),
                crate::ipam::fence::node_label_value(&spec.node),
            )]));
            let created = self
                .budgets
                .send(WriteKind::Reservation, || {
                    self.metrics.write("create");
                    api.create(&params, &object)
                })
                .await;
            let existing = match created {
                Ok(o) => {
                    return Ok(FenceObjectWritten {
                        name: name.clone(),
                        uid: o.metadata.uid.unwrap_or_default(),
                        created: true,
                    });
                }
                Err(kube::Error::Api(s)) if s.code == 409 => self
                    .budgets
                    .send(WriteKind::Reservation, || api.get_opt(&name))
                    .await
                    .map_err(|err| refused(&err))?,
                Err(err) => return Err(refused(&err)),
            };
            let Some(existing) = existing else {
                continue; // deleted meanwhile: create again
            };
            let uid = existing.metadata.uid.clone().unwrap_or_default();
            let same = (
                &existing.spec.pool,
                &existing.spec.key,
                &existing.spec.sandbox,
            ) == (&spec.pool, &spec.key, &spec.sandbox)
                && existing.spec.podref == spec.podref;
            if same {
                return Ok(FenceObjectWritten {
                    name: name.clone(),
                    uid,
                    created: false,
                });
            }
            // Left over from an earlier fence of this address (its entry is another sandbox's
            // now): replace it.
            self.delete_object(ObjectDelete::Fence(name.clone(), uid))
                .await;
        }
        Err(ReleaseError::Conflict { pool: pool.into() })
    }

    /// Whether this allocation's dry-run decision is new (and remembers it). Allocations gone
    /// from the controller's index are forgotten, so a new one at the same key is reported.
    fn first_dry_run_report(&self, pool: &str, key: &str, id: &str) -> bool {
        let mut reported = self.dry_run_reported.lock().expect("dry-run lock");
        if let Some(index) = &self.index {
            let index = index.read().expect("index lock");
            reported.retain(|(p, k, i)| index.holds(p, k, i));
        }
        reported.insert((pool.to_owned(), key.to_owned(), id.to_owned()))
    }

    /// Writes `reqs`, one patch while it goes through. A refused patch (422 or 400) is looked
    /// into: the pool is read again, entries that changed are settled (not ours any more), and
    /// when nothing changed the patch itself was refused (too large, invalid), so it is split
    /// until only the entries concerned fail. Other errors fail the patch's entries.
    async fn patch_with_retry(&self, pool: &str, reqs: &[ReleaseRequest]) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; reqs.len()];
        let mut groups: Vec<Vec<usize>> = vec![(0..reqs.len()).collect()];
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
            let refusal = match self.patch(pool, &batch, annotations).await {
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
            let pools = self.pools();
            let current = match self
                .budgets
                .send(WriteKind::Pool, || pools.get_opt(pool))
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    settle_all(&mut outcomes, Err(api_error(pool, &e)));
                    continue;
                }
            };
            annotations = Some(
                current
                    .as_ref()
                    .is_some_and(|p| p.metadata.annotations.is_some()),
            );
            let allocations = current.map(|p| p.spec.allocations).unwrap_or_default();
            let mut still = Vec::with_capacity(group.len());
            for &i in &group {
                let e = &reqs[i].judged.entry;
                match allocations.get(&e.key) {
                    None => outcomes[i] = Some(Ok(ReleaseOutcome::AlreadyGone)),
                    Some(a) if a.id == e.id && a.podref == e.podref => still.push(i),
                    // Fenced already (a first patch that answered late, or another writer
                    // completing the same fence): written.
                    Some(a) if a.id == e.id && fenced_as(&reqs[i].write, &a.podref) => {
                        outcomes[i] = Some(Ok(ReleaseOutcome::Released))
                    }
                    Some(_) => outcomes[i] = Some(Ok(ReleaseOutcome::Changed)),
                }
            }
            match (still.len() == group.len(), still.len()) {
                (_, 0) => {}
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

    /// One patch of `batch`; `annotations`: whether the pool has an annotations map, when a
    /// fresh read told (else the index is asked).
    async fn patch(
        &self,
        pool: &str,
        batch: &[&ReleaseRequest],
        annotations: Option<bool>,
    ) -> Result<(), kube::Error> {
        let has_annotations = annotations.unwrap_or_else(|| {
            let index = self.index.as_ref();
            index.is_some_and(|i| i.read().expect("index lock").has_annotations(pool))
        });
        let patch = patch::entries_patch(batch, has_annotations);
        let patch = patch::typed(patch).map_err(kube::Error::SerdeError)?;
        let pools = self.pools();
        self.metrics.pool_patch_entries.observe(batch.len() as f64);
        self.budgets
            .send(WriteKind::Pool, || {
                self.metrics.write("patch");
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

    /// Updates the state for a written fence.
    fn record_fence(
        &self,
        index: Option<&mut Index>,
        req: &ReleaseRequest,
        object: (String, String),
    ) {
        let (j, EntryWrite::Fence(record)) = (&req.judged, &req.write) else {
            return;
        };
        self.metrics.fences.inc();
        if let Some(index) = index {
            index.fence_written(&j.pool, &j.entry.key, &j.entry.id, record, object);
        }
        tracing::info!(pool = %j.pool, ip = %j.entry.ip, podref = %record.podref, node = %record.node, why = %record.why, "fenced");
    }

    /// Updates the state and metrics for a written release; returns what to delete after it
    /// (its reservations, a lifted fence's record).
    fn record_release(&self, index: Option<&mut Index>, req: &ReleaseRequest) -> Vec<ObjectDelete> {
        let j = &req.judged;
        // A fenced entry's reservations still name the pod it was fenced for.
        let podref = match &req.write {
            EntryWrite::Unfence(record, _) => &record.podref,
            _ => &j.entry.podref,
        };
        let mut after: Vec<ObjectDelete> = match index {
            Some(index) => index.released(&j.pool, &j.entry.key, podref, j.entry.ip),
            None => Vec::new(),
        }
        .into_iter()
        .map(|(name, uid)| {
            ObjectDelete::Reservation(ReservationDelete {
                name,
                uid,
                podref: podref.clone(),
                ip: Some(j.entry.ip),
                pool: Some(j.pool.clone()),
            })
        })
        .collect();
        if let EntryWrite::Unfence(_, FenceSource::Object { name, uid }) = &req.write {
            after.push(ObjectDelete::Fence(name.clone(), uid.clone()));
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

    /// Deletes one fence record with its uid as precondition (reservations go through
    /// `delete_reservation`).
    async fn delete_object(&self, object: ObjectDelete) {
        let ObjectDelete::Fence(name, uid) = object else {
            return;
        };
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let api: Api<IPFence> = Api::namespaced(self.client.clone(), &self.namespace);
        let result = self
            .budgets
            .send(WriteKind::Reservation, || {
                self.metrics.write("delete");
                api.delete(&name, &params)
            })
            .await;
        match result {
            Ok(_) => {}
            // Gone already, or replaced by a new record (uid changed): not ours.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => {
                self.metrics.failed("reservation");
                tracing::warn!(record = %name, error = %e, "could not delete fence record");
            }
        }
    }
}

/// Whether `podref` is what `write`, a fence, makes of its entry.
fn fenced_as(write: &EntryWrite, podref: &str) -> bool {
    matches!(write, EntryWrite::Fence(r) if podref == fenced_podref(&r.podref))
}

fn api_error(pool: &str, e: &kube::Error) -> ReleaseError {
    if super::budget::is_not_leader(e) {
        return ReleaseError::NotLeader;
    }
    ReleaseError::Api {
        pool: pool.into(),
        message: e.to_string(),
    }
}

/// One write per entry, lowest address first, and for each request which write answers it.
/// The sweep and the deletion path may hand in the same entry in one patch window: a second
/// `remove` of it would fail the whole patch. A fence wins over a plain removal.
fn one_write_per_entry(
    items: Vec<(ReleaseRequest, Reply)>,
) -> (Vec<ReleaseRequest>, Vec<(Answer, Reply)>) {
    let mut reqs: Vec<ReleaseRequest> = Vec::with_capacity(items.len());
    let mut by_key: HashMap<String, usize> = HashMap::with_capacity(items.len());
    let mut replies = Vec::with_capacity(items.len());
    for (req, reply) in items {
        let answer = match by_key.get(&req.judged.entry.key) {
            Some(&i) => {
                let same = reqs[i].judged.entry.id == req.judged.entry.id
                    && reqs[i].judged.entry.podref == req.judged.entry.podref;
                if !same {
                    // Two allocations seen at one key: at most one is there; the patch tests
                    // the first, and the other was replaced (its owner looks again later).
                    Answer::Other
                } else {
                    if matches!(req.write, EntryWrite::Fence(_)) {
                        reqs[i] = req;
                    }
                    Answer::By(i)
                }
            }
            None => {
                by_key.insert(req.judged.entry.key.clone(), reqs.len());
                reqs.push(req);
                Answer::By(reqs.len() - 1)
            }
        };
        replies.push((answer, reply));
    }
    // whereabouts hands out the lowest free address that has no reservation, so the
    // reservations go lowest address first: those addresses are reused first.
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| reqs[i].judged.entry.ip);
    let mut at = vec![0; reqs.len()];
    for (new, &old) in order.iter().enumerate() {
        at[old] = new;
    }
    let mut slots: Vec<Option<ReleaseRequest>> = reqs.into_iter().map(Some).collect();
    let reqs = order
        .iter()
        .map(|&i| slots[i].take().expect("each index once"))
        .collect();
    let replies = replies
        .into_iter()
        .map(|(a, r)| match a {
            Answer::By(i) => (Answer::By(at[i]), r),
            other => (other, r),
        })
        .collect();
    (reqs, replies)
}

/// Which write answers a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The write at this index.
    By(usize),
    /// None: another allocation at the same key is written instead.
    Other,
}

/// A refused group split in two: fences apart from the rest first (a fence grows the pool;
/// a removal never does), else halves.
fn split(reqs: &[ReleaseRequest], group: Vec<usize>) -> Vec<Vec<usize>> {
    let (fences, rest): (Vec<usize>, Vec<usize>) = group
        .iter()
        .partition(|&&i| matches!(reqs[i].write, EntryWrite::Fence(_)));
    if !fences.is_empty() && !rest.is_empty() {
        return vec![fences, rest];
    }
    let mut first = group;
    let second = first.split_off(first.len() / 2);
    vec![first, second]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::fixtures::{record, request};

    fn reply() -> Reply {
        oneshot::channel().0
    }

    #[test]
    fn each_entry_is_written_once_a_fence_wins_and_another_allocation_at_the_key_is_answered_apart()
    {
        let mut other = request("5", "ns/db-0", EntryWrite::Remove);
        other.judged.entry.id = "sb-other".into();
        let mut low = request("3", "ns/a-0", EntryWrite::Remove);
        low.judged.entry.ip = "192.0.2.3".parse().unwrap();
        let items = vec![
            (request("5", "ns/web-0", EntryWrite::Remove), reply()),
            (
                request("5", "ns/web-0", EntryWrite::Fence(record())),
                reply(),
            ),
            (other, reply()),
            (low, reply()),
        ];
        let (reqs, replies) = one_write_per_entry(items);
        let keys: Vec<&str> = reqs.iter().map(|r| r.judged.entry.key.as_str()).collect();
        assert_eq!(keys, ["3", "5"], "lowest address first, one write per key");
        assert!(
            matches!(reqs[1].write, EntryWrite::Fence(_)),
            "the fence wins"
        );
        let answers: Vec<Answer> = replies.into_iter().map(|(a, _)| a).collect();
        assert_eq!(
            answers,
            [Answer::By(1), Answer::By(1), Answer::Other, Answer::By(0)]
        );
    }

    #[test]
    fn an_entry_already_marked_for_the_fence_counts_as_fenced_on_a_re_read() {
        let fence = EntryWrite::Fence(record());
        assert!(fenced_as(&fence, "ns/web-0:fenced"));
        assert!(!fenced_as(&fence, "ns/web-0"));
        assert!(!fenced_as(&fence, "ns/db-0:fenced"));
        assert!(!fenced_as(&EntryWrite::Remove, "ns/web-0:fenced"));
    }

    #[test]
    fn a_refused_group_splits_fences_from_removals_then_in_halves() {
        let reqs = vec![
            request("1", "ns/a", EntryWrite::Remove),
            request("2", "ns/b", EntryWrite::Fence(record())),
            request("3", "ns/c", EntryWrite::Remove),
            request("4", "ns/d", EntryWrite::Fence(record())),
        ];
        assert_eq!(split(&reqs, vec![0, 1, 2, 3]), [vec![1, 3], vec![0, 2]]);
        assert_eq!(split(&reqs, vec![1, 3]), [vec![1], vec![3]]);
        assert_eq!(split(&reqs, vec![0, 2]), [vec![0], vec![2]]);
    }
}
