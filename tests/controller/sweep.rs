//! The sweep: an address not on its pod, a terminal pod, an orphan after the grace, the
//! breaker (also across a restart), an address listed between sweeps; `scan`, which reads what
//! the same rules would release.

use std::time::Duration;

use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use testenv::poll::{metric_value, wait_for};

use crate::harness::Env;

// The scenarios run twice, as admin and as the chart's ServiceAccount.
testenv::as_admin_and_as_the_chart!(Env {
    sweep_releases_an_ip_not_on_the_pod_but_never_a_listed_one: "ctl-sweep",
    a_succeeded_pod_is_released_and_a_late_orphan_waits_for_the_grace: "ctl-done",
    breaker_holds_a_sweep_that_would_free_most_of_a_pool: "ctl-breaker",
});

#[tokio::test]
async fn leaks_that_mature_sweep_by_sweep_are_held_once_together_they_pass_the_ratio() {
    let mut env = Env::new("ctl-trickle").await;
    // Twelve pods with an entry each; p0-p4 list another address: 5 of 12 leak.
    let names: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
    env.macvlan_of_pods(&names).await;
    for (i, n) in names.iter().enumerate() {
        let ip = match i {
            0..5 => format!("192.0.2.{}", 100 + i),
            _ => format!("192.0.2.{}", 10 + i),
        };
        env.pod(n, "macvlan", Some(&[ip.as_str()])).await;
    }
    env.start(&[]).await;
    let kept: Vec<String> = (15..22).map(|k| k.to_string()).collect();
    let kept: Vec<&str> = kept.iter().map(String::as_str).collect();
    env.wait_keys("192.0.2.0-24", &kept).await;

    // Three more leaks appear (stale entries of p5-p7): 3 of the 10 now, under half alone,
    // but 8 of the 15 the pool had before the sweeps of the last minutes.
    let stale = |i: usize| crate::support::allocation(&env.ns, &names[i], "sb-stale");
    let patch = serde_json::json!({"spec": {"allocations": {
        "30": stale(5), "31": stale(6), "32": stale(7),
    }}});
    env.merge_pool("192.0.2.0-24", patch).await;
    env.wait_events_saying(
        "IPAddressGarbageCollectionHeld",
        &["3 of 10", "after 5 released"],
    )
    .await;
    env.wait_sweeps(3.0).await;
    assert_eq!(
        env.keys("192.0.2.0-24").await.len(),
        10,
        "the three stale entries are held, not released"
    );
    env.stop().await;
}

async fn sweep_releases_an_ip_not_on_the_pod_but_never_a_listed_one(mut env: Env) {
    // web-0 lists .21 only; .20 is a stale allocation from an earlier sandbox.
    env.macvlan(&[(20, "sb-1", "web-0"), (21, "sb-2", "web-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.21"])).await;
    // A pod without network-status keeps everything (allocation races the annotation).
    env.pool("192.0.2.128-25", "192.0.2.128/25", &[(1, "sb-3", "new-0")])
        .await;
    env.pod("new-0", "macvlan", None).await;
    env.start(&[]).await;

    env.wait_keys("192.0.2.0-24", &["21"]).await;
    env.wait_metric(r#"ipreclaim_releases_total{reason="IPNotOnPod"} 1"#)
        .await;
    assert_eq!(env.keys("192.0.2.128-25").await, ["1"]);
    env.stop().await;
}

async fn a_succeeded_pod_is_released_and_a_late_orphan_waits_for_the_grace(mut env: Env) {
    env.macvlan(&[(10, "sb-job", "job-0"), (11, "sb-web", "web-0")])
        .await;
    env.pod("job-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.11"])).await;
    testenv::fixtures::merge_status(
        &env.pods(),
        "job-0",
        serde_json::json!({"status": {"phase": "Succeeded"}}),
    )
    .await;
    env.start(&["--leak-grace=3s"]).await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodTerminal"} 1"#)
        .await;

    // An allocation for a pod that never existed appears after start: only the sweep, after
    // the grace period, may release it.
    let patch = serde_json::json!({"spec": {"allocations": {"12": {"id": "sb-x", "podref": format!("{}/ghost", env.ns)}}}});
    env.merge_pool("192.0.2.0-24", patch).await;
    let appeared = std::time::Instant::now();
    env.wait_sweeps(2.0).await;
    if appeared.elapsed() < Duration::from_secs(3) {
        assert_eq!(
            env.keys("192.0.2.0-24").await,
            ["11", "12"],
            "not before the grace period"
        );
        env.wait_metric(r#"ipreclaim_gc_candidates{reason="PodMissing"} 1"#)
            .await;
    }
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    assert!(
        appeared.elapsed() >= Duration::from_secs(3),
        "released only after the grace"
    );
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodMissing"} 1"#)
        .await;
    env.stop().await;
}

