//! The deletion path: a deleted pod's addresses released with their Events, also when it was
//! deleted while the controller was down, on two networks at once, beside a concurrent
//! allocator; a release that keeps failing; dry-run.

use kube::api::{Api, ObjectMeta, PostParams};
use testenv::ControlPlane;
use testenv::poll::{metric_sum, wait_for};

use crate::harness::Env;

// The scenarios run twice, as admin and as the chart's ServiceAccount.
testenv::as_admin_and_as_the_chart!(Env {
    deleted_pod_is_released_with_an_event_and_the_live_pod_is_untouched: "ctl-delete",
    statefulset_pod_recreated_keeps_its_new_ip: "ctl-sts",
    pods_deleted_while_the_controller_was_down_are_released_at_start: "ctl-down",
    dual_stack_release_deletes_reservations_with_one_event_per_network: "ctl-ds",
    dry_run_reports_and_writes_nothing: "ctl-dry",
});

async fn deleted_pod_is_released_with_an_event_and_the_live_pod_is_untouched(mut env: Env) {
    let web_uid = env.web_0_and_db_0().await;
    env.start(&[]).await;

    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;

    let ns = env.ns.clone();
    let events = env.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(
        events,
        [(
            "web-0".to_string(),
            web_uid,
            format!("successful cleanup of IP address [192.0.2.10] from network {ns}/macvlan")
        )]
    );
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodDeleted"} 1"#)
        .await;
    env.wait_metric("ipreclaim_deletion_to_release_seconds_count 1")
        .await;
    env.stop().await;
}

async fn statefulset_pod_recreated_keeps_its_new_ip(mut env: Env) {
    env.macvlan(&[(10, "sb-old", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.start(&[]).await;

    // Deleted and recreated under the same name with a new address before anything else.
    env.delete_pod("web-0").await;
    let new_uid = env.recreate("web-0", 20, "sb-new").await;

    env.wait_keys("192.0.2.0-24", &["20"]).await;
    // Several sweeps later the new pod's address is still there.
    env.wait_sweeps(2.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["20"]);
    let pod = env.pods().get("web-0").await.unwrap();
    assert_eq!(pod.metadata.uid.unwrap(), new_uid);
    env.stop().await;
}

async fn pods_deleted_while_the_controller_was_down_are_released_at_start(mut env: Env) {
    env.nad("macvlan", "198.18.0.0/24").await;
    // gone-0 never exists any more; live-0 does.
    env.pool(
        "198.18.0.0-24",
        "198.18.0.0/24",
        &[(5, "sb-gone", "gone-0"), (6, "sb-live", "live-0")],
    )
    .await;
    env.pod("live-0", "macvlan", Some(&["198.18.0.6"])).await;
    env.start(&[]).await;
    env.wait_keys("198.18.0.0-24", &["6"]).await;
    env.stop().await;

    // Down: a pod is deleted. Back up: its address is released.
    env.pool("198.18.1.0-24", "198.18.1.0/24", &[(7, "sb-x", "live-1")])
        .await;
    env.pod("live-1", "macvlan", Some(&["198.18.1.7"])).await;
    env.delete_pod("live-1").await;
    env.start(&[]).await;
    env.wait_keys("198.18.1.0-24", &[]).await;
    assert_eq!(env.keys("198.18.0.0-24").await, ["6"]);
    env.stop().await;
}

async fn dual_stack_release_deletes_reservations_with_one_event_per_network(mut env: Env) {
    env.nad_config(
        "macvlan",
        r#"{"type":"macvlan","ipam":{"type":"whereabouts","ipRanges":[{"range":"192.0.2.0/24"},{"range":"2001:db8::/64"}]}}"#,
    )
    .await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web", "web-0")])
        .await;
    env.pool("2001-db8---64", "2001:db8::/64", &[(5, "sb-web", "web-0")])
        .await;
    for name in ["192.0.2.10", "2001-db8--5"] {
        env.reservation_of(name, "sb-web", "web-0").await;
    }
    env.pod("web-0", "macvlan", Some(&["192.0.2.10", "2001:db8::5"]))
        .await;
    env.start(&[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.wait_keys("2001-db8---64", &[]).await;
    wait_for("reservations deleted", || async {
        env.reservation_names().await.is_empty()
    })
    .await;
    let events = env.wait_events("IPAddressGarbageCollected").await;
    let ns = &env.ns;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        events[0].2,
        format!(
            "successful cleanup of IP address [192.0.2.10 2001:db8::5] from network {ns}/macvlan"
        )
    );
    env.stop().await;
}

#[tokio::test]
async fn a_concurrent_allocator_loses_nothing_during_a_mass_release() {
    let mut env = Env::new("ctl-race").await;
    env.nad("macvlan", "198.18.0.0/16").await;
    let names: Vec<String> = (0..100).map(|i| format!("p{i}")).collect();
    let sandboxes: Vec<String> = (0..100).map(|i| format!("sb-{i}")).collect();
    let allocs: Vec<(u32, &str, &str)> = (0..100)
        .map(|i| (i as u32, sandboxes[i].as_str(), names[i].as_str()))
        .collect();
    env.pool("198.18.0.0-16", "198.18.0.0/16", &allocs).await;
    for (i, n) in names.iter().enumerate() {
        let ip = format!("198.18.0.{i}");
        env.pod(n, "macvlan", Some(&[ip.as_str()])).await;
    }
    // The new allocations are for pods this test never creates: keep the sweep off them. They
    // name no pod, so --missing-pod-grace (5 s) applies, not --leak-grace: on a loaded machine
    // the sweep released them before the end state was reached.
    env.start(&["--leak-grace=10m", "--missing-pod-grace=10m"])
        .await;

    // The CNI's way: read, then JSON patch with a resourceVersion test, retried on conflict.
    let pools = env.pools();
    let ns = env.ns.clone();
    let allocator = tokio::spawn(async move {
        for i in 0..100u32 {
            loop {
                let pool = pools.get("198.18.0.0-16").await.unwrap();
                let rv = pool.metadata.resource_version.unwrap();
                let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "add", "path": format!("/spec/allocations/{}", 1000 + i),
                     "value": {"id": format!("new-{i}"), "podref": format!("{ns}/new-{i}")}},
                ]))
                .unwrap();
                match pools
                    .patch(
                        "198.18.0.0-16",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::<()>::Json(patch),
                    )
                    .await
                {
                    Ok(_) => break,
                    Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => continue,
                    Err(e) => panic!("allocator: {e}"),
                }
            }
        }
    });
    for n in &names {
        env.delete_pod(n).await;
    }
    allocator.await.unwrap();
    let want: Vec<String> = (1000..1100).map(|k: u32| k.to_string()).collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    let mut sorted = want.clone();
    sorted.sort();
    env.wait_keys("198.18.0.0-16", &sorted).await;
    env.stop().await;
}

