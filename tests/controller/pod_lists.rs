//! The pod watch's lists in protobuf (`ipreclaim::protobuf_lists`) on the real apiserver: every
//! page reads as the same page in JSON, pod by pod, for the pods a cluster has (scheduled or
//! not, terminal, mirror, a tenant's large and odd annotations), and an error reads as the
//! same error.

use std::collections::BTreeMap;

use http::Request;
use ipreclaim::api::slim::{NETWORK_STATUS_ANNOTATION, PodView};
use ipreclaim::paged::for_each_listed;
use ipreclaim::protobuf_lists::{ReadFromProtobuf, pod_list_client};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::client::Body;
use serde_json::json;
use testenv::ControlPlane;

use crate::support::network_status;

async fn create(pods: &Api<Pod>, name: &str, annotations: serde_json::Value, node: Option<&str>) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": "web"}, "annotations": annotations},
        "spec": {
            "nodeName": node, "terminationGracePeriodSeconds": 45,
            "containers": [{"name": "app", "image": "registry.example.com/app:1",
                "env": [{"name": "A", "value": "b"}]}],
        },
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
}

/// A pod's fields, each annotation as its length and its first 64 bytes.
fn summary(p: &PodView) -> String {
    let annotations: Vec<_> = p
        .metadata
        .annotations
        .iter()
        .flatten()
        .map(|(k, v)| {
            format!(
                "{k}={} bytes {:?}",
                v.len(),
                v.chars().take(64).collect::<String>()
            )
        })
        .collect();
    let m = &p.metadata;
    format!(
        "{:?} {:?} {:?} {:?} node {:?} phase {:?} grace {:?} {annotations:?}",
        m.name, m.uid, m.resource_version, m.creation_timestamp, p.node, p.phase, p.grace_seconds
    )
}

async fn all(pods: &Api<PodView>) -> Vec<PodView> {
    let mut listed = Vec::new();
    // Pages of 2: the continue tokens are read from protobuf too.
    for_each_listed(
        2,
        |page| {
            let pods = pods.clone();
            async move { pods.list(&page).await }
        },
        |p| listed.push(p),
    )
    .await
    .expect("list pods");
    listed
}

#[tokio::test]
async fn a_page_read_in_protobuf_is_the_page_read_in_json() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let ns = cp.namespace(&client, "pod-lists").await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let status = network_status(&ns, "macvlan", &["10.1.0.5"]);
    create(
        &pods,
        "web-0",
        json!({NETWORK_STATUS_ANNOTATION: status, "team": "a"}),
        Some("node-a"),
    )
    .await;
    create(&pods, "pending", json!({}), None).await;
    create(
        &pods,
        "mirror",
        json!({"kubernetes.io/config.mirror": "0f3c", "kubernetes.io/config.hash": "0f3c"}),
        Some("node-b"),
    )
    .await;
    // A tenant's: network-status past its cap, unicode, and 100 KiB of another annotation.
    let long = format!("[{}]", "\"é\",".repeat(20_000));
    create(
        &pods,
        "forged",
        json!({NETWORK_STATUS_ANNOTATION: long, "blob": "x".repeat(100 * 1024)}),
        Some("node-a"),
    )
    .await;
    create(
        &pods,
        "done",
        json!({NETWORK_STATUS_ANNOTATION: status}),
        Some("node-b"),
    )
    .await;
    pods.patch_status(
        "done",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .expect("mark done Succeeded");

    let in_json = all(&Api::<PodView>::namespaced(client.clone(), &ns)).await;
    let in_protobuf = all(&Api::<PodView>::namespaced(
        pod_list_client(client.clone()),
        &ns,
    ))
    .await;
    assert_eq!(in_json.len(), 5);
    // Compared field by field in short: the forged pod's annotation is 100 KB of text.
    assert_eq!(
        in_protobuf.iter().map(summary).collect::<Vec<_>>(),
        in_json.iter().map(summary).collect::<Vec<_>>()
    );
    assert!(
        in_protobuf == in_json,
        "the pods differ past their summaries"
    );
    let phases: BTreeMap<_, _> = in_protobuf
        .iter()
        .map(|p| {
            (
                p.metadata.name.clone().unwrap(),
                (p.phase.clone(), p.node.clone()),
            )
        })
        .collect();
    assert_eq!(phases["done"].0.as_deref(), Some("Succeeded"));
    assert_eq!(phases["pending"].1, None);
    assert!(in_protobuf.iter().all(|p| p.grace_seconds == Some(45)));

    // Read from protobuf indeed, not passed through in JSON.
    let page = Request::get(format!("/api/v1/namespaces/{ns}/pods?limit=2"))
        .body(Body::from(Vec::new()))
        .unwrap();
    let response = pod_list_client(client).send(page).await.expect("a page");
    assert_eq!(
        response.extensions().get::<ReadFromProtobuf>(),
        Some(&ReadFromProtobuf)
    );
}

#[tokio::test]
async fn an_error_in_protobuf_reads_as_the_error_in_json() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let ns = cp.namespace(&client, "pod-lists-error").await;
    let bogus = ListParams::default().limit(1).continue_token("not-a-token");
    let error = |api: Api<PodView>| {
        let bogus = bogus.clone();
        async move {
            match api.list(&bogus).await {
                Err(kube::Error::Api(status)) => {
                    (status.code, status.reason.clone(), status.message.clone())
                }
                other => panic!("expected the apiserver's refusal, got {other:?}"),
            }
        }
    };
    let in_json = error(Api::namespaced(client.clone(), &ns)).await;
    let in_protobuf = error(Api::namespaced(pod_list_client(client.clone()), &ns)).await;
    assert_eq!(in_json.0, 400, "{in_json:?}");
    assert_eq!(in_protobuf, in_json);

    // The refusal came in protobuf and was read from it, not asked again in JSON.
    let page = Request::get(format!(
        "/api/v1/namespaces/{ns}/pods?limit=1&continue=not-a-token"
    ))
    .body(Body::from(Vec::new()))
    .unwrap();
    let response = pod_list_client(client).send(page).await.expect("an answer");
    assert_eq!(response.status(), 400);
    assert_eq!(
        response.extensions().get::<ReadFromProtobuf>(),
        Some(&ReadFromProtobuf)
    );
}
