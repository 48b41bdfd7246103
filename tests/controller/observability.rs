//! What an operator reads: every metric the README names, and logs without colour codes in a
//! pipe.

use kube::api::DeleteParams;
use testenv::ControlPlane;
use testenv::poll::{WAIT, wait_for};

use crate::harness::Env;

#[tokio::test]
async fn every_metric_the_readme_names_is_on_metrics() {
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
    testenv::docs::assert_readme_metrics_on(&env.metrics_text().await, "ipreclaim_", 15);
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
