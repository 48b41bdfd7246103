//! Duplicate addresses: two or more live pods whose network-status lists the same address on the
//! same network. A pool has one entry per address, so only the pods' own word shows them (an
//! entry removed by hand, a second allocator, a restored backup). Reported, never released:
//! nothing here feeds a decision.
//!
//! Which network: the network-status `name` (`namespace/nad`; a bare name is in the pod's
//! namespace). Only whereabouts' addresses count: a duplicate is reported when a pool holds or
//! serves the address, or its network is a known whereabouts NAD (another IPAM, host-local per
//! node say, may hand out one address on several nodes on purpose). Entries marked `default: true` are left out (the parser drops them): their
//! addresses come from the cluster CNI, not from whereabouts, and the cluster network is not
//! ours to judge. Addresses compare in canonical form (IPv6 text forms parse to one value; an
//! IPv4-mapped IPv6 address is its IPv4 address).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::Arc;

use super::Index;
use crate::ipam::{NetworkAttachment, PodKey, qualified_network};

/// Whom a pool entry names: its podref and sandbox id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryOwner {
    /// Its podref (as stored: a fenced or cooling one included).
    pub podref: String,
    /// Its sandbox id.
    pub id: String,
}

/// A pod that lists a duplicate address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DuplicatePod {
    /// `namespace/name`.
    pub podref: String,
    /// Its uid.
    pub uid: String,
}

/// One address listed by two or more live pods on one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    /// The network (`namespace/nad`).
    pub network: String,
    /// The address.
    pub ip: IpAddr,
    /// The pods that list it, by podref.
    pub pods: Vec<DuplicatePod>,
    /// The pool that holds (or serves) the address, when one is known.
    pub pool: Option<String>,
    /// The podref and sandbox id of that pool's entry for the address, if it has one.
    pub entry: Option<EntryOwner>,
}

/// What a look for duplicates found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Duplicates {
    /// The duplicates, by (network, address).
    pub found: Vec<Duplicate>,
    /// Live pods left out because their network-status cannot be read.
    pub unreadable: usize,
}

impl Duplicates {
    /// Addresses with two or more pods, per network.
    pub fn per_network(&self) -> BTreeMap<&str, usize> {
        let mut out = BTreeMap::new();
        for d in &self.found {
            *out.entry(d.network.as_str()).or_default() += 1;
        }
        out
    }
}

/// What live, not terminal, pods list, copied out of the index under a short read (a
/// reference count per pod): the pass over it ([`Listings::shared`]) runs after the lock is let
/// go, so a tenant's listings never hold the watches and the deletion path.
#[derive(Debug, Default)]
pub struct Listings {
    pods: Vec<(Arc<str>, Arc<[NetworkAttachment]>)>,
    unreadable: usize,
}

/// One address two or more pods list on one network: (network, address) and the pods' podrefs,
/// sorted.
pub type SharedAddress = ((String, IpAddr), Vec<Arc<str>>);

/// The addresses two or more pods list, by (network, address).
#[derive(Debug, Default)]
pub struct Shared {
    /// The addresses, sorted by (network, address).
    pub addresses: Vec<SharedAddress>,
    /// Live pods left out because their network-status cannot be read.
    pub unreadable: usize,
}

impl Listings {
    /// The addresses two or more pods list. Each listed address becomes a hash of (network,
    /// address) beside its place (pod, attachment, address), 16 bytes, sorted so that equal
    /// hashes are neighbours; a run of equal hashes is told apart exactly by reading its
    /// members' addresses again (each its own, once). A map keyed by the addresses themselves
    /// took about 57 bytes each: 7.5 MB at 100,000 pods on top of the index, at every look.
    pub fn shared(&self) -> Shared {
        let hasher = RandomState::new();
        self.shared_by(|network, ip| hasher.hash_one((network, ip)))
    }

    /// [`shared`](Self::shared) with the hash given (a test makes every address collide).
    pub(super) fn shared_by(&self, hash: impl Fn(&str, IpAddr) -> u64) -> Shared {
        let mut keys: Vec<(u64, Place)> = Vec::with_capacity(self.pods.len());
        for (pod, (podref, networks)) in self.pods.iter().enumerate() {
            for (place, network, ip) in listed(pod, podref, networks) {
                keys.push((hash(&network, ip), place));
            }
        }
        keys.sort_unstable();
        let mut shared: BTreeMap<(String, IpAddr), BTreeSet<Arc<str>>> = BTreeMap::new();
        for run in keys.chunk_by(|a, b| a.0 == b.0).filter(|r| r.len() > 1) {
            let mut by_address: BTreeMap<(Cow<'_, str>, IpAddr), BTreeSet<&Arc<str>>> =
                BTreeMap::new();
            for &(_, place) in run {
                if let Some((podref, network, ip)) = self.at(place) {
                    by_address.entry((network, ip)).or_default().insert(podref);
                }
            }
            for ((network, ip), podrefs) in by_address {
                if podrefs.len() > 1 {
                    shared
                        .entry((network.into_owned(), ip))
                        .or_default()
                        .extend(podrefs.into_iter().cloned());
                }
            }
        }
        Shared {
            addresses: shared
                .into_iter()
                .map(|(k, pods)| (k, pods.into_iter().collect()))
                .collect(),
            unreadable: self.unreadable,
        }
    }

    /// The podref, network and canonical address at `place`.
    fn at(&self, place: Place) -> Option<(&Arc<str>, Cow<'_, str>, IpAddr)> {
        let (podref, networks) = self.pods.get(usize::try_from(place.pod).ok()?)?;
        let n = networks.get(usize::from(place.attachment))?;
        let ip = n.ips.get(usize::from(place.ip))?;
        let network = qualified_network(&n.name, PodKey::namespace_of(podref));
        Some((podref, network, ip.to_canonical()))
    }
}

/// Where a listed address is: its pod's position in the listings, its attachment's and its
/// own (both bounded by the network-status caps, far under `u16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Place {
    pod: u32,
    attachment: u16,
    ip: u16,
}

