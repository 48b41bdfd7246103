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
    web_0_recreated_listing(env, Some(&["192.0.2.10"])).await;
}

/// web-0 recreated with network-status `ips` (`None`: its ADD has not returned), and
/// 192.0.2.10's entry written for its new sandbox.
async fn web_0_recreated_listing(env: &Env, ips: Option<&[&str]>) {
    env.pod("web-0", "macvlan", ips).await;
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
/// watch lags (fault proxy) for 20 s, longer than the five looks. Once the pool reads again,
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
    // The outage lasts 20 s from the delete: longer than the five looks (0.3 s to 5 s)
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

/// The other way an allocation races a delete: web-0 recreated reads no reservation (the held
/// delete has landed), writes its entry, and, as whereabouts' ADD does, creates the reservation
/// itself a moment after its pool write; its pod lists the address only once the ADD has
/// returned. ipreclaim's re-check must not create it first (whereabouts' create would fail
/// with "already exists", and the ADD with it: the chaos suite's ManualRaces found it). The
/// 0.3 s between the pool write and the create stands in for whereabouts' own lag (a fault's
/// length, not a wait for the controller); f364767's first re-check, 0.3 s after the delete,
/// created it first.
#[tokio::test]
async fn an_allocation_that_read_no_reservation_creates_its_own_unpreempted() {
    let mut env = Env::new("ctl-recheck-own").await;
    env.macvlan(&[(10, "sb-web-0", "web-0")]).await;
    env.reservation("192.0.2.10", "web-0").await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let proxy = web_0_released_with_its_reservation_delete_held(&mut env, &[]).await;
    proxy.clear();
    proxy.release_held();
    wait_for("the held delete to land", || async {
        env.reservation_names().await.is_empty()
    })
    .await;
    // whereabouts' ADD for the recreated web-0: no reservation read, the pool written, its
    // network-status not written yet (the ADD has not returned).
    web_0_recreated_listing(&env, None).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    use ipreclaim::api::{OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};
    let created =
        kube::Api::<OverlappingRangeIPReservation>::namespaced(env.client.clone(), &env.ns)
            .create(
                &kube::api::PostParams::default(),
                &OverlappingRangeIPReservation::new(
                    "192.0.2.10",
                    OverlappingRangeIPReservationSpec {
                        containerid: None,
                        podref: format!("{}/web-0", env.ns),
                        ifname: Some("net1".into()),
                        ipamclaimref: None,
                    },
                ),
            )
            .await;
    assert!(
        created.is_ok(),
        "whereabouts' own create after its pool write: {created:?}"
    );
    assert_eq!(env.reservation_names().await, ["192.0.2.10"]);
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

/// The reservation `name`'s (podref, containerid), if it exists.
async fn reservation_of(env: &Env, name: &str) -> Option<(String, Option<String>)> {
    let r = env.reservations().get_opt(name).await.unwrap()?;
    Some((r.spec.podref, r.spec.containerid))
}

/// A second network over the same range with its own `network_name` ("other", pool
/// other-192.0.2.0-24, empty): reservations of the two networks share addresses, not names.
async fn other_network(env: &Env) {
    env.nad_config(
        "other",
        r#"{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","ipam":{"type":"whereabouts","range":"192.0.2.0/24","network_name":"other"}}"#,
    )
    .await;
    let none: [(u32, &str, &str); 0] = [];
    env.pool("other-192.0.2.0-24", "192.0.2.0/24", &none).await;
}

/// web-0's reservation of 192.0.2.10 was left behind (its delete failed once); web-0 lives on
/// at 192.0.2.11. Nothing holds or lists .10 for it: the sweep deletes it (whereabouts #712:
/// it blocked .10 network-wide for web-0's whole life). Also deleted: web-0's reservation of
/// .10 in network "other", whatever the macvlan network's pool holds at .10 (c-0's entry):
/// another network's reservation is judged by its own network's pools. web-0's live
/// reservation stays. Before, a reservation was swept only when its pod was gone.
#[tokio::test]
async fn a_reservation_left_behind_for_a_live_name_is_swept() {
    let mut env = Env::new("ctl-res-left").await;
    env.macvlan(&[(11, "sb-web-0-new", "web-0"), (10, "sb-c-0", "c-0")])
        .await;
    other_network(&env).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.pod("c-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.reservation_of("192.0.2.11", "sb-web-0-new", "web-0")
        .await;
    env.reservation_of("192.0.2.10", "sb-c-0", "c-0").await;
    env.reservation_of("other-192.0.2.10", "sb-web-0-old", "web-0")
        .await;
    env.reservation_of("192.0.2.12", "sb-web-0-old", "web-0")
        .await;
    env.start(&[]).await;
    wait_for("the reservations left behind deleted", || async {
        env.reservation_names().await == ["192.0.2.10", "192.0.2.11"]
    })
    .await;
    env.wait_metric(r#"ipreclaim_reservations_swept_total{reason="left_behind"} 2"#)
        .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10", "11"]);
    env.stop().await;
}

/// Reservations left behind for live pods are kept while anything may still use their address:
/// a pod without network-status yet (an allocation may be in flight), a pod that lists the
/// address (its entry may come), any entry holding the address in the network's pools
/// (whoever's: b-0's here), a name that reads as no address, another network's reservation of
/// an address the pod lists, and a network with no pool known. web-0's reservation left behind
/// (the control) goes. Before, none was ever swept (the control fails).
#[tokio::test]
async fn reservations_an_allocation_may_still_need_are_kept() {
    let mut env = Env::new("ctl-res-keep").await;
    env.macvlan(&[(11, "sb-web-0", "web-0"), (30, "sb-b-0", "b-0")])
        .await;
    other_network(&env).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.pod("pending-0", "macvlan", None).await;
    env.pod("lists-0", "macvlan", Some(&["192.0.2.21"])).await;
    env.pod("a-0", "macvlan", Some(&["192.0.2.31"])).await;
    env.pod("b-0", "macvlan", Some(&["192.0.2.30"])).await;
    env.reservation_of("192.0.2.11", "sb-web-0", "web-0").await;
    for (name, pod) in [
        ("192.0.2.10", "web-0"),
        ("192.0.2.20", "pending-0"),
        ("192.0.2.21", "lists-0"),
        ("192.0.2.30", "a-0"),
        ("not-an-address", "a-0"),
        ("other-192.0.2.31", "a-0"),
        ("blue-192.0.2.40", "a-0"),
    ] {
        env.reservation_of(name, "sb-old", pod).await;
    }
    env.start(&[]).await;
    wait_for("web-0's reservation left behind deleted", || async {
        !env.reservation_names().await.contains(&"192.0.2.10".into())
    })
    .await;
    env.wait_sweeps(5.0).await;
    let mut left = env.reservation_names().await;
    left.sort();
    assert_eq!(
        left,
        [
            "192.0.2.11",
            "192.0.2.20",
            "192.0.2.21",
            "192.0.2.30",
            "blue-192.0.2.40",
            "not-an-address",
            "other-192.0.2.31"
        ]
    );
    env.wait_metric(r#"ipreclaim_reservations_swept_total{reason="left_behind"} 1"#)
        .await;
    env.stop().await;
}

/// web-0's reservation delete is refused (500) after its release; web-0 is recreated under its
/// name at another address (a StatefulSet's pod). Each sweep finds the reservation again and
/// retries (the failures count up), and once deletes go through it is gone. Before, a failed
/// delete was given up, and with its pod's name alive no sweep took it: .10 stayed blocked.
#[tokio::test]
async fn a_failed_reservation_delete_is_retried_by_the_sweep() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-res-retry").await;
    env.macvlan(&[(10, "sb-web-0", "web-0")]).await;
    env.reservation("192.0.2.10", "web-0").await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let proxy = FaultProxy::start(env.client.clone(), 1).await.unwrap();
    proxy.set_rules(vec![Rule::new(
        Some("delete"),
        Some("overlappingrangeipreservations"),
        Action::Status(500),
    )]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.recreate("web-0", 12, "sb-web-0-new").await;
    env.reservation_of("192.0.2.12", "sb-web-0-new", "web-0")
        .await;
    let refused = || {
        let injected = proxy.injected();
        injected
            .get("500 delete overlappingrangeipreservations")
            .copied()
            .unwrap_or(0)
    };
    wait_for("the sweep retrying the refused delete", || async {
        refused() >= 3
    })
    .await;
    assert_eq!(env.reservation_names().await, ["192.0.2.10", "192.0.2.12"]);
    proxy.clear();
    wait_for("the reservation left behind deleted", || async {
        env.reservation_names().await == ["192.0.2.12"]
    })
    .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["12"]);
    env.stop().await;
}

/// web-0's reservation of .10 was left behind; its delete passes its check (web-0 lives at
/// .11) and is held in flight. Meanwhile web-0 is recreated and whereabouts gives it .10 back
/// through that very reservation (it names web-0), then the delete lands. The looks after it
/// find web-0's new entry and put the reservation back. Before, the reservation was never
/// deleted at all (the held delete never comes).
#[tokio::test]
async fn a_left_behind_delete_racing_the_pods_recreation_is_put_back() {
    let mut env = Env::new("ctl-res-left-race").await;
    env.macvlan(&[(11, "sb-web-0", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.reservation_of("192.0.2.10", "sb-web-0-old", "web-0")
        .await;
    let proxy = started_with_reservation_deletes_held(&mut env).await;
    a_reservation_delete_held(&proxy).await;
    proxy.set_rules(Vec::new());
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.recreate("web-0", 10, "sb-web-0-new").await;
    proxy.release_held();
    env.wait_metric("ipreclaim_reservations_restored_total 1")
        .await;
    assert_eq!(
        reservation_of(&env, "192.0.2.10").await,
        Some((format!("{}/web-0", env.ns), Some("sb-web-0-new".into()))),
        "put back for web-0's new sandbox"
    );
    env.stop().await;
    env.delete_pod("web-0").await;
}

/// web-0's reservation of .10 was left behind and is due; the delete's check reads web-0 fresh,
/// and that read reaches the apiserver 3 s late (fault proxy). Meanwhile web-0 is recreated
/// and given .10 back (the pod lists it, the entry is written), with the controller's pod and
/// pool watches 8 s behind: the check finds another pod (a new uid) that lists the address, and
/// the reservation stays. Before, the reservation was never judged (no read of web-0 comes).
#[tokio::test]
async fn a_left_behind_reservation_whose_pod_is_recreated_before_its_delete_is_kept() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-res-left-back").await;
    env.macvlan(&[(11, "sb-web-0", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.reservation_of("192.0.2.10", "sb-web-0-old", "web-0")
        .await;
    let proxy = FaultProxy::start(env.client.clone(), 6).await.unwrap();
    proxy.set_rules(vec![
        Rule::new(
            Some("get"),
            Some("pods"),
            Action::Delay(Duration::from_secs(3)),
        ),
        Rule::new(
            Some("watch"),
            Some("pods"),
            Action::DelayEvents(Duration::from_secs(8)),
        ),
        Rule::new(
            Some("watch"),
            Some("ippools"),
            Action::DelayEvents(Duration::from_secs(8)),
        ),
    ]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &[]).await;
    let reads = || proxy.requests().get("get pods").copied().unwrap_or(0);
    wait_for("the delete's check reading web-0", || async { reads() > 0 }).await;
    env.delete_pod("web-0").await;
    env.recreate("web-0", 10, "sb-web-0-new").await;
    let kept = "ipreclaim_reservations_kept_total";
    wait_for("the delete's check keeping it", || async {
        testenv::poll::metric_value(&env.metrics_text().await, kept) >= 1.0
            || env.reservation_names().await.is_empty()
    })
    .await;
    assert_eq!(
        reservation_of(&env, "192.0.2.10").await,
        Some((format!("{}/web-0", env.ns), Some("sb-web-0-old".into()))),
        "the recreated web-0's reservation"
    );
    env.stop().await;
    env.delete_pod("web-0").await;
}

/// web-0's entry (.10) has no reservation (a crash between whereabouts' pool write and its
/// create). After --reservation-repair-grace the leader creates it for web-0's sandbox, with a
/// Warning Event on the pool and the metrics. Not in network "flat", which has no overlapping
/// ranges (whereabouts makes no reservations there), and db-0's existing reservation is left
/// as it is. Before, nothing noticed: an overlapping range could hand .10 out again.
#[tokio::test]
async fn a_live_entry_missing_its_reservation_is_reported_and_repaired() {
    let mut env = Env::new("ctl-res-repair").await;
    env.web_0_and_db_0().await;
    env.nad_config(
        "flat",
        r#"{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","ipam":{"type":"whereabouts","range":"192.0.2.0/24","network_name":"flat","enable_overlapping_ranges":false}}"#,
    )
    .await;
    env.pool(
        "flat-192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-web", "web-0")],
    )
    .await;
    env.reservation_of("192.0.2.11", "sb-db", "db-0").await;
    let db_before = env.reservations().get("192.0.2.11").await.unwrap();
    env.start(&["--reservation-repair-grace=1s"]).await;
    wait_for("web-0's reservation created", || async {
        env.reservation_names().await == ["192.0.2.10", "192.0.2.11"]
    })
    .await;
    assert_eq!(
        reservation_of(&env, "192.0.2.10").await,
        Some((format!("{}/web-0", env.ns), Some("sb-web".into())))
    );
    let events = env
        .wait_events_saying(
            "ReservationMissing",
            &[
                "entry 10 (192.0.2.10)",
                "/web-0 had no reservation 192.0.2.10",
                "created it",
            ],
        )
        .await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "192.0.2.0-24");
    env.wait_metric("ipreclaim_reservations_repaired_total 1")
        .await;
    env.wait_metric("ipreclaim_reservations_missing 0").await;
    env.wait_sweeps(3.0).await;
    let db = env.reservations().get("192.0.2.11").await.unwrap();
    assert_eq!(
        db.metadata.uid, db_before.metadata.uid,
        "db-0's left as it is"
    );
    assert_eq!(
        env.reservation_names().await,
        ["192.0.2.10", "192.0.2.11"],
        "none in the network without overlapping ranges"
    );
    env.stop().await;
}

/// web-0's entry (.10) has no reservation and web-0 lists .10: its CNI ADD has returned, so
/// whereabouts will not create it any more (v0.9.4 skips the create for good when its retried
/// pool update ends on another address than its first try: the chaos suite's
/// ReservationDeletesRefused seed 2355970100144217005). The leader creates it at its next
/// sweeps, well inside the default --reservation-repair-grace (2m). pending-0's entry (.11),
/// whose pod has no network-status yet (its ADD may be in flight: whereabouts creates the
/// reservation after the entry), waits for the grace. Before, both waited 2 minutes, and an
/// overlapping range could hand .10 out meanwhile.
#[tokio::test]
async fn a_live_entry_its_pod_lists_gets_its_missing_reservation_without_the_grace() {
    let mut env = Env::new("ctl-res-repair-listed").await;
    env.macvlan(&[(10, "sb-web", "web-0"), (11, "sb-pending", "pending-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("pending-0", "macvlan", None).await;
    env.start(&[]).await;
    wait_for("web-0's reservation created", || async {
        env.reservation_names().await == ["192.0.2.10"]
    })
    .await;
    assert_eq!(
        reservation_of(&env, "192.0.2.10").await,
        Some((format!("{}/web-0", env.ns), Some("sb-web".into())))
    );
    env.wait_events_saying(
        "ReservationMissing",
        &["/web-0 had no reservation 192.0.2.10", "created it"],
    )
    .await;
    env.wait_sweeps(3.0).await;
    assert_eq!(
        env.reservation_names().await,
        ["192.0.2.10"],
        "none for pending-0 before the grace: its ADD may still create it"
    );
    env.wait_metric("ipreclaim_reservations_missing 1").await;
    env.stop().await;
}

/// The create of web-0's missing reservation is held in flight (fault proxy) while a
/// reservation of that name is made for another live pod (x-0): the create is refused (409), the
/// one made meanwhile is compared and left as it is (never overwritten), and the conflict is
/// reported. Before, no create came at all.
#[tokio::test]
async fn a_repair_refused_because_one_was_made_meanwhile_never_overwrites_it() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-res-repair-race").await;
    env.macvlan(&[(10, "sb-web", "web-0")]).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("x-0", "macvlan", Some(&["192.0.2.99"])).await;
    let proxy = FaultProxy::start(env.client.clone(), 1).await.unwrap();
    proxy.set_rules(vec![Rule::new(
        Some("create"),
        Some("overlappingrangeipreservations"),
        Action::Hold,
    )]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &["--reservation-repair-grace=1s"])
        .await;
    wait_for("the repair's create held in flight", || async {
        proxy
            .injected()
            .contains_key("hold create overlappingrangeipreservations")
    })
    .await;
    env.reservation_of("192.0.2.10", "sb-x", "x-0").await;
    proxy.set_rules(Vec::new());
    proxy.release_held();
    env.wait_metric("ipreclaim_reservation_conflicts_total 1")
        .await;
    env.wait_events_saying("ReservationMissing", &["made meanwhile for pod", "/x-0"])
        .await;
    assert_eq!(
        reservation_of(&env, "192.0.2.10").await,
        Some((format!("{}/x-0", env.ns), Some("sb-x".into()))),
        "the one made meanwhile, as it was"
    );
    assert_eq!(
        testenv::poll::metric_value(
            &env.metrics_text().await,
            "ipreclaim_reservations_repaired_total"
        ),
        0.0
    );
    env.stop().await;
}

/// web-0's and db-0's entries have no reservation. The controller's pool watch is 8 s behind
/// (fault proxy) when db-0's entry goes (whereabouts' DEL, say): its index still shows it, but
/// the repair reads the pool fresh first and creates nothing for it; web-0's (the control) is
/// created. Before, neither was (the control fails).
#[tokio::test]
async fn a_repair_creates_nothing_for_an_entry_gone_from_a_fresh_read() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-res-repair-gone").await;
    env.web_0_and_db_0().await;
    let proxy = FaultProxy::start(env.client.clone(), 1).await.unwrap();
    proxy.set_rules(vec![Rule::new(
        Some("watch"),
        Some("ippools"),
        Action::DelayEvents(Duration::from_secs(8)),
    )]);
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    env.start_as(through, &["--reservation-repair-grace=1s"])
        .await;
    env.merge_pool(
        "192.0.2.0-24",
        serde_json::json!({"spec": {"allocations": {"11": null}}}),
    )
    .await;
    wait_for("web-0's reservation created", || async {
        !env.reservation_names().await.is_empty()
    })
    .await;
    env.wait_sweeps(3.0).await;
    assert_eq!(
        env.reservation_names().await,
        ["192.0.2.10"],
        "none for db-0's entry, gone"
    );
    env.stop().await;
}
