//! What the controller knows, stripped to what decisions need: one sub-index per kind (live
//! pods and tombstones, pools, networks, reservations, fence records, objects that do not fit
//! their type, Nodes), the judgement that reads them, the addresses two live pods list
//! (`duplicates`: reported, never judged), and the one re-list driver that feeds
//! them (`relist`, with each kind's rules in `kinds`).
//!
//! Pure: no tokio, no client. The watches (`controller::watch`) feed it through
//! [`relist::Relist`]; the workers read it under one short lock per decision; the writer keeps
//! it in step with what it wrote through [`Index`]'s own methods (`fenced_written`,
//! `released`). May import `api`, `ipam` and `reclaim`, nothing above.

pub mod duplicates;
pub mod fences;
pub mod invalid;
mod judge;
pub mod kinds;
mod lock;
pub mod networks;
pub mod nodes;
pub mod other_writers;
mod out_of_step;
pub mod pods;
pub mod pools;
pub mod relist;
pub mod reservations;
#[cfg(test)]
pub(crate) mod tests;
pub mod uid;

use std::net::IpAddr;
use std::time::Instant;

use crate::api::{IPPool, NetworkAttachmentDefinition, ObjectId, OverlappingRangeIPReservation};
use crate::ipam::PoolEntry;
use crate::ipam::fence::{FenceRecord, fenced_podref};

pub use duplicates::{
    Duplicate, DuplicatePod, Duplicates, EntryOwner, Listings, Shared, SharedAddress,
};
pub use fences::{FenceIndex, FenceObject, FencedEntry, PendingFence, UnrecordedMark};
pub use invalid::{InvalidIndex, InvalidKey, InvalidObject};
pub use lock::{Acquisitions, IndexLock, SharedIndex};
pub use networks::NetworkIndex;
pub use nodes::NodeIndex;
pub use other_writers::{GoneFence, MarkedGone};
pub use out_of_step::{LeftBehind, MissingReservation};
pub use pods::{
    LiveInfo, MalformedStatus, PodIndex, PodSeen, PodUid, TOMBSTONES_PER_PODREF, Tombstone,
    TombstoneEntry,
};
pub use pools::{
    APPROVE_HOLD_ANNOTATION, CoolingEntry, Entries, MarkedKind, PoolIndex, PoolInfo, Slot,
};
pub use reservations::{NamedReservation, ReservationIndex};

/// How full a pool is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolUsage {
    /// The pool.
    pub pool: String,
    /// Addresses it can hand out.
    pub size: u128,
    /// Entries (fenced and cooling ones included).
    pub allocated: usize,
    /// Fenced entries.
    pub fenced: usize,
    /// Entries in their release cooldown.
    pub cooling: usize,
    /// The networks that allocate from it.
    pub networks: Vec<String>,
}

impl PoolUsage {
    /// Addresses still free (none when more are allocated than the range holds: a range
    /// that changed under its entries).
    pub fn free(&self) -> u128 {
        self.size.saturating_sub(self.allocated as u128)
    }
}

/// The controller's view of the cluster.
#[derive(Debug, Default)]
pub struct Index {
    pods: PodIndex,
    pools: PoolIndex,
    networks: NetworkIndex,
    reservations: ReservationIndex,
    fences: FenceIndex,
    invalid: InvalidIndex,
    /// Changes to pools and NADs (see [`Index::listing_generation`]).
    pool_changes: u64,
    /// Marked entries the pool watch saw go, for the controller's next look.
    marked_gone: Vec<MarkedGone>,
    /// Those dropped because too many waited.
    marked_gone_dropped: u64,
}

impl Index {
    /// Live pods and tombstones.
    pub fn pods(&self) -> &PodIndex {
        &self.pods
    }

    /// Pools and the podref index.
    pub fn pools(&self) -> &PoolIndex {
        &self.pools
    }

    /// NADs and their pools.
    pub fn networks(&self) -> &NetworkIndex {
        &self.networks
    }

    /// Reservations.
    pub fn reservations(&self) -> &ReservationIndex {
        &self.reservations
    }

    /// `IPFence` objects.
    pub fn fence_objects(&self) -> &FenceIndex {
        &self.fences
    }

