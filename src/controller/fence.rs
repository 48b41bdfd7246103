//! Fencing: the loop that lifts fences into releases, completes fences whose entry rewrite is
//! missing and removes records left over (the Nodes' readiness is `index::nodes`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::api::lenient::Lenient;
use crate::api::{IPFence, ObjectId};
use crate::index::{FenceObject, FencedEntry, Index, NodeIndex, PendingFence, Slot};
use crate::ipam::PoolEntry;
use crate::ipam::fence::FenceRecord;
use crate::lifts::FenceBook;
use crate::release::reports::events::Lifted;
use crate::release::{EntryWrite, ReleaseOutcome, ReleaseRequest};
use crate::rules::fence::{
    AgentReports, FenceIdentity, FencePolicy, Lift, Moment, NodeReadiness, Rejected, agent_says,
};
use crate::rules::{Decision, Judged, PodRef, Reason};
use crate::seen::{Once, Seen};

/// How often fences are checked for lifting.
pub const LIFT_EVERY: Duration = Duration::from_secs(1);

/// A fence record for a release the deletion path decided, if the pod's node is not Ready;
/// `grace_seconds`: the deleted pod's termination grace period, if known.
pub fn record_for(
    judged: &Judged,
    node: String,
    why: String,
    grace_seconds: Option<i64>,
) -> FenceRecord {
    FenceRecord {
        podref: judged.entry.podref.clone(),
        uid: judged.pod.uid.clone(),
        node,
        why,
        network: judged.network.clone(),
        since: jiff::Timestamp::now(),
        grace_seconds,
    }
}

/// A request about the fenced (or pending) entry `entry` of `pool` with `record`.
fn fence_request(
    pool: &str,
    entry: &PoolEntry,
    record: &FenceRecord,
    write: EntryWrite,
) -> ReleaseRequest {
    let network = record.network_or(pool);
    ReleaseRequest {
        judged: Judged {
            pool: pool.to_owned(),
            entry: entry.clone(),
            decision: Decision::Release(Reason::PodDeleted),
            network,
            pod: PodRef::from_podref(&record.podref, record.uid.clone()),
            node: Some(record.node.clone()),
        },
        reason: Reason::PodDeleted,
        deleted_at: None,
        cooldown: None,
        write,
    }
}

/// How long a fence record may wait for its entry's rewrite before this replica writes it (the
/// writer that wrote the record may be rewriting it right now).
const PENDING_GRACE: Duration = Duration::from_secs(10);
/// How long a fence record must look left over before it is deleted (its lift's own delete
/// may be on its way).
const STALE_GRACE: Duration = Duration::from_secs(5);

/// Lifts fences (leader only), completes fences whose entry rewrite is missing, and removes
/// records left over.
pub struct Lifter {
    pub(crate) ctx: super::ctx::Ctx,
    pub(crate) view: Arc<RwLock<NodeIndex>>,
    /// `None`: fencing is off, and fences an earlier run set are lifted.
    pub(crate) policy: Option<FencePolicy>,
    /// What the lifter keeps across passes (first sightings, reports made).
    pub(crate) book: FenceBook,
    /// When this process first saw each pending or left-over record (by name).
    pub(crate) records_seen: Seen<String>,
    /// Entries whose last write failed: not tried again before their backoff.
    pub(crate) backoff: podlife::backoff::Backoff<Slot>,
    /// The apiserver's clock, which `--fence-timeout` counts on (set with a timeout).
    pub(crate) server_clock: Option<Arc<super::server_clock::ServerClock>>,
    /// The fence objects, read fresh before a lift on the settle.
    pub(crate) fences: kube::Api<Lenient<IPFence>>,
    /// Fences (object uid) whose settle lift a fresh read holds on the agent's word: said once.
    pub(crate) held_on_read: Once<String>,
    /// Fences (object uid) whose settle lift a fresh read found deleted: said once.
    pub(crate) deleted_on_read: Once<String>,
}

/// First and longest wait before a failed fence write (lift or completion) is tried again.
pub const WRITE_BACKOFF: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// What a fresh read of a fence to lift on the settle says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FreshFence {
    /// No valid "still present" from the node agent: the lift goes.
    Silent,
    /// The node agent's "still present": the fence stays.
    Present,
    /// Deleted, not by this controller: the lift waits for the fence watch.
    Deleted,
}

