//! End-to-end scenarios, written once over a [`Platform`]:
//!
//! - by default, the local control plane: the chart installed in a fresh namespace, the
//!   controller running in this process as the chart's ServiceAccount, and a stand-in for
//!   Multus + the whereabouts CNI that allocates the way the plugin does (no kubelet runs here,
//!   so a deleted pod never gets its CNI DEL: every deletion is a leak for ipreclaim);
//! - with `IPRECLAIM_E2E=kind`, a kind cluster prepared by `e2e/kind/run.sh` (Multus, the
//!   whereabouts CNI, ipreclaim's image and chart): real pods, a real StatefulSet, the real
//!   Deployment scaled to 0 and back.
//!
//! Each scenario ends by checking the pools (only live pods hold addresses) and the Events.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use clap::Parser;
use ipreclaim::api::{IPAllocation, IPPool, IPPoolSpec, NetworkAttachmentDefinition};
use ipreclaim::controller::{self, ControllerArgs};
use ipreclaim::ipam::{ip_at, parse_network_status};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testenv::ControlPlane;
use testenv::poll::wait_for;
use testenv::program::InProcess;

const NETWORK: &str = "macvlan";
const RANGE: &str = "192.0.2.0/24";
const POOL: &str = "192.0.2.0-24";
const STATUS: &str = "k8s.v1.cni.cncf.io/network-status";
const NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";
const GC_DONE: &str = "IPAddressGarbageCollected";

/// What the scenarios need from a cluster.
trait Platform {
    fn client(&self) -> &Client;
    /// Namespace of the pods and NAD.
    fn ns(&self) -> &str;
    /// Namespace of the pools.
    fn pool_ns(&self) -> &str;
    /// Whether a deleted pod's allocation is a leak (no CNI DEL runs), so an Event must follow.
    fn deletions_leak(&self) -> bool;
    /// Creates a pod on the macvlan network and returns once it holds an address.
    async fn create_pod(&mut self, name: &str);
    /// Deletes a pod and returns once it is gone from the API.
    async fn delete_pod(&mut self, name: &str);
    /// Scales the `web` StatefulSet (pods web-0..web-N-1) and returns once it has `n` pods
    /// holding addresses.
    async fn scale_statefulset(&mut self, n: usize);
    /// Scales the controller to `n` replicas (0 or 1 here).
    async fn scale_controller(&mut self, n: i32);
}

fn network(p: &impl Platform) -> String {
    format!("{}/{NETWORK}", p.ns())
}

/// Pods of the test namespace and the addresses their network-status lists.
async fn live_addresses(p: &impl Platform) -> BTreeMap<String, BTreeSet<String>> {
    let pods = Api::<Pod>::namespaced(p.client().clone(), p.ns())
        .list(&ListParams::default())
        .await
        .unwrap();
    pods.items
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .map(|pod| {
            let ips = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(STATUS))
                .and_then(|s| parse_network_status(s).ok())
                .unwrap_or_default()
                .into_iter()
                .flat_map(|n| n.ips)
                .map(|ip| ip.to_string())
                .collect();
            (pod.metadata.name.unwrap(), ips)
        })
        .collect()
}

/// The pool's allocations as (pod name, IP) of this namespace's pods.
async fn pool_holders(p: &impl Platform) -> BTreeSet<(String, String)> {
    let pool = Api::<IPPool>::namespaced(p.client().clone(), p.pool_ns())
        .get(POOL)
        .await
        .unwrap();
    let range = RANGE.parse().unwrap();
    let prefix = format!("{}/", p.ns());
    pool.spec
        .allocations
        .iter()
        .filter_map(|(offset, a)| {
            let name = a.podref.strip_prefix(&prefix)?;
            let ip = ip_at(&range, offset.parse().ok()?)?;
            Some((name.to_string(), ip.to_string()))
        })
        .collect()
}

/// Waits until the pool holds exactly the live pods' addresses.
async fn wait_pool_matches_live_pods(p: &impl Platform) {
    wait_for(
        "the pool to hold exactly the live pods' addresses",
        || async {
            let live: BTreeSet<(String, String)> = live_addresses(p)
                .await
                .into_iter()
                .flat_map(|(name, ips)| ips.into_iter().map(move |ip| (name.clone(), ip)))
                .collect();
            pool_holders(p).await == live
        },
    )
    .await;
}

async fn gc_events_for(p: &impl Platform, pod: &str) -> Vec<String> {
    let lp = ListParams::default().fields(&format!("reason={GC_DONE},involvedObject.name={pod}"));
    Api::<CoreEvent>::namespaced(p.client().clone(), p.ns())
        .list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.message)
        .collect()
}

