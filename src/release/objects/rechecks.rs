//! Re-checks after reservation deletes. whereabouts reads the reservation before it writes the
//! pool entry, so an allocation can land between a delete's check and the delete: re-checks
//! after the delete ([`RECHECKS`]; one fresh read per pool for every re-check due) put the
//! reservation back if an entry for the pod and address appeared. An orphan's delete is
//! re-checked too: its network and address are read back from its name, in that network's pools
//! whose range holds the address.
//!
//! An entry that appeared is not always one whose reservation ipreclaim must put back: an
//! allocation that read no reservation (ours was already gone) creates its own right after its
//! pool write, and a create of ours first would make that ADD fail (409, seen in the chaos
//! suite). So the reservation is put back at once only when the pod, read fresh, lists the
//! address (its ADD has returned: whereabouts creates nothing more), and otherwise when the same
//! entry is still there, still without it, at a second read [`RESTORE_CONFIRM`] later. The
//! first keeps the gap short where the allocation read ours and will create none (an address
//! without its reservation is one an overlapping pool could hand out).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::{Api, PostParams};
use tokio::sync::mpsc;

use super::ObjectWriter;
use crate::api::slim::PodView;
use crate::api::{OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};
use crate::ipam::network_status::network_status_of;
use crate::release::ledger::Occupant;
use crate::release::types::{Deleted, ReservationDelete};

/// When, after a delete, it is re-checked (from the delete). The first re-check comes soon:
/// an allocation that raced the delete writes its pool entry a moment after it read the
/// reservation; a loaded allocator (or one retrying its pool update) writes it seconds later,
/// so the re-checks stay a second apart until 3 s (the chaos suite saw a 2.6 s gap with none
/// between 1 s and 5 s).
pub const RECHECKS: [Duration; 5] = [
    Duration::from_millis(300),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(3),
    Duration::from_secs(5),
];

/// How long after a re-check first finds an entry for the pod and address (and no reservation,
/// and a pod that does not list the address yet) it reads again before putting the reservation
/// back: whereabouts creates its own right after its pool write when it read none, and must not
/// find ours there first.
pub const RESTORE_CONFIRM: Duration = Duration::from_millis(500);

/// Re-checks that are due within this of each other share their pool reads.
const RECHECK_BATCH: Duration = Duration::from_millis(50);
/// A pool read for a re-check that takes longer is retried (a held read must not stall the rest).
/// Above 3 s: a consistent read served from the watch cache waits that long for a lagging cache
/// before it reads etcd, and must get there.
const RECHECK_READ_TIMEOUT: Duration = Duration::from_secs(4);
/// A re-check that could not be made is tried again this much later, this many times (ten
/// minutes), then reported as failed.
const RECHECK_RETRY: Duration = Duration::from_secs(1);
const RECHECK_RETRIES: u32 = 600;

impl ObjectWriter {
    /// Where a re-check of `d` reads: (pool, address). A delete after a release names both; an
    /// orphan's network and address are read back from its name, and sought in every pool
    /// of that network the ledger knows whose range holds the address (its pool is not known:
    /// overlapping ranges share the reservation).
    fn recheck_targets(&self, d: &ReservationDelete) -> Vec<(String, IpAddr)> {
        if let (Some(ip), Some(pool)) = (d.ip, &d.pool) {
            return vec![(pool.clone(), ip)];
        }
        self.cx.ledger.reservation_pools(&d.name)
    }

    /// A pool's entries for a re-check, read fresh; `None` where it could not be read in time (the
    /// index may lag the very allocation sought, so it does not stand in).
    async fn read_for_recheck(&self, pool: &str) -> Option<Vec<crate::ipam::PoolEntry>> {
        match tokio::time::timeout(RECHECK_READ_TIMEOUT, self.cx.read_pool(pool)).await {
            Ok(Ok(Some(p))) => Some(
                crate::ipam::pool_allocations(&p.spec)
                    .map(|a| a.entries)
                    .unwrap_or_default(),
            ),
            Ok(Ok(None)) => Some(Vec::new()),
            Ok(Err(e)) => {
                tracing::warn!(pool = %pool, error = %e, "could not look again after deleting reservations; looking again later");
                None
            }
            Err(_) => {
                tracing::warn!(pool = %pool, "reading the pool to look again after deleting reservations timed out; looking again later");
                None
            }
        }
    }

    /// Whether `d`'s pod, read fresh, lists its address in its network-status: its ADD has
    /// returned, so whereabouts creates no reservation for it any more. A pod not read in time,
    /// gone, or without a readable network-status counts as no (the re-check then confirms).
    async fn pod_lists(&self, d: &ReservationDelete) -> bool {
        let ip =
            d.ip.or_else(|| self.recheck_targets(d).first().map(|(_, ip)| *ip));
        let Some(ip) = ip else {
            return false;
        };
        let pod = crate::ipam::PodKey::lenient(&d.podref);
        let api = Api::<PodView>::namespaced(self.cx.client.clone(), &pod.namespace);
        match tokio::time::timeout(RECHECK_READ_TIMEOUT, api.get_opt(&pod.name)).await {
            Ok(Ok(Some(p))) => network_status_of(p.metadata.annotations.as_ref())
                .is_some_and(|n| n.iter().any(|a| a.ips.contains(&ip))),
            Ok(Ok(None)) => false,
            Ok(Err(e)) => {
                tracing::debug!(podref = %d.podref, error = %e, "could not read the pod for a re-check; confirming instead");
                false
            }
            Err(_) => false,
        }
    }

