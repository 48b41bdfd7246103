//! Fencing: the Nodes' Ready condition, the pods of nodes that are not Ready (a deleted pod's
//! node is not in its metadata, so each such node's pods are watched while it is down), and the
//! loop that lifts fences into releases.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use tokio::sync::watch as tokio_watch;
use tokio::task::JoinHandle;

use super::state::{FencedEntry, Judged, PodRef};
use super::watch::{Synced, drive};
use crate::ipam::fence::FenceRecord;
use crate::reclaim::fence::{FencePolicy, Lift, NodeReadiness, distrust, lift};
use crate::reclaim::{Decision, Reason};
use crate::release::{EntryWrite, ReleaseOutcome, ReleaseRequest};
use crate::watch_retry::retrying;

/// How often fences are checked for lifting.
pub const LIFT_EVERY: Duration = Duration::from_secs(1);

/// Where a deleted pod ran, as far as fencing is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// On a node that is not Ready: fence.
    Unready {
        /// The node.
        node: String,
        /// Its Ready condition.
        why: String,
    },
    /// Not on a node that is not Ready: release.
    Trusted,
    /// A not-Ready node's pods are not listed yet: ask again shortly.
    Pending,
}

#[derive(Debug, Default)]
struct UnreadyPods {
    /// Uids of pods seen on the node since it went down, deleted ones included: the pod
    /// watch's Delete and this watch's may come in either order.
    uids: HashSet<String>,
    synced: bool,
}

/// Nodes' readiness and the pods of those that are not Ready.
#[derive(Debug, Default)]
pub struct NodeView {
    nodes: HashMap<String, NodeReadiness>,
    unready: HashMap<String, UnreadyPods>,
}

impl NodeView {
    /// A node's readiness, if the Node exists.
    pub fn node(&self, name: &str) -> Option<&NodeReadiness> {
        self.nodes.get(name)
    }

    /// Where the pod with `uid` ran.
    pub fn placement(&self, uid: &str) -> Placement {
        for (node, pods) in &self.unready {
            if pods.uids.contains(uid) {
                let why = distrust(self.nodes.get(node)).unwrap_or_else(|| "Ready=missing".into());
                return Placement::Unready {
                    node: node.clone(),
                    why,
                };
            }
        }
        if self.unready.values().any(|p| !p.synced) {
            return Placement::Pending;
        }
        Placement::Trusted
    }
}

/// The Ready condition of a Node (`missing` when it has none yet).
pub fn readiness_of(node: &Node) -> NodeReadiness {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) => NodeReadiness {
            status: c.status.clone(),
            reason: c.reason.clone(),
            since: c.last_transition_time.as_ref().map(|t| t.0),
        },
        None => NodeReadiness {
            status: "missing".into(),
            reason: None,
            since: None,
        },
    }
}

/// Watches Nodes; while one is not Ready, watches the metadata of its pods.
pub async fn nodes(client: Client, view: Arc<RwLock<NodeView>>, synced: Synced) {
    let api = Api::<Node>::all(client.clone());
    let stream = retrying(
        client.clone(),
        watcher::watcher(api, watcher::Config::default()),
    );
    let mut pod_watches: HashMap<String, JoinHandle<()>> = HashMap::new();
    let mut relisted: HashSet<String> = HashSet::new();
    drive("nodes", stream, synced, |event| {
        let mut v = view.write().expect("node view lock");
        let mut gone = Vec::new();
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(n) | Event::Apply(n) => {
                let name = n.name_any();
                relisted.insert(name.clone());
                v.nodes.insert(name, readiness_of(&n));
            }
            Event::Delete(n) => gone.push(n.name_any()),
            Event::InitDone => gone.extend(
                v.nodes
                    .keys()
                    .filter(|k| !relisted.contains(*k))
                    .cloned()
                    .collect::<Vec<_>>(),
            ),
        }
        for name in gone {
            v.nodes.remove(&name);
        }
        // Start watching the pods of nodes that went down; stop for those back or gone.
        let down: Vec<String> = v
            .nodes
            .iter()
            .filter(|(_, r)| !r.is_ready())
            .map(|(n, _)| n.clone())
            .collect();
        for name in &down {
            if !pod_watches.contains_key(name) {
                tracing::info!(node = %name, "node is not Ready; watching its pods for fencing");
                v.unready.insert(name.clone(), UnreadyPods::default());
                pod_watches.insert(
                    name.clone(),
                    tokio::spawn(pods_on(client.clone(), name.clone(), view.clone())),
                );
            }
        }
        pod_watches.retain(|name, task| {
            let keep = down.contains(name);
            if !keep {
                task.abort();
                v.unready.remove(name);
            }
            keep
        });
    })
    .await;
}

