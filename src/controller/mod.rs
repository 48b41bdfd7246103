//! `ipreclaim controller`: releases the allocations of deleted pods within a second (the
//! deletion path) and finds every other leak on a short sweep, never touching the address of a
//! live pod. Writes only as the leader; standbys keep warm caches.

pub mod deletion;
pub mod fence;
mod housekeeping;
pub mod leadership;
pub mod report;
pub mod sweep;
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

use crate::flags::parse_duration;
use crate::index::{NodeIndex, SharedIndex};
use crate::reclaim::ReclaimConfig;
use crate::reclaim::fence::FencePolicy;
use crate::release::{BudgetConfig, Budgets, Events, writer};
use crate::telemetry::{ControllerMetrics, Health, LogFormat};

/// Deletion-path workers. They mostly wait on the pool writer, so many are cheap, and many
/// in flight at once is what lets a mass deletion become a few large patches.
const DELETION_WORKERS: usize = 64;

fn parse_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&r) {
        Ok(r)
    } else {
        Err(format!("{r} is not between 0 and 1"))
    }
}

/// Flags of `ipreclaim controller` (each also read from the environment variable shown).
#[derive(Debug, Clone, clap::Args)]
pub struct ControllerArgs {
    /// Namespace of the IPPools and reservations (where the whereabouts CNI writes them).
    #[arg(long, env = "WHEREABOUTS_NAMESPACE", default_value = "kube-system")]
    pub whereabouts_namespace: String,
    /// Time between leak sweeps.
    #[arg(long, env = "IPRECLAIM_SWEEP_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// How long an allocation must look leaked before the sweep releases it.
    #[arg(long, env = "IPRECLAIM_LEAK_GRACE", default_value = "2m", value_parser = parse_duration)]
    pub leak_grace: Duration,
    /// The leak grace for an allocation whose pod does not exist at all (no annotation can lag
    /// behind it; e.g. deleted while no replica ran); at most --leak-grace.
    #[arg(long, env = "IPRECLAIM_MISSING_POD_GRACE", default_value = "5s", value_parser = parse_duration)]
    pub missing_pod_grace: Duration,
    /// Release the addresses of Succeeded/Failed pods.
    #[arg(long, env = "IPRECLAIM_RELEASE_TERMINAL_PODS", default_value_t = true, action = clap::ArgAction::Set)]
    pub release_terminal_pods: bool,
    /// Decide and report (logs, Events, metrics) but write nothing.
    #[arg(long, env = "IPRECLAIM_DRY_RUN")]
    pub dry_run: bool,
    /// Largest share of a pool (over 10 allocations) one sweep may release; more is held.
    #[arg(long, env = "IPRECLAIM_MAX_RELEASE_RATIO", default_value = "0.5", value_parser = parse_ratio)]
    pub max_release_ratio: f64,
    /// Keep the addresses of pods deleted while their node was not Ready (the sandbox may still
    /// run there) until the node is Ready again and settled, its Node is deleted, or
    /// --fence-timeout passes.
    #[arg(long, env = "IPRECLAIM_FENCE_UNREADY_NODES", default_value_t = true, action = clap::ArgAction::Set)]
    pub fence_unready_nodes: bool,
    /// How long a node must be Ready again before its fences lift (time to kill what it should
    /// no longer run), unless the node agent there reports the pod's sandboxes gone first.
    #[arg(long, env = "IPRECLAIM_FENCE_SETTLE", default_value = "30s", value_parser = parse_duration)]
    pub fence_settle: Duration,
    /// Lift a fence after this long even if its node never comes back (default: never).
    #[arg(long, env = "IPRECLAIM_FENCE_TIMEOUT", value_parser = parse_duration)]
    pub fence_timeout: Option<Duration>,
    /// Retries of a failed release before a Warning Event (the sweep still owns the leak).
    #[arg(long, env = "IPRECLAIM_MAX_RETRIES", default_value_t = 5)]
    pub max_retries: u32,
    /// Pool patches per second (each patch releases everything pending for its pool).
    #[arg(long, env = "IPRECLAIM_POOL_WRITE_QPS", default_value_t = 20.0)]
    pub pool_write_qps: f64,
    /// Pool patch burst.
    #[arg(long, env = "IPRECLAIM_POOL_WRITE_BURST", default_value_t = 40)]
    pub pool_write_burst: u32,
    /// Least time between two patches of one pool (longer for a pool whose patches take
    /// long: four times what they take, averaged, up to 1s); releases arriving meanwhile join
    /// the next.
    #[arg(long, env = "IPRECLAIM_POOL_PATCH_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub pool_patch_interval: Duration,
    /// Reservation deletes per second (one request per address; after the pool entries).
    #[arg(
        long,
        env = "IPRECLAIM_RESERVATION_DELETE_QPS",
        default_value_t = 500.0
    )]
    pub reservation_delete_qps: f64,
    /// Reservation delete burst.
    #[arg(
        long,
        env = "IPRECLAIM_RESERVATION_DELETE_BURST",
        default_value_t = 1000
    )]
    pub reservation_delete_burst: u32,
    /// All API writes per second together (pool patches, reservation deletes, Events), pool
    /// patches first; 0 for no limit.
    #[arg(long, env = "IPRECLAIM_WRITE_QPS", default_value_t = 600.0)]
    pub write_qps: f64,
    /// Burst of all API writes together.
    #[arg(long, env = "IPRECLAIM_WRITE_BURST", default_value_t = 1200)]
    pub write_burst: u32,
    /// API writes in flight at once.
    #[arg(long, env = "IPRECLAIM_MAX_INFLIGHT_WRITES", default_value_t = 8)]
    pub max_inflight_writes: usize,
    /// Elect a leader with a Lease; only the leader writes.
    #[arg(long, env = "IPRECLAIM_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "IPRECLAIM_LEASE_NAME",
        default_value = "ipreclaim-controller"
    )]
    pub lease_name: String,
    /// How long a Lease holds without renewal; a standby takes over after it. The holder stops
    /// writing two thirds of it after its last renewal; a replica that starts while another
    /// held it lately stands for it after one and a half of it (a running standby goes first).
    #[arg(long, env = "IPRECLAIM_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// Namespace of the Lease (default: $POD_NAMESPACE, else the whereabouts namespace).
    #[arg(long, env = "IPRECLAIM_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Address of /metrics, /healthz and /readyz (`[::]`: every address of both families;
    /// IPv4 only where the host has no IPv6).
    #[arg(long, env = "IPRECLAIM_METRICS_ADDR", default_value = "[::]:8080")]
    pub metrics_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "IPRECLAIM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// What the deletion workers and the sweep share.
