//! Fences: a pod deleted from a node that is not Ready, or deleted Running before its
//! kubelet stopped it, keeps its address until the node settles, is deleted, is tainted out-of-service, its node agent reports the sandboxes gone,
//! or the fence times out; a fence the apiserver refuses holds; a replacement known first does
//! not unfence.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use testenv::ControlPlane;
use testenv::faultproxy::{Action, FaultProxy, Rule};
use testenv::poll::{metric_value, wait_for, wait_for_within};

use crate::harness::{Env, FENCED, PoolRefusal};

// The scenarios run twice, as admin and as the chart's ServiceAccount.
testenv::as_admin_and_as_the_chart!(Env {
    a_pod_deleted_from_an_unready_node_is_fenced_across_a_restart_until_the_node_settles: "ctl-fence",
});

async fn a_pod_deleted_from_an_unready_node_is_fenced_across_a_restart_until_the_node_settles(
    mut env: Env,
) {
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &["--fence-settle=2s"]).await;
    env.assert_web_0_fenced(&node).await;
    env.wait_metric("ipreclaim_fenced_addresses 1").await;
    env.wait_metric("ipreclaim_fences_total 1").await;
    let rows = ipreclaim::scan::scan(env.client.clone(), &env.ns, Default::default())
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (row, fence) = (&rows[0], rows[0].fence.as_ref().expect("a fenced row"));
    assert_eq!(
        (row.ip.as_str(), row.podref.as_str(), row.decision.as_str()),
        ("192.0.2.10", format!("{}/web-0", env.ns).as_str(), "fenced")
    );
    assert_eq!(fence.node, node);
    assert!(
        ipreclaim::scan::table(&rows).contains(&format!("{node} for ")),
        "{}",
        ipreclaim::scan::table(&rows)
    );

    // A restart while fenced: the fence is read back from the pool, nothing is released.
    env.stop().await;
    env.start(&["--fence-settle=2s"]).await;
    env.wait_metric("ipreclaim_fenced_addresses 1").await;
    env.wait_sweeps(2.0).await;
    env.assert_web_0_fenced(&node).await;

    env.set_ready(&node, "True").await;
    env.wait_web_0_released(&uid).await;
    env.wait_metric("ipreclaim_fenced_addresses 0").await;
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodDeleted"} 1"#)
        .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["11"], "db-0 untouched");
    env.finish(&node).await;
}

/// A node whose clock lags an hour comes back: its Ready transition reads an hour ago, yet the
/// fence holds for the whole settle on the controller's own clock (it lifted at once before).
#[tokio::test]
async fn a_node_back_with_a_lagging_clock_still_waits_the_settle() {
    let (mut env, node, uid) =
        Env::with_web_0_seen_fenced("ctl-fence-lag", &["--fence-settle=5s"]).await;
    // The node stays down longer than the settle: a settle counted from the fence (or from the
    // node's lagging transition time) would be over the moment it is back.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    env.assert_web_0_fenced(&node).await;
    let hour_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1);
    // The controller sees the node Ready after this, so the settle ends 5 s after it at the
    // earliest. (Not `ipreclaim_unready_nodes`: it counts other tests' stand-in Nodes too.)
    let set_ready = std::time::Instant::now();
    env.set_ready_at(&node, "True", hour_ago).await;
    // Fences are checked every second: three passes with the node Ready, still fenced.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    env.assert_web_0_fenced(&node).await;
    env.wait_web_0_released(&uid).await;
    assert!(
        set_ready.elapsed() >= std::time::Duration::from_secs(5),
        "released {:?} after the node was set Ready, settle 5s",
        set_ready.elapsed()
    );
    env.finish(&node).await;
}

#[tokio::test]
async fn a_fence_lifts_at_once_when_its_node_is_deleted() {
    let (mut env, node, uid) = Env::with_web_0_seen_fenced("ctl-fence-gone", &[]).await;
    env.delete_node(&node).await;
    env.wait_web_0_released(&uid).await;
    env.stop().await;
}

/// Non-graceful node shutdown: the operator taints the node `node.kubernetes.io/out-of-service`
/// (it is powered off). Its fences lift at once, with the usual release Event, while the node
/// is still NotReady and the settle (default 30 s) has not begun; a pod deleted from it later
/// is released, not fenced.
#[tokio::test]
async fn a_node_tainted_out_of_service_lifts_its_fences_at_once() {
    let (mut env, node, uid) = Env::with_web_0_seen_fenced("ctl-fence-oos", &[]).await;
    let taint = serde_json::json!({"spec": {"taints": [{
        "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute",
    }]}});
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(env.client.clone());
    testenv::fixtures::merge(&nodes, &node, taint).await;
    env.wait_web_0_released(&uid).await;
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert_eq!(env.events(FENCED).await.len(), 1, "db-0 was not fenced");
    env.finish(&node).await;
}

#[tokio::test]
async fn a_fence_timeout_releases_with_the_node_still_down() {
    let (mut env, node, uid) =
        Env::with_web_0_seen_fenced("ctl-fence-timeout", &["--fence-timeout=5s"]).await;
    env.wait_web_0_released(&uid).await;
    env.finish(&node).await;
}

