//! The kubelet's generic PLEG test cases (pkg/kubelet/pleg/generic_test.go), ported.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use podlife::clock::{Clock, FakeClock};
use podlife::pleg::{EventKind, Pleg, PlegConfig, PodLifecycleEvent, PodSource, Unhealthy};
use podlife::{
    Container, ContainerState, ContainerStatus, PodStatus, PodStatusCache, RuntimePod,
    SandboxState, SandboxStatus, SourceError,
};
use tokio::sync::mpsc;
use tokio_test::{assert_pending, task};

use ContainerState::{Exited, Running, Unknown};
use EventKind::{ContainerDied, ContainerRemoved, ContainerStarted, PodSync};

#[derive(Default)]
struct State {
    pods: Vec<RuntimePod>,
    list_error: Option<SourceError>,
    /// Scripted answers to pod_status, consumed in order (the mock's `.Once()`).
    statuses: HashMap<String, VecDeque<Result<PodStatus, SourceError>>>,
    status_calls: Vec<String>,
}

/// A scripted runtime, the equivalent of the kubelet's fake runtime and runtime mock.
#[derive(Clone, Default)]
struct FakeRuntime(Arc<Mutex<State>>);

impl FakeRuntime {
    fn set_pods(&self, pods: Vec<RuntimePod>) {
        self.0.lock().unwrap().pods = pods;
    }
    fn fail_listing(&self, err: Option<&str>) {
        self.0.lock().unwrap().list_error = err.map(SourceError::new);
    }
    fn script_status(&self, uid: &str, result: Result<PodStatus, SourceError>) {
        let mut s = self.0.lock().unwrap();
        s.statuses.entry(uid.into()).or_default().push_back(result);
    }
    fn status_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().unwrap().status_calls)
    }
}

impl PodSource for FakeRuntime {
    async fn list_pods(&self) -> Result<Vec<RuntimePod>, SourceError> {
        let s = self.0.lock().unwrap();
        match &s.list_error {
            Some(e) => Err(e.clone()),
            None => Ok(s.pods.clone()),
        }
    }

    async fn pod_status(&self, pod: &RuntimePod) -> Result<PodStatus, SourceError> {
        let mut s = self.0.lock().unwrap();
        s.status_calls.push(pod.uid.clone());
        s.statuses
            .get_mut(&pod.uid)
            .and_then(|q| q.pop_front())
            .unwrap_or_else(|| {
                Err(SourceError::new(format!(
                    "no status scripted for {}",
                    pod.uid
                )))
            })
    }
}

fn pod(uid: &str, containers: &[(&str, ContainerState)]) -> RuntimePod {
    RuntimePod {
        containers: containers
            .iter()
            .map(|(id, s)| Container::new(*id, *s))
            .collect(),
        ..RuntimePod::new(uid)
    }
}

fn pod_with_sandboxes(uid: &str, sandboxes: &[(&str, ContainerState)]) -> RuntimePod {
    RuntimePod {
        sandboxes: sandboxes
            .iter()
            .map(|(id, s)| Container::new(*id, *s))
            .collect(),
        ..RuntimePod::new(uid)
    }
}

/// The status of pod `uid` with its one container `cid` in `state`.
fn status_of(uid: &str, cid: &str, state: ContainerState) -> PodStatus {
    PodStatus {
        container_statuses: vec![ContainerStatus {
            id: cid.into(),
            state,
        }],
        ..PodStatus::empty(uid)
    }
}

fn ev(pod: &str, kind: EventKind, cid: &str) -> PodLifecycleEvent {
    PodLifecycleEvent::container(pod, kind, cid)
}

fn pod_sync(pod: &str) -> PodLifecycleEvent {
    PodLifecycleEvent {
        pod: pod.into(),
        kind: PodSync,
        container_id: None,
    }
}

fn drain(rx: &mut mpsc::Receiver<PodLifecycleEvent>) -> Vec<PodLifecycleEvent> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push(e);
    }
    out.sort();
    out
}

fn sorted(mut v: Vec<PodLifecycleEvent>) -> Vec<PodLifecycleEvent> {
    v.sort();
    v
}

