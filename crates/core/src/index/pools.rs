//! Pools with their parsed allocations, and the podref -> allocation index.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::api::IPPool;
use crate::ipam::cooldown::{BadCooldown, cooldown_until, cooled_pod, is_cooling};
use crate::ipam::entry_key::EntryKey;
use crate::ipam::fence::FENCED_PODREF_SUFFIX;
use crate::ipam::pool::offset_of;
use crate::ipam::{PoolEntry, pool_allocations};

use super::pods::TombstoneEntry;
use crate::ipam::own_write::OWN_WRITE_ANNOTATION;

/// A pool, parsed.
#[derive(Debug, Clone)]
pub struct PoolInfo {
    /// Pool name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// Usable entries by key.
    pub entries: Entries,
    /// What cannot be read: entries (left alone) or the whole range.
    pub problems: Vec<String>,
    /// The range could not be parsed at all.
    pub bad_range: bool,
    /// The range, when it parses.
    pub range: Option<IpNet>,
    /// Entries marked fenced (podref `<podref>:fenced`) by key; their records are `IPFence`
    /// objects (see [`super::Index::fenced`]).
    pub marked: BTreeMap<String, PoolEntry>,
    /// Entries released into their cooldown (podref `<podref>:cooldown`) by key: neither live
    /// allocations nor leaks; the leader removes each once its cooldown is over.
    pub cooling: BTreeMap<String, CoolingEntry>,
    /// The pool has an annotations map.
    pub has_annotations: bool,
    /// An operator's approval of the breaker's hold ([`APPROVE_HOLD_ANNOTATION`]'s value).
    pub approval: Option<String>,
    /// Some key is not its offset's plain decimal (`010`): [`PoolInfo::entry_at`] then reads
    /// every entry instead of looking its key up.
    pub odd_keys: bool,
    /// The signature of ipreclaim's last write of a marked entry (see `ipam::own_write`).
    pub own_write: Option<String>,
    /// Its marked entries as observed (the writer's updates leave this alone).
    pub seen: SeenMarks,
}

/// The annotation on an IPPool with which an operator lets the breaker release the held set
/// of its sweep once (the controller removes it after that sweep; `ipreclaim approve-hold`
/// sets it).
pub const APPROVE_HOLD_ANNOTATION: &str = "ipreclaim.io/approve-hold";

impl PoolInfo {
    /// Parses a pool.
    pub fn parse(pool: &IPPool) -> PoolInfo {
        let name = pool.metadata.name.clone().unwrap_or_default();
        let (entries, problems, range) = match pool_allocations(&pool.spec) {
            Ok(p) => (
                p.entries,
                p.problems.iter().map(ToString::to_string).collect(),
                Some(p.range),
            ),
            Err(e) => (Vec::new(), vec![e.to_string()], None),
        };
        let annotations = pool.metadata.annotations.as_ref();
        // A marked entry is the fence's, whether or not its record is known yet. Split as
        // Vecs and collected once each: a map collected whole is built with full nodes, one
        // filled an insert at a time is left about half empty (a third more memory).
        // Keys are plain digits: only a leading zero makes one that is not its offset's.
        let odd_keys = entries
            .iter()
            .any(|e| e.key.len() > 1 && e.key.starts_with('0'));
        let (marked, entries): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .partition(|e| e.podref.ends_with(FENCED_PODREF_SUFFIX));
        let (cooling, entries): (Vec<_>, Vec<_>) =
            entries.into_iter().partition(|e| is_cooling(&e.podref));
        let marked: BTreeMap<String, PoolEntry> =
            marked.into_iter().map(|e| (e.key.to_string(), e)).collect();
        let entries = Entries::new(entries);
        let cooling: BTreeMap<String, CoolingEntry> = cooling
            .into_iter()
            .map(|e| (e.key.to_string(), CoolingEntry::of(e)))
            .collect();
        let mut problems = problems;
        problems.extend(cooling.values().filter_map(|c| {
            Some(format!(
                "allocation {}: {}",
                c.entry.key,
                c.until.as_ref().err()?
            ))
        }));
        let own_write = annotations.and_then(|a| a.get(OWN_WRITE_ANNOTATION).cloned());
        let mut info = PoolInfo {
            name,
            cooling,
            uid: pool.metadata.uid.clone().unwrap_or_default(),
            entries,
            problems,
            bad_range: range.is_none(),
            range,
            marked,
            has_annotations: annotations.is_some(),
            approval: annotations.and_then(|a| a.get(APPROVE_HOLD_ANNOTATION).cloned()),
            odd_keys,
            own_write,
            seen: SeenMarks::default(),
        };
        info.seen = SeenMarks::of(&info);
        info
    }

