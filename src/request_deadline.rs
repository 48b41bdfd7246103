//! A deadline on every request that is not a watch. kube's client has none by default (a watch
//! has the watcher's own idle timeout), so a list, read or write sent on a pooled connection
//! to an apiserver host that died without closing it (a VIP moved, a node lost) waits until
//! TCP gives up, about 15 minutes, with that worker, lister or lease renewal stuck. The
//! apiserver ends a request that is not long-running itself after 60 s by default
//! (`--request-timeout`), so a live one answers well within [`REQUEST_DEADLINE`].
//!
//! The answer must begin within the deadline, and its body may then go silent for as long
//! between two parts: a slow but live transfer (a large page, a busy client) is not cut, a dead
//! connection is. A request past either fails as any failed request does, and is retried by
//! its caller on a new connection. The body is read here (kube reads it whole anyway), except
//! for an answer in protobuf to a request that asked for it: the pod-list layer above
//! (`protobuf_lists`) reads that one as it arrives, under the same silence limit.

use std::time::Duration;

use http::{Request, Response, header};
use http_body_util::BodyExt;
use kube::client::Body;

/// How long a request that is not a watch may wait for its answer to begin, and then for each
/// next part of its body.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(90);

/// The most a body's announced length reserves ahead of its bytes.
const MOST_RESERVED: usize = 64 * 1024 * 1024;

/// A request whose answer did not come in time.
#[derive(Debug, thiserror::Error)]
#[error("{method} {path}: {what} within {deadline:?} (a dead connection?)")]
pub struct DeadlinePassed {
    method: http::Method,
    path: String,
    what: &'static str,
    deadline: Duration,
}

/// The request a passed deadline names, taken once per request.
pub(crate) struct Asked {
    method: http::Method,
    path: String,
}

impl Asked {
    pub(crate) fn of<B>(request: &Request<B>) -> Asked {
        Asked {
            method: request.method().clone(),
            path: request.uri().path().to_owned(),
        }
    }

    /// Its answer did not begin within `deadline`.
    fn unanswered(&self, deadline: Duration) -> kube::Error {
        self.passed("no answer", deadline)
    }

    fn passed(&self, what: &'static str, deadline: Duration) -> kube::Error {
        kube::Error::Service(Box::new(DeadlinePassed {
            method: self.method.clone(),
            path: self.path.clone(),
            what,
            deadline,
        }))
    }
}

/// `client`, with `deadline` on each request that is not a watch.
pub fn with_deadline(client: kube::Client, deadline: Duration) -> kube::Client {
    let layer = Deadline {
        client: client.clone(),
        deadline,
    };
    crate::client_layer::client(&client, layer)
}

#[derive(Clone)]
struct Deadline {
    client: kube::Client,
    deadline: Duration,
}

impl crate::client_layer::Layer for Deadline {
    async fn send(&self, request: Request<Body>) -> Result<Response<Body>, kube::Error> {
        if is_watch(&request) {
            return self.client.send(request).await;
        }
        let asked_protobuf = asks_protobuf(&request);
        let asked = Asked::of(&request);
        let response = tokio::time::timeout(self.deadline, self.client.send(request))
            .await
            .map_err(|_| asked.unanswered(self.deadline))??;
        if asked_protobuf && is_protobuf(&response) {
            return Ok(response);
        }
        let (head, body) = response.into_parts();
        // As long as the answer says (a list's pages: one allocation, not doublings).
        let said = usize::try_from(http_body::Body::size_hint(&body).lower()).unwrap_or(0);
        let mut bytes = Vec::with_capacity(said.min(MOST_RESERVED));
        each_part(body, self.deadline, |part| {
            bytes.extend_from_slice(part);
            Ok::<(), std::convert::Infallible>(())
        })
        .await
        .map_err(|e| e.into_kube(&asked, self.deadline))?
        .unwrap_or_else(|never| match never {});
        // kube copies it whole: no spare capacity held beside that copy.
        bytes.shrink_to_fit();
        Ok(Response::from_parts(head, Body::from(bytes)))
    }
}

