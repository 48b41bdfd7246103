//! The writer's side of `--release-cooldown`: which writes cool instead of removing, and the
//! index and metrics after a cooling write or the end of a cooldown (see `ipam::cooldown`).

use super::types::{EntryWrite, ReleaseRequest};
use super::writer::{ObjectDelete, Writer};
use crate::index::Index;
use crate::ipam::PoolEntry;
use crate::ipam::cooldown::{cooldown_id, cooling_podref};
use crate::release::types::ReservationDelete;

/// The entry as a cooling write of `req` leaves it.
pub fn cooled_entry(req: &ReleaseRequest, until: jiff::Timestamp) -> PoolEntry {
    PoolEntry {
        id: cooldown_id(until),
        podref: cooling_podref(req.podref()),
        ..req.judged.entry.clone()
    }
}

impl Writer {
    /// Updates the index and metrics for a release written into its cooldown; returns what to
    /// delete after it: a lifted fence's record, never the reservation (it keeps the address
    /// from overlapping pools until the cooldown ends).
    pub(super) fn record_cooling(
        &self,
        index: Option<&mut Index>,
        req: &ReleaseRequest,
    ) -> Vec<ObjectDelete> {
        let (j, Some(until)) = (&req.judged, req.cooldown) else {
            return Vec::new();
        };
        if let Some(index) = index {
            index.cooled(&j.pool, &j.entry.key, cooled_entry(req, until));
        }
        self.metrics.released(req.reason.as_str());
        if let Some(at) = req.deleted_at {
            self.metrics
                .deletion_to_release_seconds
                .observe(at.elapsed().as_secs_f64());
        }
        tracing::info!(pool = %j.pool, ip = %j.entry.ip, podref = %req.podref(), reason = %req.reason, cooldown_until = %until, "released into cooldown");
        match &req.write {
            EntryWrite::Unfence(_, object) => vec![ObjectDelete::Fence(object.clone())],
            _ => Vec::new(),
        }
    }

    /// Updates the index for a cooling entry removed; returns its pod's reservations of the
    /// address to delete (each still checked against a live allocation).
    pub(super) fn record_cooldown_end(
        &self,
        index: Option<&mut Index>,
        req: &ReleaseRequest,
    ) -> Vec<ObjectDelete> {
        let j = &req.judged;
        let pod = req.podref();
        tracing::info!(pool = %j.pool, ip = %j.entry.ip, podref = %pod, "cooldown ended; the address is back in the pool");
        let Some(index) = index else {
            return Vec::new();
        };
        index
            .cooldown_ended(&j.pool, &j.entry.key, pod, j.entry.ip)
            .into_iter()
            .map(|r| ObjectDelete::Reservation(ReservationDelete::after_release(r, pod, j)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::release::fixtures::{fence_object, record, request};
    use crate::release::types::set_cooldowns;

    #[test]
    fn only_releases_and_lifts_cool_and_only_when_configured() {
        let now: jiff::Timestamp = "2026-11-25T10:00:00.5Z".parse().unwrap();
        let lift = EntryWrite::Unfence(record(), fence_object());
        let writes = [
            EntryWrite::Remove,
            lift,
            EntryWrite::Fence(record()),
            EntryWrite::EndCooldown,
        ];
        let mut reqs: Vec<ReleaseRequest> = writes
            .iter()
            .map(|w| request("5", "ns/web-0", w.clone()))
            .collect();
        set_cooldowns(&mut reqs, Duration::ZERO, now);
        assert!(reqs.iter().all(|r| r.cooldown.is_none()), "off by default");
        set_cooldowns(&mut reqs, Duration::from_secs(30), now);
        let until: jiff::Timestamp = "2026-11-25T10:00:31Z".parse().unwrap();
        let cooled: Vec<_> = reqs.iter().map(|r| r.cooldown).collect();
        assert_eq!(cooled, [Some(until), Some(until), None, None]);
        let e = cooled_entry(&reqs[0], until);
        assert_eq!(e.id, "ipreclaim-cooldown:2026-11-25T10:00:31Z");
        assert_eq!(e.podref, "ns/web-0:cooldown");
        assert_eq!(e.ip, reqs[0].judged.entry.ip);
    }
}
