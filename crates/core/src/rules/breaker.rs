//! The blast-radius breaker, pure: a sweep that would free more than a share of a pool, counting
//! what the sweeps freed there in the last [`BREAKER_WINDOW`], is held for an operator, and a
//! hold is reported once per episode, not once per sweep. An operator approves a pool's hold
//! once (its releases go in that sweep; the approval is then used up), up to the number it
//! names: a held set that grew since the operator saw it stays held.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Pools with at most this many allocations are never held.
pub const BREAKER_MIN_POOL: usize = 10;

/// Sweep releases within this long count toward the ratio together: candidates whose graces
/// end at different moments would otherwise drain a pool a few per sweep, each sweep under it.
pub const BREAKER_WINDOW: Duration = Duration::from_secs(600);

/// A pool held by this sweep that was not held before (report it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewHold {
    /// The pool.
    pub pool: String,
    /// Releases the sweep would make in it.
    pub releases: usize,
    /// Its allocations.
    pub size: usize,
    /// Released in it by the sweeps of the last [`BREAKER_WINDOW`], before this one.
    pub recent: usize,
}

/// An operator's approval of a pool's hold: releases it lets go at most (`None`: any).
pub type Approval = Option<usize>;

/// The approval annotation's value for at most `releases` (any when `None`), given `at`.
pub fn approval_value(releases: Option<usize>, at: jiff::Timestamp) -> String {
    match releases {
        Some(n) => format!("at-most={n}; approved-at={at}"),
        None => at.to_string(),
    }
}

/// The approval an annotation value gives: an `at-most=N` among its `;`-separated parts bounds
/// it (a bound that does not read as a number approves none: the hold stays and says so); a
/// value without one (a bare timestamp, `kubectl annotate ...=yes`) approves any.
pub fn approval_of(value: &str) -> Approval {
    let bounds = value.split(';').filter_map(|part| {
        let (key, n) = part.split_once('=').unwrap_or((part, ""));
        key.trim()
            .eq_ignore_ascii_case("at-most")
            .then(|| n.trim().parse().unwrap_or(0))
    });
    bounds.min()
}

/// An approval whose bound is under what the sweep would release: held still.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgrown {
    pub pool: String,
    /// What the approval lets go at most.
    pub approved: usize,
    /// What the sweep would release.
    pub releases: usize,
}

/// What the breaker says of one sweep.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Pools whose releases are held this sweep.
    pub held: BTreeSet<String>,
    /// Of those, the ones newly held.
    pub new: Vec<NewHold>,
    /// Pools over the ratio whose releases go anyway: an operator approved them.
    pub approved: BTreeSet<String>,
    /// Pools over the ratio with an approval of fewer releases than the sweep would make.
    pub outgrown: Vec<Outgrown>,
}

/// The breaker, the pools it held at the last sweep, and what the sweeps released lately.
#[derive(Debug, Default)]
pub struct Breaker {
    held: HashSet<String>,
    /// Per pool: when the sweeps released how many, within [`BREAKER_WINDOW`].
    recent: HashMap<String, VecDeque<(Instant, usize)>>,
}

impl Breaker {
    /// Judges a sweep's confirmed releases per pool at `now`: held when they and the sweeps'
    /// releases of the last [`BREAKER_WINDOW`] are more than `max_ratio` of the pool as it was
    /// before those (its size now plus them). Pools in `unconfirmed` (their candidates could
    /// not be confirmed this time) keep a hold they had: a failed confirming list ends no hold,
    /// or its next success would report the same hold again. A pool in `approved` is not held
    /// (its releases go) unless the approval names fewer releases: then it is held and
    /// `outgrown`. What the sweeps freed is told with [`record`](Self::record).
    pub fn judge(
        &mut self,
        releases: &BTreeMap<String, usize>,
        size: impl Fn(&str) -> usize,
        max_ratio: f64,
        unconfirmed: &HashSet<String>,
        approved: &HashMap<String, Approval>,
        now: Instant,
    ) -> Verdict {
        self.forget_before(now);
        let mut verdict = Verdict::default();
        for (pool, &n) in releases {
            let size = size(pool);
            let recent = self.recent_releases(pool);
            let base = size + recent;
            if base > BREAKER_MIN_POOL && ((recent + n) as f64) > max_ratio * base as f64 {
                match approved.get(pool) {
                    Some(None) => {
                        verdict.approved.insert(pool.clone());
                        continue;
                    }
                    Some(Some(at_most)) if n <= *at_most => {
                        verdict.approved.insert(pool.clone());
                        continue;
                    }
                    Some(Some(at_most)) => verdict.outgrown.push(Outgrown {
                        pool: pool.clone(),
                        approved: *at_most,
                        releases: n,
                    }),
                    None => {}
                }
                if !self.held.contains(pool) {
                    verdict.new.push(NewHold {
                        pool: pool.clone(),
                        releases: n,
                        size,
                        recent,
                    });
                }
                verdict.held.insert(pool.clone());
            }
        }
        let kept = self
            .held
            .intersection(unconfirmed)
            .filter(|p| !verdict.approved.contains(*p))
            .cloned();
        let mut now: HashSet<String> = verdict.held.iter().cloned().collect();
        now.extend(kept);
        self.held = now;
        verdict
    }

