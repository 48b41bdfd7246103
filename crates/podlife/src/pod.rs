//! What a container runtime reports about pods: the listing the PLEG diffs, and the status it
//! inspects for pods that changed.

use std::fmt;

/// A pod's uid as the runtime knows it (from the sandbox metadata).
pub type PodUid = String;

/// A container's (or sandbox's) state in a listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ContainerState {
    /// Created but not started.
    Created,
    /// Running (for a sandbox: ready).
    Running,
    /// Exited (for a sandbox: not ready).
    Exited,
    /// The runtime does not know.
    Unknown,
}

impl ContainerState {
    /// Every state, in discriminant order.
    pub const ALL: [ContainerState; 4] = [
        ContainerState::Created,
        ContainerState::Running,
        ContainerState::Exited,
        ContainerState::Unknown,
    ];

    /// Lower-case name, as used in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ContainerState::Created => "created",
            ContainerState::Running => "running",
            ContainerState::Exited => "exited",
            ContainerState::Unknown => "unknown",
        }
    }
}

/// Longest id kept inline: containerd's and CRI-O's ids are 64 hex digits.
const INLINE_ID: usize = 64;

/// A container's or sandbox's runtime id. Ids of up to 64 bytes live inside the value, not on
/// the heap: the PLEG drops a whole listing every second, and with inline ids a pod of 10
/// containers costs 5 allocations instead of 16 (the frees were over half of a relist's CPU).
#[derive(Clone)]
pub struct ContainerId(IdRepr);

#[derive(Clone)]
enum IdRepr {
    Inline(arrayvec::ArrayString<INLINE_ID>),
    Heap(Box<str>),
}

impl ContainerId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            IdRepr::Inline(s) => s,
            IdRepr::Heap(s) => s,
        }
    }
}

impl From<&str> for ContainerId {
    fn from(id: &str) -> Self {
        match arrayvec::ArrayString::from(id) {
            Ok(inline) => ContainerId(IdRepr::Inline(inline)),
            Err(_) => ContainerId(IdRepr::Heap(id.into())),
        }
    }
}

impl From<String> for ContainerId {
    fn from(id: String) -> Self {
        if id.len() <= INLINE_ID {
            ContainerId::from(id.as_str())
        } else {
            ContainerId(IdRepr::Heap(id.into_boxed_str()))
        }
    }
}

impl From<&String> for ContainerId {
    fn from(id: &String) -> Self {
        ContainerId::from(id.as_str())
    }
}

impl std::ops::Deref for ContainerId {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for ContainerId {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::borrow::Borrow<str> for ContainerId {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for ContainerId {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for ContainerId {}

impl PartialEq<str> for ContainerId {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ContainerId {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialOrd for ContainerId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ContainerId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for ContainerId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl fmt::Debug for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One container or sandbox in a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    /// Runtime id.
    pub id: ContainerId,
    /// State at listing time.
    pub state: ContainerState,
}

impl Container {
    /// A container with this id and state.
    pub fn new(id: impl Into<ContainerId>, state: ContainerState) -> Self {
        Container {
            id: id.into(),
            state,
        }
    }
}

/// A pod as a runtime listing shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuntimePod {
    /// Pod uid.
    pub uid: PodUid,
    /// Pod name.
    pub name: String,
    /// Pod namespace.
    pub namespace: String,
    /// Application containers.
    pub containers: Vec<Container>,
    /// Sandboxes (a pod may have several when its sandbox was recreated).
    pub sandboxes: Vec<Container>,
}

impl RuntimePod {
    /// A pod with only a uid.
    pub fn new(uid: impl Into<String>) -> Self {
        RuntimePod {
            uid: uid.into(),
            ..Default::default()
        }
    }

    /// Containers then sandboxes: the PLEG treats both alike.
    pub fn all_containers(&self) -> impl Iterator<Item = &Container> {
        self.containers.iter().chain(self.sandboxes.iter())
    }

    /// The state of a container or sandbox by id, if listed.
    pub fn state_of(&self, id: &str) -> Option<ContainerState> {
        self.all_containers().find(|c| c.id == id).map(|c| c.state)
    }
}

/// What a listing holds, for the metrics.
#[derive(Debug, Default)]
pub(crate) struct ListingCounts {
    /// Containers (not sandboxes) by [`ContainerState`] discriminant.
    pub(crate) containers: [usize; ContainerState::ALL.len()],
    /// Pods with a running sandbox.
    pub(crate) running_pods: usize,
}

impl ListingCounts {
    pub(crate) fn add(&mut self, pod: &RuntimePod) {
        for c in &pod.containers {
            self.containers[c.state as usize] += 1;
        }
        if pod
            .sandboxes
            .iter()
            .any(|s| s.state == ContainerState::Running)
        {
            self.running_pods += 1;
        }
    }
}

/// A sandbox's readiness in a pod status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SandboxState {
    /// The sandbox runs and its network is set up.
    Ready,
    /// Stopped: its network namespace is gone (or going).
    NotReady,
}

/// One sandbox in an inspected status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxStatus {
    /// Sandbox id.
    pub id: String,
    /// Ready or not.
    pub state: SandboxState,
    /// Addresses the runtime reports for it (empty once it stopped).
    pub ips: Vec<String>,
}

/// One container in an inspected status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerStatus {
    /// Container id.
    pub id: String,
    /// State.
    pub state: ContainerState,
}

/// The inspected status of one pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodStatus {
    /// Pod uid.
    pub uid: PodUid,
    /// Pod name.
    pub name: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod IPs (all families), possibly preserved from an earlier status.
    pub ips: Vec<String>,
    /// Sandbox statuses, newest first as the runtime reports them.
    pub sandbox_statuses: Vec<SandboxStatus>,
    /// Container statuses.
    pub container_statuses: Vec<ContainerStatus>,
}

impl PodStatus {
    /// The empty status of a pod: what a cache miss returns.
    pub fn empty(uid: &str) -> Self {
        PodStatus {
            uid: uid.to_owned(),
            ..Default::default()
        }
    }
}

/// A runtime call that failed (listing or inspection). Cloneable so the cache can keep it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct SourceError {
    message: String,
}

impl SourceError {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        SourceError {
            message: message.into(),
        }
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_reads_back_and_orders_as_its_text_inline_or_not() {
        let short = "a".repeat(INLINE_ID);
        let long = "a".repeat(INLINE_ID + 1);
        for text in ["", "sandbox-1", short.as_str(), long.as_str()] {
            let id = ContainerId::from(text);
            assert_eq!(id.as_str(), text);
            assert_eq!(id, ContainerId::from(text.to_owned()));
            assert_eq!(format!("{id}"), text);
        }
        assert!(matches!(
            ContainerId::from(short.as_str()).0,
            IdRepr::Inline(_)
        ));
        assert!(matches!(ContainerId::from(long.clone()).0, IdRepr::Heap(_)));
        // Sorting ids sorts their texts, whichever way each is kept.
        let mut ids: Vec<ContainerId> = [long.as_str(), "b", short.as_str(), "a"]
            .map(ContainerId::from)
            .to_vec();
        ids.sort();
        let texts: Vec<&str> = ids.iter().map(|i| i.as_str()).collect();
        assert_eq!(texts, ["a", short.as_str(), long.as_str(), "b"]);
    }
}
