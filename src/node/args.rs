//! Flags of `ipreclaim node-agent`.

use std::net::SocketAddr;
use std::time::Duration;

use crate::flags::{parse_duration, parse_ratio};
use crate::telemetry::LogFormat;

/// A watch timeout: whole seconds from 1 s to 1 h (the apiserver takes seconds; 0 would turn
/// the watcher's idle check off).
fn parse_watch_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) || d > Duration::from_secs(3600) {
        return Err(format!("{s:?} is not between 1s and 1h"));
    }
    if d.subsec_nanos() != 0 {
        return Err(format!("{s:?} is not a whole number of seconds"));
    }
    Ok(d)
}

/// Flags of `ipreclaim node-agent` (each also read from the environment variable shown).
#[derive(Debug, Clone, clap::Args)]
#[command(args_override_self = true)] // a repeated flag takes its last value (the chart's extraArgs)
pub struct NodeAgentArgs {
    /// The container runtime's CRI socket.
    #[arg(
        long,
        env = "IPRECLAIM_CRI_ENDPOINT",
        default_value = "unix:///run/containerd/containerd.sock"
    )]
    pub cri_endpoint: String,
    /// This node's name (from the downward API in the chart).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// This agent's own pod uid (from the downward API in the chart). A runtime listing that
    /// does not list it is not taken as this node's runtime (a wrong --cri-endpoint): no fence
    /// evidence and no release come from it. Unset: not checked.
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,
    /// Namespace of the IPPools and reservations (where the whereabouts CNI writes them).
    #[arg(long, env = "WHEREABOUTS_NAMESPACE", default_value = "kube-system")]
    pub whereabouts_namespace: String,
    /// Namespace of this node's sandbox inventory Lease (default: $POD_NAMESPACE, else the
    /// whereabouts namespace): the controller's --inventory-namespace.
    #[arg(long, env = "IPRECLAIM_INVENTORY_NAMESPACE")]
    pub inventory_namespace: Option<String>,
    /// Time between CRI relists.
    #[arg(long, env = "IPRECLAIM_RELIST_PERIOD", default_value = "1s", value_parser = parse_duration)]
    pub relist_period: Duration,
    /// The apiserver ends each watch of this node's IPFences after this or a little less
    /// (drawn from its last quarter), so a watch whose connection died without a word (a node
    /// freeze, a partition across an apiserver restart) is made again at most this plus 5 s
    /// after its last word. This plus 5 s and a few relists must stay under the controller's
    /// --fence-settle: a returning node's "still present" must land before the settle lifts
    /// its fences. Whole seconds, 1s to 1h.
    #[arg(long, env = "IPRECLAIM_FENCE_WATCH_TIMEOUT", default_value = "40s", value_parser = parse_watch_timeout)]
    pub fence_watch_timeout: Duration,
    /// Without a successful relist for this long, /healthz fails.
    #[arg(long, env = "IPRECLAIM_RELIST_THRESHOLD", default_value = "3m", value_parser = parse_duration)]
    pub relist_threshold: Duration,
    /// How long a sandbox must be dead before its pool entries are released.
    #[arg(long, env = "IPRECLAIM_SANDBOX_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub sandbox_grace: Duration,
    /// Decide and report (logs, Events, metrics) but write nothing.
    #[arg(long, env = "IPRECLAIM_DRY_RUN")]
    pub dry_run: bool,
    /// Largest share of a pool (over 10 allocations) this agent may release within 10
    /// minutes; more is held (Warning Event on the pool) and looked at again after the grace.
    #[arg(long, env = "IPRECLAIM_MAX_RELEASE_RATIO", default_value = "0.5", value_parser = parse_ratio)]
    pub max_release_ratio: f64,
    /// Keep each released address out of the pool this long (its entry is marked, not removed)
    /// so a stale client of the old pod does not reach a new one; the controller returns it to
    /// the pool when the time is up. 0: off.
    #[arg(long, env = "IPRECLAIM_RELEASE_COOLDOWN", default_value = "0s", value_parser = parse_duration)]
    pub release_cooldown: Duration,
    /// CRI calls per second.
    #[arg(long, env = "IPRECLAIM_CRI_QPS", default_value_t = 50.0)]
    pub cri_qps: f64,
    /// CRI call burst.
    #[arg(long, env = "IPRECLAIM_CRI_BURST", default_value_t = 100)]
    pub cri_burst: u32,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "IPRECLAIM_METRICS_ADDR", default_value = "[::]:8081")]
    pub metrics_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "IPRECLAIM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}
