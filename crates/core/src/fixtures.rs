//! Objects for tests, here and in the programs' tests (the `fixtures` feature).

use k8s_openapi::api::core::v1::NodeCondition;

use crate::api::slim::NodeReadyView;
use crate::api::{IPAllocation, IPPool, IPPoolSpec};
use crate::ipam::fence::FenceRecord;

/// An allocation of sandbox `id` to `podref` on `net1`.
pub fn entry(id: &str, podref: &str) -> IPAllocation {
    IPAllocation {
        id: id.into(),
        podref: podref.into(),
        ifname: Some("net1".into()),
        ipamclaimref: None,
    }
}

/// Pool `name` on 192.0.2.0/24 with entries (key, sandbox, podref).
pub fn pool_named(name: &str, allocations: &[(&str, &str, &str)]) -> IPPool {
    IPPool::new(
        name,
        IPPoolSpec {
            range: "192.0.2.0/24".into(),
            allocations: allocations
                .iter()
                .map(|(k, id, podref)| (k.to_string(), entry(id, podref)))
                .collect(),
        },
    )
}

/// A fence record of `podref` (node `n`, network `ns/net`, set 2026-11-23T10:00:00Z).
pub fn fence_record(podref: &str) -> FenceRecord {
    FenceRecord {
        podref: podref.into(),
        uid: "u".into(),
        node: "n".into(),
        why: "Ready=Unknown".into(),
        network: "ns/net".into(),
        since: "2026-11-23T10:00:00Z".parse().unwrap(),
        grace_seconds: None,
    }
}

/// A Node with its Ready condition (`None`: none yet), reason `KubeletStopped`.
pub fn node(name: &str, ready: Option<&str>) -> NodeReadyView {
    let mut n = NodeReadyView::default();
    n.metadata.name = Some(name.into());
    n.ready = ready.map(|status| NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        reason: Some("KubeletStopped".into()),
        ..Default::default()
    });
    n
}
