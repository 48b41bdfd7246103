//! How ipreclaim signs its own writes of marked entries (fenced and cooling), pure.
//!
//! A removal leaves no trace in an object's managedFields: the apiserver records which manager
//! set a field, not who removed one, and whereabouts' CNI, its reconciler and ipreclaim all
//! remove entries with JSON patches. So every ipreclaim patch that removes or rewrites a marked
//! entry (a lifted fence, an ended cooldown; by any replica or by the manual commands) also sets
//! the pool annotation [`OWN_WRITE_ANNOTATION`] to a value no other patch has. A watch event in
//! which a marked entry disappears and that annotation changed is ipreclaim's write; one in which
//! it did not change is another writer's (see `index::other_writers`).

/// The pool annotation each ipreclaim write of a marked entry sets to a value of its own.
pub const OWN_WRITE_ANNOTATION: &str = "ipreclaim.io/marked-write";

/// The annotation's value for write number `n` of the writer whose run is `run` (unique per
/// process run), at `now`: never the same for two patches.
pub fn own_write_value(run: &str, n: u64, now: jiff::Timestamp) -> String {
    format!("{}/{run}/{n}", now.as_second())
}

/// A writer run's identity for [`own_write_value`]: the process id and the start time's
/// nanoseconds, so that two replicas (or a replica and a manual command) never collide.
pub fn run_id(pid: u32, started: jiff::Timestamp) -> String {
    format!("{pid:x}-{:x}", started.as_nanosecond().rem_euclid(1 << 48))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_write_of_each_run_signs_differently_and_briefly() {
        let t: jiff::Timestamp = "2026-11-28T17:00:00.123456789Z".parse().unwrap();
        let a = run_id(1, t);
        let b = run_id(
            1,
            t.checked_add(jiff::SignedDuration::from_nanos(1)).unwrap(),
        );
        assert_ne!(a, b, "a restarted process with the same pid");
        assert_ne!(run_id(2, t), a);
        let v = own_write_value(&a, 7, t);
        assert_ne!(v, own_write_value(&a, 8, t));
        assert_ne!(v, own_write_value(&b, 7, t));
        assert!(v.len() < 64, "{v}");
    }
}