/// A settle lift a fresh read of its fence keeps back: what the read said, and whose.
struct Kept {
    read: FreshFence,
    uid: String,
    ip: std::net::IpAddr,
    podref: String,
}

/// What one pass found in the index.
struct Found {
    fenced: Vec<FencedEntry>,
    /// Fenced entries (pool, key) whose address the live pod of the fenced podref, another
    /// pod than the deleted one, lists: never lifted (a lift removes the entry).
    listed_by_replacement: HashSet<Slot>,
    pending: Vec<PendingFence>,
    stale_records: Vec<ObjectId>,
}

/// What one pass makes of the fences.
#[derive(Default)]
struct Lifts {
    /// Lifts to write.
    lifted: Vec<ReleaseRequest>,
    /// Of those, the ones the node agent's report lifted (their Events say so).
    by_agent: HashSet<Slot>,
    /// Of those, the ones lifted on the Node cache's word: each node is read fresh before
    /// they go.
    by_node: HashMap<Slot, NodeLift>,
    /// Fences (and pending fences) that stay.
    staying: i64,
    /// The age of the oldest fence that stays.
    oldest: Duration,
    /// Fences whose lift the node agent's "still present" keeps back.
    kept_by_agent: i64,
}

/// A lift on the Node cache's word: the node, why, and when the cache had seen it Ready (the
/// settle's start) when the lift was judged.
struct NodeLift {
    node: String,
    why: Lift,
    ready_seen: Option<Instant>,
}

/// The fence record and object of `r` if it is a lift on its node's settle.
fn settle_lift<'a>(
    r: &'a ReleaseRequest,
    by_node: &HashMap<Slot, NodeLift>,
) -> Option<(&'a FenceRecord, &'a ObjectId)> {
    match &r.write {
        EntryWrite::Unfence(record, object)
            if by_node
                .get(&Slot::new(&r.judged.pool, &r.judged.entry.key))
                .is_some_and(|l| l.why == Lift::NodeSettled) =>
        {
            Some((record, object))
        }
        _ => None,
    }
}

/// What the fence `object` of `record` (address `ip`), as `read` fresh, says of its lift
/// on the settle (`None`: it cannot tell now; the lift waits).
fn fresh_fence(
    record: &FenceRecord,
    object: &ObjectId,
    ip: std::net::IpAddr,
    read: Option<Lenient<IPFence>>,
) -> Option<FreshFence> {
    let status = match read {
        None => return Some(FreshFence::Deleted),
        Some(Lenient::Valid(f)) if f.metadata.uid.as_deref() != Some(object.uid.as_str()) => {
            tracing::info!(%ip, podref = %record.podref, fence = %object.name, "the fence to lift on the settle is another object now; the lift waits for the fence watch");
            return None;
        }
        Some(Lenient::Valid(f)) => f.status.unwrap_or_default(),
        Some(Lenient::Invalid { error, .. }) => {
            tracing::warn!(%ip, podref = %record.podref, fence = %object.name, %error, "the fence to lift on the settle cannot be read; the lift waits");
            return None;
        }
    };
    let identity = FenceIdentity {
        node: &record.node,
        pod_uid: &record.uid,
        fence_uid: &object.uid,
    };
    Some(
        if agent_says(identity, &AgentReports::from(&status)).present {
            FreshFence::Present
        } else {
            FreshFence::Silent
        },
    )
}

/// The fenced entries whose address a replacement lists (see [`replacement_lists`]).
fn listed_by_replacement(st: &Index, fenced: &[FencedEntry]) -> HashSet<Slot> {
    fenced
        .iter()
        .filter(|f| replacement_lists(st, &f.record, f.entry.ip))
        .map(|f| Slot::new(&f.pool, &f.entry.key))
        .collect()
}