/// `--fence-timeout` counts on the apiserver's clock (the `Date` of its answer to
/// `GET /version`), never on the controller's own. While the controller cannot read it (the
/// fault proxy answers `/version` 503), web-0's fence does not time out, however long. Then the
/// proxy answers with the apiserver's `Date` shifted an hour back: to this controller, its own
/// clock runs an hour ahead of the apiserver's, the case the rule is for (one process's clock
/// cannot be set ahead on this machine). By the apiserver's clock the fence is seconds old, so
/// the pass that first has the reading keeps it, though the 1 s timeout has long passed by the
/// controller's own clock. Before, the timeout counted on the controller's clock and web-0 was
/// released after 1 s. (That a reading in step with the fence lets it time out is
/// `a_fence_timeout_releases_with_the_node_still_down`.)
#[tokio::test]
async fn a_fence_timeout_counts_on_the_apiservers_clock_and_waits_for_it() {
    let mut env = Env::new("ctl-fence-server-clock").await;
    let (node, uid) = web_0_and_db_0_on_a_node(&env, "Unknown").await;
    let proxy = FaultProxy::start(env.client.clone(), 5).await.unwrap();
    // `/version` is the only request of the controller with no resource.
    let version = |action| vec![Rule::new(Some("list"), Some(""), action)];
    proxy.set_rules(version(Action::Status(503)));
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &["--fence-timeout=1s"]).await;
    env.delete_pod("web-0").await;
    env.wait_one_event(FENCED, "web-0", &uid).await;
    // Refused readings are 5 s apart: by the third, the 1 s timeout has long passed.
    wait_for(
        "three refused readings of the apiserver's clock",
        || async { proxy.injected().get("503 list ").copied().unwrap_or(0) >= 3 },
    )
    .await;
    env.wait_metric("ipreclaim_fence_timeouts_waiting_for_clock 1")
        .await;
    env.assert_web_0_fenced(&node).await;

    let hour_back = jiff::SignedDuration::from_secs(-3600);
    proxy.set_rules(version(Action::ShiftDate(hour_back)));
    // Set at the end of the first pass that has the reading (after its lifts are written).
    env.wait_metric("ipreclaim_fence_timeouts_waiting_for_clock 0")
        .await;
    assert_eq!(
        proxy.injected().get("shift-date list ").copied(),
        Some(1),
        "one reading, an hour back"
    );
    env.assert_web_0_fenced(&node).await;
    env.finish(&node).await;
}

/// The node agent's evidence lifts a fence at once though the settle is an hour and the node
/// is still down, with a release Event that says why; evidence naming another node, another
/// pod or another fence object (an earlier fence of the same address: stale), or malformed,
/// is counted and never lifts. Each rejection is awaited on its metric, so the fence held
/// through a pass that saw it.
#[tokio::test]
async fn a_fence_lifts_at_once_on_its_node_agents_evidence_and_never_on_wrong_or_stale_evidence() {
    let (mut env, node, uid) =
        Env::with_web_0_fenced("ctl-fence-evidence", &["--fence-settle=1h"]).await;
    env.assert_web_0_fenced_alone(&node).await;
    let name = ipreclaim::ipam::fence::fence_object_name("192.0.2.0-24", "10");
    let fence = Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &env.ns)
        .get(&name)
        .await
        .unwrap();
    let fence_uid = fence.metadata.uid.clone().unwrap();
    assert_eq!(
        fence
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ipreclaim::ipam::fence::NODE_LABEL)),
        Some(&node),
        "the agent finds its node's fences by label"
    );
    let good = serde_json::json!({
        "node": node, "podUid": uid, "fenceUid": fence_uid, "observedAt": jiff::Timestamp::now().to_string(),
    });
    let with = |field: &str, value: &str| {
        let mut v = good.clone();
        v[field] = value.into();
        v
    };
    for (report, reason) in [
        (with("node", "another-node"), "wrong_node"),
        (with("podUid", "another-pod"), "wrong_pod"),
        (with("fenceUid", "an-earlier-fence"), "other_fence"),
        (with("observedAt", "yesterday"), "malformed"),
    ] {
        env.report_gone(&name, report).await;
        env.wait_metric(&format!(
            r#"ipreclaim_fence_evidence_rejected_total{{reason="{reason}"}} 1"#
        ))
        .await;
        env.assert_web_0_fenced(&node).await;
    }
    let reported = std::time::Instant::now();
    env.report_gone(&name, good).await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    wait_for("web-0's entry and fence record gone", || async {
        env.entry_and_fence("192.0.2.0-24", "10").await == (None, None)
    })
    .await;
    let released = env
        .wait_one_event("IPAddressGarbageCollected", "web-0", &uid)
        .await;
    assert!(
        released.starts_with(&format!(
            "successful cleanup of IP address [192.0.2.10] from network {}/macvlan (fence lifted: the node agent on its node saw the pod's sandboxes gone)",
            env.ns
        )),
        "{released}"
    );
    wait_for("web-0's reservation deleted", || async {
        !env.reservation_names()
            .await
            .contains(&"192.0.2.10".to_string())
    })
    .await;
    println!(
        "lifted {:?} after the report (settle 1h)",
        reported.elapsed()
    );
    env.finish(&node).await;
}

#[tokio::test]
async fn with_fencing_off_a_pod_of_an_unready_node_is_released_at_once_and_old_fences_lift() {
    let (mut env, node, uid) = Env::with_web_0_seen_fenced("ctl-fence-off", &[]).await;
    env.stop().await;
    // Restarted with fencing off: the fence an earlier run set is released.
    env.start(&["--fence-unready-nodes=false"]).await;
    env.wait_web_0_released(&uid).await;
    // And a new deletion on the still unready node is released at once, unfenced.
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert_eq!(
        env.events(FENCED).await.len(),
        1,
        "only web-0's, from the first run"
    );
    env.finish(&node).await;
}

/// A pod its kubelet stopped (phase Failed, then deleted, as kubelets do) on a Ready node is
/// released at once, unfenced.
#[tokio::test]
async fn a_pod_deleted_from_a_ready_node_is_released_unfenced() {
    let mut env = Env::new("ctl-fence-ready").await;
    let node = env.fence_node("True").await;
    env.macvlan(&[(10, "sb-web-0", "web-0")]).await;
    env.pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node))
        .await;
    env.start(&[]).await;
    env.delete_stopped_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.wait_events("IPAddressGarbageCollected").await;
    assert!(env.events(FENCED).await.is_empty());
    env.finish(&node).await;
}