struct Harness {
    pleg: Pleg<FakeRuntime>,
    events: mpsc::Receiver<PodLifecycleEvent>,
    runtime: FakeRuntime,
    clock: Arc<FakeClock>,
    cache: Option<Arc<PodStatusCache>>,
}

impl Harness {
    /// The runtime lists `pods` from now on; one relist; the events it sent, sorted.
    async fn relist_listing(&mut self, pods: Vec<RuntimePod>) -> Vec<PodLifecycleEvent> {
        self.runtime.set_pods(pods);
        self.pleg.relist().await;
        drain(&mut self.events)
    }
}

fn harness(with_cache: bool, capacity: usize) -> Harness {
    harness_with(with_cache, capacity, Duration::ZERO)
}

fn harness_with(with_cache: bool, capacity: usize, backoff: Duration) -> Harness {
    let runtime = FakeRuntime::default();
    let clock = FakeClock::new();
    let cache = with_cache.then(|| Arc::new(PodStatusCache::new()));
    let config = PlegConfig {
        relist_period: Duration::from_secs(3600),
        channel_capacity: capacity,
        inspect_backoff_initial: backoff,
        inspect_backoff_max: backoff * 4,
        ..PlegConfig::default()
    };
    let (pleg, events) = Pleg::new(runtime.clone(), cache.clone(), clock.clone(), config);
    Harness {
        pleg,
        events,
        runtime,
        clock,
        cache,
    }
}

fn relisting_case(make: fn(&str, &[(&str, ContainerState)]) -> RuntimePod) {
    tokio_test::block_on(async {
        let mut h = harness(false, 100);
        let got = h
            .relist_listing(vec![
                make("1234", &[("c1", Exited), ("c2", Running), ("c3", Unknown)]),
                make("4567", &[("c1", Exited)]),
            ])
            .await;
        // Every running or exited container is reported the first time it is seen.
        let expected = sorted(vec![
            ev("1234", ContainerStarted, "c2"),
            ev("4567", ContainerDied, "c1"),
            ev("1234", ContainerDied, "c1"),
        ]);
        assert_eq!(got, expected);

        // Nothing changed: nothing sent.
        h.pleg.relist().await;
        assert_eq!(drain(&mut h.events), vec![]);

        let got = h
            .relist_listing(vec![
                make("1234", &[("c2", Exited), ("c3", Running)]),
                make("4567", &[("c4", Running)]),
            ])
            .await;
        let expected = sorted(vec![
            ev("1234", ContainerRemoved, "c1"),
            ev("1234", ContainerDied, "c2"),
            ev("1234", ContainerStarted, "c3"),
            ev("4567", ContainerRemoved, "c1"),
            ev("4567", ContainerStarted, "c4"),
        ]);
        assert_eq!(got, expected);
    });
}

#[test]
fn relisting() {
    relisting_case(pod);
}

#[test]
fn relisting_with_sandboxes() {
    relisting_case(pod_with_sandboxes);
}

#[test]
fn event_channel_full() {
    tokio_test::block_on(async {
        let mut h = harness(false, 4);
        h.runtime.set_pods(vec![
            pod("1234", &[("c1", Exited), ("c2", Running), ("c3", Unknown)]),
            pod("4567", &[("c1", Exited)]),
        ]);
        h.pleg.relist().await; // 3 events, not drained
        h.runtime.set_pods(vec![
            pod("1234", &[("c2", Exited), ("c3", Running)]),
            pod("4567", &[("c4", Running)]),
        ]);
        h.pleg.relist().await; // 5 more: only one fits, the relist does not block
        let all = [
            ev("1234", ContainerStarted, "c2"),
            ev("4567", ContainerDied, "c1"),
            ev("1234", ContainerDied, "c1"),
            ev("1234", ContainerRemoved, "c1"),
            ev("1234", ContainerDied, "c2"),
            ev("1234", ContainerStarted, "c3"),
            ev("4567", ContainerRemoved, "c1"),
            ev("4567", ContainerStarted, "c4"),
        ];
        let got = drain(&mut h.events);
        assert_eq!(got.len(), 4);
        assert!(
            got.iter().all(|e| all.contains(e)),
            "unexpected events: {got:?}"
        );
        assert_eq!(h.pleg.handle().metrics().dropped_events, 4);
    });
}

