//! The node agent's part in fencing: it watches this node's `IPFence` objects (by their node
//! label, in the whereabouts namespace) and writes into their status the evidence
//! [`evidence`](super::evidence) decides. The controller checks it and lifts the fence.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use super::args::NodeAgentArgs;
use super::error::NodeError;
use super::evidence::{Fence, Report, ReportKind};
use crate::api::IPFence;
use crate::api::lenient::Lenient;
use crate::ipam::fence::{NODE_LABEL, node_label_value};
use crate::release::{BudgetConfig, Budgets, WriteKind};
use crate::telemetry::WriteMetrics;
use podlife::clock::SharedClock;

/// This node's fences by object name, as last listed.
pub type Fences = Arc<Mutex<HashMap<String, Fence>>>;

/// The fence `f` as the agent needs it; `None` when it cannot be read (logged).
fn fence_of(f: &Lenient<IPFence>) -> Option<Fence> {
    let fence = match f {
        Lenient::Valid(fence) => fence,
        Lenient::Invalid { metadata, error } => {
            tracing::warn!(fence = ?metadata.name, %error, "IPFence cannot be read; not looked at");
            return None;
        }
    };
    let uid = fence.metadata.uid.clone().unwrap_or_default();
    let status = fence.status.as_ref();
    let ours = |r: Option<&crate::api::SandboxReport>| r.is_some_and(|r| r.fence_uid == uid);
    let reported = ours(status.and_then(|s| s.sandboxes_gone.as_ref()));
    let present_reported = ours(status.and_then(|s| s.sandboxes_present.as_ref()));
    Some(Fence {
        name: fence.name_any(),
        uid,
        node: fence.spec.node.clone(),
        pod_uid: fence.spec.uid.clone(),
        sandbox: fence.spec.sandbox.clone(),
        reported,
        present_reported,
    })
}

/// Watches the fences labelled for `node` in `namespace`, each watch request ended by the
/// apiserver after `timeout` or a little less (and dropped by the watcher if silent 5 s
/// longer: a returning node's fences, written while it was away, must reach the agent before
/// the settle). A re-list replaces the map only once complete.
pub fn watch(
    client: Client,
    namespace: &str,
    node: &str,
    timeout: Duration,
) -> (Fences, tokio::task::JoinHandle<()>) {
    let api = Api::<Lenient<IPFence>>::namespaced(client.clone(), namespace);
    let selector = format!("{NODE_LABEL}={}", node_label_value(node));
    let secs = spread(timeout.as_secs(), rand::random::<f64>());
    let config = watcher::Config::default().labels(&selector).timeout(secs);
    let stream = crate::watch_retry::retrying(client, watcher::watcher(api, config));
    let fences = Fences::default();
    let map = fences.clone();
    let task = tokio::spawn(async move {
        futures::pin_mut!(stream);
        let mut relisted = HashMap::new();
        while let Some(item) = stream.next().await {
            let event = match item {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(error = %e, "IPFence watch error (is the CRD installed, with its status subresource?)");
                    continue;
                }
            };
            let mut map = map.lock().expect("fences lock");
            match event {
                Event::Init => relisted.clear(),
                Event::InitApply(f) => {
                    if let Some(f) = fence_of(&f) {
                        relisted.insert(f.name.clone(), f);
                    }
                }
                Event::InitDone => *map = std::mem::take(&mut relisted),
                Event::Apply(f) => match fence_of(&f) {
                    Some(f) => {
                        map.insert(f.name.clone(), f);
                    }
                    None => {
                        map.remove(&f.meta().name.clone().unwrap_or_default());
                    }
                },
                Event::Delete(f) => {
                    map.remove(&f.meta().name.clone().unwrap_or_default());
                }
            }
        }
    });
    (fences, task)
}

/// A watch timeout of `secs` seconds drawn from its last quarter by `r` in [0, 1): the agents of
/// a zone that came back with the apiserver do not all watch again in the same second, every
/// `secs`, for good.
fn spread(secs: u64, r: f64) -> u32 {
    let low = (secs - secs / 4).max(1);
    let secs = secs.max(low);
    let picked = low + ((secs - low) as f64 * r.clamp(0.0, 1.0)).round() as u64;
    u32::try_from(picked).unwrap_or(u32::MAX)
}

