//! The controller's and the node agent's metrics, all prefixed `ipreclaim_`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Reason code.
    pub reason: String,
}

/// A `pool` label (`namespace/name`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    /// The pool.
    pub pool: String,
}

/// A `network` label (`namespace/nad`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NetworkLabel {
    /// The network.
    pub network: String,
}

impl From<String> for NetworkLabel {
    fn from(network: String) -> Self {
        NetworkLabel { network }
    }
}

/// A `kind` label (an object kind, a PLEG event kind).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Object kind.
    pub kind: String,
}

impl From<String> for KindLabel {
    fn from(kind: String) -> Self {
        KindLabel { kind }
    }
}

/// A `cause` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabel {
    /// Failure cause.
    pub cause: String,
}

/// A `verb` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabel {
    /// API verb.
    pub verb: String,
}

/// The label set of one label `s` (`ReasonLabel`, `KindLabel`, ...).
pub(super) fn labels<L: From<String>>(s: &str) -> L {
    L::from(s.to_string())
}

/// Creates the series of `family` for each of `values` at 0: a family without series is not on
/// /metrics at all, and rate() and alerts need the zero.
pub(super) fn zero<'a, L, M>(family: &Family<L, M>, values: impl IntoIterator<Item = &'a str>)
where
    L: From<String> + Clone + std::hash::Hash + Eq,
    M: Default,
{
    for value in values {
        let _ = family.get_or_create(&labels(value));
    }
}

impl From<String> for ReasonLabel {
    fn from(reason: String) -> Self {
        ReasonLabel { reason }
    }
}
impl From<String> for PoolLabel {
    fn from(pool: String) -> Self {
        PoolLabel { pool }
    }
}
impl From<String> for CauseLabel {
    fn from(cause: String) -> Self {
        CauseLabel { cause }
    }
}
impl From<String> for VerbLabel {
    fn from(verb: String) -> Self {
        VerbLabel { verb }
    }
}

/// What the pool writer counts (the controller and the node agent both write).
#[derive(Clone)]
pub struct WriteMetrics {
    /// Addresses released, by reason.
    pub releases: Family<ReasonLabel, Counter>,
    /// Decisions reported but not written because of dry-run, by reason.
    pub dry_run_releases: Family<ReasonLabel, Counter>,
    /// Release failures, by cause.
    pub failures: Family<CauseLabel, Counter>,
    /// Pod deletion seen to release written, in seconds.
    pub deletion_to_release_seconds: Histogram,
    /// API writes, by verb.
    pub api_writes: Family<VerbLabel, Counter>,
    /// Addresses fenced (kept allocated because the pod's node was not Ready).
    pub fences: Counter,
    /// Fence writes that failed (the address is kept; the write is retried with backoff).
    pub fence_failures: Counter,
    /// Reservation deletes not sent: a live allocation of the pod holds the address.
    pub reservations_kept: Counter,
    /// Reservations put back: an allocation for the pod and address appeared as it was deleted.
    pub reservations_restored: Counter,
    /// Events published.
    pub events_published: Counter,
    /// Events that could not be published (queue full, or refused or failing for too long).
    pub events_dropped: Counter,
    /// Writes the apiserver answered `429 Too Many Requests` (then paused and sent again).
    pub throttled: Counter,
    /// Time of one pool patch request, in seconds (the apiserver's cost grows with the pool).
    pub pool_patch_seconds: Histogram,
    /// Entries released or fenced by one pool patch.
    pub pool_patch_entries: Histogram,
}

const LATENCY_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 500.0];

/// The causes [`WriteMetrics::failed`] is called with.
pub const FAILURE_CAUSES: [&str; 6] = [
    "api",
    "conflict",
    "refused",
    "stopped",
    "not_leader",
    "reservation",
];

