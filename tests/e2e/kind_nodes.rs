//! Scenarios that need several real nodes: the kind cluster of `e2e/kind/run.sh`
//! (`IPRECLAIM_E2E=kind`, `DOCKER_HOST` of the engine that runs its node containers). On
//! testenv's single node they have nothing to run on and return at once, saying so.

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use testenv::poll::{metric_value, wait_for_within};

use crate::cluster::{Cluster, RELEASE_NS, wait_long};
use crate::fencing::{FENCED, fence_records, lease_holder, web_0_entry};
use crate::node_only::controller_pod_metrics;
use crate::{GC_DONE, Platform, expect_clean_releases, pool_entries, wait_pool_matches_live_pods};

/// A kind node is declared NotReady after the node monitor's grace period (50 s) and a sync.
const NODE_DOWN: Duration = Duration::from_secs(180);

fn on_kind() -> bool {
    let kind = std::env::var("IPRECLAIM_E2E").as_deref() == Ok("kind");
    if !kind {
        eprintln!("needs the kind cluster of e2e/kind/run.sh (IPRECLAIM_E2E=kind): not run here");
    }
    kind
}

fn docker(args: &[&str]) {
    let out = Command::new("docker").args(args).output().expect("docker");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A kind node's container paused (its kubelet, containerd and pods frozen, as a hung or
/// partitioned machine); unpaused when dropped, so a failed check leaves the cluster whole.
struct Paused(String);

impl Paused {
    fn new(node: &str) -> Paused {
        docker(&["pause", node]);
        Paused(node.to_string())
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["unpause", &self.0]).status();
    }
}

async fn node_ready(client: &kube::Client, node: &str) -> bool {
    let n = Api::<NodeObject>::all(client.clone())
        .get(node)
        .await
        .unwrap();
    n.status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The node the pod `name` of `ns` runs on.
async fn node_of(client: &kube::Client, ns: &str, name: &str) -> String {
    Api::<Pod>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap()
        .spec
        .and_then(|s| s.node_name)
        .unwrap_or_default()
}

/// A worker that does not run the controller's leader: the scenario freezes it, and the
/// leader must keep deciding (a frozen leader's Lease would only hand over after its term).
async fn worker_without_the_leader(client: &kube::Client) -> (String, String) {
    // After a rollout the Lease may still name a replica that is gone.
    let pods = Api::<Pod>::namespaced(client.clone(), RELEASE_NS);
    wait_long("the Lease held by a controller pod that exists", || async {
        let holder = lease_holder(client).await;
        !holder.is_empty() && pods.get_opt(&holder).await.unwrap().is_some()
    })
    .await;
    let leader = lease_holder(client).await;
    let leader_node = node_of(client, RELEASE_NS, &leader).await;
    let nodes = Api::<NodeObject>::all(client.clone())
        .list(&ListParams::default().labels("!node-role.kubernetes.io/control-plane"))
        .await
        .unwrap();
    let worker = nodes
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .find(|n| *n != leader_node)
        .expect("a worker without the controller's leader (the cluster has two)");
    (worker, leader)
}

/// A worker frozen (`docker pause` of its node container) while its StatefulSet pod is
/// force-deleted, as an operator does to get the pod scheduled elsewhere: the pod's sandbox
/// may still run there with its address, so the address is fenced, and stays so while the
/// node is away; when the node returns, its kubelet stops the old sandbox (CNI DEL), the
/// address is freed once and the fence record goes; the replacement runs with an address.
pub(crate) async fn a_paused_worker_keeps_a_force_deleted_pods_address_fenced_until_its_kubelet_stopped_the_pod(
    mut c: Cluster,
) {
    let client = c.client().clone();
    let (worker, leader) = worker_without_the_leader(&client).await;
    c.ensure_statefulset_on("web", Some(&worker)).await;
    c.scale_statefulset(1).await;
    wait_pool_matches_live_pods(&c).await;
    let (ip, id) = web_0_entry(&c).await;
    assert_eq!(node_of(&client, c.ns(), "web-0").await, worker);

    let paused = Paused::new(&worker);
    wait_for_within(
        &format!("node {worker} NotReady"),
        NODE_DOWN,
        Duration::from_millis(500),
        || async { !node_ready(&client, &worker).await },
    )
    .await;
    // A pod deleted before the leader sees its node down is, by design, not fenced.
    wait_long("the leader sees the node not Ready", || async {
        controller_pod_metrics(&client, &leader)
            .await
            .is_ok_and(|t| metric_value(&t, "ipreclaim_unready_nodes") >= 1.0)
    })
    .await;
    Api::<Pod>::namespaced(client.clone(), c.ns())
        .delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    wait_long("a Fenced Event for web-0", || async {
        testenv::events::with_reason(&client, c.ns(), FENCED, Some("web-0"))
            .await
            .iter()
            .any(|e| {
                let m = e.message.as_deref().unwrap_or_default();
                m.contains(&format!("[{ip}]"))
                    && m.contains(&format!("node {worker} was not Ready"))
            })
    })
    .await;
    let fenced_entry = ("web-0:fenced".to_string(), ip.clone(), id.clone());
    assert!(
        pool_entries(&c).await.contains(&fenced_entry),
        "the entry kept, its podref marked: {:?}",
        pool_entries(&c).await
    );
    assert_eq!(fence_records(&c).await.len(), 1);
    // Held while the node is away: the leader's gauge shows the fence ageing.
    wait_long("the leader shows the fence held for 10 s", || async {
        controller_pod_metrics(&client, &leader)
            .await
            .is_ok_and(|t| {
                metric_value(&t, "ipreclaim_fenced_addresses") == 1.0
                    && metric_value(&t, "ipreclaim_fence_oldest_age_seconds") >= 10.0
            })
    })
    .await;
    assert!(
        pool_entries(&c).await.contains(&fenced_entry),
        "still fenced"
    );

    drop(paused);
    wait_for_within(
        &format!("node {worker} Ready again"),
        NODE_DOWN,
        Duration::from_millis(500),
        || async { node_ready(&client, &worker).await },
    )
    .await;
    c.wait_running_with_address("web-0").await;
    // The returning kubelet stops the old sandbox: its entry (by sandbox id) goes, and the
    // fence record with it.
    wait_long(
        "the old sandbox's entry freed and the fence cleared",
        || async {
            !pool_entries(&c).await.iter().any(|(_, _, i)| *i == id)
                && fence_records(&c).await.is_empty()
        },
    )
    .await;
    wait_pool_matches_live_pods(&c).await;
    let released: Vec<_> = testenv::events::with_reason(&client, c.ns(), GC_DONE, Some("web-0"))
        .await
        .into_iter()
        .filter(|e| {
            e.message
                .as_deref()
                .is_some_and(|m| m.contains(&format!("[{ip}]")))
        })
        .collect();
    assert!(released.len() <= 1, "released more than once: {released:?}");
    expect_clean_releases(&c).await;
}

mod kind_scenarios {
    /// Named `cluster_…` so that `e2e/kind/run.sh`'s `::cluster` filter runs it.
    #[tokio::test]
    async fn cluster_a_paused_worker_keeps_a_force_deleted_pods_address_fenced() {
        if !super::on_kind() {
            return;
        }
        let c = crate::cluster::Cluster::kind("kind-paused-worker").await;
        super::a_paused_worker_keeps_a_force_deleted_pods_address_fenced_until_its_kubelet_stopped_the_pod(c)
            .await
    }
}
