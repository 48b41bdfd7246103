//! NADs and the pools they map to, node-slice pools included.

use super::*;
use crate::rules::{KeepReason, Reason};

const SLICE_POOL: &str = "slicenet-node-a-10.0.4.0-22";

fn slice_nad() -> NetworkAttachmentDefinition {
    nad(
        "slicenet",
        r#""range":"10.0.0.0/8","node_slice_size":"/22","network_name":"slicenet""#,
    )
}

/// A node's slice pool with one entry of pod `ns/web` that records no interface.
fn slice_pool() -> IPPool {
    let mut e = entry("sb-1", "ns/web");
    e.ifname = None;
    IPPool::new(
        SLICE_POOL,
        IPPoolSpec {
            range: "10.0.4.0/22".into(),
            allocations: BTreeMap::from([("5".to_string(), e)]),
        },
    )
}

/// `ns/web` lives, listing another address on the slice network.
fn live_web(ix: &mut Index) {
    let status = r#"[{"name":"ns/slicenet","interface":"net1","ips":["10.0.4.9"]}]"#;
    live_annotated(ix, "ns/web", "uid-web", &network_status(status));
}

fn decision(ix: &Index) -> (Decision, String) {
    let judged = ix.judge_all(&ReclaimConfig::default());
    assert_eq!(judged.len(), 1, "{judged:?}");
    (judged[0].decision, judged[0].network.clone())
}

fn networks(ix: &Index, pool: &str) -> Option<Vec<String>> {
    ix.networks().of_pool(pool).map(<[String]>::to_vec)
}

#[test]
fn a_node_slice_pool_maps_to_its_network_whichever_comes_first() {
    for nad_first in [true, false] {
        let mut ix = Index::default();
        live_web(&mut ix);
        if nad_first {
            ix.upsert_nad(&slice_nad());
            ix.upsert_pool(&slice_pool());
        } else {
            ix.upsert_pool(&slice_pool());
            ix.upsert_nad(&slice_nad());
        }
        assert_eq!(networks(&ix, SLICE_POOL), Some(vec!["ns/slicenet".into()]));
        assert_eq!(
            decision(&ix),
            (
                Decision::Candidate(Reason::IPNotOnPod),
                "ns/slicenet".to_string()
            ),
            "nad first: {nad_first}"
        );
    }
}

#[test]
fn a_removed_node_slice_nad_or_pool_forgets_the_mapping() {
    let mut ix = Index::default();
    live_web(&mut ix);
    ix.upsert_nad(&slice_nad());
    ix.upsert_pool(&slice_pool());
    ix.remove_nad("ns/slicenet");
    assert_eq!(networks(&ix, SLICE_POOL), None);
    assert_eq!(
        decision(&ix).0,
        Decision::Keep(KeepReason::NoInformationForNetwork),
        "without the mapping nothing says which network the entry is on"
    );
    ix.upsert_nad(&slice_nad());
    ix.remove_pool(SLICE_POOL);
    assert_eq!(networks(&ix, SLICE_POOL), None);
}

#[test]
fn an_exact_pool_name_wins_over_a_node_slice_match() {
    let mut ix = Index::default();
    ix.upsert_nad(&slice_nad());
    // A plain network whose pool name also reads as "slicenet-<node>-<slice>".
    ix.upsert_nad(&nad(
        "plain",
        r#""range":"10.0.4.0/22","network_name":"slicenet-node-a""#,
    ));
    ix.upsert_pool(&slice_pool());
    assert_eq!(networks(&ix, SLICE_POOL), Some(vec!["ns/plain".into()]));
}

#[test]
fn a_nad_whose_config_cannot_be_used_is_reported_and_maps_nothing() {
    let mut ix = Index::default();
    let mut bad = nad("bad", r#""range":"not-a-cidr""#);
    ix.upsert_nad(&bad);
    assert!(ix.networks().errors().contains_key("ns/bad"));
    assert!(ix.networks().keys().contains(&"ns/bad".to_string()));
    // Fixed: the error goes, the mapping comes.
    bad.spec.config = nad("bad", r#""range":"192.0.2.0/24""#).spec.config;
    ix.upsert_nad(&bad);
    assert!(ix.networks().errors().is_empty());
    assert_eq!(networks(&ix, "192.0.2.0-24"), Some(vec!["ns/bad".into()]));
}

#[test]
fn a_pools_size_comes_from_the_range_config_of_the_network_that_names_it() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool_named(
        "192.0.2.0-24",
        &[("10", "sb", "ns/a"), ("11", "sb", "ns/b:fenced")],
    ));
    let usage = |ix: &Index| ix.pool_usage()[0].clone();
    // No NAD known: the range alone (network and broadcast never handed out).
    assert_eq!(usage(&ix).size, 254);
    ix.upsert_nad(&nad(
        "net",
        r#""range":"192.0.2.0/24","range_start":"192.0.2.10","range_end":"192.0.2.29","exclude":["192.0.2.16/30"]"#,
    ));
    let u = usage(&ix);
    assert_eq!((u.size, u.allocated, u.fenced, u.free()), (16, 2, 1, 14));
    assert_eq!(u.networks, ["ns/net"]);
    ix.remove_nad("ns/net");
    assert_eq!(usage(&ix).size, 254, "the NAD's narrowing goes with it");
}

#[test]
fn a_node_slice_pools_size_leaves_out_its_networks_exclusions() {
    let mut ix = Index::default();
    ix.upsert_nad(&nad(
        "slicenet",
        r#""range":"10.0.0.0/8","node_slice_size":"/22","network_name":"slicenet","exclude":["10.0.4.0/24"]"#,
    ));
    ix.upsert_pool(&slice_pool());
    let u = &ix.pool_usage()[0];
    // 1022 usable in the /22, less the 255 of 10.0.4.0/24 that are not the network address.
    assert_eq!(u.size, 1022 - 255);
}
