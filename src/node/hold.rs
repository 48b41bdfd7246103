//! The node agent's blast-radius breaker, pure: the releases one dead sandbox's task would make
//! are judged per pool with the controller's [`Breaker`], over this agent's own releases of
//! the last [`BREAKER_WINDOW`]. Release tasks run concurrently, so what passes is reserved
//! (counted as released) in the same call that judges it: two tasks cannot both pass under the
//! ratio. What the writer then does not free is given back.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::time::Instant;

use crate::rules::breaker::{BREAKER_WINDOW, Breaker, NewHold};

/// A pool entry as the breaker knows it: its sandbox id and address.
pub type EntryId = (String, IpAddr);

/// One pool of a task's releases.
#[derive(Debug, Clone, Default)]
pub struct PoolSeen {
    /// The entries the task would release.
    pub releases: Vec<EntryId>,
    /// Every entry of the pool, as the task just read it.
    pub entries: Vec<EntryId>,
}

/// What the breaker says of one task's releases.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Hold {
    /// Pools whose releases are held (dropped for now).
    pub held: BTreeSet<String>,
    /// Of those, the ones newly held (report them).
    pub new: Vec<NewHold>,
}

/// An entry let go at `at`: counted by the breaker as released.
#[derive(Debug, Clone)]
struct Reserved {
    entry: EntryId,
    at: Instant,
}

/// The breaker of one node agent, with what it let go lately and when it last held each pool.
#[derive(Debug, Default)]
pub struct NodeBreaker {
    breaker: Breaker,
    /// Per pool, the entries let go within the window. The breaker counts them as released,
    /// so a pool read that still lists them (made before their patch landed) leaves them out
    /// of the pool's size: a pool is not counted larger by what this agent is releasing.
    reserved: HashMap<String, Vec<Reserved>>,
    /// When each held pool was last judged held. A pool is judged only when a task releases
    /// from it: a hold nobody asked about for a whole window ends (its held sandboxes are
    /// asked about every grace), so that a later episode is reported anew.
    held_at: HashMap<String, Instant>,
}

/// Judges one task's releases per pool at `now` (ratio `max_ratio`): a pool is held when these
/// releases and this agent's of the last [`BREAKER_WINDOW`] are more than `max_ratio` of the
/// pool as it was before those (a pool of at most 10 allocations never is). What passes is
/// reserved at once; pools held before and not in this call keep their hold (and report it
/// once). Call it under the lock that guards `breaker`, with `now` taken under it.
pub fn hold_pools(
    breaker: &mut NodeBreaker,
    pools: &BTreeMap<String, PoolSeen>,
    max_ratio: f64,
    now: Instant,
) -> Hold {
    breaker.forget_before(now);
    let counts: BTreeMap<String, usize> = pools
        .iter()
        .filter(|(_, p)| !p.releases.is_empty())
        .map(|(pool, p)| (pool.clone(), p.releases.len()))
        .collect();
    let sizes: HashMap<&str, usize> = pools
        .iter()
        .map(|(pool, p)| (pool.as_str(), breaker.size(pool, &p.entries)))
        .collect();
    // Holds of pools this task does not release from stay: another pool's task ends none.
    let others: HashSet<String> = breaker
        .breaker
        .held()
        .iter()
        .filter(|p| !counts.contains_key(*p) && breaker.held_at.contains_key(*p))
        .cloned()
        .collect();
    let verdict = breaker.breaker.judge(
        &counts,
        |pool| sizes.get(pool).copied().unwrap_or(0),
        max_ratio,
        &others,
        &HashMap::new(),
        now,
    );
    for pool in &verdict.held {
        breaker.held_at.insert(pool.clone(), now);
    }
    let held = breaker.breaker.held();
    breaker.held_at.retain(|p, _| held.contains(p));
    for (pool, p) in pools {
        if p.releases.is_empty() || verdict.held.contains(pool) {
            continue;
        }
        breaker.breaker.record(pool, p.releases.len(), now);
        let reserved = breaker.reserved.entry(pool.clone()).or_default();
        reserved.extend(p.releases.iter().map(|e| Reserved {
            entry: e.clone(),
            at: now,
        }));
    }
    Hold {
        held: verdict.held,
        new: verdict.new,
    }
}

