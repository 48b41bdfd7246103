//! The CRI pod source driven by podlife's PLEG, against a real containerd.

// The root tier: compiled empty without `--features root-tests` (see Cargo.toml).
#![cfg(feature = "root-tests")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ipreclaim::node::cri::{CriPodSource, connect};
use podlife::clock::{FakeClock, RealClock};
use podlife::pleg::{EventKind, Pleg, PlegConfig, PodLifecycleEvent, PodSource};
use podlife::{PodStatus, PodStatusCache, RuntimePod, SandboxState, SourceError};
use testenv::Containerd;

fn drain(rx: &mut tokio::sync::mpsc::Receiver<PodLifecycleEvent>) -> Vec<PodLifecycleEvent> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push(e);
    }
    out
}

/// Runs a sandbox for each (name, uid) and returns their ids, with the node agent's CRI pod
/// source on the same containerd.
async fn sandboxes_and_source(
    containerd: &Containerd,
    pods: impl IntoIterator<Item = (String, String)>,
) -> (Vec<String>, CriPodSource) {
    let mut ids = Vec::new();
    for (name, uid) in pods {
        let id = containerd
            .run_sandbox(&name, &uid, "node-test")
            .await
            .expect("RunPodSandbox");
        ids.push(id);
    }
    let socket = containerd.socket.to_str().unwrap();
    let source = CriPodSource::new(connect(socket).await.expect("connect"));
    (ids, source)
}

#[tokio::test]
async fn relist_inspects_only_changed_pods_and_keeps_a_stopped_sandboxs_ip() {
    let containerd = Containerd::start_for_test().await;
    let pods = (0..50).map(|i| (format!("p{i}"), format!("uid-{i:03}")));
    let (ids, source) = sandboxes_and_source(&containerd, pods).await;
    let calls = source.calls();
    let cache = Arc::new(PodStatusCache::new());
    let (mut pleg, mut events) = Pleg::new(
        source,
        Some(cache.clone()),
        RealClock::shared(),
        PlegConfig::default(),
    );

    pleg.relist().await;
    assert_eq!(
        drain(&mut events).len(),
        50,
        "one ContainerStarted per sandbox"
    );
    assert_eq!(calls.pod_sandbox_status.get(), 50);
    let (before, err) = cache.get("uid-007");
    assert_eq!(err, None);
    assert_eq!(before.ips.len(), 1, "{before:?}");

    // Nothing changed: a relist makes no status call.
    pleg.relist().await;
    assert_eq!(calls.pod_sandbox_status.get(), 50);
    assert!(drain(&mut events).is_empty());

    // One sandbox stops: exactly one status call, one death, and its IP stays in the cache
    // although CRI no longer reports it.
    containerd
        .stop_sandbox(&ids[7])
        .await
        .expect("StopPodSandbox");
    pleg.relist().await;
    assert_eq!(calls.pod_sandbox_status.get(), 51);
    assert_eq!(
        drain(&mut events),
        [PodLifecycleEvent::container(
            "uid-007",
            EventKind::ContainerDied,
            &ids[7]
        )]
    );
    let (after, _) = cache.get("uid-007");
    assert_eq!(after.sandbox_statuses[0].state, SandboxState::NotReady);
    assert!(
        after.sandbox_statuses[0].ips.is_empty(),
        "CRI reports no IP once stopped"
    );
    assert_eq!(
        after.ips, before.ips,
        "the PLEG cache preserves the dead sandbox's IP"
    );
    assert_eq!(pleg.handle().metrics().running_pods, 49);
}

#[tokio::test]
async fn an_unreachable_cri_socket_is_an_error_not_a_panic() {
    let Err(err) = connect("unix:///nonexistent/cri.sock").await else {
        panic!("connected to a socket that does not exist");
    };
    assert!(err.to_string().contains("does not exist"), "{err}");
    let Err(err) = ipreclaim::node::cri::connect_lazy("tcp://localhost:1234") else {
        panic!("accepted an endpoint that is no unix socket");
    };
    assert!(err.to_string().contains("not a unix socket path"), "{err}");
}

