//! The chart's alerts and dashboard on a real Prometheus (Debian's): it scrapes an ipreclaim
//! controller running in process against the real control plane and evaluates the chart's
//! rules (rendered with a small threshold and a short `for:`). A pool filled past the threshold
//! raises IPReclaimPoolNearlyFull, freeing its addresses resolves it, and every dashboard query
//! runs (and returns series wherever its metrics exist).

use std::collections::BTreeSet;
use std::time::Duration;

use ipreclaim::api::{IPPool, IPPoolSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use testenv::ControlPlane;
use testenv::poll::{http_get, wait_for, wait_for_within};
use testenv::prometheus::{Prometheus, Target, chart_rules, dashboard_queries};

mod support;

/// The release name the rules are rendered for, and so the job label the chart's
/// ServiceMonitor would give the controller (`<fullname>-controller`): the scrape job here.
const RELEASE: &str = "rel";
const JOB: &str = "rel-ipreclaim-controller";
const ALERT: &str = "IPReclaimPoolNearlyFull";

/// The active alerts named `ALERT` for `pool`, as (state, labels).
async fn pool_alerts(prom: &Prometheus, pool: &str) -> Vec<(String, Value)> {
    prom.alerts()
        .await
        .expect("/api/v1/alerts")
        .into_iter()
        .filter(|a| a["labels"]["alertname"] == ALERT && a["labels"]["pool"] == pool)
        .map(|a| {
            (
                a["state"].as_str().unwrap_or("").to_string(),
                a["labels"].clone(),
            )
        })
        .collect()
}

/// The value of the first sample `expr` returns now, if any.
async fn value_of(prom: &Prometheus, expr: &str) -> Option<f64> {
    let result = prom.query(expr).await.expect("query");
    result.first()?["value"][1].as_str()?.parse().ok()
}

/// Waits until every rule of the chart has been evaluated after `since` (Prometheus's
/// /api/v1/rules `lastEvaluation`).
async fn wait_evaluated_after(prom: &Prometheus, since: jiff::Timestamp) {
    wait_for("every rule evaluated again", || async move {
        let groups = prom.rule_groups().await.expect("/api/v1/rules");
        let rules: Vec<Value> = groups
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        !rules.is_empty()
            && rules.iter().all(|r| {
                assert_eq!(r["health"], "ok", "a rule Prometheus cannot evaluate: {r}");
                r["lastEvaluation"]
                    .as_str()
                    .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                    .is_some_and(|t| t > since)
            })
    })
    .await;
}

#[tokio::test]
async fn pool_nearly_full_fires_and_resolves_and_every_dashboard_query_runs() {
    let cp = ControlPlane::shared();
    let (client, ns) = cp.client_crds_and_namespace("prom-alerts").await;
    // A /28 and its network: 14 addresses to hand out (no network, no broadcast).
    let config = r#"{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","ipam":{"type":"whereabouts","range":"192.0.2.0/28"}}"#;
    support::create_nad(&client, &ns, "macvlan", config).await;
    let pools: Api<IPPool> = Api::namespaced(client.clone(), &ns);
    let pool_name = "192.0.2.0-28";
    let pool = IPPool::new(
        pool_name,
        IPPoolSpec {
            range: "192.0.2.0/28".into(),
            allocations: Default::default(),
        },
    );
    pools.create(&PostParams::default(), &pool).await.unwrap();
    // No leader election: it leads. Nothing here is a leak: deleted pods go through the
    // deletion path.
    let flags = [
        "--sweep-interval=200ms",
        "--leak-grace=30s",
        "--leader-election=false",
    ];
    let mut program = support::controller(client.clone(), &ns, &flags).await;
    let metrics = program.metrics;
    let label = format!("{ns}/{pool_name}");
    let size_line = format!(r#"ipreclaim_pool_size{{pool="{label}"}} 14"#);
    wait_for(
        &format!("{size_line} on the controller's /metrics (the pool capacity metrics)"),
        || async {
            http_get(metrics, "/metrics")
                .await
                .1
                .lines()
                .any(|l| l == size_line)
        },
    )
    .await;

    // The chart's rules: alert under half free, after 2s; NoLeader after 1s, so that a job
    // label that does not match would show at once.
    let rules = chart_rules(
        RELEASE,
        &[
            "prometheusRule.poolNearlyFull.freeRatio=0.5",
            "prometheusRule.poolNearlyFull.for=2s",
            "prometheusRule.noLeader.for=1s",
        ],
    )
    .expect("the chart's rules");
    let dir = testenv::procs::run_dir("alerts-e2e").unwrap();
    let rules_path = dir.join("rules.yml");
    std::fs::write(&rules_path, serde_json::to_vec_pretty(&rules).unwrap()).unwrap();
    let target = Target {
        job: JOB.into(),
        addr: metrics,
    };
    let prom = Prometheus::start(&[target], &[rules_path], Duration::from_millis(500))
        .await
        .expect("start Prometheus");

    // Empty: scraped, evaluated, and quiet.
    let free = format!(r#"ipreclaim_pool_free{{pool="{label}"}}"#);
    wait_for("Prometheus to scrape the pool's free addresses", || async {
        value_of(&prom, &free).await == Some(14.0)
    })
    .await;
    wait_evaluated_after(&prom, jiff::Timestamp::now()).await;
    assert_eq!(pool_alerts(&prom, &label).await, vec![], "an empty pool");
    let names: Vec<String> = prom
        .alerts()
        .await
        .unwrap()
        .iter()
        .map(|a| a["labels"]["alertname"].to_string())
        .collect();
    assert!(
        names.is_empty(),
        "no alert at all with one healthy controller (NoLeader would mean the job label the \
         chart expects is not the one scraped): {names:?}\n{}",
        prom.log()
    );

    // Filled: 12 of 14 allocated to live pods (without network-status: kept).
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut allocations = serde_json::Map::new();
    for i in 1..=12u32 {
        let name = format!("p-{i}");
        pods.create(&PostParams::default(), &testenv::fixtures::pod(&name, None))
            .await
            .unwrap();
        allocations.insert(
            i.to_string(),
            json!({"id": format!("sb-{i}"), "podref": format!("{ns}/{name}"), "ifname": "net1"}),
        );
    }
    pools
        .patch(
            pool_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"allocations": allocations}})),
        )
        .await
        .unwrap();
    let slow = Duration::from_secs(60);
    wait_for_within(
        &format!("{ALERT} firing for {label}"),
        slow,
        Duration::from_millis(200),
        || async {
            pool_alerts(&prom, &label)
                .await
                .iter()
                .any(|(state, _)| state == "firing")
        },
    )
    .await;
    let firing = pool_alerts(&prom, &label).await;
    assert_eq!(firing.len(), 1, "{firing:?}");
    let labels = &firing[0].1;
    assert_eq!(labels["severity"], "warning");
    assert_eq!(labels["job"], JOB);
    assert!(
        value_of(&prom, &free).await.unwrap() <= 2.0,
        "fired on the filled pool"
    );

    // Freed: the pods deleted, the controller releases their addresses, the alert resolves.
    for i in 1..=12u32 {
        pods.delete(&format!("p-{i}"), &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    wait_for("the pool emptied by the controller", || async {
        pools
            .get(pool_name)
            .await
            .unwrap()
            .spec
            .allocations
            .is_empty()
    })
    .await;
    wait_for_within(
        &format!("{ALERT} for {label} resolved"),
        slow,
        Duration::from_millis(200),
        || async { pool_alerts(&prom, &label).await.is_empty() },
    )
    .await;
    // The alert resolves above half free (8 of 14), maybe on a scrape taken before the last
    // releases reached the metric: the free count reaches 14 by a later scrape.
    wait_for(
        "Prometheus to scrape the emptied pool's 14 free addresses",
        || async { value_of(&prom, &free).await == Some(14.0) },
    )
    .await;

    // Every dashboard query runs; where every metric it reads is in Prometheus, it returns
    // series (rates need two scrapes of the releases above: waited for).
    let present: BTreeSet<String> = prom.metric_names().await.unwrap().into_iter().collect();
    let mut without_data = BTreeSet::new();
    for (panel, expr) in dashboard_queries("1m").unwrap() {
        let missing: Vec<String> = metric_names_in(&expr)
            .into_iter()
            .filter(|m| !present.contains(m))
            .collect();
        if !missing.is_empty() {
            prom.query(&expr)
                .await
                .unwrap_or_else(|e| panic!("panel {panel:?}: {expr}: {e:#}"));
            without_data.extend(missing);
            continue;
        }
        wait_for(&format!("series for panel {panel:?}: {expr}"), || async {
            !prom
                .query(&expr)
                .await
                .unwrap_or_else(|e| panic!("panel {panel:?}: {expr}: {e:#}"))
                .is_empty()
        })
        .await;
    }
    // Only the node agent's metrics are absent here (no node agent runs).
    assert!(
        without_data
            .iter()
            .all(|m| m.starts_with("ipreclaim_node_")),
        "dashboard metrics the controller does not export: {without_data:?}"
    );
    println!("dashboard queries not checked for data (no node agent here): {without_data:?}");
    drop(prom);
    program.stop().await;
}

/// The `ipreclaim_*` metric names an expression reads.
fn metric_names_in(expr: &str) -> BTreeSet<String> {
    expr.match_indices("ipreclaim_")
        .map(|(i, _)| {
            expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}
