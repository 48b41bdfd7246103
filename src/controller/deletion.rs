//! The deletion path: podrefs with tombstones come off the work queue, their allocations are
//! judged, and releases go to the pool writer. A worker does not wait for the write: the item
//! is finished (Events, retry or done) when its outcomes come back, while the worker hands in
//! the next, so a burst reaches the writer whole and leaves as a few patches. Failures retry
//! with per-item backoff; after the last retry a Warning Event names the cause and the sweep
//! still owns the leak. A fence that cannot be written is never given up: the entry stays,
//! the tombstone stays (so the sweep hands the entry back here, never releases it), and the
//! fence is retried with backoff for as long as it fails.

use std::time::{Duration, Instant};

use kube::api::Api;
use tokio::sync::watch;

use super::fresh_node::NodeReadError;
use super::plan::{plan_fences, releases_of};
use crate::api::slim::PodView;
use crate::index::Index;
use crate::ipam::PodKey;
use crate::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::rules::{PodRef, ReclaimConfig};
use crate::telemetry::logging::TIMELINE;

/// An item a replica could not write because it does not lead waits this long before a worker
/// (which waits for leadership) takes it again.
const NOT_LEADER_RETRY: Duration = Duration::from_secs(1);

/// Retries of a fence that keeps failing, after the Warning, are spaced by this at most.
const FENCE_RETRY_MAX: Duration = Duration::from_secs(30);

/// What went wrong with a deletion-path item (its text goes into the Warning Event).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeletionError {
    /// A blind tombstone's pod could not be read to confirm it is gone.
    #[error("confirming pod {podref} is gone: {message}")]
    Confirm {
        /// The pod.
        podref: String,
        /// What the API said.
        message: String,
    },
    /// The node of the deleted pod could not be read fresh, so nothing was removed.
    #[error("{0}")]
    NodeRead(#[from] NodeReadError),
    /// Writes of the item's releases or fences failed.
    #[error("{}", join(.0))]
    Writes(Vec<ReleaseError>),
}

fn join(errors: &[ReleaseError]) -> String {
    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
    errors.join("; ")
}

impl DeletionError {
    /// A short stable name of what failed, for logs: `confirm`, or the first write's
    /// `release_failures_total` cause.
    pub fn label(&self) -> &'static str {
        match self {
            DeletionError::Confirm { .. } => "confirm",
            DeletionError::NodeRead(_) => "node_read",
            DeletionError::Writes(errors) => errors.first().map_or("api", ReleaseError::label),
        }
    }
}

/// Why a queue item failed.
#[derive(Debug)]
struct Failure {
    /// What went wrong.
    error: DeletionError,
    /// A fence could not be written: retried for as long as it fails.
    fence: bool,
    /// The deleted pod to name in a Warning, when known.
    pod: Option<Box<PodRef>>,
    /// Nothing was written because this replica does not lead: the item waits for
    /// leadership, without counting a retry.
    not_leader: bool,
}

impl Failure {
    fn new(error: DeletionError) -> Failure {
        Failure {
            error,
            fence: false,
            pod: None,
            not_leader: false,
        }
    }
}

/// The delay before fence retry `n` past `max` (doubling from a second).
fn fence_retry_delay(n: u32, max: u32) -> Duration {
    let doublings = n.saturating_sub(max).min(16);
    (Duration::from_secs(1) * 2u32.pow(doublings)).min(FENCE_RETRY_MAX)
}

/// Whether `r` takes an entry out of its pool (a fence keeps it).
fn removes(r: &ReleaseRequest) -> bool {
    !matches!(r.write, EntryWrite::Fence(_))
}

/// What became of a queue item.
enum Processed {
    /// Released, fenced or nothing to do.
    Done,
    /// Handed to the writer; finished when its outcomes come back.
    Submitted,
}

/// A deletion-path worker.
pub struct Worker {
    pub(crate) ctx: super::ctx::Ctx,
    pub(crate) reclaim: ReclaimConfig,
    pub(crate) max_retries: u32,
    pub(crate) leader: watch::Receiver<bool>,
}

