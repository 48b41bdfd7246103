//! Fencing, pure: whether a deleted pod's addresses must stay allocated because its node may
//! still run the sandbox, and when that fence lifts. Time is passed in.
//!
//! The settle is measured on the controller's own monotonic clock, from when it observed the
//! node Ready, never from the node's `lastTransitionTime`: a node whose clock lags reports a
//! transition in the past, and its fences would lift at once.

use std::time::{Duration, Instant};

use jiff::Timestamp;

/// A node's Ready condition, as far as fencing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReadiness {
    /// `status` of the Ready condition: `True`, `False`, `Unknown`, or `missing`.
    pub status: String,
    /// Its `reason`, if any.
    pub reason: Option<String>,
    /// When this controller observed the node Ready (its own monotonic clock; `None` while
    /// not Ready). A restart observes it anew, so a restart never shortens the settle.
    pub ready_seen: Option<Instant>,
    /// Tainted `node.kubernetes.io/out-of-service`: its operator declared it powered off.
    pub out_of_service: bool,
    /// When this process saw it Ready again after seeing it not Ready (`None`: Ready since
    /// first seen, or not Ready): for a while after, its kubelet may still be stopping pods
    /// deleted while it was away, so a deletion seen then counts as one from a node not Ready.
    pub ready_again: Option<Instant>,
    /// The Ready condition's `lastTransitionTime` when last seen Ready (the node's clock, so
    /// only ever compared for a change): one that changed between two Ready sightings went
    /// through a NotReady the watch never delivered.
    pub ready_stamp: Option<jiff::Timestamp>,
}

impl NodeReadiness {
    /// Ready is True.
    pub fn is_ready(&self) -> bool {
        self.status == "True"
    }
}

/// Why a pod deleted at `now`, on `node`, must be fenced; `None` when its node is trusted to
/// kill the sandbox (Ready for longer than `window` since it was seen Ready again: the settle,
/// or the pod's grace period plus the margin) or is gone (a deleted Node is declared dead).
pub fn distrust(node: Option<&NodeReadiness>, now: Instant, window: Duration) -> Option<String> {
    let node = node?;
    // Declared powered off by its operator: nothing runs there any more.
    if node.out_of_service {
        return None;
    }
    if node.is_ready() {
        // Back from NotReady moments ago: a deletion seen now may be one made while it was
        // away (a re-list after a gap), and its kubelet may still be stopping the pod.
        let again = node.ready_again?;
        // A window past the clock's range (a tenant's grace of i64::MAX seconds) never ends.
        let left = match again.checked_add(window) {
            Some(until) if until <= now => return None,
            Some(until) => until.saturating_duration_since(now).as_secs().max(1),
            None => u64::MAX,
        };
        return Some(format!(
            "Ready=True again, settling for {left}s more: it may still be stopping pods deleted while it was away"
        ));
    }
    Some(match &node.reason {
        Some(reason) => format!("Ready={} ({reason})", node.status),
        None => format!("Ready={}", node.status),
    })
}

/// How a fence's `why` begins when the pod was deleted before its kubelet had stopped it.
pub const DELETED_BEFORE_STOPPED: &str = "deleted before its kubelet had stopped it";

/// Whether a fence's `why` says its pod was deleted before its kubelet had stopped it (see
/// [`deleted_before_stopped`]), not while its node was untrusted.
pub fn is_deleted_before_stopped(why: &str) -> bool {
    why.starts_with(DELETED_BEFORE_STOPPED)
}

/// How a fence's `why` begins when no replica saw its pod's deletion and a node agent's
/// inventory placed the sandbox (see `controller::unseen`).
pub const UNSEEN_DELETION: &str = "deleted while no controller replica watched";

/// Why a pod no replica saw deleted is fenced to `node`: its agent listed the sandbox live in
/// the inventory it wrote at `written`.
pub fn unseen_deletion(node: &str, written: &str) -> String {
    format!(
        "{UNSEEN_DELETION}, and the node agent of {node} last listed its sandbox live (inventory written {written}): it may still run there"
    )
}

