//! A deadline on every request that is not a watch. kube's client has none by default (a watch
//! has the watcher's own idle timeout), so a list, read or write sent on a pooled connection
//! to an apiserver host that died without closing it (a VIP moved, a node lost) waits until
//! TCP gives up, about 15 minutes, with that worker, lister or lease renewal stuck. The
//! apiserver ends a request that is not long-running itself after 60 s (`--request-timeout`),
//! so a live one answers well within [`REQUEST_DEADLINE`]; past it the request fails as any
//! failed request does, and is retried by its caller on a new connection.
//!
//! The deadline covers the response and its body, which is read here (kube reads it whole
//! anyway); a body read as it arrives by a layer above (a pod list in protobuf,
//! `protobuf_lists`) is left to that layer, which reads it under the same deadline.

use std::time::Duration;

use http::{Request, Response, header};
use kube::client::Body;

/// How long a request that is not a watch may take, its body included.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(90);

/// A request that passed its deadline.
#[derive(Debug, thiserror::Error)]
#[error("{method} {path}: no complete answer within {deadline:?} (a dead connection?)")]
pub struct DeadlinePassed {
    method: http::Method,
    path: String,
    deadline: Duration,
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
        let streamed = asks_protobuf(&request);
        let passed = DeadlinePassed {
            method: request.method().clone(),
            path: request.uri().path().to_owned(),
            deadline: self.deadline,
        };
        let answer = async {
            let response = self.client.send(request).await?;
            if streamed {
                return Ok(response);
            }
            let (head, body) = response.into_parts();
            let bytes = body.collect_bytes().await?;
            Ok(Response::from_parts(head, Body::from(bytes)))
        };
        tokio::time::timeout(self.deadline, answer)
            .await
            .unwrap_or_else(|_| Err(kube::Error::Service(Box::new(passed))))
    }
}

/// A watch: its stream stays open, guarded by the watcher's idle timeout.
pub(crate) fn is_watch<B>(request: &Request<B>) -> bool {
    request.uri().query().is_some_and(|q| {
        // As the apiserver parses it (Go's strconv.ParseBool).
        q.split('&').any(|p| {
            p.strip_prefix("watch=")
                .is_some_and(|v| matches!(v, "1" | "t" | "T" | "true" | "TRUE" | "True"))
        })
    })
}

/// A request that asks for protobuf first: its body is read by the layer that asked.
fn asks_protobuf<B>(request: &Request<B>) -> bool {
    request.headers().get(header::ACCEPT).is_some_and(|a| {
        a.as_bytes()
            .starts_with(b"application/vnd.kubernetes.protobuf")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
            error.to_string().contains("no complete answer within 90s"),
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

    #[test]
    fn watches_are_told_by_their_query() {
        let get = |uri: &str| Request::get(uri).body(()).unwrap();
        assert!(is_watch(&get("/api/v1/pods?watch=true&resourceVersion=5")));
        assert!(is_watch(&get("/api/v1/pods?resourceVersion=5&watch=1")));
        assert!(!is_watch(&get("/api/v1/pods?limit=500")));
        assert!(!is_watch(&get("/api/v1/pods?watch=false")));
        assert!(!is_watch(&get("/api/v1/namespaces/ns/pods/watch")));
    }
}
