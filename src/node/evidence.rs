//! Which fenced pods' sandboxes are gone from this node: the evidence the agent reports so that
//! the controller lifts a fence at once. Pure: listings and fences come in as arguments.
//!
//! Each fenced pod goes through podlife's lifecycle tracker as a pod the kubelet must kill
//! (it was deleted from the API): terminating while a sandbox of it runs, terminated once its
//! sandboxes are stopped but still there, finished once the runtime lists none of them. Only
//! absence counts: a stopped sandbox still holds its network namespace until it is removed.
//!
//! A listing counts for a fence only if it started after the agent saw the fence: the fence
//! is seen when `n` listings had completed, listing `n + 1` may have begun before that, so
//! listing `n + 2` is the first to count. A failed listing is no listing (the runtime view is
//! only updated by a complete one), and an agent that just started has seen no listing.

use std::collections::{HashMap, HashSet};

use podlife::lifecycle::{LifecycleTracker, PodState, PodUpdate, UpdateKind};

use crate::seen::Once;

/// A fence of this node, as read from its `IPFence` object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The object's name.
    pub name: String,
    /// The object's uid (the report names it).
    pub uid: String,
    /// `spec.node`.
    pub node: String,
    /// `spec.uid`: the deleted pod's uid.
    pub pod_uid: String,
    /// `spec.sandbox`: the entry's sandbox id.
    pub sandbox: String,
    /// Its status already holds a "gone" report for this object.
    pub reported: bool,
    /// Its status already holds a "still present" report for this object.
    pub present_reported: bool,
}

/// One complete, successful listing of the runtime.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Its number: listings completed since the agent started, this one included.
    pub number: u64,
    /// Pods (uid) with at least one sandbox listed.
    pub pods: HashSet<String>,
    /// Pods (uid) with a sandbox Ready.
    pub ready: HashSet<String>,
    /// Every sandbox id listed.
    pub sandboxes: HashSet<String>,
    /// Sandboxes without pod metadata, and live containers whose sandbox is not listed: any
    /// of them might be a fenced pod's (and hold its network namespace).
    pub unattributed: usize,
}

/// What a report says of a fenced pod's sandboxes on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportKind {
    /// None is listed: the fence may lift at once.
    Gone,
    /// One is still listed (its kubelet is still stopping it): the fence must not lift on a
    /// timer meanwhile.
    Present,
}

/// A report to write on a fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The fence object's name.
    pub name: String,
    /// Its uid.
    pub fence_uid: String,
    /// The pod's uid.
    pub pod_uid: String,
    /// What it says.
    pub kind: ReportKind,
}

/// Why a fence listed for this node is not looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skipped {
    /// Its `spec.node` is another node (a label that does not match its spec).
    OtherNode,
    /// It has no pod uid (written by an older release): it waits the settle.
    NoPodUid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// Waiting for evidence; not before listing `from`.
    Waiting { from: u64, failures: u32 },
    /// A report is being written (after `failures` failed ones).
    InFlight { failures: u32 },
    /// Reported (or the object already says so).
    Done,
}

/// Where the "still present" report of a fence stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Present {
    /// Not written (nor due: no counting listing has listed a sandbox of the pod).
    No,
    /// Being written (after `failures` failed writes).
    InFlight { failures: u32 },
    /// Written, or the object already says so.
    Written,
    /// Failed `failures` times: due again from listing `from` (a refusal that lasts is not
    /// asked again every relist).
    Failed { from: u64, failures: u32 },
}

impl Present {
    /// Whether it is to be written at listing `n` (its pod's sandbox listed).
    fn due(self, n: u64) -> bool {
        match self {
            Present::No => true,
            Present::Failed { from, .. } => n >= from,
            Present::InFlight { .. } | Present::Written => false,
        }
    }

    /// Failed writes so far.
    fn failures(self) -> u32 {
        match self {
            Present::InFlight { failures } | Present::Failed { failures, .. } => failures,
            Present::No | Present::Written => 0,
        }
    }
}

/// Listings to wait after the `failures`th failed report (doubling, up to the longest).
fn retry_after(failures: u32) -> u64 {
    2u64.saturating_pow(failures.min(6)).min(MAX_RETRY_LISTINGS)
}

#[derive(Debug)]
struct Watched {
    fence: Fence,
    /// The "gone" report.
    progress: Progress,
    /// The "still present" report: written once, before "gone" and never after it.
    present: Present,
}

