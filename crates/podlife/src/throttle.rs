//! Limits on how fast and how much work runs: a QPS/burst token bucket (non-blocking
//! `try_accept` as the kubelet's image puller uses it, or waiting `acquire`), and a
//! max-in-flight limit with serialized and parallel modes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::clock::SharedClock;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

/// A token bucket: `qps` tokens a second, at most `burst` saved up, starting full.
/// A `qps` of zero means no limit; a `burst` of zero with a positive `qps` admits nothing.
#[derive(Debug)]
pub struct TokenBucket {
    qps: f64,
    burst: u32,
    state: Mutex<Bucket>,
    clock: SharedClock,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(qps: f64, burst: u32, clock: SharedClock) -> Self {
        let now = clock.now();
        TokenBucket {
            qps,
            burst,
            state: Mutex::new(Bucket {
                tokens: f64::from(burst),
                last: now,
            }),
            clock,
        }
    }

    /// Whether this bucket limits anything.
    pub fn is_unlimited(&self) -> bool {
        self.qps <= 0.0
    }

    fn refill(&self, b: &mut Bucket, now: Instant) {
        let elapsed = now.saturating_duration_since(b.last).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.qps).min(f64::from(self.burst));
        b.last = b.last.max(now);
    }

    /// Takes a token if one is there now.
    pub fn try_accept(&self) -> bool {
        if self.is_unlimited() {
            return true;
        }
        let mut b = self.state.lock().expect("token bucket poisoned");
        self.refill(&mut b, self.clock.now());
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// How long until a whole token is there (zero if one is there now, or no limit).
    pub fn until_next_token(&self) -> Duration {
        if self.is_unlimited() {
            return Duration::ZERO;
        }
        let mut b = self.state.lock().expect("token bucket poisoned");
        self.refill(&mut b, self.clock.now());
        if b.tokens >= 1.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((1.0 - b.tokens) / self.qps)
        }
    }

    /// Takes a token now, possibly going into debt, and returns how long the caller must wait
    /// before acting on it (x/time/rate's reservation). With a burst of zero, a burst of one is
    /// assumed so that every caller eventually gets through.
    pub fn reserve(&self) -> Duration {
        if self.is_unlimited() {
            return Duration::ZERO;
        }
        let mut b = self.state.lock().expect("token bucket poisoned");
        let now = self.clock.now();
        self.refill(&mut b, now);
        if self.burst == 0 {
            b.tokens = b.tokens.min(1.0);
        }
        b.tokens -= 1.0;
        if b.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-b.tokens / self.qps)
        }
    }

    /// Waits (on the injected clock) until a reserved token may be used.
    pub async fn acquire(&self) {
        let wait = self.reserve();
        if !wait.is_zero() {
            let deadline = self.clock.now() + wait;
            self.clock.sleep_until(deadline).await;
        }
    }
}

/// How many pieces of work may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parallelism {
    /// One at a time.
    Serialized,
    /// Many at once, at most `max` when given.
    Parallel {
        /// The most in flight at once (none: unlimited).
        max: Option<usize>,
    },
}

/// A max-in-flight limit.
#[derive(Debug, Clone)]
pub struct InFlightLimit {
    semaphore: Option<Arc<Semaphore>>,
    capacity: usize,
}

/// Held while a piece of work is in flight; dropping it frees the slot.
#[derive(Debug)]
pub struct InFlightPermit {
    _permit: Option<OwnedSemaphorePermit>,
}

impl InFlightLimit {
    /// A limit of the given parallelism.
    pub fn new(parallelism: Parallelism) -> Self {
        let capacity = match parallelism {
            Parallelism::Serialized => Some(1),
            Parallelism::Parallel { max } => max.map(|m| m.max(1)),
        };
        InFlightLimit {
            semaphore: capacity.map(|c| Arc::new(Semaphore::new(c))),
            capacity: capacity.unwrap_or(usize::MAX),
        }
    }

    /// Waits for a free slot.
    pub async fn acquire(&self) -> InFlightPermit {
        let permit = match &self.semaphore {
            // The semaphore is never closed, so acquisition cannot fail.
            Some(s) => Some(
                s.clone()
                    .acquire_owned()
                    .await
                    .expect("semaphore never closed"),
            ),
            None => None,
        };
        InFlightPermit { _permit: permit }
    }

    /// Takes a free slot if there is one.
    pub fn try_acquire(&self) -> Option<InFlightPermit> {
        match &self.semaphore {
            Some(s) => s
                .clone()
                .try_acquire_owned()
                .ok()
                .map(|p| InFlightPermit { _permit: Some(p) }),
            None => Some(InFlightPermit { _permit: None }),
        }
    }

    /// Work in flight now (0 for an unlimited limit, which does not count).
    pub fn in_flight(&self) -> usize {
        self.semaphore
            .as_ref()
            .map_or(0, |s| self.capacity - s.available_permits())
    }
}

/// QPS/burst and max-in-flight together: what every API or CRI writer goes through.
#[derive(Debug, Clone)]
pub struct Throttle {
    bucket: Arc<TokenBucket>,
    in_flight: InFlightLimit,
}

impl Throttle {
    /// A throttle of `qps`/`burst` (qps 0: unlimited) with the given parallelism.
    pub fn new(qps: f64, burst: u32, parallelism: Parallelism, clock: SharedClock) -> Self {
        Throttle {
            bucket: Arc::new(TokenBucket::new(qps, burst, clock)),
            in_flight: InFlightLimit::new(parallelism),
        }
    }

    /// Waits for a slot and then for a token.
    pub async fn acquire(&self) -> InFlightPermit {
        let permit = self.in_flight.acquire().await;
        self.bucket.acquire().await;
        permit
    }

    /// A slot and a token if both are there now.
    pub fn try_acquire(&self) -> Option<InFlightPermit> {
        let permit = self.in_flight.try_acquire()?;
        self.bucket.try_accept().then_some(permit)
    }

    /// Work in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.in_flight()
    }
}
