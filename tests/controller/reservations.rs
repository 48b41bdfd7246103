//! OverlappingRangeIPReservations: orphans swept, live ones kept, and a reservation whose
//! address a recreated pod got back kept or put back.

use std::time::Duration;

use testenv::ControlPlane;
use testenv::poll::wait_for;

use crate::harness::Env;

// The scenarios run twice, as admin and as the chart's ServiceAccount.
testenv::as_admin_and_as_the_chart!(Env {
    orphaned_reservations_are_swept_and_live_ones_kept: "ctl-orip",
});

async fn orphaned_reservations_are_swept_and_live_ones_kept(mut env: Env) {
    env.macvlan(&[(10, "sb-web", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    for (name, pod) in [("192.0.2.10", "web-0"), ("192.0.2.99", "ghost-0")] {
        env.reservation_of(name, "sb", pod).await;
    }
    env.start(&[]).await;
    wait_for("the orphaned reservation deleted", || async {
        env.reservation_names().await == ["192.0.2.10"]
    })
    .await;
    env.wait_metric(r#"ipreclaim_api_writes_total{verb="delete"} 1"#)
        .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"]);
    env.stop().await;
}

/// web-0 recreated, and given 192.0.2.10 back by a new sandbox as whereabouts does by podref.
async fn web_0_recreated_with_its_address(env: &Env) {
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let patch = serde_json::json!({"spec": {"allocations": {"10": {
        "id": "sb-web-0-new", "podref": format!("{}/web-0", env.ns), "ifname": "net1",
    }}}});
    env.merge_pool("192.0.2.0-24", patch).await;
}

/// web-0 (192.0.2.10) and a-0 (.11), each with its entry and reservation.
async fn web_0_and_a_0_with_reservations(env: &mut Env) {
    env.macvlan(&[(10, "sb-web-0", "web-0"), (11, "sb-a-0", "a-0")])
        .await;
    env.reservation("192.0.2.10", "web-0").await;
    env.reservation("192.0.2.11", "a-0").await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("a-0", "macvlan", Some(&["192.0.2.11"])).await;
}

/// web-0 is deleted and its entry released; its reservation delete waits for its budget (here:
/// one delete per 5 s, the token taken by a-0's). Meanwhile web-0 is recreated and gets its old
/// address back, as whereabouts' CNI ADD does it: the reservation names the same pod, so it is
/// kept as it is, and a new entry is written. The reservation must stay: it is a live
/// allocation's. (Before, the delete went out guarded by the reservation's uid only.) The pool
/// write stands in for the CNI here; the real plugin does the same on the real node.
#[tokio::test]
async fn a_reservation_whose_address_a_recreated_pod_got_back_is_never_deleted() {
    let mut env = Env::new("ctl-res-guard").await;
    web_0_and_a_0_with_reservations(&mut env).await;
    env.start(&[
        "--reservation-delete-qps=0.2",
        "--reservation-delete-burst=1",
    ])
    .await;
    env.delete_pod("a-0").await;
    wait_for("a-0's reservation deleted", || async {
        env.reservation_names().await == ["192.0.2.10"]
    })
    .await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    // The recreated web-0 gets its address back before the reservation delete goes out.
    web_0_recreated_with_its_address(&env).await;
    env.wait_metric("ipreclaim_reservations_kept_total 1").await;
    assert_eq!(
        env.reservation_names().await,
        ["192.0.2.10"],
        "the live allocation's reservation stays"
    );
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"]);
    env.stop().await;
}

/// Starts the controller through a fault proxy that holds reservation deletes in flight.
async fn started_with_reservation_deletes_held(env: &mut Env) -> testenv::faultproxy::FaultProxy {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let proxy = FaultProxy::start(env.client.clone(), 1).await.unwrap();
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    proxy.set_rules(vec![Rule::new(
        Some("delete"),
        Some("overlappingrangeipreservations"),
        Action::Hold,
    )]);
    env.start_as(through, &[]).await;
    proxy
}

/// Waits until a reservation delete is held in flight by `proxy`.
async fn a_reservation_delete_held(proxy: &testenv::faultproxy::FaultProxy) {
    wait_for("the reservation delete held in flight", || async {
        proxy
            .injected()
            .contains_key("hold delete overlappingrangeipreservations")
    })
    .await;
}

/// [`started_with_reservation_deletes_held`], then deletes web-0 and returns once its entry is
/// released (`left`: the pool's keys after) and its reservation delete is held.
async fn web_0_released_with_its_reservation_delete_held(
    env: &mut Env,
    left: &[&str],
) -> testenv::faultproxy::FaultProxy {
    let proxy = started_with_reservation_deletes_held(env).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", left).await;
    a_reservation_delete_held(&proxy).await;
    proxy
}

/// A look after a reservation delete that cannot read the pool is not a "no". The delete is
/// held in flight while the recreated web-0 gets its address back (whereabouts keeps the
/// reservation naming it), and from then the pool cannot be read and the controller's pool
/// watch lags (fault proxy) for 20 s, longer than the three looks. Once the pool reads again,
/// the reservation is put back. (The previous version passes too: kube's client retries a 503
/// for minutes, so its one read rode out the outage, and stalled every other look meanwhile;
/// reads now give up after 4 s and the look is tried again every second.)
#[tokio::test]
async fn a_look_that_cannot_read_the_pool_tries_again_and_puts_the_reservation_back() {
    use testenv::faultproxy::{Action, Rule};
    let mut env = Env::new("ctl-look-retry").await;
    env.macvlan(&[(10, "sb-web-0", "web-0")]).await;
    env.reservation("192.0.2.10", "web-0").await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let proxy = web_0_released_with_its_reservation_delete_held(&mut env, &[]).await;
    proxy.set_rules(vec![
        Rule::new(Some("get"), Some("ippools"), Action::Status(503)),
        Rule::new(Some("list"), Some("ippools"), Action::Status(503)),
        Rule::new(
            Some("watch"),
            Some("ippools"),
            Action::DelayEvents(Duration::from_secs(60)),
        ),
    ]);
    proxy.cut_watches();
    web_0_recreated_with_its_address(&env).await;
    proxy.release_held();
    wait_for("the held delete to land", || async {
        env.reservation_names().await.is_empty()
    })
    .await;
    // The outage lasts 20 s from the delete: longer than the three looks (0.3 s, 1 s, 5 s)
    // with the client's own retries of each read. (The fault's length, not a wait for the
    // controller.)
    tokio::time::sleep(Duration::from_secs(20)).await;
    // A read is a LIST by name (a GET where RBAC allows no list).
    let injected = proxy.injected();
    let failed_reads: u64 = ["503 get ippools", "503 list ippools"]
        .iter()
        .filter_map(|k| injected.get(*k).copied())
        .sum();
    assert!(
        failed_reads >= 3,
        "the looks read the pool: {failed_reads} failed reads"
    );
    proxy.clear();
    wait_for("the reservation put back", || async {
        env.reservation_names().await == ["192.0.2.10"]
    })
    .await;
    env.wait_metric("ipreclaim_reservations_restored_total 1")
        .await;
    env.stop().await;
}

/// The looks read a pool with a LIST by name (the apiserver serves it from its cache); where RBAC
/// refuses the list, they read it with a GET, and remember. The delete is held in flight while
/// the recreated web-0 gets its address back; from then the proxy answers pool LISTs with 403
/// (the controller's pool watch, already open, goes on). The look must still see the new entry
/// and put the reservation back; a-0's release afterwards reads with GET straight away.
#[tokio::test]
async fn a_look_refused_a_pool_list_reads_the_pool_with_get() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-look-get").await;
    web_0_and_a_0_with_reservations(&mut env).await;
    let proxy = web_0_released_with_its_reservation_delete_held(&mut env, &["11"]).await;
    proxy.set_rules(vec![Rule::new(
        Some("list"),
        Some("ippools"),
        Action::Status(403),
    )]);
    web_0_recreated_with_its_address(&env).await;
    proxy.release_held();
    env.wait_metric("ipreclaim_reservations_restored_total 1")
        .await;
    assert_eq!(env.reservation_names().await, ["192.0.2.10", "192.0.2.11"]);
    let gets = |p: &FaultProxy| p.requests().get("get ippools").copied().unwrap_or(0);
    let gets_before = gets(&proxy);
    env.delete_pod("a-0").await;
    wait_for("a-0's reservation deleted and looked at again", || async {
        env.reservation_names().await == ["192.0.2.10"] && gets(&proxy) > gets_before
    })
    .await;
    assert_eq!(
        proxy.injected().get("403 list ippools").copied(),
        Some(1),
        "the refused list is asked for once, then the looks use GET"
    );
    env.stop().await;
}

/// An orphaned reservation's delete passes its check (web-0 is gone) and is held in flight;
/// meanwhile web-0 is recreated and gets its address back through that very reservation (as
/// whereabouts' CNI ADD does: it keeps one that names the pod), then the delete lands. The
/// looks after it read the address back from the reservation's name, find web-0's new entry in
/// the pool whose range holds it, and put the reservation back. Before, an orphan's delete had
/// no looks (its address and pool were "not known"), and the live allocation lost its
/// reservation. The pool write stands in for the CNI.
#[tokio::test]
async fn an_orphan_deleted_as_its_pod_gets_the_address_back_is_put_back() {
    let mut env = Env::new("ctl-orphan-look").await;
    env.macvlan(&[]).await;
    env.reservation_of("192.0.2.10", "sb-web-0", "web-0").await;
    let proxy = started_with_reservation_deletes_held(&mut env).await;
    a_reservation_delete_held(&proxy).await;
    proxy.set_rules(Vec::new());
    env.recreate("web-0", 10, "sb-web-0-new").await;
    proxy.release_held();
    env.wait_metric("ipreclaim_reservations_restored_total 1")
        .await;
    let back = env.reservations().get("192.0.2.10").await.unwrap();
    assert_eq!(
        (back.spec.podref.as_str(), back.spec.containerid.as_deref()),
        (format!("{}/web-0", env.ns).as_str(), Some("sb-web-0-new")),
        "put back for web-0's new sandbox"
    );
    env.stop().await;
    env.delete_pod("web-0").await;
}

/// A reservation whose pod is gone (an orphan) is due: the sweep reads the pod (gone), and
/// while that answer is on its way (3 s here) web-0 is recreated and gets the address back
/// through that very reservation, the controller's pod and pool watches lagging (6 s). The
/// delete's check, right before it goes, reads the pod fresh: it exists, the reservation
/// stays. Before, only the index was asked (no allocation, no pod yet) and it was deleted.
#[tokio::test]
async fn an_orphan_whose_pod_comes_back_before_its_delete_goes_is_kept() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-orphan-back").await;
    env.macvlan(&[]).await;
    env.reservation_of("192.0.2.10", "sb-web-0", "web-0").await;
    let proxy = FaultProxy::start(env.client.clone(), 6).await.unwrap();
    let late = |verb, resource, secs| {
        Rule::new(
            Some(verb),
            Some(resource),
            Action::DelayEvents(Duration::from_secs(secs)),
        )
    };
    proxy.set_rules(vec![
        late("get", "pods", 3),
        late("watch", "pods", 6),
        late("watch", "ippools", 6),
    ]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &[]).await;
    let reads = || proxy.requests().get("get pods").copied().unwrap_or(0);
    wait_for("the sweep reading the orphan's pod", || async {
        reads() > 0
    })
    .await;
    env.recreate("web-0", 10, "sb-web-0-new").await;

    let kept = "ipreclaim_reservations_kept_total";
    wait_for("the delete's check", || async {
        testenv::poll::metric_value(&env.metrics_text().await, kept) >= 1.0
            || env.reservation_names().await.is_empty()
    })
    .await;
    assert_eq!(
        env.reservation_names().await,
        ["192.0.2.10"],
        "the recreated web-0's reservation"
    );
    env.stop().await;
    env.delete_pod("web-0").await;
}
