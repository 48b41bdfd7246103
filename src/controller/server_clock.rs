//! The apiserver's clock as this replica knows it: the `Date` of the newest answer to a probe
//! (`GET /version`), carried forward on this process's monotonic clock. `--fence-timeout`
//! counts on it: a fence's age runs from its record and the IPFence's creationTimestamp (the
//! apiserver's clock), so a replica whose own clock runs ahead would lift fences early. Until
//! the first answer, timeouts wait. A `Date` has whole seconds and is stamped before the
//! answer arrives, so the estimate is a second or two behind (a fence times out that much
//! late); creationTimestamps have whole seconds too (up to a second early). Apiservers behind
//! one address must share a clock.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::Client;

/// Time between two probes.
const PROBE_EVERY: Duration = Duration::from_secs(60);
/// Time before a failed probe is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How long a probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The newest `Date` the apiserver answered with, and when (this process's clock) the answer
/// arrived.
#[derive(Debug, Default)]
pub struct ServerClock {
    sample: Mutex<Option<(Timestamp, Instant)>>,
}

impl ServerClock {
    /// Records an answer dated `date` that arrived at `received`.
    pub fn observe(&self, date: Timestamp, received: Instant) {
        *self.sample.lock().expect("server clock lock") = Some((date, received));
    }

    /// The apiserver's time at `now` (this process's clock), never ahead of it by this
    /// reading (the `Date` was stamped before the answer arrived); `None` before the first
    /// answer.
    pub fn now(&self, now: Instant) -> Option<Timestamp> {
        let (date, received) = (*self.sample.lock().expect("server clock lock"))?;
        let since = jiff::SignedDuration::try_from(now.saturating_duration_since(received)).ok()?;
        date.checked_add(since).ok()
    }
}

/// An HTTP `Date` (`Sat, 28 Nov 2026 02:05:31 GMT`).
pub fn parse_http_date(value: &str) -> Option<Timestamp> {
    jiff::fmt::rfc2822::DateTimeParser::new()
        .parse_timestamp(value)
        .ok()
}

/// Asks the apiserver for `/version` and returns the `Date` of its answer.
pub async fn probe(client: &Client) -> Result<Timestamp, String> {
    let request = http::Request::get("/version")
        .body(kube::client::Body::empty())
        .map_err(|e| e.to_string())?;
    let response = client.send(request).await.map_err(|e| e.to_string())?;
    // Anything between (a proxy, a load balancer) dates its own errors.
    if !response.status().is_success() {
        return Err(format!("the apiserver answered {}", response.status()));
    }
    let date = response
        .headers()
        .get(http::header::DATE)
        .ok_or("the answer has no Date header")?;
    let date = date.to_str().map_err(|e| e.to_string())?;
    parse_http_date(date).ok_or_else(|| format!("unreadable Date header {date:?}"))
}

/// Probes the apiserver now and then (run beside the fence lifter's loop, in its task, so it
/// stops with it and never holds a pass up).
pub struct Prober {
    client: Client,
    clock: Arc<ServerClock>,
    next: Instant,
    failing: bool,
}

impl Prober {
    /// A prober for `clock` whose first probe is due at once.
    pub fn new(client: Client, clock: Arc<ServerClock>) -> Prober {
        Prober {
            client,
            clock,
            next: Instant::now(),
            failing: false,
        }
    }

    /// Probes for ever.
    pub async fn run(mut self) {
        loop {
            tokio::time::sleep_until(self.next.into()).await;
            self.probe().await;
        }
    }

    /// Probes once and sets when the next probe is due.
    async fn probe(&mut self) {
        let answer = tokio::time::timeout(PROBE_TIMEOUT, probe(&self.client))
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {PROBE_TIMEOUT:?}")));
        let wait = match answer {
            Ok(date) => {
                self.clock.observe(date, Instant::now());
                let local_ahead = Timestamp::now().duration_since(date);
                if self.failing || local_ahead.abs() > jiff::SignedDuration::from_secs(5) {
                    tracing::info!(apiserver = %date, ?local_ahead, "apiserver clock read; fence timeouts count on it");
                }
                self.failing = false;
                PROBE_EVERY
            }
            Err(error) => {
                if !self.failing {
                    tracing::warn!(%error, "reading the apiserver's clock failed; retried (fence timeouts count on the last reading, or wait for the first)");
                }
                self.failing = true;
                RETRY_AFTER
            }
        };
        self.next = Instant::now() + wait;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_apiserver_time_is_unknown_until_an_answer_then_carried_on_this_clock() {
        let clock = ServerClock::default();
        let t0 = Instant::now();
        assert_eq!(clock.now(t0), None, "no answer yet: timeouts wait");
        let date: Timestamp = "2026-11-28T02:05:31Z".parse().unwrap();
        clock.observe(date, t0);
        assert_eq!(clock.now(t0), Some(date));
        let later = t0 + Duration::from_secs(90);
        assert_eq!(
            clock.now(later),
            Some("2026-11-28T02:07:01Z".parse().unwrap())
        );
        // A newer answer wins, even an earlier date (the apiserver's clock was stepped back).
        let stepped: Timestamp = "2026-11-28T02:06:00Z".parse().unwrap();
        clock.observe(stepped, later);
        assert_eq!(clock.now(later), Some(stepped));
    }

    #[test]
    fn http_dates_parse_and_other_strings_do_not() {
        assert_eq!(
            parse_http_date("Sat, 28 Nov 2026 02:05:31 GMT"),
            Some("2026-11-28T02:05:31Z".parse().unwrap())
        );
        for bad in ["", "yesterday", "2026-11-28T02:05:31Z", "Sat, 28 Nov 2026"] {
            assert_eq!(parse_http_date(bad), None, "{bad}");
        }
    }
}
