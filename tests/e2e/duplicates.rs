//! A real duplicate address on testenv's node: the kubelet runs both pods, and the real
//! whereabouts plugin hands the second one the first one's address after a "buggy tool" removed
//! the first one's entry and reservation. ipreclaim warns on both pods and the pool, counts it
//! on every replica, and touches neither pod's allocation.

use ipreclaim::api::{IPPool, OverlappingRangeIPReservation};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use crate::cluster::{Cluster, wait_long};
use crate::node_only::{controller_pods_metrics, kubectl_events, reservations};
use crate::{Platform, pool_entries};

const REASON: &str = "IPAddressDuplicate";

/// Removes `pod`'s entry from the pool and its reservation, as a buggy tool would (the pod
/// runs on with the address).
async fn forget_allocation_by_hand(c: &Cluster, pod: &str) -> (String, String) {
    let (_, ip, _) = pool_entries(c)
        .await
        .into_iter()
        .find(|(name, _, _)| name == pod)
        .unwrap_or_else(|| panic!("{pod}'s entry"));
    let pools = Api::<IPPool>::namespaced(c.client().clone(), c.pool_ns());
    let pool = pools.get(c.pool()).await.unwrap();
    let podref = format!("{}/{pod}", c.ns());
    let (key, _) = pool
        .spec
        .allocations
        .iter()
        .find(|(_, a)| a.podref == podref)
        .unwrap();
    let patch = json!([
        {"op": "test", "path": format!("/spec/allocations/{key}/podref"), "value": podref},
        {"op": "remove", "path": format!("/spec/allocations/{key}")},
    ]);
    let patch: json_patch::Patch = serde_json::from_value(patch).unwrap();
    pools
        .patch(c.pool(), &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .unwrap();
    let reservation = format!("{}-{ip}", c.ns());
    Api::<OverlappingRangeIPReservation>::namespaced(c.client().clone(), c.pool_ns())
        .delete(&reservation, &DeleteParams::default())
        .await
        .unwrap();
    (ip, key.clone())
}

/// The duplicate gauge of the test network on every controller replica.
async fn duplicate_gauges(c: &Cluster) -> Vec<f64> {
    let series = format!(
        r#"ipreclaim_duplicate_addresses{{network="{}/{}"}}"#,
        c.ns(),
        crate::NETWORK
    );
    controller_pods_metrics(c.client())
        .await
        .iter()
        .map(|text| {
            // Absent reads as -1: the series must exist (0 or more) on every replica.
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{series} ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(-1.0)
        })
        .collect()
}

/// Sweeps the leader has done (the replicas' counts summed: a standby does none).
async fn sweeps(c: &Cluster) -> f64 {
    let texts = controller_pods_metrics(c.client()).await;
    texts
        .iter()
        .map(|t| testenv::poll::metric_value(t, "ipreclaim_sweep_duration_seconds_count"))
        .sum()
}

pub(crate) async fn a_real_duplicate_address_is_warned_on_and_never_released(mut c: Cluster) {
    let node = c.node_handle();
    c.create_pod("dup-a").await;
    let (ip, key) = forget_allocation_by_hand(&c, "dup-a").await;
    // The real allocator gives the lowest free address: dup-a's, now that nothing holds it.
    c.create_pod("dup-b").await;
    let entries = pool_entries(&c).await;
    assert_eq!(
        entries
            .iter()
            .map(|(n, i, _)| (n.as_str(), i.as_str()))
            .collect::<Vec<_>>(),
        [("dup-b", ip.as_str())],
        "whereabouts gave dup-b dup-a's address {ip} (offset {key})"
    );
    let live = crate::live_addresses(&c).await;
    assert!(
        live["dup-a"].contains(&ip) && live["dup-b"].contains(&ip),
        "{live:?}"
    );
    let reserved = reservations(&c).await;

    // Warnings on both pods, through kubectl as an operator reads them, and on the pool.
    let ns = c.ns().to_string();
    wait_long("IPAddressDuplicate Warnings on dup-a and dup-b", || async {
        let events = kubectl_events(node, &ns, REASON);
        let on = |pod: &str, other: &str| {
            events.iter().any(|e| {
                e.starts_with(&format!("{pod} "))
                    && e.contains(&ip)
                    && e.contains(&format!("{ns}/{other}"))
            })
        };
        on("dup-a", "dup-b") && on("dup-b", "dup-a")
    })
    .await;
    let pool_note =
        format!("listed by 2 live pods: {ns}/dup-a, {ns}/dup-b; the pool's entry names {ns}/dup-b");
    wait_long("an IPAddressDuplicate Warning on the pool", || async {
        let events =
            testenv::events::with_reason(c.client(), c.pool_ns(), REASON, Some(c.pool())).await;
        events.iter().any(|e| {
            e.type_.as_deref() == Some("Warning")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains(&pool_note) && m.contains(&ip))
        })
    })
    .await;
    wait_long("the duplicate counted on every replica", || async {
        duplicate_gauges(&c).await.iter().all(|v| *v == 1.0)
    })
    .await;

    // Sweeps go by, past the leak grace (10 s; a sweep every 5 s): nothing is released, both
    // pods run on, neither allocation changes, one Event per pod.
    let start = sweeps(&c).await;
    wait_long("four more sweeps", || async {
        sweeps(&c).await >= start + 4.0
    })
    .await;
    assert_eq!(pool_entries(&c).await, entries, "dup-b's entry untouched");
    assert_eq!(
        reservations(&c).await,
        reserved,
        "dup-b's reservation untouched"
    );
    for pod in ["dup-a", "dup-b"] {
        assert!(c.running_with_address(pod).await.is_some(), "{pod} runs on");
    }
    assert_eq!(
        kubectl_events(node, &ns, crate::GC_DONE),
        Vec::<String>::new()
    );
    let events = testenv::events::with_reason(c.client(), &ns, REASON, None).await;
    for e in &events {
        assert_eq!(testenv::events::count(e), 1, "once per episode: {e:?}");
    }
    assert_eq!(events.len(), 2, "one per pod: {events:?}");

    // dup-a goes (its CNI DEL finds no entry of its own): the duplicate is over on every
    // replica, and dup-b keeps its address.
    c.delete_pod("dup-a").await;
    wait_long("the duplicate gauge back to 0 on every replica", || async {
        duplicate_gauges(&c).await.iter().all(|v| *v == 0.0)
    })
    .await;
    assert_eq!(pool_entries(&c).await, entries, "dup-b's entry untouched");
    assert!(c.running_with_address("dup-b").await.is_some());
    c.delete_pod("dup-b").await;
}

mod duplicate_scenarios {
    on_the_node! {
        a_real_duplicate_address_is_warned_on_and_never_released: "dup-address",
    }
}
