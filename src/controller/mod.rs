//! `ipreclaim controller`: releases the allocations of deleted pods within a second (the
//! deletion path) and finds every other leak on a short sweep, never touching the address of a
//! live pod. Writes only as the leader; standbys keep warm caches.
//!
//! Thin async shells over the pure `index` and `reclaim`: watches, workers, the sweep, the
//! fence lifter, leader election. Imports anything below it, never `node` or `scan`.

mod args;
pub mod cooldown;
mod ctx;
pub mod deletion;
pub mod duplicates;
mod election;
pub mod fence;
mod fresh_node;
mod housekeeping;
pub mod leadership;
mod ledger;
pub mod other_writers;
pub mod plan;
pub mod report;
mod reservation_sweep;
pub mod server_clock;
pub mod sweep;
pub mod unseen;
pub mod watch;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use kube::Client;
use podlife::clock::RealClock;
use podlife::queue::WorkQueue;
use prometheus_client::registry::Registry;
use tokio::sync::watch as tokio_watch;
use tokio::task::JoinHandle;

use crate::index::{NodeIndex, SharedIndex};
use crate::release::{Budgets, Events, writer};
use crate::rules::ReclaimConfig;
use crate::telemetry::{ControllerMetrics, Health};

/// Deletion-path workers. They mostly wait on the pool writer, so many are cheap, and many
/// in flight at once is what lets a mass deletion become a few large patches.
const DELETION_WORKERS: usize = 64;

pub use args::ControllerArgs;

pub use ctx::Ctx;

/// Handles a running controller exposes (for tests and the binary).
pub struct Running {
    /// Liveness and readiness.
    pub health: Health,
    /// Where /metrics is served.
    pub metrics_addr: SocketAddr,
    /// The controller's index (read-only use).
    pub index: SharedIndex,
}

/// Allocations from this size on are mapped on their own and unmapped when freed.
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Tunes glibc's malloc for a process whose heap is a long-lived index filled by large
/// short-lived reads (the list pages):
/// - two arenas, not eight per core: the controller's threads mostly wait, and every arena
///   keeps its own free memory;
/// - a fixed mmap threshold: by default glibc raises it to the size of each large buffer freed
///   (up to 32 MiB), so later pages are carved from the heap between the index's records and
///   their holes stay resident. At 100,000 pods this took 4 to 5 MiB off the RSS after a restart
///   and 2 to 5 MiB off its peak (docs/development.md, Benches).
pub fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before the runtime starts threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Hands the memory freed after large transient reads (the initial lists, a sweep) back to
/// the system: glibc keeps freed heap otherwise, and RSS is what a memory limit counts.
fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only gives free pages of the heap back; it touches no live memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A leader-election identity unique to this run (like client-go's hostname + "_" + uuid):
/// a restarted replica must not mistake its predecessor's lease for its own.
fn identity() -> String {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let host = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "ipreclaim".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{host}_{}-{run}-{nanos:08x}", std::process::id())
}

/// Sets the leader gauge, logs leadership gained and lost, and queues the deletions a new
/// leader inherits (judged with the same live re-check as any deletion).
fn follow_leadership(
    mut leads: tokio_watch::Receiver<bool>,
    gauge: prometheus_client::metrics::gauge::Gauge,
    index: SharedIndex,
    queue: Arc<WorkQueue<String>>,
    identity: String,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut led = false;
        loop {
            let now = *leads.borrow_and_update();
            gauge.set(i64::from(now));
            if now {
                let podrefs = index
                    .read()
                    .expect("index lock")
                    .pods()
                    .tombstoned_podrefs();
                tracing::info!(%identity, deletions = podrefs.len(), "leadership gained; leading: this replica writes");
                for podref in podrefs {
                    queue.add(podref);
                }
            } else if led {
                tracing::info!(%identity, "leadership lost; not leading: this replica does not write");
            } else {
                tracing::info!(%identity, "not leading: this replica does not write");
            }
            led = now;
            if leads.changed().await.is_err() {
                return;
            }
        }
    })
}

