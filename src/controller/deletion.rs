//! The deletion path: podrefs with tombstones come off the work queue, their allocations are
//! judged, and releases go to the pool writer. A worker does not wait for the write: the item
//! is finished (Events, retry or done) when its outcomes come back, while the worker hands in
//! the next, so a burst reaches the writer whole and leaves as a few patches. Failures retry
//! with per-item backoff; after the last retry a Warning Event names the cause and the sweep
//! still owns the leak.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tokio::sync::watch;

use super::fence::{Placement, record_for};
use super::state::PodRef;
use crate::reclaim::{Decision, Reason, ReclaimConfig};
use crate::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};

/// How soon a deletion asks again whether its pod ran on a node that is not Ready.
const PLACEMENT_RETRY: Duration = Duration::from_millis(250);
/// After this long without an answer it asks less often, and says so once.
const PLACEMENT_SLOW: Duration = Duration::from_secs(30);

/// What became of a queue item.
enum Processed {
    /// Released, fenced or nothing to do.
    Done,
    /// Asked again after this long (its node's pods are not listed yet).
    Later(Duration),
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
    async fn finish(&self, podref: &str, processed: Result<Processed, String>) {
        let (queue, key) = (&self.ctx.queue, podref.to_owned());
        match processed {
            Ok(Processed::Submitted) => return,
            Ok(Processed::Done) => queue.forget(&key),
            Ok(Processed::Later(after)) => queue.add_after(key.clone(), after),
            Err(cause) if queue.num_requeues(&key) < self.max_retries => {
                tracing::warn!(%podref, %cause, "release failed; retrying with backoff");
                self.ctx.metrics.retries.inc();
                queue.add_rate_limited(key.clone());
            }
            Err(cause) => {
                tracing::error!(%podref, %cause, "release failed for good; the sweep keeps the leak");
                let pod = self.pod_of(podref);
                self.ctx.events.failed(&pod, &cause).await;
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

    fn pod_of(&self, podref: &str) -> PodRef {
        let (namespace, name) = podref.split_once('/').unwrap_or(("", podref));
        let st = self.ctx.state.read().expect("state lock");
        PodRef {
            namespace: namespace.into(),
            name: name.into(),
            uid: st.live(podref).map(|l| l.uid.clone()).unwrap_or_default(),
        }
    }

    async fn process(&self, podref: &str) -> Result<Processed, String> {
        let started = Instant::now();
        let blind = {
            let st = self.ctx.state.read().expect("state lock");
            st.live(podref).is_none() && st.blind_tombstone(podref)
        };
        if blind {
            // Without network-status the tombstone would free every allocation of the name:
            // make sure no pod of that name exists now (our cache may lag a recreation).
            let (ns, name) = podref.split_once('/').unwrap_or(("", podref));
            let found = Api::<Pod>::namespaced(self.ctx.client.clone(), ns)
                .get_metadata_opt(name)
                .await
                .map_err(|e| format!("confirming pod {podref} is gone: {e}"))?;
            if let Some(p) = found {
                let mut st = self.ctx.state.write().expect("state lock");
                if let Some(uid) = &p.metadata.uid {
                    st.upsert_pod(podref, uid, p.metadata.annotations.as_ref(), started);
                }
            }
        }
        let (releases, deleted_at) = {
            let st = self.ctx.state.read().expect("state lock");
            let judged = st.judge_podref(podref, &self.reclaim);
            tracing::debug!(
                %podref,
                judged = ?judged.iter().map(|j| (j.entry.ip, j.decision)).collect::<Vec<_>>(),
                "deletion path"
            );
            let releases: Vec<ReleaseRequest> = judged
                .into_iter()
                .filter_map(|j| match j.decision {
                    Decision::Release(reason) => Some(ReleaseRequest {
                        judged: j,
                        reason,
                        deleted_at: None,
                        write: Default::default(),
                    }),
                    _ => None,
                })
                .collect();
            (releases, st.first_deletion(podref))
        };
        let mut releases: Vec<ReleaseRequest> = releases
            .into_iter()
            .map(|r| ReleaseRequest { deleted_at, ..r })
            .collect();
        if self.fence(&mut releases) == Placement::Pending {
            // Never release what may still be in use on a node that is down: wait for that
            // node's pods to be listed (the list is retried like every watch).
            let waited = deleted_at.map_or(Duration::ZERO, |at| at.elapsed());
            if waited < PLACEMENT_SLOW {
                return Ok(Processed::Later(PLACEMENT_RETRY));
            }
            if waited < PLACEMENT_SLOW + PLACEMENT_RETRY * 8 {
                tracing::warn!(%podref, waited = ?waited, "cannot list the pods of a node that is not Ready; holding this pod's addresses until it can");
            }
            return Ok(Processed::Later(PLACEMENT_RETRY * 8));
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
            let processed = me.settle(&podref, started, &outcomes);
            me.finish(&podref, processed).await;
        });
        Ok(Processed::Submitted)
    }

    /// What the outcomes of an item's releases make of it.
    fn settle(
        &self,
        podref: &str,
        started: Instant,
        outcomes: &[Result<ReleaseOutcome, ReleaseError>],
    ) -> Result<Processed, String> {
        let errors: Vec<String> = outcomes
            .iter()
            .filter_map(|o| o.as_ref().err().map(|e| e.to_string()))
            .collect();
        if !errors.is_empty() {
            return Err(errors.join("; "));
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

    /// Turns the releases of pods deleted from a node that is not Ready into fences. Returns
    /// `Pending` when one pod's node cannot be told yet, else `Trusted`.
    fn fence(&self, releases: &mut [ReleaseRequest]) -> Placement {
        let Some(view) = &self.ctx.nodes else {
            return Placement::Trusted;
        };
        let view = view.read().expect("node view lock");
        let mut pending = false;
        for r in releases {
            if r.reason != Reason::PodDeleted || r.judged.pod.uid.is_empty() {
                continue;
            }
            match view.placement(&r.judged.pod.uid) {
                Placement::Unready { node, why } => {
                    r.write = EntryWrite::Fence(record_for(&r.judged, node, why));
                }
                Placement::Pending => pending = true,
                Placement::Trusted => {}
            }
        }
        if pending {
            Placement::Pending
        } else {
            Placement::Trusted
        }
    }
}
