//! Nodes' readiness through the re-list driver.

use std::time::Duration;

use super::*;
use crate::index::NodeIndex;
use crate::index::kinds::Nodes;
use crate::index::nodes::Transition;
use crate::rules::fence::{FenceClock, FencePolicy, Lift, Moment, distrust, lift};

#[test]
fn a_pod_of_a_node_that_is_not_ready_is_distrusted_from_the_moment_the_node_is_seen() {
    let mut v = NodeIndex::default();
    let mut r = Relist::<Nodes>::default();
    let transitions = relisted(
        &mut r,
        &mut v,
        [
            node("a", Some("True")),
            node("b", Some("Unknown")),
            node("c", None),
        ],
    );
    assert_eq!(transitions.len(), 2, "b and c are seen not Ready");
    assert_eq!(v.distrust(Some("a")), None);
    assert_eq!(
        v.distrust(Some("b")).as_deref(),
        Some("Ready=Unknown (KubeletStopped)")
    );
    assert_eq!(v.distrust(Some("c")).as_deref(), Some("Ready=missing"));
    assert_eq!(
        v.distrust(Some("gone")),
        None,
        "a deleted Node is declared dead"
    );
    assert_eq!(v.distrust(None), None, "never scheduled");
    assert_eq!(v.unready(), 2);

    let down = feed(&mut r, &mut v, [Step::Changed(node("a", Some("False")))]);
    assert_eq!(
        down,
        [Transition::NotReady {
            node: "a".into(),
            status: "False".into()
        }]
    );
    assert!(v.distrust(Some("a")).is_some());
    feed(&mut r, &mut v, [Step::Deleted(node("b", Some("Unknown")))]);
    assert_eq!(v.distrust(Some("b")), None);

    // A re-list that no longer lists "c" forgets it; "a" is Ready again.
    let back = relisted(&mut r, &mut v, [node("a", Some("True"))]);
    assert_eq!(back, [Transition::ReadyAgain { node: "a".into() }]);
    assert_eq!((v.distrust(Some("c")), v.unready()), (None, 0));
}

#[test]
fn ready_counts_from_our_observation_not_from_the_nodes_lagging_transition_time() {
    let mut v = NodeIndex::default();
    let mut r = Relist::<Nodes>::default();
    let t0 = Instant::now();
    let mut down = node("a", Some("Unknown"));
    down.ready.as_mut().unwrap().last_transition_time = None;
    r.step(&mut v, Step::Changed(down), t0);
    assert_eq!(v.node("a").unwrap().ready_seen, None);
    // The node comes back with a clock an hour behind: its transition reads an hour ago.
    let mut up = node("a", Some("True"));
    let hour_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1);
    up.ready.as_mut().unwrap().last_transition_time = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(hour_ago),
    );
    let t1 = t0 + Duration::from_secs(5);
    r.step(&mut v, Step::Changed(up.clone()), t1);
    assert_eq!(v.node("a").unwrap().ready_seen, Some(t1));
    // Later heartbeats and a re-list keep the first observation.
    r.step(
        &mut v,
        Step::Changed(up.clone()),
        t1 + Duration::from_secs(10),
    );
    for s in [Step::Begin, Step::Listed(up), Step::Done] {
        r.step(&mut v, s, t1 + Duration::from_secs(20));
    }
    assert_eq!(v.node("a").unwrap().ready_seen, Some(t1));
    let policy = FencePolicy {
        settle: Duration::from_secs(30),
        timeout: None,
        grace_margin: Duration::ZERO,
    };
    let fence = FenceClock {
        set: Moment {
            wall: hour_ago,
            mono: t0,
        },
        grace: Duration::ZERO,
    };
    let at = |s| Moment {
        wall: jiff::Timestamp::now(),
        mono: t1 + Duration::from_secs(s),
    };
    assert_eq!(lift(fence, v.node("a"), at(29), &policy), None);
    assert_eq!(
        lift(fence, v.node("a"), at(30), &policy),
        Some(Lift::NodeSettled)
    );
}

#[test]
fn only_a_fresh_read_that_found_the_node_ready_spares_later_reads() {
    let mut v = NodeIndex::default();
    let t0 = std::time::Instant::now();
    let later = t0 + Duration::from_secs(1);
    assert!(!v.read_since("a", t0), "never read");
    v.record_read("a", later, true);
    assert!(
        v.read_since("a", t0),
        "a Ready read after the deletion serves it"
    );
    assert!(
        !v.read_since("a", later + Duration::from_secs(1)),
        "not a deletion seen after it"
    );
    // A read that found it not Ready: a stale watch event may say Ready again, so the next
    // deletion reads again.
    v.record_read("a", later, false);
    assert!(!v.read_since("a", t0));
}

/// A tombstone of a pod bound to `node`, deleted in phase Succeeded or Failed (`terminal`)
/// or in another.
fn deleted(node: Option<&str>, terminal: bool) -> crate::index::Tombstone {
    crate::index::Tombstone {
        uid: "uid".into(),
        networks: None,
        seen_at: std::time::Instant::now(),
        node: node.map(Into::into),
        entries: Vec::new(),
        distrust: None,
        node_judged: false,
        grace_seconds: Some(600),
        mirror: false,
        terminal,
    }
}

