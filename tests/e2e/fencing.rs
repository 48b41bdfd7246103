//! Fencing on testenv's real node: the kubelet is killed, kube-controller-manager turns the Node
//! NotReady, and a StatefulSet pod is force-deleted as an operator does to get it scheduled
//! elsewhere. Its sandbox still runs with its address, so the address must stay allocated
//! until the node is back and settled (or its Node is deleted).

use ipreclaim::api::IPFence;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, DeleteParams};
use testenv::node::NODE_NAME;

use crate::cluster::{Cluster, RELEASE_NS, wait_long};
use crate::node_only::{
    controller_pod_metrics, controller_pods_metrics, kubectl_events, reservations, set_chart_values,
};
use crate::{GC_DONE, Platform, expect_clean_releases, pool_entries, wait_pool_matches_live_pods};

pub(crate) const FENCED: &str = "IPAddressGarbageCollectionFenced";

/// web-0's (ip, sandbox id) in the pool.
pub(crate) async fn web_0_entry(c: &Cluster) -> (String, String) {
    let entries = pool_entries(c).await;
    let web: Vec<_> = entries.iter().filter(|(n, _, _)| n == "web-0").collect();
    assert_eq!(web.len(), 1, "one entry for web-0: {entries:?}");
    (web[0].1.clone(), web[0].2.clone())
}

