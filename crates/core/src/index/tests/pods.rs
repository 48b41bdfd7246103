//! Live pods, tombstones and the pod watch's re-lists.

use std::time::Instant;

use super::*;
use crate::index::TOMBSTONES_PER_PODREF;
use crate::index::kinds::{Buried, Pods};
use crate::rules::{KeepReason, Reason};

fn buried(podref: &str, vanished: bool) -> Buried {
    Buried {
        podref: podref.into(),
        vanished,
    }
}

#[test]
fn pods_gone_across_a_relist_become_tombstones() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[
        ("10", "sb-a", "ns/a"),
        ("11", "sb-b", "ns/b"),
        ("12", "sb-c", "ns/c"),
    ]));
    let mut r = Relist::<Pods>::default();
    let listed = relisted(
        &mut r,
        &mut ix,
        [
            pod("a", "uid-a", Some("192.0.2.10")),
            pod("b", "uid-b", Some("192.0.2.11")),
            pod("c", "uid-c", Some("192.0.2.12")),
        ],
    );
    assert_eq!(listed, []);

    // A gap: the watcher re-lists. "a" is gone (no Delete event), "c" was recreated.
    let recreated = feed(
        &mut r,
        &mut ix,
        [
            Step::Begin,
            Step::Listed(pod("b", "uid-b", Some("192.0.2.11"))),
            Step::Listed(pod("c", "uid-c2", Some("192.0.2.13"))),
        ],
    );
    assert_eq!(
        recreated,
        [buried("ns/c", false)],
        "a new uid under the same name is a missed deletion"
    );
    let done = r.step(&mut ix, Step::Done, Instant::now());
    assert_eq!(done.effects, [buried("ns/a", true)]);
    assert_eq!(done.vanished.len(), 1);
    assert_eq!(done.vanished[0].uid, "uid-a");

    assert_eq!(
        decisions(&ix, "ns/a"),
        [Decision::Release(Reason::PodDeleted)]
    );
    assert_eq!(
        decisions(&ix, "ns/c"),
        [Decision::Release(Reason::PodDeleted)],
        "the old pod's IP"
    );
    assert_eq!(
        decisions(&ix, "ns/b"),
        [Decision::Keep(KeepReason::ListedOnPod)]
    );
    // The release names the deleted pod and its node (the audit line's).
    let judged = ix.judge_podref("ns/a", &ReclaimConfig::default());
    assert_eq!(
        (judged[0].pod.uid.as_str(), judged[0].node.as_deref()),
        ("uid-a", Some("node-a"))
    );
}

#[test]
fn a_deleted_pods_node_and_a_finished_pods_phase_come_from_the_pod_watch() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("10", "sb-a", "ns/a"), ("11", "sb-b", "ns/b")]));
    let mut r = Relist::<Pods>::default();
    relisted(
        &mut r,
        &mut ix,
        [
            pod("a", "uid-a", Some("192.0.2.10")),
            pod("b", "uid-b", Some("192.0.2.11")),
        ],
    );
    assert_eq!(
        ix.pods().live("ns/a").unwrap().node.as_deref(),
        Some("node-a")
    );

    // "b" finishes: its address becomes a terminal pod's leak (released after the grace).
    let mut done = pod("b", "uid-b", Some("192.0.2.11"));
    done.phase = Some("Succeeded".into());
    feed(&mut r, &mut ix, [Step::Changed(done)]);
    assert_eq!(
        decisions(&ix, "ns/b"),
        [Decision::Candidate(Reason::PodTerminal)]
    );

    // "a"'s final state names no node (a stripped object): the node it was seen on counts.
    let mut gone = pod("a", "uid-a", Some("192.0.2.10"));
    gone.node = None;
    let deleted = feed(&mut r, &mut ix, [Step::Deleted(gone)]);
    assert_eq!(deleted, [buried("ns/a", false)]);
    let node = |ix: &Index, podref: &str, uid: &str| ix.pods().deleted_pod_node(podref, uid);
    assert_eq!(node(&ix, "ns/a", "uid-a").as_deref(), Some("node-a"));
    assert_eq!(node(&ix, "ns/a", "other"), None);

    // "b" vanishes in a gap: its tombstone keeps its node too.
    relisted(&mut r, &mut ix, []);
    assert_eq!(node(&ix, "ns/b", "uid-b").as_deref(), Some("node-a"));
}

#[test]
fn a_tombstone_keeps_the_entries_of_its_podref_when_the_deletion_was_seen() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("10", "sb-a", "ns/a")]));
    let t = ix
        .delete_pod("ns/a", "uid-a", PodSeen::default(), Instant::now())
        .expect("a tombstone");
    assert_eq!(t.entries.len(), 1);
    assert_eq!(
        (t.entries[0].key.as_str(), t.entries[0].id.as_str()),
        ("10", "sb-a")
    );
    // The entry goes later: the tombstone still says what was held.
    ix.upsert_pool(&pool(&[]));
    assert_eq!(ix.pods().tombstones("ns/a")[0].entries, t.entries);
}

#[test]
fn a_podref_keeps_only_its_newest_tombstones_while_it_holds_allocations() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("5", "sb", "ns/web-0")]));
    let t0 = Instant::now();
    for i in 0..(TOMBSTONES_PER_PODREF + 4) {
        ix.delete_pod("ns/web-0", &format!("uid-{i}"), PodSeen::default(), t0);
    }
    ix.expire_tombstones(t0 + std::time::Duration::from_secs(1));
    let kept: Vec<&str> = ix
        .pods()
        .tombstones("ns/web-0")
        .iter()
        .map(|t| t.uid.as_str())
        .collect();
    assert_eq!(kept.len(), TOMBSTONES_PER_PODREF);
    assert_eq!(kept[0], "uid-4", "the oldest go");
    // Without allocations, old tombstones go too.
    ix.upsert_pool(&pool(&[]));
    ix.expire_tombstones(t0 + std::time::Duration::from_secs(1));
    assert!(ix.pods().tombstones("ns/web-0").is_empty());
}

#[test]
fn an_address_a_pod_stops_listing_restarts_its_grace() {
    let mut ix = Index::default();
    let ip: std::net::IpAddr = "192.0.2.10".parse().unwrap();
    live(&mut ix, "ns/a", "uid-a", "192.0.2.10");
    assert_eq!(
        ix.pods().last_listed("ns/a", ip),
        None,
        "listed: kept anyway"
    );
    live(&mut ix, "ns/a", "uid-a", "192.0.2.11");
    let at = ix.pods().last_listed("ns/a", ip).expect("dropped now");
    ix.expire_listings(at);
    assert!(ix.pods().last_listed("ns/a", ip).is_some());
    ix.expire_listings(at + std::time::Duration::from_secs(1));
    assert_eq!(ix.pods().last_listed("ns/a", ip), None);
}