/// Whether a fence's `why` says no replica saw its pod's deletion.
pub fn is_unseen_deletion(why: &str) -> bool {
    why.starts_with(UNSEEN_DELETION)
}

/// Why a pod deleted from a node trusted to stop it must still be fenced: its final state was
/// not Succeeded or Failed. A kubelet (1.27 and later) gives a pod a terminal phase once its
/// containers have stopped and deletes it only after its sandbox is stopped (the CNI DEL), so
/// a pod deleted without one was deleted by force, and its kubelet stops it only now, taking
/// up to its termination grace period (`None`: the API's default). A mirror pod's deletion
/// stops nothing: never a fence of this kind.
pub fn deleted_before_stopped(
    terminal: bool,
    mirror: bool,
    grace_seconds: Option<i64>,
) -> Option<String> {
    if terminal || mirror {
        return None;
    }
    let default = crate::ipam::fence::DEFAULT_GRACE.as_secs();
    let grace = grace_seconds.map_or(default, |s| s.max(0).unsigned_abs());
    Some(format!(
        "{DELETED_BEFORE_STOPPED} (its last known phase was not Succeeded or Failed): it may run for up to its termination grace period of {grace}s"
    ))
}

/// When fences lift.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FencePolicy {
    /// How long a node must have been Ready again (time to kill what it should not run).
    pub settle: Duration,
    /// Lift after this long whatever the node does (`None`: wait).
    pub timeout: Option<Duration>,
    /// Added to a fenced pod's termination grace period: a returning kubelet kills the pod
    /// with its own cached spec (no grace override), waits up to that grace, then stops the
    /// sandbox (the CNI DEL). A fence never lifts by the settle before grace + margin.
    pub grace_margin: Duration,
}

/// The controller's default `--fence-grace-margin` (what a manual command assumes).
pub const DEFAULT_GRACE_MARGIN: Duration = Duration::from_secs(15);

impl FencePolicy {
    /// How long a node must have been Ready before a fence of a pod with termination grace
    /// `grace` lifts on the settle: the settle, or the grace plus the margin if longer.
    pub fn settle_for(&self, grace: Duration) -> Duration {
        self.settle.max(grace.saturating_add(self.grace_margin))
    }
}

/// Why a fence lifted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lift {
    /// The Node object was deleted: the operator declared it dead.
    NodeDeleted,
    /// The node has been Ready for the settle period.
    NodeSettled,
    /// `--fence-timeout` passed.
    TimedOut,
    /// The node is tainted `node.kubernetes.io/out-of-service`: declared powered off.
    OutOfService,
    /// Fencing is turned off.
    FencingOff,
    /// The node agent on the fence's node saw none of the pod's sandboxes after the fence.
    SandboxesGone,
}

impl Lift {
    /// For logs and Events.
    pub fn as_str(self) -> &'static str {
        match self {
            Lift::NodeDeleted => "its Node was deleted",
            Lift::NodeSettled => "its node has been Ready for the settle period",
            Lift::TimedOut => "the fence timed out",
            Lift::OutOfService => "its node is tainted out-of-service (declared powered off)",
            Lift::FencingOff => "fencing is turned off",
            Lift::SandboxesGone => "the node agent on its node saw the pod's sandboxes gone",
        }
    }
}

fn elapsed(from: Timestamp, now: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(from)).unwrap_or(Duration::ZERO)
}

/// A moment on both clocks: the wall clock (what a fence record stores, to survive restarts)
/// and this process's monotonic clock (what settles are measured on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moment {
    /// Wall clock (the apiserver's as the controller reads it, or the controller's own;
    /// never a node's).
    pub wall: Timestamp,
    /// Monotonic clock of this process.
    pub mono: Instant,
}

/// A fence as the lift rules read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceClock {
    /// The record's `since` (wall) and when this process first saw the fence (monotonic).
    pub set: Moment,
    /// The deleted pod's termination grace period (its spec's, as the kubelet caches it).
    pub grace: Duration,
}