/// Whether the live pod of the fenced podref, another pod than the deleted one, lists `ip`
/// on the fence's network (any, when the record names none): its replacement got the address,
/// and a lift would free it under it.
fn replacement_lists(st: &Index, record: &FenceRecord, ip: std::net::IpAddr) -> bool {
    let lists = |a: &crate::ipam::NetworkAttachment| {
        a.ips.contains(&ip) && (record.network.is_empty() || *a.name == record.network)
    };
    st.pods().live(&record.podref).is_some_and(|live| {
        !live.uid.is(&record.uid)
            && live
                .networks
                .as_deref()
                .is_some_and(|n| n.iter().any(lists))
    })
}

/// Reads fenced podrefs (and the fences of nodes) at most this many at a time before their
/// lifts.
const LIFT_READS: usize = 16;
/// Fences per page of a node's list: one is under 2 KB of text (the CRD bounds the agent's
/// reports).
const FENCE_PAGE: u32 = 500;
/// A node's fences to read before a settle are listed from this many on, read by name below.
const LIST_FROM: usize = 4;

impl Lifter {
    /// One pass: updates the fence gauges and, on the leader, releases what lifts, completes
    /// pending fences and clears records whose entry the node's own CNI DEL freed.
    pub async fn pass(&mut self, leader: bool) {
        let mono = Instant::now();
        let server = self.server_clock.as_ref().map(|c| c.now(mono));
        // A timeout waits for the apiserver's clock; without one, nothing times out.
        let timeouts = !matches!(server, Some(None));
        // Set once the pass is done (its lifts written): a scrape that reads 0 knows a pass
        // has judged the fences by the apiserver's clock.
        let waiting = self.ctx.metrics.fence_timeouts_waiting_for_clock.clone();
        let now = Moment {
            wall: server.flatten().unwrap_or_else(jiff::Timestamp::now),
            mono,
        };
        let found = {
            let st = self.ctx.index.read().expect("index lock");
            let fenced = st.fenced();
            Found {
                listed_by_replacement: listed_by_replacement(&st, &fenced),
                fenced,
                pending: st.pending_fences(),
                stale_records: st.stale_fence_objects(),
            }
        };
        let lifts = self.lifts(&found, leader, now, timeouts);
        let oldest = lifts.oldest.as_secs() as i64;
        self.ctx.metrics.oldest_fence_seconds.set(oldest);
        let (complete, stale) = self.due_records(&found, now.mono);
        // Lifts that do not go this pass are still fences: held by a fresh read of the
        // agent's word (`held`), in backoff, or waiting for a node or the fence watch.
        let (mut held, mut not_going) = (0, 0);
        if leader {
            let lifting = lifts.lifted.len();
            let mut writes = lifts.lifted;
            writes.extend(complete);
            let writes = self.not_in_backoff(writes, now.mono);
            let writes = self.confirm_nodes(writes, &lifts.by_node).await;
            let (writes, h) = self.confirm_agent_silent(writes, &lifts.by_node).await;
            held = h as i64;
            let going = writes
                .iter()
                .filter(|w| matches!(w.write, EntryWrite::Unfence(..)))
                .count();
            not_going = lifting.saturating_sub(going) as i64;
            self.write(writes, &lifts.by_agent).await;
        }
        self.ctx
            .metrics
            .fenced_addresses
            .set(lifts.staying + not_going);
        self.ctx
            .metrics
            .fences_held_by_node_agent
            .set(lifts.kept_by_agent + held);
        waiting.set(i64::from(!timeouts));
        if leader {
            self.backoff.gc();
            self.clean(stale);
        }
    }