impl WriteMetrics {
    /// Creates the metrics and registers them in `r` (already prefixed).
    pub fn new(r: &mut Registry) -> Self {
        let m = WriteMetrics {
            releases: Family::default(),
            dry_run_releases: Family::default(),
            failures: Family::default(),
            deletion_to_release_seconds: Histogram::new(LATENCY_BUCKETS),
            api_writes: Family::default(),
            fences: Counter::default(),
            fence_failures: Counter::default(),
            reservations_kept: Counter::default(),
            reservations_restored: Counter::default(),
            events_published: Counter::default(),
            events_dropped: Counter::default(),
            throttled: Counter::default(),
            pool_patch_seconds: Histogram::new(LATENCY_BUCKETS),
            pool_patch_entries: Histogram::new(BATCH_BUCKETS),
        };
        // Every known series from the start at 0.
        let reasons = crate::reclaim::Reason::ALL.map(|r| r.as_str());
        zero(&m.releases, reasons);
        zero(&m.dry_run_releases, reasons);
        zero(&m.failures, FAILURE_CAUSES);
        zero(&m.api_writes, ["patch", "delete"]);
        m.register_releases(r);
        m.register_writes(r);
        m
    }

    /// Releases, fences and reservations: what was written and why.
    fn register_releases(&self, r: &mut Registry) {
        r.register(
            "releases",
            "Addresses released, by reason",
            self.releases.clone(),
        );
        r.register(
            "dry_run_releases",
            "Releases decided but not written (dry-run), by reason",
            self.dry_run_releases.clone(),
        );
        r.register(
            "release_failures",
            "Release failures, by cause",
            self.failures.clone(),
        );
        r.register(
            "deletion_to_release_seconds",
            "Time from seeing a pod deletion to its addresses being released",
            self.deletion_to_release_seconds.clone(),
        );
        r.register(
            "fences",
            "Addresses fenced: kept allocated because the deleted pod's node was not Ready",
            self.fences.clone(),
        );
        r.register(
            "fence_write_failures",
            "Fence writes that failed: the address is kept and the fence retried with backoff, never released instead",
            self.fence_failures.clone(),
        );
        r.register(
            "reservations_kept",
            "Reservation deletes not sent because a live allocation of the pod holds the address",
            self.reservations_kept.clone(),
        );
        r.register(
            "reservations_restored",
            "Reservations put back because an allocation for the pod and address appeared as they were deleted",
            self.reservations_restored.clone(),
        );
    }

    /// The API writes themselves: patches, throttling, Events.
    fn register_writes(&self, r: &mut Registry) {
        r.register(
            "api_writes",
            "API write requests, by verb",
            self.api_writes.clone(),
        );
        r.register(
            "api_throttled",
            "Writes the apiserver answered 429 Too Many Requests; every write then paused for its Retry-After",
            self.throttled.clone(),
        );
        r.register(
            "pool_patch_duration_seconds",
            "Time of one pool patch request (the apiserver's cost grows with the pool's size)",
            self.pool_patch_seconds.clone(),
        );
        r.register(
            "pool_patch_entries",
            "Entries released or fenced by one pool patch",
            self.pool_patch_entries.clone(),
        );
        r.register(
            "events_published",
            "Kubernetes Events published",
            self.events_published.clone(),
        );
        r.register(
            "events_dropped",
            "Kubernetes Events dropped: queue full, or refused or failing for two minutes",
            self.events_dropped.clone(),
        );
    }

    /// Counts a release.
    pub fn released(&self, reason: &str) {
        self.releases.get_or_create(&labels(reason)).inc();
    }

    /// Counts a failure.
    pub fn failed(&self, cause: &str) {
        self.failures.get_or_create(&labels(cause)).inc();
    }

    /// Counts an API write.
    pub fn write(&self, verb: &str) {
        self.api_writes.get_or_create(&labels(verb)).inc();
    }
}

