//! The leak sweep: every allocation is judged; garbage must stay garbage for the grace period
//! and survive a fresh GET of its pod before it is released, and a sweep that would free too
//! much of a pool is held for an operator.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

use super::reservation_sweep::{ReservationGraces, ReservationSightings};
use crate::index::APPROVE_HOLD_ANNOTATION;
use crate::ipam::PodKey;
use crate::paged::for_each_listed;
use crate::release::ReleaseRequest;
use crate::rules::approvals::Approvals;
use crate::rules::breaker::{BREAKER_WINDOW, Breaker, NewHold, Outgrown};
use crate::rules::grace::{Candidate, GraceClock, Graces, Tally};
use crate::rules::{
    self, Allocation, Decision, Judged, LivePod, PodKnowledge, PodPhase, PoolContext, Reason,
    ReclaimConfig,
};

/// Up to this many missing pods are confirmed by a GET each, more by one list.
const CONFIRM_BY_GET: usize = 8;
/// Pods' metadata per page of the confirming list.
const CONFIRM_PAGE: u32 = 500;

/// Sweep settings.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// How long an allocation must be seen as garbage before it is released.
    pub graces: Graces,
    /// Largest share of a pool the sweeps may release within `BREAKER_WINDOW`.
    pub max_release_ratio: f64,
    /// The decision rules.
    pub reclaim: ReclaimConfig,
    /// Namespace of the pools (for breaker Events).
    pub namespace: String,
    /// Namespace of the node agents' sandbox inventories.
    pub inventory_namespace: String,
    /// How long a live entry must be seen without its reservation before one is created.
    pub reservation_repair_grace: std::time::Duration,
}

/// The sweep's memory between runs: when each candidate was first seen, and what the breaker
/// held.
pub struct Sweeper {
    ctx: super::ctx::Ctx,
    config: SweepConfig,
    clock: GraceClock,
    /// Reservations orphaned, left behind or missing, with when each was first seen.
    reservations: ReservationSightings,
    breaker: Breaker,
    /// Operators' approvals of holds, between sweeps.
    approvals: Approvals,
}

/// What the sweep needs of a pool.
#[derive(Debug, Clone)]
struct PoolFacts {
    /// Its allocations (the breaker's base).
    size: usize,
    /// Its uid (for Events on it).
    uid: String,
    /// An operator's approval of its hold, if any.
    approval: Option<String>,
}

/// `pool`'s uid, for Events on it (empty when unknown).
fn uid_of(pool_sizes: &HashMap<String, PoolFacts>, pool: &str) -> String {
    pool_sizes
        .get(pool)
        .map(|s| s.uid.clone())
        .unwrap_or_default()
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
    /// Releases of pods no replica saw deleted, fenced to the node whose agent lists their
    /// sandbox live instead.
    pub fenced: usize,
    /// Reservation deletes queued (orphans, and ones left behind for live pods).
    pub reservations_deleted: usize,
    /// When the next candidate's grace ends (sweep again then, not a whole interval later).
    pub next_due: Option<Instant>,
}

impl Sweeper {
    /// A sweeper with no memory yet.
    pub fn new(ctx: super::ctx::Ctx, config: SweepConfig) -> Sweeper {
        Sweeper {
            ctx,
            config,
            clock: GraceClock::default(),
            reservations: ReservationSightings::default(),
            breaker: Breaker::default(),
            approvals: Approvals::default(),
        }
    }

    /// Forgets when candidates and reservation cases were first seen (on a change of
    /// leadership): a grace counts only what one term of leadership saw, never a sighting
    /// from an earlier term with a standby's gap in between.
    pub fn forget_sightings(&mut self) {
        self.clock = GraceClock::default();
        self.reservations = ReservationSightings::default();
    }

    /// One sweep.
    pub async fn sweep(&mut self) -> SweepReport {
        let started = Instant::now();
        let (candidates, pool_sizes) = self.candidates();
        let mut report = SweepReport {
            candidates: candidates.len(),
            ..Default::default()
        };
        let mut per_pool: HashMap<String, i64> = HashMap::new();
        for c in &candidates {
            *per_pool.entry(c.judged.pool.clone()).or_default() += 1;
        }
        let tally = self.clock.tally(candidates, started, &self.config.graces);
        report.next_due = tally.next_due;
        self.export(&tally);
        let (confirmed, mut unconfirmed) = self.confirm_due(tally.due).await;
        let (fences, confirmed) = self.place_unseen(confirmed, &mut unconfirmed).await;
        let confirmed = self
            .hold(confirmed, &pool_sizes, &unconfirmed, &mut report)
            .await;
        self.export_pools(&pool_sizes, &per_pool);
        report.released = confirmed.len();
        report.fenced = fences.len();
        self.release(fences.into_iter().chain(confirmed).collect())
            .await;
        self.use_approvals(&pool_sizes).await;
        let graces = ReservationGraces {
            leak: self.config.graces.leak,
            repair: self.config.reservation_repair_grace,
        };
        let ns = &self.config.namespace;
        let reservations = self
            .reservations
            .sweep(&self.ctx, graces, ns, started)
            .await;
        report.reservations_deleted = reservations.deletes;
        self.ctx
            .metrics
            .sweep_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        report
    }

