//! Reading the node agents' sandbox inventories (`ipam::inventory`): where the sandboxes of
//! some pool entries were last listed live, for the controller's sweep and the manual release.

use std::collections::{HashMap, HashSet};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;

use crate::ipam::inventory::{self, INVENTORY_ANNOTATION, INVENTORY_LABEL};
use crate::paged::for_each_listed;
use crate::release::ReleaseRequest;
use crate::rules::Reason;

/// Inventories per page of the list.
const PAGE: u32 = 100;

/// Where a sandbox was last listed live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sighting {
    /// The node whose agent listed it.
    pub node: String,
    /// Its pod's uid.
    pub pod_uid: String,
    /// Its pod's termination grace period, when the runtime told it.
    pub grace_seconds: Option<i64>,
    /// When that agent wrote its inventory (its own clock, as it wrote it).
    pub written: String,
}

/// Where the node agents' inventories list the sandboxes of `wanted` (id prefixes); inventories
/// that cannot be read (bad value, a name not of its holder) are skipped and logged.
/// `namespace`: where they are (`None`: every namespace).
pub async fn sightings(
    client: &kube::Client,
    namespace: Option<&str>,
    wanted: &HashSet<&str>,
) -> Result<HashMap<String, Sighting>, kube::Error> {
    let leases = match namespace {
        Some(ns) => Api::<Lease>::namespaced(client.clone(), ns),
        None => Api::<Lease>::all(client.clone()),
    };
    let selector = format!("{INVENTORY_LABEL}=true");
    let mut out = HashMap::new();
    for_each_listed(
        PAGE,
        |p| {
            let leases = leases.clone();
            let p = p.labels(&selector);
            async move { leases.list(&p).await }
        },
        |lease| add(&mut out, &lease, wanted),
    )
    .await?;
    Ok(out)
}

/// Adds `lease`'s sandboxes of `wanted` to `out`.
fn add(out: &mut HashMap<String, Sighting>, lease: &Lease, wanted: &HashSet<&str>) {
    let name = lease.metadata.name.as_deref().unwrap_or_default();
    let spec = lease.spec.as_ref();
    let node = spec
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default();
    // An agent writes only its own node's (the chart's policy); one that names another node
    // than its name says is nobody's.
    if inventory::lease_name(node).as_deref() != Some(name) {
        tracing::warn!(
            lease = name,
            holder = node,
            "sandbox inventory whose name is not its holder's: skipped"
        );
        return;
    }
    let value = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(INVENTORY_ANNOTATION))
        .map_or("", String::as_str);
    let read = match inventory::decode(value) {
        Ok(read) => read,
        Err(e) => {
            tracing::warn!(lease = name, error = %e, "unreadable sandbox inventory: skipped");
            return;
        }
    };
    if !read.complete {
        tracing::warn!(
            lease = name,
            "sandbox inventory of a node past its cap: sandboxes beyond it are not known"
        );
    }
    let written = spec
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    for (id, listed) in read.sandboxes {
        if !wanted.contains(id.as_str()) {
            continue;
        }
        let sighting = Sighting {
            node: node.to_owned(),
            pod_uid: listed.pod_uid,
            grace_seconds: listed.grace_seconds,
            written: written.clone(),
        };
        out.insert(id, sighting);
    }
}

/// Whether a release for `reason` may concern another pod than the live one of its name (gone:
/// `PodMissing`; replaced: `IPNotOnPod`), whose sandbox an inventory may place.
pub fn placeable(reason: Reason) -> bool {
    matches!(reason, Reason::PodMissing | Reason::IPNotOnPod)
}

/// The id prefixes of the sandboxes of `requests` that an inventory may place.
pub fn wanted(requests: &[ReleaseRequest]) -> HashSet<&str> {
    requests
        .iter()
        .filter(|r| placeable(r.reason))
        .map(|r| inventory::id_prefix(&r.judged.entry.id))
        .filter(|id| !id.is_empty())
        .collect()
}
