//! Which dead sandboxes are due for a look. Pure: time comes in as arguments.
//!
//! A sandbox seen dead is held for a grace period first: the CNI DEL may still be on its way,
//! and a release is only worth a few API calls once it is clear nobody else will do it.
//! A failed attempt comes back later with a doubled delay. A sandbox taken for its look is
//! remembered as handled, so its later removal (a second report) does not bring it back.
//!
//! One listing is no proof of a death (a runtime recovering may list a sandbox late, or
//! without its metadata): a sandbox listed running again is forgotten, and right before a
//! release the runtime is asked again ([`SandboxNow`]).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// A sandbox the PLEG reported dead, waiting for its turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadSandbox {
    /// Sandbox id (the `id` of its pool entries).
    pub id: String,
    /// Uid of the pod it belonged to.
    pub pod_uid: String,
    /// When its death was first reported (kept across retries and rechecks).
    pub since: Instant,
    /// When it is due.
    pub due: Instant,
    /// Failed attempts so far.
    pub attempts: u32,
}

/// What the runtime says of a witnessed sandbox right before its release: the fresh
/// confirmation of its death.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxNow {
    /// The runtime has no such sandbox.
    Gone,
    /// Not ready, its network torn down, none of its containers running.
    Dead,
    /// Ready: the listing that reported it dead had missed it.
    Ready,
    /// Not ready, but its network namespace is still up (the runtime still reports its
    /// address: the CNI DEL has not run): its interfaces may still answer for the address.
    NetworkUp,
    /// Not ready, but this many of its containers still run, in its network namespace.
    ContainersRunning(usize),
}

impl SandboxNow {
    /// From a status (`None`: not found; else whether it is ready and whether the runtime
    /// reports an address for it) and the count of its containers not exited.
    pub fn of(status: Option<(bool, bool)>, running_containers: usize) -> SandboxNow {
        match status {
            None => SandboxNow::Gone,
            Some((true, _)) => SandboxNow::Ready,
            Some((false, true)) => SandboxNow::NetworkUp,
            Some((false, false)) if running_containers > 0 => {
                SandboxNow::ContainersRunning(running_containers)
            }
            Some((false, false)) => SandboxNow::Dead,
        }
    }

    /// Whether nothing of it can use an address any more.
    pub fn is_dead(self) -> bool {
        matches!(self, SandboxNow::Gone | SandboxNow::Dead)
    }
}

/// Dead sandboxes by id.
#[derive(Debug)]
pub struct Witness {
    grace: Duration,
    retry_initial: Duration,
    retry_max: Duration,
    dead: HashMap<String, DeadSandbox>,
    handled: HashSet<String>,
}

impl Witness {
    /// Holds each dead sandbox for `grace`; failed attempts retry after `retry_initial`,
    /// doubling up to `retry_max`.
    pub fn new(grace: Duration, retry_initial: Duration, retry_max: Duration) -> Self {
        Witness {
            grace,
            retry_initial,
            retry_max,
            dead: HashMap::new(),
            handled: HashSet::new(),
        }
    }

    /// Records a death seen at `now`. A second report of the same sandbox (died, then removed)
    /// keeps the first time; a report of a sandbox already handled is ignored. Returns whether
    /// it was new.
    pub fn died(&mut self, id: &str, pod_uid: &str, now: Instant) -> bool {
        if self.dead.contains_key(id) || self.handled.contains(id) {
            return false;
        }
        self.dead.insert(
            id.to_owned(),
            DeadSandbox {
                id: id.to_owned(),
                pod_uid: pod_uid.to_owned(),
                since: now,
                due: now + self.grace,
                attempts: 0,
            },
        );
        true
    }

    /// Takes every sandbox due at `now`, oldest first.
    pub fn take_due(&mut self, now: Instant) -> Vec<DeadSandbox> {
        let ids: Vec<String> = self
            .dead
            .values()
            .filter(|d| d.due <= now)
            .map(|d| d.id.clone())
            .collect();
        let mut due: Vec<DeadSandbox> = ids.iter().filter_map(|id| self.dead.remove(id)).collect();
        self.handled.extend(ids);
        due.sort_by(|a, b| a.due.cmp(&b.due).then_with(|| a.id.cmp(&b.id)));
        due
    }

    /// Puts back a sandbox whose attempt failed at `now`; it is due again after a delay that
    /// doubles with each attempt.
    pub fn retry(&mut self, mut sandbox: DeadSandbox, now: Instant) {
        let factor = 2u32.saturating_pow(sandbox.attempts.min(31));
        let delay = self
            .retry_initial
            .checked_mul(factor)
            .unwrap_or(self.retry_max)
            .min(self.retry_max);
        sandbox.attempts += 1;
        sandbox.due = now + delay;
        self.handled.remove(&sandbox.id);
        self.dead.insert(sandbox.id.clone(), sandbox);
    }

