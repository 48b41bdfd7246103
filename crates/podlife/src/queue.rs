//! A keyed work queue with client-go `workqueue` semantics: an item is queued at most once,
//! never handed to two workers at once (an item added while processing is queued again when
//! done), delayed adds, rate-limited adds, and shutdown with or without draining.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::clock::SharedClock;
use crate::throttle::TokenBucket;

/// Decides how long an item waits before it is retried.
pub trait RateLimiter<T>: Send + Sync {
    /// The delay before `item`'s next try (counts a failure).
    fn when(&self, item: &T) -> Duration;
    /// Forgets `item`'s failures.
    fn forget(&self, item: &T);
    /// Failures recorded for `item`.
    fn num_requeues(&self, item: &T) -> u32;
}

/// Failures counted per item (what the per-item limiters share).
#[derive(Debug)]
struct Failures<T>(Mutex<HashMap<T, u32>>);

impl<T: Hash + Eq + Clone> Failures<T> {
    fn new() -> Self {
        Failures(Mutex::new(HashMap::new()))
    }

    /// Counts a failure of `item`; returns the failures counted before it.
    fn count(&self, item: &T) -> u32 {
        let mut failures = self.0.lock().expect("limiter poisoned");
        let n = failures.entry(item.clone()).or_insert(0);
        let before = *n;
        *n = n.saturating_add(1);
        before
    }

    fn forget(&self, item: &T) {
        self.0.lock().expect("limiter poisoned").remove(item);
    }

    fn get(&self, item: &T) -> u32 {
        let failures = self.0.lock().expect("limiter poisoned");
        failures.get(item).copied().unwrap_or(0)
    }
}

/// Per-item exponential backoff: `base * 2^failures`, capped at `max`.
#[derive(Debug)]
pub struct ItemExponentialFailureRateLimiter<T> {
    base: Duration,
    max: Duration,
    failures: Failures<T>,
}

impl<T: Hash + Eq + Clone> ItemExponentialFailureRateLimiter<T> {
    /// Backoff from `base` up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        ItemExponentialFailureRateLimiter {
            base,
            max,
            failures: Failures::new(),
        }
    }
}

impl<T: Hash + Eq + Clone + Send> RateLimiter<T> for ItemExponentialFailureRateLimiter<T> {
    fn when(&self, item: &T) -> Duration {
        let exp = self.failures.count(item);
        // Computed in floating point so that large exponents saturate instead of overflowing.
        let nanos = self.base.as_nanos() as f64 * 2f64.powi(exp.min(1023) as i32);
        if !nanos.is_finite() || nanos >= self.max.as_nanos() as f64 {
            return self.max;
        }
        Duration::from_nanos(nanos as u64)
    }

    fn forget(&self, item: &T) {
        self.failures.forget(item);
    }

    fn num_requeues(&self, item: &T) -> u32 {
        self.failures.get(item)
    }
}

/// `fast` for the first `max_fast` failures of an item, `slow` after.
#[derive(Debug)]
pub struct ItemFastSlowRateLimiter<T> {
    fast: Duration,
    slow: Duration,
    max_fast: u32,
    failures: Failures<T>,
}

impl<T: Hash + Eq + Clone> ItemFastSlowRateLimiter<T> {
    /// `fast` for `max_fast` tries, then `slow`.
    pub fn new(fast: Duration, slow: Duration, max_fast: u32) -> Self {
        ItemFastSlowRateLimiter {
            fast,
            slow,
            max_fast,
            failures: Failures::new(),
        }
    }
}

impl<T: Hash + Eq + Clone + Send> RateLimiter<T> for ItemFastSlowRateLimiter<T> {
    fn when(&self, item: &T) -> Duration {
        let n = self.failures.count(item).saturating_add(1);
        if n <= self.max_fast {
            self.fast
        } else {
            self.slow
        }
    }

    fn forget(&self, item: &T) {
        self.failures.forget(item);
    }

    fn num_requeues(&self, item: &T) -> u32 {
        self.failures.get(item)
    }
}

/// An overall token bucket shared by all items (qps, burst).
#[derive(Debug)]
pub struct BucketRateLimiter {
    bucket: TokenBucket,
}

