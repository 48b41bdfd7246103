//! Node agent footprint: RSS and CPU of the `ipreclaim node-agent` process on a node of N pods
//! of C containers each (default 110 x 3: the kubelet's default pod limit), relisting every
//! second (the default) against a real containerd, with the pods, their allocations and a
//! private control plane as a real node has them.
//!
//! `cargo bench --bench node_footprint [-- PODS [CONTAINERS [SECONDS]]]` (as root; containerd
//! from `scripts/setup.sh`). Prints the agent's RSS and peak after the window, its CPU share of
//! one core over the window (user and system time from /proc, so the agent's whole work:
//! relists, PLEG, watches, metrics) and its CPU per relist. containerd's own CPU is not the
//! agent's and is not counted. `IPRECLAIM_BIN=PATH` runs that binary instead of the one built
//! with the bench (to measure a saved build, or the image's).

mod common;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use testenv::procs::ChildGuard;
use testenv::{Containerd, ControlPlane};

use common::support;

const NODE: &str = "bench-node";
const RANGE: &str = "198.18.0.0/16";
/// Creates in flight (containerd serialises much of a sandbox's setup anyway).
const CONCURRENCY: usize = 4;

fn args() -> (usize, usize, u64) {
    let mut numbers = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse::<u64>().ok());
    let pods = numbers.next().unwrap_or(110) as usize;
    let containers = numbers.next().unwrap_or(3) as usize;
    let seconds = numbers.next().unwrap_or(60);
    (pods, containers, seconds)
}

/// A `/proc/PID/status` field in KiB.
fn status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    common::status_kib(pid, field).ok_or_else(|| anyhow::anyhow!("no {field} for pid {pid}"))
}

/// The agent's relist count and the seconds they took, from its /metrics.
async fn relists(addr: SocketAddr) -> (f64, f64) {
    let text = common::metrics_text(addr).await;
    (
        common::metric(&text, "ipreclaim_node_relist_duration_seconds_count"),
        common::metric(&text, "ipreclaim_node_relist_duration_seconds_sum"),
    )
}

/// Pod `i` on the bench node, listing `ip` on the bench network.
fn pod(ns: &str, i: usize, ip: &str) -> Pod {
    let status = format!(r#"[{{"name":"{ns}/macvlan","interface":"net1","ips":["{ip}"]}}]"#);
    let mut pod =
        testenv::fixtures::annotated_pod(&format!("p{i}"), NETWORK_STATUS_ANNOTATION, &status);
    pod.spec
        .as_mut()
        .expect("fixture pods have a spec")
        .node_name = Some(NODE.into());
    pod
}

/// One pod as the node has it: its API object, its sandbox (the address comes from the test
/// CNI plugin) and its containers. Returns (pool offset, sandbox id, pod name).
async fn node_pod(
    containerd: &Containerd,
    pods: &Api<Pod>,
    ns: &str,
    i: usize,
    containers: usize,
) -> anyhow::Result<(u32, String, String)> {
    let name = format!("p{i}");
    // The uid comes from the apiserver, the address from the sandbox: create with a stand-in
    // address, then run the sandbox with the pod's uid.
    let created = pods
        .create(&PostParams::default(), &pod(ns, i, "0.0.0.0"))
        .await?;
    let uid = created.metadata.uid.clone().unwrap_or_default();
    let sandbox = containerd.run_sandbox(&name, &uid, ns).await?;
    for c in 0..containers {
        containerd
            .run_container(&sandbox, &format!("c{c}"), (&name, &uid, ns))
            .await?;
    }
    let status = containerd
        .sandbox_status(&sandbox, false)
        .await?
        .status
        .and_then(|s| s.network)
        .map(|n| n.ip)
        .unwrap_or_default();
    let ip: IpAddr = status
        .parse()
        .map_err(|_| anyhow::anyhow!("sandbox {sandbox} has no address: {status:?}"))?;
    let base: ipnet::IpNet = RANGE.parse()?;
    let offset = match (ip, base.network()) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => u32::from(ip) - u32::from(net),
        _ => anyhow::bail!("{ip} is not in {RANGE}"),
    };
    Ok((offset, sandbox, name))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (n, containers, seconds) = args();
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    let client = cp.client().await;
    cp.install_crds(&client).await?;
    let ns = cp.namespace(&client, "node-bench").await;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &testenv::fixtures::node(NODE))
        .await?;
    let containerd = tokio::task::spawn_blocking(Containerd::start).await??;

    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let made: Vec<(u32, String, String)> = stream::iter(0..n)
        .map(|i| node_pod(&containerd, &pods, &ns, i, containers))
        .buffer_unordered(CONCURRENCY)
        .try_collect()
        .await?;
    let allocations: BTreeMap<String, _> = made
        .iter()
        .map(|(offset, sandbox, name)| {
            (offset.to_string(), support::allocation(&ns, name, sandbox))
        })
        .collect();
    support::create_pool(&client, &ns, "198.18.0.0-16", RANGE, allocations).await;
    eprintln!(
        "{n} pods of {containers} containers running in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let port = testenv::procs::free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let agent = ChildGuard::spawn(
        Command::new(
            std::env::var_os("IPRECLAIM_BIN")
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_ipreclaim").into()),
        )
        .args([
            "node-agent",
            &format!("--cri-endpoint=unix://{}", containerd.socket.display()),
            &format!("--node-name={NODE}"),
            &format!("--whereabouts-namespace={ns}"),
            &format!("--metrics-addr={addr}"),
        ])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null()),
    )?;
    let pid = agent.id();
    while !common::get(addr, "/readyz")
        .await
        .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Warm: the first relists create the status cache and the watches fill.
    while relists(addr).await.0 < 5.0 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (count0, sum0) = relists(addr).await;
    let (cpu0, wall0) = (common::cpu_seconds_of(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let (count1, sum1) = relists(addr).await;
    let (cpu, wall) = (common::cpu_seconds_of(pid) - cpu0, wall0.elapsed());
    let (rss, peak) = (status_kib(pid, "VmRSS:")?, status_kib(pid, "VmHWM:")?);
    let (anon, file) = (status_kib(pid, "RssAnon:")?, status_kib(pid, "RssFile:")?);
    let threads = status_kib(pid, "Threads:")?;
    let relisted = count1 - count0;
    println!(
        "node agent, {n} pods x {containers} containers, relist every 1s: RSS {:.1} MiB (peak {:.1} MiB; heap and stacks {:.1}, binary and libraries {:.1}; {threads} threads)",
        rss as f64 / 1024.0,
        peak as f64 / 1024.0,
        anon as f64 / 1024.0,
        file as f64 / 1024.0,
    );
    println!(
        "node agent: {:.2}% of a core over {:.0}s ({:.0} ms CPU), {relisted:.0} relists, {:.2} ms CPU per relist (the agent's whole work over the window / relists), relist wall time mean {:.2} ms",
        cpu / wall.as_secs_f64() * 100.0,
        wall.as_secs_f64(),
        cpu * 1000.0,
        cpu * 1000.0 / relisted.max(1.0),
        (sum1 - sum0) * 1000.0 / relisted.max(1.0),
    );
    drop(agent);
    containerd.remove_all_sandboxes().await?;
    Ok(())
}
