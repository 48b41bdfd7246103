//! This node's sandbox inventory (`ipam::inventory`): the sandboxes that may still hold their
//! network, written as a Lease whenever they change, at most once per [`INVENTORY_EVERY`]. A
//! controller that never saw a pod's deletion learns from it which node may still run the pod,
//! and fences the address there instead of releasing it, also when this node is cut off.
//!
//! The Lease is owned by the Node, so the garbage collector removes it with the Node.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use podlife::clock::SharedClock;
use tokio::sync::watch;

use crate::ipam::inventory::{self, INVENTORY_ANNOTATION, INVENTORY_LABEL, Listed};

/// The least time between two writes of the inventory: a sandbox started less than this (plus
/// a relist) before its node was cut off may be missing from it.
pub const INVENTORY_EVERY: Duration = Duration::from_secs(3);
/// How often the inventory is written even when nothing changed.
const REWRITE_EVERY: Duration = Duration::from_secs(300);
/// The longest wait before a failed write is tried again.
const RETRY_MAX: Duration = Duration::from_secs(60);
/// The field manager of the agent's server-side apply.
const FIELD_MANAGER: &str = "ipreclaim-node-agent";

/// Live sandboxes: full id -> what the inventory lists of it.
pub type Live = BTreeMap<String, Listed>;

/// Writes this node's inventory.
pub struct InventoryWriter {
    /// The agent's client.
    pub client: Client,
    /// Where the inventory Lease goes (`--inventory-namespace`).
    pub namespace: String,
    /// This node.
    pub node: String,
    /// Log instead of writing.
    pub dry_run: bool,
    /// The agent's write budgets.
    pub budgets: crate::release::Budgets,
    /// Paces the writes.
    pub clock: SharedClock,
}

impl InventoryWriter {
    /// Starts the writer: it writes each newest inventory sent (`None`: nothing known yet),
    /// until the sender is dropped.
    pub fn spawn(self) -> (watch::Sender<Option<Live>>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = watch::channel(None);
        (tx, tokio::spawn(self.run(rx)))
    }

    async fn run(self, mut rx: watch::Receiver<Option<Live>>) {
        let Some(name) = inventory::lease_name(&self.node) else {
            tracing::warn!(node = %self.node, "node name too long for an inventory Lease: none written (a controller that never saw a deletion of this node's pods cannot tell they ran here)");
            return;
        };
        let mut written: Option<(Live, Instant)> = None;
        let mut owner: Option<OwnerReference> = None;
        let mut retry = INVENTORY_EVERY;
        // Spread over the nodes, so that agents retrying after an outage do not write at once.
        let spread = Duration::from_millis(node_hash(&self.node) % 1000);
        loop {
            let clock = self.clock.clone();
            let rewrite_at = written.as_ref().map(|(_, at)| *at + REWRITE_EVERY);
            let rewrite = async move {
                match rewrite_at {
                    Some(at) => clock.sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                // Written again now and then: one deleted meanwhile (by hand, or with a Node
                // recreated under its name) comes back, and its owner is asked for again.
                _ = rewrite => {
                    written = None;
                    owner = None;
                }
            }
            loop {
                let Some(live) = rx.borrow_and_update().clone() else {
                    break;
                };
                if written.as_ref().is_some_and(|(w, _)| *w == live) {
                    break;
                }
                if owner.is_none() {
                    owner = self.owner().await;
                }
                let wait = match self.write(&name, &live, owner.as_ref()).await {
                    Ok(()) => {
                        written = Some((live, self.clock.now()));
                        retry = INVENTORY_EVERY;
                        INVENTORY_EVERY
                    }
                    Err(e) => {
                        tracing::warn!(lease = %name, error = %e, retry_in = ?retry, "writing this node's sandbox inventory failed (a controller that never saw a deletion of this node's pods finds them in its last one)");
                        let wait = retry + spread;
                        retry = (retry * 2).min(RETRY_MAX);
                        wait
                    }
                };
                let until = self.clock.now() + wait;
                self.clock.sleep_until(until).await;
            }
        }
    }

    /// The Node as the inventory's owner; `None` when it cannot be read (written without one,
    /// and asked again at the next write).
    async fn owner(&self) -> Option<OwnerReference> {
        let nodes = Api::<Node>::all(self.client.clone());
        match nodes.get_metadata(&self.node).await {
            Ok(node) => Some(OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: self.node.clone(),
                uid: node.metadata.uid.unwrap_or_default(),
                ..Default::default()
            })
            .filter(|o| !o.uid.is_empty()),
            Err(e) => {
                tracing::warn!(node = %self.node, error = %e, "could not read this node to own its sandbox inventory; written without an owner");
                None
            }
        }
    }

    async fn write(
        &self,
        name: &str,
        live: &Live,
        owner: Option<&OwnerReference>,
    ) -> Result<(), kube::Error> {
        let value = inventory::encode(live.iter().map(|(id, l)| (id.as_str(), l)));
        if self.dry_run {
            tracing::info!(lease = %name, sandboxes = live.len(), "dry-run: would write this node's sandbox inventory");
            return Ok(());
        }
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(self.namespace.clone()),
                labels: Some([(INVENTORY_LABEL.to_owned(), "true".to_owned())].into()),
                annotations: Some([(INVENTORY_ANNOTATION.to_owned(), value)].into()),
                owner_references: owner.map(|o| vec![o.clone()]),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                renew_time: Some(MicroTime(jiff::Timestamp::now())),
                ..Default::default()
            }),
        };
        let api = Api::<Lease>::namespaced(self.client.clone(), &self.namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let patch = Patch::Apply(&lease);
        self.budgets
            .send(crate::release::WriteKind::Reservation, || {
                api.patch(name, &params, &patch)
            })
            .await
            .map(|_| ())
    }
}

/// A stable number for `node`, to spread the agents' retries.
fn node_hash(node: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.hash(&mut h);
    h.finish()
}
