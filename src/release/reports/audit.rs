//! The audit trail: one structured log line per address released or fenced, with target
//! [`TARGET`], so that a log store answers "who had this IP and why was it freed" long after the
//! Events expired. Written beside the Events (`release::reports::events`), from the same outcomes: only
//! what was written is audited (no dry-run decisions, no failures).
//!
//! Fields (at the top level of a JSON log line): `action` (`released` or `fenced`), `pod`
//! (`namespace/name`), `uid`, `node` (when known), `pool`, `address`, `network`, `sandbox`,
//! `interface` (when recorded), `reason`, `evidence`.

use std::net::IpAddr;

use crate::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::rules::Reason;
use crate::rules::fence::{is_deleted_before_stopped, is_unseen_deletion};

/// The log target of audit lines (`RUST_LOG=ipreclaim::audit=info` keeps them alone).
pub const TARGET: &str = "ipreclaim::audit";

/// What was done to the address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Removed from its pool: free for the next pod.
    Released,
    /// Kept allocated for a deleted pod whose node may still run it.
    Fenced,
    /// Its release cooldown is over: back in the pool.
    CooldownEnded,
}

impl Action {
    /// The `action` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Released => "released",
            Action::Fenced => "fenced",
            Action::CooldownEnded => "cooldown_ended",
        }
    }
}

/// One audit line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    /// What was done.
    pub action: Action,
    /// The pod that held the address (`namespace/name`).
    pub pod: String,
    /// Its uid (empty when unknown: a pod that vanished while no replica ran).
    pub uid: String,
    /// Its node, when the decision knew it (fences; the node agent's releases).
    pub node: Option<String>,
    /// The pool's name.
    pub pool: String,
    /// The address.
    pub address: IpAddr,
    /// The network (`namespace/nad`) named in the Event.
    pub network: String,
    /// The sandbox (container) id recorded with the allocation.
    pub sandbox: String,
    /// The interface recorded with the allocation.
    pub interface: Option<String>,
    /// The reason code (as in Events and metrics).
    pub reason: &'static str,
    /// What the decision rested on, in words.
    pub evidence: String,
    /// When the cooldown the release started ends (`--release-cooldown`), or the one that ended.
    pub cooldown_until: Option<jiff::Timestamp>,
}

impl AuditRecord {
    /// The record of one request's outcome, if it wrote something: a release (also of a
    /// lifted fence) or a fence. `lifted` says why a fence lifted, when the caller knows;
    /// `node` is the node the caller runs for (the node agent's).
    pub fn of(
        req: &ReleaseRequest,
        outcome: &Result<ReleaseOutcome, ReleaseError>,
        lifted: Option<&str>,
        node: Option<&str>,
    ) -> Option<AuditRecord> {
        let j = &req.judged;
        let action = match outcome {
            Ok(ReleaseOutcome::Released) if req.write == EntryWrite::EndCooldown => {
                return Some(Self::cooldown_ended(req));
            }
            Ok(ReleaseOutcome::Released | ReleaseOutcome::Cooling(_)) => Action::Released,
            Ok(ReleaseOutcome::Fenced) => Action::Fenced,
            _ => return None,
        };
        let cooldown_until = outcome
            .as_ref()
            .ok()
            .and_then(ReleaseOutcome::cooling_until);
        let podref = j.pod.podref();
        let mut record = AuditRecord {
            action,
            pod: podref.clone(),
            uid: j.pod.uid.clone(),
            node: node.map(str::to_owned).or_else(|| j.node.clone()),
            pool: j.pool.clone(),
            address: j.entry.ip,
            network: j.network.clone(),
            sandbox: j.entry.id.clone(),
            interface: j.entry.ifname.as_deref().map(str::to_owned),
            reason: req.reason.as_str(),
            evidence: String::new(),
            cooldown_until,
        };
        record.evidence = match (&req.write, action) {
            (EntryWrite::Fence(f), _) => {
                record.node = Some(f.node.clone());
                if record.uid.is_empty() {
                    record.uid = f.uid.clone();
                }
                if is_deleted_before_stopped(&f.why) || is_unseen_deletion(&f.why) {
                    format!(
                        "the pod on node {} was {}; the address stays allocated until its \
                         sandboxes are gone or the node is trusted again",
                        f.node, f.why
                    )
                } else {
                    format!(
                        "the pod was deleted while its node {} was not Ready ({}); the address \
                         stays allocated until the node is trusted again",
                        f.node,
                        blank(&f.why)
                    )
                }
            }
            (EntryWrite::Unfence(f, _), _) => {
                record.node = Some(f.node.clone());
                record.pod = f.podref.clone();
                if record.uid.is_empty() {
                    record.uid = f.uid.clone();
                }
                format!(
                    "fence lifted ({}); fenced since {} because node {} was not Ready ({})",
                    lifted.unwrap_or("its node is trusted again, gone, or the fence timed out"),
                    f.since,
                    f.node,
                    blank(&f.why)
                )
            }
            (EntryWrite::Remove, _) => evidence(req.reason, &podref, &record),
            (EntryWrite::EndCooldown, _) => String::new(),
        };
        if let Some(until) = cooldown_until {
            record.evidence = format!(
                "{}; the address stays out of the pool until {until} (release cooldown)",
                record.evidence
            );
        }
        Some(record)
    }

