//! What this process has seen, and since when: the one home of "first seen on my clock, due
//! after a wait" ([`Seen`]) and "report once per episode" ([`Once`]).
//!
//! Both count on this process's monotonic clock, never a timestamp another writer set: a
//! restart forgets them, which only makes a wait start again (longer, never shorter) and a
//! report be made once more.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// When each key was first seen, for as long as it keeps being seen.
#[derive(Debug)]
pub struct Seen<K> {
    first: HashMap<K, Instant>,
}

impl<K> Default for Seen<K> {
    fn default() -> Self {
        Seen {
            first: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq> Seen<K> {
    /// When `k` was first seen; seen now at `now` if it is new.
    pub fn first(&mut self, k: K, now: Instant) -> Instant {
        *self.first.entry(k).or_insert(now)
    }

    /// Whether `k`, seen now at `now` if it is new, has been seen for `wait`.
    pub fn waited(&mut self, k: K, now: Instant, wait: Duration) -> bool {
        now.saturating_duration_since(self.first(k, now)) >= wait
    }

    /// When `k` was first seen, if it is known.
    pub fn since<Q>(&self, k: &Q) -> Option<Instant>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.first.get(k).copied()
    }

    /// Starts `k`'s wait again at `at` when that is later than its first sighting (what it
    /// waited for was undone meanwhile).
    pub fn restart_at(&mut self, k: &K, at: Instant) {
        if let Some(first) = self.first.get_mut(k)
            && at > *first
        {
            *first = at;
        }
    }

    /// Forgets every key `still` says is no longer seen.
    pub fn keep_only(&mut self, mut still: impl FnMut(&K) -> bool) {
        self.first.retain(|k, _| still(k));
    }

    /// Of one pass's `items` (each with its key): those whose key has been seen for its
    /// `wait`. A key not in the pass is forgotten (its wait starts again when it comes back).
    pub fn due<T>(
        &mut self,
        items: Vec<(K, T)>,
        now: Instant,
        wait: impl Fn(&T) -> Duration,
    ) -> Vec<T> {
        {
            let current: HashSet<&K> = items.iter().map(|(k, _)| k).collect();
            self.first.retain(|k, _| current.contains(k));
        }
        let mut due = Vec::new();
        for (k, t) in items {
            if self.waited(k, now, wait(&t)) {
                due.push(t);
            }
        }
        due
    }

    /// Keeps exactly `current` (a key not in it is forgotten, a new one seen at `now`).
    pub fn observe(&mut self, current: impl IntoIterator<Item = K>, now: Instant) {
        let mut next: HashMap<K, Instant> = current
            .into_iter()
            .map(|k| {
                let since = self.first.remove(&k).unwrap_or(now);
                (k, since)
            })
            .collect();
        std::mem::swap(&mut self.first, &mut next);
    }

    /// How many keys are known.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// Whether no key is known.
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }
}

/// The keys reported in their current episode: a key is reported once until its episode ends
/// (it is no longer the case), then once again if it comes back.
#[derive(Debug)]
pub struct Once<K> {
    reported: HashSet<K>,
}

impl<K> Default for Once<K> {
    fn default() -> Self {
        Once {
            reported: HashSet::new(),
        }
    }
}

impl<K: Hash + Eq> Once<K> {
    /// Whether `k` is to be reported now: true the first time in its episode.
    pub fn first(&mut self, k: K) -> bool {
        self.reported.insert(k)
    }

    /// Ends the episode of every key `still` says is no longer the case.
    pub fn keep_only(&mut self, mut still: impl FnMut(&K) -> bool) {
        self.reported.retain(|k| still(k));
    }

    /// Ends `k`'s episode.
    pub fn end<Q>(&mut self, k: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.reported.remove(k);
    }

    /// Whether `k` is in an episode (reported, not yet ended).
    pub fn contains<Q>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.reported.contains(k)
    }

    /// How many keys are in an episode.
    pub fn len(&self) -> usize {
        self.reported.len()
    }

