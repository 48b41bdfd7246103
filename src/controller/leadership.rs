//! One writer at a time. kube-lease-manager says when the Lease is won or lost, but a leader
//! whose renewals fail (cut off from the apiserver) hears nothing and would write on after a
//! standby took over. So each replica reads its own Lease and writes only until its last
//! renewal plus the renew deadline (two thirds of the Lease duration, as client-go's renew
//! deadline is shorter than its lease duration), measured on its own clock, the one that wrote
//! that renewal. Writes stop before the Lease can expire; every write is checked at that gate
//! right before it goes, so what a demoted leader had queued is refused, never sent late. A
//! replica that comes to hold the Lease writes only after it has read itself the holder for
//! [`ACQUIRE_SETTLE`]: a replica that held it before (the Lease can change hands while the
//! old holder is reachable) has read the new holder by then and closed its gate.
//!
//! The bound's limits: a standby judges the Lease expired on its own wall clock (that is how
//! kube-lease-manager, like client-go, works), so replicas whose clocks differ by more than a
//! third of the Lease duration could overlap; and a write already sent when the gate closes
//! may still arrive. The pool patches' `test`s and the deletes' preconditions bound what
//! such a write can do.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use tokio::sync::watch;

/// How often the Lease is read to confirm it.
pub const CONFIRM_EVERY: Duration = Duration::from_millis(500);
/// How long a new holder waits before it writes: longer than a read period plus a read's
/// timeout, so that the previous holder has seen the change.
pub const ACQUIRE_SETTLE: Duration = Duration::from_millis(2000);

/// The renew deadline for a Lease of `duration`: writes stop this long after the last renewal.
pub fn renew_deadline(duration: Duration) -> Duration {
    duration * 2 / 3
}

/// Until when (this process's clock) a replica that read its Lease may write, pure: the Lease
/// names `identity` as holder and was renewed at `renewed` (written with this replica's wall
/// clock), read at `wall_now` / `mono_now`.
pub fn valid_until(
    holder: Option<&str>,
    renewed: Option<Timestamp>,
    identity: &str,
    deadline: Duration,
    wall_now: Timestamp,
    mono_now: Instant,
) -> Option<Instant> {
    if holder != Some(identity) {
        return None;
    }
    let since = Duration::try_from(wall_now.duration_since(renewed?)).ok()?;
    Some(mono_now + deadline.checked_sub(since)?)
}

/// How long a replica that has just started waits before it stands for the Lease, pure: the
/// Lease as it read it at start (`holder`, `renewed`), at `wall_now`.
///
/// While another holder's Lease is recent, a standby may be running: it saw the deletions of
/// the takeover gap (the pods' nodes, so what must be fenced), this replica did not. Standing
/// only after one and a half Lease durations lets that standby, which tries right at expiry,
/// take over first; alone, this replica leads that much later. A Lease that is free, its own,
/// or expired for a whole duration (no standby took it) is stood for at once.
pub fn newcomer_wait(
    holder: Option<&str>,
    renewed: Option<Timestamp>,
    identity: &str,
    duration: Duration,
    wall_now: Timestamp,
) -> Duration {
    let other = holder.is_some_and(|h| !h.is_empty() && h != identity);
    let recent = renewed.is_some_and(|r| {
        Duration::try_from(wall_now.duration_since(r)).map_or(true, |age| age < duration * 2)
    });
    if other && recent {
        newcomer_full_wait(duration)
    } else {
        Duration::ZERO
    }
}

/// A newcomer's wait when another held the Lease lately (or the Lease cannot be read).
pub fn newcomer_full_wait(duration: Duration) -> Duration {
    duration * 3 / 2
}

/// kube-lease-manager frees an expired Lease, then pauses up to 1 s before it acquires it: a
/// Lease found free at start is read again after this.
pub const FORCE_RELEASE_PAUSE: Duration = Duration::from_millis(1100);

