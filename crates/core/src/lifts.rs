//! Which fences lift now, pure: the fence lifter's decisions over one pass of the index, with
//! what it keeps across passes (when this process first saw each fence, on its own clock, and
//! which reports it has made in their episode). The controller's lifter is a loop around it:
//! it reads the index, asks [`FenceBook::judge`], then writes and reports what it says.

use std::collections::HashSet;
use std::time::Duration;

use crate::index::{FencedEntry, NodeIndex, Slot};
use crate::rules::fence::{
    AgentReports, FenceClock, FencePolicy, Lift, Moment, NodeReadiness, Rejected, lift_with_reports,
};
use crate::seen::{Once, Seen};

/// A fence as the lifter's clock knows it: its entry and the deleted pod's uid (a new fence of
/// the same entry starts its own settle).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SeenFence {
    slot: Slot,
    uid: String,
}

impl SeenFence {
    fn of(f: &FencedEntry) -> SeenFence {
        SeenFence {
            slot: Slot::new(&f.pool, &f.entry.key),
            uid: f.record.uid.clone(),
        }
    }
}

/// What the lifter keeps across passes.
#[derive(Debug, Default)]
pub struct FenceBook {
    /// When this process first saw each fence: settles count on its clock.
    first_seen: Seen<SeenFence>,
    /// Node agent reports rejected, as (fence uid, why): reported once.
    rejected: Once<(String, Rejected)>,
    /// Fences (by object uid) whose lift the agent's "still present" keeps back: reported once
    /// each time.
    kept_by_agent: Once<String>,
    /// Fences kept because a replacement lists their address: reported once each.
    kept_for_replacement: Once<Slot>,
}

/// What one pass decides; fences are named by their place in the pass's list.
#[derive(Debug, Default, PartialEq)]
pub struct Decisions {
    /// Fences that lift now, and why (on the leader only).
    pub lifts: Vec<(usize, Lift)>,
    /// Fences that would lift but whose address a replacement of the deleted pod lists (the
    /// entry may be its own): never lifted; newly so, to report once.
    pub newly_kept_for_replacement: Vec<(usize, Lift)>,
    /// Node agent reports that do not count, newly so, to report once each.
    pub newly_rejected: Vec<(usize, Rejected)>,
    /// Fences whose timer lift the agent's "still present" keeps back, newly so, to report once.
    pub newly_kept_by_agent: Vec<usize>,
    /// Fences that stay.
    pub staying: i64,
    /// The age of the oldest fence that stays.
    pub oldest: Duration,
    /// Fences whose lift the agent's "still present" keeps back now.
    pub kept_by_agent: usize,
}

/// What one fence's judgement has new to report.
#[derive(Debug, Default)]
struct Noted {
    rejected: Vec<Rejected>,
    kept_by_agent: bool,
}

/// How long ago a fence was set (by its record).
fn age_of(f: &FencedEntry, now: Moment) -> Duration {
    Duration::try_from(now.wall.duration_since(f.record.since)).unwrap_or_default()
}

