//! Deletions no replica saw (both replicas down, or cut off with the zone): the node agents'
//! sandbox inventories tell the restarted controller which node may still run the pod.
//!
//! The inventory Leases are written here as the node agent writes them (stand-ins: the nodes
//! are stand-ins too); `node_agent::` shows the real agent writing its own from a real
//! containerd.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use testenv::poll::wait_for;

use crate::harness::{Env, FENCED};
use ipreclaim::ipam::inventory;

const POOL: &str = "192.0.2.0-24";

/// Writes `node`'s inventory listing `sandboxes` (id, pod uid) as its agent does.
async fn inventory_of(env: &Env, node: &str, sandboxes: &[(&str, &str)]) {
    let listed: Vec<(&str, inventory::Listed)> = sandboxes
        .iter()
        .map(|(id, uid)| {
            let l = inventory::Listed {
                pod_uid: (*uid).into(),
                grace_seconds: Some(600),
            };
            (*id, l)
        })
        .collect();
    let value = inventory::encode(listed.iter().map(|(id, l)| (*id, l)));
    apply_inventory(env, node, node, &value).await;
}

/// Writes the inventory Lease of `node` as `holder`'s agent, its value `value`.
async fn apply_inventory(env: &Env, node: &str, holder: &str, value: &str) {
    let name = inventory::lease_name(node).unwrap();
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(inventory::INVENTORY_LABEL.into(), "true".into())].into()),
            annotations: Some([(inventory::INVENTORY_ANNOTATION.into(), value.into())].into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(jiff::Timestamp::now())),
            ..Default::default()
        }),
    };
    Api::<Lease>::namespaced(env.client.clone(), &env.ns)
        .patch(
            &name,
            &PatchParams::apply("test-agent").force(),
            &Patch::Apply(&lease),
        )
        .await
        .unwrap();
}