/// The Fenced Events of the namespace as (name, resourceVersion): a repeat of an Event
/// updates it.
async fn fenced_event_versions(c: &Cluster) -> Vec<(String, String)> {
    testenv::events::with_reason(c.client(), c.ns(), FENCED, None)
        .await
        .into_iter()
        .map(|e| {
            (
                e.metadata.name.unwrap_or_default(),
                e.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect()
}

/// The pool's fence records (`IPFence` objects in the pools' namespace).
pub(crate) async fn fences(c: &Cluster) -> Vec<IPFence> {
    testenv::fixtures::list_all(&Api::<IPFence>::namespaced(c.client().clone(), c.pool_ns()))
        .await
        .into_iter()
        .filter(|f| f.spec.pool == c.pool())
        .collect()
}

/// The pool's fence records as "name=spec".
pub(crate) async fn fence_records(c: &Cluster) -> Vec<String> {
    fences(c)
        .await
        .into_iter()
        .map(|f| {
            let spec = serde_json::to_string(&f.spec).unwrap();
            format!("{}={spec}", f.metadata.name.unwrap_or_default())
        })
        .collect()
}

/// The pod name of the controller replica holding the Lease.
pub(crate) async fn lease_holder(client: &kube::Client) -> String {
    let lease = Api::<Lease>::namespaced(client.clone(), RELEASE_NS)
        .get("ipreclaim-controller")
        .await
        .unwrap();
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    // The identity is `<pod name>_<run>`.
    holder.split('_').next().unwrap_or_default().to_string()
}

/// SIGKILLs the `ipreclaim controller` process of pod `pod` on this host.
fn kill_controller_process(pod: &str) {
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_controller = args.first().is_some_and(|a| a.ends_with(b"ipreclaim"))
            && args.get(1) == Some(&&b"controller"[..]);
        let of_pod = environ
            .split(|b| *b == 0)
            .any(|v| v == format!("POD_NAME={pod}").as_bytes());
        if is_controller && of_pod {
            // SAFETY: kill has no memory preconditions.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
            killed += 1;
        }
    }
    assert_eq!(killed, 1, "the controller process of pod {pod}");
}

/// Kills the kubelet, waits for the Node to turn NotReady, force-deletes web-0 and waits for
/// its Fenced Event; checks the entry is kept, marked, with its sandbox id and reservation.
pub(crate) async fn crash_and_force_delete_web_0(c: &Cluster, ip: &str, id: &str) {
    lose_node_and_force_delete(c, Outage::Crash, &[("web-0", ip, id)]).await;
}

/// How the node drops out.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outage {
    /// Its kubelet is killed: back, it knows no pod the API no longer lists, and stops their
    /// sandboxes at once.
    Crash,
    /// Its kubelet is cut off from the apiserver and lives on: back, it stops a pod deleted
    /// meanwhile with its own copy of it, so with the pod's whole grace period.
    Partition,
}

/// Takes the node out (`outage`), waits for the Node to turn NotReady, force-deletes each of
/// `pods` (name, ip, sandbox id) and waits for their Fenced Events; checks each entry is kept,
/// marked, with its sandbox id and reservation, and one fence record per pod.
pub(crate) async fn lose_node_and_force_delete(
    c: &Cluster,
    outage: Outage,
    pods: &[(&str, &str, &str)],
) {
    let node = c.node_handle();
    match outage {
        Outage::Crash => node.kill_kubelet().unwrap(),
        Outage::Partition => node.cut_kubelet_off(),
    }
    node.wait_node_ready(false).await.unwrap();
    // The controllers' Node watch lags the apiserver by a moment; a pod deleted before they
    // see the node down is, by design, not fenced.
    wait_long(
        "every controller replica sees the node not Ready",
        || async {
            controller_pods_metrics(c.client())
                .await
                .iter()
                .all(|m| m.lines().any(|l| l == "ipreclaim_unready_nodes 1"))
        },
    )
    .await;
    for (name, _, _) in pods {
        Api::<Pod>::namespaced(c.client().clone(), c.ns())
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    let ns = c.ns().to_string();
    for (name, ip, id) in pods {
        wait_long(&format!("a Fenced Event for {name} in kubectl"), || async {
            kubectl_events(node, &ns, FENCED).iter().any(|e| {
                e.starts_with(&format!("{name} "))
                    && e.contains(&format!("[{ip}]"))
                    && e.contains(&format!("node {NODE_NAME} was not Ready"))
            })
        })
        .await;
        let entries = pool_entries(c).await;
        assert!(
            entries.contains(&(format!("{name}:fenced"), ip.to_string(), id.to_string())),
            "the entry kept, its podref marked so no pod named {name} reuses it: {entries:?}"
        );
        assert!(
            reservations(c)
                .await
                .contains(&format!("{}-{ip} {}/{name}", c.ns(), c.ns())),
            "the reservation stays with the fence"
        );
    }
    let fences = fence_records(c).await;
    assert_eq!(fences.len(), pods.len(), "{fences:?}");
}

/// web-0 of a one-pod StatefulSet, fenced: its node crashed and it was force-deleted (see
/// [`crash_and_force_delete_web_0`]). Returns its address and sandbox id.
async fn fenced_web_0(c: &mut Cluster) -> (String, String) {
    c.scale_statefulset(1).await;
    wait_pool_matches_live_pods(c).await;
    let (ip, id) = web_0_entry(c).await;
    crash_and_force_delete_web_0(c, &ip, &id).await;
    (ip, id)
}

/// Waits until `ip` is released by ipreclaim (its entry and fence record gone, a release Event
/// for web-0) with the kubelet still down; `what` says why it should be.
async fn wait_released_with_the_kubelet_down(c: &Cluster, ip: &str, what: &str) {
    let ns = c.ns().to_string();
    wait_long(what, || async {
        let entries = pool_entries(c).await;
        !entries.iter().any(|(_, i, _)| *i == ip)
            && fence_records(c).await.is_empty()
            && kubectl_events(c.node_handle(), &ns, GC_DONE)
                .iter()
                .any(|e| e.starts_with("web-0 ") && e.contains(&format!("[{ip}]")))
    })
    .await;
}

/// Starts the kubelet again and waits until web-0's replacement runs with an address and the
/// pool matches the live pods.
async fn kubelet_back(c: &Cluster) {
    c.node_handle().start_kubelet().await.unwrap();
    c.wait_running_with_address("web-0").await;
    wait_pool_matches_live_pods(c).await;
}

async fn a_statefulset_pod_force_deleted_from_a_notready_node_keeps_its_address_until_the_node_settles(
    mut c: Cluster,
) {
    let node = c.node_handle();
    c.create_pod("c-0").await;
    c.scale_statefulset(1).await;
    wait_pool_matches_live_pods(&c).await;
    // A normal deletion on a Ready node: released as before, no fence.
    c.delete_pod("c-0").await;
    wait_pool_matches_live_pods(&c).await;
    let (ip, id) = web_0_entry(&c).await;

    crash_and_force_delete_web_0(&c, &ip, &id).await;
    // A failover while fenced: the leader is killed (kill -9 of its process on the host; with
    // the kubelet down nothing restarts it) and the standby, which reads the fence back from the
    // pool, takes over and keeps it.
    let client = c.client().clone();
    let leader = lease_holder(&client).await;
    kill_controller_process(&leader);
    wait_long("the standby to take the Lease", || async {
        let holder = lease_holder(&client).await;
        holder != leader && !holder.is_empty()
    })
    .await;
    // Held while the node stays down: the new leader's gauge shows the fence ageing.
    let new_leader = lease_holder(&client).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let scrape = controller_pod_metrics(&client, &new_leader).await;
        let held = scrape.as_ref().is_ok_and(|t| {
            testenv::poll::metric_value(t, "ipreclaim_fenced_addresses") == 1.0
                && testenv::poll::metric_value(t, "ipreclaim_fence_oldest_age_seconds") >= 10.0
        });
        if held {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the new leader {new_leader} does not show the fence held for 10 s: {}",
            match &scrape {
                Ok(t) => t
                    .lines()
                    .filter(|l| l.starts_with("ipreclaim_fence"))
                    .collect::<Vec<_>>()
                    .join("; "),
                Err(e) => e.clone(),
            }
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert!(
        pool_entries(&c)
            .await
            .contains(&("web-0:fenced".into(), ip.clone(), id.clone())),
        "still fenced"
    );

    node.start_kubelet().await.unwrap();
    c.wait_running_with_address("web-0").await;
    let (new_ip, new_id) = web_0_entry(&c).await;
    assert_ne!(
        new_ip, ip,
        "the replacement got another address while the old one was fenced"
    );
    assert_ne!(new_id, id);
    // The old sandbox is torn down (its CNI DEL frees the entry) or the settle period ends
    // (ipreclaim frees it): either way once, and the fence record goes.
    wait_long(
        "the fenced address released and its record cleared",
        || async {
            let entries = pool_entries(&c).await;
            !entries.iter().any(|(_, i, _)| *i == ip)
                && fence_records(&c).await.is_empty()
                && !reservations(&c)
                    .await
                    .iter()
                    .any(|r| r.contains(&format!("-{ip} ")))
        },
    )
    .await;
    wait_pool_matches_live_pods(&c).await;
    let ns = c.ns().to_string();
    let fenced = kubectl_events(node, &ns, FENCED);
    assert!(
        fenced.iter().all(|e| e.starts_with("web-0 ")),
        "only web-0 was fenced (c-0 was deleted on a Ready node): {fenced:?}"
    );
    let released = kubectl_events(node, &ns, GC_DONE);
    assert!(
        released
            .iter()
            .filter(|e| e.starts_with("web-0 ") && e.contains(&format!("[{ip}]")))
            .count()
            <= 1,
        "{released:?}"
    );
    expect_clean_releases(&c).await;
}

async fn a_fence_lifts_at_once_when_the_node_object_is_deleted(mut c: Cluster) {
    let (ip, _) = fenced_web_0(&mut c).await;

    // The operator declares the node dead. (Its kubelet is started again right after: pods
    // bound to a missing Node are garbage-collected after 40 s, the chart's included.)
    Api::<NodeObject>::all(c.client().clone())
        .delete(NODE_NAME, &DeleteParams::default())
        .await
        .unwrap();
    wait_released_with_the_kubelet_down(
        &c,
        &ip,
        "web-0's address released with the kubelet still down",
    )
    .await;
    kubelet_back(&c).await;
    expect_clean_releases(&c).await;
}

/// Sets or clears the `node.kubernetes.io/out-of-service` taint on the node (read, change,
/// replace: the node lifecycle controller changes its taints too).
async fn taint_out_of_service(c: &Cluster, on: bool) {
    taint_out_of_service_with(c, on, "NoExecute").await;
}

/// [`taint_out_of_service`] with the taint's `effect` (Kubernetes takes NoExecute or
/// NoSchedule for a non-graceful node shutdown).
pub(crate) async fn taint_out_of_service_with(c: &Cluster, on: bool, effect: &str) {
    let nodes = Api::<NodeObject>::all(c.client().clone());
    for _ in 0..10 {
        let mut node = nodes.get(NODE_NAME).await.unwrap();
        let spec = node.spec.get_or_insert_with(Default::default);
        let taints = spec.taints.get_or_insert_with(Vec::new);
        taints.retain(|t| t.key != OUT_OF_SERVICE);
        if on {
            taints.push(k8s_openapi::api::core::v1::Taint {
                key: OUT_OF_SERVICE.into(),
                value: Some("nodeshutdown".into()),
                effect: effect.into(),
                ..Default::default()
            });
        }
        match nodes.replace(NODE_NAME, &Default::default(), &node).await {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => panic!("could not change the node's taints: {e}"),
        }
    }
    panic!("the node's taints kept changing");
}

const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

/// Non-graceful node shutdown on the real node: the operator taints the NotReady node
/// out-of-service (declares it powered off), and the fence lifts at once with the kubelet
/// still down (the settle is the chart's 60 s default and would not start before the kubelet
/// is back).
async fn a_fence_lifts_at_once_when_the_node_is_tainted_out_of_service(mut c: Cluster) {
    let (ip, _) = fenced_web_0(&mut c).await;
    taint_out_of_service(&c, true).await;
    wait_released_with_the_kubelet_down(
        &c,
        &ip,
        "web-0's address released on the out-of-service taint, the kubelet still down",
    )
    .await;
    // The node is repaired: the operator removes the taint and the kubelet comes back.
    taint_out_of_service(&c, false).await;
    kubelet_back(&c).await;
    expect_clean_releases(&c).await;
}

/// `--fence-timeout` releases with the node still down; `--fence-unready-nodes=false` releases
/// at once as before fencing existed. Both set through the chart's values (`helm upgrade`).
async fn a_fence_timeout_or_fencing_off_releases_with_the_node_down(mut c: Cluster) {
    let node = c.node_handle();
    let client = c.client().clone();
    set_chart_values(node, &client, &["controller.fence.timeout=20s"]).await;
    let (ip, _) = fenced_web_0(&mut c).await;
    let fenced_at = std::time::Instant::now();
    let ns = c.ns().to_string();
    wait_long("the fence to time out with the node down", || async {
        !pool_entries(&c).await.iter().any(|(_, i, _)| *i == ip)
    })
    .await;
    let held = fenced_at.elapsed();
    assert!(
        held >= std::time::Duration::from_secs(15),
        "released {held:?} after the Fenced Event: before the 20 s timeout"
    );
    assert!(
        kubectl_events(node, &ns, GC_DONE)
            .iter()
            .any(|e| e.starts_with("web-0 ") && e.contains(&format!("[{ip}]"))),
        "released by ipreclaim (the kubelet is still down)"
    );
    node.wait_node_ready(false).await.unwrap();
    kubelet_back(&c).await;

    set_chart_values(node, &client, &["controller.fence.unreadyNodes=false"]).await;
    let (ip, _) = web_0_entry(&c).await;
    let fenced_before = fenced_event_versions(&c).await;
    node.kill_kubelet().unwrap();
    node.wait_node_ready(false).await.unwrap();
    Api::<Pod>::namespaced(client.clone(), c.ns())
        .delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    wait_long("web-0 released at once, unfenced", || async {
        !pool_entries(&c).await.iter().any(|(_, i, _)| *i == ip)
    })
    .await;
    assert_eq!(
        fenced_event_versions(&c).await,
        fenced_before,
        "no Fenced Event created or updated with fencing off"
    );
    kubelet_back(&c).await;
    set_chart_values(node, &client, &[]).await;
    expect_clean_releases(&c).await;
}

/// The node removes sandbox `id` while Multus's cache of it is lost: the CNI DEL then cannot
/// reach the secondary networks (Multus finds neither its cache nor the pod, and gives up with
/// success), so whereabouts never frees the fenced entry, as on a node whose CNI cache did not
/// survive. Through CRI, with the kubelet down. (With the cache, the CNI DEL would free the
/// entry itself: the fence leaves its sandbox id on it for that.)
async fn remove_sandbox_without_its_cni_del(node: &testenv::Node, id: &str) {
    std::fs::remove_file(node.dir().join("multus-cache").join(id)).expect("Multus's cache file");
    let mut cri = node.containerd().client().await.expect("CRI client");
    cri.stop_pod_sandbox(k8s_cri::v1::StopPodSandboxRequest {
        pod_sandbox_id: id.into(),
    })
    .await
    .expect("StopPodSandbox");
    cri.remove_pod_sandbox(k8s_cri::v1::RemovePodSandboxRequest {
        pod_sandbox_id: id.into(),
    })
    .await
    .expect("RemovePodSandbox");
}

/// The force-deleted pod's sandbox goes from the node without a CNI DEL that frees its entry.
/// With a settle of 10 minutes and the kubelet still down, only the node agent's evidence can
/// lift the fence within the wait: it sees no sandbox of the pod in a complete listing,
/// reports it in the fence's status, and the controller releases the address at once with a
/// release Event that says so.
async fn a_fence_lifts_on_the_node_agents_evidence_once_the_old_sandbox_is_gone(mut c: Cluster) {
    let node = c.node_handle();
    let client = c.client().clone();
    set_chart_values(node, &client, &["controller.fence.settle=10m"]).await;
    let (ip, id) = fenced_web_0(&mut c).await;
    let fence = fences(&c).await.into_iter().next().expect("web-0's fence");
    assert_eq!(
        fence.status.and_then(|s| s.sandboxes_gone),
        None,
        "the old sandbox still runs"
    );

    assert_eq!(fence.spec.sandbox, id);
    remove_sandbox_without_its_cni_del(node, &id).await;
    let removed = std::time::Instant::now();
    let ns = c.ns().to_string();
    wait_long(
        "the fenced address released on the node agent's evidence",
        || async {
            !pool_entries(&c).await.iter().any(|(_, i, _)| *i == ip)
                && fence_records(&c).await.is_empty()
        },
    )
    .await;
    println!(
        "freed {:?} after the sandbox was removed (settle 10m, kubelet down)",
        removed.elapsed()
    );
    let released = kubectl_events(node, &ns, GC_DONE);
    assert!(
        released.iter().any(|e| e.starts_with("web-0 ")
            && e.contains(&format!("[{ip}]"))
            && e.contains("fence lifted: the node agent on its node saw the pod's sandboxes gone")),
        "{released:?}"
    );

    kubelet_back(&c).await;
    set_chart_values(node, &client, &[]).await;
    expect_clean_releases(&c).await;
}

mod fencing_scenarios {
    on_the_node! {
        a_statefulset_pod_force_deleted_from_a_notready_node_keeps_its_address_until_the_node_settles: "fence-settle",
        a_fence_timeout_or_fencing_off_releases_with_the_node_down: "fence-values",
        a_fence_lifts_on_the_node_agents_evidence_once_the_old_sandbox_is_gone: "fence-evidence",
        a_fence_lifts_at_once_when_the_node_is_tainted_out_of_service: "fence-oos",
        a_fence_lifts_at_once_when_the_node_object_is_deleted: "fence-node-gone",
    }
}
