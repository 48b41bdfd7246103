//! `--release-cooldown` with the real whereabouts allocator: a released address is not handed
//! out while it cools (not to another pod, not to a pod of the same name), its reservation
//! stays, a restart keeps the cooldown (its state is in the pool entry), and once it is over
//! the entry and the reservation go and the address is handed out again.

use std::net::Ipv4Addr;
use std::time::Duration;

use ipreclaim::api::IPAllocation;
use ipreclaim::rules::ReclaimConfig;
use testenv::ControlPlane;
use testenv::poll::{metric_value, wait_for};
use testenv::whereabouts::WhereaboutsCni;

use crate::harness::{Env, PoolRefusal};

const RANGE: &str = "198.18.7.0/29";
const POOL: &str = "198.18.7.0-29";
/// Long enough for the adds and a restart within it; the test polls for its end.
const COOLDOWN: &str = "--release-cooldown=6s";

impl Env {
    /// The entry of `pool` holding `ip`, if any.
    async fn entry_of(&self, pool: &str, ip: Ipv4Addr) -> Option<IPAllocation> {
        let p = self.pools().get(pool).await.unwrap();
        let key = (u32::from(ip) - u32::from(Ipv4Addr::new(198, 18, 7, 0))).to_string();
        p.spec.allocations.get(&key).cloned()
    }

    /// A pod `name` on the network, then its sandbox's ADD: the address whereabouts gave. The
    /// pod exists first without network-status (it keeps every allocation meanwhile).
    async fn pod_with_address(&self, cni: &WhereaboutsCni, name: &str, sandbox: &str) -> Ipv4Addr {
        self.pod(name, "net", None).await;
        let ip = cni.add(&self.ns, name, sandbox).await.unwrap();
        let status = crate::support::network_status(&self.ns, "net", &[&ip.to_string()]);
        self.merge_pods_annotation(name, &status).await;
        ip
    }

    async fn merge_pods_annotation(&self, name: &str, status: &str) {
        let patch = serde_json::json!({"metadata": {"annotations": {
            ipreclaim::ipam::NETWORK_STATUS_ANNOTATION: status}}});
        testenv::fixtures::merge(&self.pods(), name, patch).await;
    }
}

#[tokio::test]
async fn a_released_address_cools_with_the_real_allocator_survives_a_restart_and_returns() {
    let mut env = Env::new("cooldown").await;
    let cp = ControlPlane::shared();
    let cni = WhereaboutsCni::new(cp, &env.ns, &cp.dir().join(&env.ns), RANGE).unwrap();
    env.nad_config("net", cni.netconf()).await;
    let x = env.pod_with_address(&cni, "a-0", "sandbox-a").await;
    assert!(has_reservation(&env, x).await, "{x}'s reservation");
    env.start(&[COOLDOWN]).await;

    env.delete_pod("a-0").await;
    wait_for("a-0's entry rewritten as cooling", || async {
        env.entry_of(POOL, x).await.is_some_and(|e| {
            e.podref == format!("{}/a-0:cooldown", env.ns)
                && e.id.starts_with("ipreclaim-cooldown:")
        })
    })
    .await;
    env.wait_events_saying(
        "IPAddressGarbageCollected",
        &[&format!("[{x}]"), "(in cooldown until "],
    )
    .await;
    let cooling = format!("ipreclaim_pool_cooling{{pool=\"{}/{POOL}\"}} 1", env.ns);
    env.wait_metric(&cooling).await;

    // While it cools: another pod, and a pod of the same name, get other addresses; the old
    // sandbox's late DEL does not end the cooldown; the reservation stays.
    let b = env.pod_with_address(&cni, "b-0", "sandbox-b").await;
    assert_ne!(b, x, "a cooling address was handed out");
    cni.del(&env.ns, "a-0", "sandbox-a").await.unwrap();
    let again = env.pod_with_address(&cni, "a-0", "sandbox-a2").await;
    assert_ne!(
        again, x,
        "a pod of the same name got its cooling address back"
    );
    assert!(
        env.entry_of(POOL, x).await.is_some(),
        "the late DEL freed it"
    );
    assert!(has_reservation(&env, x).await, "{x}'s reservation");
    let rows = ipreclaim::scan::scan(env.client.clone(), &env.ns, ReclaimConfig::default())
        .await
        .unwrap();
    let row = rows
        .iter()
        .find(|r| r.ip == x.to_string())
        .expect("scan shows it");
    assert_eq!(row.decision, "cooling");
    assert!(!ipreclaim::scan::would_release(row));
    assert!(
        row.cooldown.as_ref().unwrap().remaining_seconds > Some(0),
        "{row:?}"
    );

    // A restart keeps it cooling: the state is the entry.
    env.stop().await;
    assert!(env.entry_of(POOL, x).await.is_some());
    env.start(&[COOLDOWN]).await;

    wait_for(
        "the cooldown to end: entry and reservation gone",
        || async {
            env.entry_of(POOL, x).await.is_none()
                && env
                    .reservations()
                    .get_opt(&x.to_string())
                    .await
                    .unwrap()
                    .is_none()
        },
    )
    .await;
    let none = format!("ipreclaim_pool_cooling{{pool=\"{}/{POOL}\"}} 0", env.ns);
    env.wait_metric(&none).await;
    // The lowest free address again: whereabouts hands it out.
    let c = env.pod_with_address(&cni, "c-0", "sandbox-c").await;
    assert_eq!(c, x, "the address is back in the pool");
    // Live pods' entries were never touched.
    for ip in [b, again, c] {
        let e = env.entry_of(POOL, ip).await.expect("live entry");
        assert!(!e.podref.ends_with(":cooldown"), "{e:?}");
    }
}

