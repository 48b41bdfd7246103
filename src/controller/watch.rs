//! The watches that feed [`State`]: pods (deletions, gap deletions, recreated pods, their
//! nodes and phases), pools, reservations and NADs.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use futures::{Stream, StreamExt};
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource};
use podlife::queue::WorkQueue;
use tokio::sync::watch;

use super::state::{FenceObject, InvalidKey, PodSeen, State};
use crate::api::lenient::Lenient;
use crate::api::slim::PodView;
use crate::api::{IPFence, IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};
use crate::ipam::fence::fence_record;
use crate::telemetry::ControllerMetrics;
use crate::watch_retry::retrying;

fn podref_of(meta: &kube::api::ObjectMeta) -> Option<(String, String)> {
    Some((
        format!("{}/{}", meta.namespace.as_deref()?, meta.name.as_deref()?),
        meta.uid.clone()?,
    ))
}

/// Marks a watch synced (first InitDone) for readiness.
pub type Synced = watch::Sender<bool>;

pub(crate) async fn drive<K, S, F>(name: &'static str, stream: S, synced: Synced, mut apply: F)
where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
    F: FnMut(Event<K>),
{
    futures::pin_mut!(stream);
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                let done = matches!(event, Event::InitDone);
                apply(event);
                if done {
                    synced.send_replace(true);
                }
            }
            // The watcher retries with backoff; the error is worth a line, not a crash.
            Err(e) => tracing::warn!(watch = name, error = %e, "watch error"),
        }
    }
}

/// Pods per page of a list of whole pods (the watch's and `scan`'s): a page is read as one
/// piece of text before it is stripped (a Deployment's pod is about 6 KB: 100 of them are
/// 0.6 MB, 500 would be 3 MB).
pub(crate) const POD_PAGE: u32 = 100;
/// Pools per page: a pool of 5,000 entries is about 1.5 MB of text with its managedFields.
const POOL_PAGE: u32 = 4;

/// What a pod's observation tells the state.
pub fn seen(p: &PodView) -> PodSeen<'_> {
    PodSeen {
        annotations: p.metadata.annotations.as_ref(),
        node: p.node.as_deref(),
        terminal: p.is_terminal(),
    }
}

/// Watches pods and turns deletions (events, gaps, recreations) into tombstones, queued while
/// this replica leads. A standby keeps only the tombstones (what a takeover needs: they are
/// queued when it comes to lead, see `controller::run`), bounded by the allocations they
/// still have and ten minutes of deletions.
pub async fn pods(
    client: Client,
    state: Arc<RwLock<State>>,
    queue: Arc<WorkQueue<String>>,
    metrics: ControllerMetrics,
    leader: watch::Receiver<bool>,
    nodes: Option<Arc<RwLock<super::fence::NodeView>>>,
    synced: Synced,
) {
    let api = Api::<PodView>::all(client.clone());
    let config = watcher::Config::default().page_size(POD_PAGE);
    let stream = retrying(client, watcher::watcher(api, config));
    let mut relists = PodRelist::default();
    drive("pods", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        let outcome = relists.apply(&mut st, event, Instant::now());
        // The node of each deletion is judged as it is seen: the fence follows from it.
        if let Some(view) = &nodes {
            let view = view.read().expect("node view lock");
            for podref in &outcome.enqueue {
                st.judge_deleted_nodes(podref, |node| view.distrust(node));
            }
        }
        drop(st);
        for _ in 0..outcome.gap_deletions {
            metrics.watch_gap_deletions.inc();
        }
        if *leader.borrow() {
            for podref in outcome.enqueue {
                queue.add(podref);
            }
        }
    })
    .await;
}

/// What one pod watch event changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PodEventOutcome {
    /// Podrefs with new tombstones, for the work queue.
    pub enqueue: Vec<String>,
    /// Of those, pods found gone by a re-list.
    pub gap_deletions: usize,
}

/// Re-list bookkeeping: the watcher reports no Delete for pods that vanished during a gap, so
/// the pods known at `Init` that are not listed again by `InitDone` are the gap's deletions.
#[derive(Debug, Default)]
pub struct PodRelist {
    before: Option<HashSet<(String, String)>>,
    relisted: HashSet<(String, String)>,
}

