//! The sweep's bookkeeping of operators' approvals (`approve-hold`), pure. An approval is in
//! force once per value: a dry run, which removes nothing, judges each value once. A pool's
//! releases that needed an approval go only once the approval is used up (its removal, pinned
//! by its value, went through), so that no later sweep and no new leader can use it again.
//! Every approval a sweep could judge is used up, needed or not: one left lying would let a
//! later, unrelated mass release through unheld; those the sweep did not act on are used up
//! after it. A pool whose candidates could not be confirmed keeps its approval for the next
//! sweep, unless the approval was judged too small.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::breaker::{Approval, Verdict, approval_of};

/// An approval in force: its annotation value (its removal is pinned by it) and its bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InForce {
    /// The annotation's value.
    pub value: String,
    /// What it lets go at most.
    pub bound: Approval,
}

/// Approvals between sweeps.
#[derive(Debug, Default)]
pub struct Approvals {
    /// Pools whose approval the last sweep judged and did not act on: used up after it.
    unused: BTreeSet<String>,
    /// Under `--dry-run`, the approval values judged, by pool: each is judged (and reported)
    /// once, since none is removed.
    judged_dry: HashMap<String, String>,
}

/// What a sweep's approvals come to, once those it needed were used up.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Pools whose releases do not go this sweep: held, or approved with an approval that
    /// could not be used up (reported as held).
    pub held: BTreeSet<String>,
    /// Pools released once on their approval, with its bound (for the Event).
    pub released_once: Vec<(String, Approval)>,
    /// Pools whose approval was found with nothing held (it is used up all the same).
    pub unneeded: Vec<String>,
}

impl Settled {
    /// Whether `pool`'s confirmed releases go this sweep.
    pub fn goes(&self, pool: &str) -> bool {
        !self.held.contains(pool)
    }
}