/// Twelve pods with an entry each, every one listing another address: all twelve look like
/// IPNotOnPod, more than half of the pool.
async fn twelve_pods_listing_other_addresses(env: &mut Env) {
    let names: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
    env.macvlan_of_pods(&names).await;
    for (i, n) in names.iter().enumerate() {
        let other = format!("192.0.2.{}", 100 + i);
        env.pod(n, "macvlan", Some(&[other.as_str()])).await;
    }
}

async fn breaker_holds_a_sweep_that_would_free_most_of_a_pool(mut env: Env) {
    twelve_pods_listing_other_addresses(&mut env).await;
    env.start(&[]).await;
    let held = env.wait_events("IPAddressGarbageCollectionHeld").await;
    assert_eq!(held[0].0, "192.0.2.0-24");
    assert!(held[0].2.contains("12 of 12"), "{held:?}");
    assert!(
        held[0].2.contains("--releases 12"),
        "the command to run: {held:?}"
    );
    assert_eq!(env.keys("192.0.2.0-24").await.len(), 12, "nothing released");
    env.wait_metric("ipreclaim_breaker_holds_total").await;
    // One hold episode, however many sweeps it lasts.
    env.wait_sweeps(3.0).await;
    let text = env.metrics_text().await;
    let series = format!(
        r#"ipreclaim_breaker_holds_total{{pool="{}/192.0.2.0-24"}}"#,
        env.ns
    );
    assert_eq!(metric_value(&text, &series), 1.0, "{text}");
    let held = format!(r#"ipreclaim_pool_held{{pool="{}/192.0.2.0-24"}} 1"#, env.ns);
    env.wait_metric(&held).await;

    // An approval of fewer releases than the hold's (the held set grew since the operator
    // looked) keeps the hold, says so (each time with its own numbers, in an Event of its
    // own), and is used up.
    let approval_gone = || async {
        let pool = env.pools().get("192.0.2.0-24").await.unwrap();
        let annotations = pool.metadata.annotations.unwrap_or_default();
        !annotations.contains_key("ipreclaim.io/approve-hold")
    };
    for too_few in ["10", "11"] {
        crate::harness::cli(
            &env,
            "approve-hold",
            &["--pool", "192.0.2.0-24", "--releases", too_few],
        );
        let at_most = format!("at most {too_few}");
        let says = [at_most.as_str(), "would release 12", "--releases 12"];
        testenv::poll::wait_seen(
            &format!("a Held Event saying an approval of {too_few} is outgrown"),
            || env.events("IPAddressGarbageCollectionHeld"),
            |events| events.iter().any(|e| says.iter().all(|s| e.2.contains(s))),
            |events| format!("{events:?}"),
        )
        .await;
        wait_for("the outgrown approval removed from the pool", approval_gone).await;
        assert_eq!(env.keys("192.0.2.0-24").await.len(), 12, "still held");
    }

    // An operator approves the hold once, with the command an operator would run.
    approve_hold(&env);
    let approved = env
        .wait_events("IPAddressGarbageCollectionHoldApproved")
        .await;
    assert!(approved[0].2.contains("releasing 12"), "{approved:?}");
    env.wait_keys("192.0.2.0-24", &[]).await;
    wait_for("the used approval removed from the pool", approval_gone).await;
    // An approval with nothing held is used up too: it never waits for a later hold.
    approve_hold(&env);
    wait_for("the unneeded approval removed from the pool", approval_gone).await;
    env.stop().await;
}

/// An approval is used up before its releases go: while the apiserver refuses to remove the
/// approval annotation (an admission policy here; any refused write), the held set stays, sweep
/// after sweep; once it can be removed, the held set goes once. Before, the releases went first
/// and the approval, not removable, stayed to approve the next sweep over the ratio too (or a
/// new leader's).
#[tokio::test]
async fn an_approval_that_cannot_be_used_up_releases_nothing() {
    use crate::harness::PoolRefusal;
    let mut env = Env::new("ctl-approve-first").await;
    twelve_pods_listing_other_addresses(&mut env).await;
    let probe = "test.ipreclaim.io/probe";
    let annotate = serde_json::json!({"metadata": {"annotations": {probe: "x"}}});
    env.merge_pool("192.0.2.0-24", annotate).await;
    let kept = |k: &str| {
        format!(
            "!has(oldObject.metadata.annotations) || !('{k}' in oldObject.metadata.annotations) \
             || (has(object.metadata.annotations) && '{k}' in object.metadata.annotations)"
        )
    };
    let expression = format!(
        "({}) && ({})",
        kept("ipreclaim.io/approve-hold"),
        kept(probe)
    );
    let refusal = PoolRefusal::new(&env, "keep-approval", &expression).await;
    let remove_probe = serde_json::json!([
        {"op": "remove", "path": "/metadata/annotations/test.ipreclaim.io~1probe"}
    ]);
    PoolRefusal::wait_in_force(&env, "192.0.2.0-24", remove_probe.clone(), true).await;
    env.start(&[]).await;
    env.wait_events("IPAddressGarbageCollectionHeld").await;
    approve_hold(&env);
    env.wait_sweeps(5.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await.len(), 12, "nothing released");
    let approved = env.events("IPAddressGarbageCollectionHoldApproved").await;
    assert!(approved.is_empty(), "{approved:?}");
    refusal.lift().await;
    PoolRefusal::wait_in_force(&env, "192.0.2.0-24", remove_probe, false).await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.wait_events("IPAddressGarbageCollectionHoldApproved")
        .await;
    env.stop().await;
}

/// `ipreclaim approve-hold` for the test's pool, as an operator runs it.
fn approve_hold(env: &Env) {
    crate::harness::cli(env, "approve-hold", &["--pool", "192.0.2.0-24"]);
}

#[tokio::test]
async fn a_restart_never_releases_what_the_breaker_holds_and_pods_gone_meanwhile_still_go_fast() {
    let mut env = Env::new("ctl-restart-held").await;
    // 40 allocations whose pods do not exist: a sweep would free all of them.
    let names: Vec<String> = (0..40).map(|i| format!("gone-{i}")).collect();
    env.macvlan_of_pods(&names).await;
    let flags = ["--max-release-ratio=0.5"];
    env.start(&flags).await;
    env.wait_events_saying("IPAddressGarbageCollectionHeld", &["40 of 40"])
        .await;
    env.stop().await;

    // While it is down, a pod of a small pool is deleted; then it restarts (same flags).
    env.nad("small", "198.18.1.0/24").await;
    env.pool("198.18.1.0-24", "198.18.1.0/24", &[(7, "sb-x", "live-1")])
        .await;
    env.pod("live-1", "small", Some(&["198.18.1.7"])).await;
    env.delete_pod("live-1").await;
    env.start(&flags).await;
    env.wait_keys("198.18.1.0-24", &[]).await;
    env.wait_sweeps(5.0).await;
    assert_eq!(
        env.keys("192.0.2.0-24").await.len(),
        40,
        "the restart released what the breaker holds"
    );
    env.wait_released_once(&["live-1"]).await;
    env.stop().await;
}

#[tokio::test]
async fn a_pod_that_lists_its_address_between_sweeps_keeps_it() {
    let mut env = Env::new("ctl-flap").await;
    env.macvlan(&[(10, "sb-web", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.99"])).await;
    env.start(&["--leak-grace=1s"]).await;
    let status = |ip: &str| {
        let s = serde_json::json!([
            {"name": format!("{}/macvlan", env.ns), "interface": "net1", "ips": [ip]},
        ]);
        serde_json::json!({"metadata": {"annotations": {NETWORK_STATUS_ANNOTATION: s.to_string()}}})
    };
    // web-0 lists its address briefly every 400 ms: the sweep (every 200 ms) mostly samples the
    // other one, but the address never goes a whole grace (1 s) unlisted.
    for _ in 0..15 {
        for (ip, ms) in [("192.0.2.10", 50), ("192.0.2.99", 350)] {
            testenv::fixtures::merge(&env.pods(), "web-0", status(ip)).await;
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        assert_eq!(
            env.keys("192.0.2.0-24").await,
            ["10"],
            "released while in use"
        );
    }
    // Unlisted for good: released after the grace.
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.stop().await;
}

#[tokio::test]
async fn scan_reports_what_the_rules_would_release_and_writes_nothing() {
    let env = Env::new("scan").await;
    env.macvlan(&[
        (10, "sb-a", "gone-0"),
        (20, "sb-1", "web-0"),
        (21, "sb-2", "web-0"),
    ])
    .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.21"])).await;
    let rows = ipreclaim::scan::scan(env.client.clone(), &env.ns, Default::default())
        .await
        .expect("scan");
    let got: Vec<(String, String, String, String, String)> = rows
        .iter()
        .map(|r| {
            (
                r.ip.clone(),
                r.podref.clone(),
                r.sandbox.clone(),
                r.decision.clone(),
                r.reason.clone(),
            )
        })
        .collect();
    let ns = &env.ns;
    let row = |ip: &str, pod: &str, sb: &str, reason: &str| {
        (
            ip.to_string(),
            format!("{ns}/{pod}"),
            sb.to_string(),
            "candidate".to_string(),
            reason.to_string(),
        )
    };
    assert_eq!(
        got,
        [
            row("192.0.2.10", "gone-0", "sb-a", "PodMissing"),
            row("192.0.2.20", "web-0", "sb-1", "IPNotOnPod")
        ]
    );
    assert_eq!(rows[0].pod_age_seconds, None);
    assert!(rows[1].pod_age_seconds.is_some());
    let json = serde_json::to_value(&rows).unwrap();
    assert_eq!(json[1]["reason"], "IPNotOnPod");
    assert_eq!(json[1]["pool"], "192.0.2.0-24");
    assert_eq!(json[0]["pod_age_seconds"], serde_json::Value::Null);
    let table = ipreclaim::scan::table(&rows);
    assert!(table.starts_with("POOL"), "{table}");
    assert_eq!(table.lines().count(), 3, "{table}");
    assert_eq!(
        env.keys("192.0.2.0-24").await,
        ["10", "20", "21"],
        "scan is read-only"
    );
}