/// Fences of this node and their pods' lifecycles.
#[derive(Debug)]
pub struct Evidence {
    node: String,
    fences: HashMap<String, Watched>,
    tracker: LifecycleTracker<String, String>,
    /// First listing that may advance each tracked pod.
    from: HashMap<String, u64>,
    skipped: Once<String>,
}

/// Longest wait, in listings, after a failed report.
const MAX_RETRY_LISTINGS: u64 = 64;

impl Evidence {
    /// No fences yet, on node `node`.
    pub fn new(node: &str) -> Self {
        Evidence {
            node: node.to_owned(),
            fences: HashMap::new(),
            tracker: LifecycleTracker::new(),
            from: HashMap::new(),
            skipped: Once::default(),
        }
    }

    /// The fences listed for this node now, read when `listings` listings had completed.
    /// Returns the ones newly skipped, with why (to log once).
    pub fn set_fences(
        &mut self,
        fences: impl IntoIterator<Item = Fence>,
        listings: u64,
    ) -> Vec<(Fence, Skipped)> {
        let mut skipped = Vec::new();
        let mut present = HashSet::new();
        let mut listed = HashSet::new();
        for f in fences {
            listed.insert(f.uid.clone());
            let why = if f.node != self.node {
                Some(Skipped::OtherNode)
            } else if f.pod_uid.is_empty() {
                Some(Skipped::NoPodUid)
            } else {
                None
            };
            if let Some(why) = why {
                if self.skipped.first(f.uid.clone()) {
                    skipped.push((f, why));
                }
                continue;
            }
            present.insert(f.uid.clone());
            let from = listings + 2;
            if self.tracker.state(&f.pod_uid).is_none() {
                self.from.insert(f.pod_uid.clone(), from);
            }
            // Deleted from the API: the pod must stop (a runtime-only kill).
            let kill = PodUpdate::runtime(UpdateKind::Kill, f.pod_uid.clone());
            self.tracker.update(f.pod_uid.clone(), kill);
            let w = self.fences.entry(f.uid.clone()).or_insert_with(|| Watched {
                fence: f.clone(),
                progress: Progress::Waiting { from, failures: 0 },
                present: Present::No,
            });
            if f.reported {
                w.progress = Progress::Done;
            } else if f.present_reported && matches!(w.progress, Progress::Done) {
                // The status holds one report: a "present" that landed after this agent's
                // "gone" (a retry, an earlier process's request) replaced it, and would hold
                // the fence for good. Say "gone" again (a watch that has not shown our "gone"
                // yet costs one more write).
                w.progress = Progress::Waiting { from, failures: 0 };
            }
            if f.present_reported
                && !matches!(w.present, Present::InFlight { .. } | Present::Written)
            {
                w.present = Present::Written;
            }
        }
        self.fences.retain(|uid, _| present.contains(uid));
        self.skipped.keep_only(|uid| listed.contains(uid));
        skipped
    }

    /// A listing completed: advances the fenced pods and returns the reports due.
    pub fn listed(&mut self, l: &Listing) -> Vec<Report> {
        for key in self.tracker.pending() {
            // The kill is this agent's work item: it acts by looking, never by stopping.
            self.tracker.next_work(&key);
        }
        // The fence's own sandbox id counts too: a static pod's runtime uid is not its API
        // (mirror) pod's, so its uid alone would look gone while its sandbox runs.
        let sandboxes_of = |pod: &str| {
            self.fences
                .values()
                .filter(|w| w.fence.pod_uid == pod)
                .any(|w| l.sandboxes.contains(&w.fence.sandbox))
        };
        let mut advance = Vec::new();
        for (pod, from) in &self.from {
            if l.number < *from {
                continue;
            }
            let listed = l.pods.contains(pod) || sandboxes_of(pod);
            let gone = !listed && l.unattributed == 0;
            advance.push((pod.clone(), l.ready.contains(pod), gone));
        }
        for (pod, running, gone) in advance {
            if !running {
                self.tracker.complete_terminating(&pod);
            }
            if gone {
                self.tracker.complete_terminated(&pod);
            }
        }
        let mut reports = Vec::new();
        for w in self.fences.values_mut() {
            let Progress::Waiting { from, failures } = w.progress else {
                continue;
            };
            let f = &w.fence;
            // Finished is final, so look at this listing again: it must list nothing of the pod.
            let listed = l.pods.contains(&f.pod_uid) || l.sandboxes.contains(&f.sandbox);
            let absent = !listed && l.unattributed == 0;
            if l.number < from {
                continue;
            }
            let report = |kind| Report {
                name: f.name.clone(),
                fence_uid: f.uid.clone(),
                pod_uid: f.pod_uid.clone(),
                kind,
            };
            // "Gone" waits for a "present" in flight: written after it, it would be overwritten.
            if absent
                && !matches!(w.present, Present::InFlight { .. })
                && self.tracker.state(&f.pod_uid) == Some(PodState::Finished)
            {
                w.progress = Progress::InFlight { failures };
                reports.push(report(ReportKind::Gone));
            } else if listed && w.present.due(l.number) {
                w.present = Present::InFlight {
                    failures: w.present.failures(),
                };
                reports.push(report(ReportKind::Present));
            }
        }
        let desired: HashSet<String> = self
            .fences
            .values()
            .map(|w| w.fence.pod_uid.clone())
            .collect();
        // Finished pods no longer fenced are forgotten; others keep being driven.
        self.tracker.sync_known(&desired);
        let tracker = &self.tracker;
        self.from.retain(|pod, _| tracker.state(pod).is_some());
        // Every "still present" first: it holds a settle lift, a "gone" only lifts sooner.
        reports.sort_by(|a, b| {
            let gone = |r: &Report| r.kind == ReportKind::Gone;
            (gone(a), &a.name).cmp(&(gone(b), &b.name))
        });
        reports
    }

