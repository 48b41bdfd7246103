//! The node agent's metrics, prefixed `ipreclaim_node_` (its releases are counted by the
//! shared [`WriteMetrics`](super::WriteMetrics) under `ipreclaim_`).

use podlife::pleg::{EventKind, PlegHandle, RelistStats};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::metrics::{KindLabel, labels, zero};

one_label! {
    /// A CRI `method` label.
    MethodLabel { method }
    /// An `outcome` label.
    OutcomeLabel { outcome }
    /// A `state` label (a fenced pod's lifecycle state).
    StateLabel { state }
}

/// Every node agent metric.
#[derive(Clone)]
pub struct NodeMetrics {
    /// Duration of a relist.
    pub relist_duration_seconds: Histogram,
    /// Time between the starts of two relists.
    pub relist_interval_seconds: Histogram,
    /// Relists whose listing failed (the runtime did not answer).
    pub relist_failures: Counter,
    /// CRI calls by method.
    pub cri_calls: Family<MethodLabel, Counter>,
    /// PLEG events handled, by kind.
    pub pleg_events: Family<KindLabel, Counter>,
    /// PLEG events dropped because the channel was full.
    pub pleg_dropped_events: Counter,
    /// 1 while the PLEG relists within its threshold.
    pub pleg_healthy: Gauge,
    /// Runtime pods whose uid has no pod in the API.
    pub orphaned_runtime_pods: Gauge,
    /// Dead sandboxes waiting for their grace or a retry.
    pub dead_sandboxes_pending: Gauge,
    /// Seconds since the oldest dead sandbox still waiting died (0: none waits).
    pub dead_sandbox_oldest_wait_seconds: Gauge,
    /// 1 while the runtime's newest listing has no Ready sandbox of the agent's own pod.
    pub runtime_unverified: Gauge,
    /// Dead sandboxes handled, by outcome.
    pub dead_sandboxes: Family<OutcomeLabel, Counter>,
    /// NADs, node slices or pools (or pool entries) that could not be used.
    pub config_errors: Counter,
    /// Pods of this node's fences, by lifecycle state (terminating, terminated, finished).
    pub fenced_pods: Family<StateLabel, Gauge>,
    /// Reports that a fenced pod's sandboxes are gone, by outcome (reported, failed).
    pub fence_reports: Family<OutcomeLabel, Counter>,
}

impl NodeMetrics {
    /// Creates the metrics and registers them under `ipreclaim_node_`, with
    /// `ipreclaim_build_info` and the process metrics.
    pub fn new(registry: &mut Registry) -> Self {
        let buckets = [
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ];
        let m = NodeMetrics {
            relist_duration_seconds: Histogram::new(buckets),
            relist_interval_seconds: Histogram::new(buckets),
            relist_failures: Counter::default(),
            cri_calls: Family::default(),
            pleg_events: Family::default(),
            pleg_dropped_events: Counter::default(),
            pleg_healthy: Gauge::default(),
            orphaned_runtime_pods: Gauge::default(),
            dead_sandboxes_pending: Gauge::default(),
            dead_sandbox_oldest_wait_seconds: Gauge::default(),
            runtime_unverified: Gauge::default(),
            dead_sandboxes: Family::default(),
            config_errors: Counter::default(),
            fenced_pods: Family::default(),
            fence_reports: Family::default(),
        };
        super::process::register(registry);
        let r = registry.sub_registry_with_prefix("ipreclaim_node");
        // Known series at 0 from the start.
        zero(&m.fenced_pods, ["terminating", "terminated", "finished"]);
        zero(&m.fence_reports, ["reported", "failed"]);
        zero(&m.pleg_events, EventKind::SENT.iter().map(|k| k.as_str()));
        register_metrics!(r;
            "cri_calls", "CRI calls, by method", m.cri_calls;
            // The PLEG: relists, their failures, events, health.
            "relist_duration_seconds", "Duration of a CRI relist", m.relist_duration_seconds;
            "relist_interval_seconds", "Time between the starts of two relists", m.relist_interval_seconds;
            "relist_failures", "Relists whose listing failed", m.relist_failures;
            "pleg_events", "PLEG events handled, by kind", m.pleg_events;
            "pleg_dropped_events", "PLEG events dropped (channel full)", m.pleg_dropped_events;
            "pleg_healthy", "1 while the PLEG relists within its threshold", m.pleg_healthy;
            "runtime_unverified", "1 while the runtime's newest listing has no Ready sandbox of this agent's own pod (--pod-uid): it is not taken as this node's runtime", m.runtime_unverified;
            // Dead sandboxes, orphaned runtime pods, fence reports.
            "orphaned_runtime_pods", "Runtime pods with no pod in the API (not acted on)", m.orphaned_runtime_pods;
            "dead_sandboxes_pending", "Dead sandboxes waiting for the grace or a retry", m.dead_sandboxes_pending;
            "dead_sandbox_oldest_wait_seconds", "Seconds since the oldest dead sandbox still waiting (grace, retry, in use, held, unverified, or a look under way) died; 0 when none waits", m.dead_sandbox_oldest_wait_seconds;
            "dead_sandboxes", "Dead sandboxes handled, by outcome", m.dead_sandboxes;
            "config_errors", "NADs, node slices or pools (or pool entries) that could not be used", m.config_errors;
            "fenced_pods", "Pods of this node's fences, by lifecycle state (terminating: a sandbox runs; terminated: stopped, not removed; finished: none left)", m.fenced_pods;
            "fence_reports", "Reports that a fenced pod's sandboxes are gone from this node, by outcome", m.fence_reports;
        );
        m
    }

    /// Creates the dead-sandbox outcome series at 0 (the labels are the node agent's).
    pub fn zero_outcomes(&self, outcomes: &[&str]) {
        zero(&self.dead_sandboxes, outcomes.iter().copied());
    }

    /// Records one relist (the PLEG's observer).
    pub fn observe_relist(&self, stats: &RelistStats, pleg: &PlegHandle) {
        if stats.ok {
            self.relist_duration_seconds
                .observe(stats.duration.as_secs_f64());
        } else {
            self.relist_failures.inc();
        }
        if let Some(i) = stats.interval {
            self.relist_interval_seconds.observe(i.as_secs_f64());
        }
        self.pleg_healthy.set(i64::from(pleg.healthy().is_ok()));
        // The PLEG counts drops; follow its total.
        let dropped = pleg.metrics().dropped_events;
        let seen = self.pleg_dropped_events.get();
        if dropped > seen {
            self.pleg_dropped_events.inc_by(dropped - seen);
        }
    }

    /// Counts a PLEG event handled.
    pub fn pleg_event(&self, kind: EventKind) {
        self.pleg_events.get_or_create(&labels(kind.as_str())).inc();
    }

    /// Counts a dead sandbox handled.
    pub fn sandbox_outcome(&self, outcome: &str) {
        self.dead_sandboxes.get_or_create(&labels(outcome)).inc();
    }
}
