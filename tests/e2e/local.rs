//! The local platform: the shared control plane, the chart installed in a fresh namespace,
//! the controller in this process as the chart's ServiceAccount, and a stand-in for Multus and
//! the whereabouts CNI (no kubelet: a deleted pod never gets its CNI DEL).

use std::collections::{BTreeMap, BTreeSet};

use ipreclaim::api::IPPool;
use ipreclaim::ipam::{NETWORK_STATUS_ANNOTATION, NETWORKS_ANNOTATION, ip_at};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testenv::ControlPlane;

use crate::support::{self, Program, TEST_TIMINGS};
use crate::{NETWORK, Platform, RANGE, live_addresses};

const POOL: &str = "192.0.2.0-24";

/// A macvlan NAD config over `eth0` with whereabouts IPAM on the test range.
pub fn macvlan_config() -> String {
    json!({
        "cniVersion": "0.3.1", "type": "macvlan", "master": "eth0", "mode": "bridge",
        "ipam": {"type": "whereabouts", "range": RANGE},
    })
    .to_string()
}

/// Creates the test network's NAD with `config`.
pub async fn create_nad(client: &Client, ns: &str, config: &str) {
    support::create_nad(client, ns, NETWORK, config).await;
}

/// The local control plane, with the controller in process as the chart's ServiceAccount and
/// a stand-in for Multus + whereabouts.
pub struct Local {
    client: Client,
    ns: String,
    controller_client: Client,
    controller: Option<Program>,
    sandboxes: u64,
}

impl Local {
    pub async fn new(prefix: &str) -> Local {
        let cp = ControlPlane::shared();
        let client = cp.client().await;
        cp.install_crds(&client).await.expect("install crds/");
        let short: String = prefix.chars().take(20).collect();
        let ns = cp.namespace(&client, &short).await;
        let controller_client = testenv::helm::install_as(cp, &client, &ns, "controller").await;
        create_nad(&client, &ns, &macvlan_config()).await;
        support::create_pool(&client, &ns, POOL, RANGE, BTreeMap::new()).await;
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

    /// What the whereabouts CNI does on ADD, then Multus's network-status ([`allocate_as_cni`]).
    async fn allocate(&mut self, pod: &str) {
        self.sandboxes += 1;
        let sandbox = format!("sandbox-{pod}-{}", self.sandboxes);
        allocate_as_cni(&self.client, &self.ns, POOL, &self.ns, pod, &sandbox).await;
    }
}

/// What the whereabouts CNI does on ADD for pod `ns/pod` with sandbox id `sandbox`, in pool
/// `pool_ns/pool`: the lowest free offset, written with a patch that tests the
/// resourceVersion (retried on conflict); then Multus's network-status on the pod. Returns
/// the address.
pub(crate) async fn allocate_as_cni(
    client: &Client,
    pool_ns: &str,
    pool: &str,
    ns: &str,
    pod: &str,
    sandbox: &str,
) -> String {
    let pools = Api::<IPPool>::namespaced(client.clone(), pool_ns);
    let ip = loop {
        let current = pools.get(pool).await.unwrap();
        let offset = (1u32..255)
            .find(|o| !current.spec.allocations.contains_key(&o.to_string()))
            .expect("a free address");
        let alloc = support::allocation(ns, pod, sandbox);
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": current.metadata.resource_version},
            {"op": "add", "path": format!("/spec/allocations/{offset}"), "value": alloc},
        ]))
        .unwrap();
        match pools
            .patch(pool, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => break ip_at(&RANGE.parse().unwrap(), u128::from(offset)).unwrap(),
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => continue,
            Err(e) => panic!("allocate: {e}"),
        }
    };
    let status =
        json!([{"name": format!("{ns}/{NETWORK}"), "interface": "net1", "ips": [ip.to_string()]}]);
    let patch =
        json!({"metadata": {"annotations": {NETWORK_STATUS_ANNOTATION: status.to_string()}}});
    Api::<Pod>::namespaced(client.clone(), ns)
        .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    ip.to_string()
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
    fn pool(&self) -> &str {
        POOL
    }
    fn deletions_leak(&self) -> bool {
        true
    }

    async fn create_pod(&mut self, name: &str) {
        let annotations = BTreeMap::from([(NETWORKS_ANNOTATION.to_string(), NETWORK.to_string())]);
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

    async fn recreate_statefulset_pod(&mut self, name: &str) {
        // What the StatefulSet controller does: the same name, a new pod and sandbox.
        self.delete_pod(name).await;
        self.create_pod(name).await;
    }

    async fn scale_controller(&mut self, n: i32) {
        match (n, self.controller.take()) {
            (0, Some(mut running)) => running.stop().await,
            (1, None) => {
                let lease_ns = format!("--lease-namespace={}", self.ns);
                let mut flags = TEST_TIMINGS.to_vec();
                flags.extend(["--lease-name=ipreclaim-controller", &lease_ns]);
                let client = self.controller_client.clone();
                let running = support::controller(client, &self.ns, &flags).await;
                self.controller = Some(running);
            }
            (_, running) => self.controller = running,
        }
    }
}