async fn expect_release_event(p: &impl Platform, pod: &str) {
    if !p.deletions_leak() {
        return;
    }
    let net = network(p);
    wait_for(&format!("a {GC_DONE} Event for {pod}"), || async {
        gc_events_for(p, pod)
            .await
            .iter()
            .any(|n| n.contains(&format!("from network {net}")))
    })
    .await;
}

async fn deleting_pods_frees_their_addresses(mut p: impl Platform) {
    for name in ["a-0", "a-1", "a-2"] {
        p.create_pod(name).await;
    }
    wait_pool_matches_live_pods(&p).await;
    p.delete_pod("a-0").await;
    p.delete_pod("a-2").await;
    wait_pool_matches_live_pods(&p).await;
    expect_release_event(&p, "a-0").await;
    expect_release_event(&p, "a-2").await;
    assert!(
        gc_events_for(&p, "a-1").await.is_empty(),
        "a live pod got no release"
    );
    assert_eq!(pool_holders(&p).await.len(), 1);
}

async fn a_statefulset_scaled_down_and_up_keeps_only_live_addresses(mut p: impl Platform) {
    p.scale_statefulset(3).await;
    wait_pool_matches_live_pods(&p).await;
    p.scale_statefulset(1).await;
    wait_pool_matches_live_pods(&p).await;
    expect_release_event(&p, "web-2").await;
    p.scale_statefulset(3).await;
    wait_pool_matches_live_pods(&p).await;
    let holders = pool_holders(&p).await;
    let names: BTreeSet<&str> = holders.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, BTreeSet::from(["web-0", "web-1", "web-2"]));
}

async fn a_pod_deleted_while_the_controller_is_scaled_to_zero_is_freed_on_return(
    mut p: impl Platform,
) {
    p.create_pod("b-0").await;
    p.create_pod("b-1").await;
    wait_pool_matches_live_pods(&p).await;
    p.scale_controller(0).await;
    p.delete_pod("b-0").await;
    p.scale_controller(1).await;
    wait_pool_matches_live_pods(&p).await;
    expect_release_event(&p, "b-0").await;
    assert!(pool_holders(&p).await.iter().all(|(n, _)| n == "b-1"));
}

/// Runs a scenario on the platform chosen by `IPRECLAIM_E2E` (`local`, the default, or `kind`).
macro_rules! scenario {
    ($name:ident) => {
        #[tokio::test]
        async fn $name() {
            match std::env::var("IPRECLAIM_E2E").as_deref() {
                Ok("kind") => super::$name(Kind::new(stringify!($name)).await).await,
                Ok("local") | Err(_) => super::$name(Local::new(stringify!($name)).await).await,
                Ok(other) => panic!("IPRECLAIM_E2E={other:?}: use local or kind"),
            }
        }
    };
}

mod e2e {
    use super::{Kind, Local};
    scenario!(deleting_pods_frees_their_addresses);
    scenario!(a_statefulset_scaled_down_and_up_keeps_only_live_addresses);
    scenario!(a_pod_deleted_while_the_controller_is_scaled_to_zero_is_freed_on_return);
}

async fn create_nad(client: &Client, ns: &str) {
    let nad: NetworkAttachmentDefinition = serde_json::from_value(json!({
        "apiVersion": "k8s.cni.cncf.io/v1",
        "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": NETWORK},
        "spec": {"config": format!(
            r#"{{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","mode":"bridge","ipam":{{"type":"whereabouts","range":"{RANGE}"}}}}"#
        )}
    }))
    .unwrap();
    Api::<NetworkAttachmentDefinition>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &nad)
        .await
        .unwrap();
}

/// The local control plane, with the controller in process as the chart's ServiceAccount and
/// a stand-in for Multus + whereabouts.
struct Local {
    client: Client,
    ns: String,
    controller_client: Client,
    controller: Option<InProcess>,
    sandboxes: u64,
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ControllerArgs,
}

