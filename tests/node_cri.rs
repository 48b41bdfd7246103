//! The CRI pod source driven by podlife's PLEG, against a real containerd.

use std::sync::Arc;

use ipreclaim::node::cri::{CriPodSource, connect};
use k8s_cri::v1::{RunPodSandboxRequest, StopPodSandboxRequest};
use podlife::clock::RealClock;
use podlife::pleg::{EventKind, Pleg, PlegConfig, PodLifecycleEvent};
use podlife::{PodStatusCache, SandboxState};
use testenv::Containerd;

fn drain(rx: &mut tokio::sync::mpsc::Receiver<PodLifecycleEvent>) -> Vec<PodLifecycleEvent> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push(e);
    }
    out
}

#[tokio::test]
async fn relist_inspects_only_changed_pods_and_keeps_a_stopped_sandboxs_ip() {
    let containerd = Containerd::start_for_test().await;
    let mut cri = containerd.client().await.expect("CRI client");
    let mut ids = Vec::new();
    for i in 0..50 {
        let id = cri
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(containerd.sandbox_config(
                    &format!("p{i}"),
                    &format!("uid-{i:03}"),
                    "node-test",
                )),
                runtime_handler: String::new(),
            })
            .await
            .expect("RunPodSandbox")
            .into_inner()
            .pod_sandbox_id;
        ids.push(id);
    }

    let source = CriPodSource::new(
        connect(containerd.socket.to_str().unwrap())
            .await
            .expect("connect"),
    );
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
    cri.stop_pod_sandbox(StopPodSandboxRequest {
        pod_sandbox_id: ids[7].clone(),
    })
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
}
