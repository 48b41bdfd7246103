//! Live pods by podref, tombstones of deleted pods, and when each pod last stopped listing an
//! address (a leak's grace starts again from it).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use super::uid::Uid;
use crate::ipam::{NetworkAttachment, parse_network_status};

/// Tombstones kept per podref at most (the newest).
pub const TOMBSTONES_PER_PODREF: usize = 16;

/// A live pod, stripped.
#[derive(Debug, Clone)]
pub struct LiveInfo {
    /// Uid (a UUID in its 16 bytes).
    pub uid: Uid,
    /// Secondary networks, `None` when the annotation is missing or malformed.
    pub networks: Option<Arc<[NetworkAttachment]>>,
    /// Why the annotation, present, cannot be read.
    pub malformed_status: Option<Box<str>>,
    /// The node it is bound to.
    pub node: Option<Arc<str>>,
    /// Succeeded or Failed.
    pub terminal: bool,
    /// A static pod's mirror: its deletion stops nothing.
    pub mirror: bool,
    /// Its termination grace period in seconds (saturated; the API's default when unknown).
    pub grace_seconds: u32,
}

impl LiveInfo {
    /// Whether `other` lists what this does: the same pod, networks, status error and phase.
    fn lists_as(&self, other: &LiveInfo) -> bool {
        self.uid == other.uid
            && self.networks == other.networks
            && self.malformed_status == other.malformed_status
            && self.terminal == other.terminal
    }
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
    /// A static pod's mirror (`kubernetes.io/config.mirror`).
    pub mirror: bool,
    /// `spec.terminationGracePeriodSeconds`, if known.
    pub grace_seconds: Option<i64>,
}

impl PodSeen<'_> {
    /// Its grace period as a live pod keeps it (the API's default when unknown).
    fn grace_kept(&self) -> u32 {
        let s = self
            .grace_seconds
            .map_or(DEFAULT_GRACE_SECONDS, |s| s.max(0));
        u32::try_from(s).unwrap_or(u32::MAX)
    }
}

/// The API's default termination grace period.
const DEFAULT_GRACE_SECONDS: i64 = 30;

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
    pub entries: Vec<TombstoneEntry>,
    /// Why its node was not trusted when the deletion was seen (`None`: trusted, or fencing
    /// off): the fence follows from that, even if the node is Ready by the time it is judged.
    pub distrust: Option<String>,
    /// `distrust` was set (it is set once, as the deletion is seen).
    pub node_judged: bool,
    /// Its termination grace period in seconds, if known (a fence keeps it).
    pub grace_seconds: Option<i64>,
    /// A static pod's mirror: its deletion stops nothing, so it is never a release (a fence
    /// when its node is not trusted).
    pub mirror: bool,
    /// Its last known phase was Succeeded or Failed: its kubelet had stopped it.
    pub terminal: bool,
}

/// What a tombstone is made of: the pod as it was last known.
#[derive(Debug, Clone)]
pub struct GonePod {
    /// Uid (empty when unknown).
    pub uid: String,
    /// Its secondary networks (`None`: no readable network-status).
    pub networks: Option<Arc<[NetworkAttachment]>>,
    /// Its node.
    pub node: Option<Arc<str>>,
    /// Its termination grace period in seconds.
    pub grace_seconds: Option<i64>,
    /// A static pod's mirror.
    pub mirror: bool,
    /// Succeeded or Failed.
    pub terminal: bool,
}

impl From<LiveInfo> for GonePod {
    fn from(l: LiveInfo) -> Self {
        GonePod {
            uid: l.uid.to_string(),
            networks: l.networks,
            node: l.node,
            grace_seconds: Some(i64::from(l.grace_seconds)),
            mirror: l.mirror,
            terminal: l.terminal,
        }
    }
}

/// An allocation of a deleted pod's podref as it was when the deletion was seen: pool, key
/// and sandbox id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TombstoneEntry {
    /// Pool name.
    pub pool: String,
    /// Entry key (offset).
    pub key: String,
    /// Sandbox id.
    pub id: String,
}

/// Live pods and tombstones.
/// A live pod: podref and uid (a pod recreated under its name is another pod).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodUid {
    /// `namespace/name`.
    pub podref: String,
    /// Uid.
    pub uid: String,
}

/// A live pod whose network-status annotation cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MalformedStatus {
    /// `namespace/name`.
    pub podref: String,
    /// Uid.
    pub uid: String,
    /// Why it cannot be read.
    pub error: String,
}

