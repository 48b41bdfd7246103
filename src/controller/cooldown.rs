//! The end of release cooldowns (`--release-cooldown`, see `ipam::cooldown`): every second the
//! leader removes the cooling entries whose end time has passed by its clock, each pinned by
//! its marker, then deletes the pod's reservation of the address. Whatever set the cooldown
//! (this controller, an earlier leader, a node agent), the end is in the entry, so it ends
//! here even when this controller's own flag is off. With the flag set, an entry also waits
//! until this replica has seen it cooling for that long (`rules::cooldown`): an end written
//! by a lagging clock does not shorten it. Every replica counts, so a standby that takes over
//! knows how long each entry has cooled.

use std::time::{Duration, Instant};

use crate::index::{CoolingEntry, Slot};
use crate::release::{EntryWrite, ReleaseOutcome, ReleaseRequest};
use crate::rules::cooldown::CoolingSightings;
use crate::rules::{Decision, Judged, PodRef, Reason};

/// The removal of the cooling entry `c` of `pool`, named for Events by `network`.
pub fn end_request(pool: &str, c: &CoolingEntry, network: String) -> ReleaseRequest {
    ReleaseRequest {
        judged: Judged {
            pool: pool.to_owned(),
            entry: c.entry.clone(),
            // The release was judged when the cooldown began; this only ends it.
            decision: Decision::Release(Reason::CooldownEnded),
            network,
            pod: PodRef::from_podref(&c.pod, String::new()),
            node: None,
        },
        reason: Reason::CooldownEnded,
        deleted_at: None,
        write: EntryWrite::EndCooldown,
        cooldown: None,
    }
}

/// How far past its marked end a cooling entry kept for its sighting must be to be counted
/// in `ipreclaim_cooldowns_past_end`.
const PAST_END_REPORTED: jiff::SignedDuration = jiff::SignedDuration::from_secs(5);

/// Ends due cooldowns on the leader, backing off entries whose removal failed.
pub struct Cooler {
    pub(crate) ctx: super::ctx::Ctx,
    /// `--dry-run`: nothing is written, so nothing ends.
    pub(crate) dry_run: bool,
    /// Entries whose last removal failed: not tried again before their backoff.
    pub(crate) backoff: podlife::backoff::Backoff<Slot>,
    /// This controller's `--release-cooldown`: how long it must have seen an entry cooling
    /// before it ends it (zero: the marker alone decides).
    pub(crate) length: Duration,
    /// When this replica first saw each cooling entry (by slot and marker).
    pub(crate) sightings: CoolingSightings<(Slot, String)>,
}

impl Cooler {
    /// One pass: notes the entries cooling (on every replica); on the leader, removes every
    /// one that may end at this moment.
    pub async fn pass(&mut self, leader: bool) {
        let now = Instant::now();
        let sighting =
            |pool: &str, c: &CoolingEntry| (Slot::new(pool, &c.entry.key), c.entry.id.clone());
        let cooling = self.ctx.index.read().expect("index lock").cooling();
        self.sightings
            .observe(cooling.iter().map(|(pool, c)| sighting(pool, c)), now);
        let past_end = &self.ctx.metrics.cooldowns_past_end;
        if !leader || self.dry_run {
            past_end.set(0);
            return;
        }
        let wall = jiff::Timestamp::now();
        let (may_end, waiting): (Vec<_>, Vec<_>) = cooling
            .iter()
            .filter_map(|(pool, c)| Some((pool, c, c.ended_by(wall)?)))
            .partition(|(pool, c, until)| {
                let k = sighting(pool, c);
                self.sightings.may_end(&k, *until, wall, now, self.length)
            });
        // Not the second or two every cooldown waits for its first sighting after the write.
        let past_end_long = waiting
            .iter()
            .filter(|(_, _, until)| wall.duration_since(*until) > PAST_END_REPORTED)
            .count();
        past_end.set(past_end_long as i64);
        let key = |r: &ReleaseRequest| Slot::new(&r.judged.pool, &r.judged.entry.key);
        let due: Vec<ReleaseRequest> = {
            let st = self.ctx.index.read().expect("index lock");
            may_end
                .into_iter()
                .map(|(pool, c, _)| {
                    let network = st
                        .networks()
                        .of_pool(pool)
                        .and_then(|n| n.first().cloned())
                        .unwrap_or_else(|| pool.clone());
                    end_request(pool, c, network)
                })
                .filter(|r| !self.backoff.is_in_backoff_since(&key(r), now))
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let outcomes = self.ctx.writer.release(due.clone()).await;
        crate::release::reports::audit::emit_all(due.iter().zip(&outcomes), None, None);
        for (r, o) in due.iter().zip(&outcomes) {
            let ip = r.judged.entry.ip;
            match o {
                Err(e) => {
                    self.backoff
                        .next(&key(r), Instant::now(), Some(e.to_string()));
                    tracing::warn!(pool = %r.judged.pool, %ip, error = %e, retry_in = ?self.backoff.get(&key(r)), "ending a cooldown failed; retried after a backoff");
                }
                Ok(ReleaseOutcome::AlreadyGone | ReleaseOutcome::Changed) => {
                    tracing::info!(pool = %r.judged.pool, %ip, "a cooling entry was already removed or replaced")
                }
                Ok(_) => self.backoff.reset(&key(r)),
            }
        }
        self.backoff.gc();
    }
}