#[derive(Clone)]
pub struct Ctx {
    pub(crate) client: Client,
    pub(crate) state: SharedIndex,
    pub(crate) queue: Arc<WorkQueue<String>>,
    pub(crate) writer: writer::WriterHandle,
    pub(crate) events: Events,
    pub(crate) metrics: ControllerMetrics,
    /// Nodes' readiness (`None`: fencing is off).
    pub(crate) nodes: Option<Arc<RwLock<NodeIndex>>>,
}

/// Handles a running controller exposes (for tests and the binary).
pub struct Running {
    /// Liveness and readiness.
    pub health: Health,
    /// Where /metrics is served.
    pub metrics_addr: SocketAddr,
    /// The controller's state (read-only use).
    pub state: SharedIndex,
}

/// Two malloc arenas, not eight per core: the controller's threads mostly wait, and every
/// arena keeps its own free memory.
pub fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before the runtime starts threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
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

/// Whether this replica leads, the gate every write passes (see [`leadership`]), and the
/// tasks that keep them (to abort at shutdown).
async fn leadership(
    client: Client,
    args: &ControllerArgs,
    identity: &str,
) -> anyhow::Result<(
    tokio_watch::Receiver<bool>,
    Arc<leadership::Gate>,
    Vec<tokio::task::JoinHandle<()>>,
)> {
    if !args.leader_election {
        let always = (tokio_watch::channel(true).1, leadership::Gate::always());
        return Ok((always.0, always.1, Vec::new()));
    }
    let namespace = args
        .lease_namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .unwrap_or_else(|| args.whereabouts_namespace.clone());
    let duration = args.lease_duration.as_secs().max(3);
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&namespace)
        .with_identity(identity)
        .with_duration(duration)
        // Renew halfway: well within the renew deadline (two thirds) after which writes stop.
        .with_grace((duration / 2).max(1))
        .build()
        .await
        .with_context(|| format!("lease {namespace}/{}", args.lease_name))?;
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(client.clone(), &namespace);
    let lease_duration = Duration::from_secs(duration);
    let read = |leases: kube::Api<k8s_openapi::api::coordination::v1::Lease>| {
        let name = args.lease_name.clone();
        async move {
            let lease = tokio::time::timeout(Duration::from_secs(5), leases.get_opt(&name)).await;
            match lease {
                Ok(Ok(lease)) => Some(lease.and_then(|l| l.spec).unwrap_or_default()),
                _ => None,
            }
        }
    };
    let judge = |spec: &k8s_openapi::api::coordination::v1::LeaseSpec| {
        leadership::newcomer_wait(
            spec.holder_identity.as_deref(),
            spec.renew_time.as_ref().map(|t| t.0),
            identity,
            lease_duration,
            jiff::Timestamp::now(),
        )
    };
    // Unreadable: as if another held it lately. Free: it may be a standby's force-release of
    // an expired Lease (kube-lease-manager then pauses before it acquires): read it again.
    let (spec, wait) = match read(leases.clone()).await {
        None => (
            Default::default(),
            leadership::newcomer_full_wait(lease_duration),
        ),
        Some(spec) if spec.holder_identity.as_deref().is_none_or(str::is_empty) => {
            tokio::time::sleep(leadership::FORCE_RELEASE_PAUSE).await;
            match read(leases.clone()).await {
                None => (spec, leadership::newcomer_full_wait(lease_duration)),
                Some(again) => {
                    let wait = judge(&again);
                    (again, wait)
                }
            }
        }
        Some(spec) => {
            let wait = judge(&spec);
            (spec, wait)
        }
    };
    if !wait.is_zero() {
        tracing::info!(holder = ?spec.holder_identity, wait = ?wait, "another replica held the Lease lately: standing for it after a wait, so that a running standby takes over first");
    }
    let (says_tx, rx) = tokio_watch::channel(false);
    let free_check = leases.clone();
    let lease_name = args.lease_name.clone();
    let standing = tokio::spawn(async move {
        // A Lease its holder let go before it expired (a replica shut down) is stood for at
        // once; one freed after expiry is a standby's first step to take it: it goes first.
        let until = Instant::now() + wait;
        let mut renewed = spec.renew_time.as_ref().map(|t| t.0);
        while Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            tokio::time::sleep(leadership::CONFIRM_EVERY.min(left)).await;
            let read = tokio::time::timeout(
                leadership::CONFIRM_EVERY * 2,
                free_check.get_opt(&lease_name),
            );
            let Ok(Ok(lease)) = read.await else {
                continue;
            };
            let spec = lease.and_then(|l| l.spec).unwrap_or_default();
            if spec
                .holder_identity
                .as_deref()
                .is_some_and(|h| !h.is_empty())
            {
                renewed = spec.renew_time.map(|t| t.0).or(renewed);
            } else if leadership::let_go_before_expiry(
                renewed,
                lease_duration,
                jiff::Timestamp::now(),
            ) {
                break;
            }
        }
        tracing::info!("standing for the Lease");
        let (mut says, task) = manager.watch().await;
        tokio::spawn(async move {
            if let Ok(Err(e)) = task.await {
                tracing::error!(error = %e, "leader election stopped");
            }
        });
        loop {
            says_tx.send_replace(*says.borrow_and_update());
            if says.changed().await.is_err() {
                return;
            }
        }
    });
    let gate = Arc::new(leadership::Gate::default());
    let (leads, tasks) = leadership::spawn(
        leases,
        args.lease_name.clone(),
        identity.to_owned(),
        Duration::from_secs(duration),
        rx,
        gate.clone(),
    );
    let mut tasks: Vec<_> = tasks.into();
    // Aborted at shutdown: the manager's receiver goes with it, and the manager lets go.
    tasks.push(standing);
    Ok((leads, gate, tasks))
}

