//! A relisting pod lifecycle event generator, with the kubelet's generic PLEG semantics:
//! list every pod, diff each container's state against the previous listing, inspect the
//! pods that changed into the [`PodStatusCache`], and send the events.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::backoff::Backoff;
use crate::cache::{PodStatusCache, preserve_ips};
use crate::clock::SharedClock;
use crate::pod::{ContainerState, ListingCounts, PodStatus, PodUid, RuntimePod, SourceError};

/// Default period between relists.
pub const DEFAULT_RELIST_PERIOD: Duration = Duration::from_secs(1);
/// Default time without a successful relist after which the PLEG is unhealthy.
pub const DEFAULT_RELIST_THRESHOLD: Duration = Duration::from_secs(180);
/// Default capacity of the event channel.
pub const DEFAULT_CHANNEL_CAPACITY: usize = 1000;

/// The container runtime as the PLEG sees it.
pub trait PodSource: Send + Sync {
    /// Every pod the runtime knows, with all its containers and sandboxes (running or not).
    fn list_pods(&self) -> impl Future<Output = Result<Vec<RuntimePod>, SourceError>> + Send;
    /// The full status of one listed pod.
    fn pod_status(
        &self,
        pod: &RuntimePod,
    ) -> impl Future<Output = Result<PodStatus, SourceError>> + Send;
}

/// What happened to a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// A container (or sandbox) is now running.
    ContainerStarted,
    /// A container (or sandbox) exited, or vanished while running.
    ContainerDied,
    /// A container (or sandbox) is gone from the listing.
    ContainerRemoved,
    /// The pod's status was refreshed without a container change (after a re-inspection).
    PodSync,
    /// A container went to an unknown state. Computed (it triggers inspection), never sent.
    ContainerChanged,
}

impl EventKind {
    /// The kinds that are sent (not [`EventKind::ContainerChanged`]).
    pub const SENT: [EventKind; 4] = [
        EventKind::ContainerStarted,
        EventKind::ContainerDied,
        EventKind::ContainerRemoved,
        EventKind::PodSync,
    ];

    /// Name in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::ContainerStarted => "ContainerStarted",
            EventKind::ContainerDied => "ContainerDied",
            EventKind::ContainerRemoved => "ContainerRemoved",
            EventKind::PodSync => "PodSync",
            EventKind::ContainerChanged => "ContainerChanged",
        }
    }
}

/// One pod lifecycle event.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodLifecycleEvent {
    /// Pod uid.
    pub pod: PodUid,
    /// What happened.
    pub kind: EventKind,
    /// The container or sandbox concerned (none for [`EventKind::PodSync`]).
    pub container_id: Option<String>,
}

impl PodLifecycleEvent {
    /// An event about a container of a pod.
    pub fn container(pod: &str, kind: EventKind, container_id: &str) -> Self {
        PodLifecycleEvent {
            pod: pod.to_owned(),
            kind,
            container_id: Some(container_id.to_owned()),
        }
    }
}

/// PLEG settings.
#[derive(Debug, Clone)]
pub struct PlegConfig {
    /// Time between the end of one relist and the start of the next.
    pub relist_period: Duration,
    /// Without a successful relist for this long, [`PlegHandle::healthy`] fails.
    pub relist_threshold: Duration,
    /// Capacity of the event channel; events beyond it are dropped and counted.
    pub channel_capacity: usize,
    /// After a failed inspection, wait this long before inspecting that pod again, doubling
    /// up to [`inspect_backoff_max`](Self::inspect_backoff_max). Zero (the kubelet's
    /// behaviour, the default) re-inspects on every relist.
    pub inspect_backoff_initial: Duration,
    /// Longest wait between inspections of a failing pod.
    pub inspect_backoff_max: Duration,
}

impl Default for PlegConfig {
    fn default() -> Self {
        PlegConfig {
            relist_period: DEFAULT_RELIST_PERIOD,
            relist_threshold: DEFAULT_RELIST_THRESHOLD,
            channel_capacity: DEFAULT_CHANNEL_CAPACITY,
            inspect_backoff_initial: Duration::ZERO,
            inspect_backoff_max: Duration::ZERO,
        }
    }
}

/// Counters and gauges of the PLEG, for metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlegMetrics {
    /// Relists attempted.
    pub relists: u64,
    /// Relists whose listing failed.
    pub relist_failures: u64,
    /// Duration of the last relist.
    pub last_relist_duration: Option<Duration>,
    /// Time between the last two relist starts.
    pub last_relist_interval: Option<Duration>,
    /// Events sent, by kind.
    pub events_sent: BTreeMap<EventKind, u64>,
    /// Events dropped because the channel was full (or closed).
    pub dropped_events: u64,
    /// Pod status inspections made (including failed ones).
    pub inspections: u64,
    /// Inspections that failed.
    pub inspection_failures: u64,
    /// Pods with a running sandbox at the last listing.
    pub running_pods: usize,
    /// Containers (not sandboxes) by state at the last listing.
    pub containers_by_state: BTreeMap<ContainerState, usize>,
}

