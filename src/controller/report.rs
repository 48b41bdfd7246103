//! Bad input, reported where an operator looks: a Warning Event on the object and one log line,
//! once per problem (again only if it changes or comes back): objects skipped because they do
//! not fit their schema, NADs whose config cannot be used, pods whose network-status cannot be
//! read, pools with entries that cannot be read; and the duplicate addresses `duplicates` turns
//! into problems.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::ObjectReference;

use crate::index::{Index, MalformedStatus, UnrecordedMark};
use crate::ipam::PodKey;
use crate::release::Events;
use crate::release::reports::events::IP_ADDRESS_DUPLICATE;
use crate::telemetry::ControllerMetrics;

/// Event reason: an object was skipped because it does not fit the schema.
pub const INVALID_OBJECT: &str = "InvalidObject";
/// Event reason: a NAD's config cannot be used.
pub const INVALID_NETWORK_CONFIG: &str = "InvalidNetworkConfig";
/// Event reason: a pod's network-status annotation cannot be read.
pub const MALFORMED_NETWORK_STATUS: &str = "MalformedNetworkStatus";
/// Event reason: a pool has entries that cannot be read (left alone).
pub const UNREADABLE_POOL_ENTRIES: &str = "UnreadablePoolEntries";

/// The kinds whose objects can be skipped, for the metric (each has a series from the start).
pub const KINDS: [&str; 4] = [
    "IPPool",
    "OverlappingRangeIPReservation",
    "NetworkAttachmentDefinition",
    "IPFence",
];

/// Most entry problems named in one Event.
const NAMED: usize = 5;

/// One problem on one object.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The object.
    pub reference: ObjectReference,
    /// The Event reason.
    pub reason: &'static str,
    /// The message.
    pub message: String,
}

fn api_version(kind: &str) -> &'static str {
    match kind {
        "NetworkAttachmentDefinition" => "k8s.cni.cncf.io/v1",
        "Pod" => "v1",
        _ => "whereabouts.cni.cncf.io/v1alpha1",
    }
}

/// A reference to the object an Event is about.
pub fn reference(kind: &str, namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some(api_version(kind).into()),
        kind: Some(kind.into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: (!uid.is_empty()).then(|| uid.into()),
        ..Default::default()
    }
}

/// The `pool` label of every per-pool series: `namespace/name`.
pub fn pool_label(namespace: &str, pool: &str) -> String {
    format!("{namespace}/{pool}")
}

/// Every problem the index knows of; pools live in `namespace`.
pub fn problems(st: &Index, namespace: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    for (k, o) in st.invalid().all() {
        out.push(Problem {
            reference: reference(&k.kind, &k.namespace, &k.name, &o.uid),
            reason: INVALID_OBJECT,
            message: format!(
                "skipped by ipreclaim: it does not fit the schema: {}",
                o.error
            ),
        });
    }
    for (key, error) in st.networks().errors() {
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        out.push(Problem {
            reference: reference("NetworkAttachmentDefinition", ns, name, ""),
            reason: INVALID_NETWORK_CONFIG,
            message: format!("config cannot be used, its pools are not matched to it: {error}"),
        });
    }
    for MalformedStatus { podref, uid, error } in st.pods().malformed_status_pods() {
        let pod = PodKey::lenient(&podref);
        out.push(Problem {
            reference: reference("Pod", &pod.namespace, &pod.name, &uid),
            reason: MALFORMED_NETWORK_STATUS,
            message: format!(
                "network-status annotation cannot be read (its allocations are kept): {error}"
            ),
        });
    }
    let mut unrecorded: HashMap<String, Vec<String>> = HashMap::new();
    for UnrecordedMark { pool, key, podref } in st.unrecorded_marks() {
        let record = crate::ipam::fence::fence_object_name(&pool, &key);
        unrecorded.entry(pool).or_default().push(format!(
            "allocation {key} is fenced ({podref}) but has no fence record (IPFence {record}); \
             left alone: remove the entry to release it"
        ));
    }
    for (name, pool) in st.pools().all() {
        let mut notes: Vec<String> = pool.problems.clone();
        notes.extend(unrecorded.remove(name).unwrap_or_default());
        if notes.is_empty() {
            continue;
        }
        let n = notes.len();
        let mut message = format!(
            "{n} allocation problem(s), left alone: {}",
            notes[..n.min(NAMED)].join("; ")
        );
        if n > NAMED {
            message.push_str(&format!("; and {} more", n - NAMED));
        }
        out.push(Problem {
            reference: reference("IPPool", namespace, name, &pool.uid),
            reason: UNREADABLE_POOL_ENTRIES,
            message,
        });
    }
    out
}

/// Reports each problem once.
pub struct ProblemReporter {
    pub(crate) events: Events,
    pub(crate) metrics: ControllerMetrics,
    /// What was reported, by (reason, kind, namespace, name).
    pub(crate) reported: HashMap<(&'static str, String, String, String), String>,
}

impl ProblemReporter {
    /// Sets the invalid-object gauges and, on the leader, logs and publishes what is new.
    pub async fn pass(&mut self, problems: Vec<Problem>, leader: bool) {
        let mut invalid: BTreeMap<String, i64> = KINDS.iter().map(|k| (k.to_string(), 0)).collect();
        for p in problems.iter().filter(|p| p.reason == INVALID_OBJECT) {
            *invalid
                .entry(p.reference.kind.clone().unwrap_or_default())
                .or_default() += 1;
        }
        for (kind, n) in invalid {
            self.metrics
                .invalid_objects
                .get_or_create(&kind.into())
                .set(n);
        }
        if !leader {
            return;
        }
        let mut now = HashMap::with_capacity(problems.len());
        for p in problems {
            let r = &p.reference;
            let key = (
                p.reason,
                r.kind.clone().unwrap_or_default(),
                r.namespace.clone().unwrap_or_default(),
                r.name.clone().unwrap_or_default(),
            );
            if self.reported.get(&key) != Some(&p.message) {
                // A duplicate address has its own log line (`duplicates`), per address.
                if p.reason != IP_ADDRESS_DUPLICATE {
                    tracing::warn!(reason = p.reason, kind = %key.1, namespace = %key.2, name = %key.3, message = %p.message, "bad input");
                }
                self.events
                    .warning(&p.reference, p.reason, &p.message)
                    .await;
            }
            now.insert(key, p.message);
        }
        self.reported = now;
    }
}