/// web-0 (grace 600 s) is force-deleted Running on a Ready node: its kubelet only starts
/// stopping it then, and may run it for 600 s, so its address is fenced. db-0, deleted by its
/// kubelet once stopped (Failed first), is released meanwhile; web-0's fence outlasts sweeps
/// past the 1 s settle and lifts on its node agent's word. web-1 (grace 2 s) lifts on its own,
/// no earlier than the grace after the fence. (Before, web-0's address was released as its
/// deletion was seen, with its container still running.)
#[tokio::test]
async fn a_pod_force_deleted_on_a_ready_node_keeps_its_address_while_its_kubelet_stops_it() {
    let mut env = Env::new("ctl-fence-forced").await;
    let node = env.fence_node("True").await;
    env.macvlan(&[
        (10, "sb-web-0", "web-0"),
        (11, "sb-db-0", "db-0"),
        (12, "sb-web-1", "web-1"),
    ])
    .await;
    env.reservation("192.0.2.10", "web-0").await;
    let web_0 = env.pod_object("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node), 600);
    let uid = testenv::fixtures::create(&env.pods(), &web_0).await;
    env.pod_on("db-0", "macvlan", Some(&["192.0.2.11"]), Some(&node))
        .await;
    let web_1 = env.pod_object("web-1", "macvlan", Some(&["192.0.2.12"]), Some(&node), 2);
    testenv::fixtures::create(&env.pods(), &web_1).await;
    env.set_phase("web-0", "Running").await;
    env.start(&["--fence-settle=1s"]).await;
    env.delete_pod("web-0").await;
    let message = env.wait_one_event(FENCED, "web-0", &uid).await;
    assert!(
        message.contains(&format!(
            "the pod on node {node} was deleted before its kubelet had stopped it"
        )) && message.contains("grace period of 600s"),
        "{message}"
    );
    env.delete_stopped_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &["10", "12"]).await;
    env.wait_sweeps(3.0).await;
    env.assert_web_0_fenced_alone(&node).await;
    assert_eq!(env.reservation_names().await, ["192.0.2.10"]);
    env.wait_released_once(&["db-0"]).await;

    let (name, report) = env.agent_report("192.0.2.0-24", "10", &node, &uid).await;
    env.report_gone(&name, report).await;
    env.wait_keys("192.0.2.0-24", &["12"]).await;
    let released = testenv::poll::wait_seen(
        "web-0's release Event",
        || env.events("IPAddressGarbageCollected"),
        |events| events.iter().any(|e| e.0 == "web-0"),
        |events| format!("{events:?}"),
    )
    .await;
    let web_0 = released.iter().find(|e| e.0 == "web-0").unwrap();
    assert!(
        web_0.2.contains("saw the pod's sandboxes gone"),
        "{web_0:?}"
    );

    // A short grace: lifted by time alone, not before the grace has passed since the fence.
    let fenced_at = std::time::Instant::now();
    env.delete_pod("web-1").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    let held = fenced_at.elapsed();
    assert!(
        held >= Duration::from_secs(2),
        "web-1 released after {held:?}"
    );
    // Events follow their writes through their own queue.
    wait_for("web-0's and web-1's fence Events", || async {
        env.events(FENCED).await.len() >= 2
    })
    .await;
    assert_eq!(env.events(FENCED).await.len(), 2, "web-0 and web-1 fenced");
    env.finish(&node).await;
}

/// web-0 (192.0.2.10, with its reservation) and db-0 (192.0.2.11) on a new Ready node: the
/// node and web-0's uid.
async fn web_0_and_db_0_on_a_ready_node(env: &Env) -> (String, String) {
    web_0_and_db_0_on_a_node(env, "True").await
}

/// web-0 and db-0 (see [`web_0_and_db_0_on_a_ready_node`]) on a node whose Ready is `ready`.
async fn web_0_and_db_0_on_a_node(env: &Env, ready: &str) -> (String, String) {
    let node = env.fence_node(ready).await;
    env.macvlan(&[(10, "sb-web-0", "web-0"), (11, "sb-db-0", "db-0")])
        .await;
    env.reservation("192.0.2.10", "web-0").await;
    let uid = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node))
        .await;
    env.pod_on("db-0", "macvlan", Some(&["192.0.2.11"]), Some(&node))
        .await;
    (node, uid)
}

/// The node goes down while the controller runs and the pod is deleted as soon as the controller
/// has seen it: the pod's node is known from the pod watch, so nothing has to be listed first.
/// (Before, the pods of a node were listed only once it went down, and a pod deleted before that
/// list was released unfenced.)
#[tokio::test]
async fn a_pod_deleted_right_after_its_node_goes_down_is_fenced() {
    let mut env = Env::new("ctl-fence-now").await;
    let (node, uid) = web_0_and_db_0_on_a_ready_node(&env).await;
    env.start(&[]).await;
    env.wait_metric("ipreclaim_unready_nodes 0").await;
    env.set_ready(&node, "Unknown").await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;
    env.delete_pod("web-0").await;
    env.wait_one_event(FENCED, "web-0", &uid).await;
    env.assert_web_0_fenced(&node).await;
    env.finish(&node).await;
}

/// web-0 fenced on a node that is not Ready (see [`Env::fenced_web_0`]), the controller
/// running with `flags` through a fault proxy to `cp`: the node, the proxy and web-0's uid.
async fn web_0_fenced_through_a_proxy(
    env: &mut Env,
    cp: &ControlPlane,
    flags: &[&str],
) -> (String, FaultProxy, String) {
    let node = env.fence_node("Unknown").await;
    let proxy = FaultProxy::start(env.client.clone(), 8).await.unwrap();
    env.through = Some(cp.client_through_faults(&proxy).await);
    let uid = env.fenced_web_0(&node, flags).await;
    (node, proxy, uid)
}

/// [`web_0_fenced_through_a_proxy`] (settle 1 s, the shared control plane), then the
/// controller's fence watch silenced: dead without a word.
async fn web_0_fenced_and_its_fence_watch_silenced(env: &mut Env) -> (String, FaultProxy, String) {
    let shared = ControlPlane::shared();
    let (node, proxy, uid) =
        web_0_fenced_through_a_proxy(env, shared, &["--fence-settle=1s"]).await;
    env.assert_web_0_fenced(&node).await;
    proxy.silence_watches(Some("ipfences"));
    wait_for("the fence watch silenced", || async {
        proxy.silenced() >= 1
    })
    .await;
    (node, proxy, uid)
}

/// `node` goes Unknown and comes back Ready, its Ready condition stamped by a clock 2 and 4 s
/// ahead: transition times are whole seconds, so the spell ends in a later one than any stamp
/// before it.
async fn not_ready_spell(env: &Env, node: &str) {
    let now = jiff::Timestamp::now();
    env.set_ready_at(node, "Unknown", now + jiff::SignedDuration::from_secs(2))
        .await;
    env.set_ready_at(node, "True", now + jiff::SignedDuration::from_secs(4))
        .await;
}

