//! Kubernetes Events, with whereabouts' reasons.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Reporter};
use tokio::sync::mpsc;

use super::recorder::Recorder;
use crate::ipam::fence::FenceRecord;
use crate::release::budget::{Budgets, WriteKind};
use crate::release::types::{EntryWrite, PodRef, ReleaseError, ReleaseOutcome, ReleaseRequest};
use crate::rules::Reason;
use crate::rules::fence::{is_deleted_before_stopped, is_unseen_deletion};
use crate::telemetry::WriteMetrics;

/// whereabouts' reason for a release that was written.
pub const GC_DONE: &str = "IPAddressGarbageCollected";
/// whereabouts' reason for a release that failed for good.
pub const GC_FAILED: &str = "IPAddressGarbageCollectionFailed";
/// ipreclaim's reason for a release decided under `--dry-run`.
pub const GC_DRY_RUN: &str = "IPAddressGarbageCollectionDryRun";
/// ipreclaim's reason for addresses kept allocated because the pod's node may still run it.
pub const GC_FENCED: &str = "IPAddressGarbageCollectionFenced";
/// ipreclaim's reason for a sweep held by the blast-radius breaker.
pub const BREAKER_HOLD: &str = "IPAddressGarbageCollectionHeld";
/// ipreclaim's reason for a live entry found without its reservation (created again, or
/// found made meanwhile for another pod).
pub const RESERVATION_MISSING: &str = "ReservationMissing";
/// ipreclaim's reason for a held sweep an operator approved once.
pub const HOLD_APPROVED: &str = "IPAddressGarbageCollectionHoldApproved";
/// ipreclaim's reason for a fenced or cooling entry removed or rewritten by a write that is
/// not ipreclaim's (a second cleaner in the cluster).
pub const MARKED_ENTRY_REMOVED: &str = "MarkedEntryRemovedByOtherWriter";
/// Event reason: two or more live pods list the address on one network.
pub const IP_ADDRESS_DUPLICATE: &str = "IPAddressDuplicate";

/// Events waiting to be published at most; beyond that new ones are dropped (and counted).
const QUEUE: usize = 10_000;
/// Retries of one Event back off between these delays, for at most `RETRY_FOR`.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);
const RETRY_FOR: Duration = Duration::from_secs(120);

/// Publishes Events from a bounded queue, in order, retrying what fails for a while (an
/// apiserver restart); nobody waits for an Event, and what cannot be published is counted.
#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<Queued>,
    metrics: WriteMetrics,
}

/// What an Event tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tells {
    /// A release this replica wrote: published also once it no longer leads, so a leader cut
    /// off right after a release still reports it (a standby that takes over finds the entry
    /// gone and reports nothing).
    Released,
    /// A decision or a finding: published only while this replica leads.
    Decided,
    /// The breaker's verdict on a pool (held, approved, approval outgrown): published like a
    /// decision, each as an Event of its own, since its numbers change from one to the next
    /// (the recorder folds a repeat into the earlier Event and keeps that one's note).
    Verdict,
}

/// An Event waiting to be published, about `reference`.
type Queued = (Event, ObjectReference, Tells);

/// Why fences lifted, for their release Events: the note names `why`, the action ends in
/// `action` (one action per why: the recorder keeps the first note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifted<'a> {
    /// What lifted them.
    pub why: &'a str,
    /// The action's suffix.
    pub action: &'a str,
}

fn pod_reference(pod: &PodRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(pod.key.namespace.clone()),
        name: Some(pod.key.name.clone()),
        uid: (!pod.uid.is_empty()).then(|| pod.uid.clone()),
        ..Default::default()
    }
}

/// Whether asking again may help (not when the apiserver refused the Event itself).
fn retryable(e: &kube::Error) -> bool {
    if crate::release::budget::is_not_leader(e) {
        // A demoted leader's Events about its decisions are dropped, not sent once it leads
        // again (release Events pass the gate).
        return false;
    }
    match e {
        kube::Error::Api(s) => s.code == 429 || s.code >= 500,
        _ => true,
    }
}