impl NodeBreaker {
    /// Gives back entries of `pool` reserved at `at` that the writer did not free (a failed
    /// patch, an entry gone or changed meanwhile): they no longer count as released.
    pub fn give_back(&mut self, pool: &str, entries: &[EntryId], at: Instant) {
        let Some(reserved) = self.reserved.get_mut(pool) else {
            return;
        };
        let mut n = 0;
        for e in entries {
            if let Some(i) = reserved.iter().position(|r| r.at == at && r.entry == *e) {
                reserved.remove(i);
                n += 1;
            }
        }
        if reserved.is_empty() {
            self.reserved.remove(pool);
        }
        self.breaker.take_back(pool, n, at);
    }

    /// Pools held at the last call.
    pub fn held(&self) -> &HashSet<String> {
        self.breaker.held()
    }

    /// The pool's size for the breaker: its entries as read, less those reserved (the breaker
    /// counts them among the recent releases).
    fn size(&self, pool: &str, entries: &[EntryId]) -> usize {
        let Some(reserved) = self.reserved.get(pool) else {
            return entries.len();
        };
        let reserved: HashSet<&EntryId> = reserved.iter().map(|r| &r.entry).collect();
        entries.iter().filter(|e| !reserved.contains(e)).count()
    }

    fn forget_before(&mut self, now: Instant) {
        let old = |at: &Instant| now.saturating_duration_since(*at) >= BREAKER_WINDOW;
        for r in self.reserved.values_mut() {
            r.retain(|r| !old(&r.at));
        }
        self.reserved.retain(|_, r| !r.is_empty());
        self.held_at.retain(|_, at| !old(at));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn base() -> Instant {
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(Instant::now)
    }

    fn entry(sandbox: &str, last: u8) -> EntryId {
        (sandbox.into(), IpAddr::from([192, 0, 2, last]))
    }

    /// A pool of `size` entries, sandboxes `s0`, `s1`, ... at 192.0.2.0, .1, ...
    fn pool(size: u8) -> Vec<EntryId> {
        pool_of("s", size)
    }

    /// A pool of `size` entries, sandboxes `<prefix>0`, `<prefix>1`, ... at 192.0.2.0, .1, ...
    fn pool_of(prefix: &str, size: u8) -> Vec<EntryId> {
        (0..size)
            .map(|i| entry(&format!("{prefix}{i}"), i))
            .collect()
    }

    /// Sandbox `s{i}`'s task: it would release its one entry of `pool`, read as `entries`.
    fn task(pool: &str, i: u8, entries: &[EntryId]) -> BTreeMap<String, PoolSeen> {
        let seen = PoolSeen {
            releases: vec![entry(&format!("s{i}"), i)],
            entries: entries.to_vec(),
        };
        BTreeMap::from([(pool.to_string(), seen)])
    }

    /// One task that would release the first seven of `entries`, all of pool `a`.
    fn seven_of(entries: &[EntryId]) -> BTreeMap<String, PoolSeen> {
        let seen = PoolSeen {
            releases: entries[..7].to_vec(),
            entries: entries.to_vec(),
        };
        BTreeMap::from([("a".to_string(), seen)])
    }

    fn judge(b: &mut NodeBreaker, pools: &BTreeMap<String, PoolSeen>, at: Instant) -> Hold {
        hold_pools(b, pools, 0.5, at)
    }

    #[test]
    fn a_task_over_the_ratio_is_held_and_the_hold_reported_once() {
        let mut b = NodeBreaker::default();
        let entries = pool(12);
        let pools = seven_of(&entries);
        let v = judge(&mut b, &pools, base());
        assert_eq!(v.held, BTreeSet::from(["a".to_string()]));
        assert_eq!(
            v.new,
            [NewHold {
                pool: "a".into(),
                releases: 7,
                size: 12,
                recent: 0
            }]
        );
        // Asked again (the held sandbox's recheck): still held, not reported again.
        let v = judge(&mut b, &pools, base() + Duration::from_secs(30));
        assert_eq!(v.held.len(), 1);
        assert!(v.new.is_empty(), "{v:?}");
    }

    #[test]
    fn concurrent_tasks_reading_the_same_pool_let_only_the_ratio_go() {
        // 7 dead sandboxes' tasks in a pool of 12, each reading the pool before any patch
        // landed: their reservations count, and the pool is not counted larger by them.
        let mut b = NodeBreaker::default();
        let entries = pool(12);
        let mut held = Vec::new();
        for i in 0..7 {
            let v = judge(&mut b, &task("a", i, &entries), base());
            if !v.held.is_empty() {
                held.push((i, v.new.len()));
            }
        }
        assert_eq!(
            held,
            [(6, 1)],
            "6 of the 12 go, the 7th is held and reported"
        );
        // A read after the patches: the same.
        let v = judge(&mut b, &task("a", 6, &entries[6..]), base());
        assert_eq!((v.held.len(), v.new.len()), (1, 0));
    }

    #[test]
    fn what_the_writer_did_not_free_is_given_back() {
        let mut b = NodeBreaker::default();
        let entries = pool(12);
        let at = base();
        for i in 0..6 {
            assert!(judge(&mut b, &task("a", i, &entries), at).held.is_empty());
        }
        // s5's patch failed: its entry is still there, and no longer counts as released.
        b.give_back("a", &[entry("s5", 5)], at);
        b.give_back("a", &[entry("s4", 4)], at + Duration::from_secs(1)); // not reserved then
        assert!(judge(&mut b, &task("a", 6, &entries), at).held.is_empty());
        assert!(!judge(&mut b, &task("a", 5, &entries), at).held.is_empty());
    }

    #[test]
    fn a_pool_of_at_most_10_allocations_is_never_held() {
        let mut b = NodeBreaker::default();
        let entries = pool(10);
        for i in 0..10 {
            let v = hold_pools(&mut b, &task("tiny", i, &entries), 0.1, base());
            assert_eq!(v, Hold::default(), "sandbox {i}");
        }
    }

    #[test]
    fn another_pools_task_does_not_end_a_hold_one_under_the_ratio_does() {
        let mut b = NodeBreaker::default();
        let entries = pool(12);
        for i in 0..6 {
            judge(&mut b, &task("a", i, &entries), base());
        }
        assert_eq!(judge(&mut b, &task("a", 6, &entries), base()).new.len(), 1);
        // A task of pool "b" (not held): "a" stays held, not reported again.
        assert!(
            judge(&mut b, &task("b", 0, &pool(12)), base())
                .held
                .is_empty()
        );
        assert_eq!(b.held(), &HashSet::from(["a".to_string()]));
        let v = judge(&mut b, &task("a", 6, &entries[6..]), base());
        assert!(v.new.is_empty(), "{v:?}");
        // Once the releases are a window old, the held task goes and the hold is over; the
        // next task over the ratio (new pods' sandboxes died) is reported anew.
        let later = base() + BREAKER_WINDOW;
        assert!(
            judge(&mut b, &task("a", 6, &entries[6..]), later)
                .held
                .is_empty()
        );
        assert!(b.held().is_empty());
        let entries = pool_of("t", 12);
        let v = judge(&mut b, &seven_of(&entries), later);
        assert_eq!(v.new.len(), 1, "{v:?}");
    }

    #[test]
    fn a_hold_nobody_asks_about_for_a_window_ends() {
        // Its held sandbox's pod went away: nothing asks about the pool any more.
        let mut b = NodeBreaker::default();
        let entries = pool(12);
        let pools = seven_of(&entries);
        assert_eq!(judge(&mut b, &pools, base()).new.len(), 1);
        let later = base() + BREAKER_WINDOW;
        judge(&mut b, &task("b", 0, &pool(12)), later);
        assert!(b.held().is_empty());
        assert_eq!(judge(&mut b, &pools, later).new.len(), 1, "a new episode");
    }
}
