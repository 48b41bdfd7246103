//! The pod status cache: the PLEG writes each inspected pod status here, readers wait for a
//! status newer than the one they acted on.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::watch;

use crate::pod::{ContainerState, PodStatus, PodUid, SandboxState, SourceError};

#[derive(Debug, Clone)]
struct Entry {
    status: PodStatus,
    error: Option<SourceError>,
    modified: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    pods: HashMap<PodUid, Entry>,
    /// Time of the last complete relist: every pod status is at least this fresh.
    timestamp: Option<Instant>,
}

/// Pod statuses by pod uid, each with the error of its last inspection and when it was taken.
#[derive(Debug)]
pub struct PodStatusCache {
    inner: Mutex<Inner>,
    /// Bumped on every change so waiters re-check their condition.
    changed: watch::Sender<u64>,
}

impl Default for PodStatusCache {
    fn default() -> Self {
        Self::new()
    }
}

impl PodStatusCache {
    /// An empty cache with no global timestamp.
    pub fn new() -> Self {
        PodStatusCache {
            inner: Mutex::new(Inner::default()),
            changed: watch::channel(0).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("pod status cache poisoned")
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// The cached status and inspection error of a pod. A miss is an empty status for that uid
    /// and no error.
    pub fn get(&self, uid: &str) -> (PodStatus, Option<SourceError>) {
        match self.lock().pods.get(uid) {
            Some(e) => (e.status.clone(), e.error.clone()),
            None => (PodStatus::empty(uid), None),
        }
    }

    /// Stores a status (and the error that came with it) taken at `modified`.
    pub fn set(&self, uid: &str, status: PodStatus, error: Option<SourceError>, modified: Instant) {
        self.lock().pods.insert(
            uid.to_owned(),
            Entry {
                status,
                error,
                modified,
            },
        );
        self.notify();
    }

    /// Forgets a pod.
    pub fn delete(&self, uid: &str) {
        self.lock().pods.remove(uid);
        self.notify();
    }

    /// Marks every cached status as fresh as of `timestamp` (called after a complete relist).
    pub fn update_time(&self, timestamp: Instant) {
        self.lock().timestamp = Some(timestamp);
        self.notify();
    }

    /// Number of cached pods.
    pub fn len(&self) -> usize {
        self.lock().pods.len()
    }

    /// Whether the cache holds no pod.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get_if_newer_than(
        &self,
        uid: &str,
        min: Instant,
    ) -> Option<(PodStatus, Option<SourceError>)> {
        let inner = self.lock();
        let global_newer = inner.timestamp.is_some_and(|t| t > min);
        match inner.pods.get(uid) {
            Some(e) if e.modified > min || global_newer => {
                Some((e.status.clone(), e.error.clone()))
            }
            None if global_newer => Some((PodStatus::empty(uid), None)),
            _ => None,
        }
    }

    /// Waits until the pod's entry, or the global timestamp, is newer than `min`, and returns
    /// the status then cached (an empty status when the pod is unknown).
    pub async fn get_newer_than(
        &self,
        uid: &str,
        min: Instant,
    ) -> (PodStatus, Option<SourceError>) {
        let mut rx = self.changed.subscribe();
        loop {
            rx.borrow_and_update();
            if let Some(found) = self.get_if_newer_than(uid, min) {
                return found;
            }
            // The sender lives in self, so this only fails if self is gone, which borrowck forbids.
            let _ = rx.changed().await;
        }
    }
}

/// The kubelet's IP preservation: a torn-down sandbox reports no IP, but the addresses a dead
/// pod had must stay visible. Returns the IPs to cache for `new`, given the previously cached
/// status and error of the same pod.
pub fn preserve_ips(
    old: &PodStatus,
    old_error: Option<&SourceError>,
    new: &PodStatus,
) -> Vec<String> {
    if !new.ips.is_empty() || old_error.is_some() || old.ips.is_empty() {
        return new.ips.clone();
    }
    if new
        .sandbox_statuses
        .iter()
        .any(|s| s.state == SandboxState::Ready)
    {
        return new.ips.clone();
    }
    if new.sandbox_statuses.is_empty()
        && new
            .container_statuses
            .iter()
            .any(|c| matches!(c.state, ContainerState::Created | ContainerState::Running))
    {
        return new.ips.clone();
    }
    old.ips.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::{ContainerStatus, SandboxStatus};
    use std::time::Duration;
    use tokio_test::{assert_pending, assert_ready, task};

    fn status(uid: &str) -> PodStatus {
        PodStatus {
            name: format!("name-{uid}"),
            namespace: "ns".into(),
            ..PodStatus::empty(uid)
        }
    }

    #[test]
    fn cache_not_initialized() {
        let cache = PodStatusCache::new();
        let t = Instant::now();
        // No global timestamp yet: a reader must wait.
        let mut wait = task::spawn(cache.get_newer_than("1234", t));
        assert_pending!(wait.poll());
        cache.update_time(t + Duration::from_secs(1));
        assert!(wait.is_woken());
        assert_eq!(assert_ready!(wait.poll()), (PodStatus::empty("1234"), None));
    }

    #[test]
    fn get_if_newer_than_when_pod_exists() {
        let t = Instant::now();
        let s = Duration::from_secs;
        // (cache time, pod modified, request, returns without waiting)
        let cases = [
            (t, t, t - s(1), true),                // both newer
            (t, t - s(2), t - s(1), true),         // global newer
            (t - s(2), t, t - s(1), true),         // pod newer
            (t - s(2), t - s(2), t - s(1), false), // both older
        ];
        for (i, (cache_time, modified, request, ready)) in cases.into_iter().enumerate() {
            let cache = PodStatusCache::new();
            cache.set("1234", status("1234"), None, modified);
            cache.update_time(cache_time);
            let mut wait = task::spawn(cache.get_newer_than("1234", request));
            let poll = wait.poll();
            assert_eq!(poll.is_ready(), ready, "case {i}");
            if let std::task::Poll::Ready((got, _)) = poll {
                assert_eq!(got, status("1234"), "case {i}");
            }
        }
    }

    #[test]
    fn get_pod_newer_than_when_pod_does_not_exist() {
        let cache = PodStatusCache::new();
        let t = Instant::now();
        cache.update_time(t);
        let mut wait = task::spawn(cache.get_newer_than("1234", t - Duration::from_secs(1)));
        assert_eq!(assert_ready!(wait.poll()), (PodStatus::empty("1234"), None));
    }

    #[test]
    fn cache_set_and_get() {
        let cache = PodStatusCache::new();
        let t = Instant::now();
        let err = SourceError::new("inspection failed");
        cache.set("1234", status("1234"), Some(err.clone()), t);
        assert_eq!(cache.get("1234"), (status("1234"), Some(err)));
        cache.set("1234", status("1234"), None, t);
        assert_eq!(cache.get("1234"), (status("1234"), None));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn cache_get_pod_does_not_exist() {
        let cache = PodStatusCache::new();
        assert_eq!(cache.get("1234"), (PodStatus::empty("1234"), None));
        assert!(cache.is_empty());
    }

    #[test]
    fn delete() {
        let cache = PodStatusCache::new();
        cache.set("1234", status("1234"), None, Instant::now());
        cache.delete("1234");
        assert_eq!(cache.get("1234"), (PodStatus::empty("1234"), None));
    }

    #[test]
    fn register_notification() {
        let cache = PodStatusCache::new();
        let t = Instant::now();
        let mut wait = task::spawn(cache.get_newer_than("1234", t));
        assert_pending!(wait.poll());
        // An older write does not satisfy the reader.
        cache.set("1234", status("1234"), None, t - Duration::from_secs(1));
        assert_pending!(wait.poll());
        let mut newer = status("1234");
        newer.ips = vec!["192.0.2.7".into()];
        cache.set("1234", newer.clone(), None, t + Duration::from_secs(1));
        assert!(wait.is_woken());
        assert_eq!(assert_ready!(wait.poll()), (newer, None));
    }

    fn with_ips(mut s: PodStatus, ips: &[&str]) -> PodStatus {
        s.ips = ips.iter().map(|s| s.to_string()).collect();
        s
    }

    #[test]
    fn preserve_ips_rules() {
        let old = with_ips(status("p"), &["192.0.2.5", "2001:db8::5"]);
        let sandbox = |state| SandboxStatus {
            id: "s1".into(),
            state,
            ips: vec![],
        };
        let container = |state| ContainerStatus {
            id: "c1".into(),
            state,
        };
        let mut dead = status("p");
        dead.sandbox_statuses = vec![sandbox(SandboxState::NotReady)];
        assert_eq!(
            preserve_ips(&old, None, &dead),
            old.ips,
            "dead sandbox keeps all old IPs"
        );
        let mut ready = status("p");
        ready.sandbox_statuses = vec![sandbox(SandboxState::Ready)];
        assert!(
            preserve_ips(&old, None, &ready).is_empty(),
            "a ready sandbox reports the truth"
        );
        let mut running = status("p");
        running.container_statuses = vec![container(ContainerState::Running)];
        assert!(preserve_ips(&old, None, &running).is_empty());
        let mut exited = status("p");
        exited.container_statuses = vec![container(ContainerState::Exited)];
        assert_eq!(preserve_ips(&old, None, &exited), old.ips);
        let err = SourceError::new("x");
        assert!(
            preserve_ips(&old, Some(&err), &dead).is_empty(),
            "an errored entry is not trusted"
        );
        let fresh = with_ips(dead.clone(), &["198.18.0.1"]);
        assert_eq!(preserve_ips(&old, None, &fresh), fresh.ips);
    }
}
