//! The sweep's part for reservations (the leader's, once per sweep), each case seen for its
//! whole grace within one term of leadership before anything is written:
//! - orphans (no pod of that name, no allocation left): deleted after `--leak-grace` and a GET
//!   confirming the pod is gone (the delete reads it again right before it goes);
//! - left behind for a live pod of that name (see `index::out_of_step`): deleted after
//!   `--leak-grace`, the delete's check reading the pod and its network's pools fresh, with the
//!   reservation's uid as precondition and the looks after it. A delete that failed is found
//!   again by the next sweep (the reservation is still in the index): nothing gives up on it;
//! - missing for a live entry: reported (gauge, Warning Event on the pool) and created again
//!   after `--reservation-repair-grace` (whereabouts writes the entry before it creates the
//!   reservation; a create of ours in between would fail its ADD), guarded (see
//!   `release::objects::repair`); after a few seconds where its pod lists the address, read fresh (its
//!   ADD has returned: whereabouts will not create it any more).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

use crate::api::ObjectId;
use crate::index::{LeftBehind, MissingReservation, NamedReservation};
use crate::ipam::PodKey;
use crate::release::objects::rechecks::{RECHECKS, RESTORE_CONFIRM};
use crate::release::objects::repair::Repaired;
use crate::release::objects::reservation::ReservationDelete;
use crate::seen::Seen;

/// The graces of the reservation sweep.
#[derive(Debug, Clone, Copy)]
pub struct ReservationGraces {
    /// For orphans and reservations left behind (`--leak-grace`).
    pub leak: Duration,
    /// For a live entry without its reservation (`--reservation-repair-grace`).
    pub repair: Duration,
}

/// When each case was first seen (in this term of leadership).
#[derive(Debug, Default)]
pub struct ReservationSightings {
    orphans: Seen<ObjectId>,
    /// Keyed with the live pod's uid: a pod recreated under the name is judged anew.
    left_behind: Seen<(ObjectId, String)>,
    /// Keyed by pool, key, sandbox and reservation name: another allocation is another case.
    missing: Seen<MissingKey>,
    /// Missing reservations a dry run reported (each once, while it stays missing).
    dry_run_reported: HashSet<MissingKey>,
}

/// A missing reservation across sweeps: pool, key, sandbox and reservation name.
type MissingKey = (String, String, String, String);

/// The repairs of one sweep (each a fresh read and a create) take at most this long together;
/// one cut off, and the rest, are left for the next sweep: the sweep waits for them, and a
/// held write must not stall the leak sweep.
const REPAIRS_TIME: Duration = Duration::from_secs(10);
/// How long an entry its pod lists must be seen without its reservation before it is created
/// (instead of `--reservation-repair-grace`): just past the last re-check after a delete of
/// ours and its confirmation, which puts back one our own delete took as an allocation raced
/// it (and counts it so).
const LISTED_REPAIR_GRACE: Duration = RECHECKS[RECHECKS.len() - 1]
    .saturating_add(RESTORE_CONFIRM)
    .saturating_add(Duration::from_secs(1));
/// Repairs one sweep makes at most (the rest wait for the next).
const REPAIRS_PER_SWEEP: usize = 100;

/// What the reservation sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReservationReport {
    /// Deletes queued (orphans and left behind).
    pub deletes: usize,
    /// Missing reservations reported (created, found another pod's, or a dry run's).
    pub reported: usize,
}

impl ReservationSightings {
    /// One pass (see the module).
    pub async fn sweep(
        &mut self,
        ctx: &super::ctx::Ctx,
        graces: ReservationGraces,
        namespace: &str,
        now: Instant,
    ) -> ReservationReport {
        let (orphans, left_behind, missing) = {
            let st = ctx.index.read().expect("index lock");
            (
                st.orphan_reservations(),
                st.left_behind_reservations(),
                st.missing_reservations(),
            )
        };
        ctx.metrics.reservations_missing.set(missing.len() as i64);
        let mut due = self.due_orphans(ctx, orphans, now, graces.leak).await;
        let left: Vec<_> = left_behind
            .into_iter()
            .map(|l| ((l.reservation.id(), l.pod_uid.clone()), l))
            .collect();
        for LeftBehind {
            reservation,
            pod_uid,
        } in self.left_behind.due(left, now, |_| graces.leak)
        {
            tracing::info!(reservation = %reservation.name, podref = %reservation.podref, "reservation left behind: its pod lives on and neither holds nor lists its address");
            let NamedReservation { name, uid, podref } = reservation;
            due.push(ReservationDelete {
                name,
                uid,
                podref,
                ip: None,
                pool: None,
                live_pod: Some(pod_uid),
            });
        }
        let deletes = due.len();
        if deletes > 0 {
            ctx.writer.delete_reservations(due);
        }
        let missing: Vec<_> = missing
            .into_iter()
            .map(|m| {
                let e = &m.entry;
                let key = (
                    m.pool.clone(),
                    e.key.to_string(),
                    e.id.clone(),
                    m.name.clone(),
                );
                (key.clone(), (key, m))
            })
            .collect();
        let current: HashSet<&MissingKey> = missing.iter().map(|(k, _)| k).collect();
        self.dry_run_reported.retain(|k| current.contains(k));
        let mut reported = 0;
        // An entry its pod lists is repaired soon: the ADD that wrote it has returned, so
        // whereabouts will not create the reservation any more (see `MissingReservation`), and
        // an overlapping range of its network could hand the address out meanwhile.
        let grace = |(_, m): &(MissingKey, MissingReservation)| match m.listed_by {
            Some(_) => LISTED_REPAIR_GRACE.min(graces.repair),
            None => graces.repair,
        };
        let due = self.missing.due(missing, now, grace).into_iter();
        let due = due.filter(|(k, _)| !self.dry_run_reported.contains(k));
        let deadline = tokio::time::Instant::now() + REPAIRS_TIME;
        for (key, m) in due.collect::<Vec<_>>().into_iter().take(REPAIRS_PER_SWEEP) {
            let waited = self
                .missing
                .since(&key)
                .is_some_and(|first| now.saturating_duration_since(first) >= graces.repair);
            let repair = async {
                // Before the grace, only on the pod's own word read fresh (the index may lag
                // a pod recreated under the name, its ADD still in flight).
                if !waited && !still_listed(ctx, &m).await? {
                    return Ok(Repaired::EntryGone);
                }
                ctx.writer.repair_reservation(&m).await
            };
            let Ok(outcome) = tokio::time::timeout_at(deadline, repair).await else {
                tracing::warn!(pool = %m.pool, reservation = %m.name, "repairs of missing reservations took too long this sweep; the rest wait for the next");
                break;
            };
            if matches!(outcome, Ok(Repaired::DryRun)) {
                self.dry_run_reported.insert(key);
            }
            reported += usize::from(report(ctx, &m, outcome, namespace).await);
        }
        ReservationReport { deletes, reported }
    }