/// Sets the leader gauge, logs leadership gained and lost, and queues the deletions a new
/// leader inherits (judged with the same live re-check as any deletion).
fn follow_leadership(
    mut leads: tokio_watch::Receiver<bool>,
    gauge: prometheus_client::metrics::gauge::Gauge,
    state: SharedIndex,
    queue: Arc<WorkQueue<String>>,
    identity: String,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut led = false;
        loop {
            let now = *leads.borrow_and_update();
            gauge.set(i64::from(now));
            if now {
                let podrefs = state
                    .read()
                    .expect("state lock")
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
    let (client, state, ns) = (&ctx.client, &ctx.state, namespace.to_owned());
    watch(&|tx| {
        tokio::spawn(watch::pods(
            client.clone(),
            state.clone(),
            ctx.queue.clone(),
            ctx.metrics.clone(),
            leader.clone(),
            ctx.nodes.clone(),
            tx,
        ))
    });
    watch(&|tx| tokio::spawn(watch::pools(client.clone(), ns.clone(), state.clone(), tx)));
    watch(&|tx| {
        let reservations = watch::reservations(client.clone(), ns.clone(), state.clone(), tx);
        tokio::spawn(reservations)
    });
    watch(&|tx| tokio::spawn(watch::nads(client.clone(), state.clone(), tx)));
    watch(&|tx| tokio::spawn(watch::fences(client.clone(), ns.clone(), state.clone(), tx)));
    if let Some(view) = &ctx.nodes {
        watch(&|tx| tokio::spawn(watch::nodes(client.clone(), view.clone(), tx)));
    }
    synced
}

/// Every second: lifts the fences that may lift (leader only) and reports bad input.
fn spawn_lifting(
    ctx: &Ctx,
    args: &ControllerArgs,
    clock: Arc<dyn podlife::clock::Clock>,
    leader: tokio_watch::Receiver<bool>,
) -> JoinHandle<()> {
    let lifter = fence::Lifter {
        ctx: ctx.clone(),
        view: ctx.nodes.clone().unwrap_or_default(),
        policy: args.fence_unready_nodes.then_some(FencePolicy {
            settle: args.fence_settle,
            timeout: args.fence_timeout,
        }),
        first_seen: Default::default(),
        records_seen: Default::default(),
        backoff: podlife::backoff::Backoff::new(
            fence::WRITE_BACKOFF.0,
            fence::WRITE_BACKOFF.1,
            clock,
        ),
        rejected: Default::default(),
    };
    let mut reporter = report::Reporter {
        events: ctx.events.clone(),
        metrics: ctx.metrics.clone(),
        reported: Default::default(),
    };
    let (state, ns) = (ctx.state.clone(), args.whereabouts_namespace.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(fence::LIFT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let leads = *leader.borrow();
            lifter.pass(leads).await;
            let problems = report::problems(&state.read().expect("state lock"), &ns);
            reporter.pass(problems, leads).await;
        }
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
    let graces = crate::reclaim::grace::Graces {
        leak: args.leak_grace,
        missing_pod: args.missing_pod_grace.min(args.leak_grace),
    };
    let config = sweep::SweepConfig {
        graces,
        max_release_ratio: args.max_release_ratio,
        reclaim,
        namespace: args.whereabouts_namespace.clone(),
    };
    let mut sweeper = sweep::Sweeper::new(ctx.clone(), config);
    let mut next_sweep = Instant::now();
    let mut pool_series = housekeeping::PoolSeries::default();
    loop {
        tokio::time::sleep_until(next_sweep.into()).await;
        next_sweep = Instant::now() + args.sweep_interval;
        {
            let mut st = ctx.state.write().expect("state lock");
            housekeeping::expire(&mut st, args.leak_grace, Instant::now());
            pool_series.export(&st, &ctx.metrics, &args.whereabouts_namespace);
        }
        ctx.metrics.queue_depth.set(ctx.queue.len() as i64);
        return_free_memory();
        if *leader.borrow() {
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

impl ControllerArgs {
    /// The write budgets the flags set.
    fn budgets(&self) -> BudgetConfig {
        BudgetConfig {
            pool_qps: self.pool_write_qps,
            pool_burst: self.pool_write_burst,
            reservation_qps: self.reservation_delete_qps,
            reservation_burst: self.reservation_delete_burst,
            write_qps: self.write_qps,
            write_burst: self.write_burst,
            max_in_flight: self.max_inflight_writes,
        }
    }
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
    let state = SharedIndex::default();
    let (metrics, health, metrics_addr, server) = serve_metrics(args.metrics_addr, &state).await?;
    on_start(&Running {
        health: health.clone(),
        metrics_addr,
        state: state.clone(),
    });
    tracing::info!(%metrics_addr, namespace = %args.whereabouts_namespace, dry_run = args.dry_run, "controller starting");

    let clock = RealClock::shared();
    let queue: Arc<WorkQueue<String>> = WorkQueue::new(clock.clone());
    let identity = identity();
    let budgets = Budgets::new(args.budgets(), clock.clone(), metrics.writes.clone());
    let events = Events::new(
        client.clone(),
        &identity,
        budgets.clone(),
        metrics.writes.clone(),
    );
    let reclaim = ReclaimConfig {
        release_terminal_pods: args.release_terminal_pods,
    };
    let ns = &args.whereabouts_namespace;
    let writes = metrics.writes.clone();
    let writer = writer::Writer::new(client.clone(), ns, budgets.clone(), events.clone(), writes)
        .patch_interval(args.pool_patch_interval)
        .dry_run(args.dry_run)
        .index(state.clone());
    let writer = writer::spawn(Arc::new(writer));
    let (leader, gate, mut tasks) = leadership(client.clone(), &args, &identity).await?;
    // Every write passes the gate right before it goes: a demoted leader's queue is refused.
    budgets.set_gate(Arc::new(move || gate.open(Instant::now())));
    tasks.push(follow_leadership(
        leader.clone(),
        metrics.leader.clone(),
        state.clone(),
        queue.clone(),
        identity.clone(),
    ));

    let nodes = args
        .fence_unready_nodes
        .then(|| Arc::new(RwLock::new(NodeIndex::default())));
    let ctx = Ctx {
        client: client.clone(),
        state: state.clone(),
        queue: queue.clone(),
        writer,
        events,
        metrics: metrics.clone(),
        nodes: nodes.clone(),
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
        // Many workers: each waits on the writer, which batches what they hand in together.
        for _ in 0..DELETION_WORKERS {
            let worker = deletion::Worker {
                ctx: ctx.clone(),
                reclaim,
                max_retries: args.max_retries,
                leader: leader.clone(),
            };
            tasks.push(tokio::spawn(worker.run()));
        }
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
