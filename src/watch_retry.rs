//! Retrying a watch: exponential backoff for errors the apiserver answered (a 403 or a 500 is
//! not fixed by asking again soon), and, when it could not be reached at all, a retry as soon as
//! it answers again (a cheap `/version` probe) instead of sleeping out a backoff that grew
//! during the outage. The delay grows until the watch makes progress (a re-list completes,
//! events flow, or it goes on without an error for a while), never merely because a re-list
//! began.

use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::Client;
use kube::runtime::watcher::{self, Event};

/// First and largest retry delay.
const MIN_DELAY: Duration = Duration::from_millis(200);
const MAX_DELAY: Duration = Duration::from_secs(30);
/// Up to this share of a delay is added at random (many watches, on many replicas and
/// nodes, do not retry in step).
const JITTER: f64 = 0.5;
/// How often an unreachable apiserver is probed.
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// A watch that went this long without an error made progress, though a quiet watch yields
/// nothing (longer than any delay: an apiserver that keeps refusing fails more often).
const QUIET_IS_PROGRESS: Duration = Duration::from_secs(120);

/// How to wait after an error before asking again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// The watch's resource version expired (410 Gone): re-list now; nothing is wrong.
    Relist,
    /// The apiserver answered with an error: back off.
    Answered,
    /// The apiserver could not be reached: retry once it answers again.
    Unreachable,
}

fn classify(e: &watcher::Error) -> After {
    match e {
        watcher::Error::WatchError(status) if status.code == 410 => After::Relist,
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => match e {
            kube::Error::Api(s) if s.code == 410 => After::Relist,
            kube::Error::Api(_) => After::Answered,
            _ => After::Unreachable,
        },
        watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => After::Answered,
    }
}

fn next_delay(last: Duration) -> Duration {
    (last * 2).clamp(MIN_DELAY, MAX_DELAY)
}

/// Waits up to `delay` for the apiserver to answer a probe; whether it did.
async fn wait_until_reachable(client: &Client, delay: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + delay;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(PROBE_EVERY.min(deadline - now)).await;
        let probe = tokio::time::timeout(PROBE_EVERY * 4, client.apiserver_version()).await;
        if matches!(probe, Ok(Ok(_))) {
            return true;
        }
    }
}

/// What the policy does before the next poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Poll now.
    Now,
    /// Sleep this long.
    Sleep(Duration),
    /// Wait up to this long, resuming as soon as the apiserver answers a probe.
    UntilReachable(Duration),
}

/// The retry policy, without I/O: fed what the watch yields, it says how long to wait.
/// Only progress (a completed re-list, events flowing, or [`QUIET_IS_PROGRESS`] without an
/// error) resets the delay: the watcher yields `Init` before every re-list, and a delay reset
/// by that would re-list a refusing apiserver five times a second forever. A quiet watch (no
/// fences, say) yields nothing for days: without the last rule, its next outage would start
/// from the delay and the spent probe of an earlier one.
#[derive(Debug, Default)]
struct Policy {
    delay: Duration,
    /// Set after an error: how to wait before polling again.
    pending: Option<After>,
    /// A 410 was answered with an immediate re-list since the last progress (a second one
    /// backs off: an apiserver that keeps answering 410 is not hammered).
    relisted: bool,
    /// An outage ended early on a probe since the last progress: the next unreachable error
    /// waits its whole delay (an apiserver that answers probes but not the watch is not
    /// hammered either).
    resumed_early: bool,
    /// When the last error was seen.
    last_error: Option<Instant>,
}

impl Policy {
    /// Records what the watch yielded at `now`.
    fn saw<K>(&mut self, item: &Result<Event<K>, watcher::Error>, now: Instant) {
        match item {
            Ok(Event::InitDone | Event::Apply(_) | Event::Delete(_)) => {
                *self = Policy::default();
            }
            // A re-list begins or goes on: no sign yet that it will complete.
            Ok(Event::Init | Event::InitApply(_)) => {}
            Err(e) => {
                let quiet = self
                    .last_error
                    .is_some_and(|t| now.saturating_duration_since(t) >= QUIET_IS_PROGRESS);
                if quiet {
                    *self = Policy::default();
                }
                self.last_error = Some(now);
                self.pending = Some(classify(e));
            }
        }
    }

    /// How to wait before the next poll; `jitter` in [0, 1) spreads retries of many watches.
    fn next(&mut self, jitter: f64) -> Wait {
        let grow = |p: &mut Policy| {
            p.delay = next_delay(p.delay);
            p.delay.mul_f64(1.0 + JITTER * jitter.clamp(0.0, 1.0))
        };
        match self.pending.take() {
            None => Wait::Now,
            Some(After::Relist) if !self.relisted => {
                self.relisted = true;
                Wait::Now
            }
            Some(After::Relist | After::Answered) => Wait::Sleep(grow(self)),
            Some(After::Unreachable) if !self.resumed_early => Wait::UntilReachable(grow(self)),
            Some(After::Unreachable) => Wait::Sleep(grow(self)),
        }
    }

