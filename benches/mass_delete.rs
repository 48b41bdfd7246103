//! Cluster benchmark on the real local control plane: N pods with whereabouts allocations are
//! deleted at once; prints how long the controller takes to release every address and how
//! many write requests it sends. `cargo bench --bench mass_delete [-- N]` (default 2000).

use std::time::{Duration, Instant};

use clap::Parser;
use futures::{StreamExt, stream};
use ipreclaim::api::{IPAllocation, IPPool, IPPoolSpec};
use ipreclaim::controller::{self, ControllerArgs};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use testenv::ControlPlane;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ControllerArgs,
}

fn pod(ns: &str, i: usize) -> Pod {
    let ip = format!("198.18.{}.{}", i / 256, i % 256);
    let status = format!(r#"[{{"name":"{ns}/macvlan","interface":"net1","ips":["{ip}"]}}]"#);
    testenv::fixtures::pod_with_network_status(&format!("p{i}"), &status)
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics_text(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics server");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    let client = cp.client().await;
    cp.install_crds(&client).await?;
    let ns = cp.namespace(&client, "bench").await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);

    let allocations = (0..n)
        .map(|i| {
            (
                i.to_string(),
                IPAllocation {
                    id: format!("sandbox-{i}"),
                    podref: format!("{ns}/p{i}"),
                    ifname: Some("net1".into()),
                    ipamclaimref: None,
                },
            )
        })
        .collect();
    let pool = IPPool::new(
        "198.18.0.0-16",
        IPPoolSpec {
            range: "198.18.0.0/16".into(),
            allocations,
        },
    );
    Api::<IPPool>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &pool)
        .await?;
    let created = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            let ns = ns.clone();
            async move { pods.create(&PostParams::default(), &pod(&ns, i)).await }
        })
        .buffer_unordered(32)
        .for_each(|r| async move {
            r.expect("create pod");
        })
        .await;
    eprintln!(
        "created {n} pods in {:.1}s",
        created.elapsed().as_secs_f64()
    );

    let args = Cli::try_parse_from([
        "controller".to_string(),
        format!("--whereabouts-namespace={ns}"),
        "--leader-election=false".into(),
        "--metrics-addr=127.0.0.1:0".into(),
    ])?
    .args;
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let ctl_client = client.clone();
    tokio::spawn(async move {
        controller::run(ctl_client, args, std::future::pending(), move |r| {
            let _ = addr_tx.send((r.metrics_addr, r.health.clone()));
        })
        .await
    });
    let (addr, health) = addr_rx.await?;
    while !health.is_ready() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let writes_before = metric(&metrics_text(addr).await, "ipreclaim_api_writes_total");

    // All at once, as a scale-down or a node drain does: many concurrent deletes.
    let start = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                pods.delete(&format!("p{i}"), &DeleteParams::default().grace_period(0))
                    .await
            }
        })
        .buffer_unordered(64)
        .for_each(|r| async move {
            r.expect("delete pod");
        })
        .await;
    let deleted = start.elapsed();
    // Watch the pool rather than poll it: a GET of a 2,000-entry pool costs the apiserver
    // real CPU, which would slow down what is being measured.
    let pools = Api::<IPPool>::namespaced(client.clone(), &ns);
    let config = watcher::Config::default().fields("metadata.name=198.18.0.0-16");
    let mut updates = watcher::watcher(pools, config).applied_objects().boxed();
    while let Some(pool) = updates.next().await {
        if pool?.spec.allocations.is_empty() {
            break;
        }
    }
    let released = start.elapsed();
    let text = metrics_text(addr).await;
    let writes = metric(&text, "ipreclaim_api_writes_total") - writes_before;
    let p_count = metric(&text, "ipreclaim_deletion_to_release_seconds_count");
    println!(
        "mass_delete: {n} pods deleted in {:.2}s (64 concurrent deletes)",
        deleted.as_secs_f64()
    );
    println!(
        "mass_delete: every allocation released {:.2}s after the delete started",
        released.as_secs_f64()
    );
    println!(
        "mass_delete: {writes} write requests for {n} addresses = {:.4} writes per address ({p_count} latency samples)",
        writes / n as f64
    );
    Ok(())
}