impl Approvals {
    /// The approvals in force: each pool's (`pool`, its approval annotation's value, if any),
    /// but a value a dry run judged already.
    pub fn in_force<'a>(
        &self,
        pools: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    ) -> BTreeMap<String, InForce> {
        pools
            .into_iter()
            .filter_map(|(pool, value)| Some((pool, value?)))
            .filter(|(pool, value)| self.judged_dry.get(*pool).map(String::as_str) != Some(*value))
            .map(|(pool, value)| {
                let bound = approval_of(value);
                (
                    pool.to_owned(),
                    InForce {
                        value: value.to_owned(),
                        bound,
                    },
                )
            })
            .collect()
    }

    /// The bounds of `in_force`, as the breaker takes them.
    pub fn bounds(in_force: &BTreeMap<String, InForce>) -> HashMap<String, Approval> {
        in_force.iter().map(|(p, a)| (p.clone(), a.bound)).collect()
    }

    /// Under `--dry-run`: `pool`'s approval `value` was judged as if used up (nothing is
    /// removed); it is not in force again until its value changes.
    pub fn judged_in_dry_run(&mut self, pool: &str, value: &str) {
        self.judged_dry.insert(pool.to_owned(), value.to_owned());
    }

    /// Settles a sweep: `in_force` as it started, the breaker's `verdict`, the approved pools
    /// whose approval was used up (`spent`) and the pools whose candidates could not be
    /// confirmed. Remembers the approvals it judged and did not act on, to use up after it.
    pub fn settle(
        &mut self,
        in_force: &BTreeMap<String, InForce>,
        verdict: &Verdict,
        spent: &BTreeSet<String>,
        unconfirmed: &HashSet<String>,
    ) -> Settled {
        let unspent = verdict.approved.difference(spent).cloned();
        let held = verdict.held.iter().cloned().chain(unspent).collect();
        let released_once = spent
            .iter()
            .map(|p| (p.clone(), in_force.get(p).and_then(|a| a.bound)))
            .collect();
        let outgrown: BTreeSet<&String> = verdict.outgrown.iter().map(|o| &o.pool).collect();
        let judged: Vec<&String> = in_force
            .keys()
            .filter(|p| !unconfirmed.contains(*p) || outgrown.contains(p))
            .collect();
        let unneeded = judged
            .iter()
            .filter(|p| !verdict.approved.contains(**p) && !outgrown.contains(**p))
            .map(|p| (*p).clone())
            .collect();
        // Those it acted on were used up (or stay, when that failed, for the next sweep).
        self.unused = judged
            .into_iter()
            .filter(|p| !verdict.approved.contains(*p))
            .cloned()
            .collect();
        Settled {
            held,
            released_once,
            unneeded,
        }
    }

    /// The pools whose approval the last sweep judged and did not act on: to use up now.
    pub fn take_unused(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.unused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::breaker::Outgrown;

    fn set(pools: &[&str]) -> BTreeSet<String> {
        pools.iter().map(|p| p.to_string()).collect()
    }

    fn verdict(held: &[&str], approved: &[&str], outgrown: &[&str]) -> Verdict {
        Verdict {
            held: set(held),
            new: Vec::new(),
            approved: set(approved),
            outgrown: outgrown
                .iter()
                .map(|p| Outgrown {
                    pool: p.to_string(),
                    approved: 1,
                    releases: 5,
                })
                .collect(),
        }
    }

    #[test]
    fn an_approved_pool_goes_only_once_its_approval_is_used_up() {
        let mut a = Approvals::default();
        let in_force = a.in_force([("a", Some("at-most=3; approved-at=x")), ("b", Some("yes"))]);
        assert_eq!(in_force["a"].bound, Some(3));
        assert_eq!(in_force["b"].bound, None);
        let v = verdict(&[], &["a", "b"], &[]);
        // a's removal went through, b's was refused (given again meanwhile, or an API error).
        let s = a.settle(&in_force, &v, &set(&["a"]), &HashSet::new());
        assert!(s.goes("a"));
        assert!(!s.goes("b"), "an approval not used up releases nothing now");
        assert_eq!(s.held, set(&["b"]));
        assert_eq!(s.released_once, vec![("a".to_string(), Some(3))]);
        assert!(s.unneeded.is_empty());
        // b's stays in the pool for the next sweep; nothing is left to use up after this one.
        assert!(a.take_unused().is_empty());
    }

    #[test]
    fn every_approval_judged_is_used_up_needed_or_not() {
        let mut a = Approvals::default();
        let pools = [
            ("idle", Some("yes")),
            ("small", Some("at-most=1")),
            ("lagging", Some("yes")),
            ("lagging-small", Some("at-most=1")),
            ("none", None),
        ];
        let in_force = a.in_force(pools);
        assert_eq!(in_force.len(), 4, "a pool without one has none in force");
        // Nothing held in idle; small's approval is under what the sweep would release;
        // lagging's candidates could not be confirmed, and lagging-small was judged too small.
        let v = verdict(
            &["small", "lagging-small"],
            &[],
            &["small", "lagging-small"],
        );
        let unconfirmed: HashSet<String> = ["lagging", "lagging-small"]
            .iter()
            .map(|p| p.to_string())
            .collect();
        let s = a.settle(&in_force, &v, &BTreeSet::new(), &unconfirmed);
        assert_eq!(s.unneeded, vec!["idle".to_string()]);
        assert_eq!(s.held, set(&["lagging-small", "small"]));
        // Used up after the sweep: all but the one whose candidates are still unconfirmed.
        assert_eq!(a.take_unused(), set(&["idle", "lagging-small", "small"]));
        assert!(a.take_unused().is_empty(), "taken once");
    }

    #[test]
    fn a_dry_run_judges_each_approval_value_once() {
        let mut a = Approvals::default();
        assert_eq!(a.in_force([("p", Some("v1"))]).len(), 1);
        a.judged_in_dry_run("p", "v1");
        assert!(a.in_force([("p", Some("v1"))]).is_empty());
        // Given again (a new value): judged again.
        assert_eq!(a.in_force([("p", Some("v2"))])["p"].value, "v2");
        assert_eq!(a.in_force([("q", Some("v1"))]).len(), 1, "per pool");
    }
}