/// Starts the controller through a fault proxy that applies `action` to its `verb` requests
/// on Nodes.
async fn start_with_faulty_nodes(
    env: &mut Env,
    verb: &'static str,
    action: Action,
    flags: &[&str],
) -> FaultProxy {
    let proxy = FaultProxy::start(env.client.clone(), 5).await.unwrap();
    proxy.set_rules(vec![Rule::new(Some(verb), Some("nodes"), action)]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, flags).await;
    proxy
}

/// The Node watch lags the pod watch (a fault proxy delivers the controller's Node watch
/// events 8 s late): the pod's Delete event comes while the cache still says its node is Ready.
/// The deletion path reads the node fresh before it releases, finds it not Ready and fences.
/// (Before, web-0 was released unfenced: seen in a CI run on a loaded machine.)
#[tokio::test]
async fn a_deletion_seen_before_its_nodes_not_ready_update_is_still_fenced() {
    let mut env = Env::new("ctl-fence-lagging-nodes").await;
    let (node, uid) = web_0_and_db_0_on_a_ready_node(&env).await;
    let delayed = Action::DelayEvents(Duration::from_secs(8));
    let proxy = start_with_faulty_nodes(&mut env, "watch", delayed, &[]).await;
    env.set_ready(&node, "Unknown").await;
    env.delete_pod("web-0").await;
    env.wait_one_event(FENCED, "web-0", &uid).await;
    assert!(
        env.events("IPAddressGarbageCollected").await.is_empty(),
        "released unfenced"
    );
    assert!(
        proxy.injected().values().sum::<u64>() > 0,
        "the Node watch was delayed: {:?}",
        proxy.injected()
    );
    env.assert_web_0_fenced(&node).await;
    env.finish(&node).await;
}

/// The Node watch misses a whole NotReady spell (a fault proxy holds its events): the cache
/// still has the node Ready since before. A pod stopped and deleted right after the node is
/// Ready again is read fresh: its Ready condition has a newer transition time than the cache's,
/// so the node went down and came back meanwhile, and its kubelet may still be stopping pods
/// deleted while it was away. It is fenced as settling, then lifts once settled. (Before, the
/// fresh read's Ready released it at once.)
#[tokio::test]
async fn a_not_ready_spell_the_node_watch_missed_still_fences_a_deletion_right_after_it() {
    let mut env = Env::new("ctl-fence-missed-spell").await;
    let (node, uid) = web_0_and_db_0_on_a_ready_node(&env).await;
    let held = Action::DelayEvents(Duration::from_secs(300));
    let proxy = start_with_faulty_nodes(&mut env, "watch", held, &["--fence-settle=6s"]).await;
    not_ready_spell(&env, &node).await;
    env.delete_stopped_pod("web-0").await;
    let message = env.wait_one_event(FENCED, "web-0", &uid).await;
    assert!(message.contains("settling"), "{message}");
    assert!(
        proxy.injected().values().sum::<u64>() > 0,
        "the Node watch's events were held: {:?}",
        proxy.injected()
    );
    env.assert_web_0_fenced(&node).await;
    env.wait_web_0_released(&uid).await;
    env.finish(&node).await;
}

/// A deletion whose node cannot be read fresh is never released on the Node cache's word: the
/// address stays, also through the sweeps, a Warning names the failed read, and once reads
/// work again it is released. (Before, the item was given up after its retries and the sweep
/// released the address as `PodMissing`, the node never read.)
#[tokio::test]
async fn a_deletion_whose_node_cannot_be_read_keeps_its_address_until_it_can() {
    let mut env = Env::new("ctl-node-unread").await;
    let (_node, uid) = web_0_and_db_0_on_a_ready_node(&env).await;
    // 500, not 503: the client retries a 503 itself.
    let refused = Action::Status(500);
    let proxy = start_with_faulty_nodes(&mut env, "get", refused, &["--max-retries=2"]).await;
    env.delete_stopped_pod("web-0").await;
    env.wait_events_saying(
        "IPAddressGarbageCollectionFailed",
        &["reading node", "nothing is released"],
    )
    .await;
    env.wait_sweeps(5.0).await;
    assert_eq!(
        env.keys("192.0.2.0-24").await,
        ["10", "11"],
        "kept while its node cannot be read"
    );
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    proxy.clear();
    env.wait_one_event("IPAddressGarbageCollected", "web-0", &uid)
        .await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    env.stop().await;
}

/// Refuses any pool write marking entry `key` fenced (see [`PoolRefusal`]), once in force.
async fn refuse_fencing_entry(env: &Env, pool: &str, key: &str) -> PoolRefusal {
    let expression = format!(
        "!('{key}' in object.spec.allocations) || !object.spec.allocations['{key}'].podref.endsWith(':fenced')"
    );
    let refusal = PoolRefusal::new(env, "refuse-fence", &expression).await;
    let patch = serde_json::json!([
        {"op": "replace", "path": format!("/spec/allocations/{key}/podref"), "value": "x/y:fenced"},
    ]);
    PoolRefusal::wait_in_force(env, pool, patch, true).await;
    refusal
}

