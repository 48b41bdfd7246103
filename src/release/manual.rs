//! What the manual commands (`ipreclaim unfence`, `ipreclaim release`) would write, planned
//! from an [`Index`] of the cluster built by the controller's own rules. Pure: the commands
//! hand the planned requests to a [`Writer`](super::Writer), which pins each entry by its id
//! and podref as it does for the controller.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use crate::api::ObjectId;
use crate::api::slim::{NodeReadyView, OUT_OF_SERVICE_TAINT};
use crate::index::{CoolingEntry, FencedEntry, Index, PodUid, UnrecordedMark};
use crate::ipam::fence::{FENCED_PODREF_SUFFIX, FenceRecord};
use crate::ipam::{NetworkAttachment, PodKey, PoolEntry};
use crate::rules::fence::{
    AgentReports, FencePolicy, agent_says, distrust, is_deleted_before_stopped, is_unseen_deletion,
};
use crate::rules::{
    Allocation, Decision, Judged, KeepReason, LivePod, PodKnowledge, PodPhase, PodRef, PoolContext,
    Reason, ReclaimConfig,
};

use super::types::{EntryWrite, ReleaseRequest};

/// Which fences `unfence` lifts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceSelect {
    /// The fences of one address (in any pool).
    Ip(IpAddr),
    /// The fences of pods deleted from one node.
    Node(String),
    /// Every fence (the uninstall path).
    All,
}

/// One planned write, the live pods whose network-status lists its address, and what the
/// controller's rules say of it (a write they list or the rules keep is refused unless forced).
#[derive(Debug, Clone)]
pub struct Planned {
    /// The request for the writer.
    pub request: ReleaseRequest,
    /// Live (not finished) pods listing the address, as `namespace/name`.
    pub listed_by: Vec<String>,
    /// Why the controller would keep it (`release`'s entries; `None` for lifts of fences, whose
    /// node is judged apart: [`node_holds`]).
    pub kept: Option<KeepReason>,
    /// A fence's: the node agent on its node reported the pod's sandboxes gone, and the report
    /// binds to this fence as the controller checks it (the controller lifts it then).
    pub sandboxes_gone: bool,
    /// A fence's: the node agent on its node still lists a sandbox of the pod (a valid report).
    pub sandboxes_present: bool,
}

impl Planned {
    fn new(request: ReleaseRequest, listed_by: Vec<String>) -> Planned {
        Planned {
            request,
            listed_by,
            kept: None,
            sandboxes_gone: false,
            sandboxes_present: false,
        }
    }
}

/// What a `Keep` of the controller's rules means for the pod of `podref`, as a refusal says it.
pub fn kept_because(why: KeepReason, podref: &str) -> String {
    match why {
        KeepReason::ListedOnPod => format!("live pod {podref} lists the address"),
        KeepReason::NoNetworkStatus => format!(
            "live pod {podref} has no network-status yet (its allocation may be in flight: \
             the controller keeps it)"
        ),
        KeepReason::NoInformationForNetwork => format!(
            "live pod {podref}'s network-status says nothing of this network (the controller \
             keeps it)"
        ),
        KeepReason::TerminalReleaseDisabled => {
            format!("pod {podref} finished and its release is turned off")
        }
        KeepReason::FencePending => "a fence record is written for it (the controller is \
             fencing it: `ipreclaim unfence` lifts it once fenced)"
            .to_string(),
    }
}

/// Live pods that have not finished whose network-status lists `ip` on a network that
/// allocates from `pool` (on any network when none is known to), as `namespace/name` (sorted).
pub fn listed_by(index: &Index, pool: &str, ip: IpAddr) -> Vec<String> {
    let networks = index.networks().of_pool(pool).filter(|n| !n.is_empty());
    let pods = index.pods();
    let mut out: Vec<String> = pods
        .live_pods()
        .into_iter()
        .filter_map(|PodUid { podref, .. }| {
            let live = pods.live(&podref)?;
            let lists = live.networks.as_ref().is_some_and(|n| {
                n.iter().any(|a| {
                    a.ips.contains(&ip)
                        && networks.is_none_or(|ns| ns.iter().any(|m| *m == *a.name))
                })
            });
            (lists && !live.terminal).then_some(podref)
        })
        .collect();
    out.sort();
    out
}

/// The network to name in Events for an entry of `pool`: the first NAD known to allocate
/// from it, else the pool's name.
fn network_of(index: &Index, pool: &str) -> String {
    index
        .networks()
        .of_pool(pool)
        .and_then(|n| n.first().cloned())
        .unwrap_or_else(|| pool.to_owned())
}

fn request(
    pool: &str,
    entry: &PoolEntry,
    network: String,
    pod: PodRef,
    reason: Reason,
    write: EntryWrite,
) -> ReleaseRequest {
    ReleaseRequest {
        judged: Judged {
            pool: pool.to_owned(),
            entry: entry.clone(),
            decision: Decision::Release(reason),
            network,
            pod,
            node: None,
        },
        reason,
        deleted_at: None,
        cooldown: None,
        write,
    }
}