    /// Objects skipped because they do not fit their type.
    pub fn invalid(&self) -> &InvalidIndex {
        &self.invalid
    }

    /// Grows with every change to what live pods list, to pools and to NADs: a look that
    /// reads only these (duplicate addresses) gives the same answer while it stays.
    pub fn listing_generation(&self) -> u64 {
        self.pods.listing_changes() + self.pool_changes
    }

    /// Records a live pod; returns a tombstone if it replaced a pod of the same podref with
    /// another uid (a deletion whose event was missed).
    pub fn upsert_pod(
        &mut self,
        podref: &str,
        uid: &str,
        seen: PodSeen<'_>,
        now: Instant,
    ) -> Option<Tombstone> {
        let old = self.pods.upsert(podref, uid, seen, now)?;
        Some(self.bury(podref, old.into(), now))
    }

    /// Buries `gone` with the entries of `podref` now.
    fn bury(&mut self, podref: &str, gone: pods::GonePod, now: Instant) -> Tombstone {
        let entries = self.pools.entries_of(podref);
        self.pods.bury(podref, gone, entries, now)
    }

    /// Records a deleted pod (from its final state); returns the tombstone (a static pod's
    /// mirror's says so: its deletion stops nothing, see `controller::plan`).
    pub fn delete_pod(
        &mut self,
        podref: &str,
        uid: &str,
        seen: PodSeen<'_>,
        now: Instant,
    ) -> Option<Tombstone> {
        let known = self.pods.remove_live(podref, uid);
        let gone = self.pods.final_state(uid, known, seen);
        Some(self.bury(podref, gone, now))
    }

    /// A pod that vanished without a Delete event (watch gap): tombstone from what was known.
    pub fn vanish_pod(&mut self, podref: &str, uid: &str, now: Instant) -> Option<Tombstone> {
        let live = self.pods.remove_live(podref, uid)?;
        Some(self.bury(podref, live.into(), now))
    }

    /// Records, on the tombstones of `podref` just made, why their node was not trusted then.
    pub fn judge_deleted_nodes(
        &mut self,
        podref: &str,
        distrust: impl Fn(&Tombstone) -> Option<String>,
    ) {
        self.pods.judge_deleted_nodes(podref, distrust);
    }

    /// Forgets the tombstones of `podref` seen at or before `upto`.
    pub fn clear_tombstones(&mut self, podref: &str, upto: Instant) {
        self.pods.clear_tombstones(podref, upto);
    }

    /// Forgets tombstones older than `before` whose podref has no allocation left (see
    /// [`PodIndex::expire_tombstones`]).
    pub fn expire_tombstones(&mut self, before: Instant) {
        let pools = &self.pools;
        self.pods
            .expire_tombstones(before, |podref| pools.has_allocations(podref));
    }

    /// Forgets listings older than `before`.
    pub fn expire_listings(&mut self, before: Instant) {
        self.pods.expire_listings(before);
    }

    /// Replaces a pool's parsed contents and its podref index; notes the marked entries that
    /// went since its last observation (see [`Index::take_marked_gone`]).
    pub fn upsert_pool(&mut self, pool: &IPPool) {
        self.pool_changes += 1;
        let info = PoolInfo::parse(pool);
        if let Some(old) = self.pools.get(&info.name) {
            let gone = other_writers::marked_gone(&old.seen, &info, |key, entry| {
                let o = self.record_of(&old.name, key, entry)?;
                Some(GoneFence {
                    node: o.record.node.clone(),
                    object: o.id(),
                })
            });
            let room = other_writers::MAX_WAITING.saturating_sub(self.marked_gone.len());
            self.marked_gone_dropped += gone.len().saturating_sub(room) as u64;
            self.marked_gone.extend(gone.into_iter().take(room));
        }
        self.networks.pool_added(&info.name, info.range);
        self.pools.upsert(info);
    }

    /// The marked entries the pool watch saw go since the last call, and how many more were
    /// dropped meanwhile (too many waited).
    pub fn take_marked_gone(&mut self) -> (Vec<MarkedGone>, u64) {
        let dropped = std::mem::take(&mut self.marked_gone_dropped);
        (std::mem::take(&mut self.marked_gone), dropped)
    }

