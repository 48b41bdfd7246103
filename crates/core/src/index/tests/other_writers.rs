//! Marked entries that go from their pool as the watch sees it, and whether ipreclaim signed
//! the write.

use super::*;
use crate::index::{GoneFence, MarkedKind};
use crate::ipam::own_write::OWN_WRITE_ANNOTATION;

const MARK: &str = "ipreclaim-cooldown:2026-11-25T10:00:31Z";

/// Pool p with `allocations`, signed `signature` (as ipreclaim's last write of a marked entry).
fn signed(allocations: &[(&str, &str, &str)], signature: Option<&str>) -> IPPool {
    let mut p = pool(allocations);
    p.metadata.uid = Some("uid-p".into());
    p.metadata.annotations =
        signature.map(|s| BTreeMap::from([(OWN_WRITE_ANNOTATION.to_string(), s.to_string())]));
    p
}

/// Pool p: 5 fenced for ns/web-0 (record p-5 on node n), 6 cooling for ns/old-0, 7 live.
fn marked_index() -> Index {
    let mut ix = Index::default();
    ix.upsert_fence_object("p", "5", object("p-5", "sb", "ns/web-0"));
    ix.upsert_pool(&signed(
        &[
            ("5", "sb", "ns/web-0:fenced"),
            ("6", MARK, "ns/old-0:cooldown"),
            ("7", "sb-7", "ns/db-0"),
        ],
        Some("1/a/0"),
    ));
    ix.set_pools_listed();
    assert!(ix.take_marked_gone().0.is_empty(), "a first sighting");
    ix
}

#[test]
fn marked_entries_removed_by_an_unsigned_write_are_noted_with_their_fence() {
    let mut ix = marked_index();
    // Another writer removes both; whereabouts' CNI adds 8 in the same pool meanwhile.
    ix.upsert_pool(&signed(
        &[("7", "sb-7", "ns/db-0"), ("8", "sb-8", "ns/new-0")],
        Some("1/a/0"),
    ));
    let (gone, dropped) = ix.take_marked_gone();
    assert_eq!(dropped, 0);
    let seen: Vec<_> = gone
        .iter()
        .map(|g| {
            (
                g.entry.key.as_str(),
                g.kind,
                g.ours,
                g.pod(),
                g.now.is_none(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("5", MarkedKind::Fenced, false, "ns/web-0", true),
            ("6", MarkedKind::Cooling, false, "ns/old-0", true),
        ]
    );
    assert_eq!(
        gone[0].fence,
        Some(GoneFence {
            node: "n".into(),
            object: crate::api::ObjectId {
                name: "p-5".into(),
                uid: "uid-p-5".into()
            },
        })
    );
    assert_eq!(gone[1].fence, None);
    assert_eq!(gone[0].pool_uid, "uid-p");
    assert!(ix.take_marked_gone().0.is_empty(), "taken once");
}

#[test]
fn a_write_that_changed_the_signature_is_ipreclaims_own() {
    for first_signature in [None, Some("1/a/0")] {
        let mut ix = Index::default();
        ix.upsert_pool(&signed(
            &[("5", MARK, "ns/old-0:cooldown")],
            first_signature,
        ));
        ix.upsert_pool(&signed(&[], Some("2/b/7")));
        let (gone, _) = ix.take_marked_gone();
        assert_eq!(gone.len(), 1);
        assert!(gone[0].ours, "{first_signature:?}");
    }
}

#[test]
fn a_rewritten_marked_entry_is_noted_with_what_it_holds_now() {
    let mut ix = marked_index();
    ix.upsert_pool(&signed(
        &[
            ("5", "sb", "ns/web-0"),
            ("6", MARK, "ns/old-0:cooldown"),
            ("7", "sb-7", "ns/db-0"),
        ],
        Some("1/a/0"),
    ));
    let (gone, _) = ix.take_marked_gone();
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].entry.key, "5");
    assert_eq!(gone[0].now.as_ref().unwrap().podref, "ns/web-0");
    // The same state again, and another pool's changes, say nothing.
    ix.upsert_pool(&signed(&[("5", "sb", "ns/web-0")], Some("1/a/0")));
    assert!(ix.take_marked_gone().0.iter().all(|g| g.entry.key == "6"));
}

/// The writer keeps the index ahead of the watch: a fence or a cooldown it wrote, then a watch
/// event of an earlier write that still shows the entry as it was, is no change of a marked
/// entry (the comparison is with what the watch last showed).
#[test]
fn the_writers_own_updates_ahead_of_the_watch_are_no_removal() {
    let mut ix = Index::default();
    let before = signed(&[("5", "sb", "ns/web-0"), ("6", "sb-6", "ns/db-0")], None);
    ix.upsert_pool(&before);
    ix.fence_written(
        "p",
        "5",
        "sb",
        &record("ns/web-0"),
        crate::api::ObjectId {
            name: "p-5".into(),
            uid: "uid-p-5".into(),
        },
    );
    let cooled = crate::ipam::PoolEntry {
        id: MARK.into(),
        podref: "ns/db-0:cooldown".into(),
        ..ix.entry("p", "6").unwrap().clone()
    };
    ix.cooled("p", "6", cooled);
    // An event of a write before both (whereabouts added 7).
    ix.upsert_pool(&signed(
        &[
            ("5", "sb", "ns/web-0"),
            ("6", "sb-6", "ns/db-0"),
            ("7", "sb-7", "ns/x-0"),
        ],
        None,
    ));
    assert!(ix.take_marked_gone().0.is_empty());
}

#[test]
fn too_many_waiting_are_dropped_and_counted() {
    let mut ix = Index::default();
    let keys: Vec<String> = (0..10).map(|k| k.to_string()).collect();
    let full: Vec<(&str, &str, &str)> = keys
        .iter()
        .map(|k| (k.as_str(), MARK, "ns/old-0:cooldown"))
        .collect();
    for _ in 0..(crate::index::other_writers::MAX_WAITING / 10 + 1) {
        ix.upsert_pool(&signed(&full, None));
        ix.upsert_pool(&signed(&[], None));
    }
    let (gone, dropped) = ix.take_marked_gone();
    assert_eq!(gone.len(), crate::index::other_writers::MAX_WAITING);
    assert_eq!(dropped, 10);
    assert_eq!(ix.take_marked_gone().1, 0);
}
