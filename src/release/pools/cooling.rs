//! The writer's side of `--release-cooldown`: the entry a cooling write leaves (see
//! `ipam::cooldown`; which writes cool is `types::set_cooldowns`).

use crate::ipam::PoolEntry;
use crate::ipam::cooldown::{cooldown_id, cooling_podref};
use crate::release::types::ReleaseRequest;

/// The entry as a cooling write of `req` leaves it.
pub fn cooled_entry(req: &ReleaseRequest, until: jiff::Timestamp) -> PoolEntry {
    PoolEntry {
        id: cooldown_id(until),
        podref: cooling_podref(req.podref()),
        ..req.judged.entry.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::release::fixtures::{fence_object, record, request};
    use crate::release::types::EntryWrite;
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
