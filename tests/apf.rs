//! Writes under API Priority and Fairness, on a real apiserver with APF on (a private control
//! plane: the shared one runs without APF so tests do not wait on each other). A priority level
//! of one share that rejects what it cannot run at once squeezes the controller's
//! ServiceAccount: its excess writes are answered `429`. Every release must still land, with
//! nothing counted failed, and the 429s must have been seen and waited out.

use std::collections::BTreeMap;
use std::time::Duration;

use ipreclaim::api::{
    IPAllocation, IPPool, IPPoolSpec, OverlappingRangeIPReservation,
    OverlappingRangeIPReservationSpec,
};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use testenv::controlplane::Options;
use testenv::poll::{http_get, metric_sum, metric_value, wait_for_within};
use testenv::procs::ChildGuard;
use testenv::{ControlPlane, fixtures};

const PODS: usize = 24;
const SA: &str = "ipreclaim";

/// A priority level of one share (3 of the default 600 seats), no borrowing, rejecting what
/// does not fit, and a FlowSchema putting every request of `ns`'s ServiceAccount there.
async fn squeeze(client: &Client, ns: &str) -> String {
    let level: PriorityLevelConfiguration = serde_json::from_value(serde_json::json!({
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
        "metadata": {"name": "ipreclaim-squeezed"},
        "spec": {"type": "Limited", "limited": {
            "nominalConcurrencyShares": 1, "lendablePercent": 0, "borrowingLimitPercent": 0,
            "limitResponse": {"type": "Reject"}}},
    }))
    .unwrap();
    Api::<PriorityLevelConfiguration>::all(client.clone())
        .create(&PostParams::default(), &level)
        .await
        .expect("create the priority level");
    let schema: FlowSchema = serde_json::from_value(serde_json::json!({
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
        "metadata": {"name": "ipreclaim-squeezed"},
        "spec": {
            "priorityLevelConfiguration": {"name": "ipreclaim-squeezed"},
            "matchingPrecedence": 500,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{
                "subjects": [{"kind": "ServiceAccount",
                              "serviceAccount": {"namespace": ns, "name": SA}}],
                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                   "clusterScope": true, "namespaces": ["*"]}],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }],
        },
    }))
    .unwrap();
    Api::<FlowSchema>::all(client.clone())
        .create(&PostParams::default(), &schema)
        .await
        .expect("create the flow schema")
        .uid()
        .expect("a uid")
}

/// Whether the apiserver already classifies `sa`'s requests under the FlowSchema `uid` (it
/// names the schema it used in a response header).
async fn classified(sa: &Client, uid: &str) -> bool {
    let req = http::Request::get("/version").body(Vec::new()).unwrap();
    sa.send(req.map(kube::client::Body::from))
        .await
        .ok()
        .and_then(|r| {
            r.headers()
                .get("X-Kubernetes-PF-FlowSchema-UID")
                .map(|v| v == uid)
        })
        .unwrap_or(false)
}

fn pod(ns: &str, i: usize) -> Pod {
    let status = format!(
        r#"[{{"name":"{ns}/net","interface":"net1","ips":["192.0.2.{}"]}}]"#,
        i + 1
    );
    fixtures::annotated_pod(&format!("p{i}"), NETWORK_STATUS_ANNOTATION, &status)
}