/// Why the PLEG is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    /// No relist has succeeded yet.
    #[error("pleg has yet to relist successfully")]
    NeverRelisted,
    /// The last successful relist is too old.
    #[error("pleg was last seen active {elapsed:?} ago; threshold is {threshold:?}")]
    Stale {
        /// Time since the last successful relist.
        elapsed: Duration,
        /// The configured threshold.
        threshold: Duration,
    },
}

/// Relist statistics handed to an observer after each relist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelistStats {
    /// Whether the listing succeeded.
    pub ok: bool,
    /// How long the relist took.
    pub duration: Duration,
    /// Time since the previous relist started, if any.
    pub interval: Option<Duration>,
}

type Observer = Box<dyn Fn(RelistStats) + Send + Sync>;

struct Shared {
    clock: SharedClock,
    threshold: Duration,
    last_relist: Mutex<Option<Instant>>,
    metrics: Mutex<PlegMetrics>,
}

/// A cheap, cloneable view of a running PLEG: health and metrics.
#[derive(Clone)]
pub struct PlegHandle {
    shared: Arc<Shared>,
}

impl PlegHandle {
    /// Ok when the last successful relist is within the threshold.
    pub fn healthy(&self) -> Result<(), Unhealthy> {
        let last = *self.shared.last_relist.lock().expect("pleg poisoned");
        let last = last.ok_or(Unhealthy::NeverRelisted)?;
        let elapsed = self.shared.clock.since(last);
        if elapsed > self.shared.threshold {
            return Err(Unhealthy::Stale {
                elapsed,
                threshold: self.shared.threshold,
            });
        }
        Ok(())
    }

    /// A snapshot of the counters.
    pub fn metrics(&self) -> PlegMetrics {
        self.shared.metrics.lock().expect("pleg poisoned").clone()
    }
}

#[derive(Debug, Default)]
struct PodRecord {
    old: Option<RuntimePod>,
    current: Option<RuntimePod>,
    /// The relist that last listed this pod.
    listing: u64,
}

/// The relisting PLEG over a [`PodSource`].
pub struct Pleg<S> {
    source: S,
    cache: Option<Arc<PodStatusCache>>,
    records: foldhash::HashMap<PodUid, PodRecord>,
    /// Relists that listed successfully, numbering [`PodRecord::listing`].
    listing: u64,
    to_reinspect: HashMap<PodUid, RuntimePod>,
    events: mpsc::Sender<PodLifecycleEvent>,
    relist_period: Duration,
    shared: Arc<Shared>,
    observer: Option<Observer>,
    /// Per-pod backoff of failing inspections.
    backoff: Backoff<PodUid>,
}

/// The PLEG-internal state of a container, with "non-existent" for a missing one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PlegState {
    Running,
    Exited,
    Unknown,
    NonExistent,
}

fn pleg_state(state: Option<ContainerState>) -> PlegState {
    match state {
        // Created is not used by the kubelet's state machine: treat it as unknown.
        Some(ContainerState::Created) | Some(ContainerState::Unknown) => PlegState::Unknown,
        Some(ContainerState::Running) => PlegState::Running,
        Some(ContainerState::Exited) => PlegState::Exited,
        None => PlegState::NonExistent,
    }
}

fn transition_events(old: PlegState, new: PlegState) -> &'static [EventKind] {
    use EventKind::*;
    match (old, new) {
        _ if old == new => &[],
        (_, PlegState::Running) => &[ContainerStarted],
        (_, PlegState::Exited) => &[ContainerDied],
        (_, PlegState::Unknown) => &[ContainerChanged],
        // Its death was already reported when it exited.
        (PlegState::Exited, PlegState::NonExistent) => &[ContainerRemoved],
        (_, PlegState::NonExistent) => &[ContainerDied, ContainerRemoved],
    }
}

/// Same containers in the same order with the same states: nothing to report.
fn same_listing(a: &RuntimePod, b: &RuntimePod) -> bool {
    a.containers == b.containers && a.sandboxes == b.sandboxes
}

