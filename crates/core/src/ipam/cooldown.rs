//! How a released address is kept out of the pool for a while (`--release-cooldown`), pure.
//!
//! A release under cooldown does not remove the entry: one guarded patch rewrites it so that
//! neither whereabouts nor anything else can match it. Its podref becomes `<podref>:cooldown`
//! (`:` is no pod name: whereabouts reuses an entry by podref and interface, so a pod of the
//! same name must not get it back), and its id becomes [`COOLDOWN_ID_PREFIX`] followed by the
//! end time (the CNI DEL frees an entry by container id and interface; a late DEL of the old
//! sandbox must not end the cooldown). The whole state is in that one entry: it survives
//! restarts and leader changes and needs no object of its own. The leader removes the entry
//! once the end time has passed by its own clock (a clock behind only lengthens it) and, with
//! its own cooldown set, once it has seen the entry cooling that long (`rules::cooldown`: the
//! end is the writer's clock, which may lag).

use std::time::Duration;

use jiff::Timestamp;

/// Appended to a cooling entry's podref.
pub const COOLING_PODREF_SUFFIX: &str = ":cooldown";

/// A cooling entry's id: this, then the end time (RFC 3339, whole seconds, UTC).
pub const COOLDOWN_ID_PREFIX: &str = "ipreclaim-cooldown:";

/// The podref a cooling entry carries.
pub fn cooling_podref(podref: &str) -> String {
    format!("{podref}{COOLING_PODREF_SUFFIX}")
}

/// Whether a stored podref marks a cooling entry.
pub fn is_cooling(podref: &str) -> bool {
    podref.ends_with(COOLING_PODREF_SUFFIX)
}

/// The pod a cooling podref names (`ns/name:cooldown` -> `ns/name`).
pub fn cooled_pod(podref: &str) -> &str {
    podref.strip_suffix(COOLING_PODREF_SUFFIX).unwrap_or(podref)
}

/// When a cooldown of `length` that starts `now` ends: rounded up to the second, so the marker
/// never shortens it.
pub fn cooldown_end(now: Timestamp, length: Duration) -> Timestamp {
    let end = now
        .checked_add(jiff::SignedDuration::try_from(length).unwrap_or(jiff::SignedDuration::MAX))
        .unwrap_or(Timestamp::MAX);
    let secs = end.as_second() + i64::from(end.subsec_nanosecond() > 0);
    Timestamp::from_second(secs).unwrap_or(Timestamp::MAX)
}

/// The id of an entry cooling until `until`.
pub fn cooldown_id(until: Timestamp) -> String {
    let whole = Timestamp::from_second(until.as_second()).unwrap_or(until);
    format!("{COOLDOWN_ID_PREFIX}{whole}")
}

/// A cooling entry whose id does not say when its cooldown ends: kept, and reported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cooling entry's id {id:?} does not carry its end time ({COOLDOWN_ID_PREFIX}<RFC 3339>)")]
pub struct BadCooldown {
    /// The id as stored.
    pub id: String,
}

/// When the cooldown of an entry with id `id` ends.
pub fn cooldown_until(id: &str) -> Result<Timestamp, BadCooldown> {
    id.strip_prefix(COOLDOWN_ID_PREFIX)
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| BadCooldown { id: id.to_owned() })
}

/// Whether a cooldown ending at `until` is over at `now`.
pub fn is_due(until: Timestamp, now: Timestamp) -> bool {
    until <= now
}

/// What is left of a cooldown ending at `until`, at `now` (zero once over).
pub fn remaining(until: Timestamp, now: Timestamp) -> Duration {
    Duration::try_from(until.duration_since(now)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn a_marker_round_trips_and_rounds_the_end_up_to_the_second() {
        let now = t("2026-11-25T10:00:00.250Z");
        let until = cooldown_end(now, Duration::from_secs(30));
        assert_eq!(until, t("2026-11-25T10:00:31Z"));
        let id = cooldown_id(until);
        assert_eq!(id, "ipreclaim-cooldown:2026-11-25T10:00:31Z");
        assert_eq!(cooldown_until(&id), Ok(until));
        // Whole seconds stay as they are.
        let exact = cooldown_end(t("2026-11-25T10:00:00Z"), Duration::from_secs(5));
        assert_eq!(exact, t("2026-11-25T10:00:05Z"));
        // A huge cooldown saturates instead of panicking.
        let _ = cooldown_end(now, Duration::MAX);
    }

    #[test]
    fn a_marker_is_no_container_id_and_no_pod_name() {
        let id = cooldown_id(t("2026-11-25T10:00:31Z"));
        // Container ids are hex: no CNI DEL can match the marker.
        assert!(!id.bytes().all(|b| b.is_ascii_hexdigit()));
        let p = cooling_podref("apps/web-0");
        assert_eq!(p, "apps/web-0:cooldown");
        assert!(is_cooling(&p) && !is_cooling("apps/web-0"));
        assert_eq!(cooled_pod(&p), "apps/web-0");
        assert!(!crate::ipam::naming::is_pod_ref(&p));
    }

    #[test]
    fn a_bad_marker_is_an_error_not_a_time() {
        for id in [
            "",
            "0123abcd",
            "ipreclaim-cooldown:",
            "ipreclaim-cooldown:yesterday",
            "ipreclaim-cooldown:1732528800",
        ] {
            assert_eq!(
                cooldown_until(id),
                Err(BadCooldown { id: id.into() }),
                "{id}"
            );
        }
    }

    #[test]
    fn a_cooldown_is_due_from_its_end_time_on() {
        let until = t("2026-11-25T10:00:31Z");
        assert!(!is_due(until, t("2026-11-25T10:00:30.999Z")));
        assert!(is_due(until, t("2026-11-25T10:00:31Z")));
        assert!(is_due(until, t("2026-11-25T11:00:00Z")));
        assert_eq!(
            remaining(until, t("2026-11-25T10:00:01Z")),
            Duration::from_secs(30)
        );
        assert_eq!(remaining(until, t("2026-11-25T10:01:00Z")), Duration::ZERO);
    }
}
