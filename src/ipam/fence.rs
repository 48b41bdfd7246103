//! How a fenced allocation is written into its pool, pure: the entry's podref is rewritten so
//! that whereabouts never hands the address to a pod of the same name (it reuses an entry by
//! podref and interface), and a pool annotation per offset records whose it was, the node and
//! since when. The sandbox id is left alone, so the node's own CNI DEL (which matches by
//! container id and interface) still frees the address once the sandbox is torn down.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Prefix of the pool annotation that records a fence; the offset follows.
pub const FENCE_ANNOTATION_PREFIX: &str = "ipreclaim.io/fence-";

/// Appended to a fenced entry's podref. `:` is not allowed in pod names, so no pod can match.
pub const FENCED_PODREF_SUFFIX: &str = ":fenced";

/// What a fence annotation holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceRecord {
    /// The deleted pod's `namespace/name` (the entry's podref before the fence).
    pub podref: String,
    /// The deleted pod's uid.
    #[serde(default)]
    pub uid: String,
    /// The node the pod was on.
    pub node: String,
    /// Why the node was not trusted (its Ready condition).
    #[serde(default)]
    pub why: String,
    /// The network to name in Events (`namespace/nad`).
    #[serde(default)]
    pub network: String,
    /// When the fence was set.
    pub since: jiff::Timestamp,
}

/// A fence annotation that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fence annotation {key}: {message}")]
pub struct BadFence {
    /// The annotation key.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

/// The annotation key for the entry at pool key `key`.
pub fn fence_annotation_key(key: &str) -> String {
    format!("{FENCE_ANNOTATION_PREFIX}{key}")
}

/// The podref a fenced entry carries.
pub fn fenced_podref(podref: &str) -> String {
    format!("{podref}{FENCED_PODREF_SUFFIX}")
}

/// The fence records of a pool by pool key, and the annotations that cannot be read.
pub fn pool_fences(
    annotations: Option<&BTreeMap<String, String>>,
) -> (BTreeMap<String, FenceRecord>, Vec<BadFence>) {
    let mut fences = BTreeMap::new();
    let mut bad = Vec::new();
    for (key, value) in annotations.into_iter().flatten() {
        let Some(offset) = key.strip_prefix(FENCE_ANNOTATION_PREFIX) else {
            continue;
        };
        match serde_json::from_str::<FenceRecord>(value) {
            Ok(r) => {
                fences.insert(offset.to_owned(), r);
            }
            Err(e) => bad.push(BadFence {
                key: key.clone(),
                message: e.to_string(),
            }),
        }
    }
    (fences, bad)
}

/// The annotation value for `record`.
pub fn fence_annotation_value(record: &FenceRecord) -> String {
    serde_json::to_string(record).expect("a fence record always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> FenceRecord {
        FenceRecord {
            podref: "apps/web-0".into(),
            uid: "u-1".into(),
            node: "node-a".into(),
            why: "Ready=Unknown (NodeStatusUnknown)".into(),
            network: "apps/macvlan".into(),
            since: "2026-11-23T10:00:00Z".parse().unwrap(),
        }
    }

    #[test]
    fn a_record_round_trips_through_its_annotation() {
        let annotations = BTreeMap::from([
            (
                fence_annotation_key("12"),
                fence_annotation_value(&record()),
            ),
            ("other/annotation".into(), "x".into()),
        ]);
        let (fences, bad) = pool_fences(Some(&annotations));
        assert_eq!(fences, BTreeMap::from([("12".to_string(), record())]));
        assert!(bad.is_empty());
    }

    #[test]
    fn an_unreadable_annotation_is_reported_not_dropped_silently() {
        let annotations = BTreeMap::from([
            (fence_annotation_key("3"), "{not json".into()),
            (fence_annotation_key("4"), r#"{"podref":"a/b"}"#.into()),
        ]);
        let (fences, bad) = pool_fences(Some(&annotations));
        assert!(fences.is_empty());
        assert_eq!(
            bad.iter().map(|b| b.key.as_str()).collect::<Vec<_>>(),
            ["ipreclaim.io/fence-3", "ipreclaim.io/fence-4"]
        );
    }

    #[test]
    fn a_fenced_podref_is_no_pod_name() {
        let p = fenced_podref("apps/web-0");
        assert_eq!(p, "apps/web-0:fenced");
        assert!(p.split_once('/').unwrap().1.contains(':'));
    }
}