/// Whether a fence lifts. `fence`: when it was set and the pod's grace; `node`: the node now
/// (`None`: no such Node).
pub fn lift(
    fence: FenceClock,
    node: Option<&NodeReadiness>,
    now: Moment,
    policy: &FencePolicy,
) -> Option<Lift> {
    // The timeout spans restarts, so it counts from the record, written by a controller.
    let FenceClock { set, grace } = fence;
    if policy
        .timeout
        .is_some_and(|t| elapsed(set.wall, now.wall) >= t)
    {
        return Some(Lift::TimedOut);
    }
    let Some(node) = node else {
        return Some(Lift::NodeDeleted);
    };
    if node.out_of_service {
        return Some(Lift::OutOfService);
    }
    let ready_seen = match node.ready_seen {
        Some(at) if node.is_ready() => at,
        _ => return None,
    };
    // Ready counts from the later of our observation of it and of the fence: a stale view of
    // the node when the fence was set must not shorten the settle period.
    let ready_from = ready_seen.max(set.mono);
    let settled = now.mono.saturating_duration_since(ready_from) >= policy.settle_for(grace);
    settled.then_some(Lift::NodeSettled)
}

/// Whose a fence is, as its evidence must name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceIdentity<'a> {
    /// The fence's node (`spec.node`).
    pub node: &'a str,
    /// The deleted pod's uid (`spec.uid`).
    pub pod_uid: &'a str,
    /// The `IPFence` object's uid.
    pub fence_uid: &'a str,
}

/// A node agent's report on a fenced pod's sandboxes (an `IPFence` status, as read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentReport<'a> {
    /// The node whose agent looked.
    pub node: &'a str,
    /// The pod it looked for.
    pub pod_uid: &'a str,
    /// The fence object it saw before looking.
    pub fence_uid: &'a str,
    /// When it looked (the node's clock: must parse, never compared).
    pub observed_at: &'a str,
}

impl<'a> From<&'a crate::api::SandboxReport> for AgentReport<'a> {
    fn from(r: &'a crate::api::SandboxReport) -> Self {
        AgentReport {
            node: &r.node,
            pod_uid: &r.pod_uid,
            fence_uid: &r.fence_uid,
            observed_at: &r.observed_at,
        }
    }
}

/// What the node agent on a fence's node says: the pod's sandboxes are gone, or one is still
/// there (its kubelet is still stopping it). The agent writes one at a time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentReports<'a> {
    /// None of the pod's sandboxes is listed.
    pub gone: Option<AgentReport<'a>>,
    /// A sandbox of the pod is still listed.
    pub present: Option<AgentReport<'a>>,
}

impl<'a> From<&'a crate::api::IPFenceStatus> for AgentReports<'a> {
    /// The reports an `IPFence`'s status holds.
    fn from(s: &'a crate::api::IPFenceStatus) -> Self {
        AgentReports {
            gone: s.sandboxes_gone.as_ref().map(AgentReport::from),
            present: s.sandboxes_present.as_ref().map(AgentReport::from),
        }
    }
}

/// Why a report does not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rejected {
    /// The fence has no pod uid or object uid to bind a report to (an older record).
    Unbound,
    /// A field is empty or `observedAt` is no timestamp.
    Malformed,
    /// It names another node.
    WrongNode,
    /// It names another pod.
    WrongPod,
    /// It was made for another fence object (an earlier fence of the same address).
    OtherFence,
}

impl Rejected {
    /// For logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejected::Unbound => "unbound",
            Rejected::Malformed => "malformed",
            Rejected::WrongNode => "wrong_node",
            Rejected::WrongPod => "wrong_pod",
            Rejected::OtherFence => "other_fence",
        }
    }
}