/// Writes reports into fences' status.
pub struct FenceReporter {
    /// The client (the agent's ServiceAccount).
    pub client: Client,
    /// The whereabouts namespace, where the fences are.
    pub namespace: String,
    /// This node.
    pub node: String,
    /// Log what would be written instead.
    pub dry_run: bool,
    /// Its write budgets (a report counts as a reservation-kind write).
    pub budgets: Budgets,
}

/// The fence reports' own budgets, apart from the releases'. A returning node may have had
/// every pod it ran force-deleted and fenced (the kubelet's default is 110 pods), and each
/// "still present" must land before the settle (60 s by default) lifts its fence: the burst
/// covers them all (the releases' 5 a second would take 20 s), the rate bounds what a report
/// refused again and again costs.
pub const REPORT_BUDGETS: BudgetConfig = BudgetConfig {
    pool_qps: 1.0,
    pool_burst: 1,
    reservation_qps: 10.0,
    reservation_burst: 110,
    write_qps: 10.0,
    write_burst: 110,
    max_in_flight: 4,
};

impl FenceReporter {
    /// The writer of this node's fence reports, with its own [`REPORT_BUDGETS`].
    pub fn for_agent(
        client: &Client,
        args: &NodeAgentArgs,
        clock: SharedClock,
        writes: WriteMetrics,
    ) -> Self {
        FenceReporter {
            client: client.clone(),
            namespace: args.whereabouts_namespace.clone(),
            node: args.node_name.clone(),
            dry_run: args.dry_run,
            budgets: Budgets::new(REPORT_BUDGETS, clock, writes),
        }
    }

    /// Writes `r` into its fence's status (the whole status: one report at a time), with the
    /// fence's uid as a precondition (a fence deleted and written again meanwhile is another
    /// object: refused with 422).
    pub async fn report(&self, r: &Report) -> Result<(), NodeError> {
        let observed_at = jiff::Timestamp::now().to_string();
        let field = match r.kind {
            ReportKind::Gone => "sandboxesGone",
            ReportKind::Present => "sandboxesPresent",
        };
        if self.dry_run {
            tracing::info!(fence = %r.name, pod_uid = %r.pod_uid, report = field, "dry-run: would report on the fenced pod's sandboxes");
            return Ok(());
        }
        // A JSON patch's `test` is a real precondition on the status subresource (a uid in a
        // merge patch is not: the status strategy keeps the stored metadata).
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": r.fence_uid},
            {"op": "add", "path": "/status", "value": {field: {
                "node": self.node,
                "podUid": r.pod_uid,
                "fenceUid": r.fence_uid,
                "observedAt": observed_at,
            }}},
        ]);
        let ops: json_patch::Patch =
            serde_json::from_value(ops).map_err(|e| NodeError::ReportPatch(e.to_string()))?;
        let api = Api::<IPFence>::namespaced(self.client.clone(), &self.namespace);
        let (params, patch) = (PatchParams::default(), Patch::<()>::Json(ops));
        self.budgets
            .send(WriteKind::Reservation, || {
                api.patch_status(&r.name, &params, &patch)
            })
            .await
            .map(|_| ())
            .map_err(|e| NodeError::Report(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podlife::clock::FakeClock;

    /// A returning node whose 110 pods (the kubelet's default) were all fenced gets every
    /// report out without waiting for a token: on a clock that never moves, 110 report writes
    /// through the budgets the reporter is built with all go (the releases' 5 a second would
    /// make the last wait 20 s, past the settle).
    #[tokio::test]
    async fn a_full_nodes_fence_reports_wait_for_no_token() {
        let clock = FakeClock::starting_at(std::time::Instant::now());
        let mut registry = prometheus_client::registry::Registry::default();
        let budgets = Budgets::new(REPORT_BUDGETS, clock, WriteMetrics::new(&mut registry));
        let all = async {
            for _ in 0..110 {
                budgets
                    .send(WriteKind::Reservation, || async {
                        Ok::<_, kube::Error>(())
                    })
                    .await
                    .unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(10), all)
            .await
            .expect("a report waited for a token");
    }

    #[test]
    fn a_watch_timeout_is_spread_over_its_last_quarter_and_never_zero() {
        assert_eq!(spread(40, 0.0), 30);
        assert_eq!(spread(40, 0.999), 40);
        assert!((30..=40).contains(&spread(40, 0.5)));
        assert_eq!(spread(1, 0.0), 1);
        assert_eq!(spread(1, 0.99), 1);
        assert_eq!(spread(3600, 0.0), 2700);
    }
}