impl Local {
    async fn new(prefix: &str) -> Local {
        let cp = ControlPlane::shared();
        let client = cp.client().await;
        cp.install_crds(&client).await.expect("install crds/");
        let short: String = prefix.chars().take(20).collect();
        let ns = cp.namespace(&client, &short).await;
        testenv::helm::install_in(cp, &ns).expect("helm install");
        let controller_client =
            testenv::helm::service_account_client(cp, &client, &ns, "controller").await;
        create_nad(&client, &ns).await;
        let pool = IPPool::new(
            POOL,
            IPPoolSpec {
                range: RANGE.into(),
                allocations: BTreeMap::new(),
            },
        );
        Api::<IPPool>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &pool)
            .await
            .unwrap();
        let mut local = Local {
            client,
            ns,
            controller_client,
            controller: None,
            sandboxes: 0,
        };
        local.scale_controller(1).await;
        local
    }

    /// What the whereabouts CNI does on ADD: the lowest free offset, written with a patch that
    /// tests the resourceVersion (retried on conflict); then Multus's network-status.
    async fn allocate(&mut self, pod: &str) {
        self.sandboxes += 1;
        let sandbox = format!("sandbox-{pod}-{}", self.sandboxes);
        let pools = Api::<IPPool>::namespaced(self.client.clone(), &self.ns);
        let ip = loop {
            let current = pools.get(POOL).await.unwrap();
            let offset = (1u32..255)
                .find(|o| !current.spec.allocations.contains_key(&o.to_string()))
                .expect("a free address");
            let alloc = IPAllocation {
                id: sandbox.clone(),
                podref: format!("{}/{pod}", self.ns),
                ifname: Some("net1".into()),
                ipamclaimref: None,
            };
            let patch: json_patch::Patch = serde_json::from_value(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": current.metadata.resource_version},
                {"op": "add", "path": format!("/spec/allocations/{offset}"), "value": alloc},
            ]))
            .unwrap();
            match pools
                .patch(POOL, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
            {
                Ok(_) => break ip_at(&RANGE.parse().unwrap(), u128::from(offset)).unwrap(),
                Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => continue,
                Err(e) => panic!("allocate: {e}"),
            }
        };
        let status = json!([{"name": format!("{}/{NETWORK}", self.ns), "interface": "net1", "ips": [ip.to_string()]}]);
        let patch = json!({"metadata": {"annotations": {STATUS: status.to_string()}}});
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }
}

impl Platform for Local {
    fn client(&self) -> &Client {
        &self.client
    }
    fn ns(&self) -> &str {
        &self.ns
    }
    fn pool_ns(&self) -> &str {
        &self.ns
    }
    fn deletions_leak(&self) -> bool {
        true
    }

    async fn create_pod(&mut self, name: &str) {
        let annotations = BTreeMap::from([(NETWORKS.to_string(), NETWORK.to_string())]);
        let pod = testenv::fixtures::pod(name, Some(annotations));
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        self.allocate(name).await;
    }

    async fn delete_pod(&mut self, name: &str) {
        // No kubelet: the pod goes at once and no CNI DEL ever runs.
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    async fn scale_statefulset(&mut self, n: usize) {
        // What the StatefulSet controller does: ordinal pods, removed from the top.
        let existing: BTreeSet<String> = live_addresses(self).await.into_keys().collect();
        for i in 0..16 {
            let name = format!("web-{i}");
            match (i < n, existing.contains(&name)) {
                (true, false) => self.create_pod(&name).await,
                (false, true) => self.delete_pod(&name).await,
                _ => {}
            }
        }
    }

    async fn scale_controller(&mut self, n: i32) {
        match (n, self.controller.take()) {
            (0, Some(mut running)) => running.stop().await,
            (1, None) => {
                let lease_ns = format!("--lease-namespace={}", self.ns);
                let wns = format!("--whereabouts-namespace={}", self.ns);
                let args = Cli::try_parse_from([
                    "controller",
                    &wns,
                    "--sweep-interval=200ms",
                    "--leak-grace=0s",
                    "--lease-name=ipreclaim-controller",
                    &lease_ns,
                    "--metrics-addr=127.0.0.1:0",
                ])
                .expect("flags")
                .args;
                let client = self.controller_client.clone();
                let (running, _) = InProcess::start(
                    "controller",
                    |shutdown, started| {
                        controller::run(client, args, shutdown, move |r| {
                            let _ = started.send(r.health.clone());
                        })
                    },
                    |health| health.is_ready(),
                )
                .await;
                self.controller = Some(running);
            }
            (_, running) => self.controller = running,
        }
    }
}

/// A kind cluster prepared by `e2e/kind/run.sh`: the chart is installed in
/// `$IPRECLAIM_E2E_NAMESPACE` (default `ipreclaim`), whereabouts keeps its pools in
/// `kube-system`, and `KUBECONFIG` points at the cluster.
struct Kind {
    client: Client,
    ns: String,
    release_ns: String,
}

const KIND_WAIT: Duration = Duration::from_secs(120);

impl Kind {
    async fn new(prefix: &str) -> Kind {
        let client = Client::try_default()
            .await
            .expect("KUBECONFIG for the kind cluster (run e2e/kind/run.sh)");
        let ns = format!(
            "e2e-{}",
            prefix
                .replace('_', "-")
                .chars()
                .take(40)
                .collect::<String>()
        );
        let ns = ns.trim_end_matches('-').to_string();
        let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
        let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
        wait_for("an old test namespace to go", || async {
            namespaces.get_opt(&ns).await.unwrap().is_none()
        })
        .await;
        let obj = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        namespaces
            .create(&PostParams::default(), &obj)
            .await
            .unwrap();
        create_nad(&client, &ns).await;
        Kind {
            client,
            ns,
            release_ns: std::env::var("IPRECLAIM_E2E_NAMESPACE").unwrap_or("ipreclaim".into()),
        }
    }