/// Whether a Lease found free was let go by its holder (its last renewal seen, `renewed`, had
/// not expired at `wall_now`) rather than freed by a standby after expiry, pure.
pub fn let_go_before_expiry(
    renewed: Option<Timestamp>,
    duration: Duration,
    wall_now: Timestamp,
) -> bool {
    // The holder renews halfway through; a release comes at most that long after a renewal
    // (plus two reads). Older: a standby freed it after expiry, even if this replica's clock
    // lags and reads it as not expired yet (up to about half a duration of skew).
    let limit = duration / 2 + CONFIRM_EVERY * 2;
    renewed.is_some_and(|r| {
        Duration::try_from(wall_now.duration_since(r)).map_or(true, |age| age < limit)
    })
}

/// Whether this replica may write now.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
}

#[derive(Debug, Default)]
struct GateState {
    /// Leader election is off: always open.
    always: bool,
    /// kube-lease-manager says this replica holds the Lease.
    lease_says: bool,
    /// Until when the last read of the Lease allows writes.
    valid_until: Option<Instant>,
    /// Since when the reads have named this replica the holder, without a break.
    held_since: Option<Instant>,
}

impl Gate {
    /// A gate that is always open (leader election off).
    pub fn always() -> Arc<Gate> {
        let g = Gate::default();
        g.state.lock().expect("gate lock").always = true;
        Arc::new(g)
    }

    /// Whether writes may go at `now`.
    pub fn open(&self, now: Instant) -> bool {
        let s = self.state.lock().expect("gate lock");
        let settled = s
            .held_since
            .is_some_and(|t| now.saturating_duration_since(t) >= ACQUIRE_SETTLE);
        s.always || (s.lease_says && settled && s.valid_until.is_some_and(|t| now < t))
    }

    fn set_lease_says(&self, leads: bool) {
        self.state.lock().expect("gate lock").lease_says = leads;
    }

    /// Records a read of the Lease at `now`: it allows writes until `until` (`None`: it does
    /// not name this replica, or its renewal is too old).
    fn read(&self, until: Option<Instant>, now: Instant) {
        let mut s = self.state.lock().expect("gate lock");
        s.valid_until = until;
        s.held_since = match (until, s.held_since) {
            (None, _) => None,
            (Some(_), Some(t)) => Some(t),
            (Some(_), None) => Some(now),
        };
    }
}

