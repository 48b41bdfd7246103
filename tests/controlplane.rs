//! The test control plane itself, against the real kube-apiserver and etcd.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use ipreclaim::api::{IPAllocation, IPPool, IPPoolSpec};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use testenv::ControlPlane;

const WAIT: Duration = Duration::from_secs(30);

fn pod(name: &str, network_status: &str) -> Pod {
    testenv::fixtures::annotated_pod(name, NETWORK_STATUS_ANNOTATION, network_status)
}

const STATUS_JSON: &str = r#"[{"name":"default/net1","interface":"net1","ips":["192.0.2.10"],"mac":"02:00:00:00:00:01","default":false}]"#;

/// Waits for the next watcher event that satisfies `pred`.
async fn next_matching<S, F>(stream: &mut S, what: &str, mut pred: F) -> Event<Pod>
where
    S: futures::Stream<Item = Result<Event<Pod>, watcher::Error>> + Unpin,
    F: FnMut(&Event<Pod>) -> bool,
{
    tokio::time::timeout(WAIT, async {
        loop {
            match stream.try_next().await {
                Ok(Some(e)) if pred(&e) => return e,
                Ok(Some(_)) | Err(_) => continue,
                Ok(None) => panic!("watch stream ended while waiting for {what}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no watch event for {what} within {WAIT:?}"))
}

fn is_apply_of(e: &Event<Pod>, name: &str) -> bool {
    matches!(e, Event::Apply(p) | Event::InitApply(p) if p.metadata.name.as_deref() == Some(name))
}

#[tokio::test]
async fn pod_with_network_status_is_created_watched_and_deleted() {
    let cp = ControlPlane::shared();
    let (client, ns) = cp.client_and_namespace("cp-pod").await;
    let pods = Api::<Pod>::namespaced(client, &ns);
    let mut events = watcher::watcher(pods.clone(), watcher::Config::default()).boxed();
    next_matching(&mut events, "initial list", |e| {
        matches!(e, Event::InitDone)
    })
    .await;

    pods.create(&PostParams::default(), &pod("web-0", STATUS_JSON))
        .await
        .unwrap();
    let Event::Apply(seen) =
        next_matching(&mut events, "pod created", |e| is_apply_of(e, "web-0")).await
    else {
        unreachable!()
    };
    let annotations = seen.metadata.annotations.unwrap();
    assert_eq!(annotations[NETWORK_STATUS_ANNOTATION], STATUS_JSON);
    let uid = seen.metadata.uid.unwrap();

    // No kubelet runs here: only a zero-grace delete removes the pod at once.
    pods.delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let deleted = next_matching(&mut events, "pod deleted", |e| {
        matches!(e, Event::Delete(_))
    })
    .await;
    let Event::Delete(gone) = deleted else {
        unreachable!()
    };
    assert_eq!(gone.metadata.uid.as_deref(), Some(uid.as_str()));
    assert!(pods.get_opt("web-0").await.unwrap().is_none());
}

#[tokio::test]
async fn graceful_delete_without_kubelet_leaves_the_pod_terminating() {
    let cp = ControlPlane::shared();
    let (client, ns) = cp.client_and_namespace("cp-terminating").await;
    let pods = Api::<Pod>::namespaced(client, &ns);
    let mut p = pod("web-0", STATUS_JSON);
    p.spec.as_mut().unwrap().node_name = Some("node-a".into());
    pods.create(&PostParams::default(), &p).await.unwrap();
    pods.delete("web-0", &DeleteParams::default())
        .await
        .unwrap();
    let still = pods.get("web-0").await.unwrap();
    assert!(
        still.metadata.deletion_timestamp.is_some(),
        "pod is Terminating"
    );
}

#[tokio::test]
async fn watch_survives_an_apiserver_restart() {
    // A private control plane: restarting the shared one would disturb the other tests.
    let cp = ControlPlane::start_for_test().await;
    let (client, ns) = cp.client_and_namespace("cp-restart").await;
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    pods.create(&PostParams::default(), &pod("before", STATUS_JSON))
        .await
        .unwrap();

    let mut events = watcher::watcher(pods.clone(), watcher::Config::default())
        .default_backoff()
        .boxed();
    next_matching(&mut events, "pod before restart", |e| {
        is_apply_of(e, "before")
    })
    .await;

    cp.restart_apiserver()
        .await
        .expect("restart kube-apiserver");

    // etcd kept the data, and the same watcher sees what happens after the restart.
    assert!(
        pods.get_opt("before").await.unwrap().is_some(),
        "data survived the restart"
    );
    pods.create(&PostParams::default(), &pod("after", STATUS_JSON))
        .await
        .unwrap();
    next_matching(&mut events, "pod after restart", |e| {
        is_apply_of(e, "after")
    })
    .await;
}

#[tokio::test]
async fn service_account_without_permissions_gets_403() {
    let cp = ControlPlane::shared();
    let (_, ns, sa) = cp.namespace_and_rightless_client("cp-rbac", "nobody").await;
    let err = Api::<Pod>::namespaced(sa.clone(), &ns)
        .list(&Default::default())
        .await
        .expect_err("a ServiceAccount without RBAC must not list pods");
    match err {
        kube::Error::Api(status) => assert_eq!(status.code, 403, "{status:?}"),
        other => panic!("expected a 403, got {other}"),
    }
    // The token itself is valid: the apiserver knows who is asking.
    let who = sa.apiserver_version().await;
    assert!(
        who.is_ok(),
        "an authenticated ServiceAccount may read /version: {who:?}"
    );
}

#[tokio::test]
async fn crds_install_and_an_ippool_is_created() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let installed = cp.install_crds(&client).await.expect("install crds/");
    assert!(
        installed.contains(&"ippools.whereabouts.cni.cncf.io".to_string()),
        "{installed:?}"
    );
    let ns = cp.namespace(&client, "cp-crd").await;
    let pools = Api::<IPPool>::namespaced(client, &ns);
    let pool = IPPool::new(
        "198.18.0.0-24",
        IPPoolSpec {
            range: "198.18.0.0/24".into(),
            allocations: BTreeMap::from([(
                "5".to_string(),
                IPAllocation {
                    id: "sandbox-1".into(),
                    podref: format!("{ns}/web-0"),
                    ifname: Some("net1".into()),
                    ipamclaimref: None,
                },
            )]),
        },
    );
    pools.create(&PostParams::default(), &pool).await.unwrap();
    let got = pools.get("198.18.0.0-24").await.unwrap();
    assert_eq!(got.spec, pool.spec);
}

/// The chaos suite's fault proxy does what its rules say, against the real apiserver: it
/// forwards, refuses with the chosen status, holds until released, and cuts watch streams.
#[tokio::test]
async fn the_fault_proxy_forwards_refuses_holds_and_cuts_watches() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let cp = ControlPlane::shared();
    let (admin, ns) = cp.client_and_namespace("faults").await;
    let proxy = FaultProxy::start(admin.clone(), 7).await.unwrap();
    let client = cp.client_through_faults(&proxy).await;
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client, &ns);
    let mut cm = k8s_openapi::api::core::v1::ConfigMap::default();
    cm.metadata.name = Some("a".into());
    maps.create(&PostParams::default(), &cm).await.unwrap();

    proxy.set_rules(vec![Rule::new(
        Some("get"),
        Some("configmaps"),
        Action::Status(422),
    )]);
    match maps.get("a").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{s:?}"),
        other => panic!("expected the injected 422, got {other:?}"),
    }
    proxy.set_rules(vec![Rule::new(Some("get"), None, Action::Hold)]);
    let held = tokio::spawn({
        let maps = maps.clone();
        async move { maps.get("a").await }
    });
    // Held: not answered while the rule holds (bounded wait, then release).
    let early = tokio::time::timeout(Duration::from_millis(500), async {
        while !held.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(early.is_err(), "a held request was answered before release");
    proxy.release_held();
    held.await
        .unwrap()
        .expect("a released request is forwarded");
    proxy.clear();

    let mut events = maps
        .watch(&kube::api::WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    proxy.cut_watches();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(e) = events.next().await {
            if e.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "a cut watch stream did not end");
    let counts = proxy.injected();
    assert_eq!(counts.get("422 get configmaps"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("hold get configmaps"), Some(&1), "{counts:?}");
    assert!(
        proxy
            .writes()
            .iter()
            .any(|w| w.verb == "create" && w.resource == "configmaps"),
        "the create was logged as a write"
    );
}

/// A `CutAfter` rule lets its write through and answers it, then partitions the proxy: the
/// next request is not answered until healed (the chaos suite's leader lost between a pool
/// patch and a reservation delete).
#[tokio::test]
async fn the_fault_proxy_cuts_right_after_a_write_it_answered() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let cp = ControlPlane::shared();
    let (admin, ns) = cp.client_and_namespace("cutafter").await;
    let proxy = FaultProxy::start(admin.clone(), 7).await.unwrap();
    let client = cp.client_through_faults(&proxy).await;
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client, &ns);
    proxy.set_rules(vec![Rule::new(
        Some("create"),
        Some("configmaps"),
        Action::CutAfter,
    )]);
    let mut cm = k8s_openapi::api::core::v1::ConfigMap::default();
    cm.metadata.name = Some("a".into());
    let created = tokio::time::timeout(
        Duration::from_secs(10),
        maps.create(&PostParams::default(), &cm),
    )
    .await
    .expect("the write that cuts is answered")
    .unwrap();
    assert_eq!(created.metadata.name.as_deref(), Some("a"));
    assert!(proxy.is_cut());
    let next = tokio::spawn({
        let maps = maps.clone();
        async move { maps.get("a").await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!next.is_finished(), "a request after the cut was answered");
    proxy.clear();
    proxy.heal();
    next.await.unwrap().expect("answered once healed");
    let counts = proxy.injected();
    assert_eq!(
        counts.get("cut-after create configmaps"),
        Some(&1),
        "{counts:?}"
    );
}

/// The chaos suite's allocator is the real whereabouts CNI binary: ADD writes a pool entry and
/// a reservation naming the pod, an ADD for the same pod (a new sandbox) gets the same address
/// back, and DEL of the sandbox that holds the entry frees both.
#[tokio::test]
async fn the_real_whereabouts_cni_allocates_reuses_by_podref_and_frees() {
    use ipreclaim::api::OverlappingRangeIPReservation;
    let cp = ControlPlane::shared();
    let admin = cp.client().await;
    cp.install_crds(&admin).await.unwrap();
    let ns = cp.namespace(&admin, "wb").await;
    let dir = cp.dir().join(format!("wb-{ns}"));
    let cni = testenv::whereabouts::WhereaboutsCni::new(cp, &ns, &dir, "10.77.0.0/24").unwrap();
    let a = cni.add(&ns, "p-0", "sandbox-a").await.unwrap();
    let b = cni.add(&ns, "p-1", "sandbox-b").await.unwrap();
    assert_ne!(a, b, "two pods got one address");
    let again = cni.add(&ns, "p-0", "sandbox-c").await.unwrap();
    let pools: Api<IPPool> = Api::namespaced(admin.clone(), &ns);
    let pool = pools.get("10.77.0.0-24").await.unwrap();
    let podrefs: Vec<&str> = pool
        .spec
        .allocations
        .values()
        .map(|e| e.podref.as_str())
        .collect();
    assert_eq!(
        again, a,
        "a new sandbox of the same pod gets its address back; entries {podrefs:?}"
    );
    let reservations: Api<OverlappingRangeIPReservation> = Api::namespaced(admin.clone(), &ns);
    let r = reservations.get(&b.to_string()).await.unwrap();
    assert_eq!(r.spec.podref, format!("{ns}/p-1"));
    cni.del(&ns, "p-1", "sandbox-b").await.unwrap();
    let pool = pools.get("10.77.0.0-24").await.unwrap();
    assert!(
        pool.spec
            .allocations
            .values()
            .all(|e| e.podref != format!("{ns}/p-1")),
        "DEL left the entry: {:?}",
        pool.spec.allocations
    );
    assert!(
        reservations
            .get_opt(&b.to_string())
            .await
            .unwrap()
            .is_none()
    );
}
