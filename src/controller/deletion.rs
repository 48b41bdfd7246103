//! The deletion path: podrefs with tombstones come off the work queue, their allocations are
//! judged, and releases go to the pool writer. Failures retry with per-item backoff; after the
//! last retry a Warning Event names the cause and the sweep still owns the leak.

use std::sync::{Arc, RwLock};
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::Api;
use podlife::queue::WorkQueue;
use tokio::sync::watch;

use super::events::Events;
use super::state::{PodRef, State};
use super::writer::{ReleaseOutcome, ReleaseRequest, WriterHandle};
use crate::reclaim::{Decision, ReclaimConfig};
use crate::telemetry::ControllerMetrics;

/// A deletion-path worker.
pub struct Worker {
    pub(crate) client: Client,
    pub(crate) state: Arc<RwLock<State>>,
    pub(crate) queue: Arc<WorkQueue<String>>,
    pub(crate) writer: WriterHandle,
    pub(crate) events: Events,
    pub(crate) metrics: ControllerMetrics,
    pub(crate) reclaim: ReclaimConfig,
    pub(crate) max_retries: u32,
    pub(crate) leader: watch::Receiver<bool>,
}

impl Worker {
    /// Processes queue items until the queue shuts down.
    pub async fn run(mut self) {
        while let Some(podref) = self.queue.get().await {
            self.metrics.queue_depth.set(self.queue.len() as i64);
            // Writes are the leader's; a standby keeps the item until it leads.
            if self.leader.wait_for(|l| *l).await.is_err() {
                self.queue.done(&podref);
                return;
            }
            match self.process(&podref).await {
                Ok(()) => self.queue.forget(&podref),
                Err(cause) if self.queue.num_requeues(&podref) < self.max_retries => {
                    tracing::warn!(%podref, %cause, "release failed; retrying with backoff");
                    self.metrics.retries.inc();
                    self.queue.add_rate_limited(podref.clone());
                }
                Err(cause) => {
                    tracing::error!(%podref, %cause, "release failed for good; the sweep keeps the leak");
                    let pod = self.pod_of(&podref);
                    self.events.failed(&pod, &cause).await;
                    self.queue.forget(&podref);
                    self.state
                        .write()
                        .expect("state lock")
                        .clear_tombstones(&podref, Instant::now());
                }
            }
            self.queue.done(&podref);
        }
    }

    fn pod_of(&self, podref: &str) -> PodRef {
        let (namespace, name) = podref.split_once('/').unwrap_or(("", podref));
        let st = self.state.read().expect("state lock");
        PodRef {
            namespace: namespace.into(),
            name: name.into(),
            uid: st.live(podref).map(|l| l.uid.clone()).unwrap_or_default(),
        }
    }

    async fn process(&self, podref: &str) -> Result<(), String> {
        let started = Instant::now();
        let blind = {
            let st = self.state.read().expect("state lock");
            st.live(podref).is_none() && st.blind_tombstone(podref)
        };
        if blind {
            // Without network-status the tombstone would free every allocation of the name:
            // make sure no pod of that name exists now (our cache may lag a recreation).
            let (ns, name) = podref.split_once('/').unwrap_or(("", podref));
            let found = Api::<Pod>::namespaced(self.client.clone(), ns)
                .get_metadata_opt(name)
                .await
                .map_err(|e| format!("confirming pod {podref} is gone: {e}"))?;
            if let Some(p) = found {
                let mut st = self.state.write().expect("state lock");
                if let Some(uid) = &p.metadata.uid {
                    st.upsert_pod(podref, uid, p.metadata.annotations.as_ref(), started);
                }
            }
        }
        let (releases, deleted_at) = {
            let st = self.state.read().expect("state lock");
            let releases: Vec<ReleaseRequest> = st
                .judge_podref(podref, &self.reclaim)
                .into_iter()
                .filter_map(|j| match j.decision {
                    Decision::Release(reason) => Some(ReleaseRequest {
                        judged: j,
                        reason,
                        deleted_at: None,
                    }),
                    _ => None,
                })
                .collect();
            (releases, st.first_deletion(podref))
        };
        let releases: Vec<ReleaseRequest> = releases
            .into_iter()
            .map(|r| ReleaseRequest { deleted_at, ..r })
            .collect();
        if !releases.is_empty() {
            let outcomes = self.writer.release(releases.clone()).await;
            self.events
                .released_all(releases.iter().zip(&outcomes))
                .await;
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
        }
        self.state
            .write()
            .expect("state lock")
            .clear_tombstones(podref, started);
        Ok(())
    }
}
