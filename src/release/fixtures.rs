//! Test fixtures of the release path: a request, a fence record and its object.

use crate::api::ObjectId;
use crate::ipam::PoolEntry;
use crate::ipam::fence::FenceRecord;
use crate::rules::{Decision, Judged, PodRef, Reason};

use super::types::{EntryWrite, ReleaseRequest};

/// A request about the entry at `key` (sandbox `sb`, 192.0.2.5) of pool `p` held by `podref`.
pub fn request(key: &str, podref: &str, write: EntryWrite) -> ReleaseRequest {
    ReleaseRequest {
        judged: Judged {
            pool: "p".into(),
            entry: PoolEntry {
                key: key.into(),
                offset: key.parse().unwrap(),
                ip: "192.0.2.5".parse().unwrap(),
                id: "sb".into(),
                podref: podref.into(),
                ifname: None,
            },
            decision: Decision::Release(Reason::PodDeleted),
            network: "ns/net".into(),
            pod: PodRef::from_podref("ns/web-0", "u".into()),
            node: None,
        },
        reason: Reason::PodDeleted,
        deleted_at: None,
        cooldown: None,
        write,
    }
}

/// The fence record of `ns/web-0`.
pub fn record() -> FenceRecord {
    ipreclaim_core::fixtures::fence_record("ns/web-0")
}

/// The `IPFence` object of the fence of entry 5 of pool `p`.
pub fn fence_object() -> ObjectId {
    ObjectId {
        name: "p-5".into(),
        uid: "u-p-5".into(),
    }
}