    /// Who holds each delete's address now, from one fresh read per pool for all of them;
    /// `None` where a pool to read could not be read and no occupant was found.
    async fn occupants_now(&self, rechecks: &[ReservationDelete]) -> Vec<Option<Option<Occupant>>> {
        let mut read: HashMap<String, Option<Vec<crate::ipam::PoolEntry>>> = HashMap::new();
        let mut holders = Vec::with_capacity(rechecks.len());
        for d in rechecks {
            let (mut found, mut unknown) = (None, false);
            for (pool, ip) in self.recheck_targets(d) {
                if !read.contains_key(&pool) {
                    let entries = self.read_for_recheck(&pool).await;
                    read.insert(pool.clone(), entries);
                }
                let Some(entries) = read.get(&pool).and_then(Option::as_ref) else {
                    unknown = true;
                    continue;
                };
                let holder = entries.iter().find(|e| e.podref == d.podref && e.ip == ip);
                if let Some(e) = holder {
                    found = Some((e.id.clone(), e.ifname.as_deref().map(str::to_owned)));
                    break;
                }
            }
            holders.push(match found {
                Some(h) => Some(Some(h)),
                None if unknown => None,
                None => Some(None),
            });
        }
        holders
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
        let created = self.send_restore(|| api.create(&params, &r)).await;
        match created {
            // Already back (someone put it back first): fine when it names this pod.
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(&d.name).await {
                Ok(Some(r)) if r.spec.podref == d.podref => Deleted::Restored,
                // Another pod's now: reported once; re-checking cannot mend it.
                Ok(Some(_)) => {
                    tracing::error!(reservation = %d.name, podref = %d.podref, "an allocation for the pod and address appeared while its reservation was deleted, and another pod's reservation now holds the address");
                    self.cx.metrics.failed(Deleted::FAILED_LABEL);
                    Deleted::NotOurs
                }
                // Gone again or unreadable: the create is tried again.
                _ => Deleted::Failed,
            },
            Ok(_) => {
                tracing::warn!(reservation = %d.name, podref = %d.podref, "an allocation for the pod and address appeared while its reservation was deleted; reservation put back");
                self.cx.metrics.reservations_restored.inc();
                Deleted::Restored
            }
            Err(e) => {
                tracing::error!(reservation = %d.name, podref = %d.podref, error = %e, "an allocation for the pod and address appeared while its reservation was deleted, and it could not be put back");
                self.cx.metrics.failed(Deleted::FAILED_LABEL);
                Deleted::Failed
            }
        }
    }
}

/// A deleted reservation waiting for its next re-check.
struct Recheck {
    d: ReservationDelete,
    step: usize,
    /// Re-checks of this step that could not be made (pool unreadable, restore failed).
    retries: u32,
    due: Instant,
    /// The entry for the pod and address found at the last re-check: the next one, due
    /// [`RESTORE_CONFIRM`] later, puts the reservation back if the same entry is still there.
    found: Option<Occupant>,
}

/// What a re-check does with what it read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Next {
    /// Puts the reservation back: the pod lists the address, or the same entry was found again.
    Restore,
    /// Reads again after [`RESTORE_CONFIRM`]: the entry was found for the first time (or
    /// another one than before) and its pod does not list the address yet.
    Confirm,
    /// The pool could not be read: tries again soon.
    Retry,
    /// No entry holds the address: the next re-check of the schedule, if any.
    Schedule,
}

/// What a re-check that read `holder` (`None`: the pool could not be read; `Some(None)`: no
/// entry) does next, given the entry the last one found and whether the pod, read fresh,
/// lists the address.
fn next_step(
    found_before: Option<&Occupant>,
    holder: &Option<Option<Occupant>>,
    listed: bool,
) -> Next {
    match holder {
        None => Next::Retry,
        Some(Some(_)) if listed => Next::Restore,
        Some(Some(h)) if found_before == Some(h) => Next::Restore,
        Some(Some(_)) => Next::Confirm,
        Some(None) => Next::Schedule,
    }
}

/// Takes deleted reservations (with an address) and re-checks them at [`RECHECKS`]
/// (see the module), every re-check due at once sharing its pool reads.
impl ObjectWriter {
    /// Starts the re-checks (see [`rechecks`]) for this writer: send it each deleted reservation.
    /// The task ends once the sender is dropped and every re-check is done.
    pub(crate) fn spawn_rechecks(
        self: &Arc<Self>,
    ) -> (
        mpsc::UnboundedSender<ReservationDelete>,
        tokio::task::JoinHandle<()>,
    ) {
        rechecks(self.clone())
    }
}

