//! When a cooling entry may end, pure. Its end time is written into the entry by whoever
//! released it (a leader, a node agent) by that writer's wall clock, so a writer whose clock
//! lags writes an end that comes too early. Every replica therefore also counts, by its own
//! monotonic clock, how long it has seen each entry cooling; with a cooldown length set
//! (`--release-cooldown`) an entry ends only once both are over. A replica that starts (or
//! meets an entry) late only lengthens the cooldown, never shortens it.

use std::hash::Hash;
use std::time::{Duration, Instant};

use jiff::Timestamp;

use crate::ipam::cooldown::is_due;
use crate::seen::Seen;

/// When this replica first saw each cooling entry, by any key that changes when the entry is
/// rewritten (its slot and marker).
#[derive(Debug)]
pub struct CoolingSightings<K> {
    seen: Seen<K>,
}

impl<K> Default for CoolingSightings<K> {
    fn default() -> Self {
        CoolingSightings {
            seen: Seen::default(),
        }
    }
}

impl<K: Hash + Eq> CoolingSightings<K> {
    /// Records the entries cooling at `now` (a new one is first seen then) and forgets the
    /// others.
    pub fn observe(&mut self, cooling: impl IntoIterator<Item = K>, now: Instant) {
        self.seen.observe(cooling, now);
    }

    /// Whether entry `k`, whose marker ends it at `until`, may end: `until` is past at
    /// `wall_now` (this replica's clock), and it has been seen cooling for `length` at `now`.
    /// An entry not observed yet never may.
    pub fn may_end(
        &self,
        k: &K,
        until: Timestamp,
        wall_now: Timestamp,
        now: Instant,
        length: Duration,
    ) -> bool {
        let Some(since) = self.seen.since(k) else {
            return false;
        };
        is_due(until, wall_now) && now.saturating_duration_since(since) >= length
    }

    /// Entries remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LENGTH: Duration = Duration::from_secs(60);

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn an_end_written_by_a_lagging_clock_waits_the_whole_length_from_the_first_sight() {
        let t0 = Instant::now();
        let wall = t("2026-11-28T10:00:00Z");
        // Written by a node whose clock is an hour behind: its end passed long ago here.
        let lagging = t("2026-11-28T09:01:00Z");
        let mut s = CoolingSightings::default();
        assert!(
            !s.may_end(&"a", lagging, wall, t0, Duration::ZERO),
            "not observed yet"
        );
        s.observe(["a"], t0);
        let at = |secs| t0 + Duration::from_secs(secs);
        assert!(!s.may_end(&"a", lagging, wall, at(59), LENGTH));
        s.observe(["a"], at(30));
        assert!(
            s.may_end(&"a", lagging, wall, at(60), LENGTH),
            "first sight kept"
        );
        // Without a length set, the marker alone decides (as before).
        assert!(s.may_end(&"a", lagging, wall, t0, Duration::ZERO));
    }

    #[test]
    fn an_end_still_ahead_by_this_clock_waits_for_it_whatever_the_sighting() {
        let t0 = Instant::now();
        let mut s = CoolingSightings::default();
        s.observe(["a"], t0);
        let until = t("2026-11-28T10:05:00Z");
        let late = t0 + Duration::from_secs(3600);
        assert!(!s.may_end(&"a", until, t("2026-11-28T10:04:59Z"), late, LENGTH));
        assert!(s.may_end(&"a", until, t("2026-11-28T10:05:00Z"), late, LENGTH));
    }

    #[test]
    fn an_entry_gone_and_back_is_seen_anew() {
        let t0 = Instant::now();
        let past = t("2026-01-01T00:00:00Z");
        let wall = t("2026-11-28T10:00:00Z");
        let mut s = CoolingSightings::default();
        s.observe(["a", "b"], t0);
        let later = t0 + LENGTH;
        s.observe(["b"], later);
        assert_eq!(s.len(), 1);
        s.observe(["a", "b"], later);
        assert!(!s.may_end(&"a", past, wall, later, LENGTH), "seen anew");
        assert!(s.may_end(&"b", past, wall, later, LENGTH));
    }
}
