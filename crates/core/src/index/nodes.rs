//! Nodes' readiness: whether a deleted pod's node can be trusted to have killed its sandbox,
//! and since when (on this process's clock) a node has been Ready again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Now, SystemNow};

use super::pods::Tombstone;
use crate::api::slim::NodeReadyView;
use crate::rules::fence::{FencePolicy, NodeReadiness, deleted_before_stopped, distrust};

/// Nodes by name.
#[derive(Debug)]
pub struct NodeIndex {
    nodes: HashMap<String, NodeReadiness>,
    /// When each node's last fresh read (a GET, not the watch) began.
    read: HashMap<String, Instant>,
    /// The Node watch has listed every Node once (before, an unknown node is no word).
    listed: bool,
    /// How long a node seen Ready again is still distrusted: `--fence-settle`, or a deleted
    /// pod's grace period plus `--fence-grace-margin` when longer.
    window: FencePolicy,
    /// Judges whether a node is still settling.
    clock: Arc<dyn Now>,
}

impl Default for NodeIndex {
    /// No settle: a node is trusted the moment it is seen Ready.
    fn default() -> Self {
        let window = FencePolicy {
            settle: Duration::ZERO,
            timeout: None,
            grace_margin: Duration::ZERO,
        };
        NodeIndex::new(window, Arc::new(SystemNow))
    }
}

/// Why a deletion seen before the Node watch first listed is fenced.
pub const NODES_NOT_LISTED: &str = "the controller had not listed Nodes yet when the pod was deleted: its node's readiness then is unknown";

/// A node's Ready condition changed in a way worth a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The node is not Ready (newly seen so, or no longer Ready).
    NotReady {
        /// The node.
        node: String,
        /// Its Ready status.
        status: String,
    },
    /// The node is Ready again.
    ReadyAgain {
        /// The node.
        node: String,
    },
}

impl NodeIndex {
    /// No nodes yet; a node seen Ready again is distrusted for a while (`window`'s settle, or
    /// a pod's grace plus its margin) on `clock`.
    pub fn new(window: FencePolicy, clock: Arc<dyn Now>) -> Self {
        NodeIndex {
            nodes: HashMap::new(),
            read: HashMap::new(),
            listed: false,
            window,
            clock,
        }
    }

    /// A node's readiness, if the Node exists.
    pub fn node(&self, name: &str) -> Option<&NodeReadiness> {
        self.nodes.get(name)
    }

    /// Why a pod deleted now from `node` must be fenced: its node exists and is not Ready, or
    /// was seen Ready again less than the settle ago. A pod never scheduled, or bound to a Node
    /// that is gone, ran nowhere that can be trusted less than the operator's word.
    pub fn distrust(&self, node: Option<&str>) -> Option<String> {
        self.distrust_pod(node, None)
    }

    /// [`distrust`](Self::distrust) of a pod with termination grace `grace_seconds` (`None`:
    /// unknown, the settle alone): a node Ready again is distrusted until the settle or the
    /// grace plus the margin has passed, whichever is longer.
    pub fn distrust_pod(&self, node: Option<&str>, grace_seconds: Option<i64>) -> Option<String> {
        let grace = grace_seconds.map_or(Duration::ZERO, |s| {
            Duration::from_secs(s.max(0).unsigned_abs())
        });
        let window = match grace_seconds {
            Some(_) => self.window.settle_for(grace),
            None => self.window.settle,
        };
        distrust(self.node(node?), self.clock.now(), window)
    }

    /// Why the pod of tombstone `t`, deleted now, must be fenced: as
    /// [`distrust`](Self::distrust) once the Nodes are listed, or, on a node trusted to stop
    /// it, because it was deleted before its kubelet had stopped it; before the list, any pod
    /// bound to a node (the node may be down now, and Ready again by the time the list comes).
    pub fn distrust_deleted(&self, t: &Tombstone) -> Option<String> {
        let node = t.node.as_deref();
        match node {
            Some(_) if !self.listed => Some(NODES_NOT_LISTED.to_owned()),
            _ => self.distrust_pod(node, t.grace_seconds).or_else(|| {
                // Only where a kubelet is to stop it: a Node that exists and is not declared
                // powered off.
                let n = self.node(node?)?;
                (!n.out_of_service)
                    .then(|| deleted_before_stopped(t.terminal, t.mirror, t.grace_seconds))?
            }),
        }
    }

