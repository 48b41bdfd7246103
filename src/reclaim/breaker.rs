//! The blast-radius breaker, pure: a sweep that would free more than a share of a pool is held
//! for an operator, and a hold is reported once per episode, not once per sweep. An operator
//! approves a pool's hold once (its releases go in that sweep; the approval is then used up).

use std::collections::{BTreeMap, BTreeSet, HashSet};

/// Pools with at most this many allocations are never held.
pub const BREAKER_MIN_POOL: usize = 10;

/// A pool held by this sweep that was not held before (report it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewHold {
    /// The pool.
    pub pool: String,
    /// Releases the sweep would make in it.
    pub releases: usize,
    /// Its allocations.
    pub size: usize,
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
}

/// The breaker and the pools it held at the last sweep.
#[derive(Debug, Default)]
pub struct Breaker {
    held: HashSet<String>,
}

impl Breaker {
    /// Judges a sweep's confirmed releases per pool against `max_ratio` of each pool's size.
    /// Pools in `unconfirmed` (their candidates could not be confirmed this time) keep a hold
    /// they had: a failed confirming list ends no hold, or its next success would report the
    /// same hold again. A pool in `approved` is not held: its releases go.
    pub fn judge(
        &mut self,
        releases: &BTreeMap<String, usize>,
        size: impl Fn(&str) -> usize,
        max_ratio: f64,
        unconfirmed: &HashSet<String>,
        approved: &HashSet<String>,
    ) -> Verdict {
        let mut verdict = Verdict::default();
        for (pool, &n) in releases {
            let size = size(pool);
            if size > BREAKER_MIN_POOL && (n as f64) > max_ratio * size as f64 {
                if approved.contains(pool) {
                    verdict.approved.insert(pool.clone());
                    continue;
                }
                if !self.held.contains(pool) {
                    verdict.new.push(NewHold {
                        pool: pool.clone(),
                        releases: n,
                        size,
                    });
                }
                verdict.held.insert(pool.clone());
            }
        }
        let kept = self
            .held
            .intersection(unconfirmed)
            .filter(|p| !approved.contains(*p))
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn releases(of: &[(&str, usize)]) -> BTreeMap<String, usize> {
        of.iter().map(|(p, n)| (p.to_string(), *n)).collect()
    }

    fn set(pools: &[&str]) -> HashSet<String> {
        pools.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn a_sweep_freeing_more_than_the_ratio_of_a_pool_is_held_and_reported_once() {
        let mut b = Breaker::default();
        let size = |_: &str| 100;
        let sweep = releases(&[("a", 60), ("b", 50)]);
        let v = b.judge(&sweep, size, 0.5, &set(&[]), &set(&[]));
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
                size: 100
            }]
        );
        // The same episode: held, not reported again.
        let v = b.judge(&sweep, size, 0.5, &set(&[]), &set(&[]));
        assert_eq!(v.held.len(), 1);
        assert!(v.new.is_empty());
        // Under the ratio: the hold is over; a new one is reported anew.
        b.judge(&releases(&[("a", 10)]), size, 0.5, &set(&[]), &set(&[]));
        assert!(b.held().is_empty());
        assert_eq!(
            b.judge(&sweep, size, 0.5, &set(&[]), &set(&[])).new.len(),
            1
        );
    }

    #[test]
    fn a_small_pool_is_never_held() {
        let mut b = Breaker::default();
        let v = b.judge(
            &releases(&[("tiny", 10)]),
            |_| BREAKER_MIN_POOL,
            0.1,
            &set(&[]),
            &set(&[]),
        );
        assert_eq!(v, Verdict::default());
    }

    #[test]
    fn a_hold_survives_a_sweep_that_could_not_confirm_its_candidates() {
        let mut b = Breaker::default();
        let size = |_: &str| 100;
        b.judge(
            &releases(&[("a", 90), ("b", 90)]),
            size,
            0.5,
            &set(&[]),
            &set(&[]),
        );
        // "a" could not be confirmed (the list failed): still held, not reported anew later.
        let v = b.judge(&releases(&[]), size, 0.5, &set(&["a"]), &set(&[]));
        assert!(v.held.is_empty(), "nothing to hold this sweep");
        assert_eq!(b.held(), &set(&["a"]));
        assert!(
            b.judge(&releases(&[("a", 90)]), size, 0.5, &set(&[]), &set(&[]))
                .new
                .is_empty()
        );
        // Confirmed and under the ratio: the hold is over.
        b.judge(&releases(&[]), size, 0.5, &set(&[]), &set(&[]));
        assert!(b.held().is_empty());
    }

    #[test]
    fn an_approved_hold_releases_once_and_ends_the_hold() {
        let mut b = Breaker::default();
        let size = |_: &str| 100;
        let sweep = releases(&[("a", 90)]);
        assert_eq!(
            b.judge(&sweep, size, 0.5, &set(&[]), &set(&[])).held.len(),
            1
        );
        let v = b.judge(&sweep, size, 0.5, &set(&[]), &set(&["a"]));
        assert!(v.held.is_empty(), "approved: its releases go");
        assert_eq!(v.approved, BTreeSet::from(["a".to_string()]));
        assert!(b.held().is_empty());
        // The approval used up (removed), the next sweep over the ratio holds anew.
        let v = b.judge(&sweep, size, 0.5, &set(&[]), &set(&[]));
        assert_eq!(v.new.len(), 1);
        // An approval of a pool under the ratio changes nothing.
        let v = b.judge(&releases(&[("b", 1)]), size, 0.5, &set(&[]), &set(&["b"]));
        assert!(v.approved.is_empty());
    }
}
