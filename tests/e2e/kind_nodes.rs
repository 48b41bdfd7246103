//! Scenarios that need several real nodes: the kind cluster of `e2e/kind/run.sh`
//! (`IPRECLAIM_E2E=kind`, `DOCKER_HOST` of the engine that runs its node containers). On
//! testenv's single node they have nothing to run on and return at once, saying so.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use ipreclaim::api::OverlappingRangeIPReservation;
use ipreclaim::ipam::NETWORKS_ANNOTATION;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{ContainerState, ListContainersRequest, StopContainerRequest};
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use testenv::poll::{metric_value, wait_for_within};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::cluster::{Cluster, RELEASE_NS, wait_long};
use crate::fencing::{FENCED, fence_records, fences, lease_holder, web_0_entry};
use crate::node_only::controller_pod_metrics;
use crate::returning_kubelet::Timeline;
use crate::returning_kubelet::{Sandbox, sandbox_state};
use crate::{
    GC_DONE, NETWORK, Platform, expect_clean_releases, pool_entries, wait_pool_matches_live_pods,
};

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

    /// Pauses `node` until it is NotReady and the controller's `leader` counts it so.
    async fn until_seen_down(client: &kube::Client, node: &str, leader: &str) -> Paused {
        let paused = Paused::new(node);
        wait_for_within(
            &format!("node {node} NotReady"),
            NODE_DOWN,
            Duration::from_millis(500),
            || async { !node_ready(client, node).await },
        )
        .await;
        wait_long("the leader sees the node not Ready", || async {
            controller_pod_metrics(client, leader)
                .await
                .is_ok_and(|t| metric_value(&t, "ipreclaim_unready_nodes") >= 1.0)
        })
        .await;
        paused
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["unpause", &self.0])
            .stdout(std::process::Stdio::null())
            .status();
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

    // A pod deleted before the leader sees its node down is, by design, not fenced.
    let paused = Paused::until_seen_down(&client, &worker, &leader).await;
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

/// The termination grace period of the returning-kubelet scenario's pod: longer than the
/// chart's fence settle (60 s) is not needed, only longer than the agent's few listings and
/// than the kubelet's minimum (2 s), so that a fence lifted on a timer, or a release on
/// deletion, would free the address while the pod still runs.
const GRACE: i64 = 60;

/// `e2e/kind/run.sh`'s kind binary and cluster (it exports both; CI's kind is on PATH).
fn kind_load_image_archive(archive: &Path) {
    let kind = std::env::var("IPRECLAIM_KIND").unwrap_or_else(|_| "kind".into());
    let cluster =
        std::env::var("IPRECLAIM_KIND_CLUSTER").unwrap_or_else(|_| "ipreclaim-e2e".into());
    let out = Command::new(&kind)
        .args(["load", "image-archive", "--name", &cluster])
        .arg(archive)
        .output()
        .expect("run kind");
    assert!(
        out.status.success(),
        "{kind} load image-archive {}: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// [`testenv::containerd::IGNORE_SIGTERM_IMAGE`] on every kind node, once per test process.
async fn load_ignore_sigterm_image() {
    static LOADED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    LOADED
        .get_or_init(|| async {
            tokio::task::spawn_blocking(|| {
                let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kind-ignore-sigterm");
                std::fs::create_dir_all(&dir).unwrap();
                let archive = testenv::containerd::build_ignore_sigterm_image(&dir)
                    .expect("build the SIGTERM-ignoring image");
                kind_load_image_archive(&archive);
            })
            .await
            .unwrap()
        })
        .await;
}

fn docker_out(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().expect("docker");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A CRI client of kind node `node`'s containerd (what `crictl` in the node container talks
/// to), through the node container's root; `None` if it does not answer in 5 s.
async fn node_cri(node: &str) -> Option<RuntimeServiceClient<Channel>> {
    let pid = docker_out(&["inspect", "-f", "{{.State.Pid}}", node]);
    let socket = PathBuf::from(format!("/proc/{pid}/root/run/containerd/containerd.sock"));
    let connect = async move {
        let channel =
            Endpoint::try_from("http://[::]:50051")?
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let socket = socket.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?))
                    }
                }))
                .await?;
        Ok::<_, tonic::transport::Error>(RuntimeServiceClient::new(channel))
    };
    tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .ok()?
        .ok()
}

