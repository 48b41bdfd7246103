//! Releasing what a dead sandbox held, with targeted GETs only: the pod, its networks' NADs,
//! node slices and pools, and the reservations of the released addresses.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Instant;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::{Client, ResourceExt};
use podlife::SourceError;

use super::cri::CriPodSource;
use super::error::NodeError;
use super::hold::{EntryId, Hold, NodeBreaker, PoolSeen, hold_pools};
use super::plan::{PoolTarget, Written, plan_pool, pod_networks};
use super::witness::{DeadSandbox, SandboxNow};
use crate::api::lenient::Lenient;
use crate::api::{
    IPPool, NetworkAttachmentDefinition, NodeSlicePool, OverlappingRangeIPReservation,
};
use crate::ipam::{
    IpamConfig, PodKey, PoolEntry, ippool_name, parse_nad_config, pool_allocations,
    reservation_name,
};
use crate::release::objects::reservation::ReservationDelete;
use crate::release::{Events, ReleaseError, ReleaseOutcome, ReleaseRequest, WriterHandle};
use crate::rules::breaker::{BREAKER_WINDOW, NewHold};
use crate::rules::{LivePod, PodPhase, PodRef, ReclaimConfig};
use crate::telemetry::NodeMetrics;

/// What became of a dead sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This many pool entries were released.
    Released(usize),
    /// Dry-run: this many would have been.
    DryRun(usize),
    /// The pod held no entry of that sandbox (the CNI DEL ran, or it never allocated here).
    NoAllocation,
    /// Entries of that sandbox exist but the decision keeps them (listed on the pod, or the pod
    /// finished: the controller owns those).
    Kept,
    /// No live pod of that uid: a deleted pod is the controller's to clean up.
    PodGone,
    /// The runtime lists the sandbox ready: the listing that reported it dead had missed it.
    Revived,
    /// The runtime says the sandbox's network or a container of it is still up: looked at
    /// again after a grace.
    InUse(SandboxNow),
    /// The blast-radius breaker held its releases in a pool (those in other pools went):
    /// looked at again after a grace.
    Held,
    /// The runtime is not known to be this node's (it does not list the agent's own pod
    /// Ready: see [`super::identity`]): looked at again after a grace.
    Unverified,
    /// Something failed; retried later.
    Failed(NodeError),
}

impl Outcome {
    /// Every label, for metrics.
    pub const LABELS: [&'static str; 10] = [
        "released",
        "dry_run",
        "no_allocation",
        "kept",
        "pod_gone",
        "revived",
        "in_use",
        "held",
        "unverified",
        "failed",
    ];

    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Released(_) => "released",
            Outcome::DryRun(_) => "dry_run",
            Outcome::NoAllocation => "no_allocation",
            Outcome::Kept => "kept",
            Outcome::PodGone => "pod_gone",
            Outcome::Revived => "revived",
            Outcome::InUse(_) => "in_use",
            Outcome::Held => "held",
            Outcome::Unverified => "unverified",
            Outcome::Failed(_) => "failed",
        }
    }
}

/// The API pod of a dead sandbox's uid on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiPod {
    /// Its namespace and name.
    pub key: PodKey,
    /// Being deleted (the controller's to clean up).
    pub deleting: bool,
}

/// Does the API work for dead sandboxes.
pub struct Releaser {
    pub(crate) client: Client,
    /// The container runtime, asked again right before a release.
    pub(crate) runtime: CriPodSource,
    pub(crate) namespace: String,
    pub(crate) node: String,
    pub(crate) writer: WriterHandle,
    pub(crate) events: Events,
    pub(crate) reclaim: ReclaimConfig,
    pub(crate) metrics: NodeMetrics,
    /// `--max-release-ratio`.
    pub(crate) max_release_ratio: f64,
    /// The blast-radius breaker over this agent's releases (release tasks run concurrently).
    pub(crate) breaker: Mutex<NodeBreaker>,
    /// The agent's own pod uid (`--pod-uid`): a release needs the runtime to list it Ready.
    pub(crate) own_pod: Option<String>,
}

/// A pool as just read: its uid (for Events on it) and entries.
struct PoolRead {
    uid: String,
    entries: Vec<PoolEntry>,
}

