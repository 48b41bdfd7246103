//! Pods and Nodes as the controller reads them: only the fields it uses are built; the rest of
//! each object (a pod's spec and statuses, a Node's images, everyone's managedFields) is
//! skipped while the text is read. So one pod watch answers what three metadata watches did
//! (pods, terminal pods, the pods of unready nodes) at the memory cost of one, and a Node costs
//! its name and Ready condition, not the tens of KB its status holds.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeCondition, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_core::ObjectMeta;
use kube_core::Resource;
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// A pod, stripped to what reclaiming and fencing need.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodView {
    /// Name, namespace, uid, resourceVersion, creationTimestamp and the annotations of
    /// [`KEPT_POD_ANNOTATIONS`] only, each cut to its most.
    pub metadata: ObjectMeta,
    /// `spec.nodeName`: where its sandbox runs (`None` until it is scheduled).
    pub node: Option<String>,
    /// `status.phase`.
    pub phase: Option<String>,
    /// `spec.terminationGracePeriodSeconds`: how long its kubelet may take to stop it.
    pub grace_seconds: Option<i64>,
}

/// The network-status annotation's key (Multus writes it).
pub const NETWORK_STATUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";

/// Most bytes of the network-status annotation that are read: any user who can create a pod
/// can write it on a Pending pod (Multus never rewrites it), so a longer one is malformed, not
/// parsed. Multus writes about 250 bytes per attachment (an SR-IOV one with its device-info
/// about 400): 32 KiB is room for 80.
pub const MAX_NETWORK_STATUS_BYTES: usize = 32 * 1024;

/// The annotation the kubelet puts on a static pod's mirror pod: deleting that object stops
/// nothing (the kubelet recreates it), so its deletion is never proof the pod is gone.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

impl PodView {
    /// The API's mirror of a static pod, which the kubelet runs from a file.
    pub fn is_mirror(&self) -> bool {
        self.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(MIRROR_ANNOTATION))
    }

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
    #[serde(default, deserialize_with = "kept_annotations")]
    annotations: Option<BTreeMap<String, String>>,
}

/// The pod annotations the controller reads, each with the most bytes of its value kept. The
/// others are skipped as the text is read: a pod's annotations may hold 256 KiB that any tenant
/// writes, and none of it is ours to keep. network-status is cut just past its parser's cap
/// ([`MAX_NETWORK_STATUS_BYTES`]: a longer value is malformed either way, so the cut changes no
/// outcome); the kubelet's mirror-pod mark (`kubernetes.io/config.mirror`, a hash: the mirror-pod
/// rule reads only that it is there) to 64.
pub const KEPT_POD_ANNOTATIONS: [(&str, usize); 2] = [
    (NETWORK_STATUS_ANNOTATION, MAX_NETWORK_STATUS_BYTES + 1),
    ("kubernetes.io/config.mirror", 64),
];

/// The kept annotations ([`KEPT_POD_ANNOTATIONS`]), each cut to its most; `None` when there is
/// none.
fn kept_annotations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    struct Kept;
    impl<'de> Visitor<'de> for Kept {
        type Value = Option<BTreeMap<String, String>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of annotations")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut kept = BTreeMap::new();
            while let Some(KeptKey(key)) = map.next_key()? {
                match key {
                    Some((key, most)) => {
                        let CutText(value) = map.next_value_seed(Cut(most))?;
                        kept.insert(key.to_owned(), value);
                    }
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok((!kept.is_empty()).then_some(kept))
        }
    }
    d.deserialize_option(Kept)
}

/// An annotation's key: which of [`KEPT_POD_ANNOTATIONS`] it is (read without a copy).
struct KeptKey(Option<(&'static str, usize)>);

impl<'de> Deserialize<'de> for KeptKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl Visitor<'_> for Key {
            type Value = KeptKey;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an annotation key")
            }
            fn visit_str<E>(self, key: &str) -> Result<KeptKey, E> {
                Ok(KeptKey(
                    KEPT_POD_ANNOTATIONS.into_iter().find(|(k, _)| *k == key),
                ))
            }
        }
        d.deserialize_str(Key)
    }
}

/// A text cut to at most `.0` bytes (at the first character boundary from there) as it is
/// read: the whole is never copied.
struct Cut(usize);

/// What [`Cut`] read.
struct CutText(String);

impl<'de> DeserializeSeed<'de> for Cut {
    type Value = CutText;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<CutText, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Cut {
    type Value = CutText;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an annotation value")
    }
    fn visit_str<E>(self, text: &str) -> Result<CutText, E> {
        Ok(CutText(cut_to(text, self.0).to_owned()))
    }
}

/// `text` cut to at most `most` bytes, at the first character boundary from there (a kept
/// annotation's cut, whichever encoding it was read from).
pub(crate) fn cut_to(text: &str, most: usize) -> &str {
    let mut end = text.len().min(most);
    while !text.is_char_boundary(end) {
        end += 1;
    }
    &text[..end]
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WireSpec {
    node_name: Option<String>,
    termination_grace_period_seconds: Option<i64>,
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
            grace_seconds: w.spec.termination_grace_period_seconds,
        })
    }
}