/// Whether `report` is evidence for `fence`. The fence uid binds it to this fence object,
/// which exists only after the fence was decided: the agent reads it before the listing that
/// found no sandbox, so a report carrying it was made after the fence was written. Clocks are
/// never compared (the node's may lag or lead).
pub fn check_report(fence: FenceIdentity<'_>, report: &AgentReport<'_>) -> Result<(), Rejected> {
    if fence.pod_uid.is_empty() || fence.fence_uid.is_empty() || fence.node.is_empty() {
        return Err(Rejected::Unbound);
    }
    let fields = [
        report.node,
        report.pod_uid,
        report.fence_uid,
        report.observed_at,
    ];
    if fields.iter().any(|f| f.is_empty()) || report.observed_at.parse::<Timestamp>().is_err() {
        return Err(Rejected::Malformed);
    }
    if report.fence_uid != fence.fence_uid {
        return Err(Rejected::OtherFence);
    }
    if report.node != fence.node {
        return Err(Rejected::WrongNode);
    }
    if report.pod_uid != fence.pod_uid {
        return Err(Rejected::WrongPod);
    }
    Ok(())
}

/// What the lift rules make of a fence and its node agent's reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Why it lifts now, if it does.
    pub lift: Option<Lift>,
    /// A lift by the settle held because the agent still sees a sandbox.
    pub kept_by_agent: bool,
    /// Why reports present were rejected (logged and counted, never acted on).
    pub rejected: Vec<Rejected>,
}

/// What the node agent's valid reports on a fence say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentSays {
    /// None of the pod's sandboxes is listed (and no later listing says otherwise).
    pub gone: bool,
    /// A sandbox of the pod is still listed.
    pub present: bool,
    /// Why reports present were rejected.
    pub rejected: Vec<Rejected>,
}

/// Reads the reports on the fence `identity`. Both at once (the agent writes one at a time, so
/// one landed late: a retry, a restarted agent's request in flight) count as the one whose
/// listing is later; both times are the same node's clock, and a tie, or a clock stepped
/// back, counts as present.
pub fn agent_says(identity: FenceIdentity<'_>, reports: &AgentReports<'_>) -> AgentSays {
    let mut rejected = Vec::new();
    let mut valid =
        |r: &Option<AgentReport<'_>>| match r.as_ref().map(|r| check_report(identity, r)) {
            Some(Ok(())) => true,
            Some(Err(why)) => {
                rejected.push(why);
                false
            }
            None => false,
        };
    let (mut gone, mut present) = (valid(&reports.gone), valid(&reports.present));
    if gone && present {
        let at = |r: &Option<AgentReport<'_>>| {
            r.as_ref()
                .and_then(|r| r.observed_at.parse::<Timestamp>().ok())
        };
        present = at(&reports.gone) <= at(&reports.present);
        gone = !present;
    }
    AgentSays {
        gone,
        present,
        rejected,
    }
}

