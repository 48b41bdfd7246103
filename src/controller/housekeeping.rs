//! Between sweeps: the index forgets what no longer matters, and its gauges are exported (one
//! series per pool, removed with its pool); its lock's acquisitions are read at each scrape.

use std::collections::HashSet;
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

/// The per-pool series on /metrics.
#[derive(Debug, Default)]
pub struct PoolSeries {
    labels: HashSet<String>,
}

impl PoolSeries {
    /// Sets the index's gauges; a deleted pool's series go with it.
    pub fn export(&mut self, ix: &Index, metrics: &ControllerMetrics, namespace: &str) {
        let errors = ix.networks().errors().len();
        metrics.nad_config_errors.set(errors as i64);
        metrics.cached_pods.set(ix.pods().live_count() as i64);
        let malformed = ix.pods().malformed_status_count();
        metrics.malformed_network_status.set(malformed as i64);
        let mut labels = HashSet::with_capacity(ix.pools().all().len());
        for (name, pool) in ix.pools().all() {
            let label = pool_label(namespace, name);
            let allocated = pool.entries.len() + pool.marked.len();
            let problems = pool.problems.len() + pool.bad_fences.len();
            let l = label.clone().into();
            metrics.allocations.get_or_create(&l).set(allocated as i64);
            metrics.pool_problems.get_or_create(&l).set(problems as i64);
            // A pool's breaker series exists at 0 before its first hold.
            let _ = metrics.breaker_holds.get_or_create(&l);
            labels.insert(label);
        }
        for gone in self.labels.difference(&labels) {
            let l = gone.clone().into();
            metrics.allocations.remove(&l);
            metrics.pool_problems.remove(&l);
            metrics.breaker_holds.remove(&l);
        }
        self.labels = labels;
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
