//! What the release path's parts share: the allocation judged, the pod to name, the request
//! and what became of it.

use std::net::IpAddr;
use std::time::Instant;

use crate::api::ObjectId;
use crate::ipam::fence::FenceRecord;
use crate::rules::Reason;
pub use crate::rules::{Judged, PodRef};

/// One address to release.
#[derive(Debug, Clone)]
pub struct ReleaseRequest {
    /// The allocation and where to report it.
    pub judged: Judged,
    /// Why.
    pub reason: Reason,
    /// When the pod's deletion was seen (for the latency metric).
    pub deleted_at: Option<Instant>,
    /// What the write does to the entry.
    pub write: EntryWrite,
    /// Set by the writer under `--release-cooldown`: a removal (a release, a lifted fence)
    /// rewrites the entry as cooling until then instead (see `ipam::cooldown`).
    pub cooldown: Option<jiff::Timestamp>,
}

impl ReleaseRequest {
    /// The pod a written release names (a fenced or cooling entry's stored podref is
    /// rewritten): its reservations name it.
    pub fn podref(&self) -> &str {
        match &self.write {
            EntryWrite::Unfence(record, _) => &record.podref,
            EntryWrite::EndCooldown => crate::ipam::cooldown::cooled_pod(&self.judged.entry.podref),
            _ => &self.judged.entry.podref,
        }
    }
}

/// What a write does to a pool entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum EntryWrite {
    /// Removes it: a release.
    #[default]
    Remove,
    /// Keeps it, fenced: the record (an `IPFence` object) first, then its podref rewritten.
    Fence(FenceRecord),
    /// Removes a fenced entry, then its record (the `IPFence` object): the delayed release.
    Unfence(FenceRecord, ObjectId),
    /// Removes a cooling entry (its cooldown is over, or ended by hand), then its pod's
    /// reservation of the address: the address goes back to the pool. Never cooled again.
    EndCooldown,
}

/// A release's outcome, as the writer answers it.
pub type Outcome = Result<ReleaseOutcome, ReleaseError>;
/// Where the writer answers one release.
pub type Reply = tokio::sync::oneshot::Sender<Outcome>;

/// What happened to a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Removed from the pool.
    Released,
    /// The entry was already gone (the CNI's DEL got there first).
    AlreadyGone,
    /// The entry now belongs to another sandbox or pod: not ours to remove.
    Changed,
    /// `--dry-run`: reported, not written.
    DryRun,
    /// Fenced: kept allocated, unusable by a pod of the same name.
    Fenced,
    /// Released into its cooldown: no pod's any more, and unusable until then.
    Cooling(jiff::Timestamp),
}

impl ReleaseOutcome {
    /// Whether the address was freed from its pod (removed, or into its cooldown).
    pub fn freed(&self) -> bool {
        matches!(self, ReleaseOutcome::Released | ReleaseOutcome::Cooling(_))
    }

    /// When the cooldown the release started ends, if it started one.
    pub fn cooling_until(&self) -> Option<jiff::Timestamp> {
        match self {
            ReleaseOutcome::Cooling(until) => Some(*until),
            _ => None,
        }
    }
}

/// Why a release failed (it will be retried, and the sweep still owns the leak).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseError {
    /// The API refused or failed.
    #[error("patching pool {pool}: {message}")]
    Api {
        /// The pool.
        pool: String,
        /// What the API said.
        message: String,
    },
    /// The entry kept changing under us.
    #[error("pool {pool} kept changing while releasing")]
    Conflict {
        /// The pool.
        pool: String,
    },
    /// The apiserver refused this entry's write itself (too large, invalid, forbidden), not
    /// because the entry changed: only the entries concerned fail.
    #[error("pool {pool} refused the write: {message}")]
    Refused {
        /// The pool.
        pool: String,
        /// What the API said.
        message: String,
    },
    /// The writer is shutting down.
    #[error("the pool writer stopped")]
    Stopped,
    /// This replica does not lead (any more): not written, and not retried until it leads.
    #[error("not written: this replica does not lead")]
    NotLeader,
}

