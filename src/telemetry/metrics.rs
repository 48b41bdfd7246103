//! The controller's and the node agent's metrics, all prefixed `ipreclaim_`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

one_label! {
    /// A `reason` label.
    ReasonLabel { reason }
    /// A `pool` label (`namespace/name`).
    PoolLabel { pool }
    /// A `network` label (`namespace/nad`).
    NetworkLabel { network }
    /// A `kind` label (an object kind, a PLEG event kind).
    KindLabel { kind }
    /// A `cause` label.
    CauseLabel { cause }
    /// A `verb` label.
    VerbLabel { verb }
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
    /// Reservations the sweep deleted, by why: `orphan` (no pod of that name), `left_behind`
    /// (a live pod of that name that holds and lists no such address).
    pub reservations_swept: Family<ReasonLabel, Counter>,
    /// Missing reservations of live entries created again.
    pub reservations_repaired: Counter,
    /// Missing reservations found made meanwhile for another pod: reported, never replaced.
    pub reservation_conflicts: Counter,
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

/// The reasons of `reservations_swept_total`.
pub const SWEPT_RESERVATIONS: [&str; 2] = ["orphan", "left_behind"];

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
            reservations_swept: Family::default(),
            reservations_repaired: Counter::default(),
            reservation_conflicts: Counter::default(),
            events_published: Counter::default(),
            events_dropped: Counter::default(),
            throttled: Counter::default(),
            pool_patch_seconds: Histogram::new(LATENCY_BUCKETS),
            pool_patch_entries: Histogram::new(BATCH_BUCKETS),
        };
        // Every known series from the start at 0.
        let reasons = crate::rules::Reason::ALL.map(|r| r.as_str());
        zero(&m.releases, reasons);
        zero(&m.dry_run_releases, reasons);
        zero(&m.failures, FAILURE_CAUSES);
        zero(&m.api_writes, ["patch", "delete"]);
        zero(&m.reservations_swept, SWEPT_RESERVATIONS);
        register_metrics!(r;
            // Releases, fences and reservations: what was written and why.
            "releases", "Addresses released, by reason", m.releases;
            "dry_run_releases", "Releases decided but not written (dry-run), by reason", m.dry_run_releases;
            "release_failures", "Release failures, by cause", m.failures;
            "deletion_to_release_seconds", "Time from seeing a pod deletion to its addresses being released", m.deletion_to_release_seconds;
            "fences", "Addresses fenced: kept allocated because the deleted pod's node was not Ready", m.fences;
            "fence_write_failures", "Fence writes that failed: the address is kept and the fence retried with backoff, never released instead", m.fence_failures;
            "reservations_kept", "Reservation deletes not sent because a live allocation of the pod holds the address", m.reservations_kept;
            "reservations_restored", "Reservations put back because an allocation for the pod and address appeared as they were deleted", m.reservations_restored;
            "reservations_swept", "Reservations the sweep deleted, by reason: orphan (no pod of that name), left_behind (a live pod of that name holds and lists no such address)", m.reservations_swept;
            "reservations_repaired", "Reservations created again for live entries whose reservation was missing", m.reservations_repaired;
            "reservation_conflicts", "Missing reservations of live entries found made meanwhile for another pod (reported, never replaced)", m.reservation_conflicts;
            // The API writes themselves: patches, throttling, Events.
            "api_writes", "API write requests, by verb", m.api_writes;
            "api_throttled", "Writes the apiserver answered 429 Too Many Requests; every write then paused for its Retry-After", m.throttled;
            "pool_patch_duration_seconds", "Time of one pool patch request (the apiserver's cost grows with the pool's size)", m.pool_patch_seconds;
            "pool_patch_entries", "Entries released or fenced by one pool patch", m.pool_patch_entries;
            "events_published", "Kubernetes Events published", m.events_published;
            "events_dropped", "Kubernetes Events dropped: queue full, or refused or failing for two minutes", m.events_dropped;
        );
        m
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
    /// Fences past their settle, held because the node agent still sees a sandbox.
    pub fences_held_by_node_agent: Gauge,
    /// 1 while `--fence-timeout` is set and the apiserver's clock has not been read yet.
    pub fence_timeouts_waiting_for_clock: Gauge,
    /// Nodes whose Ready condition is not True: their pods' deletions are fenced.
    pub unready_nodes: Gauge,
    /// 1 when the last sweep that needed the node agents' sandbox inventories was forbidden to
    /// list them.
    pub sandbox_inventories_unreadable: Gauge,
    /// Node agent reports on fences that did not count, by why.
    pub fence_evidence_rejected: Family<ReasonLabel, Counter>,
    /// Cooling entries over 5 s past their marked end that the leader has not seen cooling
    /// for its `--release-cooldown` yet.
    pub cooldowns_past_end: Gauge,
    /// Live entries seen without their reservation by the last sweep (the leader's).
    pub reservations_missing: Gauge,
    /// 1 while this replica leads and may write, else 0.
    pub leader: Gauge,
    /// Marked entries (fenced, cooling) another writer removed or rewrote, by kind (the
    /// leader's).
    pub marked_removed_by_others: Family<KindLabel, Counter>,
}