    /// Which fences lift now (on the leader), how many stay, and the oldest's age; `timeouts`:
    /// whether `--fence-timeout` may lift (the apiserver's clock is known). Reports what is new
    /// (rejected agent reports, fences the agent keeps, replacements) once.
    fn lifts(&mut self, found: &Found, leader: bool, now: Moment, timeouts: bool) -> Lifts {
        let policy = self.policy.map(|p| FencePolicy {
            timeout: p.timeout.filter(|_| timeouts),
            ..p
        });
        let (decided, ready_seen) = {
            let v = self.view.read().expect("node view lock");
            self.ctx.metrics.unready_nodes.set(v.unready() as i64);
            let decided = self.book.judge(
                &found.fenced,
                &found.listed_by_replacement,
                &v,
                policy.as_ref(),
                leader,
                now,
            );
            // What the settles were judged on, for the fresh reads to compare.
            let ready_seen: HashMap<String, Option<Instant>> = decided
                .lifts
                .iter()
                .filter(|(_, why)| *why == Lift::NodeSettled)
                .map(|(i, _)| &found.fenced[*i].record.node)
                .map(|n| (n.clone(), v.node(n).and_then(|r| r.ready_seen)))
                .collect();
            (decided, ready_seen)
        };
        let fenced = &found.fenced;
        for (i, why) in decided.newly_rejected {
            self.report_rejected(&fenced[i], why);
        }
        for i in decided.newly_kept_by_agent {
            let f = &fenced[i];
            tracing::info!(ip = %f.entry.ip, podref = %f.record.podref, node = %f.record.node, fence_uid = %f.object.uid, "fence held: the node agent there still sees a sandbox of the deleted pod (its kubelet is stopping it)");
        }
        for (i, why) in decided.newly_kept_for_replacement {
            let f = &fenced[i];
            tracing::warn!(pool = %f.pool, ip = %f.entry.ip, podref = %f.record.podref, lifted = why.as_str(), "fence not lifted: a replacement of the deleted pod lists the address (the entry may be its own); lift it by hand once resolved");
        }
        let mut out = Lifts {
            staying: found.pending.len() as i64 + decided.staying,
            oldest: decided.oldest,
            kept_by_agent: decided.kept_by_agent as i64,
            ..Default::default()
        };
        for (i, why) in decided.lifts {
            let f = &fenced[i];
            let pool = &f.pool;
            tracing::info!(%pool, ip = %f.entry.ip, podref = %f.record.podref, node = %f.record.node, lifted = why.as_str(), "fence lifts");
            let slot = Slot::new(pool, &f.entry.key);
            match why {
                Lift::SandboxesGone => {
                    out.by_agent.insert(slot);
                }
                Lift::NodeSettled | Lift::NodeDeleted | Lift::OutOfService => {
                    let node = f.record.node.clone();
                    let ready_seen = ready_seen.get(&node).copied().flatten();
                    out.by_node.insert(
                        slot,
                        NodeLift {
                            node,
                            why,
                            ready_seen,
                        },
                    );
                }
                Lift::TimedOut | Lift::FencingOff => {}
            }
            let write = EntryWrite::Unfence(f.record.clone(), f.object.clone());
            out.lifted
                .push(fence_request(pool, &f.entry, &f.record, write));
        }
        out
    }

    /// Logs and counts a node agent report on fence `f` that does not count (once per fence
    /// and why).
    fn report_rejected(&self, f: &FencedEntry, why: Rejected) {
        let reports = [&f.evidence.sandboxes_gone, &f.evidence.sandboxes_present];
        let report = reports.into_iter().flatten().next();
        let (report_node, report_pod_uid, report_fence_uid) = report
            .map(|r| (r.node.as_str(), r.pod_uid.as_str(), r.fence_uid.as_str()))
            .unwrap_or_default();
        let fence_uid = f.object.uid.as_str();
        tracing::warn!(ip = %f.entry.ip, podref = %f.record.podref, node = %f.record.node, fence_uid, report_node, report_pod_uid, report_fence_uid, rejected = why.as_str(), "node agent report on a fence ignored");
        self.ctx
            .metrics
            .fence_evidence_rejected
            .get_or_create(&crate::telemetry::metrics::ReasonLabel {
                reason: why.as_str().into(),
            })
            .inc();
    }

    /// Lifts and completions whose entry's last write failed wait for its backoff (before any
    /// read is spent on them).
    fn not_in_backoff(&self, mut writes: Vec<ReleaseRequest>, now: Instant) -> Vec<ReleaseRequest> {
        let key = |r: &ReleaseRequest| Slot::new(&r.judged.pool, &r.judged.entry.key);
        writes.retain(|r| !self.backoff.is_in_backoff_since(&key(r), now));
        writes
    }