/// What a dead sandbox's look plans, over all its pools.
#[derive(Default)]
struct Planned {
    /// The releases.
    reqs: Vec<ReleaseRequest>,
    /// Entries of the sandbox the decision keeps.
    kept: usize,
    /// Per pool, for the breaker: the releases and every entry as read.
    seen: BTreeMap<String, PoolSeen>,
    /// Per pool, its uid (for a hold's Event).
    uids: BTreeMap<String, String>,
}

/// A pool entry as the breaker knows it.
fn entry_id(e: &PoolEntry) -> EntryId {
    (e.id.clone(), e.ip)
}

fn failed(what: String, e: kube::Error) -> Outcome {
    Outcome::Failed(NodeError::read(what, &e))
}

impl Releaser {
    /// Handles one due sandbox. `pod` is the API pod of its uid on this node, if any.
    pub async fn release(&self, sb: &DeadSandbox, pod: Option<ApiPod>) -> Outcome {
        self.try_release(sb, pod).await.unwrap_or_else(|o| o)
    }

    /// [`Releaser::release`]; `Err` carries an outcome that ends it early.
    async fn try_release(&self, sb: &DeadSandbox, pod: Option<ApiPod>) -> Result<Outcome, Outcome> {
        let Some(ApiPod {
            key,
            deleting: false,
        }) = pod
        else {
            return Ok(Outcome::PodGone);
        };
        let Some(pod) = self.live_pod(&key, &sb.pod_uid).await? else {
            return Ok(Outcome::PodGone);
        };
        let networks = pod_networks(pod.annotations(), &key.namespace);
        for why in &networks.ignored {
            tracing::warn!(pod = %key, %why, "annotation ignored");
        }
        let podref = PodRef {
            key,
            uid: sb.pod_uid.clone(),
        };
        let live = LivePod {
            uid: &sb.pod_uid,
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            networks: networks.attached.as_deref(),
        };
        let targets = self.targets_of(&networks.names).await?;
        let Planned {
            mut reqs,
            kept,
            seen,
            uids,
        } = self.plan(sb, &podref, live, &targets).await?;
        if reqs.is_empty() {
            return Ok(if kept == 0 {
                Outcome::NoAllocation
            } else {
                Outcome::Kept
            });
        }
        self.confirm_dead(sb).await?;
        let (held, reserved_at) = self.hold(&sb.id, &seen, &uids).await;
        reqs.retain(|r| !held.contains(&r.judged.pool));
        if reqs.is_empty() {
            return Ok(Outcome::Held);
        }
        let results = self.writer.release(reqs.clone()).await;
        self.give_back(&reqs, &results, reserved_at);
        let written = Written::tally(&reqs, &results);
        crate::release::reports::audit::emit_all(reqs.iter().zip(&results), None, Some(&self.node));
        for (network, ips) in &written.released {
            let cooling = written.cooling_until(ips);
            self.events
                .released_sandbox_gone(&podref, ips, network, &sb.id, cooling)
                .await;
        }
        // A cooling address keeps its reservation: the controller deletes it at the end.
        let removed = written.removed();
        for r in &reqs {
            let t = &targets[&r.judged.pool];
            if t.reservations && removed.contains(&r.judged.entry.ip) {
                self.delete_reservation(r.judged.entry.ip, t, &podref, &sb.id)
                    .await;
            }
        }
        Ok(match written.error {
            // Entries already written stay released; the retry finds only what is left.
            Some(e) => Outcome::Failed(e.into()),
            // Not looked at again: its other releases would be reported twice.
            None if written.dry_run > 0 => Outcome::DryRun(written.dry_run),
            None if !held.is_empty() => {
                let n = written.addresses().len();
                tracing::info!(sandbox = %sb.id, released = n, held = ?held, "dead sandbox's entries released but in held pools");
                Outcome::Held
            }
            None => Outcome::Released(written.addresses().len()),
        })
    }

    /// The pools the pod's `networks` allocate from on this node, by name.
    async fn targets_of(
        &self,
        networks: &BTreeSet<String>,
    ) -> Result<BTreeMap<String, PoolTarget>, Outcome> {
        let mut targets: BTreeMap<String, PoolTarget> = BTreeMap::new();
        for network in networks {
            for t in self.pools_of(network).await? {
                targets.entry(t.pool.clone()).or_insert(t);
            }
        }
        Ok(targets)
    }

