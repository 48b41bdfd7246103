//! The pod watch and the Node watch are separate streams: a pod's Delete event can come before
//! its node's NotReady update. So before a deletion's allocations are removed on the word of
//! the Node cache, each node the cache still trusts is read fresh (one read serves every
//! deletion seen before it began); a node found not Ready is recorded in the cache, and the
//! deletion is judged again: its releases become fences.

use std::time::Instant;

use kube::api::Api;

use super::ctx::Ctx;
use crate::api::slim::NodeReadyView;
use crate::release::{EntryWrite, ReleaseRequest};

/// A node of a deletion could not be read fresh.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reading node {node} before releasing its addresses: {message}")]
pub struct NodeReadError {
    /// The node.
    pub node: String,
    /// What the API said.
    pub message: String,
}

/// Reads fresh the nodes whose allocations `releases` would remove while the cache trusts
/// them (unless a read begun after `deleted_seen` already did); whether one turned out not
/// Ready, so that the deletion must be judged again. A read that fails is returned (the caller
/// retries the item): nothing is removed on a word that could not be checked.
pub(crate) async fn distrusted_when_read(
    ctx: &Ctx,
    podref: &str,
    releases: &[ReleaseRequest],
    deleted_seen: Instant,
) -> Result<bool, NodeReadError> {
    let Some(view) = &ctx.nodes else {
        return Ok(false);
    };
    let mut nodes: Vec<&str> = releases
        .iter()
        .filter(|r| r.write == EntryWrite::Remove)
        .filter_map(|r| r.judged.node.as_deref())
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    let to_read: Vec<String> = {
        let v = view.read().expect("node view lock");
        // The cache distrusts a node now that it trusted when the deletion was judged (its
        // NotReady arrived meanwhile): judge again, and the releases become fences.
        if nodes.iter().any(|n| v.distrust(Some(n)).is_some()) {
            return Ok(true);
        }
        nodes
            .into_iter()
            .filter(|n| v.node(n).is_some())
            .filter(|n| !v.read_since(n, deleted_seen))
            .map(str::to_owned)
            .collect()
    };
    let mut distrusted = false;
    for node in to_read {
        let began = Instant::now();
        let fresh = Api::<NodeReadyView>::all(ctx.client.clone())
            .get_opt(&node)
            .await
            .map_err(|e| NodeReadError {
                node: node.clone(),
                message: e.to_string(),
            })?;
        // Gone: the Node watch will drop it, and a pod of a deleted Node is released.
        let Some(fresh) = fresh else { continue };
        let mut v = view.write().expect("node view lock");
        v.upsert(&fresh, began);
        let why = v.distrust(Some(&node));
        // Only a read that found it Ready spares later reads: a watch event older than a
        // NotReady read may still arrive and say Ready again.
        v.record_read(&node, began, why.is_none());
        if let Some(why) = why {
            tracing::info!(%podref, %node, %why, "a fresh read of the node says it is not Ready: fenced, not released");
            distrusted = true;
        }
    }
    Ok(distrusted)
}
