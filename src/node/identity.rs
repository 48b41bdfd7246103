//! Whether the runtime the agent lists is this node's kubelet's. "Not listed" reads as "gone"
//! (a fence's evidence, a dead sandbox's fresh check), so a `--cri-endpoint` that points at
//! another runtime would make every pod of this node look gone. With `--pod-uid` (the
//! agent's own pod, from the downward API) a listing counts only if it lists a Ready sandbox
//! of that pod: the kubelet's runtime always runs the agent's own sandbox (a stopped one of it
//! may linger in a runtime the node has left). The release asks the runtime again right
//! before it writes (`Releaser::confirm_dead`). Pure but for [`runtime_is_ours`],
//! which logs and sets the gauge.

use super::cri::RuntimeView;
use crate::telemetry::NodeMetrics;

/// What the newest listing says about the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It lists a Ready sandbox of the agent's own pod, or no `--pod-uid` was given.
    Ours,
    /// It does not: nothing it lists, or misses, counts.
    NotOurs,
    /// No listing yet.
    Unknown,
}

/// The agent's own pod uid and what the last check found (to log and count changes once).
#[derive(Debug, Default)]
pub struct RuntimeIdentity {
    own_pod: Option<String>,
    last: Option<Verdict>,
}

impl RuntimeIdentity {
    /// Checks listings for `own_pod` (empty or none: no check).
    pub fn new(own_pod: Option<&str>) -> Self {
        RuntimeIdentity {
            own_pod: own_pod.filter(|u| !u.is_empty()).map(str::to_owned),
            last: None,
        }
    }

    /// The agent's own pod uid, if checked.
    pub fn own_pod(&self) -> Option<&str> {
        self.own_pod.as_deref()
    }

    /// The verdict on the newest listing (`listings` done so far; `lists` says whether it
    /// lists a Ready sandbox of a pod uid), and whether it changed since the last call.
    pub fn check(&mut self, listings: u64, lists: impl Fn(&str) -> bool) -> (Verdict, bool) {
        let verdict = match &self.own_pod {
            None => Verdict::Ours,
            Some(_) if listings == 0 => Verdict::Unknown,
            Some(me) if lists(me) => Verdict::Ours,
            Some(_) => Verdict::NotOurs,
        };
        let changed = self.last.replace(verdict) != Some(verdict);
        (verdict, changed)
    }
}

/// Whether the newest listing in `view` is of this node's kubelet runtime;
/// logs and sets the gauge when that changes.
pub fn runtime_is_ours(
    identity: &mut RuntimeIdentity,
    metrics: &NodeMetrics,
    view: &RuntimeView,
) -> bool {
    let (verdict, changed) = identity.check(view.listings, |uid| view.ready.contains(uid));
    if changed {
        let own_pod = identity.own_pod().unwrap_or_default();
        match verdict {
            Verdict::NotOurs => tracing::error!(
                own_pod,
                "the runtime at --cri-endpoint does not list a Ready sandbox of this agent's own pod, so it is not this node's kubelet runtime: no fence is reported and no dead sandbox released while it does not"
            ),
            Verdict::Ours if !own_pod.is_empty() => {
                tracing::info!(own_pod, "the runtime lists this agent's own pod Ready")
            }
            _ => {}
        }
        metrics
            .runtime_unverified
            .set(i64::from(verdict == Verdict::NotOurs));
    }
    verdict == Verdict::Ours
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_counts_only_if_it_lists_the_agents_own_pod() {
        let mut id = RuntimeIdentity::new(Some("agent-uid"));
        assert_eq!(id.check(0, |_| true), (Verdict::Unknown, true));
        assert_eq!(id.check(1, |u| u == "other"), (Verdict::NotOurs, true));
        assert_eq!(id.check(2, |u| u == "other"), (Verdict::NotOurs, false));
        assert_eq!(id.check(3, |u| u == "agent-uid"), (Verdict::Ours, true));
        assert_eq!(id.check(4, |u| u == "agent-uid"), (Verdict::Ours, false));
    }

    #[test]
    fn without_an_own_pod_every_listing_counts() {
        for own in [None, Some("")] {
            let mut id = RuntimeIdentity::new(own);
            assert_eq!(id.own_pod(), None);
            assert_eq!(id.check(0, |_| false).0, Verdict::Ours);
            assert_eq!(id.check(5, |_| false).0, Verdict::Ours);
        }
    }
}
