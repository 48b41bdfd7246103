//! Releasing what a dead sandbox held, with targeted GETs only: the pod, its networks' NADs,
//! node slices and pools, and the reservations of the released addresses.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::{Client, ResourceExt};

use super::cri::CriPodSource;
use super::error::NodeError;
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
use crate::reclaim::{LivePod, PodPhase, PodRef, ReclaimConfig};
use crate::release::Events;
use crate::release::WriterHandle;
use crate::release::reservation::ReservationDelete;
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
    /// Something failed; retried later.
    Failed(NodeError),
}

impl Outcome {
    /// Every label, for metrics.
    pub const LABELS: [&'static str; 8] = [
        "released",
        "dry_run",
        "no_allocation",
        "kept",
        "pod_gone",
        "revived",
        "in_use",
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
        // One listing is no proof: the runtime is asked again (a sandbox dead by then stays
        // dead: no runtime readies a stopped sandbox, nor starts a container in it).
        match self.runtime.sandbox_now(&sb.id).await {
            Ok(now) if now.is_dead() => {}
            Ok(SandboxNow::Ready) => return Ok(Outcome::Revived),
            Ok(now) => return Ok(Outcome::InUse(now)),
            Err(e) => {
                return Ok(Outcome::Failed(NodeError::Runtime {
                    sandbox: sb.id.clone(),
                    message: e.to_string(),
                }));
            }
        }
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
        let mut targets: BTreeMap<String, PoolTarget> = BTreeMap::new();
        for network in &networks.names {
            for t in self.pools_of(network).await? {
                targets.entry(t.pool.clone()).or_insert(t);
            }
        }
        let mut reqs = Vec::new();
        let mut kept = 0;
        for t in targets.values() {
            let Some(entries) = self.entries_of(&t.pool).await? else {
                continue;
            };
            let plan = plan_pool(&sb.id, &podref, live, t, entries, &self.reclaim);
            for (entry, decision) in &plan.kept {
                tracing::info!(pool = %t.pool, ip = %entry.ip, ?decision, "dead sandbox's entry kept");
            }
            kept += plan.kept.len();
            reqs.extend(plan.releases);
        }
        if reqs.is_empty() {
            return Ok(if kept == 0 {
                Outcome::NoAllocation
            } else {
                Outcome::Kept
            });
        }
        let results = self.writer.release(reqs.clone()).await;
        let written = Written::tally(&reqs, &results);
        crate::release::audit::emit_all(reqs.iter().zip(&results), None, Some(&self.node));
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
            None if written.dry_run > 0 => Outcome::DryRun(written.dry_run),
            None => Outcome::Released(written.addresses().len()),
        })
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

    /// The entries of `pool`, read fresh (`None`: gone, or unreadable and skipped).
    async fn entries_of(&self, pool: &str) -> Result<Option<Vec<PoolEntry>>, Outcome> {
        let api: Api<Lenient<IPPool>> = Api::namespaced(self.client.clone(), &self.namespace);
        let pool_object = match api.get_opt(pool).await {
            Ok(Some(Lenient::Valid(p))) => p,
            Ok(Some(Lenient::Invalid { error, .. })) => {
                tracing::warn!(%pool, %error, "pool skipped: it does not fit the schema");
                return Ok(None);
            }
            Ok(None) => return Ok(None),
            Err(e) => return Err(failed(format!("get pool {pool}"), e)),
        };
        match pool_allocations(&pool_object.spec) {
            Ok(a) => Ok(Some(a.entries)),
            Err(e) => {
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
        let api: Api<NodeSlicePool> = Api::namespaced(self.client.clone(), &self.namespace);
        let slices = match api.get_opt(name).await {
            Ok(Some(s)) => s,
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
            Outcome::Failed(NodeError::Report("x".into())),
        ];
        let labels: Vec<&str> = all.iter().map(Outcome::label).collect();
        assert_eq!(labels, Outcome::LABELS);
    }
}
