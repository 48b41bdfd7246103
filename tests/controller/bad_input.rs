//! Input that does not fit (malformed NADs, pool entries, network-status; objects without
//! the fields ours require) is reported, never fatal, and the rest goes on.

use std::collections::BTreeMap;

use ipreclaim::api::{IPPool, NetworkAttachmentDefinition};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use kube::api::PostParams;
use testenv::poll::{wait_for, wait_seen};

use crate::harness::{Env, create_raw, one_bad_input_test_at_a_time, warnings};

#[tokio::test]
async fn bad_input_is_reported_not_fatal() {
    let _alone = one_bad_input_test_at_a_time().await;
    let mut env = Env::new("ctl-bad").await;
    // A NAD that is not JSON, a pool with malformed keys, a pod with a malformed annotation.
    env.nad_config("broken", "this is not json").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-a", "odd-0")])
        .await;
    let patch = serde_json::json!({"spec": {"allocations": {
        "not-a-number": {"id": "sb-x", "podref": format!("{}/gone", env.ns)},
        "999": {"id": "sb-y", "podref": format!("{}/gone", env.ns)},
    }}});
    env.merge_pool("192.0.2.0-24", patch).await;
    let mut pod = testenv::fixtures::annotated_pod("odd-0", NETWORK_STATUS_ANNOTATION, "{not json");
    pod = env
        .pods()
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    assert!(pod.metadata.uid.is_some());
    env.start(&[]).await;
    wait_seen(
        "metrics for the bad input",
        || env.metrics_text(),
        |m| {
            m.contains("ipreclaim_nad_config_errors 1")
                && m.contains("ipreclaim_malformed_network_status_pods 1")
                && m.contains("ipreclaim_pool_problem_entries{pool=")
        },
        |m| {
            let wanted = [
                "nad_config_errors",
                "malformed_network_status",
                "pool_problem",
            ];
            let lines = m.lines().filter(|l| !l.starts_with('#'));
            let seen: Vec<&str> = lines
                .filter(|l| wanted.iter().any(|w| l.contains(w)))
                .collect();
            seen.join("\n")
        },
    )
    .await;
    // Malformed entries are never touched; the pod with a malformed annotation keeps its address.
    let mut keys = env.keys("192.0.2.0-24").await;
    keys.sort();
    assert_eq!(keys, ["10", "999", "not-a-number"]);
    // And every other pod is still processed.
    env.pool("198.18.0.0-24", "198.18.0.0/24", &[(7, "sb-ok", "ok-0")])
        .await;
    env.pod("ok-0", "macvlan", Some(&["198.18.0.7"])).await;
    env.delete_pod("ok-0").await;
    env.wait_keys("198.18.0.0-24", &[]).await;
    env.stop().await;
    env.delete_nad("broken").await;
    env.delete_pod("odd-0").await;
}

#[tokio::test]
async fn objects_that_do_not_fit_are_skipped_and_reported_once_and_the_rest_goes_on() {
    let _alone = one_bad_input_test_at_a_time().await;
    let mut env = Env::new("ctl-unfit").await;
    let ns = env.ns.clone();
    // Upstream's schemas accept all of these.
    create_raw::<IPPool>(
        &env,
        serde_json::json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
            "metadata": {"name": "nospec"}}),
    )
    .await;
    create_raw::<NetworkAttachmentDefinition>(
        &env,
        serde_json::json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": "config-on-the-node"}}),
    )
    .await;
    env.nad_config("broken", "this is not json").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    create_raw::<IPPool>(
        &env,
        serde_json::json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": "192.0.2.0-24"},
        "spec": {"range": "192.0.2.0/24", "allocations": {
            "10": {"id": "sb-odd", "podref": format!("{ns}/odd-0"), "ifname": "net1"},
            "11": {"id": "sb-nopodref"},
            "12": {"podref": format!("{ns}/noid-0")},
            "13": {"id": "sb-x", "podref": "Not A Pod"},
            "14": {"id": "sb-web", "podref": format!("{ns}/web-0"), "ifname": "net1"},
        }}}),
    )
    .await;
    let odd = testenv::fixtures::annotated_pod("odd-0", NETWORK_STATUS_ANNOTATION, "{not json");
    env.pods()
        .create(&PostParams::default(), &odd)
        .await
        .unwrap();
    env.pod("web-0", "macvlan", Some(&["192.0.2.14"])).await;

    env.start(&[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &["10", "11", "12", "13"])
        .await;
    env.wait_metric(r#"ipreclaim_invalid_objects{kind="IPPool"} 1"#)
        .await;

    let want = [
        ("InvalidObject", "nospec", "spec"),
        ("InvalidNetworkConfig", "broken", "config cannot be used"),
        ("MalformedNetworkStatus", "odd-0", "network-status"),
        (
            "UnreadablePoolEntries",
            "192.0.2.0-24",
            "allocation 11 has no podref",
        ),
        (
            "UnreadablePoolEntries",
            "192.0.2.0-24",
            "allocation 12 has no id",
        ),
        (
            "UnreadablePoolEntries",
            "192.0.2.0-24",
            r#"podref "Not A Pod", which names no pod"#,
        ),
    ];
    for (reason, object, text) in want {
        wait_for(
            &format!("a {reason} Warning on {object} naming {text:?}"),
            || async {
                warnings(&env, reason)
                    .await
                    .iter()
                    .any(|(o, m, _)| o == object && m.contains(text))
            },
        )
        .await;
    }
    // Reported once, not once per sweep; a NAD without spec is no problem at all. (Counted
    // per reporting controller: other tests' controllers watch NADs cluster-wide and report
    // this one too.)
    env.wait_sweeps(5.0).await;
    for reason in [
        "InvalidObject",
        "InvalidNetworkConfig",
        "MalformedNetworkStatus",
        "UnreadablePoolEntries",
    ] {
        let events = testenv::events::with_reason(&env.client, &ns, reason, None).await;
        let mut by_reporter: BTreeMap<String, Vec<(String, i32)>> = BTreeMap::new();
        for e in &events {
            let reporter = e.reporting_instance.clone().unwrap_or_default();
            let object = e.involved_object.name.clone().unwrap_or_default();
            by_reporter
                .entry(reporter)
                .or_default()
                .push((object, testenv::events::count(e)));
        }
        assert!(!by_reporter.is_empty(), "{reason}: none");
        for (reporter, w) in &by_reporter {
            assert_eq!(w.len(), 1, "{reason} from {reporter}: {w:?}");
            assert_eq!(w[0].1, 1, "{reason} reported once by {reporter}: {w:?}");
            assert!(w[0].0 != "config-on-the-node", "{w:?}");
        }
    }
    // scan reads the same objects.
    let rows = ipreclaim::scan::scan(env.client.clone(), &ns, Default::default())
        .await
        .expect("scan despite the objects that do not fit");
    assert!(rows.is_empty(), "nothing to release: {rows:?}");
    env.stop().await;
    env.delete_nad("broken").await;
    env.delete_pod("odd-0").await;
}
