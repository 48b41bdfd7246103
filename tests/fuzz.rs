//! Every parser of untrusted input, fed arbitrary bytes and arbitrary JSON shaped like what it
//! expects: it answers with a value or an error, never a panic, and what it accepts holds
//! together. The normal suite runs a few hundred cases per target; `scripts/fuzz.sh` runs many
//! more (PROPTEST_CASES) and prints the counts.

use ipreclaim::api::lenient::Lenient;
use ipreclaim::api::{IPAllocation, IPPool, IPPoolSpec, NetworkAttachmentDefinition};
use ipreclaim::ipam::pool::parse_pool_range;
use ipreclaim::ipam::{
    ip_at, offset_of, parse_nad_config, parse_network_status, parse_networks, pool_allocations,
};
use proptest::prelude::*;
use serde_json::{Value, json};

/// Cases per target: `PROPTEST_CASES` (what scripts/fuzz.sh sets), else 256.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Arbitrary JSON, a few levels deep, with keys and strings from what the parsers look for.
fn json_value() -> impl Strategy<Value = Value> {
    let word = prop_oneof![
        Just("type".to_string()),
        Just("ipam".to_string()),
        Just("whereabouts".to_string()),
        Just("range".to_string()),
        Just("ipRanges".to_string()),
        Just("range_start".to_string()),
        Just("range_end".to_string()),
        Just("exclude".to_string()),
        Just("plugins".to_string()),
        Just("network_name".to_string()),
        Just("node_slice_size".to_string()),
        Just("name".to_string()),
        Just("interface".to_string()),
        Just("ips".to_string()),
        Just("default".to_string()),
        Just("namespace".to_string()),
        Just("10.0.0.0/8".to_string()),
        Just("fd00::/64".to_string()),
        Just("192.0.2.1-192.0.2.9/24".to_string()),
        Just("/28".to_string()),
        ".{0,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        word.clone().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(word.clone(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        json_value().prop_map(|v| v.to_string()),
        json_value().prop_map(|v| json!({"type": "macvlan", "ipam": v}).to_string()),
        json_value().prop_map(|v| json!({"plugins": [v, {"ipam": v}]}).to_string()),
        json_value().prop_map(|v| json!([v]).to_string()),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn nad_config(s in text()) {
        if let Ok(Some(ipam)) = parse_nad_config(&s) {
            // Every pool it names is a name whereabouts could make.
            for (range, name) in ipam.pool_names(None) {
                prop_assert!(!name.is_empty(), "{range}");
            }
        }
    }

    #[test]
    fn network_status(s in text()) {
        // Accepted or refused, never a panic; what is accepted round-trips its addresses.
        if let Ok(nets) = parse_network_status(&s) {
            for ip in nets.iter().flat_map(|n| n.ips.iter()) {
                prop_assert_eq!(ip.to_string().parse::<std::net::IpAddr>().ok(), Some(*ip));
            }
        }
    }

    #[test]
    fn networks_annotation(s in text(), ns in "[a-z0-9-]{0,8}") {
        if let Ok(names) = parse_networks(&s, &ns) {
            prop_assert!(names.iter().all(|n| n.contains('/')), "{names:?}");
        }
    }

    #[test]
    fn pool_keys_and_ranges(
        range in prop_oneof![text(), Just("192.0.2.0/24".to_string()), Just("fd00::/120".to_string()), Just("0.0.0.0/0".to_string()), Just("::/0".to_string())],
        keys in prop::collection::vec(prop_oneof![".{0,8}", "[0-9]{1,40}", Just("-1".to_string()), Just("+5".to_string())], 0..12),
    ) {
        let spec = IPPoolSpec {
            range: range.clone(),
            allocations: keys
                .iter()
                .map(|k| (k.clone(), IPAllocation { id: "sb".into(), podref: "ns/p".into(), ifname: None, ipamclaimref: None }))
                .collect(),
        };
        if let Ok(parsed) = pool_allocations(&spec) {
            prop_assert_eq!(parsed.entries.len() + parsed.problems.len(), spec.allocations.len());
            for e in &parsed.entries {
                prop_assert!(parsed.range.contains(&e.ip));
                prop_assert_eq!(offset_of(&parsed.range, e.ip), Some(e.offset));
                prop_assert_eq!(ip_at(&parsed.range, e.offset), Some(e.ip));
            }
        } else {
            prop_assert!(parse_pool_range(&range).is_err());
        }
    }

    #[test]
    fn fence_records(spec in json_value(), since in text()) {
        // An IPFence as anyone may write it: read leniently, its record parsed or refused,
        // never a panic.
        let fence = json!({"apiVersion": "ipreclaim.io/v1alpha1", "kind": "IPFence",
            "metadata": {"name": "p-1", "namespace": "ns"}, "spec": spec});
        let read: Lenient<ipreclaim::api::IPFence> = serde_json::from_value(fence).unwrap();
        if let Some(f) = read.valid() {
            let mut spec = f.spec.clone();
            let _ = ipreclaim::ipam::fence::fence_record(&spec);
            spec.since = since;
            let _ = ipreclaim::ipam::fence::fence_record(&spec);
        }
    }

    #[test]
    fn objects_read_one_by_one(object in json_value(), spec in json_value()) {
        // Whatever the apiserver sends for one object, reading it never fails the list.
        let pool = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
            "metadata": {"name": "p", "namespace": "ns"}, "spec": spec});
        let read: Vec<Lenient<IPPool>> = serde_json::from_value(json!([pool, object])).unwrap();
        prop_assert_eq!(read.len(), 2);
        let nad = json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": "n", "namespace": "ns"}, "spec": spec});
        let read: Lenient<NetworkAttachmentDefinition> = serde_json::from_value(nad).unwrap();
        if let Some(n) = read.valid() {
            let _ = n.spec.config.as_deref().map(parse_nad_config);
        }
    }
}