    /// Writes lifts and completions, reports them, and backs off what failed.
    async fn write(&self, writes: Vec<ReleaseRequest>, by_agent: &HashSet<Slot>) {
        let key = |r: &ReleaseRequest| Slot::new(&r.judged.pool, &r.judged.entry.key);
        let writes = self.confirm_lifts(writes).await;
        if writes.is_empty() {
            return;
        }
        let outcomes = self.ctx.writer.release(writes.clone()).await;
        let (agent, rest): (Vec<_>, Vec<_>) = writes
            .iter()
            .zip(&outcomes)
            .partition(|(r, _)| by_agent.contains(&key(r)));
        self.ctx.events.released_all(rest).await;
        let why = Lifted {
            why: Lift::SandboxesGone.as_str(),
            action: "SandboxesGone",
        };
        self.ctx.events.released_all_because(agent, Some(why)).await;
        for (r, o) in writes.iter().zip(&outcomes) {
            match o {
                Err(e) => {
                    self.backoff
                        .next(&key(r), Instant::now(), Some(e.to_string()));
                    if matches!(r.write, EntryWrite::Fence(_)) {
                        self.ctx.metrics.writes.fence_failures.inc();
                    }
                    tracing::warn!(ip = %r.judged.entry.ip, error = %e, retry_in = ?self.backoff.get(&key(r)), "writing a fence's entry failed; retried after a backoff")
                }
                Ok(ReleaseOutcome::AlreadyGone | ReleaseOutcome::Changed) => {
                    tracing::info!(ip = %r.judged.entry.ip, "a fence's entry was already freed or replaced")
                }
                Ok(_) => self.backoff.reset(&key(r)),
            }
        }
    }

    /// Lifts on the Node cache's word (settled, deleted, tainted out-of-service) go only if a
    /// fresh read of the node says the same: the Node watch may lag (the node went NotReady
    /// again, or its Node was created again). The read is recorded in the cache, so a node found
    /// not Ready starts its settle again, and so does one found Ready again after a NotReady
    /// the watch never delivered (a settle lift then waits for the new settle); a node that
    /// cannot be read keeps its lifts for the next pass.
    async fn confirm_nodes(
        &self,
        mut writes: Vec<ReleaseRequest>,
        by_node: &HashMap<Slot, NodeLift>,
    ) -> Vec<ReleaseRequest> {
        let key = |r: &ReleaseRequest| Slot::new(&r.judged.pool, &r.judged.entry.key);
        let mut nodes: Vec<&str> = writes
            .iter()
            .filter_map(|r| by_node.get(&key(r)))
            .map(|l| l.node.as_str())
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        // Per node: `None` when it could not be read, else what it says now (`None`: gone).
        let mut fresh: HashMap<String, Option<Option<NodeReadiness>>> = HashMap::new();
        for node in nodes {
            let began = Instant::now();
            let api = kube::Api::<crate::api::slim::NodeReadyView>::all(self.ctx.client.clone());
            let now = match api.get_opt(node).await {
                Ok(Some(n)) => {
                    let mut v = self.view.write().expect("node view lock");
                    v.upsert(&n, began);
                    Some(v.node(node).cloned())
                }
                Ok(None) => Some(None),
                Err(e) => {
                    tracing::warn!(%node, error = %e, "the node of a fence to lift could not be read; the lift waits");
                    None
                }
            };
            fresh.insert(node.to_owned(), now);
        }
        writes.retain(|r| {
            let Some(NodeLift {
                node,
                why,
                ready_seen,
            }) = by_node.get(&key(r))
            else {
                return true;
            };
            let Some(Some(now)) = fresh.get(node) else {
                return false;
            };
            let holds = match (why, now) {
                (_, None) => true,
                (Lift::OutOfService, Some(n)) => n.out_of_service,
                // Ready since no later than the settle was judged on.
                (Lift::NodeSettled, Some(n)) => {
                    n.out_of_service || (n.is_ready() && n.ready_seen <= *ready_seen)
                }
                _ => false,
            };
            if !holds {
                tracing::warn!(%node, ip = %r.judged.entry.ip, lifted = why.as_str(), "a fresh read of the node does not confirm the Node cache: the fence stays");
            }
            holds
        });
        writes
    }

