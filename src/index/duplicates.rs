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

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use super::Index;
use crate::ipam::{PodKey, qualified_network};

/// Whom a pool entry names: its podref and sandbox id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holder {
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
    pub entry: Option<Holder>,
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

impl Index {
    /// Every address that two or more live, not terminal, pods list on one network. One pass
    /// over the live pods, one hash lookup per listed address.
    pub fn duplicates(&self) -> Duplicates {
        let mut first: HashMap<(std::borrow::Cow<'_, str>, IpAddr), &str> =
            HashMap::with_capacity(self.pods.live_count());
        let mut shared: BTreeMap<(String, IpAddr), BTreeSet<&str>> = BTreeMap::new();
        let mut unreadable = 0;
        for (podref, live) in self.pods.live_iter() {
            if live.terminal {
                continue;
            }
            let Some(networks) = live.networks.as_deref() else {
                unreadable += usize::from(live.malformed_status.is_some());
                continue;
            };
            let namespace = PodKey::namespace_of(podref);
            for n in networks {
                let network = qualified_network(&n.name, namespace);
                for ip in &n.ips {
                    match first.entry((network.clone(), ip.to_canonical())) {
                        Entry::Vacant(v) => {
                            v.insert(podref);
                        }
                        Entry::Occupied(o) if *o.get() != podref => {
                            let key = (o.key().0.to_string(), o.key().1);
                            let pods = shared.entry(key).or_insert_with(|| [*o.get()].into());
                            pods.insert(podref);
                        }
                        Entry::Occupied(_) => {}
                    }
                }
            }
        }
        let found = shared
            .into_iter()
            .map(|((network, ip), pods)| self.duplicate(network, ip, pods))
            .filter(|d| d.pool.is_some() || self.networks.is_whereabouts(&d.network))
            .collect();
        Duplicates { found, unreadable }
    }

    fn duplicate(&self, network: String, ip: IpAddr, pods: BTreeSet<&str>) -> Duplicate {
        let pods: Vec<DuplicatePod> = pods
            .into_iter()
            .map(|p| DuplicatePod {
                podref: p.to_owned(),
                uid: self.pods.live(p).map(|l| l.uid.clone()).unwrap_or_default(),
            })
            .collect();
        let (pool, entry) = match self.pool_of(&network, ip, &pods) {
            Some((pool, entry)) => (Some(pool), entry),
            None => (None, None),
        };
        Duplicate {
            network,
            ip,
            pods,
            pool,
            entry,
        }
    }

    /// The pool of `network` whose range holds `ip` (one with an entry for it first), else a
    /// pool whose entry for `ip` names one of `pods`; with whom that entry names.
    fn pool_of(
        &self,
        network: &str,
        ip: IpAddr,
        pods: &[DuplicatePod],
    ) -> Option<(String, Option<Holder>)> {
        let mut best: Option<(u8, &str, Option<Holder>)> = None;
        for (name, pool) in self.pools.all() {
            let entry = pool
                .entries
                .values()
                .chain(pool.marked.values())
                .chain(pool.cooling.values().map(|c| &c.entry))
                .find(|e| e.ip.to_canonical() == ip)
                .map(|e| Holder {
                    podref: e.podref.clone(),
                    id: e.id.clone(),
                });
            let of_network = self
                .networks
                .of_pool(name)
                .is_some_and(|n| n.iter().any(|n| n == network));
            let in_range = pool.range.is_some_and(|r| r.contains(&ip));
            let named = entry
                .as_ref()
                .is_some_and(|h| pods.iter().any(|d| d.podref == h.podref));
            let rank = match (of_network && in_range, entry.is_some(), named) {
                (true, true, _) => 3,
                (true, false, _) => 2,
                (false, _, true) => 1,
                _ => continue,
            };
            // Ties go to the first name, so the answer does not depend on hash order.
            if best
                .as_ref()
                .is_none_or(|(r, n, _)| rank > *r || (rank == *r && name.as_str() < *n))
            {
                best = Some((rank, name, entry));
            }
        }
        best.map(|(_, name, entry)| (name.to_owned(), entry))
    }
}
