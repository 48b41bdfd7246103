//! `ipreclaim controller`: releases the allocations of deleted pods within a second (the
//! deletion path) and finds every other leak on a short sweep, never touching the address of a
//! live pod. Writes only as the leader; standbys keep warm caches.

pub mod deletion;
pub mod fence;
pub mod leadership;
pub mod report;
pub mod state;
pub mod sweep;
pub mod watch;

use std::collections::HashSet;
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

use crate::reclaim::ReclaimConfig;
use crate::reclaim::fence::FencePolicy;
use crate::release::{BudgetConfig, Budgets, Events, writer};
use crate::telemetry::{ControllerMetrics, Health, LogFormat};
use state::State;

/// Deletion-path workers. They mostly wait on the pool writer, so many are cheap, and many
/// in flight at once is what lets a mass deletion become a few large patches.
const DELETION_WORKERS: usize = 64;

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (use e.g. 500ms, 60s, 2m)"))
}

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
#[command(args_override_self = true)] // a repeated flag takes its last value (the chart's extraArgs)
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
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "IPRECLAIM_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "IPRECLAIM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// What the deletion workers and the sweep share.
#[derive(Clone)]
pub struct Ctx {
    pub(crate) client: Client,
    pub(crate) state: Arc<RwLock<State>>,
    pub(crate) queue: Arc<WorkQueue<String>>,
    pub(crate) writer: writer::WriterHandle,
    pub(crate) events: Events,
    pub(crate) metrics: ControllerMetrics,
    /// Nodes' readiness (`None`: fencing is off).
    pub(crate) nodes: Option<Arc<RwLock<fence::NodeView>>>,
}

