//! Between sweeps: the index forgets what no longer matters, and its gauges are exported (one
//! series per pool, removed with its pool); its lock's acquisitions are read at each scrape.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;

use super::report::pool_label;
use crate::index::{Index, SharedIndex};
use crate::telemetry::ControllerMetrics;

/// Tombstones without allocations are kept this long at least.
const TOMBSTONE_MEMORY: Duration = Duration::from_secs(600);

/// Forgets tombstones and listings the sweep no longer needs.
pub fn expire(ix: &mut Index, leak_grace: Duration, now: Instant) {
    // checked: an Instant cannot go back before the machine started.
    if let Some(before) = now.checked_sub(TOMBSTONE_MEMORY) {
        ix.expire_tombstones(before);
    }
    let keep = TOMBSTONE_MEMORY.max(leak_grace.saturating_mul(2));
    if let Some(before) = now.checked_sub(keep) {
        ix.expire_listings(before);
    }
}

/// The per-pool and per-network series on /metrics.
#[derive(Debug, Default)]
pub struct PoolSeries {
    pools: HashSet<String>,
    networks: HashSet<String>,
}

/// A count as a gauge value (an IPv6 range holds more than a gauge does).
fn gauge(n: u128) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl PoolSeries {
    /// Sets the index's gauges; a deleted pool's (or network's) series go with it.
    pub fn export(&mut self, ix: &Index, metrics: &ControllerMetrics, namespace: &str) {
        let errors = ix.networks().errors().len();
        metrics.nad_config_errors.set(errors as i64);
        metrics.cached_pods.set(ix.pods().live_count() as i64);
        let malformed = ix.pods().malformed_status_count();
        metrics.malformed_network_status.set(malformed as i64);
        let mut pools = HashSet::with_capacity(ix.pools().all().len());
        for (name, pool) in ix.pools().all() {
            let l = pool_label(namespace, name).into();
            let problems = pool.problems.len() as i64;
            metrics.pool_problems.get_or_create(&l).set(problems);
            // A pool's breaker series exists at 0 before its first hold.
            let _ = metrics.breaker_holds.get_or_create(&l);
        }
        let mut networks: BTreeMap<String, (u128, u128, u128)> = BTreeMap::new();
        let g = &metrics.pools;
        for u in ix.pool_usage() {
            let label = pool_label(namespace, &u.pool);
            let l = label.clone().into();
            metrics
                .allocations
                .get_or_create(&l)
                .set(u.allocated as i64);
            g.size.get_or_create(&l).set(gauge(u.size));
            g.allocated.get_or_create(&l).set(u.allocated as i64);
            g.free.get_or_create(&l).set(gauge(u.free()));
            g.fenced.get_or_create(&l).set(u.fenced as i64);
            g.cooling.get_or_create(&l).set(u.cooling as i64);
            for n in &u.networks {
                let sums = networks.entry(n.clone()).or_default();
                *sums = (
                    sums.0 + u.size,
                    sums.1 + u.allocated as u128,
                    sums.2 + u.free(),
                );
            }
            pools.insert(label);
        }
        for (network, (size, allocated, free)) in &networks {
            let l = network.clone().into();
            g.network_size.get_or_create(&l).set(gauge(*size));
            g.network_allocated.get_or_create(&l).set(gauge(*allocated));
            g.network_free.get_or_create(&l).set(gauge(*free));
        }
        for gone in self.pools.difference(&pools) {
            let l = gone.clone().into();
            metrics.allocations.remove(&l);
            metrics.pool_problems.remove(&l);
            metrics.breaker_holds.remove(&l);
            metrics.pool_leak_candidates.remove(&l);
            metrics.pool_held.remove(&l);
            for family in [&g.size, &g.allocated, &g.free, &g.fenced, &g.cooling] {
                family.remove(&l);
            }
        }
        let networks: HashSet<String> = networks.into_keys().collect();
        for gone in self.networks.difference(&networks) {
            let l = gone.clone().into();
            for family in [&g.network_size, &g.network_allocated, &g.network_free] {
                family.remove(&l);
            }
        }
        self.pools = pools;
        self.networks = networks;
    }
}

/// The index lock's acquisitions on /metrics (`ipreclaim_index_lock_acquisitions_total`),
/// read at each scrape.
#[derive(Debug)]
pub struct IndexLockCollector(pub SharedIndex);

impl Collector for IndexLockCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let a = self.0.acquisitions();
        let mut family = encoder.encode_descriptor(
            "ipreclaim_index_lock_acquisitions",
            "Acquisitions of the controller's index lock, by mode (read, write)",
            None,
            MetricType::Counter,
        )?;
        for (mode, n) in [("read", a.reads), ("write", a.writes)] {
            let labels = [("mode", mode)];
            ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
