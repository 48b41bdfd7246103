//! Cluster benchmark: memory of the `ipreclaim controller` process with N pods cached.
//! Runs the release binary as its own process against a private control plane, reads its
//! VmRSS before and after N pods (each with a network-status annotation and an allocation)
//! exist. `cargo bench --bench footprint [-- N]` (default 20000).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use testenv::procs::ChildGuard;

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    common::status_kib(pid, "VmRSS:").ok_or_else(|| anyhow::anyhow!("no VmRSS for pid {pid}"))
}

async fn cached_pods(addr: &str) -> f64 {
    let addr = addr.parse().expect("metrics address");
    common::metric(&common::metrics_text(addr).await, "ipreclaim_cached_pods ")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = common::pods_arg(20_000);
    // The pool and pods come after the controller starts, so the baseline is an idle process.
    let cluster = common::cluster(0).await?;
    let kubeconfig = cluster.kubeconfig();
    let port = testenv::procs::free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let child = ChildGuard::spawn(
        Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
            .args([
                "controller",
                &format!("--whereabouts-namespace={}", cluster.ns),
                "--leader-election=false",
                "--sweep-interval=1s",
                &format!("--metrics-addr={addr}"),
            ])
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null()),
    )?;
    let pid = child.id();
    let sock = addr.parse()?;
    while !common::get(sock, "/readyz")
        .await
        .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let idle = rss_kib(pid)?;
    cluster.add_pods(n).await?;
    while cached_pods(&addr).await < n as f64 {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let loaded = rss_kib(pid)?;
    let per_pod = (loaded.saturating_sub(idle)) as f64 * 1024.0 / n as f64;
    println!(
        "footprint: controller RSS idle {:.1} MiB",
        idle as f64 / 1024.0
    );
    println!(
        "footprint: controller RSS with {n} pods cached {:.1} MiB, {per_pod:.0} bytes per pod",
        loaded as f64 / 1024.0
    );
    drop(child);
    Ok(())
}
