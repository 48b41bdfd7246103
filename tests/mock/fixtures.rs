//! The writer under test, on the mock apiserver, through the crate's public entry points only
//! (`Writer::new`, its builder methods, `spawn`, `WriterHandle`): what the program's own
//! wiring uses, so these tests survive moves inside `release`.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipreclaim::ipam::PoolEntry;
use ipreclaim::release::types::ReservationDelete;
use ipreclaim::release::{
    BudgetConfig, Budgets, EntryWrite, Events, Judged, PodRef, ReleaseRequest, Writer, WriterHandle,
};
use ipreclaim::rules::{Decision, Reason};
use ipreclaim::telemetry::WriteMetrics;
use podlife::clock::RealClock;
use prometheus_client::registry::Registry;

use super::apiserver::{self, Apiserver};

/// The namespace of the pools and reservations.
pub const NS: &str = "kube-system";
/// The pool every test writes.
pub const POOL: &str = "p";

/// A writer without an index (as the node agent and the CLI run it: fresh reads), patches not
/// spaced, budgets that limit nothing, on a new mock apiserver.
pub struct Rig {
    pub writer: WriterHandle,
    pub metrics: WriteMetrics,
    pub apiserver: Apiserver,
}

impl Rig {
    pub fn new() -> Rig {
        let (client, apiserver) = apiserver::pair();
        let metrics = WriteMetrics::new(&mut Registry::default());
        let budgets = Budgets::new(
            BudgetConfig::UNLIMITED,
            RealClock::shared(),
            metrics.clone(),
        );
        let events = Events::new(client.clone(), "mock", budgets.clone(), metrics.clone());
        let writer = Writer::new(client, NS, budgets, events, metrics.clone())
            .patch_interval(Duration::ZERO);
        Rig {
            writer: ipreclaim::release::writer::spawn(Arc::new(writer)),
            metrics,
            apiserver,
        }
    }

    /// `release_failures_total{cause}`.
    pub fn failures(&self, cause: &str) -> u64 {
        self.metrics
            .failures
            .get_or_create(&cause.to_string().into())
            .get()
    }
}

/// The address of entry `key` of [`POOL`] (192.0.2.0/24).
pub fn ip(key: usize) -> IpAddr {
    format!("192.0.2.{key}").parse().expect("an address")
}

/// A release of entry `key` of [`POOL`] (sandbox `sb-K`, pod `ns/pod-K`) whose pod was deleted.
pub fn release(key: usize) -> ReleaseRequest {
    request(
        key,
        &format!("sb-{key}"),
        &format!("ns/pod-{key}"),
        EntryWrite::Remove,
    )
}

/// A request to write entry `key` of [`POOL`], held by sandbox `id` of `podref`, with `write`.
pub fn request(key: usize, id: &str, podref: &str, write: EntryWrite) -> ReleaseRequest {
    ReleaseRequest {
        judged: Judged {
            pool: POOL.into(),
            entry: PoolEntry {
                key: key.to_string().into(),
                offset: key as u128,
                ip: ip(key),
                id: id.into(),
                podref: podref.into(),
                ifname: Some("net1".into()),
            },
            decision: Decision::Release(Reason::PodDeleted),
            network: "ns/net".into(),
            pod: PodRef::from_podref(podref, format!("uid-{key}")),
            node: None,
        },
        reason: Reason::PodDeleted,
        deleted_at: None,
        write,
        cooldown: None,
    }
}

/// The delete of reservation `r-K` of `ns/pod-K`, after entry `key` of [`POOL`] was released.
pub fn reservation(key: usize) -> ReservationDelete {
    ReservationDelete {
        name: format!("r-{key}"),
        uid: format!("uid-r-{key}"),
        podref: format!("ns/pod-{key}"),
        ip: Some(ip(key)),
        pool: Some(POOL.into()),
        live_pod: None,
    }
}
