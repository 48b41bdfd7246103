//! Which networks (NADs, `ns/name`) allocate from which pool. A plain NAD names its pools; a
//! node-slice NAD's pools are named per node, so they are matched by name and range as pools
//! come (an exact pool name wins over a slice match).

use std::collections::HashMap;

use ipnet::IpNet;

use crate::api::NetworkAttachmentDefinition;
use crate::ipam::capacity::capacity;
use crate::ipam::{IpRange, is_node_slice_pool, parse_nad_config};

/// A node-slice network: its `network_name`, the whole range it slices, and the subnets it
/// excludes.
#[derive(Debug, Clone)]
struct SliceNetwork {
    network_name: Option<String>,
    whole: IpNet,
    exclude: Vec<IpNet>,
}

/// NADs and the pools they map to.
#[derive(Debug, Default)]
pub struct NetworkIndex {
    /// Pool name -> networks that name it.
    by_pool: HashMap<String, Vec<String>>,
    /// Network -> pool names it names.
    pools_of: HashMap<String, Vec<String>>,
    /// Node-slice networks.
    slices: HashMap<String, SliceNetwork>,
    /// Pool name -> node-slice networks it is a node's slice of (used when `by_pool` has no
    /// exact entry).
    slice_pools: HashMap<String, Vec<String>>,
    /// Networks whose config cannot be used, with the error.
    errors: HashMap<String, String>,
    /// Pool name -> the range config it was named for (the first network's), for its size.
    ranges: HashMap<String, IpRange>,
    /// Network -> its reservations' naming: `Some(network_name)` where it has
    /// `enable_overlapping_ranges` (whereabouts reserves each address it hands out), `None`
    /// where it does not.
    reserves: HashMap<String, Option<Option<String>>>,
}

/// A NAD's key, `ns/name`.
pub fn nad_key(nad: &NetworkAttachmentDefinition) -> String {
    format!(
        "{}/{}",
        nad.metadata.namespace.as_deref().unwrap_or_default(),
        nad.metadata.name.as_deref().unwrap_or_default()
    )
}

impl NetworkIndex {
    /// Records a NAD's mapping to pools (or its config error); `pools` are the pools known
    /// with their ranges (a node-slice NAD matches them now, later pools as they come).
    pub fn upsert<'a>(
        &mut self,
        nad: &NetworkAttachmentDefinition,
        pools: impl Iterator<Item = (&'a str, Option<IpNet>)>,
    ) {
        let key = nad_key(nad);
        self.remove(&key);
        // No config here (it is a file on the node): nothing to map, nothing wrong.
        let Some(config) = nad.spec.config.as_deref().filter(|c| !c.trim().is_empty()) else {
            return;
        };
        match parse_nad_config(config) {
            Ok(Some(ipam)) if ipam.node_slice_size.is_some() => {
                self.reserves.insert(key.clone(), reserves(&ipam));
                // whereabouts slices only the first range (a parsed config has one).
                let Some(first) = ipam.ranges.first() else {
                    return;
                };
                let slice = SliceNetwork {
                    network_name: ipam.network_name.clone(),
                    whole: first.range,
                    exclude: first.exclude.clone(),
                };
                for (pool, range) in pools {
                    if range.is_some_and(|r| slice.holds(pool, &r)) {
                        let nets = self.slice_pools.entry(pool.to_owned()).or_default();
                        nets.push(key.clone());
                    }
                }
                self.slices.insert(key, slice);
            }
            Ok(Some(ipam)) => {
                self.reserves.insert(key.clone(), reserves(&ipam));
                let pools: Vec<String> =
                    ipam.pool_names(None).into_iter().map(|(_, n)| n).collect();
                for (pool, range) in pools.iter().zip(&ipam.ranges) {
                    self.ranges
                        .entry(pool.clone())
                        .or_insert_with(|| range.clone());
                }
                for p in &pools {
                    self.by_pool.entry(p.clone()).or_default().push(key.clone());
                }
                self.pools_of.insert(key, pools);
            }
            Ok(None) => {}
            Err(e) => {
                self.errors.insert(key, e.to_string());
            }
        }
    }

