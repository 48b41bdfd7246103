//! Fence records in the controller's state: `IPFence` objects and (from earlier releases) pool
//! annotations, joined with the pool entries they describe. The two arrive on different
//! watches in any order, so they are joined when asked, never at arrival.

use std::collections::{BTreeMap, HashSet};

use super::{FenceObject, FenceSource, FencedEntry, State};
use kube::Resource;

use crate::api::{IPPool, SandboxesGone};
use crate::ipam::PoolEntry;
use crate::ipam::fence::{FenceRecord, fenced_podref};

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

impl State {
    /// Records an `IPFence` object.
    pub fn upsert_fence_object(&mut self, pool: &str, key: &str, object: FenceObject) {
        self.fence_objects.retain(|_, o| o.name != object.name);
        self.fence_objects
            .insert((pool.to_owned(), key.to_owned()), object);
    }

    /// Forgets the `IPFence` object `name`.
    pub fn remove_fence_object(&mut self, name: &str) {
        self.fence_objects.retain(|_, o| o.name != name);
    }

    /// Keeps the `IPFence` objects for which `keep(name)` holds (after a re-list).
    pub fn retain_fence_objects(&mut self, keep: impl Fn(&str) -> bool) {
        self.fence_objects.retain(|_, o| keep(&o.name));
    }

    fn standing(&self, pool: &str, key: &str, o: &FenceObject) -> Standing {
        let Some(p) = self.pools.get(pool) else {
            let unreadable = self
                .invalid
                .keys()
                .any(|k| k.kind == IPPool::kind(&()) && k.name == pool);
            // A pool that cannot be read keeps its fences; a deleted one leaves them over.
            return if unreadable || !self.pools_listed {
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

    /// The pools have been listed once: a pool not known since is gone.
    pub fn set_pools_listed(&mut self) {
        self.pools_listed = true;
    }

    /// The record of the marked entry `entry` at `key` of `pool`, where it is kept, and the
    /// node agent's report on it (only an object has one).
    fn record_of(
        &self,
        pool: &str,
        key: &str,
        entry: &PoolEntry,
    ) -> Option<(FenceRecord, FenceSource, Option<SandboxesGone>)> {
        if let Some(o) = self.fence_objects.get(&(pool.to_owned(), key.to_owned()))
            && entry.podref == fenced_podref(&o.record.podref)
            && entry.id == o.sandbox
        {
            let source = FenceSource::Object {
                name: o.name.clone(),
                uid: o.uid.clone(),
            };
            return Some((o.record.clone(), source, o.evidence.clone()));
        }
        let r = self.pools.get(pool)?.annotation_fences.get(key)?;
        (entry.podref == fenced_podref(&r.podref))
            .then(|| (r.clone(), FenceSource::Annotation, None))
    }

    /// Every fenced entry whose record is known, as (pool, entry).
    pub fn fenced(&self) -> Vec<(String, FencedEntry)> {
        let mut out = Vec::new();
        for (name, p) in &self.pools {
            for (key, entry) in &p.marked {
                if let Some((record, source, evidence)) = self.record_of(name, key, entry) {
                    let entry = entry.clone();
                    out.push((
                        name.clone(),
                        FencedEntry {
                            entry,
                            record,
                            source,
                            evidence,
                        },
                    ));
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
    /// reported, as (pool, key, podref).
    pub fn unrecorded_marks(&self) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for (name, p) in &self.pools {
            for (key, entry) in &p.marked {
                if self.record_of(name, key, entry).is_none() {
                    out.push((name.clone(), key.clone(), entry.podref.clone()));
                }
            }
        }
        out
    }

    /// The fence record of `entry` of `pool` if its fence is pending (record written, entry
    /// not rewritten yet): the entry is the fence's and is kept.
    pub fn pending_fence(&self, pool: &str, entry: &PoolEntry) -> Option<&FenceObject> {
        let o = self
            .fence_objects
            .get(&(pool.to_owned(), entry.key.clone()))?;
        (self.standing(pool, &entry.key, o) == Standing::Pending).then_some(o)
    }

    /// Every pending fence, as (pool, entry, record).
    pub fn pending_fences(&self) -> Vec<(String, PoolEntry, FenceObject)> {
        let mut out = Vec::new();
        for ((pool, key), o) in &self.fence_objects {
            if self.standing(pool, key, o) == Standing::Pending
                && let Some(e) = self.entry(pool, key)
            {
                out.push((pool.clone(), e.clone(), o.clone()));
            }
        }
        out
    }

    /// `IPFence` objects left over (their entry is gone or someone else's), as (name, uid).
    pub fn stale_fence_objects(&self) -> Vec<(String, String)> {
        self.fence_objects
            .iter()
            .filter(|((pool, key), o)| self.standing(pool, key, o) == Standing::Stale)
            .map(|(_, o)| (o.name.clone(), o.uid.clone()))
            .collect()
    }

    /// Fence annotations (from earlier releases) whose entry is gone or no longer fenced, by
    /// pool, as (key, stored value).
    pub fn stale_fence_annotations(&self) -> BTreeMap<String, Vec<(String, String)>> {
        let mut out: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for (name, p) in &self.pools {
            for (key, r) in &p.annotation_fences {
                let fenced = p
                    .marked
                    .get(key)
                    .is_some_and(|e| e.podref == fenced_podref(&r.podref));
                if !fenced && let Some(v) = p.annotation_values.get(key) {
                    out.entry(name.clone())
                        .or_default()
                        .push((key.clone(), v.clone()));
                }
            }
        }
        out
    }

    /// The deleted pods (podrefs) whose addresses are fenced or pending: their reservations
    /// go with the fence's release.
    pub fn fenced_podrefs(&self) -> HashSet<&str> {
        let objects = self
            .fence_objects
            .values()
            .map(|o| o.record.podref.as_str());
        let annotations = self
            .pools
            .values()
            .flat_map(|p| p.annotation_fences.values().map(|r| r.podref.as_str()));
        objects.chain(annotations).collect()
    }
}