fn compute_pod_events(uid: &str, rec: &PodRecord, out: &mut Vec<PodLifecycleEvent>) {
    let (old, new) = (rec.old.as_ref(), rec.current.as_ref());
    if let (Some(o), Some(n)) = (old, new)
        && same_listing(o, n)
    {
        return;
    }
    let mut seen: Vec<&str> = Vec::new();
    for c in old.into_iter().chain(new).flat_map(|p| p.all_containers()) {
        if seen.contains(&c.id.as_str()) {
            continue;
        }
        seen.push(&c.id);
        let before = pleg_state(old.and_then(|p| p.state_of(&c.id)));
        let after = pleg_state(new.and_then(|p| p.state_of(&c.id)));
        for kind in transition_events(before, after) {
            out.push(PodLifecycleEvent::container(uid, *kind, &c.id));
        }
    }
}

impl<S: PodSource> Pleg<S> {
    /// A PLEG over `source`, writing statuses into `cache` (none: events only, no inspection),
    /// and the receiving end of its event channel.
    pub fn new(
        source: S,
        cache: Option<Arc<PodStatusCache>>,
        clock: SharedClock,
        config: PlegConfig,
    ) -> (Self, mpsc::Receiver<PodLifecycleEvent>) {
        let (tx, rx) = mpsc::channel(config.channel_capacity.max(1));
        let shared = Arc::new(Shared {
            clock,
            threshold: config.relist_threshold,
            last_relist: Mutex::new(None),
            metrics: Mutex::new(PlegMetrics::default()),
        });
        let backoff = Backoff::new(
            config.inspect_backoff_initial,
            config.inspect_backoff_max,
            shared.clock.clone(),
        );
        let pleg = Pleg {
            backoff,
            source,
            cache,
            records: foldhash::HashMap::default(),
            listing: 0,
            to_reinspect: HashMap::new(),
            events: tx,
            relist_period: config.relist_period,
            shared,
            observer: None,
        };
        (pleg, rx)
    }

    /// A handle for health checks and metrics.
    pub fn handle(&self) -> PlegHandle {
        PlegHandle {
            shared: self.shared.clone(),
        }
    }

    /// Calls `f` after every relist (for histograms).
    pub fn set_observer(&mut self, f: impl Fn(RelistStats) + Send + Sync + 'static) {
        self.observer = Some(Box::new(f));
    }

    /// The runtime source.
    pub fn source(&self) -> &S {
        &self.source
    }