/// A fence the apiserver refuses holds: the entry stays allocated, the failure is retried and
/// reported on the deleted pod, and the sweep never releases it; db-0 and x-0, deleted from a
/// Ready node in the same pool meanwhile (in the same patch when the writer batches them), are
/// released at once. Before, a refused patch failed its whole batch and, after the retries,
/// the sweep released web-0 with its node still down. The node comes back before the refusal
/// ends: the fence is still written (the deletion was seen while the node was down) and lifts
/// after the settle.
#[tokio::test]
async fn a_fence_the_apiserver_refuses_holds_and_the_rest_of_the_pool_is_released() {
    let mut env = Env::new("ctl-fence-refused").await;
    let down = env.fence_node("Unknown").await;
    env.macvlan(&[
        (10, "sb-web-0", "web-0"),
        (11, "sb-db-0", "db-0"),
        (12, "sb-x-0", "x-0"),
    ])
    .await;
    let refusal = refuse_fencing_entry(&env, "192.0.2.0-24", "10").await;
    let web = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&down))
        .await;
    let db = env.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    let x = env.pod("x-0", "macvlan", Some(&["192.0.2.12"])).await;
    env.start(&["--max-retries=1", "--fence-settle=5s"]).await;
    // x-0's patch goes at once; web-0's and db-0's, within the pool's spacing, go together.
    env.delete_pod("x-0").await;
    env.delete_pod("web-0").await;
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    let failed = env.wait_events("IPAddressGarbageCollectionFailed").await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].1, web, "on the deleted web-0: {failed:?}");
    assert!(failed[0].2.contains("fence not written"), "{}", failed[0].2);
    env.wait_metric("ipreclaim_fence_write_failures_total 3")
        .await;
    env.wait_sweeps(5.0).await;
    let entries = env
        .pools()
        .get("192.0.2.0-24")
        .await
        .unwrap()
        .spec
        .allocations;
    assert_eq!(
        entries.get("10").map(|a| a.podref.as_str()),
        Some(format!("{}/web-0", env.ns).as_str()),
        "web-0's entry kept while its fence cannot be written"
    );
    let mut released: Vec<String> = env
        .events("IPAddressGarbageCollected")
        .await
        .into_iter()
        .map(|e| e.1)
        .collect();
    released.sort();
    let mut want = vec![db, x];
    want.sort();
    assert_eq!(released, want, "only db-0 and x-0 released");
    assert!(
        metric_value(
            &env.metrics_text().await,
            r#"ipreclaim_release_failures_total{cause="refused"}"#
        ) >= 1.0,
        "the refusal is counted by its cause"
    );
    // The node is back before the refusal ends. The deletion was seen while it was down, so
    // the retried fence is still written, and it lifts only after the settle.
    env.set_ready(&down, "True").await;
    refusal.lift().await;
    testenv::poll::wait_for_within(
        "web-0's fence written once the refusal ended (retries are up to 30 s apart)",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            env.entry_and_fence("192.0.2.0-24", "10").await.0
                == Some(format!("{}/web-0:fenced", env.ns))
        },
    )
    .await;
    let fenced_at = std::time::Instant::now();
    let events = env.wait_events(FENCED).await;
    assert_eq!(events[0].1, web);
    env.assert_web_0_fenced_alone(&down).await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert!(
        fenced_at.elapsed() >= Duration::from_secs(4),
        "released {:?} after the fence was written, settle 5s",
        fenced_at.elapsed()
    );
    env.finish(&down).await;
}

/// The controller's watch resumes after an outage of the apiserver it watches through, during
/// which web-0 (on a node that is not Ready) was force-deleted and its replacement created
/// (no network-status yet): its watch sees the replacement and never web-0's Delete. The
/// replacement is in the cache before the deletion is judged, and the cache alone keeps the
/// entry (its allocation may race the annotation); the deleted pod's node still decides: fenced.
#[tokio::test]
async fn a_replacement_known_before_the_deletion_is_judged_still_gets_the_old_address_fenced() {
    let (cp, mut env) = Env::private("ctl-fence-replaced").await;
    let ns = env.ns.clone();
    let down = env.fence_node("Unknown").await;
    env.macvlan(&[(10, "sb-web-0", "web-0")]).await;
    let old = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&down))
        .await;
    env.start(&[]).await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;

    let (second, other) = cp.start_second_apiserver().await.expect("second apiserver");
    cp.stop_apiserver().expect("stop the first apiserver");
    let pods = Api::<Pod>::namespaced(other, &ns);
    pods.delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    pods.create(
        &PostParams::default(),
        &testenv::fixtures::pod("web-0", None),
    )
    .await
    .unwrap();
    cp.start_apiserver()
        .await
        .expect("restart the first apiserver");
    let events = env.wait_events(FENCED).await;
    assert_eq!(
        events.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(),
        [old.as_str()],
        "the deleted web-0's address is fenced"
    );
    let (podref, _) = env.entry_and_fence("192.0.2.0-24", "10").await;
    assert_eq!(podref, Some(format!("{ns}/web-0:fenced")));
    env.wait_sweeps(3.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"], "kept");
    env.stop().await;
    drop(second);
}

/// web-0 and db-0 are force-deleted from a node that is not Ready, and web-0 is recreated
/// elsewhere; whereabouts gives the replacement its name's entry back (same podref, the
/// replacement's sandbox) before Multus writes its network-status, and the controller's pod
/// watch lags its pool watch (4 s here): the deletion's snapshot of what web-0 held names the
/// replacement's sandbox, and the entry is fenced (which keeps it allocated). It is never freed
/// under the replacement: the node comes back and settles, db-0's fence lifts, and web-0's
/// stays, its lift refused on a fresh read of the pod that lists the address (the pod watch
/// still lags). Before, the lift removed the replacement's entry.
#[tokio::test]
async fn an_entry_given_back_to_the_replacement_before_the_deletion_is_seen_is_never_freed() {
    let mut env = Env::new("ctl-fence-given-back").await;
    let ns = env.ns.clone();
    let down = env.fence_node("Unknown").await;
    env.macvlan(&[(10, "sb-old", "web-0"), (11, "sb-db-0", "db-0")])
        .await;
    for (pod, ip) in [("web-0", "192.0.2.10"), ("db-0", "192.0.2.11")] {
        env.pod_on(pod, "macvlan", Some(&[ip]), Some(&down)).await;
    }
    let proxy = FaultProxy::start(env.client.clone(), 6).await.unwrap();
    let lag = Action::DelayEvents(Duration::from_secs(4));
    proxy.set_rules(vec![Rule::new(Some("watch"), Some("pods"), lag)]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &["--fence-settle=1s"]).await;
    // (Other tests' stand-in Nodes count too; a lagging Node watch is read past anyway.)
    wait_for("the controller seeing an unready node", || async {
        metric_value(&env.metrics_text().await, "ipreclaim_unready_nodes") >= 1.0
    })
    .await;

    env.delete_pod("web-0").await;
    env.delete_pod("db-0").await;
    let elsewhere = format!("{ns}-node-b");
    env.create_node(&elsewhere, "True").await;
    env.pod_on("web-0", "macvlan", None, Some(&elsewhere)).await;
    env.give_back("web-0", 10, "sb-new").await;
    let podref_of = |key: &'static str| {
        let env = &env;
        async move { env.entry_and_fence("192.0.2.0-24", key).await.0 }
    };
    wait_for("both entries fenced", || async {
        podref_of("10").await == Some(format!("{ns}/web-0:fenced"))
            && podref_of("11").await == Some(format!("{ns}/db-0:fenced"))
    })
    .await;

    // Multus lists the address on the replacement; the node comes back and settles.
    env.list_on("web-0", &["192.0.2.10"]).await;
    env.set_ready(&down, "True").await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    let pool = env.pools().get("192.0.2.0-24").await.unwrap();
    let id = pool.spec.allocations.get("10").map(|a| a.id.as_str());
    assert_eq!(id, Some("sb-new"), "the replacement's entry");
    let released = env.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(
        released.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
        ["db-0"],
        "{released:?}"
    );
    env.finish(&down).await;
    env.delete_node(&elsewhere).await;
    env.delete_pod("web-0").await;
}