    /// The apiserver answered a probe before the delay ran out.
    fn resumed(&mut self) {
        self.resumed_early = true;
    }
}

/// `stream` (a [`watcher`] without backoff of its own) with the retry policy above. Errors are
/// logged here, once per [`LOG_EVERY`] with how many there were (an outage fails every retry),
/// and a line says when the watch recovers; they are not passed on (the watch goes on by
/// itself), so the stream yields only events.
pub fn retrying<K, S>(
    client: Client,
    stream: S,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>>
where
    S: Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    let log = ErrorLog::new(short_type_name(std::any::type_name::<K>()));
    let state = (Box::pin(stream), client, Policy::default(), log);
    futures::stream::unfold(
        state,
        |(mut inner, client, mut policy, mut log)| async move {
            loop {
                match policy.next(rand::random::<f64>()) {
                    Wait::Now => {}
                    Wait::Sleep(d) => tokio::time::sleep(d).await,
                    Wait::UntilReachable(d) => {
                        if wait_until_reachable(&client, d).await {
                            policy.resumed();
                        }
                    }
                }
                let item = inner.next().await?;
                policy.saw(&item, Instant::now());
                if log.saw(&item, std::time::Instant::now()) {
                    return Some((item, (inner, client, policy, log)));
                }
            }
        },
    )
}

/// How often a watch that keeps failing logs its errors.
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// A watch's error lines: the first error of a run, then one line per [`LOG_EVERY`] with the
/// count; a line when it makes progress again.
#[derive(Debug)]
struct ErrorLog {
    watch: String,
    repeats: crate::telemetry::repeats::Repeats,
}

impl ErrorLog {
    fn new(watch: String) -> Self {
        ErrorLog {
            watch,
            repeats: crate::telemetry::repeats::Repeats::new(LOG_EVERY),
        }
    }

    /// Logs what is due for `item` at `now`; whether to pass the item on (events only).
    fn saw<K>(&mut self, item: &Result<Event<K>, watcher::Error>, now: std::time::Instant) -> bool {
        match item {
            Err(e) => {
                if let Some(errors) = self.repeats.occurred(now) {
                    let hint = hint(e);
                    tracing::warn!(watch = %self.watch, error = %e, errors, every = ?LOG_EVERY, hint, "watch error; retrying (repeats are counted and logged once per interval)");
                }
                false
            }
            Ok(Event::InitDone | Event::Apply(_) | Event::Delete(_)) => {
                if let Some(r) = self.repeats.recovered(now) {
                    tracing::info!(watch = %self.watch, errors = r.total, lasted = ?r.lasted, "watch recovered");
                }
                true
            }
            Ok(_) => true,
        }
    }
}

/// What an operator may check for an error (a resource the apiserver does not know).
fn hint(e: &watcher::Error) -> Option<&'static str> {
    let not_found = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    };
    not_found.then_some("is its CustomResourceDefinition installed (the chart's crds/)?")
}

