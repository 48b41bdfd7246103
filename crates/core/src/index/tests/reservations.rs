//! Reservations and their lookup by name.

use super::*;
use crate::api::ObjectId;

/// An index holding a reservation `name` for each (name, podref) of `reservations`.
fn with_reservations(reservations: &[(&str, &str)]) -> Index {
    let mut ix = Index::default();
    for (name, podref) in reservations {
        ix.upsert_reservation(&reservation(name, podref));
    }
    ix
}

#[test]
fn reservations_are_found_by_name_bare_or_with_any_network_name_seen() {
    let mut ix = with_reservations(&[
        ("10.0.0.5", "ns/a"),
        ("blue-10.0.0.5", "ns/a"),
        ("red-10.0.0.5", "ns/b"),
        ("green-10.0.0.6", "ns/a"),
        ("blue-fd00--5", "ns/a"),
    ]);
    let names = |ix: &Index, podref: &str, ip: &str| {
        let mut v: Vec<String> = ix
            .reservations()
            .of(podref, ip.parse().unwrap())
            .into_iter()
            .map(|ObjectId { name, uid }| {
                assert_eq!(uid, format!("uid-{name}"));
                name
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        names(&ix, "ns/a", "10.0.0.5"),
        ["10.0.0.5", "blue-10.0.0.5"]
    );
    assert_eq!(names(&ix, "ns/b", "10.0.0.5"), ["red-10.0.0.5"]);
    // "green" is known from another address's reservation.
    assert_eq!(names(&ix, "ns/a", "10.0.0.6"), ["green-10.0.0.6"]);
    assert_eq!(names(&ix, "ns/a", "fd00::5"), ["blue-fd00--5"]);
    // A network name is forgotten with the last reservation that had it.
    ix.remove_reservation("red-10.0.0.5");
    assert_eq!(ix.reservations().prefix_count("red"), 0);
    assert_eq!(ix.reservations().prefix_count("blue"), 2);
    ix.remove_reservation("blue-10.0.0.5");
    ix.remove_reservation("blue-fd00--5");
    assert_eq!(ix.reservations().prefix_count("blue"), 0);
    assert_eq!(names(&ix, "ns/a", "10.0.0.6"), ["green-10.0.0.6"]);
}

#[test]
fn a_reservation_is_an_orphan_only_without_a_live_pod_an_allocation_or_a_fence() {
    let mut ix = with_reservations(&[
        ("192.0.2.1", "ns/live"),
        ("192.0.2.2", "ns/allocated"),
        ("192.0.2.3", "ns/fenced"),
        ("192.0.2.4", "ns/gone"),
    ]);
    live(&mut ix, "ns/live", "uid", "192.0.2.1");
    ix.upsert_pool(&pool(&[("2", "sb-2", "ns/allocated")]));
    ix.upsert_fence_object(POOL, "3", object("p-3", "sb-3", "ns/fenced"));
    assert_eq!(orphan_podrefs(&ix), ["ns/gone"]);
}

#[test]
fn a_release_forgets_its_entry_and_names_that_pods_reservations_for_that_address() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("5", "sb", "ns/a")]));
    ix.upsert_reservation(&reservation("192.0.2.5", "ns/a"));
    ix.upsert_reservation(&reservation("net-192.0.2.5", "ns/other"));
    let ip = "192.0.2.5".parse().unwrap();
    let deletes = ix.released(POOL, "5", "ns/a", ip);
    assert_eq!(
        deletes,
        [ObjectId {
            name: "192.0.2.5".to_string(),
            uid: "uid-192.0.2.5".to_string()
        }]
    );
    assert!(!ix.pools().has_allocations("ns/a"));
    assert_eq!(ix.entry(POOL, "5"), None);
}

#[test]
fn an_entry_marked_fenced_keeps_its_pods_reservation_even_without_a_readable_record() {
    // The record was deleted by hand (or no longer parses): the entry is still fenced.
    let mut ix = with_reservations(&[("192.0.2.3", "ns/fenced"), ("192.0.2.4", "ns/gone")]);
    ix.upsert_pool(&pool(&[("3", "sb-3", "ns/fenced:fenced")]));
    assert_eq!(orphan_podrefs(&ix), ["ns/gone"]);
}

/// The podrefs of the orphaned reservations.
fn orphan_podrefs(ix: &Index) -> Vec<String> {
    ix.orphan_reservations()
        .into_iter()
        .map(|r| r.podref)
        .collect()
}

/// The pools an orphan's look reads: those of the network its name reads as, whose range holds
/// the address; never a pool of another network over the same range.
#[test]
fn an_orphans_look_reads_the_pools_of_its_network_that_hold_its_address() {
    let mut ix = Index::default();
    for name in ["192.0.2.0-24", "net-a-192.0.2.0-24", "net-b-192.0.2.0-24"] {
        ix.upsert_pool(&pool_named(name, &[]));
    }
    let mut other = pool_named("10.0.0.0-24", &[]);
    other.spec.range = "10.0.0.0/24".into();
    ix.upsert_pool(&other);
    ix.upsert_nad(&nad(
        "slicenet",
        r#""range":"192.0.0.0/16","node_slice_size":"/24","network_name":"net-a""#,
    ));
    ix.upsert_pool(&pool_named("net-a-node-1-192.0.2.0-24", &[]));
    let ip: std::net::IpAddr = "192.0.2.10".parse().unwrap();
    assert_eq!(ix.pools_of_reservation(None, ip), ["192.0.2.0-24"]);
    assert_eq!(
        ix.pools_of_reservation(Some("net-a"), ip),
        ["net-a-192.0.2.0-24", "net-a-node-1-192.0.2.0-24"]
    );
    assert_eq!(
        ix.pools_of_reservation(Some("net-b"), ip),
        ["net-b-192.0.2.0-24"]
    );
    assert!(ix.pools_of_reservation(Some("net-c"), ip).is_empty());
    assert!(
        ix.pools_of_reservation(None, "198.51.100.1".parse().unwrap())
            .is_empty()
    );
}
