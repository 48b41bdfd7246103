//! Duplicate addresses: two live pods whose network-status lists one address on one network
//! get a Warning on each pod and on the pool, once per episode, and a gauge; nothing is
//! released, and the gauge drops to 0 when one of the pods goes.

use std::collections::BTreeMap;

use crate::harness::{Env, one_bad_input_test_at_a_time};

const REASON: &str = "IPAddressDuplicate";

/// (reporting instance, object) -> Event counts, of the `IPAddressDuplicate` Events in the
/// test's namespace. Other tests' controllers watch pods everywhere and report these pods too
/// (on the NAD: they know no pool of this namespace), so each reporter is counted apart.
async fn by_reporter(env: &Env) -> BTreeMap<(String, String), Vec<i32>> {
    let events = testenv::events::with_reason(&env.client, &env.ns, REASON, None).await;
    let mut out: BTreeMap<(String, String), Vec<i32>> = BTreeMap::new();
    for e in &events {
        assert_eq!(e.type_.as_deref(), Some("Warning"), "{e:?}");
        let reporter = e.reporting_instance.clone().unwrap_or_default();
        let object = e.involved_object.name.clone().unwrap_or_default();
        out.entry((reporter, object))
            .or_default()
            .push(testenv::events::count(e));
    }
    out
}

#[tokio::test]
async fn two_live_pods_listing_one_address_are_warned_once_and_nothing_is_released() {
    // Every controller and scan of this process sees these pods (pods are watched in every
    // namespace): the bad-input tests, which count what they report, wait until they are gone.
    let _alone = one_bad_input_test_at_a_time().await;
    let mut env = Env::new("ctl-dup").await;
    // b-0 holds 192.0.2.10 (a-0's entry was removed by hand and the allocator gave the
    // address again); c-0 is an ordinary pod.
    env.macvlan(&[(10, "sb-b-0", "b-0"), (11, "sb-c-0", "c-0")])
        .await;
    env.reservation("192.0.2.10", "b-0").await;
    env.reservation("192.0.2.11", "c-0").await;
    let a_uid = env.pod("a-0", "macvlan", Some(&["192.0.2.10"])).await;
    let b_uid = env.pod("b-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("c-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.start(&[]).await;
    let ns = env.ns.clone();
    let series = format!(r#"ipreclaim_duplicate_addresses{{network="{ns}/macvlan"}}"#);
    env.wait_metric(&format!("{series} 1")).await;

    // A Warning on each pod (naming the other) and on the pool (naming both and its entry).
    let events = env.wait_events(REASON).await;
    let want = [
        (
            "a-0",
            a_uid.as_str(),
            format!("also listed by live pod {ns}/b-0"),
        ),
        (
            "b-0",
            b_uid.as_str(),
            format!("also listed by live pod {ns}/a-0"),
        ),
    ];
    for (pod, uid, text) in &want {
        testenv::poll::wait_for(&format!("a {REASON} Warning on {pod}"), || async {
            env.events(REASON).await.iter().any(|(o, u, m)| {
                o == pod && u == uid && m.contains(text) && m.contains("192.0.2.10")
            })
        })
        .await;
    }
    let pool_text =
        format!("listed by 2 live pods: {ns}/a-0, {ns}/b-0; the pool's entry names {ns}/b-0");
    testenv::poll::wait_for(&format!("a {REASON} Warning on the pool"), || async {
        env.events(REASON)
            .await
            .iter()
            .any(|(o, _, m)| o == "192.0.2.0-24" && m.contains(&pool_text))
    })
    .await;
    assert!(
        !events.iter().any(|(o, _, _)| o == "c-0"),
        "c-0 shares nothing: {events:?}"
    );

    // Sweeps go by: nothing released, no reservation deleted, one Event per object and
    // reporter (not one per sweep, nor per pass of the reporter, once a second: 15 sweeps of
    // 200 ms see two passes at least).
    env.wait_sweeps(15.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10", "11"]);
    assert_eq!(env.reservation_names().await.len(), 2);
    let seen = by_reporter(&env).await;
    for ((reporter, object), counts) in &seen {
        assert_eq!(counts, &[1], "{object} from {reporter}: {seen:?}");
    }
    let ours: Vec<&str> = seen
        .keys()
        .filter(|(_, o)| o == "192.0.2.0-24")
        .map(|(r, _)| r.as_str())
        .collect();
    assert_eq!(
        ours.len(),
        1,
        "only this test's controller knows the pool: {seen:?}"
    );
    assert!(env.metrics_text().await.contains(&format!("{series} 1")));

    // a-0 goes: the gauge drops to 0, b-0 keeps its address, no new Event.
    env.delete_pod("a-0").await;
    env.wait_metric(&format!("{series} 0")).await;
    env.wait_sweeps(15.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10", "11"]);
    assert_eq!(env.reservation_names().await.len(), 2);
    // Other tests' controllers, started meanwhile, may report the pair once too; this test's
    // controller reports nothing new.
    let after = by_reporter(&env).await;
    let of_ours = |m: &BTreeMap<(String, String), Vec<i32>>| {
        m.iter()
            .filter(|((r, _), _)| r == ours[0])
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(of_ours(&after), of_ours(&seen), "no Event once resolved");
    for ((reporter, object), counts) in &after {
        assert_eq!(counts, &[1], "{object} from {reporter}: {after:?}");
    }
    env.stop().await;
    env.delete_pod("b-0").await;
}
