//! Replicas and the Lease: one writer, failover when the leader stops, is killed or is cut
//! off, and a replica that just started lets the running standby take over.

use std::time::Duration;

use testenv::ControlPlane;
use testenv::faultproxy::{Action, FaultProxy, Rule};
use testenv::poll::{metric_value, wait_for};

use crate::harness::{Env, controller_process, controller_process_logging, holder_pid, lease};

#[tokio::test]
async fn with_two_replicas_only_the_lease_holder_writes() {
    let mut first = Env::new("ctl-ha").await;
    first.web_0_and_db_0().await;
    let lease = [
        "--leader-election=true".to_string(),
        format!("--lease-namespace={}", first.ns),
    ];
    let lease: Vec<&str> = lease.iter().map(String::as_str).collect();
    first.start(&lease).await;
    let mut second = Env::with(first.client.clone(), first.ns.clone());
    second.start(&lease).await;

    first.delete_pod("web-0").await;
    first.wait_keys("192.0.2.0-24", &["11"]).await;
    first.delete_pod("db-0").await;
    first.wait_keys("192.0.2.0-24", &[]).await;
    let patches = |text: String| {
        text.lines()
            .find_map(|l| l.strip_prefix(r#"ipreclaim_api_writes_total{verb="patch"} "#))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    let (a, b) = (
        patches(first.metrics_text().await),
        patches(second.metrics_text().await),
    );
    assert!(a == 0 || b == 0, "both replicas wrote: {a} and {b} patches");
    assert!(a + b >= 1, "someone wrote");
    let events = first.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(
        events.len(),
        2,
        "one Event per address, from the leader: {events:?}"
    );
    first.stop().await;
    second.stop().await;
}

#[tokio::test]
async fn when_the_leader_stops_the_standby_takes_over_and_nothing_is_released_twice() {
    let mut first = Env::new("ctl-failover").await;
    first
        .macvlan(&[(10, "sb-a", "a-0"), (11, "sb-b", "b-0")])
        .await;
    first.pod("a-0", "macvlan", Some(&["192.0.2.10"])).await;
    first.pod("b-0", "macvlan", Some(&["192.0.2.11"])).await;
    let flags = [
        "--leader-election=true".to_string(),
        format!("--lease-namespace={}", first.ns),
        "--lease-duration=3s".into(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    first.start(&flags).await;
    first.delete_pod("a-0").await;
    first.wait_keys("192.0.2.0-24", &["11"]).await;
    let mut second = Env::with(first.client.clone(), first.ns.clone());
    second.start(&flags).await;
    first.stop().await;

    second.delete_pod("b-0").await;
    second.wait_keys("192.0.2.0-24", &[]).await;
    second
        .wait_metric(r#"ipreclaim_releases_total{reason="PodDeleted"} 1"#)
        .await;
    second.wait_released_once(&["a-0", "b-0"]).await;
    second.stop().await;
}

/// `pods` (name, address offset in the macvlan pool) with a leader (`a`, Lease of 6 s) that
/// reaches the apiserver through a fault proxy, and a standby (`b`) that reaches it directly;
/// the proxy applies `rule` once both run.
async fn leader_behind_a_fault_proxy_and_a_standby(
    prefix: &str,
    pods: &[(&str, u32)],
    rule: Rule,
) -> (Env, Env, FaultProxy) {
    let cp = ControlPlane::shared();
    let mut a = Env::new(prefix).await;
    let sandboxes: Vec<String> = pods.iter().map(|(name, _)| format!("sb-{name}")).collect();
    let entries: Vec<(u32, &str, &str)> = pods
        .iter()
        .zip(&sandboxes)
        .map(|((name, offset), sb)| (*offset, sb.as_str(), *name))
        .collect();
    a.macvlan(&entries).await;
    for (name, offset) in pods {
        a.pod(name, "macvlan", Some(&[&format!("192.0.2.{offset}")]))
            .await;
    }
    let flags = [
        "--leader-election=true".to_string(),
        format!("--lease-namespace={}", a.ns),
        "--lease-duration=6s".to_string(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let proxy = FaultProxy::start(a.client.clone(), 3).await.expect("proxy");
    let through = cp.client_through_faults(&proxy).await;
    a.start_as(through, &flags).await;
    a.wait_metric("ipreclaim_leader 1").await;
    let mut b = Env::with(a.client.clone(), a.ns.clone());
    b.start(&flags).await;
    b.wait_metric("ipreclaim_leader 0").await;
    proxy.set_rules(vec![rule]);
    (a, b, proxy)
}

/// The leader's own connection to the apiserver is cut (a partition: the fault proxy in front
/// of it answers nothing and delivers nothing) while the standby's works. The leader stops
/// writing before its Lease can expire (its `ipreclaim_leader` goes to 0 before the standby
/// leads), no write leaves it after that, the standby takes over and releases web-0 and db-0,
/// and after the partition heals no two replicas lead at once. The old leader's pool patch for
/// db-0 was on its way at the cut (held by the proxy) and arrives after the heal, a slow write:
/// by then db-0 was recreated and got its address back in a new sandbox, and the patch's `test`
/// of the entry's id refuses it. web-0 was deleted while the standby did not lead: kept as a
/// tombstone, not queued, and judged at takeover. Before, a leader whose renewals failed was
/// never told and kept leading.
#[tokio::test]
async fn a_leader_cut_off_from_the_apiserver_stops_writing_before_a_standby_takes_over() {
    // The leader's pool patch for db-0 is on its way at the cut: it arrives after the heal.
    let hold = Rule::new(Some("patch"), Some("ippools"), Action::Hold);
    let (mut a, mut b, proxy) = leader_behind_a_fault_proxy_and_a_standby(
        "ctl-partition",
        &[("web-0", 10), ("db-0", 11)],
        hold,
    )
    .await;
    a.delete_pod("db-0").await;
    wait_for("the leader's pool patch for db-0 in flight", || async {
        proxy.injected().contains_key("hold patch ippools")
    })
    .await;
    proxy.cut();
    proxy.clear();
    let cut = std::time::Instant::now();
    // Deleted while the standby does not lead: it keeps the tombstone, not a queue item (a
    // standby's queue used to grow with every deletion, forever), and judges it at takeover.
    a.delete_pod("web-0").await;
    // The standby sets its queue gauge every 200 ms (its sweep loop, which sweeps only when
    // it leads): five rounds.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = b.metrics_text().await;
    assert_eq!(
        metric_value(&text, "ipreclaim_leader"),
        0.0,
        "still the standby"
    );
    assert_eq!(
        metric_value(&text, "ipreclaim_queue_depth"),
        0.0,
        "nothing queued on the standby"
    );
    let demoted = async {
        a.wait_metric("ipreclaim_leader 0").await;
        cut.elapsed()
    };
    let took_over = async {
        b.wait_metric("ipreclaim_leader 1").await;
        cut.elapsed()
    };
    let (demoted, took_over) = tokio::join!(demoted, took_over);
    eprintln!(
        "partition: the cut-off leader stopped writing {demoted:.1?} after the cut, the standby led {took_over:.1?} after it"
    );
    assert!(
        demoted < took_over,
        "the old leader stopped writing ({demoted:?}) before the standby led ({took_over:?})"
    );
    b.wait_keys("192.0.2.0-24", &[]).await;
    // db-0 recreated (a StatefulSet) gets its address back in a new sandbox before the heal.
    b.recreate("db-0", 11, "sb-db-new").await;
    // Healed, the old leader's watches resume (and kube-lease-manager may take the Lease back
    // for it): never two writers at once, sampled every 100 ms.
    proxy.heal();
    let healed = std::time::Instant::now();
    for _ in 0..60 {
        let (ta, tb) = (a.metrics_text().await, b.metrics_text().await);
        let leads = |t: &str| metric_value(t, "ipreclaim_leader") == 1.0;
        assert!(!(leads(&ta) && leads(&tb)), "two replicas lead at once");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let demoted_at = cut + demoted;
    let pool_writes: Vec<_> = proxy
        .writes()
        .into_iter()
        .filter(|w| w.resource == "ippools")
        .collect();
    assert!(
        pool_writes.iter().all(|w| w.entered < demoted_at),
        "the old leader sent a pool write after it stopped leading: {pool_writes:?}"
    );
    assert!(
        pool_writes.iter().any(|w| w.at >= healed),
        "the patch held at the cut arrived after the heal: {pool_writes:?}"
    );
    let pool = b.pools().get("192.0.2.0-24").await.unwrap();
    let ids: Vec<(&String, &str)> = pool
        .spec
        .allocations
        .iter()
        .map(|(k, v)| (k, v.id.as_str()))
        .collect();
    assert_eq!(
        ids,
        [(&"11".to_string(), "sb-db-new")],
        "the recreated db-0 keeps its address (late pool writes: {pool_writes:?})"
    );
    b.wait_released_once(&["db-0", "web-0"]).await;
    a.stop().await;
    b.stop().await;
}

/// A release the leader wrote right before it was cut off is still reported: its Event, which
/// the apiserver refused (503) until then, goes once the old leader reaches the apiserver again,
/// although it no longer leads. Before, a demoted leader dropped it at its gate, and that
/// release had no Event at all: the standby that took over found nothing left to release.
#[tokio::test]
async fn a_release_written_just_before_the_cut_is_reported_after_the_heal() {
    let refuse = Rule::new(Some("create"), Some("events"), Action::Status(503));
    let (mut a, mut b, proxy) =
        leader_behind_a_fault_proxy_and_a_standby("ctl-cut-event", &[("db-0", 11)], refuse).await;
    a.delete_pod("db-0").await;
    a.wait_keys("192.0.2.0-24", &[]).await;
    let refused = || {
        let injected = proxy.injected();
        injected.get("503 create events").copied().unwrap_or(0)
    };
    wait_for("the release Event refused", || async { refused() > 0 }).await;
    proxy.cut();
    a.wait_metric("ipreclaim_leader 0").await;
    b.wait_metric("ipreclaim_leader 1").await;
    // The old leader's Lease writes stay refused after the heal: on a loaded machine a late
    // renewal of the standby's would hand the Lease back to it, and the retries below must come
    // from a replica that does not lead.
    let refuse_lease = |verb| Rule::new(Some(verb), Some("leases"), Action::Status(503));
    proxy.set_rules(vec![
        Rule::new(Some("create"), Some("events"), Action::Status(503)),
        refuse_lease("patch"),
        refuse_lease("create"),
        refuse_lease("update"),
    ]);
    proxy.heal();
    // The one try held in the partition is answered now; more tries show the Event is still
    // sent by a replica that does not lead.
    let at_heal = refused();
    wait_for("the old leader trying the Event again", || async {
        refused() >= at_heal + 2
    })
    .await;
    let text = a.metrics_text().await;
    assert_eq!(
        metric_value(&text, "ipreclaim_leader"),
        0.0,
        "a standby now"
    );
    proxy.clear();
    b.wait_released_once(&["db-0"]).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn when_the_leader_is_killed_the_standby_leads_within_the_lease_and_one_renew_period() {
    let env = Env::new("ctl-kill-leader").await;
    let (duration, grace) = (4u64, 1u64);
    let lease_ns = format!("--lease-namespace={}", env.ns);
    let flags = ["--leader-election=true", "--lease-duration=4s", &lease_ns];
    let mut replicas = [
        controller_process(&env, &flags),
        controller_process(&env, &flags),
    ];
    wait_for("a leader", || async { lease(&env).await.is_some() }).await;
    let (holder, _) = lease(&env).await.unwrap();
    let pid = holder_pid(&holder);
    let leader = replicas
        .iter_mut()
        .position(|c| c.id() == pid)
        .unwrap_or_else(|| panic!("the holder {holder} is one of the replicas"));
    replicas[leader].kill().unwrap();
    let killed_at = jiff::Timestamp::now();
    replicas[leader].wait().unwrap();
    wait_for("the standby to hold the Lease", || async {
        lease(&env).await.is_some_and(|(h, _)| h != holder)
    })
    .await;
    let (_, acquired) = lease(&env).await.unwrap();
    let took = acquired.duration_since(killed_at);
    let bound = jiff::SignedDuration::from_secs((duration + (duration - grace)) as i64);
    eprintln!(
        "failover: the standby acquired the Lease {took:#} after the leader's SIGKILL (bound {bound:#})"
    );
    assert!(
        took <= bound,
        "failover took {took:#}, more than the Lease duration plus one renew period ({bound:#})"
    );
}

/// A replica that starts while another holds the Lease stands for it only later, so that a
/// standby that was running (and saw the deletions of the takeover gap: the nodes of the pods
/// to fence) takes over first. Before, the newcomer and the standby both tried at expiry and
/// either could win.
#[tokio::test]
async fn a_replica_that_just_started_lets_the_running_standby_take_over() {
    let env = Env::new("ctl-newcomer").await;
    let lease_ns = format!("--lease-namespace={}", env.ns);
    let flags = ["--leader-election=true", "--lease-duration=4s", &lease_ns];
    let logs = ControlPlane::shared()
        .dir()
        .join(format!("{}-logs", env.ns));
    std::fs::create_dir_all(&logs).unwrap();
    let start = |name: &str| controller_process_logging(&env, &flags, Some(&logs.join(name)));
    let standing = |name: &str| {
        std::fs::read_to_string(logs.join(name)).is_ok_and(|l| l.contains("standing for the Lease"))
    };
    let mut leader = start("leader.log");
    wait_for("a leader", || async { lease(&env).await.is_some() }).await;
    let (holder, _) = lease(&env).await.unwrap();
    assert_eq!(holder_pid(&holder), leader.id());
    let standby = start("standby.log");
    wait_for("the standby to stand for the Lease", || async {
        standing("standby.log")
    })
    .await;
    leader.kill().unwrap();
    leader.wait().unwrap();
    let _newcomer = start("newcomer.log");
    wait_for("a new holder", || async {
        lease(&env).await.is_some_and(|(h, _)| h != holder)
    })
    .await;
    let (now_holder, _) = lease(&env).await.unwrap();
    let waited = std::fs::read_to_string(logs.join("newcomer.log")).unwrap_or_default();
    assert!(
        waited.contains("standing for it after a wait"),
        "the newcomer did not wait: {waited}"
    );
    assert_eq!(
        holder_pid(&now_holder),
        standby.id(),
        "the replica that just started took the Lease before the running standby"
    );
}