fn report_missing_containers(relists: usize) {
    tokio_test::block_on(async {
        let mut h = harness(false, 100);
        h.runtime.set_pods(vec![pod(
            "1234",
            &[("c1", Running), ("c2", Running), ("c3", Exited)],
        )]);
        for _ in 0..relists {
            h.pleg.relist().await;
            drain(&mut h.events);
        }
        // c2 was stopped and removed between relists; c3 had exited and was garbage collected.
        let got = h
            .relist_listing(vec![pod("1234", &[("c1", Running)])])
            .await;
        let expected = sorted(vec![
            ev("1234", ContainerDied, "c2"),
            ev("1234", ContainerRemoved, "c2"),
            ev("1234", ContainerRemoved, "c3"),
        ]);
        assert_eq!(got, expected, "after {relists} relists");
    });
}

fn report_missing_pods(relists: usize) {
    tokio_test::block_on(async {
        let mut h = harness(false, 100);
        h.runtime.set_pods(vec![pod("1234", &[("c2", Running)])]);
        for _ in 0..relists {
            h.pleg.relist().await;
            drain(&mut h.events);
        }
        let got = h.relist_listing(vec![]).await;
        let expected = sorted(vec![
            ev("1234", ContainerDied, "c2"),
            ev("1234", ContainerRemoved, "c2"),
        ]);
        assert_eq!(got, expected, "after {relists} relists");
    });
}

#[test]
fn detecting_container_deaths() {
    report_missing_containers(1);
    report_missing_pods(1);
    report_missing_containers(3);
    report_missing_pods(3);
}

/// Pods test-pod-i, each with one running container ci, their statuses and start events.
fn pods_statuses_events(n: usize) -> (Vec<RuntimePod>, Vec<PodStatus>, Vec<PodLifecycleEvent>) {
    let mut out = (vec![], vec![], vec![]);
    for i in 0..n {
        let uid = format!("test-pod-{i}");
        let cid = format!("c{i}");
        out.0.push(pod(&uid, &[(&cid, Running)]));
        out.1.push(status_of(&uid, &cid, Running));
        out.2.push(ev(&uid, ContainerStarted, &cid));
    }
    out
}

#[test]
fn relist_with_cache() {
    tokio_test::block_on(async {
        let mut h = harness(true, 100);
        let cache = h.cache.clone().unwrap();
        let (pods, statuses, events) = pods_statuses_events(2);
        h.runtime.set_pods(pods.clone());
        h.runtime
            .script_status("test-pod-0", Ok(statuses[0].clone()));
        let err = SourceError::new("unable to get status");
        h.runtime.script_status("test-pod-1", Err(err.clone()));
        h.pleg.relist().await;

        assert_eq!(cache.get("test-pod-0"), (statuses[0].clone(), None));
        // The failed inspection is cached too, with its error.
        assert_eq!(
            cache.get("test-pod-1"),
            (PodStatus::empty("test-pod-1"), Some(err))
        );
        // No event for the pod whose inspection failed.
        assert_eq!(drain(&mut h.events), vec![events[0].clone()]);

        h.runtime
            .script_status("test-pod-1", Ok(statuses[1].clone()));
        h.pleg.relist().await;
        assert_eq!(cache.get("test-pod-0"), (statuses[0].clone(), None));
        assert_eq!(cache.get("test-pod-1"), (statuses[1].clone(), None));
        // Now that its status could be read, its change is reported.
        assert_eq!(drain(&mut h.events), vec![events[1].clone()]);
        assert_eq!(
            h.runtime.status_calls(),
            ["test-pod-0", "test-pod-1", "test-pod-1"]
        );
    });
}

#[test]
fn remove_cache_entry() {
    tokio_test::block_on(async {
        let mut h = harness(true, 100);
        let cache = h.cache.clone().unwrap();
        let (pods, statuses, _) = pods_statuses_events(1);
        h.runtime.set_pods(pods);
        h.runtime
            .script_status("test-pod-0", Ok(statuses[0].clone()));
        h.pleg.relist().await;
        assert_eq!(cache.get("test-pod-0"), (statuses[0].clone(), None));
        // Gone from the runtime: gone from the cache.
        h.runtime.set_pods(vec![]);
        h.pleg.relist().await;
        assert_eq!(
            cache.get("test-pod-0"),
            (PodStatus::empty("test-pod-0"), None)
        );
        assert!(cache.is_empty());
    });
}

