//! A drain of a worker and a rolling update of the controller's Deployment while deletions
//! flow, on the kind cluster of `e2e/kind/run.sh`: nothing leaks and nothing live is freed.
//!
//! Two kinds of pods are created and deleted in a loop:
//! - real pods (the pause image, the test network): the kubelet runs their CNI DEL, so the
//!   whereabouts plugin usually frees them itself; ipreclaim must never free one that lives;
//! - ghosts: pods never scheduled (a node selector no node has) whose allocation the test
//!   writes as the whereabouts CNI and Multus would; no kubelet ever runs a DEL for them, so
//!   each deletion is a leak that only ipreclaim frees, across its leader's eviction and the
//!   rollout's hand-over.
//!
//! A monitor reads the pool, the reservations and the pods every 500 ms: each live pod's entry
//! (and a real pod's reservation) must be there at every read; each deleted pod's entry and
//! reservation must be gone once the churn has stopped, within a deadline derived from the
//! controller's configuration ([`liveness_deadline`]). Safety is strict (no live pod's address
//! freed at any look); how long each release took is printed, not asserted: on a loaded
//! machine a hand-over can take longer than any fixed bound, and that is not a leak.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ipreclaim::api::OverlappingRangeIPReservation;
use ipreclaim::ipam::NETWORKS_ANNOTATION;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::cluster::{Cluster, RELEASE_NS};
use crate::fencing::lease_holder;
use crate::local::allocate_as_cni;
use crate::{NETWORK, Platform, expect_clean_releases, pool_entries, wait_pool_matches_live_pods};

/// How long, once the churn has stopped, every deleted pod's entry and reservation may take
/// to be gone: ten times what one release needs by the controller's own flags (read from its
/// Deployment: a leak grace, a sweep, and a leader hand-over at worst, the Lease's duration).
/// With `run.sh`'s chart values (5 s, 5 s, 15 s) 250 s; a passing run waits only until the
/// last is freed. A liveness deadline: generous, so that a loaded machine does not fail it,
/// and still finite, so that a leak (e.g. `controller.dryRun=true`) fails.
async fn liveness_deadline(client: &Client) -> Duration {
    let deployment = Api::<Deployment>::namespaced(client.clone(), RELEASE_NS)
        .get("ipreclaim-controller")
        .await
        .unwrap();
    let args: Vec<String> = deployment
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.args)
        .unwrap_or_default();
    let flag = |name: &str| -> Duration {
        // The last one counts (the chart's extraArgs come last).
        let value = args
            .iter()
            .rev()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")))
            .unwrap_or_else(|| panic!("the controller's --{name} in {args:?}"));
        humantime::parse_duration(value)
            .unwrap_or_else(|e| panic!("the controller's --{name}={value}: {e}"))
    };
    let grace = flag("leak-grace").max(flag("missing-pod-grace"));
    10 * (grace + flag("sweep-interval") + flag("lease-duration"))
}
/// Real and ghost pods alive at once.
const LIVE: usize = 4;

/// A pod of the churn, as the monitor follows it.
#[derive(Clone, Debug)]
struct Tracked {
    /// A real pod (its kubelet runs the CNI DEL) or a ghost (only ipreclaim frees it).
    real: bool,
    ip: String,
    sandbox: String,
    /// Since when the pod is gone from the API.
    gone_at: Option<Instant>,
    /// Since when its entry and reservation are gone too.
    freed_at: Option<Instant>,
}

#[derive(Default)]
struct Ledger {
    pods: BTreeMap<String, Tracked>,
    /// Live pods whose entry or reservation was missing, with what was missing and when.
    violations: Vec<String>,
}