/// The real CRI source, with PodSandboxStatus failing for one pod on demand: containerd cannot
/// be made to fail one status call, so this one fault is injected (everything else is real).
struct StatusFailsFor {
    inner: CriPodSource,
    uid: String,
    failing: AtomicBool,
    attempts: AtomicU64,
}

impl PodSource for StatusFailsFor {
    async fn list_pods(&self) -> Result<Vec<RuntimePod>, SourceError> {
        self.inner.list_pods().await
    }

    async fn pod_status(&self, pod: &RuntimePod) -> Result<PodStatus, SourceError> {
        if pod.uid == self.uid {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            if self.failing.load(Ordering::SeqCst) {
                return Err(SourceError::new("PodSandboxStatus: injected failure"));
            }
        }
        self.inner.pod_status(pod).await
    }
}

#[tokio::test]
async fn a_failing_status_call_is_retried_with_backoff_and_other_pods_are_unaffected() {
    let containerd = Containerd::start_for_test().await;
    let pods = ["uid-a", "uid-b", "uid-c"].map(|uid| (uid.to_string(), uid.to_string()));
    let (ids, source) = sandboxes_and_source(&containerd, pods).await;
    let calls = source.calls();
    let faulty = StatusFailsFor {
        inner: source,
        uid: "uid-a".into(),
        failing: AtomicBool::new(true),
        attempts: AtomicU64::new(0),
    };
    let clock = FakeClock::new();
    let cache = Arc::new(PodStatusCache::new());
    let (mut pleg, mut events) = Pleg::new(
        faulty,
        Some(cache.clone()),
        clock.clone(),
        PlegConfig {
            inspect_backoff_initial: Duration::from_secs(1),
            inspect_backoff_max: Duration::from_secs(4),
            ..PlegConfig::default()
        },
    );
    let attempts = |p: &Pleg<StatusFailsFor>| p.source().attempts.load(Ordering::SeqCst);
    let started =
        |uid: &str, id: &str| PodLifecycleEvent::container(uid, EventKind::ContainerStarted, id);

    pleg.relist().await;
    let mut got = drain(&mut events);
    got.sort();
    assert_eq!(got, [started("uid-b", &ids[1]), started("uid-c", &ids[2])]);
    assert_eq!(attempts(&pleg), 1);
    let (_, err) = cache.get("uid-a");
    assert!(err.is_some_and(|e| e.to_string().contains("injected")));

    // Within the backoff: not retried.
    pleg.relist().await;
    assert_eq!(attempts(&pleg), 1);
    // After it: retried (and fails again; the backoff doubles to 2 s).
    clock.step(Duration::from_secs(1));
    pleg.relist().await;
    assert_eq!(attempts(&pleg), 2);

    // Meanwhile another pod's sandbox stops: reported at once, one status call.
    let status_calls = calls.pod_sandbox_status.get();
    containerd
        .stop_sandbox(&ids[2])
        .await
        .expect("StopPodSandbox");
    clock.step(Duration::from_secs(1));
    pleg.relist().await;
    assert_eq!(
        drain(&mut events),
        [PodLifecycleEvent::container(
            "uid-c",
            EventKind::ContainerDied,
            &ids[2]
        )]
    );
    assert_eq!(calls.pod_sandbox_status.get(), status_calls + 1);
    assert_eq!(attempts(&pleg), 2, "uid-a still backing off");

    // The runtime answers again: after the backoff the pod is inspected and its event goes out.
    pleg.source().failing.store(false, Ordering::SeqCst);
    clock.step(Duration::from_secs(1));
    pleg.relist().await;
    assert_eq!(attempts(&pleg), 3);
    assert_eq!(drain(&mut events), [started("uid-a", &ids[0])]);
    let (status, err) = cache.get("uid-a");
    assert_eq!(err, None);
    assert_eq!(status.ips.len(), 1, "{status:?}");
}
