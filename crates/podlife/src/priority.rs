//! One write budget shared by kinds of work of different urgency: a QPS/burst bucket and a
//! max-in-flight limit where tokens and slots go to the most urgent waiter, and which the server
//! can pause (a `429 Too Many Requests` with `Retry-After`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::clock::SharedClock;
use crate::throttle::{InFlightLimit, InFlightPermit, Parallelism, TokenBucket};

/// The shortest wait for a token.
const MIN_POLL: Duration = Duration::from_millis(1);
/// The longest a waiter sleeps before looking again (it is also woken when a slot frees or a
/// more urgent waiter leaves).
const MAX_POLL: Duration = Duration::from_millis(100);

/// A budget whose tokens go to level 0 first, then 1, and so on.
#[derive(Debug)]
pub struct PriorityThrottle {
    bucket: TokenBucket,
    in_flight: InFlightLimit,
    waiting: Vec<AtomicUsize>,
    paused_until: Mutex<Option<Instant>>,
    /// Woken when a slot frees or a waiter leaves.
    changed: Arc<Notify>,
    clock: SharedClock,
}

/// Held while a piece of work is in flight; dropping it frees the slot and wakes the waiters.
#[derive(Debug)]
pub struct PriorityPermit {
    _slot: InFlightPermit,
    changed: Arc<Notify>,
}

impl Drop for PriorityPermit {
    fn drop(&mut self) {
        self.changed.notify_waiters();
    }
}

/// Counts a waiter at its level while it waits (also when its future is dropped).
struct Waiting<'a> {
    count: &'a AtomicUsize,
    changed: &'a Notify,
}