    /// Pools held at the last sweep.
    pub fn held(&self) -> &HashSet<String> {
        &self.held
    }

    /// Records that a sweep at `at` freed `n` addresses of `pool` (what the writer answered,
    /// not what was asked: a dry run or a refused patch frees nothing). Approved releases
    /// count too: an approval lets one held set go, not the sweeps after it.
    pub fn record(&mut self, pool: &str, n: usize, at: Instant) {
        if n > 0 {
            self.recent
                .entry(pool.to_owned())
                .or_default()
                .push_back((at, n));
        }
    }

    /// Takes back `n` of what was recorded for `pool` at `at`: a caller that records its
    /// releases when they are judged (a reservation, so that concurrent callers see them)
    /// gives back what the writer then did not free.
    pub fn take_back(&mut self, pool: &str, mut n: usize, at: Instant) {
        let Some(r) = self.recent.get_mut(pool) else {
            return;
        };
        for (when, m) in r.iter_mut().rev() {
            if n == 0 {
                break;
            }
            if *when == at {
                let k = n.min(*m);
                *m -= k;
                n -= k;
            }
        }
        r.retain(|(_, m)| *m > 0);
        if r.is_empty() {
            self.recent.remove(pool);
        }
    }

    fn recent_releases(&self, pool: &str) -> usize {
        self.recent
            .get(pool)
            .map_or(0, |r| r.iter().map(|(_, n)| n).sum())
    }

