//! The real-cluster platform: the kubelet runs the pods, the real Multus and whereabouts
//! plugins write the allocations and run CNI DEL, and ipreclaim runs as pods installed by its
//! chart. Two flavours:
//!
//! - the node (default): testenv's real node on this machine, started once per test process;
//!   the chart is installed from `charts/` into `ipreclaim` with an image built here without
//!   Docker, and whereabouts' and Multus's own CRDs;
//! - kind (`IPRECLAIM_E2E=kind`): a cluster prepared by `e2e/kind/run.sh`, `KUBECONFIG`
//!   pointing at it, the chart in `$IPRECLAIM_E2E_NAMESPACE` (default `ipreclaim`).

use std::time::Duration;

use ipreclaim::ipam::NETWORKS_ANNOTATION;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testenv::Node;
use testenv::poll::wait_for_within;
use tokio::sync::{Mutex, MutexGuard, OnceCell};

use crate::local::{create_nad, macvlan_config};
use crate::{NETWORK, Platform, RANGE, network, test_network_ips};

/// How long a real pod may take to run with an address, or a scale to settle.
const WAIT: Duration = Duration::from_secs(120);
/// The chart's release and namespace on the node.
pub const RELEASE_NS: &str = "ipreclaim";
/// The chart's controller replicas (its default, and what the node installs).
pub const CONTROLLER_REPLICAS: i32 = 2;
/// The ipreclaim image built for the node from the Dockerfile (`scripts/image.sh` with
/// `IMAGE=localhost/ipreclaim/ipreclaim:e2e` tags it `<IMAGE>-<arch>`).
pub const IMAGE: &str = "localhost/ipreclaim/ipreclaim:e2e-amd64";

/// Scenarios on the node take turns: some crash or reboot it.
static TURN: Mutex<()> = Mutex::const_new(());
static INSTALLED: OnceCell<()> = OnceCell::const_new();

pub struct Cluster {
    client: Client,
    ns: String,
    release_ns: String,
    pool: String,
    pod_image: String,
    /// The test pods' `terminationGracePeriodSeconds`.
    grace_seconds: i64,
    /// The node, when the cluster is testenv's.
    node: Option<&'static Node>,
    _turn: Option<MutexGuard<'static, ()>>,
}

/// Polls `check` every 500 ms until it holds, failing after [`WAIT`] with `what`.
pub async fn wait_long<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    wait_for_within(what, WAIT, Duration::from_millis(500), check).await
}

fn test_namespace(prefix: &str) -> String {
    let ns: String = format!("e2e-{}", prefix.replace('_', "-"))
        .chars()
        .take(40)
        .collect();
    ns.trim_end_matches('-').to_string()
}

/// Deletes a namespace left by an earlier run and creates it afresh.
async fn fresh_namespace(client: &Client, ns: &str) {
    let namespaces = Api::<Namespace>::all(client.clone());
    let _ = namespaces.delete(ns, &DeleteParams::default()).await;
    wait_long("an old test namespace to go", || async {
        namespaces.get_opt(ns).await.unwrap().is_none()
    })
    .await;
    let obj = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
    namespaces
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
}

impl Cluster {
    /// The cluster `IPRECLAIM_E2E` names: `kind`, or testenv's node (unset or `node`).
    pub async fn from_env(prefix: &str) -> Cluster {
        match std::env::var("IPRECLAIM_E2E").as_deref() {
            Ok("kind") => Cluster::kind(prefix).await,
            Ok("node") | Err(_) => Cluster::node(prefix).await,
            Ok(other) => panic!("IPRECLAIM_E2E={other:?}: use node (the default) or kind"),
        }
    }

    pub async fn kind(prefix: &str) -> Cluster {
        let client = Client::try_default()
            .await
            .expect("KUBECONFIG for the kind cluster (run e2e/kind/run.sh)");
        let ns = test_namespace(prefix);
        fresh_namespace(&client, &ns).await;
        create_nad(&client, &ns, &macvlan_config()).await;
        Cluster {
            client,
            ns,
            release_ns: std::env::var("IPRECLAIM_E2E_NAMESPACE").unwrap_or(RELEASE_NS.into()),
            pool: "192.0.2.0-24".into(),
            // The pause image the kind node has (run.sh names the one its node image holds).
            pod_image: std::env::var("IPRECLAIM_E2E_POD_IMAGE")
                .unwrap_or("registry.k8s.io/pause:3.10".into()),
            grace_seconds: 1,
            node: None,
            _turn: None,
        }
    }

