//! CPU cost of one PLEG relist of 1,000 pods x 10 containers (plus a sandbox each), measured
//! in thread CPU time: with nothing changed, and with 10% of the containers changed.
//!
//! The listings are built before the clock starts, so the number is the PLEG's own work
//! (diffing, inspecting changed pods, caching, sending events, dropping the listing), not the
//! cost of the runtime client building its response.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use podlife::clock::RealClock;
use podlife::pleg::{Pleg, PlegConfig, PodSource};
use podlife::{Container, ContainerState, PodStatus, PodStatusCache, RuntimePod, SourceError};

const PODS: usize = 1000;
const CONTAINERS: usize = 10;

#[derive(Clone)]
struct Source {
    /// The next listing to return, prepared outside the measured time.
    listing: Arc<Mutex<Vec<RuntimePod>>>,
    status_calls: Arc<Mutex<u64>>,
}

impl PodSource for Source {
    async fn list_pods(&self) -> Result<Vec<RuntimePod>, SourceError> {
        Ok(std::mem::take(&mut *self.listing.lock().unwrap()))
    }
    async fn pod_status(&self, pod: &RuntimePod) -> Result<PodStatus, SourceError> {
        *self.status_calls.lock().unwrap() += 1;
        Ok(PodStatus {
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            ips: vec!["198.18.0.1".into()],
            ..PodStatus::empty(&pod.uid)
        })
    }
}

fn listing(changed: impl Fn(usize, usize) -> bool) -> Vec<RuntimePod> {
    (0..PODS)
        .map(|p| RuntimePod {
            uid: format!("{p:08}-0000-4000-8000-000000000000"),
            name: format!("pod-{p}"),
            namespace: "bench".into(),
            containers: (0..CONTAINERS)
                .map(|c| {
                    let state = if changed(p, c) {
                        ContainerState::Exited
                    } else {
                        ContainerState::Running
                    };
                    Container::new(format!("{p:032x}{c:032x}"), state)
                })
                .collect(),
            sandboxes: vec![Container::new(format!("{p:064x}"), ContainerState::Running)],
        })
        .collect()
}

fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Benchmarks relists alternating between listing `a` and `b` (identical: nothing changes).
fn bench_alternating(c: &mut Criterion, name: &str, a: Vec<RuntimePod>, b: Vec<RuntimePod>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let source = Source {
        listing: Arc::new(Mutex::new(a.clone())),
        status_calls: Arc::new(Mutex::new(0)),
    };
    let config = PlegConfig {
        channel_capacity: 4 * PODS * CONTAINERS,
        ..PlegConfig::default()
    };
    let cache = Arc::new(PodStatusCache::new());
    let (mut pleg, mut events) =
        Pleg::new(source.clone(), Some(cache), RealClock::shared(), config);
    rt.block_on(pleg.relist()); // warm: every pod known
    while events.try_recv().is_ok() {}
    let mut flip = false;
    let mut relists = 0u64;
    *source.status_calls.lock().unwrap() = 0;
    c.bench_function(name, |bench| {
        bench.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                flip = !flip;
                *source.listing.lock().unwrap() = if flip { b.clone() } else { a.clone() };
                // Fault the fresh listing's pages in before the clock starts.
                std::hint::black_box(&source.listing);
                let start = thread_cpu_time();
                rt.block_on(pleg.relist());
                spent += thread_cpu_time() - start;
                relists += 1;
                while events.try_recv().is_ok() {}
            }
            spent
        })
    });
    let calls = *source.status_calls.lock().unwrap();
    if relists == 0 {
        return; // filtered out on the command line
    }
    println!(
        "{name}: {:.2} status calls per relist ({calls} over {relists} relists)",
        calls as f64 / relists as f64
    );
}

fn relist(c: &mut Criterion) {
    let unchanged = listing(|_, _| false);
    bench_alternating(
        c,
        "relist/1000x10/nothing_changed",
        unchanged.clone(),
        unchanged.clone(),
    );
    // 10% of containers: every container of one pod in ten (a pod restart).
    bench_alternating(
        c,
        "relist/1000x10/10pct_changed_in_10pct_pods",
        unchanged.clone(),
        listing(|p, _| p % 10 == 0),
    );
    // 10% of containers spread over every pod: the worst case, every pod is inspected.
    bench_alternating(
        c,
        "relist/1000x10/10pct_changed_spread",
        unchanged,
        listing(|_, c| c == 0),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(5));
    targets = relist
}
criterion_main!(benches);
