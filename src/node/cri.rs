//! A [`PodSource`] over CRI: ListPodSandbox and ListContainers for the listing, and
//! PodSandboxStatus only when the PLEG inspects a pod that changed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerState as CriContainerState, ListContainersRequest, ListPodSandboxRequest,
    PodSandboxState, PodSandboxStatusRequest,
};
use podlife::pleg::PodSource;
use podlife::{
    Container, ContainerState, PodStatus, RuntimePod, SandboxState, SandboxStatus, SourceError,
};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// CRI calls made, by method (for metrics and tests).
#[derive(Debug, Default)]
pub struct CriCalls {
    /// ListPodSandbox.
    pub list_pod_sandbox: AtomicU64,
    /// ListContainers.
    pub list_containers: AtomicU64,
    /// PodSandboxStatus.
    pub pod_sandbox_status: AtomicU64,
}

/// The container runtime, as the PLEG sees it.
#[derive(Clone)]
pub struct CriPodSource {
    client: RuntimeServiceClient<Channel>,
    calls: Arc<CriCalls>,
}

/// Connects to a CRI socket (`unix:///path` or a plain path).
pub async fn connect(endpoint: &str) -> Result<RuntimeServiceClient<Channel>, SourceError> {
    let path = endpoint
        .strip_prefix("unix://")
        .unwrap_or(endpoint)
        .to_owned();
    if !Path::new(&path).exists() {
        return Err(SourceError::new(format!(
            "CRI socket {path} does not exist"
        )));
    }
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| SourceError::new(e.to_string()))?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| SourceError::new(format!("connect to CRI: {e}")))?;
    Ok(RuntimeServiceClient::new(channel))
}

fn cri_error(call: &str, e: tonic::Status) -> SourceError {
    SourceError::new(format!("{call}: {} ({:?})", e.message(), e.code()))
}

fn container_state(state: i32) -> ContainerState {
    match CriContainerState::try_from(state) {
        Ok(CriContainerState::ContainerCreated) => ContainerState::Created,
        Ok(CriContainerState::ContainerRunning) => ContainerState::Running,
        Ok(CriContainerState::ContainerExited) => ContainerState::Exited,
        _ => ContainerState::Unknown,
    }
}

fn sandbox_running(state: i32) -> bool {
    state == PodSandboxState::SandboxReady as i32
}

impl CriPodSource {
    /// A source over an open CRI client.
    pub fn new(client: RuntimeServiceClient<Channel>) -> Self {
        CriPodSource {
            client,
            calls: Arc::default(),
        }
    }

    /// Calls made so far.
    pub fn calls(&self) -> Arc<CriCalls> {
        self.calls.clone()
    }
}

impl PodSource for CriPodSource {
    async fn list_pods(&self) -> Result<Vec<RuntimePod>, SourceError> {
        let mut client = self.client.clone();
        self.calls.list_pod_sandbox.fetch_add(1, Ordering::Relaxed);
        let sandboxes = client
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await
            .map_err(|e| cri_error("ListPodSandbox", e))?
            .into_inner()
            .items;
        self.calls.list_containers.fetch_add(1, Ordering::Relaxed);
        let containers = client
            .list_containers(ListContainersRequest::default())
            .await
            .map_err(|e| cri_error("ListContainers", e))?
            .into_inner()
            .containers;
        let mut pods: HashMap<String, RuntimePod> = HashMap::new();
        let mut pod_of_sandbox: HashMap<String, String> = HashMap::new();
        for sb in sandboxes {
            let Some(meta) = sb.metadata else { continue };
            pod_of_sandbox.insert(sb.id.clone(), meta.uid.clone());
            let pod = pods.entry(meta.uid.clone()).or_insert_with(|| RuntimePod {
                uid: meta.uid.clone(),
                name: meta.name.clone(),
                namespace: meta.namespace.clone(),
                ..Default::default()
            });
            let state = if sandbox_running(sb.state) {
                ContainerState::Running
            } else {
                ContainerState::Exited
            };
            pod.sandboxes.push(Container::new(sb.id, state));
        }
        for c in containers {
            // A container whose sandbox is already gone has no pod to report it under.
            if let Some(pod) = pod_of_sandbox
                .get(&c.pod_sandbox_id)
                .and_then(|uid| pods.get_mut(uid))
            {
                pod.containers
                    .push(Container::new(c.id, container_state(c.state)));
            }
        }
        let mut pods: Vec<RuntimePod> = pods.into_values().collect();
        // A stable order lets the PLEG compare listings cheaply.
        for p in &mut pods {
            p.sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
            p.containers.sort_by(|a, b| a.id.cmp(&b.id));
        }
        pods.sort_by(|a, b| a.uid.cmp(&b.uid));
        Ok(pods)
    }

    async fn pod_status(&self, pod: &RuntimePod) -> Result<PodStatus, SourceError> {
        let mut client = self.client.clone();
        let mut sandbox_statuses = Vec::with_capacity(pod.sandboxes.len());
        let mut newest_ready: Option<(i64, Vec<String>)> = None;
        for sb in &pod.sandboxes {
            self.calls
                .pod_sandbox_status
                .fetch_add(1, Ordering::Relaxed);
            let status = client
                .pod_sandbox_status(PodSandboxStatusRequest {
                    pod_sandbox_id: sb.id.clone(),
                    verbose: false,
                })
                .await
                .map_err(|e| cri_error("PodSandboxStatus", e))?
                .into_inner()
                .status
                .ok_or_else(|| {
                    SourceError::new(format!("PodSandboxStatus of {} returned no status", sb.id))
                })?;
            let ips: Vec<String> = status
                .network
                .map(|n| {
                    std::iter::once(n.ip)
                        .chain(n.additional_ips.into_iter().map(|p| p.ip))
                        .filter(|ip| !ip.is_empty())
                        .collect()
                })
                .unwrap_or_default();
            let ready = sandbox_running(status.state);
            if ready
                && newest_ready
                    .as_ref()
                    .is_none_or(|(t, _)| status.created_at > *t)
            {
                newest_ready = Some((status.created_at, ips.clone()));
            }
            sandbox_statuses.push(SandboxStatus {
                id: status.id,
                state: if ready {
                    SandboxState::Ready
                } else {
                    SandboxState::NotReady
                },
                ips,
            });
        }
        Ok(PodStatus {
            uid: pod.uid.clone(),
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
            ips: newest_ready.map(|(_, ips)| ips).unwrap_or_default(),
            sandbox_statuses,
            container_statuses: pod
                .containers
                .iter()
                .map(|c| podlife::ContainerStatus {
                    id: c.id.clone(),
                    state: c.state,
                })
                .collect(),
        })
    }
}