impl FenceBook {
    /// Judges `fenced` at `now`: `listed_by_replacement`, the slots whose address the live pod
    /// of the fenced podref (another pod) lists; `nodes`, the nodes' readiness; `policy`, the
    /// fencing rules (`None`: fencing is off, every fence lifts); `leader`, whether this
    /// replica writes (a standby judges, to report, and lifts nothing).
    pub fn judge(
        &mut self,
        fenced: &[FencedEntry],
        listed_by_replacement: &HashSet<Slot>,
        nodes: &NodeIndex,
        policy: Option<&FencePolicy>,
        leader: bool,
        now: Moment,
    ) -> Decisions {
        let keys: HashSet<SeenFence> = fenced.iter().map(SeenFence::of).collect();
        self.first_seen.keep_only(|k| keys.contains(k));
        let uids: HashSet<&str> = fenced.iter().map(|f| f.object.uid.as_str()).collect();
        self.rejected
            .keep_only(|(uid, _)| uids.contains(uid.as_str()));
        self.kept_by_agent
            .keep_only(|uid| uids.contains(uid.as_str()));
        self.kept_for_replacement
            .keep_only(|s| listed_by_replacement.contains(s));
        let mut out = Decisions::default();
        for (i, f) in fenced.iter().enumerate() {
            let first = self.first_seen.first(SeenFence::of(f), now.mono);
            let fence = FenceClock {
                set: Moment {
                    // An IPFence's record time, already no earlier than its creation.
                    wall: f.record.since,
                    mono: first,
                },
                grace: f.record.grace(),
            };
            let node = nodes.node(&f.record.node);
            let lifts = match policy {
                Some(policy) => {
                    let (lifts, noted) = self.lift(f, fence, node, now, policy);
                    out.newly_rejected
                        .extend(noted.rejected.into_iter().map(|why| (i, why)));
                    if noted.kept_by_agent {
                        out.newly_kept_by_agent.push(i);
                    }
                    lifts
                }
                None => Some(Lift::FencingOff),
            };
            let slot = Slot::new(&f.pool, &f.entry.key);
            let replaced = listed_by_replacement.contains(&slot);
            match lifts {
                Some(_) if !leader => out.staying += 1,
                Some(why) if replaced => {
                    if self.kept_for_replacement.first(slot) {
                        out.newly_kept_for_replacement.push((i, why));
                    }
                    out.staying += 1;
                    out.oldest = out.oldest.max(age_of(f, now));
                }
                Some(why) => out.lifts.push((i, why)),
                None => {
                    out.staying += 1;
                    out.oldest = out.oldest.max(age_of(f, now));
                }
            }
        }
        out.kept_by_agent = self.kept_by_agent.len();
        out
    }