/// What the pod at position `pod` lists: each address's place, network and canonical form (a
/// place that does not fit is left out: more pods than `u32` counts cannot be listed).
fn listed<'a>(
    pod: usize,
    podref: &'a str,
    networks: &'a [NetworkAttachment],
) -> impl Iterator<Item = (Place, Cow<'a, str>, IpAddr)> {
    let namespace = PodKey::namespace_of(podref);
    let pod = u32::try_from(pod).ok();
    networks.iter().enumerate().flat_map(move |(a, n)| {
        let network = qualified_network(&n.name, namespace);
        n.ips.iter().enumerate().filter_map(move |(i, ip)| {
            let place = Place {
                pod: pod?,
                attachment: u16::try_from(a).ok()?,
                ip: u16::try_from(i).ok()?,
            };
            Some((place, network.clone(), ip.to_canonical()))
        })
    })
}

impl Index {
    /// Every address that two or more live, not terminal, pods list on one network (the three
    /// steps the controller takes with the lock let go in between, in one).
    pub fn duplicates(&self) -> Duplicates {
        let shared = self.listings().shared();
        Duplicates {
            found: self.resolve(&shared.addresses),
            unreadable: shared.unreadable,
        }
    }

    /// What live, not terminal, pods list.
    pub fn listings(&self) -> Listings {
        let mut out = Listings {
            pods: Vec::with_capacity(self.pods.live_count()),
            unreadable: 0,
        };
        for (podref, live) in self.pods.live_shared() {
            if live.terminal {
                continue;
            }
            match &live.networks {
                Some(n) => out.pods.push((podref.clone(), n.clone())),
                None => out.unreadable += usize::from(live.malformed_status.is_some()),
            }
        }
        out
    }

    /// The duplicates among `shared` (whereabouts' addresses only), with their pods' uids and
    /// the pool that holds or serves each. Each pool's range is looked up in the addresses
    /// (sorted), and an address's entry by its key: the work grows with the addresses and the
    /// pools, never with their product times the entries.
    pub fn resolve(&self, shared: &[SharedAddress]) -> Vec<Duplicate> {
        let mut by_ip: BTreeMap<IpAddr, Vec<usize>> = BTreeMap::new();
        for (i, ((_, ip), _)) in shared.iter().enumerate() {
            by_ip.entry(*ip).or_default().push(i);
        }
        let mut best: Vec<Option<(u8, &str, Option<EntryOwner>)>> = vec![None; shared.len()];
        for (name, pool) in self.pools.all() {
            let Some(range) = pool.range else { continue };
            let networks = self.networks.of_pool(name);
            for (ip, indices) in by_ip.range(range.network()..=range.broadcast()) {
                let entry = pool.entry_at(*ip).map(|e| EntryOwner {
                    podref: e.podref.clone(),
                    id: e.id.clone(),
                });
                for &i in indices {
                    let ((network, _), pods) = &shared[i];
                    let of_network = networks.is_some_and(|n| n.iter().any(|n| n == network));
                    let named = entry
                        .as_ref()
                        .is_some_and(|h| pods.iter().any(|p| **p == *h.podref));
                    let rank = match (of_network, entry.is_some(), named) {
                        (true, true, _) => 3,
                        (true, false, _) => 2,
                        (false, _, true) => 1,
                        _ => continue,
                    };
                    // Ties go to the first name, so the answer does not depend on hash order.
                    let b = &mut best[i];
                    if b.as_ref()
                        .is_none_or(|(r, n, _)| rank > *r || (rank == *r && name.as_str() < *n))
                    {
                        *b = Some((rank, name.as_str(), entry.clone()));
                    }
                }
            }
        }
        shared
            .iter()
            .zip(best)
            .filter_map(|(((network, ip), pods), best)| {
                let (pool, entry) = match best {
                    Some((_, name, entry)) => (Some(name.to_owned()), entry),
                    None => (None, None),
                };
                if pool.is_none() && !self.networks.is_whereabouts(network) {
                    return None;
                }
                let pods = pods
                    .iter()
                    .map(|p| DuplicatePod {
                        podref: p.to_string(),
                        uid: self
                            .pods
                            .live(p)
                            .map(|l| l.uid.to_string())
                            .unwrap_or_default(),
                    })
                    .collect();
                Some(Duplicate {
                    network: network.clone(),
                    ip: *ip,
                    pods,
                    pool,
                    entry,
                })
            })
            .collect()
    }
}
