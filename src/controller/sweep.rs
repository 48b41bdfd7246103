//! The leak sweep: every allocation is judged; garbage must stay garbage for the grace period
//! and survive a fresh GET of its pod before it is released, and a sweep that would free too
//! much of a pool is held for an operator.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

use super::state::Judged;
use crate::api::paged::for_each_listed;
use crate::ipam::{NETWORK_STATUS_ANNOTATION, parse_network_status};
use crate::reclaim::{
    self, Allocation, Decision, LivePod, PodKnowledge, PodPhase, PoolContext, Reason, ReclaimConfig,
};
use crate::release::ReleaseRequest;
use crate::release::reservation::ReservationDelete;

/// Up to this many missing pods are confirmed by a GET each, more by one list.
const CONFIRM_BY_GET: usize = 8;
/// Pods' metadata per page of the confirming list.
const CONFIRM_PAGE: u32 = 500;

/// Pools with at most this many allocations are never held by the breaker.
const BREAKER_MIN_POOL: usize = 10;

/// Sweep settings.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// How long an allocation must be seen as garbage before it is released.
    pub leak_grace: Duration,
    /// The same for an allocation whose pod does not exist at all.
    pub missing_pod_grace: Duration,
    /// Largest share of a pool one sweep may release.
    pub max_release_ratio: f64,
    /// The decision rules.
    pub reclaim: ReclaimConfig,
    /// Namespace of the pools (for breaker Events).
    pub namespace: String,
}

/// The sweep's memory between runs: when each candidate was first seen.
pub struct Sweeper {
    pub(crate) ctx: super::Ctx,
    pub(crate) config: SweepConfig,
    pub(crate) first_seen: HashMap<(String, String, String), (Instant, Reason)>,
    /// Orphaned reservations by (name, uid), with when they were first seen.
    pub(crate) orphan_reservations_seen: HashMap<(String, String), Instant>,
    /// Pools the breaker held at the last sweep: a hold is counted, logged and reported
    /// once per episode, not once per sweep.
    pub(crate) held_pools: HashSet<String>,
}

/// What one sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Candidates seen.
    pub candidates: usize,
    /// Releases handed to the writer.
    pub released: usize,
    /// Pools held by the breaker.
    pub held_pools: Vec<String>,
    /// Orphaned reservations deleted.
    pub reservations_deleted: usize,
    /// When the next candidate's grace ends (sweep again then, not a whole interval later).
    pub next_due: Option<Instant>,
}

/// The pools held after a sweep: those held now, and those held before whose candidates could
/// not be confirmed this time (a failed confirming list ends no hold: its next success would
/// report the same hold again).
fn still_held(
    before: &HashSet<String>,
    now: HashSet<String>,
    unconfirmed: &HashSet<String>,
) -> HashSet<String> {
    let mut held = now;
    held.extend(before.intersection(unconfirmed).cloned());
    held
}