#[derive(Debug, Default)]
pub struct PodIndex {
    /// By podref (shared: the duplicate pass copies the listings out under a short read, a
    /// reference count each, and looks at them after the lock is let go).
    live: HashMap<Arc<str>, LiveInfo>,
    /// Node names, network names and interface names, one copy of each shared by all pods.
    names: HashSet<Arc<str>>,
    tombstones: HashMap<String, Vec<Tombstone>>,
    /// When each podref's network-status last listed each address: any such observation
    /// restarts a leak's grace, not only the sweep's samples.
    listed_at: HashMap<String, Vec<(IpAddr, Instant)>>,
    /// Changes to what the live pods list (a pod added, removed, or its uid, networks or
    /// phase changed): looks that read only that can be skipped while it stays.
    listing_changes: u64,
}

impl PodIndex {
    /// The shared copy of a name.
    fn shared(&mut self, name: &str) -> Arc<str> {
        if let Some(n) = self.names.get(name) {
            return n.clone();
        }
        let n: Arc<str> = name.into();
        self.names.insert(n.clone());
        n
    }

    /// The shared copy of a node name.
    fn node_name(&mut self, node: Option<&str>) -> Option<Arc<str>> {
        Some(self.shared(node?))
    }

    /// A pod's secondary networks from its annotations (their names shared), and why they
    /// cannot be read.
    fn networks_of(
        &mut self,
        annotations: Option<&BTreeMap<String, String>>,
    ) -> (Option<Arc<[NetworkAttachment]>>, Option<Box<str>>) {
        match annotations.and_then(|a| a.get(crate::ipam::NETWORK_STATUS_ANNOTATION)) {
            None => (None, None),
            Some(s) => match parse_network_status(s) {
                Ok(n) => {
                    let n = n.into_iter().map(|mut a| {
                        a.name = self.shared(&a.name);
                        a.interface = a.interface.map(|i| self.shared(&i));
                        a
                    });
                    (Some(n.collect()), None)
                }
                Err(e) => (None, Some(e.to_string().into())),
            },
        }
    }

    /// Records a live pod; returns the pod it replaced if that had another uid (a deletion
    /// whose event was missed: the caller buries it).
    pub fn upsert(
        &mut self,
        podref: &str,
        uid: &str,
        seen: PodSeen<'_>,
        now: Instant,
    ) -> Option<LiveInfo> {
        let (networks, malformed_status) = self.networks_of(seen.annotations);
        if let Some(old) = self.live.get(podref).filter(|l| l.uid.is(uid)) {
            let dropped = dropped_addresses(old, networks.as_deref());
            self.listed_until(podref, dropped, now);
        }
        let info = LiveInfo {
            uid: Uid::of(uid),
            networks,
            malformed_status,
            node: self.node_name(seen.node),
            terminal: seen.terminal,
            mirror: seen.mirror,
            grace_seconds: seen.grace_kept(),
        };
        if self.live.get(podref).is_none_or(|old| !old.lists_as(&info)) {
            self.listing_changes += 1;
        }
        let old = match self.live.get_mut(podref) {
            Some(l) => std::mem::replace(l, info),
            None => {
                self.live.insert(podref.into(), info);
                return None;
            }
        };
        (!old.uid.is(uid)).then_some(old)
    }

    /// An address the same pod listed and lists no more was listed until now: the leak grace
    /// of that address starts again. (While listed it is kept anyway, so only drops are
    /// recorded: a record per pod would cost megabytes at scale.)
    fn listed_until(&mut self, podref: &str, dropped: Vec<IpAddr>, now: Instant) {
        if dropped.is_empty() {
            return;
        }
        let listed = self.listed_at.entry(podref.to_owned()).or_default();
        for ip in dropped {
            match listed.iter_mut().find(|(i, _)| *i == ip) {
                Some((_, at)) => *at = now,
                None => listed.push((ip, now)),
            }
        }
    }

    /// Removes the live pod `uid` of `podref` (deleted or vanished), returning it.
    pub fn remove_live(&mut self, podref: &str, uid: &str) -> Option<LiveInfo> {
        self.live.get(podref).filter(|l| l.uid.is(uid))?;
        self.listing_changes += 1;
        self.live.remove(podref)
    }

    /// Changes so far to what the live pods list.
    pub fn listing_changes(&self) -> u64 {
        self.listing_changes
    }

    /// A tombstone for a pod deleted or vanished, from what is known of it.
    pub fn bury(
        &mut self,
        podref: &str,
        gone: GonePod,
        entries: Vec<TombstoneEntry>,
        now: Instant,
    ) -> Tombstone {
        let t = Tombstone {
            uid: gone.uid,
            networks: gone.networks,
            seen_at: now,
            node: gone.node,
            entries,
            distrust: None,
            node_judged: false,
            grace_seconds: gone.grace_seconds,
            mirror: gone.mirror,
            terminal: gone.terminal,
        };
        self.tombstones
            .entry(podref.to_owned())
            .or_default()
            .push(t.clone());
        t
    }