/// A fence whose address the deleted pod's replacement lists (the entry was the replacement's
/// when it was fenced) is never lifted: a lift removes the entry, from under the replacement.
/// web-0 and db-0 are fenced on one node; web-0's replacement lists web-0's address; the node
/// comes back and settles: db-0's fence lifts (its address released) in the pass that keeps
/// web-0's. Before, both were lifted and web-0's address freed under the replacement.
#[tokio::test]
async fn a_fence_whose_address_the_replacement_lists_is_never_lifted() {
    let (mut env, node, _) =
        Env::with_web_0_seen_fenced("ctl-fence-listed", &["--fence-settle=1s"]).await;
    let ns = env.ns.clone();
    env.delete_pod("db-0").await;
    wait_for("db-0's entry fenced", || async {
        env.entry_and_fence("192.0.2.0-24", "11").await.0 == Some(format!("{ns}/db-0:fenced"))
    })
    .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.set_ready(&node, "True").await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    let (podref, fence) = env.entry_and_fence("192.0.2.0-24", "10").await;
    assert_eq!(podref, Some(format!("{ns}/web-0:fenced")), "still fenced");
    assert!(fence.is_some(), "its record kept");
    let released = env.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(
        released.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
        ["db-0"],
        "{released:?}"
    );
    env.wait_metric("ipreclaim_fenced_addresses 1").await;
    env.finish(&node).await;
    env.delete_pod("web-0").await;
}

/// The controller starts while its Node list is slow (4 s here): web-0 is deleted from a node
/// that is not Ready once the pod watch runs and before the Nodes are listed, and the node is
/// Ready again by the time they are. Its node's readiness at the deletion is unknown: fenced
/// (lifted after the settle), not released. Before, the empty Node view called the node
/// trusted for good, and the address was released at once.
#[tokio::test]
async fn a_deletion_seen_before_the_nodes_are_listed_is_fenced() {
    let mut env = Env::new("ctl-fence-unlisted").await;
    let node = env.fence_node("Unknown").await;
    env.macvlan(&[(10, "sb-web-0", "web-0")]).await;
    let uid = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node))
        .await;
    let proxy = FaultProxy::start(env.client.clone(), 6).await.unwrap();
    let slow = Action::Delay(Duration::from_secs(4));
    proxy.set_rules(vec![Rule::new(Some("list"), Some("nodes"), slow)]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    let other = Env::with(env.client.clone(), env.ns.clone());
    let meanwhile = async {
        wait_for("the controller's pod watch running", || async {
            proxy.requests().contains_key("watch pods")
        })
        .await;
        other.delete_pod("web-0").await;
        other.set_ready(&node, "True").await;
    };
    tokio::join!(env.start_as(through, &[]), meanwhile);
    let message = env.wait_one_event(FENCED, "web-0", &uid).await;
    assert!(message.contains("had not listed Nodes"), "{message}");
    env.wait_sweeps(3.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"], "kept");
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    env.finish(&node).await;
}

/// A returning kubelet stops a pod deleted while it was away with the pod's own grace period
/// (its cached spec; no grace override), and only then runs the CNI DEL: a database pod with a
/// long grace keeps running on its address meanwhile. So the fence waits for the grace period
/// plus the margin after the node is Ready, not only for the settle. (Before, it lifted the
/// settle (1 s) after Ready.)
#[tokio::test]
async fn a_fence_waits_the_deleted_pods_grace_period_after_its_node_is_ready_again() {
    let mut env = Env::new("ctl-fence-grace").await;
    let node = env.fence_node("Unknown").await;
    let flags = ["--fence-settle=1s", "--fence-grace-margin=2s"];
    let uid = env.fenced_web_0_with("192.0.2", &node, 20, &flags).await;
    env.assert_web_0_fenced(&node).await;
    let name = ipreclaim::ipam::fence::fence_object_name("192.0.2.0-24", "10");
    let fence = Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &env.ns)
        .get(&name)
        .await
        .unwrap();
    assert_eq!(
        fence.spec.grace_period_seconds,
        Some(20),
        "the fence keeps it"
    );
    let set_ready = std::time::Instant::now();
    env.set_ready(&node, "True").await;
    // Fences are checked every second: five passes past the settle, still fenced.
    tokio::time::sleep(Duration::from_secs(6)).await;
    env.assert_web_0_fenced(&node).await;
    env.wait_web_0_released(&uid).await;
    assert!(
        set_ready.elapsed() >= Duration::from_secs(22),
        "released {:?} after the node was set Ready; grace 20 s, margin 2 s",
        set_ready.elapsed()
    );
    env.finish(&node).await;
}

/// The node agent on a returning node still lists the deleted pod's sandbox (its kubelet is
/// stopping it) and says so: the fence holds past the settle until the agent reports the
/// sandboxes gone. (Before, the agent could only report "gone", and the fence lifted on the
/// settle while the sandbox ran.) `--fence-timeout` stays the operator's bound, whatever the
/// node does (`a_fence_timeout_releases_with_the_node_still_down`).
#[tokio::test]
async fn the_node_agents_still_present_report_holds_a_fence_past_the_settle() {
    let flags = ["--fence-settle=1s"];
    let (mut env, node, uid) = Env::with_web_0_seen_fenced("ctl-fence-present", &flags).await;
    let (name, report) = env.web_0_present_then_ready(&node, &uid).await;
    // A pass judged the settle over and held the fence on the agent's word.
    env.wait_metric("ipreclaim_fences_held_by_node_agent 1")
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    env.assert_web_0_fenced(&node).await;
    env.report_gone(&name, report).await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    let released = env
        .wait_one_event("IPAddressGarbageCollected", "web-0", &uid)
        .await;
    assert!(
        released.contains("the node agent on its node saw the pod's sandboxes gone"),
        "{released}"
    );
    env.wait_metric("ipreclaim_fences_held_by_node_agent 0")
        .await;
    env.finish(&node).await;
}

