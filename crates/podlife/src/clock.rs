//! Injectable time: every timing decision in podlife reads a [`Clock`], so tests step a
//! [`FakeClock`] instead of sleeping.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// A future that completes at a deadline of a [`Clock`].
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A source of monotonic time that can also wait for a deadline.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;

    /// A future that completes once `now() >= deadline`.
    fn sleep_until(&self, deadline: Instant) -> Sleep;

    /// Time elapsed since `earlier` (zero when `earlier` is in the future).
    fn since(&self, earlier: Instant) -> Duration {
        self.now().saturating_duration_since(earlier)
    }
}

/// A shared, dynamically typed clock.
pub type SharedClock = Arc<dyn Clock>;

/// The wall clock, backed by tokio's timer.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealClock;

impl RealClock {
    /// A [`SharedClock`] of the real time.
    pub fn shared() -> SharedClock {
        Arc::new(RealClock)
    }
}

impl Clock for RealClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        Box::pin(tokio::time::sleep_until(deadline.into()))
    }
}

/// A clock that only moves when told to. Sleepers wake when a step reaches their deadline.
pub struct FakeClock {
    now: Mutex<Instant>,
    tx: watch::Sender<Instant>,
}

impl fmt::Debug for FakeClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeClock")
            .field("now", &self.now())
            .finish()
    }
}

impl FakeClock {
    /// A fake clock that starts at the current instant.
    pub fn new() -> Arc<Self> {
        Self::starting_at(Instant::now())
    }

    /// A fake clock that starts at `start`.
    pub fn starting_at(start: Instant) -> Arc<Self> {
        let (tx, _) = watch::channel(start);
        Arc::new(FakeClock {
            now: Mutex::new(start),
            tx,
        })
    }

    /// Moves time forward by `d` and wakes every sleeper whose deadline has passed.
    pub fn step(&self, d: Duration) {
        let mut now = self.now.lock().expect("fake clock poisoned");
        *now += d;
        self.tx.send_replace(*now);
    }

    /// Number of futures currently waiting on this clock.
    pub fn sleepers(&self) -> usize {
        self.tx.receiver_count()
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Instant {
        *self.now.lock().expect("fake clock poisoned")
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        let mut rx = self.tx.subscribe();
        Box::pin(async move {
            // The sender lives as long as the clock; if it is gone, time stops and we wait forever
            // like a real sleeper whose clock was dropped would be cancelled by its owner.
            let _ = rx.wait_for(|now| *now >= deadline).await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_test::{assert_pending, assert_ready, task};

    #[test]
    fn fake_clock_wakes_sleepers_only_when_stepped_past_deadline() {
        let clock = FakeClock::new();
        let start = clock.now();
        let mut sleep = task::spawn(clock.sleep_until(start + Duration::from_secs(5)));
        assert_pending!(sleep.poll());
        clock.step(Duration::from_secs(4));
        assert_pending!(sleep.poll());
        clock.step(Duration::from_secs(1));
        assert!(sleep.is_woken());
        assert_ready!(sleep.poll());
        assert_eq!(clock.since(start), Duration::from_secs(5));
    }

    #[test]
    fn since_a_future_instant_is_zero() {
        let clock = FakeClock::new();
        let later = clock.now() + Duration::from_secs(1);
        assert_eq!(clock.since(later), Duration::ZERO);
    }
}
