//! A [`PodSource`] over CRI: ListPodSandbox and ListContainers for the listing, and
//! PodSandboxStatus only when the PLEG inspects a pod that changed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerFilter, ContainerState as CriContainerState, ListContainersRequest,
    ListPodSandboxRequest, PodSandboxFilter, PodSandboxState, PodSandboxStateValue,
    PodSandboxStatusRequest,
};
use podlife::pleg::PodSource;
use podlife::throttle::Throttle;
use podlife::{
    Container, ContainerState, PodStatus, RuntimePod, SandboxState, SandboxStatus, SourceError,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::witness::SandboxNow;
use crate::ipam::PodKey;

pub use crate::telemetry::node_metrics::MethodLabel;

/// CRI calls made, by method (metrics counters; `get()` reads them).
#[derive(Debug, Clone, Default)]
pub struct CriCalls {
    /// ListPodSandbox.
    pub list_pod_sandbox: Counter,
    /// ListContainers.
    pub list_containers: Counter,
    /// PodSandboxStatus.
    pub pod_sandbox_status: Counter,
}

impl CriCalls {
    /// Counters that are the members of `family` (so /metrics shows them by method).
    pub fn in_family(family: &Family<MethodLabel, Counter>) -> Self {
        let get = |m: &str| {
            family
                .get_or_create(&MethodLabel { method: m.into() })
                .clone()
        };
        CriCalls {
            list_pod_sandbox: get("ListPodSandbox"),
            list_containers: get("ListContainers"),
            pod_sandbox_status: get("PodSandboxStatus"),
        }
    }
}

/// What the last listings showed, for the agent: which ids are sandboxes (a PLEG event names
/// only a container id) and which pods the runtime has (for orphan counting).
#[derive(Debug, Default)]
pub struct RuntimeView {
    /// Successful listings so far.
    pub listings: u64,
    /// Every sandbox listed, with the number of the last listing that had it. The agent
    /// forgets entries it is done with.
    pub sandboxes: HashMap<String, u64>,
    /// Pods of the last listing, by uid.
    pub pods: HashMap<String, PodKey>,
    /// Pods of the last listing with a sandbox Ready (running).
    pub ready: HashSet<String>,
    /// Sandboxes of the last listing that may still hold their network (Ready, or with a
    /// container of theirs not exited): the node's inventory.
    pub live: BTreeMap<String, LiveSandbox>,
    /// Sandboxes of the last listing without pod metadata, and containers not exited whose
    /// sandbox is not listed: whose pod cannot be told.
    pub unattributed: usize,
}

/// A sandbox that may still hold its network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSandbox {
    /// Its pod's uid as the runtime knows it (a static pod's is its config hash).
    pub pod_uid: String,
    /// Its pod's termination grace period, from its containers' kubelet annotation.
    pub grace_seconds: Option<i64>,
}

/// The kubelet's annotation of a container with its pod's termination grace period.
const GRACE_ANNOTATION: &str = "io.kubernetes.pod.terminationGracePeriod";

/// The container runtime, as the PLEG sees it.
#[derive(Clone)]
pub struct CriPodSource {
    client: RuntimeServiceClient<Channel>,
    calls: CriCalls,
    view: Arc<Mutex<RuntimeView>>,
    throttle: Option<Throttle>,
}

/// Connects to a CRI socket (`unix:///path` or a plain path).
pub async fn connect(endpoint: &str) -> Result<RuntimeServiceClient<Channel>, SourceError> {
    let path = socket_path(endpoint)?;
    if !Path::new(&path).exists() {
        return Err(SourceError::new(format!(
            "CRI socket {path} does not exist"
        )));
    }
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| SourceError::new(e.to_string()))?
        .connect_with_connector(unix_connector(path))
        .await
        .map_err(|e| SourceError::new(format!("connect to CRI: {e}")))?;
    Ok(RuntimeServiceClient::new(channel))
}

/// Longest wait for one CRI call.
pub const CRI_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Like [`connect`], but connects on first use and reconnects after the runtime restarts:
/// the agent keeps running (and reports unhealthy) while the runtime is down.
pub fn connect_lazy(endpoint: &str) -> Result<RuntimeServiceClient<Channel>, SourceError> {
    let path = socket_path(endpoint)?;
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| SourceError::new(e.to_string()))?
        // A hung runtime fails the relist (and so, in time, /healthz) instead of stalling it.
        .timeout(CRI_TIMEOUT)
        .connect_timeout(CRI_TIMEOUT)
        .connect_with_connector_lazy(unix_connector(path));
    Ok(RuntimeServiceClient::new(channel))
}

/// The socket path of `unix:///path` or `/path`.
fn socket_path(endpoint: &str) -> Result<String, SourceError> {
    let path = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    if !path.starts_with('/') {
        return Err(SourceError::new(format!(
            "{endpoint:?} is not a unix socket path (use unix:///path/to/socket)"
        )));
    }
    Ok(path.to_owned())
}

fn unix_connector(
    path: String,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<UnixStream>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<TokioIo<UnixStream>>> + Send,
> + Clone
+ Send {
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    })
}