    /// Whether no key is in an episode.
    pub fn is_empty(&self) -> bool {
        self.reported.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_wait_counts_from_the_first_sighting_and_starts_again_when_forgotten() {
        let t0 = Instant::now();
        let mut seen = Seen::default();
        assert!(!seen.waited("a", t0, 5 * S));
        assert!(!seen.waited("a", t0 + 4 * S, 5 * S));
        assert!(seen.waited("a", t0 + 5 * S, 5 * S));
        assert_eq!(seen.since("a"), Some(t0));
        seen.keep_only(|k| *k != "a");
        assert!(seen.is_empty());
        assert!(
            !seen.waited("a", t0 + 6 * S, 5 * S),
            "a key seen again after it went waits its whole time again"
        );
    }

    #[test]
    fn a_restart_only_ever_moves_the_start_later() {
        let t0 = Instant::now();
        let mut seen = Seen::default();
        seen.first("a", t0 + 2 * S);
        seen.restart_at(&"a", t0);
        assert_eq!(seen.since("a"), Some(t0 + 2 * S));
        seen.restart_at(&"a", t0 + 3 * S);
        assert_eq!(seen.since("a"), Some(t0 + 3 * S));
        seen.restart_at(&"b", t0);
        assert_eq!(seen.since("b"), None, "a restart sees nothing new");
    }

    #[test]
    fn observing_keeps_exactly_the_current_keys_with_their_first_sightings() {
        let t0 = Instant::now();
        let mut seen = Seen::default();
        seen.observe(["a", "b"], t0);
        seen.observe(["b", "c"], t0 + S);
        assert_eq!(seen.len(), 2);
        assert_eq!(seen.since("a"), None);
        assert_eq!(seen.since("b"), Some(t0));
        assert_eq!(seen.since("c"), Some(t0 + S));
    }

    #[test]
    fn a_case_is_due_once_seen_for_its_wait_and_starts_again_when_its_key_changes() {
        let grace = Duration::from_secs(120);
        let t0 = Instant::now();
        let mut seen: Seen<(&str, &str)> = Seen::default();
        // A reservation judged against web-0's pod of uid u1.
        let case = |uid| vec![(("192.0.2.10", uid), uid)];
        assert!(seen.due(case("u1"), t0, |_| grace).is_empty());
        assert!(seen.due(case("u1"), t0 + grace / 2, |_| grace).is_empty());
        assert_eq!(seen.due(case("u1"), t0 + grace, |_| grace), ["u1"]);
        // web-0 recreated (uid u2): judged anew, its wait from now.
        let t1 = t0 + grace + S;
        assert!(seen.due(case("u2"), t1, |_| grace).is_empty());
        assert_eq!(seen.due(case("u2"), t1 + grace, |_| grace), ["u2"]);
        // Not seen in a pass: forgotten, and its wait starts again.
        let t2 = t1 + grace * 2;
        assert!(seen.due(Vec::<(_, &str)>::new(), t2, |_| grace).is_empty());
        assert!(seen.due(case("u2"), t2, |_| grace).is_empty());
        // Each case with its own wait.
        let both = vec![(("a", "1"), 1u64), (("b", "2"), 3)];
        let waits = |n: &u64| S * (*n as u32);
        assert!(seen.due(both.clone(), t2, waits).is_empty());
        assert_eq!(seen.due(both.clone(), t2 + S, waits), [1]);
        assert_eq!(seen.due(both, t2 + 3 * S, waits), [1, 3]);
    }

    #[test]
    fn a_report_is_made_once_per_episode() {
        let mut once = Once::default();
        assert!(once.first("a"));
        assert!(!once.first("a"));
        assert!(once.first("b"));
        once.keep_only(|k| *k == "b");
        assert!(once.first("a"), "a new episode of a is reported again");
        assert!(!once.first("b"));
        once.end("b");
        assert!(once.first("b"));
        assert_eq!(once.len(), 2);
    }
}