/// Sandbox `id` on kind node `node` as its runtime shows it; `None` if the runtime does not
/// answer in 5 s.
async fn kind_sandbox(node: &str, id: &str) -> Option<Sandbox> {
    let mut cri = node_cri(node).await?;
    tokio::time::timeout(Duration::from_secs(5), sandbox_state(&mut cri, id))
        .await
        .ok()?
        .ok()
}

/// The ids of the running kube-apiserver containers on kind node `node`.
async fn apiserver_containers(node: &str) -> Vec<String> {
    let Some(mut cri) = node_cri(node).await else {
        return Vec::new();
    };
    let Ok(Ok(listed)) = tokio::time::timeout(
        Duration::from_secs(5),
        cri.list_containers(ListContainersRequest::default()),
    )
    .await
    else {
        return Vec::new();
    };
    listed
        .into_inner()
        .containers
        .into_iter()
        .filter(|c| {
            c.state == ContainerState::ContainerRunning as i32
                && c.labels
                    .get("io.kubernetes.container.name")
                    .map(String::as_str)
                    == Some("kube-apiserver")
        })
        .map(|c| c.id)
        .collect()
}

/// Stops the kind cluster's kube-apiserver container (its kubelet starts it again) and waits
/// until the apiserver is ready: a kubelet whose watch was open then cannot resume it when it
/// returns and re-lists, as after a partition longer than the watch window.
async fn restart_kind_apiserver(client: &kube::Client) {
    let cp = Api::<NodeObject>::all(client.clone())
        .list(&ListParams::default().labels("node-role.kubernetes.io/control-plane"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find_map(|n| n.metadata.name)
        .expect("a control-plane node");
    let old = apiserver_containers(&cp).await;
    assert_eq!(old.len(), 1, "one running kube-apiserver on {cp}: {old:?}");
    let mut cri = node_cri(&cp).await.expect("the control plane's CRI");
    cri.stop_container(StopContainerRequest {
        container_id: old[0].clone(),
        timeout: 0,
    })
    .await
    .expect("stop kube-apiserver");
    let started = Instant::now();
    wait_for_within(
        "the kind apiserver restarted and ready",
        Duration::from_secs(300),
        Duration::from_secs(1),
        || async {
            let now = apiserver_containers(&cp).await;
            if now.is_empty() || now == old {
                return false;
            }
            let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
            matches!(
                tokio::time::timeout(Duration::from_secs(5), client.request_text(req)).await,
                Ok(Ok(body)) if body.trim() == "ok"
            )
        },
    )
    .await;
    println!(
        "kube-apiserver restarted, ready {:.1}s after the stop",
        started.elapsed().as_secs_f64()
    );
}

/// Whether reservation `name` is of address `ip` (whereabouts names it by the address, with
/// the network name before it when the network has one).
fn reservation_of(name: &str, ip: &str) -> bool {
    name == ip || name.ends_with(&format!("-{ip}"))
}

/// The reservations of the pools' namespace, by name.
async fn reservation_names(c: &Cluster) -> Vec<String> {
    let api = Api::<OverlappingRangeIPReservation>::namespaced(c.client().clone(), c.pool_ns());
    testenv::fixtures::list_all(&api)
        .await
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .collect()
}

/// From `back` (the worker unpaused) every 500 ms until the fenced pod's sandbox is removed
/// from `worker`'s runtime and its entry, reservation and fence record are gone: the pool,
/// the reservations, the fence's status and the node's runtime. Fails as soon as the entry or
/// the reservation is gone while the pod's container still runs.
async fn watch_the_return(
    c: &Cluster,
    worker: &str,
    pods: &[(&str, &str, &str)],
    back: Instant,
    limit: Duration,
) -> Vec<Timeline> {
    let mut returns = vec![Timeline::default(); pods.len()];
    loop {
        let now = back.elapsed();
        let entries = pool_entries(c).await;
        let reserved = reservation_names(c).await;
        let fenced = fences(c).await;
        let mut done = true;
        for (&(name, ip, id), r) in pods.iter().zip(returns.iter_mut()) {
            let fence = fenced.iter().find(|f| f.spec.sandbox == id);
            let sandbox = kind_sandbox(worker, id).await;
            let first = |at: &mut Option<Duration>, seen: bool| {
                if seen && at.is_none() {
                    *at = Some(now);
                }
            };
            let entry = entries.iter().any(|(_, i, s)| i == ip && s == id);
            let reservation = reserved.iter().any(|n| reservation_of(n, ip));
            let report = |which: fn(
                &ipreclaim::api::IPFenceStatus,
            ) -> Option<&ipreclaim::api::SandboxReport>| {
                fence.is_some_and(|f| {
                    let uid = f.metadata.uid.as_deref().unwrap_or_default();
                    f.status
                        .as_ref()
                        .and_then(which)
                        .is_some_and(|rep| rep.fence_uid == uid && rep.node == worker)
                })
            };
            first(
                &mut r.present_reported,
                report(|s| s.sandboxes_present.as_ref()),
            );
            first(&mut r.gone_reported, report(|s| s.sandboxes_gone.as_ref()));
            if let Some(sandbox) = sandbox {
                first(&mut r.containers_stopped, sandbox != Sandbox::Running);
                first(
                    &mut r.sandbox_stopped,
                    matches!(sandbox, Sandbox::Stopped | Sandbox::Removed),
                );
                first(&mut r.sandbox_removed, sandbox == Sandbox::Removed);
            }
            first(&mut r.entry_gone, !entry);
            first(&mut r.reservation_gone, !reservation);
            first(&mut r.fence_gone, fence.is_none());
            if sandbox == Some(Sandbox::Running) && (!entry || !reservation) {
                panic!(
                    "{name}'s address {ip} was freed while its container still ran on {worker} \
                     (sandbox {id}, {:.1}s after the worker returned; entry kept: {entry}, \
                     reservation kept: {reservation}). {r}. Release Events: {:?}",
                    now.as_secs_f64(),
                    testenv::events::with_reason(c.client(), c.ns(), GC_DONE, None)
                        .await
                        .into_iter()
                        .filter_map(|e| e.message)
                        .collect::<Vec<_>>(),
                );
            }
            done &= r.sandbox_removed.is_some() && !entry && !reservation && fence.is_none();
        }
        if done {
            return returns;
        }
        assert!(
            now < limit,
            "not every pod stopped, removed and freed within {limit:?} of the return: {}",
            pods.iter()
                .zip(&returns)
                .map(|((name, ip, _), r)| format!("{name} {ip}: {r}"))
                .collect::<Vec<_>>()
                .join("; ")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Creates pod `name` on `node` and waits until it runs with an address.
async fn create_pod_on(c: &Cluster, name: &str, node: &str) {
    let mut spec = c.pod_spec();
    spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {NETWORKS_ANNOTATION: NETWORK}},
        "spec": spec,
    }))
    .unwrap();
    Api::<Pod>::namespaced(c.client().clone(), c.ns())
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    c.wait_running_with_address(name).await;
}

/// Pod `name`'s (ip, sandbox id) in the pool.
async fn entry_of(c: &Cluster, name: &str) -> (String, String) {
    let entries = pool_entries(c).await;
    let of: Vec<_> = entries.iter().filter(|(n, _, _)| n == name).collect();
    assert_eq!(of.len(), 1, "one entry for {name}: {entries:?}");
    (of[0].1.clone(), of[0].2.clone())
}

/// The node agent's evidence on the returning worker. Two StatefulSet pods whose container
/// ignores SIGTERM (grace [`GRACE`]), web-0 and db-0, run on a worker that is frozen
/// (`docker pause`) until its Node is NotReady; both are force-deleted and their addresses
/// fenced. Multus's cache of db-0's sandbox was removed on the node before (as a node whose
/// `/var/lib/cni` was lost): its CNI DEL will never reach whereabouts. Meanwhile a pod on the
/// healthy worker is deleted and freed as usual. The apiserver restarts while the worker is
/// away (its kubelet must re-list on return, as after a long partition), then the worker
/// returns: its kubelet stops the old pods with its own copy, so with the whole grace period.
/// Each address must stay (entry and reservation, fenced) until its pod's container stopped;
/// the node agent there reports `sandboxesPresent` on each fence meanwhile. web-0 is freed by
/// its own CNI DEL; db-0's fence is held by the agent's "still present" past the settle
/// (Ready for 75 s) while its stopped sandbox lingers, and lifts on the agent's
/// `sandboxesGone` once the kubelet removed the sandbox.
pub(crate) async fn a_returning_workers_agent_reports_the_fenced_pod_present_until_its_kubelet_stopped_it(
    mut c: Cluster,
) {
    let started = Instant::now();
    let at = || format!("[{:.0}s]", started.elapsed().as_secs_f64());
    let client = c.client().clone();
    let (worker, leader) = worker_without_the_leader(&client).await;
    let healthy = Api::<NodeObject>::all(client.clone())
        .list(&ListParams::default().labels("!node-role.kubernetes.io/control-plane"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .find(|n| *n != worker)
        .expect("a second worker");
    create_pod_on(&c, "calm", &healthy).await;
    load_ignore_sigterm_image().await;
    c.set_pod_image(testenv::containerd::IGNORE_SIGTERM_IMAGE, GRACE);
    for set in ["web", "db"] {
        c.ensure_statefulset_on(set, Some(&worker)).await;
        c.scale_statefulset_named(set, 1).await;
    }
    wait_pool_matches_live_pods(&c).await;
    let web = entry_of(&c, "web-0").await;
    let db = entry_of(&c, "db-0").await;
    let calm = entry_of(&c, "calm").await;
    println!(
        "{} web-0 {} and db-0 {} on {worker}, calm {} on {healthy}; leader {leader}",
        at(),
        web.0,
        db.0,
        calm.0
    );
    // db-0's CNI DEL will not reach whereabouts: Multus finds no cache of its delegates.
    let cache = format!("/var/lib/cni/multus/{}", db.1);
    docker(&["exec", &worker, "test", "-f", &cache]);
    docker(&["exec", &worker, "rm", &cache]);

    let paused_at = Instant::now();
    let paused = Paused::until_seen_down(&client, &worker, &leader).await;
    println!(
        "{} {worker} NotReady {:.0}s after the pause",
        at(),
        paused_at.elapsed().as_secs_f64()
    );
    let lost = [("web-0", &web), ("db-0", &db)];
    for (name, (ip, id)) in lost {
        Api::<Pod>::namespaced(client.clone(), c.ns())
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
        wait_long(&format!("a Fenced Event for {name}"), || async {
            testenv::events::with_reason(&client, c.ns(), FENCED, Some(name))
                .await
                .iter()
                .any(|e| {
                    let m = e.message.as_deref().unwrap_or_default();
                    m.contains(&format!("[{ip}]"))
                        && m.contains(&format!("node {worker} was not Ready"))
                })
        })
        .await;
        let fence = fences(&c)
            .await
            .into_iter()
            .find(|f| f.spec.sandbox == *id)
            .unwrap_or_else(|| panic!("{name}'s IPFence"));
        assert_eq!(
            fence.spec.grace_period_seconds,
            Some(GRACE),
            "the fence keeps the pod's grace period"
        );
        println!(
            "{} {name} force-deleted and fenced (IPFence {})",
            at(),
            fence.metadata.name.as_deref().unwrap_or_default()
        );
    }

    // The healthy worker's pods are released as usual meanwhile.
    let deleted = Instant::now();
    Api::<Pod>::namespaced(client.clone(), c.ns())
        .delete("calm", &DeleteParams::default())
        .await
        .unwrap();
    wait_long("calm's entry and reservation freed", || async {
        let entries = pool_entries(&c).await;
        let reserved = reservation_names(&c).await;
        !entries.iter().any(|(_, _, s)| *s == calm.1)
            && !reserved.iter().any(|n| reservation_of(n, &calm.0))
    })
    .await;
    println!(
        "{} calm {} on {healthy} freed {:.1}s after its deletion",
        at(),
        calm.0,
        deleted.elapsed().as_secs_f64()
    );
    let still_fenced = |when: &str| {
        let c = &c;
        let when = when.to_string();
        async move {
            let entries = pool_entries(c).await;
            let reserved = reservation_names(c).await;
            for (name, (ip, id)) in lost {
                let fenced = (format!("{name}:fenced"), ip.clone(), id.clone());
                assert!(
                    entries.contains(&fenced),
                    "{name}'s entry still fenced {when}: {entries:?}"
                );
                assert!(
                    reserved.iter().any(|n| reservation_of(n, ip)),
                    "{name}'s reservation kept {when}"
                );
            }
        }
    };
    still_fenced(&format!("while {worker} is away")).await;
    restart_kind_apiserver(&client).await;
    still_fenced("after the apiserver's restart").await;
    println!(
        "{} unpausing {worker} after {:.0}s away",
        at(),
        paused_at.elapsed().as_secs_f64()
    );
    drop(paused);
    let back = Instant::now();
    let limit = Duration::from_secs(GRACE as u64 + 240);
    let watched: Vec<(&str, &str, &str)> = lost
        .iter()
        .map(|(name, (ip, id))| (*name, ip.as_str(), id.as_str()))
        .collect();
    let returns = watch_the_return(&c, &worker, &watched, back, limit).await;
    for ((name, ip, _), r) in watched.iter().zip(&returns) {
        println!(
            "{} {name} {ip} back on {worker} (from the unpause): {r}",
            at()
        );
    }
    for ((name, _, _), r) in watched.iter().zip(&returns) {
        let stopped = r.containers_stopped.expect("containers stopped");
        assert!(
            stopped >= Duration::from_secs(GRACE as u64 - 2),
            "{name}'s container stopped {stopped:?} after the return, before its {GRACE} s \
             grace: the kubelet did not stop it with its own copy. {r}"
        );
        let present = r.present_reported.unwrap_or_else(|| {
            panic!(
                "the node agent on {worker} never reported sandboxesPresent on {name}'s fence: {r}"
            )
        });
        assert!(
            present < stopped,
            "{name}: sandboxesPresent reported while the pod ran: {r}"
        );
        assert!(
            r.entry_gone.unwrap() >= stopped && r.reservation_gone.unwrap() >= stopped,
            "{name}: freed only once the container stopped: {r}"
        );
    }
    // db-0: no CNI DEL freed it; the agent's "still present" held the fence past the settle
    // while the stopped sandbox lingered, and its "gone" lifted it once the sandbox was
    // removed. The controller acts on the report at once (lift, release, record deleted), so
    // a poll may miss the status itself: the release Event names the agent's evidence.
    let r = &returns[1];
    let removed = r.sandbox_removed.expect("db-0's sandbox removed");
    assert!(
        r.entry_gone.unwrap() + Duration::from_secs(1) >= removed,
        "db-0: its fence held until its stopped sandbox was removed (no CNI DEL freed it): {r}"
    );
    if let Some(gone) = r.gone_reported {
        assert!(
            gone + Duration::from_secs(1) >= removed,
            "db-0: sandboxesGone only once the sandbox was removed: {r}"
        );
    }
    let lifted_by_agent = testenv::events::with_reason(&client, c.ns(), GC_DONE, Some("db-0"))
        .await
        .into_iter()
        .filter_map(|e| e.message)
        .filter(|m| m.contains(&format!("[{}]", db.0)))
        .collect::<Vec<_>>();
    assert!(
        lifted_by_agent
            .iter()
            .any(|m| m.contains("the node agent on its node saw the pod's sandboxes gone")),
        "db-0 released on the node agent's sandboxesGone: {lifted_by_agent:?}; {r}"
    );
    for set in ["web", "db"] {
        c.wait_running_with_address(&format!("{set}-0")).await;
    }
    wait_pool_matches_live_pods(&c).await;
    for (name, (ip, _)) in lost {
        let released: Vec<_> = testenv::events::with_reason(&client, c.ns(), GC_DONE, Some(name))
            .await
            .into_iter()
            .filter(|e| {
                e.message
                    .as_deref()
                    .is_some_and(|m| m.contains(&format!("[{ip}]")))
            })
            .collect();
        assert!(
            released.len() <= 1,
            "{name} released more than once: {released:?}"
        );
    }
    expect_clean_releases(&c).await;
    // Nothing slow left for the next scenario.
    for set in ["web", "db"] {
        c.scale_statefulset_named(set, 0).await;
    }
    println!("{} done", at());
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

    #[tokio::test]
    async fn cluster_a_returning_workers_agent_reports_the_fenced_pod_present_until_stopped() {
        if !super::on_kind() {
            return;
        }
        let c = crate::cluster::Cluster::kind("kind-returning-agent").await;
        super::a_returning_workers_agent_reports_the_fenced_pod_present_until_its_kubelet_stopped_it(c)
            .await
    }
}
