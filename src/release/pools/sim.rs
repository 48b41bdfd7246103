//! The batcher's schedule run on a fake clock with the real pool token bucket: deletions
//! arriving round-robin over a few pools, patches that take a fixed time. What a release waits
//! for its pool's batch (spacing and token), and how many patches a burst costs, without an
//! apiserver or a quiet machine.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use podlife::clock::FakeClock;
use podlife::throttle::TokenBucket;

use super::schedule::PoolSchedule;

/// Deletions arriving round-robin over `pools` pools.
pub struct Scenario {
    pub pools: usize,
    /// Deletions in all, at `rate` per second.
    pub count: usize,
    pub rate: f64,
    /// What each patch takes.
    pub patch: Duration,
    /// `--pool-patch-interval`, `--pool-write-qps`, `--pool-write-burst`.
    pub interval: Duration,
    pub qps: f64,
    pub burst: u32,
}

/// What a run measured.
pub struct Run {
    /// Each release's wait from queued to its batch formed, sorted.
    pub waits: Vec<Duration>,
    pub patches: usize,
    /// The last batch formed after the last arrival.
    pub tail: Duration,
}

impl Run {
    /// The `q` quantile of the waits.
    pub fn wait(&self, q: f64) -> Duration {
        let i = ((self.waits.len() - 1) as f64 * q).round() as usize;
        self.waits[i]
    }
}

/// Runs `s` on a fake clock.
pub fn run(s: &Scenario) -> Run {
    let t0 = Instant::now();
    let clock = FakeClock::starting_at(t0);
    let tokens = TokenBucket::new(s.qps, s.burst, clock.clone());
    let mut schedule = PoolSchedule::new(s.interval);
    let every = Duration::from_secs_f64(1.0 / s.rate);
    let arrivals: Vec<(Instant, String)> = (0..s.count)
        .map(|i| (t0 + every * i as u32, format!("pool-{}", i % s.pools)))
        .collect();
    let last_arrival = arrivals.last().map_or(t0, |a| a.0);
    let mut next = arrivals.into_iter().peekable();
    // Patches in flight: when each finishes.
    let mut finishing: BTreeMap<Instant, Vec<String>> = BTreeMap::new();
    let (mut now, mut waits, mut patches, mut last_formed) = (t0, Vec::new(), 0, t0);
    loop {
        while let Some((_, pool)) = next.next_if(|a| a.0 <= now) {
            schedule.arrived(pool, now, now);
        }
        while let Some(entry) = finishing.first_entry().filter(|e| *e.key() <= now) {
            for pool in entry.remove() {
                schedule.finished(&pool, s.patch, now);
            }
        }
        for (pool, items) in schedule.ready_within(now, || tokens.reserve()) {
            waits.extend(items.iter().map(|queued| now - *queued));
            finishing.entry(now + s.patch).or_default().push(pool);
            patches += 1;
            last_formed = now;
        }
        let wake = [
            next.peek().map(|a| a.0),
            finishing.keys().next().copied(),
            schedule.next_wake(now),
        ];
        let Some(then) = wake.into_iter().flatten().min() else {
            break;
        };
        clock.step(then - now);
        now = then;
    }
    // Nothing is left behind: a request never sent would wait for a wake that never comes.
    assert_eq!(
        waits.len(),
        s.count,
        "requests left pending with nothing to wake them"
    );
    waits.sort();
    Run {
        waits,
        patches,
        tail: last_formed.saturating_duration_since(last_arrival),
    }
}

#[cfg(test)]
mod tests {
    use super::super::schedule::BURST_SPACING;
    use super::*;
    use crate::release::budget::{DEFAULT_POOL_WRITE_BURST, DEFAULT_POOL_WRITE_QPS};

    const MS: fn(u64) -> Duration = Duration::from_millis;

    /// The scale bench's steady phase: 1,000 deletions at 50/s in 4 pools, patches of 25 ms
    /// (a pool of 314 entries on a quiet apiserver), the default interval.
    fn steady(qps: f64, burst: u32) -> Scenario {
        Scenario {
            pools: 4,
            count: 1000,
            rate: 50.0,
            patch: MS(25),
            interval: MS(100),
            qps,
            burst,
        }
    }

