//! `ipreclaim node-agent`: relists the node's container runtime over CRI with podlife's PLEG,
//! witnesses sandboxes that died while their pod lives on, and releases the pool entries those
//! sandboxes held (the CNI DEL that should have freed them never ran).
//!
//! It also reports, for each fence of this node (an `IPFence` the controller wrote when a pod
//! was deleted while the node was not Ready), once the runtime lists none of the pod's
//! sandboxes: the controller then lifts the fence at once instead of waiting the settle.
//!
//! It never lists cluster-wide: its watches are the metadata of this node's pods and this
//! node's fences; everything else is a targeted GET.
//!
//! Imports `release` and below (and podlife), never `controller` or `scan`.

pub mod args;
pub mod attempts;
pub mod cri;
pub mod error;
pub mod evidence;
pub mod fences;
pub mod hold;
pub mod identity;
pub mod inventory;
pub mod plan;
pub mod release;
pub mod witness;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use podlife::PodStatusCache;
use podlife::clock::{RealClock, SharedClock};
use podlife::pleg::{EventKind, Pleg, PlegConfig, PlegHandle, PodLifecycleEvent};
use podlife::throttle::{Parallelism, Throttle};
use prometheus_client::registry::Registry;
use tokio::task::JoinSet;

use crate::api::slim::MIRROR_ANNOTATION;
use crate::ipam::PodKey;
use crate::ipam::inventory::Listed;
use crate::release::{BudgetConfig, Budgets, Events, writer};
use crate::rules::ReclaimConfig;
use crate::seen::Once;
use crate::telemetry::{Health, NodeMetrics, WriteMetrics};
pub use args::NodeAgentArgs;
use cri::{CriCalls, CriPodSource, RuntimeView};
use error::NodeError;
use identity::{RuntimeIdentity, runtime_is_ours};
use release::{ApiPod, Outcome, Releaser};
use witness::{DeadSandbox, Witness};

/// Sandboxes not listed for this many relists are forgotten (their events were handled or
/// dropped; either way nothing will name them again).
const FORGET_AFTER_LISTINGS: u64 = 600;
/// Failed releases are retried this often before a Warning Event; the controller's sweep
/// still owns the leak afterwards (IPNotOnPod).
const MAX_ATTEMPTS: u32 = 5;
/// Least time between two patches of one pool by this node's agent.
const POOL_PATCH_INTERVAL: Duration = Duration::from_millis(200);
/// A node's releases are few: its share of the API stays small.
const NODE_BUDGETS: BudgetConfig = BudgetConfig {
    pool_qps: 5.0,
    pool_burst: 10,
    reservation_qps: 5.0,
    reservation_burst: 10,
    write_qps: 10.0,
    write_burst: 20,
    max_in_flight: 2,
};
/// A pod whose status call fails is retried on the next relist, then less often, up to this.
const INSPECT_BACKOFF_MAX: Duration = Duration::from_secs(60);
/// A dead sandbox's release that failed is retried after at least a second (or a relist
/// period, if longer), doubling up to a minute.
const WITNESS_MIN_RECHECK: Duration = Duration::from_secs(1);
const WITNESS_MAX_RECHECK: Duration = Duration::from_secs(60);

/// Handles a running node agent exposes (for tests and the binary).
pub struct NodeRunning {
    /// Liveness (the PLEG's health) and readiness.
    pub health: Health,
    /// Where /metrics is served.
    pub metrics_addr: SocketAddr,
    /// The PLEG's health and counters.
    pub pleg: PlegHandle,
}

type PodStore = Store<PartialObjectMeta<Pod>>;

/// Watches the metadata of this node's pods into a store.
fn watch_node_pods(client: Client, node: &str) -> (PodStore, tokio::task::JoinHandle<()>) {
    let api = Api::<PartialObjectMeta<Pod>>::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let (reader, writer) = reflector::store();
    let stream = crate::watch_retry::retrying(client, watcher::watcher(api, config))
        .modify(|p| {
            p.managed_fields_mut().clear();
        })
        .reflect(writer);
    let task = tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                tracing::warn!(error = %e, "node pod watch error");
            }
        }
    });
    (reader, task)
}

