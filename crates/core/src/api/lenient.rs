//! Reading objects one by one: a typed list or watch fails as a whole when one object does not
//! match the type, so a single odd pool would stop every watch. [`Lenient`] deserializes each
//! object on its own and keeps the ones that do not fit as [`Lenient::Invalid`] with the error,
//! for the caller to skip, count and report.

use std::borrow::Cow;

use kube_core::ObjectMeta;
use kube_core::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

/// One object as read: the typed object, or its metadata and why it does not fit the type.
#[derive(Debug, Clone)]
pub enum Lenient<K> {
    /// It fits.
    Valid(K),
    /// It does not.
    Invalid {
        /// Its metadata (default when even that cannot be read).
        metadata: Box<ObjectMeta>,
        /// What is wrong, naming the field.
        error: String,
    },
}

/// Fills what upstream's schema allows to be missing before the typed read.
pub trait Defaults {
    /// Adds the defaults to a raw object.
    fn fill_defaults(_object: &mut serde_json::Value) {}
}

impl<K> Lenient<K> {
    /// The typed object, if it fits.
    pub fn valid(&self) -> Option<&K> {
        match self {
            Lenient::Valid(k) => Some(k),
            Lenient::Invalid { .. } => None,
        }
    }
}

impl<'de, K: DeserializeOwned + Defaults + Resource> Deserialize<'de> for Lenient<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        Ok(Self::read(raw.get()))
    }
}

impl<K: DeserializeOwned + Defaults + Resource> Lenient<K> {
    /// Reads one object's JSON text. The common case goes straight into the type: a pool of
    /// thousands of entries would cost several times its size as an intermediate tree.
    /// `managedFields` is dropped unread where it can be cut from the text (nothing here uses
    /// it, and a pool's lists every entry: read, it is a tree of thousands of small
    /// allocations, freed at once), else dropped after.
    fn read(text: &str) -> Self {
        let cut = without_managed_fields(text);
        let text = cut.as_deref().unwrap_or(text);
        if let Ok(mut k) = serde_json::from_str::<K>(text) {
            k.meta_mut().managed_fields = None;
            return Lenient::Valid(k);
        }
        let mut value: serde_json::Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                return Lenient::Invalid {
                    metadata: Box::default(),
                    error: e.to_string(),
                };
            }
        };
        if let Some(m) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            m.remove("managedFields");
        }
        K::fill_defaults(&mut value);
        match K::deserialize(&value) {
            Ok(k) => Lenient::Valid(k),
            Err(e) => Lenient::Invalid {
                metadata: Box::new(
                    value
                        .get("metadata")
                        .and_then(|m| ObjectMeta::deserialize(m).ok())
                        .unwrap_or_default(),
                ),
                error: e.to_string(),
            },
        }
    }
}

/// `text` (an object) without its `metadata.managedFields`, cut from the text unread; `None`
/// when it has none, or when a key of the object or its metadata has an escape (then it is read
/// and dropped).
fn without_managed_fields(text: &str) -> Option<String> {
    use std::collections::BTreeMap;
    let top: BTreeMap<&str, &RawValue> = serde_json::from_str(text).ok()?;
    let meta: BTreeMap<&str, &RawValue> = serde_json::from_str(top.get("metadata")?.get()).ok()?;
    if !meta.contains_key("managedFields") {
        return None;
    }
    let mut out = String::with_capacity(text.len());
    let field = |out: &mut String, key: &str, value: &str| {
        if !out.ends_with('{') {
            out.push(',');
        }
        out.push('"');
        out.push_str(key);
        out.push_str("\":");
        out.push_str(value);
    };
    out.push('{');
    for (key, value) in &top {
        if *key != "metadata" {
            field(&mut out, key, value.get());
            continue;
        }
        let mut m = String::from("{");
        for (k, v) in meta.iter().filter(|(k, _)| **k != "managedFields") {
            field(&mut m, k, v.get());
        }
        m.push('}');
        field(&mut out, key, &m);
    }
    out.push('}');
    Some(out)
}