#[test]
fn a_deletion_seen_before_the_nodes_are_listed_is_distrusted_whatever_its_node_says_later() {
    let mut v = NodeIndex::default();
    // The Node list is still on its way: a pod bound to a node gets the doubt.
    assert_eq!(
        v.distrust_deleted(&deleted(Some("a"), true)).as_deref(),
        Some(crate::index::nodes::NODES_NOT_LISTED)
    );
    assert_eq!(
        v.distrust_deleted(&deleted(None, false)),
        None,
        "never scheduled"
    );
    // Listed (a is Ready by then): the Node's word from now on.
    let mut r = Relist::<Nodes>::default();
    relisted(
        &mut r,
        &mut v,
        [node("a", Some("True")), node("b", Some("Unknown"))],
    );
    assert_eq!(v.distrust_deleted(&deleted(Some("a"), true)), None);
    assert_eq!(
        v.distrust_deleted(&deleted(Some("b"), true)).as_deref(),
        Some("Ready=Unknown (KubeletStopped)")
    );
    assert_eq!(v.distrust_deleted(&deleted(Some("gone"), false)), None);
}

#[test]
fn a_pod_deleted_from_a_ready_node_before_its_kubelet_stopped_it_is_distrusted() {
    let mut v = NodeIndex::default();
    let mut r = Relist::<Nodes>::default();
    relisted(&mut r, &mut v, [node("a", Some("True"))]);
    // Not Succeeded or Failed when deleted: forced, and its kubelet stops it only now.
    let why = v.distrust_deleted(&deleted(Some("a"), false)).unwrap();
    assert!(
        crate::rules::fence::is_deleted_before_stopped(&why) && why.ends_with("600s"),
        "{why}"
    );
    // Its kubelet had stopped it (the phase it gives before deleting): released as before.
    assert_eq!(v.distrust_deleted(&deleted(Some("a"), true)), None);
    // A mirror pod's deletion stops nothing.
    let mut mirror = deleted(Some("a"), false);
    mirror.mirror = true;
    assert_eq!(v.distrust_deleted(&mirror), None);
    // No kubelet to wait for: a Node that is gone, or never scheduled.
    assert_eq!(v.distrust_deleted(&deleted(Some("gone"), false)), None);
    assert_eq!(v.distrust_deleted(&deleted(None, false)), None);
    // Declared powered off by its operator.
    let mut tainted = node("a", Some("True"));
    tainted.out_of_service = true;
    feed(&mut r, &mut v, [Step::Changed(tainted)]);
    assert_eq!(v.distrust_deleted(&deleted(Some("a"), false)), None);
}

/// `node` Ready with its Ready condition's transition stamped `stamp` (the node's clock).
fn ready_since(name: &str, stamp: &str) -> NodeReadyView {
    let mut n = node(name, Some("True"));
    n.ready.as_mut().unwrap().last_transition_time = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(stamp.parse().unwrap()),
    );
    n
}

#[test]
fn a_not_ready_spell_the_watch_never_delivered_still_starts_the_settle() {
    let mut v = NodeIndex::default();
    let mut r = Relist::<Nodes>::default();
    let t0 = Instant::now();
    let window = Duration::from_secs(30);
    for s in [
        Step::Begin,
        Step::Listed(ready_since("a", "2026-11-30T10:00:00Z")),
        Step::Done,
    ] {
        r.step(&mut v, s, t0);
    }
    assert_eq!(
        v.node("a").unwrap().ready_again,
        None,
        "Ready since first seen"
    );
    // Heartbeats keep the stamp: nothing happened.
    let t1 = t0 + Duration::from_secs(60);
    let same = r.step(
        &mut v,
        Step::Changed(ready_since("a", "2026-11-30T10:00:00Z")),
        t1,
    );
    assert!(same.effects.is_empty());
    assert_eq!(v.node("a").unwrap().ready_seen, Some(t0));
    assert_eq!(distrust(v.node("a"), t1, window), None);

    // The watch was down while the node went NotReady and came back: a re-list sees it Ready
    // with a new transition stamp. It is Ready again from now, as if the NotReady was seen.
    let t2 = t1 + Duration::from_secs(60);
    let mut back = Vec::new();
    for s in [
        Step::Begin,
        Step::Listed(ready_since("a", "2026-11-30T10:01:30Z")),
        Step::Done,
    ] {
        back.extend(r.step(&mut v, s, t2).effects);
    }
    assert_eq!(back, [Transition::ReadyAgain { node: "a".into() }]);
    let a = v.node("a").unwrap();
    assert_eq!((a.ready_again, a.ready_seen), (Some(t2), Some(t2)));
    assert!(
        distrust(v.node("a"), t2 + Duration::from_secs(29), window).is_some(),
        "a deletion seen in the settle is fenced"
    );
    assert_eq!(distrust(v.node("a"), t2 + window, window), None);

    // A later heartbeat with that stamp keeps the moment; a Ready condition without a stamp
    // tells nothing.
    let t3 = t2 + Duration::from_secs(5);
    r.step(
        &mut v,
        Step::Changed(ready_since("a", "2026-11-30T10:01:30Z")),
        t3,
    );
    r.step(&mut v, Step::Changed(node("a", Some("True"))), t3);
    let a = v.node("a").unwrap();
    assert_eq!((a.ready_again, a.ready_seen), (Some(t2), Some(t2)));
}
