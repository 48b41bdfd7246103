//! Reservations left behind for live pods, and live entries missing their reservation.

use super::*;

/// The names of `ix`'s reservations left behind.
fn left_behind(ix: &Index) -> Vec<String> {
    let mut names: Vec<String> = ix
        .left_behind_reservations()
        .into_iter()
        .map(|l| l.reservation.name)
        .collect();
    names.sort();
    names
}

#[test]
fn a_reservation_is_left_behind_only_when_nothing_may_still_use_its_address() {
    let mut ix = Index::default();
    ix.upsert_nad(&nad("net", r#""range":"192.0.2.0/24""#));
    ix.upsert_nad(&nad(
        "other",
        r#""range":"192.0.2.0/24","network_name":"other""#,
    ));
    ix.upsert_pool(&pool_named(
        "192.0.2.0-24",
        &[
            ("11", "sb-web", "ns/web"),
            ("30", "sb-someone", "ns/someone"),
            ("40", "sb-y", "ns/y:fenced"),
        ],
    ));
    ix.upsert_pool(&pool_named("other-192.0.2.0-24", &[]));
    live(&mut ix, "ns/web", "uid-web", "192.0.2.11");
    live_annotated(&mut ix, "ns/pending", "uid-p", &BTreeMap::new());
    live(&mut ix, "ns/lists", "uid-l", "192.0.2.21");
    live(&mut ix, "ns/other-held", "uid-o", "192.0.2.31");
    live(&mut ix, "ns/x", "uid-x", "192.0.2.41");
    for (name, podref) in [
        // web-0's delete failed after a release; it lives on at .11: left behind.
        ("192.0.2.10", "ns/web"),
        // Its live allocation's.
        ("192.0.2.11", "ns/web"),
        // No network-status yet: an allocation may be in flight.
        ("192.0.2.20", "ns/pending"),
        // Listed by the pod (the entry may come).
        ("192.0.2.21", "ns/lists"),
        // Another pod's entry holds the address: kept, whoever's.
        ("192.0.2.30", "ns/other-held"),
        // A fenced entry holds the address.
        ("192.0.2.40", "ns/x"),
        // A name that reads as no address.
        ("not-an-address", "ns/web"),
        // Another network's reservation of an address the pod lists on its own network.
        ("other-192.0.2.11", "ns/web"),
        // A network with no pool known: nothing to read fresh.
        ("blue-192.0.2.10", "ns/web"),
        // No pod of that name: an orphan, not this.
        ("192.0.2.50", "ns/gone"),
    ] {
        ix.upsert_reservation(&reservation(name, podref));
    }
    assert_eq!(left_behind(&ix), ["192.0.2.10"]);
    let l = &ix.left_behind_reservations()[0];
    assert_eq!(
        (l.reservation.podref.as_str(), l.pod_uid.as_str()),
        ("ns/web", "uid-web")
    );
    // Another network's reservation of an address the pod does not list is left behind
    // whatever the pod holds on its own network.
    ix.upsert_reservation(&reservation("other-192.0.2.12", "ns/web"));
    assert_eq!(left_behind(&ix), ["192.0.2.10", "other-192.0.2.12"]);
    // The pod gets the address back: no longer.
    ix.upsert_pool(&pool_named(
        "192.0.2.0-24",
        &[
            ("10", "sb-web-new", "ns/web"),
            ("11", "sb-web", "ns/web"),
            ("30", "sb-someone", "ns/someone"),
            ("40", "sb-y", "ns/y:fenced"),
        ],
    ));
    assert_eq!(left_behind(&ix), ["other-192.0.2.12"]);
}

#[test]
fn a_live_entry_misses_its_reservation_only_where_its_network_reserves_addresses() {
    let mut ix = Index::default();
    ix.upsert_nad(&nad("net", r#""range":"192.0.2.0/24""#));
    ix.upsert_nad(&nad(
        "blue",
        r#""range":"192.0.2.0/24","network_name":"blue""#,
    ));
    ix.upsert_nad(&nad(
        "off",
        r#""range":"192.0.2.0/24","network_name":"off","enable_overlapping_ranges":false"#,
    ));
    ix.upsert_pool(&pool_named(
        "192.0.2.0-24",
        &[
            ("10", "sb-web", "ns/web"),
            ("11", "sb-a", "ns/a"),
            ("12", "sb-p", "ns/pending"),
            ("13", "sb-g", "ns/gone"),
            ("14", "sb-n", "ns/not-listed"),
            ("15", "sb-o", "ns/other"),
        ],
    ));
    ix.upsert_pool(&pool_named("blue-192.0.2.0-24", &[("11", "sb-a", "ns/a")]));
    ix.upsert_pool(&pool_named("off-192.0.2.0-24", &[("11", "sb-a", "ns/a")]));
    // A pool no network names (its NAD deleted): no reservation is expected there.
    ix.upsert_pool(&pool_named("gone-192.0.2.0-24", &[("11", "sb-a", "ns/a")]));
    live(&mut ix, "ns/web", "u1", "192.0.2.10");
    live(&mut ix, "ns/a", "u2", "192.0.2.11");
    live_annotated(&mut ix, "ns/pending", "u3", &BTreeMap::new());
    live(&mut ix, "ns/not-listed", "u4", "192.0.2.99");
    live(&mut ix, "ns/other", "u5", "192.0.2.15");
    ix.upsert_reservation(&reservation("192.0.2.10", "ns/web"));
    // Another pod's reservation under that name: never replaced, not missing.
    ix.upsert_reservation(&reservation("192.0.2.15", "ns/zzz"));
    let missing: Vec<(String, String, String, Option<String>)> = ix
        .missing_reservations()
        .into_iter()
        .map(|m| (m.pool, m.entry.key.to_string(), m.name, m.listed_by))
        .collect();
    // a lists its address (its ADD has returned); pending has no network-status yet.
    let want = [
        ("192.0.2.0-24", "11", "192.0.2.11", Some("u2")),
        ("192.0.2.0-24", "12", "192.0.2.12", None),
        ("blue-192.0.2.0-24", "11", "blue-192.0.2.11", Some("u2")),
    ];
    let want: Vec<(String, String, String, Option<String>)> = want
        .iter()
        .map(|(p, k, n, u)| {
            let u = u.map(str::to_string);
            (p.to_string(), k.to_string(), n.to_string(), u)
        })
        .collect();
    assert_eq!(missing, want);
}

#[test]
fn a_pool_reserves_only_when_every_network_of_it_does_under_one_name() {
    let mut ix = Index::default();
    ix.upsert_nad(&nad("a", r#""range":"192.0.2.0/24""#));
    ix.upsert_pool(&pool_named("192.0.2.0-24", &[]));
    assert_eq!(
        ix.networks().reservation_network("192.0.2.0-24"),
        Some(None)
    );
    // A second network over the same pool without overlapping ranges.
    ix.upsert_nad(&nad(
        "b",
        r#""range":"192.0.2.0/24","enable_overlapping_ranges":false"#,
    ));
    assert_eq!(ix.networks().reservation_network("192.0.2.0-24"), None);
    ix.remove_nad("ns/b");
    assert_eq!(
        ix.networks().reservation_network("192.0.2.0-24"),
        Some(None)
    );
    ix.remove_nad("ns/a");
    assert_eq!(ix.networks().reservation_network("192.0.2.0-24"), None);
}
