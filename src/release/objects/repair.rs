//! A missing reservation created again for a live entry (see `index::out_of_step`), guarded:
//! the entry is read fresh first (still there, same sandbox and pod), and the create is refused
//! if a reservation of that name was made meanwhile; that one is then compared, never replaced.

use kube::api::{Api, PostParams};

use super::ObjectWriter;
use crate::api::{OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};
use crate::index::MissingReservation;
use crate::release::budget::{Paid, WriteKind};

/// What became of a missing reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repaired {
    /// Created for the entry.
    Created,
    /// `--dry-run`: the entry is still there; nothing written.
    DryRun,
    /// Made meanwhile for the same pod (whereabouts' own create, or another replica's).
    Present,
    /// Made meanwhile for another pod (named): two pods claim the address; left as it is.
    Conflict(String),
    /// The entry is gone or changed since: nothing to repair.
    EntryGone,
}

impl ObjectWriter {
    /// Creates the missing reservation `m` once a fresh read confirms its entry (see the
    /// module). A refused create whose reservation is gone again is an error: tried again.
    pub(crate) async fn repair_reservation(
        &self,
        m: &MissingReservation,
    ) -> Result<Repaired, kube::Error> {
        let pool = self.cx.read_pool(&m.pool).await?;
        let still = pool
            .as_ref()
            .and_then(|p| p.spec.allocations.get(m.entry.key.as_str()))
            .is_some_and(|a| a.id == m.entry.id && a.podref == m.entry.podref);
        if !still {
            return Ok(Repaired::EntryGone);
        }
        if self.cx.dry_run {
            return Ok(Repaired::DryRun);
        }
        let api: Api<OverlappingRangeIPReservation> =
            Api::namespaced(self.cx.client.clone(), &self.cx.namespace);
        let r = OverlappingRangeIPReservation::new(
            &m.name,
            OverlappingRangeIPReservationSpec {
                containerid: Some(m.entry.id.clone()),
                podref: m.entry.podref.clone(),
                ifname: m.entry.ifname.as_deref().map(str::to_owned),
                ipamclaimref: None,
            },
        );
        let params = PostParams::default();
        let metrics = &self.cx.metrics;
        let created = self
            .cx
            .budgets
            .send_counted(WriteKind::Reservation, Paid::No, metrics, "create", || {
                api.create(&params, &r)
            })
            .await;
        match created {
            Ok(_) => {
                metrics.reservations_repaired.inc();
                Ok(Repaired::Created)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(&m.name).await? {
                Some(r) if r.spec.podref == m.entry.podref => Ok(Repaired::Present),
                Some(r) => {
                    metrics.reservation_conflicts.inc();
                    Ok(Repaired::Conflict(r.spec.podref))
                }
                None => Err(kube::Error::Api(s)),
            },
            Err(e) => Err(e),
        }
    }
}