    fn forget_before(&mut self, now: Instant) {
        for r in self.recent.values_mut() {
            while r
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= BREAKER_WINDOW)
            {
                r.pop_front();
            }
        }
        self.recent.retain(|_, r| !r.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn releases(of: &[(&str, usize)]) -> BTreeMap<String, usize> {
        of.iter().map(|(p, n)| (p.to_string(), *n)).collect()
    }

    fn set(pools: &[&str]) -> HashSet<String> {
        pools.iter().map(|p| p.to_string()).collect()
    }

    /// Approvals of any number of releases for `pools`.
    fn approvals(pools: &[&str]) -> HashMap<String, Approval> {
        pools.iter().map(|p| (p.to_string(), None)).collect()
    }

    fn base() -> Instant {
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(Instant::now)
    }

    /// A whole window after the last call on this test's thread: sweeps that share no window.
    fn apart() -> Instant {
        thread_local!(static SWEEPS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) });
        let n = SWEEPS.with(|c| {
            c.set(c.get() + 1);
            c.get()
        });
        base() + BREAKER_WINDOW * n
    }

    /// A sweep at `at` that would free `n` of pool "a", `left` allocations now, ratio 0.5;
    /// what it was let free is recorded as freed.
    fn sweep_a(b: &mut Breaker, n: usize, left: usize, approved: &[&str], at: Instant) -> Verdict {
        let approved = approvals(approved);
        let v = b.judge(
            &releases(&[("a", n)]),
            |_| left,
            0.5,
            &set(&[]),
            &approved,
            at,
        );
        if !v.held.contains("a") {
            b.record("a", n, at);
        }
        v
    }

    #[test]
    fn sweeps_that_each_free_a_little_are_held_once_together_they_pass_the_ratio() {
        // 100 entries; each sweep a minute apart frees 10 (each under half of what is left).
        let mut b = Breaker::default();
        let mut left = 100;
        let minute = Duration::from_secs(60);
        for k in 0..5 {
            let v = sweep_a(&mut b, 10, left, &[], base() + minute * k);
            assert!(v.held.is_empty(), "sweep {k}: {} freed so far", 100 - left);
            left -= 10;
        }
        let v = sweep_a(&mut b, 10, left, &[], base() + minute * 5);
        assert_eq!(
            v.new,
            [NewHold {
                pool: "a".into(),
                releases: 10,
                size: 50,
                recent: 50
            }],
            "60 of the 100 within the window"
        );
        // Once the first releases are a window old, they no longer count: 40 + 10 of 90.
        let v = sweep_a(&mut b, 10, left, &[], base() + BREAKER_WINDOW + minute);
        assert!(v.held.is_empty(), "{v:?}");
    }

    #[test]
    fn what_is_taken_back_no_longer_counts() {
        let mut b = Breaker::default();
        let (t0, t1) = (base(), base() + Duration::from_secs(1));
        b.record("a", 3, t0);
        b.record("a", 3, t1);
        b.take_back("a", 2, t1);
        b.take_back("a", 5, t0 + Duration::from_millis(1)); // nothing recorded then
        b.take_back("b", 1, t0); // nor in that pool
        assert_eq!(b.recent_releases("a"), 4);
        b.take_back("a", 9, t0);
        assert_eq!(b.recent_releases("a"), 1, "at most what was recorded then");
        b.take_back("a", 1, t1);
        assert!(b.recent.is_empty());
    }

    #[test]
    fn what_was_not_freed_does_not_count() {
        // A dry run, or patches refused: the same 15 are judged every sweep, nothing recorded.
        let mut b = Breaker::default();
        for k in 0..20 {
            let at = base() + Duration::from_secs(60) * k;
            let v = b.judge(
                &releases(&[("a", 15)]),
                |_| 100,
                0.5,
                &set(&[]),
                &approvals(&[]),
                at,
            );
            assert!(v.held.is_empty(), "sweep {k}: {v:?}");
        }
    }

    #[test]
    fn an_approval_lets_one_held_set_go_and_the_next_sweep_over_the_ratio_is_held_again() {
        let mut b = Breaker::default();
        sweep_a(&mut b, 40, 100, &[], base());
        let v = sweep_a(&mut b, 20, 60, &["a"], base());
        assert_eq!(v.approved, BTreeSet::from(["a".to_string()]));
        // 20 of the 40 left: 80 of the 100 within the window, held again.
        let v = sweep_a(&mut b, 20, 40, &[], base());
        assert_eq!(v.held, BTreeSet::from(["a".to_string()]), "{v:?}");
    }

    /// Judges a sweep freeing `of` from pools of 100 at ratio 0.5, a window after the last.
    fn judge100(
        b: &mut Breaker,
        of: &[(&str, usize)],
        unconfirmed: &[&str],
        approved: &[&str],
    ) -> Verdict {
        let (unconfirmed, approved) = (set(unconfirmed), approvals(approved));
        b.judge(
            &releases(of),
            |_| 100,
            0.5,
            &unconfirmed,
            &approved,
            apart(),
        )
    }

    #[test]
    fn a_sweep_freeing_more_than_the_ratio_of_a_pool_is_held_and_reported_once() {
        let mut b = Breaker::default();
        let sweep = [("a", 60), ("b", 50)];
        let v = judge100(&mut b, &sweep, &[], &[]);
        assert_eq!(
            v.held,
            BTreeSet::from(["a".to_string()]),
            "50 of 100 is not over 0.5"
        );
        assert_eq!(
            v.new,
            [NewHold {
                pool: "a".into(),
                releases: 60,
                size: 100,
                recent: 0
            }]
        );
        // The same episode: held, not reported again.
        let v = judge100(&mut b, &sweep, &[], &[]);
        assert_eq!(v.held.len(), 1);
        assert!(v.new.is_empty());
        // Under the ratio: the hold is over; a new one is reported anew.
        judge100(&mut b, &[("a", 10)], &[], &[]);
        assert!(b.held().is_empty());
        assert_eq!(judge100(&mut b, &sweep, &[], &[]).new.len(), 1);
    }

    #[test]
    fn a_small_pool_is_never_held() {
        let mut b = Breaker::default();
        let v = b.judge(
            &releases(&[("tiny", 10)]),
            |_| BREAKER_MIN_POOL,
            0.1,
            &set(&[]),
            &approvals(&[]),
            apart(),
        );
        assert_eq!(v, Verdict::default());
    }

    #[test]
    fn a_hold_survives_a_sweep_that_could_not_confirm_its_candidates() {
        let mut b = Breaker::default();
        judge100(&mut b, &[("a", 90), ("b", 90)], &[], &[]);
        // "a" could not be confirmed (the list failed): still held, not reported anew later.
        let v = judge100(&mut b, &[], &["a"], &[]);
        assert!(v.held.is_empty(), "nothing to hold this sweep");
        assert_eq!(b.held(), &set(&["a"]));
        assert!(judge100(&mut b, &[("a", 90)], &[], &[]).new.is_empty());
        // Confirmed and under the ratio: the hold is over.
        judge100(&mut b, &[], &[], &[]);
        assert!(b.held().is_empty());
    }

    #[test]
    fn an_approved_hold_releases_once_and_ends_the_hold() {
        let mut b = Breaker::default();
        let sweep = [("a", 90)];
        assert_eq!(judge100(&mut b, &sweep, &[], &[]).held.len(), 1);
        let v = judge100(&mut b, &sweep, &[], &["a"]);
        assert!(v.held.is_empty(), "approved: its releases go");
        assert_eq!(v.approved, BTreeSet::from(["a".to_string()]));
        assert!(b.held().is_empty());
        // The approval used up (removed), the next sweep over the ratio holds anew.
        let v = judge100(&mut b, &sweep, &[], &[]);
        assert_eq!(v.new.len(), 1);
        // An approval of a pool under the ratio changes nothing.
        let v = judge100(&mut b, &[("b", 1)], &[], &["b"]);
        assert!(v.approved.is_empty());
    }

    #[test]
    fn an_approval_of_fewer_releases_than_the_sweep_would_make_keeps_the_hold() {
        let mut b = Breaker::default();
        let judge = |b: &mut Breaker, n: usize, at_most: usize| {
            let approved = HashMap::from([("a".to_string(), Some(at_most))]);
            b.judge(
                &releases(&[("a", n)]),
                |_| 100,
                0.5,
                &set(&[]),
                &approved,
                apart(),
            )
        };
        assert_eq!(judge100(&mut b, &[("a", 60)], &[], &[]).new.len(), 1);
        // The held set grew from the 60 approved to 75: held, not reported as a new hold.
        let v = judge(&mut b, 75, 60);
        assert_eq!(v.held, BTreeSet::from(["a".to_string()]));
        assert!(v.new.is_empty() && v.approved.is_empty(), "{v:?}");
        let outgrown = Outgrown {
            pool: "a".into(),
            approved: 60,
            releases: 75,
        };
        assert_eq!(v.outgrown, [outgrown]);
        // Up to the number approved, it goes.
        let v = judge(&mut b, 60, 60);
        assert_eq!(v.approved, BTreeSet::from(["a".to_string()]));
        assert!(v.held.is_empty() && v.outgrown.is_empty(), "{v:?}");
    }

    #[test]
    fn approval_values_bound_the_approval_or_approve_any() {
        let at: jiff::Timestamp = "2026-11-28T06:00:00Z".parse().unwrap();
        assert_eq!(approval_of(&approval_value(Some(12), at)), Some(12));
        assert_eq!(approval_of(&approval_value(None, at)), None);
        // What `kubectl annotate` writes by hand approves any number.
        for any in ["yes", "", "2026-11-28T06:00:00Z", "at-most-ish=3"] {
            assert_eq!(approval_of(any), None, "{any:?}");
        }
        assert_eq!(approval_of(" At-Most = 3 "), Some(3));
        // A bound typed wrong approves none (held, and the Event says so), never any.
        let wrongs = [
            "at-most=many",
            "at-most=-1",
            "at-most=",
            "at-most",
            "at-most=12,",
            "x; at-most=1e9",
        ];
        for wrong in wrongs {
            assert_eq!(approval_of(wrong), Some(0), "{wrong:?}");
        }
        assert_eq!(
            approval_of("at-most=; at-most=5"),
            Some(0),
            "the least bound"
        );
    }
}
