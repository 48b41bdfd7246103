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

use super::fence::record_for;
use crate::api::slim::PodView;
use crate::index::NodeIndex;
use crate::index::{Index, Tombstone};
use crate::ipam::PodKey;
use crate::reclaim::{Decision, Reason, ReclaimConfig};
use crate::reclaim::{Judged, PodRef};
use crate::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};

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

/// What became of a queue item.
enum Processed {
    /// Released, fenced or nothing to do.
    Done,
    /// Handed to the writer; finished when its outcomes come back.
    Submitted,
}

/// A deletion-path worker.
pub struct Worker {
    pub(crate) ctx: super::Ctx,
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
            Err(f) if f.fence => {
                // Never given up, never a release: the entry stays allocated meanwhile.
                let n = queue.num_requeues(&key);
                self.ctx.metrics.writes.fence_failures.inc();
                self.ctx.metrics.retries.inc();
                tracing::warn!(%podref, cause = %f.error, kind = f.error.label(), attempt = n + 1, "fence could not be written; the address is kept and the fence retried");
                if n == self.max_retries {
                    let pod = f.pod.map_or_else(|| self.pod_of(podref), |p| *p);
                    let cause = format!(
                        "fence not written ({}); the address is kept and the fence retried until it is written or lifts",
                        f.error
                    );
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
                    .state
                    .write()
                    .expect("state lock")
                    .clear_tombstones(podref, Instant::now());
            }
        }
        queue.done(&key);
    }

    /// The deleted pod of `podref` (its latest tombstone), for a Warning: never the live
    /// replacement of the same name.
    fn pod_of(&self, podref: &str) -> PodRef {
        let st = self.ctx.state.read().expect("state lock");
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
        let (decided, seen) = {
            let st = self.ctx.state.read().expect("state lock");
            let blind = st.pods().live(podref).is_none() && st.pods().blind_tombstone(podref);
            let seen = st.pods().tombstones(podref).iter().map(|t| t.seen_at).max();
            ((!blind).then(|| self.decide(&st, podref)), seen)
        };
        let mut releases = match decided {
            Some(releases) => releases,
            None => self.decide_blind(podref, started).await?,
        };
        let seen = seen.unwrap_or(started);
        let distrusted =
            super::fresh_node::distrusted_when_read(&self.ctx, podref, &releases, seen)
                .await
                .map_err(|message| {
                    let podref = podref.to_owned();
                    Failure::new(DeletionError::Confirm { podref, message })
                })?;
        if distrusted {
            let st = self.ctx.state.read().expect("state lock");
            releases = self.decide(&st, podref);
        }
        if releases.is_empty() {
            self.ctx
                .state
                .write()
                .expect("state lock")
                .clear_tombstones(podref, started);
            return Ok(Processed::Done);
        }
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
        let mut st = self.ctx.state.write().expect("state lock");
        if let Some(p) = &found
            && let Some(uid) = &p.metadata.uid
        {
            st.upsert_pod(podref, uid, crate::index::kinds::seen(p), started);
        }
        Ok(self.decide(&st, podref))
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
            .state
            .write()
            .expect("state lock")
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

/// The releases the judgement calls for (deleted at `deleted_at`, for the latency metric).
fn releases_of(judged: &[Judged], deleted_at: Option<Instant>) -> Vec<ReleaseRequest> {
    judged
        .iter()
        .filter_map(|j| match j.decision {
            Decision::Release(reason) => Some(ReleaseRequest {
                judged: j.clone(),
                reason,
                deleted_at,
                cooldown: None,
                write: Default::default(),
            }),
            _ => None,
        })
        .collect()
}

/// Why the deletion `t` is fenced: its node was not trusted when the deletion was seen, or is
/// not now; never when its Node is gone or tainted out-of-service now (declared dead).
fn fence_reason(t: &Tombstone, view: &NodeIndex) -> Option<String> {
    let node = t.node.as_deref()?;
    let now = view.node(node)?;
    if now.out_of_service {
        return None;
    }
    t.distrust.clone().or_else(|| view.distrust(Some(node)))
}

/// The fences a deletion calls for, whatever the cache holds now. The node of a deleted pod
/// is known whenever its deletion was observed (a Delete event, a re-list's diff, a pod
/// replaced under its name), and the fence follows from that node: a release of a pod deleted
/// from a node that is not Ready becomes a fence; so does an allocation that pod held (same
/// pool, key and sandbox id as when its deletion was seen, its address listed by it) that is
/// judged kept only because a replacement of the same name is known without network-status
/// yet. Left unfenced, that entry would later be released as `IPNotOnPod`, its node still down.
pub(crate) fn plan_fences(
    st: &Index,
    view: &NodeIndex,
    podref: &str,
    judged: &[Judged],
    releases: &mut Vec<ReleaseRequest>,
) {
    for r in releases.iter_mut() {
        if r.reason != Reason::PodDeleted || r.judged.pod.uid.is_empty() {
            continue;
        }
        let Some(t) = st.pods().deleted_pod(podref, &r.judged.pod.uid) else {
            continue;
        };
        if let Some(why) = fence_reason(t, view) {
            let node = t.node.as_deref().unwrap_or_default().to_owned();
            r.write = EntryWrite::Fence(record_for(&r.judged, node, why));
        }
    }
    let live = st.pods().live(podref);
    let live_lists = |ip| {
        live.and_then(|l| l.networks.as_deref())
            .is_some_and(|n| n.iter().any(|a| a.ips.contains(&ip)))
    };
    for t in st.pods().tombstones(podref) {
        let Some(why) = fence_reason(t, view) else {
            continue;
        };
        if t.uid.is_empty() {
            continue;
        }
        for j in judged {
            let e = &j.entry;
            let planned = releases
                .iter()
                .any(|r| (&r.judged.pool, &r.judged.entry.key) == (&j.pool, &e.key));
            let held = t
                .held
                .iter()
                .any(|h| (&h.pool, &h.key, &h.id) == (&j.pool, &e.key, &e.id));
            let listed = match t.networks.as_deref() {
                Some(n) => n.iter().any(|a| a.ips.contains(&e.ip)),
                // Without its network-status, only while no pod of the name lives.
                None => live.is_none(),
            };
            if planned || !held || !listed || live_lists(e.ip) {
                continue;
            }
            let mut fenced = j.clone();
            fenced.decision = Decision::Release(Reason::PodDeleted);
            fenced.pod.uid = t.uid.clone();
            let node = t.node.as_deref().unwrap_or_default().to_owned();
            let record = record_for(&fenced, node, why.clone());
            releases.push(ReleaseRequest {
                judged: fenced,
                reason: Reason::PodDeleted,
                deleted_at: Some(t.seen_at),
                cooldown: None,
                write: EntryWrite::Fence(record),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::NodeCondition;

    use super::*;
    use crate::api::slim::NodeReadyView;
    use crate::api::{IPAllocation, IPPool, IPPoolSpec};
    use crate::index::PodSeen;

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
    }

    const WEB: &str = "ns/web-0";

    fn status(ip: &str) -> BTreeMap<String, String> {
        let s = format!(r#"[{{"name":"ns/net","interface":"net1","ips":["{ip}"]}}]"#);
        BTreeMap::from([(crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(), s)])
    }

    fn pool(id: &str) -> IPPool {
        let entry = IPAllocation {
            id: id.into(),
            podref: WEB.into(),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        };
        IPPool::new(
            "192.0.2.0-24",
            IPPoolSpec {
                range: "192.0.2.0/24".into(),
                allocations: BTreeMap::from([("10".to_string(), entry)]),
            },
        )
    }

    fn view(ready: &str) -> NodeIndex {
        let mut n = NodeReadyView::default();
        n.metadata.name = Some("node-a".into());
        n.ready = Some(NodeCondition {
            type_: "Ready".into(),
            status: ready.into(),
            reason: Some("NodeStatusUnknown".into()),
            ..Default::default()
        });
        let mut v = NodeIndex::default();
        v.upsert(&n, Instant::now());
        v
    }

    /// web-0 (old-uid, 192.0.2.10, sandbox sb-old) on node-a was deleted; then a replacement
    /// web-0 (new-uid) is known, with the network-status `replacement` (None: not yet).
    fn replaced(replacement: Option<&str>) -> Index {
        let mut st = Index::default();
        st.upsert_pool(&pool("sb-old"));
        let old = status("192.0.2.10");
        let on_a = |annotations| PodSeen {
            annotations,
            node: Some("node-a"),
            terminal: false,
        };
        let now = Instant::now();
        st.upsert_pod(WEB, "old-uid", on_a(Some(&old)), now);
        st.delete_pod(WEB, "old-uid", on_a(Some(&old)), now);
        let new = replacement.map(status);
        let seen = PodSeen {
            annotations: new.as_ref(),
            node: Some("node-b"),
            terminal: false,
        };
        st.upsert_pod(WEB, "new-uid", seen, now);
        st
    }

    fn plan(st: &Index, v: &NodeIndex) -> Vec<(String, String, bool)> {
        let judged = st.judge_podref(WEB, &ReclaimConfig::default());
        let mut releases = releases_of(&judged, None);
        plan_fences(st, v, WEB, &judged, &mut releases);
        releases
            .into_iter()
            .map(|r| {
                let fence = matches!(r.write, EntryWrite::Fence(_));
                (r.judged.entry.key, r.judged.pod.uid, fence)
            })
            .collect()
    }

    #[test]
    fn the_deleted_pods_node_decides_the_fence_even_when_the_replacement_is_known_first() {
        // The replacement has no network-status yet: the cache alone judges the entry kept
        // (the allocation may be racing the annotation), and it used to be left unfenced.
        let st = replaced(None);
        let judged = st.judge_podref(WEB, &ReclaimConfig::default());
        assert!(
            matches!(judged[0].decision, Decision::Keep(_)),
            "{judged:?}"
        );
        assert_eq!(
            plan(&st, &view("Unknown")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
        // On a Ready node nothing is fenced, and a kept entry stays kept.
        assert_eq!(plan(&st, &view("True")), []);
    }

    #[test]
    fn a_replacement_that_lists_the_address_or_reused_the_entry_is_never_fenced() {
        // It lists the address (whereabouts gave it back by podref): it is the replacement's.
        assert_eq!(plan(&replaced(Some("192.0.2.10")), &view("Unknown")), []);
        // The entry's sandbox changed since the deletion was seen (reused by the replacement).
        let mut st = replaced(None);
        st.upsert_pool(&pool("sb-new"));
        assert_eq!(plan(&st, &view("Unknown")), []);
    }

    #[test]
    fn a_replacement_listing_another_address_makes_the_old_one_a_fence() {
        assert_eq!(
            plan(&replaced(Some("192.0.2.20")), &view("Unknown")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
    }

    #[test]
    fn a_deletion_seen_while_its_node_was_down_is_fenced_even_if_the_node_is_back_when_judged() {
        let mut st = replaced(Some("192.0.2.20"));
        let down = view("Unknown");
        st.judge_deleted_nodes(WEB, |node| down.distrust(node));
        // Judged later: the node is Ready again (its settle has not passed).
        assert_eq!(
            plan(&st, &view("True")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
        // Declared dead since: released, not fenced.
        let mut gone = view("Unknown");
        let mut tainted = NodeReadyView::default();
        tainted.metadata.name = Some("node-a".into());
        tainted.out_of_service = true;
        gone.upsert(&tainted, Instant::now());
        assert_eq!(
            plan(&st, &gone),
            [("10".to_string(), "old-uid".to_string(), false)]
        );
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
