//! The kubelet's own grace period on testenv's real node (issue 35, item 1, where the real
//! kubelet shows it). The pods' container ignores SIGTERM
//! ([`testenv::containerd::IGNORE_SIGTERM_IMAGE`]) and their termination grace period is
//! [`GRACE`]. Through every stop the pod's address must stay allocated: its entry and its
//! reservation may go only once the pod's container has stopped (whereabouts' own CNI DEL runs
//! inside StopPodSandbox, after the containers are killed and before the sandbox turns
//! NotReady).
//!
//! What kubelet v1.36 does, as its log shows (`Killing container with a grace period`):
//! - a pod force-deleted while the kubelet watches: it sees the deletion's grace of 0 and stops
//!   the pod with its minimum, 2 s (pod_workers' calculateEffectiveGracePeriod: the apiserver's
//!   value overrides the spec);
//! - back from a crash: it never knew the pod's deletion nor its spec, and stops the orphaned
//!   sandbox at once (2 s);
//! - back from a partition during which the pod was force-deleted: its pod watch cannot resume
//!   (the apiserver restarted meanwhile, as a long partition outlives the watch window) and the
//!   re-list drops the pod, so it stops the pod with its own copy, which has no deletion grace:
//!   the spec's whole grace period.

use std::time::{Duration, Instant};

use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerFilter, ContainerState, ListContainersRequest, PodSandboxState,
    PodSandboxStatusRequest,
};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;
use testenv::node::NODE_NAME;
use testenv::poll::wait_for_within;
use tonic::transport::Channel;

use crate::cluster::{Cluster, wait_long};
use crate::fencing::{FENCED, Outage, fences, lose_node_and_force_delete};
use crate::node_only::{kubectl_events, reservations};
use crate::{GC_DONE, Platform, expect_clean_releases, pool_entries, wait_pool_matches_live_pods};

/// The test pods' termination grace period: clearly longer than the chart's settle on the node
/// (10 s) and the default `--fence-grace-margin` (15 s) together, so that a fence lifted on the
/// settle, or a release on deletion, frees the address while the pod still runs.
const GRACE: i64 = 60;

/// A pod's sandbox as the node's runtime shows it (CRI, as `crictl pods` / `crictl ps -a`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sandbox {
    /// Ready, with a container running (or in an unknown state): the address is in use.
    Running,
    /// Ready, its containers exited: StopPodSandbox (and its CNI DEL) is under way.
    ContainersStopped,
    /// NotReady: stopped, its network torn down.
    Stopped,
    /// Removed from the runtime.
    Removed,
}

async fn sandbox_now(node: &testenv::Node, id: &str) -> Sandbox {
    let mut cri = node.containerd().client().await.expect("CRI client");
    sandbox_state(&mut cri, id).await.expect("CRI")
}

