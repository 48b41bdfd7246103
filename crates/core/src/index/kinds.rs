//! Each watched kind's rules for the re-list driver: how an object is keyed, recorded,
//! forgotten, and which keys the index knows. An object that does not fit its type is recorded
//! as invalid (reported once) and its usable part forgotten; it never stops the watch.

use std::time::Instant;

use kube_core::Resource;

use super::invalid::InvalidKey;
use super::nodes::{NodeIndex, Transition};
use super::pods::PodSeen;
pub use super::pods::PodUid;
use super::relist::Kind;
use super::{FenceObject, Index};
use crate::api::lenient::Lenient;
use crate::api::slim::{NodeReadyView, PodView};
use crate::api::{IPFence, IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};
use crate::ipam::PodKey;
use crate::ipam::fence::fence_record;

/// What a pod's observation tells the index.
pub fn seen(p: &PodView) -> PodSeen<'_> {
    PodSeen {
        annotations: p.metadata.annotations.as_ref(),
        node: p.node.as_deref(),
        terminal: p.is_terminal(),
        mirror: p.is_mirror(),
        grace_seconds: p.grace_seconds,
    }
}

/// A pod deletion the index turned into a tombstone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buried {
    /// Its podref (for the work queue).
    pub podref: String,
    /// Found gone by a re-list (no Delete was seen).
    pub vanished: bool,
}

/// Pods (deletions, gap deletions, recreations, nodes and phases).
pub struct Pods;

impl Kind for Pods {
    type Store = Index;
    type Object = PodView;
    type Key = PodUid;
    type Effect = Buried;

    fn key(p: &PodView) -> Option<PodUid> {
        Some(PodUid {
            podref: PodKey::of_meta(&p.metadata)?.podref(),
            uid: p.metadata.uid.clone()?,
        })
    }

    fn apply(ix: &mut Index, key: &PodUid, p: PodView, now: Instant) -> Option<Buried> {
        // A different uid under the same name: the old pod's deletion was missed.
        ix.upsert_pod(&key.podref, &key.uid, seen(&p), now)?;
        Some(Buried {
            podref: key.podref.clone(),
            vanished: false,
        })
    }

    fn delete(ix: &mut Index, key: &PodUid, p: PodView, now: Instant) -> Option<Buried> {
        ix.delete_pod(&key.podref, &key.uid, seen(&p), now)?;
        Some(Buried {
            podref: key.podref.clone(),
            vanished: false,
        })
    }

    fn vanish(ix: &mut Index, key: &PodUid, now: Instant) -> Option<Buried> {
        ix.vanish_pod(&key.podref, &key.uid, now)?;
        Some(Buried {
            podref: key.podref.clone(),
            vanished: true,
        })
    }

    fn known(ix: &Index) -> Vec<PodUid> {
        ix.pods().live_pods()
    }
}

/// The invalid-object key of `object` of kind `K`.
fn invalid_key<K: Resource<DynamicType = ()>>(meta: &kube_core::ObjectMeta) -> InvalidKey {
    InvalidKey {
        kind: K::kind(&()).into_owned(),
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
    }
}

/// Records whether `object` fits (reported, with an Event, by the reporter); the typed object
/// when it does.
fn fit<K: Resource<DynamicType = ()>>(ix: &mut Index, object: &Lenient<K>) -> bool {
    let meta = object.meta();
    let key = invalid_key::<K>(meta);
    match object {
        Lenient::Valid(_) => {
            ix.clear_invalid(&key);
            true
        }
        Lenient::Invalid { error, .. } => {
            let uid = meta.uid.clone().unwrap_or_default();
            ix.set_invalid(key, uid, error.clone());
            false
        }
    }
}

/// Records whether `object` fits: its usable part with `upsert` when it does, else `key` is
/// forgotten with `remove`.
fn record_fitting<K: Resource<DynamicType = ()>>(
    ix: &mut Index,
    key: &str,
    object: &Lenient<K>,
    upsert: fn(&mut Index, &K),
    remove: fn(&mut Index, &str),
) {
    match (fit(ix, object), object) {
        (true, Lenient::Valid(valid)) => upsert(ix, valid),
        _ => remove(ix, key),
    }
}

