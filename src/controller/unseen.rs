//! Deletions no replica saw. A pod that is gone when the sweep finds its entry (`PodMissing`,
//! or `IPNotOnPod` when a pod of the same name was created since) may have been force-deleted
//! while both replicas were down or cut off, from a node that still runs it (cut off itself, or
//! its kubelet still stopping it). Its node is found in the node agents' sandbox inventories
//! (`ipam::inventory`): an entry whose sandbox an agent last listed live, for another pod than
//! the live one of its name, is fenced to that node instead of released, and its fence lifts by
//! the usual rules.

use std::collections::HashMap;

use crate::ipam::inventory;
use crate::release::inventories::{Sighting, placeable};
use crate::release::{EntryWrite, ReleaseRequest};
use crate::rules::fence::unseen_deletion;

/// Rewrites the releases whose sandbox an inventory lists live for another pod than the one
/// the release names (none, when it is gone) into fences of that node; returns them, and the
/// releases left.
pub fn place(
    requests: Vec<ReleaseRequest>,
    sightings: &HashMap<String, Sighting>,
) -> (Vec<ReleaseRequest>, Vec<ReleaseRequest>) {
    let mut fences = Vec::new();
    let mut releases = Vec::new();
    for mut r in requests {
        let seen = sightings.get(inventory::id_prefix(&r.judged.entry.id));
        match seen {
            Some(s) if placeable(r.reason) && s.pod_uid != r.judged.pod.uid => {
                // The uid the agent read from the runtime: the deleted pod's, for the Event and
                // the evidence the agent later gives about it.
                r.judged.pod.uid = s.pod_uid.clone();
                r.judged.node = Some(s.node.clone());
                let why = unseen_deletion(&s.node, &s.written);
                let record =
                    super::fence::record_for(&r.judged, s.node.clone(), why, s.grace_seconds);
                tracing::warn!(podref = %r.judged.entry.podref, ip = %r.judged.entry.ip, node = %s.node, reason = %r.reason, "a pod no replica saw deleted may still run on its node: fenced, not released");
                r.write = EntryWrite::Fence(record);
                fences.push(r);
            }
            _ => releases.push(r),
        }
    }
    (fences, releases)
}
