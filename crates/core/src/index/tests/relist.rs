//! The one re-list driver, over every kind the index holds: what a re-list does not list
//! again is forgotten, usable or not; a `Done` without its `Begin` forgets nothing.

use kube_core::ObjectMeta;

use super::*;
use crate::api::lenient::Lenient;
use crate::api::{IPFence, IPFenceSpec};
use crate::index::kinds::{Fences, Nads, Pods, Pools, Reservations};

fn invalid<K>(namespace: &str, name: &str) -> Lenient<K> {
    Lenient::Invalid {
        metadata: Box::new(ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        }),
        error: "spec.range: bad".into(),
    }
}

/// A new index after a first re-list of kind `K`: the `valid` objects, then an invalid one in
/// `ns` named `bad`.
fn listed_with_invalid<K, R>(valid: impl IntoIterator<Item = R>, bad: &str) -> (Index, Relist<K>)
where
    K: Kind<Store = Index, Object = Lenient<R>>,
{
    let mut ix = Index::default();
    let mut relist = Relist::<K>::default();
    let objects = valid.into_iter().map(Lenient::Valid);
    relisted(&mut relist, &mut ix, objects.chain([invalid("ns", bad)]));
    (ix, relist)
}

fn in_ns<K: kube_core::Resource>(mut object: K) -> K {
    object.meta_mut().namespace = Some("ns".into());
    object
}

fn invalid_names(ix: &Index) -> Vec<String> {
    ix.invalid().all().keys().map(|k| k.name.clone()).collect()
}

#[test]
fn pools_not_listed_again_are_forgotten_with_their_podrefs_and_invalid_reports() {
    let pools = [
        pool_named("a", &[("1", "sb", "ns/x")]),
        pool_named("b", &[("2", "sb", "ns/y")]),
    ];
    let (mut ix, mut r) = listed_with_invalid::<Pools, _>(pools, "bad");
    assert!(ix.pools().listed());
    assert_eq!(invalid_names(&ix), ["bad"]);
    assert!(ix.pools().has_allocations("ns/x"));
    relisted(
        &mut r,
        &mut ix,
        [Lenient::Valid(pool_named("b", &[("2", "sb", "ns/y")]))],
    );
    let mut names: Vec<&String> = ix.pools().all().keys().collect();
    names.sort();
    assert_eq!(names, ["b"]);
    assert!(!ix.pools().has_allocations("ns/x"), "a's podref index went");
    assert!(invalid_names(&ix).is_empty(), "the invalid pool went too");
}

#[test]
fn a_pool_that_stops_fitting_is_forgotten_and_reported_and_comes_back_when_it_fits() {
    let mut ix = Index::default();
    let mut r = Relist::<Pools>::default();
    let good = || Lenient::Valid(in_ns(pool_named("a", &[("1", "sb", "ns/x")])));
    feed(&mut r, &mut ix, [Step::Changed(good())]);
    feed(&mut r, &mut ix, [Step::Changed(invalid("ns", "a"))]);
    assert!(ix.pools().get("a").is_none());
    assert_eq!(invalid_names(&ix), ["a"]);
    feed(&mut r, &mut ix, [Step::Changed(good())]);
    assert!(ix.pools().get("a").is_some());
    assert!(invalid_names(&ix).is_empty());
    feed(&mut r, &mut ix, [Step::Deleted(good())]);
    assert!(ix.pools().get("a").is_none());
}

#[test]
fn reservations_and_fences_not_listed_again_are_forgotten() {
    let listed = [
        reservation("192.0.2.1", "ns/a"),
        reservation("192.0.2.2", "ns/b"),
    ];
    let (mut ix, mut reservations) = listed_with_invalid::<Reservations, _>(listed, "192.0.2.3");
    let vanished = reservations
        .step(&mut ix, Step::Begin, Instant::now())
        .vanished;
    assert!(vanished.is_empty());
    feed(
        &mut reservations,
        &mut ix,
        [
            Step::Listed(Lenient::Valid(reservation("192.0.2.2", "ns/b"))),
            Step::Done,
        ],
    );
    assert_eq!(ix.reservations().names(), ["192.0.2.2"]);
    assert!(invalid_names(&ix).is_empty());

    let fence = |name: &str, key: &str| Lenient::Valid(ipfence(name, key, "2026-11-23T10:00:00Z"));
    let mut fences = Relist::<Fences>::default();
    relisted(&mut fences, &mut ix, [fence("p-5", "5"), fence("p-6", "6")]);
    assert_eq!(ix.fence_objects().names().len(), 2);
    relisted(&mut fences, &mut ix, [fence("p-6", "6")]);
    assert_eq!(ix.fence_objects().names(), ["p-6"]);
}

#[test]
fn a_fence_written_by_a_lagging_clock_is_as_old_as_the_apiserver_says() {
    let mut ix = Index::default();
    // The writer's clock was 20 minutes behind.
    let mut f = ipfence("p-5", "5", "2026-11-23T09:40:00Z");
    let created: jiff::Timestamp = "2026-11-23T10:00:00Z".parse().unwrap();
    f.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        created,
    ));
    let mut fences = Relist::<Fences>::default();
    relisted(&mut fences, &mut ix, [Lenient::Valid(f.clone())]);
    let since = |ix: &Index| ix.fence_objects().iter().next().unwrap().1.record.since;
    assert_eq!(since(&ix), created);
    // A writer clock ahead of the apiserver's is kept: the later of the two.
    f.spec.since = "2026-11-23T10:05:00Z".into();
    relisted(&mut fences, &mut ix, [Lenient::Valid(f)]);
    assert_eq!(since(&ix), "2026-11-23T10:05:00Z".parse().unwrap());
}

#[test]
fn nads_not_listed_again_are_forgotten_usable_or_not() {
    let nads = [
        nad("a", r#""range":"192.0.2.0/24""#),
        nad("b", r#""range":"bad""#),
    ];
    let (mut ix, mut r) = listed_with_invalid::<Nads, _>(nads, "c");
    let mut keys = ix.networks().keys();
    keys.sort();
    assert_eq!(keys, ["ns/a", "ns/b"]);
    assert_eq!(invalid_names(&ix), ["c"]);
    relisted(&mut r, &mut ix, []);
    assert!(ix.networks().keys().is_empty());
    assert!(ix.networks().errors().is_empty());
    assert!(invalid_names(&ix).is_empty());
}

#[test]
fn a_done_without_its_begin_forgets_nothing() {
    let mut ix = Index::default();
    let mut r = Relist::<Pods>::default();
    feed(
        &mut r,
        &mut ix,
        [Step::Changed(pod("a", "uid-a", Some("192.0.2.10")))],
    );
    let done = r.step(&mut ix, Step::Done, Instant::now());
    assert!(done.vanished.is_empty());
    assert!(ix.pods().live("ns/a").is_some());
}

/// The IPFence `name` of entry `key` of the pool, written at `since`.
fn ipfence(name: &str, key: &str, since: &str) -> IPFence {
    let mut f = IPFence::new(
        name,
        IPFenceSpec {
            pool: POOL.into(),
            key: key.into(),
            address: format!("192.0.2.{key}"),
            sandbox: "sb".into(),
            podref: "ns/web-0".into(),
            uid: "u".into(),
            node: "n".into(),
            why: "Ready=Unknown".into(),
            network: "ns/net".into(),
            since: since.into(),
            grace_period_seconds: None,
        },
    );
    f.metadata.uid = Some(format!("uid-{name}"));
    f
}
