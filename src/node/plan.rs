//! The node agent's release plan, pure: which of a dead sandbox's pool entries go, given the
//! pod as the API has it now, and what the writer's answers come to.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::ipam::{
    NETWORK_STATUS_ANNOTATION, NETWORKS_ANNOTATION, NetworkAttachment, PoolEntry,
    parse_network_status, parse_networks,
};
use crate::release::{ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::rules::{
    self, Allocation, Decision, Judged, LivePod, PodKnowledge, PodRef, PoolContext, Reason,
    ReclaimConfig,
};

/// A pool to look in, for one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTarget {
    /// The pool.
    pub pool: String,
    /// The network (`ns/nad`) that allocates from it.
    pub network: String,
    /// Its `network_name`, which prefixes its reservations' names.
    pub network_name: Option<String>,
    /// The network keeps reservations (not a node-slice network's own pools).
    pub reservations: bool,
}

/// A pod's secondary networks: what its network-status lists (`None`: missing or malformed,
/// with the error), and every network it asks for or lists (`ns/nad`).
#[derive(Debug, Default)]
pub struct PodNetworks {
    /// Its network-status.
    pub attached: Option<Vec<NetworkAttachment>>,
    /// Every network it asks for (networks annotation) or lists.
    pub names: BTreeSet<String>,
    /// Why an annotation, present, was ignored.
    pub ignored: Vec<String>,
}

/// Reads a pod's network annotations (a malformed one is ignored and said why).
pub fn pod_networks(annotations: &BTreeMap<String, String>, namespace: &str) -> PodNetworks {
    let mut out = PodNetworks::default();
    if let Some(a) = annotations.get(NETWORK_STATUS_ANNOTATION) {
        match parse_network_status(a) {
            Ok(n) => out.attached = Some(n),
            Err(e) => out.ignored.push(format!("network-status: {e}")),
        }
    }
    if let Some(a) = annotations.get(NETWORKS_ANNOTATION) {
        match parse_networks(a, namespace) {
            Ok(n) => out.names.extend(n),
            Err(e) => out.ignored.push(format!("networks annotation: {e}")),
        }
    }
    let listed = out.attached.iter().flatten().map(|n| n.name.to_string());
    out.names.extend(listed);
    out
}

/// What the plan for one pool comes to.
#[derive(Debug, Default)]
pub struct PoolPlan {
    /// Releases to hand to the writer.
    pub releases: Vec<ReleaseRequest>,
    /// Entries of the dead sandbox the decision keeps, with the decision.
    pub kept: Vec<(PoolEntry, Decision)>,
}

/// The releases of the dead sandbox `sandbox`'s entries in `target`'s pool: each judged with
/// the pod as it lives now and the sandbox dead; only `SandboxGone` is released.
pub fn plan_pool(
    sandbox: &str,
    pod: &PodRef,
    live: LivePod<'_>,
    target: &PoolTarget,
    entries: Vec<PoolEntry>,
    config: &ReclaimConfig,
) -> PoolPlan {
    let mut plan = PoolPlan::default();
    let networks = [target.network.clone()];
    let dead = [sandbox.to_owned()];
    for entry in entries.into_iter().filter(|e| e.id == sandbox) {
        let decision = rules::decide(
            &Allocation::from(&entry),
            &PoolContext {
                networks: Some(&networks),
            },
            &PodKnowledge {
                live: Some(live),
                deleted: &[],
                dead_sandboxes: &dead,
            },
            config,
        );
        if decision != Decision::Release(Reason::SandboxGone) {
            plan.kept.push((entry, decision));
            continue;
        }
        plan.releases.push(ReleaseRequest {
            judged: Judged {
                pool: target.pool.clone(),
                entry,
                decision,
                network: target.network.clone(),
                pod: pod.clone(),
                node: None,
            },
            reason: Reason::SandboxGone,
            deleted_at: None,
            cooldown: None,
            write: Default::default(),
        });
    }
    plan
}