/// Starts the watches that feed the index; returns a receiver per watch that turns true at
/// its first complete list.
fn spawn_watches(
    ctx: &Ctx,
    namespace: &str,
    leader: &tokio_watch::Receiver<bool>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Vec<tokio_watch::Receiver<bool>> {
    let mut synced = Vec::new();
    let mut watch = |task: &dyn Fn(watch::Synced) -> JoinHandle<()>| {
        let (tx, rx) = tokio_watch::channel(false);
        synced.push(rx);
        tasks.push(task(tx));
    };
    let (client, index, ns) = (&ctx.client, &ctx.index, namespace.to_owned());
    watch(&|tx| {
        tokio::spawn(watch::pods(
            client.clone(),
            index.clone(),
            ctx.queue.clone(),
            ctx.metrics.clone(),
            leader.clone(),
            ctx.nodes.clone(),
            tx,
        ))
    });
    watch(&|tx| tokio::spawn(watch::pools(client.clone(), ns.clone(), index.clone(), tx)));
    watch(&|tx| {
        let reservations = watch::reservations(client.clone(), ns.clone(), index.clone(), tx);
        tokio::spawn(reservations)
    });
    watch(&|tx| tokio::spawn(watch::nads(client.clone(), index.clone(), tx)));
    watch(&|tx| tokio::spawn(watch::fences(client.clone(), ns.clone(), index.clone(), tx)));
    if let Some(view) = &ctx.nodes {
        watch(&|tx| tokio::spawn(watch::nodes(client.clone(), view.clone(), tx)));
    }
    synced
}

/// The deletion-path workers. Many: each waits on the writer, which batches what they hand
/// in together.
fn spawn_workers(
    ctx: &Ctx,
    args: &ControllerArgs,
    reclaim: ReclaimConfig,
    leader: &tokio_watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    (0..DELETION_WORKERS)
        .map(|_| {
            let worker = deletion::Worker {
                ctx: ctx.clone(),
                reclaim,
                max_retries: args.max_retries,
                leader: leader.clone(),
            };
            tokio::spawn(worker.run())
        })
        .collect()
}

/// The core's reading of this process's clock: the one the queue and the budgets use.
#[derive(Debug)]
struct CoreNow(podlife::clock::SharedClock);

impl ipreclaim_core::clock::Now for CoreNow {
    fn now(&self) -> Instant {
        self.0.now()
    }
}

/// Every second: lifts the fences that may lift and ends the cooldowns that are over (leader
/// only), and reports bad input, duplicate addresses and marked entries other writers removed.
fn spawn_lifting(
    ctx: &Ctx,
    args: &ControllerArgs,
    clock: Arc<dyn podlife::clock::Clock>,
    leader: tokio_watch::Receiver<bool>,
) -> JoinHandle<()> {
    // Only a timeout needs the apiserver's clock.
    let server_clock = args
        .fence_timeout
        .map(|_| Arc::new(server_clock::ServerClock::default()));
    let prober = server_clock
        .clone()
        .map(|c| server_clock::Prober::new(ctx.client.clone(), c));
    let mut lifter = fence::Lifter {
        ctx: ctx.clone(),
        view: ctx.nodes.clone().unwrap_or_default(),
        policy: args.fence_unready_nodes.then(|| args.fence_policy()),
        book: Default::default(),
        records_seen: Default::default(),
        backoff: podlife::backoff::Backoff::new(
            fence::WRITE_BACKOFF.0,
            fence::WRITE_BACKOFF.1,
            clock.clone(),
        ),
        server_clock: server_clock.clone(),
        fences: kube::Api::namespaced(ctx.client.clone(), &args.whereabouts_namespace),
        held_on_read: Default::default(),
        deleted_on_read: Default::default(),
    };
    let mut cooler = cooldown::Cooler {
        ctx: ctx.clone(),
        dry_run: args.dry_run,
        backoff: podlife::backoff::Backoff::new(
            fence::WRITE_BACKOFF.0,
            fence::WRITE_BACKOFF.1,
            clock,
        ),
        length: args.release_cooldown,
        sightings: Default::default(),
    };
    let mut reporter = report::ProblemReporter {
        events: ctx.events.clone(),
        metrics: ctx.metrics.clone(),
        reported: Default::default(),
    };
    let mut others = other_writers::OtherWriters {
        ctx: ctx.clone(),
        wait: args.other_writer_wait,
        namespace: args.whereabouts_namespace.clone(),
        waiting: Vec::new(),
    };
    let mut duplicates = duplicates::DuplicateReporter::default();
    let (index, ns) = (ctx.index.clone(), args.whereabouts_namespace.clone());
    let metrics = ctx.metrics.clone();
    let probing = async move {
        match prober {
            Some(p) => p.run().await,
            None => std::future::pending().await,
        }
    };
    let lifting = async move {
        let mut tick = tokio::time::interval(fence::LIFT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let leads = *leader.borrow();
            lifter.pass(leads).await;
            cooler.pass(leads).await;
            others.pass(leads).await;
            // Found with the lock let go but for short reads (see `DuplicateReporter::found`).
            let found = duplicates.found(&index);
            let problems = {
                let st = index.read().expect("index lock");
                let mut problems = report::problems(&st, &ns);
                problems.extend(duplicates.pass(&st, &found, &metrics, &ns, leads));
                problems
            };
            reporter.pass(problems, leads).await;
        }
    };
    // One task: aborting it stops both.
    tokio::spawn(async move {
        tokio::join!(probing, lifting);
    })
}

/// Sweeps every --sweep-interval, and as soon as a candidate's grace ends (leader only);
/// between sweeps, the index forgets what no longer matters and its gauges are exported.
async fn sweep_forever(
    ctx: &Ctx,
    args: &ControllerArgs,
    reclaim: ReclaimConfig,
    leader: &tokio_watch::Receiver<bool>,
) {
    let graces = crate::rules::grace::Graces {
        leak: args.leak_grace,
        missing_pod: args.missing_pod_grace.min(args.leak_grace),
    };
    let config = sweep::SweepConfig {
        graces,
        max_release_ratio: args.max_release_ratio,
        reclaim,
        namespace: args.whereabouts_namespace.clone(),
        inventory_namespace: crate::flags::own_namespace(
            args.inventory_namespace.as_deref(),
            &args.whereabouts_namespace,
        ),
        reservation_repair_grace: args.reservation_repair_grace,
    };
    let mut sweeper = sweep::Sweeper::new(ctx.clone(), config);
    // Any change of leadership since the last tick (even one lost and won back between two
    // ticks) ends the sweep's sightings: a grace counts within one term.
    let mut term = leader.clone();
    let mut next_sweep = Instant::now();
    let mut pool_series = housekeeping::PoolSeries::default();
    loop {
        tokio::time::sleep_until(next_sweep.into()).await;
        next_sweep = Instant::now() + args.sweep_interval;
        {
            let mut st = ctx.index.write().expect("index lock");
            housekeeping::expire(&mut st, args.leak_grace, Instant::now());
            pool_series.export(&st, &ctx.metrics, &args.whereabouts_namespace);
        }
        ctx.metrics.queue_depth.set(ctx.queue.len() as i64);
        return_free_memory();
        if term.has_changed().unwrap_or(false) {
            term.mark_unchanged();
            sweeper.forget_sightings();
        }
        if !*leader.borrow() {
            // The sweep's gauges are the leader's: a standby shows none, never stale ones.
            ctx.metrics.pool_leak_candidates.clear();
            ctx.metrics.pool_held.clear();
            ctx.metrics.reservations_missing.set(0);
        } else {
            let report = sweeper.sweep().await;
            tracing::debug!(?report, "sweep done");
            if let Some(due) = report.next_due {
                // Not sooner than a tenth of a second: a sweep reads every pool.
                let soonest = Instant::now() + Duration::from_millis(100);
                next_sweep = next_sweep.min(due.max(soonest));
            }
        }
    }
}

/// The pool writer, keeping the index in step with what it writes.
fn spawn_writer(
    client: &Client,
    args: &ControllerArgs,
    budgets: &Budgets,
    events: &Events,
    metrics: &ControllerMetrics,
    index: &SharedIndex,
) -> writer::WriterHandle {
    let ns = &args.whereabouts_namespace;
    let writes = metrics.writes.clone();
    let writer = writer::Writer::new(client.clone(), ns, budgets.clone(), events.clone(), writes)
        .patch_interval(args.pool_patch_interval)
        .cooldown(args.release_cooldown)
        .dry_run(args.dry_run)
        .ledger(index.clone());
    writer::spawn(Arc::new(writer))
}

/// The controller's metrics, served with the probes on `addr`.
async fn serve_metrics(
    addr: SocketAddr,
    index: &SharedIndex,
) -> anyhow::Result<(ControllerMetrics, Health, SocketAddr, JoinHandle<()>)> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(housekeeping::IndexLockCollector(index.clone())));
    let metrics = ControllerMetrics::new(&mut registry);
    for kind in report::KINDS {
        let _ = metrics
            .invalid_objects
            .get_or_create(&kind.to_string().into());
    }
    let health = Health::default();
    let (bound, server) = crate::telemetry::serve(addr, Arc::new(registry), health.clone())
        .await
        .with_context(|| format!("bind metrics address {addr}"))?;
    Ok((metrics, health, bound, server))
}