    pub async fn node(prefix: &str) -> Cluster {
        let turn = TURN.lock().await;
        let node: &'static Node = tokio::task::spawn_blocking(Node::shared)
            .await
            .expect("node start");
        node.ensure_running()
            .await
            .expect("the node running again after an earlier scenario");
        let client = node.client().await;
        INSTALLED
            .get_or_init(|| crate::node_only::install_ipreclaim(node, &client))
            .await;
        crate::node_only::ensure_default_chart_values(node, &client).await;
        let ns = test_namespace(prefix);
        fresh_namespace(&client, &ns).await;
        // A network name per namespace: each scenario gets pools of its own in kube-system.
        let config = json!({
            "cniVersion": "0.3.1",
            "type": "bridge",
            "bridge": testenv::node::SECONDARY_BRIDGE,
            "isGateway": false,
            "ipMasq": false,
            "ipam": {
                "type": "whereabouts",
                "range": RANGE,
                "network_name": ns,
                "configuration_path": node.whereabouts_conf(),
            },
        })
        .to_string();
        create_nad(&client, &ns, &config).await;
        Cluster {
            client,
            pool: format!("{ns}-192.0.2.0-24"),
            ns,
            release_ns: RELEASE_NS.into(),
            pod_image: testenv::containerd::SANDBOX_IMAGE.into(),
            grace_seconds: 1,
            node: Some(node),
            _turn: Some(turn),
        }
    }

    /// testenv's node; the node-only scenarios need it.
    pub fn node_handle(&self) -> &'static Node {
        self.node
            .expect("this scenario crashes or reboots the node: it runs on testenv's node only")
    }

    /// Pods created from now on, the `web` StatefulSet's included when it does not exist yet,
    /// run a container that ignores SIGTERM, with a termination grace period of `grace`
    /// seconds: the kubelet stops them only by SIGKILL at the end of it (testenv's node only).
    pub async fn pods_ignoring_sigterm(&mut self, grace: i64) {
        crate::node_only::import_ignore_sigterm_image(self.node_handle()).await;
        self.pod_image = testenv::containerd::IGNORE_SIGTERM_IMAGE.into();
        self.grace_seconds = grace;
    }

    /// Pods created from now on run `image` (already on the kind nodes) with a termination
    /// grace period of `grace` seconds.
    pub fn set_pod_image(&mut self, image: &str, grace: i64) {
        self.pod_image = image.into();
        self.grace_seconds = grace;
    }

    pub(crate) fn pod_spec(&self) -> serde_json::Value {
        json!({
            "terminationGracePeriodSeconds": self.grace_seconds,
            "containers": [{
                "name": "app",
                "image": self.pod_image,
                "imagePullPolicy": if self.node.is_some() { "Never" } else { "IfNotPresent" },
            }],
        })
    }

    /// The pod `name` when it runs and its network-status lists a test-network address.
    pub async fn running_with_address(&self, name: &str) -> Option<Pod> {
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns);
        let p = pods.get_opt(name).await.unwrap()?;
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let has_ip = !test_network_ips(&p, &network(self)).is_empty();
        (running && has_ip && p.metadata.deletion_timestamp.is_none()).then_some(p)
    }

    pub async fn wait_running_with_address(&self, name: &str) {
        wait_long(&format!("pod {name} running with an address"), || async {
            self.running_with_address(name).await.is_some()
        })
        .await;
    }

    /// Creates StatefulSet `name` with no replicas if it is missing.
    async fn ensure_statefulset(&self, name: &str) -> Api<StatefulSet> {
        self.ensure_statefulset_on(name, None).await
    }

    /// Creates StatefulSet `name` with no replicas if it is missing, its pods on `node` when
    /// given (a kind worker the multi-node scenarios stop).
    pub async fn ensure_statefulset_on(&self, name: &str, node: Option<&str>) -> Api<StatefulSet> {
        let sts = Api::<StatefulSet>::namespaced(self.client.clone(), &self.ns);
        if sts.get_opt(name).await.unwrap().is_none() {
            let mut spec = self.pod_spec();
            if let Some(node) = node {
                spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
            }
            let s: StatefulSet = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {
                    "replicas": 0,
                    "serviceName": name,
                    "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": {"app": name}},
                    "template": {
                        "metadata": {"labels": {"app": name}, "annotations": {NETWORKS_ANNOTATION: NETWORK}},
                        "spec": spec,
                    }
                }
            }))
            .unwrap();
            sts.create(&PostParams::default(), &s).await.unwrap();
        }
        sts
    }
}

