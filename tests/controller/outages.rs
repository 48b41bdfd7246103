//! The watched apiserver down: a pod deleted meanwhile is released, and the watches resume
//! as soon as it answers.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use testenv::ControlPlane;

use crate::harness::Env;

/// A controller on a private control plane of two apiservers, watching through the first,
/// which is down; web-0 (192.0.2.10) was deleted through the second meanwhile, db-0
/// (192.0.2.11) lives. The second apiserver stops when its handle is dropped.
async fn web_0_deleted_while_the_watched_apiserver_is_down(
    prefix: &str,
) -> (ControlPlane, Env, testenv::controlplane::SecondApiServer) {
    let (cp, mut env) = Env::private(prefix).await;
    let ns = env.ns.clone();
    env.web_0_and_db_0().await;
    env.start(&[]).await;

    let (second, other) = cp.start_second_apiserver().await.expect("second apiserver");
    cp.stop_apiserver().expect("stop the first apiserver");
    Api::<Pod>::namespaced(other, &ns)
        .delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    (cp, env, second)
}

#[tokio::test]
async fn after_a_long_outage_the_watches_resume_as_soon_as_the_apiserver_answers() {
    let (cp, mut env, _second) =
        web_0_deleted_while_the_watched_apiserver_is_down("ctl-outage").await;
    // The fault: an outage long enough for the watches' retry delays to grow past 10 s.
    tokio::time::sleep(Duration::from_secs(20)).await;
    cp.start_apiserver()
        .await
        .expect("restart the first apiserver");
    // Well under the grown delay: the watches retry once the apiserver answers.
    testenv::poll::wait_for_within(
        "the release within 5 s of the apiserver's return",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { env.keys("192.0.2.0-24").await == ["11"] },
    )
    .await;
    env.stop().await;
}

#[tokio::test]
async fn a_pod_deleted_while_the_watched_apiserver_is_down_is_released() {
    let (cp, mut env, _second) = web_0_deleted_while_the_watched_apiserver_is_down("ctl-gap").await;
    cp.start_apiserver()
        .await
        .expect("restart the first apiserver");
    // The watch resumes (replayed Delete, or a re-list and its gap diff: unit-tested in
    // controller::watch); either way the address is released and the live pod's stays.
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    env.stop().await;
}

/// An apiserver that stops answering on an open connection (a host gone behind its address,
/// here a partitioned proxy): a read fails at its deadline, and the next read after the
/// partition heals is answered. A watch is not ended by the deadline.
#[tokio::test]
async fn a_read_from_an_apiserver_that_stopped_answering_fails_at_its_deadline() {
    use futures::StreamExt;
    use ipreclaim::request_deadline::with_deadline;
    use kube::api::WatchParams;
    use testenv::faultproxy::FaultProxy;

    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let ns = cp.namespace(&client, "deadline").await;
    let proxy = FaultProxy::start(client.clone(), 7).await.unwrap();
    let through = with_deadline(
        cp.client_through_faults(&proxy).await,
        Duration::from_secs(2),
    );
    let pods: Api<Pod> = Api::namespaced(through, &ns);
    pods.list(&Default::default())
        .await
        .expect("answered before");
    let version = pods
        .list_metadata(&Default::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    // A watch with the same deadline, not through the proxy (a cut ends the proxy's streams):
    // it stays open past the deadline while the read below waits for it.
    let direct: Api<Pod> =
        Api::namespaced(with_deadline(client.clone(), Duration::from_secs(2)), &ns);
    let mut watch = Box::pin(
        direct
            .watch(&WatchParams::default().timeout(20), &version)
            .await
            .expect("a watch"),
    );

    proxy.cut();
    // Bounded, so that a missing deadline fails here instead of hanging the test.
    let error = tokio::time::timeout(Duration::from_secs(60), pods.get_opt("web-0"))
        .await
        .expect("failed by its deadline")
        .expect_err("no answer while cut");
    assert!(error.to_string().contains("no answer within 2s"), "{error}");

    proxy.heal();
    assert!(
        pods.get_opt("web-0")
            .await
            .expect("answered after")
            .is_none()
    );
    // The watch opened before the read, more than its deadline ago, still delivers.
    Api::<Pod>::namespaced(client, &ns)
        .create(
            &Default::default(),
            &testenv::fixtures::pod("after-the-cut", None),
        )
        .await
        .unwrap();
    let event = tokio::time::timeout(Duration::from_secs(60), watch.next())
        .await
        .expect("an event")
        .expect("the watch still open")
        .expect("an event, not an error");
    assert!(
        matches!(&event, kube::api::WatchEvent::Added(p) if p.metadata.name.as_deref() == Some("after-the-cut")),
        "{event:?}"
    );
}
