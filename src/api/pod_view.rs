//! Pods as the controller reads them: the metadata it needs, the node a pod is bound to and
//! whether it has finished. Everything else of a pod (its spec, statuses, managedFields) is
//! skipped while the text is read, never built, so a full-pod watch costs what a metadata
//! watch costs in memory, and one watch answers what three did (pods, terminal pods, the pods
//! of unready nodes).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Resource;
use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer};

/// A pod, stripped to what reclaiming and fencing need.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodView {
    /// Name, namespace, uid, resourceVersion, creationTimestamp and annotations only.
    pub metadata: ObjectMeta,
    /// `spec.nodeName`: where its sandbox runs (`None` until it is scheduled).
    pub node: Option<String>,
    /// `status.phase`.
    pub phase: Option<String>,
}

impl PodView {
    /// Succeeded or Failed: its containers are done and will not run again.
    pub fn is_terminal(&self) -> bool {
        matches!(self.phase.as_deref(), Some("Succeeded" | "Failed"))
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    #[serde(default)]
    metadata: WireMeta,
    #[serde(default)]
    spec: WireSpec,
    #[serde(default)]
    status: WireStatus,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WireSpec {
    node_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WireStatus {
    phase: Option<String>,
}

impl<'de> Deserialize<'de> for PodView {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        Ok(PodView {
            metadata: ObjectMeta {
                name: w.metadata.name,
                namespace: w.metadata.namespace,
                uid: w.metadata.uid,
                resource_version: w.metadata.resource_version,
                creation_timestamp: w.metadata.creation_timestamp,
                annotations: w.metadata.annotations,
                ..Default::default()
            },
            node: w.spec.node_name.filter(|n| !n.is_empty()),
            phase: w.status.phase,
        })
    }
}

impl Resource for PodView {
    type DynamicType = ();
    type Scope = <Pod as Resource>::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        Pod::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        Pod::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        Pod::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        Pod::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_full_pod_reads_as_its_node_phase_and_metadata() {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "web-0", "namespace": "ns", "uid": "u1", "resourceVersion": "7",
                "annotations": {"k8s.v1.cni.cncf.io/network-status": "[]"},
                "labels": {"app": "web"},
                "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]
            },
            "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Succeeded", "podIP": "10.0.0.1"}
        });
        let p: PodView = serde_json::from_value(pod).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("web-0"));
        assert_eq!(p.metadata.uid.as_deref(), Some("u1"));
        assert_eq!(p.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(p.metadata.annotations.as_ref().map(|a| a.len()), Some(1));
        assert_eq!(p.metadata.labels, None, "not kept");
        assert_eq!(p.metadata.managed_fields, None, "never read");
        assert_eq!(p.node.as_deref(), Some("node-a"));
        assert!(p.is_terminal());
    }

    #[test]
    fn an_unscheduled_pod_has_no_node_and_is_not_terminal() {
        for pod in [
            json!({"metadata": {"name": "p"}}),
            json!({"metadata": {"name": "p"}, "spec": {"nodeName": ""}, "status": {"phase": "Pending"}}),
        ] {
            let p: PodView = serde_json::from_value(pod).unwrap();
            assert_eq!((p.node.as_deref(), p.is_terminal()), (None, false));
        }
    }

    #[test]
    fn the_url_is_the_pods_one() {
        assert_eq!(
            PodView::url_path(&(), Some("ns")),
            "/api/v1/namespaces/ns/pods"
        );
        assert_eq!(PodView::kind(&()), "Pod");
    }
}