impl Platform for Cluster {
    fn client(&self) -> &Client {
        &self.client
    }
    fn ns(&self) -> &str {
        &self.ns
    }
    fn pool_ns(&self) -> &str {
        "kube-system"
    }
    fn pool(&self) -> &str {
        &self.pool
    }
    fn deletions_leak(&self) -> bool {
        // The kubelet runs the CNI DEL; whoever frees the address, the pool must end clean.
        false
    }

    async fn create_pod(&mut self, name: &str) {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {NETWORKS_ANNOTATION: NETWORK}},
            "spec": self.pod_spec(),
        }))
        .unwrap();
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        self.wait_running_with_address(name).await;
    }

    async fn delete_pod(&mut self, name: &str) {
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns);
        pods.delete(name, &DeleteParams::default()).await.unwrap();
        wait_long(&format!("pod {name} gone"), || async {
            pods.get_opt(name).await.unwrap().is_none()
        })
        .await;
    }

    async fn scale_statefulset(&mut self, n: usize) {
        self.scale_statefulset_named("web", n).await
    }

    async fn recreate_statefulset_pod(&mut self, name: &str) {
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns);
        let old = pods.get(name).await.unwrap().metadata.uid;
        pods.delete(name, &DeleteParams::default()).await.unwrap();
        wait_long(&format!("{name} recreated with an address"), || async {
            self.running_with_address(name)
                .await
                .is_some_and(|p| p.metadata.uid != old)
        })
        .await;
    }

    async fn scale_controller(&mut self, n: i32) {
        let n = if n > 0 { CONTROLLER_REPLICAS } else { 0 };
        let deployments = Api::<Deployment>::namespaced(self.client.clone(), &self.release_ns);
        let name = "ipreclaim-controller";
        let patch = json!({"spec": {"replicas": n}});
        deployments
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        wait_long(&format!("controller at {n} ready replicas"), || async {
            let d = deployments.get(name).await.unwrap();
            let status = d.status.unwrap_or_default();
            status.ready_replicas.unwrap_or(0) == n && status.replicas.unwrap_or(0) == n
        })
        .await;
    }
}

impl Cluster {
    /// Scales StatefulSet `name` (created like `web` if missing) and returns once it has `n`
    /// pods holding addresses and no pod beyond them.
    pub async fn scale_statefulset_named(&mut self, name: &str, n: usize) {
        let sts = self.ensure_statefulset(name).await;
        let patch = json!({"spec": {"replicas": n}});
        sts.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        for i in 0..n {
            self.wait_running_with_address(&format!("{name}-{i}")).await;
        }
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns);
        wait_long("scaled-down pods gone", || async {
            let mut gone = true;
            for i in n..16 {
                gone &= pods
                    .get_opt(&format!("{name}-{i}"))
                    .await
                    .unwrap()
                    .is_none();
            }
            gone
        })
        .await;
    }
}

/// Waits until the chart's controller Deployment has `replicas` ready pods and its node agent
/// DaemonSet is ready on every node.
pub async fn wait_chart_ready(client: &Client, ns: &str, replicas: i32) {
    let deployments = Api::<Deployment>::namespaced(client.clone(), ns);
    let daemonsets = Api::<DaemonSet>::namespaced(client.clone(), ns);
    wait_long("the chart's pods Ready", || async {
        let d = deployments
            .get_opt("ipreclaim-controller")
            .await
            .unwrap()
            .and_then(|d| d.status)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
        let ds = daemonsets
            .get_opt("ipreclaim-node-agent")
            .await
            .unwrap()
            .and_then(|d| d.status);
        let agents_ready = ds.is_some_and(|s| {
            s.desired_number_scheduled > 0 && s.number_ready == s.desired_number_scheduled
        });
        d == replicas && agents_ready
    })
    .await;
}
