//! What the writer knows of the allocations it writes, and where it tells what it wrote. The
//! controller hands it its index (`controller::ledger`): checks answer from memory and every
//! write is recorded there at once, before the watches confirm it. The node agent and the
//! manual commands keep no index ([`FreshReads`]): every check reads the API fresh and nothing
//! is recorded. The writer asks only through this trait, so it never reaches into the index.

use std::net::IpAddr;

use crate::api::ObjectId;
use crate::ipam::PoolEntry;
use crate::ipam::fence::FenceRecord;

/// Who holds an address now: a pool entry's sandbox id and interface.
pub type Occupant = (String, Option<String>);

/// One entry write that went through, as the ledger is told of it.
#[derive(Debug, Clone, Copy)]
pub enum Written<'a> {
    /// The entry at `key` of `pool` (sandbox `sandbox`) was fenced with `record`, kept in the
    /// `IPFence` `object`.
    Fenced {
        pool: &'a str,
        key: &'a str,
        sandbox: &'a str,
        record: &'a FenceRecord,
        object: &'a ObjectId,
    },
    /// The entry at `key` of `pool`, held by `podref` with `ip`, was removed.
    Released {
        pool: &'a str,
        key: &'a str,
        podref: &'a str,
        ip: IpAddr,
    },
    /// The entry at `key` of `pool` was rewritten into its cooldown as `cooled`.
    Cooled {
        pool: &'a str,
        key: &'a str,
        cooled: &'a PoolEntry,
    },
    /// The cooling entry at `key` of `pool` (of `podref`, address `ip`) was removed.
    CooldownEnded {
        pool: &'a str,
        key: &'a str,
        podref: &'a str,
        ip: IpAddr,
    },
}

/// The writer's view of the allocations, and its report of what it wrote.
pub trait Ledger: Send + Sync {
    /// The entry of `podref` holding `ip`: `Some(..)` when this ledger knows the pools,
    /// `None` when it does not (the writer then reads the pool fresh).
    fn holder(&self, podref: &str, ip: IpAddr) -> Option<Option<Occupant>>;

    /// Whether `podref` is known to live or to hold any allocation (an orphan reservation of
    /// it is then kept; one not known is read fresh).
    fn pod_known(&self, podref: &str) -> bool;

    /// The (pool, address) pairs a reservation's name can stand for, in the pools known here
    /// (none where no pools are known).
    fn reservation_pools(&self, name: &str) -> Vec<(String, IpAddr)>;

    /// Whether `pool` is known to have an annotations map (a first guess, corrected by a
    /// refused patch's fresh read).
    fn has_annotations(&self, pool: &str) -> bool;

    /// For each allocation (`pool`, `key`, sandbox `id`), whether it may still be there: false
    /// only when it is known gone (a ledger that knows nothing says true). One look for all.
    fn may_hold(&self, allocations: &[(&str, &str, &str)]) -> Vec<bool>;

    /// Records what one batch wrote, in order, all at once; returns for each write the
    /// reservations it left to delete (those of the pod and address it freed).
    fn wrote(&self, writes: &[Written<'_>]) -> Vec<Vec<ObjectId>>;
}

/// No index: every check reads fresh, nothing is recorded (the node agent, the manual
/// commands).
#[derive(Debug, Default, Clone, Copy)]
pub struct FreshReads;

impl Ledger for FreshReads {
    fn holder(&self, _: &str, _: IpAddr) -> Option<Option<Occupant>> {
        None
    }

    fn pod_known(&self, _: &str) -> bool {
        false
    }

    fn reservation_pools(&self, _: &str) -> Vec<(String, IpAddr)> {
        Vec::new()
    }

    fn has_annotations(&self, _: &str) -> bool {
        false
    }

    fn may_hold(&self, allocations: &[(&str, &str, &str)]) -> Vec<bool> {
        vec![true; allocations.len()]
    }

    fn wrote(&self, writes: &[Written<'_>]) -> Vec<Vec<ObjectId>> {
        vec![Vec::new(); writes.len()]
    }
}
