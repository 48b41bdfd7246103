//! client-go workqueue test cases (queue_test.go, default_rate_limiters_test.go,
//! delaying_queue_test.go), ported, plus property tests of the queue's guarantees.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use podlife::clock::{FakeClock, RealClock};
use podlife::queue::{
    ItemExponentialFailureRateLimiter, ItemFastSlowRateLimiter, MaxOfRateLimiter, RateLimiter,
    WorkQueue,
};
use proptest::prelude::*;
use tokio_test::{assert_pending, assert_ready, task};

const MS: Duration = Duration::from_millis(1);

/// Producers add, consumers process; checks that no item is processed by two workers at once.
async fn run_producers_consumers(
    queue: Arc<WorkQueue<String>>,
    drain: bool,
    readd: bool,
) -> HashMap<String, usize> {
    let in_process = Arc::new(Mutex::new(HashSet::new()));
    let processed = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let mut producers = Vec::new();
    for i in 0..50 {
        let q = queue.clone();
        producers.push(tokio::spawn(async move {
            for _ in 0..50 {
                q.add(format!("item-{i}"));
                tokio::task::yield_now().await;
            }
        }));
    }
    let mut consumers = Vec::new();
    for _ in 0..10 {
        let (q, in_process, processed) = (queue.clone(), in_process.clone(), processed.clone());
        consumers.push(tokio::spawn(async move {
            let mut seen = HashMap::<String, usize>::new();
            while let Some(item) = q.get().await {
                assert_ne!(
                    item, "added after shutdown!",
                    "got an item added after shutdown"
                );
                assert!(
                    in_process.lock().unwrap().insert(item.clone()),
                    "{item} handed out twice at once"
                );
                *processed.lock().unwrap().entry(item.clone()).or_default() += 1;
                let count = seen.entry(item.clone()).or_default();
                *count += 1;
                if readd && *count < 2 {
                    // Re-added while processing: must come back after done, not concurrently.
                    q.add(item.clone());
                }
                tokio::task::yield_now().await;
                in_process.lock().unwrap().remove(&item);
                q.done(&item);
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    if drain {
        queue.shutdown_with_drain().await;
    } else {
        queue.shutdown();
    }
    queue.add("added after shutdown!".into());
    for c in consumers {
        c.await.unwrap();
    }
    assert_eq!(queue.len(), 0);
    Arc::try_unwrap(processed).unwrap().into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn basic() {
    for drain in [false, true] {
        let processed =
            run_producers_consumers(WorkQueue::new(RealClock::shared()), drain, false).await;
        assert_eq!(
            processed.len(),
            50,
            "every produced item was processed (drain={drain})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn add_while_processing() {
    for drain in [false, true] {
        let processed =
            run_producers_consumers(WorkQueue::new(RealClock::shared()), drain, true).await;
        assert_eq!(processed.len(), 50);
        assert!(
            processed.values().all(|n| *n >= 2),
            "re-added items were processed again"
        );
    }
}

#[test]
fn len() {
    let q = WorkQueue::new(FakeClock::new());
    q.add("foo");
    assert_eq!(q.len(), 1);
    q.add("bar");
    assert_eq!(q.len(), 2);
    q.add("foo"); // already queued
    assert_eq!(q.len(), 2);
}

#[test]
fn reinsert() {
    let q = WorkQueue::new(FakeClock::new());
    q.add("foo");
    let item = q.try_get().unwrap();
    assert_eq!(item, "foo");
    q.add(item); // re-add while processing
    assert_eq!(q.len(), 0, "not handed out while still processing");
    q.done(&item);
    assert_eq!(q.try_get(), Some("foo"));
    q.done(&"foo");
    assert_eq!(q.len(), 0);
}

#[test]
fn queue_drainage_using_shutdown_with_drain() {
    let q = WorkQueue::new(FakeClock::new());
    q.add(1);
    q.add(2);
    let first = q.try_get().unwrap();
    let second = q.try_get().unwrap();
    let mut drain = task::spawn(q.shutdown_with_drain());
    assert_pending!(drain.poll(), "waits for the items in process");
    let mut get = task::spawn(q.get());
    assert_eq!(assert_ready!(get.poll()), None, "getters are released");
    drop(get);
    q.done(&first);
    assert_pending!(drain.poll());
    q.done(&second);
    assert!(drain.is_woken());
    assert_ready!(drain.poll());
}

#[test]
fn no_queue_drainage_using_shutdown() {
    let q = WorkQueue::new(FakeClock::new());
    q.add(1);
    q.add(2);
    q.try_get().unwrap();
    q.try_get().unwrap();
    // Returns at once although two items are still in process.
    q.shutdown();
    assert!(q.shutting_down());
    q.add(3);
    assert_eq!(q.len(), 0, "adds after shutdown are ignored");
}

#[test]
fn shutdown_while_waiting_releases_getters() {
    let q = WorkQueue::<u32>::new(FakeClock::new());
    let mut get = task::spawn(q.get());
    assert_pending!(get.poll());
    q.shutdown();
    assert!(get.is_woken());
    assert_eq!(assert_ready!(get.poll()), None);
}

#[test]
fn add_after_waits_on_the_clock_and_duplicates_only_move_earlier() {
    let clock = FakeClock::new();
    let q = WorkQueue::new(clock.clone());
    q.add_after("a", 50 * MS);
    q.add_after("a", 80 * MS); // later: ignored
    assert_eq!((q.len(), q.delayed_len()), (0, 1));
    let mut get = task::spawn(q.get());
    assert_pending!(get.poll());
    clock.step(49 * MS);
    assert_pending!(get.poll());
    q.add_after("a", 10 * MS); // earlier: moves to 59 ms
    assert_eq!(q.delayed_len(), 1);
    clock.step(10 * MS);
    assert!(get.is_woken());
    assert_eq!(assert_ready!(get.poll()), Some("a"));
    drop(get);
    q.done(&"a");
    clock.step(Duration::from_secs(1));
    assert_eq!(
        q.len(),
        0,
        "the superseded later add does not hand it out again"
    );
}

#[test]
fn add_rate_limited_uses_the_limiter_and_forget_resets_it() {
    let clock = FakeClock::new();
    let limiter = ItemExponentialFailureRateLimiter::new(MS, Duration::from_secs(1));
    let q = WorkQueue::with_rate_limiter(clock.clone(), Box::new(limiter));
    q.add_rate_limited("one");
    assert_eq!(q.len(), 0);
    clock.step(MS);
    assert_eq!(q.try_get(), Some("one"));
    q.done(&"one");
    q.add_rate_limited("one");
    clock.step(MS);
    assert_eq!(q.len(), 0, "second failure waits 2 ms");
    clock.step(MS);
    assert_eq!(q.len(), 1);
    assert_eq!(q.num_requeues(&"one"), 2);
    q.forget(&"one");
    assert_eq!(q.num_requeues(&"one"), 0);
}

#[test]
fn default_limiter_is_exponential_5ms_with_an_overall_bucket() {
    let clock = FakeClock::new();
    let q = WorkQueue::new(clock.clone());
    q.add_rate_limited("x");
    clock.step(4 * MS);
    assert_eq!(q.len(), 0);
    clock.step(MS);
    assert_eq!(q.len(), 1);
}

#[test]
fn item_exponential_failure_rate_limiter() {
    let limiter = ItemExponentialFailureRateLimiter::new(MS, Duration::from_secs(1));
    for ms in [1, 2, 4, 8, 16] {
        assert_eq!(limiter.when(&"one"), ms * MS);
    }
    assert_eq!(limiter.num_requeues(&"one"), 5);
    assert_eq!(limiter.when(&"two"), MS);
    assert_eq!(limiter.when(&"two"), 2 * MS);
    assert_eq!(limiter.num_requeues(&"two"), 2);
    limiter.forget(&"one");
    assert_eq!(limiter.num_requeues(&"one"), 0);
    assert_eq!(limiter.when(&"one"), MS);
}

#[test]
fn item_exponential_failure_rate_limiter_overflow() {
    let limiter = ItemExponentialFailureRateLimiter::new(MS, Duration::from_secs(1000));
    for _ in 0..5 {
        limiter.when(&"one");
    }
    assert_eq!(limiter.when(&"one"), 32 * MS);
    for _ in 0..1000 {
        limiter.when(&"overflow1");
    }
    assert_eq!(limiter.when(&"overflow1"), Duration::from_secs(1000));

    let minute = Duration::from_secs(60);
    let limiter = ItemExponentialFailureRateLimiter::new(minute, 1000 * 60 * minute);
    for _ in 0..2 {
        limiter.when(&"two");
    }
    assert_eq!(limiter.when(&"two"), 4 * minute);
    for _ in 0..1000 {
        limiter.when(&"overflow2");
    }
    assert_eq!(limiter.when(&"overflow2"), 1000 * 60 * minute);
}

#[test]
fn max_of_rate_limiter() {
    let limiter: MaxOfRateLimiter<&str> = MaxOfRateLimiter::new(vec![
        Box::new(ItemFastSlowRateLimiter::new(
            5 * MS,
            Duration::from_secs(3),
            3,
        )),
        Box::new(ItemExponentialFailureRateLimiter::new(
            MS,
            Duration::from_secs(1),
        )),
    ]);
    let three = Duration::from_secs(3);
    for expected in [5 * MS, 5 * MS, 5 * MS, three, three] {
        assert_eq!(limiter.when(&"one"), expected);
    }
    assert_eq!(limiter.num_requeues(&"one"), 5);
    assert_eq!(limiter.when(&"two"), 5 * MS);
    assert_eq!(limiter.when(&"two"), 5 * MS);
    assert_eq!(limiter.num_requeues(&"two"), 2);
    limiter.forget(&"one");
    assert_eq!(limiter.num_requeues(&"one"), 0);
    assert_eq!(limiter.when(&"one"), 5 * MS);
}

#[derive(Debug, Clone)]
enum Op {
    Add(u8),
    AddAfter(u8, u8),
    Get(usize),
    Done(usize),
    Step(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..6).prop_map(Op::Add),
        (0u8..6, 0u8..40).prop_map(|(i, d)| Op::AddAfter(i, d)),
        (0usize..3).prop_map(Op::Get),
        (0usize..3).prop_map(Op::Done),
        (0u8..30).prop_map(Op::Step),
    ]
}

proptest! {
    #[test]
    fn no_item_is_handed_to_two_workers_and_every_add_is_served(ops in prop::collection::vec(op(), 1..200)) {
        let clock = FakeClock::new();
        let q = WorkQueue::<u8>::new(clock.clone());
        let mut workers: [Option<u8>; 3] = [None; 3];
        // Logical time of each item's last add and last hand-out.
        let mut last_add: HashMap<u8, usize> = HashMap::new();
        let mut last_handout: HashMap<u8, usize> = HashMap::new();
        let mut t = 0usize;
        let hand_out = |item: u8, workers: &[Option<u8>; 3], t: usize, last_handout: &mut HashMap<u8, usize>| {
            prop_assert!(!workers.contains(&Some(item)), "{} handed out while a worker holds it", item);
            last_handout.insert(item, t);
            Ok(())
        };
        for op in ops {
            t += 1;
            match op {
                Op::Add(i) => { q.add(i); last_add.insert(i, t); }
                Op::AddAfter(i, d) => { q.add_after(i, u32::from(d) * MS); last_add.insert(i, t); }
                Op::Get(w) if workers[w].is_none() => {
                    if let Some(item) = q.try_get() {
                        hand_out(item, &workers, t, &mut last_handout)?;
                        workers[w] = Some(item);
                    }
                }
                Op::Get(_) => {}
                Op::Done(w) => if let Some(item) = workers[w].take() { q.done(&item); },
                Op::Step(ms) => clock.step(u32::from(ms) * MS),
            }
        }
        // Finish: workers complete, time runs out every delay, the queue is drained.
        for w in workers.iter_mut() {
            if let Some(item) = w.take() { q.done(&item); }
        }
        clock.step(Duration::from_secs(1));
        t += 1;
        while let Some(item) = q.try_get() {
            hand_out(item, &workers, t, &mut last_handout)?;
            q.done(&item);
        }
        for (item, added) in last_add {
            let served = last_handout.get(&item).copied().unwrap_or(0);
            prop_assert!(served > added, "item {} added at {} last handed out at {}", item, added, served);
        }
    }
}
