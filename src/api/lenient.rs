//! Reading objects one by one: a typed list or watch fails as a whole when one object does not
//! match the type, so a single odd pool would stop every watch. [`Lenient`] deserializes each
//! object on its own and keeps the ones that do not fit as [`Lenient::Invalid`] with the error,
//! for the caller to skip, count and report.

use std::borrow::Cow;

use kube::Resource;
use kube::api::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

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

impl<'de, K: DeserializeOwned + Defaults> Deserialize<'de> for Lenient<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut value = serde_json::Value::deserialize(d)?;
        K::fill_defaults(&mut value);
        let metadata = || {
            value
                .get("metadata")
                .and_then(|m| serde_json::from_value::<ObjectMeta>(m.clone()).ok())
                .unwrap_or_default()
        };
        Ok(match serde_json::from_value::<K>(value.clone()) {
            Ok(k) => Lenient::Valid(k),
            Err(e) => Lenient::Invalid {
                metadata: Box::new(metadata()),
                error: e.to_string(),
            },
        })
    }
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
    use crate::api::{IPPool, NetworkAttachmentDefinition};
    use serde_json::json;

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
    fn a_nad_without_spec_is_a_nad_without_config() {
        let nad: Lenient<NetworkAttachmentDefinition> = serde_json::from_value(json!({
            "apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": "file-config", "namespace": "ns"},
        }))
        .unwrap();
        assert_eq!(nad.valid().unwrap().spec.config, None);
    }
}