async fn publish_queued(
    (client, reporter): (Client, Reporter),
    mut rx: mpsc::Receiver<Queued>,
    budgets: Budgets,
    metrics: WriteMetrics,
) {
    let merging = Recorder::new(client.clone(), reporter.clone());
    while let Some((event, reference, tells)) = rx.recv().await {
        let unmerged;
        let recorder = match tells {
            Tells::Verdict => {
                unmerged = Recorder::new(client.clone(), reporter.clone());
                &unmerged
            }
            Tells::Released | Tells::Decided => &merging,
        };
        let started = Instant::now();
        let mut delay = RETRY_FIRST;
        loop {
            let publish = || recorder.publish(&event, &reference);
            let sent = match tells {
                Tells::Released => budgets.send_report(publish).await,
                Tells::Decided | Tells::Verdict => budgets.send(WriteKind::Event, publish).await,
            };
            match sent {
                Ok(()) => {
                    metrics.events_published.inc();
                    break;
                }
                Err(e) if retryable(&e) && started.elapsed() < RETRY_FOR => {
                    tracing::debug!(error = %e, reason = %event.reason, "publishing an event failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
                Err(e) => {
                    metrics.events_dropped.inc();
                    tracing::warn!(error = %e, reason = %event.reason, object = ?reference.name, "could not publish event; dropped");
                    break;
                }
            }
        }
    }
}

/// Released addresses by the pod and network their Event names, and the end of the cooldown
/// they went into (if any).
type ByNetwork = std::collections::BTreeMap<(PodRef, String, Option<jiff::Timestamp>), Vec<IpAddr>>;

/// Adds `req`'s address to its pod and network's Event if it was released (the end of a
/// cooldown is no release: it was reported when the cooldown began).
fn add_released(
    by_network: &mut ByNetwork,
    req: &ReleaseRequest,
    outcome: &Result<ReleaseOutcome, ReleaseError>,
) {
    let Ok(o) = outcome else { return };
    if o.freed() && req.write != EntryWrite::EndCooldown {
        let j = &req.judged;
        by_network
            .entry((j.pod.clone(), j.network.clone(), o.cooling_until()))
            .or_default()
            .push(j.entry.ip);
    }
}

/// What a release Event adds for a cooldown: to the note, and to the action (the recorder keeps
/// the first note of an action).
fn cooldown_extra(cooling: Option<jiff::Timestamp>) -> (String, String) {
    match cooling {
        Some(until) => (format!(" (in cooldown until {until})"), " Cooldown".into()),
        None => Default::default(),
    }
}

impl Events {
    /// A publisher reporting as `instance` (the pod name of this replica), within `budgets`
    /// (after every pool patch and reservation delete that waits); starts its queue.
    pub fn new(client: Client, instance: &str, budgets: Budgets, metrics: WriteMetrics) -> Self {
        Self::flushed(client, instance, budgets, metrics).0
    }

    /// Like [`new`](Self::new), with the publisher's task: it ends once every clone of the
    /// publisher is dropped and what was queued is published (or given up), so a command that
    /// exits after its writes can wait for its Events.
    pub fn flushed(
        client: Client,
        instance: &str,
        budgets: Budgets,
        metrics: WriteMetrics,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let reporter = Reporter {
            controller: "ipreclaim".into(),
            instance: Some(instance.into()),
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let task = tokio::spawn(publish_queued(
            (client, reporter),
            rx,
            budgets,
            metrics.clone(),
        ));
        (Events { tx, metrics }, task)
    }

    async fn publish(
        &self,
        type_: EventType,
        reason: &str,
        action: String,
        note: String,
        reference: &ObjectReference,
    ) {
        self.publish_telling(Tells::Decided, type_, reason, action, note, reference)
            .await;
    }

    async fn publish_telling(
        &self,
        tells: Tells,
        type_: EventType,
        reason: &str,
        action: String,
        note: String,
        reference: &ObjectReference,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            // The recorder merges repeats of the same action and keeps the first note:
            // one action per address keeps each address's message.
            action,
            secondary: None,
        };
        if self.tx.try_send((event, reference.clone(), tells)).is_err() {
            self.metrics.events_dropped.inc();
            tracing::warn!(reason, object = ?reference.name, "event queue full; event dropped");
        }
    }

    /// A release was written.
    pub async fn released(&self, pod: &PodRef, ips: &[IpAddr], network: &str) {
        self.publish_released(pod, ips, network, None, None).await;
    }

    /// The node agent released what a dead sandbox held; the message names the reason and the
    /// sandbox (one Event per sandbox: the recorder would merge repeats into the first note).
    pub async fn released_sandbox_gone(
        &self,
        pod: &PodRef,
        ips: &[IpAddr],
        network: &str,
        sandbox: &str,
        cooling: Option<jiff::Timestamp>,
    ) {
        self.publish_released(pod, ips, network, Some(sandbox), cooling)
            .await;
    }

    async fn publish_released(
        &self,
        pod: &PodRef,
        ips: &[IpAddr],
        network: &str,
        dead_sandbox: Option<&str>,
        cooling: Option<jiff::Timestamp>,
    ) {
        let (cool_note, cool_action) = cooldown_extra(cooling);
        let extra = match dead_sandbox {
            Some(sb) => {
                let short = &sb[..sb.len().min(12)];
                let note = format!(" ({}: sandbox {short} is gone)", Reason::SandboxGone);
                Some((note + &cool_note, format!(" {short}{cool_action}")))
            }
            None => cooling.map(|_| (cool_note, cool_action)),
        };
        self.publish_released_with(pod, ips, network, extra).await;
    }

    /// A release Event whose note and action carry `extra` (note suffix, action suffix).
    async fn publish_released_with(
        &self,
        pod: &PodRef,
        ips: &[IpAddr],
        network: &str,
        extra: Option<(String, String)>,
    ) {
        let list = ips
            .iter()
            .map(|ip| ip.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let mut note = format!("successful cleanup of IP address [{list}] from network {network}");
        let mut action = format!("Release {network}");
        if let Some((n, a)) = extra {
            note.push_str(&n);
            action.push_str(&a);
        }
        let reference = pod_reference(pod);
        self.publish_telling(
            Tells::Released,
            EventType::Normal,
            GC_DONE,
            action,
            note,
            &reference,
        )
        .await;
    }

    /// One Event per pod and network for the releases that were written, naming every address,
    /// and one per fenced address.
    pub async fn released_all<'a>(
        &self,
        results: impl IntoIterator<
            Item = (&'a ReleaseRequest, &'a Result<ReleaseOutcome, ReleaseError>),
        >,
    ) {
        self.released_all_because(results, None).await;
    }

    /// Like [`released_all`](Self::released_all); releases of lifted fences name why the fence
    /// lifted when `lifted` is given (one action per why: the recorder keeps the first note).
    pub async fn released_all_because<'a>(
        &self,
        results: impl IntoIterator<
            Item = (&'a ReleaseRequest, &'a Result<ReleaseOutcome, ReleaseError>),
        >,
        lifted: Option<Lifted<'_>>,
    ) {
        let mut by_network = ByNetwork::default();
        let mut fenced = Vec::new();
        for (req, outcome) in results {
            // The audit line of each address written, beside its Event.
            let why = lifted.map(|l| l.why);
            if let Some(audit) =
                crate::release::reports::audit::AuditRecord::of(req, outcome, why, None)
            {
                audit.emit();
            }
            if let (Ok(ReleaseOutcome::Fenced), EntryWrite::Fence(r)) = (outcome, &req.write) {
                fenced.push((req.judged.pod.clone(), req.judged.entry.ip, r.clone()));
            }
            add_released(&mut by_network, req, outcome);
        }
        for ((pod, network, cooling), ips) in by_network {
            let (cool_note, cool_action) = cooldown_extra(cooling);
            let extra = match lifted {
                Some(l) => Some((
                    format!(" (fence lifted: {}){cool_note}", l.why),
                    format!(" {}{cool_action}", l.action),
                )),
                None => cooling.map(|_| (cool_note, cool_action)),
            };
            self.publish_released_with(&pod, &ips, &network, extra)
                .await;
        }
        for (pod, ip, record) in fenced {
            self.fenced(&pod, ip, &record, false).await;
        }
    }

    /// Releases written by hand (`ipreclaim release`): one Event per pod and network naming
    /// every address and `how` (the command), and one audit line per address whose evidence
    /// says it was done by hand, and what the rules say of the pod.
    pub async fn released_by_hand<'a>(
        &self,
        results: impl IntoIterator<
            Item = (&'a ReleaseRequest, &'a Result<ReleaseOutcome, ReleaseError>),
        >,
        how: &str,
    ) {
        let mut by_network = ByNetwork::default();
        for (req, outcome) in results {
            if let Some(mut audit) =
                crate::release::reports::audit::AuditRecord::of(req, outcome, None, None)
            {
                audit.evidence = format!("released by hand ({how}); {}", audit.evidence);
                audit.emit();
            }
            add_released(&mut by_network, req, outcome);
        }
        for ((pod, network, cooling), ips) in by_network {
            let (cool_note, cool_action) = cooldown_extra(cooling);
            let extra = (
                format!(" (released by hand: {how}){cool_note}"),
                format!(" Manual{cool_action}"),
            );
            self.publish_released_with(&pod, &ips, &network, Some(extra))
                .await;
        }
    }

    /// A release would have been written (dry-run).
    /// `cooldown`: how long the release would keep the address out of the pool (zero: none).
    pub async fn dry_run(
        &self,
        pod: &PodRef,
        ip: IpAddr,
        network: &str,
        reason: Reason,
        cooldown: std::time::Duration,
    ) {
        let mut note =
            format!("dry-run: would clean up IP address [{ip}] from network {network} ({reason})");
        if !cooldown.is_zero() {
            note.push_str(&format!(
                " and keep it out of the pool for {} (release cooldown)",
                humantime::format_duration(cooldown)
            ));
        }
        self.publish(
            EventType::Normal,
            GC_DRY_RUN,
            format!("Release {ip}"),
            note,
            &pod_reference(pod),
        )
        .await;
    }

    /// A deleted pod's address stays allocated: its node may still run the sandbox.
    pub async fn fenced(&self, pod: &PodRef, ip: IpAddr, record: &FenceRecord, dry_run: bool) {
        let dry = if dry_run { "dry-run: " } else { "" };
        let note = if is_deleted_before_stopped(&record.why) || is_unseen_deletion(&record.why) {
            format!(
                "{dry}IP address [{ip}] from network {} stays allocated: the pod on node {} was \
                 {}; released once its node agent reports the pod's sandboxes gone, the settle \
                 period (or that grace period plus the margin, if longer) has passed since, its \
                 Node is deleted, or the fence times out",
                record.network, record.node, record.why
            )
        } else {
            format!(
                "{dry}IP address [{ip}] from network {} stays allocated: the pod was deleted while \
                 its node {} was not Ready ({}) and may still run it; released once the node has \
                 been Ready for the settle period, its node agent reports the pod's sandboxes \
                 gone, its Node is deleted, or the fence times out",
                record.network, record.node, record.why
            )
        };
        // Gated even when written: a fence a standby completed after a takeover can also be
        // the cut-off leader's, and each would report it.
        self.publish(
            EventType::Warning,
            GC_FENCED,
            format!("Fence {ip}"),
            note,
            &pod_reference(pod),
        )
        .await;
    }

    /// A Warning on `reference` (the IPPool, or the entry's IPFence record): the marked entry of
    /// address `ip` was removed or rewritten by another writer (one action per address).
    pub async fn marked_entry_removed(
        &self,
        reference: &ObjectReference,
        ip: IpAddr,
        note: String,
    ) {
        let action = format!("Watch {ip}");
        self.publish(
            EventType::Warning,
            MARKED_ENTRY_REMOVED,
            action,
            note,
            reference,
        )
        .await;
    }

    /// A Warning about bad input on `reference` (one action per reason: the recorder merges
    /// repeats of it).
    pub async fn warning(&self, reference: &ObjectReference, reason: &str, note: &str) {
        self.publish(
            EventType::Warning,
            reason,
            "Read".into(),
            note.into(),
            reference,
        )
        .await;
    }

    /// Releases for a pod failed for good.
    pub async fn failed(&self, pod: &PodRef, cause: &str) {
        let note = format!(
            "failed to garbage collect addresses for pod {}: {cause}",
            pod.key
        );
        self.publish(
            EventType::Warning,
            GC_FAILED,
            "Release".into(),
            note,
            &pod_reference(pod),
        )
        .await;
    }

    /// The breaker held a pool's sweep.
    pub async fn breaker_hold(&self, namespace: &str, pool: &str, uid: &str, note: String) {
        let what = (EventType::Warning, BREAKER_HOLD, "Sweep");
        self.on_pool(what, namespace, pool, uid, note).await;
    }

    /// The breaker held a node agent's releases of dead sandboxes' entries in a pool (the
    /// sweep's reason, another action).
    pub async fn release_held(&self, namespace: &str, pool: &str, uid: &str, note: String) {
        let what = (EventType::Warning, BREAKER_HOLD, "Release");
        self.on_pool(what, namespace, pool, uid, note).await;
    }

    /// The breaker still holds a pool's sweep: the operator's approval names fewer releases
    /// (the hold's reason, action `Approve`).
    pub async fn approval_outgrown(&self, namespace: &str, pool: &str, uid: &str, note: String) {
        let what = (EventType::Warning, BREAKER_HOLD, "Approve");
        self.on_pool(what, namespace, pool, uid, note).await;
    }

    /// A Normal Event on a pool whose held sweep an operator approved once.
    pub async fn hold_approved(&self, namespace: &str, pool: &str, uid: &str, note: String) {
        let what = (EventType::Normal, HOLD_APPROVED, "Sweep");
        self.on_pool(what, namespace, pool, uid, note).await;
    }

    /// A Warning on a pool one of whose live entries (address `ip`) had no reservation.
    pub async fn reservation_missing(
        &self,
        namespace: &str,
        pool: &str,
        uid: &str,
        ip: IpAddr,
        note: String,
    ) {
        let action = format!("Repair {ip}");
        let what = (EventType::Warning, RESERVATION_MISSING, action.as_str());
        self.on_pool(what, namespace, pool, uid, note).await;
    }

    /// An Event on a pool: `what` is its type, reason and action.
    async fn on_pool(
        &self,
        what: (EventType, &'static str, &str),
        namespace: &str,
        pool: &str,
        uid: &str,
        note: String,
    ) {
        let (kind, reason, action) = what;
        let reference = ObjectReference {
            api_version: Some("whereabouts.cni.cncf.io/v1alpha1".into()),
            kind: Some("IPPool".into()),
            namespace: Some(namespace.into()),
            name: Some(pool.into()),
            uid: (!uid.is_empty()).then(|| uid.into()),
            ..Default::default()
        };
        let tells = Tells::Verdict;
        self.publish_telling(tells, kind, reason, action.into(), note, &reference)
            .await;
    }
}
