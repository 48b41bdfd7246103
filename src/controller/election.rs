//! Standing for the Lease: how long a replica that just started waits before it stands (a
//! running standby takes over first), the Lease manager, and the gate every write passes. The
//! timing rules are `leadership`'s, pure; this is their async shell.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::{Api, Client};
use kube_lease_manager::LeaseManager;
use tokio::sync::watch as tokio_watch;
use tokio::task::JoinHandle;

use super::ControllerArgs;
use super::leadership;

/// Whether this replica leads, the gate every write passes, and the tasks that keep them (to
/// abort at shutdown).
pub type Leadership = (
    tokio_watch::Receiver<bool>,
    Arc<leadership::Gate>,
    Vec<JoinHandle<()>>,
);

/// Whether this replica leads, the gate every write passes (see [`leadership`]), and the
/// tasks that keep them (to abort at shutdown).
pub async fn leadership(
    client: Client,
    args: &ControllerArgs,
    identity: &str,
) -> anyhow::Result<Leadership> {
    if !args.leader_election {
        let always = (tokio_watch::channel(true).1, leadership::Gate::always());
        return Ok((always.0, always.1, Vec::new()));
    }
    let namespace = args
        .lease_namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .unwrap_or_else(|| args.whereabouts_namespace.clone());
    let duration = args.lease_duration.as_secs().max(3);
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&namespace)
        .with_identity(identity)
        .with_duration(duration)
        // Renew halfway: well within the renew deadline (two thirds) after which writes stop.
        .with_grace((duration / 2).max(1))
        .build()
        .await
        .with_context(|| format!("lease {namespace}/{}", args.lease_name))?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    let lease = LeaseRef {
        leases: leases.clone(),
        name: args.lease_name.clone(),
        duration: Duration::from_secs(duration),
    };
    let (spec, wait) = lease.newcomer_wait(identity).await;
    if !wait.is_zero() {
        tracing::info!(holder = ?spec.holder_identity, wait = ?wait, "another replica held the Lease lately: standing for it after a wait, so that a running standby takes over first");
    }
    let (says_tx, rx) = tokio_watch::channel(false);
    let renewed = spec.renew_time.as_ref().map(|t| t.0);
    let standing = tokio::spawn(lease.stand(wait, renewed, manager, says_tx));
    let gate = Arc::new(leadership::Gate::default());
    let (leads, tasks) = leadership::spawn(
        leases,
        args.lease_name.clone(),
        identity.to_owned(),
        Duration::from_secs(duration),
        rx,
        gate.clone(),
    );
    let mut tasks: Vec<_> = tasks.into();
    // Aborted at shutdown: the manager's receiver goes with it, and the manager lets go.
    tasks.push(standing);
    Ok((leads, gate, tasks))
}

/// The Lease this replica stands for.
struct LeaseRef {
    leases: Api<Lease>,
    name: String,
    duration: Duration,
}

impl LeaseRef {
    /// The Lease's spec, `None` when it cannot be read within five seconds.
    async fn read(&self) -> Option<LeaseSpec> {
        let lease = tokio::time::timeout(Duration::from_secs(5), self.leases.get_opt(&self.name));
        match lease.await {
            Ok(Ok(lease)) => Some(lease.and_then(|l| l.spec).unwrap_or_default()),
            _ => None,
        }
    }

    /// How long a replica that just started waits before it stands, and the spec it judged.
    /// Unreadable: as if another held it lately. Free: it may be a standby's force-release of
    /// an expired Lease (kube-lease-manager then pauses before it acquires): read it again.
    async fn newcomer_wait(&self, identity: &str) -> (LeaseSpec, Duration) {
        let judge = |spec: &LeaseSpec| {
            leadership::newcomer_wait(
                spec.holder_identity.as_deref(),
                spec.renew_time.as_ref().map(|t| t.0),
                identity,
                self.duration,
                jiff::Timestamp::now(),
            )
        };
        let full = leadership::newcomer_full_wait(self.duration);
        match self.read().await {
            None => (Default::default(), full),
            Some(spec) if spec.holder_identity.as_deref().is_none_or(str::is_empty) => {
                tokio::time::sleep(leadership::FORCE_RELEASE_PAUSE).await;
                match self.read().await {
                    None => (spec, full),
                    Some(again) => {
                        let wait = judge(&again);
                        (again, wait)
                    }
                }
            }
            Some(spec) => {
                let wait = judge(&spec);
                (spec, wait)
            }
        }
    }

    /// Waits `wait` (less if the Lease is let go before it expires), then stands for it and
    /// passes on what the manager says. A Lease its holder let go before it expired (a replica
    /// shut down) is stood for at once; one freed after expiry is a standby's first step to
    /// take it: it goes first.
    async fn stand(
        self,
        wait: Duration,
        mut renewed: Option<jiff::Timestamp>,
        manager: LeaseManager,
        says_tx: tokio_watch::Sender<bool>,
    ) {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            tokio::time::sleep(leadership::CONFIRM_EVERY.min(left)).await;
            let read = tokio::time::timeout(
                leadership::CONFIRM_EVERY * 2,
                self.leases.get_opt(&self.name),
            );
            let Ok(Ok(lease)) = read.await else {
                continue;
            };
            let spec = lease.and_then(|l| l.spec).unwrap_or_default();
            let held = spec
                .holder_identity
                .as_deref()
                .is_some_and(|h| !h.is_empty());
            if held {
                renewed = spec.renew_time.map(|t| t.0).or(renewed);
            } else if leadership::let_go_before_expiry(
                renewed,
                self.duration,
                jiff::Timestamp::now(),
            ) {
                break;
            }
        }
        tracing::info!("standing for the Lease");
        let (mut says, task) = manager.watch().await;
        tokio::spawn(async move {
            if let Ok(Err(e)) = task.await {
                tracing::error!(error = %e, "leader election stopped");
            }
        });
        loop {
            says_tx.send_replace(*says.borrow_and_update());
            if says.changed().await.is_err() {
                return;
            }
        }
    }
}
