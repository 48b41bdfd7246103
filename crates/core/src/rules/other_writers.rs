//! Whose write removed a marked entry (fenced or cooling), pure: ipreclaim's own, the
//! returning kubelet's CNI DEL, or another cleaner's.
//!
//! The rule:
//! - ipreclaim signed the write (`ipam::own_write`): its own (any replica, the manual commands).
//! - A cooling entry: another writer's. Its id is ipreclaim's marker, not a container id, so no
//!   CNI DEL (which matches by container id and interface) can remove it.
//! - A fenced entry keeps its sandbox id: the whereabouts CNI DEL of that sandbox removes it
//!   when the fence's node comes back and its kubelet stops the pod. That kubelet is running, so
//!   it reports its node's Ready condition (True or False) within about 10 s. A fenced entry
//!   removed while its node's kubelet is not heard from (Ready Unknown or no condition, or no
//!   Node) and still not heard from `wait` later is another writer's; one whose node reports
//!   then, or by `wait` later, is taken for the CNI DEL and not reported.
//! - A fenced entry whose record is unknown, or with no view of the Nodes (fencing off): not
//!   judged.
//!
//! So a second cleaner is missed when it frees a fence of a node whose kubelet reports (Ready
//! or NotReady), and reported wrongly only when a kubelet runs the CNI DEL and then stays
//! silent for `wait` (it dies again at once, or reaches the apiserver for the plugin but not
//! for its own status).

use std::time::{Duration, Instant};

use super::fence::NodeReadiness;

/// What a fence's node says of its kubelet when looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kubelet {
    /// Its Ready condition is True or False: the kubelet reports, so it runs.
    Reporting,
    /// Ready Unknown, no condition yet, or no Node at all: not heard from.
    Silent,
    /// Nodes are not watched (fencing off): nothing is known.
    Unknown,
}

impl Kubelet {
    /// What `node` (the Node, if it exists) says, with a view of the Nodes.
    pub fn of(node: Option<&NodeReadiness>) -> Kubelet {
        match node.map(|n| n.status.as_str()) {
            Some("True" | "False") => Kubelet::Reporting,
            _ => Kubelet::Silent,
        }
    }
}

/// The verdict on one marked entry gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// ipreclaim's own write.
    Ours,
    /// Another writer removed or rewrote it: reported.
    OtherWriter,
    /// Most likely the returning kubelet's CNI DEL of the fenced sandbox: not reported.
    CniDel,
    /// Not known yet: look again once `wait` has passed since it was seen.
    Wait,
    /// Cannot be judged (no fence record, no view of the Nodes): not reported.
    Unjudged,
}

/// What is known of one marked entry gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone {
    /// ipreclaim signed the write.
    pub ours: bool,
    /// A fenced entry (else a cooling one).
    pub fenced: bool,
    /// A fenced entry's fence record is known (its node).
    pub recorded: bool,
    /// Its node's kubelet when the removal was seen.
    pub then: Kubelet,
    /// When the removal was seen.
    pub seen: Instant,
}

/// The verdict on `gone` at `now`, its node's kubelet being `now_kubelet`, after waiting up to
/// `wait` for a returning kubelet to report.
pub fn judge(gone: &Gone, now_kubelet: Kubelet, now: Instant, wait: Duration) -> Verdict {
    if gone.ours {
        return Verdict::Ours;
    }
    if !gone.fenced {
        return Verdict::OtherWriter;
    }
    if !gone.recorded || gone.then == Kubelet::Unknown || now_kubelet == Kubelet::Unknown {
        return Verdict::Unjudged;
    }
    if gone.then == Kubelet::Reporting || now_kubelet == Kubelet::Reporting {
        return Verdict::CniDel;
    }
    if now.saturating_duration_since(gone.seen) < wait {
        return Verdict::Wait;
    }
    Verdict::OtherWriter
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(30);

    fn gone(ours: bool, fenced: bool, then: Kubelet, seen: Instant) -> Gone {
        Gone {
            ours,
            fenced,
            recorded: true,
            then,
            seen,
        }
    }

    fn node(status: &str) -> NodeReadiness {
        NodeReadiness {
            status: status.into(),
            reason: None,
            ready_seen: None,
            out_of_service: false,
            ready_again: None,
            ready_stamp: None,
        }
    }

    #[test]
    fn a_kubelet_that_reports_ready_or_not_ready_runs_and_one_unknown_or_gone_does_not() {
        assert_eq!(Kubelet::of(Some(&node("True"))), Kubelet::Reporting);
        assert_eq!(Kubelet::of(Some(&node("False"))), Kubelet::Reporting);
        assert_eq!(Kubelet::of(Some(&node("Unknown"))), Kubelet::Silent);
        assert_eq!(Kubelet::of(Some(&node("missing"))), Kubelet::Silent);
        assert_eq!(Kubelet::of(None), Kubelet::Silent);
    }

    #[test]
    fn what_ipreclaim_signed_is_its_own_whatever_else_is_true() {
        let t = Instant::now();
        for fenced in [true, false] {
            for then in [Kubelet::Reporting, Kubelet::Silent, Kubelet::Unknown] {
                let g = gone(true, fenced, then, t);
                assert_eq!(judge(&g, Kubelet::Silent, t + WAIT, WAIT), Verdict::Ours);
            }
        }
    }

    #[test]
    fn a_cooling_entry_removed_by_anyone_else_is_another_writers_at_once() {
        let t = Instant::now();
        // No CNI DEL matches its marker id: neither the node nor the wait matters.
        for (then, now) in [
            (Kubelet::Reporting, Kubelet::Reporting),
            (Kubelet::Unknown, Kubelet::Unknown),
        ] {
            let g = gone(false, false, then, t);
            assert_eq!(judge(&g, now, t, WAIT), Verdict::OtherWriter);
        }
    }

    #[test]
    fn a_fence_removed_while_its_node_stays_silent_is_another_writers_after_the_wait() {
        let t = Instant::now();
        let g = gone(false, true, Kubelet::Silent, t);
        assert_eq!(judge(&g, Kubelet::Silent, t, WAIT), Verdict::Wait);
        let just_before = t + WAIT - Duration::from_millis(1);
        assert_eq!(judge(&g, Kubelet::Silent, just_before, WAIT), Verdict::Wait);
        assert_eq!(
            judge(&g, Kubelet::Silent, t + WAIT, WAIT),
            Verdict::OtherWriter
        );
    }

    #[test]
    fn a_fence_removed_by_a_node_that_reports_then_or_within_the_wait_is_its_cni_del() {
        let t = Instant::now();
        // Reporting when the removal was seen: its kubelet runs.
        let g = gone(false, true, Kubelet::Reporting, t);
        assert_eq!(judge(&g, Kubelet::Silent, t + WAIT, WAIT), Verdict::CniDel);
        // The returning kubelet's DEL came before its first status: it reports within the wait.
        let g = gone(false, true, Kubelet::Silent, t);
        let soon = t + Duration::from_secs(8);
        assert_eq!(judge(&g, Kubelet::Reporting, soon, WAIT), Verdict::CniDel);
    }

    #[test]
    fn a_fence_with_no_record_or_no_view_of_nodes_is_not_judged() {
        let t = Instant::now();
        let mut g = gone(false, true, Kubelet::Silent, t);
        g.recorded = false;
        assert_eq!(
            judge(&g, Kubelet::Silent, t + WAIT, WAIT),
            Verdict::Unjudged
        );
        let g = gone(false, true, Kubelet::Unknown, t);
        assert_eq!(
            judge(&g, Kubelet::Unknown, t + WAIT, WAIT),
            Verdict::Unjudged
        );
    }
}
