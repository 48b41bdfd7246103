//! The chart's PrometheusRule and Grafana dashboard, checked with Debian's `promtool`: the rules
//! load (`promtool check rules`), every alert fires, stays quiet and resolves as
//! `tests/promtool/rules_test.yml` says (`promtool test rules`), a changed rule fails those
//! tests, and every dashboard query parses. (The rules and queries on a real Prometheus
//! scraping a controller: `prometheus.rs`.)

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;
use testenv::helm::chart_dir;
use testenv::prometheus::{chart_rules, dashboard_queries, render_chart, run_promtool};

/// The alerts the chart ships (all of them with the default values).
const ALERTS: [&str; 13] = [
    "IPReclaimPoolNearlyFull",
    "IPReclaimPoolFullSoon",
    "IPReclaimBreakerHoldWaiting",
    "IPReclaimLeaksNotFreed",
    "IPReclaimInventoriesUnreadable",
    "IPReclaimReleaseFailures",
    "IPReclaimFenceTooOld",
    "IPReclaimOtherCleaner",
    "IPReclaimDuplicateAddress",
    "IPReclaimNodePLEGUnhealthy",
    "IPReclaimNodeRuntimeUnverified",
    "IPReclaimNodeDeadSandboxWaiting",
    "IPReclaimNoLeader",
];

fn render(sets: &[&str]) -> Vec<Value> {
    render_chart("rel", sets).expect("helm template")
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind)
}

/// The chart's rules (release `rel`, `prometheusRule.enabled=true` and `sets`) as a rule file.
fn rules_file(sets: &[&str]) -> Value {
    chart_rules("rel", sets).expect("the chart's PrometheusRule")
}

fn alert_names(rules: &Value) -> BTreeSet<String> {
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter_map(|r| r["alert"].as_str().map(String::from))
        .collect()
}

fn rule_of<'a>(rules: &'a Value, alert: &str) -> &'a Value {
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .find(|r| r["alert"] == alert)
        .unwrap_or_else(|| panic!("no alert {alert}"))
}

fn expr_of(rules: &Value, alert: &str) -> String {
    rule_of(rules, alert)["expr"]
        .as_str()
        .unwrap_or_else(|| panic!("no expr in {alert}"))
        .to_string()
}

fn write_yaml(dir: &Path, name: &str, v: &Value) {
    std::fs::write(dir.join(name), serde_norway::to_string(v).unwrap()).unwrap();
}

/// `promtool check rules` on `rules`, asserting it passes.
fn check_rules(rules: &Value, what: &str) -> String {
    let dir = testenv::procs::run_dir("promtool").unwrap();
    write_yaml(&dir, "rules.yml", rules);
    let (ok, out) = run_promtool(&dir, &["check", "rules", "rules.yml"]).expect("promtool");
    assert!(ok, "promtool check rules ({what}):\n{out}");
    out
}

/// `promtool test rules` of tests/promtool/rules_test.yml against `rules`.
fn test_rules(rules: &Value) -> (bool, String) {
    let dir = testenv::procs::run_dir("promtool").unwrap();
    write_yaml(&dir, "rules.yml", rules);
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/promtool/rules_test.yml");
    std::fs::copy(&tests, dir.join("rules_test.yml")).unwrap();
    run_promtool(&dir, &["test", "rules", "rules_test.yml"]).expect("promtool")
}

