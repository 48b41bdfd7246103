//! When each pool's next patch may go, pure: at most one patch per pool in flight, a pool's
//! patches spaced by the interval or by what its patches take, and what arrives meanwhile
//! joins the next patch (a burst of deletions becomes a few large patches, a lone deletion
//! goes at once). The writer's batcher drives it with the clock, the channel and the pool
//! write budget.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::telemetry::logging::TIMELINE;

/// Most requests in one pool patch (a larger backlog goes in the next).
pub const MAX_BATCH: usize = 1000;
/// A pool's patches take at most this share of the time: the next patch waits
/// `PATCH_DUTY` times what its patches take (smoothed) from the last one's start. A patch
/// costs the apiserver about as much as the whole pool, whatever it removes, so a large pool,
/// or a backlog's large patches, go less often and carry more, before the patches themselves
/// saturate the apiserver (4 pools of 550 entries at 50 deletions/s on 2 cores: p50 613 ms with
/// a fixed 200 ms spacing, 327 ms with this; see benches/scale.rs).
const PATCH_DUTY: u32 = 4;
/// The longest a pool's patch time can space its patches (a slow apiserver still gets one
/// patch per pool in flight at most).
pub const MAX_SPACING: Duration = Duration::from_secs(1);
/// A pool's patch time is forgotten after this long without a patch.
const COST_MEMORY: Duration = Duration::from_secs(300);
/// A burst: at least this many requests pending for a pool, arriving on average at most
/// [`BURST_GAP`] apart (40 a second for one pool; a steady 50 deletions a second over 4 pools
/// is 12.5), and fewer than a full patch ([`MAX_BATCH`]: a backlog goes at once). A pool in a
/// burst waits for [`BURST_SPACING`] from its last patch's start, so a mass deletion leaves in
/// fewer, larger patches, unless its arrivals pause for [`BURST_QUIET`] (the burst's end goes
/// at once).
const BURST_MIN: usize = 16;
const BURST_GAP: Duration = Duration::from_millis(25);
const BURST_QUIET: Duration = Duration::from_millis(100);
/// A burst's patches carry at least what arrives at [`BURST_GAP`] in this long (60 entries): a
/// mass deletion slowed towards the burst rate by a busy apiserver costs under 0.02 patches per
/// address (with 1 s, 0.022 in the scale bench, where 2,000 deletes took 10 s on 2 cores).
pub const BURST_SPACING: Duration = Duration::from_millis(1500);

/// How long after a patch's start the next patch of its pool may go: `interval`, or
/// `PATCH_DUTY` times the pool's estimated patch time if longer (up to `MAX_SPACING`).
pub fn spacing(interval: Duration, estimate: Option<Duration>) -> Duration {
    let cost = estimate.map_or(Duration::ZERO, |d| (d * PATCH_DUTY).min(MAX_SPACING));
    interval.max(cost)
}

/// The pool's patch time estimate after a patch that took `took`: a moving average, so one
/// slow patch does not space the next ones by much.
pub fn smoothed(estimate: Option<Duration>, took: Duration) -> Duration {
    match estimate {
        Some(e) => (e * 3 + took) / 4,
        None => took,
    }
}

/// Pending requests per pool and when each pool may be patched next.
#[derive(Debug)]
pub struct PoolSchedule<T> {
    interval: Duration,
    pending: BTreeMap<String, Vec<T>>,
    in_flight: HashSet<String>,
    /// When each pool's last patch started.
    last_sent: HashMap<String, Instant>,
    /// Each pool's estimated patch time, and when it was last updated.
    cost: HashMap<String, (Duration, Instant)>,
    /// When each due pool's reserved write token may be used.
    token_at: HashMap<String, Instant>,
    /// When the oldest and the newest of each pool's pending requests arrived (only requests
    /// queued with [`arrived`](Self::arrived)).
    arrivals: HashMap<String, (Instant, Instant)>,
}

impl<T> PoolSchedule<T> {
    /// A schedule spacing each pool's patches by at least `interval`.
    pub fn new(interval: Duration) -> Self {
        PoolSchedule {
            interval,
            pending: BTreeMap::new(),
            in_flight: HashSet::new(),
            last_sent: HashMap::new(),
            cost: HashMap::new(),
            token_at: HashMap::new(),
            arrivals: HashMap::new(),
        }
    }

    /// Queues a request for `pool`.
    pub fn push(&mut self, pool: String, item: T) {
        self.pending.entry(pool).or_default().push(item);
    }

    /// Queues a request for `pool` that arrived at `now`: how fast a pool's requests arrive
    /// tells a burst (see [`BURST_MIN`]).
    pub fn arrived(&mut self, pool: String, item: T, now: Instant) {
        let span = self.arrivals.entry(pool.clone()).or_insert((now, now));
        span.1 = span.1.max(now);
        self.push(pool, item);
    }

