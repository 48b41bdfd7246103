//! Flags of `ipreclaim controller`.

use std::net::SocketAddr;
use std::time::Duration;

use crate::flags::{parse_duration, parse_ratio};
use crate::release::{BudgetConfig, DEFAULT_POOL_WRITE_BURST, DEFAULT_POOL_WRITE_QPS};
use crate::telemetry::LogFormat;

/// Flags of `ipreclaim controller` (each also read from the environment variable shown).
#[derive(Debug, Clone, clap::Args)]
#[command(args_override_self = true)] // a repeated flag takes its last value (the chart's extraArgs)
pub struct ControllerArgs {
    /// Namespace of the IPPools and reservations (where the whereabouts CNI writes them).
    #[arg(long, env = "WHEREABOUTS_NAMESPACE", default_value = "kube-system")]
    pub whereabouts_namespace: String,
    /// Time between leak sweeps.
    #[arg(long, env = "IPRECLAIM_SWEEP_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// How long an allocation must look leaked before the sweep releases it.
    #[arg(long, env = "IPRECLAIM_LEAK_GRACE", default_value = "2m", value_parser = parse_duration)]
    pub leak_grace: Duration,
    /// The leak grace for an allocation whose pod does not exist at all (no annotation can lag
    /// behind it; e.g. deleted while no replica ran); at most --leak-grace.
    #[arg(long, env = "IPRECLAIM_MISSING_POD_GRACE", default_value = "5s", value_parser = parse_duration)]
    pub missing_pod_grace: Duration,
    /// How long a live entry of a network with overlapping ranges must be seen without its
    /// reservation before the leader creates it (guarded: never replacing one); keep it well
    /// above whereabouts' 10 s request timeout, since whereabouts writes the entry first and
    /// fails the pod's ADD if the reservation exists when it creates it.
    #[arg(long, env = "IPRECLAIM_RESERVATION_REPAIR_GRACE", default_value = "2m", value_parser = parse_duration)]
    pub reservation_repair_grace: Duration,
    /// Release the addresses of Succeeded/Failed pods.
    #[arg(long, env = "IPRECLAIM_RELEASE_TERMINAL_PODS", default_value_t = true, action = clap::ArgAction::Set)]
    pub release_terminal_pods: bool,
    /// Decide and report (logs, Events, metrics) but write nothing.
    #[arg(long, env = "IPRECLAIM_DRY_RUN")]
    pub dry_run: bool,
    /// Largest share of a pool (over 10 allocations) the sweeps may release within 10 minutes;
    /// more is held.
    #[arg(long, env = "IPRECLAIM_MAX_RELEASE_RATIO", default_value = "0.5", value_parser = parse_ratio)]
    pub max_release_ratio: f64,
    /// Keep the addresses of pods deleted while their node was not Ready, or deleted before
    /// their kubelet stopped them (a force deletion: the sandbox may still run there), until the
    /// node has been Ready and the fence set for the settle, its Node is deleted, or
    /// --fence-timeout passes.
    #[arg(long, env = "IPRECLAIM_FENCE_UNREADY_NODES", default_value_t = true, action = clap::ArgAction::Set)]
    pub fence_unready_nodes: bool,
    /// How long a node must be Ready again before its fences lift (time to kill what it should
    /// no longer run), unless the node agent there reports the pod's sandboxes gone first. Keep
    /// it above the cluster's node-monitor-grace-period (50s): a node whose kubelet died stays
    /// Ready that long.
    #[arg(long, env = "IPRECLAIM_FENCE_SETTLE", default_value = "60s", value_parser = parse_duration)]
    pub fence_settle: Duration,
    /// Added to a fenced pod's termination grace period: its node, Ready again, must have been
    /// Ready for that grace plus this margin (if longer than --fence-settle) before the fence
    /// lifts, since the returning kubelet stops the pod with its full grace period.
    #[arg(long, env = "IPRECLAIM_FENCE_GRACE_MARGIN", default_value = "15s", value_parser = parse_duration)]
    pub fence_grace_margin: Duration,
    /// Lift a fence after this long even if its node never comes back (default: never); counted
    /// by the apiserver's clock (whatever the node or its agent says).
    #[arg(long, env = "IPRECLAIM_FENCE_TIMEOUT", value_parser = parse_duration)]
    pub fence_timeout: Option<Duration>,
    /// Keep each released address out of the pool this long (its entry is marked, not removed)
    /// so a stale client of the old pod does not reach a new one; the leader returns it to the
    /// pool when the time is up by its own clock and it has seen the entry cooling this long
    /// (whoever wrote it). 0: off.
    #[arg(long, env = "IPRECLAIM_RELEASE_COOLDOWN", default_value = "0s", value_parser = parse_duration)]
    pub release_cooldown: Duration,
    /// A fenced entry removed by a write that is not ipreclaim's while its node is not heard
    /// from (Ready Unknown, or no Node) is reported as another cleaner's (a Warning
    /// MarkedEntryRemovedByOtherWriter) if the node is still not heard from this long after: a
    /// returning kubelet, whose own CNI DEL frees the entry, reports its node within about
    /// 10 s. Cooling entries are reported at once.
    #[arg(long, env = "IPRECLAIM_OTHER_WRITER_WAIT", default_value = "30s", value_parser = parse_duration)]
    pub other_writer_wait: Duration,
    /// Retries of a failed release before a Warning Event (the sweep still owns the leak).
    #[arg(long, env = "IPRECLAIM_MAX_RETRIES", default_value_t = 5)]
    pub max_retries: u32,
    /// Pool patches per second (each patch releases everything pending for its pool).
    #[arg(long, env = "IPRECLAIM_POOL_WRITE_QPS", default_value_t = DEFAULT_POOL_WRITE_QPS)]
    pub pool_write_qps: f64,
    /// Pool patch burst.
    #[arg(long, env = "IPRECLAIM_POOL_WRITE_BURST", default_value_t = DEFAULT_POOL_WRITE_BURST)]
    pub pool_write_burst: u32,
    /// Least time between two patches of one pool (longer for a pool whose patches take
    /// long: four times what they take, averaged, up to 1s); releases arriving meanwhile join
    /// the next.
    #[arg(long, env = "IPRECLAIM_POOL_PATCH_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub pool_patch_interval: Duration,
    /// Reservation deletes per second (one request per address; after the pool entries).
    #[arg(
        long,
        env = "IPRECLAIM_RESERVATION_DELETE_QPS",
        default_value_t = 500.0
    )]
    pub reservation_delete_qps: f64,
    /// Reservation delete burst.
    #[arg(
        long,
        env = "IPRECLAIM_RESERVATION_DELETE_BURST",
        default_value_t = 1000
    )]
    pub reservation_delete_burst: u32,
    /// All API writes per second together (pool patches, reservation deletes, Events), pool
    /// patches first; 0 for no limit.
    #[arg(long, env = "IPRECLAIM_WRITE_QPS", default_value_t = 600.0)]
    pub write_qps: f64,
    /// Burst of all API writes together.
    #[arg(long, env = "IPRECLAIM_WRITE_BURST", default_value_t = 1200)]
    pub write_burst: u32,
    /// API writes in flight at once.
    #[arg(long, env = "IPRECLAIM_MAX_INFLIGHT_WRITES", default_value_t = 8)]
    pub max_inflight_writes: usize,
    /// Elect a leader with a Lease; only the leader writes.
    #[arg(long, env = "IPRECLAIM_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "IPRECLAIM_LEASE_NAME",
        default_value = "ipreclaim-controller"
    )]
    pub lease_name: String,
    /// How long a Lease holds without renewal; a standby takes over after it. The holder stops
    /// writing two thirds of it after its last renewal; a replica that starts while another
    /// held it lately stands for it after one and a half of it (a running standby goes first).
    #[arg(long, env = "IPRECLAIM_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// Namespace of the Lease (default: $POD_NAMESPACE, else the whereabouts namespace).
    #[arg(long, env = "IPRECLAIM_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Namespace of the node agents' sandbox inventories (default: $POD_NAMESPACE, else the
    /// whereabouts namespace): the node agents' --inventory-namespace.
    #[arg(long, env = "IPRECLAIM_INVENTORY_NAMESPACE")]
    pub inventory_namespace: Option<String>,
    /// Address of /metrics, /healthz and /readyz (`[::]`: every address of both families;
    /// IPv4 only where the host has no IPv6).
    #[arg(long, env = "IPRECLAIM_METRICS_ADDR", default_value = "[::]:8080")]
    pub metrics_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "IPRECLAIM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl ControllerArgs {
    /// When fences lift, as the flags set it.
    pub(crate) fn fence_policy(&self) -> crate::rules::fence::FencePolicy {
        crate::rules::fence::FencePolicy {
            settle: self.fence_settle,
            timeout: self.fence_timeout,
            grace_margin: self.fence_grace_margin,
        }
    }

    /// The write budgets the flags set.
    pub(crate) fn budgets(&self) -> BudgetConfig {
        BudgetConfig {
            pool_qps: self.pool_write_qps,
            pool_burst: self.pool_write_burst,
            reservation_qps: self.reservation_delete_qps,
            reservation_burst: self.reservation_delete_burst,
            write_qps: self.write_qps,
            write_burst: self.write_burst,
            max_in_flight: self.max_inflight_writes,
        }
    }
}