    /// Whether fence `f` lifts, its node agent's reports counted; and what is new to report:
    /// reports that do not count, and a hold by the agent (once per episode each).
    fn lift(
        &mut self,
        f: &FencedEntry,
        fence: FenceClock,
        node: Option<&NodeReadiness>,
        now: Moment,
        policy: &FencePolicy,
    ) -> (Option<Lift>, Noted) {
        let identity = f.identity();
        let fence_uid = identity.fence_uid;
        let reports = AgentReports::from(&f.evidence);
        let verdict = lift_with_reports(fence, identity, &reports, node, now, policy);
        let mut noted = Noted::default();
        for why in verdict.rejected {
            if self.rejected.first((fence_uid.to_owned(), why)) {
                noted.rejected.push(why);
            }
        }
        if !verdict.kept_by_agent {
            self.kept_by_agent.end(fence_uid);
        } else {
            noted.kept_by_agent = self.kept_by_agent.first(fence_uid.to_owned());
        }
        (verdict.lift, noted)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::api::{IPFenceStatus, ObjectId, SandboxReport};
    use crate::fixtures::fence_record;
    use crate::ipam::PoolEntry;

    const POLICY: FencePolicy = FencePolicy {
        settle: Duration::from_secs(60),
        timeout: None,
        grace_margin: Duration::from_secs(15),
    };

    /// The fence of entry `key` (record node `n`, pod uid `u`), with the agent's "gone"
    /// report from `report_node`, if any.
    fn fence(key: &str, report_node: Option<&str>) -> FencedEntry {
        let sandboxes_gone = report_node.map(|node| SandboxReport {
            node: node.into(),
            pod_uid: "u".into(),
            fence_uid: format!("uid-{key}"),
            observed_at: "2026-11-29T01:00:00Z".into(),
        });
        FencedEntry {
            pool: "p".into(),
            entry: PoolEntry {
                key: key.into(),
                offset: key.parse().unwrap(),
                ip: format!("192.0.2.{key}").parse().unwrap(),
                id: format!("sb-{key}"),
                podref: "ns/web-0:fenced".into(),
                ifname: Some("net1".into()),
            },
            record: fence_record("ns/web-0"),
            object: ObjectId {
                name: format!("p-{key}"),
                uid: format!("uid-{key}"),
            },
            evidence: IPFenceStatus {
                sandboxes_gone,
                ..Default::default()
            },
        }
    }

    /// Node `n`, the fences' node, seen not Ready at `t0`.
    fn down(t0: Instant) -> NodeIndex {
        let mut nodes = NodeIndex::default();
        nodes.upsert(&crate::fixtures::node("n", Some("Unknown")), t0);
        nodes
    }

    fn at(mono: Instant) -> Moment {
        Moment {
            wall: "2026-11-29T01:00:00Z".parse().unwrap(),
            mono,
        }
    }

    #[test]
    fn a_report_from_another_node_is_noted_once_per_episode_and_never_lifts() {
        let t0 = Instant::now();
        let mut book = FenceBook::default();
        let nodes = down(t0);
        let forged = [fence("5", Some("other-node"))];
        let none = HashSet::new();
        let d = book.judge(&forged, &none, &nodes, Some(&POLICY), true, at(t0));
        assert_eq!(d.lifts, []);
        assert_eq!(d.newly_rejected, [(0, Rejected::WrongNode)]);
        assert_eq!(d.staying, 1);
        let again = book.judge(&forged, &none, &nodes, Some(&POLICY), true, at(t0));
        assert_eq!(again.newly_rejected, [], "said once");
        // The fence goes (lifted by hand) and comes back: a new episode, said again.
        book.judge(&[], &none, &nodes, Some(&POLICY), true, at(t0));
        let back = book.judge(&forged, &none, &nodes, Some(&POLICY), true, at(t0));
        assert_eq!(back.newly_rejected, [(0, Rejected::WrongNode)]);
    }

    #[test]
    fn the_agents_gone_report_lifts_on_the_leader_only_and_never_under_a_replacement() {
        let t0 = Instant::now();
        let nodes = down(t0);
        let gone = [fence("5", Some("n")), fence("6", Some("n"))];
        let none = HashSet::new();
        let mut book = FenceBook::default();
        let standby = book.judge(&gone, &none, &nodes, Some(&POLICY), false, at(t0));
        assert_eq!((standby.lifts.len(), standby.staying), (0, 2));
        let leader = book.judge(&gone, &none, &nodes, Some(&POLICY), true, at(t0));
        assert_eq!(
            leader.lifts,
            [(0, Lift::SandboxesGone), (1, Lift::SandboxesGone)]
        );
        // A replacement lists 6's address: kept, said once.
        let replaced = HashSet::from([Slot::new("p", "6")]);
        let kept = book.judge(&gone, &replaced, &nodes, Some(&POLICY), true, at(t0));
        assert_eq!(kept.lifts, [(0, Lift::SandboxesGone)]);
        assert_eq!(kept.newly_kept_for_replacement, [(1, Lift::SandboxesGone)]);
        let still = book.judge(&gone, &replaced, &nodes, Some(&POLICY), true, at(t0));
        assert_eq!(still.newly_kept_for_replacement, []);
        assert_eq!(still.staying, 1);
    }

    #[test]
    fn with_fencing_off_every_fence_lifts_and_with_it_on_a_down_nodes_fence_is_held() {
        let t0 = Instant::now();
        let nodes = down(t0);
        let none = HashSet::new();
        let mut book = FenceBook::default();
        let off = book.judge(&[fence("5", None)], &none, &nodes, None, true, at(t0));
        assert_eq!(off.lifts, [(0, Lift::FencingOff)]);
        // Fencing on, no report, the node not Ready: it stays, however long this replica watches.
        let later = at(t0 + Duration::from_secs(3600));
        let on = book.judge(
            &[fence("5", None)],
            &none,
            &nodes,
            Some(&POLICY),
            true,
            later,
        );
        assert_eq!((on.lifts.len(), on.staying), (0, 1));
    }
}
