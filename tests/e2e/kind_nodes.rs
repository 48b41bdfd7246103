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
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testenv::poll::{metric_value, wait_for_within};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::cluster::{CONTROLLER_REPLICAS, Cluster, RELEASE_NS, wait_long};
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

/// `docker inspect -f FORMAT container`, or `None` (no panic: also called from a drop).
fn inspect(container: &str, format: &str) -> Option<String> {
    let out = Command::new("docker")
        .args(["inspect", "-f", format, container])
        .output()
        .ok()?;
    let value = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !value.is_empty()).then_some(value)
}

/// The control-plane node container of `e2e/kind/run.sh`'s kind cluster.
fn control_plane_container() -> String {
    let cluster = std::env::var("IPRECLAIM_KIND_CLUSTER").unwrap_or("ipreclaim-e2e".into());
    format!("{cluster}-control-plane")
}

/// The packet filter rule that cuts a node's own processes (its kubelet; host-network pods)
/// off from the control plane at `control_plane`: every TCP segment from the control plane to
/// the node's address answered with a reset. The reset closes the apiserver's side of each
/// connection, so nothing the apiserver writes while the node is away (a watch event) waits
/// in the frozen node's socket buffers to be read on its return: a paused container's kernel
/// still receives, and a kubelet that read the force-deletion's zero grace from such a buffer
/// stopped the pod at once (the kubelet's minimum) instead of with its own copy. The returning
/// kubelet finds its connections reset, and re-lists. The pods' own connections (FORWARD) are
/// left alone: a pod's client that is never told its connection is gone hears nothing until
/// its read timeout (the node agent's, kube's default, is 295 s).
fn partition_rules(control_plane: &str) -> Vec<Vec<String>> {
    vec![
        [
            "INPUT",
            "-s",
            control_plane,
            "-p",
            "tcp",
            "-m",
            "comment",
            "--comment",
            "ipreclaim-e2e-partition",
            "-j",
            "REJECT",
            "--reject-with",
            "tcp-reset",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    ]
}

/// `iptables -w OP RULE` (this machine's) in the network namespace of the process `pid` (a
/// node container's), which a paused node's own tools cannot change; whether it succeeded.
fn netns_iptables(pid: &str, op: &str, rule: &[String]) -> Result<(), String> {
    let out = Command::new("nsenter")
        .args(["-t", pid, "-n", "iptables", "-w", op])
        .args(rule)
        .output()
        .map_err(|e| format!("nsenter: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

/// The node container `node`'s pid and the control plane's address, or `None`.
fn partition_ends(node: &str) -> Option<(String, String)> {
    let pid = inspect(node, "{{.State.Pid}}").filter(|p| p != "0")?;
    let control_plane = inspect(
        &control_plane_container(),
        "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
    )?;
    Some((pid, control_plane))
}

/// Node `node` cut off from the control plane ([`partition_rules`]).
fn cut_off(node: &str) {
    let (pid, control_plane) = partition_ends(node)
        .unwrap_or_else(|| panic!("{node}'s pid and the control plane's address"));
    for rule in partition_rules(&control_plane) {
        if let Err(e) = netns_iptables(&pid, "-I", &rule) {
            panic!("iptables -I {rule:?} in {node}: {e}");
        }
    }
}

/// The cut of [`cut_off`] undone, every copy of its rules (a rule a killed run left goes
/// too); whether there was one. Never panics (also called from a drop).
fn reconnect(node: &str) -> bool {
    let Some((pid, control_plane)) = partition_ends(node) else {
        return false;
    };
    let mut removed = false;
    for rule in partition_rules(&control_plane) {
        while netns_iptables(&pid, "-D", &rule).is_ok() {
            removed = true;
        }
    }
    removed
}

/// A kind node's container paused (its kubelet, containerd and pods frozen, as a hung or
/// partitioned machine) and its kubelet cut off from the control plane ([`partition_rules`]);
/// reconnected and unpaused when dropped, so a failed check leaves the cluster whole.
struct Paused(String);

impl Paused {
    /// Pauses `node` until it is NotReady and the controller's `leader` counts it so.
    async fn until_seen_down(client: &kube::Client, node: &str, leader: &str) -> Paused {
        let mut paused = Paused::all_until_seen_down(client, &[node], leader).await;
        paused.pop().expect("one node paused")
    }

    /// Pauses every node of `nodes` at once (one `docker pause`), until each is NotReady and
    /// the controller's `leader` counts them all so.
    async fn all_until_seen_down(
        client: &kube::Client,
        nodes: &[&str],
        leader: &str,
    ) -> Vec<Paused> {
        // The guards first: a pause or cut that fails half way is undone.
        let paused: Vec<Paused> = nodes.iter().map(|n| Paused(n.to_string())).collect();
        for node in nodes {
            // A killed run's cut first: one copy only, removed whole on return.
            reconnect(node);
            cut_off(node);
        }
        docker(&[&["pause"], nodes].concat());
        for node in nodes {
            wait_for_within(
                &format!("node {node} NotReady"),
                NODE_DOWN,
                Duration::from_millis(500),
                || async { !node_ready(client, node).await },
            )
            .await;
        }
        let down = nodes.len() as f64;
        wait_long("the leader sees the nodes not Ready", || async {
            controller_pod_metrics(client, leader)
                .await
                .is_ok_and(|t| metric_value(&t, "ipreclaim_unready_nodes") >= down)
        })
        .await;
        paused
    }

    /// Reconnects and unpauses every node of `paused` at once (one `docker unpause`).
    fn unpause_together(paused: Vec<Paused>) {
        let nodes: Vec<&str> = paused.iter().map(|p| p.0.as_str()).collect();
        for node in &nodes {
            assert!(reconnect(node), "{node} was cut off from the control plane");
        }
        let out = Command::new("docker")
            .args([&["unpause"], nodes.as_slice()].concat())
            .output()
            .expect("docker");
        assert!(
            out.status.success(),
            "docker unpause {nodes:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Unpaused: nothing left for each drop to do.
        std::mem::forget(paused);
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        reconnect(&self.0);
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
    leader_shows_fences_held(&client, &leader, 1).await;
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

/// The kind cluster's control-plane node.
async fn control_plane_node(client: &kube::Client) -> String {
    Api::<NodeObject>::all(client.clone())
        .list(&ListParams::default().labels("node-role.kubernetes.io/control-plane"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find_map(|n| n.metadata.name)
        .expect("a control-plane node")
}

/// The kind cluster's workers, by name.
async fn workers(client: &kube::Client) -> Vec<String> {
    let mut names: Vec<String> = Api::<NodeObject>::all(client.clone())
        .list(&ListParams::default().labels("!node-role.kubernetes.io/control-plane"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    names.sort();
    names
}

/// Stops the kind cluster's kube-apiserver container (its kubelet starts it again) and waits
/// until the apiserver is ready: a kubelet whose watch was open then cannot resume it when it
/// returns and re-lists, as after a partition longer than the watch window.
async fn restart_kind_apiserver(client: &kube::Client) {
    let cp = control_plane_node(client).await;
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

/// The reservations of the pools' namespace as (name, uid).
async fn reservation_uids(c: &Cluster) -> Vec<(String, String)> {
    let api = Api::<OverlappingRangeIPReservation>::namespaced(c.client().clone(), c.pool_ns());
    testenv::fixtures::list_all(&api)
        .await
        .into_iter()
        .filter_map(|r| Some((r.metadata.name?, r.metadata.uid?)))
        .collect()
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

/// A force-deleted pod whose return is watched: its name, the node it ran on, its address and
/// its sandbox id.
#[derive(Clone, Copy)]
struct Lost<'a> {
    name: &'a str,
    node: &'a str,
    ip: &'a str,
    id: &'a str,
}

/// From `back` (the workers unpaused) every 500 ms until each fenced pod's sandbox is removed
/// from its node's runtime and its entry, reservation and fence record are gone: the pool,
/// the reservations, the fence's status and each node's runtime. Fails as soon as an entry or
/// a reservation is gone while its pod's container still runs.
async fn watch_the_return(
    c: &Cluster,
    pods: &[Lost<'_>],
    back: Instant,
    limit: Duration,
) -> Vec<Timeline> {
    let mut returns = vec![Timeline::default(); pods.len()];
    // Each old allocation's reservation object, by uid from the first look (the pods are
    // fenced then): a replacement given the address back once it was freed gets a reservation
    // of the same name and podref (whereabouts v0.9.4 writes no sandbox id), but its own.
    let first = reservation_uids(c).await;
    let old_reservations: Vec<Option<String>> = pods
        .iter()
        .map(|p| {
            first
                .iter()
                .find(|(n, _)| reservation_of(n, p.ip))
                .map(|(_, uid)| uid.clone())
        })
        .collect();
    loop {
        let now = back.elapsed();
        let entries = pool_entries(c).await;
        let reserved = reservation_uids(c).await;
        let fenced = fences(c).await;
        let mut done = true;
        for ((&Lost { name, node, ip, id }, r), old) in
            pods.iter().zip(returns.iter_mut()).zip(&old_reservations)
        {
            let fence = fenced.iter().find(|f| f.spec.sandbox == id);
            let sandbox = kind_sandbox(node, id).await;
            let first = |at: &mut Option<Duration>, seen: bool| {
                if seen && at.is_none() {
                    *at = Some(now);
                }
            };
            let entry = entries.iter().any(|(_, i, s)| i == ip && s == id);
            let reservation = old
                .as_deref()
                .is_some_and(|o| reserved.iter().any(|(_, uid)| uid == o));
            let report = |which: fn(
                &ipreclaim::api::IPFenceStatus,
            ) -> Option<&ipreclaim::api::SandboxReport>| {
                fence.is_some_and(|f| {
                    let uid = f.metadata.uid.as_deref().unwrap_or_default();
                    f.status
                        .as_ref()
                        .and_then(which)
                        .is_some_and(|rep| rep.fence_uid == uid && rep.node == node)
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
                    "{name}'s address {ip} was freed while its container still ran on {node} \
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
                .map(|(p, r)| format!("{} {}: {r}", p.name, p.ip))
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
    Paused::unpause_together(vec![paused]);
    let back = Instant::now();
    let limit = Duration::from_secs(GRACE as u64 + 240);
    let watched: Vec<Lost> = lost
        .iter()
        .map(|(name, (ip, id))| Lost {
            name,
            node: &worker,
            ip,
            id,
        })
        .collect();
    let returns = watch_the_return(&c, &watched, back, limit).await;
    for (Lost { name, ip, .. }, r) in watched.iter().zip(&returns) {
        println!(
            "{} {name} {ip} back on {worker} (from the unpause): {r}",
            at()
        );
    }
    for (Lost { name, .. }, r) in watched.iter().zip(&returns) {
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
    scale_to_zero_without_waiting_out_the_grace(&c, &["web", "db"]).await;
    println!("{} done", at());
}

/// `helm` (the one `scripts/setup.sh` built) on the kind cluster of `KUBECONFIG`.
fn helm(args: &[&str]) -> String {
    testenv::helm::helm(None, args).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Waits until the controller Deployment's replicas all run, Ready, on nodes `on` accepts, no
/// other controller pod is left, and one of them holds the Lease; returns that one.
async fn controller_settled(
    client: &kube::Client,
    what: &str,
    on: impl Fn(&str) -> bool,
) -> String {
    let pods = Api::<Pod>::namespaced(client.clone(), RELEASE_NS);
    wait_long(what, || async {
        let listed = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
            .await
            .unwrap()
            .items;
        let holder = lease_holder(client).await;
        listed.len() == CONTROLLER_REPLICAS as usize
            && listed.iter().all(|p| {
                let ready = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
                ready && p.metadata.deletion_timestamp.is_none() && node.is_some_and(&on)
            })
            && listed
                .iter()
                .any(|p| p.metadata.name.as_deref() == Some(holder.as_str()))
    })
    .await;
    lease_holder(client).await
}

/// The controller moved to the control-plane node by the chart's `controller.nodeSelector` and
/// `controller.tolerations` (`helm upgrade --reuse-values`), as an operator keeps it running
/// when every worker may be cut off at once. [`ControllerOnControlPlane::restore`] rolls the
/// release back to the revision before and waits until the controller runs on the workers
/// again; dropped before that (a failed check), the rollback runs all the same.
struct ControllerOnControlPlane {
    revision: Option<String>,
}

fn rollback(revision: &str) -> anyhow::Result<String> {
    testenv::helm::helm(
        None,
        &[
            "rollback",
            "ipreclaim",
            revision,
            "-n",
            RELEASE_NS,
            "--wait",
            "--timeout",
            "300s",
        ],
    )
}

impl ControllerOnControlPlane {
    /// Returns the guard and the leader (a replica on the control-plane node).
    async fn new(client: &kube::Client) -> (ControllerOnControlPlane, String) {
        let cp = control_plane_node(client).await;
        let status: serde_json::Value = serde_json::from_str(&helm(&[
            "status",
            "ipreclaim",
            "-n",
            RELEASE_NS,
            "-o",
            "json",
        ]))
        .unwrap();
        let revision = status["version"]
            .as_i64()
            .expect("the release's revision")
            .to_string();
        let guard = ControllerOnControlPlane {
            revision: Some(revision),
        };
        tokio::task::spawn_blocking(|| {
            let chart = testenv::helm::chart_dir();
            helm(&[
                "upgrade",
                "ipreclaim",
                chart.to_str().unwrap(),
                "-n",
                RELEASE_NS,
                "--reuse-values",
                "--set-json",
                r#"controller.nodeSelector={"node-role.kubernetes.io/control-plane":""}"#,
                "--set-json",
                r#"controller.tolerations=[{"key":"node-role.kubernetes.io/control-plane","operator":"Exists","effect":"NoSchedule"}]"#,
                "--wait",
                "--timeout",
                "300s",
            ])
        })
        .await
        .unwrap();
        let leader = controller_settled(
            client,
            &format!("the controller's replicas on {cp}, one leading"),
            |n| n == cp,
        )
        .await;
        (guard, leader)
    }

    async fn restore(mut self, client: &kube::Client) {
        let revision = self.revision.take().expect("not restored yet");
        let cp = control_plane_node(client).await;
        tokio::task::spawn_blocking(move || rollback(&revision))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{e:#}"));
        controller_settled(
            client,
            "the controller's replicas back on the workers, one leading",
            |n| n != cp,
        )
        .await;
    }
}

impl Drop for ControllerOnControlPlane {
    fn drop(&mut self) {
        if let Some(revision) = self.revision.take()
            && let Err(e) = rollback(&revision)
        {
            eprintln!("putting the controller back on the workers: {e:#}");
        }
    }
}

/// The two-worker scenario's pods' grace periods, one StatefulSet pod on each worker: far
/// apart, so that their fences must lift at different times, each when its own node's kubelet
/// has stopped its pod (the later one well past the chart's 60 s settle).
const EARLY_GRACE: i64 = GRACE;
const LATE_GRACE: i64 = 150;

/// Several nodes partitioned and returning together. The controller runs on the control-plane
/// node (chart values `controller.nodeSelector`/`controller.tolerations`) and keeps deciding
/// while BOTH workers are frozen at once (`docker pause` of their node containers) until each
/// Node is NotReady. On each worker a StatefulSet pod whose container ignores SIGTERM runs,
/// early-0 (grace [`EARLY_GRACE`]) on one and late-0 (grace [`LATE_GRACE`]) on the other; both
/// are force-deleted while their nodes are down and fenced; the apiserver restarts meanwhile
/// (the kubelets re-list on return, as after a partition longer than the watch window), and
/// both workers are unpaused together. Each kubelet stops its old pod, mostly with its own
/// copy, so with the whole grace period (a kubelet whose watch resumed reads the deletion's
/// zero grace instead; the run prints which).
///
/// Fails when a fence lifts early: an entry or reservation gone while its pod's container
/// still runs in its node's runtime (read through that node's CRI, as `crictl` there), or a
/// fence record gone before its container stopped (each polled every 500 ms); when the
/// fences lift together (the one stopped first still held once the other's container
/// stopped, when they stopped 20 s apart or more; or the other freed with it while its
/// container ran); when a node agent never reports its own node's fenced sandbox present
/// (a container that ran 15 s or more after the return); and when something leaks (an address not freed, its
/// reservation left, a fence record left, a release twice).
pub(crate) async fn both_workers_partitioned_and_returning_together_each_fence_lifts_when_its_own_kubelet_stopped_its_pod(
    mut c: Cluster,
) {
    let started = Instant::now();
    let at = || format!("[{:.0}s]", started.elapsed().as_secs_f64());
    let client = c.client().clone();
    let (controller, leader) = ControllerOnControlPlane::new(&client).await;
    let workers = workers(&client).await;
    assert_eq!(workers.len(), 2, "two workers: {workers:?}");
    println!(
        "{} controller on the control-plane node, leader {leader}; workers {workers:?}",
        at()
    );
    load_ignore_sigterm_image().await;
    let sets = [
        ("early", workers[0].as_str(), EARLY_GRACE),
        ("late", workers[1].as_str(), LATE_GRACE),
    ];
    for (set, node, grace) in sets {
        c.set_pod_image(testenv::containerd::IGNORE_SIGTERM_IMAGE, grace);
        c.ensure_statefulset_on(set, Some(node)).await;
        c.scale_statefulset_named(set, 1).await;
    }
    wait_pool_matches_live_pods(&c).await;
    let mut entries = Vec::new();
    for (set, node, _) in sets {
        let name = format!("{set}-0");
        assert_eq!(node_of(&client, c.ns(), &name).await, node);
        let (ip, id) = entry_of(&c, &name).await;
        println!("{} {name} {ip} on {node}", at());
        entries.push((name, ip, id));
    }
    let lost: Vec<Lost> = sets
        .iter()
        .zip(&entries)
        .map(|((_, node, _), (name, ip, id))| Lost { name, node, ip, id })
        .collect();

    let paused_at = Instant::now();
    let paused = Paused::all_until_seen_down(&client, &[&workers[0], &workers[1]], &leader).await;
    println!(
        "{} both workers NotReady {:.0}s after the pause",
        at(),
        paused_at.elapsed().as_secs_f64()
    );
    for (p, (_, _, grace)) in lost.iter().zip(sets) {
        Api::<Pod>::namespaced(client.clone(), c.ns())
            .delete(p.name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
        wait_long(&format!("a Fenced Event for {}", p.name), || async {
            testenv::events::with_reason(&client, c.ns(), FENCED, Some(p.name))
                .await
                .iter()
                .any(|e| {
                    let m = e.message.as_deref().unwrap_or_default();
                    m.contains(&format!("[{}]", p.ip))
                        && m.contains(&format!("node {} was not Ready", p.node))
                })
        })
        .await;
        let fence = fences(&c)
            .await
            .into_iter()
            .find(|f| f.spec.sandbox == p.id)
            .unwrap_or_else(|| panic!("{}'s IPFence", p.name));
        assert_eq!(fence.spec.node, p.node, "{}'s fence names its node", p.name);
        assert_eq!(
            fence.spec.grace_period_seconds,
            Some(grace),
            "{}'s fence keeps its pod's grace period",
            p.name
        );
        println!("{} {} force-deleted and fenced", at(), p.name);
    }
    let still_fenced = |when: &str| {
        let (c, lost) = (&c, &lost);
        let when = when.to_string();
        async move {
            let entries = pool_entries(c).await;
            let reserved = reservation_names(c).await;
            for p in lost {
                let fenced = (
                    format!("{}:fenced", p.name),
                    p.ip.to_string(),
                    p.id.to_string(),
                );
                assert!(
                    entries.contains(&fenced),
                    "{}'s entry still fenced {when}: {entries:?}",
                    p.name
                );
                assert!(
                    reserved.iter().any(|n| reservation_of(n, p.ip)),
                    "{}'s reservation kept {when}",
                    p.name
                );
            }
        }
    };
    // Held while both are away: the leader's gauges show both fences ageing.
    leader_shows_fences_held(&client, &leader, 2).await;
    still_fenced("while both workers are away").await;
    // The returning kubelets must re-list (not read the force-deletions from their old
    // watches, which carry a zero grace), so that they stop the pods with their own copies.
    restart_kind_apiserver(&client).await;
    still_fenced("after the apiserver's restart").await;
    println!(
        "{} unpausing both workers after {:.0}s away",
        at(),
        paused_at.elapsed().as_secs_f64()
    );
    Paused::unpause_together(paused);
    let back = Instant::now();
    let limit = Duration::from_secs(LATE_GRACE as u64 + 240);
    let returns = watch_the_return(&c, &lost, back, limit).await;
    for (p, r) in lost.iter().zip(&returns) {
        println!(
            "{} {} {} back on {} (from the unpause): {r}",
            at(),
            p.name,
            p.ip,
            p.node
        );
    }
    for ((p, r), (_, _, grace)) in lost.iter().zip(&returns).zip(sets) {
        let name = p.name;
        let stopped = r.containers_stopped.expect("containers stopped");
        // Which way its kubelet stopped it: with its own copy after a re-list (the whole
        // grace), or with the force-deletion's zero grace read from a watch that resumed
        // (seen once on kind, on one worker of two, with the apiserver restarted meanwhile).
        println!(
            "{} {name}: its kubelet stopped it {:.1}s after the return ({})",
            at(),
            stopped.as_secs_f64(),
            if stopped >= Duration::from_secs(grace as u64 - 2) {
                "its own copy: the whole grace"
            } else {
                "the deletion's zero grace"
            }
        );
        // The agent lists its node's sandboxes every second: a container that ran on after
        // the return was seen and reported.
        if stopped >= Duration::from_secs(15) {
            let present = r.present_reported.unwrap_or_else(|| {
                panic!(
                    "the node agent on {} never reported sandboxesPresent on {name}'s fence: {r}",
                    p.node
                )
            });
            assert!(
                present < stopped,
                "{name}: sandboxesPresent reported while the pod ran: {r}"
            );
        }
        assert!(
            r.entry_gone.unwrap() >= stopped
                && r.reservation_gone.unwrap() >= stopped
                && r.fence_gone.unwrap() >= stopped,
            "{name}: its fence lifted before its own kubelet stopped its container: {r}"
        );
    }
    // Independently: the pod stopped first was freed, its fence record gone, while the other
    // still ran on the other worker and kept its address (the watch fails at once had that
    // one been freed then). Told apart when the two stopped well apart.
    let mut by_stop: Vec<(&Lost, &Timeline)> = lost.iter().zip(&returns).collect();
    by_stop.sort_by_key(|(_, r)| r.containers_stopped);
    let ((first, f), (second, l)) = (by_stop[0], by_stop[1]);
    let (f_stopped, l_stopped) = (f.containers_stopped.unwrap(), l.containers_stopped.unwrap());
    if l_stopped >= f_stopped + Duration::from_secs(20) {
        assert!(
            f.entry_gone.unwrap() < l_stopped && f.fence_gone.unwrap() < l_stopped,
            "the fences did not lift each on its own: {}'s was held until {}'s container \
             stopped. {}: {f}; {}: {l}",
            first.name,
            second.name,
            first.name,
            second.name
        );
    } else {
        println!(
            "{} both stopped within 20 s: the two lifts are not told apart in this run",
            at()
        );
    }
    // Nothing leaked: the replacements run with addresses, the pool holds exactly the live
    // pods' addresses, each with its reservation, the old addresses are free (or a live
    // pod's again), each released once at most, no fence record left.
    for (set, _, _) in sets {
        c.wait_running_with_address(&format!("{set}-0")).await;
    }
    wait_pool_matches_live_pods(&c).await;
    let live: Vec<String> = crate::live_addresses(&c)
        .await
        .into_values()
        .flatten()
        .collect();
    let reserved = reservation_names(&c).await;
    for ip in &live {
        assert!(
            reserved.iter().any(|n| reservation_of(n, ip)),
            "a live pod's address {ip} has its reservation: {reserved:?}"
        );
    }
    for p in &lost {
        assert!(
            live.iter().any(|ip| ip == p.ip) || !reserved.iter().any(|n| reservation_of(n, p.ip)),
            "{}'s old address {} left reserved: {reserved:?}",
            p.name,
            p.ip
        );
        let released: Vec<_> = testenv::events::with_reason(&client, c.ns(), GC_DONE, Some(p.name))
            .await
            .into_iter()
            .filter(|e| {
                e.message
                    .as_deref()
                    .is_some_and(|m| m.contains(&format!("[{}]", p.ip)))
            })
            .collect();
        assert!(
            released.len() <= 1,
            "{} released more than once: {released:?}",
            p.name
        );
    }
    assert!(
        fences(&c)
            .await
            .iter()
            .all(|f| !f.spec.podref.starts_with(&format!("{}/", c.ns()))),
        "no fence record left: {:?}",
        fence_records(&c).await
    );
    expect_clean_releases(&c).await;
    // Nothing slow left for the next scenario (the replacements ignore SIGTERM too).
    scale_to_zero_without_waiting_out_the_grace(&c, &["early", "late"]).await;
    controller.restore(&client).await;
    println!("{} done", at());
}

/// A scenario's teardown, once its checks are done: the pods of StatefulSets `sets` deleted
/// with a grace of 1 s (the kubelet's minimum is 2 s), the sets scaled to zero right after,
/// then the pods waited gone. Their containers ignore SIGTERM, so each would otherwise take its
/// whole grace (60 s, 150 s) to go: minutes of CI spent on nothing the scenario checks. The
/// delete comes first: a kubelet already stopping a pod with its whole grace (as after the
/// scale-down's own delete) keeps to it. A set does not replace a pod that is still
/// terminating, and the scale-down follows within milliseconds. Their kubelets still stop
/// them with a CNI DEL as for any deletion, so nothing is left for the next scenario.
async fn scale_to_zero_without_waiting_out_the_grace(c: &Cluster, sets: &[&str]) {
    let pods = Api::<Pod>::namespaced(c.client().clone(), c.ns());
    for set in sets {
        match pods
            .delete(
                &format!("{set}-0"),
                &DeleteParams::default().grace_period(1),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => panic!("delete {set}-0 with a grace of 1 s: {e}"),
        }
    }
    for set in sets {
        c.ensure_statefulset_on(set, None)
            .await
            .patch(
                set,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 0}})),
            )
            .await
            .unwrap();
    }
    let started = Instant::now();
    wait_long("the scaled-down pods gone", || async {
        let mut gone = true;
        for set in sets {
            gone &= pods.get_opt(&format!("{set}-0")).await.unwrap().is_none();
        }
        gone
    })
    .await;
    println!(
        "{sets:?} scaled down, their pods gone in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// Waits until the leader's gauges show `n` fences held, the oldest for 10 s or more.
async fn leader_shows_fences_held(client: &kube::Client, leader: &str, n: u32) {
    let what = format!("the leader shows {n} fence(s) held for 10 s");
    wait_long(&what, || async {
        controller_pod_metrics(client, leader).await.is_ok_and(|t| {
            metric_value(&t, "ipreclaim_fenced_addresses") == f64::from(n)
                && metric_value(&t, "ipreclaim_fence_oldest_age_seconds") >= 10.0
        })
    })
    .await;
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

    /// Sorted after the others (libtest runs them by name): it moves the controller to the
    /// control-plane node and back.
    #[tokio::test]
    async fn cluster_both_workers_partitioned_and_returning_together() {
        if !super::on_kind() {
            return;
        }
        let c = crate::cluster::Cluster::kind("kind-both-workers").await;
        super::both_workers_partitioned_and_returning_together_each_fence_lifts_when_its_own_kubelet_stopped_its_pod(c)
            .await
    }
}