impl PodRelist {
    /// Applies one watcher event to the state.
    pub fn apply(
        &mut self,
        st: &mut State,
        event: Event<PodView>,
        now: Instant,
    ) -> PodEventOutcome {
        let mut out = PodEventOutcome::default();
        match event {
            Event::Init => {
                self.before = Some(st.live_pods());
                self.relisted = HashSet::new();
            }
            Event::InitApply(p) | Event::Apply(p) => {
                let Some((podref, uid)) = podref_of(&p.metadata) else {
                    return out;
                };
                self.relisted.insert((podref.clone(), uid.clone()));
                // A different uid under the same name: the old pod's deletion was missed.
                if st.upsert_pod(&podref, &uid, seen(&p), now).is_some() {
                    out.enqueue.push(podref);
                }
            }
            Event::Delete(p) => {
                let Some((podref, uid)) = podref_of(&p.metadata) else {
                    return out;
                };
                st.delete_pod(&podref, &uid, seen(&p), now);
                out.enqueue.push(podref);
            }
            Event::InitDone => {
                for (podref, uid) in self.before.take().unwrap_or_default() {
                    if !self.relisted.contains(&(podref.clone(), uid.clone()))
                        && st.vanish_pod(&podref, &uid, now).is_some()
                    {
                        tracing::info!(%podref, %uid, "pod vanished during a watch gap");
                        out.gap_deletions += 1;
                        out.enqueue.push(podref);
                    }
                }
                // Dropped, not cleared: a cleared set keeps its table (megabytes at scale).
                self.relisted = HashSet::new();
            }
        }
        out
    }
}

/// Records an object that does not fit its type (or clears it once it does) and says so once.
fn invalid<K: Resource<DynamicType = ()>>(st: &mut State, object: &Lenient<K>) {
    let meta = object.meta();
    let key = InvalidKey {
        kind: K::kind(&()).into_owned(),
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
    };
    match object {
        Lenient::Valid(_) => st.clear_invalid(&key),
        Lenient::Invalid { error, .. } => {
            let uid = meta.uid.clone().unwrap_or_default();
            // Reported (log line, Event) by the reporter.
            st.set_invalid(key, uid, error.clone());
        }
    }
}

fn name_of<K: Resource>(object: &K) -> String {
    object.meta().name.clone().unwrap_or_default()
}

fn nad_key<K: Resource>(object: &K) -> String {
    let m = object.meta();
    format!(
        "{}/{}",
        m.namespace.as_deref().unwrap_or_default(),
        m.name.as_deref().unwrap_or_default()
    )
}

/// Watches the pools in the whereabouts namespace. A pool that cannot be read is skipped and
/// reported; it never stops the watch.
pub async fn pools(client: Client, namespace: String, state: Arc<RwLock<State>>, synced: Synced) {
    let api = Api::<Lenient<IPPool>>::namespaced(client.clone(), &namespace);
    let config = watcher::Config::default().page_size(POOL_PAGE);
    let stream = retrying(client, watcher::watcher(api, config));
    let mut relisted: HashSet<String> = HashSet::new();
    drive("ippools", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(p) | Event::Apply(p) => {
                relisted.insert(name_of(&p));
                invalid(&mut st, &p);
                match &p {
                    Lenient::Valid(pool) => st.upsert_pool(pool),
                    Lenient::Invalid { .. } => st.remove_pool(&name_of(&p)),
                }
            }
            Event::Delete(p) => {
                st.clear_invalid_named(IPPool::kind(&()).as_ref(), &namespace, &name_of(&p));
                st.remove_pool(&name_of(&p))
            }
            Event::InitDone => {
                st.set_pools_listed();
                let gone: Vec<String> = st
                    .pools()
                    .keys()
                    .filter(|k| !relisted.contains(*k))
                    .cloned()
                    .collect();
                for name in gone {
                    st.remove_pool(&name);
                }
                let kind = IPPool::kind(&());
                st.retain_invalid(kind.as_ref(), |_, name| relisted.contains(name));
            }
        }
    })
    .await;
}

/// Watches reservations in the whereabouts namespace.
pub async fn reservations(
    client: Client,
    namespace: String,
    state: Arc<RwLock<State>>,
    synced: Synced,
) {
    let api = Api::<Lenient<OverlappingRangeIPReservation>>::namespaced(client.clone(), &namespace);
    let stream = retrying(client, watcher::watcher(api, watcher::Config::default()));
    let mut relisted: HashSet<String> = HashSet::new();
    drive("reservations", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(r) | Event::Apply(r) => {
                relisted.insert(name_of(&r));
                invalid(&mut st, &r);
                match &r {
                    Lenient::Valid(r) => st.upsert_reservation(r),
                    Lenient::Invalid { .. } => st.remove_reservation(&name_of(&r)),
                }
            }
            Event::Delete(r) => {
                let kind = OverlappingRangeIPReservation::kind(&());
                st.clear_invalid_named(kind.as_ref(), &namespace, &name_of(&r));
                st.remove_reservation(&name_of(&r))
            }
            Event::InitDone => {
                let kind = OverlappingRangeIPReservation::kind(&());
                st.retain_invalid(kind.as_ref(), |_, name| relisted.contains(name));
                st.retain_reservations(|name| relisted.contains(name));
            }
        }
    })
    .await;
}