    /// Every leak candidate under one short lock, with the pools' sizes and uids; direct
    /// evidence the deletion path has not handled yet is queued for it instead.
    fn candidates(&self) -> (Vec<Candidate>, HashMap<String, PoolFacts>) {
        let st = self.ctx.index.read().expect("index lock");
        let sizes = st
            .pools()
            .all()
            .iter()
            .map(|(n, p)| {
                let facts = PoolFacts {
                    size: p.entries.len(),
                    uid: p.uid.clone(),
                    approval: p.approval.clone(),
                };
                (n.clone(), facts)
            })
            .collect();
        let mut candidates = Vec::new();
        for j in st.judge_leaks(&self.config.reclaim) {
            match j.decision {
                Decision::Candidate(reason) => {
                    let last_listed = st.pods().last_listed(&j.entry.podref, j.entry.ip);
                    candidates.push(Candidate {
                        judged: j,
                        reason,
                        last_listed,
                    });
                }
                // Unless it is retrying it with backoff: adding it now would skip the backoff.
                Decision::Release(_) if self.ctx.queue.num_requeues(&j.entry.podref) == 0 => {
                    self.ctx.queue.add(j.entry.podref.clone());
                }
                Decision::Release(_) | Decision::Keep(_) => {}
            }
        }
        (candidates, sizes)
    }

    /// The candidate gauges.
    fn export(&self, tally: &Tally) {
        for (reason, n) in &tally.counts {
            let label = reason.to_string().into();
            self.ctx.metrics.candidates.get_or_create(&label).set(*n);
        }
        let oldest = tally.oldest.as_secs() as i64;
        self.ctx.metrics.oldest_candidate_seconds.set(oldest);
    }

    /// Per pool: candidates, and whether the breaker holds it (every pool's series, so a pool
    /// whose candidates went reads 0).
    fn export_pools(&self, pools: &HashMap<String, PoolFacts>, candidates: &HashMap<String, i64>) {
        let m = &self.ctx.metrics;
        for pool in pools.keys() {
            let l = super::report::pool_label(&self.config.namespace, pool).into();
            let n = candidates.get(pool).copied().unwrap_or(0);
            m.pool_leak_candidates.get_or_create(&l).set(n);
            let held = self.breaker.held().contains(pool);
            m.pool_held.get_or_create(&l).set(i64::from(held));
        }
    }

