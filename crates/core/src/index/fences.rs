//! Fence records: `IPFence` objects, joined with the pool entries they describe. The two arrive
//! on different watches in any order, so they are joined when asked, never at arrival.

use std::collections::{HashMap, HashSet};

use kube_core::Resource;

use super::Index;
use super::pools::Slot;
use crate::api::{IPFenceStatus, IPPool, ObjectId};
use crate::ipam::PoolEntry;
use crate::ipam::fence::{FenceRecord, fenced_podref};

/// A fenced allocation.
#[derive(Debug, Clone)]
pub struct FencedEntry {
    /// Its pool.
    pub pool: String,
    /// The entry as stored (podref rewritten).
    pub entry: PoolEntry,
    /// Whose it was, where and since when.
    pub record: FenceRecord,
    /// Its `IPFence` object.
    pub object: ObjectId,
    /// The node agent's reports on its object (checked before they count).
    pub evidence: IPFenceStatus,
}

impl FencedEntry {
    /// Whose the fence is, as a node agent's report must name it.
    pub fn identity(&self) -> crate::rules::fence::FenceIdentity<'_> {
        crate::rules::fence::FenceIdentity {
            node: &self.record.node,
            pod_uid: &self.record.uid,
            fence_uid: &self.object.uid,
        }
    }
}

/// An `IPFence` object, parsed.
#[derive(Debug, Clone)]
pub struct FenceObject {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// The entry's sandbox id when it was fenced.
    pub sandbox: String,
    /// The record.
    pub record: FenceRecord,
    /// The node agent's reports (its status).
    pub evidence: IPFenceStatus,
}

impl FenceObject {
    /// Its name and uid (a delete's precondition).
    pub fn id(&self) -> ObjectId {
        ObjectId {
            name: self.name.clone(),
            uid: self.uid.clone(),
        }
    }
}

/// A fence whose record is written and whose entry is not rewritten yet.
#[derive(Debug, Clone)]
pub struct PendingFence {
    /// Its pool.
    pub pool: String,
    /// The entry as stored (not rewritten).
    pub entry: PoolEntry,
    /// The record.
    pub object: FenceObject,
}

/// An entry marked fenced whose record is nowhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnrecordedMark {
    /// Its pool.
    pub pool: String,
    /// Its key (offset).
    pub key: String,
    /// Its (fenced) podref.
    pub podref: String,
}

/// `IPFence` objects by the slot they fence.
#[derive(Debug, Default)]
pub struct FenceIndex {
    objects: HashMap<Slot, FenceObject>,
}

impl FenceIndex {
    /// Records an `IPFence` object for the entry at `key` of `pool`.
    pub fn upsert(&mut self, pool: &str, key: &str, object: FenceObject) {
        self.remove(&object.name);
        let slot = Slot {
            pool: pool.to_owned(),
            key: key.to_owned(),
        };
        self.objects.insert(slot, object);
    }

    /// Forgets the `IPFence` object `name`.
    pub fn remove(&mut self, name: &str) {
        self.objects.retain(|_, o| o.name != name);
    }

    /// The object of the entry at `key` of `pool`.
    pub fn get(&self, pool: &str, key: &str) -> Option<&FenceObject> {
        // The map is keyed by owned strings; fences are few, a lookup key is cheap.
        self.objects.get(&Slot {
            pool: pool.to_owned(),
            key: key.to_owned(),
        })
    }

    /// Every object with its slot.
    pub fn iter(&self) -> impl Iterator<Item = (&Slot, &FenceObject)> {
        self.objects.iter()
    }

    /// Every object's name.
    pub fn names(&self) -> Vec<String> {
        self.objects.values().map(|o| o.name.clone()).collect()
    }
}

/// What a fence record's entry says of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// The entry is rewritten for this record: fenced.
    Fenced,
    /// The entry is as it was when fenced, not rewritten yet: a crash between the two writes,
    /// or the rewrite in flight.
    Pending,
    /// The entry is gone or now someone else's: the record is left over.
    Stale,
    /// Its pool is not known (not listed yet, or unreadable): nothing can be said.
    Unknown,
}