impl BucketRateLimiter {
    /// A bucket of `qps` and `burst`.
    pub fn new(qps: f64, burst: u32, clock: SharedClock) -> Self {
        BucketRateLimiter {
            bucket: TokenBucket::new(qps, burst, clock),
        }
    }
}

impl<T> RateLimiter<T> for BucketRateLimiter {
    fn when(&self, _item: &T) -> Duration {
        self.bucket.reserve()
    }
    fn forget(&self, _item: &T) {}
    fn num_requeues(&self, _item: &T) -> u32 {
        0
    }
}

/// The longest delay of several limiters.
pub struct MaxOfRateLimiter<T> {
    limiters: Vec<Box<dyn RateLimiter<T>>>,
}

impl<T> MaxOfRateLimiter<T> {
    /// The maximum of `limiters`.
    pub fn new(limiters: Vec<Box<dyn RateLimiter<T>>>) -> Self {
        MaxOfRateLimiter { limiters }
    }
}

impl<T> RateLimiter<T> for MaxOfRateLimiter<T> {
    fn when(&self, item: &T) -> Duration {
        self.limiters
            .iter()
            .map(|l| l.when(item))
            .max()
            .unwrap_or_default()
    }
    fn forget(&self, item: &T) {
        self.limiters.iter().for_each(|l| l.forget(item));
    }
    fn num_requeues(&self, item: &T) -> u32 {
        self.limiters
            .iter()
            .map(|l| l.num_requeues(item))
            .max()
            .unwrap_or(0)
    }
}

/// client-go's default controller limiter: per-item exponential 5 ms .. 1000 s, and an overall
/// 10 qps / burst 100 bucket, whichever is longer.
pub fn default_controller_rate_limiter<T>(clock: SharedClock) -> MaxOfRateLimiter<T>
where
    T: Hash + Eq + Clone + Send + 'static,
{
    MaxOfRateLimiter::new(vec![
        Box::new(ItemExponentialFailureRateLimiter::new(
            Duration::from_millis(5),
            Duration::from_secs(1000),
        )),
        Box::new(BucketRateLimiter::new(10.0, 100, clock)),
    ])
}

#[derive(Debug)]
struct State<T> {
    queue: VecDeque<T>,
    /// Items that need processing (queued, or re-added while processing).
    dirty: HashSet<T>,
    processing: HashSet<T>,
    /// Delayed items by (ready time, sequence), with the reverse index.
    waiting: BTreeMap<(Instant, u64), T>,
    waiting_at: HashMap<T, (Instant, u64)>,
    seq: u64,
    shutting_down: bool,
    drain: bool,
}

/// The work queue. Cheap to share behind an `Arc`.
pub struct WorkQueue<T> {
    state: Mutex<State<T>>,
    /// Wakes getters (new item, ready delayed item, shutdown).
    ready: Notify,
    /// Wakes a draining shutdown when processing empties.
    drained: Notify,
    clock: SharedClock,
    limiter: Box<dyn RateLimiter<T>>,
}