    #[test]
    fn at_fifty_deletions_a_second_in_four_pools_the_default_budget_leaves_no_release_waiting_for_a_token()
     {
        let s = steady(DEFAULT_POOL_WRITE_QPS, DEFAULT_POOL_WRITE_BURST);
        let r = run(&s);
        // Spaced by the interval only: a release waits for its pool's next window, no longer.
        assert!(r.wait(0.99) <= MS(100), "p99 {:?}", r.wait(0.99));
        // And the budget holds: no more patches than the burst and the rate allow.
        let secs = s.count as f64 / s.rate + 1.0;
        assert!(
            r.patches as f64 <= f64::from(s.burst) + s.qps * secs,
            "{}",
            r.patches
        );
        // 20 a second (the earlier default) is what 4 pools at a 100 ms interval use up: then
        // each pool gets a token every 200 ms, and that is the wait.
        let old = run(&steady(20.0, 40));
        assert!(old.wait(0.99) >= MS(180), "p99 {:?}", old.wait(0.99));
        assert!(old.patches as f64 <= 40.0 + 20.0 * secs, "{}", old.patches);
    }

    #[test]
    fn a_mass_deletion_is_spaced_by_its_patch_time_not_by_the_budget() {
        // 2,000 deletions in 5 s, patches of 250 ms (pools of 550 entries, an apiserver busy
        // with the deletes): the pools' spacing, not the pool rate, bounds the patches.
        let mass = |qps, burst| {
            run(&Scenario {
                pools: 4,
                count: 2000,
                rate: 400.0,
                patch: MS(250),
                interval: MS(100),
                qps,
                burst,
            })
        };
        let (now, before) = (
            mass(DEFAULT_POOL_WRITE_QPS, DEFAULT_POOL_WRITE_BURST),
            mass(20.0, 40),
        );
        assert_eq!(now.patches, before.patches);
        assert!(now.patches as f64 / 2000.0 <= 0.02, "{}", now.patches);
        // The last deletions go in a patch within a spacing of the last arrival.
        assert!(now.tail <= Duration::from_secs(1), "{:?}", now.tail);
    }

    #[test]
    fn a_mass_deletion_on_a_quiet_apiserver_leaves_in_large_patches_and_its_end_at_once() {
        // 2,000 deletions in 5 s, patches of 100 ms: spaced by 400 ms alone, each pool would
        // be patched 12 times (0.028 patches per address).
        let r = run(&Scenario {
            pools: 4,
            count: 2000,
            rate: 400.0,
            patch: MS(100),
            interval: MS(100),
            qps: DEFAULT_POOL_WRITE_QPS,
            burst: DEFAULT_POOL_WRITE_BURST,
        });
        assert!(r.patches as f64 / 2000.0 <= 0.02, "{} patches", r.patches);
        // The last arrivals wait for the pause that ends the burst and the patch in flight;
        // none waits longer than a burst's spacing.
        assert!(r.tail <= MS(250), "{:?}", r.tail);
        assert!(r.wait(1.0) <= BURST_SPACING, "{:?}", r.wait(1.0));
    }

    /// The scale bench's mass phase on 2 cores (see the test below).
    fn mass_at_200() -> Scenario {
        Scenario {
            pools: 4,
            count: 2000,
            rate: 200.0,
            patch: MS(400),
            interval: MS(100),
            qps: DEFAULT_POOL_WRITE_QPS,
            burst: DEFAULT_POOL_WRITE_BURST,
        }
    }

    #[test]
    fn a_mass_deletion_as_slow_as_the_apiservers_deletes_still_costs_under_a_fiftieth_patch_per_address()
     {
        // The scale bench's mass phase on 2 cores: 2,000 deletions take 10 s (200/s, 50/s
        // per pool: a burst), patches of 400 ms (their own spacing capped at 1 s). Each pool's
        // patch carries what a spacing brings: at 1 s, 50 entries, 0.02 patches per address
        // before the tail.
        let r = run(&mass_at_200());
        let per_address = r.patches as f64 / 2000.0;
        assert!(per_address <= 0.017, "{} patches, {per_address}", r.patches);
        // The end still goes at once (the pause that ends the burst, the patch in flight).
        assert!(r.tail <= MS(500), "{:?}", r.tail);
        // Slower still (45 a second per pool: no burst at 50 a second, 0.022 before).
        let slower = run(&Scenario {
            rate: 180.0,
            ..mass_at_200()
        });
        let per_address = slower.patches as f64 / 2000.0;
        assert!(per_address <= 0.018, "{} patches at 180/s", slower.patches);
    }

    #[test]
    fn every_deletion_leaves_whatever_the_budget_pools_rate_and_patch_time() {
        // `run` fails if a request is left pending (a pool the batcher would never wake).
        for (qps, burst) in [(50.0, 100), (20.0, 40), (5.0, 1)] {
            for pools in [1, 4, 8, 16] {
                for rate in [400.0, 1000.0, 3000.0] {
                    for patch in [MS(5), MS(10), MS(30)] {
                        let s = Scenario {
                            pools,
                            count: 6000,
                            rate,
                            patch,
                            interval: MS(100),
                            qps,
                            burst,
                        };
                        run(&s);
                    }
                }
            }
        }
    }
}