/// The lift of a recorded fence, as the controller writes it.
fn lift(pool: &str, entry: &PoolEntry, record: &FenceRecord, object: ObjectId) -> ReleaseRequest {
    let network = record.network_or(pool);
    let pod = PodRef::from_podref(&record.podref, record.uid.clone());
    let write = EntryWrite::Unfence(record.clone(), object);
    request(pool, entry, network, pod, Reason::PodDeleted, write)
}

/// The fences `select` names, each as an `Unfence` request (the entry removed pinned by its id
/// and fenced podref, then its record deleted with its uid as precondition), sorted by pool
/// and address. With [`FenceSelect::Ip`] and [`FenceSelect::All`], entries marked fenced whose
/// record is nowhere (deleted by hand) come too, as plain removals of the marked entry.
pub fn fences(index: &Index, select: &FenceSelect) -> Vec<Planned> {
    let mut out: Vec<Planned> = index
        .fenced()
        .into_iter()
        .filter(|f| match select {
            FenceSelect::Ip(ip) => f.entry.ip == *ip,
            FenceSelect::Node(node) => f.record.node == *node,
            FenceSelect::All => true,
        })
        .map(|f| Planned {
            sandboxes_gone: agent_reports(&f).0,
            sandboxes_present: agent_reports(&f).1,
            ..Planned::new(
                lift(&f.pool, &f.entry, &f.record, f.object.clone()),
                listed_by(index, &f.pool, f.entry.ip),
            )
        })
        .collect();
    if !matches!(select, FenceSelect::Node(_)) {
        for UnrecordedMark {
            pool,
            key,
            podref: marked,
        } in index.unrecorded_marks()
        {
            let Some(entry) = index.pools().get(&pool).and_then(|p| p.marked.get(&key)) else {
                continue;
            };
            if matches!(select, FenceSelect::Ip(ip) if entry.ip != *ip) {
                continue;
            }
            let podref = marked.strip_suffix(FENCED_PODREF_SUFFIX).unwrap_or(&marked);
            let pod = PodRef::from_podref(podref, String::new());
            let network = network_of(index, &pool);
            out.push(Planned::new(
                request(
                    &pool,
                    entry,
                    network,
                    pod,
                    Reason::PodDeleted,
                    EntryWrite::Remove,
                ),
                listed_by(index, &pool, entry.ip),
            ));
        }
    }
    out.sort_by(|a, b| {
        let key = |p: &Planned| (p.request.judged.pool.clone(), p.request.judged.entry.ip);
        key(a).cmp(&key(b))
    });
    out
}

/// What `release` frees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseTarget {
    /// One address, in the pools of `network` (`namespace/nad`) when given.
    Ip {
        /// The address.
        ip: IpAddr,
        /// The NAD whose pools are meant.
        network: Option<String>,
    },
    /// Every allocation of one pod.
    Pod(PodKey),
}

/// Why `release` plans nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPlanned {
    /// No pool entry matches.
    #[error("no allocation of {0}")]
    Nothing(String),
    /// The address is allocated in several pools and no network says which.
    #[error("{ip} is allocated in several pools: {pools}; say which with --network NAMESPACE/NAD")]
    Ambiguous {
        /// The address.
        ip: IpAddr,
        /// The pools, each with the networks known to allocate from it.
        pools: String,
    },
    /// The address is held only by fences: `unfence` lifts them.
    #[error("{ip} is fenced ({pools}): lift the fence with `ipreclaim unfence --ip {ip}`")]
    Fenced {
        /// The address.
        ip: IpAddr,
        /// The pools that hold it fenced.
        pools: String,
    },
    /// The address was released and is in its release cooldown: it returns to the pool then.
    #[error(
        "{ip} is cooling ({pools}): released, and kept out of the pool until {until} \
         (--release-cooldown); --force ends the cooldown now"
    )]
    Cooling {
        /// The address.
        ip: IpAddr,
        /// The pools that hold it cooling.
        pools: String,
        /// When its cooldown ends (the latest, if in several pools), or why it cannot be read.
        until: String,
    },
    /// `--sandbox` pins a sandbox that holds none of what was asked for (any more).
    #[error(
        "{what} is held by sandbox {held} now, not {pinned} (--sandbox): it changed since you \
         looked; look again (ipreclaim scan -o wide)"
    )]
    OtherSandbox {
        /// The address or pod asked for.
        what: String,
        /// The sandbox pinned.
        pinned: String,
        /// The sandboxes that hold it now.
        held: String,
    },
}

/// The live pod of a podref as the controller's rules read it: from the listing, or from a
/// fresh read right before the write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodReading {
    /// Its uid.
    pub uid: String,
    /// Succeeded or Failed.
    pub terminal: bool,
    /// Its secondary networks; `None` when its network-status is missing or malformed.
    pub networks: Option<Vec<NetworkAttachment>>,
}