    async fn wait_running_with_address(&self, name: &str) {
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns);
        let deadline = tokio::time::Instant::now() + KIND_WAIT;
        loop {
            if let Some(p) = pods.get_opt(name).await.unwrap() {
                let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                let has_ip = p
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(STATUS))
                    .and_then(|s| parse_network_status(s).ok())
                    .is_some_and(|n| n.iter().any(|a| !a.ips.is_empty()));
                if running && has_ip {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "pod {name} never ran with an address"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Platform for Kind {
    fn client(&self) -> &Client {
        &self.client
    }
    fn ns(&self) -> &str {
        &self.ns
    }
    fn pool_ns(&self) -> &str {
        "kube-system"
    }
    fn deletions_leak(&self) -> bool {
        // The kubelet runs the CNI DEL; whoever frees the address, the pool must end clean.
        false
    }

    async fn create_pod(&mut self, name: &str) {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {NETWORKS: NETWORK}},
            "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}]}
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
        wait_for(&format!("pod {name} gone"), || async {
            pods.get_opt(name).await.unwrap().is_none()
        })
        .await;
    }

    async fn scale_statefulset(&mut self, n: usize) {
        let sts = Api::<StatefulSet>::namespaced(self.client.clone(), &self.ns);
        if sts.get_opt("web").await.unwrap().is_none() {
            let s: StatefulSet = serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {
                    "replicas": 0,
                    "serviceName": "web",
                    "selector": {"matchLabels": {"app": "web"}},
                    "template": {
                        "metadata": {"labels": {"app": "web"}, "annotations": {NETWORKS: NETWORK}},
                        "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}]}
                    }
                }
            }))
            .unwrap();
            sts.create(&PostParams::default(), &s).await.unwrap();
        }
        let patch = json!({"spec": {"replicas": n}});
        sts.patch("web", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        for i in 0..n {
            self.wait_running_with_address(&format!("web-{i}")).await;
        }
        let pods = Api::<Pod>::namespaced(self.client.clone(), &self.ns);
        wait_for("scaled-down pods gone", || async {
            let mut gone = true;
            for i in n..16 {
                gone &= pods.get_opt(&format!("web-{i}")).await.unwrap().is_none();
            }
            gone
        })
        .await;
    }

    async fn scale_controller(&mut self, n: i32) {
        let deployments = Api::<Deployment>::namespaced(self.client.clone(), &self.release_ns);
        let name = "ipreclaim-controller";
        let patch = json!({"spec": {"replicas": n}});
        deployments
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        wait_for(&format!("controller at {n} ready replicas"), || async {
            let d = deployments.get(name).await.unwrap();
            d.status.and_then(|s| s.ready_replicas).unwrap_or(0) == n
        })
        .await;
    }
}

#[test]
fn e2e_and_ci_scripts_are_shellcheck_clean() {
    let root = testenv::procs::workspace_root();
    let mut scripts = Vec::new();
    for dir in ["e2e", "e2e/kind", "e2e/controlplane", "scripts"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "sh") {
                scripts.push(path);
            }
        }
    }
    scripts.push(root.join(".ci/run"));
    assert!(scripts.len() >= 5, "found {scripts:?}");
    let out = std::process::Command::new("shellcheck")
        // Follow `source`d files relative to each script.
        .args(["-x", "-P", "SCRIPTDIR"])
        .args(&scripts)
        .output()
        .expect("shellcheck (apt-get install shellcheck; scripts/setup.sh does)");
    assert!(
        out.status.success(),
        "shellcheck:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
