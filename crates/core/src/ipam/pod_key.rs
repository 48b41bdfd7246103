//! A pod by namespace and name: what whereabouts writes as an entry's `podref`
//! (`namespace/name`), what reservations and fence records name, what Events are put on.

use std::fmt;
use std::str::FromStr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// A pod's namespace and name; `namespace/name` on the wire ([`fmt::Display`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// Why a string is not a `namespace/name` pod reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{podref:?} is not a pod reference: expected NAMESPACE/NAME")]
pub struct PodKeyError {
    /// The string given.
    pub podref: String,
}

impl PodKey {
    /// The pod `name` in `namespace`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> PodKey {
        PodKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// `namespace/name`, both non-empty, one `/` (names are not checked against Kubernetes'
    /// rules: see [`super::naming::is_pod_ref`]).
    pub fn parse(podref: &str) -> Result<PodKey, PodKeyError> {
        match split(podref) {
            Some((ns, name)) => Ok(PodKey::new(ns, name)),
            None => Err(PodKeyError {
                podref: podref.to_owned(),
            }),
        }
    }

    /// A podref as others wrote it (a pool entry, a reservation, a record), read without
    /// judging it: split at the first `/`, the namespace empty when there is none, so that a
    /// lookup with a bad one finds nothing rather than failing.
    pub fn lenient(podref: &str) -> PodKey {
        let (namespace, name) = podref.split_once('/').unwrap_or(("", podref));
        PodKey::new(namespace, name)
    }

    /// The namespace of a podref read as [`PodKey::lenient`] reads it, without allocating
    /// (for loops over every live pod).
    pub fn namespace_of(podref: &str) -> &str {
        podref.split_once('/').map_or("", |(ns, _)| ns)
    }

    /// The pod an object's metadata names (none without a namespace or a name).
    pub fn of_meta(meta: &ObjectMeta) -> Option<PodKey> {
        Some(PodKey::new(
            meta.namespace.as_deref()?,
            meta.name.as_deref()?,
        ))
    }

    /// `namespace/name`, the wire form.
    pub fn podref(&self) -> String {
        self.to_string()
    }
}

/// The namespace and name of `podref` if it is `namespace/name` (both non-empty, one `/`),
/// without allocating: [`PodKey::parse`] for checks on every pool entry.
pub(crate) fn split(podref: &str) -> Option<(&str, &str)> {
    let (ns, name) = podref.split_once('/')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains('/')).then_some((ns, name))
}

impl fmt::Display for PodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl FromStr for PodKey {
    type Err = PodKeyError;

    fn from_str(s: &str) -> Result<PodKey, PodKeyError> {
        PodKey::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_namespace_and_name_and_prints_them_back() {
        let k = PodKey::parse("ns/web-0").unwrap();
        assert_eq!(k, PodKey::new("ns", "web-0"));
        assert_eq!(k.to_string(), "ns/web-0");
        assert_eq!("a/b".parse::<PodKey>().unwrap().podref(), "a/b");
    }

    #[test]
    fn refuses_what_is_not_namespace_slash_name_with_a_clear_error() {
        for bad in ["", "web-0", "ns/", "/web-0", "ns/web-0/x", "/"] {
            let e = PodKey::parse(bad).unwrap_err();
            assert_eq!(e.podref, bad);
            assert!(e.to_string().contains("expected NAMESPACE/NAME"), "{e}");
        }
    }

    #[test]
    fn lenient_reads_split_at_the_first_slash_or_have_no_namespace() {
        assert_eq!(PodKey::lenient("ns/a/b"), PodKey::new("ns", "a/b"));
        assert_eq!(PodKey::lenient("web-0"), PodKey::new("", "web-0"));
        assert_eq!(PodKey::lenient("ns/web-0").to_string(), "ns/web-0");
        for podref in ["ns/a/b", "web-0", "ns/web-0", ""] {
            assert_eq!(
                PodKey::namespace_of(podref),
                PodKey::lenient(podref).namespace
            );
        }
    }

    #[test]
    fn of_meta_needs_namespace_and_name() {
        let mut m = ObjectMeta {
            name: Some("p".into()),
            ..Default::default()
        };
        assert_eq!(PodKey::of_meta(&m), None);
        m.namespace = Some("ns".into());
        assert_eq!(PodKey::of_meta(&m), Some(PodKey::new("ns", "p")));
    }
}