    /// The entry for `ip` (usable, fenced or cooling), found by its key: the address's offset in
    /// the range.
    pub fn entry_at(&self, ip: IpAddr) -> Option<&PoolEntry> {
        if self.odd_keys {
            let all = self.entries.values().chain(self.marked.values());
            return all
                .chain(self.cooling.values().map(|c| &c.entry))
                .find(|e| e.ip.to_canonical() == ip);
        }
        let key = offset_of(self.range.as_ref()?, ip)?.to_string();
        let found = self.entries.get(&key).or_else(|| self.marked.get(&key));
        found
            .or_else(|| self.cooling.get(&key).map(|c| &c.entry))
            .filter(|e| e.ip.to_canonical() == ip)
    }
}

/// An entry released into its cooldown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoolingEntry {
    /// The entry as stored (id: the marker; podref: `<pod>:cooldown`).
    pub entry: PoolEntry,
    /// The pod that held it (`namespace/name`): its reservation still names it.
    pub pod: String,
    /// When the cooldown ends, or why that cannot be read (then it is kept, and reported).
    pub until: Result<jiff::Timestamp, BadCooldown>,
}

impl CoolingEntry {
    /// A cooling entry as stored.
    pub fn of(entry: PoolEntry) -> CoolingEntry {
        CoolingEntry {
            pod: cooled_pod(&entry.podref).to_owned(),
            until: cooldown_until(&entry.id),
            entry,
        }
    }

    /// Its end, if its marker's end has passed at `now` (one whose end cannot be read never
    /// has: it is kept and reported).
    pub fn ended_by(&self, now: jiff::Timestamp) -> Option<jiff::Timestamp> {
        let until = *self.until.as_ref().ok()?;
        crate::ipam::cooldown::is_due(until, now).then_some(until)
    }
}

/// A pool's usable entries, sorted by key (as a `BTreeMap` keyed by it orders them), in one
/// vector: each entry names its key already, so no second copy of it is kept, and a vector
/// has no tree nodes around its elements (about 60 bytes an entry less: 6 MB at 100,000).
/// A removal moves the entries after it (a pool of 5,000 is about 700 KB; removals are one
/// per released address).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entries {
    sorted: Vec<PoolEntry>,
}

impl Entries {
    /// The entries, by key; of two with one key the later is kept (as a map collected from
    /// them would).
    pub fn new(mut entries: Vec<PoolEntry>) -> Entries {
        // Stable: entries of one key stay in their order, and the last of each run is kept.
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let mut sorted: Vec<PoolEntry> = Vec::with_capacity(entries.len());
        for e in entries {
            match sorted.last_mut() {
                Some(last) if last.key == e.key => *last = e,
                _ => sorted.push(e),
            }
        }
        sorted.shrink_to_fit();
        Entries { sorted }
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.sorted.binary_search_by(|e| e.key.as_str().cmp(key))
    }

    /// The entry at `key`.
    pub fn get(&self, key: &str) -> Option<&PoolEntry> {
        self.position(key).ok().map(|i| &self.sorted[i])
    }