#[tokio::test(flavor = "multi_thread")]
async fn squeezed_by_priority_and_fairness_every_release_lands_after_waiting_out_the_429s() {
    let cp = tokio::task::spawn_blocking(|| {
        ControlPlane::start_with(Options {
            priority_and_fairness: true,
            ..Options::default()
        })
    })
    .await
    .unwrap()
    .expect("a control plane with API Priority and Fairness on");
    let (client, ns) = cp.client_crds_and_namespace("apf").await;

    // The pods, their allocations and their reservations.
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    for i in 0..PODS {
        pods.create(&PostParams::default(), &pod(&ns, i))
            .await
            .unwrap();
    }
    let allocations: BTreeMap<String, IPAllocation> = (0..PODS)
        .map(|i| {
            let a = IPAllocation {
                id: format!("sandbox-{i}"),
                podref: format!("{ns}/p{i}"),
                ifname: Some("net1".into()),
                ipamclaimref: None,
            };
            ((i + 1).to_string(), a)
        })
        .collect();
    let spec = IPPoolSpec {
        range: "192.0.2.0/24".into(),
        allocations,
    };
    let pools = Api::<IPPool>::namespaced(client.clone(), &ns);
    pools
        .create(&PostParams::default(), &IPPool::new("192.0.2.0-24", spec))
        .await
        .unwrap();
    let reservations = Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), &ns);
    for i in 0..PODS {
        let spec = OverlappingRangeIPReservationSpec {
            containerid: Some(format!("sandbox-{i}")),
            podref: format!("{ns}/p{i}"),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        };
        let r = OverlappingRangeIPReservation::new(&format!("192.0.2.{}", i + 1), spec);
        reservations
            .create(&PostParams::default(), &r)
            .await
            .unwrap();
    }

    // The controller binary as a ServiceAccount that may do anything, squeezed by APF.
    let token = cp.service_account_token(&client, &ns, SA).await.unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{ns}-admin")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "namespace": ns, "name": SA}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let schema = squeeze(&client, &ns).await;
    let sa = cp.service_account_client(&client, &ns, SA).await.unwrap();
    wait_for_within(
        "the apiserver to classify the ServiceAccount's requests under the squeeze",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || classified(&sa, &schema),
    )
    .await;
    let kubeconfig = cp.dir().join(format!("{ns}.kubeconfig"));
    cp.write_kubeconfig_for_token(&token, &kubeconfig).unwrap();
    let port = testenv::procs::free_port().unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let controller = ChildGuard::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
            .args([
                "controller",
                &format!("--whereabouts-namespace={ns}"),
                "--leader-election=false",
                "--fence-unready-nodes=false",
                &format!("--metrics-addr={addr}"),
            ])
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn"),
    )
    .expect("start the ipreclaim binary");
    // The binary binds its metrics address a moment after it starts.
    let metrics = || async move {
        tokio::net::TcpStream::connect(addr).await.ok()?;
        Some(http_get(addr, "/metrics").await.1)
    };
    wait_for_within(
        "the controller to cache the pods",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            metrics()
                .await
                .is_some_and(|m| metric_sum(&m, "ipreclaim_cached_pods") >= PODS as f64)
        },
    )
    .await;

    // All at once: more writes than the level has seats.
    fixtures::delete_numbered_pods(&pods, PODS, PODS).await;
    wait_for_within(
        "every entry and reservation released",
        Duration::from_secs(120),
        Duration::from_millis(200),
        || async {
            let pool = pools.get("192.0.2.0-24").await.unwrap();
            let left = reservations.list(&Default::default()).await.unwrap();
            pool.spec.allocations.is_empty() && left.items.is_empty()
        },
    )
    .await;
    let text = metrics().await.expect("the controller's metrics");
    drop(controller);
    let throttled = metric_sum(&text, "ipreclaim_api_throttled_total");
    eprintln!(
        "apf: {throttled} writes answered 429 and sent again; {} pool patches, {} deletes",
        metric_value(&text, "ipreclaim_api_writes_total{verb=\"patch\"}"),
        metric_value(&text, "ipreclaim_api_writes_total{verb=\"delete\"}"),
    );
    assert!(
        throttled > 0.0,
        "no 429 seen: the squeeze did not bite (3 seats, {PODS} deletions at once)"
    );
    assert_eq!(metric_sum(&text, "ipreclaim_release_failures_total"), 0.0);
    assert_eq!(
        metric_sum(&text, "ipreclaim_releases_total"),
        PODS as f64,
        "each address released once"
    );
}
