//! Cluster benchmark: steady churn of pod deletions at a fixed rate; prints the
//! deletion-to-release latency seen from outside (delete call returned -> entry gone from the
//! pool, observed by a watch). `cargo bench --bench churn [-- RATE SECONDS]` (default 50/s, 20 s).

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::DeleteParams;
use kube::runtime::{WatchStreamExt, watcher};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let nums: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rate = nums.first().copied().unwrap_or(50);
    let seconds = nums.get(1).copied().unwrap_or(20);
    let n = (rate * seconds) as usize;
    let cluster = common::cluster(n).await?;
    let _controller = cluster.start_controller().await;

    // Entry removals as the pool watch sees them.
    let config = watcher::Config::default().fields(&format!("metadata.name={}", common::POOL));
    let mut updates = watcher::watcher(cluster.pools(), config)
        .applied_objects()
        .boxed();
    let (gone_tx, mut gone_rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
    tokio::spawn(async move {
        let mut known: Option<Vec<String>> = None;
        while let Some(Ok(pool)) = updates.next().await {
            let now = Instant::now();
            let keys: Vec<String> = pool.spec.allocations.keys().cloned().collect();
            if let Some(before) = known.take() {
                for k in before
                    .iter()
                    .filter(|k| !pool.spec.allocations.contains_key(*k))
                {
                    let _ = gone_tx.send((k.clone(), now));
                }
            }
            known = Some(keys);
        }
    });

    let pods = cluster.pods();
    let mut deleted_at: HashMap<String, Instant> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    let start = Instant::now();
    for i in 0..n {
        tick.tick().await;
        let pods = pods.clone();
        pods.delete(&format!("p{i}"), &DeleteParams::default().grace_period(0))
            .await?;
        deleted_at.insert(i.to_string(), Instant::now());
    }
    let achieved = n as f64 / start.elapsed().as_secs_f64();
    let mut latencies = Vec::with_capacity(n);
    while latencies.len() < n {
        let Some((key, at)) = gone_rx.recv().await else {
            break;
        };
        if let Some(d) = deleted_at.get(&key) {
            latencies.push(at.saturating_duration_since(*d).as_secs_f64());
        }
    }
    println!("churn: {n} deletions at {achieved:.1}/s (target {rate}/s)");
    println!(
        "churn: deletion-to-release p50 {:.3}s p99 {:.3}s max {:.3}s",
        common::quantile(&mut latencies, 0.5),
        common::quantile(&mut latencies, 0.99),
        common::quantile(&mut latencies, 1.0)
    );
    Ok(())
}
