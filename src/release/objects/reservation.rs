//! Reservation deletes that never take the reservation of a live allocation. whereabouts keeps
//! an existing OverlappingRangeIPReservation that already names the same pod, so a pod
//! recreated under its name that gets its old address back before the delete goes out (write
//! budgets and 429 pauses make that window long) would lose its reservation, and a pool with an
//! overlapping range could hand the address out again. So each delete is checked at the moment
//! it goes out: no pool entry may hold the address for that podref (the writer's ledger: the
//! controller's index; a fresh read of the pool where there is none; for an orphan, whose
//! address is not known, no allocation of the pod and no pod of that name, read fresh), and the
//! delete carries the uid it was chosen with as precondition. whereabouts reads the reservation
//! before it writes the pool entry, so its allocation can still land between the check and the
//! delete: the re-checks after it (`rechecks`) put the reservation back then.

use std::collections::HashMap;
use std::net::IpAddr;

use kube::api::Api;

use super::ObjectWriter;
use super::delete_only_uid;
use crate::api::OverlappingRangeIPReservation;
use crate::release::budget::WriteKind;
use crate::release::ledger::Occupant;
pub use crate::release::types::{Deleted, ReservationDelete};

impl ObjectWriter {
    /// A pool entry of `podref` holding `ip` now: from the ledger, else a fresh read of `pool`.
    async fn holder(&self, d: &ReservationDelete) -> Result<Option<Occupant>, kube::Error> {
        if let Some(uid) = &d.live_pod {
            let kept = self.left_behind_kept(d, uid).await?;
            return Ok(kept.then(|| (String::new(), None)));
        }
        let Some(ip) = d.ip else {
            // An orphan: kept while its pod holds any allocation or lives. The sweep read the
            // pod gone a while ago (the delete may wait for its budget), and our watches may
            // lag: a pod of that name now may hold the address through this very reservation
            // (whereabouts keeps one that names the pod). A pod exists before its allocation,
            // so a fresh read of it now closes that window.
            let exists = self.cx.ledger.pod_known(&d.podref) || self.pod_exists(&d.podref).await?;
            return Ok(exists.then(|| (String::new(), None)));
        };
        if let Some(holder) = self.cx.ledger.holder(&d.podref, ip) {
            return Ok(holder);
        }
        let Some(pool) = &d.pool else {
            return Ok(None);
        };
        // Reads go outside the write budgets (they bound writes; APF bounds both).
        let current = self.cx.read_pool(pool).await?;
        let Some(current) = current else {
            return Ok(None);
        };
        let entries = crate::ipam::pool_allocations(&current.spec)
            .map(|p| p.entries)
            .unwrap_or_default();
        Ok(entries
            .into_iter()
            .find(|e| e.podref == d.podref && e.ip == ip)
            .map(|e| (e.id, e.ifname.as_deref().map(str::to_owned))))
    }