#[test]
fn healthy() {
    tokio_test::block_on(async {
        let mut h = harness(false, 100);
        let handle = h.pleg.handle();
        assert_eq!(handle.healthy(), Err(Unhealthy::NeverRelisted));
        h.pleg.relist().await;
        assert_eq!(handle.healthy(), Ok(()));
        h.clock.step(Duration::from_secs(60));
        assert_eq!(handle.healthy(), Ok(()), "within the 3 minute threshold");
        h.clock.step(Duration::from_secs(10 * 60));
        assert!(matches!(handle.healthy(), Err(Unhealthy::Stale { .. })));

        // A failed listing does not count as a relist.
        h.runtime.fail_listing(Some("runtime down"));
        h.pleg.relist().await;
        assert!(matches!(handle.healthy(), Err(Unhealthy::Stale { .. })));
        assert_eq!(handle.metrics().relist_failures, 1);

        h.runtime.fail_listing(None);
        h.pleg.relist().await;
        assert_eq!(
            handle.healthy(),
            Ok(()),
            "recovers after a successful relist"
        );
    });
}

#[test]
fn failed_listing_leaves_records_and_relist_time_untouched() {
    tokio_test::block_on(async {
        let mut h = harness(false, 100);
        h.runtime.set_pods(vec![pod("1234", &[("c1", Running)])]);
        h.pleg.relist().await;
        drain(&mut h.events);
        let t0 = h.clock.now();
        h.clock.step(Duration::from_secs(30));
        h.runtime.fail_listing(Some("down"));
        h.pleg.relist().await;
        assert_eq!(
            drain(&mut h.events),
            vec![],
            "no events from a failed listing"
        );
        // Health is measured from the last successful relist.
        h.clock.step(Duration::from_secs(151));
        assert_eq!(
            h.pleg.handle().healthy(),
            Err(Unhealthy::Stale {
                elapsed: h.clock.now() - t0,
                threshold: Duration::from_secs(180)
            })
        );
        // Once listing works again, the change across the outage is reported once.
        h.runtime.fail_listing(None);
        h.runtime.set_pods(vec![]);
        h.pleg.relist().await;
        assert_eq!(
            drain(&mut h.events),
            sorted(vec![
                ev("1234", ContainerDied, "c1"),
                ev("1234", ContainerRemoved, "c1")
            ])
        );
    });
}

#[test]
fn relist_with_reinspection() {
    tokio_test::block_on(async {
        let mut h = harness(true, 100);
        let cache = h.cache.clone().unwrap();
        let infra = ("infra", Running);
        let pods = vec![pod("test-pod", &[infra])];
        let good = status_of("test-pod", "infra", Running);

        // Listing 1: all good, the infra container is up.
        h.runtime.set_pods(pods.clone());
        h.runtime.script_status("test-pod", Ok(good.clone()));
        h.pleg.relist().await;
        assert_eq!(cache.get("test-pod"), (good.clone(), None));
        assert_eq!(
            drain(&mut h.events),
            vec![ev("test-pod", ContainerStarted, "infra")]
        );

        // Listing 2: a transient container appears and inspection fails.
        h.runtime
            .set_pods(vec![pod("test-pod", &[infra, ("transient", Unknown)])]);
        let err = SourceError::new("inspection error");
        h.runtime.script_status("test-pod", Err(err.clone()));
        h.pleg.relist().await;
        assert_eq!(
            cache.get("test-pod"),
            (PodStatus::empty("test-pod"), Some(err))
        );
        assert_eq!(drain(&mut h.events), vec![]);

        // Listing 3: the transient container is gone again. The listing equals the record of
        // listing 1 (2 did not advance it), so no container event; but the pod is re-inspected,
        // and the successful re-inspection is announced with a PodSync.
        h.runtime.set_pods(pods);
        h.runtime.script_status("test-pod", Ok(good.clone()));
        h.pleg.relist().await;
        assert_eq!(cache.get("test-pod"), (good, None));
        assert_eq!(drain(&mut h.events), vec![pod_sync("test-pod")]);
        assert_eq!(h.runtime.status_calls().len(), 3);

        // Listing 4: nothing changed and nothing to re-inspect: no call, no event.
        h.pleg.relist().await;
        assert_eq!(drain(&mut h.events), vec![]);
        assert_eq!(h.runtime.status_calls(), Vec::<String>::new());
    });
}