/// Why reading a body stopped.
pub(crate) enum BodyError {
    /// No part came within the silence limit.
    Silent,
    /// The transport failed.
    Transport(kube::Error),
}

impl BodyError {
    /// The error of `asked`, whose body was read with `silence`.
    pub(crate) fn into_kube(self, asked: &Asked, silence: Duration) -> kube::Error {
        match self {
            BodyError::Silent => asked.passed("no further answer", silence),
            BodyError::Transport(e) => e,
        }
    }
}

/// Hands each data part of `body` to `each` as it arrives, waiting at most `silence` for
/// each; stops at the first error `each` returns (the inner result).
pub(crate) async fn each_part<B, E>(
    mut body: B,
    silence: Duration,
    mut each: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<Result<(), E>, BodyError>
where
    B: http_body::Body<Data = bytes::Bytes, Error = kube::Error> + Unpin,
{
    loop {
        let frame = tokio::time::timeout(silence, body.frame())
            .await
            .map_err(|_| BodyError::Silent)?;
        let Some(frame) = frame else {
            return Ok(Ok(()));
        };
        if let Ok(data) = frame.map_err(BodyError::Transport)?.into_data()
            && let Err(e) = each(&data)
        {
            return Ok(Err(e));
        }
    }
}

/// A watch: its stream stays open, guarded by the watcher's idle timeout. As the apiserver
/// tells one: a `watch` parameter whose first value is anything but `0` or `false` (in any
/// case; empty counts as a watch), or a path under the legacy `watch/` prefix.
pub(crate) fn is_watch<B>(request: &Request<B>) -> bool {
    let uri = request.uri();
    let watch_param = uri.query().and_then(|q| {
        q.split('&').find_map(|p| match p.split_once('=') {
            Some(("watch", v)) => Some(v),
            None if p == "watch" => Some(""),
            _ => None,
        })
    });
    if let Some(v) = watch_param {
        return !(v == "0" || v.eq_ignore_ascii_case("false"));
    }
    let segments: Vec<&str> = uri.path().split('/').collect();
    matches!(
        segments.as_slice(),
        ["", "api", _, "watch", ..] | ["", "apis", _, _, "watch", ..]
    )
}

/// A request that asks for protobuf first: its body is read by the layer that asked.
fn asks_protobuf<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(header::ACCEPT)
        .is_some_and(|a| a.as_bytes().starts_with(PROTOBUF.as_bytes()))
}

/// An answer in protobuf.
pub(crate) fn is_protobuf<B>(response: &Response<B>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|t| t.to_str().ok())
        .is_some_and(|t| t.starts_with(PROTOBUF))
}