    /// Whether a reservation the sweep found left behind for the live pod `uid` of its name
    /// must stay after all, read fresh right before its delete: the pod (gone, recreated, without
    /// network-status, or listing the address: kept) and the pools of its network whose range
    /// holds the address (any entry of it, whoever's, keeps it; so does one that cannot be
    /// read, and a network with no such pool known).
    async fn left_behind_kept(
        &self,
        d: &ReservationDelete,
        uid: &str,
    ) -> Result<bool, kube::Error> {
        let key = crate::ipam::PodKey::lenient(&d.podref);
        let pods: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(self.cx.client.clone(), &key.namespace);
        let Some(pod) = pods.get_metadata_opt(&key.name).await? else {
            // Gone since: an orphan now, judged as one (with its own grace) by a later sweep.
            return Ok(true);
        };
        if pod.metadata.uid.as_deref() != Some(uid) {
            return Ok(true);
        }
        let status = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::ipam::NETWORK_STATUS_ANNOTATION));
        let Some(Ok(networks)) = status.map(|s| crate::ipam::parse_network_status(s)) else {
            return Ok(true);
        };
        let readings = crate::ipam::naming::reservation_readings(&d.name);
        let lists = |ip: &IpAddr| networks.iter().any(|n| n.ips.contains(ip));
        if readings.iter().any(|(_, ip)| lists(ip)) {
            return Ok(true);
        }
        let own = readings.iter().any(|(_, ip)| {
            self.cx
                .ledger
                .holder(&d.podref, *ip)
                .is_some_and(|h| h.is_some())
        });
        let targets = self.cx.ledger.reservation_pools(&d.name);
        if own || targets.is_empty() {
            return Ok(true);
        }
        let mut read: HashMap<&str, Option<crate::api::IPPool>> = HashMap::new();
        for (pool, ip) in &targets {
            if !read.contains_key(pool.as_str()) {
                read.insert(pool, self.cx.read_pool(pool).await?);
            }
            let held = read[pool.as_str()]
                .as_ref()
                .is_some_and(|p| crate::ipam::holds_address(&p.spec, *ip));
            if held {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Whether a pod of `podref` exists now (read fresh, its metadata only).
    async fn pod_exists(&self, podref: &str) -> Result<bool, kube::Error> {
        let pod = crate::ipam::PodKey::lenient(podref);
        let pods: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(self.cx.client.clone(), &pod.namespace);
        Ok(pods.get_metadata_opt(&pod.name).await?.is_some())
    }

    /// Deletes one reservation unless a live allocation holds its address (see the module).
    pub(crate) async fn delete_reservation(&self, d: ReservationDelete) -> Deleted {
        let api: Api<OverlappingRangeIPReservation> =
            Api::namespaced(self.cx.client.clone(), &self.cx.namespace);
        // Checked once admitted, right before the delete: a delete may wait long for its budget
        // (or a 429 pause), and the check must be as fresh as the delete.
        let result = self
            .cx
            .budgets
            .send(WriteKind::Reservation, || {
                let (api, d) = (api.clone(), d.clone());
                async move {
                    if self.holder(&d).await?.is_some() {
                        return Ok(Deleted::Kept);
                    }
                    // uid as precondition: a reservation replaced since (another pod's) is not
                    // touched; whereabouts never updates one in place.
                    let params = delete_only_uid(d.uid.clone());
                    // The checks took a moment: the gate again, right before the delete.
                    if !self.cx.budgets.open() {
                        return Err(crate::release::budget::not_leader());
                    }
                    self.cx.metrics.write("delete");
                    match api.delete(&d.name, &params).await {
                        Ok(_) => {
                            self.count_swept(&d);
                            Ok(Deleted::Deleted)
                        }
                        // Gone already, or replaced (its uid changed).
                        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                            Ok(Deleted::NotOurs)
                        }
                        Err(e) => Err(e),
                    }
                }
            })
            .await;
        match result {
            Ok(Deleted::Kept) => {
                tracing::info!(reservation = %d.name, podref = %d.podref, "reservation kept: a live allocation of the pod holds its address");
                self.cx.metrics.reservations_kept.inc();
                Deleted::Kept
            }
            Ok(done) => done,
            Err(e) => {
                self.cx.metrics.failed(Deleted::FAILED_LABEL);
                tracing::warn!(reservation = %d.name, error = %e, "could not delete reservation");
                Deleted::Failed
            }
        }
    }

    /// Counts a reservation the sweep deleted (one with no address known: an orphan, or one
    /// left behind for a live pod).
    fn count_swept(&self, d: &ReservationDelete) {
        let why = match (&d.live_pod, d.ip) {
            (Some(_), _) => "left_behind",
            (None, None) => "orphan",
            (None, Some(_)) => return,
        };
        let swept = &self.cx.metrics.reservations_swept;
        swept.get_or_create(&why.to_string().into()).inc();
    }
}
