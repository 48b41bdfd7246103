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
    /// Wall clock (the controller's, never a node's).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A moment `s` seconds after a fixed origin, on both clocks.
    fn at(origin: Instant, s: u64) -> Moment {
        Moment {
            wall: Timestamp::from_second(1_800_000_000 + s as i64).unwrap(),
            mono: origin + Duration::from_secs(s),
        }
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
        assert_eq!(lift(fence, Some(&ready), at(o, 229), &POLICY), None);
        assert_eq!(
            lift(fence, Some(&ready), at(o, 230), &POLICY),
            Some(Lift::NodeSettled)
        );
    }

    #[test]
    fn a_ready_node_seen_before_the_fence_settles_from_the_fence() {
        // The fence was decided on a stale view: the settle still runs from the fence.
        let o = Instant::now();
        let ready = node("True", Some(o));
        assert_eq!(lift(at(o, 100), Some(&ready), at(o, 129), &POLICY), None);
        assert_eq!(
            lift(at(o, 100), Some(&ready), at(o, 130), &POLICY),
            Some(Lift::NodeSettled)
        );
    }

    #[test]
    fn a_fence_an_earlier_run_set_long_ago_still_waits_the_whole_settle_after_a_restart() {
        // The record says an hour ago (wall); this process saw the fence and the Ready node
        // only now (monotonic): nothing lifts before the settle has passed on our clock.
        let o = Instant::now();
        let fence = Moment {
            wall: at(o, 0).wall,
            mono: at(o, 3600).mono,
        };
        let ready = node("True", Some(at(o, 3600).mono));
        let now = |s| Moment {
            wall: at(o, s).wall,
            mono: at(o, s).mono,
        };
        assert_eq!(lift(fence, Some(&ready), now(3629), &POLICY), None);
        assert_eq!(
            lift(fence, Some(&ready), now(3630), &POLICY),
            Some(Lift::NodeSettled)
        );
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
        let now = Moment {
            wall: at(o, 50).wall,
            mono: at(o, 500).mono,
        };
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
}