/// [`lift`], where the node agent's reports also count ([`agent_says`]). Valid "gone" evidence
/// lifts at once (after a timeout or the node's deletion or taint, which say so first); valid
/// "still present" keeps back the settle (the returning kubelet is still stopping the pod), never
/// the operator's word (a deleted Node, the out-of-service taint, `--fence-timeout`, which
/// lifts whatever the node does).
pub fn lift_with_reports(
    fence: FenceClock,
    identity: FenceIdentity<'_>,
    reports: &AgentReports<'_>,
    node: Option<&NodeReadiness>,
    now: Moment,
    policy: &FencePolicy,
) -> Verdict {
    let by_node = lift(fence, node, now, policy);
    let AgentSays {
        gone,
        present,
        rejected,
    } = agent_says(identity, reports);
    let (lift, kept_by_agent) = match by_node {
        Some(Lift::NodeSettled) if present => (None, true),
        Some(Lift::NodeSettled) | None if gone => (Some(Lift::SandboxesGone), false),
        other => (other, false),
    };
    Verdict {
        lift,
        kept_by_agent,
        rejected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A moment `s` seconds after a fixed origin, on both clocks.
    fn at(origin: Instant, s: u64) -> Moment {
        skewed(origin, s, s)
    }

    /// A moment `wall` seconds after the origin on the wall clock, `mono` on the monotonic.
    fn skewed(origin: Instant, wall: u64, mono: u64) -> Moment {
        Moment {
            wall: Timestamp::from_second(1_800_000_000 + wall as i64).unwrap(),
            mono: origin + Duration::from_secs(mono),
        }
    }

    /// Asserts that `fence` lifts as settled with the node `ready` at `s` seconds after `o`,
    /// and not a second earlier.
    #[track_caller]
    fn assert_settles_at(fence: Moment, ready: &NodeReadiness, o: Instant, s: u64) {
        assert_eq!(lift_at(fence, Some(ready), at(o, s - 1), &POLICY), None);
        assert_eq!(
            lift_at(fence, Some(ready), at(o, s), &POLICY),
            Some(Lift::NodeSettled)
        );
    }

    fn node(status: &str, ready_seen: Option<Instant>) -> NodeReadiness {
        NodeReadiness {
            status: status.into(),
            reason: (status != "True").then(|| "NodeStatusUnknown".into()),
            ready_seen,
            out_of_service: false,
            ready_again: None,
            ready_stamp: None,
        }
    }

    /// The window after Ready again in which deletions are distrusted, in these tests.
    const W: Duration = Duration::from_secs(30);

    const POLICY: FencePolicy = FencePolicy {
        settle: Duration::from_secs(30),
        timeout: None,
        grace_margin: Duration::ZERO,
    };

    /// [`lift`] of a fence set at `set` of a pod with no grace period.
    fn lift_at(
        set: Moment,
        node: Option<&NodeReadiness>,
        now: Moment,
        policy: &FencePolicy,
    ) -> Option<Lift> {
        lift(
            FenceClock {
                set,
                grace: Duration::ZERO,
            },
            node,
            now,
            policy,
        )
    }

    /// [`lift_with_reports`] with `gone` as the only report: the lift and the first rejection.
    fn reported(
        set: Moment,
        identity: FenceIdentity<'_>,
        gone: Option<&AgentReport<'_>>,
        node: Option<&NodeReadiness>,
        now: Moment,
        policy: &FencePolicy,
    ) -> (Option<Lift>, Option<Rejected>) {
        let reports = AgentReports {
            gone: gone.cloned(),
            present: None,
        };
        let fence = FenceClock {
            set,
            grace: Duration::ZERO,
        };
        let v = lift_with_reports(fence, identity, &reports, node, now, policy);
        (v.lift, v.rejected.first().copied())
    }

    #[test]
    fn a_pod_deleted_before_its_kubelet_stopped_it_is_fenced_with_its_grace() {
        let why = deleted_before_stopped(false, false, Some(600)).unwrap();
        assert!(is_deleted_before_stopped(&why), "{why}");
        assert!(why.ends_with("600s"), "{why}");
        // Unknown grace: the API's default; a negative one (never valid) counts as none.
        assert!(
            deleted_before_stopped(false, false, None)
                .unwrap()
                .ends_with("30s")
        );
        assert!(
            deleted_before_stopped(false, false, Some(-5))
                .unwrap()
                .ends_with(" 0s")
        );
        // Stopped by its kubelet (a terminal phase), or a mirror (stops nothing): no fence.
        assert_eq!(deleted_before_stopped(true, false, Some(600)), None);
        assert_eq!(deleted_before_stopped(false, true, Some(600)), None);
    }

    #[test]
    fn only_a_node_that_is_not_ready_is_distrusted() {
        assert_eq!(
            distrust(Some(&node("True", Some(Instant::now()))), Instant::now(), W),
            None
        );
        assert_eq!(
            distrust(Some(&node("Unknown", None)), Instant::now(), W).as_deref(),
            Some("Ready=Unknown (NodeStatusUnknown)")
        );
        assert_eq!(
            distrust(Some(&node("False", None)), Instant::now(), W).as_deref(),
            Some("Ready=False (NodeStatusUnknown)")
        );
        let missing = NodeReadiness {
            status: "missing".into(),
            reason: None,
            ready_seen: None,
            out_of_service: false,
            ready_again: None,
            ready_stamp: None,
        };
        assert_eq!(
            distrust(Some(&missing), Instant::now(), W).as_deref(),
            Some("Ready=missing")
        );
        assert_eq!(
            distrust(None, Instant::now(), W),
            None,
            "a deleted Node is declared dead"
        );
    }

    #[test]
    fn a_fence_lifts_once_the_node_has_been_seen_ready_for_the_settle_period() {
        let o = Instant::now();
        let fence = at(o, 100);
        assert_eq!(
            lift_at(fence, Some(&node("Unknown", None)), at(o, 10_000), &POLICY),
            None
        );
        let ready = node("True", Some(at(o, 200).mono));
        assert_settles_at(fence, &ready, o, 230);
    }

    #[test]
    fn a_ready_node_seen_before_the_fence_settles_from_the_fence() {
        // The fence was decided on a stale view: the settle still runs from the fence.
        let o = Instant::now();
        let ready = node("True", Some(o));
        assert_settles_at(at(o, 100), &ready, o, 130);
    }

    #[test]
    fn a_fence_an_earlier_run_set_long_ago_still_waits_the_whole_settle_after_a_restart() {
        // The record says an hour ago (wall); this process saw the fence and the Ready node
        // only now (monotonic): nothing lifts before the settle has passed on our clock.
        let o = Instant::now();
        let fence = skewed(o, 0, 3600);
        let ready = node("True", Some(at(o, 3600).mono));
        assert_settles_at(fence, &ready, o, 3630);
    }

    #[test]
    fn a_ready_node_without_an_observation_never_lifts() {
        let o = Instant::now();
        assert_eq!(
            lift_at(at(o, 0), Some(&node("True", None)), at(o, 10_000), &POLICY),
            None
        );
    }

    #[test]
    fn a_deleted_node_lifts_at_once_and_a_timeout_whatever_the_node_does() {
        let o = Instant::now();
        assert_eq!(
            lift_at(at(o, 100), None, at(o, 100), &POLICY),
            Some(Lift::NodeDeleted)
        );
        let policy = FencePolicy {
            timeout: Some(Duration::from_secs(20)),
            ..POLICY
        };
        let down = node("Unknown", None);
        assert_eq!(lift_at(at(o, 100), Some(&down), at(o, 119), &policy), None);
        assert_eq!(
            lift_at(at(o, 100), Some(&down), at(o, 120), &policy),
            Some(Lift::TimedOut)
        );
    }

    #[test]
    fn a_wall_clock_behind_the_fence_never_times_it_out_early() {
        let o = Instant::now();
        let policy = FencePolicy {
            timeout: Some(Duration::from_secs(20)),
            ..POLICY
        };
        let now = skewed(o, 50, 500);
        assert_eq!(
            lift_at(at(o, 100), Some(&node("Unknown", None)), now, &policy),
            None
        );
    }

    #[test]
    fn a_node_declared_powered_off_lifts_its_fences_at_once_and_fences_nothing_new() {
        let o = Instant::now();
        let down = NodeReadiness {
            out_of_service: true,
            ..node("Unknown", None)
        };
        assert_eq!(
            lift_at(at(o, 100), Some(&down), at(o, 101), &POLICY),
            Some(Lift::OutOfService)
        );
        assert_eq!(distrust(Some(&down), Instant::now(), W), None);
    }

    const FENCE: FenceIdentity<'static> = FenceIdentity {
        node: "node-a",
        pod_uid: "pod-1",
        fence_uid: "fence-2",
    };

    fn report() -> AgentReport<'static> {
        AgentReport {
            node: "node-a",
            pod_uid: "pod-1",
            fence_uid: "fence-2",
            observed_at: "2026-11-24T10:00:00Z",
        }
    }

    #[test]
    fn evidence_for_this_fence_lifts_at_once_with_the_node_still_down_and_no_settle() {
        let o = Instant::now();
        let long = FencePolicy {
            settle: Duration::from_secs(3600),
            ..POLICY
        };
        let down = node("Unknown", None);
        let r = report();
        assert_eq!(
            reported(at(o, 100), FENCE, Some(&r), Some(&down), at(o, 101), &long),
            (Some(Lift::SandboxesGone), None)
        );
        let ready = node("True", Some(at(o, 100).mono));
        assert_eq!(
            reported(at(o, 100), FENCE, Some(&r), Some(&ready), at(o, 101), &long).0,
            Some(Lift::SandboxesGone)
        );
        // Without a report, the settle still rules.
        assert_eq!(
            reported(at(o, 100), FENCE, None, Some(&ready), at(o, 101), &long),
            (None, None)
        );
    }

    #[test]
    fn evidence_for_another_node_pod_or_fence_never_lifts() {
        let o = Instant::now();
        let down = node("Unknown", None);
        let cases = [
            (
                AgentReport {
                    node: "node-b",
                    ..report()
                },
                Rejected::WrongNode,
            ),
            (
                AgentReport {
                    pod_uid: "pod-9",
                    ..report()
                },
                Rejected::WrongPod,
            ),
            // Stale: made for an earlier fence of the same address (another object).
            (
                AgentReport {
                    fence_uid: "fence-1",
                    ..report()
                },
                Rejected::OtherFence,
            ),
            (
                AgentReport {
                    observed_at: "yesterday",
                    ..report()
                },
                Rejected::Malformed,
            ),
            (
                AgentReport {
                    node: "",
                    ..report()
                },
                Rejected::Malformed,
            ),
        ];
        for (r, why) in cases {
            assert_eq!(
                reported(
                    at(o, 100),
                    FENCE,
                    Some(&r),
                    Some(&down),
                    at(o, 9_999),
                    &POLICY
                ),
                (None, Some(why)),
                "{r:?}"
            );
        }
    }

    #[test]
    fn a_fence_without_a_pod_uid_takes_no_evidence() {
        let o = Instant::now();
        let old = FenceIdentity {
            pod_uid: "",
            ..FENCE
        };
        let r = AgentReport {
            pod_uid: "",
            ..report()
        };
        let down = node("Unknown", None);
        assert_eq!(
            reported(at(o, 1), old, Some(&r), Some(&down), at(o, 2), &POLICY),
            (None, Some(Rejected::Unbound))
        );
    }

    #[test]
    fn a_timeout_or_a_deleted_node_still_names_itself_when_evidence_is_there_too() {
        let o = Instant::now();
        let r = report();
        assert_eq!(
            reported(at(o, 1), FENCE, Some(&r), None, at(o, 2), &POLICY).0,
            Some(Lift::NodeDeleted)
        );
    }

    fn present() -> AgentReport<'static> {
        report()
    }

    #[test]
    fn a_fence_waits_the_pods_grace_period_plus_the_margin_when_longer_than_the_settle() {
        // A database pod with a 120 s grace: the returning kubelet may run it 120 s more.
        let o = Instant::now();
        let policy = FencePolicy {
            grace_margin: Duration::from_secs(10),
            ..POLICY
        };
        let fence = FenceClock {
            set: at(o, 100),
            grace: Duration::from_secs(120),
        };
        let ready = node("True", Some(at(o, 200).mono));
        assert_eq!(lift(fence, Some(&ready), at(o, 329), &policy), None);
        assert_eq!(
            lift(fence, Some(&ready), at(o, 330), &policy),
            Some(Lift::NodeSettled)
        );
        // A short grace: the settle rules.
        let short = FenceClock {
            grace: Duration::from_secs(5),
            ..fence
        };
        assert_eq!(lift(short, Some(&ready), at(o, 229), &policy), None);
        assert_eq!(
            lift(short, Some(&ready), at(o, 230), &policy),
            Some(Lift::NodeSettled)
        );
    }

    #[test]
    fn the_agents_still_present_report_holds_the_settle_but_not_the_operators_word() {
        let o = Instant::now();
        let policy = FencePolicy {
            timeout: Some(Duration::from_secs(50)),
            ..POLICY
        };
        let fence = FenceClock {
            set: at(o, 0),
            grace: Duration::ZERO,
        };
        let reports = AgentReports {
            gone: None,
            present: Some(present()),
        };
        let ready = node("True", Some(at(o, 0).mono));
        let held = |node: Option<&NodeReadiness>, s| {
            lift_with_reports(fence, FENCE, &reports, node, at(o, s), &policy)
        };
        let v = held(Some(&ready), 40);
        assert_eq!((v.lift, v.kept_by_agent), (None, true), "settled, held");
        // The timeout is the operator's bound: it lifts whatever the node does.
        let v = held(Some(&node("Unknown", None)), 60);
        assert_eq!((v.lift, v.kept_by_agent), (Some(Lift::TimedOut), false));
        assert_eq!(held(None, 40).lift, Some(Lift::NodeDeleted));
        let tainted = NodeReadiness {
            out_of_service: true,
            ..ready.clone()
        };
        assert_eq!(held(Some(&tainted), 1).lift, Some(Lift::OutOfService));
        // Gone and present at once (the agent writes one, so one landed late): the later
        // listing counts; the same time, or a node clock stepped back, holds.
        let both = |gone_at: &'static str| AgentReports {
            gone: Some(AgentReport {
                observed_at: gone_at,
                ..report()
            }),
            present: Some(present()),
        };
        let judge = |gone_at| {
            let v = lift_with_reports(
                fence,
                FENCE,
                &both(gone_at),
                Some(&ready),
                at(o, 40),
                &policy,
            );
            (v.lift, v.kept_by_agent)
        };
        let listed = present().observed_at;
        assert_eq!(
            judge(listed),
            (None, true),
            "the same listing time: present"
        );
        assert_eq!(
            judge("2026-01-01T00:00:00Z"),
            (None, true),
            "gone listed earlier"
        );
        assert_eq!(
            judge("2099-01-01T00:00:00Z"),
            (Some(Lift::SandboxesGone), false),
            "a late present write after gone"
        );
        // A present report for another fence object holds nothing and is rejected.
        let stale = AgentReports {
            gone: None,
            present: Some(AgentReport {
                fence_uid: "fence-1",
                ..present()
            }),
        };
        let v = lift_with_reports(fence, FENCE, &stale, Some(&ready), at(o, 40), &policy);
        assert_eq!(
            (v.lift, v.kept_by_agent, v.rejected),
            (Some(Lift::NodeSettled), false, vec![Rejected::OtherFence])
        );
    }

    #[test]
    fn a_window_past_the_clocks_range_distrusts_and_never_panics() {
        let o = Instant::now();
        let mut back = node("True", Some(o));
        back.ready_again = Some(o);
        let why = distrust(Some(&back), o, Duration::MAX).unwrap();
        assert!(why.contains("settling"), "{why}");
    }

    #[test]
    fn a_node_seen_ready_again_is_distrusted_until_its_settle_has_passed() {
        let o = Instant::now();
        let settling = NodeReadiness {
            ready_again: Some(o),
            ..node("True", Some(o))
        };
        let why = distrust(Some(&settling), o + Duration::from_secs(10), W);
        assert!(
            why.as_deref()
                .is_some_and(|w| w.contains("settling for 20s")),
            "{why:?}"
        );
        assert_eq!(
            distrust(Some(&settling), o + Duration::from_secs(30), W),
            None
        );
        let tainted = NodeReadiness {
            out_of_service: true,
            ..settling
        };
        assert_eq!(distrust(Some(&tainted), o, W), None);
    }
}