    /// Whether an entry is at `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.position(key).is_ok()
    }

    /// Removes the entry at `key`.
    pub fn remove(&mut self, key: &str) -> Option<PoolEntry> {
        let i = self.position(key).ok()?;
        Some(self.sorted.remove(i))
    }

    /// The entries, by key.
    pub fn values(&self) -> std::slice::Iter<'_, PoolEntry> {
        self.sorted.iter()
    }

    /// The entries with their keys, by key.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&str, &PoolEntry)> {
        self.sorted.iter().map(|e| (e.key.as_str(), e))
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &str> {
        self.sorted.iter().map(|e| e.key.as_str())
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }
}

/// An allocation's place: pool and key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Pool name.
    pub pool: String,
    /// Entry key (offset).
    pub key: String,
}

impl Slot {
    /// The slot of entry `key` of `pool`.
    pub fn new(pool: &str, key: &str) -> Slot {
        Slot {
            pool: pool.to_owned(),
            key: key.to_owned(),
        }
    }
}

/// An allocation's place as the podref index keeps it: the pool's name is shared by all its
/// slots (one copy per pool, not per allocation), the key kept inline.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotRef {
    pool: Arc<str>,
    key: EntryKey,
}

/// The slots of one podref: a pod has one allocation or a few, so the first is kept inline
/// (100,000 single-element Vecs cost megabytes).
#[derive(Debug, Clone)]
enum Slots {
    One(SlotRef),
    Many(Vec<SlotRef>),
}

impl Slots {
    fn as_slice(&self) -> &[SlotRef] {
        match self {
            Slots::One(s) => std::slice::from_ref(s),
            Slots::Many(v) => v,
        }
    }

    /// Adds `slot` unless it is there; in order.
    fn add(&mut self, slot: SlotRef) {
        if self.as_slice().contains(&slot) {
            return;
        }
        match self {
            Slots::One(first) => *self = Slots::Many(vec![first.clone(), slot]),
            Slots::Many(v) => v.push(slot),
        }
    }

    /// Removes the slot of `pool` and `key`; whether none is left.
    fn remove(&mut self, pool: &str, key: &str) -> bool {
        let is = |s: &SlotRef| (&*s.pool, s.key.as_str()) == (pool, key);
        match self {
            Slots::One(s) => is(s),
            Slots::Many(v) => {
                v.retain(|s| !is(s));
                v.is_empty()
            }
        }
    }
}

/// Pools and the podref index.
#[derive(Debug, Default)]
pub struct PoolIndex {
    pools: HashMap<String, PoolInfo>,
    /// The slots of each podref's allocations, by a hash of the podref: each entry names its
    /// podref already, so the index keeps no second copy of it (100,000 strings). Podrefs
    /// whose hashes collide share a list; a lookup keeps the slots whose entry names it.
    by_podref: HashMap<u64, Slots>,
    /// The hash of `by_podref` (seeded per process, like a `HashMap`'s).
    hasher: RandomState,
    /// The pools were listed once (a pool unknown since is gone, and its fence records left
    /// over).
    listed: bool,
}

impl PoolIndex {
    fn podref_hash(&self, podref: &str) -> u64 {
        self.hasher.hash_one(podref)
    }

    /// Replaces a pool's parsed contents and its podref index.
    pub fn upsert(&mut self, info: PoolInfo) {
        self.remove(&info.name);
        let pool: Arc<str> = info.name.as_str().into();
        for e in info.entries.values() {
            let slot = SlotRef {
                pool: pool.clone(),
                key: EntryKey::new(&e.key),
            };
            let hash = self.podref_hash(&e.podref);
            match self.by_podref.get_mut(&hash) {
                Some(slots) => slots.add(slot),
                None => {
                    self.by_podref.insert(hash, Slots::One(slot));
                }
            }
        }
        self.pools.insert(info.name.clone(), info);
    }

    /// Forgets a pool.
    pub fn remove(&mut self, name: &str) {
        if let Some(old) = self.pools.remove(name) {
            for e in old.entries.values() {
                self.unindex(&e.podref, name, &e.key);
            }
        }
    }

