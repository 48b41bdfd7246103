//! A repeated error, logged once per interval with a count: an outage of the apiserver makes
//! every watch fail again and again, and a line per retry buries everything else. Pure: the
//! caller passes the time (tests step it, nothing sleeps).

use std::time::{Duration, Instant};

/// Counts the occurrences of one repeated error and says when a line is due.
#[derive(Debug, Clone)]
pub struct Repeats {
    interval: Duration,
    /// When the last line was due.
    last_line: Option<Instant>,
    /// Occurrences since the last line (not yet in a line).
    unlogged: u64,
    /// Occurrences since the errors began.
    total: u64,
    /// When the errors began.
    since: Option<Instant>,
}

/// The end of a run of errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    /// Errors in the run.
    pub total: u64,
    /// Of those, errors that no line counted yet.
    pub unlogged: u64,
    /// From the first error to the recovery.
    pub lasted: Duration,
}

impl Repeats {
    /// At most one line per `interval`.
    pub fn new(interval: Duration) -> Self {
        Repeats {
            interval,
            last_line: None,
            unlogged: 0,
            total: 0,
            since: None,
        }
    }

    /// One more occurrence at `now`. `Some(n)` when a line is due now, `n` being the
    /// occurrences it stands for (this one and those since the last line); the first occurrence
    /// of a run is always logged.
    pub fn occurred(&mut self, now: Instant) -> Option<u64> {
        self.unlogged += 1;
        self.total += 1;
        self.since.get_or_insert(now);
        let due = self
            .last_line
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if !due {
            return None;
        }
        self.last_line = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }

    /// The errors stopped at `now` (the operation succeeded): the run that ended, if any. The
    /// next error starts a new run and is logged at once.
    pub fn recovered(&mut self, now: Instant) -> Option<Recovery> {
        let since = self.since.take()?;
        let recovery = Recovery {
            total: self.total,
            unlogged: self.unlogged,
            lasted: now.saturating_duration_since(since),
        };
        *self = Repeats::new(self.interval);
        Some(recovery)
    }

    /// Errors in the current run.
    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn the_first_error_is_logged_then_one_line_per_interval_with_the_count() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_millis(s);
        let mut r = Repeats::new(MINUTE);
        assert_eq!(r.occurred(at(0)), Some(1));
        // Backing off: 200 ms, 400 ms, ... all within the minute.
        let quiet: Vec<_> = [200, 600, 1_400, 3_000, 6_200, 12_600, 25_400, 55_000]
            .into_iter()
            .map(|ms| r.occurred(at(ms)))
            .collect();
        assert!(quiet.iter().all(Option::is_none), "{quiet:?}");
        // The first error a whole interval after the last line stands for the nine since.
        assert_eq!(r.occurred(at(60_000)), Some(9));
        assert_eq!(r.occurred(at(90_000)), None);
        assert_eq!(r.occurred(at(119_999)), None);
        assert_eq!(r.occurred(at(120_000)), Some(3));
        assert_eq!(r.total(), 13);
    }

    #[test]
    fn recovery_reports_the_run_and_the_next_error_is_logged_at_once() {
        let t0 = Instant::now();
        let mut r = Repeats::new(MINUTE);
        assert_eq!(r.recovered(t0), None, "no errors, nothing to report");
        r.occurred(t0);
        r.occurred(t0 + Duration::from_secs(1));
        r.occurred(t0 + Duration::from_secs(2));
        assert_eq!(
            r.recovered(t0 + Duration::from_secs(5)),
            Some(Recovery {
                total: 3,
                unlogged: 2,
                lasted: Duration::from_secs(5)
            })
        );
        assert_eq!(r.recovered(t0 + Duration::from_secs(6)), None);
        assert_eq!(r.occurred(t0 + Duration::from_secs(7)), Some(1));
    }
}