fn kubectl(args: &[&str]) -> String {
    let out = Command::new("kubectl")
        .args(args)
        .output()
        .expect("kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Creates a real pod (scheduled by the scheduler) and waits until it runs with an address;
/// `None` if it went first (evicted by the drain before it ran).
async fn create_real(c: &Cluster, name: &str) -> Option<(String, String)> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"churn": "real"}, "annotations": {NETWORKS_ANNOTATION: NETWORK}},
        "spec": c.pod_spec(),
    }))
    .unwrap();
    let pods = Api::<Pod>::namespaced(c.client().clone(), c.ns());
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if c.running_with_address(name).await.is_some() {
            let entry = pool_entries(c)
                .await
                .into_iter()
                .find(|(n, _, _)| n == name)?;
            return Some((entry.1, entry.2));
        }
        // Gone before it ran (evicted by the drain): nothing to follow.
        pods.get_opt(name).await.unwrap()?;
        assert!(
            Instant::now() < deadline,
            "pod {name} running with an address"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Creates a ghost: a pod no node takes, its allocation written as the CNI would.
async fn create_ghost(c: &Cluster, name: &str) -> (String, String) {
    let mut spec = c.pod_spec();
    spec["nodeSelector"] = json!({"ipreclaim.io/e2e-no-such-node": "true"});
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"churn": "ghost"}, "annotations": {NETWORKS_ANNOTATION: NETWORK}},
        "spec": spec,
    }))
    .unwrap();
    Api::<Pod>::namespaced(c.client().clone(), c.ns())
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let sandbox = format!("ghost-sandbox-{name}");
    let ip = allocate_as_cni(c.client(), c.pool_ns(), c.pool(), c.ns(), name, &sandbox).await;
    (ip, sandbox)
}

/// Creates and deletes pods until `stop`: one ghost in three, [`LIVE`] pods alive at once,
/// the oldest deleted as each new one runs. Returns how many it created.
async fn churn(c: &Cluster, ledger: &Mutex<Ledger>, stop: &AtomicBool) -> usize {
    let pods = Api::<Pod>::namespaced(c.client().clone(), c.ns());
    let mut alive: Vec<String> = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let ghost = n % 3 == 0;
        let name = format!("{}-{n}", if ghost { "ghost" } else { "real" });
        let created = if ghost {
            Some(create_ghost(c, &name).await)
        } else {
            create_real(c, &name).await
        };
        if let Some((ip, sandbox)) = created {
            ledger.lock().unwrap().pods.insert(
                name.clone(),
                Tracked {
                    real: !ghost,
                    ip,
                    sandbox,
                    gone_at: None,
                    freed_at: None,
                },
            );
            alive.push(name);
        }
        while alive.len() > LIVE {
            let old = alive.remove(0);
            let _ = pods.delete(&old, &DeleteParams::default()).await;
        }
    }
    for old in alive {
        let _ = pods.delete(&old, &DeleteParams::default()).await;
    }
    n
}

/// The reservations of the pools' namespace as (name, podref).
async fn reservations(client: &Client, pool_ns: &str) -> Vec<(String, String)> {
    let api = Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), pool_ns);
    testenv::fixtures::list_all(&api)
        .await
        .into_iter()
        .map(|r| (r.metadata.name.unwrap_or_default(), r.spec.podref))
        .collect()
}

/// One look: the pool and the reservations first, then the pods (a pod listed alive after the
/// pool was read was alive when it was read), for the pods allocated before.
async fn look(c: &Cluster, ledger: &Mutex<Ledger>, since: Instant) {
    // Only pods whose allocation was written before the pool is read.
    let known: Vec<String> = ledger.lock().unwrap().pods.keys().cloned().collect();
    let entries = pool_entries(c).await;
    let reserved = reservations(c.client(), c.pool_ns()).await;
    let listed = Api::<Pod>::namespaced(c.client().clone(), c.ns())
        .list(&ListParams::default().labels("churn"))
        .await
        .unwrap()
        .items;
    let now = Instant::now();
    let mut ledger = ledger.lock().unwrap();
    let Ledger { pods, violations } = &mut *ledger;
    for (name, t) in pods.iter_mut().filter(|(n, _)| known.contains(n)) {
        let podref = format!("{}/{name}", c.ns());
        let entry = entries
            .iter()
            .any(|(_, ip, id)| *ip == t.ip && *id == t.sandbox);
        let reservation = reserved.iter().any(|(_, r)| *r == podref);
        let pod = listed
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name));
        match pod {
            Some(p) if p.metadata.deletion_timestamp.is_none() => {
                if !entry || (t.real && !reservation) {
                    violations.push(format!(
                        "{name} {} alive but {} missing ({:.1}s into the run)",
                        t.ip,
                        if entry {
                            "its reservation"
                        } else {
                            "its entry"
                        },
                        now.duration_since(since).as_secs_f64()
                    ));
                }
            }
            Some(_) => {}
            None => {
                t.gone_at.get_or_insert(now);
                if !entry && !reservation {
                    t.freed_at.get_or_insert(now);
                }
            }
        }
    }
}