    fn unindex(&mut self, podref: &str, pool: &str, key: &str) {
        let hash = self.podref_hash(podref);
        if let Some(slots) = self.by_podref.get_mut(&hash)
            && slots.remove(pool, key)
        {
            self.by_podref.remove(&hash);
        }
    }

    /// Removes one entry after a successful release or fence (the watch will confirm).
    pub fn forget_entry(&mut self, pool: &str, key: &str) -> Option<PoolEntry> {
        let e = self.pools.get_mut(pool)?.entries.remove(key)?;
        self.unindex(&e.podref, pool, key);
        Some(e)
    }

    /// Marks an entry fenced with `podref` rewritten (after its fence was written).
    pub fn mark(&mut self, pool: &str, key: &str, fenced_podref: String) {
        if let Some(mut entry) = self.forget_entry(pool, key)
            && let Some(p) = self.pools.get_mut(pool)
        {
            entry.podref = fenced_podref;
            p.marked.insert(key.to_owned(), entry);
        }
    }

    /// Moves a released entry (live or fenced) to the cooling ones, rewritten as `cooled`.
    pub fn cool(&mut self, pool: &str, key: &str, cooled: PoolEntry) {
        self.forget_entry(pool, key);
        if let Some(p) = self.pools.get_mut(pool) {
            p.marked.remove(key);
            p.cooling.insert(key.to_owned(), CoolingEntry::of(cooled));
        }
    }

    /// Forgets a cooling entry after its removal was written.
    pub fn forget_cooling(&mut self, pool: &str, key: &str) {
        if let Some(p) = self.pools.get_mut(pool) {
            p.cooling.remove(key);
        }
    }

    /// Forgets a fenced entry after its release was written (its record object goes when
    /// its delete is seen).
    pub fn forget_fenced(&mut self, pool: &str, key: &str) {
        if let Some(p) = self.pools.get_mut(pool) {
            p.marked.remove(key);
        }
    }

    /// The pools have been listed once: a pool not known since is gone.
    pub fn set_listed(&mut self) {
        self.listed = true;
    }

    /// Whether the pools have been listed once.
    pub fn listed(&self) -> bool {
        self.listed
    }

    /// A pool by name.
    pub fn get(&self, name: &str) -> Option<&PoolInfo> {
        self.pools.get(name)
    }

    /// Pools by name.
    pub fn all(&self) -> &HashMap<String, PoolInfo> {
        &self.pools
    }

    /// A pool's entry by key.
    pub fn entry(&self, pool: &str, key: &str) -> Option<&PoolEntry> {
        self.pools.get(pool)?.entries.get(key)
    }

    /// The slots of `podref`'s allocations: pool and key.
    pub fn slots<'a>(&'a self, podref: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let slots = self
            .by_podref
            .get(&self.podref_hash(podref))
            .map_or(&[][..], Slots::as_slice);
        slots
            .iter()
            .map(|s| (&*s.pool, s.key.as_str()))
            .filter(move |(pool, key)| self.entry(pool, key).is_some_and(|e| e.podref == podref))
    }

    /// Whether `podref` holds any allocation.
    pub fn has_allocations(&self, podref: &str) -> bool {
        self.slots(podref).next().is_some()
    }

    /// Podrefs that have allocations.
    pub fn allocated_podrefs(&self) -> Vec<String> {
        let podrefs: std::collections::BTreeSet<&str> = self
            .by_podref
            .values()
            .flat_map(Slots::as_slice)
            .filter_map(|s| Some(self.entry(&s.pool, s.key.as_str())?.podref.as_str()))
            .collect();
        podrefs.into_iter().map(str::to_owned).collect()
    }

    /// The allocations `podref` holds now.
    pub fn entries_of(&self, podref: &str) -> Vec<TombstoneEntry> {
        self.slots(podref)
            .filter_map(|(pool, key)| {
                Some(TombstoneEntry {
                    pool: pool.to_owned(),
                    key: key.to_owned(),
                    id: self.entry(pool, key)?.id.clone(),
                })
            })
            .collect()
    }

    /// The pools whose range holds `ip` (where an allocation of it can be).
    pub fn containing(&self, ip: IpAddr) -> Vec<String> {
        let mut names: Vec<String> = self
            .pools
            .iter()
            .filter(|(_, p)| p.range.is_some_and(|r| r.contains(&ip)))
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// The entry of `podref` that holds `ip` now, in any pool.
    pub fn holder(&self, podref: &str, ip: IpAddr) -> Option<&PoolEntry> {
        self.slots(podref)
            .filter_map(|(pool, key)| self.entry(pool, key))
            .find(|e| e.ip == ip)
    }
}