    /// The record of a cooling entry removed: its cooldown is over.
    fn cooldown_ended(req: &ReleaseRequest) -> AuditRecord {
        let j = &req.judged;
        let until = crate::ipam::cooldown::cooldown_until(&j.entry.id).ok();
        let when = until.map_or_else(|| "its end".to_owned(), |u| u.to_string());
        AuditRecord {
            action: Action::CooldownEnded,
            pod: crate::ipam::cooldown::cooled_pod(&j.entry.podref).to_owned(),
            uid: j.pod.uid.clone(),
            node: None,
            pool: j.pool.clone(),
            address: j.entry.ip,
            network: j.network.clone(),
            sandbox: j.entry.id.clone(),
            interface: j.entry.ifname.as_deref().map(str::to_owned),
            reason: Reason::CooldownEnded.as_str(),
            evidence: format!(
                "the release cooldown until {when} is over; the address is back in the pool"
            ),
            cooldown_until: until,
        }
    }

    /// Writes the line (info level, target [`TARGET`]).
    pub fn emit(&self) {
        tracing::info!(
            target: "ipreclaim::audit",
            action = self.action.as_str(),
            pod = %self.pod,
            uid = %self.uid,
            node = self.node.as_deref(),
            pool = %self.pool,
            address = %self.address,
            network = %self.network,
            sandbox = %self.sandbox,
            interface = self.interface.as_deref(),
            reason = self.reason,
            evidence = %self.evidence,
            cooldown_until = self.cooldown_until.map(|t| t.to_string()),
            "{} {} of pod {}",
            self.action.as_str(),
            self.address,
            self.pod,
        );
    }
}

fn blank(s: &str) -> &str {
    if s.is_empty() { "unknown" } else { s }
}

fn evidence(reason: Reason, podref: &str, r: &AuditRecord) -> String {
    match reason {
        Reason::PodDeleted => format!("pod {podref} was deleted"),
        Reason::PodMissing => {
            format!("no pod named {podref} exists (checked again before the release)")
        }
        Reason::IPNotOnPod => format!(
            "the live pod {podref} does not list {} on network {} in its network-status",
            r.address, r.network
        ),
        Reason::PodTerminal => format!("pod {podref} has finished (Succeeded or Failed)"),
        Reason::SandboxGone => format!(
            "sandbox {} is gone from the node's container runtime while pod {podref} lives on",
            r.sandbox
        ),
        Reason::Forced => format!(
            "released with --force although pod {podref} lists {} on network {}",
            r.address, r.network
        ),
        Reason::CooldownEnded => "the release cooldown is over".to_owned(),
    }
}