/// Every controller metric.
#[derive(Clone)]
pub struct ControllerMetrics {
    /// The pool writer's.
    pub writes: WriteMetrics,
    /// Allocations per pool.
    pub allocations: Family<PoolLabel, Gauge>,
    /// Per-pool capacity, on every replica (from its own cache).
    pub pools: PoolGauges,
    /// Per-pool leak candidates (leader only: the sweep's).
    pub pool_leak_candidates: Family<PoolLabel, Gauge>,
    /// 1 while the breaker holds the pool's sweep (leader only).
    pub pool_held: Family<PoolLabel, Gauge>,
    /// Pool entries that cannot be read (malformed key, offset out of range).
    pub pool_problems: Family<PoolLabel, Gauge>,
    /// Current sweep candidates (garbage waiting for the grace period), by reason.
    pub candidates: Family<ReasonLabel, Gauge>,
    /// Age in seconds of the oldest sweep candidate.
    pub oldest_candidate_seconds: Gauge,
    /// Items waiting in the work queue.
    pub queue_depth: Gauge,
    /// Items re-queued after a failure.
    pub retries: Counter,
    /// Sweep duration in seconds.
    pub sweep_duration_seconds: Histogram,
    /// Sweeps held by the blast-radius breaker, by pool.
    pub breaker_holds: Family<PoolLabel, Counter>,
    /// Pods found deleted by a re-list (no Delete event was seen).
    pub watch_gap_deletions: Counter,
    /// NetworkAttachmentDefinitions whose config cannot be parsed.
    pub nad_config_errors: Gauge,
    /// Pods whose network-status annotation is malformed.
    pub malformed_network_status: Gauge,
    /// Live pods in the controller's cache.
    pub cached_pods: Gauge,
    /// Addresses two or more live pods list on the network, on every replica.
    pub duplicate_addresses: Family<NetworkLabel, Gauge>,
    /// Objects skipped because they do not fit their schema, by kind.
    pub invalid_objects: Family<KindLabel, Gauge>,
    /// Addresses fenced now.
    pub fenced_addresses: Gauge,
    /// Age in seconds of the oldest fence held.
    pub oldest_fence_seconds: Gauge,
    /// Nodes whose Ready condition is not True: their pods' deletions are fenced.
    pub unready_nodes: Gauge,
    /// Node agent reports on fences that did not count, by why.
    pub fence_evidence_rejected: Family<ReasonLabel, Counter>,
    /// 1 while this replica leads and may write, else 0.
    pub leader: Gauge,
}

impl ControllerMetrics {
    /// Creates the metrics and registers them under `ipreclaim_`, with `ipreclaim_build_info`
    /// and the process metrics.
    pub fn new(registry: &mut Registry) -> Self {
        super::process::register(registry);
        let r = registry.sub_registry_with_prefix("ipreclaim");
        let m = ControllerMetrics {
            writes: WriteMetrics::new(r),
            allocations: Family::default(),
            pools: PoolGauges::default(),
            pool_leak_candidates: Family::default(),
            pool_held: Family::default(),
            pool_problems: Family::default(),
            candidates: Family::default(),
            oldest_candidate_seconds: Gauge::default(),
            queue_depth: Gauge::default(),
            retries: Counter::default(),
            sweep_duration_seconds: Histogram::new(LATENCY_BUCKETS),
            breaker_holds: Family::default(),
            watch_gap_deletions: Counter::default(),
            nad_config_errors: Gauge::default(),
            malformed_network_status: Gauge::default(),
            cached_pods: Gauge::default(),
            duplicate_addresses: Family::default(),
            fenced_addresses: Gauge::default(),
            oldest_fence_seconds: Gauge::default(),
            unready_nodes: Gauge::default(),
            fence_evidence_rejected: Family::default(),
            leader: Gauge::default(),
            invalid_objects: Family::default(),
        };
        m.pools.register(r);
        r.register(
            "pool_leak_candidates",
            "Allocations of the pool seen as garbage, waiting for their grace (the leader's; a standby has none)",
            m.pool_leak_candidates.clone(),
        );
        r.register(
            "pool_held",
            "1 while the breaker holds the pool's sweep for an operator (the leader's; a standby has none)",
            m.pool_held.clone(),
        );
        m.register_fencing(r);
        m.register_sweep(r);
        m.register_cache(r);
        m
    }

    /// Fences: held, their age, unready nodes, rejected node-agent reports.
    fn register_fencing(&self, r: &mut Registry) {
        r.register(
            "fenced_addresses",
            "Addresses held by a fence now",
            self.fenced_addresses.clone(),
        );
        r.register(
            "fence_oldest_age_seconds",
            "Age of the oldest fence held",
            self.oldest_fence_seconds.clone(),
        );
        r.register(
            "unready_nodes",
            "Nodes not Ready now: their pods' addresses are fenced when the pods are deleted",
            self.unready_nodes.clone(),
        );
        r.register(
            "fence_evidence_rejected",
            "Node agent reports on fences that did not count (another node, pod or fence; malformed), by reason",
            self.fence_evidence_rejected.clone(),
        );
        let reasons = [
            "unbound",
            "malformed",
            "wrong_node",
            "wrong_pod",
            "other_fence",
        ];
        zero(&self.fence_evidence_rejected, reasons);
    }

