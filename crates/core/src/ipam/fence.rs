//! How a fenced allocation is written, pure: the entry's podref is rewritten so that
//! whereabouts never hands the address to a pod of the same name (it reuses an entry by podref
//! and interface), and an `IPFence` object per address records whose it was, the node and since
//! when. The sandbox id is left alone, so the node's own CNI DEL (which matches by container id
//! and interface) still frees the address once the sandbox is torn down.
//!
//! Crash safety comes from the order of the two writes. A fence writes its record first, then
//! rewrites the entry; a lift removes the entry first, then the record. A crash in between
//! leaves either a record whose entry is unchanged (a pending fence: the entry is kept, and the
//! rewrite is completed) or a record whose entry is gone (stale: the record is deleted); never
//! an entry released while recorded, nor a rewritten entry without its record.

use serde::{Deserialize, Serialize};

/// Appended to a fenced entry's podref. `:` is not allowed in pod names, so no pod can match.
pub const FENCED_PODREF_SUFFIX: &str = ":fenced";

/// What a fence records (an `IPFence` object's spec, parsed).
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
    /// The deleted pod's termination grace period in seconds (`None`: not recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_seconds: Option<i64>,
}

/// The grace period assumed for a fence that records none: the API's default.
pub const DEFAULT_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

impl FenceRecord {
    /// The deleted pod's termination grace period ([`DEFAULT_GRACE`] when not recorded; a
    /// negative one, which the API refuses, counts as none).
    pub fn grace(&self) -> std::time::Duration {
        match self.grace_seconds {
            Some(s) => std::time::Duration::from_secs(s.max(0).unsigned_abs()),
            None => DEFAULT_GRACE,
        }
    }

    /// The network to name in Events: the record's, or `pool` when the record names none.
    pub fn network_or(&self, pool: &str) -> String {
        if self.network.is_empty() {
            pool.to_owned()
        } else {
            self.network.clone()
        }
    }
}

/// Longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;

/// Label on each `IPFence` naming its node (see [`node_label_value`]): the node agent lists
/// only its own node's fences. Records written before it have none and wait the settle.
pub const NODE_LABEL: &str = "ipreclaim.io/node";

/// Longest label value.
const MAX_LABEL_VALUE: usize = 63;

/// FNV-1a: stable across releases and machines (names and labels are looked up again later).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The [`NODE_LABEL`] value for `node`: its name, or when longer than a label value allows,
/// its head and a hash of the whole (the agent checks `spec.node` too).
pub fn node_label_value(node: &str) -> String {
    if node.len() <= MAX_LABEL_VALUE {
        return node.to_owned();
    }
    // Node names are ASCII, but a flag may be anything: cut on a character boundary.
    let mut end = MAX_LABEL_VALUE - 17;
    while !node.is_char_boundary(end) {
        end -= 1;
    }
    let head = node[..end].trim_end_matches(['-', '.']);
    format!("{head}-{:016x}", fnv(node))
}

/// The `IPFence` object's name for the entry at `key` of `pool`: `<pool>-<key>` (the key is
/// digits, so the last `-` tells them apart), shortened with a hash of the whole when too long.
pub fn fence_object_name(pool: &str, key: &str) -> String {
    let name = format!("{pool}-{key}");
    if name.len() <= MAX_NAME {
        return name;
    }
    let hash = fnv(&name);
    let head = name[..MAX_NAME - 17].trim_end_matches(['-', '.']);
    format!("{head}-{hash:016x}")
}

/// The `IPFence` spec for a fence of the entry (`pool`, `key`, `address`, `sandbox`).
pub fn fence_spec(
    pool: &str,
    key: &str,
    address: std::net::IpAddr,
    sandbox: &str,
    record: &FenceRecord,
) -> crate::api::IPFenceSpec {
    crate::api::IPFenceSpec {
        pool: pool.into(),
        key: key.into(),
        address: address.to_string(),
        sandbox: sandbox.into(),
        podref: record.podref.clone(),
        uid: record.uid.clone(),
        node: record.node.clone(),
        why: record.why.clone(),
        network: record.network.clone(),
        since: record.since.to_string(),
        grace_period_seconds: record.grace_seconds,
    }
}