/// A test namespace with two Ready stand-in nodes, `down` and `healthy`, and web-0 (sb-web-0,
/// 192.0.2.10, grace 30s) on `down` and db-0 (sb-db-0, 192.0.2.11) on `healthy`, with
/// reservations. Returns it, the two nodes and web-0's uid.
async fn two_nodes(prefix: &str) -> (Env, String, String, String) {
    let env = Env::new(prefix).await;
    let down = env.fence_node("True").await;
    let healthy = format!("{}-healthy", env.ns);
    env.create_node(&healthy, "True").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    let allocations = [(10, "sb-web-0", "web-0"), (11, "sb-db-0", "db-0")];
    env.pool(POOL, "192.0.2.0/24", &allocations).await;
    env.reservation("192.0.2.10", "web-0").await;
    env.reservation("192.0.2.11", "db-0").await;
    let web = env.pod_object("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&down), 30);
    let web = testenv::fixtures::create(&env.pods(), &web).await;
    env.pod_on("db-0", "macvlan", Some(&["192.0.2.11"]), Some(&healthy))
        .await;
    (env, down, healthy, web)
}

/// Stops the controller and removes the two nodes.
async fn finish(mut env: Env, down: &str, healthy: &str) {
    env.finish(down).await;
    env.delete_node(healthy).await;
}

/// Item 6: web-0 is force-deleted while its node is NotReady and no controller runs (both
/// replicas were in the zone that was cut off); db-0 is deleted from a healthy node meanwhile
/// (its kubelet stopped it, its CNI DEL lost). The controller that starts afterwards never saw
/// either deletion: it finds both entries without a pod. web-0's node agent last listed
/// web-0's sandbox live, so its address is fenced to that node (Event naming the inventory),
/// reservation kept, while db-0's, listed by no agent, is released as `PodMissing`. The fence
/// lifts when the agent there reports the sandbox gone.
#[tokio::test]
async fn a_pod_no_replica_saw_deleted_is_fenced_to_the_node_whose_agent_listed_its_sandbox() {
    let (mut env, down, healthy, web) = two_nodes("unseen").await;
    inventory_of(&env, &down, &[("sb-web-0", &web)]).await;
    inventory_of(&env, &healthy, &[]).await;
    env.set_ready(&down, "Unknown").await;
    env.delete_pod("web-0").await;
    env.delete_stopped_pod("db-0").await;

    env.start(&[]).await;
    let message = env.wait_one_event(FENCED, "web-0", &web).await;
    assert!(
        message.contains("no controller replica watched") && message.contains(&down),
        "{message}"
    );
    env.wait_keys(POOL, &["10"]).await;
    let (podref, fence) = env.entry_and_fence(POOL, "10").await;
    assert_eq!(podref, Some(format!("{}/web-0:fenced", env.ns)));
    let fence: serde_json::Value = serde_json::from_str(&fence.unwrap()).unwrap();
    assert_eq!(
        (fence["node"].as_str(), fence["uid"].as_str()),
        (Some(down.as_str()), Some(web.as_str()))
    );
    assert_eq!(env.reservation_names().await, ["192.0.2.10"]);
    env.wait_released_once(&["db-0"]).await;
    env.wait_metric("ipreclaim_sandbox_inventories_unreadable 0")
        .await;

    let (name, gone) = env.agent_report(POOL, "10", &down, &web).await;
    env.report_gone(&name, gone).await;
    env.wait_keys(POOL, &[]).await;
    wait_for("web-0's reservation deleted", || async {
        env.reservation_names().await.is_empty()
    })
    .await;
    finish(env, &down, &healthy).await;
}

/// An inventory whose name is not its holder's (an agent writing under another node's name,
/// where the chart's policy is off) places nothing: the pod is released as `PodMissing`, and a
/// malformed inventory beside it does not stop the sweep.
#[tokio::test]
async fn an_inventory_not_of_its_holder_or_unreadable_places_nothing() {
    let (mut env, node, healthy, web) = two_nodes("unseen-forged").await;
    // The agent of `healthy` claims web-0's sandbox under `node`'s name; `healthy`'s own
    // inventory cannot be read.
    let web_0 = inventory::Listed {
        pod_uid: web,
        grace_seconds: None,
    };
    let claim = inventory::encode([("sb-web-0", &web_0)]);
    apply_inventory(&env, &node, &healthy, &claim).await;
    apply_inventory(&env, &healthy, &healthy, "sb-db-0 without-a-uid").await;
    env.delete_stopped_pod("web-0").await;
    env.delete_stopped_pod("db-0").await;

    env.start(&[]).await;
    env.wait_keys(POOL, &[]).await;
    assert!(env.events(FENCED).await.is_empty());
    finish(env, &node, &healthy).await;
}

/// Listing the inventories is forbidden (the RBAC of an older install): the sweep releases
/// db-0's leak as before, and says so where an operator looks (the gauge, besides the log).
#[tokio::test]
async fn inventories_the_controller_may_not_list_are_said_unreadable_and_releases_go_on() {
    use testenv::ControlPlane;
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let (mut env, node, healthy, web) = two_nodes("unseen-403").await;
    inventory_of(&env, &node, &[("sb-web-0", &web)]).await;
    env.delete_stopped_pod("db-0").await;
    let proxy = FaultProxy::start(env.client.clone(), 1).await.unwrap();
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    proxy.set_rules(vec![Rule::new(
        Some("list"),
        Some("leases"),
        Action::Status(403),
    )]);
    env.start_as(through, &[]).await;
    env.wait_keys(POOL, &["10"]).await;
    env.wait_metric("ipreclaim_sandbox_inventories_unreadable 1")
        .await;
    assert!(
        proxy.injected().contains_key("403 list leases"),
        "{:?}",
        proxy.injected()
    );
    finish(env, &node, &healthy).await;
}

/// web-0 is force-deleted from its NotReady node while no controller runs, and its StatefulSet
/// creates it again on a healthy node with another address (sandbox sb-web-0-new). The
/// restarted controller finds the old entry held by a name whose live pod lists another
/// address (`IPNotOnPod`): the old pod's node agent last listed the old sandbox live for the
/// old pod's uid, so the old address is fenced to that node, and the new pod's is kept.
#[tokio::test]
async fn a_pod_recreated_elsewhere_while_no_replica_watched_keeps_its_old_address_fenced() {
    let (mut env, down, healthy, old) = two_nodes("unseen-recreated").await;
    inventory_of(&env, &down, &[("sb-web-0", &old)]).await;
    env.set_ready(&down, "Unknown").await;
    env.delete_pod("web-0").await;
    let new = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.12"]), Some(&healthy))
        .await;
    let entry = json!({"12": {"id": "sb-web-0-new", "podref": format!("{}/web-0", env.ns)}});
    env.merge_pool(POOL, json!({"spec": {"allocations": entry}}))
        .await;

    env.start(&[]).await;
    let message = env.wait_one_event(FENCED, "web-0", &old).await;
    assert!(
        message.contains("no controller replica watched"),
        "{message}"
    );
    let (podref, _) = env.entry_and_fence(POOL, "10").await;
    assert_eq!(podref, Some(format!("{}/web-0:fenced", env.ns)));
    env.wait_sweeps(2.0).await;
    assert_eq!(env.keys(POOL).await, ["10", "11", "12"]);
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    assert_ne!(old, new);
    finish(env, &down, &healthy).await;
}

/// A live pod's own leak is not fenced: web-0 runs (a static pod's mirror, say), and an old
/// sandbox of it left an entry its network-status no longer lists (`IPNotOnPod`). Its node's
/// agent lists that sandbox for web-0's own uid (the agent names a static pod by its mirror
/// pod's uid): the entry is released, not fenced (fenced, nothing would ever lift it while
/// web-0 runs).
#[tokio::test]
async fn a_live_pods_own_leak_listed_for_that_pod_is_released_not_fenced() {
    let (mut env, node, healthy, web) = two_nodes("unseen-own").await;
    let entry = json!({"12": {"id": "sb-web-0-old", "podref": format!("{}/web-0", env.ns)}});
    env.merge_pool(POOL, json!({"spec": {"allocations": entry}}))
        .await;
    inventory_of(&env, &node, &[("sb-web-0", &web), ("sb-web-0-old", &web)]).await;

    env.start(&[]).await;
    env.wait_keys(POOL, &["10", "11"]).await;
    env.wait_released_once(&["web-0"]).await;
    assert!(env.events(FENCED).await.is_empty());
    finish(env, &node, &healthy).await;
}