    /// Lifts on the settle go only if a fresh read of their fence object holds no "still
    /// present" from the node agent: the fence watch may have missed it (a connection lost
    /// without a word is noticed only by the watch's idle check). A fence that cannot be read,
    /// or was replaced by another object since the index read it (a report on the new one is
    /// not bound to this fence), keeps its lift for the next pass; so does one deleted since:
    /// this controller removes a fenced entry before its record, so someone else deleted it,
    /// and once the fence watch shows that, the marked entry is left alone as a record deleted
    /// by hand is. The fences of a node with [`LIST_FROM`] or more to read are read with one
    /// list by its label, and one the list does not show (its label changed) by name; those of
    /// other nodes by name. Returns the lifts that go and how many the agent's word held.
    async fn confirm_agent_silent(
        &mut self,
        writes: Vec<ReleaseRequest>,
        by_node: &HashMap<Slot, NodeLift>,
    ) -> (Vec<ReleaseRequest>, usize) {
        use futures::StreamExt;
        // Found deleted on an earlier pass: gone for good, so not read again (the fence
        // watch's re-list ends the wait).
        let mut wanted: HashMap<String, HashSet<String>> = HashMap::new();
        for (record, object) in writes.iter().filter_map(|r| settle_lift(r, by_node)) {
            if !self.deleted_on_read.contains(&object.uid) {
                let names = wanted.entry(record.node.clone()).or_default();
                names.insert(object.name.clone());
            }
        }
        // A label selector is not indexed: a list costs the apiserver a look at every fence of
        // the namespace, so a node with a few fences to read has them read by name.
        wanted.retain(|_, names| names.len() >= LIST_FROM);
        let this = &*self;
        let listed: HashMap<String, Option<HashMap<String, Lenient<IPFence>>>> =
            futures::stream::iter(wanted)
                .map(|(node, names)| async move {
                    let fences = this.fences_on(&node, &names).await;
                    (node, fences)
                })
                .buffer_unordered(LIFT_READS)
                .collect()
                .await;
        let listed = &listed;
        let checked = futures::stream::iter(writes)
            .map(|r| async move {
                let Some((record, object)) = settle_lift(&r, by_node) else {
                    return Some(Ok(r));
                };
                let kept = |read| Kept {
                    read,
                    uid: object.uid.clone(),
                    ip: r.judged.entry.ip,
                    podref: record.podref.clone(),
                };
                if this.deleted_on_read.contains(&object.uid) {
                    return Some(Err(kept(FreshFence::Deleted)));
                }
                // The node's list failed: the lift waits (said where it failed).
                let on_node = match listed.get(&record.node) {
                    Some(list) => list.as_ref()?.get(&object.name),
                    None => None,
                };
                let read = match on_node {
                    Some(fence) => Some(fence.clone()),
                    None => this.read_fence(record, object).await?,
                };
                let read = fresh_fence(record, object, r.judged.entry.ip, read)?;
                Some(match read {
                    FreshFence::Silent => Ok(r),
                    _ => Err(kept(read)),
                })
            })
            .buffer_unordered(LIFT_READS)
            .collect::<Vec<_>>()
            .await;
        let (mut go, mut held, mut deleted) = (Vec::new(), Vec::new(), Vec::new());
        for c in checked.into_iter().flatten() {
            match c {
                Ok(r) => go.push(r),
                Err(k) if k.read == FreshFence::Deleted => deleted.push(k),
                Err(k) => held.push(k),
            }
        }
        for k in &held {
            if self.held_on_read.first(k.uid.clone()) {
                tracing::info!(fence_uid = %k.uid, ip = %k.ip, podref = %k.podref, "fence held: a fresh read shows the node agent on its node still sees a sandbox of the deleted pod (the fence watch had not shown it)");
            }
        }
        for k in &deleted {
            if self.deleted_on_read.first(k.uid.clone()) {
                tracing::warn!(fence_uid = %k.uid, ip = %k.ip, podref = %k.podref, "the fence to lift on the settle was deleted, not by this controller (it removes a fenced entry before its record): the lift waits for the fence watch, and the marked entry is then left alone");
            }
        }
        self.held_on_read
            .keep_only(|uid| held.iter().any(|k| k.uid == *uid));
        self.deleted_on_read
            .keep_only(|uid| deleted.iter().any(|k| k.uid == *uid));
        (go, held.len())
    }