impl PodReading {
    /// The live pod of `podref` in the listing.
    pub fn listed(index: &Index, podref: &str) -> Option<PodReading> {
        index.pods().live(podref).map(|l| PodReading {
            uid: l.uid.to_string(),
            terminal: l.terminal,
            networks: l.networks.as_deref().map(<[NetworkAttachment]>::to_vec),
        })
    }

    /// A pod as read.
    pub fn of(pod: &crate::api::slim::PodView) -> PodReading {
        let networks =
            crate::ipam::network_status::network_status_of(pod.metadata.annotations.as_ref());
        PodReading {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            terminal: pod.is_terminal(),
            networks,
        }
    }
}

/// The controller's decision on `entry` of `pool` with `pod` the live pod of its podref (a
/// manual command knows of no deleted pod and no dead sandbox: one listing, no history).
fn decide_on(index: &Index, pool: &str, entry: &PoolEntry, pod: Option<&PodReading>) -> Decision {
    if index.pending_fence(pool, entry).is_some() {
        return Decision::Keep(KeepReason::FencePending);
    }
    let live = pod.map(|p| LivePod {
        uid: &p.uid,
        phase: if p.terminal {
            PodPhase::Succeeded
        } else {
            PodPhase::Running
        },
        networks: p.networks.as_deref(),
    });
    crate::rules::decide(
        &Allocation::from(entry),
        &PoolContext {
            networks: index.networks().of_pool(pool),
        },
        &PodKnowledge {
            live,
            ..Default::default()
        },
        &ReclaimConfig::default(),
    )
}

/// The reason code a manual release of `entry` carries and why the rules keep it, if they do:
/// what the controller's rules say of the pod named in it (the audit line and the Event also say
/// it was done by hand), or [`Reason::Forced`] for what the rules keep or a live pod lists
/// (written only with `--force`).
fn judged(
    index: &Index,
    pool: &str,
    entry: &PoolEntry,
    listed_by: &[String],
) -> (Reason, Option<KeepReason>) {
    let pod = PodReading::listed(index, &entry.podref);
    match decide_on(index, pool, entry, pod.as_ref()) {
        Decision::Keep(why) => (Reason::Forced, Some(why)),
        _ if !listed_by.is_empty() => (Reason::Forced, None),
        Decision::Release(r) | Decision::Candidate(r) => (r, None),
    }
}

/// Whether `sandbox` (the whole id, or 12 characters or more of its start, as `scan` shows
/// it) names the sandbox id `id`.
pub fn pins(sandbox: &str, id: &str) -> bool {
    id == sandbox || (sandbox.chars().count() >= 12 && id.starts_with(sandbox))
}

/// The removals `target` names (each pinned by its id and podref), sorted by pool and address,
/// or why there are none. A cooling address (`--release-cooldown`) is refused, or with `force`
/// its cooldown ends now. With `sandbox`, only entries held by that sandbox (see [`pins`]);
/// when the target is held by others only, that is refused.
pub fn releases(
    index: &Index,
    target: &ReleaseTarget,
    force: bool,
    sandbox: Option<&str>,
) -> Result<Vec<Planned>, NotPlanned> {
    let found = targeted(index, target);
    let planned = plan_releases(index, target, force, found)?;
    let Some(pin) = sandbox else {
        return Ok(planned);
    };
    let (pinned, others): (Vec<Planned>, Vec<Planned>) = planned
        .into_iter()
        .partition(|p| pins(pin, &p.request.judged.entry.id));
    if pinned.is_empty() {
        let held: BTreeSet<String> = others
            .iter()
            .map(|p| p.request.judged.entry.id.clone())
            .collect();
        let what = match target {
            ReleaseTarget::Ip { ip, .. } => ip.to_string(),
            ReleaseTarget::Pod(pod) => format!("pod {pod}"),
        };
        return Err(NotPlanned::OtherSandbox {
            what,
            pinned: pin.to_owned(),
            held: held.into_iter().collect::<Vec<_>>().join(", "),
        });
    }
    Ok(pinned)
}

fn plan_releases(
    index: &Index,
    target: &ReleaseTarget,
    force: bool,
    found: Vec<(String, PoolEntry)>,
) -> Result<Vec<Planned>, NotPlanned> {
    if let ReleaseTarget::Ip { ip, network } = target {
        match refuse_ip(index, &found, *ip, network.as_deref()) {
            Err(NotPlanned::Cooling { .. }) if force => {
                return Ok(end_cooldowns(index, *ip, network.as_deref()));
            }
            result => result?,
        }
    }
    if let (ReleaseTarget::Pod(podref), true) = (target, found.is_empty()) {
        return Err(NotPlanned::Nothing(format!("pod {podref}")));
    }
    Ok(found
        .into_iter()
        .map(|(pool, entry)| {
            let network = match target {
                ReleaseTarget::Ip {
                    network: Some(n), ..
                } => n.clone(),
                _ => network_of(index, &pool),
            };
            let uid = index
                .pods()
                .live(&entry.podref)
                .map(|l| l.uid.to_string())
                .unwrap_or_default();
            let pod = PodRef::from_podref(&entry.podref, uid);
            let listed_by = listed_by(index, &pool, entry.ip);
            let (reason, kept) = judged(index, &pool, &entry, &listed_by);
            Planned {
                kept,
                ..Planned::new(
                    request(&pool, &entry, network, pod, reason, EntryWrite::Remove),
                    listed_by,
                )
            }
        })
        .collect())
}

