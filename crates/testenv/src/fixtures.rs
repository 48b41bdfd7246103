//! Objects tests create again and again.

use std::collections::BTreeMap;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::containerd::SANDBOX_IMAGE;

/// A pod with one container (never started: no kubelet runs) and the given annotations.
pub fn pod(name: &str, annotations: Option<BTreeMap<String, String>>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations,
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some(SANDBOX_IMAGE.into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A stand-in Node `name`: only its name is set (no kubelet runs behind it).
pub fn node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The status merge patch of a Node that sets its Ready condition to `status` (`True`,
/// `False`, `Unknown`) for `reason`, heartbeat and transition at `at` (RFC 3339).
pub fn ready_condition(status: &str, reason: &str, at: &str) -> serde_json::Value {
    serde_json::json!({"status": {"conditions": [{
        "type": "Ready", "status": status, "reason": reason,
        "lastHeartbeatTime": at, "lastTransitionTime": at,
    }]}})
}

/// A pod with one annotation, `key` = `value` (a network-status: ipreclaim's
/// `NETWORK_STATUS_ANNOTATION`, which this crate cannot name).
pub fn annotated_pod(name: &str, key: &str, value: &str) -> Pod {
    pod(name, Some(BTreeMap::from([(key.into(), value.into())])))
}

/// What a typed [`Api`] reads back.
pub trait Object: Clone + DeserializeOwned + std::fmt::Debug {}

impl<K: Clone + DeserializeOwned + std::fmt::Debug> Object for K {}

/// Creates `object` through `api` and returns its uid (the test fails if it cannot).
pub async fn create<K: Object + kube::Resource + Serialize>(api: &Api<K>, object: &K) -> String {
    let created = api.create(&PostParams::default(), object).await.unwrap();
    created
        .meta()
        .uid
        .clone()
        .expect("a created object has a uid")
}

/// Deletes pods `p0` to `p<n-1>` through `pods` all at once (grace 0), `concurrency` deletes in
/// flight, as a scale-down or a node drain does (the test fails if one cannot be deleted).
pub async fn delete_numbered_pods(pods: &Api<Pod>, n: usize, concurrency: usize) {
    stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                pods.delete(&format!("p{i}"), &DeleteParams::default().grace_period(0))
                    .await
            }
        })
        .buffer_unordered(concurrency)
        .for_each(|r| async move {
            r.expect("delete pod");
        })
        .await;
}

/// Every object `api` lists (the test fails if it cannot).
pub async fn list_all<K: Object>(api: &Api<K>) -> Vec<K> {
    api.list(&ListParams::default()).await.unwrap().items
}

/// Merge-patches object `name` through `api` with `patch` (the test fails if it cannot).
pub async fn merge<K: Object>(api: &Api<K>, name: &str, patch: serde_json::Value) {
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

/// Merge-patches the status of object `name` through `api` with `patch`.
pub async fn merge_status<K: Object>(api: &Api<K>, name: &str, patch: serde_json::Value) {
    let params = PatchParams::default();
    api.patch_status(name, &params, &Patch::Merge(patch))
        .await
        .unwrap();
}

/// The forged network-status kinds a tenant can write on a Pending pod (issue 35, item 4):
/// `big` (130 KiB of addresses on one attachment), `wide` (400 attachments) and `many` (1,500
/// addresses on one attachment) each break one of ipreclaim's caps; `shared` keeps to every cap
/// (16 attachments of 16 addresses) and lists the 256 addresses it is given, as every other
/// `shared` pod does.
pub const FORGED_KINDS: [&str; 4] = ["big", "wide", "many", "shared"];

/// An annotation no controller reads, 100 KiB, on every forged pod: with the forged
/// network-status, a pod's annotations stay under the apiserver's 256 KiB.
pub const FORGED_BLOB_KEY: &str = "tenant.example.com/blob";
pub const FORGED_BLOB_BYTES: usize = 100 * 1024;

/// The forged network-status of `kind` (one of [`FORGED_KINDS`]) for network `network`
/// (`ns/nad`): `shared(k)` is the `k`th of the 256 addresses a `shared` one lists; the others
/// list addresses of 198.19.0.0/16.
pub fn forged_network_status(
    kind: &str,
    network: &str,
    shared: impl Fn(usize) -> String,
) -> String {
    let ip = |k: usize| format!("198.19.{}.{}", k / 256 % 256, k % 256);
    let entries: Vec<serde_json::Value> = match kind {
        "big" => vec![serde_json::json!({
            "name": network, "interface": "net1", "ips": (0..9_000).map(ip).collect::<Vec<_>>(),
        })],
        "wide" => (0..400)
            .map(|k| serde_json::json!({"name": network, "ips": [ip(k)]}))
            .collect(),
        "many" => vec![serde_json::json!({
            "name": network, "interface": "net1", "ips": (0..1_500).map(ip).collect::<Vec<_>>(),
        })],
        _ => (0..16)
            .map(|k| {
                let ips: Vec<String> = (0..16).map(|j| shared(k * 16 + j)).collect();
                serde_json::json!({"name": network, "interface": format!("net{k}"), "ips": ips})
            })
            .collect(),
    };
    serde_json::Value::from(entries).to_string()
}

/// A Pending pod `name` (never scheduled) carrying `status` as its network-status (under
/// `status_key`, ipreclaim's `NETWORK_STATUS_ANNOTATION`) and [`FORGED_BLOB_BYTES`] of an
/// annotation no controller reads.
pub fn forged_pod(name: &str, status_key: &str, status: String) -> Pod {
    pod(
        name,
        Some(BTreeMap::from([
            (status_key.to_string(), status),
            (FORGED_BLOB_KEY.to_string(), "x".repeat(FORGED_BLOB_BYTES)),
        ])),
    )
}
