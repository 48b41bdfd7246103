//! The decision, pure: is this allocation garbage, and why. Shared by the controller's
//! deletion path and sweep, the node agent and `scan`.
//!
//! Safety comes first: an address listed in a live pod's network-status is never released
//! (a terminal pod's is at most a candidate), and a live pod without network-status keeps every
//! allocation (the allocation may simply be ahead of the annotation).
//!
//! Also the sweep's grace clock and blast-radius breaker, and when a cooling entry may end.
//! Pure; imports `api` and `ipam`; imported by `index`, `release` and the programs.

pub mod approvals;
pub mod breaker;
pub mod cooldown;
pub mod fence;
pub mod grace;
mod judged;
pub mod other_writers;

pub use judged::{Judged, PodRef};

use std::net::IpAddr;

use crate::ipam::NetworkAttachment;

/// Why an allocation is garbage. The names are the reason codes in Events, metrics and `scan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// A deleted pod (tombstone) held it.
    PodDeleted,
    /// No pod of that podref exists.
    PodMissing,
    /// The live pod of that podref lists other addresses on that network.
    IPNotOnPod,
    /// The pod finished (Succeeded or Failed).
    PodTerminal,
    /// The sandbox that held it is gone while the pod lives on (node agent).
    SandboxGone,
    /// Released by hand with `--force` although a live pod lists it (never decided by the
    /// rules).
    Forced,
    /// The end of a release cooldown: the entry was released (under its own reason) when the
    /// cooldown began; removing it only returns the address. Never counted as a release.
    CooldownEnded,
}

impl Reason {
    /// The reason code.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PodDeleted => "PodDeleted",
            Reason::PodMissing => "PodMissing",
            Reason::IPNotOnPod => "IPNotOnPod",
            Reason::PodTerminal => "PodTerminal",
            Reason::SandboxGone => "SandboxGone",
            Reason::Forced => "Forced",
            Reason::CooldownEnded => "CooldownEnded",
        }
    }

    /// Every reason a release is counted under, for metrics (not [`Reason::CooldownEnded`]).
    pub const ALL: [Reason; 6] = [
        Reason::PodDeleted,
        Reason::PodMissing,
        Reason::IPNotOnPod,
        Reason::PodTerminal,
        Reason::SandboxGone,
        Reason::Forced,
    ];
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an allocation is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeepReason {
    /// The live pod's network-status lists the address.
    ListedOnPod,
    /// The live pod has no (readable) network-status yet.
    NoNetworkStatus,
    /// The live pod's network-status says nothing about this pool's network.
    NoInformationForNetwork,
    /// The pod is terminal but releasing terminal pods is turned off.
    TerminalReleaseDisabled,
    /// A fence's record is written for it (its entry is about to be marked, or a crash came
    /// between the two writes): the fence's, not the sweep's.
    FencePending,
}

/// What to do with an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Leave it.
    Keep(KeepReason),
    /// Garbage by the sweep's evidence: release only after the grace period and a fresh look.
    Candidate(Reason),
    /// Garbage by direct evidence (a deletion, a dead sandbox): release now.
    Release(Reason),
}

/// One pool entry being judged.
#[derive(Debug, Clone, Copy)]
pub struct Allocation<'a> {
    /// Its address.
    pub ip: IpAddr,
    /// The sandbox id recorded with it.
    pub sandbox_id: &'a str,
    /// `namespace/name` recorded with it.
    pub podref: &'a str,
    /// The interface recorded with it.
    pub ifname: Option<&'a str>,
}

impl<'a> From<&'a crate::ipam::PoolEntry> for Allocation<'a> {
    fn from(entry: &'a crate::ipam::PoolEntry) -> Self {
        Allocation {
            ip: entry.ip,
            sandbox_id: &entry.id,
            podref: &entry.podref,
            ifname: entry.ifname.as_deref(),
        }
    }
}

/// A pod's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PodPhase {
    /// Not yet running.
    Pending,
    /// Running.
    Running,
    /// Finished successfully: never runs again.
    Succeeded,
    /// Finished with a failure: never runs again.
    Failed,
    /// Unknown (node unreachable).
    Unknown,
}

impl PodPhase {
    /// From the `status.phase` string; anything unrecognised is `Unknown`.
    pub fn parse(phase: Option<&str>) -> PodPhase {
        match phase {
            Some("Pending") => PodPhase::Pending,
            Some("Running") => PodPhase::Running,
            Some("Succeeded") => PodPhase::Succeeded,
            Some("Failed") => PodPhase::Failed,
            _ => PodPhase::Unknown,
        }
    }

