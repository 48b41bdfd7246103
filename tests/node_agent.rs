//! `ipreclaim node-agent` against a real containerd and the real kube-apiserver: each test
//! starts its own containerd and uses its own namespace (also its whereabouts namespace) and
//! node name.

// The root tier: compiled empty without `--features root-tests` (see Cargo.toml).
#![cfg(feature = "root-tests")]

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use ipreclaim::api::{
    IPPool, NodeSliceAllocation, NodeSlicePool, NodeSlicePoolSpec, NodeSlicePoolStatus,
};
use ipreclaim::ipam::{NETWORK_STATUS_ANNOTATION, NETWORKS_ANNOTATION};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use testenv::faultproxy::{Action, FaultProxy, Rule};
use testenv::poll::{http_get, metric_sum, metric_value, wait_for, wait_for_within};
use testenv::{Containerd, ControlPlane};

use crate::support::Program;

// The scenarios run twice, as admin and as the chart's ServiceAccount.
testenv::as_admin_and_as_the_chart!(NodeEnv {
    a_dead_sandboxs_entry_is_released_after_the_grace_and_the_new_sandboxs_kept: "node-restart",
    a_node_slice_networks_entry_is_released_from_this_nodes_slice_pool: "node-slice",
    a_pod_deleted_from_the_api_is_left_to_the_controller: "node-deleted",
    sandboxes_without_an_api_pod_are_counted_as_orphaned_runtime_pods: "node-orphans",
    a_fenced_pod_is_reported_gone_only_once_its_sandbox_is_removed: "node-evidence",
    the_nodes_live_sandboxes_are_written_to_its_inventory: "node-inventory",
});

const RANGE: &str = "192.0.2.0/24";
const POOL: &str = "192.0.2.0-24";

struct NodeEnv {
    containerd: Containerd,
    client: Client,
    /// The chart's node-agent ServiceAccount client, when the chart is installed.
    chart: Option<Client>,
    ns: String,
    node: String,
    /// The IPPool the macvlan network allocates from on this node.
    pool: String,
    metrics: SocketAddr,
    program: Option<Program>,
}

impl NodeEnv {
    async fn new(prefix: &str) -> NodeEnv {
        let cp = ControlPlane::shared();
        let (client, ns) = cp.client_crds_and_namespace(prefix).await;
        let containerd = Containerd::start_for_test().await;
        NodeEnv {
            node: format!("node-{ns}"),
            containerd,
            client,
            chart: None,
            ns,
            pool: POOL.into(),
            metrics: "127.0.0.1:0".parse().unwrap(),
            program: None,
        }
    }

    /// Like [`new`](Self::new), with the chart installed in the namespace (also the
    /// whereabouts namespace); the agent then acts as the chart's ServiceAccount, with a token
    /// bound to its pod on this node (the chart's report policy refuses any other).
    async fn new_chart(prefix: &str) -> NodeEnv {
        let mut env = NodeEnv::new(&format!("{prefix}-sa")).await;
        let cp = ControlPlane::shared();
        testenv::helm::install_in(cp, &env.ns).expect("helm install");
        let client = testenv::helm::node_agent_client_on(cp, &env.client, &env.ns, &env.node);
        env.chart = Some(client.await);
        env
    }

    /// Starts the agent with test timings plus `extra` flags; waits until it is ready.
    async fn start(&mut self, extra: &[&str]) {
        let client = self.chart.clone().unwrap_or_else(|| self.client.clone());
        self.start_as(client, extra).await;
    }

    /// [`start`](Self::start) with the agent's API client `client`.
    async fn start_as(&mut self, client: Client, extra: &[&str]) {
        let cri = format!("--cri-endpoint=unix://{}", self.containerd.socket.display());
        let node = format!("--node-name={}", self.node);
        let mut flags = vec![cri.as_str(), node.as_str(), "--relist-period=100ms"];
        flags.extend_from_slice(extra);
        let program = support::node_agent(client, &self.ns, &flags).await;
        self.metrics = program.metrics;
        self.program = Some(program);
    }

    async fn stop(&mut self) {
        if let Some(program) = &mut self.program {
            program.stop().await;
        }
    }

    async fn metric(&self, line: &str) -> f64 {
        metric_value(&http_get(self.metrics, "/metrics").await.1, line)
    }

    async fn wait_metric(&self, line: &str, want: f64) {
        testenv::poll::wait_metric(self.metrics, line, want).await;
    }

    fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The macvlan NAD (whereabouts over RANGE) and its empty pool.
    async fn nad(&self) {
        self.create_nad(&format!(r#""range":"{RANGE}""#)).await;
        self.create_pool(RANGE).await;
    }

    /// The macvlan NAD as a node-slice network whose CNI name (`slicenet`) is not the NAD's,
    /// its NodeSlicePool with another node's slice listed first, and this node's slice pool.
    async fn slice_nad(&mut self) {
        self.create_nad(&format!(r#""range":"{RANGE}","node_slice_size":"/28""#))
            .await;
        let mut slices = NodeSlicePool::new(
            "slicenet",
            NodeSlicePoolSpec {
                range: RANGE.into(),
                slice_size: "/28".into(),
            },
        );
        slices.status = Some(NodeSlicePoolStatus {
            allocations: vec![
                NodeSliceAllocation {
                    node_name: "another-node".into(),
                    slice_range: "192.0.2.0/28".into(),
                },
                NodeSliceAllocation {
                    node_name: self.node.clone(),
                    slice_range: "192.0.2.16/28".into(),
                },
            ],
        });
        Api::<NodeSlicePool>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &slices)
            .await
            .unwrap();
        self.pool = format!("{}-192.0.2.16-28", self.node);
        self.create_pool("192.0.2.16/28").await;
    }

    async fn create_nad(&self, ipam_fields: &str) {
        let config = format!(
            r#"{{"cniVersion":"0.3.1","name":"slicenet","type":"macvlan","master":"eth0","ipam":{{"type":"whereabouts",{ipam_fields}}}}}"#
        );
        support::create_nad(&self.client, &self.ns, "macvlan", &config).await;
    }

    async fn create_pool(&self, range: &str) {
        support::create_pool(&self.client, &self.ns, &self.pool, range, BTreeMap::new()).await;
    }

    /// An API pod on this node asking for the macvlan network; returns its uid.
    async fn pod(&self, name: &str) -> String {
        let annotations =
            BTreeMap::from([(NETWORKS_ANNOTATION.to_string(), "macvlan".to_string())]);
        let mut pod = testenv::fixtures::pod(name, Some(annotations));
        pod.spec.as_mut().unwrap().node_name = Some(self.node.clone());
        testenv::fixtures::create(&self.pods(), &pod).await
    }

    /// Multus's network-status for `name`: `ip` on the macvlan network.
    async fn set_network_status(&self, name: &str, ip: &str) {
        let status = support::network_status(&self.ns, "macvlan", &[ip]);
        let patch =
            serde_json::json!({"metadata": {"annotations": {NETWORK_STATUS_ANNOTATION: status}}});
        testenv::fixtures::merge(&self.pods(), name, patch).await;
    }

    async fn run_sandbox(&self, name: &str, uid: &str) -> String {
        self.containerd
            .run_sandbox(name, uid, &self.ns)
            .await
            .expect("RunPodSandbox")
    }

    /// A sandbox of pod `name` that got `ip` (at `offset` of the pool) the way whereabouts and
    /// Multus record it: pool entry, reservation, network-status. Returns the sandbox id.
    async fn sandbox_with_address(&self, name: &str, uid: &str, offset: u32, ip: &str) -> String {
        let id = self.sandbox_allocated(name, uid, offset, ip).await;
        self.set_network_status(name, ip).await;
        id
    }

    /// A sandbox of pod `name` whose pool entry and reservation whereabouts wrote (`ip` at
    /// `offset`), with no network-status from Multus. Returns the sandbox id.
    async fn sandbox_allocated(&self, name: &str, uid: &str, offset: u32, ip: &str) -> String {
        let id = self.run_sandbox(name, uid).await;
        self.allocate(offset, &id, name).await;
        self.reserve(ip, &id, name).await;
        id
    }

    /// Stops and removes a sandbox the way a crashed node loses it: no CNI DEL reaches the pool.
    /// web-0 with sandbox S1 holding `first` (offset, address), the agent running with a 5 s
    /// sandbox grace (it covers the time Multus takes to list S2's address instead of S1's).
    /// S1 is lost without a CNI DEL; the kubelet starts S2, which allocates `second` anew.
    /// Returns S1's id.
    async fn web_0_sandbox_replaced(&mut self, first: (u32, &str), second: (u32, &str)) -> String {
        let uid = self.pod("web-0").await;
        let s1 = self
            .sandbox_with_address("web-0", &uid, first.0, first.1)
            .await;
        self.start(&["--sandbox-grace=5s"]).await;
        self.wait_metric(STARTED, 1.0).await;
        self.remove_sandbox(&s1).await;
        self.sandbox_with_address("web-0", &uid, second.0, second.1)
            .await;
        s1
    }

    async fn remove_sandbox(&self, id: &str) {
        self.stop_sandbox(id).await;
        self.delete_sandbox(id).await;
    }

    async fn stop_sandbox(&self, id: &str) {
        self.containerd
            .stop_sandbox(id)
            .await
            .expect("StopPodSandbox");
    }

    async fn delete_sandbox(&self, id: &str) {
        self.containerd
            .remove_sandbox(id)
            .await
            .expect("RemovePodSandbox");
    }

    /// Adds a pool entry the way the whereabouts CNI does.
    async fn allocate(&self, offset: u32, sandbox: &str, pod: &str) {
        let alloc = support::allocation(&self.ns, pod, sandbox);
        let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
            {"op": "add", "path": format!("/spec/allocations/{offset}"), "value": alloc}
        ]))
        .unwrap();
        self.pools()
            .patch(
                &self.pool,
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
            .unwrap();
    }

    async fn reserve(&self, ip: &str, sandbox: &str, pod: &str) {
        support::create_reservation(&self.client, &self.ns, ip, sandbox, pod).await;
    }

    async fn reservations(&self) -> Vec<String> {
        support::reservation_names(&self.client, &self.ns).await
    }

    async fn keys(&self) -> Vec<String> {
        let pool = self.pools().get(&self.pool).await.unwrap();
        pool.spec.allocations.keys().cloned().collect()
    }

    /// The Events with `reason` once there is one (Events are published after the release).
    async fn wait_events(&self, reason: &str) -> Vec<(String, String)> {
        let events = testenv::events::wait_with_reason(&self.client, &self.ns, reason).await;
        events.into_iter().map(name_and_message).collect()
    }

    /// Waits until the pool's keys are `keys` (`entry_gone` says what that means), then until
    /// the reservations are `reservations` (S1's is deleted), then returns the one release
    /// Event (pod, message).
    async fn wait_s1_released(
        &self,
        entry_gone: &str,
        keys: &[&str],
        reservations: &[&str],
    ) -> (String, String) {
        wait_for(entry_gone, || async { self.keys().await == keys }).await;
        wait_for("S1's reservation deleted", || async {
            self.reservations().await == reservations
        })
        .await;
        let events = self.wait_events("IPAddressGarbageCollected").await;
        assert_eq!(events.len(), 1, "{events:?}");
        events.into_iter().next().unwrap()
    }

    async fn events(&self, reason: &str) -> Vec<(String, String)> {
        let events = testenv::events::with_reason(&self.client, &self.ns, reason, None).await;
        events.into_iter().map(name_and_message).collect()
    }
}

/// An Event as (object name, message).
fn name_and_message(e: k8s_openapi::api::core::v1::Event) -> (String, String) {
    (
        e.involved_object.name.unwrap_or_default(),
        e.message.unwrap_or_default(),
    )
}

const DIED: &str = r#"ipreclaim_node_pleg_events_total{kind="ContainerDied"}"#;
const STARTED: &str = r#"ipreclaim_node_pleg_events_total{kind="ContainerStarted"}"#;
const REMOVED: &str = r#"ipreclaim_node_pleg_events_total{kind="ContainerRemoved"}"#;
const PENDING: &str = "ipreclaim_node_dead_sandboxes_pending";
const OLDEST_WAIT: &str = "ipreclaim_node_dead_sandbox_oldest_wait_seconds";

async fn a_dead_sandboxs_entry_is_released_after_the_grace_and_the_new_sandboxs_kept(
    mut env: NodeEnv,
) {
    env.nad().await;
    let s1 = env
        .web_0_sandbox_replaced((10, "192.0.2.10"), (11, "192.0.2.11"))
        .await;

    env.wait_metric(PENDING, 1.0).await;
    assert_eq!(
        env.keys().await,
        ["10", "11"],
        "nothing is released within the grace"
    );
    let (pod, message) = env
        .wait_s1_released("S1's entry released", &["11"], &["192.0.2.11"])
        .await;
    assert_eq!(pod, "web-0");
    assert!(
        message.contains("[192.0.2.10]")
            && message.contains("SandboxGone")
            && message.contains(&s1[..12]),
        "{message}"
    );
    assert_eq!(
        env.metric(r#"ipreclaim_releases_total{reason="SandboxGone"}"#)
            .await,
        1.0
    );
    // Counted once the release task reports back to the agent's loop.
    env.wait_metric(
        r#"ipreclaim_node_dead_sandboxes_total{outcome="released"}"#,
        1.0,
    )
    .await;
    assert_eq!(env.metric(PENDING).await, 0.0);
    env.stop().await;
}

async fn a_node_slice_networks_entry_is_released_from_this_nodes_slice_pool(mut env: NodeEnv) {
    env.slice_nad().await;
    env.web_0_sandbox_replaced((2, "192.0.2.18"), (3, "192.0.2.19"))
        .await;

    let (_, message) = env
        .wait_s1_released(
            "S1's entry released from this node's slice pool",
            &["3"],
            &["192.0.2.19"],
        )
        .await;
    assert!(
        message.contains("[192.0.2.18]") && message.contains("SandboxGone"),
        "{message}"
    );
    assert_eq!(
        env.metric("ipreclaim_node_config_errors_total").await,
        0.0,
        "the NodeSlicePool and this node's slice were found"
    );
    env.stop().await;
}

async fn a_pod_deleted_from_the_api_is_left_to_the_controller(mut env: NodeEnv) {
    env.nad().await;
    let uid = env.pod("gone-0").await;
    let s1 = env.run_sandbox("gone-0", &uid).await;
    env.allocate(20, &s1, "gone-0").await;
    env.set_network_status("gone-0", "192.0.2.20").await;
    env.start(&["--sandbox-grace=0s"]).await;
    env.wait_metric(STARTED, 1.0).await;

    env.pods()
        .delete("gone-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    env.remove_sandbox(&s1).await;
    env.wait_metric(
        r#"ipreclaim_node_dead_sandboxes_total{outcome="pod_gone"}"#,
        1.0,
    )
    .await;
    assert_eq!(
        env.keys().await,
        ["20"],
        "the controller releases it, not us"
    );
    let text = http_get(env.metrics, "/metrics").await.1;
    assert!(
        metric_sum(&text, "ipreclaim_releases_total") == 0.0
            && metric_sum(&text, "ipreclaim_release_failures_total") == 0.0,
        "no release and no failure:\n{text}"
    );
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    assert!(
        env.events("IPAddressGarbageCollectionFailed")
            .await
            .is_empty()
    );
    env.stop().await;
}

async fn sandboxes_without_an_api_pod_are_counted_as_orphaned_runtime_pods(mut env: NodeEnv) {
    let uid = env.pod("known-0").await;
    env.run_sandbox("known-0", &uid).await;
    for i in 0..3 {
        env.run_sandbox(&format!("stray-{i}"), &format!("no-such-uid-{i}"))
            .await;
    }
    env.start(&[]).await;
    env.wait_metric("ipreclaim_node_orphaned_runtime_pods", 3.0)
        .await;
    // Deleting the known pod from the API makes its sandbox an orphan too.
    env.pods()
        .delete("known-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    env.wait_metric("ipreclaim_node_orphaned_runtime_pods", 4.0)
        .await;
    env.stop().await;
}

impl NodeEnv {
    /// An `IPFence` (written as the controller does, labelled for this node) of pod `pod_uid`
    /// whose entry held `sandbox`, its spec naming `node`; returns its uid.
    async fn fence(&self, pod: &str, pod_uid: &str, sandbox: &str, node: &str) -> String {
        let spec: ipreclaim::api::IPFenceSpec = serde_json::from_value(serde_json::json!({
            "pool": POOL, "key": "10", "address": "192.0.2.10", "sandbox": sandbox,
            "podref": format!("{}/{pod}", self.ns), "uid": pod_uid, "node": node,
            "why": "Ready=Unknown", "since": jiff::Timestamp::now().to_string(),
        }))
        .unwrap();
        let mut fence = ipreclaim::api::IPFence::new(&format!("{POOL}-{pod}"), spec);
        fence.metadata.labels = Some(BTreeMap::from([(
            ipreclaim::ipam::fence::NODE_LABEL.to_string(),
            ipreclaim::ipam::fence::node_label_value(&self.node),
        )]));
        let fences = Api::<ipreclaim::api::IPFence>::namespaced(self.client.clone(), &self.ns);
        testenv::fixtures::create(&fences, &fence).await
    }

    /// The node agent's "gone" report in fence `pod`'s status, if any.
    async fn report_of(&self, pod: &str) -> Option<ipreclaim::api::SandboxReport> {
        self.status_of(pod).await.sandboxes_gone
    }

    /// Fence `pod`'s status (the node agent's reports).
    async fn status_of(&self, pod: &str) -> ipreclaim::api::IPFenceStatus {
        Api::<ipreclaim::api::IPFence>::namespaced(self.client.clone(), &self.ns)
            .get(&format!("{POOL}-{pod}"))
            .await
            .unwrap()
            .status
            .unwrap_or_default()
    }

    /// Waits until `n` more relists have completed.
    async fn wait_relists(&self, n: f64) {
        let count = "ipreclaim_node_relist_duration_seconds_count";
        let from = self.metric(count).await;
        wait_for(&format!("{n} more relists"), || async {
            self.metric(count).await >= from + n
        })
        .await;
    }
}

const TERMINATING: &str = r#"ipreclaim_node_fenced_pods{state="terminating"}"#;
const TERMINATED: &str = r#"ipreclaim_node_fenced_pods{state="terminated"}"#;
const REPORTED: &str = r#"ipreclaim_node_fence_reports_total{outcome="reported"}"#;

/// A pod force-deleted while this node was down, its address fenced: while its sandbox runs,
/// and while it is stopped but still there, nothing is reported; once containerd no longer
/// lists it, the fence's status names this node, the pod and the fence object. A fence
/// labelled for this node but naming another in its spec is never reported.
async fn a_fenced_pod_is_reported_gone_only_once_its_sandbox_is_removed(mut env: NodeEnv) {
    let uid = format!("{}-web-0", env.ns);
    let sb = env.run_sandbox("web-0", &uid).await;
    let node = env.node.clone();
    let fence_uid = env.fence("web-0", &uid, &sb, &node).await;
    env.fence(
        "other-0",
        &format!("{}-other-0", env.ns),
        "sb-gone",
        "another-node",
    )
    .await;
    env.start(&[]).await;
    env.wait_metric(TERMINATING, 1.0).await;
    // Its sandbox runs: the agent says so once ("still present" holds a settle lift).
    env.wait_metric(REPORTED, 1.0).await;
    env.wait_relists(5.0).await;
    assert_eq!(env.metric(TERMINATING).await, 1.0, "its sandbox runs");
    assert_eq!(env.report_of("web-0").await, None);
    let present = env
        .status_of("web-0")
        .await
        .sandboxes_present
        .expect("present");
    assert_eq!(
        (present.node.as_str(), present.pod_uid.as_str()),
        (node.as_str(), uid.as_str())
    );

    env.stop_sandbox(&sb).await;
    env.wait_metric(TERMINATED, 1.0).await;
    env.wait_relists(5.0).await;
    assert_eq!(env.report_of("web-0").await, None, "stopped is not gone");
    assert_eq!(env.metric(REPORTED).await, 1.0, "present, once");

    env.delete_sandbox(&sb).await;
    wait_for("the fence's report", || async {
        env.report_of("web-0").await.is_some()
    })
    .await;
    let report = env.report_of("web-0").await.unwrap();
    assert_eq!(
        (
            report.node.as_str(),
            report.pod_uid.as_str(),
            report.fence_uid.as_str()
        ),
        (node.as_str(), uid.as_str(), fence_uid.as_str())
    );
    assert!(
        report.observed_at.parse::<jiff::Timestamp>().is_ok(),
        "{report:?}"
    );
    assert_eq!(
        env.status_of("web-0").await.sandboxes_present,
        None,
        "gone replaces present"
    );
    env.wait_metric(REPORTED, 2.0).await;
    env.wait_relists(3.0).await;
    assert_eq!(env.metric(REPORTED).await, 2.0, "present once, gone once");
    assert_eq!(
        env.status_of("other-0").await,
        Default::default(),
        "another node's fence"
    );
    env.stop().await;
}

/// This node's sandbox inventory (the Lease `ipreclaim-sandboxes-<node>`, held by this node):
/// web-0's sandbox is listed with web-0's uid while it runs, and dropped once it is stopped
/// (its network torn down). A static pod runs under its config hash, which its mirror pod in
/// the API carries (`kubernetes.io/config.mirror`): its sandbox is listed with the mirror
/// pod's uid, so the controller takes it for the live pod it is. As the chart's
/// ServiceAccount, the report policy lets the agent write its own node's inventory.
async fn the_nodes_live_sandboxes_are_written_to_its_inventory(mut env: NodeEnv) {
    use ipreclaim::ipam::inventory;
    use k8s_openapi::api::coordination::v1::Lease;
    let uid = format!("{}-web-0", env.ns);
    let sb = env.run_sandbox("web-0", &uid).await;
    let hash = format!("{}-static-hash", env.ns);
    let mut mirror = testenv::fixtures::annotated_pod(
        "static-0",
        ipreclaim::api::slim::MIRROR_ANNOTATION,
        &hash,
    );
    mirror.spec.as_mut().unwrap().node_name = Some(env.node.clone());
    let mirror_uid = testenv::fixtures::create(&env.pods(), &mirror).await;
    let static_sb = env.run_sandbox("static-0", &hash).await;
    env.start(&[]).await;
    let leases = Api::<Lease>::namespaced(env.client.clone(), &env.ns);
    let name = inventory::lease_name(&env.node).unwrap();
    let listed = || async {
        let lease = leases.get_opt(&name).await.unwrap()?;
        let holder = lease.spec.and_then(|s| s.holder_identity);
        let value = lease
            .metadata
            .annotations?
            .remove(inventory::INVENTORY_ANNOTATION)?;
        Some((holder, inventory::decode(&value).unwrap()))
    };
    let of = |uid: &str| inventory::Listed {
        pod_uid: uid.into(),
        grace_seconds: None,
    };
    wait_for("both sandboxes in the inventory", || async {
        listed().await.is_some_and(|(_, i)| i.sandboxes.len() == 2)
    })
    .await;
    let (holder, read) = listed().await.unwrap();
    assert_eq!(holder.as_deref(), Some(env.node.as_str()));
    assert!(read.complete);
    let mut want = vec![
        (inventory::id_prefix(&sb).to_string(), of(&uid)),
        (
            inventory::id_prefix(&static_sb).to_string(),
            of(&mirror_uid),
        ),
    ];
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(read.sandboxes.into_iter().collect::<Vec<_>>(), want);

    env.stop_sandbox(&sb).await;
    env.stop_sandbox(&static_sb).await;
    wait_for(
        "the stopped sandboxes dropped from the inventory",
        || async { listed().await.is_some_and(|(_, i)| i.sandboxes.is_empty()) },
    )
    .await;
    env.stop().await;
}

/// A fence written while the agent's watch connection was lost without a word (the apiserver's
/// end gone, nothing sent to the agent: a node frozen while its connections were reset, a
/// partition across an apiserver restart) reaches the agent within its --fence-watch-timeout
/// and is reported. kube's own idle check (290 s) would let a returning node's settle lift
/// the fence first.
#[tokio::test]
async fn a_fence_written_while_the_agents_watch_was_silently_lost_is_reported() {
    let mut env = NodeEnv::new("node-evidence-silenced").await;
    let uid = format!("{}-web-0", env.ns);
    let sb = env.run_sandbox("web-0", &uid).await;
    let proxy = FaultProxy::start(env.client.clone(), 11).await.unwrap();
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &["--fence-watch-timeout=3s"]).await;
    // A first fence, of a pod with no sandbox here, reported gone: the watch delivers.
    let node = env.node.clone();
    env.fence("gone-0", &format!("{}-gone-0", env.ns), "sb-gone", &node)
        .await;
    wait_for("the first fence reported", || async {
        env.report_of("gone-0").await.is_some()
    })
    .await;
    proxy.silence_watches(Some("ipfences"));
    wait_for("the fence watch silenced", || async {
        proxy.silenced() >= 1
    })
    .await;
    env.fence("web-0", &uid, &sb, &node).await;
    // The silenced watch is dropped at most 3 + 5 s after its last word; a few relists more.
    let limit = Duration::from_secs(3 + 5 + 7);
    wait_for_within(
        "web-0's still-present report",
        limit,
        Duration::from_millis(100),
        || async { env.status_of("web-0").await.sandboxes_present.is_some() },
    )
    .await;
    env.stop().await;
}

/// A report carries its fence object's uid as a precondition: one made for an earlier fence
/// of the same name (deleted and written again since) is refused by the apiserver and lands
/// nowhere.
#[tokio::test]
async fn a_report_for_a_replaced_fence_object_is_refused() {
    let env = NodeEnv::new("node-evidence-stale").await;
    let uid = format!("{}-web-0", env.ns);
    let node = env.node.clone();
    let fence_uid = env.fence("web-0", &uid, "sb-web-0", &node).await;
    let budgets = ipreclaim::release::Budgets::new(
        ipreclaim::release::BudgetConfig {
            pool_qps: 0.0,
            pool_burst: 1,
            reservation_qps: 0.0,
            reservation_burst: 1,
            write_qps: 0.0,
            write_burst: 1,
            max_in_flight: 1,
        },
        podlife::clock::RealClock::shared(),
        ipreclaim::telemetry::WriteMetrics::new(&mut Default::default()),
    );
    let reporter = ipreclaim::node::fences::FenceReporter {
        client: env.client.clone(),
        namespace: env.ns.clone(),
        node: node.clone(),
        dry_run: false,
        budgets,
    };
    let report = |fence_uid: &str| ipreclaim::node::evidence::Report {
        name: format!("{POOL}-web-0"),
        fence_uid: fence_uid.into(),
        pod_uid: uid.clone(),
        kind: ipreclaim::node::evidence::ReportKind::Gone,
    };
    let refused = reporter.report(&report("an-earlier-fence")).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("code: 422")),
        "{refused:?}"
    );
    assert_eq!(env.report_of("web-0").await, None);
    reporter.report(&report(&fence_uid)).await.unwrap();
    assert_eq!(
        env.report_of("web-0").await.map(|r| r.fence_uid),
        Some(fence_uid)
    );
}

/// A fenced pod with no sandbox here is not reported while the runtime does not answer (a
/// failed listing shows nothing, which is not "gone"), and is once it answers again.
#[tokio::test]
async fn a_runtime_that_does_not_answer_is_no_evidence() {
    let mut env = NodeEnv::new("node-evidence-outage").await;
    let uid = format!("{}-web-0", env.ns);
    let node = env.node.clone();
    // Killed, not stopped: a containerd stopped right after its start took two minutes to stop
    // again at the end of the test.
    env.containerd.kill().expect("kill containerd");
    env.fence("web-0", &uid, "sb-web-0", &node).await;
    env.start(&[]).await;
    env.wait_metric(TERMINATING, 1.0).await;
    let failures = "ipreclaim_node_relist_failures_total";
    wait_for("three failed relists", || async {
        env.metric(failures).await >= 3.0
    })
    .await;
    assert_eq!(env.report_of("web-0").await, None);
    assert_eq!(env.metric(REPORTED).await, 0.0);
    env.containerd.restart().await.expect("restart containerd");
    wait_for("the fence's report", || async {
        env.report_of("web-0").await.is_some()
    })
    .await;
    env.wait_metric(REPORTED, 1.0).await;
    env.stop().await;
}

const RUNTIME_UNVERIFIED: &str = "ipreclaim_node_runtime_unverified";
const UNVERIFIED: &str = r#"ipreclaim_node_dead_sandboxes_total{outcome="unverified"}"#;

/// A runtime that does not list the agent's own pod (`--pod-uid`) Ready is not taken as this
/// node's (a wrong `--cri-endpoint` lists none of the node's pods, or only a stopped sandbox of
/// the agent from before the node left that runtime, and "not listed" reads as "gone"): a
/// fenced pod it does not list is not reported, and a dead sandbox due is looked at again
/// instead of released (`unverified`). Once the agent's own sandbox is listed Ready, both go.
#[tokio::test]
async fn a_runtime_that_does_not_list_the_agents_own_pod_is_not_taken_as_this_nodes() {
    let mut env = NodeEnv::new("node-identity").await;
    env.nad().await;
    let uid = env.pod("db-0").await;
    let sandbox = env.sandbox_allocated("db-0", &uid, 10, "192.0.2.10").await;
    let node = env.node.clone();
    env.fence("web-0", &format!("{}-web-0", env.ns), "sb-web-0", &node)
        .await;
    let agent_uid = format!("{}-agent", env.ns);
    let stale = env.run_sandbox("ipreclaim-node-agent", &agent_uid).await;
    env.stop_sandbox(&stale).await;
    let own_pod = format!("--pod-uid={agent_uid}");
    env.start(&["--sandbox-grace=1s", &own_pod]).await;
    env.wait_metric(RUNTIME_UNVERIFIED, 1.0).await;
    env.wait_metric(STARTED, 1.0).await;
    env.remove_sandbox(&sandbox).await;
    wait_for("two looks at db-0's dead sandbox", || async {
        env.metric(UNVERIFIED).await >= 2.0
    })
    .await;
    assert_eq!(env.keys().await, ["10"], "not released");
    assert_eq!(env.report_of("web-0").await, None, "not reported");
    assert_eq!(env.metric(REPORTED).await, 0.0);

    env.delete_sandbox(&stale).await;
    env.run_sandbox("ipreclaim-node-agent", &agent_uid).await;
    env.wait_metric(RUNTIME_UNVERIFIED, 0.0).await;
    wait_for("the fence's report", || async {
        env.report_of("web-0").await.is_some()
    })
    .await;
    wait_for("db-0's entry released", || async {
        env.keys().await.is_empty()
    })
    .await;
    env.stop().await;
}

/// The runtime stops being this node's after the listing that made a dead sandbox due was
/// judged (the agent's own sandbox is gone by the time the release asks the runtime): the
/// release asks for the agent's own Ready sandbox again after its fresh look at the dead one,
/// and releases nothing (`unverified`). The release's pod read is held at the fault proxy
/// until the agent's own sandbox is removed, so the listing's verdict is stale when the
/// release reaches the runtime.
#[tokio::test]
async fn a_runtime_that_stops_being_this_nodes_during_a_release_releases_nothing() {
    let mut env = NodeEnv::new("node-identity-late").await;
    env.nad().await;
    let uid = env.pod("db-0").await;
    let sandbox = env.sandbox_allocated("db-0", &uid, 10, "192.0.2.10").await;
    let agent_uid = format!("{}-agent", env.ns);
    let own = env.run_sandbox("ipreclaim-node-agent", &agent_uid).await;
    let proxy = FaultProxy::start(env.client.clone(), 7).await.unwrap();
    proxy.set_rules(vec![Rule::new(Some("get"), Some("pods"), Action::Hold)]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    let own_pod = format!("--pod-uid={agent_uid}");
    env.start_as(through, &["--sandbox-grace=1s", &own_pod])
        .await;
    env.wait_metric(STARTED, 2.0).await;
    assert_eq!(env.metric(RUNTIME_UNVERIFIED).await, 0.0);
    env.remove_sandbox(&sandbox).await;
    let reads = || proxy.requests().get("get pods").copied().unwrap_or(0);
    wait_for("the release reading db-0", || async { reads() > 0 }).await;
    env.remove_sandbox(&own).await;
    env.wait_metric(RUNTIME_UNVERIFIED, 1.0).await;
    proxy.clear();
    wait_for("the release's outcome", || async {
        env.metric(UNVERIFIED).await >= 1.0
    })
    .await;
    assert_eq!(env.keys().await, ["10"], "not released");
    let released = r#"ipreclaim_node_dead_sandboxes_total{outcome="released"}"#;
    assert_eq!(env.metric(released).await, 0.0);
    env.stop().await;
}

/// The pid of a sandbox's pause process, from containerd's verbose status.
async fn sandbox_pid(containerd: &Containerd, id: &str) -> i32 {
    let status = containerd
        .sandbox_status(id, true)
        .await
        .expect("PodSandboxStatus");
    let info: serde_json::Value =
        serde_json::from_str(status.info.get("info").expect("verbose info")).unwrap();
    info["pid"].as_i64().expect("pid in verbose info") as i32
}

/// web-0's pause process dies (killed, as by the OOM killer) and nothing has stopped its
/// sandbox yet: the runtime lists it NOTREADY, but its network namespace is still up, the
/// address on its interface. web-0 has no network-status, so only the runtime's word can keep
/// the entry: the agent asks the runtime again right before the release and keeps it while
/// the network is up, asking again after each grace. Once the sandbox is stopped (its network
/// torn down) the entry is released. Before, the listing that said NOTREADY released it after
/// the grace.
#[tokio::test]
async fn a_sandbox_whose_pause_died_keeps_its_entry_while_its_network_is_up() {
    let mut env = NodeEnv::new("node-netup").await;
    env.nad().await;
    let uid = env.pod("web-0").await;
    let s1 = env.sandbox_allocated("web-0", &uid, 10, "192.0.2.10").await;
    env.start(&["--sandbox-grace=1s"]).await;
    env.wait_metric(STARTED, 1.0).await;
    let pid = sandbox_pid(&env.containerd, &s1).await;
    // SAFETY: a pid we read from containerd for a process our test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    env.wait_metric(DIED, 1.0).await;
    let in_use = r#"ipreclaim_node_dead_sandboxes_total{outcome="in_use"}"#;
    wait_for("two looks finding the sandbox's network up", || async {
        env.metric(in_use).await >= 2.0
    })
    .await;
    assert_eq!(env.keys().await, ["10"], "kept while the network is up");
    assert_eq!(env.reservations().await, ["192.0.2.10"]);
    // Two graces of 1s have passed since it died: its wait counts from the death, across
    // the looks (a wait counted from each look would stay under 2).
    wait_for("the oldest wait counting from the death", || async {
        env.metric(OLDEST_WAIT).await >= 2.0
    })
    .await;

    env.stop_sandbox(&s1).await;
    let (pod, message) = env
        .wait_s1_released("the entry released once the sandbox is stopped", &[], &[])
        .await;
    assert_eq!(pod, "web-0");
    assert!(
        message.contains("[192.0.2.10]") && message.contains("SandboxGone"),
        "{message}"
    );
    env.wait_metric(
        r#"ipreclaim_node_dead_sandboxes_total{outcome="released"}"#,
        1.0,
    )
    .await;
    env.wait_metric(OLDEST_WAIT, 0.0).await;
    env.stop().await;
}

/// Seven pods of this node lose their sandboxes at once (stopped, no CNI DEL) in a pool of 12
/// allocations; their pods list none of those addresses (four have no network-status, three
/// list another address), so each entry would be released. All seven would free more than
/// half of the pool: at `--max-release-ratio=0.5` the agent releases 6 and holds the 7th, with
/// one Warning Event on the pool, and keeps looking at the held sandbox after each grace
/// without reporting the hold again. Its release tasks run concurrently and may all read the
/// pool before any patch lands: each reserves what it lets go, and a reserved entry still
/// listed does not count in the pool's size, so exactly 6 go in any order. Before, all 7 went.
#[tokio::test]
async fn the_breaker_holds_what_the_agent_would_release_over_the_ratio_of_a_pool() {
    let mut env = NodeEnv::new("node-breaker").await;
    env.nad().await;
    // Allocations of pods elsewhere: the agent never looks at them.
    for i in 0..5 {
        let other = format!("other-{i}");
        env.allocate(20 + i, &format!("sandbox-of-{other}"), &other)
            .await;
    }
    let mut sandboxes = Vec::new();
    for i in 0..7 {
        let name = format!("web-{i}");
        let uid = env.pod(&name).await;
        let id = env.run_sandbox(&name, &uid).await;
        env.allocate(10 + i, &id, &name).await;
        if i % 2 == 1 {
            env.set_network_status(&name, &format!("192.0.2.{}", 40 + i))
                .await;
        }
        sandboxes.push(id);
    }
    assert_eq!(env.keys().await.len(), 12);
    env.start(&["--sandbox-grace=1s", "--max-release-ratio=0.5"])
        .await;
    env.wait_metric(STARTED, 7.0).await;
    futures::future::join_all(sandboxes.iter().map(|id| env.stop_sandbox(id))).await;

    let released = r#"ipreclaim_node_dead_sandboxes_total{outcome="released"}"#;
    let held = r#"ipreclaim_node_dead_sandboxes_total{outcome="held"}"#;
    wait_for(
        "every sandbox released, or one held and looked at again",
        || async { env.metric(released).await >= 7.0 || env.metric(held).await >= 2.0 },
    )
    .await;
    assert!(
        env.metric(held).await > 0.0,
        "nothing held: {} released",
        env.metric(released).await
    );
    // Six of the twelve go (the writes of the last may still be landing), and no more while
    // the held sandbox is looked at again.
    env.wait_metric(released, 6.0).await;
    let looks = env.metric(held).await;
    wait_for("two more looks at the held sandbox", || async {
        env.metric(held).await >= looks + 2.0
    })
    .await;
    assert_eq!(env.metric(released).await, 6.0);
    assert_eq!(env.keys().await.len(), 6, "12 - 6 released");
    assert_eq!(
        env.metric(r#"ipreclaim_releases_total{reason="SandboxGone"}"#)
            .await,
        6.0
    );
    let holds = env.wait_events("IPAddressGarbageCollectionHeld").await;
    assert_eq!(holds.len(), 1, "reported once: {holds:?}");
    let (object, message) = &holds[0];
    assert_eq!(object, POOL);
    assert!(
        message.contains(&format!("node agent on node {}", env.node))
            && message.contains("would release 1 of 6 allocations")
            && message.contains("6 released by it in the last 10 min")
            && message.contains("--max-release-ratio 0.5")
            && message.contains("kubectl ipreclaim release"),
        "{message}"
    );
    env.stop().await;
}

#[tokio::test]
async fn a_runtime_outage_fails_healthz_and_recovers_without_lost_or_duplicated_events() {
    let mut env = NodeEnv::new("node-outage").await;
    let a = env.run_sandbox("a", "uid-a").await;
    let b = env.run_sandbox("b", "uid-b").await;
    env.start(&["--relist-threshold=1s"]).await;
    env.wait_metric(STARTED, 2.0).await;
    wait_for("healthz ok", || async {
        http_get(env.metrics, "/healthz").await.0 == 200
    })
    .await;
    let pid_b = sandbox_pid(&env.containerd, &b).await;
    assert_ne!(pid_b, sandbox_pid(&env.containerd, &a).await);

    env.containerd.stop().expect("stop containerd");
    wait_for("healthz failing while containerd is down", || async {
        let (code, body) = http_get(env.metrics, "/healthz").await;
        code == 503 && body.contains("pleg was last seen active")
    })
    .await;
    env.wait_metric("ipreclaim_node_pleg_healthy", 0.0).await;
    // B's sandbox dies while nobody is watching.
    // SAFETY: a pid we read from containerd for a process our test started.
    assert_eq!(unsafe { libc::kill(pid_b, libc::SIGKILL) }, 0);

    env.containerd.restart().await.expect("restart containerd");
    wait_for("healthz ok again", || async {
        http_get(env.metrics, "/healthz").await.0 == 200
    })
    .await;
    env.wait_metric(DIED, 1.0).await;
    // Several more relists: nothing is reported twice, nothing extra appears.
    env.wait_relists(5.0).await;
    assert_eq!(env.metric(STARTED).await, 2.0);
    assert_eq!(env.metric(DIED).await, 1.0);
    assert_eq!(env.metric(REMOVED).await, 0.0);
    assert!(env.metric("ipreclaim_node_relist_failures_total").await >= 1.0);
    env.wait_metric("ipreclaim_node_pleg_healthy", 1.0).await;
    env.stop().await;
}

#[tokio::test]
async fn dry_run_reports_a_dead_sandbox_and_writes_nothing() {
    let mut env = NodeEnv::new("node-dry").await;
    env.nad().await;
    let uid = env.pod("web-0").await;
    let s1 = env.sandbox_allocated("web-0", &uid, 30, "192.0.2.30").await;
    env.start(&["--sandbox-grace=0s", "--dry-run"]).await;
    env.wait_metric(STARTED, 1.0).await;
    env.stop_sandbox(&s1).await;
    env.set_network_status("web-0", "192.0.2.31").await;
    env.wait_metric(
        r#"ipreclaim_node_dead_sandboxes_total{outcome="dry_run"}"#,
        1.0,
    )
    .await;
    // Removed after its look: the second report must not bring it back (nothing was written,
    // so the entry is still there to be reported again).
    env.delete_sandbox(&s1).await;
    env.wait_metric(REMOVED, 1.0).await;
    env.wait_relists(3.0).await;
    assert_eq!(
        env.metric(r#"ipreclaim_node_dead_sandboxes_total{outcome="dry_run"}"#)
            .await,
        1.0,
        "a removal after the look is not a second death"
    );
    assert_eq!(env.keys().await, ["30"], "dry-run writes nothing");
    assert_eq!(env.reservations().await, ["192.0.2.30"]);
    let events = env.wait_events("IPAddressGarbageCollectionDryRun").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].1.contains("192.0.2.30") && events[0].1.contains("SandboxGone"),
        "{events:?}"
    );
    assert_eq!(
        env.metric(r#"ipreclaim_dry_run_releases_total{reason="SandboxGone"}"#)
            .await,
        1.0
    );
    let text = http_get(env.metrics, "/metrics").await.1;
    assert_eq!(
        metric_sum(&text, "ipreclaim_api_writes_total"),
        0.0,
        "{text}"
    );
    env.stop().await;
}

#[tokio::test]
async fn every_metric_the_reference_names_is_on_metrics() {
    let mut env = NodeEnv::new("agent-metrics-doc").await;
    env.start(&[]).await;
    // Some series appear with the first relist.
    env.wait_metric("ipreclaim_node_pleg_healthy", 1.0).await;
    let text = http_get(env.metrics, "/metrics").await.1;
    testenv::docs::assert_reference_metrics_on(&text, "ipreclaim_node_", 14);
    env.stop().await;
}