/// What a fresh read of the pod of `planned`'s entry (`fresh`: `None` when there is no such
/// pod now) shows changed since the listing, as a refusal says it: another pod (a new uid, or
/// one gone or come), or another decision of the controller's rules (its network-status now
/// lists the address, or is written now, or it finished). `None`: as listed.
pub fn changed_since_listing(
    index: &Index,
    planned: &Planned,
    fresh: Option<&PodReading>,
) -> Option<String> {
    let j = &planned.request.judged;
    let podref = &j.entry.podref;
    let listed = PodReading::listed(index, podref);
    let uid = |p: Option<&PodReading>| match p {
        Some(p) => format!("uid {}", p.uid),
        None => "no pod".to_string(),
    };
    if listed.as_ref().map(|p| &p.uid) != fresh.map(|p| &p.uid) {
        return Some(format!(
            "pod {podref} changed since the listing: {} now, {} then",
            uid(fresh),
            uid(listed.as_ref())
        ));
    }
    let then = decide_on(index, &j.pool, &j.entry, listed.as_ref());
    let now = decide_on(index, &j.pool, &j.entry, fresh);
    (then != now).then(|| {
        format!(
            "pod {podref} changed since the listing: the controller's rules say {} now, {} then",
            says(now),
            says(then)
        )
    })
}

/// A decision as a refusal says it.
fn says(d: Decision) -> String {
    match d {
        Decision::Keep(why) => format!("keep ({why:?})"),
        Decision::Candidate(r) | Decision::Release(r) => format!("release ({r})"),
    }
}

/// Whether the node agent's reports on a fence count, as the controller reads them: (gone,
/// still present).
fn agent_reports(f: &FencedEntry) -> (bool, bool) {
    let says = agent_says(f.identity(), &AgentReports::from(&f.evidence));
    (says.gone, says.present)
}

/// The command an operator runs to declare `node` powered off: the safe way to free what a
/// node that does not come back held (the kubelet there cannot run anything any more).
pub fn out_of_service_command(node: &str) -> String {
    format!("kubectl taint node {node} {OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute")
}

/// Why the lift of `planned` (a fence) by hand would free an address its node may still use,
/// as a refusal says it; `None` when the controller would lift it: its Node is gone (`node`
/// `None`), tainted out-of-service, Ready for at least `settle` (or the pod's grace plus the
/// margin) by its Ready condition's `lastTransitionTime` and since the fence's `since` at
/// `now`, or the node agent there reported the pod's sandboxes gone.
/// (The controller measures the settle on its own clock from when it saw the node Ready; a
/// command has only the node's word, so a node whose clock lags can look settled early:
/// Ready=True is the floor.) A mark with no record names no node: nothing to judge.
pub fn node_holds(
    planned: &Planned,
    node: Option<&NodeReadyView>,
    now: jiff::Timestamp,
    settle: Duration,
) -> Option<String> {
    let EntryWrite::Unfence(record, _) = &planned.request.write else {
        return None;
    };
    if record.node.is_empty() || planned.sandboxes_gone {
        return None;
    }
    let node = node?;
    let name = &record.node;
    if planned.sandboxes_present && !node.out_of_service {
        return Some(format!(
            "the node agent on {name} still lists a sandbox of pod {} (its kubelet is stopping it)",
            record.podref
        ));
    }
    let ready = node.ready.as_ref();
    let readiness = crate::rules::fence::NodeReadiness {
        status: ready.map_or_else(|| "missing".to_string(), |c| c.status.clone()),
        reason: ready.and_then(|c| c.reason.clone()),
        ready_seen: None,
        out_of_service: node.out_of_service,
        ready_again: None,
        ready_stamp: None,
    };
    if let Some(why) = distrust(Some(&readiness), std::time::Instant::now(), Duration::ZERO) {
        return Some(format!(
            "node {name} is {why}: it may still run pod {}'s sandbox",
            record.podref
        ));
    }
    if node.out_of_service {
        return None;
    }
    // A pod deleted before its kubelet stopped it, on a node Ready all along, is stopped by
    // that kubelet only from the fence on: counted from the later of the two, as the
    // controller counts. (A fence of a node not Ready then predates its Ready transition.)
    let stopping = is_deleted_before_stopped(&record.why) || is_unseen_deletion(&record.why);
    let since = ready
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| if stopping { t.0.max(record.since) } else { t.0 });
    let ready_for =
        since.map(|t| Duration::try_from(now.duration_since(t)).unwrap_or(Duration::ZERO));
    // As the controller waits: the pod's grace period plus the margin, when longer.
    let policy = FencePolicy {
        settle,
        timeout: None,
        grace_margin: crate::rules::fence::DEFAULT_GRACE_MARGIN,
    };
    let settle = policy.settle_for(record.grace());
    match ready_for {
        Some(d) if d >= settle => None,
        _ => Some(format!(
            "node {name} has been Ready{} for only {} (less than {}, the settle or the pod's \
             grace period plus margin): its kubelet may still be stopping pod {}",
            if stopping { ", and the fence set," } else { "" },
            ready_for.map_or_else(
                || "an unknown time".to_string(),
                |d| { humantime::format_duration(Duration::from_secs(d.as_secs())).to_string() }
            ),
            humantime::format_duration(settle),
            record.podref
        )),
    }
}

