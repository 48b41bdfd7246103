//! Pool writes: releases batched into one JSON patch per pool, each entry pinned by `test`
//! operations on its `id` and `podref` before its `remove`, so concurrent allocations of other
//! offsets are never lost and never conflict. A fence's record is written first (an entry
//! whose record cannot be written is not touched); what a batch freed goes to the object
//! writes after it (see `ipam::fence` for why that order is crash-safe).
//!
//! Its pure parts: the schedule (`schedule`), the batch's shape (`batch`) and the patch
//! builder (`patch`); `batcher` drives them; this file sends a batch and tells the ledger.

pub mod batch;
pub(super) mod batcher;
pub mod cooling;
pub mod patch;
pub mod schedule;
#[cfg(test)]
mod sim;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};

use self::batch::{Answer, one_write_per_entry, settle_against, split};
use self::cooling::cooled_entry;
use super::budget::{Paid, WriteKind};
use super::context::{WriteContext, api_error};
use super::ledger::Written;
use super::objects::{ObjectDelete, ObjectWriter};
use super::reports::dry_run::DryRunReports;
use super::types::{
    EntryWrite, Outcome, ReleaseError, ReleaseOutcome, ReleaseRequest, Reply, ReservationDelete,
};
use crate::api::ObjectId;
use crate::telemetry::logging::TIMELINE;

/// Patches one batch may take while refused writes are split apart (each refusal costs a
/// patch and a read); what is left then is retried later, with backoff.
const MAX_PATCHES_PER_BATCH: usize = 64;

/// The pool writes: their settings, and what they hand on to the object writes and reports.
pub struct PoolWriter {
    pub(crate) cx: Arc<WriteContext>,
    /// Fence records before their entries; reservation deletes after them.
    pub(crate) objects: Arc<ObjectWriter>,
    /// Least time between two patches of one pool: what arrives meanwhile joins the next.
    pub(crate) patch_interval: Duration,
    /// `--release-cooldown`: how long a released address stays out of the pool (zero: off).
    pub(crate) cooldown: Duration,
    dry_run_reports: DryRunReports,
    /// This run's identity in the signature of its writes of marked entries, and how many it
    /// signed (see `ipam::own_write`).
    run: String,
    signed: AtomicU64,
}

impl PoolWriter {
    /// Pool writes of `cx`, handing fence records and deletes to `objects`.
    pub(crate) fn new(
        cx: Arc<WriteContext>,
        objects: Arc<ObjectWriter>,
        patch_interval: Duration,
        cooldown: Duration,
    ) -> Self {
        PoolWriter {
            cx,
            objects,
            patch_interval,
            cooldown,
            dry_run_reports: DryRunReports::default(),
            run: crate::ipam::own_write::run_id(std::process::id(), jiff::Timestamp::now()),
            signed: AtomicU64::new(0),
        }
    }

    /// The signature of the next write of marked entries (see `ipam::own_write`).
    fn signature(&self) -> String {
        let n = self.signed.fetch_add(1, Ordering::Relaxed);
        crate::ipam::own_write::own_write_value(&self.run, n, jiff::Timestamp::now())
    }
}

