//! End-to-end scenarios, written once over a [`Platform`]:
//!
//! - `local`: the local control plane with the chart installed in a fresh namespace, the
//!   controller running in this process as the chart's ServiceAccount, and a stand-in for
//!   Multus + the whereabouts CNI that allocates the way the plugin does (no kubelet runs there,
//!   so a deleted pod never gets its CNI DEL: every deletion is a leak for ipreclaim);
//! - `cluster`: a real cluster where the kubelet runs the pods and the real Multus and
//!   whereabouts plugins write the allocations, with ipreclaim installed by its chart as pods:
//!   by default testenv's real node on this machine (`node.rs`), with `IPRECLAIM_E2E=kind` a kind
//!   cluster prepared by `e2e/kind/run.sh`.
//!
//! The node-only scenarios (`node_only::`) crash and reboot the node.
//! Each scenario ends by checking the pools (only live pods hold addresses) and the Events.

// The root tier: compiled empty without `--features root-tests` (see Cargo.toml).
#![cfg(feature = "root-tests")]

#[path = "../support/mod.rs"]
mod support;

/// One `#[tokio::test]` per `scenario: "prefix"`, running the scenario of the enclosing file on
/// testenv's real node (`Cluster::node(prefix)`). Defined before the modules that use it.
macro_rules! on_the_node {
    ($($scenario:ident: $prefix:literal),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $scenario() {
                super::$scenario(crate::cluster::Cluster::node($prefix).await).await
            }
        )*
    };
}

mod cluster;
mod duplicates;
mod fencing;
mod helm_test;
mod kind_churn;
mod kind_nodes;
mod local;
mod node_only;
mod returning_kubelet;

use std::collections::{BTreeMap, BTreeSet};

use ipreclaim::api::IPPool;
use ipreclaim::ipam::{NETWORK_STATUS_ANNOTATION, ip_at, parse_network_status};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};
use testenv::poll::wait_for;

const NETWORK: &str = "macvlan";
const RANGE: &str = "192.0.2.0/24";
const GC_DONE: &str = "IPAddressGarbageCollected";
const GC_FAILED: &str = "IPAddressGarbageCollectionFailed";

/// What the scenarios need from a cluster.
trait Platform {
    fn client(&self) -> &Client;
    /// Namespace of the pods and NAD.
    fn ns(&self) -> &str;
    /// Namespace of the pools.
    fn pool_ns(&self) -> &str;
    /// Name of the pool of the test network.
    fn pool(&self) -> &str;
    /// Whether a deleted pod's allocation is a leak (no CNI DEL runs), so an Event must follow.
    fn deletions_leak(&self) -> bool;
    /// Creates a pod on the test network and returns once it holds an address.
    async fn create_pod(&mut self, name: &str);
    /// Deletes a pod and returns once it is gone from the API.
    async fn delete_pod(&mut self, name: &str);
    /// Scales the `web` StatefulSet (pods web-0..web-N-1) and returns once it has `n` pods
    /// holding addresses.
    async fn scale_statefulset(&mut self, n: usize);
    /// Deletes StatefulSet pod `name` and returns once its replacement (same name, another
    /// uid) holds an address.
    async fn recreate_statefulset_pod(&mut self, name: &str);
    /// Stops the controller (`0`) or runs it again (`1`; a real cluster at the chart's
    /// replica count).
    async fn scale_controller(&mut self, n: i32);
}

fn network(p: &impl Platform) -> String {
    format!("{}/{NETWORK}", p.ns())
}

/// The test network's addresses in a pod's network-status.
fn test_network_ips(pod: &Pod, network: &str) -> BTreeSet<String> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NETWORK_STATUS_ANNOTATION))
        .and_then(|s| parse_network_status(s).ok())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| *n.name == *network)
        .flat_map(|n| n.ips.to_vec())
        .map(|ip| ip.to_string())
        .collect()
}

/// Pods of the test namespace and the test network's addresses their network-status lists.
async fn live_addresses(p: &impl Platform) -> BTreeMap<String, BTreeSet<String>> {
    let pods = Api::<Pod>::namespaced(p.client().clone(), p.ns())
        .list(&ListParams::default())
        .await
        .unwrap();
    let net = network(p);
    pods.items
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .map(|pod| {
            let ips = test_network_ips(&pod, &net);
            (pod.metadata.name.unwrap(), ips)
        })
        .collect()
}

/// The pool's allocations as (pod name, IP) of this namespace's pods (none before the first
/// allocation created the pool).
async fn pool_holders(p: &impl Platform) -> BTreeSet<(String, String)> {
    pool_entries(p)
        .await
        .into_iter()
        .map(|(name, ip, _)| (name, ip))
        .collect()
}