/// The message of a CRI call's reply; a failed call as an error naming it.
fn reply<T>(call: &str, r: Result<tonic::Response<T>, tonic::Status>) -> Result<T, SourceError> {
    r.map(tonic::Response::into_inner)
        .map_err(|e| SourceError::new(format!("{call}: {} ({:?})", e.message(), e.code())))
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
            calls: CriCalls::default(),
            view: Arc::default(),
            throttle: None,
        }
    }

    /// Counts calls in `calls` instead of private counters.
    pub fn with_calls(mut self, calls: CriCalls) -> Self {
        self.calls = calls;
        self
    }

    /// Limits the rate of CRI calls (`--cri-qps`, `--cri-burst`).
    pub fn with_throttle(mut self, throttle: Throttle) -> Self {
        self.throttle = Some(throttle);
        self
    }

    /// Calls made so far.
    pub fn calls(&self) -> CriCalls {
        self.calls.clone()
    }

    /// What the listings showed.
    pub fn view(&self) -> Arc<Mutex<RuntimeView>> {
        self.view.clone()
    }

    /// Whether the runtime lists a Ready sandbox of pod `uid` now (the agent's own pod: see
    /// [`super::identity`]).
    pub async fn pod_ready_now(&self, uid: &str) -> Result<bool, SourceError> {
        let mut client = self.client.clone();
        self.call(&self.calls.list_pod_sandbox).await;
        let listed = client.list_pod_sandbox(ListPodSandboxRequest {
            filter: Some(PodSandboxFilter {
                state: Some(PodSandboxStateValue {
                    state: PodSandboxState::SandboxReady as i32,
                }),
                ..Default::default()
            }),
        });
        Ok(reply("ListPodSandbox", listed.await)?
            .items
            .iter()
            .any(|sb| {
                sandbox_running(sb.state) && sb.metadata.as_ref().is_some_and(|m| m.uid == uid)
            }))
    }

    /// Asks the runtime about sandbox `id` now (its status, and its containers not exited):
    /// the fresh confirmation of a death before its addresses are released.
    pub async fn sandbox_now(&self, id: &str) -> Result<SandboxNow, SourceError> {
        let mut client = self.client.clone();
        self.call(&self.calls.pod_sandbox_status).await;
        let asked = client.pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: false,
        });
        let status = match asked.await {
            Err(e) if e.code() == tonic::Code::NotFound => return Ok(SandboxNow::Gone),
            other => reply("PodSandboxStatus", other)?.status,
        };
        let Some(status) = status else {
            return Err(SourceError::new(format!(
                "PodSandboxStatus of {id} returned no status"
            )));
        };
        // The runtime reports an address while the network namespace is open.
        let has_ip = status
            .network
            .is_some_and(|n| !n.ip.is_empty() || n.additional_ips.iter().any(|p| !p.ip.is_empty()));
        self.call(&self.calls.list_containers).await;
        let listed = client.list_containers(ListContainersRequest {
            filter: Some(ContainerFilter {
                pod_sandbox_id: id.to_owned(),
                ..Default::default()
            }),
        });
        let running = reply("ListContainers", listed.await)?
            .containers
            .iter()
            // A container created and never started holds nothing; an unknown one may.
            .filter(|c| {
                c.pod_sandbox_id == id
                    && matches!(
                        container_state(c.state),
                        ContainerState::Running | ContainerState::Unknown
                    )
            })
            .count();
        Ok(SandboxNow::of(
            Some((sandbox_running(status.state), has_ip)),
            running,
        ))
    }

    async fn call(&self, counter: &Counter) {
        if let Some(t) = &self.throttle {
            drop(t.acquire().await);
        }
        counter.inc();
    }

    fn record(
        &self,
        pods: &[RuntimePod],
        unattributed: usize,
        live: BTreeMap<String, LiveSandbox>,
    ) {
        let mut view = self.view.lock().expect("runtime view lock");
        view.listings += 1;
        let n = view.listings;
        view.pods.clear();
        view.ready.clear();
        view.live = live;
        view.unattributed = unattributed;
        for p in pods {
            if p.sandboxes
                .iter()
                .any(|s| s.state == ContainerState::Running)
            {
                view.ready.insert(p.uid.clone());
            }
            view.pods
                .insert(p.uid.clone(), PodKey::new(&p.namespace, &p.name));
            for sb in &p.sandboxes {
                match view.sandboxes.get_mut(sb.id.as_str()) {
                    Some(last) => *last = n,
                    None => {
                        view.sandboxes.insert(sb.id.to_string(), n);
                    }
                }
            }
        }
    }
}

