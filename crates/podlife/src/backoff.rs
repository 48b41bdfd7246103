//! Per-key exponential backoff with client-go's `flowcontrol.Backoff` semantics: the first
//! failure waits `initial`, each further one doubles up to `max`, and an entry untouched for
//! twice `max` is forgotten (stable again).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::clock::SharedClock;

#[derive(Debug, Clone)]
struct Entry {
    backoff: Duration,
    last_update: Instant,
    last_error: Option<String>,
}

/// Backoff state per key.
#[derive(Debug)]
pub struct Backoff<K = String> {
    initial: Duration,
    max: Duration,
    entries: Mutex<HashMap<K, Entry>>,
    clock: SharedClock,
}

impl<K: Hash + Eq + Clone> Backoff<K> {
    /// A backoff starting at `initial`, doubling up to `max`.
    pub fn new(initial: Duration, max: Duration, clock: SharedClock) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
            entries: Mutex::new(HashMap::new()),
            clock,
        }
    }

    fn expired(&self, event_time: Instant, last_update: Instant) -> bool {
        event_time.saturating_duration_since(last_update) > self.max * 2
    }

    /// Records a failure of `key` at `event_time`, with its error for later messages.
    pub fn next(&self, key: &K, event_time: Instant, error: Option<String>) {
        let mut entries = self.entries.lock().expect("backoff poisoned");
        let backoff = match entries.get(key) {
            Some(e) if !self.expired(event_time, e.last_update) => (e.backoff * 2).min(self.max),
            _ => self.initial,
        };
        entries.insert(
            key.clone(),
            Entry {
                backoff,
                last_update: self.clock.now(),
                last_error: error,
            },
        );
    }

    /// The current backoff duration of `key` (zero when none).
    pub fn get(&self, key: &K) -> Duration {
        let entries = self.entries.lock().expect("backoff poisoned");
        entries.get(key).map_or(Duration::ZERO, |e| e.backoff)
    }

    /// Whether `key` is still backing off at `event_time`.
    pub fn is_in_backoff_since(&self, key: &K, event_time: Instant) -> bool {
        let entries = self.entries.lock().expect("backoff poisoned");
        match entries.get(key) {
            Some(e) if !self.expired(event_time, e.last_update) => {
                event_time.saturating_duration_since(e.last_update) < e.backoff
            }
            _ => false,
        }
    }

    /// The error recorded with the last failure of `key`.
    pub fn last_error(&self, key: &K) -> Option<String> {
        let entries = self.entries.lock().expect("backoff poisoned");
        entries.get(key).and_then(|e| e.last_error.clone())
    }

    /// Forgets `key` (after a success).
    pub fn reset(&self, key: &K) {
        self.entries.lock().expect("backoff poisoned").remove(key);
    }

    /// Drops every entry untouched for more than twice the maximum.
    pub fn gc(&self) {
        let now = self.clock.now();
        let mut entries = self.entries.lock().expect("backoff poisoned");
        entries.retain(|_, e| !self.expired(now, e.last_update));
    }

    /// Number of keys with backoff state.
    pub fn len(&self) -> usize {
        self.entries.lock().expect("backoff poisoned").len()
    }

    /// Whether no key has backoff state.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, FakeClock};

    /// A backoff starting at one second, up to `max`.
    fn from_one_second(max: Duration, clock: SharedClock) -> Backoff<String> {
        Backoff::new(Duration::from_secs(1), max, clock)
    }

    #[test]
    fn doubles_up_to_max_and_expires() {
        let clock = FakeClock::new();
        let b = from_one_second(Duration::from_secs(4), clock.clone());
        let k = "img".to_string();
        let mut seen = vec![];
        for _ in 0..4 {
            b.next(&k, clock.now(), None);
            seen.push(b.get(&k).as_secs());
        }
        assert_eq!(seen, [1, 2, 4, 4]);
        clock.step(Duration::from_secs(9));
        assert!(
            !b.is_in_backoff_since(&k, clock.now()),
            "expired after 2 x max"
        );
        b.next(&k, clock.now(), Some("boom".into()));
        assert_eq!(
            b.get(&k),
            Duration::from_secs(1),
            "restarts at initial once expired"
        );
        assert_eq!(b.last_error(&k).as_deref(), Some("boom"));
    }

    #[test]
    fn gc_removes_only_stale_entries() {
        let clock = FakeClock::new();
        let b = from_one_second(Duration::from_secs(10), clock.clone());
        b.next(&"old".to_string(), clock.now(), None);
        clock.step(Duration::from_secs(15));
        b.next(&"new".to_string(), clock.now(), None);
        clock.step(Duration::from_secs(6));
        b.gc();
        assert_eq!(b.len(), 1);
        assert_eq!(b.get(&"new".to_string()), Duration::from_secs(1));
        b.reset(&"new".to_string());
        assert!(b.is_empty());
    }
}