    /// The due candidates whose pod a fresh look confirms, and the pools whose candidates
    /// could not be confirmed this time.
    async fn confirm_due(
        &self,
        mut due: Vec<(Judged, Reason)>,
    ) -> (Vec<ReleaseRequest>, HashSet<String>) {
        let mut confirmed = Vec::new();
        let mut unconfirmed: HashSet<String> = HashSet::new();
        // Many pods gone (e.g. while no replica ran): one consistent list confirms them all.
        let missing = due.iter().filter(|(_, r)| *r == Reason::PodMissing).count();
        let existing = if missing > CONFIRM_BY_GET {
            match self.existing_podrefs().await {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(error = %e, "could not list pods to confirm leaks; next sweep");
                    for (j, _) in due.iter().filter(|(_, r)| *r == Reason::PodMissing) {
                        unconfirmed.insert(j.pool.clone());
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
                    cooldown: None,
                    write: Default::default(),
                }),
                Ok(false) => {}
                Err(e) => {
                    unconfirmed.insert(j.pool.clone());
                    tracing::warn!(podref = %j.entry.podref, error = %e, "could not confirm a leak; next sweep")
                }
            }
        }
        (confirmed, unconfirmed)
    }

    /// Splits off the releases whose sandbox a node agent lists live for a pod no replica saw
    /// deleted: fenced to that node instead (not the breaker's: nothing is freed). When the
    /// inventories cannot be read, no release of a pod gone or replaced goes this time (those
    /// pools count as unconfirmed), unless reading them is forbidden (RBAC of an older install):
    /// then they go as before the inventories, with a warning.
    async fn place_unseen(
        &self,
        confirmed: Vec<ReleaseRequest>,
        unconfirmed: &mut HashSet<String>,
    ) -> (Vec<ReleaseRequest>, Vec<ReleaseRequest>) {
        let wanted = crate::release::inventories::wanted(&confirmed);
        if wanted.is_empty() {
            return (Vec::new(), confirmed);
        }
        let ns = &self.config.inventory_namespace;
        let read =
            crate::release::inventories::sightings(&self.ctx.client, Some(ns), &wanted).await;
        drop(wanted);
        // Forbidden is a setting to fix, said until a sweep reads them; another error is retried
        // by the next sweep (its releases wait, and the leak alerts see them wait).
        let forbidden = matches!(&read, Err(kube::Error::Api(s)) if s.code == 403);
        let unreadable = &self.ctx.metrics.sandbox_inventories_unreadable;
        unreadable.set(i64::from(forbidden));
        match read {
            Ok(sightings) => super::unseen::place(confirmed, &sightings),
            Err(kube::Error::Api(s)) if s.code == 403 => {
                tracing::warn!(namespace = %ns, error = %s.message, "may not list the node agents' sandbox inventories (grant list on leases there): releasing without them");
                (Vec::new(), confirmed)
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not list the node agents' sandbox inventories; releases of pods gone or replaced wait for the next sweep");
                let (wait, rest): (Vec<_>, Vec<_>) = confirmed
                    .into_iter()
                    .partition(|r| crate::release::inventories::placeable(r.reason));
                unconfirmed.extend(wait.into_iter().map(|r| r.judged.pool));
                (Vec::new(), rest)
            }
        }
    }

    /// The blast-radius breaker: drops the releases of held pools, and reports a new hold
    /// (log line, metric, Event on the pool).
    async fn hold(
        &mut self,
        mut confirmed: Vec<ReleaseRequest>,
        pool_sizes: &HashMap<String, PoolFacts>,
        unconfirmed: &HashSet<String>,
        report: &mut SweepReport,
    ) -> Vec<ReleaseRequest> {
        let mut per_pool: BTreeMap<String, usize> = BTreeMap::new();
        for r in &confirmed {
            *per_pool.entry(r.judged.pool.clone()).or_default() += 1;
        }
        let size = |pool: &str| pool_sizes.get(pool).map_or(0, |s| s.size);
        let ratio = self.config.max_release_ratio;
        let in_force = self.approvals.in_force(
            pool_sizes
                .iter()
                .map(|(p, f)| (p.as_str(), f.approval.as_deref())),
        );
        let bounds = Approvals::bounds(&in_force);
        let mut verdict =
            self.breaker
                .judge(&per_pool, size, ratio, unconfirmed, &bounds, Instant::now());
        for hold in std::mem::take(&mut verdict.new) {
            self.report_hold(hold, pool_sizes).await;
        }
        for outgrown in &verdict.outgrown {
            self.report_outgrown(outgrown, pool_sizes).await;
        }
        // An approval is used up (removed, pinned by its value) before its releases go: no
        // later sweep, nor a new leader, can use it again; one that cannot be removed releases
        // nothing now.
        let mut spent = BTreeSet::new();
        for pool in &verdict.approved {
            if self.use_approval(pool, &in_force[pool].value).await {
                spent.insert(pool.clone());
            }
        }
        let settled = self
            .approvals
            .settle(&in_force, &verdict, &spent, unconfirmed);
        confirmed.retain(|r| settled.goes(&r.judged.pool));
        report.held_pools = settled.held.iter().cloned().collect();
        for (pool, bound) in &settled.released_once {
            let n = per_pool.get(pool).copied().unwrap_or(0);
            tracing::warn!(%pool, releases = n, "an operator approved the breaker's hold: releasing once");
            let uid = uid_of(pool_sizes, pool);
            let bound = match bound {
                Some(at_most) => format!("at most {at_most}"),
                None => "any number".to_string(),
            };
            let note = format!(
                "an operator approved the held sweep ({bound}): releasing {n} allocations once (the next sweep over --max-release-ratio {ratio} is held again)"
            );
            let events = &self.ctx.events;
            events
                .hold_approved(&self.config.namespace, pool, &uid, note)
                .await;
        }
        for pool in &settled.unneeded {
            tracing::info!(%pool, "approval of a hold found with nothing held; removed so that it cannot approve a later hold");
        }
        confirmed
    }

    /// Reports a new hold: log line, metric, Warning Event on the pool.
    async fn report_hold(&self, hold: NewHold, pool_sizes: &HashMap<String, PoolFacts>) {
        let ratio = self.config.max_release_ratio;
        let NewHold {
            pool,
            releases,
            size,
            recent,
        } = hold;
        let minutes = BREAKER_WINDOW.as_secs() / 60;
        let (earlier, until) = match recent {
            0 => (String::new(), " or raises the ratio".to_string()),
            n => (
                format!(", after {n} released by the sweeps of the last {minutes} min"),
                format!(", raises the ratio, or those are {minutes} min old"),
            ),
        };
        let note = format!(
            "sweep would release {releases} of {size} allocations{earlier} (more than --max-release-ratio {ratio}); \
             held until an operator approves it once (ipreclaim approve-hold --pool {pool} --releases {releases}){until}"
        );
        tracing::warn!(%pool, n = releases, size, "breaker holds the sweep of this pool");
        let label = super::report::pool_label(&self.config.namespace, &pool);
        let holds = &self.ctx.metrics.breaker_holds;
        holds.get_or_create(&label.into()).inc();
        let uid = uid_of(pool_sizes, &pool);
        let events = &self.ctx.events;
        events
            .breaker_hold(&self.config.namespace, &pool, &uid, note)
            .await;
    }

    /// Reports an approval that names fewer releases than the sweep would make: log line and
    /// a Warning Event on the pool (the hold's reason; the approval is used up).
    async fn report_outgrown(&self, o: &Outgrown, pool_sizes: &HashMap<String, PoolFacts>) {
        let Outgrown {
            pool,
            approved,
            releases,
        } = o;
        tracing::warn!(%pool, approved, releases, "the breaker's hold grew past the operator's approval: still held");
        let note = format!(
            "the approval lets at most {approved} allocations go, and the sweep would release {releases}: still held; \
             approve again to release them (ipreclaim approve-hold --pool {pool} --releases {releases})"
        );
        let uid = uid_of(pool_sizes, pool);
        let events = &self.ctx.events;
        events
            .approval_outgrown(&self.config.namespace, pool, &uid, note)
            .await;
    }

    /// Uses up `pool`'s approval `value`: removes the annotation, pinned by its value (one
    /// removed already, which a lagging index still shows, or given again meanwhile, is not
    /// this one); whether it did.
    async fn use_approval(&mut self, pool: &str, value: &str) -> bool {
        if self.ctx.writer.is_dry_run() {
            self.approvals.judged_in_dry_run(pool, value);
            return true;
        }
        let annotation = vec![(APPROVE_HOLD_ANNOTATION.to_string(), value.to_string())];
        match self.ctx.writer.remove_annotations(pool, annotation).await {
            Ok(()) => true,
            Err(kube::Error::Api(s)) if s.code == 422 => {
                tracing::info!(%pool, "the approval read is gone or was given again; judged at the next sweep");
                false
            }
            Err(e) => {
                tracing::warn!(%pool, error = %e, "could not use up the approval (removing it); its hold waits for the next sweep");
                false
            }
        }
    }

    /// Uses up the approvals this sweep judged and did not act on.
    async fn use_approvals(&mut self, pools: &HashMap<String, PoolFacts>) {
        for pool in self.approvals.take_unused() {
            if let Some(value) = pools.get(&pool).and_then(|f| f.approval.clone()) {
                self.use_approval(&pool, &value).await;
            }
        }
    }

    /// Hands the confirmed releases to the writer, reports them, and tells the breaker what
    /// was freed.
    async fn release(&mut self, confirmed: Vec<ReleaseRequest>) {
        if confirmed.is_empty() {
            return;
        }
        let outcomes = self.ctx.writer.release(confirmed.clone()).await;
        self.ctx
            .events
            .released_all(confirmed.iter().zip(&outcomes))
            .await;
        let mut freed: BTreeMap<&str, usize> = BTreeMap::new();
        for (request, outcome) in confirmed.iter().zip(&outcomes) {
            match outcome {
                Ok(o) if o.freed() => *freed.entry(&request.judged.pool).or_default() += 1,
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "sweep release failed; next sweep retries"),
            }
        }
        let now = Instant::now();
        for (pool, n) in freed {
            self.breaker.record(pool, n, now);
        }
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
                if let Some(pod) = PodKey::of_meta(&p.metadata) {
                    podrefs.insert(pod.podref());
                }
            },
        )
        .await?;
        Ok(podrefs)
    }

    /// A fresh look at the pod before releasing on the sweep's evidence.
    async fn confirm(&self, j: &Judged, reason: Reason) -> Result<bool, kube::Error> {
        let key = PodKey::lenient(&j.entry.podref);
        let pod = Api::<Pod>::namespaced(self.ctx.client.clone(), &key.namespace)
            .get_opt(&key.name)
            .await?;
        let Some(pod) = pod else {
            return Ok(reason == Reason::PodMissing);
        };
        let networks =
            crate::ipam::network_status::network_status_of(pod.metadata.annotations.as_ref());
        let live = LivePod {
            uid: pod.metadata.uid.as_deref().unwrap_or_default(),
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            networks: networks.as_deref(),
        };
        let pool_networks = {
            let st = self.ctx.index.read().expect("index lock");
            st.networks().of_pool(&j.pool).map(<[String]>::to_vec)
        };
        let fresh = rules::decide(
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