#[test]
fn reinspection_failure_is_retried_and_other_pods_are_unaffected() {
    tokio_test::block_on(async {
        let mut h = harness(true, 100);
        let (pods, statuses, events) = pods_statuses_events(2);
        h.runtime.set_pods(pods);
        h.runtime
            .script_status("test-pod-0", Ok(statuses[0].clone()));
        h.runtime
            .script_status("test-pod-1", Err(SourceError::new("e1")));
        h.pleg.relist().await;
        assert_eq!(drain(&mut h.events), vec![events[0].clone()]);
        h.runtime.status_calls();
        // Still failing: retried each relist, only for that pod.
        h.runtime
            .script_status("test-pod-1", Err(SourceError::new("e2")));
        h.pleg.relist().await;
        assert_eq!(h.runtime.status_calls(), ["test-pod-1"]);
        assert_eq!(drain(&mut h.events), vec![]);
        let m = h.pleg.handle().metrics();
        assert_eq!((m.inspections, m.inspection_failures), (3, 2));
    });
}

fn relist_ip_change_case(ips: &[&str]) {
    tokio_test::block_on(async {
        let mut h = harness(true, 100);
        let cache = h.cache.clone().unwrap();
        let ips: Vec<String> = ips.iter().map(|s| s.to_string()).collect();
        let running = PodStatus {
            ips: ips.clone(),
            ..status_of("test-pod-0", "c0", Running)
        };
        h.runtime
            .set_pods(vec![pod("test-pod-0", &[("c0", Running)])]);
        h.runtime.script_status("test-pod-0", Ok(running.clone()));
        h.pleg.relist().await;
        assert_eq!(cache.get("test-pod-0"), (running, None));
        assert_eq!(
            drain(&mut h.events),
            vec![ev("test-pod-0", ContainerStarted, "c0")]
        );

        // The container exits and the runtime no longer reports an IP.
        let exited = status_of("test-pod-0", "c0", Exited);
        h.runtime
            .set_pods(vec![pod("test-pod-0", &[("c0", Exited)])]);
        h.runtime.script_status("test-pod-0", Ok(exited.clone()));
        h.pleg.relist().await;
        let expected = PodStatus {
            ips: ips.clone(),
            ..exited
        };
        assert_eq!(
            cache.get("test-pod-0"),
            (expected, None),
            "the old IPs are preserved"
        );
        assert_eq!(
            drain(&mut h.events),
            vec![ev("test-pod-0", ContainerDied, "c0")]
        );
    });
}

#[test]
fn relist_ip_change() {
    relist_ip_change_case(&["192.0.2.5/24"]);
    relist_ip_change_case(&["192.0.2.5/24", "2001:db8::5/64"]);
}

#[test]
fn relist_preserves_ips_of_a_stopped_sandbox() {
    tokio_test::block_on(async {
        let mut h = harness(true, 100);
        let cache = h.cache.clone().unwrap();
        let sandbox = |state| SandboxStatus {
            id: "s1".into(),
            state,
            ips: vec![],
        };
        h.runtime
            .set_pods(vec![pod_with_sandboxes("p", &[("s1", Running)])]);
        h.runtime.script_status(
            "p",
            Ok(PodStatus {
                ips: vec!["198.18.0.9".into()],
                sandbox_statuses: vec![sandbox(SandboxState::Ready)],
                ..PodStatus::empty("p")
            }),
        );
        h.pleg.relist().await;
        h.runtime
            .set_pods(vec![pod_with_sandboxes("p", &[("s1", Exited)])]);
        h.runtime.script_status(
            "p",
            Ok(PodStatus {
                sandbox_statuses: vec![sandbox(SandboxState::NotReady)],
                ..PodStatus::empty("p")
            }),
        );
        h.pleg.relist().await;
        assert_eq!(cache.get("p").0.ips, ["198.18.0.9"]);
    });
}