/// Runs the controller until `shutdown` completes. Calls `on_start` once the metrics server
/// is bound.
pub async fn run(
    client: Client,
    args: ControllerArgs,
    shutdown: impl Future<Output = ()>,
    on_start: impl FnOnce(&Running),
) -> anyhow::Result<()> {
    let index = SharedIndex::default();
    let (metrics, health, metrics_addr, server) = serve_metrics(args.metrics_addr, &index).await?;
    on_start(&Running {
        health: health.clone(),
        metrics_addr,
        index: index.clone(),
    });
    tracing::info!(%metrics_addr, namespace = %args.whereabouts_namespace, dry_run = args.dry_run, "controller starting");

    let clock = RealClock::shared();
    let queue: Arc<WorkQueue<String>> = WorkQueue::new(clock.clone());
    let identity = identity();
    let budgets = Budgets::new(args.budgets(), clock.clone(), metrics.writes.clone());
    let writes = metrics.writes.clone();
    let events = Events::new(client.clone(), &identity, budgets.clone(), writes);
    let reclaim = ReclaimConfig {
        release_terminal_pods: args.release_terminal_pods,
    };
    let writer = spawn_writer(&client, &args, &budgets, &events, &metrics, &index);
    let (leader, gate, mut tasks) = election::leadership(client.clone(), &args, &identity).await?;
    // Every write passes the gate right before it goes: a demoted leader's queue is refused.
    budgets.set_gate(Arc::new(move || gate.open(Instant::now())));
    tasks.push(follow_leadership(
        leader.clone(),
        metrics.leader.clone(),
        index.clone(),
        queue.clone(),
        identity.clone(),
    ));

    let nodes = args.fence_unready_nodes.then(|| {
        Arc::new(RwLock::new(NodeIndex::new(
            args.fence_policy(),
            Arc::new(CoreNow(clock.clone())),
        )))
    });
    let ctx = Ctx {
        client: client.clone(),
        index: index.clone(),
        queue: queue.clone(),
        writer,
        events,
        metrics: metrics.clone(),
        nodes: nodes.clone(),
        node_reads: Arc::default(),
    };
    let synced = spawn_watches(&ctx, &args.whereabouts_namespace, &leader, &mut tasks);

    let main = async {
        for mut rx in synced {
            let _ = rx.wait_for(|s| *s).await;
        }
        // Pods gone while no replica ran were not seen deleted: their allocations are the
        // sweep's (grace, a fresh list, the breaker), which runs at once.
        health.set_ready(true);
        tracing::info!("caches synced; ready");
        return_free_memory();
        tasks.extend(spawn_workers(&ctx, &args, reclaim, &leader));
        tasks.push(spawn_lifting(&ctx, &args, clock.clone(), leader.clone()));
        sweep_forever(&ctx, &args, reclaim, &leader).await;
    };
    tokio::select! {
        _ = shutdown => tracing::info!("shutting down"),
        _ = main => {}
    }
    queue.shutdown();
    health.set_ready(false);
    for t in tasks {
        t.abort();
    }
    server.abort();
    Ok(())
}
