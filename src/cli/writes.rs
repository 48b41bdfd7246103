//! What the manual commands (`unfence`, `release`) share: the cluster indexed by the
//! controller's rules, a writer with no index (entries pinned by id and podref, deletes with
//! uid preconditions, reservations re-checked), Events as `ipreclaim-cli`, and waiting for all of
//! it before the process exits.

use std::process::ExitCode;
use std::sync::Arc;

use ipreclaim::index::Index;
use ipreclaim::release::manual::{Planned, kept_because};
use ipreclaim::release::writer::{self, WriterHandle};
use ipreclaim::release::{BudgetConfig, Budgets, Events, Writer};
use ipreclaim::release::{ReleaseError, ReleaseOutcome};
use ipreclaim::rules::KeepReason;
use ipreclaim::telemetry::WriteMetrics;
use kube::Client;
use podlife::clock::RealClock;

use super::exit;
use super::kube::KubeArgs;

/// The Events' reporting instance (the controller is `ipreclaim`).
pub const INSTANCE: &str = "ipreclaim-cli";

/// A person's command: a few writes, well under the controller's budgets.
const BUDGETS: BudgetConfig = BudgetConfig {
    pool_qps: 5.0,
    pool_burst: 10,
    reservation_qps: 10.0,
    reservation_burst: 20,
    write_qps: 20.0,
    write_burst: 40,
    max_in_flight: 8,
};

/// The flags every manual command takes.
#[derive(Debug, clap::Args)]
pub struct WriteArgs {
    /// Namespace of the IPPools, reservations and fences (where the whereabouts CNI writes them).
    #[arg(long, env = "WHEREABOUTS_NAMESPACE", default_value = "kube-system")]
    pub whereabouts_namespace: String,
    /// Print what would be done and write nothing (no pool patch, no delete, no Event).
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// A command's writer and Event publisher, and their tasks to wait for.
pub struct Session {
    /// The writer.
    pub writer: WriterHandle,
    /// The Event publisher (also the writer's).
    pub events: Events,
    drained: tokio::task::JoinHandle<()>,
    published: tokio::task::JoinHandle<()>,
}

/// The client and the cluster's index (read-only: nothing is written yet).
pub async fn index(args: &WriteArgs) -> anyhow::Result<(Client, Index)> {
    let client = args.kube.client(true).await?;
    let index =
        ipreclaim::scan::index_for_writes(client.clone(), &args.whereabouts_namespace).await?;
    Ok((client, index))
}

impl Session {
    /// Starts the writer and the Event publisher. Releases go into no cooldown (`unfence`
    /// never cools: `--all` is the uninstall path, which leaves no marked entry).
    pub fn start(client: Client, namespace: &str) -> Session {
        Session::start_cooling(client, namespace, std::time::Duration::ZERO)
    }

    /// [`Session::start`] whose releases go into a `cooldown` (zero: removed now).
    pub fn start_cooling(
        client: Client,
        namespace: &str,
        cooldown: std::time::Duration,
    ) -> Session {
        let metrics = WriteMetrics::new(&mut Default::default());
        let budgets = Budgets::new(BUDGETS, RealClock::shared(), metrics.clone());
        let (events, published) =
            Events::flushed(client.clone(), INSTANCE, budgets.clone(), metrics.clone());
        let w = Writer::new(client, namespace, budgets, events.clone(), metrics).cooldown(cooldown);
        let (writer, drained) = writer::spawn_drained(Arc::new(w));
        Session {
            writer,
            events,
            drained,
            published,
        }
    }

    /// Waits until everything handed in is written (patches, deletes and the looks after
    /// them) and every Event is published.
    pub async fn finish(self) {
        let Session {
            writer,
            events,
            drained,
            published,
        } = self;
        drop(writer);
        let _ = drained.await;
        drop(events);
        let _ = published.await;
    }
}

/// Runs a command's `main` on a runtime of its own, with logs as text on stderr: its exit
/// code, or 2 on an error (printed). (Every one-shot command: scan and approve-hold too.)
pub fn run<F>(main: F) -> ExitCode
where
    F: std::future::Future<Output = anyhow::Result<u8>>,
{
    ipreclaim::telemetry::init_logging(ipreclaim::telemetry::LogFormat::Text);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let result = runtime
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(main));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(exit::ERROR)
        }
    }
}

/// Splits `planned` into what goes ahead and what is refused unless `force`: what a live pod's
/// network-status lists, what the controller's rules keep, and whatever `more` says holds it.
/// Prints each refusal as `refused <place>: <what>; <why> (--force <overrides> anyway)`;
/// whether anything was refused.
pub fn refuse_unsafe(
    planned: Vec<Planned>,
    force: bool,
    what: impl Fn(&Planned) -> String,
    more: impl Fn(&Planned) -> Option<String>,
    overrides: &str,
) -> (Vec<Planned>, bool) {
    let mut go = Vec::new();
    let mut any_refused = false;
    for p in planned {
        let mut why = Vec::new();
        if !p.listed_by.is_empty() {
            why.push(format!(
                "live pod {} lists the address",
                p.listed_by.join(", ")
            ));
        }
        match p.kept {
            // Said above, with every pod that lists it.
            Some(KeepReason::ListedOnPod) if !p.listed_by.is_empty() => {}
            Some(k) => why.push(kept_because(k, &p.request.judged.entry.podref)),
            None => {}
        }
        why.extend(more(&p));
        if why.is_empty() || force {
            go.push(p);
            continue;
        }
        any_refused = true;
        let j = &p.request.judged;
        println!(
            "refused {}: {}; {} (--force {overrides} anyway)",
            place(&j.pool, j.entry.ip),
            what(&p),
            why.join("; ")
        );
    }
    (go, any_refused)
}

/// `what` (`pool`, address) as the commands print it.
pub fn place(pool: &str, ip: std::net::IpAddr) -> String {
    format!("{ip} (pool {pool})")
}

/// Prints what became of a write that did not go as asked (gone, changed, failed); whether
/// that is fine (the entry was freed meanwhile).
pub fn report_unwritten(at: &str, outcome: &Result<ReleaseOutcome, ReleaseError>) -> bool {
    match outcome {
        Ok(ReleaseOutcome::AlreadyGone) => {
            println!("already gone {at}: the entry was freed meanwhile");
            true
        }
        Ok(ReleaseOutcome::Changed) => {
            println!("left {at}: the entry changed meanwhile (another sandbox or pod holds it)");
            false
        }
        Ok(other) => {
            println!("left {at}: {other:?}");
            false
        }
        Err(e) => {
            println!("failed {at}: {e}");
            false
        }
    }
}