const PROTOBUF: &str = ipreclaim_core::api::protobuf::PROTOBUF;

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use kube::api::{Api, ListParams};
    use tower_test::mock;

    type Handle = mock::Handle<Request<Body>, Response<Body>>;

    fn client(deadline: Duration) -> (kube::Client, Handle) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let inner = kube::Client::new(service, "default");
        (with_deadline(inner, deadline), handle)
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_with_no_answer_fails_at_its_deadline() {
        let (client, mut handle) = client(Duration::from_secs(90));
        let api: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client, "ns");
        let started = tokio::time::Instant::now();
        let server = tokio::spawn(async move {
            // Taken and never answered: a dead connection.
            let (_request, send) = handle.next_request().await.expect("a request");
            std::future::pending::<()>().await;
            drop(send);
        });
        // Bounded, so that a missing deadline fails the test instead of hanging it.
        let error = tokio::time::timeout(Duration::from_secs(3600), api.get("cm"))
            .await
            .expect("failed by the deadline, not by this bound")
            .expect_err("no answer");
        assert_eq!(started.elapsed(), Duration::from_secs(90));
        assert!(
            error.to_string().contains("no answer within 90s"),
            "{error}"
        );
        server.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_within_the_deadline_and_a_watch_past_it_are_read() {
        let (client, mut handle) = client(Duration::from_secs(90));
        let api: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client, "ns");
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("a list");
            assert!(!is_watch(&request));
            tokio::time::sleep(Duration::from_secs(89)).await;
            let list = br#"{"apiVersion":"v1","kind":"ConfigMapList","metadata":{"resourceVersion":"5"},"items":[]}"#;
            send.send_response(Response::new(Body::from(list.to_vec())));
            let (request, send) = handle.next_request().await.expect("a watch");
            assert!(is_watch(&request));
            tokio::time::sleep(Duration::from_secs(200)).await;
            let event = br#"{"type":"BOOKMARK","object":{"apiVersion":"v1","kind":"ConfigMap","metadata":{"resourceVersion":"6"}}}"#;
            send.send_response(Response::new(Body::from(event.to_vec())));
        });
        let list = api
            .list(&ListParams::default())
            .await
            .expect("answered in 89 s");
        assert!(list.items.is_empty());
        let params = kube::api::WatchParams::default();
        let mut events = Box::pin(api.watch(&params, "5").await.expect("a watch past 90 s"));
        use futures::TryStreamExt;
        assert!(events.try_next().await.expect("an event").is_some());
        server.await.unwrap();
    }

    /// A body of `parts`, each after its delay; then silence when `then_silent`, else its end.
    fn slow_body(
        parts: Vec<(Duration, &'static [u8])>,
        then_silent: bool,
    ) -> impl http_body::Body<Data = bytes::Bytes, Error = kube::Error> + Unpin {
        let frames = futures::stream::iter(parts)
            .then(|(delay, part)| async move {
                tokio::time::sleep(delay).await;
                Ok(http_body::Frame::data(bytes::Bytes::from_static(part)))
            })
            .chain(
                futures::stream::iter(then_silent.then_some(())).then(|_| async {
                    std::future::pending::<Result<http_body::Frame<bytes::Bytes>, kube::Error>>()
                        .await
                }),
            );
        http_body_util::StreamBody::new(Box::pin(frames))
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_body_is_read_and_a_silent_one_fails_at_the_limit() {
        let minute = Duration::from_secs(60);
        let parts = vec![(minute, &b"ab"[..]), (minute, b"cd"), (minute, b"ef")];
        let mut read = Vec::new();
        let slow = each_part(slow_body(parts.clone(), false), REQUEST_DEADLINE, |p| {
            read.extend_from_slice(p);
            Ok::<(), ()>(())
        });
        assert!(
            matches!(slow.await, Ok(Ok(()))),
            "three minutes, a part a minute"
        );
        assert_eq!(read, b"abcdef");

        let started = tokio::time::Instant::now();
        let silent = each_part(slow_body(parts, true), REQUEST_DEADLINE, |_| {
            Ok::<(), ()>(())
        });
        let bounded = tokio::time::timeout(Duration::from_secs(3600), silent);
        assert!(matches!(bounded.await, Ok(Err(BodyError::Silent))));
        assert_eq!(started.elapsed(), 3 * minute + REQUEST_DEADLINE);

        // What the reader refuses stops the read, with its own error.
        let refused = each_part(
            slow_body(vec![(minute, b"x")], true),
            REQUEST_DEADLINE,
            |_| Err("refused"),
        );
        assert!(matches!(refused.await, Ok(Err("refused"))));
    }

    #[test]
    fn watches_are_told_as_the_apiserver_tells_them() {
        let get = |uri: &str| Request::get(uri).body(()).unwrap();
        for watch in [
            "/api/v1/pods?watch=true&resourceVersion=5",
            "/api/v1/pods?resourceVersion=5&watch=1",
            "/api/v1/pods?watch",
            "/api/v1/pods?watch=",
            "/api/v1/pods?watch=yes",
            "/api/v1/pods?watch=tRue&watch=false",
            "/api/v1/watch/namespaces/ns/pods",
            "/apis/whereabouts.cni.cncf.io/v1alpha1/watch/ippools",
        ] {
            assert!(is_watch(&get(watch)), "{watch}");
        }
        for not in [
            "/api/v1/pods?limit=500",
            "/api/v1/pods?watch=false",
            "/api/v1/pods?watch=FALSE&watch=true",
            "/api/v1/pods?watch=0",
            "/api/v1/pods?watchx=true",
            "/api/v1/namespaces/ns/pods/watch",
        ] {
            assert!(!is_watch(&get(not)), "{not}");
        }
    }
}
