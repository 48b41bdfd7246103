//! Reports: Kubernetes Events with whereabouts' reasons (`events`, written through
//! `recorder`), the audit trail (`audit`), and what a dry run reported (here).

pub mod audit;
pub mod events;
pub mod recorder;

use std::collections::HashSet;
use std::sync::Mutex;

use super::types::{EntryWrite, ReleaseOutcome, ReleaseRequest};
use super::writer::{Reply, Writer};

/// Under `--dry-run`, the allocations already reported: nothing is written, so they come back
/// on every sweep, and each is reported once.
#[derive(Debug, Default)]
pub struct DryRunReports(Mutex<HashSet<Reported>>);

/// An allocation reported under `--dry-run`: its pool, key and sandbox id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Reported {
    pool: String,
    key: String,
    id: String,
}

impl Writer {
    /// `--dry-run`: reports each decision once (Event, metric) and writes nothing.
    pub(super) async fn report_dry_run(&self, pool: &str, items: Vec<(ReleaseRequest, Reply)>) {
        for (req, reply) in items {
            let j = &req.judged;
            if let EntryWrite::Fence(record) = &req.write {
                if self.first_dry_run_report(pool, &j.entry.key, &j.entry.id) {
                    self.events.fenced(&j.pod, j.entry.ip, record, true).await;
                }
            } else if req.write == EntryWrite::EndCooldown {
                // Not a release: nothing to report (no cooldown starts or ends in a dry run).
            } else if self.first_dry_run_report(pool, &j.entry.key, &j.entry.id) {
                self.events
                    .dry_run(
                        &j.pod,
                        j.entry.ip,
                        &j.network,
                        req.reason,
                        self.pools.cooldown,
                    )
                    .await;
                self.metrics
                    .dry_run_releases
                    .get_or_create(&req.reason.as_str().to_string().into())
                    .inc();
            }
            let _ = reply.send(Ok(ReleaseOutcome::DryRun));
        }
    }

    /// Whether this allocation's dry-run decision is new (and remembers it). Allocations the
    /// ledger knows gone are forgotten, so a new one at the same key is reported.
    fn first_dry_run_report(&self, pool: &str, key: &str, id: &str) -> bool {
        let mut reported = self.dry_run_reports.0.lock().expect("dry-run lock");
        reported.retain(|r| self.ledger.may_hold(&r.pool, &r.key, &r.id));
        reported.insert(Reported {
            pool: pool.to_owned(),
            key: key.to_owned(),
            id: id.to_owned(),
        })
    }
}
