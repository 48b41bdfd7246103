//! What the controller knows, stripped to what decisions need: live pods by podref,
//! tombstones of deleted pods, pools with their parsed allocations, the podref -> allocation
//! index, the NAD -> pool mapping (node-slice pools matched by name and range), and
//! reservations.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use ipnet::IpNet;

use crate::api::{IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};
pub use crate::ipam::fence::FenceSource;
use crate::ipam::fence::{
    BadFence, FENCED_PODREF_SUFFIX, FenceRecord, fence_annotation_key, fenced_podref, pool_fences,
};
use crate::ipam::{
    NetworkAttachment, PoolEntry, is_node_slice_pool, parse_nad_config, parse_network_status,
    pool_allocations, reservation_name, reservation_prefixes,
};
use crate::reclaim::{
    self, Allocation, Decision, DeletedPod, LivePod, PodKnowledge, PodPhase, PoolContext,
    ReclaimConfig,
};
pub use crate::release::{Judged, PodRef};

mod fences;

/// Tombstones kept per podref at most (the newest).
pub const TOMBSTONES_PER_PODREF: usize = 16;

/// A live pod, stripped.
#[derive(Debug, Clone)]
pub struct LiveInfo {
    /// Uid.
    pub uid: String,
    /// Secondary networks, `None` when the annotation is missing or malformed.
    pub networks: Option<Arc<[NetworkAttachment]>>,
    /// Why the annotation, present, cannot be read.
    pub malformed_status: Option<String>,
    /// The node it is bound to.
    pub node: Option<Arc<str>>,
    /// Succeeded or Failed.
    pub terminal: bool,
}

/// What one observation of a pod says.
#[derive(Debug, Clone, Copy, Default)]
pub struct PodSeen<'a> {
    /// Its annotations (network-status).
    pub annotations: Option<&'a BTreeMap<String, String>>,
    /// The node it is bound to.
    pub node: Option<&'a str>,
    /// Succeeded or Failed.
    pub terminal: bool,
}

/// A deleted pod waiting for its addresses to be released.
#[derive(Debug, Clone)]
pub struct Tombstone {
    /// Uid (empty when unknown).
    pub uid: String,
    /// Secondary networks it listed, `None` when it had no (readable) network-status.
    pub networks: Option<Arc<[NetworkAttachment]>>,
    /// When the deletion was seen.
    pub seen_at: Instant,
    /// The node it was bound to: a node that is not Ready may still run its sandbox.
    pub node: Option<Arc<str>>,
    /// The allocations of its podref when the deletion was seen (no other pod of that name
    /// existed then): a fence follows them whatever the cache holds later.
    pub held: Vec<HeldEntry>,
    /// Why its node was not trusted when the deletion was seen (`None`: trusted, or fencing
    /// off): the fence follows from that, even if the node is Ready by the time it is judged.
    pub distrust: Option<String>,
    /// `distrust` was set (it is set once, as the deletion is seen).
    pub node_judged: bool,
}

/// An allocation as it was: pool, key and sandbox id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldEntry {
    /// Pool name.
    pub pool: String,
    /// Entry key (offset).
    pub key: String,
    /// Sandbox id.
    pub id: String,
}

/// An object that does not fit its type: kind, namespace, name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InvalidKey {
    /// Its kind.
    pub kind: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// Why an object does not fit, and its uid (for an Event on it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidObject {
    /// Its uid.
    pub uid: String,
    /// What is wrong.
    pub error: String,
}

/// A pool, parsed.
#[derive(Debug, Clone)]
pub struct PoolInfo {
    /// Pool name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// Usable entries by key.
    pub entries: BTreeMap<String, PoolEntry>,
    /// What cannot be read: entries (left alone) or the whole range.
    pub problems: Vec<String>,
    /// The range could not be parsed at all.
    pub bad_range: bool,
    /// The range, when it parses.
    pub range: Option<IpNet>,
    /// Entries marked fenced (podref `<podref>:fenced`) by key; their records are fence
    /// objects or, from earlier releases, pool annotations (see [`State::fenced`]).
    pub marked: BTreeMap<String, PoolEntry>,
    /// Fence records from earlier releases, in pool annotations, by key.
    pub annotation_fences: BTreeMap<String, FenceRecord>,
    /// Those annotations' values as stored (a removal `test`s them).
    pub annotation_values: BTreeMap<String, String>,
    /// Fence annotations that cannot be read.
    pub bad_fences: Vec<BadFence>,
    /// The pool has an annotations map.
    pub has_annotations: bool,
}

/// A fenced allocation.
#[derive(Debug, Clone)]
pub struct FencedEntry {
    /// The entry as stored (podref rewritten).
    pub entry: PoolEntry,
    /// Whose it was, where and since when.
    pub record: FenceRecord,
    /// Where the record is kept.
    pub source: FenceSource,
    /// The node agent's report on its object, if any (checked before it counts).
    pub evidence: Option<crate::api::SandboxesGone>,
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
    /// The node agent's report (its status), if any.
    pub evidence: Option<crate::api::SandboxesGone>,
}

/// A reservation, stripped.
#[derive(Debug, Clone)]
pub struct ReservationInfo {
    /// Its uid (for the delete precondition).
    pub uid: String,
    /// The podref it names.
    pub podref: String,
}

