//! `--dry-run`: each decision reported once (Event, metric), nothing written. Nothing is
//! written, so the same allocations come back on every sweep: each is remembered until the
//! ledger knows it gone.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use crate::release::context::WriteContext;
use crate::release::types::{EntryWrite, ReleaseOutcome, ReleaseRequest, Reply};

/// The allocations already reported under `--dry-run`.
#[derive(Debug, Default)]
pub struct DryRunReports(Mutex<HashSet<Reported>>);

/// An allocation reported under `--dry-run`: its pool, key and sandbox id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Reported {
    pool: String,
    key: String,
    id: String,
}

impl DryRunReports {
    /// Reports each decision of `items` (of `pool`) once and answers it: nothing written. A
    /// release names the `cooldown` it would have started.
    pub(crate) async fn report(
        &self,
        cx: &WriteContext,
        cooldown: Duration,
        pool: &str,
        items: Vec<(ReleaseRequest, Reply)>,
    ) {
        for (req, reply) in items {
            let j = &req.judged;
            if let EntryWrite::Fence(record) = &req.write {
                if self.first(cx, pool, &j.entry.key, &j.entry.id) {
                    cx.events.fenced(&j.pod, j.entry.ip, record, true).await;
                }
            } else if req.write == EntryWrite::EndCooldown {
                // Not a release: nothing to report (no cooldown starts or ends in a dry run).
            } else if self.first(cx, pool, &j.entry.key, &j.entry.id) {
                cx.events
                    .dry_run(&j.pod, j.entry.ip, &j.network, req.reason, cooldown)
                    .await;
                cx.metrics
                    .dry_run_releases
                    .get_or_create(&req.reason.as_str().to_string().into())
                    .inc();
            }
            let _ = reply.send(Ok(ReleaseOutcome::DryRun));
        }
    }

    /// Whether this allocation's decision is new (and remembers it). Allocations the ledger
    /// knows gone are forgotten, so a new one at the same key is reported.
    fn first(&self, cx: &WriteContext, pool: &str, key: &str, id: &str) -> bool {
        let mut reported = self.0.lock().expect("dry-run lock");
        let allocations: Vec<(&str, &str, &str)> = reported
            .iter()
            .map(|r| (r.pool.as_str(), r.key.as_str(), r.id.as_str()))
            .collect();
        let held = cx.ledger.may_hold(&allocations);
        // `retain` visits the unchanged set in the order `iter` did.
        let mut held = held.into_iter();
        reported.retain(|_| held.next().unwrap_or(true));
        reported.insert(Reported {
            pool: pool.to_owned(),
            key: key.to_owned(),
            id: id.to_owned(),
        })
    }
}
