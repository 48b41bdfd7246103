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
