//! A mock apiserver: `kube::Client` over a `tower_test` service whose requests the test answers
//! one by one, as kube-rs' controller-rs tests do. Each test drives its side in the order the
//! program sends, so a request that should not come (or one that does not come) fails it.

use std::time::Duration;

use http::{Method, Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

/// How long a test waits for a request it expects (generous: the writer answers in
/// microseconds; under paused time it costs nothing).
const EXPECT_WITHIN: Duration = Duration::from_secs(10);

/// The test's side of the mock.
pub struct Apiserver {
    handle: Handle<Request<Body>, Response<Body>>,
}

/// A client talking to a new mock apiserver, and the mock.
pub fn pair() -> (kube::Client, Apiserver) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    (client, Apiserver { handle })
}

/// One request the program sent, its body read, waiting for its answer.
pub struct Call {
    pub method: Method,
    /// The path without the query.
    pub path: String,
    pub query: String,
    /// The Accept header, if any.
    pub accept: Option<String>,
    /// The body as JSON (`Null` when empty).
    pub body: Value,
    reply: SendResponse<Response<Body>>,
}

impl Apiserver {
    /// The next request; fails the test if none comes.
    pub async fn next(&mut self) -> Call {
        match tokio::time::timeout(EXPECT_WITHIN, self.next_or_none()).await {
            Ok(Some(call)) => call,
            Ok(None) => panic!("the client was dropped while a request was expected"),
            Err(_) => panic!("no request within {EXPECT_WITHIN:?}"),
        }
    }

    /// The next request, if one comes within `within`.
    pub async fn next_within(&mut self, within: Duration) -> Option<Call> {
        tokio::time::timeout(within, self.next_or_none())
            .await
            .ok()
            .flatten()
    }

    /// Fails the test if a request comes within `within`.
    pub async fn expect_silence(&mut self, within: Duration) {
        if let Some(call) = self.next_within(within).await {
            panic!(
                "expected no request within {within:?}, got {} {}?{} {}",
                call.method, call.path, call.query, call.body
            );
        }
    }

    async fn next_or_none(&mut self) -> Option<Call> {
        let (request, reply) = self.handle.next_request().await?;
        let (parts, body) = request.into_parts();
        let accept = parts
            .headers
            .get(http::header::ACCEPT)
            .map(|a| a.to_str().expect("an ASCII Accept").to_owned());
        let bytes = body.collect().await.expect("request body").to_bytes();
        let body = match bytes.is_empty() {
            true => Value::Null,
            false => serde_json::from_slice(&bytes).expect("a JSON request body"),
        };
        Some(Call {
            method: parts.method,
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or_default().to_owned(),
            accept,
            body,
            reply,
        })
    }
}

impl Call {
    /// Answers with `status` and `body`.
    pub fn respond(self, status: u16, body: &Value) {
        self.respond_bytes(
            status,
            "application/json",
            serde_json::to_vec(body).expect("JSON"),
        );
    }

    /// Answers with `status` and `body` in `content_type`.
    pub fn respond_bytes(self, status: u16, content_type: &str, body: Vec<u8>) {
        let response = Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Body::from(body))
            .expect("a response");
        self.reply.send_response(response);
    }

    /// Answers with a failure `Status` of `code`, as the apiserver does.
    pub fn fail(self, code: u16, reason: &str, message: &str) {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        });
        self.respond(code, &status);
    }

    /// `METHOD resource[/name]` after the namespace, for assertions and messages:
    /// `PATCH ippools/p`, `GET ippools` (a list), `DELETE overlappingrangeipreservations/r`;
    /// the whole path where there is no namespace (`GET /api/v1/pods`).
    pub fn what(&self) -> String {
        let tail = match self.path.split_once("/namespaces/") {
            Some((_, rest)) => rest.split_once('/').map_or(rest, |(_, rest)| rest),
            None => &self.path,
        };
        format!("{} {tail}", self.method)
    }
}
