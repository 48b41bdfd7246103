//! Write budgets. Pool patches and reservation deletes each have their own rate (a freed pool
//! entry is what pods wait for; a reservation delete is one small request per address), and
//! every write, Events included, shares one cap in which pool patches go first, then
//! reservation deletes, then Events. A `429` pauses them all for the server's `Retry-After`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::core::Status;
use podlife::clock::SharedClock;
use podlife::priority::{PriorityPermit, PriorityThrottle};
use podlife::throttle::{Parallelism, TokenBucket};

use crate::telemetry::WriteMetrics;

/// Sends of one write answered `429` before it is given up (the caller retries it later).
const MAX_THROTTLED: u32 = 30;
/// The pause after a `429` that names no delay.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The longest pause one `429` can ask for.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Whether a write's token of its kind's own rate was taken before it was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Paid {
    /// Taken: only the shared cap is waited for.
    Yes,
    /// Not taken: the write waits for its kind's rate first.
    No,
}

/// What a write is, most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// A patch of a pool (releases, fences) or its re-read after a conflict.
    Pool = 0,
    /// A reservation delete.
    Reservation = 1,
    /// An Event.
    Event = 2,
}

/// `--pool-write-qps`'s default: 4 pools patched at the default 100 ms interval use 40 a
/// second, so a steady stream of deletions waits for its pool's spacing, not for a token (at 20
/// a second, 4 busy pools got a token every 200 ms each; see `pools::sim`).
pub const DEFAULT_POOL_WRITE_QPS: f64 = 50.0;
/// `--pool-write-burst`'s default.
pub const DEFAULT_POOL_WRITE_BURST: u32 = 100;

/// The limits, as the flags give them (a qps of 0: no limit).
#[derive(Debug, Clone, Copy)]
pub struct BudgetConfig {
    /// Pool patches per second and burst.
    pub pool_qps: f64,
    pub pool_burst: u32,
    /// Reservation deletes per second and burst.
    pub reservation_qps: f64,
    pub reservation_burst: u32,
    /// All writes per second and burst.
    pub write_qps: f64,
    pub write_burst: u32,
    /// All writes in flight at once.
    pub max_in_flight: usize,
}

impl BudgetConfig {
    /// Budgets that limit nothing (at most 8 writes in flight).
    pub const UNLIMITED: BudgetConfig = BudgetConfig {
        pool_qps: 0.0,
        pool_burst: 0,
        reservation_qps: 0.0,
        reservation_burst: 0,
        write_qps: 0.0,
        write_burst: 0,
        max_in_flight: 8,
    };
}

struct Inner {
    pools: TokenBucket,
    reservations: TokenBucket,
    all: PriorityThrottle,
    metrics: WriteMetrics,
    /// Whether writes may go now (the controller's leadership); none: always.
    gate: std::sync::OnceLock<Gate>,
}

/// Whether writes may go now.
pub type Gate = Arc<dyn Fn() -> bool + Send + Sync>;

/// The reason of the error a write refused at the gate gets.
pub const NOT_LEADER: &str = "NotLeader";

/// The error of a write refused at the gate: this replica does not lead (any more).
pub fn not_leader() -> kube::Error {
    kube::Error::Api(
        kube::core::Status::failure(
            "not written: this replica does not lead (its Lease was lost or not renewed within the renew deadline)",
            NOT_LEADER,
        )
        .with_code(503)
        .boxed(),
    )
}

/// Whether `e` is a write refused at the gate.
pub fn is_not_leader(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.reason == NOT_LEADER)
}

/// The budgets of one program, shared by its writer and its Event publisher.
#[derive(Clone)]
pub struct Budgets(Arc<Inner>);

impl Budgets {
    /// Budgets of `config` on `clock`, counting into `metrics`.
    /// A burst of zero is taken as one: a rate with no burst would admit nothing.
    pub fn new(config: BudgetConfig, clock: SharedClock, metrics: WriteMetrics) -> Self {
        Budgets(Arc::new(Inner {
            pools: TokenBucket::new(config.pool_qps, config.pool_burst.max(1), clock.clone()),
            reservations: TokenBucket::new(
                config.reservation_qps,
                config.reservation_burst.max(1),
                clock.clone(),
            ),
            all: PriorityThrottle::new(
                config.write_qps,
                config.write_burst.max(1),
                Parallelism::Parallel {
                    max: Some(config.max_in_flight),
                },
                3,
                clock,
            ),
            metrics,
            gate: std::sync::OnceLock::new(),
        }))
    }