/// Handles a running controller exposes (for tests and the binary).
pub struct Running {
    /// Liveness and readiness.
    pub health: Health,
    /// Where /metrics is served.
    pub metrics_addr: SocketAddr,
    /// The controller's state (read-only use).
    pub state: Arc<RwLock<State>>,
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

/// Runs the controller until `shutdown` completes. Calls `on_start` once the metrics server
/// is bound.
pub async fn run(
    client: Client,
    args: ControllerArgs,
    shutdown: impl Future<Output = ()>,
    on_start: impl FnOnce(&Running),
) -> anyhow::Result<()> {
    let mut registry = Registry::default();
    let metrics = ControllerMetrics::new(&mut registry);
    for kind in report::KINDS {
        let _ = metrics
            .invalid_objects
            .get_or_create(&kind.to_string().into());
    }
    let health = Health::default();
    let (metrics_addr, server) =
        crate::telemetry::serve(args.metrics_addr, Arc::new(registry), health.clone())
            .await
            .with_context(|| format!("bind metrics address {}", args.metrics_addr))?;
    let state = Arc::new(RwLock::new(State::default()));
    on_start(&Running {
        health: health.clone(),
        metrics_addr,
        state: state.clone(),
    });
    tracing::info!(%metrics_addr, namespace = %args.whereabouts_namespace, dry_run = args.dry_run, "controller starting");

    let clock = RealClock::shared();
    let queue: Arc<WorkQueue<String>> = WorkQueue::new(clock.clone());
    let identity = identity();
    let budgets = Budgets::new(
        BudgetConfig {
            pool_qps: args.pool_write_qps,
            pool_burst: args.pool_write_burst,
            reservation_qps: args.reservation_delete_qps,
            reservation_burst: args.reservation_delete_burst,
            write_qps: args.write_qps,
            write_burst: args.write_burst,
            max_in_flight: args.max_inflight_writes,
        },
        clock.clone(),
        metrics.writes.clone(),
    );
    let events = Events::new(
        client.clone(),
        &identity,
        budgets.clone(),
        metrics.writes.clone(),
    );
    let reclaim = ReclaimConfig {
        release_terminal_pods: args.release_terminal_pods,
    };
    let writer = writer::spawn(Arc::new(writer::Writer {
        client: client.clone(),
        namespace: args.whereabouts_namespace.clone(),
        budgets: budgets.clone(),
        patch_interval: args.pool_patch_interval,
        metrics: metrics.writes.clone(),
        events: events.clone(),
        dry_run: args.dry_run,
        index: Some(state.clone()),
        dry_run_reported: Default::default(),
    }));
    let (leader, gate, mut tasks) = leadership(client.clone(), &args, &identity).await?;
    // Every write passes the gate right before it goes: a demoted leader's queue is refused.
    budgets.set_gate(Arc::new(move || gate.open(Instant::now())));
    {
        let (mut leads, gauge) = (leader.clone(), metrics.leader.clone());
        let (state, queue) = (state.clone(), queue.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let now = *leads.borrow_and_update();
                gauge.set(i64::from(now));
                if now {
                    // What was deleted while this replica did not lead: judged now, with the
                    // same live re-check as any deletion.
                    let podrefs = state.read().expect("state lock").tombstoned_podrefs();
                    tracing::info!(deletions = podrefs.len(), "leading: this replica writes");
                    for podref in podrefs {
                        queue.add(podref);
                    }
                } else {
                    tracing::info!("not leading: this replica does not write");
                }
                if leads.changed().await.is_err() {
                    return;
                }
            }
        }));
    }

    let nodes = args
        .fence_unready_nodes
        .then(|| Arc::new(RwLock::new(fence::NodeView::default())));
    // Watches, each reporting its first full list.
    let mut synced = Vec::new();
    let mut watch_task = |f: &dyn Fn(tokio_watch::Sender<bool>) -> tokio::task::JoinHandle<()>| {
        let (tx, rx) = tokio_watch::channel(false);
        synced.push(rx);
        tasks.push(f(tx));
    };
    let ns = args.whereabouts_namespace.clone();
    watch_task(&|tx| {
        tokio::spawn(watch::pods(
            client.clone(),
            state.clone(),
            queue.clone(),
            metrics.clone(),
            leader.clone(),
            nodes.clone(),
            tx,
        ))
    });
    watch_task(&|tx| tokio::spawn(watch::pools(client.clone(), ns.clone(), state.clone(), tx)));
    watch_task(&|tx| {
        tokio::spawn(watch::reservations(
            client.clone(),
            ns.clone(),
            state.clone(),
            tx,
        ))
    });
    watch_task(&|tx| tokio::spawn(watch::nads(client.clone(), state.clone(), tx)));
    watch_task(&|tx| tokio::spawn(watch::fences(client.clone(), ns.clone(), state.clone(), tx)));
    if let Some(view) = &nodes {
        watch_task(&|tx| tokio::spawn(fence::nodes(client.clone(), view.clone(), tx)));
    }

    let ctx = Ctx {
        client: client.clone(),
        state: state.clone(),
        queue: queue.clone(),
        writer,
        events,
        metrics: metrics.clone(),
        nodes: nodes.clone(),
    };
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
            tasks.push(tokio::spawn(
                deletion::Worker {
                    ctx: ctx.clone(),
                    reclaim,
                    max_retries: args.max_retries,
                    leader: leader.clone(),
                }
                .run(),
            ));
        }
        let lifter = fence::Lifter {
            ctx: ctx.clone(),
            view: nodes.clone().unwrap_or_default(),
            policy: args.fence_unready_nodes.then_some(FencePolicy {
                settle: args.fence_settle,
                timeout: args.fence_timeout,
            }),
            first_seen: Default::default(),
            records_seen: Default::default(),
            backoff: podlife::backoff::Backoff::new(
                fence::WRITE_BACKOFF.0,
                fence::WRITE_BACKOFF.1,
                clock.clone(),
            ),
            rejected: Default::default(),
        };
        let mut reporter = report::Reporter {
            events: ctx.events.clone(),
            metrics: metrics.clone(),
            reported: Default::default(),
        };
        let (lifting, housekeeping_state, ns) = (
            leader.clone(),
            state.clone(),
            args.whereabouts_namespace.clone(),
        );
        // Every second: fences that lift, and bad input to report.
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(fence::LIFT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let leads = *lifting.borrow();
                lifter.pass(leads).await;
                let problems =
                    report::problems(&housekeeping_state.read().expect("state lock"), &ns);
                reporter.pass(problems, leads).await;
            }
        }));
        let mut sweeper = sweep::Sweeper {
            ctx: ctx.clone(),
            config: sweep::SweepConfig {
                leak_grace: args.leak_grace,
                missing_pod_grace: args.missing_pod_grace.min(args.leak_grace),
                max_release_ratio: args.max_release_ratio,
                reclaim,
                namespace: args.whereabouts_namespace.clone(),
            },
            first_seen: Default::default(),
            held_pools: Default::default(),
            orphan_reservations_seen: Default::default(),
        };
        // Every --sweep-interval, and as soon as a candidate's grace ends.
        let mut next_sweep = Instant::now();
        // The pools whose per-pool series are on /metrics.
        let mut pool_series: HashSet<String> = HashSet::new();
        loop {
            tokio::time::sleep_until(next_sweep.into()).await;
            next_sweep = Instant::now() + args.sweep_interval;
            {
                let mut st = state.write().expect("state lock");
                // checked: an Instant cannot go back before the machine started.
                let now = Instant::now();
                if let Some(before) = now.checked_sub(Duration::from_secs(600)) {
                    st.expire_tombstones(before);
                }
                let keep = Duration::from_secs(600).max(args.leak_grace.saturating_mul(2));
                if let Some(before) = now.checked_sub(keep) {
                    st.expire_listings(before);
                }
                metrics.nad_config_errors.set(st.nad_errors.len() as i64);
                metrics.cached_pods.set(st.live_count() as i64);
                metrics
                    .malformed_network_status
                    .set(st.malformed_status_count() as i64);
                let mut labels = HashSet::with_capacity(st.pools().len());
                for (name, pool) in st.pools() {
                    let label = report::pool_label(&args.whereabouts_namespace, name);
                    metrics
                        .allocations
                        .get_or_create(&label.clone().into())
                        .set((pool.entries.len() + pool.marked.len()) as i64);
                    metrics
                        .pool_problems
                        .get_or_create(&label.clone().into())
                        .set((pool.problems.len() + pool.bad_fences.len()) as i64);
                    // A pool's breaker series exists at 0 before its first hold.
                    let _ = metrics.breaker_holds.get_or_create(&label.clone().into());
                    labels.insert(label);
                }
                // A deleted pool's series go with it.
                for gone in pool_series.difference(&labels) {
                    let l = gone.clone().into();
                    metrics.allocations.remove(&l);
                    metrics.pool_problems.remove(&l);
                    metrics.breaker_holds.remove(&l);
                }
                pool_series = labels;
            }
            metrics.queue_depth.set(queue.len() as i64);
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
