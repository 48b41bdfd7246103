//! The Event queue under faults. A stand-in apiserver (an in-process HTTP service): a real
//! apiserver cannot be made to fail only its Event writes, for a set number of requests, while
//! everything else works. Against the real apiserver, Events are checked by the controller tests.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http_body_util::BodyExt;
use ipreclaim::ipam::PodKey;
use ipreclaim::release::{BudgetConfig, Budgets, Events, PodRef};
use ipreclaim::telemetry::WriteMetrics;
use kube::client::Body;
use podlife::clock::RealClock;
use prometheus_client::registry::Registry;
use testenv::poll::wait_for;

/// Answers Event creates: the first `fail` with `status` (a 429 asks for a 1 s pause, as
/// API Priority and Fairness does), then by echoing the Event back.
fn apiserver(fail: usize, status: u16, created: Arc<AtomicUsize>) -> kube::Client {
    let seen = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn(move |req: http::Request<Body>| {
        let (seen, created) = (seen.clone(), created.clone());
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let n = seen.fetch_add(1, Ordering::SeqCst);
            let response = if n < fail {
                let mut status_body = serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "injected", "reason": "ServiceUnavailable", "code": status,
                });
                let mut response = http::Response::builder().status(status);
                if status == 429 {
                    status_body["details"] = serde_json::json!({"retryAfterSeconds": 1});
                    response = response.header("Retry-After", "1");
                }
                response.body(Body::from(serde_json::to_vec(&status_body).unwrap()))
            } else {
                created.fetch_add(1, Ordering::SeqCst);
                http::Response::builder()
                    .status(201)
                    .body(Body::from(body.to_vec()))
            };
            Ok::<_, Infallible>(response.unwrap())
        }
    });
    kube::Client::new(service, "default")
}

fn pod(i: usize) -> PodRef {
    PodRef {
        key: PodKey::new("ns", format!("p-{i}")),
        uid: format!("uid-{i}"),
    }
}

fn metrics() -> WriteMetrics {
    WriteMetrics::new(&mut Registry::default())
}

/// Events under budgets that limit nothing.
fn events(client: kube::Client, m: &WriteMetrics) -> Events {
    let budgets = Budgets::new(BudgetConfig::UNLIMITED, RealClock::shared(), m.clone());
    Events::new(client, "test", budgets, m.clone())
}

/// Publishes `n` release Events (pods p-0.., addresses 192.0.2.0..) to an apiserver that
/// answers the first `fail` creates with `status`. Returns the creates that went through, the
/// metrics, and the publisher (kept while the test waits).
async fn publish(n: usize, fail: usize, status: u16) -> (Arc<AtomicUsize>, WriteMetrics, Events) {
    let created = Arc::new(AtomicUsize::new(0));
    let m = metrics();
    let events = events(apiserver(fail, status, created.clone()), &m);
    for i in 0..n {
        let ip = format!("192.0.2.{i}").parse().unwrap();
        events.released(&pod(i), &[ip], "ns/net").await;
    }
    (created, m, events)
}

/// Waits until `n` Events are published.
async fn wait_every_event_published(m: &WriteMetrics, n: u64) {
    wait_for("every event published", || async {
        m.events_published.get() == n
    })
    .await;
}

#[tokio::test]
async fn events_that_fail_while_the_apiserver_is_unavailable_are_retried_not_lost() {
    let (created, m, _events) = publish(50, 5, 503).await;
    wait_every_event_published(&m, 50).await;
    assert_eq!(created.load(Ordering::SeqCst), 50);
    assert_eq!(m.events_dropped.get(), 0);
}

#[tokio::test]
async fn an_event_the_apiserver_refuses_is_dropped_and_counted() {
    let (_, m, _events) = publish(3, 1, 422).await;
    wait_for("two published, one dropped", || async {
        m.events_published.get() == 2 && m.events_dropped.get() == 1
    })
    .await;
}

#[tokio::test]
async fn a_429_pauses_for_its_retry_after_and_the_event_is_sent_again() {
    let (created, m, _events) = publish(3, 2, 429).await;
    wait_every_event_published(&m, 3).await;
    // Each 429 counted once, none dropped, nothing sent twice.
    assert_eq!(m.throttled.get(), 2);
    assert_eq!(m.events_dropped.get(), 0);
    assert_eq!(created.load(Ordering::SeqCst), 3);
}