impl Sweeper {
    /// One sweep.
    pub async fn sweep(&mut self) -> SweepReport {
        let started = Instant::now();
        let (judged, pool_sizes) = {
            let st = self.ctx.state.read().expect("state lock");
            let sizes: HashMap<String, (usize, String)> = st
                .pools()
                .iter()
                .map(|(n, p)| (n.clone(), (p.entries.len(), p.uid.clone())))
                .collect();
            let judged: Vec<(Judged, Option<Instant>)> = st
                .judge_leaks(&self.config.reclaim)
                .into_iter()
                .map(|j| {
                    let listed = st.last_listed(&j.entry.podref, j.entry.ip);
                    (j, listed)
                })
                .collect();
            (judged, sizes)
        };
        let mut report = SweepReport::default();
        let mut seen = HashSet::new();
        let mut due: Vec<(Judged, Reason)> = Vec::new();
        let mut counts: BTreeMap<&'static str, i64> =
            Reason::ALL.iter().map(|r| (r.as_str(), 0)).collect();
        let mut oldest = Duration::ZERO;
        for (j, listed) in judged {
            let reason = match j.decision {
                Decision::Candidate(r) => r,
                Decision::Release(_) => {
                    // Direct evidence the deletion path has not handled yet (unless it is
                    // retrying it with backoff: adding it now would skip the backoff).
                    if self.ctx.queue.num_requeues(&j.entry.podref) == 0 {
                        self.ctx.queue.add(j.entry.podref.clone());
                    }
                    continue;
                }
                Decision::Keep(_) => continue,
            };
            report.candidates += 1;
            *counts.entry(reason.as_str()).or_default() += 1;
            let key = (j.pool.clone(), j.entry.key.clone(), j.entry.id.clone());
            seen.insert(key.clone());
            let first = self.first_seen.entry(key).or_insert((started, reason));
            if first.1 != reason {
                *first = (started, reason);
            }
            // The pod listed the address after the grace began (between sweeps): it begins again.
            if let Some(at) = listed.filter(|at| *at > first.0) {
                first.0 = at;
            }
            let age = started.saturating_duration_since(first.0);
            oldest = oldest.max(age);
            let grace = match reason {
                Reason::PodMissing => self.config.missing_pod_grace,
                _ => self.config.leak_grace,
            };
            if age >= grace {
                due.push((j, reason));
            } else {
                let at = first.0 + grace;
                report.next_due = Some(report.next_due.map_or(at, |n| n.min(at)));
            }
        }
        self.first_seen.retain(|k, _| seen.contains(k));
        for (reason, n) in counts {
            self.ctx
                .metrics
                .candidates
                .get_or_create(&reason.to_string().into())
                .set(n);
        }
        self.ctx
            .metrics
            .oldest_candidate_seconds
            .set(oldest.as_secs() as i64);

        let mut confirmed: Vec<ReleaseRequest> = Vec::new();
        // Many pods gone (e.g. while no replica ran): one consistent list confirms them all.
        let missing = due.iter().filter(|(_, r)| *r == Reason::PodMissing).count();
        // Pools whose candidates could not be confirmed this time: their hold is not over.
        let mut unconfirmed: HashSet<String> = HashSet::new();
        let existing = if missing > CONFIRM_BY_GET {
            match self.existing_podrefs().await {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(error = %e, "could not list pods to confirm leaks; next sweep");
                    for (j, r) in &due {
                        if *r == Reason::PodMissing {
                            unconfirmed.insert(j.pool.clone());
                        }
                    }
                    due.retain(|(_, r)| *r != Reason::PodMissing);
                    None
                }
            }
        } else {
            None
        };
        for (j, reason) in due {
            let check = match &existing {
                Some(pods) if reason == Reason::PodMissing => Ok(!pods.contains(&j.entry.podref)),
                _ => self.confirm(&j, reason).await,
            };
            match check {
                Ok(true) => confirmed.push(ReleaseRequest {
                    judged: j,
                    reason,
                    deleted_at: None,
                    write: Default::default(),
                }),
                Ok(false) => {}
                Err(e) => {
                    unconfirmed.insert(j.pool.clone());
                    tracing::warn!(podref = %j.entry.podref, error = %e, "could not confirm a leak; next sweep")
                }
            }
        }