/// The record an `IPFence` spec holds.
pub fn fence_record(spec: &crate::api::IPFenceSpec) -> Result<FenceRecord, String> {
    if spec.podref.is_empty() || spec.pool.is_empty() || spec.key.is_empty() {
        return Err("pool, key and podref are required".into());
    }
    let since = spec
        .since
        .parse()
        .map_err(|e| format!("since {:?}: {e}", spec.since))?;
    Ok(FenceRecord {
        podref: spec.podref.clone(),
        uid: spec.uid.clone(),
        node: spec.node.clone(),
        why: spec.why.clone(),
        network: spec.network.clone(),
        since,
        grace_seconds: spec.grace_period_seconds,
    })
}

/// The podref a fenced entry carries.
pub fn fenced_podref(podref: &str) -> String {
    format!("{podref}{FENCED_PODREF_SUFFIX}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_long_non_ascii_node_name_gets_a_label_value_without_panicking() {
        let v = super::node_label_value(&"ü".repeat(40));
        assert!(v.len() <= super::MAX_LABEL_VALUE, "{v}");
    }

    use super::*;

    fn record() -> FenceRecord {
        FenceRecord {
            podref: "apps/web-0".into(),
            uid: "u-1".into(),
            node: "node-a".into(),
            why: "Ready=Unknown (NodeStatusUnknown)".into(),
            network: "apps/macvlan".into(),
            since: "2026-11-23T10:00:00Z".parse().unwrap(),
            grace_seconds: None,
        }
    }

    #[test]
    fn a_fence_object_is_named_after_its_pool_and_key_and_stays_a_valid_name() {
        assert_eq!(fence_object_name("192.0.2.0-24", "10"), "192.0.2.0-24-10");
        assert_eq!(fence_object_name("net-fd00---64", "5"), "net-fd00---64-5");
        let long = format!("{}-10.0.0.0-8", "n".repeat(245));
        let a = fence_object_name(&long, "1");
        let b = fence_object_name(&long, "2");
        assert!(a.len() <= 253 && b.len() <= 253, "{} {}", a.len(), b.len());
        assert_ne!(a, b);
        assert_eq!(a, fence_object_name(&long, "1"), "stable");
        assert!(a.chars().last().unwrap().is_ascii_alphanumeric());
    }

    #[test]
    fn a_fence_record_round_trips_through_its_object_and_a_bad_one_is_an_error() {
        let spec = fence_spec("p", "12", "192.0.2.12".parse().unwrap(), "sb", &record());
        assert_eq!(spec.address, "192.0.2.12");
        assert_eq!(fence_record(&spec), Ok(record()));
        let bad = crate::api::IPFenceSpec {
            since: "yesterday".into(),
            ..spec.clone()
        };
        assert!(fence_record(&bad).unwrap_err().contains("yesterday"));
        let empty = crate::api::IPFenceSpec {
            podref: String::new(),
            ..spec
        };
        assert!(fence_record(&empty).is_err());
    }

    #[test]
    fn a_node_label_is_the_node_name_or_a_stable_hash_within_63_chars() {
        assert_eq!(node_label_value("node-a.example"), "node-a.example");
        let long = format!("{}.example.com", "n".repeat(70));
        let v = node_label_value(&long);
        assert!(v.len() <= 63, "{}", v.len());
        assert_eq!(v, node_label_value(&long), "stable");
        assert_ne!(v, node_label_value(&format!("{long}x")));
        assert!(v.starts_with('n') && v.chars().last().unwrap().is_ascii_alphanumeric());
    }

    #[test]
    fn a_fenced_podref_is_no_pod_name() {
        let p = fenced_podref("apps/web-0");
        assert_eq!(p, "apps/web-0:fenced");
        assert!(p.split_once('/').unwrap().1.contains(':'));
    }
}
