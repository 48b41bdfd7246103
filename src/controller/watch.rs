//! The watches that feed the [`Index`]: pods (deletions, gap deletions, recreated pods, their
//! nodes and phases), pools, reservations, fence records, NADs and Nodes. Each watch is a thin
//! shell: its events go through the index's one re-list driver ([`Relist`]) under one short
//! lock, and what the driver reports (tombstones, node transitions) is logged and queued here.

use std::fmt::Debug;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use futures::{Stream, StreamExt};
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource};
use podlife::queue::WorkQueue;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::api::lenient::Lenient;
use crate::api::slim::{NodeReadyView, PodView};
use crate::api::{IPFence, IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};
use crate::index::kinds::{Fences, Nads, Nodes, Pods, Pools, Reservations};
use crate::index::nodes::Transition;
use crate::index::relist::{Kind, Relist, Step};
use crate::index::{Index, NodeIndex, SharedIndex};
use crate::paged::{POD_PAGE, POOL_PAGE, RESERVATION_PAGE};
use crate::telemetry::ControllerMetrics;
use crate::telemetry::logging::TIMELINE;
use crate::watch_retry::retrying;

/// Marks a watch synced (first InitDone) for readiness.
pub type Synced = watch::Sender<bool>;

/// Nodes per page of the Node list: a Node's status (its images, above all) is tens of KB of
/// text, read whole before it is stripped.
const NODE_PAGE: u32 = 50;

/// A watcher event as the index's driver sees it.
fn step<K>(event: Event<K>) -> Step<K> {
    match event {
        Event::Init => Step::Begin,
        Event::InitApply(o) => Step::Listed(o),
        Event::Apply(o) => Step::Changed(o),
        Event::Delete(o) => Step::Deleted(o),
        Event::InitDone => Step::Done,
    }
}

/// Feeds a watch's steps to `apply`, and marks it synced at its first complete list. Each
/// complete list is logged with its wall time and the part of it spent in `apply` (the rest
/// is the apiserver, the transfer and the parse, which the watcher does before it yields).
async fn feed<K, S, F>(name: &'static str, stream: S, synced: Synced, mut apply: F)
where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
    F: FnMut(Step<K>),
{
    futures::pin_mut!(stream);
    let mut listing: Option<ListTiming> = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                let (begin, done) = (
                    matches!(event, Event::Init),
                    matches!(event, Event::InitDone),
                );
                let step = step(event);
                let applying = Instant::now();
                apply(step);
                if begin {
                    listing = Some(ListTiming::new(applying));
                } else if let Some(t) = &mut listing {
                    t.applied(applying.elapsed());
                }
                if done {
                    if let Some(t) = listing.take() {
                        t.log(name);
                    }
                    synced.send_replace(true);
                }
            }
            // `retrying` logs errors itself (once per interval, with a hint for a missing CRD)
            // and passes none on; a stream that did would be logged here.
            Err(e) => tracing::warn!(watch = name, error = %e, "watch error"),
        }
    }
}

/// Where a complete list's time went: all of it, and the part spent applying its objects.
struct ListTiming {
    began: Instant,
    objects: u64,
    applying: std::time::Duration,
}

impl ListTiming {
    fn new(began: Instant) -> ListTiming {
        ListTiming {
            began,
            objects: 0,
            applying: std::time::Duration::ZERO,
        }
    }

    fn applied(&mut self, took: std::time::Duration) {
        self.objects += 1;
        self.applying += took;
    }

    fn log(&self, name: &str) {
        let seconds = self.began.elapsed().as_secs_f64();
        // The InitDone step counts as applied but is not an object.
        let objects = self.objects.saturating_sub(1);
        let applying = self.applying.as_secs_f64();
        tracing::info!(watch = name, objects, seconds, applying, "listed");
    }
}

/// Watches pods and turns deletions (events, gaps, recreations) into tombstones, queued while
/// this replica leads. A standby keeps only the tombstones (what a takeover needs: they are
/// queued when it comes to lead, see `controller::run`), bounded by the allocations they
/// still have and ten minutes of deletions.
pub async fn pods(
    client: Client,
    index: SharedIndex,
    queue: Arc<WorkQueue<String>>,
    metrics: ControllerMetrics,
    leader: watch::Receiver<bool>,
    nodes: Option<Arc<RwLock<NodeIndex>>>,
    synced: Synced,
) {
    let api = Api::<PodView>::all(crate::protobuf_lists::pod_list_client(client.clone()));
    let config = watcher::Config::default().page_size(POD_PAGE);
    relisted::<Pods, _>("pods", client, api, config, synced, |relist, step| {
        let mut ix = index.write().expect("index lock");
        let applied = relist.step(&mut ix, step, Instant::now());
        // The node of each deletion is judged as it is seen: the fence follows from it (before
        // the Nodes are listed, a pod bound to a node is fenced: its node then is unknown).
        if let Some(view) = &nodes {
            let view = view.read().expect("node index lock");
            for b in &applied.effects {
                ix.judge_deleted_nodes(&b.podref, |t| view.distrust_deleted(t));
            }
        }
        drop(ix);
        for gone in &applied.vanished {
            tracing::info!(podref = %gone.podref, uid = %gone.uid, "pod vanished during a watch gap");
            metrics.watch_gap_deletions.inc();
        }
        if *leader.borrow() {
            for b in applied.effects {
                tracing::trace!(target: TIMELINE, podref = %b.podref, "deletion seen");
                queue.add(b.podref);
            }
        }
    })
    .await;
}