/// A drained node, uncordoned when dropped (also when a check fails: the next scenarios need
/// both workers).
struct Cordoned(String);

impl Drop for Cordoned {
    fn drop(&mut self) {
        let _ = Command::new("kubectl")
            .args(["uncordon", &self.0])
            .stdout(std::process::Stdio::null())
            .status();
    }
}

/// The controller's leader and its node, once the Lease names a pod that exists (after a
/// rollout it may name a gone replica until the new one takes it).
async fn leader_and_node(client: &Client) -> (String, String) {
    let pods = Api::<Pod>::namespaced(client.clone(), RELEASE_NS);
    let found = std::cell::RefCell::new(None);
    crate::cluster::wait_long("the Lease held by a controller pod that exists", || async {
        let holder = lease_holder(client).await;
        let node = match holder.is_empty() {
            true => None,
            false => pods
                .get_opt(&holder)
                .await
                .unwrap()
                .and_then(|p| p.spec?.node_name),
        };
        let held = node.is_some();
        *found.borrow_mut() = node.map(|n| (holder, n));
        held
    })
    .await;
    found.into_inner().expect("the leader's node")
}

/// Drains a worker (the leader's, so the Lease must change hands) and restarts the
/// controller's Deployment (`kubectl rollout restart`) while pods are created and deleted;
/// then checks nothing leaked and nothing live was freed.
pub(crate) async fn a_drain_and_a_controller_rollout_while_deletions_flow_leak_nothing_and_free_nothing_live(
    c: Cluster,
) {
    let started = Instant::now();
    let at = || format!("[{:.0}s]", started.elapsed().as_secs_f64());
    let c = Arc::new(c);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let watching = Arc::new(AtomicBool::new(true));
    // The pool exists once a real pod got an address.
    create_real(&c, "real-0").await.expect("real-0 runs");
    Api::<Pod>::namespaced(c.client().clone(), c.ns())
        .delete("real-0", &DeleteParams::default())
        .await
        .unwrap();
    let churner = tokio::spawn({
        let (c, ledger, stop) = (c.clone(), ledger.clone(), stop.clone());
        async move { churn(&c, &ledger, &stop).await }
    });
    let monitor = tokio::spawn({
        let (c, ledger, watching) = (c.clone(), ledger.clone(), watching.clone());
        async move {
            let mut looks = 0u64;
            while watching.load(Ordering::Relaxed) {
                look(&c, &ledger, started).await;
                looks += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            look(&c, &ledger, started).await;
            looks + 1
        }
    });
    tokio::time::sleep(Duration::from_secs(20)).await;

    println!("{} rollout restart of the controller", at());
    let t = Instant::now();
    kubectl(&[
        "-n",
        RELEASE_NS,
        "rollout",
        "restart",
        "deployment/ipreclaim-controller",
    ]);
    kubectl(&[
        "-n",
        RELEASE_NS,
        "rollout",
        "status",
        "deployment/ipreclaim-controller",
        "--timeout=300s",
    ]);
    println!("{} rollout done in {:.0}s", at(), t.elapsed().as_secs_f64());
    tokio::time::sleep(Duration::from_secs(15)).await;

    // The leader's worker, so that its eviction hands the Lease over mid-flow.
    let (leader, mut node) = leader_and_node(c.client()).await;
    let control_plane = Api::<NodeObject>::all(c.client().clone())
        .get(&node)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default()
        .contains_key("node-role.kubernetes.io/control-plane");
    if control_plane || node.is_empty() {
        node = Api::<NodeObject>::all(c.client().clone())
            .list(&ListParams::default().labels("!node-role.kubernetes.io/control-plane"))
            .await
            .unwrap()
            .items
            .into_iter()
            .find_map(|n| n.metadata.name)
            .expect("a worker");
    }
    println!("{} draining {node} (leader {leader})", at());
    let t = Instant::now();
    let cordoned = Cordoned(node.clone());
    // Each eviction waits for its pod's CNI DEL, which whereabouts makes wait for its own
    // Lease: on a loaded machine that took minutes.
    kubectl(&[
        "drain",
        &node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--force",
        "--timeout=600s",
    ]);
    println!("{} drain done in {:.0}s", at(), t.elapsed().as_secs_f64());
    tokio::time::sleep(Duration::from_secs(20)).await;
    drop(cordoned);
    tokio::time::sleep(Duration::from_secs(10)).await;

    stop.store(true, Ordering::Relaxed);
    let created = churner.await.unwrap();
    println!("{} churn stopped after {created} pods", at());
    let ns = c.ns().to_string();
    let pods = Api::<Pod>::namespaced(c.client().clone(), &ns);
    crate::cluster::wait_long("the churn's pods gone", || async {
        pods.list(&ListParams::default().labels("churn"))
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    // Every deleted pod freed, or the liveness deadline past.
    let freed_within = liveness_deadline(c.client()).await;
    let deadline = Instant::now() + freed_within;
    while Instant::now() < deadline
        && ledger
            .lock()
            .unwrap()
            .pods
            .values()
            .any(|t| t.freed_at.is_none())
    {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    watching.store(false, Ordering::Relaxed);
    let looks = monitor.await.unwrap();

    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let latency = |t: &Tracked| match (t.gone_at, t.freed_at) {
        (Some(g), Some(f)) => Some(f.saturating_duration_since(g)),
        _ => None,
    };
    let (real, ghosts): (Vec<_>, Vec<_>) = ledger.pods.values().partition(|t| t.real);
    let slowest = |ts: &[&Tracked]| {
        ts.iter()
            .filter_map(|t| Some((latency(t)?, t.gone_at?)))
            .max()
            .map(|(d, gone)| {
                format!(
                    "{:.1}s (deleted {:.0}s into the run)",
                    d.as_secs_f64(),
                    gone.duration_since(started).as_secs_f64()
                )
            })
            .unwrap_or("-".into())
    };
    println!(
        "{} {} real and {} ghost pods deleted, {looks} looks; slowest freed after leaving the \
         API: real {}, ghost {}",
        at(),
        real.len(),
        ghosts.len(),
        slowest(&real),
        slowest(&ghosts),
    );
    assert!(
        ledger.violations.is_empty(),
        "a live pod's address was freed: {:?}",
        ledger.violations
    );
    let leaked: Vec<String> = ledger
        .pods
        .iter()
        .filter(|(_, t)| latency(t).is_none())
        .map(|(n, t)| {
            format!(
                "{n} {} ({}; freed {:?} after its deletion)",
                t.ip,
                if t.real { "real" } else { "ghost" },
                latency(t)
            )
        })
        .collect();
    assert!(
        leaked.is_empty(),
        "leaked (not freed {freed_within:?} after the churn stopped): {leaked:?}"
    );
    assert!(
        !ghosts.is_empty() && real.len() >= 3,
        "the churn ran: {} real, {} ghosts",
        real.len(),
        ghosts.len()
    );
    wait_pool_matches_live_pods(&*c).await;
    expect_clean_releases(&*c).await;
}

mod kind_scenarios {
    /// Named `cluster_…` so that `e2e/kind/run.sh`'s `::cluster` filter runs it.
    #[tokio::test]
    async fn cluster_a_drain_and_a_controller_rollout_while_deletions_flow() {
        if std::env::var("IPRECLAIM_E2E").as_deref() != Ok("kind") {
            eprintln!(
                "needs the kind cluster of e2e/kind/run.sh (IPRECLAIM_E2E=kind): not run here"
            );
            return;
        }
        let c = crate::cluster::Cluster::kind("kind-churn").await;
        super::a_drain_and_a_controller_rollout_while_deletions_flow_leak_nothing_and_free_nothing_live(c)
            .await
    }
}