    /// A deleted pod's final state: its networks, node and grace (the node and grace it was
    /// last seen with when the final state names none).
    pub fn final_state(
        &mut self,
        uid: &str,
        known: Option<LiveInfo>,
        seen: PodSeen<'_>,
    ) -> GonePod {
        let (networks, _) = self.networks_of(seen.annotations);
        // Capped as a live pod's is: a tenant's grace of i64::MAX seconds must not overflow
        // the clock arithmetic of the fence windows.
        let grace_seconds = seen
            .grace_seconds
            .map(|s| s.clamp(0, i64::from(u32::MAX)))
            .or(known.as_ref().map(|l| i64::from(l.grace_seconds)));
        let mirror = seen.mirror || known.as_ref().is_some_and(|l| l.mirror);
        // A phase never leaves Succeeded or Failed.
        let terminal = seen.terminal || known.as_ref().is_some_and(|l| l.terminal);
        let node = self.node_name(seen.node).or(known.and_then(|l| l.node));
        GonePod {
            uid: uid.to_owned(),
            networks,
            node,
            grace_seconds,
            mirror,
            terminal,
        }
    }

    /// Records, on the tombstones of `podref` just made, why their node was not trusted then.
    pub fn judge_deleted_nodes(
        &mut self,
        podref: &str,
        distrust: impl Fn(&Tombstone) -> Option<String>,
    ) {
        for t in self.tombstones.get_mut(podref).into_iter().flatten() {
            if !t.node_judged {
                t.distrust = distrust(t);
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

    /// The node the deleted pod `uid` of `podref` was bound to, if known.
    pub fn deleted_pod_node(&self, podref: &str, uid: &str) -> Option<Arc<str>> {
        self.deleted_pod(podref, uid)?.node.clone()
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
        self.tombstones(podref).iter().any(|t| t.networks.is_none())
    }

    /// The earliest deletion time seen for `podref` (start-up orphans were not seen deleted).
    pub fn first_deletion(&self, podref: &str) -> Option<Instant> {
        self.tombstones(podref)
            .iter()
            .filter(|t| !t.uid.is_empty())
            .map(|t| t.seen_at)
            .min()
    }

    /// Forgets tombstones older than `before` for which `allocated(podref)` is false, and all
    /// but the newest [`TOMBSTONES_PER_PODREF`] of a podref (a StatefulSet pod restarted again
    /// and again keeps allocations under its name, so age alone would keep them all).
    pub fn expire_tombstones(&mut self, before: Instant, allocated: impl Fn(&str) -> bool) {
        self.tombstones.retain(|podref, ts| {
            ts.retain(|t| t.seen_at >= before || allocated(podref));
            let extra = ts.len().saturating_sub(TOMBSTONES_PER_PODREF);
            ts.drain(..extra);
            !ts.is_empty()
        });
        // Names no pod refers to any more (nodes replaced by autoscaling, networks removed).
        self.names.retain(|n| Arc::strong_count(n) > 1);
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

    /// Live pods.
    pub fn live_pods(&self) -> Vec<PodUid> {
        self.live
            .iter()
            .map(|(p, l)| PodUid {
                podref: p.to_string(),
                uid: l.uid.to_string(),
            })
            .collect()
    }

    /// Live pods by podref.
    pub fn live_iter(&self) -> impl Iterator<Item = (&str, &LiveInfo)> {
        self.live.iter().map(|(p, l)| (&**p, l))
    }

    /// Live pods by shared podref.
    pub fn live_shared(&self) -> impl Iterator<Item = (&Arc<str>, &LiveInfo)> {
        self.live.iter()
    }

    /// The live pod of a podref.
    pub fn live(&self, podref: &str) -> Option<&LiveInfo> {
        self.live.get(podref)
    }

    /// Whether a pod of `podref` lives.
    pub fn is_live(&self, podref: &str) -> bool {
        self.live.contains_key(podref)
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

    /// Live pods whose network-status cannot be read.
    pub fn malformed_status_pods(&self) -> Vec<MalformedStatus> {
        self.live
            .iter()
            .filter_map(|(p, l)| {
                Some(MalformedStatus {
                    podref: p.to_string(),
                    uid: l.uid.to_string(),
                    error: l.malformed_status.as_deref()?.to_owned(),
                })
            })
            .collect()
    }
}

/// The addresses `old` listed that `now` does not.
fn dropped_addresses(old: &LiveInfo, now: Option<&[NetworkAttachment]>) -> Vec<IpAddr> {
    let Some(old_nets) = &old.networks else {
        return Vec::new();
    };
    let lists = |ip: &IpAddr| now.is_some_and(|n| n.iter().any(|n| n.ips.contains(ip)));
    old_nets
        .iter()
        .flat_map(|n| n.ips.iter())
        .filter(|ip| !lists(ip))
        .copied()
        .collect()
}
