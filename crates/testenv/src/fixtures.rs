//! Objects tests create again and again.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
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