/// The API pod of `uid` on this node.
fn api_pod(store: &PodStore, uid: &str) -> Option<ApiPod> {
    store
        .state()
        .iter()
        .find(|p| p.metadata.uid.as_deref() == Some(uid))
        .map(|p| ApiPod {
            key: PodKey::new(p.namespace().unwrap_or_default(), p.name_any()),
            deleting: p.metadata.deletion_timestamp.is_some(),
        })
}

/// The events loop's view of the world.
struct Agent {
    clock: SharedClock,
    view: Arc<Mutex<RuntimeView>>,
    pods: PodStore,
    witness: Witness,
    metrics: NodeMetrics,
    releaser: Arc<Releaser>,
    logged_orphans: Once<String>,
    pleg: PlegHandle,
    fences: fences::Fences,
    evidence: evidence::Evidence,
    reporter: Arc<fences::FenceReporter>,
    /// The listing the evidence last looked at.
    evidence_listing: u64,
    identity: RuntimeIdentity,
    /// This node's live sandboxes, for the inventory writer.
    inventory: tokio::sync::watch::Sender<Option<inventory::Live>>,
}

/// A report on a fence, written or not.
struct ReportDone {
    fence_uid: String,
    pod_uid: String,
    kind: evidence::ReportKind,
    outcome: Result<(), NodeError>,
}

impl Agent {
    /// Reacts to the PLEG's events, releases dead sandboxes when their grace ends, and every
    /// relist period refreshes its gauges and checks this node's fences; until the PLEG stops.
    async fn run(
        mut self,
        mut events: tokio::sync::mpsc::Receiver<PodLifecycleEvent>,
        relist_period: Duration,
    ) {
        let mut looks = attempts::Attempts::default();
        let mut reports: JoinSet<ReportDone> = JoinSet::new();
        let mut tick = tokio::time::interval(relist_period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_due = self.witness.next_due();
            let clock = self.clock.clone();
            let due = async {
                match next_due {
                    Some(at) => clock.sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(ev) => self.on_event(ev),
                    None => return,
                },
                _ = due => self.start_due(&mut looks),
                Some((sb, outcome)) = looks.next() => self.finished(sb, outcome).await,
                Some(done) = reports.join_next() => match done {
                    Ok(done) => self.reported(done),
                    Err(e) => tracing::error!(error = %e, "fence report task failed"),
                },
                _ = tick.tick() => {
                    self.refresh();
                    self.check_fences(&mut reports);
                    self.publish_inventory();
                }
            }
            self.set_waiting_gauges(&looks);
        }
    }

    fn on_event(&mut self, ev: PodLifecycleEvent) {
        self.metrics.pleg_event(ev.kind);
        if let (EventKind::ContainerStarted, Some(id)) = (ev.kind, ev.container_id.as_deref())
            && self.witness.revived(id)
        {
            tracing::warn!(sandbox = id, pod_uid = %ev.pod, "a sandbox reported dead is listed running again; forgotten");
            return;
        }
        let (EventKind::ContainerDied | EventKind::ContainerRemoved, Some(id)) =
            (ev.kind, ev.container_id.as_deref())
        else {
            return;
        };
        let is_sandbox = {
            let mut view = self.view.lock().expect("runtime view lock");
            let known = view.sandboxes.contains_key(id);
            if known && ev.kind == EventKind::ContainerRemoved {
                view.sandboxes.remove(id);
            }
            known
        };
        if is_sandbox && self.witness.died(id, &ev.pod, self.clock.now()) {
            tracing::info!(sandbox = id, pod_uid = %ev.pod, "sandbox died; witnessing");
        }
    }