/// The controller's view of the cluster.
#[derive(Debug, Default)]
pub struct State {
    live: HashMap<String, LiveInfo>,
    /// Node names, shared by the pods on each node.
    node_names: HashSet<Arc<str>>,
    tombstones: HashMap<String, Vec<Tombstone>>,
    pools: HashMap<String, PoolInfo>,
    /// (pool, key) of each podref's allocations: a Vec, as a pod has one or two (20,000 small
    /// sets would cost megabytes).
    by_podref: HashMap<String, Vec<(String, String)>>,
    /// Pool name -> networks (`ns/nad`) that allocate from it.
    pool_networks: HashMap<String, Vec<String>>,
    /// NAD (`ns/name`) -> pool names it maps to.
    nad_pools: HashMap<String, Vec<String>>,
    /// Node-slice NADs (`ns/name`) -> (network_name, whole range): their pools are named per
    /// node, so they are matched as pools come.
    slice_nads: HashMap<String, (Option<String>, IpNet)>,
    /// Pool name -> node-slice networks it is a node's slice of (used when `pool_networks`
    /// has no exact entry).
    slice_networks: HashMap<String, Vec<String>>,
    /// NADs whose config cannot be used, with the error.
    pub nad_errors: HashMap<String, String>,
    reservations: HashMap<String, ReservationInfo>,
    /// The `<network_name>` parts of reservation names, with how many names have each: a
    /// release looks its reservations up by name instead of scanning them all.
    reservation_prefixes: HashMap<String, usize>,
    /// Objects skipped because they do not fit their type.
    invalid: BTreeMap<InvalidKey, InvalidObject>,
    /// When each podref's network-status last listed each address: any such observation
    /// restarts a leak's grace, not only the sweep's samples.
    listed_at: HashMap<String, Vec<(IpAddr, Instant)>>,
    /// `IPFence` objects by (pool, key).
    fence_objects: HashMap<(String, String), FenceObject>,
    /// The pools were listed once (a pool unknown since is gone, and its fence records left
    /// over).
    pools_listed: bool,
}

fn networks_of(
    annotations: Option<&BTreeMap<String, String>>,
) -> (Option<Arc<[NetworkAttachment]>>, Option<String>) {
    match annotations.and_then(|a| a.get(crate::ipam::NETWORK_STATUS_ANNOTATION)) {
        None => (None, None),
        Some(s) => match parse_network_status(s) {
            Ok(n) => (Some(n.into()), None),
            Err(e) => (None, Some(e.to_string())),
        },
    }
}

impl State {
    /// The shared copy of a node name.
    fn node_name(&mut self, node: Option<&str>) -> Option<Arc<str>> {
        let node = node?;
        if let Some(n) = self.node_names.get(node) {
            return Some(n.clone());
        }
        let n: Arc<str> = node.into();
        self.node_names.insert(n.clone());
        Some(n)
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
        let (networks, malformed_status) = networks_of(seen.annotations);
        // An address the same pod listed and lists no more was listed until now: the leak
        // grace of that address starts again. (While listed it is kept anyway, so only drops
        // are recorded: a record per pod would cost megabytes at scale.)
        if let Some(old) = self.live.get(podref).filter(|l| l.uid == uid)
            && let Some(old_nets) = &old.networks
        {
            let lists = |ip: &IpAddr| {
                networks
                    .as_deref()
                    .is_some_and(|n| n.iter().any(|n| n.ips.contains(ip)))
            };
            let dropped: Vec<IpAddr> = old_nets
                .iter()
                .flat_map(|n| n.ips.iter())
                .filter(|ip| !lists(ip))
                .copied()
                .collect();
            if !dropped.is_empty() {
                let listed = self.listed_at.entry(podref.to_owned()).or_default();
                for ip in dropped {
                    match listed.iter_mut().find(|(i, _)| *i == ip) {
                        Some((_, at)) => *at = now,
                        None => listed.push((ip, now)),
                    }
                }
            }
        }
        let info = LiveInfo {
            uid: uid.to_owned(),
            networks,
            malformed_status,
            node: self.node_name(seen.node),
            terminal: seen.terminal,
        };
        let old = self.live.insert(podref.to_owned(), info)?;
        (old.uid != uid).then(|| self.bury(podref, old, now))
    }

    /// The allocations `podref` holds now.
    fn held_by(&self, podref: &str) -> Vec<HeldEntry> {
        let keys = self.by_podref.get(podref).map(Vec::as_slice).unwrap_or(&[]);
        keys.iter()
            .filter_map(|(pool, key)| {
                Some(HeldEntry {
                    pool: pool.clone(),
                    key: key.clone(),
                    id: self.entry(pool, key)?.id.clone(),
                })
            })
            .collect()
    }

    fn bury(&mut self, podref: &str, old: LiveInfo, now: Instant) -> Tombstone {
        let t = Tombstone {
            uid: old.uid,
            networks: old.networks,
            seen_at: now,
            node: old.node,
            held: self.held_by(podref),
            distrust: None,
            node_judged: false,
        };
        self.tombstones
            .entry(podref.to_owned())
            .or_default()
            .push(t.clone());
        t
    }

    /// Records a deleted pod (from its final state); returns the tombstone.
    pub fn delete_pod(
        &mut self,
        podref: &str,
        uid: &str,
        seen: PodSeen<'_>,
        now: Instant,
    ) -> Tombstone {
        let known = match self.live.get(podref) {
            Some(l) if l.uid == uid => self.live.remove(podref).and_then(|l| l.node),
            _ => None,
        };
        let (networks, _) = networks_of(seen.annotations);
        let node = self.node_name(seen.node).or(known);
        let t = Tombstone {
            uid: uid.to_owned(),
            networks,
            seen_at: now,
            node,
            held: self.held_by(podref),
            distrust: None,
            node_judged: false,
        };
        self.tombstones
            .entry(podref.to_owned())
            .or_default()
            .push(t.clone());
        t
    }

    /// A pod that vanished without a Delete event (watch gap): tombstone from what was known.
    pub fn vanish_pod(&mut self, podref: &str, uid: &str, now: Instant) -> Option<Tombstone> {
        let live = self.live.get(podref).filter(|l| l.uid == uid)?.clone();
        self.live.remove(podref);
        Some(self.bury(podref, live, now))
    }

    /// Records, on the tombstones of `podref` just made, why their node was not trusted then.
    pub fn judge_deleted_nodes(
        &mut self,
        podref: &str,
        distrust: impl Fn(Option<&str>) -> Option<String>,
    ) {
        for t in self.tombstones.get_mut(podref).into_iter().flatten() {
            if !t.node_judged {
                t.distrust = distrust(t.node.as_deref());
                t.node_judged = true;
            }
        }
    }

    /// The tombstone of the deleted pod `uid` of `podref`.
    pub fn deleted_pod(&self, podref: &str, uid: &str) -> Option<&Tombstone> {
        self.tombstones
            .get(podref)?
            .iter()
            .rev()
            .find(|t| t.uid == uid)
    }