/// What kind of marked entry: one another writer may remove (see `other_writers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MarkedKind {
    /// A fenced entry (`ns/name:fenced`).
    Fenced,
    /// An entry in its release cooldown (`ns/name:cooldown`).
    Cooling,
}

impl MarkedKind {
    /// The `kind` label of the metric, and the word in Events.
    pub fn as_str(self) -> &'static str {
        match self {
            MarkedKind::Fenced => "fenced",
            MarkedKind::Cooling => "cooling",
        }
    }
}

/// A pool's marked entries and own-write signature as the watch last observed them: the
/// writer's own updates of the index (a fence marked, a release forgotten, ahead of the watch)
/// never touch it, so a watch event that still shows the older state is no change.
#[derive(Debug, Clone, Default)]
pub struct SeenMarks {
    /// The pool's own-write signature.
    pub signature: Option<String>,
    /// Its marked entries with their kind, by key.
    pub entries: std::collections::BTreeMap<String, (PoolEntry, MarkedKind)>,
}

impl SeenMarks {
    /// What `pool`, just parsed from an observation, holds marked.
    pub fn of(pool: &PoolInfo) -> SeenMarks {
        let fenced = pool
            .marked
            .iter()
            .map(|(k, e)| (k.clone(), (e.clone(), MarkedKind::Fenced)));
        let cooling = pool
            .cooling
            .iter()
            .map(|(k, c)| (k.clone(), (c.entry.clone(), MarkedKind::Cooling)));
        SeenMarks {
            signature: pool.own_write.clone(),
            entries: fenced.chain(cooling).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, id: &str) -> PoolEntry {
        PoolEntry {
            key: key.into(),
            offset: 0,
            ip: "192.0.2.1".parse().unwrap(),
            id: id.to_owned(),
            podref: "ns/pod".to_owned(),
            ifname: None,
        }
    }

    #[test]
    fn entries_are_kept_and_found_by_key_in_a_maps_order() {
        let keys = ["10", "2", "010", "1", "200"];
        let entries = Entries::new(keys.iter().map(|k| entry(k, k)).collect());
        // As a BTreeMap<String, _> orders them: by the key's text.
        let map: BTreeMap<&str, ()> = keys.iter().map(|k| (*k, ())).collect();
        assert!(entries.keys().eq(map.keys().copied()));
        for k in keys {
            assert_eq!(entries.get(k).map(|e| e.id.as_str()), Some(k));
        }
        assert_eq!(entries.get("3"), None);
        assert_eq!(entries.get(""), None);
        assert_eq!(entries.len(), 5);
    }

    #[test]
    fn of_two_entries_with_one_key_the_later_is_kept_as_a_map_keeps_it() {
        let entries = Entries::new(vec![
            entry("7", "first"),
            entry("3", "x"),
            entry("7", "second"),
        ]);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries.get("7").unwrap().id, "second");
    }

    #[test]
    fn a_removed_entry_is_gone_and_the_others_stay_found() {
        let mut entries = Entries::new((1..=20).map(|i| entry(&i.to_string(), "s")).collect());
        assert_eq!(entries.remove("13").map(|e| e.key), Some("13".into()));
        assert_eq!(entries.remove("13"), None);
        assert!(!entries.contains_key("13"));
        for i in (1..=20).filter(|i| *i != 13) {
            assert!(entries.contains_key(&i.to_string()), "{i}");
        }
        assert_eq!(entries.len(), 19);
    }
}
