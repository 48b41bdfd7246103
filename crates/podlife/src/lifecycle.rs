//! A pod lifecycle tracker after the kubelet's pod workers: each pod moves
//! syncing -> terminating -> terminated -> finished, only the latest pending update is kept,
//! and a periodic [`sync_known`](LifecycleTracker::sync_known) drives pods that are no longer
//! desired to termination and forgets finished ones.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// Where a pod is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PodState {
    /// Wanted and being kept in sync.
    Syncing,
    /// Asked to stop; its containers may still run.
    Terminating,
    /// Stopped; its resources are being cleaned up.
    Terminated,
    /// Done; forgotten at the next `sync_known` unless still desired.
    Finished,
}

/// The kind of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpdateKind {
    /// The pod appeared.
    Create,
    /// The pod changed.
    Update,
    /// A periodic resync.
    Sync,
    /// The pod must stop.
    Kill,
}

/// An update for a pod, carrying the caller's view of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUpdate<P> {
    /// What kind of update.
    pub kind: UpdateKind,
    /// The pod as the caller knows it.
    pub pod: P,
    /// The pod is known only from the runtime (no desired spec).
    pub runtime_only: bool,
}

impl<P> PodUpdate<P> {
    /// An update of a desired pod.
    pub fn new(kind: UpdateKind, pod: P) -> Self {
        PodUpdate {
            kind,
            pod,
            runtime_only: false,
        }
    }

    /// An update of a pod known only from the runtime.
    pub fn runtime(kind: UpdateKind, pod: P) -> Self {
        PodUpdate {
            kind,
            pod,
            runtime_only: true,
        }
    }
}

/// What the tracker did with an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateOutcome {
    /// It is now the pod's pending update.
    Accepted,
    /// It did not apply (a non-kill update of a runtime-only pod, or of a stopping pod).
    Ignored,
    /// A create arrived while the previous pod with this key is still stopping: it was not
    /// merged; the key is forgotten once finished so that the caller can create it anew.
    RestartRequested,
}

/// The next piece of work for a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Work<P> {
    /// The state the worker acts in.
    pub state: PodState,
    /// The update to act on.
    pub update: PodUpdate<P>,
}

/// A pod's state as returned by [`LifecycleTracker::sync_known`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownPod {
    /// Its state.
    pub state: PodState,
    /// Known to the tracker but no longer desired.
    pub orphan: bool,
}

#[derive(Debug)]
struct Tracked<P> {
    state: PodState,
    pending: Option<PodUpdate<P>>,
    last: Option<PodUpdate<P>>,
    runtime_only: bool,
    restart_requested: bool,
}

/// Pods by identity with their lifecycle state.
#[derive(Debug)]
pub struct LifecycleTracker<K, P> {
    pods: HashMap<K, Tracked<P>>,
}