    /// Forgets a pool.
    pub fn remove_pool(&mut self, name: &str) {
        self.pool_changes += 1;
        self.networks.pool_removed(name);
        self.pools.remove(name);
    }

    /// The pools have been listed once: a pool not known since is gone.
    pub fn set_pools_listed(&mut self) {
        self.pools.set_listed();
    }

    /// A pool's entry by key.
    pub fn entry(&self, pool: &str, key: &str) -> Option<&PoolEntry> {
        self.pools.entry(pool, key)
    }

    /// Whether `pool` still has the allocation (`key`, `id`).
    pub fn holds(&self, pool: &str, key: &str, id: &str) -> bool {
        self.pools.entry(pool, key).is_some_and(|e| e.id == id)
    }

    /// Whether `pool` has an annotations map (a patch adding the first annotation adds it).
    pub fn has_annotations(&self, pool: &str) -> bool {
        self.pools.get(pool).is_some_and(|p| p.has_annotations)
    }

    /// Records a NAD's mapping to pools (or its config error).
    pub fn upsert_nad(&mut self, nad: &NetworkAttachmentDefinition) {
        self.pool_changes += 1;
        let pools = self
            .pools
            .all()
            .values()
            .map(|p| (p.name.as_str(), p.range));
        self.networks.upsert(nad, pools);
    }

    /// Forgets a NAD.
    pub fn remove_nad(&mut self, key: &str) {
        self.pool_changes += 1;
        self.networks.remove(key);
    }

    /// Records a reservation.
    pub fn upsert_reservation(&mut self, r: &OverlappingRangeIPReservation) {
        self.reservations.upsert(r);
    }

    /// Forgets a reservation.
    pub fn remove_reservation(&mut self, name: &str) {
        self.reservations.remove(name);
    }

    /// Records an `IPFence` object for the entry at `key` of `pool`.
    pub fn upsert_fence_object(&mut self, pool: &str, key: &str, object: FenceObject) {
        self.fences.upsert(pool, key, object);
    }

    /// Forgets the `IPFence` object `name`.
    pub fn remove_fence_object(&mut self, name: &str) {
        self.fences.remove(name);
    }

    /// Records an object that does not fit its type; whether this is news (new or changed).
    pub fn set_invalid(&mut self, key: InvalidKey, uid: String, error: String) -> bool {
        self.invalid.set(key, uid, error)
    }

    /// Forgets an invalid object (it fits now, or it is gone).
    pub fn clear_invalid(&mut self, key: &InvalidKey) {
        self.invalid.clear(key);
    }

    /// How full each pool is.
    pub fn pool_usage(&self) -> Vec<PoolUsage> {
        let mut out: Vec<PoolUsage> = self
            .pools
            .all()
            .values()
            .map(|p| PoolUsage {
                pool: p.name.clone(),
                size: self.networks.capacity_of(&p.name, p.range),
                allocated: p.entries.len() + p.marked.len() + p.cooling.len(),
                fenced: p.marked.len(),
                cooling: p.cooling.len(),
                networks: self.networks.of_pool(&p.name).unwrap_or_default().to_vec(),
            })
            .collect();
        out.sort_by(|a, b| a.pool.cmp(&b.pool));
        out
    }

    /// The pools an allocation of `ip` that a reservation of `network` (its name's network part)
    /// stands for can be in: their range holds `ip`, and they are that network's (named for it,
    /// or a node's slice of a node-slice network of that name).
    pub fn pools_of_reservation(&self, network: Option<&str>, ip: IpAddr) -> Vec<String> {
        let network = network.filter(|n| !n.is_empty());
        let mut pools = self.pools.containing(ip);
        pools.retain(|pool| {
            let range = self.pools.get(pool).and_then(|p| p.range);
            let named = range.is_some_and(|r| crate::ipam::ippool_name(&r, network, None) == *pool);
            named
                || self
                    .networks
                    .slice_network_names(pool)
                    .into_iter()
                    .any(|n| n.filter(|n| !n.is_empty()) == network)
        });
        pools
    }