/// Watches the fence records (`IPFence`) in the whereabouts namespace. A record that cannot be
/// read is skipped and reported; its entry stays fenced (marked) and is left alone.
pub async fn fences(client: Client, namespace: String, state: Arc<RwLock<State>>, synced: Synced) {
    let api = Api::<Lenient<IPFence>>::namespaced(client.clone(), &namespace);
    let stream = retrying(client, watcher::watcher(api, watcher::Config::default()));
    let mut relisted: HashSet<String> = HashSet::new();
    let kind = IPFence::kind(&()).into_owned();
    let stream = stream.inspect(|item| {
        if let Err(watcher::Error::InitialListFailed(kube::Error::Api(s))) = item
            && s.code == 404
        {
            tracing::error!("the IPFence CRD (ipfences.ipreclaim.io) is not installed: kubectl apply -f crds/ipfences.ipreclaim.io.yaml (the chart installs it unless --skip-crds)");
        }
    });
    drive("ipfences", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(f) | Event::Apply(f) => {
                let name = name_of(&f);
                relisted.insert(name.clone());
                let parsed = match &f {
                    Lenient::Valid(fence) => fence_record(&fence.spec).map(|record| {
                        let object = FenceObject {
                            name: name.clone(),
                            uid: fence.metadata.uid.clone().unwrap_or_default(),
                            sandbox: fence.spec.sandbox.clone(),
                            record,
                            evidence: fence.status.as_ref().and_then(|s| s.sandboxes_gone.clone()),
                        };
                        (fence.spec.pool.clone(), fence.spec.key.clone(), object)
                    }),
                    Lenient::Invalid { error, .. } => Err(error.clone()),
                };
                let key = InvalidKey {
                    kind: kind.clone(),
                    namespace: namespace.clone(),
                    name: name.clone(),
                };
                match parsed {
                    Ok((pool, entry, object)) => {
                        st.clear_invalid(&key);
                        st.upsert_fence_object(&pool, &entry, object);
                    }
                    Err(error) => {
                        let uid = f.meta().uid.clone().unwrap_or_default();
                        st.set_invalid(key, uid, error);
                        st.remove_fence_object(&name);
                    }
                }
            }
            Event::Delete(f) => {
                st.clear_invalid_named(&kind, &namespace, &name_of(&f));
                st.remove_fence_object(&name_of(&f));
            }
            Event::InitDone => {
                st.retain_invalid(&kind, |_, name| relisted.contains(name));
                st.retain_fence_objects(|name| relisted.contains(name));
            }
        }
    })
    .await;
}