    /// A report was written (`ok`) or failed, when `listings` listings had completed; a failed
    /// "gone" is due again after a delay that doubles, a failed "present" at the next listing
    /// that still lists the pod.
    pub fn reported(&mut self, fence_uid: &str, kind: ReportKind, ok: bool, listings: u64) {
        let Some(w) = self.fences.get_mut(fence_uid) else {
            return;
        };
        if kind == ReportKind::Present {
            let failures = w.present.failures();
            w.present = match ok {
                true => Present::Written,
                false => Present::Failed {
                    from: listings + retry_after(failures),
                    failures: failures + 1,
                },
            };
            return;
        }
        let failures = match w.progress {
            Progress::Waiting { failures, .. } | Progress::InFlight { failures } => failures,
            Progress::Done => 0,
        };
        w.progress = if ok {
            Progress::Done
        } else {
            Progress::Waiting {
                from: listings + retry_after(failures),
                failures: failures + 1,
            }
        };
    }

    /// Tracked pods by lifecycle state.
    pub fn states(&self) -> HashMap<PodState, usize> {
        let mut out = HashMap::new();
        for pod in self.from.keys() {
            if let Some(s) = self.tracker.state(pod) {
                *out.entry(s).or_default() += 1;
            }
        }
        out
    }

    /// The lifecycle state of pod `uid`, if tracked.
    pub fn state(&self, pod_uid: &str) -> Option<PodState> {
        self.tracker.state(&pod_uid.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(uid: &str, pod: &str) -> Fence {
        Fence {
            name: format!("pool-{uid}"),
            uid: uid.into(),
            node: "node-a".into(),
            pod_uid: pod.into(),
            sandbox: format!("sb-{pod}"),
            reported: false,
            present_reported: false,
        }
    }

    /// Listing `n`, with `running` pods (a Ready sandbox) and `stopped` ones (sandboxes
    /// listed, none Ready).
    fn listing(n: u64, running: &[&str], stopped: &[&str]) -> Listing {
        let all = running.iter().chain(stopped);
        Listing {
            number: n,
            pods: all.clone().map(|p| p.to_string()).collect(),
            ready: running.iter().map(|p| p.to_string()).collect(),
            sandboxes: all.map(|p| format!("sb-{p}")).collect(),
            unattributed: 0,
        }
    }

    /// The fences of the "gone" reports.
    fn names(r: &[Report]) -> Vec<&str> {
        r.iter()
            .filter(|r| r.kind == ReportKind::Gone)
            .map(|r| r.fence_uid.as_str())
            .collect()
    }

    /// The fences of the "still present" reports.
    fn present(r: &[Report]) -> Vec<&str> {
        r.iter()
            .filter(|r| r.kind == ReportKind::Present)
            .map(|r| r.fence_uid.as_str())
            .collect()
    }

    #[test]
    fn a_pod_is_reported_only_once_its_sandboxes_are_gone_not_while_stopped() {
        let mut e = Evidence::new("node-a");
        assert!(e.set_fences([fence("f1", "p1")], 5).is_empty());
        assert_eq!(e.state("p1"), Some(PodState::Terminating));
        assert_eq!(present(&e.listed(&listing(7, &["p1"], &[]))), ["f1"]);
        assert_eq!(e.state("p1"), Some(PodState::Terminating), "running");
        e.reported("f1", ReportKind::Present, true, 7);
        assert!(e.listed(&listing(8, &[], &["p1"])).is_empty());
        assert_eq!(
            e.state("p1"),
            Some(PodState::Terminated),
            "stopped, still there"
        );
        let r = e.listed(&listing(9, &[], &[]));
        assert_eq!(
            r,
            [Report {
                name: "pool-f1".into(),
                fence_uid: "f1".into(),
                pod_uid: "p1".into(),
                kind: ReportKind::Gone,
            }]
        );
        assert_eq!(e.state("p1"), Some(PodState::Finished));
        assert!(e.listed(&listing(10, &[], &[])).is_empty(), "in flight");
        e.reported("f1", ReportKind::Gone, true, 10);
        assert!(e.listed(&listing(11, &[], &[])).is_empty(), "done");
        // The fence lifted: the finished pod is forgotten.
        e.set_fences([], 11);
        e.listed(&listing(12, &[], &[]));
        assert_eq!(e.state("p1"), None);
    }

    #[test]
    fn only_a_listing_that_began_after_the_fence_was_seen_counts() {
        // Seen when 5 listings had completed: listing 6 may have begun before.
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f1", "p1")], 5);
        assert!(e.listed(&listing(6, &[], &[])).is_empty());
        assert_eq!(e.state("p1"), Some(PodState::Terminating));
        assert_eq!(names(&e.listed(&listing(7, &[], &[]))), ["f1"]);
    }

    #[test]
    fn an_agent_that_just_started_reports_nothing_before_its_second_listing() {
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f1", "p1")], 0);
        assert!(e.listed(&listing(1, &[], &[])).is_empty());
        assert_eq!(names(&e.listed(&listing(2, &[], &[]))), ["f1"]);
    }

    #[test]
    fn a_listed_sandbox_of_the_fence_or_one_without_metadata_is_never_gone() {
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f1", "p1")], 0);
        // The pod's uid is not listed, but the fence's sandbox id is.
        let mut l = listing(2, &[], &[]);
        l.sandboxes.insert("sb-p1".into());
        let r = e.listed(&l);
        assert_eq!((names(&r), present(&r)), (vec![], vec!["f1"]));
        e.reported("f1", ReportKind::Present, true, 2);
        let mut l = listing(3, &[], &[]);
        l.unattributed = 1;
        assert!(e.listed(&l).is_empty());
        assert_ne!(e.state("p1"), Some(PodState::Finished));
        assert_eq!(names(&e.listed(&listing(4, &[], &[]))), ["f1"]);
    }

    #[test]
    fn fences_of_another_node_or_without_a_pod_uid_are_skipped_and_said_once() {
        let mut e = Evidence::new("node-a");
        let other = Fence {
            node: "node-b".into(),
            ..fence("f1", "p1")
        };
        let old = fence("f2", "");
        let skipped = e.set_fences([other.clone(), old.clone()], 0);
        assert_eq!(
            skipped
                .iter()
                .map(|(f, why)| (f.uid.as_str(), *why))
                .collect::<Vec<_>>(),
            [("f1", Skipped::OtherNode), ("f2", Skipped::NoPodUid)]
        );
        assert!(e.set_fences([other, old], 0).is_empty(), "once");
        assert!(e.listed(&listing(5, &[], &[])).is_empty());
        assert_eq!(e.state("p1"), None);
    }

    #[test]
    fn a_new_fence_of_a_finished_pod_waits_for_a_listing_after_it() {
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f1", "p1")], 0);
        assert_eq!(names(&e.listed(&listing(2, &[], &[]))), ["f1"]);
        e.reported("f1", ReportKind::Gone, true, 2);
        // A second fence of the same pod (another address), seen at listing 10.
        e.set_fences([fence("f1", "p1"), fence("f2", "p1")], 10);
        assert!(e.listed(&listing(11, &[], &[])).is_empty());
        assert_eq!(names(&e.listed(&listing(12, &[], &[]))), ["f2"]);
    }

    #[test]
    fn a_fence_already_reported_on_its_object_is_not_reported_again_and_failures_back_off() {
        let mut e = Evidence::new("node-a");
        let done = Fence {
            reported: true,
            ..fence("f1", "p1")
        };
        e.set_fences([done, fence("f2", "p2")], 0);
        assert_eq!(names(&e.listed(&listing(2, &[], &[]))), ["f2"]);
        e.reported("f2", ReportKind::Gone, false, 2);
        assert!(e.listed(&listing(2, &[], &[])).is_empty());
        assert_eq!(names(&e.listed(&listing(3, &[], &[]))), ["f2"]);
        e.reported("f2", ReportKind::Gone, false, 3);
        assert!(e.listed(&listing(4, &[], &[])).is_empty(), "doubled");
        assert_eq!(names(&e.listed(&listing(5, &[], &[]))), ["f2"]);
    }

    #[test]
    fn a_sandbox_still_listed_is_reported_present_once_and_gone_waits_for_that_write() {
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f1", "p1")], 0);
        // Listing 1 may have begun before the fence was seen: it says nothing.
        assert!(e.listed(&listing(1, &["p1"], &[])).is_empty());
        assert_eq!(present(&e.listed(&listing(2, &["p1"], &[]))), ["f1"]);
        // Gone while "present" is in flight: "gone" waits for it (written after, it would be
        // overwritten and the fence held for good).
        assert!(e.listed(&listing(3, &[], &[])).is_empty());
        e.reported("f1", ReportKind::Present, true, 3);
        assert_eq!(names(&e.listed(&listing(4, &[], &[]))), ["f1"]);
        // A failed "present" is written again while the pod is listed, after a delay that
        // doubles (a refusal that lasts is not asked again every relist).
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f2", "p2")], 0);
        assert_eq!(present(&e.listed(&listing(2, &["p2"], &[]))), ["f2"]);
        e.reported("f2", ReportKind::Present, false, 2);
        assert_eq!(present(&e.listed(&listing(3, &[], &["p2"]))), ["f2"]);
        e.reported("f2", ReportKind::Present, false, 3);
        assert!(
            e.listed(&listing(4, &[], &["p2"])).is_empty(),
            "waits 2 listings"
        );
        assert_eq!(present(&e.listed(&listing(5, &[], &["p2"]))), ["f2"]);
        // The object already says so (an agent restart): not written again.
        let mut e = Evidence::new("node-a");
        let said = Fence {
            present_reported: true,
            ..fence("f3", "p3")
        };
        e.set_fences([said], 0);
        assert!(e.listed(&listing(2, &["p3"], &[])).is_empty());
    }

    #[test]
    fn every_still_present_report_goes_before_any_gone() {
        // A returning node with many fences: the ones whose sandbox runs hold a settle lift
        // and must not queue behind those that only lift sooner.
        let mut e = Evidence::new("node-a");
        e.set_fences(
            [
                fence("a", "gone-a"),
                fence("b", "run-b"),
                fence("c", "gone-c"),
            ],
            0,
        );
        e.listed(&listing(1, &["run-b"], &[]));
        let reports = e.listed(&listing(2, &["run-b"], &[]));
        let kinds: Vec<(ReportKind, &str)> = reports
            .iter()
            .map(|r| (r.kind, r.fence_uid.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                (ReportKind::Present, "b"),
                (ReportKind::Gone, "a"),
                (ReportKind::Gone, "c")
            ]
        );
    }

    #[test]
    fn a_late_present_that_replaced_gone_on_the_object_is_answered_with_gone_again() {
        let mut e = Evidence::new("node-a");
        e.set_fences([fence("f1", "p1")], 0);
        assert_eq!(names(&e.listed(&listing(2, &[], &[]))), ["f1"]);
        e.reported("f1", ReportKind::Gone, true, 2);
        // The object now says "present" alone: a late write replaced the "gone".
        let replaced = Fence {
            present_reported: true,
            ..fence("f1", "p1")
        };
        e.set_fences([replaced], 5);
        assert!(e.listed(&listing(6, &[], &[])).is_empty());
        assert_eq!(names(&e.listed(&listing(7, &[], &[]))), ["f1"]);
        e.reported("f1", ReportKind::Gone, true, 7);
        // The object says "gone": done, nothing more.
        let gone = Fence {
            reported: true,
            ..fence("f1", "p1")
        };
        e.set_fences([gone], 8);
        assert!(e.listed(&listing(12, &[], &[])).is_empty());
    }
}