/// The pool's allocations as (pod name, IP, sandbox id) of this namespace's pods.
async fn pool_entries(p: &impl Platform) -> Vec<(String, String, String)> {
    let Some(pool) = Api::<IPPool>::namespaced(p.client().clone(), p.pool_ns())
        .get_opt(p.pool())
        .await
        .unwrap()
    else {
        return Vec::new();
    };
    let range = RANGE.parse().unwrap();
    let prefix = format!("{}/", p.ns());
    pool.spec
        .allocations
        .iter()
        .filter_map(|(offset, a)| {
            let name = a.podref.strip_prefix(&prefix)?;
            let ip = ip_at(&range, offset.parse().ok()?)?;
            Some((name.to_string(), ip.to_string(), a.id.clone()))
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

async fn events_for(p: &impl Platform, reason: &str, pod: Option<&str>) -> Vec<String> {
    testenv::events::with_reason(p.client(), p.ns(), reason, pod)
        .await
        .into_iter()
        .filter_map(|e| e.message)
        .collect()
}

async fn gc_events_for(p: &impl Platform, pod: &str) -> Vec<String> {
    events_for(p, GC_DONE, Some(pod)).await
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

/// No release failed, and no pod's address was released twice (one Event at most per pod).
async fn expect_clean_releases(p: &impl Platform) {
    let failed = events_for(p, GC_FAILED, None).await;
    assert!(failed.is_empty(), "release failures: {failed:?}");
    let done = testenv::events::with_reason(p.client(), p.ns(), GC_DONE, None).await;
    for e in &done {
        assert!(
            e.count.unwrap_or(1) <= 1 && e.series.is_none(),
            "an address released more than once: {e:?}"
        );
    }
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
    expect_clean_releases(&p).await;
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
    expect_clean_releases(&p).await;
}

async fn a_statefulset_pod_recreated_under_its_name_keeps_only_the_new_address(
    mut p: impl Platform,
) {
    p.scale_statefulset(2).await;
    wait_pool_matches_live_pods(&p).await;
    let before = pool_entries(&p).await;
    let old = before
        .iter()
        .find(|(n, _, _)| n == "web-0")
        .cloned()
        .expect("web-0 holds an entry");
    p.recreate_statefulset_pod("web-0").await;
    wait_pool_matches_live_pods(&p).await;
    let after = pool_entries(&p).await;
    let web0: Vec<_> = after.iter().filter(|(n, _, _)| n == "web-0").collect();
    assert_eq!(web0.len(), 1, "web-0 holds one entry: {after:?}");
    assert_ne!(
        web0[0].2, old.2,
        "the entry is the new sandbox's, not the old one's"
    );
    expect_release_event(&p, "web-0").await;
    expect_clean_releases(&p).await;
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
    expect_clean_releases(&p).await;
}

/// Runs a scenario twice: `local` (the stand-in) and `cluster` (testenv's real node, or the
/// kind cluster with `IPRECLAIM_E2E=kind`).
macro_rules! scenario {
    ($name:ident) => {
        mod $name {
            use crate::cluster::Cluster;
            use crate::local::Local;

            #[tokio::test]
            async fn local() {
                crate::$name(Local::new(stringify!($name)).await).await
            }

            #[tokio::test]
            async fn cluster() {
                crate::$name(Cluster::from_env(stringify!($name)).await).await
            }
        }
    };
}

mod e2e {
    scenario!(deleting_pods_frees_their_addresses);
    scenario!(a_statefulset_scaled_down_and_up_keeps_only_live_addresses);
    scenario!(a_statefulset_pod_recreated_under_its_name_keeps_only_the_new_address);
    scenario!(a_pod_deleted_while_the_controller_is_scaled_to_zero_is_freed_on_return);
}

#[test]
fn e2e_and_ci_scripts_are_shellcheck_clean() {
    let root = testenv::procs::workspace_root();
    let mut scripts = Vec::new();
    for dir in ["e2e", "e2e/kind", "e2e/node", "e2e/controlplane", "scripts"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "sh") {
                scripts.push(path);
            }
        }
    }
    scripts.push(root.join(".ci/run"));
    assert!(scripts.len() >= 5, "found {scripts:?}");
    // -x -P SCRIPTDIR: follow `source`d files relative to each script.
    testenv::procs::assert_shellcheck_clean("shellcheck", &["-x", "-P", "SCRIPTDIR"], &scripts);
}
