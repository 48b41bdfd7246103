//! Marked entries (fenced or cooling) that disappear from their pool, or are rewritten, as the
//! pool watch sees it: each is recorded with whether ipreclaim wrote it (its pool's
//! `ipam::own_write` signature changed in the same observation) and, for a fenced one, its
//! fence's node, for the controller to judge (`rules::other_writers`) and report. Pure.
//!
//! Each watch event is one write, so a signature that did not change means no ipreclaim write
//! of a marked entry happened between the two observations: the entry went by another writer's
//! hand. Across a re-list (a watch gap) several writes fold into one observation: a signature
//! that changed there may hide another writer's removal beside ipreclaim's own (it is taken as
//! ipreclaim's: a missed report, never a false one).

use std::net::IpAddr;

use super::pools::{MarkedKind, PoolInfo, SeenMarks};
use crate::api::ObjectId;
use crate::ipam::PoolEntry;

/// Marked entries seen gone at most, waiting for the controller's next look (about a second);
/// more are counted and dropped.
pub const MAX_WAITING: usize = 10_000;

/// The fence a fenced entry that went was recorded under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoneFence {
    /// The fence's node.
    pub node: String,
    /// Its `IPFence` object.
    pub object: ObjectId,
}

/// A marked entry that disappeared from its pool or was rewritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkedGone {
    /// The pool.
    pub pool: String,
    /// Its uid.
    pub pool_uid: String,
    /// The entry as it was.
    pub entry: PoolEntry,
    /// Fenced or cooling.
    pub kind: MarkedKind,
    /// What the key holds now (`None`: removed).
    pub now: Option<PoolEntry>,
    /// The pool's own-write signature changed in the same observation: ipreclaim wrote it.
    pub ours: bool,
    /// A fenced entry's fence, when its record is known.
    pub fence: Option<GoneFence>,
}

impl MarkedGone {
    /// The pod it was marked for (`ns/name`).
    pub fn pod(&self) -> &str {
        let p = &self.entry.podref;
        p.strip_suffix(crate::ipam::fence::FENCED_PODREF_SUFFIX)
            .or_else(|| p.strip_suffix(crate::ipam::cooldown::COOLING_PODREF_SUFFIX))
            .unwrap_or(p)
    }

    /// Its address.
    pub fn ip(&self) -> IpAddr {
        self.entry.ip
    }
}

/// Whether two stored entries are the same allocation as written (id, podref, interface).
fn same(a: &PoolEntry, b: &PoolEntry) -> bool {
    a.id == b.id && a.podref == b.podref && a.ifname == b.ifname
}

/// The entry at `key` of `pool`, whatever its kind.
fn at<'a>(pool: &'a PoolInfo, key: &str) -> Option<&'a PoolEntry> {
    pool.entries
        .get(key)
        .or_else(|| pool.marked.get(key))
        .or_else(|| pool.cooling.get(key).map(|c| &c.entry))
}

/// The marked entries `old` (a pool's last observation) held that `new` (the same pool,
/// observed next) no longer holds as they were; `fence_of(key, entry)` names a fenced entry's
/// fence.
pub fn marked_gone(
    old: &SeenMarks,
    new: &PoolInfo,
    fence_of: impl Fn(&str, &PoolEntry) -> Option<GoneFence>,
) -> Vec<MarkedGone> {
    // A pool whose range no longer parses lists no entries: nothing can be said of them.
    if new.bad_range {
        return Vec::new();
    }
    let ours = new.own_write.is_some() && new.own_write != old.signature;
    old.entries
        .iter()
        .filter_map(|(key, (entry, kind))| {
            let kind = *kind;
            let now = at(new, key);
            if now.is_some_and(|n| same(n, entry)) {
                return None;
            }
            Some(MarkedGone {
                pool: new.name.clone(),
                pool_uid: new.uid.clone(),
                entry: entry.clone(),
                kind,
                now: now.cloned(),
                ours,
                fence: match kind {
                    MarkedKind::Fenced => fence_of(key, entry),
                    MarkedKind::Cooling => None,
                },
            })
        })
        .collect()
}
