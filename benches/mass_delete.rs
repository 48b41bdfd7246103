//! Cluster benchmark on the real local control plane: N pods with whereabouts allocations are
//! deleted at once; prints how long the controller takes to release every address and how
//! many write requests it sends. `cargo bench --bench mass_delete [-- N]` (default 2000).

mod common;

use std::time::Instant;

use futures::{StreamExt, stream};
use kube::api::DeleteParams;
use kube::runtime::{WatchStreamExt, watcher};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let cluster = common::cluster(n).await?;
    let controller = cluster.start_controller().await;
    let addr = controller.metrics;
    let writes_before = common::metric(
        &common::metrics_text(addr).await,
        "ipreclaim_api_writes_total",
    );

    // All at once, as a scale-down or a node drain does: many concurrent deletes.
    let pods = cluster.pods();
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
    let text = common::metrics_text(addr).await;
    let writes = common::metric(&text, "ipreclaim_api_writes_total") - writes_before;
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
    Ok(())
}
