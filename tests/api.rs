//! The CRDs in `crds/` on the real apiserver, with an IPPool written the way the whereabouts
//! CNI plugin writes it (create with empty allocations, then a JSON patch that tests the
//! resourceVersion and replaces the allocations).

use ipreclaim::api::IPPool;
use ipreclaim::ipam::pool_allocations;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::json;
use testenv::ControlPlane;

#[tokio::test]
async fn an_ippool_written_like_the_whereabouts_cni_reads_back() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let crds = cp.install_crds(&client).await.expect("apply crds/");
    for want in [
        "ippools.whereabouts.cni.cncf.io",
        "overlappingrangeipreservations.whereabouts.cni.cncf.io",
        "nodeslicepools.whereabouts.cni.cncf.io",
        "network-attachment-definitions.k8s.cni.cncf.io",
    ] {
        assert!(crds.iter().any(|c| c == want), "{want} installed: {crds:?}");
    }
    let ns = cp.namespace(&client, "api-ippool").await;

    // Untyped, as the Go client sends it.
    let gvk = GroupVersionKind::gvk("whereabouts.cni.cncf.io", "v1alpha1", "IPPool");
    let raw =
        Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &ApiResource::from_gvk(&gvk));
    let created: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "whereabouts.cni.cncf.io/v1alpha1",
        "kind": "IPPool",
        "metadata": {"name": "2001-db8-1---64", "namespace": ns},
        "spec": {"range": "2001:db8:1::/64", "allocations": {}},
    }))
    .unwrap();
    let created = raw
        .create(&PostParams::default(), &created)
        .await
        .expect("create pool");
    let rv = created.metadata.resource_version.clone().unwrap();
    let offset = (1u128 << 63) + 5;
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "replace", "path": "/spec/allocations", "value": {
            "1": {"id": "sandbox-a", "podref": format!("{ns}/web-0"), "ifname": "net1"},
            offset.to_string(): {"id": "sandbox-b", "podref": format!("{ns}/web-1"), "ifname": "net1",
                                 "ipamclaimref": format!("{ns}/claim-1")},
        }},
    ]))
    .unwrap();
    raw.patch(
        "2001-db8-1---64",
        &PatchParams::default(),
        &Patch::<()>::Json(patch),
    )
    .await
    .expect("JSON patch as the CNI sends it");

    let typed = Api::<IPPool>::namespaced(client, &ns)
        .get("2001-db8-1---64")
        .await
        .unwrap();
    let pool = pool_allocations(&typed.spec).unwrap();
    assert!(pool.problems.is_empty(), "{:?}", pool.problems);
    let got: Vec<(String, String, String)> = pool
        .entries
        .iter()
        .map(|e| (e.ip.to_string(), e.id.clone(), e.podref.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "2001:db8:1::1".to_string(),
                "sandbox-a".to_string(),
                format!("{ns}/web-0")
            ),
            (
                "2001:db8:1:0:8000::5".to_string(),
                "sandbox-b".to_string(),
                format!("{ns}/web-1")
            ),
        ]
    );
    assert_eq!(
        typed.spec.allocations[&offset.to_string()]
            .ipamclaimref
            .as_deref(),
        Some(format!("{ns}/claim-1").as_str())
    );
}

/// A node agent's report on a fence is bounded by the CRD: the agent writes the status of every
/// fence of its node and the controller lists them a node at a time, so a report past its
/// fields' lengths (here a 64 KiB node name) is refused by the apiserver; one that fits lands.
#[tokio::test]
async fn a_fence_report_past_its_fields_lengths_is_refused() {
    use ipreclaim::api::{IPFence, IPFenceSpec};
    let cp = ControlPlane::shared();
    let (client, ns) = cp.client_crds_and_namespace("api-fence-report").await;
    let fences = Api::<IPFence>::namespaced(client, &ns);
    let spec = IPFenceSpec {
        pool: "192.0.2.0-24".into(),
        key: "10".into(),
        address: "192.0.2.10".into(),
        sandbox: "sb-web-0".into(),
        podref: format!("{ns}/web-0"),
        uid: "pod-uid".into(),
        node: "node-a".into(),
        why: "Ready=Unknown".into(),
        network: String::new(),
        since: "2026-11-30T00:00:00Z".into(),
        grace_period_seconds: None,
    };
    let fence = fences
        .create(
            &PostParams::default(),
            &IPFence::new("192.0.2.0-24-10", spec),
        )
        .await
        .expect("create the fence");
    let report = |node: &str| {
        json!({"status": {"sandboxesPresent": {
            "node": node, "podUid": "pod-uid",
            "fenceUid": fence.metadata.uid.clone().unwrap(),
            "observedAt": "2026-11-30T00:00:01Z",
        }}})
    };
    let write = |patch: serde_json::Value| {
        let fences = fences.clone();
        async move {
            fences
                .patch_status(
                    "192.0.2.0-24-10",
                    &PatchParams::default(),
                    &Patch::Merge(patch),
                )
                .await
        }
    };
    match write(report(&"n".repeat(64 * 1024))).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{s:?}"),
        other => panic!("a 64 KiB node name written: {other:?}"),
    }
    let written = write(report("node-a")).await.expect("a report that fits");
    let present = written.status.and_then(|s| s.sandboxes_present);
    assert_eq!(present.map(|p| p.node).as_deref(), Some("node-a"));
}

/// A watch the apiserver refuses (a ServiceAccount without RBAC: 403 on every LIST) backs off:
/// kube's watcher yields `Init` before each re-list, which must not reset the delay (it did:
/// about five LISTs a second, forever, per watch and replica).
#[tokio::test]
async fn a_refused_watch_backs_off_instead_of_relisting_five_times_a_second() {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    use kube::runtime::watcher;

    let cp = ControlPlane::shared();
    let (_, _, client) = cp
        .namespace_and_rightless_client("api-refused-watch", "no-rights")
        .await;
    let stream = ipreclaim::watch_retry::retrying(
        client.clone(),
        watcher::watcher(Api::<Pod>::all(client), watcher::Config::default()),
    );
    futures::pin_mut!(stream);
    let (mut refused, mut other) = (0, Vec::new());
    let window = std::time::Duration::from_secs(6);
    let _ = tokio::time::timeout(window, async {
        while let Some(item) = stream.next().await {
            match item {
                // Each LIST begins with Init; its 403 is logged by `retrying`, not passed on.
                Ok(watcher::Event::Init) => refused += 1,
                Ok(_) => other.push("an event".to_string()),
                Err(e) => other.push(e.to_string()),
            }
        }
    })
    .await;
    assert!(other.is_empty(), "only refused LISTs expected: {other:?}");
    // Backoff from 200 ms doubling (plus up to half again of jitter): at most 6 LISTs in 6 s.
    assert!(
        (2..=6).contains(&refused),
        "LISTs refused in {window:?}: {refused} (2 to 6 with backoff)"
    );
}