impl Worker {
    /// Processes queue items until the queue shuts down.
    pub async fn run(mut self) {
        while let Some(podref) = self.ctx.queue.get().await {
            self.ctx
                .metrics
                .queue_depth
                .set(self.ctx.queue.len() as i64);
            // Writes are the leader's; a standby keeps the item until it leads.
            if self.leader.wait_for(|l| *l).await.is_err() {
                self.ctx.queue.done(&podref);
                return;
            }
            tracing::trace!(target: TIMELINE, %podref, "worker took");
            let processed = self.process(&podref).await;
            self.finish(&podref, processed).await;
        }
    }

    /// Files a processed item: done, later, or retried with backoff; the last failure gets a
    /// Warning Event. A submitted item is filed by its own task when its outcomes come back.
    async fn finish(&self, podref: &str, processed: Result<Processed, Failure>) {
        let (queue, key) = (&self.ctx.queue, podref.to_owned());
        match processed {
            Ok(Processed::Submitted) => return,
            Ok(Processed::Done) => queue.forget(&key),
            Err(f) if f.not_leader => {
                // Handed back: a worker takes it when this replica leads again.
                tracing::info!(%podref, "not written: this replica does not lead");
                queue.add_after(key.clone(), NOT_LEADER_RETRY);
            }
            Err(f) if f.fence || matches!(f.error, DeletionError::NodeRead(_)) => {
                // Never given up, never a release: the entry stays allocated meanwhile, and so
                // does the tombstone (the sweep hands the entry back here).
                let n = queue.num_requeues(&key);
                self.ctx.metrics.retries.inc();
                let cause = if f.fence {
                    self.ctx.metrics.writes.fence_failures.inc();
                    tracing::warn!(%podref, cause = %f.error, kind = f.error.label(), attempt = n + 1, "fence could not be written; the address is kept and the fence retried");
                    format!(
                        "fence not written ({}); the address is kept and the fence retried until it is written or lifts",
                        f.error
                    )
                } else {
                    tracing::warn!(%podref, cause = %f.error, kind = f.error.label(), attempt = n + 1, "the node could not be read; the address is kept and the read retried");
                    format!(
                        "{}; nothing is released until the node is read (retried)",
                        f.error
                    )
                };
                if n == self.max_retries {
                    let pod = f.pod.map_or_else(|| self.pod_of(podref), |p| *p);
                    self.ctx.events.failed(&pod, &cause).await;
                }
                if n <= self.max_retries {
                    queue.add_rate_limited(key.clone());
                } else {
                    queue.add_after(key.clone(), fence_retry_delay(n, self.max_retries));
                }
            }
            Err(f) if queue.num_requeues(&key) < self.max_retries => {
                tracing::warn!(%podref, cause = %f.error, kind = f.error.label(), "release failed; retrying with backoff");
                self.ctx.metrics.retries.inc();
                queue.add_rate_limited(key.clone());
            }
            Err(f) => {
                tracing::error!(%podref, cause = %f.error, kind = f.error.label(), "release failed for good; the sweep keeps the leak");
                let pod = f.pod.map_or_else(|| self.pod_of(podref), |p| *p);
                self.ctx.events.failed(&pod, &f.error.to_string()).await;
                queue.forget(&key);
                self.ctx
                    .index
                    .write()
                    .expect("index lock")
                    .clear_tombstones(podref, Instant::now());
            }
        }
        queue.done(&key);
    }

    /// The deleted pod of `podref` (its latest tombstone), for a Warning: never the live
    /// replacement of the same name.
    fn pod_of(&self, podref: &str) -> PodRef {
        let st = self.ctx.index.read().expect("index lock");
        let uid = st
            .pods()
            .tombstones(podref)
            .iter()
            .rev()
            .find(|t| !t.uid.is_empty());
        PodRef::from_podref(podref, uid.map(|t| t.uid.clone()).unwrap_or_default())
    }

