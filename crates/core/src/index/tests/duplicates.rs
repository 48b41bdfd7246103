//! Duplicate addresses: two live pods listing one address on one network.

use std::net::IpAddr;
use std::time::Instant;

use super::*;
use crate::index::{Duplicate, EntryOwner, Shared};
use crate::rules::Decision;

/// An index that knows `ns/net`, a whereabouts NAD.
fn with_whereabouts_net() -> Index {
    let mut ix = Index::default();
    ix.upsert_nad(&nad("net", r#""range":"192.0.2.0/24""#));
    ix
}

/// A live pod `ns/<name>` (uid `uid-<name>`) with network-status `status` (raw JSON).
fn listing(ix: &mut Index, name: &str, status: &str) {
    let (podref, uid) = (format!("ns/{name}"), format!("uid-{name}"));
    live_annotated(ix, &podref, &uid, &network_status(status));
}

/// Network-status listing `ips` on network `network`, after the cluster network's entry.
fn on(network: &str, ips: &[&str]) -> String {
    serde_json::json!([
        {"name": "cbr0", "interface": "eth0", "ips": ["10.244.0.5"], "default": true},
        {"name": network, "interface": "net1", "ips": ips},
    ])
    .to_string()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A duplicate as [`found`] reports it: `address` on `ns/net`, listed by `podrefs`.
fn net_dup(address: &str, podrefs: &[&str]) -> (String, IpAddr, Vec<String>) {
    let podrefs = podrefs.iter().map(|p| p.to_string()).collect();
    ("ns/net".to_string(), ip(address), podrefs)
}

/// (network, address, podrefs) of each duplicate.
fn found(ix: &Index) -> Vec<(String, IpAddr, Vec<String>)> {
    ix.duplicates()
        .found
        .into_iter()
        .map(|d| {
            (
                d.network,
                d.ip,
                d.pods.into_iter().map(|p| p.podref).collect(),
            )
        })
        .collect()
}

#[test]
fn two_pods_listing_one_address_on_one_network_are_a_duplicate_and_nothing_is_released() {
    let mut ix = with_whereabouts_net();
    // b holds the entry; a's was removed by hand, and the allocator gave b the same address.
    ix.upsert_pool(&pool_named("192.0.2.0-24", &[("10", "sb-b", "ns/b")]));
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "c", &on("ns/net", &["192.0.2.11"]));
    let d = ix.duplicates();
    assert_eq!(d.unreadable, 0);
    assert_eq!(
        d.found,
        [Duplicate {
            network: "ns/net".into(),
            ip: ip("192.0.2.10"),
            pods: vec![
                crate::index::DuplicatePod {
                    podref: "ns/a".into(),
                    uid: "uid-a".into()
                },
                crate::index::DuplicatePod {
                    podref: "ns/b".into(),
                    uid: "uid-b".into()
                },
            ],
            pool: Some("192.0.2.0-24".into()),
            entry: Some(holder("ns/b", "sb-b")),
        }]
    );
    assert_eq!(d.per_network().get("ns/net"), Some(&1));
    // Never a release: every allocation is kept, and neither pod has anything to release.
    let config = ReclaimConfig::default();
    for j in ix.judge_all(&config) {
        assert!(matches!(j.decision, Decision::Keep(_)), "{j:?}");
    }
    assert!(ix.judge_leaks(&config).is_empty());
    assert!(decisions(&ix, "ns/a").is_empty());
}

#[test]
fn three_pods_are_one_duplicate_and_a_bare_network_name_is_in_the_pods_namespace() {
    let mut ix = with_whereabouts_net();
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("net", &["192.0.2.10"]));
    listing(&mut ix, "c", &on("ns/net", &["192.0.2.10"]));
    assert_eq!(
        found(&ix),
        [net_dup("192.0.2.10", &["ns/a", "ns/b", "ns/c"])]
    );
    // A whereabouts NAD, no pool yet: the duplicate names none (its Events go on the NAD).
    assert_eq!(ix.duplicates().found[0].pool, None);
}

#[test]
fn only_whereabouts_addresses_count() {
    let mut ix = Index::default();
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10"]));
    assert_eq!(
        found(&ix),
        [],
        "no NAD, no pool: nothing says whereabouts gave it"
    );
    // host-local hands out one range per node: the same address on two nodes may be meant.
    let mut host_local = nad("net", "");
    host_local.spec.config = Some(
        r#"{"name":"net","type":"macvlan","ipam":{"type":"host-local","subnet":"192.0.2.0/24"}}"#
            .into(),
    );
    ix.upsert_nad(&host_local);
    assert_eq!(found(&ix), []);
    ix.upsert_nad(&nad("net", r#""range":"192.0.2.0/24""#));
    assert_eq!(found(&ix).len(), 1);
    ix.remove_nad("ns/net");
    // The NAD was deleted, its pool holds the address for one of the pods.
    ix.upsert_pool(&pool_named("192.0.2.0-24", &[("10", "sb-a", "ns/a")]));
    assert_eq!(found(&ix).len(), 1);
}

#[test]
fn one_address_on_two_networks_or_twice_on_one_pod_is_no_duplicate() {
    let mut ix = Index::default();
    for n in ["net", "other", "twice"] {
        ix.upsert_nad(&nad(n, r#""range":"192.0.2.0/24""#));
    }
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("ns/other", &["192.0.2.10"]));
    listing(&mut ix, "c", &on("other-ns/net", &["192.0.2.10"]));
    // One pod listing an address twice (two interfaces on one network).
    let twice = serde_json::json!([
        {"name": "ns/twice", "interface": "net1", "ips": ["198.18.0.1"]},
        {"name": "ns/twice", "interface": "net2", "ips": ["198.18.0.1"]},
    ]);
    listing(&mut ix, "d", &twice.to_string());
    // The cluster network's addresses are not whereabouts': every pod here lists 10.244.0.5.
    assert_eq!(found(&ix), []);
    // One more on a's network: a and e only.
    listing(&mut ix, "e", &on("ns/net", &["192.0.2.10"]));
    assert_eq!(found(&ix), [net_dup("192.0.2.10", &["ns/a", "ns/e"])]);
}

#[test]
fn a_terminal_or_deleted_pod_is_no_duplicate() {
    let mut ix = with_whereabouts_net();
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10"]));
    assert_eq!(found(&ix).len(), 1);

    // b finishes (Succeeded): its address is a terminal pod's, not a live duplicate.
    let status = on("ns/net", &["192.0.2.10"]);
    let annotations = network_status(&status);
    let done = PodSeen {
        annotations: Some(&annotations),
        terminal: true,
        mirror: false,
        grace_seconds: None,
        ..Default::default()
    };
    ix.upsert_pod("ns/b", "uid-b", done, Instant::now());
    assert_eq!(found(&ix), []);

    // b runs again (a restartable phase never comes back, but a new pod of the name may).
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10"]));
    assert_eq!(found(&ix).len(), 1);
    ix.delete_pod("ns/a", "uid-a", PodSeen::default(), Instant::now());
    assert_eq!(found(&ix), [], "a deleted pod lists nothing");
}

#[test]
fn ipv6_addresses_compare_in_canonical_form() {
    let mut ix = with_whereabouts_net();
    listing(&mut ix, "a", &on("ns/net", &["2001:db8::a"]));
    listing(
        &mut ix,
        "b",
        &on("ns/net", &["2001:0DB8:0000:0:0::000a/64"]),
    );
    listing(&mut ix, "c", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "d", &on("ns/net", &["::ffff:192.0.2.10"]));
    assert_eq!(
        found(&ix),
        [
            net_dup("192.0.2.10", &["ns/c", "ns/d"]),
            net_dup("2001:db8::a", &["ns/a", "ns/b"]),
        ]
    );
}

#[test]
fn a_malformed_status_is_skipped_and_counted_and_a_missing_one_is_no_information() {
    let mut ix = with_whereabouts_net();
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    for (name, bad) in [
        ("b", "{not json"),
        (
            "c",
            r#"[{"name":"ns/net","ips":["192.0.2.10","not-an-ip"]}]"#,
        ),
        ("d", "null"),
    ] {
        listing(&mut ix, name, bad);
    }
    ix.upsert_pod("ns/e", "uid-e", PodSeen::default(), Instant::now());
    let d = ix.duplicates();
    assert_eq!(d.found, []);
    assert_eq!(d.unreadable, 3);
}

#[test]
fn the_pool_named_is_the_networks_and_else_one_whose_entry_names_a_pod() {
    let mut ix = Index::default();
    // Another network's pool over the same range, holding the address for someone else.
    ix.upsert_nad(&nad(
        "other",
        r#""range":"192.0.2.0/24","network_name":"o""#,
    ));
    ix.upsert_pool(&pool_named("o-192.0.2.0-24", &[("10", "sb-x", "ns/x")]));
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10"]));
    assert_eq!(
        found(&ix),
        [],
        "not that pool's, and no NAD says whereabouts"
    );
    // A pool no NAD names (the NAD was deleted) whose entry names b.
    ix.upsert_pool(&pool_named("192.0.2.0-24", &[("10", "sb-b", "ns/b")]));
    let d = &ix.duplicates().found[0];
    assert_eq!(d.pool.as_deref(), Some("192.0.2.0-24"));
    assert_eq!(d.entry, Some(holder("ns/b", "sb-b")));
    // The network's own pool, even without an entry for the address.
    ix.upsert_nad(&nad("net", r#""range":"192.0.2.0/24","network_name":"n""#));
    ix.upsert_pool(&pool_named("n-192.0.2.0-24", &[]));
    let d = &ix.duplicates().found[0];
    assert_eq!(d.pool.as_deref(), Some("n-192.0.2.0-24"));
    assert_eq!(d.entry, None);
    // A fenced or cooling entry holds the address too: it is named as stored.
    let until = "2026-11-25T10:00:00Z".parse().unwrap();
    let marker = crate::ipam::cooldown::cooldown_id(until);
    let cooling = [("10", marker.as_str(), "ns/gone:cooldown")];
    ix.upsert_pool(&pool_named("n-192.0.2.0-24", &cooling));
    let d = &ix.duplicates().found[0];
    assert_eq!(d.entry, Some(holder("ns/gone:cooldown", &marker)));
}

#[test]
fn an_entry_is_found_by_its_key_and_a_key_with_a_leading_zero_still_counts() {
    let mut ix = with_whereabouts_net();
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10", "192.0.2.11"]));
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10", "192.0.2.11"]));
    let entries = [("10", "sb-b", "ns/b"), ("011", "sb-a", "ns/a")];
    ix.upsert_pool(&pool_named("192.0.2.0-24", &entries));
    let d = ix.duplicates().found;
    let holders: Vec<_> = d.iter().map(|d| d.entry.clone()).collect();
    assert_eq!(
        holders,
        [Some(holder("ns/b", "sb-b")), Some(holder("ns/a", "sb-a"))]
    );
}

#[test]
fn listings_copied_out_are_looked_at_after_the_index_moved_on() {
    let mut ix = with_whereabouts_net();
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10"]));
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.10"]));
    let listings = ix.listings();
    // The index changes after the copy (the lock let go): the pass reads what was copied.
    listing(&mut ix, "b", &on("ns/net", &["192.0.2.12"]));
    let shared = listings.shared();
    assert_eq!(shared.addresses.len(), 1);
    // Resolved against the index as it is now: b's uid is still known.
    let d = ix.resolve(&shared.addresses);
    assert_eq!(d[0].pods[1].uid, "uid-b");
    assert!(ix.duplicates().found.is_empty());
}

/// Addresses whose hashes collide are told apart: with every address hashed alike, the look
/// finds what it finds with a real hash, neither a duplicate more (one address on two
/// networks, twice on one pod, two addresses) nor one less.
#[test]
fn addresses_whose_hashes_collide_are_still_told_apart() {
    let mut ix = Index::default();
    for n in ["net", "other", "twice"] {
        ix.upsert_nad(&nad(n, r#""range":"192.0.2.0/24""#));
    }
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.10", "192.0.2.11"]));
    listing(&mut ix, "b", &on("ns/other", &["192.0.2.10"]));
    listing(&mut ix, "c", &on("net", &["192.0.2.11", "192.0.2.12"]));
    listing(&mut ix, "e", &on("ns/net", &["192.0.2.10"]));
    let twice = serde_json::json!([
        {"name": "ns/twice", "interface": "net1", "ips": ["198.18.0.1"]},
        {"name": "ns/twice", "interface": "net2", "ips": ["198.18.0.1"]},
    ]);
    listing(&mut ix, "d", &twice.to_string());
    let listings = ix.listings();
    let by = |shared: Shared| -> Vec<(String, IpAddr, Vec<String>)> {
        let addresses = shared.addresses.into_iter();
        addresses
            .map(|((n, ip), pods)| (n, ip, pods.iter().map(|p| p.to_string()).collect()))
            .collect()
    };
    let colliding = by(listings.shared_by(|_, _| 7));
    assert_eq!(
        colliding,
        [
            net_dup("192.0.2.10", &["ns/a", "ns/e"]),
            net_dup("192.0.2.11", &["ns/a", "ns/c"]),
        ]
    );
    assert_eq!(colliding, by(listings.shared()));
}

/// The cost of a look at 20,000 pods (the controller looks once a second): printed, not
/// asserted (`cargo test --lib duplicates -- --nocapture`).
#[test]
fn a_look_at_20000_pods_is_cheap() {
    let mut ix = with_whereabouts_net();
    for i in 0..20_000u32 {
        let addr = std::net::Ipv4Addr::from(0xC612_0000 + i); // 198.18.0.0/15
        listing(
            &mut ix,
            &format!("p{i}"),
            &on("ns/net", &[&addr.to_string()]),
        );
    }
    listing(&mut ix, "dup", &on("ns/net", &["198.18.0.7"]));
    let started = Instant::now();
    let d = ix.duplicates();
    let took = started.elapsed();
    assert_eq!(d.found.len(), 1);
    eprintln!("duplicates over 20001 live pods: {took:?} (this build's profile)");
}

fn holder(podref: &str, id: &str) -> EntryOwner {
    EntryOwner {
        podref: podref.into(),
        id: id.into(),
    }
}

#[test]
fn the_listing_generation_moves_with_what_pods_list_and_with_pools_but_not_with_other_updates() {
    let mut ix = Index::default();
    let status = on("ns/net", &["192.0.2.10"]);
    listing(&mut ix, "a", &status);
    let g = ix.listing_generation();
    // The same listing again (a readiness flip, a label): nothing a look reads changed.
    listing(&mut ix, "a", &status);
    ix.expire_listings(Instant::now());
    assert_eq!(ix.listing_generation(), g);
    listing(&mut ix, "a", &on("ns/net", &["192.0.2.11"]));
    let g2 = ix.listing_generation();
    assert!(g2 > g, "a changed address is a change");
    listing(&mut ix, "b", &status);
    let g3 = ix.listing_generation();
    assert!(g3 > g2, "a new pod is a change");
    ix.upsert_pool(&pool_named("192.0.2.0-24", &[("10", "sb-b", "ns/b")]));
    let g4 = ix.listing_generation();
    assert!(g4 > g3, "a pool change is a change");
    ix.vanish_pod("ns/b", "uid-b", Instant::now());
    assert!(ix.listing_generation() > g4, "a pod gone is a change");
}