    /// Updates the health gauge, counts runtime pods whose uid is not in the API (called once
    /// the pod store is ready), logging each once, and forgets stale sandbox ids (and handled
    /// ones the runtime no longer lists).
    fn refresh(&mut self) {
        // Here too, not only after relists: a relist that hangs never reports.
        self.metrics
            .pleg_healthy
            .set(i64::from(self.pleg.healthy().is_ok()));
        let (orphans, listings) = {
            let mut view = self.view.lock().expect("runtime view lock");
            let listings = view.listings;
            view.sandboxes
                .retain(|_, last| listings.saturating_sub(*last) < FORGET_AFTER_LISTINGS);
            self.witness
                .forget_handled(|id| view.sandboxes.contains_key(id));
            let api: HashSet<String> = self
                .pods
                .state()
                .iter()
                .filter_map(|p| p.metadata.uid.clone())
                .collect();
            let orphans: Vec<(String, PodKey)> = view
                .pods
                .iter()
                .filter(|(uid, _)| !api.contains(*uid))
                .map(|(uid, pod)| (uid.clone(), pod.clone()))
                .collect();
            (orphans, listings)
        };
        if listings == 0 {
            return;
        }
        self.metrics.orphaned_runtime_pods.set(orphans.len() as i64);
        let current: HashSet<String> = orphans.iter().map(|o| o.0.clone()).collect();
        for (uid, pod) in orphans {
            if self.logged_orphans.first(uid.clone()) {
                tracing::warn!(pod_uid = %uid, %pod, "orphaned runtime pod: its sandboxes have no pod in the API (not acted on)");
            }
        }
        self.logged_orphans.keep_only(|u| current.contains(u));
    }

    /// Attempts at this node's fences against the newest complete listing and starts the
    /// reports due. The fences are read before the listing count, so a fence counts as seen
    /// no earlier than it was.
    fn check_fences(&mut self, tasks: &mut JoinSet<ReportDone>) {
        let listed: Vec<evidence::Fence> = {
            let map = self.fences.lock().expect("fences lock");
            map.values().cloned().collect()
        };
        let (listings, listing, ours) = {
            let view = self.view.lock().expect("runtime view lock");
            let ours = runtime_is_ours(&mut self.identity, &self.metrics, &view);
            let listing = (view.listings > self.evidence_listing).then(|| evidence::Listing {
                number: view.listings,
                pods: view.pods.keys().cloned().collect(),
                ready: view.ready.clone(),
                sandboxes: view
                    .sandboxes
                    .iter()
                    .filter(|(_, n)| **n == view.listings)
                    .map(|(id, _)| id.clone())
                    .collect(),
                unattributed: view.unattributed,
            });
            (view.listings, listing, ours)
        };
        for (f, why) in self.evidence.set_fences(listed, listings) {
            tracing::warn!(fence = %f.name, node = %f.node, pod_uid = %f.pod_uid, skipped = ?why, "fence not looked at");
        }
        if let Some(listing) = listing {
            self.evidence_listing = listing.number;
            // Nothing listed by a runtime that is not this node's is evidence.
            let reports = if ours {
                self.evidence.listed(&listing)
            } else {
                Vec::new()
            };
            for r in reports {
                match r.kind {
                    evidence::ReportKind::Gone => {
                        tracing::info!(fence = %r.name, pod_uid = %r.pod_uid, listing = listing.number, "fenced pod has no sandbox left on this node; reporting")
                    }
                    evidence::ReportKind::Present => {
                        tracing::info!(fence = %r.name, pod_uid = %r.pod_uid, listing = listing.number, "fenced pod still has a sandbox on this node (its kubelet is stopping it); reporting, which holds the fence")
                    }
                }
                let reporter = self.reporter.clone();
                tasks.spawn(async move {
                    let outcome = reporter.report(&r).await;
                    ReportDone {
                        fence_uid: r.fence_uid,
                        pod_uid: r.pod_uid,
                        kind: r.kind,
                        outcome,
                    }
                });
            }
        }
        let states = self.evidence.states();
        for (state, label) in [
            (podlife::lifecycle::PodState::Terminating, "terminating"),
            (podlife::lifecycle::PodState::Terminated, "terminated"),
            (podlife::lifecycle::PodState::Finished, "finished"),
        ] {
            self.metrics
                .fenced_pods
                .get_or_create(&crate::telemetry::node_metrics::StateLabel {
                    state: label.into(),
                })
                .set(states.get(&state).copied().unwrap_or(0) as i64);
        }
    }

