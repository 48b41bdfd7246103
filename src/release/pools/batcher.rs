//! The batcher: one task that collects release requests per pool and starts each pool's patch
//! when its [`PoolSchedule`] says it may. At most one patch per pool is in flight, and a
//! pool's patches are spaced by its interval; what arrives meanwhile for that pool goes out as
//! the next patch, so a burst of deletions becomes a few large patches while a lone deletion
//! goes out at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::PoolWriter;
use super::schedule::PoolSchedule;
use crate::release::budget::Paid;
use crate::release::objects::ObjectDelete;
use crate::release::types::ReleaseRequest;
use crate::release::types::Reply;
use crate::telemetry::logging::TIMELINE;

/// The batcher: collects requests per pool and sends each pool's patch when its
/// [`PoolSchedule`] says it may and its token of the pool rate is there. The token is reserved
/// before the batch is formed, so what arrives while a pool waits for it goes in its next
/// patch, not the one after, and a patch's time (which spaces its pool's patches) does not
/// count the wait.
pub(crate) async fn batch(
    writer: Arc<PoolWriter>,
    mut rx: mpsc::Receiver<(ReleaseRequest, Reply)>,
    deletes: mpsc::UnboundedSender<ObjectDelete>,
) {
    let mut schedule = PoolSchedule::new(writer.patch_interval);
    // Each finished patch: its pool and how long it took.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(String, Duration)>();
    let mut open = true;
    // A dry run writes nothing, so it reserves no budget (and its batches send nothing).
    let (budgets, dry_run) = (&writer.cx.budgets, writer.cx.dry_run);
    let reserve = || match dry_run {
        true => Duration::ZERO,
        false => budgets.reserve_pool_token(),
    };
    loop {
        let now = Instant::now();
        for (pool, items) in schedule.ready_within(now, reserve) {
            if tracing::enabled!(target: TIMELINE, tracing::Level::TRACE) {
                let podrefs: Vec<&str> = items
                    .iter()
                    .map(|i: &(ReleaseRequest, Reply)| i.0.podref())
                    .collect();
                tracing::trace!(target: TIMELINE, %pool, n = items.len(), podrefs = podrefs.join(","), "batch formed");
            }
            let (w, done, res) = (writer.clone(), done_tx.clone(), deletes.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                for r in w.release_pool(&pool, items, Paid::Yes).await {
                    let _ = res.send(r);
                }
                let _ = done.send((pool, started.elapsed()));
            });
        }
        if !open && schedule.idle() {
            return;
        }
        let wake = crate::release::sleep_until(schedule.next_wake(now));
        tokio::select! {
            item = rx.recv(), if open => match item {
                Some(item) => {
                    queue(&mut schedule, item);
                    // Let whatever else is already queued join this batch.
                    while let Ok(item) = rx.try_recv() {
                        queue(&mut schedule, item);
                    }
                }
                None => open = false,
            },
            Some((pool, took)) = done_rx.recv() => {
                tracing::trace!(target: TIMELINE, %pool, took_us = took.as_micros() as u64, "pool finished");
                schedule.finished(&pool, took, Instant::now())
            }
            () = wake => {}
        }
    }
}

/// Queues `item` for its pool, arrived now.
fn queue(schedule: &mut PoolSchedule<(ReleaseRequest, Reply)>, item: (ReleaseRequest, Reply)) {
    let pool = item.0.judged.pool.clone();
    tracing::trace!(target: TIMELINE, %pool, podref = item.0.podref(), "queued");
    schedule.arrived(pool, item, Instant::now());
}