/// Whether the reservation of `ip` exists.
async fn has_reservation(env: &Env, ip: Ipv4Addr) -> bool {
    env.reservations()
        .get_opt(&ip.to_string())
        .await
        .unwrap()
        .is_some()
}

/// A cooldown whose end the apiserver refuses: the entry and its reservation stay, the
/// refusal is counted and retried after a backoff, and the other pool's cooldown ends
/// meanwhile; once the refusal is lifted, the entry and the reservation go. The cooldowns were
/// set by someone else (written here as a controller or node agent writes them, already due),
/// and this controller's own `--release-cooldown` is off: the end is in the entry.
#[tokio::test]
async fn a_refused_cooldown_end_keeps_entry_and_reservation_and_the_other_pools_end() {
    let mut env = Env::new("cooldown-refused").await;
    env.nad("net-a", "198.18.8.0/28").await;
    env.nad("net-b", "198.18.9.0/28").await;
    let due = "ipreclaim-cooldown:2026-01-01T00:00:00Z";
    env.pool(
        "198.18.8.0-28",
        "198.18.8.0/28",
        &[(3, due, "a-0:cooldown")],
    )
    .await;
    env.pool(
        "198.18.9.0-28",
        "198.18.9.0/28",
        &[(4, due, "b-0:cooldown")],
    )
    .await;
    env.reservation("198.18.8.3", "a-0").await;
    env.reservation("198.18.9.4", "b-0").await;
    let refusal = PoolRefusal::new(
        &env,
        "refuse-cooldown-end",
        "object.metadata.name != '198.18.8.0-28' || '3' in object.spec.allocations",
    )
    .await;
    let remove = serde_json::json!([{"op": "remove", "path": "/spec/allocations/3"}]);
    PoolRefusal::wait_in_force(&env, "198.18.8.0-28", remove.clone(), true).await;
    env.start(&[]).await;

    env.wait_keys("198.18.9.0-28", &[]).await;
    wait_for("b-0's reservation deleted after its cooldown", || async {
        !env.reservation_names()
            .await
            .contains(&"198.18.9.4".to_string())
    })
    .await;
    // Refused, then tried again after its backoff (1 s, then doubling), and refused again.
    wait_for("the refused end counted twice", || async {
        metric_value(
            &env.metrics_text().await,
            r#"ipreclaim_release_failures_total{cause="refused"}"#,
        ) >= 2.0
    })
    .await;
    assert_eq!(
        env.keys("198.18.8.0-28").await,
        ["3"],
        "a-0's cooling entry kept"
    );
    assert!(
        env.reservation_names()
            .await
            .contains(&"198.18.8.3".to_string()),
        "a-0's reservation kept while its entry stays"
    );
    let cooling = format!(
        "ipreclaim_pool_cooling{{pool=\"{}/198.18.8.0-28\"}} 1",
        env.ns
    );
    env.wait_metric(&cooling).await;

    refusal.lift().await;
    PoolRefusal::wait_in_force(&env, "198.18.8.0-28", remove, false).await;
    testenv::poll::wait_for_within(
        "a-0's cooldown ended once the refusal was lifted (retries are up to 30 s apart)",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            env.keys("198.18.8.0-28").await.is_empty()
                && !env
                    .reservation_names()
                    .await
                    .contains(&"198.18.8.3".to_string())
        },
    )
    .await;
    env.stop().await;
}

/// A node agent whose clock lags an hour releases a-0's address into a 10 s cooldown: the end it
/// writes has passed an hour ago by the leader's clock. (The test writes the entry as such an
/// agent writes it: a node's clock cannot be set back on this machine.) With its own
/// `--release-cooldown` set, the leader keeps the entry and its reservation until it has seen
/// it cooling that long (`ipreclaim_cooldowns_past_end` is 1 meanwhile), then ends it, no
/// earlier than 10 s after it started. Before, the leader ended it on its first pass.
#[tokio::test]
async fn an_end_written_by_a_lagging_clock_waits_the_whole_cooldown_from_the_first_sight() {
    let mut env = Env::new("cooldown-lagging").await;
    env.nad("net-a", "198.18.12.0/28").await;
    let hour_behind = jiff::Timestamp::now()
        .checked_sub(jiff::SignedDuration::from_secs(3600))
        .unwrap();
    let until = ipreclaim::ipam::cooldown::cooldown_end(hour_behind, Duration::from_secs(10));
    let marker = ipreclaim::ipam::cooldown::cooldown_id(until);
    env.pool(
        "198.18.12.0-28",
        "198.18.12.0/28",
        &[(3, &marker, "a-0:cooldown")],
    )
    .await;
    env.reservation("198.18.12.3", "a-0").await;
    // The controller cannot have seen the entry before it starts: it may end no earlier than
    // 10 s after this (a slow machine only makes the wait look longer).
    let before_start = std::time::Instant::now();
    env.start(&["--release-cooldown=10s"]).await;

    env.wait_metric("ipreclaim_cooldowns_past_end 1").await;
    assert_eq!(
        env.keys("198.18.12.0-28").await,
        ["3"],
        "kept while the leader has seen it cooling for less than its cooldown"
    );
    assert!(
        env.reservation_names()
            .await
            .contains(&"198.18.12.3".to_string()),
        "its reservation kept"
    );
    env.wait_keys("198.18.12.0-28", &[]).await;
    let waited = before_start.elapsed();
    assert!(
        waited >= Duration::from_secs(10),
        "ended {waited:?} after the controller started, before its 10 s cooldown"
    );
    wait_for("a-0's reservation deleted at the end", || async {
        !env.reservation_names()
            .await
            .contains(&"198.18.12.3".to_string())
    })
    .await;
    env.wait_metric("ipreclaim_cooldowns_past_end 0").await;
    env.stop().await;
}