#[tokio::test]
async fn a_release_that_keeps_failing_ends_in_a_warning_event_with_the_cause() {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let mut env = Env::new("ctl-fail").await;
    env.macvlan(&[(10, "sb-web", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;

    // A ServiceAccount that may read everything it watches and write Events, but not patch pools.
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let name = format!("{}-readonly", env.ns);
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        rules: Some(vec![
            rule(&[""], &["pods", "nodes"], &["get", "list", "watch"]),
            rule(
                &["whereabouts.cni.cncf.io"],
                &["ippools", "overlappingrangeipreservations"],
                &["get", "list", "watch"],
            ),
            rule(
                &["k8s.cni.cncf.io"],
                &["network-attachment-definitions"],
                &["get", "list", "watch"],
            ),
            rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
            rule(&["ipreclaim.io"], &["ipfences"], &["get", "list", "watch"]),
        ]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(env.client.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "ctl".into(),
            namespace: Some(env.ns.clone()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(env.client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let sa = ControlPlane::shared()
        .service_account_client(&env.client, &env.ns, "ctl")
        .await
        .expect("ServiceAccount client");
    env.start_as(sa, &["--max-retries=2"]).await;

    env.delete_pod("web-0").await;
    let failed = env.wait_events("IPAddressGarbageCollectionFailed").await;
    assert_eq!(failed[0].0, "web-0");
    assert!(
        failed[0].2.contains("forbidden"),
        "the cause is named: {failed:?}"
    );
    assert_eq!(
        env.keys("192.0.2.0-24").await,
        ["10"],
        "nothing was released"
    );
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    env.wait_metric(r#"ipreclaim_release_failures_total{cause="api"} 3"#)
        .await;
    env.wait_metric("ipreclaim_queue_retries_total 2").await;
    env.stop().await;
}

async fn dry_run_reports_and_writes_nothing(mut env: Env) {
    env.macvlan(&[(10, "sb-web", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.start(&["--dry-run", "--release-cooldown=30s"]).await;
    env.delete_pod("web-0").await;
    let events = env.wait_events("IPAddressGarbageCollectionDryRun").await;
    assert!(events[0].2.contains("PodDeleted"), "{events:?}");
    assert!(
        events[0]
            .2
            .contains("and keep it out of the pool for 30s (release cooldown)"),
        "the dry run says what the cooldown would do: {events:?}"
    );
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"], "nothing written");
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    // The allocation stays (nothing is written), and later sweeps see it as PodMissing: the
    // decision is still reported once.
    env.wait_sweeps(3.0).await;
    let text = env.metrics_text().await;
    assert_eq!(
        metric_sum(&text, "ipreclaim_dry_run_releases_total"),
        1.0,
        "one dry-run decision for one allocation:\n{text}"
    );
    env.stop().await;
}

/// A StatefulSet pod recreated and given its address back while the controller's pod watch
/// lags its pool watch (4 s here): the old pod's deletion arrives after the replacement's pool
/// entry (same podref and address, a new sandbox) and before the replacement itself. The
/// tombstone listed the address, but the entry is the replacement's: a fresh read finds the
/// replacement and the entry stays. Before, it was released: the patch tested the entry's id
/// and podref as the index had them, the replacement's.
#[tokio::test]
async fn a_replacement_given_the_address_back_while_the_pod_watch_lags_keeps_it() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-pods-lag").await;
    env.macvlan(&[(11, "sb-old", "db-0")]).await;
    env.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    let proxy = FaultProxy::start(env.client.clone(), 6).await.unwrap();
    let lag = Action::DelayEvents(std::time::Duration::from_secs(4));
    proxy.set_rules(vec![Rule::new(Some("watch"), Some("pods"), lag)]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &[]).await;

    // The kubelet's CNI DEL frees the old entry; the StatefulSet controller recreates the pod
    // (it takes a while: this pause stands for it, and the lagging watch keeps it between the
    // two events); whereabouts gives it the lowest free address, the same one.
    env.delete_pod("db-0").await;
    env.merge_pool(
        "192.0.2.0-24",
        serde_json::json!({"spec": {"allocations": {"11": null}}}),
    )
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    env.recreate("db-0", 11, "sb-new").await;

    let id_of_11 = || async {
        let pool = env.pools().get("192.0.2.0-24").await.unwrap();
        pool.spec.allocations.get("11").map(|a| a.id.clone())
    };
    // The deletion arrives 4 s late and is judged: the worker reads the pod (the only pod
    // read through the proxy), or, without that read, releases the entry.
    wait_for("the deletion judged", || async {
        proxy.requests().contains_key("get pods") || id_of_11().await.as_deref() != Some("sb-new")
    })
    .await;
    env.wait_sweeps(2.0).await;
    assert_eq!(
        id_of_11().await.as_deref(),
        Some("sb-new"),
        "the replacement's entry was released (pod reads: {:?})",
        proxy.requests().get("get pods")
    );
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    env.stop().await;
    // The manual commands of other tests read every namespace's pods listing 192.0.2.x.
    env.delete_pod("db-0").await;
}

/// The API object of a static pod is a mirror (`kubernetes.io/config.mirror`): deleting it
/// stops nothing, and the kubelet recreates it a moment later, without network-status. The
/// deletion path never releases on it (the static pod's node's CNI DEL and the sweep, with its
/// grace, remain); a plain pod deleted after it is released as usual. (Before, the mirror's
/// address was released at once under the running static pod.)
#[tokio::test]
async fn a_mirror_pods_deletion_frees_nothing_while_a_plain_pods_does() {
    let mut env = Env::new("ctl-mirror").await;
    // The API admits a mirror pod only bound to a node (a Ready one: nothing is fenced).
    let node = env.fence_node("True").await;
    env.macvlan(&[(10, "sb-static", "etcd-node-a"), (11, "sb-gone", "gone-0")])
        .await;
    let mirror = |ips: Option<&[&str]>| {
        let mut pod = env.pod_object("etcd-node-a", "macvlan", ips, Some(&node), 30);
        pod.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(MIRROR.into(), "a3c9".into());
        pod
    };
    let (static_pod, recreated) = (mirror(Some(&["192.0.2.10"])), mirror(None));
    testenv::fixtures::create(&env.pods(), &static_pod).await;
    let gone = env.pod("gone-0", "macvlan", Some(&["192.0.2.11"])).await;
    // The sweep's grace keeps the recreated mirror's entry out of this test: only the deletion
    // path is judged.
    env.start(&["--leak-grace=10m"]).await;
    env.delete_pod("etcd-node-a").await;
    testenv::fixtures::create(&env.pods(), &recreated).await;
    env.delete_pod("gone-0").await;
    env.wait_one_event("IPAddressGarbageCollected", "gone-0", &gone)
        .await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    env.wait_sweeps(2.0).await;
    assert_eq!(
        env.keys("192.0.2.0-24").await,
        ["10"],
        "the static pod's entry"
    );
    assert_eq!(
        env.events("IPAddressGarbageCollected").await.len(),
        1,
        "only gone-0's"
    );
    env.finish(&node).await;
}

const MIRROR: &str = "kubernetes.io/config.mirror";
