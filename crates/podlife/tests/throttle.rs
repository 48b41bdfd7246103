//! The kubelet image manager's table (pkg/kubelet/images/image_manager_test.go) replayed on
//! podlife's backoff and throttle: a puller that backs off per image after failures, refuses
//! pulls over its QPS, and runs at most N pulls at once.

use std::time::Duration;

use podlife::backoff::Backoff;
use podlife::clock::{FakeClock, SharedClock};
use podlife::throttle::{InFlightLimit, Parallelism, Throttle, TokenBucket};
use tokio_test::{assert_pending, assert_ready, task};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PullError {
    /// The pull was tried and failed (or was refused by the QPS limit).
    Pull,
    /// Not tried: the image is backing off.
    BackOff,
}

/// What one call did: the runtime calls made and the result.
type Outcome = (&'static [&'static str], Result<(), PullError>);

struct Puller {
    backoff: Backoff,
    qps: TokenBucket,
    clock: SharedClock,
    fail_pulls: bool,
}

impl Puller {
    fn new(clock: SharedClock, qps: f64, burst: u32, fail_pulls: bool) -> Self {
        Puller {
            backoff: Backoff::new(
                Duration::from_secs(1),
                Duration::from_secs(60),
                clock.clone(),
            ),
            qps: TokenBucket::new(qps, burst, clock.clone()),
            clock,
            fail_pulls,
        }
    }

    fn ensure_image(&self, image: &str) -> Outcome {
        let key = image.to_string();
        let now = self.clock.now();
        if self.backoff.is_in_backoff_since(&key, now) {
            return (&["GetImageRef"], Err(PullError::BackOff));
        }
        if !self.qps.try_accept() {
            self.backoff
                .next(&key, now, Some("pull QPS exceeded".into()));
            return (&["GetImageRef"], Err(PullError::Pull));
        }
        if self.fail_pulls {
            self.backoff.next(&key, now, Some("404".into()));
            return (&["GetImageRef", "PullImage"], Err(PullError::Pull));
        }
        self.backoff.reset(&key);
        (&["GetImageRef", "PullImage"], Ok(()))
    }
}

fn run_case(name: &str, qps: f64, burst: u32, fail_pulls: bool, expected: &[Outcome]) {
    let clock = FakeClock::new();
    let puller = Puller::new(clock.clone(), qps, burst, fail_pulls);
    for (i, want) in expected.iter().enumerate() {
        clock.step(Duration::from_secs(1));
        assert_eq!(
            &puller.ensure_image("present_image"),
            want,
            "{name}: call {i}"
        );
    }
}

const PULLED: Outcome = (&["GetImageRef", "PullImage"], Ok(()));

#[test]
fn image_present_pull_always() {
    run_case("no qps limit", 0.0, 0, false, &[PULLED, PULLED, PULLED]);
    run_case(
        "qps 400 burst 600",
        400.0,
        600,
        false,
        &[PULLED, PULLED, PULLED],
    );
}

#[test]
fn pull_backoff_after_repeated_failure() {
    let failed: Outcome = (&["GetImageRef", "PullImage"], Err(PullError::Pull));
    let backoff: Outcome = (&["GetImageRef"], Err(PullError::BackOff));
    run_case(
        "unable to fetch",
        0.0,
        0,
        true,
        &[failed, failed, backoff, failed, backoff, backoff],
    );
}

#[test]
fn qps_exceeded() {
    let refused: Outcome = (&["GetImageRef"], Err(PullError::Pull));
    let backoff: Outcome = (&["GetImageRef"], Err(PullError::BackOff));
    run_case(
        "qps 2000 burst 0",
        2000.0,
        0,
        false,
        &[refused, refused, backoff],
    );
}

#[test]
fn backoff_remembers_the_last_error() {
    let clock = FakeClock::new();
    let puller = Puller::new(clock.clone(), 2000.0, 0, false);
    let _ = puller.ensure_image("img");
    assert_eq!(
        puller.backoff.last_error(&"img".into()).as_deref(),
        Some("pull QPS exceeded")
    );
}

#[test]
fn max_parallel_5_with_7_callers() {
    let limit = InFlightLimit::new(Parallelism::Parallel { max: Some(5) });
    let mut callers: Vec<_> = (0..7).map(|_| task::spawn(limit.acquire())).collect();
    let mut running: Vec<_> = callers[..5]
        .iter_mut()
        .map(|c| assert_ready!(c.poll()))
        .collect();
    for c in &mut callers[5..] {
        assert_pending!(c.poll());
    }
    assert_eq!(limit.in_flight(), 5);
    // Two pulls finish: the two waiting callers go through.
    running.truncate(3);
    for c in &mut callers[5..] {
        assert!(c.is_woken());
        running.push(assert_ready!(c.poll()));
    }
    assert_eq!(limit.in_flight(), 5);
    running.clear();
    assert_eq!(limit.in_flight(), 0);
}

#[test]
fn serialized_runs_one_at_a_time() {
    let limit = InFlightLimit::new(Parallelism::Serialized);
    let first = limit.try_acquire().expect("free");
    assert!(limit.try_acquire().is_none());
    let mut second = task::spawn(limit.acquire());
    assert_pending!(second.poll());
    drop(first);
    assert_ready!(second.poll());
}

#[test]
fn unlimited_parallelism_never_waits() {
    let limit = InFlightLimit::new(Parallelism::Parallel { max: None });
    let permits: Vec<_> = (0..100)
        .map(|_| limit.try_acquire().expect("unlimited"))
        .collect();
    assert_eq!(permits.len(), 100);
}

#[test]
fn throttle_waits_for_tokens_on_the_injected_clock() {
    let clock = FakeClock::new();
    let throttle = Throttle::new(
        10.0,
        2,
        Parallelism::Parallel { max: Some(4) },
        clock.clone(),
    );
    let _a = throttle.try_acquire().expect("burst token 1");
    let _b = throttle.try_acquire().expect("burst token 2");
    assert!(throttle.try_acquire().is_none(), "bucket empty");
    let mut c = task::spawn(throttle.acquire());
    assert_pending!(c.poll());
    clock.step(Duration::from_millis(99));
    assert_pending!(c.poll());
    clock.step(Duration::from_millis(1));
    let _c = assert_ready!(c.poll());
    assert_eq!(throttle.in_flight(), 3);
}

#[test]
fn token_bucket_reserve_spaces_callers_at_the_rate() {
    let clock = FakeClock::new();
    let bucket = TokenBucket::new(10.0, 1, clock.clone());
    assert_eq!(bucket.reserve(), Duration::ZERO);
    assert_eq!(bucket.reserve(), Duration::from_millis(100));
    assert_eq!(bucket.reserve(), Duration::from_millis(200));
    clock.step(Duration::from_millis(300));
    assert_eq!(bucket.reserve(), Duration::ZERO);
}
