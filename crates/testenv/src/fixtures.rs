//! Objects tests create again and again.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::ObjectMeta;

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