/// Sandbox `id`'s state through the CRI client `cri` (testenv's node, or a kind node's).
pub(crate) async fn sandbox_state(
    cri: &mut RuntimeServiceClient<Channel>,
    id: &str,
) -> Result<Sandbox, tonic::Status> {
    let status = match cri
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.into(),
            verbose: false,
        })
        .await
    {
        Err(e) if e.code() == tonic::Code::NotFound => return Ok(Sandbox::Removed),
        other => other?.into_inner().status,
    };
    if status.is_none_or(|s| s.state != PodSandboxState::SandboxReady as i32) {
        return Ok(Sandbox::Stopped);
    }
    let containers = cri
        .list_containers(ListContainersRequest {
            filter: Some(ContainerFilter {
                pod_sandbox_id: id.into(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .containers;
    let running = containers.iter().any(|c| {
        c.pod_sandbox_id == id
            && (c.state == ContainerState::ContainerRunning as i32
                || c.state == ContainerState::ContainerUnknown as i32)
    });
    Ok(if running {
        Sandbox::Running
    } else {
        Sandbox::ContainersStopped
    })
}

/// A pod whose address is watched: its name, address and sandbox id.
#[derive(Clone, Debug)]
struct Watched {
    name: String,
    ip: String,
    id: String,
}

/// When each thing was first seen, after the watch's start (or the node's return).
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub containers_stopped: Option<Duration>,
    pub sandbox_stopped: Option<Duration>,
    pub sandbox_removed: Option<Duration>,
    pub entry_gone: Option<Duration>,
    pub reservation_gone: Option<Duration>,
    pub fence_gone: Option<Duration>,
    /// The node agent's `sandboxesPresent` report on the pod's fence (this fence's own).
    pub present_reported: Option<Duration>,
    /// Its `sandboxesGone` report.
    pub gone_reported: Option<Duration>,
}

impl std::fmt::Display for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = |d: Option<Duration>| match d {
            Some(d) => format!("{:.1}s", d.as_secs_f64()),
            None => "-".into(),
        };
        write!(
            f,
            "agent's sandboxesPresent {}, containers stopped {}, sandbox stopped {}, sandbox \
             removed {}, agent's sandboxesGone {}, entry gone {}, reservation gone {}, fence \
             record gone {}",
            t(self.present_reported),
            t(self.containers_stopped),
            t(self.sandbox_stopped),
            t(self.sandbox_removed),
            t(self.gone_reported),
            t(self.entry_gone),
            t(self.reservation_gone),
            t(self.fence_gone),
        )
    }
}

/// The pool's entries, reservations, fences and the runtime every 200 ms from `start` until
/// each of `pods` has its containers stopped and its entry, reservation and fence record gone
/// (within `limit`). Fails as soon as a pod's entry or reservation is gone while its container
/// still runs. Returns each pod's timeline.
async fn watch_until_stopped_and_freed(
    c: &Cluster,
    pods: &[Watched],
    start: Instant,
    limit: Duration,
) -> Vec<Timeline> {
    let node = c.node_handle();
    let ns = c.ns().to_string();
    let mut timelines = vec![Timeline::default(); pods.len()];
    loop {
        let now = start.elapsed();
        let entries = pool_entries(c).await;
        let reserved = reservations(c).await;
        let fences = fences(c).await;
        let mut done = true;
        for (p, t) in pods.iter().zip(timelines.iter_mut()) {
            let sandbox = sandbox_now(node, &p.id).await;
            let first = |at: &mut Option<Duration>, seen: bool| {
                if seen && at.is_none() {
                    *at = Some(now);
                }
            };
            first(&mut t.containers_stopped, sandbox != Sandbox::Running);
            first(
                &mut t.sandbox_stopped,
                matches!(sandbox, Sandbox::Stopped | Sandbox::Removed),
            );
            first(&mut t.sandbox_removed, sandbox == Sandbox::Removed);
            let entry = entries.iter().any(|(_, ip, id)| *ip == p.ip && *id == p.id);
            first(&mut t.entry_gone, !entry);
            let reservation = reserved
                .iter()
                .any(|r| r.starts_with(&format!("{ns}-{} ", p.ip)));
            first(&mut t.reservation_gone, !reservation);
            let fence = fences.iter().find(|f| f.spec.sandbox == p.id);
            first(&mut t.fence_gone, fence.is_none());
            first(
                &mut t.present_reported,
                fence.is_some_and(|f| {
                    let uid = f.metadata.uid.as_deref().unwrap_or_default();
                    f.status
                        .as_ref()
                        .and_then(|s| s.sandboxes_present.as_ref())
                        .is_some_and(|r| r.fence_uid == uid)
                }),
            );
            if sandbox == Sandbox::Running && (!entry || !reservation) {
                panic!(
                    "{}'s address {} was freed while its container still ran (sandbox {}, \
                     {:.1}s after the watch started; entry kept: {entry}, reservation kept: \
                     {reservation}). Timeline: {t}. Pool entries: {entries:?}. Release Events: \
                     {:?}. Fenced Events: {:?}",
                    p.name,
                    p.ip,
                    p.id,
                    now.as_secs_f64(),
                    kubectl_events(node, &ns, GC_DONE),
                    kubectl_events(node, &ns, FENCED),
                );
            }
            done &= sandbox != Sandbox::Running
                && t.entry_gone.is_some()
                && t.reservation_gone.is_some()
                && fence.is_none();
        }
        if done {
            return timelines;
        }
        assert!(
            now < limit,
            "not every pod stopped and freed within {limit:?}: {}",
            pods.iter()
                .zip(&timelines)
                .map(|(p, t)| format!("{} {}: {t}", p.name, p.ip))
                .collect::<Vec<_>>()
                .join("; ")
        );
        // Often: the kubelet's minimum grace leaves about 2 s between a force deletion and
        // the SIGKILL.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Pod `name`'s (ip, sandbox id) in the pool.
async fn entry_of(c: &Cluster, name: &str) -> Watched {
    let entries = pool_entries(c).await;
    let of: Vec<_> = entries.iter().filter(|(n, _, _)| n == name).collect();
    assert_eq!(of.len(), 1, "one entry for {name}: {entries:?}");
    Watched {
        name: name.into(),
        ip: of[0].1.clone(),
        id: of[0].2.clone(),
    }
}

/// Scales each StatefulSet to 0 and removes its pods with a short grace (they ignore SIGTERM
/// and would take [`GRACE`] each), so the node is left with nothing slow to stop.
async fn remove_slow_pods(c: &Cluster) {
    let sets = Api::<StatefulSet>::namespaced(c.client().clone(), c.ns());
    for s in sets.list(&ListParams::default()).await.unwrap().items {
        let patch = json!({"spec": {"replicas": 0}});
        sets.patch(
            &s.metadata.name.unwrap(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    }
    let pods = Api::<Pod>::namespaced(c.client().clone(), c.ns());
    wait_long("the slow pods gone", || async {
        let listed = pods.list(&ListParams::default()).await.unwrap().items;
        for p in &listed {
            let _ = pods
                .delete(
                    p.metadata.name.as_deref().unwrap(),
                    &DeleteParams::default().grace_period(1),
                )
                .await;
        }
        listed.is_empty()
    })
    .await;
}

fn print_timelines(what: &str, pods: &[Watched], timelines: &[Timeline]) {
    for (p, t) in pods.iter().zip(timelines) {
        println!("{what}: {} {} (sandbox {}): {t}", p.name, p.ip, &p.id[..12]);
    }
}

/// The kubelet waited the pod's grace period: its container (which ignores SIGTERM) stopped
/// no earlier than [`GRACE`] after `from` (when the kubelet could first have sent SIGTERM).
fn assert_stopped_after_the_grace(p: &Watched, t: &Timeline) {
    let stopped = t.containers_stopped.expect("containers stopped");
    assert!(
        stopped >= Duration::from_secs(GRACE as u64 - 2),
        "{}'s container stopped {stopped:?} into the watch, before its {GRACE} s grace ended: \
         the kubelet did not stop it with its own copy (see `Killing container with a grace \
         period` in kubelet.log). {t}",
        p.name
    );
}

/// Waits until the Node has been Ready for `age` (by its Ready condition's last transition):
/// a deletion seen sooner after its node came back is fenced, by design.
async fn wait_node_ready_for(c: &Cluster, age: Duration) {
    let nodes = Api::<NodeObject>::all(c.client().clone());
    wait_for_within(
        &format!("the node Ready for {age:?}"),
        age + Duration::from_secs(180),
        Duration::from_secs(1),
        || async {
            let ready = nodes
                .get(NODE_NAME)
                .await
                .unwrap()
                .status
                .and_then(|s| s.conditions)
                .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"));
            ready.is_some_and(|r| {
                r.status == "True"
                    && r.last_transition_time.is_some_and(|t| {
                        jiff::Timestamp::now().duration_since(t.0).as_secs() >= age.as_secs() as i64
                    })
            })
        },
    )
    .await;
}

/// The node is partitioned with `pods` (StatefulSet pods whose container ignores SIGTERM) on
/// it; they are force-deleted and fenced, the node agent reports their sandboxes present, the
/// apiserver restarts (the kubelet's pod watch cannot resume), and the partition heals: the
/// kubelet stops each pod with its own copy, waiting the whole grace period. Checks that
/// every address stays (entry and reservation) until its pod's container has stopped, and is
/// freed afterwards; that each replacement got another address and keeps it.
async fn fenced_pods_return_with_their_kubelet(c: &Cluster, pods: &[Watched]) {
    let node = c.node_handle();
    let lost: Vec<(&str, &str, &str)> = pods
        .iter()
        .map(|p| (p.name.as_str(), p.ip.as_str(), p.id.as_str()))
        .collect();
    lose_node_and_force_delete(c, Outage::Partition, &lost).await;
    for f in fences(c).await {
        assert_eq!(
            f.spec.grace_period_seconds,
            Some(GRACE),
            "the fence keeps the pod's grace period"
        );
    }
    // The node agent keeps its own connection and sees the sandboxes still there.
    wait_long(
        "the node agent's sandboxesPresent report on every fence",
        || async {
            let fences = fences(c).await;
            fences.len() == pods.len()
                && fences.iter().all(|f| {
                    let uid = f.metadata.uid.as_deref().unwrap_or_default();
                    f.status
                        .as_ref()
                        .and_then(|s| s.sandboxes_present.as_ref())
                        .is_some_and(|r| r.fence_uid == uid)
                })
        },
    )
    .await;
    node.cp.restart_apiserver().await.unwrap();

    let healed = Instant::now();
    node.reconnect_kubelet();
    node.wait_node_ready(true).await.unwrap();
    println!(
        "partition healed; node Ready {:.1}s later",
        healed.elapsed().as_secs_f64()
    );
    // The grace period, then the shared machine's slowness.
    let limit = Duration::from_secs(GRACE as u64 + 180);
    let timelines = watch_until_stopped_and_freed(c, pods, healed, limit).await;
    print_timelines("back from the partition (from the heal)", pods, &timelines);
    for (p, t) in pods.iter().zip(&timelines) {
        assert_stopped_after_the_grace(p, t);
        assert!(
            t.present_reported.is_some(),
            "{}: the node agent's sandboxesPresent report was on the fence while it ran: {t}",
            p.name
        );
    }

    for p in pods {
        c.wait_running_with_address(&p.name).await;
        let new = entry_of(c, &p.name).await;
        assert_ne!(
            new.id, p.id,
            "{}'s replacement has a sandbox of its own",
            p.name
        );
        assert!(
            pods.iter().all(|old| old.ip != new.ip),
            "{}'s replacement got an address of a fenced pod: {new:?}",
            p.name
        );
    }
    wait_pool_matches_live_pods(c).await;
    let released = kubectl_events(node, c.ns(), GC_DONE);
    for p in pods {
        assert!(
            released
                .iter()
                .filter(|e| e.starts_with(&format!("{} ", p.name))
                    && e.contains(&format!("[{}]", p.ip)))
                .count()
                <= 1,
            "{released:?}"
        );
    }
    println!("release Events: {released:?}");
    expect_clean_releases(c).await;
}

async fn a_fenced_pod_that_ignores_sigterm_keeps_its_address_until_the_returning_kubelet_stopped_it(
    mut c: Cluster,
) {
    c.pods_ignoring_sigterm(GRACE).await;
    c.scale_statefulset(1).await;
    wait_pool_matches_live_pods(&c).await;
    let web_0 = entry_of(&c, "web-0").await;
    fenced_pods_return_with_their_kubelet(&c, &[web_0]).await;
    remove_slow_pods(&c).await;
}

/// Several fenced pods of two StatefulSets return together with their kubelet.
async fn fenced_pods_of_two_statefulsets_return_together_each_kept_until_stopped(mut c: Cluster) {
    c.pods_ignoring_sigterm(GRACE).await;
    c.scale_statefulset(2).await;
    c.scale_statefulset_named("db", 2).await;
    wait_pool_matches_live_pods(&c).await;
    let mut pods = Vec::new();
    for name in ["web-0", "web-1", "db-0", "db-1"] {
        pods.push(entry_of(&c, name).await);
    }
    fenced_pods_return_with_their_kubelet(&c, &pods).await;
    remove_slow_pods(&c).await;
}

/// Pods slow-0 and neighbour-0 on a node Ready for longer than any settle window, slow-0's
/// entry watched. Returns it.
async fn slow_pod_and_neighbour(c: &mut Cluster) -> (Watched, Watched) {
    c.pods_ignoring_sigterm(GRACE).await;
    // The deletion must be judged as on a trusted node: Ready for longer than the settle, or
    // the grace plus the margin, after an earlier scenario brought it back.
    wait_node_ready_for(c, Duration::from_secs(GRACE as u64 + 30)).await;
    c.create_pod("slow-0").await;
    c.create_pod("neighbour-0").await;
    wait_pool_matches_live_pods(c).await;
    (
        entry_of(c, "slow-0").await,
        entry_of(c, "neighbour-0").await,
    )
}

/// The neighbour keeps its entry; the pool ends with the live pods' addresses, no failure.
async fn neighbour_kept_and_pool_clean(c: &Cluster, neighbour: &Watched) {
    let after = entry_of(c, &neighbour.name).await;
    assert_eq!(
        (&after.ip, &after.id),
        (&neighbour.ip, &neighbour.id),
        "the neighbour keeps its address"
    );
    wait_pool_matches_live_pods(c).await;
    let released = kubectl_events(c.node_handle(), c.ns(), GC_DONE);
    println!("release Events: {released:?}");
    expect_clean_releases(c).await;
}

/// A pod force-deleted (`grace_period_seconds=0`) on a Ready node whose kubelet watches: the
/// apiserver forgets it at once, and the kubelet stops it with its minimum grace (2 s, SIGTERM
/// ignored, then SIGKILL), then StopPodSandbox and the CNI DEL. Its address must stay until its
/// container has stopped; a live neighbour keeps its own.
async fn a_pod_force_deleted_on_a_ready_node_keeps_its_address_while_the_kubelet_stops_it(
    mut c: Cluster,
) {
    let (slow, neighbour) = slow_pod_and_neighbour(&mut c).await;
    Api::<Pod>::namespaced(c.client().clone(), c.ns())
        .delete("slow-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let deleted = Instant::now();
    let limit = Duration::from_secs(GRACE as u64 + 180);
    let timelines =
        watch_until_stopped_and_freed(&c, std::slice::from_ref(&slow), deleted, limit).await;
    print_timelines(
        "force-deleted on a Ready node (from the deletion)",
        std::slice::from_ref(&slow),
        &timelines,
    );
    neighbour_kept_and_pool_clean(&c, &neighbour).await;
    remove_slow_pods(&c).await;
}

/// A pod force-deleted while its kubelet is cut off for a moment, its Node still Ready (the
/// partition is shorter than kube-controller-manager's grace): back, the kubelet re-lists,
/// finds the pod gone and stops it with its own copy, with the whole grace period. Its address
/// must stay until its container has stopped.
async fn a_pod_force_deleted_while_its_kubelet_is_cut_off_briefly_keeps_its_address_until_stopped(
    mut c: Cluster,
) {
    let (slow, neighbour) = slow_pod_and_neighbour(&mut c).await;
    let node = c.node_handle();
    node.cut_kubelet_off();
    Api::<Pod>::namespaced(c.client().clone(), c.ns())
        .delete("slow-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let deleted = Instant::now();
    // The apiserver restarts while the kubelet is away, so that its pod watch cannot resume
    // (as after a partition longer than the watch window) and it re-lists.
    node.cp.restart_apiserver().await.unwrap();
    node.reconnect_kubelet();
    let healed = deleted.elapsed();
    println!(
        "kubelet reconnected {:.1}s after the deletion",
        healed.as_secs_f64()
    );
    let limit = Duration::from_secs(GRACE as u64 + 180);
    let timelines =
        watch_until_stopped_and_freed(&c, std::slice::from_ref(&slow), deleted, limit).await;
    print_timelines(
        "force-deleted with the kubelet cut off (from the deletion)",
        std::slice::from_ref(&slow),
        &timelines,
    );
    let stopped = timelines[0].containers_stopped.expect("stopped");
    assert!(
        stopped >= healed + Duration::from_secs(GRACE as u64 - 2),
        "the kubelet stopped slow-0 {stopped:?} after the deletion, {healed:?} after it was \
         reconnected: not with its own copy's grace ({GRACE} s)"
    );
    node.wait_node_ready(true).await.unwrap();
    neighbour_kept_and_pool_clean(&c, &neighbour).await;
    remove_slow_pods(&c).await;
}

mod returning_kubelet_scenarios {
    on_the_node! {
        a_fenced_pod_that_ignores_sigterm_keeps_its_address_until_the_returning_kubelet_stopped_it: "grace-fenced",
        a_pod_force_deleted_on_a_ready_node_keeps_its_address_while_the_kubelet_stops_it: "grace-force-ready",
        a_pod_force_deleted_while_its_kubelet_is_cut_off_briefly_keeps_its_address_until_stopped: "grace-cut-briefly",
        fenced_pods_of_two_statefulsets_return_together_each_kept_until_stopped: "grace-fenced-many",
    }
}