    /// When `pool` may be patched again (`None`: now).
    fn due(&self, pool: &str) -> Option<Instant> {
        let estimate = self.cost.get(pool).map(|c| c.0);
        let last = self.last_sent.get(pool)?;
        let due = *last + spacing(self.interval, estimate);
        match self.burst(pool) {
            Some(newest) => Some(due.max((*last + BURST_SPACING).min(newest + BURST_QUIET))),
            None => Some(due),
        }
    }

    /// When `pool`'s newest request arrived, if its pending requests are a burst.
    fn burst(&self, pool: &str) -> Option<Instant> {
        let n = self.pending.get(pool).map_or(0, Vec::len);
        let (oldest, newest) = *self.arrivals.get(pool)?;
        let gaps = u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX);
        let arriving_fast = newest - oldest <= BURST_GAP * gaps;
        ((BURST_MIN..MAX_BATCH).contains(&n) && arriving_fast).then_some(newest)
    }

    /// The pools with requests that may be patched now, due longest first (those never
    /// patched or not for a while by name).
    fn due_now(&self, now: Instant) -> Vec<String> {
        let mut due: Vec<(Option<Instant>, &String)> = self
            .pending
            .keys()
            .filter(|p| !self.in_flight.contains(*p))
            .map(|p| (self.due(p), p))
            .filter(|(t, _)| t.is_none_or(|t| t <= now))
            .collect();
        due.sort();
        due.into_iter().map(|(_, p)| p.clone()).collect()
    }

    /// The batches that may go now (each pool's first [`MAX_BATCH`] requests), marked in
    /// flight; forgets what no longer matters. Without a budget: the tests' form.
    #[cfg(test)]
    pub fn ready(&mut self, now: Instant) -> Vec<(String, Vec<T>)> {
        self.ready_within(now, || Duration::ZERO)
    }

    /// Like [`ready`](Self::ready), each due pool first reserving its write token with
    /// `reserve`, which says how long until the token may be used. A pool keeps its requests
    /// until then, and what arrives meanwhile joins its batch instead of the next one. Every
    /// due pool reserves as soon as it is due, so none is passed over.
    pub fn ready_within(
        &mut self,
        now: Instant,
        mut reserve: impl FnMut() -> Duration,
    ) -> Vec<(String, Vec<T>)> {
        let ready = self.due_now(now);
        let mut out = Vec::with_capacity(ready.len());
        for pool in ready {
            let entry = self.token_at.entry(pool.clone());
            let token_at = *entry.or_insert_with(|| {
                let wait = reserve();
                tracing::trace!(target: TIMELINE, %pool, wait_us = wait.as_micros() as u64, "token reserved");
                now + wait
            });
            if token_at > now {
                continue;
            }
            self.token_at.remove(&pool);
            let Some(mut items) = self.pending.remove(&pool) else {
                continue;
            };
            // What is left of a backlog keeps its arrival times (its oldest is older still).
            if items.len() <= MAX_BATCH {
                self.arrivals.remove(&pool);
            }
            if items.len() > MAX_BATCH {
                self.pending
                    .insert(pool.clone(), items.split_off(MAX_BATCH));
            }
            self.in_flight.insert(pool.clone());
            self.last_sent.insert(pool.clone(), now);
            out.push((pool, items));
        }
        // Pools not written for a while (their spacing has passed).
        let forget_after = self.interval.max(MAX_SPACING).max(BURST_SPACING);
        let in_flight = &self.in_flight;
        self.last_sent.retain(|pool, t| {
            in_flight.contains(pool) || now.saturating_duration_since(*t) < forget_after
        });
        self.cost
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < COST_MEMORY);
        out
    }

    /// The soonest a waiting pool may be patched, by its spacing or its reserved token
    /// (`None`: nothing waits on the clock).
    pub fn next_wake(&self, now: Instant) -> Option<Instant> {
        self.pending
            .keys()
            .filter(|p| !self.in_flight.contains(*p))
            .filter_map(|p| match (self.token_at.get(p).copied(), self.due(p)) {
                (Some(t), Some(d)) => Some(t.max(d)),
                (t, d) => t.or(d),
            })
            .filter(|t| *t > now)
            .min()
    }

    /// `pool`'s patch finished (written or not) after `took`.
    pub fn finished(&mut self, pool: &str, took: Duration, now: Instant) {
        self.in_flight.remove(pool);
        let estimate = smoothed(self.cost.get(pool).map(|c| c.0), took);
        self.cost.insert(pool.to_owned(), (estimate, now));
    }

    /// Nothing pending and nothing in flight.
    pub fn idle(&self) -> bool {
        self.in_flight.is_empty() && self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_pool_is_spaced_by_the_interval_or_by_what_its_patches_take() {
        let interval = MS(200);
        assert_eq!(spacing(interval, None), MS(200));
        // Quick patches keep the interval; slow ones space by PATCH_DUTY times their time.
        assert_eq!(spacing(interval, Some(MS(40))), MS(200));
        assert_eq!(spacing(interval, Some(MS(80))), MS(320));
        // Capped, however slow the apiserver.
        assert_eq!(spacing(interval, Some(MS(5000))), MAX_SPACING);
        // A longer interval than the cap still holds.
        assert_eq!(spacing(MS(2000), Some(MS(5000))), MS(2000));
    }

    #[test]
    fn one_slow_patch_moves_the_estimate_a_quarter_of_the_way() {
        assert_eq!(smoothed(None, MS(40)), MS(40));
        assert_eq!(smoothed(Some(MS(40)), MS(440)), MS(140));
        assert_eq!(smoothed(Some(MS(140)), MS(40)), MS(115));
        // Steady patch times pull the estimate to themselves.
        let mut e = MS(400);
        for _ in 0..40 {
            e = smoothed(Some(e), MS(90));
        }
        assert!(e.abs_diff(MS(90)) < MS(1), "{e:?}");
    }

    #[test]
    fn a_pool_waiting_for_its_token_keeps_its_requests_and_none_is_passed_over() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(100));
        s.push("b".into(), 1);
        s.push("a".into(), 1);
        // One token now, the next in 50 ms, the one after in 100 ms.
        let mut waits = [MS(0), MS(50), MS(100)].into_iter();
        let mut reserve = || waits.next().expect("a pool reserved twice");
        assert_eq!(
            s.ready_within(t0, &mut reserve),
            [("a".to_string(), vec![1])]
        );
        assert_eq!(s.next_wake(t0), Some(t0 + MS(50)));
        // b keeps its token: it is not asked again, and what arrives meanwhile joins its batch.
        s.push("b".into(), 2);
        assert!(s.ready_within(t0 + MS(49), &mut reserve).is_empty());
        let batch = s.ready_within(t0 + MS(50), &mut reserve);
        assert_eq!(batch, [("b".to_string(), vec![1, 2])]);
        // a, due again, reserves the next token and waits for it.
        s.finished("a", MS(10), t0 + MS(10));
        s.finished("b", MS(10), t0 + MS(60));
        s.push("a".into(), 2);
        assert!(s.ready_within(t0 + MS(100), &mut reserve).is_empty());
        assert_eq!(s.next_wake(t0 + MS(100)), Some(t0 + MS(200)));
        assert_eq!(s.ready_within(t0 + MS(200), &mut reserve).len(), 1);
        assert!(waits.next().is_none(), "every token reserved once");
    }

    #[test]
    fn a_lone_request_goes_at_once_and_what_comes_meanwhile_joins_the_next_patch() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(200));
        s.push("a".into(), 1);
        assert_eq!(s.ready(t0), [("a".to_string(), vec![1])]);
        // In flight: nothing more goes for "a", and nothing waits on the clock.
        s.push("a".into(), 2);
        s.push("a".into(), 3);
        assert!(s.ready(t0 + MS(500)).is_empty());
        assert_eq!(s.next_wake(t0), None);
        // Finished in 10 ms: the next patch waits for the interval from the first's start.
        s.finished("a", MS(10), t0 + MS(10));
        assert!(s.ready(t0 + MS(10)).is_empty());
        assert_eq!(s.next_wake(t0 + MS(10)), Some(t0 + MS(200)));
        assert_eq!(s.ready(t0 + MS(200)), [("a".to_string(), vec![2, 3])]);
        s.finished("a", MS(10), t0 + MS(210));
        assert!(s.idle());
    }

    #[test]
    fn pools_are_scheduled_apart_and_a_backlog_goes_in_batches() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(0));
        for i in 0..(MAX_BATCH + 5) {
            s.push("big".into(), i);
        }
        s.push("small".into(), 0);
        let first = s.ready(t0);
        let sizes: Vec<(&str, usize)> = first.iter().map(|(p, v)| (p.as_str(), v.len())).collect();
        assert_eq!(sizes, [("big", MAX_BATCH), ("small", 1)]);
        s.finished("big", MS(5), t0);
        let rest = s.ready(t0 + MS(20));
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].1.len(), 5);
        assert!(!s.idle(), "two patches in flight");
    }

    #[test]
    fn a_slow_pool_waits_longer_and_forgets_its_cost_in_time() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(100));
        s.push("p".into(), 1);
        s.ready(t0);
        s.finished("p", MS(200), t0 + MS(200));
        s.push("p".into(), 2);
        // Spaced by 4 x 200 ms from the last start.
        assert_eq!(s.next_wake(t0 + MS(200)), Some(t0 + MS(800)));
        assert!(s.ready(t0 + MS(799)).is_empty());
        assert_eq!(s.ready(t0 + MS(800)).len(), 1);
        s.finished("p", MS(200), t0 + MS(1000));
        // Long after, the estimate is forgotten with the last start: a new request goes at once.
        let later = t0 + COST_MEMORY + MS(2000);
        s.push("p".into(), 3);
        assert_eq!(s.ready(later).len(), 1);
    }

    #[test]
    fn a_burst_waits_for_the_longest_spacing_and_goes_when_its_arrivals_pause() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(100));
        s.arrived("p".into(), 0, t0);
        assert_eq!(s.ready(t0).len(), 1, "a lone request goes at once");
        s.finished("p", MS(10), t0 + MS(10));
        // 20 requests 5 ms apart: a burst. Its spacing (100 ms) has passed, yet it waits.
        for i in 1..=20 {
            s.arrived("p".into(), i, t0 + MS(5 * i as u64));
        }
        assert!(s.ready(t0 + MS(150)).is_empty());
        // Until its arrivals pause for BURST_QUIET...
        assert_eq!(s.next_wake(t0 + MS(150)), Some(t0 + MS(100) + BURST_QUIET));
        assert_eq!(s.ready(t0 + MS(200))[0].1.len(), 20);
        s.finished("p", MS(10), t0 + MS(210));
        // ...or until BURST_SPACING from its last patch's start, however long it lasts.
        let mut t = t0 + MS(200);
        while t < t0 + MS(200) + BURST_SPACING {
            t += MS(5);
            s.arrived("p".into(), 0, t);
            let batch = s.ready(t);
            assert!(
                batch.is_empty() || t >= t0 + MS(200) + BURST_SPACING,
                "sent at {:?}",
                t - t0
            );
        }
        assert_eq!(s.next_wake(t), None, "sent at the longest spacing");
    }

    #[test]
    fn a_backlog_of_a_full_patch_is_no_burst_and_goes_at_its_spacing() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(100));
        s.arrived("p".into(), 0, t0);
        s.ready(t0);
        s.finished("p", MS(10), t0 + MS(10));
        // A re-list's tombstones: more than a patch holds, all at once.
        for i in 0..MAX_BATCH + 5 {
            s.arrived("p".into(), i, t0 + MS(20));
        }
        // Due at its spacing (100 ms), not a burst's: a full patch waits for nothing more.
        let batch = s.ready(t0 + MS(100));
        assert_eq!(batch[0].1.len(), MAX_BATCH);
    }

    #[test]
    fn a_steady_trickle_is_not_held_however_long_its_backlog() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(100));
        s.arrived("p".into(), 0, t0);
        s.ready(t0);
        // 20 requests 80 ms apart while a slow patch is in flight: a backlog, not a burst.
        for i in 1..=20 {
            s.arrived("p".into(), i, t0 + MS(80 * i as u64));
        }
        s.finished("p", MS(1600), t0 + MS(1600));
        // Spaced by 4 x 1.6 s, capped at 1 s: due at once, as before.
        assert_eq!(s.ready(t0 + MS(1600))[0].1.len(), 20);
    }

    #[test]
    fn a_pool_holding_a_token_that_turns_into_a_burst_is_still_woken() {
        let t0 = Instant::now();
        let mut s = PoolSchedule::new(MS(100));
        s.arrived("p".into(), 0, t0);
        assert_eq!(s.ready(t0).len(), 1);
        s.finished("p", MS(10), t0 + MS(10));
        // 5 requests while spaced: not a burst.
        for i in 0..5u64 {
            s.arrived("p".into(), 1, t0 + MS(20 + 10 * i));
        }
        // Due at 100 ms; the pool rate makes it wait 50 ms for its token.
        assert!(s.ready_within(t0 + MS(100), || MS(50)).is_empty());
        assert_eq!(s.next_wake(t0 + MS(100)), Some(t0 + MS(150)));
        // 11 more while it waits for the token: 16 pending, now a burst (due 140 + 100 ms).
        for i in 0..11u64 {
            s.arrived("p".into(), 2, t0 + MS(105 + 3 * i));
        }
        // The batcher wakes at the token's time: not sent (the burst holds it)...
        assert!(
            s.ready_within(t0 + MS(150), || panic!("reserved twice"))
                .is_empty()
        );
        // ...and nothing will wake it again: the batcher sleeps until another request comes.
        assert_eq!(
            s.next_wake(t0 + MS(150)),
            Some(t0 + MS(235)),
            "stuck: no wake"
        );
    }
}