    fn metrics(&self) -> std::sync::MutexGuard<'_, PlegMetrics> {
        self.shared.metrics.lock().expect("pleg poisoned")
    }

    /// One relist: list, diff, inspect changed pods into the cache, send events.
    pub async fn relist(&mut self) {
        let clock = self.shared.clock.clone();
        let timestamp = clock.now();
        let interval = self
            .shared
            .last_relist
            .lock()
            .expect("pleg poisoned")
            .map(|last| timestamp.saturating_duration_since(last));
        let listed = self.source.list_pods().await;
        let ok = listed.is_ok();
        match listed {
            Err(e) => {
                tracing::error!(error = %e, "pleg: unable to list pods");
                self.metrics().relist_failures += 1;
            }
            Ok(pods) => {
                *self.shared.last_relist.lock().expect("pleg poisoned") = Some(timestamp);
                self.backoff.gc();
                let counts = self.set_current(pods);
                self.record_counts(counts);
                self.diff_and_inspect(timestamp).await;
            }
        }
        let duration = clock.since(timestamp);
        {
            let mut m = self.metrics();
            m.relists += 1;
            m.last_relist_duration = Some(duration);
            if interval.is_some() {
                m.last_relist_interval = interval;
            }
        }
        if let Some(observe) = &self.observer {
            observe(RelistStats {
                ok,
                duration,
                interval,
            });
        }
    }

    fn record_counts(&self, counts: ListingCounts) {
        let mut m = self.metrics();
        m.containers_by_state = ContainerState::ALL
            .into_iter()
            .zip(counts.containers)
            .filter(|(_, n)| *n > 0)
            .collect();
        m.running_pods = counts.running_pods;
    }

    /// Makes `pods` the current listing (one pass over it and one over the records: this runs
    /// every second over every pod), and counts it for the metrics.
    fn set_current(&mut self, pods: Vec<RuntimePod>) -> ListingCounts {
        self.listing += 1;
        let listing = self.listing;
        let mut counts = ListingCounts::default();
        for pod in pods {
            counts.add(&pod);
            match self.records.get_mut(&pod.uid) {
                Some(rec) => {
                    rec.current = Some(pod);
                    rec.listing = listing;
                }
                None => {
                    let uid = pod.uid.clone();
                    self.records.insert(
                        uid,
                        PodRecord {
                            old: None,
                            current: Some(pod),
                            listing,
                        },
                    );
                }
            }
        }
        self.records.retain(|_, r| {
            if r.listing != listing {
                r.current = None;
            }
            // A pod that never produced an event and vanished has nothing left to compare.
            r.old.is_some() || r.current.is_some()
        });
        counts
    }

    async fn diff_and_inspect(&mut self, timestamp: Instant) {
        let mut events = Vec::new();
        let mut by_pod: BTreeMap<PodUid, Vec<PodLifecycleEvent>> = BTreeMap::new();
        for (uid, rec) in &self.records {
            compute_pod_events(uid, rec, &mut events);
            if !events.is_empty() {
                by_pod.insert(uid.clone(), std::mem::take(&mut events));
            }
        }

        let mut needs_reinspection = HashMap::new();
        for (uid, pod_events) in by_pod {
            let current = self.records.get(&uid).and_then(|r| r.current.clone());
            if self.cache.is_some() {
                // Inspected now, so not again below in this relist.
                self.to_reinspect.remove(&uid);
                if current.is_some() && self.backing_off(&uid) {
                    if let Some(pod) = current {
                        needs_reinspection.insert(uid, pod);
                    }
                    continue;
                }
                if let Err(e) = self.update_cache(&uid, current.as_ref()).await {
                    tracing::warn!(pod = %uid, error = %e, "pleg: ignoring events of a pod whose inspection failed");
                    if let Some(pod) = current {
                        needs_reinspection.insert(uid, pod);
                    }
                    continue;
                }
            }
            self.advance_record(&uid);
            for e in pod_events {
                if e.kind != EventKind::ContainerChanged {
                    self.send(e);
                }
            }
        }

        if self.cache.is_some() {
            for (uid, pod) in std::mem::take(&mut self.to_reinspect) {
                if self.backing_off(&uid) {
                    needs_reinspection.insert(uid, pod);
                    continue;
                }
                match self.update_cache(&uid, Some(&pod)).await {
                    Ok(()) => self.send(PodLifecycleEvent {
                        pod: uid,
                        kind: EventKind::PodSync,
                        container_id: None,
                    }),
                    Err(e) => {
                        tracing::warn!(pod = %uid, error = %e, "pleg: pod failed reinspection");
                        needs_reinspection.insert(uid, pod);
                    }
                }
            }
            // Only after every pod above is in the cache.
            if let Some(cache) = &self.cache {
                cache.update_time(timestamp);
            }
        }
        self.to_reinspect = needs_reinspection;
    }

    fn backing_off(&self, uid: &str) -> bool {
        self.backoff
            .is_in_backoff_since(&uid.to_owned(), self.shared.clock.now())
    }

    fn advance_record(&mut self, uid: &str) {
        if let Some(rec) = self.records.get_mut(uid) {
            match rec.current.take() {
                Some(current) => rec.old = Some(current),
                None => {
                    self.records.remove(uid);
                }
            }
        }
    }

    async fn update_cache(&self, uid: &str, pod: Option<&RuntimePod>) -> Result<(), SourceError> {
        let cache = self.cache.clone().expect("update_cache needs a cache");
        let Some(pod) = pod else {
            // Gone from the listing: no containers left at all.
            cache.delete(uid);
            return Ok(());
        };
        let timestamp = self.shared.clock.now();
        let result = self.source.pod_status(pod).await;
        let mut m = self.metrics();
        m.inspections += 1;
        match result {
            Ok(mut status) => {
                drop(m);
                self.backoff.reset(&uid.to_owned());
                let (old, old_err) = cache.get(uid);
                status.ips = preserve_ips(&old, old_err.as_ref(), &status);
                cache.set(uid, status, None, timestamp);
                Ok(())
            }
            Err(e) => {
                m.inspection_failures += 1;
                drop(m);
                self.backoff
                    .next(&uid.to_owned(), timestamp, Some(e.to_string()));
                let status = PodStatus {
                    name: pod.name.clone(),
                    namespace: pod.namespace.clone(),
                    ..PodStatus::empty(uid)
                };
                cache.set(uid, status, Some(e.clone()), timestamp);
                Err(e)
            }
        }
    }

    fn send(&self, event: PodLifecycleEvent) {
        let kind = event.kind;
        match self.events.try_send(event) {
            Ok(()) => *self.metrics().events_sent.entry(kind).or_insert(0) += 1,
            Err(e) => {
                self.metrics().dropped_events += 1;
                tracing::error!(event = ?e.into_inner(), "pleg: event channel full, dropping event");
            }
        }
    }

    /// Relists every period until `shutdown` completes.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            self.relist().await;
            let next = self.shared.clock.now() + self.relist_period;
            let sleep = self.shared.clock.sleep_until(next);
            tokio::select! {
                _ = &mut shutdown => return,
                _ = sleep => {}
            }
        }
    }
}