    /// Forgets a sandbox the runtime lists running again (pending or handled): it never died,
    /// and its real death is a new one. Returns whether it was known.
    pub fn revived(&mut self, id: &str) -> bool {
        let pending = self.dead.remove(id).is_some();
        self.handled.remove(id) || pending
    }

    /// Puts back a sandbox the runtime says is still in use at `now` (its containers or its
    /// network still up): looked at again after a grace, its attempts unchanged.
    pub fn recheck(&mut self, mut sandbox: DeadSandbox, now: Instant) {
        sandbox.due = now + self.grace;
        self.handled.remove(&sandbox.id);
        self.dead.insert(sandbox.id.clone(), sandbox);
    }

    /// When the oldest sandbox waiting here (for its grace, a retry or a recheck) was first
    /// reported dead; the release attempts under way are [`super::attempts::Attempts`]'. One that stays in use
    /// (its network never torn down), held or unverified keeps it for ever.
    pub fn oldest_death(&self) -> Option<Instant> {
        self.dead.values().map(|d| d.since).min()
    }

    /// Forgets handled sandboxes for which `still_known` is false (the runtime no longer lists
    /// them, so no report can name them again).
    pub fn forget_handled(&mut self, still_known: impl Fn(&str) -> bool) {
        self.handled.retain(|id| still_known(id));
    }

    /// Handled sandboxes remembered.
    pub fn handled(&self) -> usize {
        self.handled.len()
    }

