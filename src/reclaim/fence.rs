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
}

impl NodeReadiness {
    /// Ready is True.
    pub fn is_ready(&self) -> bool {
        self.status == "True"
    }
}

/// Why a pod deleted now, on `node`, must be fenced; `None` when its node is trusted to kill
/// the sandbox (Ready) or is gone (a deleted Node is declared dead).
pub fn distrust(node: Option<&NodeReadiness>) -> Option<String> {
    let node = node?;
    // Ready, or declared powered off by its operator (nothing runs there any more).
    if node.is_ready() || node.out_of_service {
        return None;
    }
    Some(match &node.reason {
        Some(reason) => format!("Ready={} ({reason})", node.status),
        None => format!("Ready={}", node.status),
    })
}

/// When fences lift.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FencePolicy {
    /// How long a node must have been Ready again (time to kill what it should not run).
    pub settle: Duration,
    /// Lift after this long whatever the node does (`None`: wait).
    pub timeout: Option<Duration>,
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
            Lift::NodeSettled => "its node is Ready again and settled",
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

/// Whether a fence lifts. `fence`: the record's `since` (wall) and when this process first
/// saw the fence (monotonic); `node`: the node now (`None`: no such Node).
pub fn lift(
    fence: Moment,
    node: Option<&NodeReadiness>,
    now: Moment,
    policy: &FencePolicy,
) -> Option<Lift> {
    // The timeout spans restarts, so it counts from the record, written by a controller.
    if policy
        .timeout
        .is_some_and(|t| elapsed(fence.wall, now.wall) >= t)
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
    let ready_from = ready_seen.max(fence.mono);
    (now.mono.saturating_duration_since(ready_from) >= policy.settle).then_some(Lift::NodeSettled)
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

/// A node agent's report that a pod's sandboxes are gone (an `IPFence` status, as read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoneReport<'a> {
    /// The node whose agent looked.
    pub node: &'a str,
    /// The pod it looked for.
    pub pod_uid: &'a str,
    /// The fence object it saw before looking.
    pub fence_uid: &'a str,
    /// When it looked (the node's clock: must parse, never compared).
    pub observed_at: &'a str,
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
pub fn check_report(fence: FenceIdentity<'_>, report: &GoneReport<'_>) -> Result<(), Rejected> {
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

/// [`lift`], where the node agent's report also counts: valid evidence lifts at once (after a
/// timeout or the node's deletion or taint, which say so first). Returns why a report present
/// was rejected, for logs and metrics.
pub fn lift_with_report(
    fence: Moment,
    identity: FenceIdentity<'_>,
    report: Option<&GoneReport<'_>>,
    node: Option<&NodeReadiness>,
    now: Moment,
    policy: &FencePolicy,
) -> (Option<Lift>, Option<Rejected>) {
    let by_node = lift(fence, node, now, policy);
    let checked = report.map(|r| check_report(identity, r));
    let rejected = checked.and_then(Result::err);
    match by_node {
        Some(Lift::NodeSettled) | None if checked == Some(Ok(())) => {
            (Some(Lift::SandboxesGone), rejected)
        }
        other => (other, rejected),
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
        assert_eq!(lift(fence, Some(ready), at(o, s - 1), &POLICY), None);
        assert_eq!(
            lift(fence, Some(ready), at(o, s), &POLICY),
            Some(Lift::NodeSettled)
        );
    }

    fn node(status: &str, ready_seen: Option<Instant>) -> NodeReadiness {
        NodeReadiness {
            status: status.into(),
            reason: (status != "True").then(|| "NodeStatusUnknown".into()),
            ready_seen,
            out_of_service: false,
        }
    }

    const POLICY: FencePolicy = FencePolicy {
        settle: Duration::from_secs(30),
        timeout: None,
    };

    #[test]
    fn only_a_node_that_is_not_ready_is_distrusted() {
        assert_eq!(distrust(Some(&node("True", Some(Instant::now())))), None);
        assert_eq!(
            distrust(Some(&node("Unknown", None))).as_deref(),
            Some("Ready=Unknown (NodeStatusUnknown)")
        );
        assert_eq!(
            distrust(Some(&node("False", None))).as_deref(),
            Some("Ready=False (NodeStatusUnknown)")
        );
        let missing = NodeReadiness {
            status: "missing".into(),
            reason: None,
            ready_seen: None,
            out_of_service: false,
        };
        assert_eq!(distrust(Some(&missing)).as_deref(), Some("Ready=missing"));
        assert_eq!(distrust(None), None, "a deleted Node is declared dead");
    }

    #[test]
    fn a_fence_lifts_once_the_node_has_been_seen_ready_for_the_settle_period() {
        let o = Instant::now();
        let fence = at(o, 100);
        assert_eq!(
            lift(fence, Some(&node("Unknown", None)), at(o, 10_000), &POLICY),
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
            lift(at(o, 0), Some(&node("True", None)), at(o, 10_000), &POLICY),
            None
        );
    }

    #[test]
    fn a_deleted_node_lifts_at_once_and_a_timeout_whatever_the_node_does() {
        let o = Instant::now();
        assert_eq!(
            lift(at(o, 100), None, at(o, 100), &POLICY),
            Some(Lift::NodeDeleted)
        );
        let policy = FencePolicy {
            timeout: Some(Duration::from_secs(20)),
            ..POLICY
        };
        let down = node("Unknown", None);
        assert_eq!(lift(at(o, 100), Some(&down), at(o, 119), &policy), None);
        assert_eq!(
            lift(at(o, 100), Some(&down), at(o, 120), &policy),
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
            lift(at(o, 100), Some(&node("Unknown", None)), now, &policy),
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
            lift(at(o, 100), Some(&down), at(o, 101), &POLICY),
            Some(Lift::OutOfService)
        );
        assert_eq!(distrust(Some(&down)), None);
    }

    const FENCE: FenceIdentity<'static> = FenceIdentity {
        node: "node-a",
        pod_uid: "pod-1",
        fence_uid: "fence-2",
    };

    fn report() -> GoneReport<'static> {
        GoneReport {
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
            timeout: None,
        };
        let down = node("Unknown", None);
        let r = report();
        assert_eq!(
            lift_with_report(at(o, 100), FENCE, Some(&r), Some(&down), at(o, 101), &long),
            (Some(Lift::SandboxesGone), None)
        );
        let ready = node("True", Some(at(o, 100).mono));
        assert_eq!(
            lift_with_report(at(o, 100), FENCE, Some(&r), Some(&ready), at(o, 101), &long).0,
            Some(Lift::SandboxesGone)
        );
        // Without a report, the settle still rules.
        assert_eq!(
            lift_with_report(at(o, 100), FENCE, None, Some(&ready), at(o, 101), &long),
            (None, None)
        );
    }

    #[test]
    fn evidence_for_another_node_pod_or_fence_never_lifts() {
        let o = Instant::now();
        let down = node("Unknown", None);
        let cases = [
            (
                GoneReport {
                    node: "node-b",
                    ..report()
                },
                Rejected::WrongNode,
            ),
            (
                GoneReport {
                    pod_uid: "pod-9",
                    ..report()
                },
                Rejected::WrongPod,
            ),
            // Stale: made for an earlier fence of the same address (another object).
            (
                GoneReport {
                    fence_uid: "fence-1",
                    ..report()
                },
                Rejected::OtherFence,
            ),
            (
                GoneReport {
                    observed_at: "yesterday",
                    ..report()
                },
                Rejected::Malformed,
            ),
            (
                GoneReport {
                    node: "",
                    ..report()
                },
                Rejected::Malformed,
            ),
        ];
        for (r, why) in cases {
            assert_eq!(
                lift_with_report(
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
        let r = GoneReport {
            pod_uid: "",
            ..report()
        };
        let down = node("Unknown", None);
        assert_eq!(
            lift_with_report(at(o, 1), old, Some(&r), Some(&down), at(o, 2), &POLICY),
            (None, Some(Rejected::Unbound))
        );
    }

    #[test]
    fn a_timeout_or_a_deleted_node_still_names_itself_when_evidence_is_there_too() {
        let o = Instant::now();
        let r = report();
        assert_eq!(
            lift_with_report(at(o, 1), FENCE, Some(&r), None, at(o, 2), &POLICY).0,
            Some(Lift::NodeDeleted)
        );
    }
}
