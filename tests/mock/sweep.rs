//! The sweep's approval bookkeeping (`controller::sweep`): an operator's approval of a held
//! sweep (`ipreclaim.io/approve-hold` on the pool) is used up, removed pinned by its value,
//! before the releases it approves go; one the apiserver fails to remove releases nothing and
//! stays for the next sweep, and so does the approval of a pool whose leaks could not be
//! confirmed this time. The real-apiserver tests (`--test controller -- sweep`) show the hold,
//! the approval by the CLI, an outgrown and an unneeded approval, and one refused by a policy;
//! these are the failures of a list and of a write that a real apiserver gives only by chance.

use std::sync::Arc;
use std::time::Duration;

use ipreclaim::api::IPPool;
use ipreclaim::controller::Ctx;
use ipreclaim::controller::sweep::{SweepConfig, SweepReport, Sweeper};
use ipreclaim::index::{APPROVE_HOLD_ANNOTATION, SharedIndex};
use ipreclaim::release::reports::events::HOLD_APPROVED;
use ipreclaim::release::{BudgetConfig, Budgets, Events, Writer};
use ipreclaim::rules::grace::Graces;
use ipreclaim::telemetry::ControllerMetrics;
use podlife::clock::RealClock;
use podlife::queue::WorkQueue;
use prometheus_client::registry::Registry;
use serde_json::json;

use super::apiserver::{self, Apiserver, Call};
use super::fixtures::NS;
use super::pool::Pool;

/// Entries of the pool, every one a leak (no pod of its name): all of them is past the ratio.
const LEAKS: usize = 20;

/// A sweeper on a mock apiserver, its index holding the pool as the watch last saw it.
struct Rig {
    sweeper: Option<Sweeper>,
    index: SharedIndex,
    apiserver: Apiserver,
    pool: Pool,
    /// The reasons of the Events published.
    events: Vec<String>,
}

/// What the apiserver says this sweep to the pods' list and to the approval's removal.
#[derive(Clone, Copy)]
struct Answers {
    pods_listed: bool,
    approval_removed: bool,
}

impl Rig {
    /// The pool with [`LEAKS`] leaked entries and an approval of any number of releases;
    /// no grace, a breaker ratio of a half.
    fn new() -> Rig {
        let (client, apiserver) = apiserver::pair();
        let metrics = ControllerMetrics::new(&mut Registry::default());
        let writes = metrics.writes.clone();
        let budgets = Budgets::new(BudgetConfig::UNLIMITED, RealClock::shared(), writes.clone());
        let events = Events::new(client.clone(), "mock", budgets.clone(), writes.clone());
        let writer = Writer::new(client.clone(), NS, budgets, events.clone(), writes)
            .patch_interval(Duration::ZERO);
        let writer = ipreclaim::release::writer::spawn(Arc::new(writer));
        let index = SharedIndex::default();
        let queue = WorkQueue::new(RealClock::shared());
        let ctx = Ctx::new(client, index.clone(), queue, writer, events, metrics);
        let config = SweepConfig {
            graces: Graces {
                leak: Duration::ZERO,
                missing_pod: Duration::ZERO,
            },
            max_release_ratio: 0.5,
            reclaim: Default::default(),
            namespace: NS.into(),
            inventory_namespace: NS.into(),
            reservation_repair_grace: Duration::from_secs(3600),
        };
        let mut pool = Pool::numbered(LEAKS);
        pool.object["metadata"]["annotations"] = json!({APPROVE_HOLD_ANNOTATION: "yes"});
        let mut rig = Rig {
            sweeper: Some(Sweeper::new(ctx, config)),
            index,
            apiserver,
            pool,
            events: Vec::new(),
        };
        rig.watch();
        rig
    }

    /// The index catches up with the pool, as the pool watch does.
    fn watch(&mut self) {
        let pool: IPPool = serde_json::from_value(self.pool.object.clone()).expect("a pool");
        self.index.write().unwrap().upsert_pool(&pool);
    }

    /// One sweep, the apiserver answering as `answers` says; then the index catches up.
    async fn sweep(&mut self, answers: Answers) -> SweepReport {
        let mut sweeper = self.sweeper.take().expect("a sweeper");
        let mut sweep = tokio::spawn(async move {
            let report = sweeper.sweep().await;
            (sweeper, report)
        });
        let report = loop {
            tokio::select! {
                done = &mut sweep => {
                    let (sweeper, report) = done.expect("the sweep");
                    self.sweeper = Some(sweeper);
                    break report;
                }
                call = self.apiserver.next() => self.answer(call, answers),
            }
        };
        self.watch();
        report
    }

