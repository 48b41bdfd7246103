//! Objects for tests, here and in the programs' tests (the `fixtures` feature).

use crate::api::{IPAllocation, IPPool, IPPoolSpec};

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