    async fn process(&self, podref: &str) -> Result<Processed, Failure> {
        let started = Instant::now();
        // One look at the index decides, unless the tombstone is blind.
        let (decided, seen, none_live) = {
            let st = self.ctx.index.read().expect("index lock");
            let none_live = st.pods().live(podref).is_none();
            let blind = none_live && st.pods().blind_tombstone(podref);
            let seen = st.pods().tombstones(podref).iter().map(|t| t.seen_at).max();
            ((!blind).then(|| self.decide(&st, podref)), seen, none_live)
        };
        let seen = seen.unwrap_or(started);
        let (mut releases, distrusted) = match decided {
            // With no pod of the name known, the address a tombstone listed may already be a
            // replacement's (same name, the address given back, our pod watch behind the pool
            // watch): a pod must exist before an allocation is made for it, so a fresh read
            // now finds any replacement whose entry we judged.
            Some(judged) if none_live && judged.iter().any(removes) => {
                self.confirm_no_replacement(podref, judged, started, seen)
                    .await?
            }
            Some(releases) => {
                let distrusted = self.nodes_distrusted(podref, &releases, seen).await?;
                (releases, distrusted)
            }
            None => {
                let releases = self.decide_blind(podref, started).await?;
                let distrusted = self.nodes_distrusted(podref, &releases, seen).await?;
                (releases, distrusted)
            }
        };
        if distrusted {
            let st = self.ctx.index.read().expect("index lock");
            releases = self.decide(&st, podref);
        }
        if releases.is_empty() {
            self.ctx
                .index
                .write()
                .expect("index lock")
                .clear_tombstones(podref, started);
            return Ok(Processed::Done);
        }
        tracing::trace!(target: TIMELINE, %podref, "to the writer");
        let outcomes = self.ctx.writer.submit(releases.clone()).await;
        let (me, podref) = (self.clone_for_finish(), podref.to_owned());
        tokio::spawn(async move {
            let outcomes = outcomes.await;
            me.ctx
                .events
                .released_all(releases.iter().zip(&outcomes))
                .await;
            let processed = me.settle(&podref, started, &releases, &outcomes);
            me.finish(&podref, processed).await;
        });
        Ok(Processed::Submitted)
    }

    /// The releases (and fences) of `podref`'s allocations, judged from `st`.
    fn decide(&self, st: &Index, podref: &str) -> Vec<ReleaseRequest> {
        let judged = st.judge_podref(podref, &self.reclaim);
        tracing::debug!(
            %podref,
            judged = ?judged.iter().map(|j| (j.entry.ip, j.decision)).collect::<Vec<_>>(),
            "deletion path"
        );
        let deleted_at = st.pods().first_deletion(podref);
        let mut releases = releases_of(&judged, deleted_at);
        if let Some(view) = &self.ctx.nodes {
            let view = view.read().expect("node view lock");
            plan_fences(st, &view, podref, &judged, &mut releases);
        }
        releases
    }

    /// Without network-status the tombstone would free every allocation of the name: makes
    /// sure no pod of that name exists now (our cache may lag a recreation), then decides.
    async fn decide_blind(
        &self,
        podref: &str,
        started: Instant,
    ) -> Result<Vec<ReleaseRequest>, Failure> {
        self.read_pod(podref, started).await?;
        let st = self.ctx.index.read().expect("index lock");
        Ok(self.decide(&st, podref))
    }

    /// `judged` (releases that remove entries, with no pod of the name known) unless a pod of
    /// that name exists now: then it is judged again, live. Not judged again when there is
    /// none: entries newer than the read could be a pod's made after it. The nodes of `judged`
    /// are read fresh meanwhile (see [`nodes_distrusted`](Self::nodes_distrusted)), and those
    /// of a new judgement after; whether one is distrusted.
    async fn confirm_no_replacement(
        &self,
        podref: &str,
        judged: Vec<ReleaseRequest>,
        started: Instant,
        seen: Instant,
    ) -> Result<(Vec<ReleaseRequest>, bool), Failure> {
        let (replaced, distrusted) = tokio::join!(
            self.read_pod(podref, started),
            self.nodes_distrusted(podref, &judged, seen)
        );
        // The pod read's failure first, as when the node was read after it.
        if !replaced? {
            return Ok((judged, distrusted?));
        }
        tracing::info!(%podref, "a pod of the deleted pod's name exists: judged again with it");
        let releases = {
            let st = self.ctx.index.read().expect("index lock");
            self.decide(&st, podref)
        };
        // Nodes read Ready since the deletion are not read again.
        let again = self.nodes_distrusted(podref, &releases, seen).await?;
        Ok((releases, distrusted? || again))
    }

