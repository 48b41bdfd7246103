//! Support that knows ipreclaim, shared by the test binaries (`mod support;`, or
//! `#[path = "../support/mod.rs"] mod support;` from a test folder) and the benchmarks
//! (`#[path = "../../tests/support/mod.rs"]` in `benches/common`). What needs no ipreclaim type
//! lives in `testenv` (which must not depend on this crate): [`InProcess`], the waits with a
//! report of what was seen (`testenv::poll::wait_seen`, `wait_metric`, `wait_metric_line`,
//! `testenv::events::wait_with_reason`).
//!
//! Here: starting `ipreclaim controller` or `ipreclaim node-agent` inside the test process, with
//! its flags parsed as the binary parses them; creating the objects whereabouts and Multus
//! write (NADs, pools and their entries, reservations).
#![allow(dead_code)] // each test binary uses a part of this module

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;

use clap::Parser;
use ipreclaim::api::{
    IPAllocation, IPPool, IPPoolSpec, NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec,
    OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec,
};
use ipreclaim::controller::{self, ControllerArgs};
use ipreclaim::node::{self, NodeAgentArgs};
use ipreclaim::telemetry::Health;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use testenv::poll::{http_get, metric_value};
use testenv::program::{InProcess, Shutdown};
use tokio::sync::oneshot;

/// The controller's timings in tests: a sweep every 200 ms, no leak grace.
/// (Stand-in pods have a grace of 1 s and no kubelet: no margin after it.)
pub const TEST_TIMINGS: &[&str] = &[
    "--sweep-interval=200ms",
    "--leak-grace=0s",
    "--fence-grace-margin=0s",
];

/// Flags as the binary parses them; a later flag overrides an earlier one.
#[derive(Parser)]
#[command(args_override_self = true)]
struct Flags<A: clap::Args> {
    #[command(flatten)]
    args: A,
}

/// `subcommand --whereabouts-namespace=NS --metrics-addr=127.0.0.1:0 FLAGS...`, parsed.
fn parse<A: clap::Args>(subcommand: &str, namespace: &str, flags: &[&str]) -> A {
    let mut argv = vec![
        subcommand.to_string(),
        format!("--whereabouts-namespace={namespace}"),
        "--metrics-addr=127.0.0.1:0".into(),
    ];
    argv.extend(flags.iter().map(|f| f.to_string()));
    Flags::<A>::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("{subcommand} flags {argv:?}: {e}"))
        .args
}

/// A program running in this process until [`stop`](Self::stop)ped (dropped, it is told to stop
/// and not awaited).
pub struct Program {
    program: InProcess,
    /// Where its /metrics (and /healthz, /readyz) is served.
    pub metrics: SocketAddr,
}

/// Starts `run` (a program's `run`, sending its health and metrics address once it serves)
/// as `what` in this process; returns once it is ready.
async fn start<F, Fut>(what: &str, run: F) -> Program
where
    F: FnOnce(Shutdown, oneshot::Sender<(Health, SocketAddr)>) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let ready = |(health, _): &(Health, SocketAddr)| health.is_ready();
    let (program, (_, metrics)) = InProcess::start(what, run, ready).await;
    Program { program, metrics }
}

/// Sends the logs of the programs a test runs in process to that test's captured output, so a
/// failed test shows them (a passing one does not): `IPRECLAIM_TEST_LOG` filters them
/// (default `ipreclaim=info`). For tests only: a benchmark's runs must not pay for it.
pub fn log_to_test_output() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("IPRECLAIM_TEST_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("ipreclaim=info"));
        // Another subscriber set first (a test of its own logging) is kept.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_test_writer()
            .try_init();
    });
}

/// Runs `ipreclaim controller` with `flags` through `client`, watching pools in `namespace`;
/// returns once it is ready (caches synced).
pub async fn controller(client: Client, namespace: &str, flags: &[&str]) -> Program {
    let args: ControllerArgs = parse("controller", namespace, flags);
    start("controller", |shutdown, started| {
        controller::run(client, args, shutdown, move |running| {
            let _ = started.send((running.health.clone(), running.metrics_addr));
        })
    })
    .await
}

/// Runs `ipreclaim node-agent` with `flags` (its CRI endpoint and node name among them)
/// through `client`, for pools in `namespace`; returns once it is ready.
pub async fn node_agent(client: Client, namespace: &str, flags: &[&str]) -> Program {
    let args: NodeAgentArgs = parse("node-agent", namespace, flags);
    start("node agent", |shutdown, started| {
        node::run(client, args, shutdown, move |running| {
            let _ = started.send((running.health.clone(), running.metrics_addr));
        })
    })
    .await
}