    /// Orphans seen for `grace` whose pod a GET confirms gone.
    async fn due_orphans(
        &mut self,
        ctx: &super::ctx::Ctx,
        orphans: Vec<NamedReservation>,
        now: Instant,
        grace: Duration,
    ) -> Vec<ReservationDelete> {
        let seen = orphans.into_iter().map(|r| (r.id(), r)).collect();
        let mut due = Vec::new();
        for r in self.orphans.due(seen, now, |_| grace) {
            let NamedReservation { name, uid, podref } = r;
            let pod = PodKey::lenient(&podref);
            match Api::<Pod>::namespaced(ctx.client.clone(), &pod.namespace)
                .get_metadata_opt(&pod.name)
                .await
            {
                Ok(None) => due.push(ReservationDelete {
                    name,
                    uid,
                    podref,
                    ip: None,
                    pool: None,
                    live_pod: None,
                }),
                Ok(Some(_)) => {}
                Err(e) => {
                    tracing::warn!(reservation = %name, error = %e, "could not confirm the pod is gone")
                }
            }
        }
        due
    }
}

/// Whether the pod `m` was listed by (same uid) still lists the entry's address, read fresh.
async fn still_listed(ctx: &super::ctx::Ctx, m: &MissingReservation) -> Result<bool, kube::Error> {
    let Some(uid) = &m.listed_by else {
        return Ok(false);
    };
    let key = PodKey::lenient(&m.entry.podref);
    let pod = Api::<Pod>::namespaced(ctx.client.clone(), &key.namespace)
        .get_metadata_opt(&key.name)
        .await?;
    let Some(pod) = pod.filter(|p| p.metadata.uid.as_ref() == Some(uid)) else {
        return Ok(false);
    };
    let status = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(crate::ipam::NETWORK_STATUS_ANNOTATION));
    Ok(match status.map(|s| crate::ipam::parse_network_status(s)) {
        Some(Ok(networks)) => networks.iter().any(|n| n.ips.contains(&m.entry.ip)),
        _ => false,
    })
}

/// Reports what became of one missing reservation: log line, Warning Event on the pool.
/// Whether it was reported (created, another pod's, or a dry run's).
async fn report(
    ctx: &super::ctx::Ctx,
    m: &MissingReservation,
    outcome: Result<Repaired, kube::Error>,
    namespace: &str,
) -> bool {
    let e = &m.entry;
    let (ip, podref, pool, name) = (e.ip, &e.podref, &m.pool, &m.name);
    let lacked = format!(
        "entry {} ({ip}) of pod {podref} had no reservation {name}, so an overlapping range of its network could hand {ip} out again",
        e.key
    );
    let note = match outcome {
        Ok(Repaired::Created) => {
            tracing::warn!(%pool, %ip, %podref, reservation = %name, "a live entry had no reservation: created it");
            format!("{lacked}: created it")
        }
        Ok(Repaired::DryRun) => format!("{lacked}: would create it (dry run)"),
        Ok(Repaired::Present) => return false,
        Ok(Repaired::Conflict(other)) => {
            tracing::error!(%pool, %ip, %podref, reservation = %name, other = %other, "a live entry had no reservation, and one was made meanwhile for another pod: two pods claim the address");
            format!(
                "{lacked}; one was made meanwhile for pod {other}: left as it is (two pods claim {ip})"
            )
        }
        Ok(Repaired::EntryGone) => return false,
        Err(e) => {
            tracing::warn!(%pool, %ip, %podref, reservation = %name, error = %e, "could not create a missing reservation; next sweep");
            return false;
        }
    };
    let uid = {
        let st = ctx.index.read().expect("index lock");
        st.pools()
            .get(pool)
            .map(|p| p.uid.clone())
            .unwrap_or_default()
    };
    ctx.events
        .reservation_missing(namespace, pool, &uid, ip, note)
        .await;
    true
}
