//! Fencing, pure: whether a deleted pod's addresses must stay allocated because its node may
//! still run the sandbox, and when that fence lifts. Time is passed in.

use std::time::Duration;

use jiff::Timestamp;

/// A node's Ready condition, as far as fencing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReadiness {
    /// `status` of the Ready condition: `True`, `False`, `Unknown`, or `missing`.
    pub status: String,
    /// Its `reason`, if any.
    pub reason: Option<String>,
    /// Its `lastTransitionTime`, if any.
    pub since: Option<Timestamp>,
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
    if node.is_ready() {
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
            Lift::FencingOff => "fencing is turned off",
        }
    }
}

fn elapsed(from: Timestamp, now: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(from)).unwrap_or(Duration::ZERO)
}

/// Whether a fence set at `since` on a node now in state `node` (`None`: no such Node) lifts.
pub fn lift(
    since: Timestamp,
    node: Option<&NodeReadiness>,
    now: Timestamp,
    policy: &FencePolicy,
) -> Option<Lift> {
    if policy.timeout.is_some_and(|t| elapsed(since, now) >= t) {
        return Some(Lift::TimedOut);
    }
    let Some(node) = node else {
        return Some(Lift::NodeDeleted);
    };
    if !node.is_ready() {
        return None;
    }
    // Ready counts from the later of the transition and the fence: a stale view of the node
    // when the fence was set must not shorten the settle period.
    let ready_from = node.since.map_or(since, |t| t.max(since));
    (elapsed(ready_from, now) >= policy.settle).then_some(Lift::NodeSettled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn node(status: &str, since: i64) -> NodeReadiness {
        NodeReadiness {
            status: status.into(),
            reason: (status != "True").then(|| "NodeStatusUnknown".into()),
            since: Some(t(since)),
        }
    }

    const POLICY: FencePolicy = FencePolicy {
        settle: Duration::from_secs(30),
        timeout: None,
    };

    #[test]
    fn only_a_node_that_is_not_ready_is_distrusted() {
        assert_eq!(distrust(Some(&node("True", 0))), None);
        assert_eq!(
            distrust(Some(&node("Unknown", 0))).as_deref(),
            Some("Ready=Unknown (NodeStatusUnknown)")
        );
        assert_eq!(
            distrust(Some(&node("False", 0))).as_deref(),
            Some("Ready=False (NodeStatusUnknown)")
        );
        let missing = NodeReadiness {
            status: "missing".into(),
            reason: None,
            since: None,
        };
        assert_eq!(distrust(Some(&missing)).as_deref(), Some("Ready=missing"));
        assert_eq!(distrust(None), None, "a deleted Node is declared dead");
    }

    #[test]
    fn a_fence_lifts_once_the_node_has_been_ready_for_the_settle_period() {
        let since = t(100);
        assert_eq!(
            lift(since, Some(&node("Unknown", 90)), t(10_000), &POLICY),
            None
        );
        assert_eq!(lift(since, Some(&node("True", 200)), t(229), &POLICY), None);
        assert_eq!(
            lift(since, Some(&node("True", 200)), t(230), &POLICY),
            Some(Lift::NodeSettled)
        );
    }

    #[test]
    fn a_ready_transition_older_than_the_fence_does_not_shorten_the_settle() {
        let since = t(100);
        assert_eq!(lift(since, Some(&node("True", 0)), t(129), &POLICY), None);
        assert_eq!(
            lift(since, Some(&node("True", 0)), t(130), &POLICY),
            Some(Lift::NodeSettled)
        );
    }

    #[test]
    fn a_deleted_node_lifts_at_once_and_a_timeout_whatever_the_node_does() {
        assert_eq!(lift(t(100), None, t(100), &POLICY), Some(Lift::NodeDeleted));
        let policy = FencePolicy {
            timeout: Some(Duration::from_secs(20)),
            ..POLICY
        };
        let down = node("Unknown", 90);
        assert_eq!(lift(t(100), Some(&down), t(119), &policy), None);
        assert_eq!(
            lift(t(100), Some(&down), t(120), &policy),
            Some(Lift::TimedOut)
        );
    }

    #[test]
    fn a_clock_behind_the_fence_never_lifts_it_early() {
        assert_eq!(lift(t(100), Some(&node("True", 200)), t(50), &POLICY), None);
    }
}