impl<K: Resource<DynamicType = ()>> Resource for Lenient<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        match self {
            Lenient::Valid(k) => k.meta(),
            Lenient::Invalid { metadata, .. } => metadata,
        }
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Lenient::Valid(k) => k.meta_mut(),
            Lenient::Invalid { metadata, .. } => metadata,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{IPPool, NetworkAttachmentDefinition, NodeSlicePool};
    use serde_json::json;

    #[test]
    fn a_node_slice_pool_that_does_not_fit_is_invalid_with_its_name() {
        let text = r#"{"apiVersion":"whereabouts.cni.cncf.io/v1alpha1","kind":"NodeSlicePool",
            "metadata":{"name":"slicenet"},"spec":{"range":"10.0.0.0/8","sliceSize":"/28"},
            "status":{"allocations":null}}"#;
        match Lenient::<NodeSlicePool>::read(text) {
            Lenient::Invalid { metadata, error } => {
                assert_eq!(metadata.name.as_deref(), Some("slicenet"));
                assert!(error.contains("null"), "{error}");
            }
            Lenient::Valid(v) => panic!("read as valid: {v:?}"),
        }
    }

    #[test]
    fn one_bad_object_in_a_list_leaves_the_others_readable() {
        let list = json!([
            {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
             "metadata": {"name": "good", "namespace": "ns"},
             "spec": {"range": "192.0.2.0/24", "allocations": {}}},
            {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
             "metadata": {"name": "nospec", "namespace": "ns"}},
        ]);
        let read: Vec<Lenient<IPPool>> = serde_json::from_value(list).unwrap();
        assert_eq!(read[0].valid().unwrap().spec.range, "192.0.2.0/24");
        match &read[1] {
            Lenient::Invalid { metadata, error } => {
                assert_eq!(metadata.name.as_deref(), Some("nospec"));
                assert!(error.contains("spec"), "{error}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_fence_whose_status_does_not_fit_is_read_without_it_and_stays_a_fence() {
        let fence = |status: serde_json::Value| {
            let f: Lenient<crate::api::IPFence> = serde_json::from_value(json!({
                "apiVersion": "ipreclaim.io/v1alpha1", "kind": "IPFence",
                "metadata": {"name": "p-10", "namespace": "ns", "uid": "f1"},
                "spec": {"pool": "p", "key": "10", "address": "192.0.2.10", "sandbox": "sb",
                         "podref": "ns/web-0", "uid": "u1", "node": "n", "since": "2026-11-24T10:00:00Z"},
                "status": status,
            }))
            .unwrap();
            f.valid().expect("a valid fence").status.clone()
        };
        assert_eq!(fence(json!({"sandboxesGone": "yes"})), None);
        assert_eq!(fence(json!({"sandboxesGone": {"node": 5}})), None);
        let ok = fence(json!({"sandboxesGone": {"node": "n"}})).unwrap();
        let gone = ok.sandboxes_gone.unwrap();
        assert_eq!((gone.node.as_str(), gone.pod_uid.as_str()), ("n", ""));
    }

    #[test]
    fn a_nad_without_spec_is_a_nad_without_config() {
        let nad: Lenient<NetworkAttachmentDefinition> = serde_json::from_value(json!({
            "apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": "file-config", "namespace": "ns"},
        }))
        .unwrap();
        assert_eq!(nad.valid().unwrap().spec.config, None);
    }

    #[test]
    fn managed_fields_are_dropped_from_valid_and_invalid_objects() {
        let managed = json!([{"manager": "whereabouts", "operation": "Update",
            "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:allocations": {"f:1": {}}}}}]);
        let text = json!([
            {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
             "metadata": {"name": "good", "namespace": "ns", "managedFields": managed},
             "spec": {"range": "192.0.2.0/24", "allocations": {}}},
            {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
             "metadata": {"name": "bad", "namespace": "ns", "managedFields": managed},
             "spec": {"range": 5}},
        ])
        .to_string();
        // As kube reads a list or a watch event: from text.
        let read: Vec<Lenient<IPPool>> = serde_json::from_str(&text).unwrap();
        assert_eq!(read[0].meta().name.as_deref(), Some("good"));
        assert!(read[0].valid().is_some());
        assert!(
            matches!(&read[1], Lenient::Invalid { error, .. } if error.contains("integer `5`")),
            "{:?}",
            read[1]
        );
        assert_eq!(read[1].meta().name.as_deref(), Some("bad"));
        for r in &read {
            assert_eq!(r.meta().managed_fields, None);
        }
    }

    #[test]
    fn managed_fields_are_cut_from_the_text_and_the_rest_kept_as_it_was() {
        let text = r#"{"apiVersion":"v1","kind":"IPPool","metadata":{"name":"p","managedFields":[{"manager":"w","fieldsV1":{"f:spec":{}}}],"labels":{"a":"b"}},"spec":{"range":"192.0.2.0/24"}}"#;
        let cut: serde_json::Value =
            serde_json::from_str(&without_managed_fields(text).expect("cut")).unwrap();
        let mut expected: serde_json::Value = serde_json::from_str(text).unwrap();
        expected["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("managedFields");
        assert_eq!(cut, expected);
        // None to cut, an escaped key, not an object: left to the typed read.
        assert_eq!(without_managed_fields(r#"{"metadata":{"name":"p"}}"#), None);
        assert_eq!(
            without_managed_fields(r#"{"metadata":{"na\u006de":"p","managedFields":[]}}"#),
            None
        );
        assert_eq!(without_managed_fields("[5]"), None);
        assert_eq!(without_managed_fields(r#"{"metadata":5}"#), None);
    }

    #[test]
    fn text_that_is_not_an_object_is_invalid_not_an_error() {
        let read: Vec<Lenient<IPPool>> = serde_json::from_str("[5, \"x\"]").unwrap();
        assert!(
            read.iter()
                .all(|r| matches!(r, Lenient::Invalid { metadata, .. } if metadata.name.is_none()))
        );
    }
}