async fn pods_on(client: Client, node: String, view: Arc<RwLock<NodeView>>) {
    let api = Api::<PartialObjectMeta<Pod>>::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let stream = retrying(client, watcher::watcher(api, config));
    let (tx, _rx) = tokio_watch::channel(false);
    drive("pods-on-unready-node", stream, tx, |event| {
        let mut v = view.write().expect("node view lock");
        let Some(pods) = v.unready.get_mut(&node) else {
            return;
        };
        match event {
            Event::InitApply(p) | Event::Apply(p) => {
                if let Some(uid) = p.metadata.uid {
                    pods.uids.insert(uid);
                }
            }
            Event::InitDone => pods.synced = true,
            Event::Init | Event::Delete(_) => {}
        }
    })
    .await;
}

/// A fence record for a release the deletion path decided, if the pod's node is not Ready.
pub fn record_for(judged: &Judged, node: String, why: String) -> FenceRecord {
    FenceRecord {
        podref: judged.entry.podref.clone(),
        uid: judged.pod.uid.clone(),
        node,
        why,
        network: judged.network.clone(),
        since: jiff::Timestamp::now(),
    }
}

/// The release of a fenced entry.
fn unfence(pool: &str, f: &FencedEntry) -> ReleaseRequest {
    let r = &f.record;
    let (namespace, name) = r.podref.split_once('/').unwrap_or(("", &r.podref));
    ReleaseRequest {
        judged: Judged {
            pool: pool.to_owned(),
            entry: f.entry.clone(),
            decision: Decision::Release(Reason::PodDeleted),
            network: if r.network.is_empty() {
                pool.to_owned()
            } else {
                r.network.clone()
            },
            pod: PodRef {
                namespace: namespace.into(),
                name: name.into(),
                uid: r.uid.clone(),
            },
        },
        reason: Reason::PodDeleted,
        deleted_at: None,
        write: EntryWrite::Unfence(r.clone()),
    }
}

/// Lifts fences (leader only).
pub struct Lifter {
    pub(crate) ctx: super::Ctx,
    pub(crate) view: Arc<RwLock<NodeView>>,
    /// `None`: fencing is off, and fences an earlier run set are lifted.
    pub(crate) policy: Option<FencePolicy>,
}

impl Lifter {
    /// One pass: updates the fence gauges and, on the leader, releases what lifts and clears
    /// fence annotations whose entry the node's own CNI DEL freed.
    pub async fn pass(&self, leader: bool) {
        let now = jiff::Timestamp::now();
        let (fenced, stale) = {
            let st = self.ctx.state.read().expect("state lock");
            let stale: Vec<(String, Vec<(String, String)>)> = st
                .pools()
                .iter()
                .filter(|(_, p)| !p.stale_fences.is_empty())
                .map(|(n, p)| {
                    let s = p.stale_fences.iter();
                    (n.clone(), s.map(|(k, v)| (k.clone(), v.clone())).collect())
                })
                .collect();
            (st.fenced(), stale)
        };
        let mut lifted = Vec::new();
        let mut oldest = Duration::ZERO;
        let mut held = 0;
        {
            let v = self.view.read().expect("node view lock");
            for (pool, f) in &fenced {
                let node = v.node(&f.record.node);
                let lifts = match &self.policy {
                    Some(policy) => lift(f.record.since, node, now, policy),
                    None => Some(Lift::FencingOff),
                };
                match lifts {
                    Some(_) if !leader => {}
                    Some(why) => {
                        tracing::info!(%pool, ip = %f.entry.ip, podref = %f.record.podref, node = %f.record.node, lifted = why.as_str(), "fence lifts");
                        lifted.push(unfence(pool, f));
                    }
                    None => {
                        held += 1;
                        let age = now.duration_since(f.record.since);
                        oldest = oldest.max(Duration::try_from(age).unwrap_or_default());
                    }
                }
            }
        }
        self.ctx.metrics.fenced_addresses.set(held);
        self.ctx
            .metrics
            .oldest_fence_seconds
            .set(oldest.as_secs() as i64);
        if !leader {
            return;
        }
        if !lifted.is_empty() {
            let outcomes = self.ctx.writer.release(lifted.clone()).await;
            self.ctx
                .events
                .released_all(lifted.iter().zip(&outcomes))
                .await;
            for (r, o) in lifted.iter().zip(&outcomes) {
                match o {
                    Err(e) => {
                        tracing::warn!(ip = %r.judged.entry.ip, error = %e, "releasing a lifted fence failed; next pass retries")
                    }
                    Ok(ReleaseOutcome::AlreadyGone | ReleaseOutcome::Changed) => {
                        tracing::info!(ip = %r.judged.entry.ip, "a lifted fence's entry was already freed")
                    }
                    Ok(_) => {}
                }
            }
        }
        for (pool, annotations) in stale {
            for (key, _) in &annotations {
                tracing::info!(%pool, %key, "fenced entry freed by its node (CNI DEL) or replaced; clearing its fence record");
            }
            self.ctx.writer.clear_fences(&pool, annotations).await;
        }
    }
}
