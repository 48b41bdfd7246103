//! Entries in their release cooldown: neither live allocations nor leaks, due by their marker.

use super::*;
use crate::ipam::PoolEntry;

const MARK: &str = "ipreclaim-cooldown:2026-11-25T10:00:31Z";

fn t(s: &str) -> jiff::Timestamp {
    s.parse().unwrap()
}

/// Pool p: 5 cooling for ns/old-0 until 10:00:31, 6 cooling with an unreadable end, 7 live.
fn cooling_index() -> Index {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[
        ("5", MARK, "ns/old-0:cooldown"),
        ("6", "ipreclaim-cooldown:later", "ns/odd-0:cooldown"),
        ("7", "sb-web", "ns/web-0"),
    ]));
    ix.set_pools_listed();
    ix
}

#[test]
fn a_cooling_entry_is_no_allocation_no_leak_and_counts_as_allocated() {
    let ix = cooling_index();
    // No pod of that name exists, yet nothing of it is judged a leak.
    assert!(decisions(&ix, "ns/old-0").is_empty());
    let leaks = ix.judge_leaks(&ReclaimConfig::default());
    assert_eq!(leaks.len(), 1, "only the live-looking entry 7: {leaks:?}");
    assert_eq!(leaks[0].entry.key, "7");
    assert!(!ix.pools().has_allocations("ns/old-0"));
    assert!(ix.fenced().is_empty(), "not a fence");
    let usage = &ix.pool_usage()[0];
    assert_eq!((usage.allocated, usage.cooling, usage.fenced), (3, 2, 0));
    // The unreadable end is reported, and the entry kept.
    let p = ix.pools().get(POOL).unwrap();
    assert_eq!(p.problems.len(), 1, "{:?}", p.problems);
    assert!(p.problems[0].contains("ipreclaim-cooldown:later"));
    assert!(p.cooling["6"].until.is_err());
}

#[test]
fn cooldowns_are_due_from_their_end_by_the_given_clock_and_never_when_unreadable() {
    let ix = cooling_index();
    assert!(ix.due_cooldowns(t("2026-11-25T10:00:30Z")).is_empty());
    let due = ix.due_cooldowns(t("2026-11-25T10:00:31Z"));
    assert_eq!(due.len(), 1);
    assert_eq!(
        (due[0].0.as_str(), due[0].1.entry.key.as_str()),
        (POOL, "5")
    );
    assert_eq!(due[0].1.pod, "ns/old-0");
    let much_later = ix.due_cooldowns(t("2030-01-01T00:00:00Z"));
    assert_eq!(much_later.len(), 1, "the unreadable one is never due");
}

#[test]
fn a_cooling_pods_reservation_is_no_orphan_until_the_cooldown_ends() {
    let mut ix = cooling_index();
    ix.upsert_reservation(&reservation("192.0.2.5", "ns/old-0"));
    assert!(ix.orphan_reservations().is_empty());
    let ended = ix.cooldown_ended(POOL, "5", "ns/old-0", "192.0.2.5".parse().unwrap());
    assert_eq!(
        ended,
        [crate::api::ObjectId {
            name: "192.0.2.5".to_string(),
            uid: "uid-192.0.2.5".to_string()
        }]
    );
    assert_eq!(ix.pool_usage()[0].cooling, 1);
    assert_eq!(ix.orphan_reservations().len(), 1);
}

#[test]
fn a_release_written_into_cooldown_moves_the_entry_out_of_the_live_ones() {
    let mut ix = cooling_index();
    let live = ix.entry(POOL, "7").unwrap().clone();
    let cooled = PoolEntry {
        id: MARK.into(),
        podref: "ns/web-0:cooldown".into(),
        ..live
    };
    ix.cooled(POOL, "7", cooled);
    assert!(ix.entry(POOL, "7").is_none());
    assert!(!ix.pools().has_allocations("ns/web-0"));
    assert_eq!(ix.pool_usage()[0].cooling, 3);
    assert!(ix.cooling_podrefs().contains("ns/web-0"));
}