impl Program {
    /// Stops it and fails the test if it ended with an error. Stopping twice is a no-op.
    pub async fn stop(&mut self) {
        self.program.stop().await;
    }

    /// Its /metrics text.
    pub async fn metrics_text(&self) -> String {
        http_get(self.metrics, "/metrics").await.1
    }

    /// The value of `series` on its /metrics (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics_text().await, series)
    }

    /// Waits until its /metrics has a line starting with `line`; a failure shows that
    /// metric's lines.
    pub async fn wait_metric_line(&self, line: &str) {
        testenv::poll::wait_metric_line(self.metrics, line).await;
    }

    /// Waits until `series` reads `want`; a failure shows that metric's lines.
    pub async fn wait_metric(&self, series: &str, want: f64) {
        testenv::poll::wait_metric(self.metrics, series, want).await;
    }
}

/// Multus's network-status for a pod: its default network, and `ips` on network `ns/nad`
/// (interface `net1`).
pub fn network_status(ns: &str, nad: &str, ips: &[&str]) -> String {
    serde_json::json!([
        {"name": "cbr0", "interface": "eth0", "ips": ["10.244.0.5"], "default": true},
        {"name": format!("{ns}/{nad}"), "interface": "net1", "ips": ips},
    ])
    .to_string()
}

/// Creates NetworkAttachmentDefinition `name` in `ns` with CNI config `config` (any text: a
/// test may give one that is not JSON).
pub async fn create_nad(client: &Client, ns: &str, name: &str, config: &str) {
    let nad = NetworkAttachmentDefinition::new(
        name,
        NetworkAttachmentDefinitionSpec {
            config: Some(config.into()),
        },
    );
    Api::<NetworkAttachmentDefinition>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &nad)
        .await
        .unwrap_or_else(|e| panic!("create NAD {ns}/{name}: {e}"));
}

/// A pool entry as the whereabouts CNI writes it: sandbox `sandbox` of pod `ns/pod` on `net1`.
pub fn allocation(ns: &str, pod: &str, sandbox: &str) -> IPAllocation {
    IPAllocation {
        id: sandbox.into(),
        podref: format!("{ns}/{pod}"),
        ifname: Some("net1".into()),
        ipamclaimref: None,
    }
}

/// Creates IPPool `name` over `range` in `ns` with `allocations` (offset -> entry).
pub async fn create_pool(
    client: &Client,
    ns: &str,
    name: &str,
    range: &str,
    allocations: BTreeMap<String, IPAllocation>,
) {
    let pool = IPPool::new(
        name,
        IPPoolSpec {
            range: range.into(),
            allocations,
        },
    );
    Api::<IPPool>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pool)
        .await
        .unwrap_or_else(|e| panic!("create pool {ns}/{name}: {e}"));
}

/// Creates the OverlappingRangeIPReservation of `ip` (its name) for sandbox `sandbox` of pod
/// `ns/pod`, as the whereabouts CNI writes it beside a pool entry.
pub async fn create_reservation(client: &Client, ns: &str, ip: &str, sandbox: &str, pod: &str) {
    let r = OverlappingRangeIPReservation::new(
        ip,
        OverlappingRangeIPReservationSpec {
            containerid: Some(sandbox.into()),
            podref: format!("{ns}/{pod}"),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        },
    );
    Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &r)
        .await
        .unwrap_or_else(|e| panic!("create reservation {ns}/{ip}: {e}"));
}

/// The names of the reservations in `ns`.
pub async fn reservation_names(client: &Client, ns: &str) -> Vec<String> {
    Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap_or_else(|e| panic!("list reservations in {ns}: {e}"))
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .collect()
}

/// `kubectl ipreclaim` as an operator runs it: the real kubectl, with the built binary on its
/// PATH as the `kubectl-ipreclaim` plugin, against `kubeconfig`. Add the subcommand and flags.
pub fn kubectl_ipreclaim(kubeconfig: &std::path::Path) -> std::process::Command {
    static PLUGIN_DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let dir = PLUGIN_DIR.get_or_init(|| {
        let dir = testenv::procs::run_dir("kubectl-plugin").expect("a run directory");
        std::os::unix::fs::symlink(
            env!("CARGO_BIN_EXE_ipreclaim"),
            dir.join("kubectl-ipreclaim"),
        )
        .expect("symlink kubectl-ipreclaim");
        dir
    });
    let kubectl = testenv::procs::binary("kubectl").expect("kubectl");
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = std::process::Command::new(kubectl);
    cmd.arg("ipreclaim")
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("WHEREABOUTS_NAMESPACE")
        .env_remove("IPRECLAIM_RELEASE_COOLDOWN");
    cmd
}