/// Feeds a watch of kind `K` to `apply`, step by step, with its one re-list driver.
async fn relisted<K, F>(
    name: &'static str,
    client: Client,
    api: Api<K::Object>,
    config: watcher::Config,
    synced: Synced,
    mut apply: F,
) where
    K: Kind,
    K::Object: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    F: FnMut(&mut Relist<K>, Step<K::Object>),
{
    let stream = retrying(client, watcher::watcher(api, config));
    let mut relist = Relist::<K>::default();
    feed(name, stream, synced, |step| apply(&mut relist, step)).await;
}

/// Feeds a watch of kind `K` into the index.
async fn into_index<K>(
    name: &'static str,
    client: Client,
    api: Api<K::Object>,
    config: watcher::Config,
    index: SharedIndex,
    synced: Synced,
) where
    K: Kind<Store = Index>,
    K::Object: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    relisted::<K, _>(name, client, api, config, synced, |relist, step| {
        let mut ix = index.write().expect("index lock");
        relist.step(&mut ix, step, Instant::now());
    })
    .await;
}

/// Watches the pools in the whereabouts namespace. A pool that cannot be read is skipped and
/// reported; it never stops the watch.
pub async fn pools(client: Client, namespace: String, index: SharedIndex, synced: Synced) {
    let api = Api::<Lenient<IPPool>>::namespaced(client.clone(), &namespace);
    let config = watcher::Config::default().page_size(POOL_PAGE);
    into_index::<Pools>("ippools", client, api, config, index, synced).await;
}

/// Watches reservations in the whereabouts namespace.
pub async fn reservations(client: Client, namespace: String, index: SharedIndex, synced: Synced) {
    let api = Api::<Lenient<OverlappingRangeIPReservation>>::namespaced(client.clone(), &namespace);
    let config = watcher::Config::default().page_size(RESERVATION_PAGE);
    into_index::<Reservations>("reservations", client, api, config, index, synced).await;
}

/// Each watch request of the fence records ends after this many seconds (kube's default is
/// 290): a watch whose connection died without a word is made again at most 5 s later, so the
/// node agents' reports (a "gone" lifts at once) are not missed for minutes. A handful of
/// replicas make it: the cost is nothing.
const FENCE_WATCH_SECS: u32 = 60;

/// Watches the fence records (`IPFence`) in the whereabouts namespace.
pub async fn fences(client: Client, namespace: String, index: SharedIndex, synced: Synced) {
    let api = Api::<Lenient<IPFence>>::namespaced(client.clone(), &namespace);
    let config = watcher::Config::default().timeout(FENCE_WATCH_SECS);
    into_index::<Fences>("ipfences", client, api, config, index, synced).await;
}

/// Watches NADs in all namespaces.
pub async fn nads(client: Client, index: SharedIndex, synced: Synced) {
    let api = Api::<Lenient<NetworkAttachmentDefinition>>::all(client.clone());
    let config = watcher::Config::default();
    let name = "network-attachment-definitions";
    into_index::<Nads>(name, client, api, config, index, synced).await;
}

/// Watches Nodes' readiness.
pub async fn nodes(client: Client, view: Arc<RwLock<NodeIndex>>, synced: Synced) {
    let api = Api::<NodeReadyView>::all(client.clone());
    let config = watcher::Config::default().page_size(NODE_PAGE);
    relisted::<Nodes, _>("nodes", client, api, config, synced, |relist, step| {
        let mut v = view.write().expect("node index lock");
        let applied = relist.step(&mut v, step, Instant::now());
        drop(v);
        for t in applied.effects {
            match t {
                Transition::NotReady { node, status } => tracing::info!(%node, ready = %status, "node is not Ready: its pods' addresses are fenced when they are deleted"),
                Transition::ReadyAgain { node } => tracing::info!(%node, "node is Ready again"),
            }
        }
    })
    .await;
}