    /// Hands the newest listing's live sandboxes to the inventory writer (a runtime not taken
    /// as this node's is not listed), each named by its pod's uid in the API: a static pod runs
    /// under its config hash, which its mirror pod carries.
    fn publish_inventory(&mut self) {
        let runtime = {
            let view = self.view.lock().expect("runtime view lock");
            let ours = runtime_is_ours(&mut self.identity, &self.metrics, &view);
            if view.listings == 0 || !ours {
                return;
            }
            view.live.clone()
        };
        let mirrors: HashMap<String, String> = self
            .pods
            .state()
            .iter()
            .filter_map(|p| {
                let hash = p.metadata.annotations.as_ref()?.get(MIRROR_ANNOTATION)?;
                Some((hash.clone(), p.metadata.uid.clone()?))
            })
            .collect();
        let live: inventory::Live = runtime
            .into_iter()
            .map(|(id, sb)| {
                let pod_uid = mirrors.get(&sb.pod_uid).cloned().unwrap_or(sb.pod_uid);
                let listed = Listed {
                    pod_uid,
                    grace_seconds: sb.grace_seconds,
                };
                (id, listed)
            })
            .collect();
        self.inventory.send_if_modified(|now| {
            let changed = now.as_ref() != Some(&live);
            if changed {
                *now = Some(live);
            }
            changed
        });
    }

    fn reported(&mut self, done: ReportDone) {
        let ReportDone {
            fence_uid,
            pod_uid,
            kind,
            outcome,
        } = done;
        let label = if outcome.is_ok() {
            "reported"
        } else {
            "failed"
        };
        if let Err(error) = &outcome {
            tracing::warn!(%fence_uid, %pod_uid, report = ?kind, %error, kind = error.label(), "reporting on a fenced pod's sandboxes failed; retried");
        }
        self.metrics
            .fence_reports
            .get_or_create(&crate::telemetry::node_metrics::OutcomeLabel {
                outcome: label.into(),
            })
            .inc();
        let listings = self.view.lock().expect("runtime view lock").listings;
        self.evidence
            .reported(&fence_uid, kind, outcome.is_ok(), listings);
    }

    fn start_due(&mut self, looks: &mut attempts::Attempts) {
        let ours = {
            let view = self.view.lock().expect("runtime view lock");
            runtime_is_ours(&mut self.identity, &self.metrics, &view)
        };
        for sb in self.witness.take_due(self.clock.now()) {
            if !ours {
                tracing::info!(sandbox = %sb.id, "the runtime is not taken as this node's; looked at again after the grace");
                self.metrics.sandbox_outcome(Outcome::Unverified.label());
                self.witness.recheck(sb, self.clock.now());
                continue;
            }
            let pod = api_pod(&self.pods, &sb.pod_uid);
            let releaser = self.releaser.clone();
            looks.spawn(sb, |sb| async move { releaser.release(&sb, pod).await });
        }
    }

    /// The dead sandboxes waiting, and how long the oldest of them (waiting or under a look)
    /// has been dead.
    fn set_waiting_gauges(&self, looks: &attempts::Attempts) {
        self.metrics
            .dead_sandboxes_pending
            .set(self.witness.pending() as i64);
        let oldest = [self.witness.oldest_death(), looks.oldest_death()]
            .into_iter()
            .flatten()
            .min()
            .map_or(Duration::ZERO, |since| {
                self.clock.now().saturating_duration_since(since)
            });
        self.metrics
            .dead_sandbox_oldest_wait_seconds
            .set(oldest.as_secs() as i64);
    }

    async fn finished(&mut self, sb: DeadSandbox, outcome: Outcome) {
        self.metrics.sandbox_outcome(outcome.label());
        match outcome {
            Outcome::Failed(cause) if sb.attempts + 1 < MAX_ATTEMPTS => {
                tracing::warn!(sandbox = %sb.id, %cause, kind = cause.label(), attempt = sb.attempts + 1, "release failed; will retry");
                self.witness.retry(sb, self.clock.now());
            }
            Outcome::Failed(cause) => {
                tracing::error!(sandbox = %sb.id, %cause, kind = cause.label(), "release failed for good; the controller's sweep still owns the leak");
                let pod = api_pod(&self.pods, &sb.pod_uid);
                self.releaser.gave_up(&sb, pod, &cause).await;
            }
            Outcome::Revived => {
                tracing::warn!(sandbox = %sb.id, "the runtime lists the sandbox ready: it never died; nothing released");
                self.witness.revived(&sb.id);
            }
            Outcome::InUse(now) => {
                tracing::info!(sandbox = %sb.id, ?now, "the sandbox's network or containers are still up; looked at again after the grace");
                self.witness.recheck(sb, self.clock.now());
            }
            Outcome::Held => {
                tracing::info!(sandbox = %sb.id, "the breaker holds the sandbox's releases; looked at again after the grace");
                self.witness.recheck(sb, self.clock.now());
            }
            Outcome::Unverified => {
                tracing::warn!(sandbox = %sb.id, "the runtime does not list this agent's own pod Ready: not taken as this node's; looked at again after the grace");
                self.witness.recheck(sb, self.clock.now());
            }
            other => tracing::info!(sandbox = %sb.id, outcome = ?other, "dead sandbox handled"),
        }
    }
}