/// The sandboxes that may still hold their network: Ready, or with a container of theirs not
/// exited; with their pod's uid and the grace period its containers carry.
fn live_sandboxes(
    pod_of_sandbox: &HashMap<String, String>,
    running: &HashSet<String>,
    containers: &[k8s_cri::v1::Container],
) -> BTreeMap<String, LiveSandbox> {
    let mut up: HashSet<&str> = running.iter().map(String::as_str).collect();
    let mut grace: HashMap<&str, i64> = HashMap::new();
    for c in containers {
        if container_state(c.state) != ContainerState::Exited {
            up.insert(&c.pod_sandbox_id);
        }
        let g = c
            .annotations
            .get(GRACE_ANNOTATION)
            .and_then(|g| g.parse::<i64>().ok());
        if let Some(g) = g {
            let max = grace.entry(&c.pod_sandbox_id).or_insert(g);
            *max = (*max).max(g);
        }
    }
    up.into_iter()
        .filter_map(|id| {
            let sandbox = LiveSandbox {
                pod_uid: pod_of_sandbox.get(id)?.clone(),
                grace_seconds: grace.get(id).copied(),
            };
            Some((id.to_owned(), sandbox))
        })
        .collect()
}

impl PodSource for CriPodSource {
    async fn list_pods(&self) -> Result<Vec<RuntimePod>, SourceError> {
        let mut client = self.client.clone();
        self.call(&self.calls.list_pod_sandbox).await;
        let listed = client.list_pod_sandbox(ListPodSandboxRequest::default());
        let sandboxes = reply("ListPodSandbox", listed.await)?.items;
        self.call(&self.calls.list_containers).await;
        let listed = client.list_containers(ListContainersRequest::default());
        let containers = reply("ListContainers", listed.await)?.containers;
        let mut pods: HashMap<String, RuntimePod> = HashMap::new();
        let mut pod_of_sandbox: HashMap<String, String> = HashMap::new();
        let mut running: HashSet<String> = HashSet::new();
        let mut unattributed = 0;
        for sb in sandboxes {
            let Some(meta) = sb.metadata else {
                unattributed += 1;
                continue;
            };
            pod_of_sandbox.insert(sb.id.clone(), meta.uid.clone());
            if sandbox_running(sb.state) {
                running.insert(sb.id.clone());
            }
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
        let live = live_sandboxes(&pod_of_sandbox, &running, &containers);
        for c in containers {
            // A container whose sandbox is already gone has no pod to report it under.
            if let Some(pod) = pod_of_sandbox
                .get(&c.pod_sandbox_id)
                .and_then(|uid| pods.get_mut(uid))
            {
                pod.containers
                    .push(Container::new(c.id, container_state(c.state)));
            } else if container_state(c.state) != ContainerState::Exited {
                // It may still hold its gone sandbox's network namespace: no pod is gone.
                unattributed += 1;
            }
        }
        let mut pods: Vec<RuntimePod> = pods.into_values().collect();
        // A stable order lets the PLEG compare listings cheaply.
        for p in &mut pods {
            p.sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
            p.containers.sort_by(|a, b| a.id.cmp(&b.id));
        }
        pods.sort_by(|a, b| a.uid.cmp(&b.uid));
        self.record(&pods, unattributed, live);
        Ok(pods)
    }

    async fn pod_status(&self, pod: &RuntimePod) -> Result<PodStatus, SourceError> {
        let mut client = self.client.clone();
        let mut sandbox_statuses = Vec::with_capacity(pod.sandboxes.len());
        let mut newest_ready: Option<(i64, Vec<String>)> = None;
        for sb in &pod.sandboxes {
            self.call(&self.calls.pod_sandbox_status).await;
            let inspected = client.pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: sb.id.to_string(),
                verbose: false,
            });
            let status = reply("PodSandboxStatus", inspected.await)?
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
                    id: c.id.to_string(),
                    state: c.state,
                })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(
        sandbox: &str,
        state: CriContainerState,
        grace: Option<&str>,
    ) -> k8s_cri::v1::Container {
        let mut c = k8s_cri::v1::Container {
            pod_sandbox_id: sandbox.into(),
            state: state as i32,
            ..Default::default()
        };
        if let Some(g) = grace {
            c.annotations.insert(GRACE_ANNOTATION.into(), g.into());
        }
        c
    }

    /// A restarted pod's old sandbox, stopped, is not live though the pod's new containers
    /// run; a stopped sandbox with a container still running is; the grace is the largest its
    /// containers carry (an unreadable one is ignored).
    #[test]
    fn only_a_ready_sandbox_or_one_with_its_own_container_up_is_live() {
        let pods: HashMap<String, String> = [("old", "p"), ("new", "p"), ("stuck", "q")]
            .into_iter()
            .map(|(s, p)| (s.to_string(), p.to_string()))
            .collect();
        let running: HashSet<String> = ["new".to_string()].into();
        let containers = [
            container("old", CriContainerState::ContainerExited, Some("600")),
            container("new", CriContainerState::ContainerRunning, Some("600")),
            container("stuck", CriContainerState::ContainerRunning, Some("30")),
            container("stuck", CriContainerState::ContainerExited, Some("90")),
            container("stuck", CriContainerState::ContainerExited, Some("x")),
        ];
        let live = live_sandboxes(&pods, &running, &containers);
        let got: Vec<(&str, &str, Option<i64>)> = live
            .iter()
            .map(|(id, s)| (id.as_str(), s.pod_uid.as_str(), s.grace_seconds))
            .collect();
        assert_eq!(got, [("new", "p", Some(600)), ("stuck", "q", Some(90))]);
    }
}
