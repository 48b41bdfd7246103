//! Releasing what a dead sandbox held, with targeted GETs only: the pod, its networks' NADs,
//! node slices and pools, and the reservations of the released addresses.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::{Client, ResourceExt};

use super::witness::DeadSandbox;
use crate::api::lenient::Lenient;
use crate::api::{
    IPPool, NetworkAttachmentDefinition, NodeSlicePool, OverlappingRangeIPReservation,
};
use crate::ipam::{
    IpamConfig, NETWORK_STATUS_ANNOTATION, NETWORKS_ANNOTATION, ippool_name, parse_nad_config,
    parse_network_status, parse_networks, pool_allocations, reservation_name,
};
use crate::reclaim::{
    self, Allocation, Decision, LivePod, PodKnowledge, PodPhase, PoolContext, Reason, ReclaimConfig,
};
use crate::release::Events;
use crate::release::reservation::ReservationDelete;
use crate::release::{Judged, PodRef};
use crate::release::{ReleaseOutcome, ReleaseRequest, WriterHandle};
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
    /// Something failed; retried later.
    Failed(String),
}

impl Outcome {
    /// Every label, for metrics.
    pub const LABELS: [&'static str; 6] = [
        "released",
        "dry_run",
        "no_allocation",
        "kept",
        "pod_gone",
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
            Outcome::Failed(_) => "failed",
        }
    }
}

/// Does the API work for dead sandboxes.
pub struct Releaser {
    pub(crate) client: Client,
    pub(crate) namespace: String,
    pub(crate) node: String,
    pub(crate) writer: WriterHandle,
    pub(crate) events: Events,
    pub(crate) reclaim: ReclaimConfig,
    pub(crate) metrics: NodeMetrics,
}

/// A pool to look in, for one network.
struct PoolTarget {
    pool: String,
    network: String,
    network_name: Option<String>,
    reservations: bool,
}

fn failed(what: &str, e: kube::Error) -> Outcome {
    Outcome::Failed(format!("{what}: {e}"))
}