/// The releaser of dead sandboxes: its own writer (no index: it reads pools fresh) and
/// Events as `node-agent/<node>`.
fn releaser(
    client: &Client,
    runtime: CriPodSource,
    args: &NodeAgentArgs,
    budgets: &Budgets,
    writes: WriteMetrics,
    metrics: &NodeMetrics,
) -> Releaser {
    let component = format!("node-agent/{}", args.node_name);
    let events = Events::new(client.clone(), &component, budgets.clone(), writes.clone());
    let ns = &args.whereabouts_namespace;
    let writer = writer::Writer::new(client.clone(), ns, budgets.clone(), events.clone(), writes)
        .patch_interval(POOL_PATCH_INTERVAL)
        .cooldown(args.release_cooldown)
        .dry_run(args.dry_run)
        // The chart grants the agent on every node no list of pools.
        .pools_read_by_get();
    Releaser {
        client: client.clone(),
        runtime,
        namespace: args.whereabouts_namespace.clone(),
        node: args.node_name.clone(),
        writer: writer::spawn(Arc::new(writer)),
        events,
        reclaim: ReclaimConfig::default(),
        metrics: metrics.clone(),
        max_release_ratio: args.max_release_ratio,
        breaker: Mutex::new(hold::NodeBreaker::default()),
        own_pod: args.pod_uid.clone().filter(|u| !u.is_empty()),
    }
}

/// Serves /metrics and the probes on `addr`; live while the PLEG is healthy.
async fn serve(
    addr: SocketAddr,
    registry: Registry,
    pleg: &PlegHandle,
) -> anyhow::Result<(Health, SocketAddr, tokio::task::JoinHandle<()>)> {
    let live = pleg.clone();
    let health = Health::with_liveness(move || live.healthy().map_err(|e| e.to_string()));
    let (bound, server) = crate::telemetry::serve(addr, Arc::new(registry), health.clone())
        .await
        .with_context(|| format!("bind metrics address {addr}"))?;
    Ok((health, bound, server))
}

/// The first wait before a dead sandbox's failed release is tried again.
fn witness_recheck(args: &NodeAgentArgs) -> Duration {
    args.relist_period.max(WITNESS_MIN_RECHECK)
}

/// The PLEG, its events, the runtime view its source keeps, and the source (for the
/// releaser's own questions to the runtime).
type PlegParts = (
    Pleg<CriPodSource>,
    tokio::sync::mpsc::Receiver<PodLifecycleEvent>,
    Arc<Mutex<RuntimeView>>,
    CriPodSource,
);

/// The PLEG over the node's runtime: relists throttled CRI calls into the pod status cache.
fn start_pleg(
    args: &NodeAgentArgs,
    metrics: &NodeMetrics,
    clock: SharedClock,
) -> anyhow::Result<PlegParts> {
    let client_cri = cri::connect_lazy(&args.cri_endpoint)
        .with_context(|| format!("CRI endpoint {}", args.cri_endpoint))?;
    let source = CriPodSource::new(client_cri)
        .with_calls(CriCalls::in_family(&metrics.cri_calls))
        .with_throttle(Throttle::new(
            args.cri_qps,
            args.cri_burst,
            Parallelism::Parallel { max: None },
            clock.clone(),
        ));
    let view = source.view();
    let runtime = source.clone();
    let cache = Arc::new(PodStatusCache::new());
    let (pleg, events) = Pleg::new(
        source,
        Some(cache),
        clock.clone(),
        PlegConfig {
            relist_period: args.relist_period,
            relist_threshold: args.relist_threshold,
            // A pod whose status call fails is retried on the next relist, then less often.
            inspect_backoff_initial: args.relist_period,
            inspect_backoff_max: INSPECT_BACKOFF_MAX,
            ..PlegConfig::default()
        },
    );
    Ok((pleg, events, view, runtime))
}

