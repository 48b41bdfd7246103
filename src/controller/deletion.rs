//! The deletion path: podrefs with tombstones come off the work queue, their allocations are
//! judged, and releases go to the pool writer. A worker does not wait for the write: the item
//! is finished (Events, retry or done) when its outcomes come back, while the worker hands in
//! the next, so a burst reaches the writer whole and leaves as a few patches. Failures retry
//! with per-item backoff; after the last retry a Warning Event names the cause and the sweep
//! still owns the leak.

use std::time::Instant;

use kube::api::Api;
use tokio::sync::watch;

use super::fence::record_for;
use super::state::PodRef;
use crate::api::slim::PodView;
use crate::reclaim::{Decision, Reason, ReclaimConfig};
use crate::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};

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
    async fn finish(&self, podref: &str, processed: Result<Processed, String>) {
        let (queue, key) = (&self.ctx.queue, podref.to_owned());
        match processed {
            Ok(Processed::Submitted) => return,
            Ok(Processed::Done) => queue.forget(&key),
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
            let found = Api::<PodView>::namespaced(self.ctx.client.clone(), ns)
                .get_opt(name)
                .await
                .map_err(|e| format!("confirming pod {podref} is gone: {e}"))?;
            if let Some(p) = found {
                let mut st = self.ctx.state.write().expect("state lock");
                if let Some(uid) = &p.metadata.uid {
                    st.upsert_pod(podref, uid, super::watch::seen(&p), started);
                }
            }
        }
        let mut releases = {
            let st = self.ctx.state.read().expect("state lock");
            let judged = st.judge_podref(podref, &self.reclaim);
            tracing::debug!(
                %podref,
                judged = ?judged.iter().map(|j| (j.entry.ip, j.decision)).collect::<Vec<_>>(),
                "deletion path"
            );
            let deleted_at = st.first_deletion(podref);
            judged
                .into_iter()
                .filter_map(|j| match j.decision {
                    Decision::Release(reason) => Some(ReleaseRequest {
                        judged: j,
                        reason,
                        deleted_at,
                        write: Default::default(),
                    }),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        self.fence(podref, &mut releases);
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

    /// Turns the releases of pods deleted from a node that is not Ready into fences.
    fn fence(&self, podref: &str, releases: &mut [ReleaseRequest]) {
        let Some(view) = &self.ctx.nodes else {
            return;
        };
        let st = self.ctx.state.read().expect("state lock");
        let view = view.read().expect("node view lock");
        for r in releases {
            if r.reason != Reason::PodDeleted || r.judged.pod.uid.is_empty() {
                continue;
            }
            let node = st.deleted_pod_node(podref, &r.judged.pod.uid);
            if let Some(why) = view.distrust(node.as_deref()) {
                let node = node.as_deref().unwrap_or_default().to_owned();
                r.write = EntryWrite::Fence(record_for(&r.judged, node, why));
            }
        }
    }
}