    fn answer(&mut self, call: Call, answers: Answers) {
        let what = call.what();
        match what.as_str() {
            // The confirming list of every pod (more than 8 missing), metadata only.
            "GET /api/v1/pods" if answers.pods_listed => call.respond(
                200,
                &json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                        "metadata": {"resourceVersion": "1"}, "items": []}),
            ),
            "GET /api/v1/pods" => call.fail(500, "InternalError", "etcdserver: request timed out"),
            // The node agents' sandbox inventories: none.
            "GET leases" => call.respond(
                200,
                &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList",
                        "metadata": {"resourceVersion": "1"}, "items": []}),
            ),
            "POST events" => {
                self.events
                    .push(call.body["reason"].as_str().unwrap_or_default().into());
                let body = call.body.clone();
                call.respond(201, &body);
            }
            "PATCH ippools/p" if removes_approval(&call) && !answers.approval_removed => {
                self.pool.patches += 1;
                call.fail(500, "InternalError", "etcdserver: leader changed")
            }
            _ => self.pool.answer(call),
        }
    }

    /// Answers what comes within `quiet` of the last request (the Events, published after the
    /// sweep by their own task); returns the reasons of the Events published so far.
    async fn drain(&mut self, quiet: Duration) -> Vec<String> {
        while let Some(call) = self.apiserver.next_within(quiet).await {
            self.answer(call, ANSWERED);
        }
        self.events.clone()
    }

    fn approval(&self) -> Option<&str> {
        self.pool.object["metadata"]["annotations"][APPROVE_HOLD_ANNOTATION].as_str()
    }
}

/// Whether a pool patch removes the approval.
fn removes_approval(call: &Call) -> bool {
    let path = format!(
        "/metadata/annotations/{}",
        APPROVE_HOLD_ANNOTATION.replace('/', "~1")
    );
    call.body.as_array().is_some_and(|ops| {
        ops.iter()
            .any(|op| op["op"] == "remove" && op["path"] == path)
    })
}

/// How long without a request the Events are taken to be published.
const QUIET: Duration = Duration::from_millis(300);

const ANSWERED: Answers = Answers {
    pods_listed: true,
    approval_removed: true,
};

#[tokio::test]
async fn an_approval_the_apiserver_fails_to_remove_releases_nothing_and_stays_for_the_next_sweep() {
    let mut rig = Rig::new();
    let failed = Answers {
        approval_removed: false,
        ..ANSWERED
    };
    let report = rig.sweep(failed).await;
    assert_eq!((report.candidates, report.released), (LEAKS, 0));
    assert_eq!(report.held_pools, ["p"]);
    assert_eq!(rig.pool.keys().len(), LEAKS, "nothing released");
    assert_eq!(rig.approval(), Some("yes"));
    // The removal is the only write: no second try of it, nor of a removal as unneeded.
    assert_eq!(rig.pool.patches, 1);
    let approved = HOLD_APPROVED.to_string();
    assert!(!rig.drain(QUIET).await.contains(&approved));

    let report = rig.sweep(ANSWERED).await;
    assert_eq!(report.released, LEAKS);
    assert!(report.held_pools.is_empty(), "{report:?}");
    assert_eq!(rig.pool.keys().len(), 0);
    assert_eq!(rig.approval(), None, "used up");
    assert_eq!(rig.pool.patches, 3, "the removal, then the releases");
    assert!(rig.drain(QUIET).await.contains(&approved));
}

#[tokio::test]
async fn the_approval_of_a_pool_whose_leaks_could_not_be_confirmed_stays_for_the_next_sweep() {
    let mut rig = Rig::new();
    let unconfirmed = Answers {
        pods_listed: false,
        ..ANSWERED
    };
    let report = rig.sweep(unconfirmed).await;
    assert_eq!((report.candidates, report.released), (LEAKS, 0));
    // Judged with nothing to hold, it would be removed as unneeded: kept, not written.
    assert_eq!(rig.approval(), Some("yes"));
    assert_eq!(rig.pool.patches, 0);

    let report = rig.sweep(ANSWERED).await;
    assert_eq!(report.released, LEAKS);
    assert_eq!(rig.pool.keys().len(), 0);
    assert_eq!(rig.approval(), None, "used up");
}