/// Reads the Lease every [`CONFIRM_EVERY`] and keeps `gate` up to date; publishes on the
/// returned channel whether this replica leads (the Lease manager says so and the gate is
/// open). A read that fails changes nothing: the validity runs out by itself. The tasks are
/// returned to be aborted at shutdown.
pub fn spawn(
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration: Duration,
    mut lease_says: watch::Receiver<bool>,
    gate: Arc<Gate>,
) -> (watch::Receiver<bool>, [tokio::task::JoinHandle<()>; 2]) {
    let (tx, rx) = watch::channel(false);
    let deadline = renew_deadline(lease_duration);
    let confirm = gate.clone();
    let reader = tokio::spawn(async move {
        loop {
            let read = tokio::time::timeout(CONFIRM_EVERY * 2, api.get_opt(&name)).await;
            if let Ok(Ok(lease)) = read {
                let spec = lease.and_then(|l| l.spec).unwrap_or_default();
                let now = Instant::now();
                let until = valid_until(
                    spec.holder_identity.as_deref(),
                    spec.renew_time.map(|t| t.0),
                    &identity,
                    deadline,
                    Timestamp::now(),
                    now,
                );
                confirm.read(until, now);
            }
            tokio::time::sleep(CONFIRM_EVERY).await;
        }
    });
    let publisher = tokio::spawn(async move {
        loop {
            let says = *lease_says.borrow_and_update();
            gate.set_lease_says(says);
            let leads = gate.open(Instant::now());
            tx.send_if_modified(|l| std::mem::replace(l, leads) != leads);
            tokio::select! {
                changed = lease_says.changed() => if changed.is_err() {
                    gate.set_lease_says(false);
                    tx.send_replace(false);
                    return;
                },
                () = tokio::time::sleep(CONFIRM_EVERY / 5) => {}
            }
        }
    });
    // Aborted with the controller: the Lease manager's receiver then closes and it releases.
    (rx, [reader, publisher])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_writes_until_its_renewal_plus_the_renew_deadline() {
        let (now, mono) = (
            Timestamp::from_second(1_800_000_000).unwrap(),
            Instant::now(),
        );
        let deadline = renew_deadline(Duration::from_secs(15));
        assert_eq!(deadline, Duration::from_secs(10));
        let renewed = |ago: i64| Some(now - jiff::SignedDuration::from_secs(ago));
        assert_eq!(
            valid_until(Some("me"), renewed(4), "me", deadline, now, mono),
            Some(mono + Duration::from_secs(6))
        );
        // The renewal is older than the deadline: no more writes.
        assert_eq!(
            valid_until(Some("me"), renewed(11), "me", deadline, now, mono),
            None
        );
        // Someone else holds it, or it was never renewed.
        assert_eq!(
            valid_until(Some("other"), renewed(1), "me", deadline, now, mono),
            None
        );
        assert_eq!(
            valid_until(Some("me"), None, "me", deadline, now, mono),
            None
        );
    }

    #[test]
    fn a_lease_freed_before_its_expiry_was_let_go_by_its_holder() {
        let now: Timestamp = "2026-11-24T12:00:00Z".parse().unwrap();
        let d = Duration::from_secs(15);
        let ago = |s: i64| Some(now - jiff::SignedDuration::from_secs(s));
        assert!(let_go_before_expiry(ago(3), d, now));
        assert!(
            let_go_before_expiry(ago(8), d, now),
            "renewed halfway, let go a read later"
        );
        // Freed after expiry by a standby, read by a replica whose clock lags 4 s.
        assert!(!let_go_before_expiry(ago(11), d, now));
        assert!(!let_go_before_expiry(ago(16), d, now));
        assert!(!let_go_before_expiry(None, d, now));
    }

    #[test]
    fn a_newcomer_lets_a_running_standby_take_a_recently_held_lease_first() {
        let now: Timestamp = "2026-11-24T12:00:00Z".parse().unwrap();
        let d = Duration::from_secs(15);
        let ago = |s: i64| now - jiff::SignedDuration::from_secs(s);
        let wait = |holder, renewed| newcomer_wait(holder, renewed, "me", d, now);
        assert_eq!(wait(Some("other"), Some(ago(5))), d * 3 / 2);
        // Expired but within two durations: a standby may be about to take it.
        assert_eq!(wait(Some("other"), Some(ago(25))), d * 3 / 2);
        // A renewal "in the future" (the holder's clock ahead) is recent.
        assert_eq!(wait(Some("other"), Some(ago(-5))), d * 3 / 2);
        assert_eq!(wait(Some("other"), Some(ago(31))), Duration::ZERO);
        assert_eq!(wait(Some("me"), Some(ago(5))), Duration::ZERO);
        assert_eq!(wait(None, Some(ago(5))), Duration::ZERO);
        assert_eq!(wait(Some(""), Some(ago(5))), Duration::ZERO);
        assert_eq!(wait(Some("other"), None), Duration::ZERO);
    }

    #[test]
    fn the_gate_opens_only_while_the_lease_manager_and_the_last_read_agree() {
        let g = Gate::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert!(!g.open(t0));
        g.set_lease_says(true);
        assert!(!g.open(t0), "no confirming read yet");
        g.read(Some(at(10_000)), t0);
        assert!(
            !g.open(at(1999)),
            "a new holder waits for the old one to see it"
        );
        assert!(g.open(at(2000)));
        // Later reads keep the first; a read that does not name us starts again.
        g.read(Some(at(12_000)), at(3000));
        assert!(g.open(at(3000)));
        assert!(!g.open(at(12_000)), "the deadline passed");
        g.read(None, at(4000));
        g.read(Some(at(14_000)), at(4500));
        assert!(!g.open(at(5000)), "held again only since 4.5 s");
        assert!(g.open(at(6500)));
        g.set_lease_says(false);
        assert!(!g.open(at(6500)));
        assert!(Gate::always().open(t0));
    }
}