    /// Podrefs with tombstones (what a replica that comes to lead queues).
    pub fn tombstoned_podrefs(&self) -> Vec<String> {
        self.tombstones.keys().cloned().collect()
    }

    /// The deleted pods of `podref` not yet reclaimed.
    pub fn tombstones(&self, podref: &str) -> &[Tombstone] {
        self.tombstones
            .get(podref)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The node the deleted pod `uid` of `podref` was bound to, if known.
    pub fn deleted_pod_node(&self, podref: &str, uid: &str) -> Option<Arc<str>> {
        self.tombstones
            .get(podref)?
            .iter()
            .rev()
            .find(|t| t.uid == uid)?
            .node
            .clone()
    }

    /// Records an object that does not fit its type; whether this is news (new or changed).
    pub fn set_invalid(&mut self, key: InvalidKey, uid: String, error: String) -> bool {
        let object = InvalidObject { uid, error };
        self.invalid.insert(key, object.clone()) != Some(object)
    }

    /// Forgets an invalid object (it fits now, or it is gone).
    pub fn clear_invalid(&mut self, key: &InvalidKey) {
        self.invalid.remove(key);
    }

    /// Forgets the invalid object `kind` `namespace/name`.
    pub fn clear_invalid_named(&mut self, kind: &str, namespace: &str, name: &str) {
        self.clear_invalid(&InvalidKey {
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
        });
    }

    /// Keeps the invalid objects of `kind` for which `keep(namespace, name)` holds.
    pub fn retain_invalid(&mut self, kind: &str, keep: impl Fn(&str, &str) -> bool) {
        self.invalid
            .retain(|k, _| k.kind != kind || keep(&k.namespace, &k.name));
    }

    /// Objects skipped because they do not fit their type.
    pub fn invalid_objects(&self) -> &BTreeMap<InvalidKey, InvalidObject> {
        &self.invalid
    }

    /// Keeps the reservations for which `keep(name)` holds (after a re-list).
    pub fn retain_reservations(&mut self, keep: impl Fn(&str) -> bool) {
        self.reservations.retain(|name, _| keep(name));
        self.reservation_prefixes.clear();
        for name in self.reservations.keys() {
            for p in reservation_prefixes(name) {
                *self.reservation_prefixes.entry(p.to_owned()).or_default() += 1;
            }
        }
    }

    /// The NADs known (`ns/name`), usable or not.
    pub fn nad_keys(&self) -> Vec<String> {
        self.nad_pools
            .keys()
            .chain(self.slice_nads.keys())
            .chain(self.nad_errors.keys())
            .cloned()
            .collect()
    }

    /// A pool's entry by key.
    pub fn entry(&self, pool: &str, key: &str) -> Option<&PoolEntry> {
        self.pools.get(pool)?.entries.get(key)
    }

    /// Live (podref, uid) pairs.
    pub fn live_pods(&self) -> HashSet<(String, String)> {
        self.live
            .iter()
            .map(|(p, l)| (p.clone(), l.uid.clone()))
            .collect()
    }

    /// The live pod of a podref.
    pub fn live(&self, podref: &str) -> Option<&LiveInfo> {
        self.live.get(podref)
    }

    /// Number of live pods.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Number of live pods with a malformed network-status.
    pub fn malformed_status_count(&self) -> usize {
        self.live
            .values()
            .filter(|l| l.malformed_status.is_some())
            .count()
    }

    /// Live pods (podref, uid, error) whose network-status cannot be read.
    pub fn malformed_status_pods(&self) -> Vec<(String, String, String)> {
        self.live
            .iter()
            .filter_map(|(p, l)| Some((p.clone(), l.uid.clone(), l.malformed_status.clone()?)))
            .collect()
    }

    /// Forgets the tombstones of `podref` seen at or before `upto`.
    pub fn clear_tombstones(&mut self, podref: &str, upto: Instant) {
        if let Some(ts) = self.tombstones.get_mut(podref) {
            ts.retain(|t| t.seen_at > upto);
            if ts.is_empty() {
                self.tombstones.remove(podref);
            }
        }
    }

    /// Whether a tombstone of `podref` has no network-status (it would release every
    /// allocation of the podref, so the worker confirms no pod of that name exists).
    pub fn blind_tombstone(&self, podref: &str) -> bool {
        self.tombstones
            .get(podref)
            .is_some_and(|ts| ts.iter().any(|t| t.networks.is_none()))
    }

    /// When a pod of `podref` last stopped listing `ip` in its network-status.
    pub fn last_listed(&self, podref: &str, ip: IpAddr) -> Option<Instant> {
        let listed = self.listed_at.get(podref)?;
        listed.iter().find(|(i, _)| *i == ip).map(|(_, at)| *at)
    }

    /// Forgets listings older than `before`.
    pub fn expire_listings(&mut self, before: Instant) {
        self.listed_at.retain(|_, ips| {
            ips.retain(|(_, at)| *at >= before);
            !ips.is_empty()
        });
    }

    /// Forgets tombstones older than `before` whose podref has no allocation left, and all but
    /// the newest [`TOMBSTONES_PER_PODREF`] of a podref (a StatefulSet pod restarted again and
    /// again keeps allocations under its name, so age alone would keep them all).
    pub fn expire_tombstones(&mut self, before: Instant) {
        let by_podref = &self.by_podref;
        self.tombstones.retain(|podref, ts| {
            ts.retain(|t| t.seen_at >= before || by_podref.contains_key(podref));
            let extra = ts.len().saturating_sub(TOMBSTONES_PER_PODREF);
            ts.drain(..extra);
            !ts.is_empty()
        });
        // Names no pod refers to any more (nodes replaced by autoscaling).
        self.node_names.retain(|n| Arc::strong_count(n) > 1);
    }

    /// The earliest deletion time seen for `podref` (start-up orphans were not seen deleted).
    pub fn first_deletion(&self, podref: &str) -> Option<Instant> {
        self.tombstones
            .get(podref)?
            .iter()
            .filter(|t| !t.uid.is_empty())
            .map(|t| t.seen_at)
            .min()
    }

    /// Replaces a pool's parsed contents and its podref index.
    pub fn upsert_pool(&mut self, pool: &IPPool) {
        let name = pool.metadata.name.clone().unwrap_or_default();
        self.remove_pool(&name);
        let (entries, problems, range) = match pool_allocations(&pool.spec) {
            Ok(p) => (
                p.entries,
                p.problems.iter().map(ToString::to_string).collect(),
                Some(p.range),
            ),
            Err(e) => (Vec::new(), vec![e.to_string()], None),
        };
        if let Some(range) = range {
            let nets: Vec<String> = self
                .slice_nads
                .iter()
                .filter(|(_, (network_name, whole))| {
                    is_node_slice_pool(&name, &range, whole, network_name.as_deref())
                })
                .map(|(key, _)| key.clone())
                .collect();
            if !nets.is_empty() {
                self.slice_networks.insert(name.clone(), nets);
            }
        }
        let (annotation_fences, bad_fences) = pool_fences(pool.metadata.annotations.as_ref());
        let annotation_values = annotation_fences
            .keys()
            .filter_map(|k| {
                let raw = pool.metadata.annotations.as_ref()?;
                Some((k.clone(), raw.get(&fence_annotation_key(k))?.clone()))
            })
            .collect();
        let mut marked = BTreeMap::new();
        let mut by_key = BTreeMap::new();
        for e in entries {
            if e.podref.ends_with(FENCED_PODREF_SUFFIX) {
                // The fence's, whether or not its record is known yet.
                marked.insert(e.key.clone(), e);
                continue;
            }
            let keys = self.by_podref.entry(e.podref.clone()).or_default();
            let key = (name.clone(), e.key.clone());
            if !keys.contains(&key) {
                keys.push(key);
            }
            by_key.insert(e.key.clone(), e);
        }
        self.pools.insert(
            name.clone(),
            PoolInfo {
                name,
                uid: pool.metadata.uid.clone().unwrap_or_default(),
                entries: by_key,
                problems,
                bad_range: range.is_none(),
                range,
                marked,
                annotation_fences,
                annotation_values,
                bad_fences,
                has_annotations: pool.metadata.annotations.is_some(),
            },
        );
    }

    /// Marks an entry fenced after the fence was written, with its record's object (the
    /// watches will confirm).
    pub fn fence_entry(&mut self, pool: &str, key: &str, object: FenceObject) {
        // Already marked (a late answer): only the record is news.
        if let Some(mut entry) = self.entry(pool, key).cloned() {
            self.forget_entry(pool, key);
            entry.podref = fenced_podref(&object.record.podref);
            if let Some(p) = self.pools.get_mut(pool) {
                p.marked.insert(key.to_owned(), entry);
            }
        }
        self.fence_objects
            .insert((pool.to_owned(), key.to_owned()), object);
    }

    /// Forgets a fenced entry after its release was written (its record object goes when
    /// its delete is seen).
    pub fn forget_fenced(&mut self, pool: &str, key: &str) {
        if let Some(p) = self.pools.get_mut(pool) {
            p.marked.remove(key);
            p.annotation_fences.remove(key);
            p.annotation_values.remove(key);
        }
    }

    /// Forgets a pool.
    pub fn remove_pool(&mut self, name: &str) {
        self.slice_networks.remove(name);
        if let Some(old) = self.pools.remove(name) {
            for e in old.entries.values() {
                if let Some(set) = self.by_podref.get_mut(&e.podref) {
                    set.retain(|(p, k)| (p.as_str(), k) != (name, &e.key));
                    if set.is_empty() {
                        self.by_podref.remove(&e.podref);
                    }
                }
            }
        }
    }

    /// Removes one entry after a successful release (the watch will confirm).
    pub fn forget_entry(&mut self, pool: &str, key: &str) {
        if let Some(p) = self.pools.get_mut(pool)
            && let Some(e) = p.entries.remove(key)
            && let Some(set) = self.by_podref.get_mut(&e.podref)
        {
            set.retain(|(p, k)| (p.as_str(), k.as_str()) != (pool, key));
            if set.is_empty() {
                self.by_podref.remove(&e.podref);
            }
        }
    }

    /// Pools by name.
    pub fn pools(&self) -> &HashMap<String, PoolInfo> {
        &self.pools
    }

    /// Podrefs that have allocations.
    pub fn allocated_podrefs(&self) -> Vec<String> {
        self.by_podref.keys().cloned().collect()
    }

    /// Records a NAD's mapping to pools (or its config error).
    pub fn upsert_nad(&mut self, nad: &NetworkAttachmentDefinition) {
        let key = format!(
            "{}/{}",
            nad.metadata.namespace.as_deref().unwrap_or_default(),
            nad.metadata.name.as_deref().unwrap_or_default()
        );
        self.remove_nad(&key);
        // No config here (it is a file on the node): nothing to map, nothing wrong.
        let Some(config) = nad.spec.config.as_deref().filter(|c| !c.trim().is_empty()) else {
            return;
        };
        match parse_nad_config(config) {
            Ok(Some(ipam)) if ipam.node_slice_size.is_some() => {
                // whereabouts slices only the first range (a parsed config has one).
                let Some(whole) = ipam.ranges.first().map(|r| r.range) else {
                    return;
                };
                for p in self.pools.values() {
                    if p.range.is_some_and(|r| {
                        is_node_slice_pool(&p.name, &r, &whole, ipam.network_name.as_deref())
                    }) {
                        self.slice_networks
                            .entry(p.name.clone())
                            .or_default()
                            .push(key.clone());
                    }
                }
                self.slice_nads.insert(key, (ipam.network_name, whole));
            }
            Ok(Some(ipam)) => {
                let pools: Vec<String> =
                    ipam.pool_names(None).into_iter().map(|(_, n)| n).collect();
                for p in &pools {
                    self.pool_networks
                        .entry(p.clone())
                        .or_default()
                        .push(key.clone());
                }
                self.nad_pools.insert(key, pools);
            }
            Ok(None) => {}
            Err(e) => {
                self.nad_errors.insert(key, e.to_string());
            }
        }
    }

    /// Forgets a NAD.
    pub fn remove_nad(&mut self, key: &str) {
        self.nad_errors.remove(key);
        if self.slice_nads.remove(key).is_some() {
            self.slice_networks.retain(|_, nets| {
                nets.retain(|n| n != key);
                !nets.is_empty()
            });
        }
        for p in self.nad_pools.remove(key).unwrap_or_default() {
            if let Some(nets) = self.pool_networks.get_mut(&p) {
                nets.retain(|n| n != key);
                if nets.is_empty() {
                    self.pool_networks.remove(&p);
                }
            }
        }
    }

    /// The networks (`ns/nad`) known to allocate from `pool`.
    pub fn pool_networks(&self, pool: &str) -> Option<Vec<String>> {
        self.networks_of_pool(pool).cloned()
    }

    fn networks_of_pool(&self, pool: &str) -> Option<&Vec<String>> {
        self.pool_networks
            .get(pool)
            .or_else(|| self.slice_networks.get(pool))
    }

    /// Records a reservation.
    pub fn upsert_reservation(&mut self, r: &OverlappingRangeIPReservation) {
        if let Some(name) = &r.metadata.name {
            let info = ReservationInfo {
                uid: r.metadata.uid.clone().unwrap_or_default(),
                podref: r.spec.podref.clone(),
            };
            if self.reservations.insert(name.clone(), info).is_none() {
                for p in reservation_prefixes(name) {
                    *self.reservation_prefixes.entry(p.to_owned()).or_default() += 1;
                }
            }
        }
    }

    /// Forgets a reservation.
    pub fn remove_reservation(&mut self, name: &str) {
        if self.reservations.remove(name).is_some() {
            for p in reservation_prefixes(name) {
                if let Some(n) = self.reservation_prefixes.get_mut(p) {
                    *n -= 1;
                    if *n == 0 {
                        self.reservation_prefixes.remove(p);
                    }
                }
            }
        }
    }

    /// Reservations of `podref` for `ip`: named `[<network_name>-]<normalized ip>`, matched by
    /// computing the IP's name forward (bare, and with each network name part seen).
    pub fn reservations_for(&self, podref: &str, ip: IpAddr) -> Vec<(String, String)> {
        let bare = reservation_name(ip, None);
        let prefixed = self
            .reservation_prefixes
            .keys()
            .map(|p| reservation_name(ip, Some(p)));
        std::iter::once(bare)
            .chain(prefixed)
            .filter_map(|name| {
                let r = self.reservations.get(&name)?;
                (r.podref == podref).then(|| (name, r.uid.clone()))
            })
            .collect()
    }

    /// Reservations `(name, uid, podref)` whose podref has no live pod and no allocation left in
    /// any pool: nothing can still be using them.
    pub fn orphan_reservations(&self) -> Vec<(String, String, String)> {
        // A fenced entry's reservation names the deleted pod: it goes with the fence's release.
        let fenced = self.fenced_podrefs();
        self.reservations
            .iter()
            .filter(|(_, r)| {
                !self.live.contains_key(&r.podref)
                    && !self.by_podref.contains_key(&r.podref)
                    && !fenced.contains(r.podref.as_str())
            })
            .map(|(name, r)| (name.clone(), r.uid.clone(), r.podref.clone()))
            .collect()
    }

    /// Judges every allocation of `podref`.
    pub fn judge_podref(&self, podref: &str, config: &ReclaimConfig) -> Vec<Judged> {
        let Some(keys) = self.by_podref.get(podref) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(keys.len());
        for (pool, key) in keys {
            if let Some(entry) = self.pools.get(pool).and_then(|p| p.entries.get(key)) {
                out.push(self.judge(pool, entry, config));
            }
        }
        out.sort_by(|a, b| (&a.pool, &a.entry.key).cmp(&(&b.pool, &b.entry.key)));
        out
    }

    /// Every allocation that is not kept: releases and leak candidates (the sweep's and
    /// `scan`'s work; without materializing the kept majority, which at scale is most).
    pub fn judge_leaks(&self, config: &ReclaimConfig) -> Vec<Judged> {
        let mut out = Vec::new();
        for (name, pool) in &self.pools {
            for entry in pool.entries.values() {
                let j = self.judge(name, entry, config);
                if !matches!(j.decision, Decision::Keep(_)) {
                    out.push(j);
                }
            }
        }
        out
    }

    /// Judges every allocation of every pool.
    pub fn judge_all(&self, config: &ReclaimConfig) -> Vec<Judged> {
        let mut out = Vec::new();
        for (name, pool) in &self.pools {
            for entry in pool.entries.values() {
                out.push(self.judge(name, entry, config));
            }
        }
        out
    }

    fn judge(&self, pool: &str, entry: &PoolEntry, config: &ReclaimConfig) -> Judged {
        if self.pending_fence(pool, entry).is_some() {
            // Its fence record is written, the entry not yet rewritten: the fence's.
            return Judged {
                pool: pool.to_owned(),
                decision: Decision::Keep(reclaim::KeepReason::FencePending),
                network: pool.to_owned(),
                pod: PodRef::from_podref(&entry.podref, String::new()),
                entry: entry.clone(),
            };
        }
        let live = self.live.get(&entry.podref);
        let tombstones = self
            .tombstones
            .get(&entry.podref)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let deleted: Vec<DeletedPod<'_>> = tombstones
            .iter()
            .map(|t| DeletedPod {
                uid: &t.uid,
                networks: t.networks.as_deref(),
            })
            .collect();
        let knowledge = PodKnowledge {
            live: live.map(|l| LivePod {
                uid: &l.uid,
                phase: if l.terminal {
                    PodPhase::Succeeded
                } else {
                    PodPhase::Running
                },
                networks: l.networks.as_deref(),
            }),
            deleted: &deleted,
            dead_sandboxes: &[],
        };
        let pool_networks = self.networks_of_pool(pool);
        let alloc = Allocation {
            ip: entry.ip,
            sandbox_id: &entry.id,
            podref: &entry.podref,
            ifname: entry.ifname.as_deref(),
        };
        let decision = reclaim::decide(
            &alloc,
            &PoolContext {
                networks: pool_networks.map(Vec::as_slice),
            },
            &knowledge,
            config,
        );
        // Name the network the pod itself recorded for this address, else the pool's NAD.
        let listed = tombstones
            .iter()
            .filter_map(|t| t.networks.as_deref())
            .chain(live.and_then(|l| l.networks.as_deref()))
            .flatten()
            .find(|n| n.ips.contains(&entry.ip))
            .map(|n| n.name.clone());
        let network = listed
            .or_else(|| pool_networks.and_then(|n| n.first().cloned()))
            .unwrap_or_else(|| pool.to_owned());
        let (namespace, name) = entry.podref.split_once('/').unwrap_or(("", &entry.podref));
        let uid = match decision {
            Decision::Release(reclaim::Reason::PodDeleted) => tombstones
                .iter()
                .rev()
                .find(|t| {
                    t.networks
                        .as_deref()
                        .is_none_or(|n| n.iter().any(|a| a.ips.contains(&entry.ip)))
                })
                .map(|t| t.uid.clone()),
            _ => live.map(|l| l.uid.clone()),
        };
        Judged {
            pool: pool.to_owned(),
            entry: entry.clone(),
            decision,
            network,
            pod: PodRef {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                uid: uid.unwrap_or_default(),
            },
        }
    }
}

/// The writer keeps the controller's index in step with what it writes.
impl crate::release::Index for std::sync::RwLock<State> {
    fn holds(&self, pool: &str, key: &str, id: &str) -> bool {
        let st = self.read().expect("state lock");
        st.entry(pool, key).is_some_and(|e| e.id == id)
    }

