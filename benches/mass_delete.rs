//! Cluster benchmark on the real local control plane: N pods with whereabouts allocations are
//! deleted at once; prints how long the controller takes to release every address and how
//! many write requests it sends, how often the controller took its index lock per pod, and
//! how many heap allocations the whole process made per address (the controller runs in
//! process; the benchmark's own deletes are counted too, and are the same before and after a
//! change). `cargo bench --bench mass_delete [-- N]` (default 2000).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The system allocator, counting allocations.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

use futures::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = common::pods_arg(2000);
    let cluster = common::cluster(n).await?;
    let controller = cluster.start_controller().await;
    let addr = controller.metrics;
    let text = common::metrics_text(addr).await;
    let writes_before = common::metric(&text, "ipreclaim_api_writes_total");
    let locks_before = common::metric(&text, "ipreclaim_index_lock_acquisitions_total");
    let allocations_before = ALLOCATIONS.load(Ordering::Relaxed);

    // All at once, as a scale-down or a node drain does: many concurrent deletes.
    let pods = cluster.pods();
    let start = Instant::now();
    testenv::fixtures::delete_numbered_pods(&pods, n, 64).await;
    let deleted = start.elapsed();
    // Watch the pool rather than poll it: a GET of a large pool costs the apiserver real CPU,
    // which would slow down what is being measured.
    let config = watcher::Config::default().fields(&format!("metadata.name={}", common::POOL));
    let mut updates = watcher::watcher(cluster.pools(), config)
        .applied_objects()
        .boxed();
    while let Some(pool) = updates.next().await {
        if pool?.spec.allocations.is_empty() {
            break;
        }
    }
    let released = start.elapsed();
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations_before;
    let text = common::metrics_text(addr).await;
    let writes = common::metric(&text, "ipreclaim_api_writes_total") - writes_before;
    // The reservation looks and Events after the last release are not waited for.
    let locks = common::metric(&text, "ipreclaim_index_lock_acquisitions_total") - locks_before;
    println!(
        "mass_delete: {n} pods deleted in {:.2}s (64 concurrent deletes)",
        deleted.as_secs_f64()
    );
    println!(
        "mass_delete: every allocation released {:.2}s after the delete started",
        released.as_secs_f64()
    );
    println!(
        "mass_delete: {writes} write requests for {n} addresses = {:.4} writes per address",
        writes / n as f64
    );
    if text.contains("ipreclaim_index_lock_acquisitions_total") {
        println!(
            "mass_delete: {locks} index lock acquisitions (watches, workers, writer) = {:.2} per pod",
            locks / n as f64
        );
    } else {
        println!("mass_delete: index lock acquisitions not exported by this build");
    }
    println!(
        "mass_delete: {allocations} heap allocations in the process = {:.0} per address",
        allocations as f64 / n as f64
    );
    Ok(())
}