#[test]
fn the_rules_are_opt_in_and_pass_promtool_check_rules_with_defaults_and_every_value() {
    assert!(
        of_kind(&render(&[]), "PrometheusRule").is_none(),
        "no PrometheusRule by default"
    );
    let defaults = rules_file(&[]);
    assert_eq!(
        alert_names(&defaults),
        ALERTS.iter().map(|s| s.to_string()).collect(),
    );
    let out = check_rules(&defaults, "defaults");
    assert!(out.contains("SUCCESS: 13 rules found"), "{out}");

    // Every value changed: still valid, and each lands where it should.
    let every = rules_file(&[
        "prometheusRule.alertLabels.team=network",
        "prometheusRule.runbookUrl=https://example.invalid/ipreclaim/docs/operations/runbooks.md",
        "prometheusRule.controllerJob=kubernetes-pods",
        "prometheusRule.poolNearlyFull.freeRatio=0.2",
        "prometheusRule.poolNearlyFull.for=1m",
        "prometheusRule.poolNearlyFull.severity=critical",
        "prometheusRule.poolFullSoon.hours=12",
        "prometheusRule.poolFullSoon.window=1d",
        "prometheusRule.leaksNotFreed.olderThan=1h 30m",
        "prometheusRule.releaseFailures.threshold=3",
        "prometheusRule.releaseFailures.window=1h",
        "prometheusRule.fenceTooOld.olderThan=90min",
        "prometheusRule.otherCleaner.window=30m",
        "prometheusRule.duplicateAddress.for=2m",
        "prometheusRule.duplicateAddress.severity=critical",
        "prometheusRule.noLeader.for=1m",
        "prometheusRule.nodeRuntimeUnverified.for=3m",
        "prometheusRule.nodeRuntimeUnverified.severity=critical",
        "prometheusRule.nodeDeadSandboxWaiting.olderThan=2h",
        "prometheusRule.nodeDeadSandboxWaiting.severity=critical",
    ]);
    check_rules(&every, "every value");
    let expr = |a| expr_of(&every, a);
    assert!(expr("IPReclaimPoolNearlyFull").ends_with(") < 0.2"));
    assert!(
        expr("IPReclaimPoolFullSoon")
            .contains("predict_linear(ipreclaim_pool_free[1d], 12 * 3600)")
    );
    assert!(expr("IPReclaimLeaksNotFreed").ends_with(") > 5400"));
    assert!(expr("IPReclaimReleaseFailures").contains("[1h]"));
    assert!(expr("IPReclaimReleaseFailures").ends_with(") > 3"));
    assert!(expr("IPReclaimFenceTooOld").ends_with(" > 5400"));
    assert!(expr("IPReclaimOtherCleaner").contains("_total[30m]"));
    assert!(expr("IPReclaimNodeDeadSandboxWaiting").ends_with(" > 7200"));
    assert!(expr("IPReclaimNoLeader").contains(r#"ipreclaim_leader{job="kubernetes-pods"}"#));
    for group in every["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let alert = rule["alert"].as_str().unwrap();
            assert_eq!(rule["labels"]["team"], "network", "{alert}");
            assert_eq!(
                rule["annotations"]["runbook_url"],
                format!(
                    "https://example.invalid/ipreclaim/docs/operations/runbooks.md#{}",
                    alert.to_lowercase()
                ),
            );
            assert!(rule["annotations"]["summary"].is_string(), "{alert}");
        }
    }
    let pool_full = every["groups"][0]["rules"][0].clone();
    assert_eq!(pool_full["for"], "1m");
    assert_eq!(pool_full["labels"]["severity"], "critical");
    let duplicate = rule_of(&every, "IPReclaimDuplicateAddress");
    assert_eq!(duplicate["for"], "2m");
    assert_eq!(duplicate["labels"]["severity"], "critical");
    let runtime = rule_of(&every, "IPReclaimNodeRuntimeUnverified");
    assert_eq!(runtime["for"], "3m");
    assert_eq!(runtime["labels"]["severity"], "critical");
    let waiting = rule_of(&every, "IPReclaimNodeDeadSandboxWaiting");
    assert_eq!(waiting["labels"]["severity"], "critical");

    // The leak threshold follows the controller's sweep interval and leak grace by default.
    let leaks = |sets: &[&str]| expr_of(&rules_file(sets), "IPReclaimLeaksNotFreed");
    assert!(leaks(&[]).ends_with(") > 180"), "60s + 2m: {}", leaks(&[]));
    assert!(
        leaks(&[
            "controller.sweepInterval=1m 30s",
            "controller.leakGrace=10min"
        ])
        .ends_with(") > 690")
    );
    // A duration the helper cannot read is refused by the schema or by the template.
    for bad in [
        "prometheusRule.fenceTooOld.olderThan=soon",
        "prometheusRule.fenceTooOld.olderThan=5parsecs",
        "prometheusRule.nodeDeadSandboxWaiting.olderThan=5parsecs",
        "prometheusRule.poolNearlyFull.for=10 minutes",
    ] {
        let err = render_chart("rel", &["prometheusRule.enabled=true", bad]).unwrap_err();
        let err = format!("{err:#}");
        assert!(
            err.contains("olderThan") || err.contains("for"),
            "{bad}: {err}"
        );
    }
    // Without the controller there is no leader to miss.
    let no_controller = rules_file(&["controller.enabled=false"]);
    assert!(!alert_names(&no_controller).contains("IPReclaimNoLeader"));
}

/// The page `prometheusRule.runbookUrl` points at: one `## <alert>` heading per alert the chart
/// ships (its GitHub anchor is the alert's name in lower case, as the chart's `runbook_url`
/// appends), and no heading for an alert it does not ship.
#[test]
fn each_alert_has_one_runbook_heading() {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations/runbooks.md");
    let text = std::fs::read_to_string(&page).expect("docs/operations/runbooks.md");
    let mut headings: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(str::trim)
        .collect();
    headings.sort_unstable();
    let mut alerts = ALERTS.to_vec();
    alerts.sort_unstable();
    assert_eq!(
        headings, alerts,
        "docs/operations/runbooks.md: one `## <alert>` heading per alert of the chart"
    );
    for alert in ALERTS {
        assert!(
            alert.chars().all(|c| c.is_ascii_alphanumeric()),
            "{alert}: its anchor is its lower-case name only if it is plain ASCII"
        );
    }
}

#[test]
fn each_alert_fires_stays_quiet_and_resolves_under_promtool_test_rules() {
    let rules = rules_file(&[]);
    let (ok, out) = test_rules(&rules);
    assert!(
        ok,
        "promtool test rules tests/promtool/rules_test.yml:\n{out}"
    );
    // Every alert has a case that expects it firing.
    let tests: Value = serde_norway::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/promtool/rules_test.yml"),
        )
        .unwrap(),
    )
    .unwrap();
    let fired: BTreeSet<String> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|c| c["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()))
        .map(|c| c["alertname"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(fired, alert_names(&rules), "an alert without a firing case");
}

/// The unit tests can fail: with a threshold of 1% the nearly-full pool (5% free) does not
/// fire, and without the leader join a standby's stale hold raises an alert; promtool says so.
#[test]
fn a_changed_rule_fails_the_promtool_tests() {
    let (ok, out) = test_rules(&rules_file(&[
        "prometheusRule.poolNearlyFull.freeRatio=0.01",
    ]));
    assert!(!ok, "a threshold of 0.01 should fail the tests:\n{out}");
    assert!(
        out.contains("alertname: IPReclaimPoolNearlyFull, time: 25m"),
        "{out}"
    );

    let mut rules = rules_file(&[]);
    for group in rules["groups"].as_array_mut().unwrap() {
        for rule in group["rules"].as_array_mut().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            rule["expr"] = expr
                .replace("and on (job, instance) (ipreclaim_leader == 1)", "")
                .into();
        }
    }
    let (ok, out) = test_rules(&rules);
    assert!(!ok, "rules without the leader join should fail:\n{out}");
    assert!(out.contains(r#"pool="kube-system/stale""#), "{out}");
}

#[test]
fn the_dashboard_is_opt_in_and_every_query_parses() {
    assert!(of_kind(&render(&[]), "ConfigMap").is_none());
    let docs = render(&[
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.labelKey=my_dashboards",
        "grafanaDashboard.labelValue=yes",
        "grafanaDashboard.namespace=monitoring",
        "grafanaDashboard.annotations.grafana_folder=Networking",
    ]);
    let cm = of_kind(&docs, "ConfigMap").expect("a ConfigMap when enabled");
    assert_eq!(cm["metadata"]["labels"]["my_dashboards"], "yes");
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    assert_eq!(
        cm["metadata"]["annotations"]["grafana_folder"],
        "Networking"
    );
    let file = std::fs::read_to_string(chart_dir().join("dashboards/ipreclaim.json")).unwrap();
    let carried = cm["data"]["ipreclaim.json"].as_str().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(carried).unwrap(),
        serde_json::from_str::<Value>(&file).unwrap()
    );
    let defaults = render(&["grafanaDashboard.enabled=true"]);
    let cm = of_kind(&defaults, "ConfigMap").unwrap();
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");

    // What the issue asks the dashboard to show, each in some panel's query.
    let queries = dashboard_queries("5m").expect("the dashboard's queries");
    for metric in [
        "ipreclaim_pool_allocated",
        "ipreclaim_pool_size",
        "ipreclaim_pool_free",
        "ipreclaim_releases_total",
        "ipreclaim_deletion_to_release_seconds_bucket",
        "ipreclaim_gc_candidates",
        "ipreclaim_pool_held",
        "ipreclaim_fenced_addresses",
        "ipreclaim_api_writes_total",
        "ipreclaim_api_throttled_total",
        "ipreclaim_node_pleg_healthy",
    ] {
        assert!(
            queries.iter().any(|(_, q)| q.contains(metric)),
            "no panel queries {metric}"
        );
    }
    // promtool parses PromQL only as part of rules: each query as a recording rule.
    let rules = |queries: &[(String, String)]| {
        serde_json::json!({"groups": [{"name": "dashboard", "rules": queries.iter().enumerate().map(|(i, (_, q))| {
            serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": q})
        }).collect::<Vec<_>>()}]})
    };
    let out = check_rules(&rules(&queries), "the dashboard's queries");
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{out}"
    );
    // And this check can fail: a query that does not parse is refused.
    let broken = vec![(
        "broken".to_string(),
        "sum(rate(ipreclaim_releases_total[5m])".to_string(),
    )];
    let dir = testenv::procs::run_dir("promtool").unwrap();
    write_yaml(&dir, "rules.yml", &rules(&broken));
    let (ok, out) = run_promtool(&dir, &["check", "rules", "rules.yml"]).unwrap();
    assert!(!ok && out.contains("parse error"), "{out}");
}
