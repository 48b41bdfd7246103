//! CPU time and CRI calls of one node-agent relist on a real containerd, at 50 and 200
//! sandboxes, with nothing changed and with one sandbox stopped.
//!
//! `cargo bench --bench cri_relist` (as root; containerd from `scripts/setup.sh`).
//! CPU time is this process's (CLOCK_PROCESS_CPUTIME_ID on a current-thread runtime, so it is
//! the relist's own work: listing, decoding, diffing); containerd's side is not included.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ipreclaim::node::cri::{CriPodSource, connect};
use podlife::PodStatusCache;
use podlife::clock::RealClock;
use podlife::pleg::{Pleg, PlegConfig};
use testenv::Containerd;

const RELISTS: u32 = 50;

fn process_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

async fn measure(containerd: &Containerd, sandboxes: usize) -> anyhow::Result<()> {
    containerd.remove_all_sandboxes().await?;
    let mut ids = Vec::with_capacity(sandboxes);
    for i in 0..sandboxes {
        let uid = format!("bench-uid-{i:04}");
        ids.push(
            containerd
                .run_sandbox(&format!("p{i}"), &uid, "bench")
                .await?,
        );
    }
    let source = CriPodSource::new(connect(containerd.socket.to_str().unwrap()).await?);
    let calls = source.calls();
    let (mut pleg, mut events) = Pleg::new(
        source,
        Some(Arc::new(PodStatusCache::new())),
        RealClock::shared(),
        PlegConfig::default(),
    );
    pleg.relist().await;
    while events.try_recv().is_ok() {}

    let before = (
        calls.list_pod_sandbox.get() + calls.list_containers.get(),
        calls.pod_sandbox_status.get(),
    );
    let (cpu0, wall0) = (process_cpu(), Instant::now());
    for _ in 0..RELISTS {
        pleg.relist().await;
    }
    let (cpu, wall) = (process_cpu() - cpu0, wall0.elapsed());
    let lists = calls.list_pod_sandbox.get() + calls.list_containers.get() - before.0;
    let statuses = calls.pod_sandbox_status.get() - before.1;
    println!(
        "{sandboxes:>4} sandboxes, nothing changed: {:.3} ms CPU, {:.3} ms wall per relist; \
         per relist {:.1} list calls, {:.1} PodSandboxStatus calls",
        cpu.as_secs_f64() * 1e3 / f64::from(RELISTS),
        wall.as_secs_f64() * 1e3 / f64::from(RELISTS),
        lists as f64 / f64::from(RELISTS),
        statuses as f64 / f64::from(RELISTS),
    );

    containerd.stop_sandbox(&ids[0]).await?;
    let s0 = calls.pod_sandbox_status.get();
    let (cpu0, wall0) = (process_cpu(), Instant::now());
    pleg.relist().await;
    println!(
        "{sandboxes:>4} sandboxes, one stopped:     {:.3} ms CPU, {:.3} ms wall; {} PodSandboxStatus call(s), {} event(s)",
        (process_cpu() - cpu0).as_secs_f64() * 1e3,
        wall0.elapsed().as_secs_f64() * 1e3,
        calls.pod_sandbox_status.get() - s0,
        std::iter::from_fn(|| events.try_recv().ok()).count(),
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes --bench; `cargo test --benches` would too: only run when benching.
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let containerd = Containerd::start()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        for n in [50, 200] {
            measure(&containerd, n).await?;
        }
        containerd.remove_all_sandboxes().await
    })
}