impl ReleaseError {
    /// The `cause` label of `release_failures_total` (stable: dashboards and alerts use it).
    pub fn label(&self) -> &'static str {
        match self {
            ReleaseError::Api { .. } => "api",
            ReleaseError::Conflict { .. } => "conflict",
            ReleaseError::Refused { .. } => "refused",
            ReleaseError::Stopped => "stopped",
            ReleaseError::NotLeader => "not_leader",
        }
    }
}

/// A reservation to delete, and what it must not belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationDelete {
    /// Its name.
    pub name: String,
    /// Its uid when it was chosen.
    pub uid: String,
    /// The pod it names.
    pub podref: String,
    /// The address it reserves, when known (not for an orphan: its delete's check reads the
    /// pod; its re-checks read the address back from its name).
    pub ip: Option<IpAddr>,
    /// The pool the address was released from, when known.
    pub pool: Option<String>,
    /// For a reservation left behind for a live pod of its name: that pod's uid. Its delete's
    /// check reads the pod and its network's pools fresh (see `objects::reservation`).
    pub live_pod: Option<String>,
}

impl ReservationDelete {
    /// The delete of `reservation` of `podref` after the entry of `judged` was released: its
    /// address and pool are known.
    pub fn after_release(reservation: ObjectId, podref: &str, judged: &Judged) -> Self {
        let ObjectId { name, uid } = reservation;
        ReservationDelete {
            name,
            uid,
            podref: podref.to_owned(),
            ip: Some(judged.entry.ip),
            pool: Some(judged.pool.clone()),
            live_pod: None,
        }
    }
}

/// What became of one reservation delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// Deleted.
    Deleted,
    /// Kept: a live allocation holds the address for that pod.
    Kept,
    /// Left: gone already, or changed or replaced since it was chosen (not the one meant).
    NotOurs,
    /// Deleted, then put back: an allocation for the pod and address appeared meanwhile.
    Restored,
    /// The apiserver failed.
    Failed,
}

impl Deleted {
    /// The `cause` label of `release_failures_total` a failed reservation (or fence record)
    /// delete counts under.
    pub const FAILED_LABEL: &'static str = "reservation";
}

/// Under a cooldown of `length` (zero: off), each release and fence lift in `reqs` cools until
/// `now + length` instead of removing its entry. Fences and ends of cooldowns never do.
pub fn set_cooldowns(
    reqs: &mut [ReleaseRequest],
    length: std::time::Duration,
    now: jiff::Timestamp,
) {
    if length.is_zero() {
        return;
    }
    let until = crate::ipam::cooldown::cooldown_end(now, length);
    for r in reqs {
        if matches!(r.write, EntryWrite::Remove | EntryWrite::Unfence(..)) {
            r.cooldown = Some(until);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::FAILURE_CAUSES;

    #[test]
    fn failure_labels_are_the_causes_the_metric_starts_with() {
        let pool = || "p".to_string();
        let errors = [
            ReleaseError::Api {
                pool: pool(),
                message: "m".into(),
            },
            ReleaseError::Conflict { pool: pool() },
            ReleaseError::Refused {
                pool: pool(),
                message: "m".into(),
            },
            ReleaseError::Stopped,
            ReleaseError::NotLeader,
        ];
        let mut labels: Vec<&str> = errors.iter().map(ReleaseError::label).collect();
        labels.push(Deleted::FAILED_LABEL);
        assert_eq!(
            labels,
            [
                "api",
                "conflict",
                "refused",
                "stopped",
                "not_leader",
                "reservation"
            ]
        );
        let mut causes = FAILURE_CAUSES.to_vec();
        causes.sort();
        labels.sort();
        assert_eq!(labels, causes);
    }
}