    /// Reservations whose podref has no live pod and no allocation left in any pool (fenced or
    /// not): nothing can still be using them.
    pub fn orphan_reservations(&self) -> Vec<NamedReservation> {
        // A fenced entry's reservation names the deleted pod: it goes with the fence's release;
        // a cooling one's keeps the address from overlapping pools until the cooldown ends.
        let fenced = self.fenced_podrefs();
        let cooling = self.cooling_podrefs();
        self.reservations
            .iter()
            .filter(|r| {
                !self.pods.is_live(&r.podref)
                    && !self.pools.has_allocations(&r.podref)
                    && !fenced.contains(r.podref.as_str())
                    && !cooling.contains(r.podref.as_str())
            })
            .collect()
    }

    /// The writer wrote the fence of the entry at `key` of `pool` (sandbox `sandbox`) with
    /// `record`, kept in the `IPFence` `object`: the watches will confirm.
    pub fn fence_written(
        &mut self,
        pool: &str,
        key: &str,
        sandbox: &str,
        record: &FenceRecord,
        object: ObjectId,
    ) {
        self.pool_changes += 1;
        // Already marked (a late answer): only the record is news.
        self.pools.mark(pool, key, fenced_podref(&record.podref));
        let ObjectId { name, uid } = object;
        // The watch may have brought this very object with a node agent's report first (the
        // answer came late): keep the report. A report on another object never counts here.
        let evidence = self
            .fences
            .get(pool, key)
            .filter(|o| o.name == name && o.uid == uid)
            .map(|o| o.evidence.clone())
            .unwrap_or_default();
        let object = FenceObject {
            name,
            uid,
            sandbox: sandbox.to_owned(),
            record: record.clone(),
            evidence,
        };
        self.fences.upsert(pool, key, object);
    }

    /// The pods whose released addresses are cooling.
    pub fn cooling_podrefs(&self) -> std::collections::HashSet<&str> {
        self.pools
            .all()
            .values()
            .flat_map(|p| p.cooling.values().map(|c| c.pod.as_str()))
            .collect()
    }

    /// Every cooling entry, as (pool, entry), by pool and key.
    pub fn cooling(&self) -> Vec<(String, CoolingEntry)> {
        let mut out: Vec<(String, CoolingEntry)> = self
            .pools
            .all()
            .values()
            .flat_map(|p| p.cooling.values().map(|c| (p.name.clone(), c.clone())))
            .collect();
        out.sort_by(|a, b| (&a.0, a.1.entry.offset).cmp(&(&b.0, b.1.entry.offset)));
        out
    }

    /// The cooling entries whose cooldown is over at `now` (one whose end cannot be read
    /// never is: it is kept and reported).
    pub fn due_cooldowns(&self, now: jiff::Timestamp) -> Vec<(String, CoolingEntry)> {
        self.cooling()
            .into_iter()
            .filter(|(_, c)| c.ended_by(now).is_some())
            .collect()
    }

    /// The writer released the entry at `key` of `pool` into its cooldown, rewriting it as
    /// `cooled`: it is no allocation and no leak until the cooldown ends.
    pub fn cooled(&mut self, pool: &str, key: &str, cooled: PoolEntry) {
        self.pool_changes += 1;
        self.pools.forget_fenced(pool, key);
        self.pools.cool(pool, key, cooled);
    }

    /// The writer removed the cooling entry at `key` of `pool` (of pod `podref`, address
    /// `ip`): forgets it, and returns that pod's reservations for that address.
    pub fn cooldown_ended(
        &mut self,
        pool: &str,
        key: &str,
        podref: &str,
        ip: IpAddr,
    ) -> Vec<ObjectId> {
        self.pool_changes += 1;
        self.pools.forget_cooling(pool, key);
        self.reservations.of(podref, ip)
    }

    /// The writer released the entry at `key` of `pool` (held by `podref`, address `ip`):
    /// forgets it, and returns that pod's reservations for that address.
    pub fn released(&mut self, pool: &str, key: &str, podref: &str, ip: IpAddr) -> Vec<ObjectId> {
        self.pool_changes += 1;
        self.pools.forget_entry(pool, key);
        self.pools.forget_fenced(pool, key);
        self.reservations.of(podref, ip)
    }
}