    /// The fences labelled for `node` now, of those named in `names` (`None`: the list
    /// failed, and the lifts wait).
    async fn fences_on(
        &self,
        node: &str,
        names: &HashSet<String>,
    ) -> Option<HashMap<String, Lenient<IPFence>>> {
        use kube::ResourceExt;
        let labels = format!(
            "{}={}",
            crate::ipam::fence::NODE_LABEL,
            crate::ipam::fence::node_label_value(node)
        );
        let mut found = HashMap::new();
        let listed = crate::paged::for_each_listed(
            FENCE_PAGE,
            |params| {
                let params = params.labels(&labels);
                async move { self.fences.list(&params).await }
            },
            |fence: Lenient<IPFence>| {
                let name = fence.name_any();
                if names.contains(&name) {
                    found.insert(name, fence);
                }
            },
        )
        .await;
        match listed {
            Ok(()) => Some(found),
            Err(e) => {
                tracing::warn!(%node, fences = names.len(), error = %e, "the fences to lift on the node's settle could not be listed; the lifts wait");
                None
            }
        }
    }

    /// The fence `object` of `record` read by name (`None`: it cannot tell now; the lift
    /// waits); `Some(None)`: there is none.
    async fn read_fence(
        &self,
        record: &FenceRecord,
        object: &ObjectId,
    ) -> Option<Option<Lenient<IPFence>>> {
        match self.fences.get_opt(&object.name).await {
            Ok(read) => Some(read),
            Err(e) => {
                tracing::warn!(podref = %record.podref, fence = %object.name, error = %e, "the fence to lift on the settle could not be read; the lift waits");
                None
            }
        }
    }

    /// A lift is a release no deletion just triggered: the fenced podref is read fresh first
    /// (the pod cache may lag), and a lift whose address a replacement lists is dropped. A
    /// lift whose pod cannot be read waits for the next pass.
    async fn confirm_lifts(&self, writes: Vec<ReleaseRequest>) -> Vec<ReleaseRequest> {
        use futures::StreamExt;
        let checked = futures::stream::iter(writes)
            .map(|r| async move {
                let EntryWrite::Unfence(record, _) = &r.write else {
                    return Some(r);
                };
                match self.replaced_now(record, r.judged.entry.ip).await {
                    Ok(false) => Some(r),
                    Ok(true) => {
                        tracing::warn!(ip = %r.judged.entry.ip, podref = %record.podref, "fence not lifted: a replacement of the deleted pod lists the address (read fresh)");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(ip = %r.judged.entry.ip, podref = %record.podref, error = %e, "the fenced pod's name could not be read; the lift waits");
                        None
                    }
                }
            })
            .buffer_unordered(LIFT_READS)
            .collect::<Vec<_>>()
            .await;
        checked.into_iter().flatten().collect()
    }

    /// Reads the pod of `record`'s podref fresh into the index; whether a replacement lists
    /// `ip` (see [`replacement_lists`]).
    async fn replaced_now(
        &self,
        record: &FenceRecord,
        ip: std::net::IpAddr,
    ) -> Result<bool, kube::Error> {
        let pod = crate::ipam::PodKey::lenient(&record.podref);
        let api = kube::Api::<crate::api::slim::PodView>::namespaced(
            self.ctx.client.clone(),
            &pod.namespace,
        );
        let Some(p) = api.get_opt(&pod.name).await? else {
            return Ok(false);
        };
        let Some(uid) = p.metadata.uid.as_deref() else {
            return Ok(false);
        };
        let mut st = self.ctx.index.write().expect("index lock");
        st.upsert_pod(
            &record.podref,
            uid,
            crate::index::kinds::seen(&p),
            Instant::now(),
        );
        Ok(replacement_lists(&st, record, ip))
    }

    /// Deletes the records left over.
    fn clean(&self, stale: Vec<ObjectId>) {
        if stale.is_empty() {
            return;
        }
        for ObjectId { name, .. } in &stale {
            tracing::info!(record = %name, "fence record left over (its entry was freed by its node's CNI DEL, or replaced); deleting it");
        }
        self.ctx.writer.delete_fence_records(stale);
    }