/// The entries `target` names, as (pool, entry), by pool and address.
fn targeted(index: &Index, target: &ReleaseTarget) -> Vec<(String, PoolEntry)> {
    let pools = index.pools();
    let mut found: Vec<(String, PoolEntry)> = match target {
        ReleaseTarget::Ip { ip, network } => pools
            .all()
            .values()
            .filter(|p| match network {
                Some(n) => index
                    .networks()
                    .of_pool(&p.name)
                    .is_some_and(|ns| ns.contains(n)),
                None => true,
            })
            .flat_map(|p| {
                p.entries
                    .values()
                    .filter(|e| e.ip == *ip)
                    .map(|e| (p.name.clone(), e.clone()))
            })
            .collect(),
        ReleaseTarget::Pod(pod) => pools
            .slots(&pod.podref())
            .filter_map(|(pool, key)| Some((pool.to_owned(), pools.entry(pool, key)?.clone())))
            .collect(),
    };
    found.sort_by(|a, b| (&a.0, a.1.ip).cmp(&(&b.0, b.1.ip)));
    found
}

/// Why an address (`ip`, on `network` if given) cannot be released as asked: it is in several
/// pools, fenced, or in none.
fn refuse_ip(
    index: &Index,
    found: &[(String, PoolEntry)],
    ip: IpAddr,
    network: Option<&str>,
) -> Result<(), NotPlanned> {
    let describe = |names: &BTreeSet<&str>| {
        names
            .iter()
            .map(|p| match index.networks().of_pool(p) {
                Some(n) if !n.is_empty() => format!("{p} (network {})", n.join(", ")),
                _ => format!("{p} (no known network)"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let names: BTreeSet<&str> = found.iter().map(|(p, _)| p.as_str()).collect();
    if names.len() > 1 {
        let pools = describe(&names);
        return Err(NotPlanned::Ambiguous { ip, pools });
    }
    if !found.is_empty() {
        return Ok(());
    }
    let fenced: BTreeSet<&str> = index
        .pools()
        .all()
        .values()
        .filter(|p| p.marked.values().any(|e| e.ip == ip))
        .map(|p| p.name.as_str())
        .collect();
    if !fenced.is_empty() {
        let pools = describe(&fenced);
        return Err(NotPlanned::Fenced { ip, pools });
    }
    let cooling = cooling_at(index, ip, network);
    if let Some(until) = cooling
        .iter()
        .map(|(_, c)| &c.until)
        .max_by_key(|u| u.as_ref().ok())
    {
        let names = cooling.iter().map(|(p, _)| p.as_str()).collect();
        let until = match until {
            Ok(t) => t.to_string(),
            Err(e) => e.to_string(),
        };
        let pools = describe(&names);
        return Err(NotPlanned::Cooling { ip, pools, until });
    }
    let what = match network {
        Some(n) => format!("{ip} in the pools of network {n}"),
        None => ip.to_string(),
    };
    Err(NotPlanned::Nothing(what))
}

/// The cooling entries of `ip` (in the pools of `network` when given), as (pool, entry).
fn cooling_at(index: &Index, ip: IpAddr, network: Option<&str>) -> Vec<(String, CoolingEntry)> {
    index
        .cooling()
        .into_iter()
        .filter(|(pool, c)| {
            c.entry.ip == ip
                && network.is_none_or(|n| {
                    index
                        .networks()
                        .of_pool(pool)
                        .is_some_and(|ns| ns.iter().any(|x| x == n))
                })
        })
        .collect()
}

/// The ends of the cooldowns of `ip` (`release --ip --force`), as the controller writes them.
fn end_cooldowns(index: &Index, ip: IpAddr, network: Option<&str>) -> Vec<Planned> {
    cooling_at(index, ip, network)
        .into_iter()
        .map(|(pool, c)| {
            let network = network.map_or_else(|| network_of(index, &pool), str::to_owned);
            let pod = PodRef::from_podref(&c.pod, String::new());
            let write = EntryWrite::EndCooldown;
            Planned::new(
                request(&pool, &c.entry, network, pod, Reason::CooldownEnded, write),
                listed_by(index, &pool, ip),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use super::*;
    use crate::index::{FenceObject, PodSeen};

    use ipreclaim_core::fixtures::pool_named as pool;

    fn record(podref: &str, node: &str) -> FenceRecord {
        FenceRecord {
            podref: podref.into(),
            uid: format!("uid-{podref}"),
            node: node.into(),
            why: "Ready=Unknown".into(),
            network: "ns/net".into(),
            since: "2025-01-01T00:00:00Z".parse().unwrap(),
            grace_seconds: None,
        }
    }

    fn object(name: &str, sandbox: &str, podref: &str, node: &str) -> FenceObject {
        FenceObject {
            name: name.into(),
            uid: format!("uid-{name}"),
            sandbox: sandbox.into(),
            record: record(podref, node),
            evidence: Default::default(),
        }
    }

    fn live(ix: &mut Index, podref: &str, ips: &[&str], terminal: bool) {
        let ips: Vec<String> = ips.iter().map(|i| format!("\"{i}\"")).collect();
        let annotations = BTreeMap::from([(
            crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(),
            format!(
                r#"[{{"name":"ns/net","interface":"net1","ips":[{}]}}]"#,
                ips.join(",")
            ),
        )]);
        let seen = PodSeen {
            annotations: Some(&annotations),
            node: Some("node-a"),
            terminal,
            mirror: false,
            grace_seconds: None,
        };
        ix.upsert_pod(podref, &format!("uid-{podref}"), seen, Instant::now());
    }

    /// Pool p: 10 and 11 fenced (node-a, node-b), 12 marked with no record, 20 of web-0 (live,
    /// lists .20 and .10), 30 of gone-0; pool q: 30 of other-0, 40 of done-0 (finished, lists
    /// .40).
    fn index() -> Index {
        let mut ix = Index::default();
        ix.upsert_pool(&pool(
            "p",
            &[
                ("10", "sb-a", "ns/a:fenced"),
                ("11", "sb-b", "ns/b:fenced"),
                ("12", "sb-c", "ns/c:fenced"),
                ("20", "sb-web", "ns/web-0"),
                ("30", "sb-gone", "ns/gone-0"),
            ],
        ));
        ix.upsert_pool(&pool(
            "q",
            &[("30", "sb-o", "ns/other-0"), ("40", "sb-d", "ns/done-0")],
        ));
        ix.set_pools_listed();
        ix.upsert_fence_object("p", "10", object("p-10", "sb-a", "ns/a", "node-a"));
        ix.upsert_fence_object("p", "11", object("p-11", "sb-b", "ns/b", "node-b"));
        live(&mut ix, "ns/web-0", &["192.0.2.20", "192.0.2.10"], false);
        live(&mut ix, "ns/done-0", &["192.0.2.40"], true);
        ix
    }

    fn releases_of(ix: &Index, target: &ReleaseTarget) -> Result<Vec<Planned>, NotPlanned> {
        releases(ix, target, false, None)
    }

    fn ips(planned: &[Planned]) -> Vec<String> {
        planned
            .iter()
            .map(|p| format!("{}/{}", p.request.judged.pool, p.request.judged.entry.ip))
            .collect()
    }

    #[test]
    fn fences_are_chosen_by_address_node_or_all_with_who_lists_them() {
        let ix = index();
        let ip = |s: &str| FenceSelect::Ip(s.parse().unwrap());
        let one = fences(&ix, &ip("192.0.2.10"));
        assert_eq!(ips(&one), ["p/192.0.2.10"]);
        assert_eq!(one[0].listed_by, ["ns/web-0"]);
        let EntryWrite::Unfence(r, ObjectId { name, uid }) = &one[0].request.write else {
            panic!("an unfence of the object: {:?}", one[0].request.write)
        };
        assert_eq!(
            (r.podref.as_str(), name.as_str(), uid.as_str()),
            ("ns/a", "p-10", "uid-p-10")
        );
        // Pinned on the entry as stored: its id and fenced podref.
        let e = &one[0].request.judged.entry;
        assert_eq!((e.id.as_str(), e.podref.as_str()), ("sb-a", "ns/a:fenced"));
        assert_eq!(one[0].request.judged.pod.podref(), "ns/a");
        assert_eq!(one[0].request.judged.network, "ns/net");

        let node = fences(&ix, &FenceSelect::Node("node-b".into()));
        assert_eq!(ips(&node), ["p/192.0.2.11"]);
        assert!(node[0].listed_by.is_empty());
        // A mark without a record: with --ip and --all, a plain removal of the marked entry.
        let all = fences(&ix, &FenceSelect::All);
        assert_eq!(ips(&all), ["p/192.0.2.10", "p/192.0.2.11", "p/192.0.2.12"]);
        assert_eq!(all[2].request.write, EntryWrite::Remove);
        assert_eq!(all[2].request.judged.entry.podref, "ns/c:fenced");
        assert_eq!(all[2].request.judged.pod.podref(), "ns/c");
        assert!(fences(&ix, &ip("192.0.2.20")).is_empty(), "not fenced");
    }

    #[test]
    fn releases_pin_each_entry_and_say_why_none_is_planned() {
        let ix = index();
        let at = |ip: &str, network: Option<&str>| ReleaseTarget::Ip {
            ip: ip.parse().unwrap(),
            network: network.map(str::to_owned),
        };
        let one = releases_of(&ix, &at("192.0.2.20", None)).unwrap();
        assert_eq!(ips(&one), ["p/192.0.2.20"]);
        assert_eq!(one[0].listed_by, ["ns/web-0"]);
        assert_eq!(one[0].request.write, EntryWrite::Remove);
        assert_eq!(one[0].request.judged.pod.uid, "uid-ns/web-0");
        // Listed by a live pod: written only with --force, and says so.
        assert_eq!(one[0].request.reason, Reason::Forced);
        // A finished pod's listing does not count.
        let done = releases_of(&ix, &at("192.0.2.40", None)).unwrap();
        assert!(done[0].listed_by.is_empty());
        assert_eq!(done[0].request.reason, Reason::PodTerminal);
        // In two pools: which one must be said.
        let err = releases_of(&ix, &at("192.0.2.30", None)).unwrap_err();
        assert!(
            matches!(&err, NotPlanned::Ambiguous { pools, .. } if pools.contains("p (") && pools.contains("q (")),
            "{err}"
        );
        let fenced = releases_of(&ix, &at("192.0.2.11", None)).unwrap_err();
        assert!(matches!(fenced, NotPlanned::Fenced { .. }), "{fenced}");
        assert!(matches!(
            releases_of(&ix, &at("192.0.2.99", None)),
            Err(NotPlanned::Nothing(_))
        ));
        let pod = releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "gone-0"))).unwrap();
        assert_eq!(ips(&pod), ["p/192.0.2.30"]);
        assert_eq!(pod[0].request.reason, Reason::PodMissing);
        assert!(matches!(
            releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "nobody"))),
            Err(NotPlanned::Nothing(_))
        ));
    }

    #[test]
    fn a_cooling_address_is_refused_and_force_ends_its_cooldown() {
        let mut ix = index();
        let marker = "ipreclaim-cooldown:2026-11-25T10:00:31Z";
        ix.upsert_pool(&pool("r", &[("50", marker, "ns/old-0:cooldown")]));
        let at = ReleaseTarget::Ip {
            ip: "192.0.2.50".parse().unwrap(),
            network: None,
        };
        let err = releases(&ix, &at, false, None).unwrap_err();
        let NotPlanned::Cooling { until, pools, .. } = &err else {
            panic!("cooling: {err}")
        };
        assert_eq!(until, "2026-11-25T10:00:31Z");
        assert!(pools.starts_with("r "), "{pools}");
        assert!(err.to_string().contains("--force"), "{err}");
        let forced = releases(&ix, &at, true, None).unwrap();
        assert_eq!(ips(&forced), ["r/192.0.2.50"]);
        let r = &forced[0].request;
        assert_eq!(r.write, EntryWrite::EndCooldown);
        // Pinned on the entry as stored; its reservation names the pod.
        assert_eq!(r.judged.entry.id, marker);
        assert_eq!(r.podref(), "ns/old-0");
        // Not a release of the pod's other addresses, nor a leak.
        assert!(releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "old-0"))).is_err());
    }

    #[test]
    fn what_the_controller_keeps_is_planned_as_kept_and_forced() {
        let mut ix = index();
        ix.upsert_pool(&pool("n", &[("7", "sb-new", "ns/new-0")]));
        let seen = PodSeen {
            annotations: None,
            node: Some("node-a"),
            terminal: false,
            mirror: false,
            grace_seconds: None,
        };
        ix.upsert_pod("ns/new-0", "uid-new", seen, Instant::now());
        let planned = releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "new-0"))).unwrap();
        assert_eq!(planned[0].kept, Some(KeepReason::NoNetworkStatus));
        assert!(planned[0].listed_by.is_empty());
        assert_eq!(planned[0].request.reason, Reason::Forced);
        let why = kept_because(KeepReason::NoNetworkStatus, "ns/new-0");
        assert!(
            why.contains("live pod ns/new-0 has no network-status yet"),
            "{why}"
        );
        // A missing pod's entry is the rules' candidate: not kept.
        let gone = releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "gone-0"))).unwrap();
        assert_eq!(gone[0].kept, None);
    }

    #[test]
    fn a_sandbox_pin_plans_only_the_entry_seen() {
        assert!(pins("sb-gone", "sb-gone"));
        assert!(!pins("sb-gon", "sb-gone"), "a short prefix is no pin");
        assert!(pins("0123456789ab", "0123456789abcdef"));
        assert!(!pins("0123456789ac", "0123456789abcdef"));
        let ix = index();
        let at = ReleaseTarget::Ip {
            ip: "192.0.2.20".parse().unwrap(),
            network: None,
        };
        let err = releases(&ix, &at, true, Some("sb-other")).unwrap_err();
        assert!(
            err.to_string()
                .contains("held by sandbox sb-web now, not sb-other (--sandbox)"),
            "{err}"
        );
        let ok = releases(&ix, &at, true, Some("sb-web")).unwrap();
        assert_eq!(ips(&ok), ["p/192.0.2.20"]);
    }

    fn look(uid: &str, ips: &[&str]) -> PodReading {
        PodReading {
            uid: uid.into(),
            terminal: false,
            networks: Some(vec![NetworkAttachment {
                name: "ns/net".into(),
                interface: Some("net1".into()),
                ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            }]),
        }
    }

    #[test]
    fn a_fresh_read_refuses_another_pod_or_another_decision() {
        let ix = index();
        let gone = &releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "gone-0"))).unwrap()[0];
        assert_eq!(
            changed_since_listing(&ix, gone, None),
            None,
            "still missing"
        );
        let came = changed_since_listing(&ix, gone, Some(&look("uid-new", &[]))).unwrap();
        assert!(came.contains("uid uid-new now, no pod then"), "{came}");
        // web-0 lists .20 and .10; .20 released with --force: the same pod and view go ahead.
        let web = &releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "web-0"))).unwrap()[0];
        let same = look("uid-ns/web-0", &["192.0.2.20", "192.0.2.10"]);
        assert_eq!(changed_since_listing(&ix, web, Some(&same)), None);
        let recreated = look("uid-2", &["192.0.2.20"]);
        assert!(changed_since_listing(&ix, web, Some(&recreated)).is_some());
        assert!(
            changed_since_listing(&ix, web, None).is_some(),
            "gone since"
        );
        // done-0 (finished) is the rules' candidate; running again is another decision.
        let done = &releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "done-0"))).unwrap()[0];
        let running = look("uid-ns/done-0", &["192.0.2.40"]);
        let why = changed_since_listing(&ix, done, Some(&running)).unwrap();
        assert!(why.contains("keep (ListedOnPod) now"), "{why}");
    }

    fn node_view(status: &str, ready_for: i64, out_of_service: bool) -> NodeReadyView {
        use k8s_openapi::api::core::v1::NodeCondition;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let at = jiff::Timestamp::from_second(1_800_000_000 - ready_for).unwrap();
        NodeReadyView {
            ready: Some(NodeCondition {
                type_: "Ready".into(),
                status: status.into(),
                reason: Some("KubeletReady".into()),
                last_transition_time: Some(Time(at)),
                ..Default::default()
            }),
            out_of_service,
            ..Default::default()
        }
    }

    #[test]
    fn a_fence_whose_node_may_still_run_the_pod_is_held() {
        let ix = index();
        let f = &fences(&ix, &FenceSelect::Node("node-b".into()))[0];
        let now = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        let settle = Duration::from_secs(30);
        let holds = |n: Option<&NodeReadyView>| node_holds(f, n, now, settle);
        let down = holds(Some(&node_view("Unknown", 0, false))).unwrap();
        assert!(
            down.contains("node node-b is Ready=Unknown (KubeletReady)"),
            "{down}"
        );
        let early = holds(Some(&node_view("True", 29, false))).unwrap();
        assert!(
            early.contains("Ready for only 29s (less than 45s, the settle"),
            "{early}"
        );
        // The record names no grace: the API's default 30 s, plus the 15 s margin.
        assert!(holds(Some(&node_view("True", 44, false))).is_some());
        assert_eq!(holds(Some(&node_view("True", 45, false))), None, "settled");
        assert_eq!(
            holds(Some(&node_view("False", 0, true))),
            None,
            "out-of-service"
        );
        assert_eq!(holds(None), None, "the Node is deleted");
        // A fence set 10 s ago on a node Ready all along (the pod was deleted before its
        // kubelet had stopped it): its kubelet stops it only from then on.
        let mut recent = f.clone();
        if let EntryWrite::Unfence(record, _) = &mut recent.request.write {
            record.since = jiff::Timestamp::from_second(1_800_000_000 - 10).unwrap();
            record.why =
                crate::rules::fence::deleted_before_stopped(false, false, Some(0)).unwrap();
        }
        let young = node_holds(&recent, Some(&node_view("True", 600, false)), now, settle);
        assert!(
            young.as_deref().is_some_and(|y| y.contains("for only 10s")),
            "{young:?}"
        );
        let reported = Planned {
            sandboxes_gone: true,
            ..f.clone()
        };
        let gone = node_holds(
            &reported,
            Some(&node_view("Unknown", 0, false)),
            now,
            settle,
        );
        assert_eq!(gone, None, "the node agent saw the sandboxes gone");
        let present = Planned {
            sandboxes_present: true,
            ..f.clone()
        };
        let settled = node_view("True", 600, false);
        let still = node_holds(&present, Some(&settled), now, settle).unwrap();
        assert!(still.contains("still lists a sandbox"), "{still}");
        assert_eq!(
            node_holds(&present, Some(&node_view("True", 0, true)), now, settle),
            None,
            "out-of-service"
        );
        assert_eq!(
            out_of_service_command("node-b"),
            "kubectl taint node node-b node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"
        );
    }
}