impl Releaser {
    /// Handles one due sandbox. `pod` is the live API pod of its uid on this node, if any
    /// (namespace, name, being deleted).
    pub async fn release(&self, sb: &DeadSandbox, pod: Option<(String, String, bool)>) -> Outcome {
        let Some((namespace, name, false)) = pod else {
            return Outcome::PodGone;
        };
        // The watch may lag: look at the pod itself.
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let pod = match pods.get_opt(&name).await {
            Ok(Some(p)) if p.metadata.uid.as_deref() == Some(sb.pod_uid.as_str()) => p,
            Ok(Some(_)) | Ok(None) => return Outcome::PodGone,
            Err(e) => return failed(&format!("get pod {namespace}/{name}"), e),
        };
        if pod.metadata.deletion_timestamp.is_some() {
            return Outcome::PodGone;
        }
        let annotations = pod.annotations();
        let attached = annotations
            .get(NETWORK_STATUS_ANNOTATION)
            .and_then(|a| match parse_network_status(a) {
                Ok(n) => Some(n),
                Err(e) => {
                    tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "ignoring network-status");
                    None
                }
            });
        let mut networks: BTreeSet<String> = BTreeSet::new();
        if let Some(a) = annotations.get(NETWORKS_ANNOTATION) {
            match parse_networks(a, &namespace) {
                Ok(n) => networks.extend(n),
                Err(e) => {
                    tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "ignoring networks annotation")
                }
            }
        }
        networks.extend(attached.iter().flatten().map(|n| n.name.clone()));
        let podref = PodRef {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: sb.pod_uid.clone(),
        };
        let live = LivePod {
            uid: &sb.pod_uid,
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            networks: attached.as_deref(),
        };

        let mut targets: BTreeMap<String, PoolTarget> = BTreeMap::new();
        for network in &networks {
            match self.pools_of(network).await {
                Ok(found) => {
                    for t in found {
                        targets.entry(t.pool.clone()).or_insert(t);
                    }
                }
                Err(outcome) => return outcome,
            }
        }

        let mut reqs = Vec::new();
        let mut reservations: Vec<(IpAddr, &PoolTarget)> = Vec::new();
        let mut seen_entries = 0;
        let dead = [sb.id.clone()];
        let api: Api<Lenient<IPPool>> = Api::namespaced(self.client.clone(), &self.namespace);
        for t in targets.values() {
            let pool = match api.get_opt(&t.pool).await {
                Ok(Some(Lenient::Valid(p))) => p,
                Ok(Some(Lenient::Invalid { error, .. })) => {
                    tracing::warn!(pool = %t.pool, %error, "pool skipped: it does not fit the schema");
                    continue;
                }
                Ok(None) => continue,
                Err(e) => return failed(&format!("get pool {}", t.pool), e),
            };
            let allocations = match pool_allocations(&pool.spec) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(pool = %t.pool, error = %e, "unreadable pool");
                    continue;
                }
            };
            let networks = [t.network.clone()];
            for entry in allocations.entries.into_iter().filter(|e| e.id == sb.id) {
                seen_entries += 1;
                let decision = reclaim::decide(
                    &Allocation {
                        ip: entry.ip,
                        sandbox_id: &entry.id,
                        podref: &entry.podref,
                        ifname: entry.ifname.as_deref(),
                    },
                    &PoolContext {
                        networks: Some(&networks),
                    },
                    &PodKnowledge {
                        live: Some(live),
                        deleted: &[],
                        dead_sandboxes: &dead,
                    },
                    &self.reclaim,
                );
                if decision != Decision::Release(Reason::SandboxGone) {
                    tracing::info!(pool = %t.pool, ip = %entry.ip, ?decision, "dead sandbox's entry kept");
                    continue;
                }
                if t.reservations {
                    reservations.push((entry.ip, t));
                }
                reqs.push(ReleaseRequest {
                    judged: Judged {
                        pool: t.pool.clone(),
                        entry,
                        decision,
                        network: t.network.clone(),
                        pod: podref.clone(),
                    },
                    reason: Reason::SandboxGone,
                    deleted_at: None,
                    write: Default::default(),
                });
            }
        }
        if reqs.is_empty() {
            return if seen_entries == 0 {
                Outcome::NoAllocation
            } else {
                Outcome::Kept
            };
        }

        let results = self.writer.release(reqs.clone()).await;
        let mut released: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        let mut dry_run = 0;
        let mut error = None;
        for (req, result) in reqs.iter().zip(&results) {
            match result {
                Ok(ReleaseOutcome::Released) => released
                    .entry(req.judged.network.clone())
                    .or_default()
                    .push(req.judged.entry.ip),
                Ok(ReleaseOutcome::DryRun) => dry_run += 1,
                Ok(_) => {}
                Err(e) => error = Some(e.to_string()),
            }
        }
        for (network, ips) in &released {
            self.events
                .released_sandbox_gone(&podref, ips, network, &sb.id)
                .await;
        }
        let released_ips: BTreeSet<IpAddr> = released.values().flatten().copied().collect();
        for (ip, t) in reservations {
            if released_ips.contains(&ip) {
                self.delete_reservation(ip, t, &podref, &sb.id).await;
            }
        }
        match error {
            // Entries already written stay released; the retry finds only what is left.
            Some(e) => Outcome::Failed(e),
            None if dry_run > 0 => Outcome::DryRun(dry_run),
            None => Outcome::Released(released_ips.len()),
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
            Err(e) => return Err(failed(&format!("get NAD {network}"), e)),
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
            Err(e) => return Err(failed(&format!("get NodeSlicePool {name}"), e)),
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
    pub async fn gave_up(
        &self,
        sb: &DeadSandbox,
        pod: Option<(String, String, bool)>,
        cause: &str,
    ) {
        if let Some((namespace, name, _)) = pod {
            let pod = PodRef {
                namespace,
                name,
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
    use super::Outcome;

    #[test]
    fn every_outcome_label_is_listed() {
        let all = [
            Outcome::Released(1),
            Outcome::DryRun(1),
            Outcome::NoAllocation,
            Outcome::Kept,
            Outcome::PodGone,
            Outcome::Failed("x".into()),
        ];
        let labels: Vec<&str> = all.iter().map(Outcome::label).collect();
        assert_eq!(labels, Outcome::LABELS);
    }
}