    /// Whether a node whose allocations `releases` would remove turns out not Ready when read
    /// fresh (see [`super::fresh_node`]).
    async fn nodes_distrusted(
        &self,
        podref: &str,
        releases: &[ReleaseRequest],
        seen: Instant,
    ) -> Result<bool, Failure> {
        super::fresh_node::distrusted_when_read(&self.ctx, podref, releases, seen)
            .await
            .map_err(|e| Failure::new(e.into()))
    }

    /// Reads the pod of `podref` fresh and puts it in the index if there is one; whether there
    /// is.
    async fn read_pod(&self, podref: &str, started: Instant) -> Result<bool, Failure> {
        let pod = PodKey::lenient(podref);
        let found = Api::<PodView>::namespaced(self.ctx.client.clone(), &pod.namespace)
            .get_opt(&pod.name)
            .await
            .map_err(|e| {
                Failure::new(DeletionError::Confirm {
                    podref: podref.to_owned(),
                    message: e.to_string(),
                })
            })?;
        let Some((p, uid)) = found
            .as_ref()
            .and_then(|p| Some((p, p.metadata.uid.as_deref()?)))
        else {
            return Ok(false);
        };
        let mut st = self.ctx.index.write().expect("index lock");
        st.upsert_pod(podref, uid, crate::index::kinds::seen(p), started);
        Ok(true)
    }

    /// What the outcomes of an item's releases make of it.
    fn settle(
        &self,
        podref: &str,
        started: Instant,
        releases: &[ReleaseRequest],
        outcomes: &[Result<ReleaseOutcome, ReleaseError>],
    ) -> Result<Processed, Failure> {
        let failed: Vec<(&ReleaseRequest, &ReleaseError)> = releases
            .iter()
            .zip(outcomes)
            .filter_map(|(r, o)| Some((r, o.as_ref().err()?)))
            .collect();
        if let Some((first, _)) = failed.first() {
            let errors = failed.iter().map(|(_, e)| (*e).clone()).collect();
            return Err(Failure {
                error: DeletionError::Writes(errors),
                fence: failed
                    .iter()
                    .any(|(r, _)| matches!(r.write, EntryWrite::Fence(_))),
                pod: Some(Box::new(first.judged.pod.clone())).filter(|p| !p.uid.is_empty()),
                not_leader: failed.iter().all(|(_, e)| **e == ReleaseError::NotLeader),
            });
        }
        let changed = outcomes
            .iter()
            .filter(|o| **o == Ok(ReleaseOutcome::Changed))
            .count();
        if changed > 0 {
            tracing::info!(%podref, changed, "entries now belong to another allocation; left alone");
        }
        self.ctx
            .index
            .write()
            .expect("index lock")
            .clear_tombstones(podref, started);
        Ok(Processed::Done)
    }

    fn clone_for_finish(&self) -> Worker {
        Worker {
            ctx: self.ctx.clone(),
            reclaim: self.reclaim,
            max_retries: self.max_retries,
            leader: self.leader.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deletion_errors_read_as_the_warning_always_did_and_name_what_failed() {
        let writes = DeletionError::Writes(vec![
            ReleaseError::Conflict { pool: "p".into() },
            ReleaseError::NotLeader,
        ]);
        assert_eq!(
            writes.to_string(),
            "pool p kept changing while releasing; not written: this replica does not lead"
        );
        assert_eq!(writes.label(), "conflict");
        let confirm = DeletionError::Confirm {
            podref: "ns/a".into(),
            message: "boom".into(),
        };
        assert_eq!(confirm.to_string(), "confirming pod ns/a is gone: boom");
        assert_eq!(confirm.label(), "confirm");
        let node = DeletionError::from(NodeReadError {
            node: "n1".into(),
            message: "boom".into(),
        });
        assert_eq!(
            node.to_string(),
            "reading node n1 before releasing its addresses: boom"
        );
        assert_eq!(node.label(), "node_read");
    }

    #[test]
    fn fence_retries_after_the_warning_double_from_a_second_up_to_thirty() {
        let s = Duration::from_secs;
        assert_eq!(fence_retry_delay(5, 5), s(1));
        assert_eq!(fence_retry_delay(6, 5), s(2));
        assert_eq!(fence_retry_delay(9, 5), s(16));
        assert_eq!(fence_retry_delay(10, 5), FENCE_RETRY_MAX);
        assert_eq!(fence_retry_delay(1000, 5), FENCE_RETRY_MAX);
    }
}
