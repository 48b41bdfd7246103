//! Forged network-status (issue 35, item 4): any user who can create a pod can write the
//! annotation on a Pending pod. Hundreds of forged pods (large, many-attachment, many-IP, and
//! hundreds listing the same addresses) neither stop releases elsewhere nor take the
//! controller's memory near its chart limit; a forged annotation past a cap is malformed (the
//! pod keeps its allocations), reported once per pod. How long a release takes meanwhile is
//! printed by `cargo bench --bench scale -- --phases hostile`, not asserted here.

use std::time::Duration;

use futures::{StreamExt, stream};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use kube::api::PostParams;
use testenv::poll::{http_get, wait_for};

use testenv::procs::ChildGuard;

use crate::harness::{Env, warnings};
use crate::support::TEST_TIMINGS;

/// The controller's address space at most (prlimit execs it: the pid is the controller's).
const ADDRESS_SPACE: u64 = 4 << 30;

/// Forged pods of each kind.
const EACH: usize = 100;
/// Pod `i` of forged `kind` (see `testenv::fixtures::FORGED_KINDS`) in `ns`: `shared` pods
/// list 198.18.100.0-255.
fn forged_pod(kind: &str, ns: &str, i: usize) -> k8s_openapi::api::core::v1::Pod {
    let status = testenv::fixtures::forged_network_status(kind, &format!("{ns}/bulk"), |k| {
        format!("198.18.100.{k}")
    });
    testenv::fixtures::forged_pod(&format!("{kind}-{i}"), NETWORK_STATUS_ANNOTATION, status)
}

/// The peak resident memory of process `pid`, in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib / 1024.0
}

/// The controller's memory limit in the chart, in MiB.
fn chart_memory_limit_mib() -> f64 {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/ipreclaim/values.yaml");
    let values: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let limit = values["controller"]["resources"]["limits"]["memory"]
        .as_str()
        .expect("controller.resources.limits.memory");
    limit
        .strip_suffix("Mi")
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("a limit in Mi: {limit}"))
}

#[tokio::test]
async fn hundreds_of_forged_pods_stop_no_release_and_stay_far_from_the_memory_limit() {
    // A control plane of its own: every controller of this process would read these pods,
    // and report them, on the shared one.
    let (cp, mut env) = Env::private("ctl-forged").await;
    let ns = env.ns.clone();
    // An ordinary pod to release, and the forged pods' own allocations, which they keep.
    env.macvlan(&[(10, "sb-web", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.nad("bulk", "198.18.0.0/16").await;
    let kept: Vec<(u32, String, String)> = ["big", "wide", "many"]
        .iter()
        .enumerate()
        .flat_map(|(k, kind)| {
            (0..EACH).map(move |i| {
                let offset = (1 + k * EACH + i) as u32;
                (offset, format!("sb-{kind}-{i}"), format!("{kind}-{i}"))
            })
        })
        .collect();
    env.pool("198.18.0.0-16", "198.18.0.0/16", &kept).await;
    let pods = env.pods();
    let made: Vec<(String, usize)> = testenv::fixtures::FORGED_KINDS
        .iter()
        .flat_map(|k| (0..EACH).map(move |i| (k.to_string(), i)))
        .collect();
    stream::iter(made)
        .for_each_concurrent(16, |(kind, i)| {
            let (pods, ns) = (pods.clone(), ns.clone());
            async move {
                pods.create(&PostParams::default(), &forged_pod(&kind, &ns, i))
                    .await
                    .unwrap_or_else(|e| panic!("create {kind}-{i}: {e}"));
            }
        })
        .await;

    // The controller as its own process, so that its memory is its own; it lists them all.
    // Under an address-space limit: a controller whose memory runs away fails this test, not
    // the machine.
    let port = testenv::procs::free_port().unwrap();
    let mut command = std::process::Command::new("prlimit");
    command
        .arg(format!("--as={}", ADDRESS_SPACE))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_ipreclaim"))
        .arg("controller")
        .arg(format!("--whereabouts-namespace={ns}"))
        .args(TEST_TIMINGS)
        .arg("--leader-election=false")
        .arg(format!("--metrics-addr=127.0.0.1:{port}"))
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null());
    let controller = ChildGuard::spawn(&mut command).expect("start the ipreclaim binary");
    env.metrics = format!("127.0.0.1:{port}").parse().unwrap();
    wait_for("the controller ready", || async {
        tokio::time::timeout(Duration::from_secs(1), async {
            tokio::net::TcpStream::connect(env.metrics).await.is_ok()
                && http_get(env.metrics, "/readyz").await.0 == 200
        })
        .await
        .unwrap_or(false)
    })
    .await;

    // Past a cap: malformed, as if it had no network-status.
    env.wait_metric(&format!(
        "ipreclaim_malformed_network_status_pods {}",
        3 * EACH
    ))
    .await;
    // Releases elsewhere still happen.
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.wait_released_once(&["web-0"]).await;
    // The forged pods keep their allocations (their network-status does not list them: read,
    // it would make them leaks).
    env.wait_sweeps(3.0).await;
    assert_eq!(env.keys("198.18.0.0-16").await.len(), kept.len());
    // Reported once per pod, saying which cap (published from a queue: wait until all three
    // pods have theirs).
    let firsts = ["big-0", "wide-0", "many-0"];
    wait_for("the Warnings on big-0, wide-0 and many-0", || async {
        let said = warnings(&env, "MalformedNetworkStatus").await;
        firsts.iter().all(|f| said.iter().any(|(p, _, _)| p == f))
    })
    .await;
    let said = warnings(&env, "MalformedNetworkStatus").await;
    for (pod, says) in [
        ("big-0", "more than 32768 bytes"),
        ("wide-0", "more than 32 attachments"),
        ("many-0", "more than 16 IPs on one attachment"),
    ] {
        let on: Vec<_> = said.iter().filter(|(p, _, _)| p == pod).collect();
        assert_eq!(on.len(), 1, "one Event on {pod}: {said:?}");
        assert!(on[0].1.contains(says), "{pod}: {says:?} in {:?}", on[0].1);
    }
    // The shared pods' 256 addresses are duplicates, reported on the pool within an Event's
    // note.
    env.wait_metric(&format!(
        r#"ipreclaim_duplicate_addresses{{network="{ns}/bulk"}} 256"#
    ))
    .await;
    let on_pool = testenv::poll::wait_seen(
        "an IPAddressDuplicate Event on the pool",
        || warnings(&env, "IPAddressDuplicate"),
        |w| w.iter().any(|(o, _, _)| o == "198.18.0.0-16"),
        |w| format!("{} Events, none on the pool", w.len()),
    )
    .await;
    assert!(on_pool.iter().all(|(_, m, _)| m.len() <= 1024));

    let peak = peak_rss_mib(controller.id());
    let limit = chart_memory_limit_mib();
    println!(
        "controller peak RSS with {} forged pods: {peak:.1} MiB (chart limit {limit} MiB)",
        4 * EACH
    );
    assert!(
        peak < limit / 2.0,
        "peak RSS {peak:.1} MiB, half the chart's limit is {} MiB",
        limit / 2.0
    );
    drop(controller);
}