impl PoolWriter {
    /// Writes one batch and answers each request; returns the objects to delete after it
    /// (reservations of what was released, records of lifted fences). `paid`: whether its
    /// first patch's token was taken already.
    pub(super) async fn release_pool(
        &self,
        pool: &str,
        items: Vec<(ReleaseRequest, Reply)>,
        paid: Paid,
    ) -> Vec<ObjectDelete> {
        if self.cx.dry_run {
            self.dry_run_reports
                .report(&self.cx, self.cooldown, pool, items)
                .await;
            return Vec::new();
        }
        let (mut reqs, replies) = one_write_per_entry(items);
        super::types::set_cooldowns(&mut reqs, self.cooldown, jiff::Timestamp::now());
        // Fences: the record first. An entry whose record cannot be written is not touched.
        let records = self.objects.write_fence_records(pool, &reqs).await;
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
        let objects: Vec<Option<ObjectId>> = records
            .iter()
            .map(|r| match r {
                Some(Ok(o)) => Some(ObjectId {
                    name: o.name.clone(),
                    uid: o.uid.clone(),
                }),
                _ => None,
            })
            .collect();
        let cooled: Vec<_> = reqs
            .iter()
            .map(|r| r.cooldown.map(|until| cooled_entry(r, until)))
            .collect();
        let mut after = Vec::new();
        let mut answers: Vec<Outcome> = Vec::with_capacity(reqs.len());
        // What went through, told to the ledger at once (one write of the index per patch).
        let mut written: Vec<(usize, Written<'_>)> = Vec::new();
        for (i, (req, outcome)) in reqs.iter().zip(outcomes).enumerate() {
            let mut outcome = outcome.unwrap_or(Err(ReleaseError::Stopped));
            let (j, podref) = (&req.judged, req.podref());
            let (pool, key) = (j.pool.as_str(), j.entry.key.as_str());
            match (&outcome, &records[i], &objects[i], &req.write) {
                (Ok(ReleaseOutcome::Released), _, Some(object), EntryWrite::Fence(record)) => {
                    let sandbox = j.entry.id.as_str();
                    written.push((
                        i,
                        Written::Fenced {
                            pool,
                            key,
                            sandbox,
                            record,
                            object,
                        },
                    ));
                    outcome = Ok(ReleaseOutcome::Fenced);
                }
                (Ok(ReleaseOutcome::Released), ..) if cooled[i].is_some() => {
                    let cooled = cooled[i].as_ref().expect("a cooling write");
                    written.push((i, Written::Cooled { pool, key, cooled }));
                    outcome = Ok(req
                        .cooldown
                        .map_or(ReleaseOutcome::Released, ReleaseOutcome::Cooling));
                }
                (Ok(ReleaseOutcome::Released), .., EntryWrite::EndCooldown) => {
                    let ip = j.entry.ip;
                    written.push((
                        i,
                        Written::CooldownEnded {
                            pool,
                            key,
                            podref,
                            ip,
                        },
                    ));
                }
                (Ok(ReleaseOutcome::Released), ..) => {
                    let ip = j.entry.ip;
                    written.push((
                        i,
                        Written::Released {
                            pool,
                            key,
                            podref,
                            ip,
                        },
                    ));
                }
                // The entry went or changed before its fence: the record this write created is
                // left over (one it found is another writer's, and the left-over check judges it).
                (
                    Ok(ReleaseOutcome::AlreadyGone | ReleaseOutcome::Changed),
                    Some(Ok(o)),
                    Some(object),
                    _,
                ) if o.created => after.push(ObjectDelete::Fence(object.clone())),
                (Err(e), ..) => self.cx.metrics.failed(e.label()),
                _ => {}
            }
            answers.push(outcome);
        }
        let writes: Vec<Written<'_>> = written.iter().map(|(_, w)| *w).collect();
        let freed = self.cx.ledger.wrote(&writes);
        for ((i, w), reservations) in written.iter().zip(freed) {
            after.extend(self.after_written(&reqs[*i], w, reservations));
        }
        send_answers(pool, replies, &answers);
        after
    }

    /// Logs and counts one write that went through; returns what to delete after it: the
    /// reservations it freed (`reservations`, as the ledger knows them) and a lifted fence's
    /// record (a cooling write keeps the reservation until its cooldown ends).
    fn after_written(
        &self,
        req: &ReleaseRequest,
        written: &Written<'_>,
        reservations: Vec<ObjectId>,
    ) -> Vec<ObjectDelete> {
        let (j, podref) = (&req.judged, req.podref());
        let mut after: Vec<ObjectDelete> = reservations
            .into_iter()
            .map(|r| ObjectDelete::Reservation(ReservationDelete::after_release(r, podref, j)))
            .collect();
        match written {
            Written::Fenced { record, .. } => {
                self.cx.metrics.fences.inc();
                tracing::info!(pool = %j.pool, ip = %j.entry.ip, podref = %record.podref, node = %record.node, why = %record.why, "fenced");
                return after;
            }
            Written::CooldownEnded { .. } => {
                tracing::info!(pool = %j.pool, ip = %j.entry.ip, podref = %podref, "cooldown ended; the address is back in the pool");
                return after;
            }
            Written::Cooled { .. } => {
                let until = req.cooldown.map(|t| t.to_string()).unwrap_or_default();
                tracing::info!(pool = %j.pool, ip = %j.entry.ip, %podref, reason = %req.reason, cooldown_until = %until, "released into cooldown");
            }
            Written::Released { .. } => {
                tracing::info!(pool = %j.pool, ip = %j.entry.ip, %podref, reason = %req.reason, "released");
            }
        }
        if let EntryWrite::Unfence(_, object) = &req.write {
            after.push(ObjectDelete::Fence(object.clone()));
        }
        self.cx.metrics.released(req.reason.as_str());
        if let Some(at) = req.deleted_at {
            self.cx
                .metrics
                .deletion_to_release_seconds
                .observe(at.elapsed().as_secs_f64());
        }
        after
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
            let used = annotations.unwrap_or_else(|| self.cx.ledger.has_annotations(pool));
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
                .cx
                .budgets
                .send(WriteKind::Pool, || self.cx.read_pool(pool))
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
        let pools = self.cx.pools_api();
        self.cx
            .metrics
            .pool_patch_entries
            .observe(batch.len() as f64);
        self.cx
            .budgets
            .send_counted(WriteKind::Pool, paid, &self.cx.metrics, "patch", || {
                let patch = Patch::<()>::Json(patch.clone());
                let (pools, metrics) = (pools.clone(), self.cx.metrics.clone());
                async move {
                    let started = Instant::now();
                    tracing::trace!(target: TIMELINE, %pool, "patch sent");
                    let result = pools.patch(pool, &PatchParams::default(), &patch).await;
                    tracing::trace!(target: TIMELINE, %pool, "patch returned");
                    metrics
                        .pool_patch_seconds
                        .observe(started.elapsed().as_secs_f64());
                    result
                }
            })
            .await
            .map(|_| ())
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
