//! The custom resources ipreclaim reads and writes, wire-compatible with whereabouts v0.9
//! (`whereabouts.cni.cncf.io/v1alpha1`) and Multus (`k8s.cni.cncf.io/v1`).
//!
//! The ground floor: imports no other module of the crate; everything may import it
//! (`tests/layers.rs` holds the layering).

pub mod lenient;
pub mod protobuf;
pub mod slim;

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube_core::CustomResourceExt;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// An object (of a kind and namespace the context gives) by name, with the uid it had when
/// read: what a delete pins as its precondition.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
}

/// IPPoolSpec defines the desired state of IPPool.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "whereabouts.cni.cncf.io",
    version = "v1alpha1",
    kind = "IPPool",
    plural = "ippools",
    singular = "ippool",
    namespaced,
    doc = "IPPool is the Schema for the ippools API"
)]
pub struct IPPoolSpec {
    /// Range is a RFC 4632/4291-style string that represents an IP address and prefix length in CIDR notation
    pub range: String,
    /// Allocations is the set of allocated IPs for the given range. Its indices are a direct mapping to the
    /// IP with the same index/offset for the pool's range.
    pub allocations: BTreeMap<String, IPAllocation>,
}

/// IPAllocation represents metadata about the pod/container owner of a specific IP
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct IPAllocation {
    /// The sandbox (container) ID that holds the address.
    #[serde(default)]
    pub id: String,
    /// The owning pod as "namespace/name".
    #[serde(default)]
    pub podref: String,
    /// The interface inside the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ifname: Option<String>,
    /// IPAMClaimRef is "namespace/name" of the IPAMClaim that owns this
    /// allocation. Empty for legacy pod-scoped allocations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipamclaimref: Option<String>,
}

/// OverlappingRangeIPReservationSpec defines the desired state of OverlappingRangeIPReservation
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "whereabouts.cni.cncf.io",
    version = "v1alpha1",
    kind = "OverlappingRangeIPReservation",
    plural = "overlappingrangeipreservations",
    singular = "overlappingrangeipreservation",
    namespaced,
    doc = "OverlappingRangeIPReservation is the Schema for the OverlappingRangeIPReservations API"
)]
pub struct OverlappingRangeIPReservationSpec {
    /// The sandbox (container) ID that holds the address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containerid: Option<String>,
    /// The owning pod as "namespace/name".
    pub podref: String,
    /// The interface inside the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ifname: Option<String>,
    /// IPAMClaimRef is "namespace/name" of the IPAMClaim that owns this
    /// reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipamclaimref: Option<String>,
}

/// NodeSlicePoolSpec defines the desired state of NodeSlicePool
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "whereabouts.cni.cncf.io",
    version = "v1alpha1",
    kind = "NodeSlicePool",
    plural = "nodeslicepools",
    singular = "nodeslicepool",
    namespaced,
    status = "NodeSlicePoolStatus",
    doc = "NodeSlicePool is the Schema for the nodesliceippools API"
)]
pub struct NodeSlicePoolSpec {
    /// Range is a RFC 4632/4291-style string that represents an IP address and prefix length in CIDR notation
    /// this refers to the entire range where the node is allocated a subset
    pub range: String,
    /// The size of each node's slice, as a prefix length such as "/28".
    #[serde(rename = "sliceSize")]
    pub slice_size: String,
}

/// NodeSlicePoolStatus defines the desired state of NodeSlicePool
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct NodeSlicePoolStatus {
    /// Which node holds which slice.
    pub allocations: Vec<NodeSliceAllocation>,
}

/// One node's slice of a NodeSlicePool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct NodeSliceAllocation {
    /// The node.
    #[serde(rename = "nodeName")]
    pub node_name: String,
    /// Its slice, as a CIDR.
    #[serde(rename = "sliceRange")]
    pub slice_range: String,
}

/// NetworkAttachmentDefinitionSpec: the CNI configuration of a secondary network.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "k8s.cni.cncf.io",
    version = "v1",
    kind = "NetworkAttachmentDefinition",
    plural = "network-attachment-definitions",
    singular = "network-attachment-definition",
    shortname = "net-attach-def",
    namespaced,
    doc = "NetworkAttachmentDefinition is a CRD schema specified by the Network Plumbing Working Group to express the intent for attaching pods to one or more logical or physical networks."
)]
pub struct NetworkAttachmentDefinitionSpec {
    /// The CNI configuration (a single config or a conflist) as a JSON string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
}

/// IPFenceSpec: an address ipreclaim keeps allocated because the pod that held it was deleted
/// while its node was not Ready (the sandbox may still run there). One object per fenced
/// address, in the pools' namespace; the pool entry's podref carries `:fenced` meanwhile.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    crates(kube_core = "::kube_core"),
    group = "ipreclaim.io",
    version = "v1alpha1",
    kind = "IPFence",
    plural = "ipfences",
    singular = "ipfence",
    shortname = "ipf",
    namespaced,
    status = "IPFenceStatus",
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".spec.address"}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.podref"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.node"}"#,
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".spec.pool"}"#,
    printcolumn = r#"{"name":"Since","type":"date","jsonPath":".spec.since"}"#,
    doc = "IPFence records an address ipreclaim keeps allocated: its pod was deleted while its node was not Ready. Delete the pool entry to release it by hand; the fence record then goes by itself."
)]
pub struct IPFenceSpec {
    /// The IPPool (in this namespace) that holds the address.
    pub pool: String,
    /// The entry's key in the pool (the address's offset in its range).
    pub key: String,
    /// The address.
    pub address: String,
    /// The entry's sandbox (container) id when it was fenced.
    pub sandbox: String,
    /// The deleted pod, as "namespace/name" (the entry's podref before the fence).
    pub podref: String,
    /// The deleted pod's uid.
    #[serde(default)]
    pub uid: String,
    /// The node the pod ran on.
    pub node: String,
    /// Why the node was not trusted (its Ready condition then).
    #[serde(default)]
    pub why: String,
    /// The network to name in Events ("namespace/nad").
    #[serde(default)]
    pub network: String,
    /// When the fence was set (RFC 3339, the controller's clock).
    pub since: String,
    /// The deleted pod's `spec.terminationGracePeriodSeconds`: a returning kubelet may take
    /// that long to stop it, so the fence does not lift on the settle before it has passed.
    #[serde(
        default,
        rename = "gracePeriodSeconds",
        skip_serializing_if = "Option::is_none"
    )]
    pub grace_period_seconds: Option<i64>,
}