    /// Succeeded or Failed.
    pub fn is_terminal(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// The live pod of a podref, as far as it matters here.
#[derive(Debug, Clone, Copy)]
pub struct LivePod<'a> {
    /// Its uid.
    pub uid: &'a str,
    /// Its phase.
    pub phase: PodPhase,
    /// Its secondary networks from network-status; `None` when missing or malformed.
    pub networks: Option<&'a [NetworkAttachment]>,
}

/// A deleted pod of a podref (a tombstone from the deletion path).
#[derive(Debug, Clone, Copy)]
pub struct DeletedPod<'a> {
    /// Its uid.
    pub uid: &'a str,
    /// Its secondary networks from network-status; `None` when it had none.
    pub networks: Option<&'a [NetworkAttachment]>,
    /// When its deletion was seen, this entry's slot (pool and key) held another sandbox: the
    /// entry is a newer allocation, not this pod's. (A slot not known then counts as its.)
    pub entry_replaced: bool,
}

/// Everything known about the pods of an allocation's podref.
#[derive(Debug, Clone, Copy, Default)]
pub struct PodKnowledge<'a> {
    /// The pod of that podref that exists now, if any.
    pub live: Option<LivePod<'a>>,
    /// Deleted pods of that podref not yet fully reclaimed.
    pub deleted: &'a [DeletedPod<'a>],
    /// Sandbox ids the node agent saw die (after its grace) for the live pod.
    pub dead_sandboxes: &'a [String],
}

/// The pool an allocation is in.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolContext<'a> {
    /// The networks (`namespace/nad-name`) whose IPAM config allocates from this pool;
    /// `None` when unknown (e.g. the NAD was deleted or could not be parsed).
    pub networks: Option<&'a [String]>,
}

/// Configuration of the decision.
#[derive(Debug, Clone, Copy)]
pub struct ReclaimConfig {
    /// Release the addresses of Succeeded/Failed pods (default on).
    pub release_terminal_pods: bool,
}

impl Default for ReclaimConfig {
    fn default() -> Self {
        ReclaimConfig {
            release_terminal_pods: true,
        }
    }
}

fn lists(networks: &[NetworkAttachment], ip: IpAddr) -> bool {
    networks.iter().any(|n| n.ips.contains(&ip))
}

/// Whether the pod's network-status has an entry for the network this allocation belongs to:
/// by the pool's known networks, or else by the allocation's interface name.
fn describes_network(
    networks: &[NetworkAttachment],
    alloc: &Allocation<'_>,
    pool: &PoolContext<'_>,
) -> bool {
    networks.iter().any(|n| {
        pool.networks
            .is_some_and(|names| names.iter().any(|m| *m == *n.name))
            || alloc
                .ifname
                .is_some_and(|i| n.interface.as_deref() == Some(i))
    })
}

/// Decides what to do with one allocation.
pub fn decide(
    alloc: &Allocation<'_>,
    pool: &PoolContext<'_>,
    pods: &PodKnowledge<'_>,
    config: &ReclaimConfig,
) -> Decision {
    let Some(live) = pods.live else {
        // No pod of this podref lives: a tombstone that listed the address (or that had no
        // network-status at all) proves it was the deleted pod's.
        let proven = pods
            .deleted
            .iter()
            .any(|d| d.networks.is_none_or(|nets| lists(nets, alloc.ip)));
        return if proven {
            Decision::Release(Reason::PodDeleted)
        } else {
            Decision::Candidate(Reason::PodMissing)
        };
    };
    if live.phase.is_terminal() {
        return if config.release_terminal_pods {
            Decision::Candidate(Reason::PodTerminal)
        } else {
            Decision::Keep(KeepReason::TerminalReleaseDisabled)
        };
    }
    if live.networks.is_some_and(|nets| lists(nets, alloc.ip)) {
        return Decision::Keep(KeepReason::ListedOnPod);
    }
    // The sandbox that holds it is gone: not an allocation racing its annotation.
    if pods.dead_sandboxes.iter().any(|s| s == alloc.sandbox_id) {
        return Decision::Release(Reason::SandboxGone);
    }
    let Some(networks) = live.networks else {
        return Decision::Keep(KeepReason::NoNetworkStatus);
    };
    // A recreated pod (same podref, new uid): what an older pod listed is the older pod's,
    // unless the entry was allocated again since that pod was deleted (then it is the new
    // pod's, for a sandbox its network-status does not show yet).
    let deleted_listed = pods
        .deleted
        .iter()
        .filter(|d| d.uid != live.uid && !d.entry_replaced)
        .any(|d| d.networks.is_some_and(|nets| lists(nets, alloc.ip)));
    if deleted_listed {
        return Decision::Release(Reason::PodDeleted);
    }
    if describes_network(networks, alloc, pool) {
        return Decision::Candidate(Reason::IPNotOnPod);
    }
    Decision::Keep(KeepReason::NoInformationForNetwork)
}

#[cfg(test)]
mod tests;