fn name_of<K: Resource>(object: &K) -> Option<String> {
    object.meta().name.clone()
}

/// The names of the invalid objects of kind `K` (one namespace is watched).
fn invalid_names<K: Resource<DynamicType = ()>>(ix: &Index) -> Vec<String> {
    let kind = K::kind(&());
    ix.invalid()
        .of_kind(kind.as_ref())
        .map(|k| k.name.clone())
        .collect()
}

/// Forgets the invalid object of kind `K` named `name` (one namespace is watched).
fn clear_invalid_named<K: Resource<DynamicType = ()>>(ix: &mut Index, name: &str) {
    let kind = K::kind(&());
    let keys: Vec<InvalidKey> = ix
        .invalid()
        .of_kind(kind.as_ref())
        .filter(|k| k.name == name)
        .cloned()
        .collect();
    for k in keys {
        ix.clear_invalid(&k);
    }
}

/// A kind of the whereabouts namespace (one namespace is watched), keyed by name and read
/// leniently: what does not fit is recorded as invalid. Its deletion and its vanishing from a
/// re-list are the same: the name is forgotten, usable or not.
pub trait Named {
    /// The resource watched.
    type Resource: Resource<DynamicType = ()>;

    /// Records `object` under `name`: its usable part, or that it does not fit.
    fn record(ix: &mut Index, name: &str, object: Lenient<Self::Resource>);
    /// Forgets the usable part of `name`.
    fn remove(ix: &mut Index, name: &str);
    /// The names whose usable part the index holds.
    fn names(ix: &Index) -> Vec<String>;
    /// The re-list is complete.
    fn listed(_ix: &mut Index) {}
}

impl<N: Named> Kind for N {
    type Store = Index;
    type Object = Lenient<N::Resource>;
    type Key = String;
    type Effect = ();

    fn key(object: &Self::Object) -> Option<String> {
        name_of(object)
    }

    fn apply(ix: &mut Index, name: &String, object: Self::Object, _: Instant) -> Option<()> {
        N::record(ix, name, object);
        None
    }

    fn delete(ix: &mut Index, name: &String, _: Self::Object, now: Instant) -> Option<()> {
        Self::vanish(ix, name, now)
    }

    fn vanish(ix: &mut Index, name: &String, _: Instant) -> Option<()> {
        clear_invalid_named::<N::Resource>(ix, name);
        N::remove(ix, name);
        None
    }

    fn known(ix: &Index) -> Vec<String> {
        let mut keys = N::names(ix);
        keys.extend(invalid_names::<N::Resource>(ix));
        keys
    }

    fn listed(ix: &mut Index) {
        N::listed(ix);
    }
}

/// Pools in the whereabouts namespace.
pub struct Pools;

impl Named for Pools {
    type Resource = IPPool;

    fn record(ix: &mut Index, name: &str, p: Lenient<IPPool>) {
        record_fitting(ix, name, &p, Index::upsert_pool, Self::remove);
    }

    fn remove(ix: &mut Index, name: &str) {
        ix.remove_pool(name);
    }

    fn names(ix: &Index) -> Vec<String> {
        ix.pools().all().keys().cloned().collect()
    }

    fn listed(ix: &mut Index) {
        ix.set_pools_listed();
    }
}

/// Reservations in the whereabouts namespace.
pub struct Reservations;

impl Named for Reservations {
    type Resource = OverlappingRangeIPReservation;

    fn record(ix: &mut Index, name: &str, r: Lenient<OverlappingRangeIPReservation>) {
        record_fitting(ix, name, &r, Index::upsert_reservation, Self::remove);
    }

    fn remove(ix: &mut Index, name: &str) {
        ix.remove_reservation(name);
    }

    fn names(ix: &Index) -> Vec<String> {
        ix.reservations().names()
    }
}

/// Fence records (`IPFence`) in the whereabouts namespace. A record that cannot be read is
/// reported; its entry stays fenced (marked) and is left alone.
pub struct Fences;

impl Named for Fences {
    type Resource = IPFence;