    /// Reads each target pool fresh and judges the dead sandbox's entries there.
    async fn plan(
        &self,
        sb: &DeadSandbox,
        podref: &PodRef,
        live: LivePod<'_>,
        targets: &BTreeMap<String, PoolTarget>,
    ) -> Result<Planned, Outcome> {
        let mut out = Planned::default();
        for t in targets.values() {
            let Some(PoolRead { uid, entries }) = self.entries_of(&t.pool).await? else {
                continue;
            };
            let all = entries.iter().map(entry_id).collect();
            let plan = plan_pool(&sb.id, podref, live, t, entries, &self.reclaim);
            for (entry, decision) in &plan.kept {
                tracing::info!(pool = %t.pool, ip = %entry.ip, ?decision, "dead sandbox's entry kept");
            }
            out.kept += plan.kept.len();
            let releases = plan
                .releases
                .iter()
                .map(|r| entry_id(&r.judged.entry))
                .collect();
            let seen = PoolSeen {
                releases,
                entries: all,
            };
            out.seen.insert(t.pool.clone(), seen);
            out.uids.insert(t.pool.clone(), uid);
            out.reqs.extend(plan.releases);
        }
        Ok(out)
    }

    /// The blast-radius breaker: judges the sandbox's releases per pool (reserving what
    /// passes) and reports new holds. Returns the held pools and when the rest was reserved.
    async fn hold(
        &self,
        sandbox: &str,
        seen: &BTreeMap<String, PoolSeen>,
        uids: &BTreeMap<String, String>,
    ) -> (BTreeSet<String>, Instant) {
        let (Hold { held, new }, at) = {
            let mut breaker = self.breaker.lock().expect("breaker lock");
            // Taken under the lock: the reservations are recorded in the order of their times.
            let now = Instant::now();
            (
                hold_pools(&mut breaker, seen, self.max_release_ratio, now),
                now,
            )
        };
        for hold in new {
            let uid = uids.get(&hold.pool).cloned().unwrap_or_default();
            self.report_hold(sandbox, hold, &uid).await;
        }
        (held, at)
    }

    /// Reports a new hold: a warning log line and a Warning Event on the pool.
    async fn report_hold(&self, sandbox: &str, hold: NewHold, uid: &str) {
        let (pool, releases, size, recent) = (hold.pool, hold.releases, hold.size, hold.recent);
        let (node, ratio) = (&self.node, self.max_release_ratio);
        let minutes = BREAKER_WINDOW.as_secs() / 60;
        let short = &sandbox[..sandbox.len().min(12)];
        tracing::warn!(%pool, sandbox, releases, size, recent, ratio, "breaker holds this node agent's releases in the pool");
        let note = format!(
            "the node agent on node {node} would release {releases} of {size} allocations \
             (dead sandbox {short}; {recent} released by it in the last {minutes} min), more than \
             --max-release-ratio {ratio}: held. The dead sandboxes' entries stay and are looked \
             at again after each --sandbox-grace; they go once this agent's releases of the last \
             {minutes} min leave room. To release them sooner, raise --max-release-ratio on the \
             node agent, or release by hand: kubectl ipreclaim release --ip ADDRESS"
        );
        self.events
            .release_held(&self.namespace, &pool, uid, note)
            .await;
    }

    /// Gives back to the breaker the reservations of what the writer did not free (a dry run
    /// counts what it would have freed: each dead sandbox is judged once).
    fn give_back(
        &self,
        reqs: &[ReleaseRequest],
        results: &[Result<ReleaseOutcome, ReleaseError>],
        at: Instant,
    ) {
        let mut unfreed: BTreeMap<&str, Vec<EntryId>> = BTreeMap::new();
        for (r, result) in reqs.iter().zip(results) {
            let freed = matches!(result, Ok(o) if o.freed() || *o == ReleaseOutcome::DryRun);
            if !freed {
                unfreed
                    .entry(&r.judged.pool)
                    .or_default()
                    .push(entry_id(&r.judged.entry));
            }
        }
        if unfreed.is_empty() {
            return;
        }
        let mut breaker = self.breaker.lock().expect("breaker lock");
        for (pool, entries) in unfreed {
            breaker.give_back(pool, &entries, at);
        }
    }