    /// Pending fences to complete and left-over records to delete, each once it has waited
    /// its grace on this process's clock.
    fn due_records(&mut self, found: &Found, now: Instant) -> (Vec<ReleaseRequest>, Vec<ObjectId>) {
        let seen = &mut self.records_seen;
        let names: HashSet<&str> = found
            .pending
            .iter()
            .map(|p| p.object.name.as_str())
            .chain(found.stale_records.iter().map(|r| r.name.as_str()))
            .collect();
        seen.keep_only(|n| names.contains(n.as_str()));
        let mut waited = |name: &str, grace: Duration| seen.waited(name.to_owned(), now, grace);
        // A pending fence the deletion path is retrying is its own; others (a crash between
        // the two writes, a record of another replica) are completed here.
        let retrying = |o: &FenceObject| self.ctx.queue.num_requeues(&o.record.podref) > 0;
        let complete = found
            .pending
            .iter()
            .filter(|p| waited(&p.object.name, PENDING_GRACE) && !retrying(&p.object))
            .map(|PendingFence { pool, entry, object }| {
                tracing::info!(%pool, ip = %entry.ip, podref = %object.record.podref, "fence record without its entry's rewrite; writing it");
                let write = EntryWrite::Fence(object.record.clone());
                fence_request(pool, entry, &object.record, write)
            })
            .collect();
        let stale = found
            .stale_records
            .iter()
            .filter(|r| waited(&r.name, STALE_GRACE))
            .cloned()
            .collect();
        (complete, stale)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::api::{IPAllocation, IPPool, IPPoolSpec};
    use crate::index::PodSeen;

    /// web-0's entry 10 (192.0.2.10 on ns/net-a) fenced, and a live web-0 whose network-status
    /// lists `ip` on `network`, with `uid`.
    fn fenced_and_live(uid: &str, network: &str, ip: &str) -> Index {
        let mut st = Index::default();
        let entry = IPAllocation {
            id: "sb".into(),
            podref: "ns/web-0:fenced".into(),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        };
        let spec = IPPoolSpec {
            range: "192.0.2.0/24".into(),
            allocations: BTreeMap::from([("10".to_string(), entry)]),
        };
        st.upsert_pool(&IPPool::new("p", spec));
        let record = FenceRecord {
            podref: "ns/web-0".into(),
            uid: "old-uid".into(),
            node: "n".into(),
            why: "Ready=Unknown".into(),
            network: "ns/net-a".into(),
            since: jiff::Timestamp::now(),
            grace_seconds: None,
        };
        let object = FenceObject {
            name: "p-10".into(),
            uid: "f".into(),
            sandbox: "sb".into(),
            record,
            evidence: Default::default(),
        };
        st.upsert_fence_object("p", "10", object);
        st.set_pools_listed();
        let status = format!(r#"[{{"name":"{network}","interface":"net1","ips":["{ip}"]}}]"#);
        let annotations =
            BTreeMap::from([(crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(), status)]);
        let seen = PodSeen {
            annotations: Some(&annotations),
            node: None,
            terminal: false,
            mirror: false,
            grace_seconds: None,
        };
        st.upsert_pod("ns/web-0", uid, seen, Instant::now());
        st
    }

    fn kept(st: &Index) -> bool {
        let fenced = st.fenced();
        assert_eq!(fenced.len(), 1);
        !listed_by_replacement(st, &fenced).is_empty()
    }

    #[test]
    fn only_a_replacement_listing_the_address_on_the_fences_network_keeps_it() {
        assert!(kept(&fenced_and_live("new-uid", "ns/net-a", "192.0.2.10")));
        // The same address in another network's pool (a range used twice) is another address.
        assert!(!kept(&fenced_and_live("new-uid", "ns/net-b", "192.0.2.10")));
        assert!(!kept(&fenced_and_live("new-uid", "ns/net-a", "192.0.2.11")));
        // The deleted pod itself is not a replacement.
        assert!(!kept(&fenced_and_live("old-uid", "ns/net-a", "192.0.2.10")));
    }
}