#[test]
fn running_pod_and_container_count() {
    tokio_test::block_on(async {
        let mut h = harness(false, 100);
        let mut pods = vec![
            pod("1234", &[("c1", Running), ("c2", Unknown), ("c3", Unknown)]),
            pod("4567", &[("c1", Exited), ("c2", Running)]),
            pod("8910", &[("c1", ContainerState::Created)]),
        ];
        pods[0].sandboxes = vec![Container::new("s1", Running)];
        pods[1].sandboxes = vec![Container::new("s2", Exited), Container::new("s3", Running)];
        pods[2].sandboxes = vec![Container::new("s4", Exited)];
        h.runtime.set_pods(pods);
        h.pleg.relist().await;
        let m = h.pleg.handle().metrics();
        assert_eq!(m.running_pods, 2);
        let by_state: Vec<_> = m.containers_by_state.into_iter().collect();
        assert_eq!(
            by_state,
            [
                (ContainerState::Created, 1),
                (Running, 2),
                (Exited, 1),
                (Unknown, 2)
            ]
        );
    });
}

#[test]
fn run_relists_every_period_on_the_injected_clock() {
    let h = harness(false, 100);
    let (clock, handle) = (h.clock.clone(), h.pleg.handle());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut run = task::spawn(h.pleg.run(async {
        let _ = stop_rx.await;
    }));
    assert_pending!(run.poll());
    assert_eq!(handle.metrics().relists, 1);
    clock.step(Duration::from_secs(1800));
    assert_pending!(run.poll());
    assert_eq!(handle.metrics().relists, 1, "not before the period");
    clock.step(Duration::from_secs(1800));
    assert!(run.is_woken());
    assert_pending!(run.poll());
    assert_eq!(handle.metrics().relists, 2);
    assert_eq!(
        handle.metrics().last_relist_interval,
        Some(Duration::from_secs(3600))
    );
    stop_tx.send(()).unwrap();
    assert!(run.poll().is_ready(), "stops on shutdown");
}

#[test]
fn failing_inspection_backs_off_per_pod_and_other_pods_are_unaffected() {
    tokio_test::block_on(async {
        let mut h = harness_with(true, 100, Duration::from_secs(1));
        let (pods, statuses, events) = pods_statuses_events(2);
        h.runtime.set_pods(pods.clone());
        h.runtime
            .script_status("test-pod-0", Ok(statuses[0].clone()));
        h.runtime
            .script_status("test-pod-1", Err(SourceError::new("CRI unavailable")));
        h.pleg.relist().await;
        assert_eq!(h.runtime.status_calls(), ["test-pod-0", "test-pod-1"]);
        assert_eq!(drain(&mut h.events), vec![events[0].clone()]);

        // Within the 1 s backoff: no call for the failing pod.
        h.pleg.relist().await;
        assert_eq!(h.runtime.status_calls(), Vec::<String>::new());

        // After 1 s: tried again, fails again; the backoff doubles to 2 s.
        h.clock.step(Duration::from_secs(1));
        h.runtime
            .script_status("test-pod-1", Err(SourceError::new("CRI unavailable")));
        h.pleg.relist().await;
        assert_eq!(h.runtime.status_calls(), ["test-pod-1"]);

        // 1 s later it is still backing off, while the other pod's change is inspected at once.
        h.clock.step(Duration::from_secs(1));
        let mut changed = pods.clone();
        changed[0].containers[0].state = Exited;
        h.runtime.set_pods(changed);
        let mut exited = statuses[0].clone();
        exited.container_statuses[0].state = Exited;
        h.runtime.script_status("test-pod-0", Ok(exited));
        h.pleg.relist().await;
        assert_eq!(h.runtime.status_calls(), ["test-pod-0"]);
        assert_eq!(
            drain(&mut h.events),
            vec![ev("test-pod-0", ContainerDied, "c0")]
        );

        // After the 2 s: inspected, succeeds, and its event finally goes out.
        h.clock.step(Duration::from_secs(1));
        h.runtime
            .script_status("test-pod-1", Ok(statuses[1].clone()));
        h.pleg.relist().await;
        assert_eq!(h.runtime.status_calls(), ["test-pod-1"]);
        assert_eq!(drain(&mut h.events), vec![events[1].clone()]);
    });
}
