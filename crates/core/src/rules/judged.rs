//! An allocation with its decision and the pod to name: what the judgement hands to the
//! release path.

use crate::ipam::{PodKey, PoolEntry};

use super::Decision;

/// A pod's identity for Events.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodRef {
    /// Namespace and name.
    pub key: PodKey,
    /// Uid (empty when unknown, e.g. a pod that vanished while the controller was down).
    pub uid: String,
}

impl PodRef {
    /// The pod of `podref` (`namespace/name`, read leniently: see [`PodKey::lenient`]) with
    /// `uid`.
    pub fn from_podref(podref: &str, uid: String) -> PodRef {
        PodRef {
            key: PodKey::lenient(podref),
            uid,
        }
    }

    /// `namespace/name`.
    pub fn podref(&self) -> String {
        self.key.podref()
    }
}

/// One allocation with everything needed to decide and to release it.
#[derive(Debug, Clone)]
pub struct Judged {
    /// Pool name.
    pub pool: String,
    /// The entry.
    pub entry: PoolEntry,
    /// The decision.
    pub decision: Decision,
    /// The network to name in Events.
    pub network: String,
    /// The pod to put Events on.
    pub pod: PodRef,
    /// The node that pod was bound to, when known (for the audit line).
    pub node: Option<String>,
}