/// `Resource` as the full type it strips: same kind, group, version and URL.
macro_rules! resource_as {
    ($slim:ty, $full:ty) => {
        impl Resource for $slim {
            type DynamicType = ();
            type Scope = <$full as Resource>::Scope;

            fn kind(dt: &()) -> Cow<'_, str> {
                <$full>::kind(dt)
            }
            fn group(dt: &()) -> Cow<'_, str> {
                <$full>::group(dt)
            }
            fn version(dt: &()) -> Cow<'_, str> {
                <$full>::version(dt)
            }
            fn plural(dt: &()) -> Cow<'_, str> {
                <$full>::plural(dt)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

resource_as!(PodView, Pod);
resource_as!(NodeReadyView, Node);

/// The taint an operator puts on a node it declares powered off (non-graceful node shutdown).
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// A Node, stripped to its name, Ready condition and out-of-service taint.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeReadyView {
    /// Name and resourceVersion only.
    pub metadata: ObjectMeta,
    /// Its `Ready` condition, if it has one yet.
    pub ready: Option<NodeCondition>,
    /// Tainted `node.kubernetes.io/out-of-service` (any value or effect).
    pub out_of_service: bool,
}

#[derive(Deserialize)]
struct NodeWire {
    #[serde(default)]
    metadata: WireMeta,
    #[serde(default)]
    spec: NodeWireSpec,
    #[serde(default)]
    status: NodeWireStatus,
}

#[derive(Deserialize, Default)]
struct NodeWireSpec {
    #[serde(default)]
    taints: Vec<NodeWireTaint>,
}

#[derive(Deserialize, Default)]
struct NodeWireTaint {
    #[serde(default)]
    key: String,
}

#[derive(Deserialize, Default)]
struct NodeWireStatus {
    #[serde(default)]
    conditions: Vec<NodeCondition>,
}

impl<'de> Deserialize<'de> for NodeReadyView {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = NodeWire::deserialize(d)?;
        Ok(NodeReadyView {
            metadata: ObjectMeta {
                name: w.metadata.name,
                uid: w.metadata.uid,
                resource_version: w.metadata.resource_version,
                ..Default::default()
            },
            ready: w.status.conditions.into_iter().find(|c| c.type_ == "Ready"),
            out_of_service: w.spec.taints.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT),
        })
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
    fn only_the_annotations_the_controller_reads_are_kept_and_each_is_bounded() {
        let status = format!("[{}]", " ".repeat(200 * 1024));
        let pod = json!({
            "metadata": {"name": "p", "annotations": {
                "tenant.example.com/blob": "x".repeat(200 * 1024),
                NETWORK_STATUS_ANNOTATION: status,
                "kubernetes.io/config.mirror": "m".repeat(1000),
            }},
        });
        let p: PodView = serde_json::from_value(pod).unwrap();
        let kept = p.metadata.annotations.expect("network-status kept");
        let mirror = "kubernetes.io/config.mirror";
        assert_eq!(
            kept.keys().collect::<Vec<_>>(),
            [NETWORK_STATUS_ANNOTATION, mirror]
        );
        assert_eq!(kept[mirror].len(), 64);
        let value = &kept[NETWORK_STATUS_ANNOTATION];
        assert_eq!(value.len(), MAX_NETWORK_STATUS_BYTES + 1);
        // Still past the parser's cap (`ipam::network_status`), so still malformed.
        // From text as the watch reads it (a borrowed read), and with nothing to keep.
        let text = r#"{"metadata":{"name":"q","annotations":{"a":"b","c":"d"}}}"#;
        let q: PodView = serde_json::from_str(text).unwrap();
        assert_eq!(q.metadata.annotations, None);
        let r: PodView =
            serde_json::from_str(r#"{"metadata":{"name":"r","annotations":null}}"#).unwrap();
        assert_eq!(r.metadata.annotations, None);
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

    #[test]
    fn a_node_reads_as_its_name_and_ready_condition() {
        let node = json!({
            "metadata": {"name": "n1", "resourceVersion": "9", "labels": {"a": "b"}},
            "status": {
                "conditions": [
                    {"type": "MemoryPressure", "status": "False"},
                    {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                     "lastTransitionTime": "2026-11-24T07:00:00Z"}
                ],
                "images": [{"names": ["registry.example.com/a:1"], "sizeBytes": 1}]
            }
        });
        let n: NodeReadyView = serde_json::from_value(node).unwrap();
        assert_eq!(n.metadata.name.as_deref(), Some("n1"));
        assert_eq!(n.metadata.labels, None);
        let ready = n.ready.expect("the Ready condition");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_deref()),
            ("Unknown", Some("NodeStatusUnknown"))
        );
        assert!(!n.out_of_service);
        let bare: NodeReadyView =
            serde_json::from_value(json!({"metadata": {"name": "n2"}})).unwrap();
        assert_eq!(bare.ready, None);
        let tainted: NodeReadyView = serde_json::from_value(json!({
            "metadata": {"name": "n3"},
            "spec": {"taints": [
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
                {"key": OUT_OF_SERVICE_TAINT, "value": "nodeshutdown", "effect": "NoExecute"}
            ]}
        }))
        .unwrap();
        assert!(tainted.out_of_service);
        assert_eq!(NodeReadyView::url_path(&(), None), "/api/v1/nodes");
    }
}