/// `a::b::Outer<c::Inner>` -> `Outer<Inner>`.
fn short_type_name(full: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        out.push_str(word.rsplit("::").next().unwrap_or(word));
        word.clear();
    };
    for c in full.chars() {
        if matches!(c, '<' | '>' | ',' | ' ' | '(' | ')' | '[' | ']' | '&') {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("test", "Test")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn errors_are_classified_by_whether_the_apiserver_answered() {
        assert_eq!(
            classify(&watcher::Error::InitialListFailed(api(403))),
            After::Answered
        );
        assert_eq!(
            classify(&watcher::Error::WatchStartFailed(api(410))),
            After::Relist
        );
        let gone = kube::core::Status::failure("too old resource version", "Expired")
            .with_code(410)
            .boxed();
        assert_eq!(classify(&watcher::Error::WatchError(gone)), After::Relist);
        let refused = kube::Error::Service(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(
            classify(&watcher::Error::WatchStartFailed(refused)),
            After::Unreachable
        );
    }

    #[test]
    fn the_delay_doubles_from_the_minimum_up_to_the_maximum() {
        let mut d = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..10 {
            d = next_delay(d);
            seen.push(d);
        }
        assert_eq!(seen[0], MIN_DELAY);
        assert_eq!(seen[1], MIN_DELAY * 2);
        assert_eq!(*seen.last().unwrap(), MAX_DELAY);
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
    }

    fn refused() -> Result<Event<()>, watcher::Error> {
        Err(watcher::Error::InitialListFailed(api(403)))
    }

    fn unreachable() -> Result<Event<()>, watcher::Error> {
        Err(watcher::Error::InitialListFailed(kube::Error::Service(
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        )))
    }

    /// For tests whose errors come moments apart.
    fn now() -> Instant {
        Instant::now()
    }

    fn sleeps(w: Wait) -> Duration {
        match w {
            Wait::Now => Duration::ZERO,
            Wait::Sleep(d) | Wait::UntilReachable(d) => d,
        }
    }

    #[test]
    fn a_refused_list_backs_off_although_every_relist_begins_with_init() {
        let mut p = Policy::default();
        let mut waits = Vec::new();
        for _ in 0..8 {
            waits.push(sleeps(p.next(0.0)));
            // What kube's watcher yields per attempt: Init, then the failed list.
            p.saw(&Ok(Event::<()>::Init), now());
            p.saw(&refused(), now());
        }
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            waits,
            [
                ms(0),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(3200),
                ms(6400),
                ms(12800)
            ]
        );
        // A completed re-list is progress: the next error starts from the minimum again.
        p.next(0.0);
        p.saw(&Ok(Event::<()>::Init), now());
        p.saw(&Ok(Event::InitApply(())), now());
        p.saw(&Ok(Event::<()>::InitDone), now());
        p.saw(&refused(), now());
        assert_eq!(p.next(0.0), Wait::Sleep(MIN_DELAY));
    }

    #[test]
    fn events_flowing_reset_the_delay_and_jitter_only_lengthens_it() {
        let mut p = Policy::default();
        for _ in 0..4 {
            p.saw(&refused(), now());
            p.next(0.0);
        }
        p.saw(&Ok(Event::Apply(())), now());
        p.saw(&refused(), now());
        assert_eq!(
            p.next(0.99),
            Wait::Sleep(MIN_DELAY.mul_f64(1.0 + JITTER * 0.99))
        );
    }

    #[test]
    fn an_outage_ends_early_once_then_waits_its_delay_until_progress() {
        let mut p = Policy::default();
        p.saw(&unreachable(), now());
        assert_eq!(p.next(0.0), Wait::UntilReachable(MIN_DELAY));
        p.resumed();
        // The probe answered but the watch still cannot get through: no second early end.
        p.saw(&Ok(Event::<()>::Init), now());
        p.saw(&unreachable(), now());
        assert_eq!(p.next(0.0), Wait::Sleep(MIN_DELAY * 2));
        p.saw(&Ok(Event::<()>::InitDone), now());
        p.saw(&unreachable(), now());
        assert_eq!(p.next(0.0), Wait::UntilReachable(MIN_DELAY));
    }

    #[test]
    fn a_watch_quiet_for_a_while_after_errors_starts_its_next_outage_afresh() {
        let t0 = Instant::now();
        let mut p = Policy::default();
        // An outage: its probe spent, its delay grown.
        p.saw(&unreachable(), t0);
        p.next(0.0);
        p.resumed();
        p.saw(&unreachable(), t0 + Duration::from_secs(1));
        assert_eq!(p.next(0.0), Wait::Sleep(MIN_DELAY * 2));
        // The watch is made again and yields nothing (no fences) for a long time: the next
        // error is a new outage, probed from the start.
        p.saw(
            &unreachable(),
            t0 + Duration::from_secs(1) + QUIET_IS_PROGRESS,
        );
        assert_eq!(p.next(0.0), Wait::UntilReachable(MIN_DELAY));
        // Errors closer together still back off.
        p.saw(&refused(), t0 + Duration::from_secs(2) + QUIET_IS_PROGRESS);
        assert_eq!(p.next(0.0), Wait::Sleep(MIN_DELAY * 2));
    }

    #[test]
    fn errors_are_logged_once_per_interval_and_never_passed_on() {
        let t0 = std::time::Instant::now();
        let mut log = ErrorLog::new("pods".into());
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(!log.saw(&refused(), at(0)));
        assert!(!log.saw(&unreachable(), at(1)));
        assert_eq!(log.repeats.total(), 2);
        assert!(
            log.saw(&Ok(Event::<()>::Init), at(2)),
            "a re-list beginning is passed on"
        );
        assert_eq!(log.repeats.total(), 2, "and is no recovery");
        assert!(log.saw(&Ok(Event::<()>::InitDone), at(3)));
        assert_eq!(log.repeats.total(), 0, "a completed re-list ends the run");
    }

    #[test]
    fn watch_names_are_short_and_unknown_resources_hinted() {
        assert_eq!(
            short_type_name(
                "kube_core::metadata::PartialObjectMeta<k8s_openapi::api::core::v1::pod::Pod>"
            ),
            "PartialObjectMeta<Pod>"
        );
        assert_eq!(short_type_name("ipreclaim::api::slim::PodView"), "PodView");
        assert!(hint(&watcher::Error::InitialListFailed(api(404))).is_some());
        assert!(hint(&watcher::Error::InitialListFailed(api(403))).is_none());
    }

    #[test]
    fn a_second_410_in_a_row_backs_off() {
        let gone = || {
            Err::<Event<()>, _>(watcher::Error::WatchError(
                kube::core::Status::failure("expired", "Expired")
                    .with_code(410)
                    .boxed(),
            ))
        };
        let mut p = Policy::default();
        p.saw(&gone(), now());
        assert_eq!(p.next(0.0), Wait::Now);
        p.saw(&Ok(Event::<()>::Init), now());
        p.saw(&gone(), now());
        assert_eq!(p.next(0.0), Wait::Sleep(MIN_DELAY));
    }
}