    /// Pools and the sweep: allocations, unreadable entries, candidates, holds.
    fn register_sweep(&self, r: &mut Registry) {
        r.register(
            "allocations",
            "Allocations per IP pool",
            self.allocations.clone(),
        );
        r.register(
            "pool_problem_entries",
            "Pool entries that cannot be read",
            self.pool_problems.clone(),
        );
        r.register(
            "gc_candidates",
            "Allocations seen as garbage, waiting for the grace period",
            self.candidates.clone(),
        );
        r.register(
            "gc_candidate_oldest_age_seconds",
            "Age of the oldest candidate",
            self.oldest_candidate_seconds.clone(),
        );
        r.register(
            "sweep_duration_seconds",
            "Duration of a leak sweep",
            self.sweep_duration_seconds.clone(),
        );
        r.register(
            "breaker_holds",
            "Sweeps held by the blast-radius breaker",
            self.breaker_holds.clone(),
        );
    }

    /// The cache and the queue: watches, bad input, leadership.
    fn register_cache(&self, r: &mut Registry) {
        r.register(
            "invalid_objects",
            "Objects skipped because they do not fit their schema, by kind",
            self.invalid_objects.clone(),
        );
        r.register(
            "leader",
            "1 while this replica leads and may write (it holds the Lease and renewed it within the renew deadline), else 0",
            self.leader.clone(),
        );
        r.register(
            "queue_depth",
            "Items waiting in the work queue",
            self.queue_depth.clone(),
        );
        r.register(
            "queue_retries",
            "Items re-queued after a failure",
            self.retries.clone(),
        );
        r.register(
            "watch_gap_deletions",
            "Pods found deleted by a re-list (no Delete event was seen)",
            self.watch_gap_deletions.clone(),
        );
        r.register(
            "nad_config_errors",
            "NetworkAttachmentDefinitions whose config cannot be used",
            self.nad_config_errors.clone(),
        );
        r.register(
            "malformed_network_status_pods",
            "Pods whose network-status annotation is malformed",
            self.malformed_network_status.clone(),
        );
        r.register(
            "cached_pods",
            "Live pods in the controller's cache",
            self.cached_pods.clone(),
        );
        r.register(
            "duplicate_addresses",
            "Addresses that two or more live pods list on the network (never released; each gets a Warning IPAddressDuplicate Event)",
            self.duplicate_addresses.clone(),
        );
    }
}

/// How full each pool and network is: computed on every replica from its own cache.
#[derive(Clone, Debug, Default)]
pub struct PoolGauges {
    /// Addresses the pool can hand out (range less network, broadcast and exclusions).
    pub size: Family<PoolLabel, Gauge>,
    /// Its entries, fenced ones included.
    pub allocated: Family<PoolLabel, Gauge>,
    /// Addresses still free.
    pub free: Family<PoolLabel, Gauge>,
    /// Its fenced entries.
    pub fenced: Family<PoolLabel, Gauge>,
    /// Its entries in their release cooldown.
    pub cooling: Family<PoolLabel, Gauge>,
    /// The same per network (its pools summed).
    pub network_size: Family<NetworkLabel, Gauge>,
    /// Allocated per network.
    pub network_allocated: Family<NetworkLabel, Gauge>,
    /// Free per network.
    pub network_free: Family<NetworkLabel, Gauge>,
}

impl PoolGauges {
    fn register(&self, r: &mut Registry) {
        let pools = [
            (
                "pool_size",
                "Addresses the pool can hand out: its range less the network and broadcast addresses and the network's exclusions",
                &self.size,
            ),
            (
                "pool_allocated",
                "Allocations in the pool, fenced and cooling ones included",
                &self.allocated,
            ),
            ("pool_free", "Addresses of the pool still free", &self.free),
            (
                "pool_fenced",
                "Allocations of the pool held by a fence",
                &self.fenced,
            ),
            (
                "pool_cooling",
                "Released addresses of the pool kept out of it by --release-cooldown",
                &self.cooling,
            ),
        ];
        for (name, help, family) in pools {
            r.register(name, help, family.clone());
        }
        let networks = [
            (
                "network_size",
                "Addresses the network's pools can hand out",
                &self.network_size,
            ),
            (
                "network_allocated",
                "Allocations in the network's pools",
                &self.network_allocated,
            ),
            (
                "network_free",
                "Addresses of the network's pools still free",
                &self.network_free,
            ),
        ];
        for (name, help, family) in networks {
            r.register(name, help, family.clone());
        }
    }
}