/// What the writer's answers come to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Addresses released, by network.
    pub released: BTreeMap<String, Vec<IpAddr>>,
    /// Of those, the ones released into a cooldown, with its end: their reservations stay
    /// (the controller deletes them when the cooldown ends).
    pub cooling: BTreeMap<IpAddr, jiff::Timestamp>,
    /// Releases `--dry-run` only reported.
    pub dry_run: usize,
    /// The last failure, if any (what was written stays written; a retry finds the rest).
    pub error: Option<ReleaseError>,
}

impl Written {
    /// Tallies the writer's answers to `reqs`.
    pub fn tally(
        reqs: &[ReleaseRequest],
        results: &[Result<ReleaseOutcome, ReleaseError>],
    ) -> Written {
        let mut out = Written::default();
        for (req, result) in reqs.iter().zip(results) {
            match result {
                Ok(o @ (ReleaseOutcome::Released | ReleaseOutcome::Cooling(_))) => {
                    let ip = req.judged.entry.ip;
                    if let Some(until) = o.cooling_until() {
                        out.cooling.insert(ip, until);
                    }
                    let network = req.judged.network.clone();
                    out.released.entry(network).or_default().push(ip);
                }
                Ok(ReleaseOutcome::DryRun) => out.dry_run += 1,
                Ok(_) => {}
                Err(e) => out.error = Some(e.clone()),
            }
        }
        out
    }

    /// Every address released.
    pub fn addresses(&self) -> BTreeSet<IpAddr> {
        self.released.values().flatten().copied().collect()
    }

    /// The addresses released and removed (not cooling): their reservations go now.
    pub fn removed(&self) -> BTreeSet<IpAddr> {
        let mut out = self.addresses();
        out.retain(|ip| !self.cooling.contains_key(ip));
        out
    }