        // The blast-radius breaker.
        let mut per_pool: BTreeMap<String, usize> = BTreeMap::new();
        for r in &confirmed {
            *per_pool.entry(r.judged.pool.clone()).or_default() += 1;
        }
        let mut held = HashSet::new();
        for (pool, n) in &per_pool {
            let (size, uid) = pool_sizes.get(pool).cloned().unwrap_or_default();
            if size > BREAKER_MIN_POOL && (*n as f64) > self.config.max_release_ratio * size as f64
            {
                let note = format!(
                    "sweep would release {n} of {size} allocations (more than --max-release-ratio {}); \
                     held until an operator raises the ratio",
                    self.config.max_release_ratio
                );
                if !self.held_pools.contains(pool) {
                    tracing::warn!(%pool, n, size, "breaker holds the sweep of this pool");
                    let label = super::report::pool_label(&self.config.namespace, pool);
                    self.ctx
                        .metrics
                        .breaker_holds
                        .get_or_create(&label.into())
                        .inc();
                    self.ctx
                        .events
                        .breaker_hold(&self.config.namespace, pool, &uid, note)
                        .await;
                }
                held.insert(pool.clone());
            }
        }
        self.held_pools = still_held(&self.held_pools, held.clone(), &unconfirmed);
        confirmed.retain(|r| !held.contains(&r.judged.pool));
        report.held_pools = held.into_iter().collect();
        report.held_pools.sort();
        report.released = confirmed.len();
        if !confirmed.is_empty() {
            let outcomes = self.ctx.writer.release(confirmed.clone()).await;
            self.ctx
                .events
                .released_all(confirmed.iter().zip(&outcomes))
                .await;
            for outcome in outcomes {
                if let Err(e) = outcome {
                    tracing::warn!(error = %e, "sweep release failed; next sweep retries");
                }
            }
        }
        report.reservations_deleted = self.sweep_reservations(started).await;
        self.ctx
            .metrics
            .sweep_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        report
    }

    /// Reservations of pods that are gone and hold no allocation any more (e.g. a delete that
    /// failed earlier): after the grace period and a GET confirming the pod is gone.
    async fn sweep_reservations(&mut self, now: Instant) -> usize {
        let orphans = self
            .ctx
            .state
            .read()
            .expect("state lock")
            .orphan_reservations();
        let current: std::collections::HashSet<(String, String)> = orphans
            .iter()
            .map(|(n, u, _)| (n.clone(), u.clone()))
            .collect();
        self.orphan_reservations_seen
            .retain(|k, _| current.contains(k));
        let mut due = Vec::new();
        for (name, uid, podref) in orphans {
            let first = *self
                .orphan_reservations_seen
                .entry((name.clone(), uid.clone()))
                .or_insert(now);
            if now.saturating_duration_since(first) < self.config.leak_grace {
                continue;
            }
            let (ns, pod) = podref.split_once('/').unwrap_or(("", &podref));
            match Api::<Pod>::namespaced(self.ctx.client.clone(), ns)
                .get_metadata_opt(pod)
                .await
            {
                Ok(None) => due.push(ReservationDelete {
                    name,
                    uid,
                    podref,
                    ip: None,
                    pool: None,
                }),
                Ok(Some(_)) => {}
                Err(e) => {
                    tracing::warn!(reservation = %name, error = %e, "could not confirm the pod is gone")
                }
            }
        }
        let n = due.len();
        if n > 0 {
            tracing::info!(count = n, "deleting orphaned reservations");
            self.ctx.writer.delete_reservations(due);
        }
        n
    }

    /// Every pod's `namespace/name`, from one consistent list of metadata, paged.
    async fn existing_podrefs(&self) -> Result<HashSet<String>, kube::Error> {
        let pods = Api::<Pod>::all(self.ctx.client.clone());
        let mut podrefs = HashSet::new();
        for_each_listed(
            CONFIRM_PAGE,
            |page| {
                let pods = pods.clone();
                async move { pods.list_metadata(&page).await }
            },
            |p| {
                if let (Some(ns), Some(name)) = (p.metadata.namespace, p.metadata.name) {
                    podrefs.insert(format!("{ns}/{name}"));
                }
            },
        )
        .await?;
        Ok(podrefs)
    }

    /// A fresh look at the pod before releasing on the sweep's evidence.
    async fn confirm(&self, j: &Judged, reason: Reason) -> Result<bool, kube::Error> {
        let (ns, name) = j
            .entry
            .podref
            .split_once('/')
            .unwrap_or(("", &j.entry.podref));
        let pod = Api::<Pod>::namespaced(self.ctx.client.clone(), ns)
            .get_opt(name)
            .await?;
        let Some(pod) = pod else {
            return Ok(reason == Reason::PodMissing);
        };
        let networks = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NETWORK_STATUS_ANNOTATION))
            .and_then(|s| parse_network_status(s).ok());
        let live = LivePod {
            uid: pod.metadata.uid.as_deref().unwrap_or_default(),
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            networks: networks.as_deref(),
        };
        let pool_networks = {
            let st = self.ctx.state.read().expect("state lock");
            st.pool_networks(&j.pool)
        };
        let fresh = reclaim::decide(
            &Allocation {
                ip: j.entry.ip,
                sandbox_id: &j.entry.id,
                podref: &j.entry.podref,
                ifname: j.entry.ifname.as_deref(),
            },
            &PoolContext {
                networks: pool_networks.as_deref(),
            },
            &PodKnowledge {
                live: Some(live),
                ..Default::default()
            },
            &self.config.reclaim,
        );
        Ok(fresh == Decision::Candidate(reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(pools: &[&str]) -> HashSet<String> {
        pools.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn a_hold_survives_a_sweep_that_could_not_confirm_its_candidates() {
        let before = set(&["a", "b"]);
        // "a" could not be confirmed (the list failed): still held, not reported anew later.
        assert_eq!(still_held(&before, set(&[]), &set(&["a"])), set(&["a"]));
        // Confirmed and under the ratio: the hold is over.
        assert_eq!(still_held(&before, set(&[]), &set(&[])), set(&[]));
        // Held now, whatever came before.
        assert_eq!(
            still_held(&set(&[]), set(&["c"]), &set(&["c"])),
            set(&["c"])
        );
    }
}