/// IPFenceStatus: what the node agent on the fence's node reports (a status subresource, so
/// the agent's RBAC is `patch` on `ipfences/status` and it can never change the spec).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct IPFenceStatus {
    /// The node agent saw none of the pod's sandboxes in its container runtime.
    #[serde(
        default,
        rename = "sandboxesGone",
        skip_serializing_if = "Option::is_none"
    )]
    pub sandboxes_gone: Option<SandboxReport>,
    /// The node agent still sees a sandbox of the pod (its kubelet is still stopping it): the
    /// fence does not lift on the settle while this is the agent's word.
    #[serde(
        default,
        rename = "sandboxesPresent",
        skip_serializing_if = "Option::is_none"
    )]
    pub sandboxes_present: Option<SandboxReport>,
}

/// A node agent's report on a fenced pod's sandboxes. The controller trusts it only when
/// `node`, `podUid` and `fenceUid` are this fence's own. Its fields are bounded in the schema:
/// an agent writes the status of every fence of its node, and the controller lists them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct SandboxReport {
    /// The node whose agent looked.
    #[serde(default)]
    #[schemars(length(max = 253))]
    pub node: String,
    /// The pod whose sandboxes were looked for.
    #[serde(default, rename = "podUid")]
    #[schemars(length(max = 128))]
    pub pod_uid: String,
    /// The uid of the IPFence the agent saw before the listing (binds the evidence to this
    /// fence: a later fence of the same address is another object).
    #[serde(default, rename = "fenceUid")]
    #[schemars(length(max = 128))]
    pub fence_uid: String,
    /// When the listing it reports completed (RFC 3339, the node's clock; for people, not
    /// trusted).
    #[serde(default, rename = "observedAt")]
    #[schemars(length(max = 64))]
    pub observed_at: String,
}

/// An entry without `id` or `podref` (older whereabouts releases did not require them) is
/// read with them empty and reported as a problem of its pool.
impl lenient::Defaults for IPPool {}

impl lenient::Defaults for OverlappingRangeIPReservation {}

impl lenient::Defaults for NodeSlicePool {}

impl lenient::Defaults for IPFence {
    /// A status that does not fit (an older or foreign writer) is dropped, so the fence itself
    /// stays readable and held; it never counts as evidence.
    fn fill_defaults(object: &mut serde_json::Value) {
        let Some(o) = object.as_object_mut() else {
            return;
        };
        if let Some(status) = o.get("status")
            && let Err(e) = IPFenceStatus::deserialize(status)
        {
            tracing::warn!(error = %e, "IPFence status does not fit; ignored");
            o.remove("status");
        }
    }
}

impl lenient::Defaults for NetworkAttachmentDefinition {
    /// Upstream's schema does not require `spec`: without it (the config is a file on the
    /// node) the NAD has no config here.
    fn fill_defaults(object: &mut serde_json::Value) {
        if let Some(o) = object.as_object_mut() {
            o.entry("spec").or_insert_with(|| serde_json::json!({}));
        }
    }
}

/// Drops `spec` from a CRD's required top-level fields (upstream's schema does not require it).
fn spec_optional(crd: &mut CustomResourceDefinition) {
    for v in &mut crd.spec.versions {
        let required = v
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|s| s.required.as_mut());
        if let Some(required) = required {
            required.retain(|r| r != "spec");
        }
    }
}

/// The CRDs ipreclaim works with, as the apiserver should hold them.
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut node_slice = NodeSlicePool::crd();
    // Upstream declares no status subresource: whereabouts writes status with a plain update,
    // which a status subresource would silently ignore.
    for v in &mut node_slice.spec.versions {
        v.subresources = None;
    }
    let (mut pool, mut nad) = (IPPool::crd(), NetworkAttachmentDefinition::crd());
    spec_optional(&mut pool);
    spec_optional(&mut nad);
    vec![
        pool,
        OverlappingRangeIPReservation::crd(),
        node_slice,
        nad,
        IPFence::crd(),
    ]
}

/// Every CRD as one multi-document YAML stream (what `ipreclaim crds` prints and `crds/` holds).
pub fn crds_yaml() -> Result<String, serde_norway::Error> {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_norway::to_string(&crd)?);
    }
    Ok(out)
}

/// File name under `crds/` for each CRD, with its YAML.
pub fn crd_files() -> Result<Vec<(String, String)>, serde_norway::Error> {
    crds()
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            Ok((format!("{name}.yaml"), serde_norway::to_string(&crd)?))
        })
        .collect()
}