    fn has_annotations(&self, pool: &str) -> bool {
        let st = self.read().expect("state lock");
        st.pools().get(pool).is_some_and(|p| p.has_annotations)
    }

    fn fenced(
        &self,
        pool: &str,
        key: &str,
        sandbox: &str,
        record: &FenceRecord,
        object: (String, String),
    ) {
        let (name, uid) = object;
        self.write().expect("state lock").fence_entry(
            pool,
            key,
            FenceObject {
                name,
                uid,
                sandbox: sandbox.to_owned(),
                record: record.clone(),
                evidence: None,
            },
        );
    }

    fn holder(&self, podref: &str, ip: IpAddr) -> Option<(String, Option<String>)> {
        let st = self.read().expect("state lock");
        let keys = st.by_podref.get(podref)?;
        keys.iter().find_map(|(pool, key)| {
            let e = st.entry(pool, key)?;
            (e.ip == ip).then(|| (e.id.clone(), e.ifname.clone()))
        })
    }

    fn has_allocations(&self, podref: &str) -> bool {
        self.read()
            .expect("state lock")
            .by_podref
            .contains_key(podref)
    }

    fn released(&self, pool: &str, key: &str, podref: &str, ip: IpAddr) -> Vec<(String, String)> {
        let mut st = self.write().expect("state lock");
        st.forget_entry(pool, key);
        st.forget_fenced(pool, key);
        st.reservations_for(podref, ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{IPAllocation, IPPoolSpec, NetworkAttachmentDefinitionSpec, SandboxesGone};

    const SLICE_POOL: &str = "slicenet-node-a-10.0.4.0-22";

    fn nad(name: &str, ipam: &str) -> NetworkAttachmentDefinition {
        let mut nad = NetworkAttachmentDefinition::new(
            name,
            NetworkAttachmentDefinitionSpec {
                config: Some(format!(
                    r#"{{"name":"{name}","type":"macvlan","ipam":{{"type":"whereabouts",{ipam}}}}}"#
                )),
            },
        );
        nad.metadata.namespace = Some("ns".into());
        nad
    }

    fn slice_nad() -> NetworkAttachmentDefinition {
        nad(
            "slicenet",
            r#""range":"10.0.0.0/8","node_slice_size":"/22","network_name":"slicenet""#,
        )
    }

    /// A node's slice pool with one entry of pod `ns/web` that records no interface.
    fn slice_pool() -> IPPool {
        let entry = IPAllocation {
            id: "sb-1".into(),
            podref: "ns/web".into(),
            ifname: None,
            ipamclaimref: None,
        };
        IPPool::new(
            SLICE_POOL,
            IPPoolSpec {
                range: "10.0.4.0/22".into(),
                allocations: BTreeMap::from([("5".to_string(), entry)]),
            },
        )
    }

    /// `ns/web` lives, listing another address on the slice network.
    fn live_web(st: &mut State) {
        let status = r#"[{"name":"ns/slicenet","interface":"net1","ips":["10.0.4.9"]}]"#;
        let annotations = BTreeMap::from([(
            crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(),
            status.to_string(),
        )]);
        let seen = PodSeen {
            annotations: Some(&annotations),
            ..Default::default()
        };
        st.upsert_pod("ns/web", "uid-web", seen, Instant::now());
    }

    fn decision(st: &State) -> (Decision, String) {
        let judged = st.judge_all(&ReclaimConfig::default());
        assert_eq!(judged.len(), 1, "{judged:?}");
        (judged[0].decision, judged[0].network.clone())
    }

    fn reservation(name: &str, podref: &str) -> OverlappingRangeIPReservation {
        let mut r = OverlappingRangeIPReservation::new(
            name,
            crate::api::OverlappingRangeIPReservationSpec {
                containerid: None,
                podref: podref.into(),
                ifname: None,
                ipamclaimref: None,
            },
        );
        r.metadata.uid = Some(format!("uid-{name}"));
        r
    }

    #[test]
    fn reservations_are_found_by_name_bare_or_with_any_network_name_seen() {
        let mut st = State::default();
        for (name, podref) in [
            ("10.0.0.5", "ns/a"),
            ("blue-10.0.0.5", "ns/a"),
            ("red-10.0.0.5", "ns/b"),
            ("green-10.0.0.6", "ns/a"),
            ("blue-fd00--5", "ns/a"),
        ] {
            st.upsert_reservation(&reservation(name, podref));
        }
        let names = |st: &State, podref: &str, ip: &str| {
            let mut v: Vec<String> = st
                .reservations_for(podref, ip.parse().unwrap())
                .into_iter()
                .map(|(n, uid)| {
                    assert_eq!(uid, format!("uid-{n}"));
                    n
                })
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            names(&st, "ns/a", "10.0.0.5"),
            ["10.0.0.5", "blue-10.0.0.5"]
        );
        assert_eq!(names(&st, "ns/b", "10.0.0.5"), ["red-10.0.0.5"]);
        // "green" is known from another address's reservation.
        assert_eq!(names(&st, "ns/a", "10.0.0.6"), ["green-10.0.0.6"]);
        assert_eq!(names(&st, "ns/a", "fd00::5"), ["blue-fd00--5"]);
        // A network name is forgotten with the last reservation that had it.
        st.remove_reservation("red-10.0.0.5");
        assert!(!st.reservation_prefixes.contains_key("red"));
        assert_eq!(st.reservation_prefixes["blue"], 2);
        st.retain_reservations(|n| !n.starts_with("blue"));
        assert!(!st.reservation_prefixes.contains_key("blue"));
        assert_eq!(names(&st, "ns/a", "10.0.0.6"), ["green-10.0.0.6"]);
    }

    #[test]
    fn a_node_slice_pool_maps_to_its_network_whichever_comes_first() {
        for nad_first in [true, false] {
            let mut st = State::default();
            live_web(&mut st);
            if nad_first {
                st.upsert_nad(&slice_nad());
                st.upsert_pool(&slice_pool());
            } else {
                st.upsert_pool(&slice_pool());
                st.upsert_nad(&slice_nad());
            }
            assert_eq!(
                st.pool_networks(SLICE_POOL),
                Some(vec!["ns/slicenet".to_string()])
            );
            assert_eq!(
                decision(&st),
                (
                    Decision::Candidate(reclaim::Reason::IPNotOnPod),
                    "ns/slicenet".to_string()
                ),
                "nad first: {nad_first}"
            );
        }
    }

    #[test]
    fn a_removed_node_slice_nad_or_pool_forgets_the_mapping() {
        let mut st = State::default();
        live_web(&mut st);
        st.upsert_nad(&slice_nad());
        st.upsert_pool(&slice_pool());
        st.remove_nad("ns/slicenet");
        assert_eq!(st.pool_networks(SLICE_POOL), None);
        assert_eq!(
            decision(&st).0,
            Decision::Keep(reclaim::KeepReason::NoInformationForNetwork),
            "without the mapping nothing says which network the entry is on"
        );
        st.upsert_nad(&slice_nad());
        st.remove_pool(SLICE_POOL);
        assert_eq!(st.pool_networks(SLICE_POOL), None);
    }

    #[test]
    fn an_exact_pool_name_wins_over_a_node_slice_match() {
        let mut st = State::default();
        st.upsert_nad(&slice_nad());
        // A plain network whose pool name also reads as "slicenet-<node>-<slice>".
        st.upsert_nad(&nad(
            "plain",
            r#""range":"10.0.4.0/22","network_name":"slicenet-node-a""#,
        ));
        st.upsert_pool(&slice_pool());
        assert_eq!(
            st.pool_networks(SLICE_POOL),
            Some(vec!["ns/plain".to_string()])
        );
    }

    fn record(podref: &str) -> crate::ipam::fence::FenceRecord {
        crate::ipam::fence::FenceRecord {
            podref: podref.into(),
            uid: "u".into(),
            node: "n".into(),
            why: "Ready=Unknown".into(),
            network: "ns/net".into(),
            since: "2026-11-23T10:00:00Z".parse().unwrap(),
        }
    }

    fn entry(id: &str, podref: &str) -> IPAllocation {
        IPAllocation {
            id: id.into(),
            podref: podref.into(),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        }
    }

    fn pool_with(allocations: &[(&str, &str, &str)]) -> IPPool {
        IPPool::new(
            "p",
            IPPoolSpec {
                range: "192.0.2.0/24".into(),
                allocations: allocations
                    .iter()
                    .map(|(k, id, podref)| (k.to_string(), entry(id, podref)))
                    .collect(),
            },
        )
    }

    fn object(name: &str, sandbox: &str, podref: &str) -> FenceObject {
        FenceObject {
            name: name.into(),
            uid: format!("uid-{name}"),
            sandbox: sandbox.into(),
            record: record(podref),
            evidence: None,
        }
    }

    #[test]
    fn a_podref_keeps_only_its_newest_tombstones_while_it_holds_allocations() {
        let mut st = State::default();
        st.upsert_pool(&pool_with(&[("5", "sb", "ns/web-0")]));
        let t0 = Instant::now();
        for i in 0..(TOMBSTONES_PER_PODREF + 4) {
            st.delete_pod("ns/web-0", &format!("uid-{i}"), PodSeen::default(), t0);
        }
        st.expire_tombstones(t0);
        let kept: Vec<&str> = st
            .tombstones("ns/web-0")
            .iter()
            .map(|t| t.uid.as_str())
            .collect();
        assert_eq!(kept.len(), TOMBSTONES_PER_PODREF);
        assert_eq!(kept[0], "uid-4", "the oldest go");
    }

    #[test]
    fn fence_records_and_entries_are_joined_whichever_comes_first() {
        for records_first in [true, false] {
            let mut st = State::default();
            let pool = pool_with(&[
                ("5", "sb", "ns/web-0:fenced"),
                // Record written, rewrite not yet (a crash between the two writes).
                ("6", "sb-6", "ns/db-0"),
                ("7", "sb-7", "ns/other-0"),
            ]);
            let add_records = |st: &mut State| {
                st.upsert_fence_object("p", "5", object("p-5", "sb", "ns/web-0"));
                st.upsert_fence_object("p", "6", object("p-6", "sb-6", "ns/db-0"));
                // Its entry is another allocation now: left over.
                st.upsert_fence_object("p", "7", object("p-7", "sb-old", "ns/gone-0"));
                // Its entry is gone.
                st.upsert_fence_object("p", "8", object("p-8", "sb-8", "ns/gone-1"));
            };
            if records_first {
                add_records(&mut st);
                st.upsert_pool(&pool);
            } else {
                st.upsert_pool(&pool);
                add_records(&mut st);
            }
            st.set_pools_listed();
            let fenced = st.fenced();
            assert_eq!(fenced.len(), 1);
            assert_eq!(fenced[0].1.record.podref, "ns/web-0");
            assert_eq!(
                fenced[0].1.source,
                FenceSource::Object {
                    name: "p-5".into(),
                    uid: "uid-p-5".into()
                }
            );
            let pending: Vec<String> = st.pending_fences().into_iter().map(|p| p.1.key).collect();
            assert_eq!(pending, ["6"]);
            let judged = st.judge_all(&ReclaimConfig::default());
            let decision = |key: &str| judged.iter().find(|j| j.entry.key == key).unwrap().decision;
            assert_eq!(
                decision("6"),
                Decision::Keep(reclaim::KeepReason::FencePending),
                "a pending fence's entry is never the sweep's"
            );
            assert!(matches!(decision("7"), Decision::Candidate(_)));
            let mut stale: Vec<String> =
                st.stale_fence_objects().into_iter().map(|s| s.0).collect();
            stale.sort();
            assert_eq!(stale, ["p-7", "p-8"]);
            assert!(st.unrecorded_marks().is_empty());
            assert!(st.fenced_podrefs().contains("ns/db-0"));
        }
    }

    #[test]
    fn records_of_a_pool_that_cannot_be_read_or_is_not_listed_yet_are_never_left_over() {
        let mut st = State::default();
        st.upsert_fence_object("p", "5", object("p-5", "sb", "ns/web-0"));
        assert!(st.stale_fence_objects().is_empty(), "pools not listed yet");
        st.set_invalid(
            InvalidKey {
                kind: "IPPool".into(),
                namespace: "ns".into(),
                name: "p".into(),
            },
            "uid".into(),
            "bad".into(),
        );
        st.set_pools_listed();
        assert!(st.stale_fence_objects().is_empty(), "unreadable pool");
        st.clear_invalid_named("IPPool", "ns", "p");
        assert_eq!(st.stale_fence_objects().len(), 1, "a deleted pool's record");
    }

    #[test]
    fn a_record_of_an_earlier_fence_of_the_same_address_and_name_never_speaks_for_a_new_one() {
        // web-0 fenced (sandbox sb-1), lifted, recreated, given the same address, fenced again
        // (sb-2) while the watch still holds the first record and its agent's report.
        let mut st = State::default();
        st.upsert_pool(&pool_with(&[("5", "sb-2", "ns/web-0:fenced")]));
        let mut old = object("p-5", "sb-1", "ns/web-0");
        old.evidence = Some(SandboxesGone {
            node: "n".into(),
            pod_uid: "uid".into(),
            fence_uid: "uid-p-5".into(),
            observed_at: "2026-11-23T10:00:00Z".into(),
        });
        st.upsert_fence_object("p", "5", old);
        st.set_pools_listed();
        assert!(
            st.fenced().is_empty(),
            "the old record lifted the new fence"
        );
        assert_eq!(
            st.stale_fence_objects().len(),
            1,
            "the old record is left over"
        );
        assert!(st.judge_all(&ReclaimConfig::default()).is_empty());
    }

    #[test]
    fn a_fenced_entry_without_a_record_is_reported_and_left_alone() {
        let mut st = State::default();
        st.upsert_pool(&pool_with(&[("5", "sb", "ns/web-0:fenced")]));
        assert!(st.fenced().is_empty());
        assert!(st.judge_all(&ReclaimConfig::default()).is_empty());
        assert_eq!(
            st.unrecorded_marks(),
            [(
                "p".to_string(),
                "5".to_string(),
                "ns/web-0:fenced".to_string()
            )]
        );
    }

    #[test]
    fn a_fenced_entry_is_kept_out_of_judgement_and_a_stale_fence_record_is_found() {
        use crate::ipam::fence::{FenceRecord, fence_annotation_key, fence_annotation_value};
        let record = |podref: &str| FenceRecord {
            podref: podref.into(),
            uid: "u".into(),
            node: "n".into(),
            why: "Ready=Unknown".into(),
            network: "ns/net".into(),
            since: "2026-11-23T10:00:00Z".parse().unwrap(),
        };
        let entry = |podref: &str| IPAllocation {
            id: "sb".into(),
            podref: podref.into(),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        };
        let mut pool = IPPool::new(
            "p",
            IPPoolSpec {
                range: "192.0.2.0/24".into(),
                allocations: BTreeMap::from([
                    ("5".to_string(), entry("ns/web-0:fenced")),
                    // Its fence record names another pod: a new allocation took the offset.
                    ("6".to_string(), entry("ns/db-0")),
                ]),
            },
        );
        pool.metadata.annotations = Some(BTreeMap::from([
            (
                fence_annotation_key("5"),
                fence_annotation_value(&record("ns/web-0")),
            ),
            (
                fence_annotation_key("6"),
                fence_annotation_value(&record("ns/old-0")),
            ),
            (
                fence_annotation_key("7"),
                fence_annotation_value(&record("ns/gone-0")),
            ),
        ]));
        let mut st = State::default();
        st.upsert_pool(&pool);
        let fenced = st.fenced();
        assert_eq!(fenced.len(), 1);
        assert_eq!(fenced[0].1.record.podref, "ns/web-0");
        assert_eq!(
            st.judge_all(&ReclaimConfig::default())
                .iter()
                .map(|j| j.entry.podref.as_str())
                .collect::<Vec<_>>(),
            ["ns/db-0"],
            "the fenced entry is the fence's, not the sweep's"
        );
        assert_eq!(fenced[0].1.source, FenceSource::Annotation);
        let stale = st.stale_fence_annotations();
        assert_eq!(
            stale["p"]
                .iter()
                .map(|(k, _)| k.as_str())
                .collect::<Vec<_>>(),
            ["6", "7"]
        );
        assert!(
            st.allocated_podrefs()
                .iter()
                .all(|p| p != "ns/web-0:fenced")
        );
    }
}