    /// Whether writes may go now (the gate, if any).
    pub fn open(&self) -> bool {
        self.0.gate.get().is_none_or(|open| open())
    }

    /// Sets the gate every write passes right before it goes (once); only the Events of
    /// releases written go past it ([`send_report`](Self::send_report)).
    pub fn set_gate(&self, gate: Gate) {
        let _ = self.0.gate.set(gate);
    }

    /// Reserves a pool patch's token of the pool rate, in turn with every other pool write,
    /// and says how long until it may be used: the batcher forms the batch then and sends it
    /// with [`Paid::Yes`].
    pub fn reserve_pool_token(&self) -> Duration {
        self.0.pools.reserve()
    }

    /// Waits until a write of `kind` may go: its own rate (unless `paid`), then the shared cap.
    pub async fn admit(&self, kind: WriteKind, paid: Paid) -> PriorityPermit {
        match (kind, paid) {
            (_, Paid::Yes) | (WriteKind::Event, _) => {}
            (WriteKind::Pool, Paid::No) => self.0.pools.acquire().await,
            (WriteKind::Reservation, Paid::No) => self.0.reservations.acquire().await,
        }
        self.0.all.acquire(kind as usize).await
    }

    /// Sends one write of `kind` within the budgets. When the apiserver answers `429` (API
    /// Priority and Fairness rejected it), every write pauses for the `Retry-After` it gives
    /// and this one is sent again, up to a limit.
    pub async fn send<T, F, Fut>(&self, kind: WriteKind, write: F) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        self.send_paid(kind, Paid::No, write).await
    }

    /// [`send`](Self::send), its first send's token of the kind's own rate already taken when
    /// `paid` (a resend after a `429` takes one again).
    pub async fn send_paid<T, F, Fut>(
        &self,
        kind: WriteKind,
        paid: Paid,
        write: F,
    ) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        self.send_within(kind, paid, true, write).await
    }

    /// [`send`](Self::send) past the gate: for the Event of a release this replica wrote,
    /// which decides nothing and is still true once it no longer leads (a leader cut off right
    /// after a release publishes the release's Event once it can).
    pub async fn send_report<T, F, Fut>(&self, write: F) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        self.send_ungated(WriteKind::Event, write).await
    }

    /// [`send`](Self::send) past the gate, for a write that decides nothing and only reports
    /// or repairs one this replica made, which no other replica knows is due: a release's
    /// Event, a reservation put back for an allocation that appeared while this replica
    /// deleted it (a create, refused if one exists).
    pub async fn send_ungated<T, F, Fut>(&self, kind: WriteKind, write: F) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        self.send_within(kind, Paid::No, false, write).await
    }

    async fn send_within<T, F, Fut>(
        &self,
        kind: WriteKind,
        mut paid: Paid,
        gated: bool,
        mut write: F,
    ) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let mut throttled = 0;
        loop {
            let permit = self
                .admit(kind, std::mem::replace(&mut paid, Paid::No))
                .await;
            if gated && !self.open() {
                return Err(not_leader());
            }
            let result = write().await;
            drop(permit);
            match &result {
                Err(kube::Error::Api(s)) if s.code == 429 && throttled < MAX_THROTTLED => {
                    throttled += 1;
                    let wait = retry_after(s);
                    self.0.metrics.throttled.inc();
                    self.0.all.pause_for(wait);
                    tracing::debug!(?kind, ?wait, "the apiserver asked to slow down (429)");
                }
                _ => return result,
            }
        }
    }
}

impl Budgets {
    /// [`send_paid`](Self::send_paid)s one write of `kind`, counting each request it sends as
    /// an API write of `verb` in `metrics`.
    pub async fn send_counted<T, F, Fut>(
        &self,
        kind: WriteKind,
        paid: Paid,
        metrics: &WriteMetrics,
        verb: &str,
        write: F,
    ) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        self.send_paid(kind, paid, counted(metrics, verb, write))
            .await
    }
}

/// `write`, counting each request it sends as an API write of `verb` in `metrics`.
pub fn counted<'a, F, Fut>(
    metrics: &'a WriteMetrics,
    verb: &'a str,
    mut write: F,
) -> impl FnMut() -> Fut + 'a
where
    F: FnMut() -> Fut + 'a,
{
    move || {
        metrics.write(verb);
        write()
    }
}