/// Runs the node agent until `shutdown` completes. Calls `on_start` once the metrics server is
/// bound.
pub async fn run(
    client: Client,
    args: NodeAgentArgs,
    shutdown: impl Future<Output = ()>,
    on_start: impl FnOnce(&NodeRunning),
) -> anyhow::Result<()> {
    if args.node_name.is_empty() {
        anyhow::bail!("--node-name (or $NODE_NAME) is empty");
    }
    let clock = RealClock::shared();
    let mut registry = Registry::default();
    let metrics = NodeMetrics::new(&mut registry);
    metrics.zero_outcomes(&release::Outcome::LABELS);
    let writes = WriteMetrics::new(registry.sub_registry_with_prefix("ipreclaim"));

    let (mut pleg, events, view, runtime) = start_pleg(&args, &metrics, clock.clone())?;
    let handle = pleg.handle();
    let (m, h) = (metrics.clone(), handle.clone());
    pleg.set_observer(move |stats| m.observe_relist(&stats, &h));
    let (health, metrics_addr, server) = serve(args.metrics_addr, registry, &handle).await?;
    on_start(&NodeRunning {
        health: health.clone(),
        metrics_addr,
        pleg: handle.clone(),
    });
    tracing::info!(%metrics_addr, node = %args.node_name, cri = %args.cri_endpoint, dry_run = args.dry_run, "node agent starting");

    let (pods, watch_task) = watch_node_pods(client.clone(), &args.node_name);
    let (fence_map, fence_task) = fences::watch(
        client.clone(),
        &args.whereabouts_namespace,
        &args.node_name,
        args.fence_watch_timeout,
    );
    let budgets = Budgets::new(NODE_BUDGETS, clock.clone(), writes.clone());
    let reporter = fences::FenceReporter::for_agent(&client, &args, clock.clone(), writes.clone());
    let releaser = Arc::new(releaser(
        &client, runtime, &args, &budgets, writes, &metrics,
    ));
    let (inventory, inventory_task) = inventory::InventoryWriter {
        client: client.clone(),
        namespace: crate::flags::own_namespace(
            args.inventory_namespace.as_deref(),
            &args.whereabouts_namespace,
        ),
        node: args.node_name.clone(),
        dry_run: args.dry_run,
        budgets: budgets.clone(),
        clock: clock.clone(),
    }
    .spawn();
    let (stop_pleg_tx, stop_pleg_rx) = tokio::sync::oneshot::channel::<()>();
    let pleg_task = tokio::spawn(pleg.run(async {
        let _ = stop_pleg_rx.await;
    }));

    let agent = Agent {
        clock: clock.clone(),
        view,
        pods: pods.clone(),
        witness: Witness::new(
            args.sandbox_grace,
            witness_recheck(&args),
            WITNESS_MAX_RECHECK,
        ),
        metrics,
        releaser,
        logged_orphans: Once::default(),
        pleg: handle.clone(),
        fences: fence_map,
        evidence: evidence::Evidence::new(&args.node_name),
        reporter: Arc::new(reporter),
        evidence_listing: 0,
        identity: RuntimeIdentity::new(args.pod_uid.as_deref()),
        inventory,
    };
    let main = async {
        // Nothing is judged before this node's pods are known.
        if pods.wait_until_ready().await.is_err() {
            return;
        }
        health.set_ready(true);
        tracing::info!("node pods synced; ready");
        agent.run(events, args.relist_period).await;
    };
    tokio::select! {
        _ = shutdown => tracing::info!("shutting down"),
        _ = main => {}
    }
    let _ = stop_pleg_tx.send(());
    let _ = pleg_task.await;
    health.set_ready(false);
    watch_task.abort();
    fence_task.abort();
    inventory_task.abort();
    server.abort();
    Ok(())
}
