//! What an operator reads: every metric docs/reference/metrics.md names, and logs without
//! colour codes in a pipe.

use kube::api::DeleteParams;
use testenv::ControlPlane;
use testenv::poll::{WAIT, wait_for};

use crate::harness::Env;

#[tokio::test]
async fn every_metric_the_reference_names_is_on_metrics() {
    let mut env = Env::new("ctl-metrics-doc").await;
    // A pool and its network, so that the per-pool and per-network series exist; nothing
    // else has happened yet.
    env.macvlan(&[]).await;
    env.start(&[]).await;
    let ns = env.ns.clone();
    for series in [
        "breaker_holds_total",
        "allocations",
        "pool_problem_entries",
        "pool_allocated",
        "pool_fenced",
        "pool_leak_candidates",
        "pool_held",
    ] {
        env.wait_metric(&format!(
            r#"ipreclaim_{series}{{pool="{ns}/192.0.2.0-24"}} 0"#
        ))
        .await;
    }
    // Its size is its range's, less network and broadcast (the NAD narrows nothing).
    for series in ["pool_size", "pool_free"] {
        env.wait_metric(&format!(
            r#"ipreclaim_{series}{{pool="{ns}/192.0.2.0-24"}} 254"#
        ))
        .await;
    }
    for series in ["network_size", "network_free"] {
        env.wait_metric(&format!(
            r#"ipreclaim_{series}{{network="{ns}/macvlan"}} 254"#
        ))
        .await;
    }
    testenv::docs::assert_reference_metrics_on(&env.metrics_text().await, "ipreclaim_", 15);
    // A deleted pool's series go with it (one pool label format everywhere).
    env.pools()
        .delete("192.0.2.0-24", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the deleted pool's series removed", || async {
        !env.metrics_text().await.contains("192.0.2.0-24")
    })
    .await;
    env.stop().await;
}

#[tokio::test]
async fn text_logs_to_a_pipe_carry_no_colour_codes() {
    let cp = ControlPlane::shared();
    let (_, ns) = cp.client_crds_and_namespace("ctl-log-colour").await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
        .args([
            "controller",
            "--leader-election=false",
            "--metrics-addr=127.0.0.1:0",
            "--log-format=text",
        ])
        .arg(format!("--whereabouts-namespace={ns}"))
        .env("KUBECONFIG", cp.kubeconfig_path())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the ipreclaim binary");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        child.stderr.take().expect("stderr"),
    ));
    let mut seen = Vec::new();
    let ready = tokio::time::timeout(WAIT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            let done = line.contains("caches synced");
            seen.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await;
    child.kill().await.expect("stop the controller");
    assert_eq!(ready, Ok(true), "the controller logged readiness: {seen:?}");
    assert!(
        seen.iter().all(|l| !l.contains('\u{1b}')),
        "ANSI escape codes in piped logs: {seen:?}"
    );
}

/// The longest names Kubernetes allows (namespace 63, NAD and pod 253, the pod's name one
/// label or dotted labels): each pod's address is released and its Event (whose action names
/// the network, whose name starts with the pod's) accepted, and found by its reason.
#[tokio::test]
async fn a_release_event_at_the_longest_names_is_accepted() {
    crate::support::log_to_test_output();
    let cp = ControlPlane::shared();
    let (client, _) = cp.client_crds_and_namespace("ctl-long-names").await;
    let tag = format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let ns = format!("ctl-long-{tag}-{}", "n".repeat(63 - 10 - tag.len()));
    assert_eq!(ns.len(), 63);
    let namespace = k8s_openapi::api::core::v1::Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(ns.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(&Default::default(), &namespace)
        .await
        .unwrap();
    let mut env = Env::with(client, ns.clone());
    let nad = format!("macvlan-{}", "x".repeat(253 - 8));
    let one_label = format!("web-{}", "p".repeat(253 - 4));
    let dotted = format!("db.{}", [62, 62, 62, 61].map(|n| "q".repeat(n)).join("."));
    assert_eq!((nad.len(), one_label.len(), dotted.len()), (253, 253, 253));
    env.nad(&nad, "192.0.2.0/24").await;
    let entries = [(10, "sb-web", one_label.as_str()), (11, "sb-db", &dotted)];
    env.pool("192.0.2.0-24", "192.0.2.0/24", &entries).await;
    let mut uids = Vec::new();
    for (offset, _, pod) in entries {
        let ip = format!("192.0.2.{offset}");
        uids.push(env.pod(pod, &nad, Some(&[&ip])).await);
    }
    env.start(&[]).await;
    for (_, _, pod) in entries {
        env.delete_pod(pod).await;
    }
    env.wait_keys("192.0.2.0-24", &[]).await;
    let reason = "IPAddressGarbageCollected";
    let events = testenv::poll::wait_seen(
        &format!("{reason} Events in {ns}"),
        || env.events(reason),
        |events| events.len() == 2,
        |events| format!("{events:?}; refused ones are counted in ipreclaim_events_dropped_total"),
    )
    .await;
    for ((offset, _, pod), uid) in entries.iter().zip(&uids) {
        let (_, _, message) = events
            .iter()
            .find(|(name, event_uid, _)| name == pod && event_uid == uid)
            .unwrap_or_else(|| panic!("an Event on {pod}: {events:?}"));
        assert!(
            message.contains(&format!("[192.0.2.{offset}]")),
            "{message}"
        );
        assert!(message.len() <= 1024, "{}", message.len());
    }
    env.stop().await;
}