/// Watches NADs in all namespaces.
pub async fn nads(client: Client, state: Arc<RwLock<State>>, synced: Synced) {
    let api = Api::<Lenient<NetworkAttachmentDefinition>>::all(client.clone());
    let stream = retrying(client, watcher::watcher(api, watcher::Config::default()));
    let mut relisted: HashSet<String> = HashSet::new();
    drive("network-attachment-definitions", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(n) | Event::Apply(n) => {
                let key = nad_key(&n);
                relisted.insert(key.clone());
                invalid(&mut st, &n);
                match &n {
                    Lenient::Valid(nad) => st.upsert_nad(nad),
                    Lenient::Invalid { .. } => st.remove_nad(&key),
                }
            }
            Event::Delete(n) => {
                let (kind, key) = (NetworkAttachmentDefinition::kind(&()), nad_key(&n));
                let (ns, name) = key.split_once('/').unwrap_or(("", &key));
                st.clear_invalid_named(kind.as_ref(), ns, name);
                st.remove_nad(&key);
            }
            Event::InitDone => {
                let kind = NetworkAttachmentDefinition::kind(&());
                st.retain_invalid(kind.as_ref(), |ns, name| {
                    relisted.contains(&format!("{ns}/{name}"))
                });
                let gone: Vec<String> = st
                    .nad_keys()
                    .into_iter()
                    .filter(|k| !relisted.contains(k))
                    .collect();
                for key in gone {
                    st.remove_nad(&key);
                }
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reclaim::{Decision, Reason, ReclaimConfig};
    use std::collections::BTreeMap;

    fn pod(name: &str, uid: &str, ip: Option<&str>) -> PodView {
        let mut p = PodView {
            node: Some("node-a".into()),
            ..Default::default()
        };
        p.metadata.namespace = Some("ns".into());
        p.metadata.name = Some(name.into());
        p.metadata.uid = Some(uid.into());
        p.metadata.annotations = ip.map(|ip| {
            BTreeMap::from([(
                crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(),
                format!(r#"[{{"name":"ns/net","interface":"net1","ips":["{ip}"]}}]"#),
            )])
        });
        p
    }

    fn pool(allocs: &[(&str, &str, &str)]) -> IPPool {
        let spec = crate::api::IPPoolSpec {
            range: "192.0.2.0/24".into(),
            allocations: allocs
                .iter()
                .map(|(k, id, pod)| {
                    (
                        k.to_string(),
                        crate::api::IPAllocation {
                            id: id.to_string(),
                            podref: format!("ns/{pod}"),
                            ifname: Some("net1".into()),
                            ipamclaimref: None,
                        },
                    )
                })
                .collect(),
        };
        IPPool::new("192.0.2.0-24", spec)
    }

    #[test]
    fn pods_gone_across_a_relist_become_tombstones() {
        let mut st = State::default();
        st.upsert_pool(&pool(&[
            ("10", "sb-a", "a"),
            ("11", "sb-b", "b"),
            ("12", "sb-c", "c"),
        ]));
        let mut r = PodRelist::default();
        let now = Instant::now();
        for e in [
            Event::Init,
            Event::InitApply(pod("a", "uid-a", Some("192.0.2.10"))),
            Event::InitApply(pod("b", "uid-b", Some("192.0.2.11"))),
            Event::InitApply(pod("c", "uid-c", Some("192.0.2.12"))),
        ] {
            assert_eq!(r.apply(&mut st, e, now), PodEventOutcome::default());
        }
        assert_eq!(
            r.apply(&mut st, Event::InitDone, now),
            PodEventOutcome::default()
        );

        // A gap: the watcher re-lists. "a" is gone (no Delete event), "c" was recreated.
        r.apply(&mut st, Event::Init, now);
        r.apply(
            &mut st,
            Event::InitApply(pod("b", "uid-b", Some("192.0.2.11"))),
            now,
        );
        let recreated = r.apply(
            &mut st,
            Event::InitApply(pod("c", "uid-c2", Some("192.0.2.13"))),
            now,
        );
        assert_eq!(
            recreated.enqueue,
            ["ns/c"],
            "a new uid under the same name is a missed deletion"
        );
        let done = r.apply(&mut st, Event::InitDone, now);
        assert_eq!(
            done,
            PodEventOutcome {
                enqueue: vec!["ns/a".into()],
                gap_deletions: 1
            }
        );

        let cfg = ReclaimConfig::default();
        let decision = |podref: &str| st.judge_podref(podref, &cfg)[0].decision;
        assert_eq!(decision("ns/a"), Decision::Release(Reason::PodDeleted));
        assert_eq!(
            decision("ns/c"),
            Decision::Release(Reason::PodDeleted),
            "the old pod's IP"
        );
        assert_eq!(
            decision("ns/b"),
            Decision::Keep(crate::reclaim::KeepReason::ListedOnPod)
        );
    }

    #[test]
    fn a_deleted_pods_node_and_a_finished_pods_phase_come_from_the_pod_watch() {
        let mut st = State::default();
        st.upsert_pool(&pool(&[("10", "sb-a", "a"), ("11", "sb-b", "b")]));
        let mut r = PodRelist::default();
        let now = Instant::now();
        for e in [
            Event::Init,
            Event::InitApply(pod("a", "uid-a", Some("192.0.2.10"))),
            Event::InitApply(pod("b", "uid-b", Some("192.0.2.11"))),
            Event::InitDone,
        ] {
            r.apply(&mut st, e, now);
        }
        assert_eq!(st.live("ns/a").unwrap().node.as_deref(), Some("node-a"));
        let cfg = ReclaimConfig::default();
        let decision = |st: &State, podref: &str| st.judge_podref(podref, &cfg)[0].decision;

        // "b" finishes: its address becomes a terminal pod's leak (released after the grace).
        let mut done = pod("b", "uid-b", Some("192.0.2.11"));
        done.phase = Some("Succeeded".into());
        r.apply(&mut st, Event::Apply(done), now);
        assert_eq!(
            decision(&st, "ns/b"),
            Decision::Candidate(Reason::PodTerminal)
        );

        // "a"'s final state names no node (a stripped object): the node it was seen on counts.
        let mut gone = pod("a", "uid-a", Some("192.0.2.10"));
        gone.node = None;
        r.apply(&mut st, Event::Delete(gone), now);
        assert_eq!(
            st.deleted_pod_node("ns/a", "uid-a").as_deref(),
            Some("node-a")
        );
        assert_eq!(st.deleted_pod_node("ns/a", "other"), None);

        // "b" vanishes in a gap: its tombstone keeps its node too.
        r.apply(&mut st, Event::Init, now);
        r.apply(&mut st, Event::InitDone, now);
        assert_eq!(
            st.deleted_pod_node("ns/b", "uid-b").as_deref(),
            Some("node-a")
        );
    }
}