/// The controller's fence watch dies without a word (its connection lost, the apiserver's end
/// gone: a silenced stream), and the node agent's "still present" lands after that, so the
/// index never shows it. A lift on the settle reads the fence fresh first and holds. (Before,
/// the settle lifted it on the stale index while the kubelet was still stopping the pod; the
/// watch's idle check notices such a watch only a minute or more later.) The agent's "gone"
/// then lets it lift.
#[tokio::test]
async fn a_still_present_report_a_dead_fence_watch_missed_still_holds_the_settle() {
    let mut env = Env::new("ctl-fence-present-unseen").await;
    let (node, proxy, uid) = web_0_fenced_and_its_fence_watch_silenced(&mut env).await;
    let (name, report) = env.web_0_present_then_ready(&node, &uid).await;
    // Passes past the settle read the fence fresh, find the agent's word and keep it.
    let reads = || proxy.requests().get("get ipfences").copied().unwrap_or(0);
    wait_for("two lifts held on a fresh read of the fence", || async {
        reads() >= 2
    })
    .await;
    env.assert_web_0_fenced(&node).await;
    env.report_gone(&name, report).await;
    env.wait_web_0_released(&uid).await;
    env.finish(&node).await;
}

/// Six pods of one node are fenced, the controller's fence watch dies without a word, and the
/// node agent's "still present" for web-0 lands after that; the node comes back. Six fences
/// to read on one node are read with one list by the node's label: the five others lift, and
/// web-0's report, read from the list, holds its fence until the agent says "gone".
#[tokio::test]
async fn a_still_present_report_read_in_a_list_of_the_nodes_fences_holds_the_settle() {
    let mut env = Env::new("ctl-fence-present-listed").await;
    let node = env.fence_node("Unknown").await;
    let proxy = FaultProxy::start(env.client.clone(), 8).await.unwrap();
    env.through = Some(ControlPlane::shared().client_through_faults(&proxy).await);
    env.nad("macvlan", "192.0.2.0/24").await;
    let pods: Vec<(u32, String, String)> = (0..6)
        .map(|i| (10 + i, format!("sb-web-{i}"), format!("web-{i}")))
        .collect();
    env.pool("192.0.2.0-24", "192.0.2.0/24", &pods).await;
    let mut uids = Vec::new();
    for (offset, _, name) in &pods {
        let ip = format!("192.0.2.{offset}");
        env.reservation(&ip, name).await;
        uids.push(env.pod_on(name, "macvlan", Some(&[&ip]), Some(&node)).await);
    }
    env.start(&["--fence-settle=1s"]).await;
    for (_, _, name) in &pods {
        env.delete_pod(name).await;
    }
    let fences = Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &env.ns);
    wait_for("six fences, each with its record", || async {
        env.events(FENCED).await.len() == 6
            && fences.list(&Default::default()).await.unwrap().items.len() == 6
    })
    .await;
    proxy.silence_watches(Some("ipfences"));
    wait_for("the fence watch silenced", || async {
        proxy.silenced() >= 1
    })
    .await;
    let requests = |what: &str| proxy.requests().get(what).copied().unwrap_or(0);
    let listed_before = requests("list ipfences");
    let (name, report) = env.web_0_present_then_ready(&node, &uids[0]).await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    assert!(
        requests("list ipfences") > listed_before,
        "the node's fences listed"
    );
    assert_eq!(requests("get ipfences"), 0, "fences read one by one");
    let (podref, _) = env.entry_and_fence("192.0.2.0-24", "10").await;
    assert_eq!(podref, Some(format!("{}/web-0:fenced", env.ns)));
    env.report_gone(&name, report).await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.finish(&node).await;
}

/// web-0 is fenced while its node is down; the node comes back and the Node watch sees it, so
/// the settle (10 s) begins. The watch then lags (a fault proxy holds its events) while the
/// node goes down and comes back again. When the cached settle has passed, the lift reads the
/// node fresh: Ready, but its Ready condition has a newer transition time, so the settle starts
/// again from that read and the lift waits for it. (Before, the fresh read's Ready lifted it
/// then, moments after the kubelet came back the second time.)
#[tokio::test]
async fn a_second_not_ready_spell_the_node_watch_missed_restarts_a_fences_settle() {
    let (cp, mut env) = Env::private("ctl-fence-second-spell").await;
    let (node, proxy, uid) =
        web_0_fenced_through_a_proxy(&mut env, &cp, &["--fence-settle=10s"]).await;
    env.set_ready(&node, "True").await;
    env.wait_metric("ipreclaim_unready_nodes 0").await;
    // The Node watch is made again through a rule holding its events.
    let held = Action::DelayEvents(Duration::from_secs(300));
    proxy.set_rules(vec![Rule::new(Some("watch"), Some("nodes"), held)]);
    let watches = || proxy.requests().get("watch nodes").copied().unwrap_or(0);
    let before = watches();
    proxy.cut_watches();
    wait_for("the Node watch made again", || async { watches() > before }).await;
    not_ready_spell(&env, &node).await;
    let back = std::time::Instant::now();
    env.wait_web_0_released(&uid).await;
    // The first settle ends less than 10 s after `back`; the one from the lift's read, 10 s
    // after that read.
    let after = back.elapsed();
    assert!(
        after >= Duration::from_secs(15),
        "lifted {after:?} after the node came back the second time"
    );
    env.finish(&node).await;
}