    /// The Node watch listed every Node.
    pub fn set_listed(&mut self) {
        self.listed = true;
    }

    /// Nodes that are not Ready.
    pub fn unready(&self) -> usize {
        self.nodes.values().filter(|r| !r.is_ready()).count()
    }

    /// Records a Node observed at `seen` (this process's clock).
    pub fn upsert(&mut self, node: &NodeReadyView, seen: Instant) -> Option<Transition> {
        let name = node.metadata.name.clone().unwrap_or_default();
        let before = self.nodes.get(&name);
        let now = readiness_of(node, before, seen);
        let was = before.map(NodeReadiness::is_ready);
        let transition = if was != Some(now.is_ready()) && !now.is_ready() {
            Some(Transition::NotReady {
                node: name.clone(),
                status: now.status.clone(),
            })
        } else if now.ready_again.is_some() && now.ready_again != before.and_then(|b| b.ready_again)
        {
            // Seen not Ready before, or through a NotReady this process never saw.
            Some(Transition::ReadyAgain { node: name.clone() })
        } else {
            None
        };
        self.nodes.insert(name, now);
        transition
    }

    /// Forgets a Node.
    pub fn remove(&mut self, name: &str) {
        self.nodes.remove(name);
        self.read.remove(name);
    }

    /// Records a fresh read of `name` (a GET) begun at `began` that found it `ready`; one that
    /// did not forgets the last Ready read.
    pub fn record_read(&mut self, name: &str, began: Instant, ready: bool) {
        if ready {
            self.read.insert(name.to_owned(), began);
        } else {
            self.read.remove(name);
        }
    }

    /// Whether a fresh read of `name` that found it Ready began at or after `since`.
    pub fn read_since(&self, name: &str, since: Instant) -> bool {
        self.read.get(name).is_some_and(|at| *at >= since)
    }

    /// The Nodes known.
    pub fn names(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }
}

/// The Ready condition of a Node (`missing` when it has none yet), given what was known of it
/// before and when this observation was made. Ready counts from our own first observation of
/// it (the node's `lastTransitionTime` is the node's clock, which may lag); a node seen not
/// Ready before is Ready again from that observation. So is a node seen Ready twice whose
/// Ready condition changed its `lastTransitionTime` in between: it went through a NotReady
/// this process never saw (a watch gap and a re-list, a watch that lagged behind a fresh
/// read), and its kubelet may still be stopping pods deleted while it was away.
pub fn readiness_of(
    node: &NodeReadyView,
    before: Option<&NodeReadiness>,
    seen: Instant,
) -> NodeReadiness {
    let (status, reason) = match &node.ready {
        Some(c) => (c.status.clone(), c.reason.clone()),
        None => ("missing".into(), None),
    };
    let ready = status == "True";
    let stamp = node
        .ready
        .as_ref()
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0);
    let missed_cycle = ready
        && before.is_some_and(|b| {
            b.is_ready() && b.ready_stamp.is_some() && stamp.is_some() && b.ready_stamp != stamp
        });
    let before = before.filter(|_| !missed_cycle);
    let ready_seen = ready.then(|| before.and_then(|b| b.ready_seen).unwrap_or(seen));
    let ready_again = match before {
        _ if !ready => None,
        _ if missed_cycle => Some(seen),
        Some(b) if !b.is_ready() => Some(seen),
        Some(b) => b.ready_again,
        None => None,
    };
    NodeReadiness {
        status,
        reason,
        ready_seen,
        out_of_service: node.out_of_service,
        ready_again,
        ready_stamp: stamp
            .or_else(|| before.and_then(|b| b.ready_stamp))
            .filter(|_| ready),
    }
}