impl Index {
    fn standing(&self, pool: &str, key: &str, o: &FenceObject) -> Standing {
        let Some(p) = self.pools.get(pool) else {
            let unreadable = self.invalid.has(IPPool::kind(&()).as_ref(), pool);
            // A pool that cannot be read keeps its fences; a deleted one leaves them over.
            return if unreadable || !self.pools.listed() {
                Standing::Unknown
            } else {
                Standing::Stale
            };
        };
        if let Some(e) = p.marked.get(key) {
            // The sandbox too: a record cached from an earlier fence of the same address and
            // pod name (a lagging watch) must not speak for this one.
            return if e.podref == fenced_podref(&o.record.podref) && e.id == o.sandbox {
                Standing::Fenced
            } else {
                Standing::Stale
            };
        }
        match p.entries.get(key) {
            Some(e) if e.id == o.sandbox && e.podref == o.record.podref => Standing::Pending,
            _ => Standing::Stale,
        }
    }

    /// The `IPFence` object of the marked entry `entry` at `key` of `pool`.
    pub(super) fn record_of(
        &self,
        pool: &str,
        key: &str,
        entry: &PoolEntry,
    ) -> Option<&FenceObject> {
        self.fences
            .get(pool, key)
            .filter(|o| entry.podref == fenced_podref(&o.record.podref) && entry.id == o.sandbox)
    }

    /// Every fenced entry whose record is known, as (pool, entry).
    pub fn fenced(&self) -> Vec<FencedEntry> {
        let mut out = Vec::new();
        for (name, p) in self.pools.all() {
            for (key, entry) in &p.marked {
                if let Some(o) = self.record_of(name, key, entry) {
                    out.push(FencedEntry {
                        pool: name.clone(),
                        entry: entry.clone(),
                        record: o.record.clone(),
                        object: o.id(),
                        evidence: o.evidence.clone(),
                    });
                }
            }
        }
        out
    }

    /// Number of fenced entries in `pool` (recorded or not).
    pub fn marked_count(&self, pool: &str) -> usize {
        self.pools.get(pool).map_or(0, |p| p.marked.len())
    }

    /// Entries marked fenced whose record is nowhere (removed by hand): left alone, and
    /// reported.
    pub fn unrecorded_marks(&self) -> Vec<UnrecordedMark> {
        let mut out = Vec::new();
        for (name, p) in self.pools.all() {
            for (key, entry) in &p.marked {
                if self.record_of(name, key, entry).is_none() {
                    out.push(UnrecordedMark {
                        pool: name.clone(),
                        key: key.clone(),
                        podref: entry.podref.clone(),
                    });
                }
            }
        }
        out
    }

    /// The fence record of `entry` of `pool` if its fence is pending (record written, entry
    /// not rewritten yet): the entry is the fence's and is kept.
    pub fn pending_fence(&self, pool: &str, entry: &PoolEntry) -> Option<&FenceObject> {
        let o = self.fences.get(pool, &entry.key)?;
        (self.standing(pool, &entry.key, o) == Standing::Pending).then_some(o)
    }

    /// Every pending fence.
    pub fn pending_fences(&self) -> Vec<PendingFence> {
        let mut out = Vec::new();
        for (Slot { pool, key }, o) in self.fences.iter() {
            if self.standing(pool, key, o) == Standing::Pending
                && let Some(e) = self.entry(pool, key)
            {
                out.push(PendingFence {
                    pool: pool.clone(),
                    entry: e.clone(),
                    object: o.clone(),
                });
            }
        }
        out
    }

    /// `IPFence` objects left over (their entry is gone or someone else's).
    pub fn stale_fence_objects(&self) -> Vec<ObjectId> {
        self.fences
            .iter()
            .filter(|(Slot { pool, key }, o)| self.standing(pool, key, o) == Standing::Stale)
            .map(|(_, o)| o.id())
            .collect()
    }

    /// The deleted pods (podrefs) whose addresses are fenced or pending: their reservations
    /// go with the fence's release. An entry marked fenced counts whether or not its record
    /// can be read (a record deleted by hand, or one that no longer parses, is no release).
    pub fn fenced_podrefs(&self) -> HashSet<&str> {
        let objects = self.fences.iter().map(|(_, o)| o.record.podref.as_str());
        let marked = self.pools.all().values().flat_map(|p| {
            p.marked.values().filter_map(|e| {
                e.podref
                    .strip_suffix(crate::ipam::fence::FENCED_PODREF_SUFFIX)
            })
        });
        objects.chain(marked).collect()
    }
}