/// The kinds of `marked_entries_removed_by_others_total`.
pub const MARKED_KINDS: [&str; 2] = ["fenced", "cooling"];

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
            fences_held_by_node_agent: Gauge::default(),
            fence_timeouts_waiting_for_clock: Gauge::default(),
            unready_nodes: Gauge::default(),
            sandbox_inventories_unreadable: Gauge::default(),
            fence_evidence_rejected: Family::default(),
            leader: Gauge::default(),
            cooldowns_past_end: Gauge::default(),
            reservations_missing: Gauge::default(),
            invalid_objects: Family::default(),
            marked_removed_by_others: Family::default(),
        };
        zero(&m.marked_removed_by_others, MARKED_KINDS);
        let evidence = [
            "unbound",
            "malformed",
            "wrong_node",
            "wrong_pod",
            "other_fence",
        ];
        zero(&m.fence_evidence_rejected, evidence);
        register_metrics!(r;
            // How full each pool and network is, on every replica.
            "pool_size", "Addresses the pool can hand out: its range less the network and broadcast addresses and the network's exclusions", m.pools.size;
            "pool_allocated", "Allocations in the pool, fenced and cooling ones included", m.pools.allocated;
            "pool_free", "Addresses of the pool still free", m.pools.free;
            "pool_fenced", "Allocations of the pool held by a fence", m.pools.fenced;
            "pool_cooling", "Released addresses of the pool kept out of it by --release-cooldown", m.pools.cooling;
            "cooldowns_past_end", "Cooling entries whose marked end passed over 5 s ago by the leader's clock, kept until it has seen them cooling for its --release-cooldown (an end written by a lagging clock, or the leader started since; a standby has none)", m.cooldowns_past_end;
            "network_size", "Addresses the network's pools can hand out", m.pools.network_size;
            "network_allocated", "Allocations in the network's pools", m.pools.network_allocated;
            "network_free", "Addresses of the network's pools still free", m.pools.network_free;
            // Per pool, the leader's: its candidates, its hold.
            "pool_leak_candidates", "Allocations of the pool seen as garbage, waiting for their grace (the leader's; a standby has none)", m.pool_leak_candidates;
            "pool_held", "1 while the breaker holds the pool's sweep for an operator (the leader's; a standby has none)", m.pool_held;
            // Fences: held, their age, unready nodes, rejected node-agent reports.
            "fenced_addresses", "Addresses held by a fence now", m.fenced_addresses;
            "fence_oldest_age_seconds", "Age of the oldest fence held", m.oldest_fence_seconds;
            "fences_held_by_node_agent", "Fences past their settle, held because the node agent on their node still lists a sandbox of the deleted pod (its kubelet is stopping it)", m.fences_held_by_node_agent;
            "fence_timeouts_waiting_for_clock", "1 while --fence-timeout is set and the apiserver's clock (the Date of GET /version) has not been read: no fence times out", m.fence_timeouts_waiting_for_clock;
            "unready_nodes", "Nodes not Ready now: their pods' addresses are fenced when the pods are deleted", m.unready_nodes;
            "sandbox_inventories_unreadable", "1 when the last sweep that needed the node agents' sandbox inventories was forbidden to list them: its releases went ahead without them", m.sandbox_inventories_unreadable;
            "fence_evidence_rejected", "Node agent reports on fences that did not count (another node, pod or fence; malformed), by reason", m.fence_evidence_rejected;
            "marked_entries_removed_by_others", "Fenced and cooling entries removed or rewritten by a write that is not ipreclaim's (a second cleaner, e.g. whereabouts' ip-reconciler), by kind (the leader's; each has a Warning MarkedEntryRemovedByOtherWriter Event)", m.marked_removed_by_others;
            // Pools and the sweep: allocations, unreadable entries, candidates, holds.
            "allocations", "Allocations per IP pool", m.allocations;
            "pool_problem_entries", "Pool entries that cannot be read", m.pool_problems;
            "gc_candidates", "Allocations seen as garbage, waiting for the grace period", m.candidates;
            "gc_candidate_oldest_age_seconds", "Age of the oldest candidate", m.oldest_candidate_seconds;
            "sweep_duration_seconds", "Duration of a leak sweep", m.sweep_duration_seconds;
            "breaker_holds", "Sweeps held by the blast-radius breaker", m.breaker_holds;
            "reservations_missing", "Live entries of networks with overlapping ranges seen without their reservation by the last sweep (the leader's; each is created again after --reservation-repair-grace)", m.reservations_missing;
            // The cache and the queue: watches, bad input, leadership.
            "invalid_objects", "Objects skipped because they do not fit their schema, by kind", m.invalid_objects;
            "leader", "1 while this replica leads and may write (it holds the Lease and renewed it within the renew deadline), else 0", m.leader;
            "queue_depth", "Items waiting in the work queue", m.queue_depth;
            "queue_retries", "Items re-queued after a failure", m.retries;
            "watch_gap_deletions", "Pods found deleted by a re-list (no Delete event was seen)", m.watch_gap_deletions;
            "nad_config_errors", "NetworkAttachmentDefinitions whose config cannot be used", m.nad_config_errors;
            "malformed_network_status_pods", "Pods whose network-status annotation is malformed", m.malformed_network_status;
            "cached_pods", "Live pods in the controller's cache", m.cached_pods;
            "duplicate_addresses", "Addresses that two or more live pods list on the network (never released; each gets a Warning IPAddressDuplicate Event)", m.duplicate_addresses;
        );
        m
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
