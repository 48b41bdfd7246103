//! The sweep's grace clock, pure: a leak candidate is due only once it has been garbage, for
//! the same reason, for its whole grace; a pod that lists the address again restarts it.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use super::{Judged, Reason};
use crate::seen::Seen;

/// How long a candidate must stay garbage before it is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Graces {
    /// For every reason but a missing pod.
    pub leak: Duration,
    /// For an allocation whose pod does not exist at all.
    pub missing_pod: Duration,
}

impl Graces {
    fn of(&self, reason: Reason) -> Duration {
        match reason {
            Reason::PodMissing => self.missing_pod,
            _ => self.leak,
        }
    }
}

/// A candidate across sweeps: its pool, key and sandbox (a new allocation at the key is
/// another candidate).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CandidateKey {
    pool: String,
    key: String,
    id: String,
}

/// One candidate as a sweep saw it.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The allocation judged.
    pub judged: Judged,
    /// Why it is garbage.
    pub reason: Reason,
    /// When its pod last stopped listing the address, if it did lately.
    pub last_listed: Option<Instant>,
}

/// What one sweep's candidates come to.
#[derive(Debug, Default)]
pub struct Tally {
    /// Candidates whose grace has passed, with their reason.
    pub due: Vec<(Judged, Reason)>,
    /// When the next candidate's grace ends.
    pub next_due: Option<Instant>,
    /// The age of the oldest candidate.
    pub oldest: Duration,
    /// Candidates per reason code (every reason listed, zeros included).
    pub counts: BTreeMap<&'static str, i64>,
}

/// When each candidate was first seen garbage, for its reason (another reason is another
/// sighting: its grace starts again).
#[derive(Debug, Default)]
pub struct GraceClock {
    seen: Seen<(CandidateKey, Reason)>,
}

impl GraceClock {
    /// Counts this sweep's candidates at `now`; forgets those not seen again.
    pub fn tally(&mut self, candidates: Vec<Candidate>, now: Instant, graces: &Graces) -> Tally {
        let mut tally = Tally {
            counts: Reason::ALL.iter().map(|r| (r.as_str(), 0)).collect(),
            ..Default::default()
        };
        let mut seen = HashSet::with_capacity(candidates.len());
        for c in candidates {
            *tally.counts.entry(c.reason.as_str()).or_default() += 1;
            let key = CandidateKey {
                pool: c.judged.pool.clone(),
                key: c.judged.entry.key.to_string(),
                id: c.judged.entry.id.clone(),
            };
            let key = (key, c.reason);
            self.seen.first(key.clone(), now);
            // The pod listed the address after the grace began (between sweeps): it begins again.
            if let Some(at) = c.last_listed {
                self.seen.restart_at(&key, at);
            }
            let first = self.seen.since(&key).unwrap_or(now);
            seen.insert(key);
            let age = now.saturating_duration_since(first);
            tally.oldest = tally.oldest.max(age);
            let grace = graces.of(c.reason);
            if age >= grace {
                tally.due.push((c.judged, c.reason));
            } else {
                let at = first + grace;
                tally.next_due = Some(tally.next_due.map_or(at, |n| n.min(at)));
            }
        }
        self.seen.keep_only(|k| seen.contains(k));
        tally
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::PoolEntry;
    use crate::rules::{Decision, PodRef};

    const GRACES: Graces = Graces {
        leak: Duration::from_secs(60),
        missing_pod: Duration::from_secs(30),
    };

    fn candidate(key: &str, id: &str, reason: Reason) -> Candidate {
        let entry = PoolEntry {
            key: key.into(),
            offset: key.parse().unwrap(),
            ip: format!("192.0.2.{key}").parse().unwrap(),
            id: id.into(),
            podref: "ns/a".into(),
            ifname: None,
        };
        Candidate {
            judged: Judged {
                pool: "p".into(),
                entry,
                decision: Decision::Candidate(reason),
                network: "ns/net".into(),
                pod: PodRef::from_podref("ns/a", String::new()),
                node: None,
            },
            reason,
            last_listed: None,
        }
    }

    fn due_keys(t: &Tally) -> Vec<&str> {
        t.due.iter().map(|(j, _)| j.entry.key.as_str()).collect()
    }

    #[test]
    fn a_candidate_is_due_after_its_grace_and_the_next_due_time_is_told() {
        let t0 = Instant::now();
        let mut clock = GraceClock::default();
        let sweep = || {
            vec![
                candidate("1", "sb", Reason::IPNotOnPod),
                candidate("2", "sb", Reason::PodMissing),
            ]
        };
        let first = clock.tally(sweep(), t0, &GRACES);
        assert!(first.due.is_empty());
        assert_eq!(first.next_due, Some(t0 + GRACES.missing_pod));
        assert_eq!(first.counts["IPNotOnPod"], 1);
        assert_eq!(first.counts["PodDeleted"], 0, "every reason is listed");
        let later = clock.tally(sweep(), t0 + GRACES.missing_pod, &GRACES);
        assert_eq!(due_keys(&later), ["2"]);
        assert_eq!(later.oldest, GRACES.missing_pod);
        assert_eq!(
            due_keys(&clock.tally(sweep(), t0 + GRACES.leak, &GRACES)),
            ["1", "2"]
        );
    }

    #[test]
    fn a_new_reason_a_new_sandbox_or_a_gap_in_sightings_starts_the_grace_again() {
        let t0 = Instant::now();
        let mut clock = GraceClock::default();
        // A sweep that sees key "1" only, held by sandbox `id`, for `reason`.
        fn sweep(clock: &mut GraceClock, id: &str, reason: Reason, at: Instant) -> Tally {
            clock.tally(vec![candidate("1", id, reason)], at, &GRACES)
        }
        sweep(&mut clock, "sb", Reason::IPNotOnPod, t0);
        let at = t0 + GRACES.leak;
        // Another reason: garbage for another cause, counted from now.
        let changed = sweep(&mut clock, "sb", Reason::PodTerminal, at);
        assert!(changed.due.is_empty());
        // Another sandbox at the key is another allocation.
        let t1 = at + GRACES.leak;
        let other = sweep(&mut clock, "sb-2", Reason::PodTerminal, t1);
        assert!(other.due.is_empty());
        // Not seen in a sweep: forgotten, so it starts again when seen.
        clock.tally(vec![], t1, &GRACES);
        let t2 = t1 + GRACES.leak;
        let back = sweep(&mut clock, "sb-2", Reason::PodTerminal, t2);
        assert!(back.due.is_empty());
    }

    #[test]
    fn a_pod_that_listed_the_address_after_the_grace_began_restarts_it() {
        let t0 = Instant::now();
        let mut clock = GraceClock::default();
        clock.tally(vec![candidate("1", "sb", Reason::IPNotOnPod)], t0, &GRACES);
        let mut listed = candidate("1", "sb", Reason::IPNotOnPod);
        listed.last_listed = Some(t0 + Duration::from_secs(50));
        let t = clock.tally(vec![listed.clone()], t0 + GRACES.leak, &GRACES);
        assert!(t.due.is_empty(), "listed 10 s ago");
        assert_eq!(t.next_due, Some(t0 + Duration::from_secs(50) + GRACES.leak));
        let t = clock.tally(vec![listed], t0 + Duration::from_secs(110), &GRACES);
        assert_eq!(due_keys(&t), ["1"]);
    }
}