    fn record(ix: &mut Index, name: &str, f: Lenient<IPFence>) {
        let parsed = match &f {
            Lenient::Valid(fence) => fence_record(&fence.spec).map(|mut record| {
                // Its age counts from the later of the writer's clock and the apiserver's (its
                // creation): a replica whose clock lagged wrote an early `since`, which another
                // replica would take for an old fence (and time it out early).
                if let Some(created) = &fence.metadata.creation_timestamp {
                    record.since = record.since.max(created.0);
                }
                let object = FenceObject {
                    name: name.to_owned(),
                    uid: fence.metadata.uid.clone().unwrap_or_default(),
                    sandbox: fence.spec.sandbox.clone(),
                    record,
                    evidence: fence.status.clone().unwrap_or_default(),
                };
                (fence.spec.pool.clone(), fence.spec.key.clone(), object)
            }),
            Lenient::Invalid { error, .. } => Err(error.clone()),
        };
        let key = invalid_key::<IPFence>(f.meta());
        match parsed {
            Ok((pool, entry, object)) => {
                ix.clear_invalid(&key);
                ix.upsert_fence_object(&pool, &entry, object);
            }
            Err(error) => {
                let uid = f.meta().uid.clone().unwrap_or_default();
                ix.set_invalid(key, uid, error);
                ix.remove_fence_object(name);
            }
        }
    }

    fn remove(ix: &mut Index, name: &str) {
        ix.remove_fence_object(name);
    }

    fn names(ix: &Index) -> Vec<String> {
        ix.fence_objects().names()
    }
}

/// NetworkAttachmentDefinitions in all namespaces, keyed `ns/name`.
pub struct Nads;

impl Kind for Nads {
    type Store = Index;
    type Object = Lenient<NetworkAttachmentDefinition>;
    type Key = String;
    type Effect = ();

    fn key(n: &Self::Object) -> Option<String> {
        let m = n.meta();
        Some(format!(
            "{}/{}",
            m.namespace.as_deref()?,
            m.name.as_deref()?
        ))
    }

    fn apply(ix: &mut Index, key: &String, n: Self::Object, _: Instant) -> Option<()> {
        record_fitting(ix, key, &n, Index::upsert_nad, Index::remove_nad);
        None
    }

    fn delete(ix: &mut Index, key: &String, _: Self::Object, now: Instant) -> Option<()> {
        Self::vanish(ix, key, now)
    }

    fn vanish(ix: &mut Index, key: &String, _: Instant) -> Option<()> {
        let (namespace, name) = key.split_once('/').unwrap_or(("", key));
        ix.clear_invalid(&InvalidKey {
            kind: NetworkAttachmentDefinition::kind(&()).into_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        });
        ix.remove_nad(key);
        None
    }

    fn known(ix: &Index) -> Vec<String> {
        let kind = NetworkAttachmentDefinition::kind(&());
        let mut keys = ix.networks().keys();
        keys.extend(
            ix.invalid()
                .of_kind(kind.as_ref())
                .map(|k| format!("{}/{}", k.namespace, k.name)),
        );
        keys
    }
}

/// Nodes' readiness.
pub struct Nodes;

impl Kind for Nodes {
    type Store = NodeIndex;
    type Object = NodeReadyView;
    type Key = String;
    type Effect = Transition;

    fn key(n: &NodeReadyView) -> Option<String> {
        n.metadata.name.clone()
    }

    fn apply(v: &mut NodeIndex, _: &String, n: NodeReadyView, seen: Instant) -> Option<Transition> {
        v.upsert(&n, seen)
    }

    fn delete(
        v: &mut NodeIndex,
        name: &String,
        _: NodeReadyView,
        now: Instant,
    ) -> Option<Transition> {
        Self::vanish(v, name, now)
    }

    fn vanish(v: &mut NodeIndex, name: &String, _: Instant) -> Option<Transition> {
        v.remove(name);
        None
    }

    fn known(v: &NodeIndex) -> Vec<String> {
        v.names()
    }

    fn listed(v: &mut NodeIndex) {
        v.set_listed();
    }
}
