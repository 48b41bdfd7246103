//! Retrying a watch: exponential backoff for errors the apiserver answered (a 403 or a 500 is
//! not fixed by asking again soon), and, when it could not be reached at all, a retry as soon as
//! it answers again (a cheap `/version` probe) instead of sleeping out a backoff that grew
//! during the outage.

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::Client;
use kube::runtime::watcher;

/// First and largest retry delay.
const MIN_DELAY: Duration = Duration::from_millis(200);
const MAX_DELAY: Duration = Duration::from_secs(30);
/// How often an unreachable apiserver is probed.
const PROBE_EVERY: Duration = Duration::from_millis(250);

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

struct Retrying<S> {
    inner: Pin<Box<S>>,
    client: Client,
    delay: Duration,
    /// Set after an error: how to wait before polling again.
    pending: Option<After>,
    /// A 410 was answered with an immediate re-list since the last success (a second one in a
    /// row backs off: an apiserver that keeps answering 410 is not hammered).
    relisted: bool,
}

/// `stream` (a [`watcher`] without backoff of its own) with the retry policy above.
pub fn retrying<K, S>(client: Client, stream: S) -> impl Stream<Item = Result<K, watcher::Error>>
where
    S: Stream<Item = Result<K, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    let state = Retrying {
        inner: Box::pin(stream),
        client,
        delay: Duration::ZERO,
        pending: None,
        relisted: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        match st.pending.take() {
            None => {}
            Some(After::Relist) if !st.relisted => st.relisted = true,
            Some(After::Relist | After::Answered) => {
                st.delay = next_delay(st.delay);
                tokio::time::sleep(st.delay).await;
            }
            Some(After::Unreachable) => {
                st.delay = next_delay(st.delay);
                if wait_until_reachable(&st.client, st.delay).await {
                    // Back: what comes next is judged afresh (a real error backs off from
                    // the start again).
                    st.delay = Duration::ZERO;
                }
            }
        }
        let item = st.inner.next().await?;
        match &item {
            Ok(_) => {
                st.delay = Duration::ZERO;
                st.relisted = false;
            }
            Err(e) => st.pending = Some(classify(e)),
        }
        Some((item, st))
    })
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
}
