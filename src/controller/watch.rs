//! The watches that feed [`State`]: pod metadata (deletions, gap deletions, recreated pods),
//! terminal pods, pools, reservations and NADs.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use podlife::queue::WorkQueue;
use tokio::sync::watch;

use super::state::State;
use crate::api::{IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};

fn podref_of(meta: &kube::api::ObjectMeta) -> Option<(String, String)> {
    Some((
        format!("{}/{}", meta.namespace.as_deref()?, meta.name.as_deref()?),
        meta.uid.clone()?,
    ))
}

/// Marks a watch synced (first InitDone) for readiness.
pub type Synced = watch::Sender<bool>;

async fn drive<K, S, F>(name: &'static str, stream: S, synced: Synced, mut apply: F)
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

/// Watches pod metadata and turns deletions (events, gaps, recreations) into tombstones on the queue.
pub async fn pods(
    client: Client,
    state: Arc<RwLock<State>>,
    queue: Arc<WorkQueue<String>>,
    synced: Synced,
) {
    let api = Api::<PartialObjectMeta<Pod>>::all(client);
    let stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(|p| {
            p.managed_fields_mut().clear();
        });
    // Pods known when a re-list starts; what is not listed again vanished during the gap.
    let mut before_relist: Option<HashSet<(String, String)>> = None;
    let mut relisted: HashSet<(String, String)> = HashSet::new();
    drive("pods", stream, synced, |event| {
        let now = Instant::now();
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => {
                before_relist = Some(st.live_pods());
                relisted.clear();
            }
            Event::InitApply(p) | Event::Apply(p) => {
                let Some((podref, uid)) = podref_of(&p.metadata) else {
                    return;
                };
                relisted.insert((podref.clone(), uid.clone()));
                if st
                    .upsert_pod(&podref, &uid, p.metadata.annotations.as_ref(), now)
                    .is_some()
                {
                    queue.add(podref);
                }
            }
            Event::Delete(p) => {
                let Some((podref, uid)) = podref_of(&p.metadata) else {
                    return;
                };
                st.delete_pod(&podref, &uid, p.metadata.annotations.as_ref(), now);
                queue.add(podref);
            }
            Event::InitDone => {
                for (podref, uid) in before_relist.take().unwrap_or_default() {
                    if !relisted.contains(&(podref.clone(), uid.clone()))
                        && st.vanish_pod(&podref, &uid, now).is_some()
                    {
                        tracing::info!(%podref, %uid, "pod vanished during a watch gap");
                        queue.add(podref);
                    }
                }
                relisted.clear();
            }
        }
    })
    .await;
}

/// Watches the metadata of pods in one terminal phase (the field selector does the filtering,
/// so no full pod is ever cached).
pub async fn terminal_pods(
    client: Client,
    state: Arc<RwLock<State>>,
    phase: &'static str,
    synced: Synced,
) {
    let api = Api::<PartialObjectMeta<Pod>>::all(client);
    let config = watcher::Config::default().fields(&format!("status.phase={phase}"));
    let stream = watcher::watcher(api, config).default_backoff();
    let mut known: HashSet<String> = HashSet::new();
    let mut relisted: HashSet<String> = HashSet::new();
    drive("terminal-pods", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(p) | Event::Apply(p) => {
                if let Some(uid) = p.metadata.uid {
                    st.set_terminal(&uid, true);
                    relisted.insert(uid.clone());
                    known.insert(uid);
                }
            }
            Event::Delete(p) => {
                if let Some(uid) = p.metadata.uid {
                    st.set_terminal(&uid, false);
                    known.remove(&uid);
                }
            }
            Event::InitDone => {
                for uid in known.difference(&relisted) {
                    st.set_terminal(uid, false);
                }
                known = std::mem::take(&mut relisted);
            }
        }
    })
    .await;
}

/// Watches the pools in the whereabouts namespace.
pub async fn pools(client: Client, namespace: String, state: Arc<RwLock<State>>, synced: Synced) {
    let api = Api::<IPPool>::namespaced(client, &namespace);
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    let mut relisted: HashSet<String> = HashSet::new();
    drive("ippools", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(p) | Event::Apply(p) => {
                relisted.insert(p.metadata.name.clone().unwrap_or_default());
                st.upsert_pool(&p);
            }
            Event::Delete(p) => st.remove_pool(p.metadata.name.as_deref().unwrap_or_default()),
            Event::InitDone => {
                let gone: Vec<String> = st
                    .pools()
                    .keys()
                    .filter(|k| !relisted.contains(*k))
                    .cloned()
                    .collect();
                for name in gone {
                    st.remove_pool(&name);
                }
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
    let api = Api::<OverlappingRangeIPReservation>::namespaced(client, &namespace);
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    drive("reservations", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::InitApply(r) | Event::Apply(r) => st.upsert_reservation(&r),
            Event::Delete(r) => {
                st.remove_reservation(r.metadata.name.as_deref().unwrap_or_default())
            }
            Event::Init | Event::InitDone => {}
        }
    })
    .await;
}

/// Watches NADs in all namespaces.
pub async fn nads(client: Client, state: Arc<RwLock<State>>, synced: Synced) {
    let api = Api::<NetworkAttachmentDefinition>::all(client);
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    drive("network-attachment-definitions", stream, synced, |event| {
        let mut st = state.write().expect("state lock");
        match event {
            Event::InitApply(n) | Event::Apply(n) => {
                st.upsert_nad(&n);
                let key = format!(
                    "{}/{}",
                    n.meta().namespace.as_deref().unwrap_or_default(),
                    n.meta().name.as_deref().unwrap_or_default()
                );
                if let Some(err) = st.nad_errors.get(&key) {
                    tracing::warn!(nad = %key, error = %err, "NetworkAttachmentDefinition config cannot be used");
                }
            }
            Event::Delete(n) => {
                let key = format!(
                    "{}/{}",
                    n.meta().namespace.as_deref().unwrap_or_default(),
                    n.meta().name.as_deref().unwrap_or_default()
                );
                st.remove_nad(&key);
            }
            Event::Init | Event::InitDone => {}
        }
    })
    .await;
}
