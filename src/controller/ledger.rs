//! The controller's index as the writer's ledger: checks answer from it, and each batch's
//! writes are recorded in it under one write lock, before the watches confirm them.

use std::net::IpAddr;

use crate::api::ObjectId;
use crate::index::IndexLock;
use crate::release::ledger::{Ledger, Occupant, Written};

impl Ledger for IndexLock {
    fn holder(&self, podref: &str, ip: IpAddr) -> Option<Option<Occupant>> {
        let index = self.read().expect("index lock");
        let holder = index.pools().holder(podref, ip);
        Some(holder.map(|e| (e.id.clone(), e.ifname.as_deref().map(str::to_owned))))
    }

    fn pod_known(&self, podref: &str) -> bool {
        let index = self.read().expect("index lock");
        index.pools().has_allocations(podref) || index.pods().is_live(podref)
    }

    fn reservation_pools(&self, name: &str) -> Vec<(String, IpAddr)> {
        self.read().expect("index lock").reservation_pools(name)
    }

    fn has_annotations(&self, pool: &str) -> bool {
        self.read().expect("index lock").has_annotations(pool)
    }

    fn may_hold(&self, allocations: &[(&str, &str, &str)]) -> Vec<bool> {
        let index = self.read().expect("index lock");
        allocations
            .iter()
            .map(|(pool, key, id)| index.holds(pool, key, id))
            .collect()
    }

    fn wrote(&self, writes: &[Written<'_>]) -> Vec<Vec<ObjectId>> {
        if writes.is_empty() {
            return Vec::new();
        }
        let mut index = self.write().expect("index lock");
        writes
            .iter()
            .map(|w| match *w {
                Written::Fenced {
                    pool,
                    key,
                    sandbox,
                    record,
                    object,
                } => {
                    index.fence_written(pool, key, sandbox, record, object.clone());
                    Vec::new()
                }
                Written::Released {
                    pool,
                    key,
                    podref,
                    ip,
                } => index.released(pool, key, podref, ip),
                Written::Cooled { pool, key, cooled } => {
                    index.cooled(pool, key, cooled.clone());
                    Vec::new()
                }
                Written::CooldownEnded {
                    pool,
                    key,
                    podref,
                    ip,
                } => index.cooldown_ended(pool, key, podref, ip),
            })
            .collect()
    }
}