impl<K, P> Default for LifecycleTracker<K, P> {
    fn default() -> Self {
        LifecycleTracker {
            pods: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq + Clone, P: Clone> LifecycleTracker<K, P> {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Offers an update for `key`.
    pub fn update(&mut self, key: K, update: PodUpdate<P>) -> UpdateOutcome {
        let kill = update.kind == UpdateKind::Kill;
        let Some(t) = self.pods.get_mut(&key) else {
            if update.runtime_only && !kill {
                return UpdateOutcome::Ignored;
            }
            let state = if kill {
                PodState::Terminating
            } else {
                PodState::Syncing
            };
            self.pods.insert(
                key,
                Tracked {
                    state,
                    runtime_only: update.runtime_only,
                    pending: Some(update),
                    last: None,
                    restart_requested: false,
                },
            );
            return UpdateOutcome::Accepted;
        };
        if t.runtime_only && !kill {
            return UpdateOutcome::Ignored;
        }
        match t.state {
            PodState::Syncing => {
                if kill {
                    t.state = PodState::Terminating;
                }
                t.pending = Some(update);
                UpdateOutcome::Accepted
            }
            _ if update.kind == UpdateKind::Create => {
                t.restart_requested = true;
                UpdateOutcome::RestartRequested
            }
            PodState::Terminating if kill => {
                t.pending = Some(update);
                UpdateOutcome::Accepted
            }
            _ => UpdateOutcome::Ignored,
        }
    }

    /// Takes the pending update of `key` as the work to do now.
    pub fn next_work(&mut self, key: &K) -> Option<Work<P>> {
        let t = self.pods.get_mut(key)?;
        let update = t.pending.take()?;
        t.last = Some(update.clone());
        Some(Work {
            state: t.state,
            update,
        })
    }

    /// Keys that have a pending update.
    pub fn pending(&self) -> Vec<K> {
        self.pods
            .iter()
            .filter(|(_, t)| t.pending.is_some())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Records that `key`'s containers have stopped. Returns false if it was not terminating.
    pub fn complete_terminating(&mut self, key: &K) -> bool {
        self.advance(key, PodState::Terminating, PodState::Terminated)
    }

    /// Records that `key`'s cleanup is done. Returns false if it was not terminated.
    pub fn complete_terminated(&mut self, key: &K) -> bool {
        self.advance(key, PodState::Terminated, PodState::Finished)
    }

    fn advance(&mut self, key: &K, from: PodState, to: PodState) -> bool {
        match self.pods.get_mut(key) {
            Some(t) if t.state == from => {
                t.state = to;
                true
            }
            _ => false,
        }
    }

    /// The state of `key`, if tracked.
    pub fn state(&self, key: &K) -> Option<PodState> {
        self.pods.get(key).map(|t| t.state)
    }

    /// Whether a create arrived for `key` while it was stopping.
    pub fn restart_requested(&self, key: &K) -> bool {
        self.pods.get(key).is_some_and(|t| t.restart_requested)
    }

    /// Reconciles with the set of desired keys: finished pods that are orphaned or awaiting a
    /// restart are forgotten; orphans that are not yet finished get a kill (the last update
    /// replayed) so they keep moving toward termination. Returns each remaining key's state.
    pub fn sync_known(&mut self, desired: &HashSet<K>) -> HashMap<K, KnownPod> {
        self.pods.retain(|k, t| {
            t.state != PodState::Finished || (desired.contains(k) && !t.restart_requested)
        });
        let mut known = HashMap::with_capacity(self.pods.len());
        for (k, t) in &mut self.pods {
            let orphan = !desired.contains(k);
            if orphan && t.state != PodState::Finished && t.pending.is_none() {
                if t.state == PodState::Syncing {
                    t.state = PodState::Terminating;
                }
                if let Some(last) = &t.last {
                    t.pending = Some(PodUpdate {
                        kind: UpdateKind::Kill,
                        ..last.clone()
                    });
                }
            } else if orphan && t.state == PodState::Syncing {
                // A pending non-kill update becomes a kill of the same pod.
                t.state = PodState::Terminating;
                if let Some(p) = &mut t.pending {
                    p.kind = UpdateKind::Kill;
                }
            }
            known.insert(
                k.clone(),
                KnownPod {
                    state: t.state,
                    orphan,
                },
            );
        }
        known
    }

    /// Number of tracked pods.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no pod is tracked.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Tracker = LifecycleTracker<&'static str, &'static str>;

    #[test]
    fn only_the_latest_pending_update_is_kept() {
        let mut t = Tracker::new();
        t.update("p", PodUpdate::new(UpdateKind::Create, "v1"));
        t.update("p", PodUpdate::new(UpdateKind::Update, "v2"));
        let work = t.next_work(&"p").unwrap();
        assert_eq!(work.update.pod, "v2");
        assert_eq!(work.state, PodState::Syncing);
        assert_eq!(t.next_work(&"p"), None, "taken once");
    }

    #[test]
    fn update_pod_for_runtime_pod() {
        let mut t = Tracker::new();
        // A runtime-only pod is never started.
        assert_eq!(
            t.update("r", PodUpdate::runtime(UpdateKind::Create, "r")),
            UpdateOutcome::Ignored
        );
        assert_eq!(t.state(&"r"), None);
        // But it can be killed.
        assert_eq!(
            t.update("r", PodUpdate::runtime(UpdateKind::Kill, "r")),
            UpdateOutcome::Accepted
        );
        assert_eq!(t.state(&"r"), Some(PodState::Terminating));
        // Further non-kill updates for it are ignored.
        assert_eq!(
            t.update("r", PodUpdate::runtime(UpdateKind::Update, "r2")),
            UpdateOutcome::Ignored
        );
        let work = t.next_work(&"r").unwrap();
        assert_eq!(work.update.kind, UpdateKind::Kill);
        assert_eq!(work.update.pod, "r");
        assert!(t.complete_terminating(&"r"));
        assert!(t.complete_terminated(&"r"));
        assert!(
            t.sync_known(&HashSet::new()).is_empty(),
            "finished runtime pod forgotten"
        );
    }

    #[test]
    fn create_while_terminating_requests_restart() {
        let mut t = Tracker::new();
        t.update("p", PodUpdate::new(UpdateKind::Create, "old"));
        t.next_work(&"p");
        t.update("p", PodUpdate::new(UpdateKind::Kill, "old"));
        assert_eq!(
            t.update("p", PodUpdate::new(UpdateKind::Create, "new")),
            UpdateOutcome::RestartRequested
        );
        assert!(t.restart_requested(&"p"));
        let work = t.next_work(&"p").unwrap();
        assert_eq!(
            work.update.pod, "old",
            "the create is not merged into the old pod"
        );
        assert_eq!(work.state, PodState::Terminating);
        assert!(t.complete_terminating(&"p"));
        assert_eq!(
            t.update("p", PodUpdate::new(UpdateKind::Create, "new")),
            UpdateOutcome::RestartRequested,
            "still stopping while terminated"
        );
        assert!(t.complete_terminated(&"p"));
        let desired = HashSet::from(["p"]);
        assert!(
            !t.sync_known(&desired).contains_key("p"),
            "forgotten so it can restart"
        );
        assert_eq!(
            t.update("p", PodUpdate::new(UpdateKind::Create, "new")),
            UpdateOutcome::Accepted
        );
        assert_eq!(t.state(&"p"), Some(PodState::Syncing));
        assert_eq!(t.next_work(&"p").unwrap().update.pod, "new");
    }

    #[test]
    fn sync_known_pods_drives_orphans() {
        let mut t = Tracker::new();
        for k in ["kept", "orphan", "finished", "stuck"] {
            t.update(k, PodUpdate::new(UpdateKind::Create, k));
            t.next_work(&k);
        }
        // "finished" ran to the end; "stuck" is terminating but its worker gave up.
        t.update("finished", PodUpdate::new(UpdateKind::Kill, "finished"));
        t.next_work(&"finished");
        t.complete_terminating(&"finished");
        t.complete_terminated(&"finished");
        t.update("stuck", PodUpdate::new(UpdateKind::Kill, "stuck"));
        t.next_work(&"stuck");

        let desired = HashSet::from(["kept"]);
        let known = t.sync_known(&desired);
        assert_eq!(known.len(), 3);
        assert_eq!(
            known["kept"],
            KnownPod {
                state: PodState::Syncing,
                orphan: false
            }
        );
        assert_eq!(
            known["orphan"],
            KnownPod {
                state: PodState::Terminating,
                orphan: true
            }
        );
        assert_eq!(
            known["stuck"],
            KnownPod {
                state: PodState::Terminating,
                orphan: true
            }
        );
        assert!(!known.contains_key("finished"));

        // Orphans got a kill replaying their last update; the desired pod got nothing.
        let work = t.next_work(&"orphan").unwrap();
        assert_eq!(
            (work.update.kind, work.update.pod),
            (UpdateKind::Kill, "orphan")
        );
        let work = t.next_work(&"stuck").unwrap();
        assert_eq!(
            (work.update.kind, work.update.pod),
            (UpdateKind::Kill, "stuck")
        );
        assert_eq!(t.next_work(&"kept"), None);

        // Once the orphan finishes, the next sync forgets it.
        t.complete_terminating(&"orphan");
        t.complete_terminated(&"orphan");
        let known = t.sync_known(&desired);
        assert!(!known.contains_key("orphan"));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn an_orphan_with_a_pending_update_gets_it_turned_into_a_kill() {
        let mut t = Tracker::new();
        t.update("p", PodUpdate::new(UpdateKind::Create, "p"));
        let known = t.sync_known(&HashSet::new());
        assert_eq!(
            known["p"],
            KnownPod {
                state: PodState::Terminating,
                orphan: true
            }
        );
        assert_eq!(t.next_work(&"p").unwrap().update.kind, UpdateKind::Kill);
    }
}
