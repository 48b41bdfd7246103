//! Where a release's latency goes, stage by stage: the controller's trace events (target
//! `ipreclaim::timeline`, JSON lines) beside the bench's own times of each delete's return and
//! each entry's disappearance from the pool watch.
//!
//! Stages of one deleted pod, each from the end of the one before:
//! - `watch`: the delete returned to the controller's pod watch seeing the deletion;
//! - `queue`: to a deletion worker taking it;
//! - `judge`: to its releases handed to the writer (the fresh reads of the pod and its node);
//! - `to batcher`: to the batcher queueing it for its pool;
//! - `in flight`: waiting for the pool's patch in flight to finish;
//! - `spacing`: waiting for the pool's spacing to pass (its token reserved then);
//! - `token`: waiting for that token of `--pool-write-qps`;
//! - `cap`: the batch formed to its patch sent (fence records, the shared write cap);
//! - `patch`: the patch's round trip;
//! - `seen`: the patch returned to the bench's pool watch seeing the entry gone.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// The stages, in order (see the module doc).
pub const STAGES: [&str; 10] = [
    "watch",
    "queue",
    "judge",
    "to batcher",
    "in flight",
    "spacing",
    "token",
    "cap",
    "patch",
    "seen",
];

/// One trace event: seconds after the anchor, its message and fields.
struct Event {
    at: f64,
    message: String,
    pool: String,
    podref: String,
    podrefs: String,
}

/// Maps the controller's wall-clock timestamps onto the bench's `Instant`s.
#[derive(Clone, Copy)]
pub struct Anchor {
    instant: Instant,
    wall: jiff::Timestamp,
}

impl Anchor {
    pub fn now() -> Anchor {
        Anchor {
            instant: Instant::now(),
            wall: jiff::Timestamp::now(),
        }
    }

    /// Seconds from the anchor to `at`.
    pub fn secs(&self, at: Instant) -> f64 {
        if at >= self.instant {
            (at - self.instant).as_secs_f64()
        } else {
            -(self.instant - at).as_secs_f64()
        }
    }

    fn secs_wall(&self, at: &str) -> Option<f64> {
        let t: jiff::Timestamp = at.parse().ok()?;
        let d = t.duration_since(self.wall);
        Some(d.as_secs_f64())
    }
}

fn events(log: &Path, anchor: &Anchor) -> Vec<Event> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["target"] != "ipreclaim::timeline" {
            continue;
        }
        let field = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        let Some(at) = v["timestamp"].as_str().and_then(|t| anchor.secs_wall(t)) else {
            continue;
        };
        out.push(Event {
            at,
            message: field("message"),
            pool: field("pool"),
            podref: field("podref"),
            podrefs: field("podrefs"),
        });
    }
    out.sort_by(|a, b| a.at.total_cmp(&b.at));
    out
}

/// One victim: its podref and pool, and when (seconds after the anchor) its delete returned
/// and its entry was seen gone.
pub struct Victim {
    pub podref: String,
    pub pool: String,
    pub returned: f64,
    pub gone: f64,
}

/// Each victim's stage durations (seconds, in [`STAGES`] order), for those whose every stage
/// was traced.
pub fn stages(log: &Path, anchor: &Anchor, victims: &[Victim]) -> Vec<[f64; 10]> {
    let events = events(log, anchor);
    let mut first: HashMap<(&str, &str), f64> = HashMap::new();
    // Per pool, in time order: (time, what, podrefs of a batch).
    let mut pools: HashMap<&str, Vec<&Event>> = HashMap::new();
    for e in &events {
        if !e.podref.is_empty() {
            first
                .entry((e.message.as_str(), e.podref.as_str()))
                .or_insert(e.at);
        }
        if !e.pool.is_empty() {
            pools.entry(e.pool.as_str()).or_default().push(e);
        }
    }
    let mut out = Vec::new();
    'victims: for v in victims {
        let get = |m: &str| first.get(&(m, v.podref.as_str())).copied();
        let (Some(seen), Some(took), Some(handed), Some(queued)) = (
            get("deletion seen"),
            get("worker took"),
            get("to the writer"),
            get("queued"),
        ) else {
            continue;
        };
        let Some(pool) = pools.get(v.pool.as_str()) else {
            continue;
        };
        // The batch that carried it, and the pool's events around it.
        let Some(b) = pool.iter().position(|e| {
            e.message == "batch formed"
                && e.at >= queued
                && e.podrefs.split(',').any(|p| p == v.podref)
        }) else {
            continue;
        };
        let formed = pool[b].at;
        // The patch in flight when it was queued: the last batch before it, finished when.
        let mut busy_until = queued;
        if let Some(prev) = pool[..b].iter().rposition(|e| e.message == "batch formed")
            && let Some(fin) = pool[prev..].iter().find(|e| e.message == "pool finished")
        {
            busy_until = busy_until.max(fin.at.min(formed));
        }
        let token = pool[..b]
            .iter()
            .rev()
            .find(|e| e.message == "token reserved")
            .map_or(formed, |e| e.at.clamp(busy_until, formed));
        let mut after = pool[b..].iter();
        let Some(sent) = after.find(|e| e.message == "patch sent").map(|e| e.at) else {
            continue 'victims;
        };
        let Some(back) = after.find(|e| e.message == "patch returned").map(|e| e.at) else {
            continue 'victims;
        };
        out.push([
            seen - v.returned,
            took - seen,
            handed - took,
            queued - handed,
            busy_until - queued,
            token - busy_until,
            formed - token,
            sent - formed,
            back - sent,
            v.gone - back,
        ]);
    }
    out
}

/// Prints each stage's p50 and p99, and its mean among the slowest 1% and 10% (by the sum of
/// the stages: the delete's return to the entry seen gone).
pub fn print(label: &str, rows: &[[f64; 10]], of: usize) {
    if rows.is_empty() {
        println!("{label}: no timeline (run with --timeline)");
        return;
    }
    let mut by_total: Vec<&[f64; 10]> = rows.iter().collect();
    by_total.sort_by(|a, b| a.iter().sum::<f64>().total_cmp(&b.iter().sum::<f64>()));
    let tail = |share: f64| {
        let n = ((rows.len() as f64 * share).ceil() as usize).max(1);
        let slow = &by_total[rows.len() - n..];
        let mut mean = [0.0; 10];
        for r in slow {
            for (m, x) in mean.iter_mut().zip(r.iter()) {
                *m += x / n as f64;
            }
        }
        mean
    };
    let (tail1, tail10) = (tail(0.01), tail(0.10));
    let mut totals: Vec<f64> = rows.iter().map(|r| r.iter().sum()).collect();
    println!(
        "{label}: {} of {of} releases traced; delete returned to entry seen gone p50 {:.0} ms, p99 {:.0} ms. By stage (ms): p50 / p99 / mean of the slowest 10% / of the slowest 1%:",
        rows.len(),
        super::common::quantile(&mut totals.clone(), 0.5) * 1000.0,
        super::common::quantile(&mut totals, 0.99) * 1000.0,
    );
    for (i, stage) in STAGES.iter().enumerate() {
        let mut v: Vec<f64> = rows.iter().map(|r| r[i]).collect();
        println!(
            "{label}:   {stage:>10}  {:6.1} {:6.1} {:6.1} {:6.1}",
            super::common::quantile(&mut v.clone(), 0.5) * 1000.0,
            super::common::quantile(&mut v, 0.99) * 1000.0,
            tail10[i] * 1000.0,
            tail1[i] * 1000.0,
        );
    }
}