    /// One listing is no proof of a death: the runtime is asked again, right before the
    /// release (a sandbox dead by then stays dead: no runtime readies a stopped sandbox, nor
    /// starts a container in it). `Err`: the outcome when it is not dead or cannot be asked.
    async fn confirm_dead(&self, sb: &DeadSandbox) -> Result<(), Outcome> {
        let runtime_error = |e: SourceError| {
            Outcome::Failed(NodeError::Runtime {
                sandbox: sb.id.clone(),
                message: e.to_string(),
            })
        };
        match self.runtime.sandbox_now(&sb.id).await {
            Ok(now) if now.is_dead() => {}
            Ok(SandboxNow::Ready) => return Err(Outcome::Revived),
            Ok(now) => return Err(Outcome::InUse(now)),
            Err(e) => return Err(runtime_error(e)),
        }
        // Asked after the sandbox: a runtime swapped in before that answer fails this.
        let Some(own_pod) = &self.own_pod else {
            return Ok(());
        };
        match self.runtime.pod_ready_now(own_pod).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Outcome::Unverified),
            Err(e) => Err(runtime_error(e)),
        }
    }

    /// The pod `key` if it is still the live pod of `uid` (the watch may lag: the pod itself
    /// is read); `None` when it is gone, replaced or being deleted.
    async fn live_pod(&self, key: &PodKey, uid: &str) -> Result<Option<Pod>, Outcome> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &key.namespace);
        match pods.get_opt(&key.name).await {
            Ok(Some(p))
                if p.metadata.uid.as_deref() == Some(uid)
                    && p.metadata.deletion_timestamp.is_none() =>
            {
                Ok(Some(p))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(failed(format!("get pod {key}"), e)),
        }
    }

    /// The entries of `pool`, read fresh, with its uid (`None`: gone, or unreadable and
    /// skipped).
    async fn entries_of(&self, pool: &str) -> Result<Option<PoolRead>, Outcome> {
        let api: Api<Lenient<IPPool>> = Api::namespaced(self.client.clone(), &self.namespace);
        let pool_object = match api.get_opt(pool).await {
            Ok(Some(Lenient::Valid(p))) => p,
            Ok(Some(Lenient::Invalid { error, .. })) => {
                self.metrics.config_errors.inc();
                tracing::warn!(%pool, %error, "pool skipped: it does not fit the schema");
                return Ok(None);
            }
            Ok(None) => return Ok(None),
            Err(e) => return Err(failed(format!("get pool {pool}"), e)),
        };
        match pool_allocations(&pool_object.spec) {
            Ok(a) => {
                if !a.problems.is_empty() {
                    // The entries that can be read are judged; the others are the controller's
                    // to report (on the pool).
                    self.metrics.config_errors.inc();
                    tracing::warn!(%pool, problems = a.problems.len(), "pool entries that cannot be read skipped");
                }
                Ok(Some(PoolRead {
                    uid: pool_object.metadata.uid.clone().unwrap_or_default(),
                    entries: a.entries,
                }))
            }
            Err(e) => {
                self.metrics.config_errors.inc();
                tracing::warn!(%pool, error = %e, "unreadable pool");
                Ok(None)
            }
        }
    }

    /// The pools a network allocates from on this node. A NAD that is gone or not whereabouts
    /// has none; one that cannot be read is counted and skipped (the controller reports it).
    async fn pools_of(&self, network: &str) -> Result<Vec<PoolTarget>, Outcome> {
        let Some((ns, nad_name)) = network.split_once('/') else {
            return Ok(Vec::new());
        };
        let nads: Api<Lenient<NetworkAttachmentDefinition>> =
            Api::namespaced(self.client.clone(), ns);
        let nad = match nads.get_opt(nad_name).await {
            Ok(Some(Lenient::Valid(n))) => n,
            Ok(Some(Lenient::Invalid { error, .. })) => {
                self.metrics.config_errors.inc();
                tracing::warn!(nad = %network, %error, "NAD skipped: it does not fit the schema");
                return Ok(Vec::new());
            }
            Ok(None) => return Ok(Vec::new()),
            Err(e) => return Err(failed(format!("get NAD {network}"), e)),
        };
        let config = match nad.spec.config.as_deref().map(parse_nad_config) {
            Some(Ok(Some(c))) => c,
            Some(Ok(None)) | None => return Ok(Vec::new()),
            Some(Err(e)) => {
                self.metrics.config_errors.inc();
                tracing::warn!(nad = %network, error = %e, "unusable NAD config");
                return Ok(Vec::new());
            }
        };
        let ranges: Vec<(IpNet, String)> = if config.node_slice_size.is_some() {
            self.node_slice_pools(&config, nad_name).await?
        } else {
            config.pool_names(None)
        };
        Ok(ranges
            .into_iter()
            .map(|(_, pool)| PoolTarget {
                pool,
                network: network.to_owned(),
                network_name: config.network_name.clone(),
                reservations: config.enable_overlapping_ranges,
            })
            .collect())
    }

    /// A node-slice network's pool on this node: the IPPool named with the node and this
    /// node's slice of the NodeSlicePool (named by `network_name`, else the CNI network's name,
    /// else the NAD's).
    async fn node_slice_pools(
        &self,
        config: &IpamConfig,
        nad_name: &str,
    ) -> Result<Vec<(IpNet, String)>, Outcome> {
        let name = config.node_slice_pool_name().unwrap_or(nad_name);
        let api: Api<Lenient<NodeSlicePool>> =
            Api::namespaced(self.client.clone(), &self.namespace);
        let slices = match api.get_opt(name).await {
            Ok(Some(Lenient::Valid(s))) => s,
            Ok(Some(Lenient::Invalid { error, .. })) => {
                self.metrics.config_errors.inc();
                tracing::warn!(nodeslicepool = name, %error, "NodeSlicePool skipped: it does not fit the schema");
                return Ok(Vec::new());
            }
            Ok(None) => {
                self.metrics.config_errors.inc();
                tracing::warn!(
                    nodeslicepool = name,
                    "no NodeSlicePool for a node-slice network"
                );
                return Ok(Vec::new());
            }
            Err(e) => return Err(failed(format!("get NodeSlicePool {name}"), e)),
        };
        let slice = slices
            .status
            .iter()
            .flat_map(|s| &s.allocations)
            .find(|a| a.node_name == self.node)
            .and_then(|a| a.slice_range.parse::<IpNet>().ok().map(|n| n.trunc()));
        Ok(match slice {
            Some(net) => vec![(
                net,
                ippool_name(&net, config.network_name.as_deref(), Some(&self.node)),
            )],
            None => {
                self.metrics.config_errors.inc();
                tracing::warn!(nodeslicepool = name, node = %self.node, "no slice for this node");
                Vec::new()
            }
        })
    }

    /// Deletes the reservation of a released address when it is still this pod's (and, where
    /// recorded, this sandbox's).
    async fn delete_reservation(&self, ip: IpAddr, t: &PoolTarget, pod: &PodRef, sandbox: &str) {
        let name = reservation_name(ip, t.network_name.as_deref());
        let api: Api<OverlappingRangeIPReservation> =
            Api::namespaced(self.client.clone(), &self.namespace);
        let r = match api.get_opt(&name).await {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(reservation = %name, error = %e, "could not read reservation");
                return;
            }
        };
        let ours = r.spec.podref == pod.podref()
            && r.spec
                .containerid
                .as_deref()
                .is_none_or(|c| c.is_empty() || c == sandbox);
        if let (true, Some(uid)) = (ours, r.metadata.uid.clone()) {
            self.writer.delete_reservations(vec![ReservationDelete {
                name,
                uid,
                podref: pod.podref(),
                ip: Some(ip),
                pool: Some(t.pool.clone()),
                live_pod: None,
            }]);
        }
    }

    /// Retries ran out: a Warning Event on the pod, naming the sandbox and the cause.
    pub async fn gave_up(&self, sb: &DeadSandbox, pod: Option<ApiPod>, cause: &NodeError) {
        if let Some(ApiPod { key, .. }) = pod {
            let pod = PodRef {
                key,
                uid: sb.pod_uid.clone(),
            };
            let short = &sb.id[..sb.id.len().min(12)];
            self.events
                .failed(&pod, &format!("dead sandbox {short}: {cause}"))
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{NodeError, Outcome};

    #[test]
    fn every_outcome_label_is_listed() {
        let all = [
            Outcome::Released(1),
            Outcome::DryRun(1),
            Outcome::NoAllocation,
            Outcome::Kept,
            Outcome::PodGone,
            Outcome::Revived,
            Outcome::InUse(super::SandboxNow::NetworkUp),
            Outcome::Held,
            Outcome::Unverified,
            Outcome::Failed(NodeError::Report("x".into())),
        ];
        let labels: Vec<&str> = all.iter().map(Outcome::label).collect();
        assert_eq!(labels, Outcome::LABELS);
    }
}