    /// When the cooldown of `ips` ends, if they went into one (the latest of them).
    pub fn cooling_until(&self, ips: &[IpAddr]) -> Option<jiff::Timestamp> {
        ips.iter()
            .filter_map(|ip| self.cooling.get(ip))
            .max()
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{KeepReason, PodPhase};

    fn entry(key: &str, id: &str, ifname: &str) -> PoolEntry {
        PoolEntry {
            key: key.into(),
            offset: key.parse().unwrap(),
            ip: format!("192.0.2.{key}").parse().unwrap(),
            id: id.into(),
            podref: "ns/web-0".into(),
            ifname: Some(ifname.into()),
        }
    }

    /// The plan for `sandbox`'s entries among `entries` of pod `ns/web-0` living as `live`.
    /// The plan of a running pod listing no network, with entries 5 (net1) and 6 (net2) of its
    /// sandbox `sb`: both released.
    fn two_releases() -> PoolPlan {
        let live = LivePod {
            uid: "u",
            phase: PodPhase::Running,
            networks: Some(&[]),
        };
        let entries = vec![entry("5", "sb", "net1"), entry("6", "sb", "net2")];
        plan_for("sb", live, entries)
    }

    fn plan_for(sandbox: &str, live: LivePod<'_>, entries: Vec<PoolEntry>) -> PoolPlan {
        let pod = PodRef::from_podref("ns/web-0", "u".into());
        plan_pool(
            sandbox,
            &pod,
            live,
            &target(),
            entries,
            &ReclaimConfig::default(),
        )
    }

    fn target() -> PoolTarget {
        PoolTarget {
            pool: "192.0.2.0-24".into(),
            network: "ns/net".into(),
            network_name: None,
            reservations: true,
        }
    }

    #[test]
    fn only_the_dead_sandboxs_entries_the_pod_no_longer_lists_are_released() {
        let annotations = BTreeMap::from([(
            NETWORK_STATUS_ANNOTATION.to_string(),
            r#"[{"name":"ns/net","interface":"net1","ips":["192.0.2.7"]}]"#.to_string(),
        )]);
        let networks = pod_networks(&annotations, "ns");
        assert_eq!(networks.names, BTreeSet::from(["ns/net".to_string()]));
        let live = LivePod {
            uid: "u",
            phase: PodPhase::Running,
            networks: networks.attached.as_deref(),
        };
        let entries = vec![
            // The old sandbox's address: the pod lists another now.
            entry("5", "sb-old", "net1"),
            // The new sandbox's: not this plan's.
            entry("7", "sb-new", "net1"),
        ];
        let plan = plan_for("sb-old", live, entries);
        let keys: Vec<&str> = plan
            .releases
            .iter()
            .map(|r| r.judged.entry.key.as_str())
            .collect();
        assert_eq!(keys, ["5"]);
        assert!(plan.kept.is_empty());

        // The pod still lists the dead sandbox's address (the annotation lags): kept.
        let plan = plan_for("sb-old", live, vec![entry("7", "sb-old", "net1")]);
        assert!(plan.releases.is_empty());
        assert_eq!(plan.kept[0].1, Decision::Keep(KeepReason::ListedOnPod));
    }

    #[test]
    fn malformed_annotations_are_ignored_and_said_why() {
        let annotations = BTreeMap::from([
            (
                NETWORK_STATUS_ANNOTATION.to_string(),
                "not json".to_string(),
            ),
            (
                NETWORKS_ANNOTATION.to_string(),
                "net-a, other/net-b".to_string(),
            ),
        ]);
        let n = pod_networks(&annotations, "ns");
        assert!(n.attached.is_none());
        assert_eq!(n.ignored.len(), 1, "{:?}", n.ignored);
        assert_eq!(
            n.names,
            BTreeSet::from(["ns/net-a".to_string(), "other/net-b".to_string()])
        );
    }

    #[test]
    fn the_writers_answers_are_tallied_by_network_and_a_failure_is_kept() {
        let plan = two_releases();
        assert_eq!(plan.releases.len(), 2);
        let answers = [
            Ok(ReleaseOutcome::Released),
            Err(ReleaseError::Conflict { pool: "p".into() }),
        ];
        let w = Written::tally(&plan.releases, &answers);
        assert_eq!(
            w.addresses(),
            BTreeSet::from(["192.0.2.5".parse().unwrap()])
        );
        assert!(w.error.is_some());
        assert_eq!(w.dry_run, 0);
    }

    /// The node agent's releases go through the writer, which cools them under
    /// `--release-cooldown` (see `release::pools::cooling`): a cooled address is released (Event,
    /// count) but its reservation is not deleted.
    #[test]
    fn a_release_into_cooldown_counts_as_released_and_keeps_its_reservation() {
        let mut plan = two_releases();
        let now: jiff::Timestamp = "2026-11-25T10:00:00Z".parse().unwrap();
        crate::release::types::set_cooldowns(
            &mut plan.releases,
            std::time::Duration::from_secs(30),
            now,
        );
        let until: jiff::Timestamp = "2026-11-25T10:00:30Z".parse().unwrap();
        assert!(plan.releases.iter().all(|r| r.cooldown == Some(until)));
        let patch = crate::release::pools::patch::entries_patch(&[&plan.releases[0]], false, "sig");
        assert_eq!(patch[2]["value"], "ipreclaim-cooldown:2026-11-25T10:00:30Z");
        assert_eq!(patch[3]["value"], "ns/web-0:cooldown");
        let answers = [
            Ok(ReleaseOutcome::Cooling(until)),
            Ok(ReleaseOutcome::Released),
        ];
        let w = Written::tally(&plan.releases, &answers);
        assert_eq!(w.addresses().len(), 2);
        let five: IpAddr = "192.0.2.5".parse().unwrap();
        let six: IpAddr = "192.0.2.6".parse().unwrap();
        assert_eq!(w.removed(), BTreeSet::from([six]));
        assert_eq!(w.cooling_until(&[five, six]), Some(until));
        assert_eq!(w.cooling_until(&[six]), None);
    }
}