    /// Forgets a NAD.
    pub fn remove(&mut self, key: &str) {
        self.errors.remove(key);
        self.reserves.remove(key);
        if self.slices.remove(key).is_some() {
            self.slice_pools.retain(|_, nets| {
                nets.retain(|n| n != key);
                !nets.is_empty()
            });
        }
        for p in self.pools_of.remove(key).unwrap_or_default() {
            if let Some(nets) = self.by_pool.get_mut(&p) {
                nets.retain(|n| n != key);
                if nets.is_empty() {
                    self.by_pool.remove(&p);
                    self.ranges.remove(&p);
                }
            }
        }
    }

    /// How many addresses `pool` (with `range`, when it parses) can hand out: by the range
    /// config of the network that names it, else by its node-slice network's exclusions, else
    /// by its range alone (`0`: a range that does not parse).
    pub fn capacity_of(&self, pool: &str, range: Option<IpNet>) -> u128 {
        if let Some(r) = self.ranges.get(pool) {
            return capacity(r);
        }
        let Some(range) = range else { return 0 };
        let exclude = self
            .slice_pools
            .get(pool)
            .and_then(|nets| self.slices.get(nets.first()?))
            .map(|s| s.exclude.clone())
            .unwrap_or_default();
        capacity(&IpRange {
            range,
            range_start: None,
            range_end: None,
            exclude,
        })
    }

    /// A pool came (or changed): matches it against the node-slice networks.
    pub fn pool_added(&mut self, pool: &str, range: Option<IpNet>) {
        self.slice_pools.remove(pool);
        let Some(range) = range else { return };
        let nets: Vec<String> = self
            .slices
            .iter()
            .filter(|(_, s)| s.holds(pool, &range))
            .map(|(key, _)| key.clone())
            .collect();
        if !nets.is_empty() {
            self.slice_pools.insert(pool.to_owned(), nets);
        }
    }

    /// A pool went.
    pub fn pool_removed(&mut self, pool: &str) {
        self.slice_pools.remove(pool);
    }

    /// The networks known to allocate from `pool`.
    pub fn of_pool(&self, pool: &str) -> Option<&[String]> {
        self.by_pool
            .get(pool)
            .or_else(|| self.slice_pools.get(pool))
            .map(Vec::as_slice)
    }

    /// The `network_name`s of the node-slice networks `pool` is a node's slice of.
    pub fn slice_network_names(&self, pool: &str) -> Vec<Option<&str>> {
        let nets = self.slice_pools.get(pool).map_or(&[][..], Vec::as_slice);
        nets.iter()
            .filter_map(|key| Some(self.slices.get(key)?.network_name.as_deref()))
            .collect()
    }

    /// The `network_name` (`None`: unnamed) of the reservations whereabouts makes for the
    /// allocations of `pool`: only when every network known to allocate from it has
    /// `enable_overlapping_ranges` and they agree on the name. `None` when a network of it
    /// reserves nothing, they disagree, or none is known (a deleted NAD): no reservation is
    /// expected there.
    pub fn reservation_network(&self, pool: &str) -> Option<Option<&str>> {
        let nets = self.of_pool(pool)?;
        let mut named = nets
            .iter()
            .map(|n| self.reserves.get(n)?.as_ref().map(|name| name.as_deref()));
        let first = named.next()??;
        named.all(|n| n == Some(first)).then_some(first)
    }

    /// Whether `key` is a known NAD whose IPAM is whereabouts.
    pub fn is_whereabouts(&self, key: &str) -> bool {
        self.pools_of.contains_key(key) || self.slices.contains_key(key)
    }

    /// The NADs known, usable or not.
    pub fn keys(&self) -> Vec<String> {
        self.pools_of
            .keys()
            .chain(self.slices.keys())
            .chain(self.errors.keys())
            .cloned()
            .collect()
    }

    /// NADs whose config cannot be used, with the error.
    pub fn errors(&self) -> &HashMap<String, String> {
        &self.errors
    }
}

/// How `ipam`'s reservations are named: `Some(network_name)` with overlapping ranges on.
fn reserves(ipam: &crate::ipam::IpamConfig) -> Option<Option<String>> {
    let name = ipam.network_name.clone().filter(|n| !n.is_empty());
    ipam.enable_overlapping_ranges.then_some(name)
}

impl SliceNetwork {
    /// Whether `pool` (with `range`) is a node's slice of this network.
    fn holds(&self, pool: &str, range: &IpNet) -> bool {
        is_node_slice_pool(pool, range, &self.whole, self.network_name.as_deref())
    }
}