/// Writes the audit lines of a batch's outcomes (see [`AuditRecord::of`]).
pub fn emit_all<'a>(
    results: impl IntoIterator<Item = (&'a ReleaseRequest, &'a Result<ReleaseOutcome, ReleaseError>)>,
    lifted: Option<&str>,
    node: Option<&str>,
) {
    for (req, outcome) in results {
        if let Some(record) = AuditRecord::of(req, outcome, lifted, node) {
            record.emit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::PoolEntry;
    use crate::ipam::fence::FenceRecord;
    use crate::release::{Judged, PodRef};
    use crate::rules::Decision;

    fn request(reason: Reason, write: EntryWrite) -> ReleaseRequest {
        ReleaseRequest {
            judged: Judged {
                pool: "192.0.2.0-24".into(),
                entry: PoolEntry {
                    key: "10".into(),
                    offset: 10,
                    ip: "192.0.2.10".parse().unwrap(),
                    id: "sb-web".into(),
                    podref: "ns/web-0".into(),
                    ifname: Some("net1".into()),
                },
                decision: Decision::Release(reason),
                network: "ns/macvlan".into(),
                pod: PodRef::from_podref("ns/web-0", "uid-1".into()),
                node: Some("node-a".into()),
            },
            reason,
            deleted_at: None,
            cooldown: None,
            write,
        }
    }

    fn record(
        reason: Reason,
        write: EntryWrite,
        outcome: Result<ReleaseOutcome, ReleaseError>,
    ) -> Option<AuditRecord> {
        AuditRecord::of(&request(reason, write), &outcome, None, None)
    }

    /// Asserts that `r`'s evidence says `part`, showing the evidence when it does not.
    #[track_caller]
    fn assert_evidence_has(r: &AuditRecord, part: &str) {
        assert!(r.evidence.contains(part), "{}", r.evidence);
    }

    fn fence() -> FenceRecord {
        FenceRecord {
            podref: "ns/web-0".into(),
            uid: "uid-1".into(),
            node: "node-a".into(),
            why: "Ready=Unknown".into(),
            network: "ns/macvlan".into(),
            since: "2025-01-01T00:00:00Z".parse().unwrap(),
            grace_seconds: None,
        }
    }

    #[test]
    fn only_writes_are_audited() {
        for outcome in [
            Ok(ReleaseOutcome::AlreadyGone),
            Ok(ReleaseOutcome::Changed),
            Ok(ReleaseOutcome::DryRun),
            Err(ReleaseError::Stopped),
        ] {
            assert_eq!(
                record(Reason::PodDeleted, EntryWrite::Remove, outcome.clone()),
                None,
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn a_release_names_the_pod_the_pool_the_address_and_why() {
        let r = record(
            Reason::IPNotOnPod,
            EntryWrite::Remove,
            Ok(ReleaseOutcome::Released),
        )
        .unwrap();
        assert_eq!(r.action, Action::Released);
        assert_eq!(
            (
                r.pod.as_str(),
                r.uid.as_str(),
                r.pool.as_str(),
                r.sandbox.as_str()
            ),
            ("ns/web-0", "uid-1", "192.0.2.0-24", "sb-web")
        );
        assert_eq!(r.address.to_string(), "192.0.2.10");
        assert_eq!(r.interface.as_deref(), Some("net1"));
        assert_eq!(r.reason, "IPNotOnPod");
        // The judgement's node, when the caller runs for none.
        assert_eq!(r.node.as_deref(), Some("node-a"));
        assert_evidence_has(&r, "does not list 192.0.2.10 on network ns/macvlan");
        let agent = AuditRecord::of(
            &request(Reason::SandboxGone, EntryWrite::Remove),
            &Ok(ReleaseOutcome::Released),
            None,
            Some("node-b"),
        )
        .unwrap();
        assert_eq!(agent.node.as_deref(), Some("node-b"));
        assert!(agent.evidence.contains("sandbox sb-web is gone"));
    }

    #[test]
    fn fences_and_lifted_fences_name_the_node_and_why() {
        let f = record(
            Reason::PodDeleted,
            EntryWrite::Fence(fence()),
            Ok(ReleaseOutcome::Fenced),
        )
        .unwrap();
        assert_eq!(f.action, Action::Fenced);
        assert_eq!(f.node.as_deref(), Some("node-a"));
        assert_evidence_has(&f, "node node-a was not Ready (Ready=Unknown)");
        let mut req = request(
            Reason::PodDeleted,
            EntryWrite::Unfence(fence(), crate::release::fixtures::fence_object()),
        );
        // A fenced entry's podref carries the mark; the record names the pod.
        req.judged.entry.podref = "ns/web-0:fenced".into();
        req.judged.pod.uid.clear();
        let lifted = AuditRecord::of(
            &req,
            &Ok(ReleaseOutcome::Released),
            Some("the node agent on its node saw the pod's sandboxes gone"),
            None,
        )
        .unwrap();
        assert_eq!(lifted.action, Action::Released);
        assert_eq!(
            (lifted.pod.as_str(), lifted.uid.as_str()),
            ("ns/web-0", "uid-1")
        );
        assert_eq!(lifted.node.as_deref(), Some("node-a"));
        assert!(
            lifted
                .evidence
                .starts_with("fence lifted (the node agent on its node saw"),
            "{}",
            lifted.evidence
        );
    }

    #[test]
    fn a_cooldown_is_in_the_release_line_and_its_end_has_a_line_of_its_own() {
        let until: jiff::Timestamp = "2026-11-25T10:00:31Z".parse().unwrap();
        let outcome = Ok(ReleaseOutcome::Cooling(until));
        let r = record(Reason::PodDeleted, EntryWrite::Remove, outcome).unwrap();
        assert_eq!(
            (r.action, r.cooldown_until),
            (Action::Released, Some(until))
        );
        assert!(
            r.evidence
                .ends_with("until 2026-11-25T10:00:31Z (release cooldown)")
        );
        let plain = record(
            Reason::PodDeleted,
            EntryWrite::Remove,
            Ok(ReleaseOutcome::Released),
        );
        assert_eq!(plain.unwrap().cooldown_until, None);
        let mut end = request(Reason::CooldownEnded, EntryWrite::EndCooldown);
        end.judged.entry.id = "ipreclaim-cooldown:2026-11-25T10:00:31Z".into();
        end.judged.entry.podref = "ns/web-0:cooldown".into();
        let e = AuditRecord::of(&end, &Ok(ReleaseOutcome::Released), None, None).unwrap();
        assert_eq!(e.action.as_str(), "cooldown_ended");
        assert_eq!((e.pod.as_str(), e.reason), ("ns/web-0", "CooldownEnded"));
        assert_eq!(e.cooldown_until, Some(until));
    }
}
