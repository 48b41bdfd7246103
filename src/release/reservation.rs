//! Reservation deletes that never take the reservation of a live allocation. whereabouts keeps
//! an existing OverlappingRangeIPReservation that already names the same pod, so a pod
//! recreated under its name that gets its old address back before the delete goes out (write
//! budgets and 429 pauses make that window long) would lose its reservation, and a pool with an
//! overlapping range could hand the address out again. So each delete is checked at the moment
//! it goes out: no pool entry may hold the address for that podref (the controller's index; a
//! fresh read of the pool where there is no index), and the delete carries the uid it was
//! chosen with as precondition. Two looks after the delete (fresh pool reads) put the
//! reservation back if an entry for the pod and address appeared in between (the allocation
//! raced the check).

use std::time::Duration;

use kube::api::{Api, DeleteParams, PostParams, Preconditions};

use super::budget::WriteKind;
pub use super::types::{Deleted, ReservationDelete};
use super::writer::Writer;
use crate::api::{IPPool, OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};

/// When, after a delete, it is looked at again (each wait after the one before).
pub const SECOND_LOOKS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(4)];

/// Who holds an address now: a pool entry's sandbox id and interface.
type Holder = (String, Option<String>);

impl Writer {
    /// A pool entry of `podref` holding `ip` now: from the index, else a fresh read of `pool`.
    async fn holder(&self, d: &ReservationDelete) -> Result<Option<Holder>, kube::Error> {
        self.holder_from(d, self.index.is_some()).await
    }

    /// The same, from the index when `indexed`, else from a fresh read of the pool.
    async fn holder_from(
        &self,
        d: &ReservationDelete,
        indexed: bool,
    ) -> Result<Option<Holder>, kube::Error> {
        let Some(ip) = d.ip else {
            // An orphan: kept while its pod holds any allocation.
            let any = self
                .index
                .as_ref()
                .is_some_and(|i| i.has_allocations(&d.podref));
            return Ok(any.then(|| (String::new(), None)));
        };
        if let Some(index) = self.index.as_ref().filter(|_| indexed) {
            return Ok(index.holder(&d.podref, ip));
        }
        let Some(pool) = &d.pool else {
            return Ok(None);
        };
        let pools: Api<IPPool> = Api::namespaced(self.client.clone(), &self.namespace);
        // Reads go outside the write budgets (they bound writes; APF bounds both).
        let current = pools.get_opt(pool).await?;
        let Some(current) = current else {
            return Ok(None);
        };
        let entries = crate::ipam::pool_allocations(&current.spec)
            .map(|p| p.entries)
            .unwrap_or_default();
        Ok(entries
            .into_iter()
            .find(|e| e.podref == d.podref && e.ip == ip)
            .map(|e| (e.id, e.ifname)))
    }

    /// Deletes one reservation unless a live allocation holds its address (see the module).
    pub(crate) async fn delete_reservation(&self, d: ReservationDelete) -> Deleted {
        let api: Api<OverlappingRangeIPReservation> =
            Api::namespaced(self.client.clone(), &self.namespace);
        // Checked once admitted, right before the delete: a delete may wait long for its budget
        // (or a 429 pause), and the check must be as fresh as the delete.
        let result = self
            .budgets
            .send(WriteKind::Reservation, || {
                let (api, d) = (api.clone(), d.clone());
                async move {
                    if self.holder(&d).await?.is_some() {
                        return Ok(Deleted::Kept);
                    }
                    // uid as precondition: a reservation replaced since (another pod's) is not
                    // touched; whereabouts never updates one in place.
                    let params = DeleteParams {
                        preconditions: Some(Preconditions {
                            uid: Some(d.uid.clone()),
                            resource_version: None,
                        }),
                        ..DeleteParams::default()
                    };
                    // The checks took a moment: the gate again, right before the delete.
                    if !self.budgets.open() {
                        return Err(super::budget::not_leader());
                    }
                    self.metrics.write("delete");
                    match api.delete(&d.name, &params).await {
                        Ok(_) => Ok(Deleted::Deleted),
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
                self.metrics.reservations_kept.inc();
                Deleted::Kept
            }
            Ok(done) => done,
            Err(e) => {
                self.metrics.failed("reservation");
                tracing::warn!(reservation = %d.name, error = %e, "could not delete reservation");
                Deleted::Failed
            }
        }
    }

    /// The looks a moment after a delete (spawned: they hold no delete slot while they wait):
    /// a fresh read of the pool where it is known (the index may lag the allocation that
    /// raced the delete), twice, a second and five seconds after.
    pub(crate) async fn second_look(&self, d: ReservationDelete) -> Deleted {
        if d.ip.is_none() {
            return Deleted::Deleted;
        }
        let api: Api<OverlappingRangeIPReservation> =
            Api::namespaced(self.client.clone(), &self.namespace);
        for wait in SECOND_LOOKS {
            tokio::time::sleep(wait).await;
            // The pool read when the pool is known, else the index.
            let holder = match self.holder_from(&d, d.pool.is_none()).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(reservation = %d.name, error = %e, "could not look again after deleting a reservation; looking from the index");
                    self.holder_from(&d, true).await.ok().flatten()
                }
            };
            if let Some((id, ifname)) = holder {
                return self.restore(&api, &d, id, ifname).await;
            }
        }
        Deleted::Deleted
    }

    /// Puts a deleted reservation back for the allocation that now holds its address.
    async fn restore(
        &self,
        api: &Api<OverlappingRangeIPReservation>,
        d: &ReservationDelete,
        id: String,
        ifname: Option<String>,
    ) -> Deleted {
        let r = OverlappingRangeIPReservation::new(
            &d.name,
            OverlappingRangeIPReservationSpec {
                containerid: Some(id),
                podref: d.podref.clone(),
                ifname,
                ipamclaimref: None,
            },
        );
        let params = PostParams::default();
        let created = self
            .budgets
            .send(WriteKind::Reservation, || {
                self.metrics.write("create");
                api.create(&params, &r)
            })
            .await;
        match created {
            // Already back (someone put it back first): fine when it names this pod.
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(&d.name).await {
                Ok(Some(r)) if r.spec.podref == d.podref => Deleted::Restored,
                _ => {
                    tracing::error!(reservation = %d.name, podref = %d.podref, "an allocation for the pod and address appeared while its reservation was deleted, and another pod's reservation now holds the address");
                    self.metrics.failed("reservation");
                    Deleted::Failed
                }
            },
            Ok(_) => {
                tracing::warn!(reservation = %d.name, podref = %d.podref, "an allocation for the pod and address appeared while its reservation was deleted; reservation put back");
                self.metrics.reservations_restored.inc();
                Deleted::Restored
            }
            Err(e) => {
                tracing::error!(reservation = %d.name, podref = %d.podref, error = %e, "an allocation for the pod and address appeared while its reservation was deleted, and it could not be put back");
                self.metrics.failed("reservation");
                Deleted::Failed
            }
        }
    }
}