/// The delay a `429` asks for (its `Retry-After`, which the apiserver also puts in the
/// Status details), within bounds.
fn retry_after(status: &Status) -> Duration {
    let secs = status.details.as_ref().map_or(0, |d| d.retry_after_seconds);
    if secs == 0 {
        DEFAULT_RETRY_AFTER
    } else {
        Duration::from_secs(u64::from(secs)).min(MAX_RETRY_AFTER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Status as the apiserver sends it with a 429.
    fn status(code: u16, retry_after_seconds: Option<u32>) -> Status {
        let mut s = serde_json::json!({
            "status": "Failure", "message": "too many requests", "reason": "TooManyRequests",
            "code": code,
        });
        if let Some(secs) = retry_after_seconds {
            s["details"] = serde_json::json!({"retryAfterSeconds": secs});
        }
        serde_json::from_value(s).expect("a Status")
    }

    /// Budgets of `config` on a clock that does not move.
    fn on_still_clock(config: BudgetConfig) -> Budgets {
        let metrics = WriteMetrics::new(&mut prometheus_client::registry::Registry::default());
        Budgets::new(config, podlife::clock::FakeClock::new(), metrics)
    }

    /// Whether a write of `kind` is admitted without waiting.
    fn admitted_now(budgets: &Budgets, kind: WriteKind, paid: Paid) -> bool {
        use futures::FutureExt;
        budgets.admit(kind, paid).now_or_never().is_some()
    }

    #[test]
    fn a_burst_of_zero_still_admits_writes_at_the_rate() {
        let budgets = on_still_clock(BudgetConfig {
            write_qps: 10.0,
            ..BudgetConfig::UNLIMITED
        });
        // Taken as a burst of one: the first write goes at once, the next waits for the rate.
        assert!(
            admitted_now(&budgets, WriteKind::Event, Paid::No),
            "a write budget of burst 0 admitted nothing"
        );
        assert!(!admitted_now(&budgets, WriteKind::Event, Paid::No));
    }

    #[test]
    fn a_pool_patch_whose_token_the_batcher_reserved_waits_only_for_the_shared_cap() {
        let budgets = on_still_clock(BudgetConfig {
            pool_qps: 1.0,
            pool_burst: 1,
            ..BudgetConfig::UNLIMITED
        });
        assert_eq!(budgets.reserve_pool_token(), Duration::ZERO);
        // One token a second, burst 1: the next is reserved for a second later.
        assert_eq!(budgets.reserve_pool_token(), Duration::from_secs(1));
        // The batch that reserved its token goes without waiting for the rate again; an
        // unpaid pool write waits for it.
        assert!(admitted_now(&budgets, WriteKind::Pool, Paid::Yes));
        assert!(!admitted_now(&budgets, WriteKind::Pool, Paid::No));
    }

    #[test]
    fn a_closed_gate_refuses_writes_but_not_the_report_of_a_write_made() {
        use futures::FutureExt;
        let budgets = on_still_clock(BudgetConfig::UNLIMITED);
        budgets.set_gate(Arc::new(|| false));
        let sent = std::sync::atomic::AtomicU32::new(0);
        let write = || {
            sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async { Ok::<(), kube::Error>(()) }
        };
        for kind in [WriteKind::Pool, WriteKind::Reservation, WriteKind::Event] {
            let refused = budgets.send(kind, write).now_or_never().expect("no wait");
            assert!(refused.is_err_and(|e| is_not_leader(&e)), "{kind:?} went");
        }
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 0);
        let report = budgets.send_report(write).now_or_never().expect("no wait");
        assert!(report.is_ok());
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 1);
        let restore = budgets.send_ungated(WriteKind::Reservation, write);
        assert!(restore.now_or_never().expect("no wait").is_ok());
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 2);
    }

    #[test]
    fn a_429_waits_what_the_server_asks_within_bounds() {
        assert_eq!(retry_after(&status(429, Some(3))), Duration::from_secs(3));
        assert_eq!(retry_after(&status(429, None)), DEFAULT_RETRY_AFTER);
        assert_eq!(retry_after(&status(429, Some(0))), DEFAULT_RETRY_AFTER);
        assert_eq!(retry_after(&status(429, Some(3600))), MAX_RETRY_AFTER);
    }
}