    /// When the next sandbox is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.dead.values().map(|d| d.due).min()
    }

    /// Sandboxes waiting.
    pub fn pending(&self) -> usize {
        self.dead.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(30);

    fn witness() -> Witness {
        Witness::new(GRACE, Duration::from_secs(1), Duration::from_secs(8))
    }

    #[test]
    fn a_dead_sandbox_is_due_only_after_the_grace() {
        let t0 = Instant::now();
        let mut w = witness();
        assert!(w.died("s1", "uid-a", t0));
        assert_eq!(w.next_due(), Some(t0 + GRACE));
        assert!(w.take_due(t0 + GRACE - Duration::from_millis(1)).is_empty());
        let due = w.take_due(t0 + GRACE);
        assert_eq!(due.len(), 1);
        assert_eq!(
            (due[0].id.as_str(), due[0].pod_uid.as_str()),
            ("s1", "uid-a")
        );
        assert_eq!(w.pending(), 0);
        assert_eq!(w.next_due(), None);
    }

    #[test]
    fn died_then_removed_counts_once_from_the_first_report() {
        let t0 = Instant::now();
        let mut w = witness();
        assert!(w.died("s1", "uid-a", t0));
        assert!(!w.died("s1", "uid-a", t0 + Duration::from_secs(20)));
        assert_eq!(w.take_due(t0 + GRACE).len(), 1);
        assert!(w.take_due(t0 + GRACE * 2).is_empty());
    }

    #[test]
    fn a_handled_sandbox_reported_again_is_not_taken_twice() {
        let t0 = Instant::now();
        let mut w = witness();
        w.died("s1", "uid-a", t0);
        assert_eq!(w.take_due(t0 + GRACE).len(), 1);
        // Removed long after it died: the second report comes after the look.
        assert!(!w.died("s1", "uid-a", t0 + GRACE * 3));
        assert_eq!((w.pending(), w.next_due()), (0, None));
        w.forget_handled(|id| id != "s1");
        assert_eq!(w.handled(), 0);
        assert!(
            w.died("s1", "uid-a", t0 + GRACE * 4),
            "forgotten ids are new again"
        );
    }

    #[test]
    fn a_sandbox_put_back_for_retry_is_pending_not_handled() {
        let t0 = Instant::now();
        let mut w = witness();
        w.died("s1", "uid-a", t0);
        let sb = w.take_due(t0 + GRACE).pop().expect("due");
        w.retry(sb, t0 + GRACE);
        assert_eq!((w.pending(), w.handled()), (1, 0));
        assert!(!w.died("s1", "uid-a", t0 + GRACE), "still pending");
    }

    #[test]
    fn due_sandboxes_come_oldest_first_and_others_wait() {
        let t0 = Instant::now();
        let mut w = witness();
        w.died("late", "uid-b", t0 + Duration::from_secs(5));
        w.died("early", "uid-a", t0);
        w.died("later", "uid-c", t0 + Duration::from_secs(60));
        let due = w.take_due(t0 + GRACE + Duration::from_secs(5));
        let ids: Vec<&str> = due.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["early", "late"]);
        assert_eq!(w.pending(), 1);
    }

    #[test]
    fn a_sandbox_listed_running_again_is_forgotten_and_its_real_death_witnessed_anew() {
        let t0 = Instant::now();
        let mut w = witness();
        // A listing missed s1 (died, removed), the next one lists it running.
        w.died("s1", "uid-a", t0);
        assert!(w.revived("s1"));
        assert_eq!((w.pending(), w.next_due()), (0, None));
        assert!(w.take_due(t0 + GRACE).is_empty());
        // Revived after its look too: it is not remembered as handled.
        w.died("s1", "uid-a", t0 + GRACE);
        assert_eq!(w.take_due(t0 + GRACE * 2).len(), 1);
        assert!(w.revived("s1"));
        let later = t0 + GRACE * 3;
        assert!(w.died("s1", "uid-a", later), "its real death is new");
        assert_eq!(w.next_due(), Some(later + GRACE));
        assert!(!w.revived("s2"), "never seen");
    }

    #[test]
    fn a_sandbox_still_in_use_is_looked_at_again_after_a_grace() {
        let t0 = Instant::now();
        let mut w = witness();
        w.died("s1", "uid-a", t0);
        let sb = w.take_due(t0 + GRACE).pop().expect("due");
        w.recheck(sb, t0 + GRACE);
        assert_eq!((w.pending(), w.handled()), (1, 0));
        assert!(
            w.take_due(t0 + GRACE * 2 - Duration::from_millis(1))
                .is_empty()
        );
        let again = w.take_due(t0 + GRACE * 2);
        assert_eq!((again.len(), again[0].attempts), (1, 0));
    }

    #[test]
    fn only_a_sandbox_gone_or_dead_with_nothing_running_in_it_is_dead() {
        use SandboxNow::*;
        let cases = [
            (None, 0, Gone),
            (None, 3, Gone),
            (Some((true, true)), 0, Ready),
            (Some((true, false)), 2, Ready),
            (Some((false, true)), 0, NetworkUp),
            (Some((false, true)), 2, NetworkUp),
            (Some((false, false)), 2, ContainersRunning(2)),
            (Some((false, false)), 0, Dead),
        ];
        for (status, running, want) in cases {
            let now = SandboxNow::of(status, running);
            assert_eq!(now, want, "{status:?} with {running} running");
            assert_eq!(now.is_dead(), matches!(want, Gone | Dead), "{want:?}");
        }
    }

    #[test]
    fn failed_attempts_retry_with_a_doubling_delay_up_to_the_max() {
        let t0 = Instant::now();
        let mut w = witness();
        w.died("s1", "uid-a", t0);
        let mut now = t0 + GRACE;
        let mut delays = Vec::new();
        for _ in 0..6 {
            let sb = w.take_due(now).pop().expect("due");
            w.retry(sb, now);
            let next = w.next_due().expect("back in");
            delays.push((next - now).as_secs());
            assert!(w.take_due(next - Duration::from_millis(1)).is_empty());
            now = next;
        }
        assert_eq!(delays, [1, 2, 4, 8, 8, 8]);
        assert_eq!(w.take_due(now)[0].attempts, 6);
    }

    #[test]
    fn the_oldest_death_is_kept_across_rechecks_and_retries_and_ends_with_the_last_look() {
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        let mut w = witness();
        assert_eq!(w.oldest_death(), None, "nothing waits");
        w.died("stuck", "uid-a", t0);
        w.died("young", "uid-b", t0 + secs(20));
        assert_eq!(w.oldest_death(), Some(t0));
        // Both taken: the attempts under way are Attempts' to count.
        let mut due = w.take_due(t0 + secs(50));
        assert_eq!((w.pending(), w.oldest_death()), (0, None));
        // The young one is settled; the stuck one is found in use, again and again.
        due.pop().expect("young");
        let stuck = due.pop().expect("stuck");
        w.recheck(stuck, t0 + secs(50));
        for look in 1..=5u64 {
            let at = t0 + secs(50) + GRACE * look as u32;
            let sb = w.take_due(at).pop().expect("due again");
            assert_eq!(sb.since, t0, "the first death is kept");
            w.recheck(sb, at);
        }
        assert_eq!(w.oldest_death(), Some(t0), "kept while it stays in use");
        // A failed attempt keeps it too; once its last look is taken, nothing waits here.
        let later = t0 + secs(50) + GRACE * 5;
        let sb = w.take_due(later + GRACE).pop().expect("due");
        w.retry(sb, later + GRACE);
        assert_eq!(w.oldest_death(), Some(t0));
        assert_eq!(w.take_due(later + GRACE * 2).len(), 1);
        assert_eq!(w.oldest_death(), None);
        // A revived sandbox waits no more.
        w.died("r", "uid-c", later);
        assert!(w.revived("r"));
        assert_eq!(w.oldest_death(), None);
    }
}
