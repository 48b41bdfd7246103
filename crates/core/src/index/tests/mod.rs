//! The index's tests, one file per kind, on one set of fixtures. Synchronous: the index is
//! pure, so each test feeds it steps and reads what it decides.

mod cooling;
mod duplicates;
mod fences;
mod networks;
mod nodes;
mod other_writers;
mod out_of_step;
mod pods;
mod relist;
mod reservations;

use super::relist::{Kind, Relist, Step};
use super::{FenceObject, Index, PodSeen};
use crate::api::slim::{NodeReadyView, PodView};
use crate::api::{
    IPPool, IPPoolSpec, NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec,
    OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec,
};
use crate::fixtures::{entry, pool_named};
use crate::ipam::fence::FenceRecord;
use crate::rules::{Decision, ReclaimConfig};
use std::collections::BTreeMap;
use std::time::Instant;

/// The pool most tests use.
const POOL: &str = "p";

/// A NAD `ns/<name>` of the whereabouts plugin with the given IPAM fields.
fn nad(name: &str, ipam: &str) -> NetworkAttachmentDefinition {
    let mut nad = NetworkAttachmentDefinition::new(
        name,
        NetworkAttachmentDefinitionSpec {
            config: Some(format!(
                r#"{{"name":"{name}","type":"macvlan","ipam":{{"type":"whereabouts",{ipam}}}}}"#
            )),
        },
    );
    nad.metadata.namespace = Some("ns".into());
    nad
}

/// Pool [`POOL`] with entries (key, sandbox, podref).
fn pool(allocations: &[(&str, &str, &str)]) -> IPPool {
    pool_named(POOL, allocations)
}

/// The network-status annotation `raw` (JSON, or anything a test gives).
fn network_status(raw: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(
        crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(),
        raw.to_string(),
    )])
}

/// The network-status annotation listing `ip` on `ns/net`.
fn status(ip: &str) -> BTreeMap<String, String> {
    network_status(&format!(
        r#"[{{"name":"ns/net","interface":"net1","ips":["{ip}"]}}]"#
    ))
}

/// Pod `ns/<name>` on node-a, listing `ip` when given.
fn pod(name: &str, uid: &str, ip: Option<&str>) -> PodView {
    let mut p = PodView {
        node: Some("node-a".into()),
        ..Default::default()
    };
    p.metadata.namespace = Some("ns".into());
    p.metadata.name = Some(name.into());
    p.metadata.uid = Some(uid.into());
    p.metadata.annotations = ip.map(status);
    p
}

/// A live pod listing `ip`, recorded directly.
fn live(ix: &mut Index, podref: &str, uid: &str, ip: &str) {
    live_annotated(ix, podref, uid, &status(ip));
}

/// A live pod with `annotations`, recorded directly.
fn live_annotated(ix: &mut Index, podref: &str, uid: &str, annotations: &BTreeMap<String, String>) {
    let seen = PodSeen {
        annotations: Some(annotations),
        ..Default::default()
    };
    ix.upsert_pod(podref, uid, seen, Instant::now());
}

/// Reservation `name` of `podref`, uid `uid-<name>`.
fn reservation(name: &str, podref: &str) -> OverlappingRangeIPReservation {
    let mut r = OverlappingRangeIPReservation::new(
        name,
        OverlappingRangeIPReservationSpec {
            containerid: None,
            podref: podref.into(),
            ifname: None,
            ipamclaimref: None,
        },
    );
    r.metadata.uid = Some(format!("uid-{name}"));
    r
}

/// A fence record of `podref`.
fn record(podref: &str) -> FenceRecord {
    crate::fixtures::fence_record(podref)
}

/// An `IPFence` object `name` for sandbox `sandbox` of `podref`.
fn object(name: &str, sandbox: &str, podref: &str) -> FenceObject {
    FenceObject {
        name: name.into(),
        uid: format!("uid-{name}"),
        sandbox: sandbox.into(),
        record: record(podref),
        evidence: Default::default(),
    }
}

/// A Node with its Ready condition (`None`: none yet).
fn node(name: &str, ready: Option<&str>) -> NodeReadyView {
    crate::fixtures::node(name, ready)
}

/// The decisions on `podref`'s allocations.
fn decisions(ix: &Index, podref: &str) -> Vec<Decision> {
    ix.judge_podref(podref, &ReclaimConfig::default())
        .into_iter()
        .map(|j| j.decision)
        .collect()
}

/// A whole re-list of `objects` (begin, each listed, done) through `relist`; every effect.
fn relisted<K: Kind>(
    relist: &mut Relist<K>,
    store: &mut K::Store,
    objects: impl IntoIterator<Item = K::Object>,
) -> Vec<K::Effect> {
    let listed = objects.into_iter().map(Step::Listed);
    let steps = std::iter::once(Step::Begin)
        .chain(listed)
        .chain([Step::Done]);
    feed(relist, store, steps)
}

/// Feeds `steps` to `store` through one driver; returns every effect.
fn feed<K: Kind>(
    relist: &mut Relist<K>,
    store: &mut K::Store,
    steps: impl IntoIterator<Item = Step<K::Object>>,
) -> Vec<K::Effect> {
    let now = Instant::now();
    steps
        .into_iter()
        .flat_map(|s| relist.step(store, s, now).effects)
        .collect()
}