impl<T: Hash + Eq + Clone + Send + 'static> WorkQueue<T> {
    /// A queue with client-go's default controller rate limiter.
    pub fn new(clock: SharedClock) -> Arc<Self> {
        let limiter = default_controller_rate_limiter(clock.clone());
        Self::with_rate_limiter(clock, Box::new(limiter))
    }

    /// A queue with the given rate limiter.
    pub fn with_rate_limiter(clock: SharedClock, limiter: Box<dyn RateLimiter<T>>) -> Arc<Self> {
        Arc::new(WorkQueue {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                dirty: HashSet::new(),
                processing: HashSet::new(),
                waiting: BTreeMap::new(),
                waiting_at: HashMap::new(),
                seq: 0,
                shutting_down: false,
                drain: false,
            }),
            ready: Notify::new(),
            drained: Notify::new(),
            clock,
            limiter,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().expect("work queue poisoned")
    }

    /// Queues `item` unless it is already queued; an item being processed is queued again
    /// when it is done.
    pub fn add(&self, item: T) {
        let mut s = self.lock();
        if Self::add_locked(&mut s, item) {
            self.ready.notify_waiters();
        }
    }

    /// Returns whether the item became ready to hand out.
    fn add_locked(s: &mut State<T>, item: T) -> bool {
        if s.shutting_down || s.dirty.contains(&item) {
            return false;
        }
        s.dirty.insert(item.clone());
        if s.processing.contains(&item) {
            return false;
        }
        s.queue.push_back(item);
        true
    }

    /// Moves delayed items whose time has come to the queue; returns the next deadline.
    fn promote(&self, s: &mut State<T>) -> Option<Instant> {
        let now = self.clock.now();
        let mut woke = false;
        while let Some(entry) = s.waiting.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let item = entry.remove();
            s.waiting_at.remove(&item);
            woke |= Self::add_locked(s, item);
        }
        if woke {
            self.ready.notify_waiters();
        }
        s.waiting.first_key_value().map(|((t, _), _)| *t)
    }

    /// Queues `item` after `delay`. If it is already waiting, it only moves earlier.
    pub fn add_after(&self, item: T, delay: Duration) {
        if delay.is_zero() {
            return self.add(item);
        }
        let ready_at = self.clock.now() + delay;
        let mut s = self.lock();
        if s.shutting_down {
            return;
        }
        if let Some(&key) = s.waiting_at.get(&item) {
            if key.0 <= ready_at {
                return;
            }
            s.waiting.remove(&key);
        }
        s.seq += 1;
        let key = (ready_at, s.seq);
        s.waiting.insert(key, item.clone());
        s.waiting_at.insert(item, key);
        // A getter may be sleeping until a later deadline.
        self.ready.notify_waiters();
    }

    /// Queues `item` after its rate limiter's delay (a failure is counted).
    pub fn add_rate_limited(&self, item: T) {
        let delay = self.limiter.when(&item);
        self.add_after(item, delay);
    }

    /// Clears `item`'s failure history (after it succeeded or was given up).
    pub fn forget(&self, item: &T) {
        self.limiter.forget(item);
    }

    /// Failures recorded for `item`.
    pub fn num_requeues(&self, item: &T) -> u32 {
        self.limiter.num_requeues(item)
    }

    /// Items ready to be handed out (not counting delayed or in-process ones).
    pub fn len(&self) -> usize {
        let mut s = self.lock();
        self.promote(&mut s);
        s.queue.len()
    }

    /// Whether no item is ready.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Items waiting for their delay.
    pub fn delayed_len(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Takes a ready item without waiting and marks it as processing.
    pub fn try_get(&self) -> Option<T> {
        let mut s = self.lock();
        self.promote(&mut s);
        Self::take_locked(&mut s)
    }

    fn take_locked(s: &mut State<T>) -> Option<T> {
        let item = s.queue.pop_front()?;
        s.dirty.remove(&item);
        s.processing.insert(item.clone());
        Some(item)
    }

    /// Waits for an item and marks it as processing. `None` once the queue is shut down and
    /// nothing is left in it.
    pub async fn get(&self) -> Option<T> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let deadline = {
                let mut s = self.lock();
                let deadline = self.promote(&mut s);
                if let Some(item) = Self::take_locked(&mut s) {
                    return Some(item);
                }
                if s.shutting_down {
                    return None;
                }
                deadline
            };
            match deadline {
                Some(at) => {
                    let sleep = self.clock.sleep_until(at);
                    tokio::select! {
                        _ = notified => {}
                        _ = sleep => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Marks `item` as processed; if it was added meanwhile, it is queued again.
    pub fn done(&self, item: &T) {
        let mut s = self.lock();
        s.processing.remove(item);
        if s.dirty.contains(item) {
            s.queue.push_back(item.clone());
            self.ready.notify_waiters();
        } else if s.processing.is_empty() {
            self.drained.notify_waiters();
        }
    }

    /// Stops the queue: new adds are ignored, getters get what is still queued and then
    /// `None`, and in-process items are not waited for.
    pub fn shutdown(&self) {
        let mut s = self.lock();
        s.shutting_down = true;
        s.drain = false;
        drop(s);
        self.ready.notify_waiters();
        self.drained.notify_waiters();
    }

    /// Stops the queue like [`shutdown`](Self::shutdown), then waits until every item being
    /// processed is done.
    pub async fn shutdown_with_drain(&self) {
        {
            let mut s = self.lock();
            s.shutting_down = true;
            s.drain = true;
        }
        self.ready.notify_waiters();
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.lock();
                if !s.drain || s.processing.is_empty() {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Whether the queue is shutting down.
    pub fn shutting_down(&self) -> bool {
        self.lock().shutting_down
    }
}