impl<'a> Waiting<'a> {
    fn enter(count: &'a AtomicUsize, changed: &'a Notify) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Waiting { count, changed }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

impl PriorityThrottle {
    /// A budget of `qps`/`burst` (qps 0: unlimited), `parallelism`, and `levels` urgencies.
    pub fn new(
        qps: f64,
        burst: u32,
        parallelism: Parallelism,
        levels: usize,
        clock: SharedClock,
    ) -> Self {
        PriorityThrottle {
            bucket: TokenBucket::new(qps, burst, clock.clone()),
            in_flight: InFlightLimit::new(parallelism),
            waiting: (0..levels.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            paused_until: Mutex::new(None),
            changed: Arc::new(Notify::new()),
            clock,
        }
    }

    /// Waits until no more urgent work waits and both a slot and a token are there. `level` 0
    /// is the most urgent; levels past the last count as the last.
    pub async fn acquire(&self, level: usize) -> PriorityPermit {
        let level = level.min(self.waiting.len() - 1);
        let _waiting = Waiting::enter(&self.waiting[level], &self.changed);
        loop {
            // Registered before looking, so a change after the look still wakes this waiter.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = self.clock.now();
            if let Some(until) = self.paused_until().filter(|u| *u > now) {
                self.clock.sleep_until(until).await;
                continue;
            }
            let urgent_waits = self.waiting[..level]
                .iter()
                .any(|w| w.load(Ordering::SeqCst) > 0);
            let mut wait = MAX_POLL;
            if !urgent_waits && let Some(slot) = self.in_flight.try_acquire() {
                if self.bucket.try_accept() {
                    return PriorityPermit {
                        _slot: slot,
                        changed: self.changed.clone(),
                    };
                }
                wait = self.bucket.until_next_token().clamp(MIN_POLL, MAX_POLL);
            }
            tokio::select! {
                () = &mut changed => {}
                () = self.clock.sleep_until(now + wait) => {}
            }
        }
    }

    /// Nothing is admitted for `d` from now (longer pauses win).
    pub fn pause_for(&self, d: Duration) {
        let until = self.clock.now() + d;
        let mut p = self.paused_until.lock().expect("pause lock");
        if p.is_none_or(|p| p < until) {
            *p = Some(until);
        }
    }

    fn paused_until(&self) -> Option<Instant> {
        *self.paused_until.lock().expect("pause lock")
    }

    /// Waiters at each level now.
    pub fn waiting(&self) -> Vec<usize> {
        self.waiting
            .iter()
            .map(|w| w.load(Ordering::SeqCst))
            .collect()
    }

    /// Work in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.in_flight()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::clock::FakeClock;
    use tokio_test::{assert_pending, assert_ready, task};

    fn throttle(qps: f64, burst: u32, clock: &Arc<FakeClock>) -> PriorityThrottle {
        PriorityThrottle::new(
            qps,
            burst,
            Parallelism::Parallel { max: None },
            3,
            clock.clone(),
        )
    }

    /// Ten tokens a second, a burst of one, that one taken by a caller at `level`: the next
    /// token comes in 100 ms.
    fn drained(clock: &Arc<FakeClock>, level: usize) -> PriorityThrottle {
        let t = throttle(10.0, 1, clock);
        assert_ready!(task::spawn(t.acquire(level)).poll());
        t
    }

    #[test]
    fn a_token_goes_to_the_most_urgent_waiter_even_if_it_came_last() {
        let clock = FakeClock::new();
        let t = drained(&clock, 1);
        // The bucket is empty: a reservation delete waits, then a pool patch comes.
        let mut low = task::spawn(t.acquire(1));
        assert_pending!(low.poll());
        let mut high = task::spawn(t.acquire(0));
        assert_pending!(high.poll());
        assert_eq!(t.waiting(), [1, 1, 0]);
        clock.step(Duration::from_millis(100));
        // Whichever looks first, only the urgent one may take the one new token.
        assert_pending!(low.poll());
        assert_ready!(high.poll());
        assert_eq!(t.waiting(), [0, 1, 0]);
        clock.step(Duration::from_millis(100));
        assert_ready!(low.poll());
        assert_eq!(t.waiting(), [0, 0, 0]);
    }

    #[test]
    fn a_freed_slot_goes_to_the_most_urgent_waiter() {
        let clock = FakeClock::new();
        let t = PriorityThrottle::new(
            0.0,
            0,
            Parallelism::Parallel { max: Some(1) },
            3,
            clock.clone(),
        );
        let mut first = task::spawn(t.acquire(2));
        let held = assert_ready!(first.poll());
        let mut low = task::spawn(t.acquire(1));
        assert_pending!(low.poll());
        let mut high = task::spawn(t.acquire(0));
        assert_pending!(high.poll());
        drop(held);
        assert!(low.is_woken() && high.is_woken());
        assert_pending!(low.poll());
        let held = assert_ready!(high.poll());
        drop(held);
        assert_ready!(low.poll());
    }

    #[test]
    fn a_pause_holds_every_level_until_it_ends() {
        let clock = FakeClock::new();
        let t = throttle(0.0, 0, &clock);
        t.pause_for(Duration::from_secs(2));
        t.pause_for(Duration::from_secs(1)); // a shorter pause does not shorten it
        let mut urgent = task::spawn(t.acquire(0));
        assert_pending!(urgent.poll());
        clock.step(Duration::from_millis(1999));
        assert_pending!(urgent.poll());
        clock.step(Duration::from_millis(1));
        assert_ready!(urgent.poll());
        assert_ready!(task::spawn(t.acquire(2)).poll());
    }

    #[test]
    fn a_dropped_waiter_stops_holding_back_the_less_urgent() {
        let clock = FakeClock::new();
        let t = drained(&clock, 0);
        let mut high = task::spawn(t.acquire(0));
        assert_pending!(high.poll());
        drop(high);
        let mut low = task::spawn(t.acquire(2));
        clock.step(Duration::from_millis(100));
        assert_ready!(low.poll());
        assert_eq!(t.waiting(), [0, 0, 0]);
    }

    #[test]
    fn levels_past_the_last_count_as_the_last() {
        let clock = FakeClock::new();
        let t = throttle(0.0, 0, &clock);
        assert_ready!(task::spawn(t.acquire(7)).poll());
    }
}