fn rechecks(
    writer: Arc<ObjectWriter>,
) -> (
    mpsc::UnboundedSender<ReservationDelete>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<ReservationDelete>();
    let task = tokio::spawn(async move {
        let api: Api<OverlappingRangeIPReservation> =
            Api::namespaced(writer.cx.client.clone(), &writer.cx.namespace);
        let mut waiting: Vec<Recheck> = Vec::new();
        let mut open = true;
        while open || !waiting.is_empty() {
            let next = waiting.iter().map(|l| l.due).min();
            let wake = crate::release::sleep_until(next);
            tokio::select! {
                d = rx.recv(), if open => match d {
                    Some(d) => waiting.push(Recheck {
                        d,
                        step: 0,
                        retries: 0,
                        due: Instant::now() + RECHECKS[0],
                        found: None,
                    }),
                    None => open = false,
                },
                () = wake => {
                    let now = Instant::now();
                    let (due, rest): (Vec<Recheck>, Vec<Recheck>) =
                        waiting.drain(..).partition(|l| l.due <= now + RECHECK_BATCH);
                    waiting = rest;
                    let deletes: Vec<ReservationDelete> = due.iter().map(|l| l.d.clone()).collect();
                    let holders = writer.occupants_now(&deletes).await;
                    for (mut recheck, holder) in due.into_iter().zip(holders) {
                        // Not known (the pool could not be read) is not a "no".
                        // The pod read fresh only where it decides: an entry new to this item.
                        let listed = match &holder {
                            Some(Some(h)) if recheck.found.as_ref() != Some(h) => {
                                writer.pod_lists(&recheck.d).await
                            }
                            _ => false,
                        };
                        let retry = match (next_step(recheck.found.as_ref(), &holder, listed), holder) {
                            (Next::Restore, Some(Some((id, ifname)))) => {
                                // Put back, or another pod's now (reported): done.
                                let r = writer.restore(&api, &recheck.d, id, ifname).await;
                                if r != Deleted::Failed {
                                    continue;
                                }
                                true
                            }
                            (Next::Confirm, Some(Some(h))) => {
                                recheck.found = Some(h);
                                recheck.due = Instant::now() + RESTORE_CONFIRM;
                                waiting.push(recheck);
                                continue;
                            }
                            (Next::Retry, _) => true,
                            _ => {
                                recheck.found = None;
                                false
                            }
                        };
                        if retry {
                            recheck.retries += 1;
                            if recheck.retries > RECHECK_RETRIES {
                                tracing::error!(reservation = %recheck.d.name, podref = %recheck.d.podref, "gave up looking again after deleting a reservation: its pool could not be read or the reservation put back");
                                writer.cx.metrics.failed(Deleted::FAILED_LABEL);
                            } else {
                                recheck.due = Instant::now() + RECHECK_RETRY;
                                waiting.push(recheck);
                            }
                        } else if let Some(wait) = RECHECKS.get(recheck.step + 1) {
                            let since = RECHECKS[recheck.step];
                            waiting.push(Recheck {
                                due: recheck.due + wait.saturating_sub(since),
                                step: recheck.step + 1,
                                retries: 0,
                                d: recheck.d,
                                found: None,
                            });
                        }
                    }
                }
            }
        }
    });
    (tx, task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_put_back_once_its_pod_lists_it_or_it_is_found_again() {
        let h = |id: &str| ("sb-".to_string() + id, Some("net1".to_string()));
        let entry = |id: &str| Some(Some(h(id)));
        // Found for the first time, its pod not listing the address yet: whereabouts may be
        // about to create the reservation itself (it read none): read again, create nothing.
        assert_eq!(next_step(None, &entry("new"), false), Next::Confirm);
        // Its pod lists it: the ADD has returned, whereabouts creates nothing more: at once.
        assert_eq!(next_step(None, &entry("new"), true), Next::Restore);
        // The same entry still there, still without it: whereabouts read ours and will not.
        assert_eq!(
            next_step(Some(&h("new")), &entry("new"), false),
            Next::Restore
        );
        // Another entry than the one found (the sandbox torn down, a new one allocated that
        // may have read no reservation): a first sighting again.
        assert_eq!(
            next_step(Some(&h("new")), &entry("newer"), false),
            Next::Confirm
        );
        // Gone meanwhile: the schedule goes on.
        assert_eq!(
            next_step(Some(&h("new")), &Some(None), false),
            Next::Schedule
        );
        // An unreadable pool is no answer, found before or not.
        assert_eq!(next_step(Some(&h("new")), &None, false), Next::Retry);
        assert_eq!(next_step(None, &None, true), Next::Retry);
        assert!(RESTORE_CONFIRM > Duration::ZERO && RESTORE_CONFIRM < RECHECKS[1]);
    }
}