/// The controller's fence watch dies without a word, and someone deletes web-0's IPFence by
/// hand meanwhile; the node comes back. A lift on the settle reads the fence fresh first and
/// finds it gone: the lift waits for the fence watch (this controller removes a fenced entry
/// before its record, so the record went by another hand), whose re-list then leaves the marked
/// entry alone, as a record deleted by hand is. (Before, the settle lifted it: no agent report
/// can be on a deleted fence.)
#[tokio::test]
async fn a_fence_deleted_by_hand_while_the_fence_watch_is_dead_does_not_lift_on_the_settle() {
    let mut env = Env::new("ctl-fence-deleted-unseen").await;
    let (node, proxy, _) = web_0_fenced_and_its_fence_watch_silenced(&mut env).await;
    let name = ipreclaim::ipam::fence::fence_object_name("192.0.2.0-24", "10");
    Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &env.ns)
        .delete(&name, &Default::default())
        .await
        .unwrap();
    env.set_ready(&node, "True").await;
    // Passes past the settle read the node and the fence fresh, find the fence gone and wait;
    // the fence is not read again.
    let reads = |what: &str| proxy.requests().get(what).copied().unwrap_or(0);
    wait_for("three lifts waiting on a fresh read", || async {
        reads("get ipfences") >= 1 && reads("get nodes") >= 3
    })
    .await;
    assert_eq!(
        reads("get ipfences"),
        1,
        "a fence found deleted is read again"
    );
    let marked = Some(format!("{}/web-0:fenced", env.ns));
    assert_eq!(
        env.entry_and_fence("192.0.2.0-24", "10").await,
        (marked.clone(), None)
    );
    assert!(
        env.events("IPAddressGarbageCollected").await.is_empty(),
        "lifted on the settle"
    );
    // The fence watch is made again (every 60 s): the entry without its record is reported
    // and left alone.
    let report = "the marked entry reported without its record";
    wait_for_within(
        report,
        Duration::from_secs(90),
        Duration::from_secs(1),
        || async {
            crate::harness::warnings(&env, "UnreadablePoolEntries")
                .await
                .iter()
                .any(|(o, m, _)| o == "192.0.2.0-24" && m.contains("has no fence record"))
        },
    )
    .await;
    assert_eq!(
        env.entry_and_fence("192.0.2.0-24", "10").await,
        (marked, None)
    );
    env.finish(&node).await;
}

/// A node that was NotReady is Ready again, and a pod deletion is seen moments later (a watch
/// re-list after a gap finds deletions made while the node was away): its kubelet may still be
/// stopping that pod, so the deletion is fenced as one from a node that is not Ready, and
/// lifts once the node has settled. (Before, it was released at once.) A private control plane,
/// so that `ipreclaim_unready_nodes` counts this test's node alone.
#[tokio::test]
async fn a_deletion_seen_while_its_node_is_settling_after_ready_is_fenced() {
    let (_cp, mut env) = Env::private("ctl-fence-settling").await;
    let (node, uid) = web_0_and_db_0_on_a_node(&env, "Unknown").await;
    env.start(&["--fence-settle=8s"]).await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;
    env.set_ready(&node, "True").await;
    env.wait_metric("ipreclaim_unready_nodes 0").await;
    env.delete_pod("web-0").await;
    let message = env.wait_one_event(FENCED, "web-0", &uid).await;
    assert!(message.contains("settling"), "{message}");
    env.assert_web_0_fenced(&node).await;
    env.wait_web_0_released(&uid).await;
    // Settled since: a pod its kubelet stopped is released unfenced.
    env.delete_stopped_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert_eq!(env.events(FENCED).await.len(), 1, "db-0 was not fenced");
    env.finish(&node).await;
}

/// The Node watch lags 8 s (a fault proxy): the node comes back Ready, and goes down again
/// before the cache has seen that; the settle (6 s) passes on the cache's stale Ready. A lift
/// on the Node cache's word reads the node fresh first, finds it not Ready and keeps the
/// fence. (Before, web-0 was released on the stale Ready while its node was down again.) A
/// private control plane, so that `ipreclaim_unready_nodes` counts this test's node alone.
#[tokio::test]
async fn a_fence_never_lifts_on_a_lagging_node_cache_that_missed_the_node_going_down_again() {
    let (cp, mut env) = Env::private("ctl-fence-stale-ready").await;
    let (node, uid) = web_0_and_db_0_on_a_node(&env, "Unknown").await;
    let proxy = FaultProxy::start(env.client.clone(), 5).await.unwrap();
    let lag = Action::DelayEvents(Duration::from_secs(8));
    proxy.set_rules(vec![Rule::new(Some("watch"), Some("nodes"), lag)]);
    let through = cp.client_through_faults(&proxy).await;
    env.start_as(through, &["--fence-settle=6s"]).await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;
    env.delete_pod("web-0").await;
    env.wait_one_event(FENCED, "web-0", &uid).await;
    env.set_ready(&node, "True").await;
    // The cache saw it Ready (8 s late); down again at once, which it sees 8 s later, after
    // the settle would have passed.
    env.wait_metric("ipreclaim_unready_nodes 0").await;
    env.set_ready(&node, "Unknown").await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;
    env.assert_web_0_fenced(&node).await;
    assert!(
        proxy.injected().values().sum::<u64>() > 0,
        "the Node watch lagged"
    );
    // Back for good: lifted once settled.
    env.set_ready(&node, "True").await;
    env.wait_web_0_released(&uid).await;
    env.finish(&node).await;
}

/// A tenant's pod with a termination grace of i64::MAX seconds (the API takes it), deleted
/// from a node seen Ready again moments ago: the window after Ready again must not overflow
/// the clock. (It panicked the pod watch with the index lock held: no deletion was handled
/// after it.) The pod is fenced, and a pod deleted after it is released. A private control
/// plane, so that `ipreclaim_unready_nodes` counts this test's node alone.
#[tokio::test]
async fn a_grace_period_of_i64_max_seconds_is_fenced_and_stops_nothing_else() {
    let (_cp, mut env) = Env::private("ctl-fence-huge-grace").await;
    let node = env.fence_node("Unknown").await;
    env.macvlan(&[(10, "sb-web-0", "web-0"), (11, "sb-db-0", "db-0")])
        .await;
    let web = env.pod_object(
        "web-0",
        "macvlan",
        Some(&["192.0.2.10"]),
        Some(&node),
        i64::MAX,
    );
    let uid = testenv::fixtures::create(&env.pods(), &web).await;
    env.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.start(&["--fence-settle=8s"]).await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;
    env.set_ready(&node, "True").await;
    env.wait_metric("ipreclaim_unready_nodes 0").await;
    env.delete_pod("web-0").await;
    env.wait_one_event(FENCED, "web-0", &uid).await;
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    env.finish(&node).await;
}
