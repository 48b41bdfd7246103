//! `ipreclaim controller` against the real kube-apiserver: each test runs a controller in
//! process, with its own namespace as the whereabouts namespace.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use ipreclaim::api::{
    IPAllocation, IPPool, IPPoolSpec, NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec,
};
use ipreclaim::controller::{self, ControllerArgs};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use testenv::ControlPlane;
use testenv::poll::{WAIT, http_get, metric_sum, metric_value, wait_for};
use testenv::program::InProcess;

const STATUS: &str = "k8s.v1.cni.cncf.io/network-status";

/// Later flags override the test defaults.
#[derive(Parser)]
#[command(args_override_self = true)]
struct Cli {
    #[command(flatten)]
    args: ControllerArgs,
}

struct Env {
    client: Client,
    ns: String,
    /// The chart's controller ServiceAccount client, when the chart is installed.
    chart: Option<Client>,
    metrics: SocketAddr,
    program: Option<InProcess>,
}

impl Env {
    async fn new(prefix: &str) -> Env {
        let cp = ControlPlane::shared();
        let client = cp.client().await;
        cp.install_crds(&client).await.expect("install crds/");
        let ns = cp.namespace(&client, prefix).await;
        Env::with(client, ns)
    }

    /// Like [`new`](Self::new), with the chart installed in the namespace (also the
    /// whereabouts namespace); [`start`](Self::start) then acts as the chart's ServiceAccount.
    async fn new_chart(prefix: &str) -> Env {
        let mut env = Env::new(&format!("{prefix}-sa")).await;
        let cp = ControlPlane::shared();
        testenv::helm::install_in(cp, &env.ns).expect("helm install");
        env.chart = Some(
            testenv::helm::service_account_client(cp, &env.client, &env.ns, "controller").await,
        );
        env
    }

    /// An environment on a control plane of its own (started here; it stops when the returned
    /// handle is dropped), with the CRDs and a namespace.
    async fn private(prefix: &str) -> (ControlPlane, Env) {
        let cp = tokio::task::spawn_blocking(ControlPlane::start)
            .await
            .unwrap()
            .expect("private control plane");
        let client = cp.client().await;
        cp.install_crds(&client).await.expect("install crds/");
        let ns = cp.namespace(&client, prefix).await;
        (cp, Env::with(client, ns))
    }

    /// An environment on an existing namespace (a second replica, or a private control plane).
    fn with(client: Client, ns: String) -> Env {
        Env {
            client,
            ns,
            chart: None,
            metrics: "127.0.0.1:0".parse().unwrap(),
            program: None,
        }
    }

    /// Starts the controller with test timings plus `extra` flags; waits until it is ready.
    async fn start(&mut self, extra: &[&str]) {
        match self.chart.clone() {
            Some(sa) => {
                let lease = format!("--lease-namespace={}", self.ns);
                let mut flags = vec![
                    "--leader-election=true",
                    "--lease-name=ipreclaim-controller",
                    &lease,
                ];
                flags.extend_from_slice(extra);
                self.start_as(sa, &flags).await;
            }
            None => {
                let client = self.client.clone();
                self.start_as(client, extra).await;
            }
        }
    }

    /// Like [`start`](Self::start), with the controller acting through `client`.
    async fn start_as(&mut self, client: Client, extra: &[&str]) {
        let mut argv = vec![
            "controller".to_string(),
            format!("--whereabouts-namespace={}", self.ns),
            "--sweep-interval=200ms".into(),
            "--leak-grace=0s".into(),
            "--leader-election=false".into(),
            "--metrics-addr=127.0.0.1:0".into(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        let args = Cli::try_parse_from(argv).expect("controller flags").args;
        let (program, (_, addr)) = InProcess::start(
            "controller",
            |shutdown, started| {
                controller::run(client, args, shutdown, move |running| {
                    let _ = started.send((running.health.clone(), running.metrics_addr));
                })
            },
            |(health, _)| health.is_ready(),
        )
        .await;
        self.metrics = addr;
        self.program = Some(program);
    }

    async fn stop(&mut self) {
        if let Some(program) = &mut self.program {
            program.stop().await;
        }
    }

    fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn nad(&self, name: &str, range: &str) {
        let nad = NetworkAttachmentDefinition::new(
            name,
            NetworkAttachmentDefinitionSpec {
                config: Some(format!(
                    r#"{{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","ipam":{{"type":"whereabouts","range":"{range}"}}}}"#
                )),
            },
        );
        Api::<NetworkAttachmentDefinition>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &nad)
            .await
            .unwrap();
    }

    /// A pool holding (offset, sandbox, pod name) allocations.
    async fn pool(&self, name: &str, range: &str, allocations: &[(u32, &str, &str)]) {
        let allocations = allocations
            .iter()
            .map(|(offset, id, pod)| {
                (
                    offset.to_string(),
                    IPAllocation {
                        id: id.to_string(),
                        podref: format!("{}/{}", self.ns, pod),
                        ifname: Some("net1".into()),
                        ipamclaimref: None,
                    },
                )
            })
            .collect();
        let pool = IPPool::new(
            name,
            IPPoolSpec {
                range: range.into(),
                allocations,
            },
        );
        self.pools()
            .create(&PostParams::default(), &pool)
            .await
            .unwrap();
    }

    /// A pool with one allocation per pod of `names`: offsets 10, 11, ..., sandboxes sb-0, sb-1, ...
    async fn pool_of_pods(&self, name: &str, range: &str, names: &[String]) {
        let sandboxes: Vec<String> = (0..names.len()).map(|i| format!("sb-{i}")).collect();
        let allocations: Vec<(u32, &str, &str)> = names
            .iter()
            .zip(&sandboxes)
            .enumerate()
            .map(|(i, (n, sb))| (10 + i as u32, sb.as_str(), n.as_str()))
            .collect();
        self.pool(name, range, &allocations).await;
    }

    /// A pod whose network-status lists `ips` on network `nad` (None: no annotation).
    async fn pod(&self, name: &str, nad: &str, ips: Option<&[&str]>) -> String {
        self.pod_on(name, nad, ips, None).await
    }

    /// Like [`pod`](Self::pod), bound to `node`.
    async fn pod_on(
        &self,
        name: &str,
        nad: &str,
        ips: Option<&[&str]>,
        node: Option<&str>,
    ) -> String {
        let annotations = ips.map(|ips| {
            let status = serde_json::json!([
                {"name": "cbr0", "interface": "eth0", "ips": ["10.244.0.5"], "default": true},
                {"name": format!("{}/{nad}", self.ns), "interface": "net1", "ips": ips},
            ]);
            BTreeMap::from([(STATUS.to_string(), status.to_string())])
        });
        let mut pod = testenv::fixtures::pod(name, annotations);
        if let (Some(spec), Some(node)) = (pod.spec.as_mut(), node) {
            spec.node_name = Some(node.into());
        }
        let created = self
            .pods()
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        created.metadata.uid.unwrap()
    }

    async fn delete_pod(&self, name: &str) {
        self.pods()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    async fn keys(&self, pool: &str) -> Vec<String> {
        self.pools()
            .get(pool)
            .await
            .unwrap()
            .spec
            .allocations
            .keys()
            .cloned()
            .collect()
    }

    async fn wait_keys(&self, pool: &str, want: &[&str]) {
        let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        wait_for(&format!("pool {pool} keys {want:?}"), || {
            let want = want.clone();
            async move { self.keys(pool).await == want }
        })
        .await;
    }

    /// Events with `reason` in the test namespace, as (object name, uid, message).
    async fn events(&self, reason: &str) -> Vec<(String, String, String)> {
        testenv::events::with_reason(&self.client, &self.ns, reason, None)
            .await
            .into_iter()
            .map(|e| {
                (
                    e.involved_object.name.unwrap_or_default(),
                    e.involved_object.uid.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Waits until at least one Event with `reason` exists and returns them.
    async fn wait_events(&self, reason: &str) -> Vec<(String, String, String)> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let events = self.events(reason).await;
            if !events.is_empty() {
                return events;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for a {reason} event"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sweeps done so far.
    async fn sweeps(&self) -> u64 {
        let text = self.metrics_text().await;
        text.lines()
            .find_map(|l| l.strip_prefix("ipreclaim_sweep_duration_seconds_count "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits until /metrics has a line starting with `line`: counters are bumped when the
    /// write returns, which may be after the test already sees its effect.
    async fn wait_metric(&self, line: &str) {
        wait_for(&format!("a metric line {line:?}"), || async {
            self.metrics_text()
                .await
                .lines()
                .any(|l| l.starts_with(line))
        })
        .await;
    }

    /// Waits until `n` more sweeps have run.
    async fn wait_sweeps(&self, n: f64) {
        let count = "ipreclaim_sweep_duration_seconds_count";
        let start = metric_value(&self.metrics_text().await, count);
        wait_for(&format!("{n} more sweeps"), || async {
            metric_value(&self.metrics_text().await, count) >= start + n
        })
        .await;
    }

    async fn metrics_text(&self) -> String {
        http_get(self.metrics, "/metrics").await.1
    }
}

testenv::as_admin_and_as_the_chart!(
    Env,
    deleted_pod_is_released_with_an_event_and_the_live_pod_is_untouched,
    "ctl-delete"
);
async fn deleted_pod_is_released_with_an_event_and_the_live_pod_is_untouched(mut env: Env) {
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-web", "web-0"), (11, "sb-db", "db-0")],
    )
    .await;
    let web_uid = env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.start(&[]).await;

    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;

    let ns = env.ns.clone();
    let events = env.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(
        events,
        [(
            "web-0".to_string(),
            web_uid,
            format!("successful cleanup of IP address [192.0.2.10] from network {ns}/macvlan")
        )]
    );
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodDeleted"} 1"#)
        .await;
    env.wait_metric("ipreclaim_deletion_to_release_seconds_count 1")
        .await;
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(Env, statefulset_pod_recreated_keeps_its_new_ip, "ctl-sts");
async fn statefulset_pod_recreated_keeps_its_new_ip(mut env: Env) {
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-old", "web-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.start(&[]).await;

    // Deleted and recreated under the same name with a new address before anything else.
    env.delete_pod("web-0").await;
    let new_uid = env.pod("web-0", "macvlan", Some(&["192.0.2.20"])).await;
    let pool = env.pools().get("192.0.2.0-24").await.unwrap();
    let mut spec = pool.spec.clone();
    spec.allocations.insert(
        "20".into(),
        IPAllocation {
            id: "sb-new".into(),
            podref: format!("{}/web-0", env.ns),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        },
    );
    let patch = serde_json::json!({"spec": {"allocations": {"20": spec.allocations["20"]}}});
    env.pools()
        .patch(
            "192.0.2.0-24",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .unwrap();

    env.wait_keys("192.0.2.0-24", &["20"]).await;
    // Several sweeps later the new pod's address is still there.
    let sweeps = env.sweeps().await;
    wait_for("two more sweeps", || async {
        env.sweeps().await >= sweeps + 2
    })
    .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["20"]);
    let pod = env.pods().get("web-0").await.unwrap();
    assert_eq!(pod.metadata.uid.unwrap(), new_uid);
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(
    Env,
    pods_deleted_while_the_controller_was_down_are_released_at_start,
    "ctl-down"
);
async fn pods_deleted_while_the_controller_was_down_are_released_at_start(mut env: Env) {
    env.nad("macvlan", "198.18.0.0/24").await;
    // gone-0 never exists any more; live-0 does.
    env.pool(
        "198.18.0.0-24",
        "198.18.0.0/24",
        &[(5, "sb-gone", "gone-0"), (6, "sb-live", "live-0")],
    )
    .await;
    env.pod("live-0", "macvlan", Some(&["198.18.0.6"])).await;
    env.start(&[]).await;
    env.wait_keys("198.18.0.0-24", &["6"]).await;
    env.stop().await;

    // Down: a pod is deleted. Back up: its address is released.
    env.pool("198.18.1.0-24", "198.18.1.0/24", &[(7, "sb-x", "live-1")])
        .await;
    env.pod("live-1", "macvlan", Some(&["198.18.1.7"])).await;
    env.delete_pod("live-1").await;
    env.start(&[]).await;
    env.wait_keys("198.18.1.0-24", &[]).await;
    assert_eq!(env.keys("198.18.0.0-24").await, ["6"]);
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(
    Env,
    sweep_releases_an_ip_not_on_the_pod_but_never_a_listed_one,
    "ctl-sweep"
);
async fn sweep_releases_an_ip_not_on_the_pod_but_never_a_listed_one(mut env: Env) {
    env.nad("macvlan", "192.0.2.0/24").await;
    // web-0 lists .21 only; .20 is a stale allocation from an earlier sandbox.
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(20, "sb-1", "web-0"), (21, "sb-2", "web-0")],
    )
    .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.21"])).await;
    // A pod without network-status keeps everything (allocation races the annotation).
    env.pool("192.0.2.128-25", "192.0.2.128/25", &[(1, "sb-3", "new-0")])
        .await;
    env.pod("new-0", "macvlan", None).await;
    env.start(&[]).await;

    env.wait_keys("192.0.2.0-24", &["21"]).await;
    env.wait_metric(r#"ipreclaim_releases_total{reason="IPNotOnPod"} 1"#)
        .await;
    assert_eq!(env.keys("192.0.2.128-25").await, ["1"]);
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(Env, dry_run_reports_and_writes_nothing, "ctl-dry");
async fn dry_run_reports_and_writes_nothing(mut env: Env) {
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web", "web-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.start(&["--dry-run"]).await;
    env.delete_pod("web-0").await;
    let events = env.wait_events("IPAddressGarbageCollectionDryRun").await;
    assert!(events[0].2.contains("PodDeleted"), "{events:?}");
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"], "nothing written");
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    // The allocation stays (nothing is written), and later sweeps see it as PodMissing: the
    // decision is still reported once.
    env.wait_sweeps(3.0).await;
    let text = env.metrics_text().await;
    assert_eq!(
        metric_sum(&text, "ipreclaim_dry_run_releases_total"),
        1.0,
        "one dry-run decision for one allocation:\n{text}"
    );
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(
    Env,
    breaker_holds_a_sweep_that_would_free_most_of_a_pool,
    "ctl-breaker"
);
async fn breaker_holds_a_sweep_that_would_free_most_of_a_pool(mut env: Env) {
    env.nad("macvlan", "192.0.2.0/24").await;
    let names: Vec<String> = (0..12).map(|i| format!("p{i}")).collect();
    env.pool_of_pods("192.0.2.0-24", "192.0.2.0/24", &names)
        .await;
    // Every pod lists another address: all twelve look like IPNotOnPod.
    for (i, n) in names.iter().enumerate() {
        let other = format!("192.0.2.{}", 100 + i);
        env.pod(n, "macvlan", Some(&[other.as_str()])).await;
    }
    env.start(&[]).await;
    let held = env.wait_events("IPAddressGarbageCollectionHeld").await;
    assert_eq!(held[0].0, "192.0.2.0-24");
    assert!(held[0].2.contains("12 of 12"), "{held:?}");
    assert_eq!(env.keys("192.0.2.0-24").await.len(), 12, "nothing released");
    env.wait_metric("ipreclaim_breaker_holds_total").await;
    // One hold episode, however many sweeps it lasts.
    env.wait_sweeps(3.0).await;
    let text = env.metrics_text().await;
    let series = format!(
        r#"ipreclaim_breaker_holds_total{{pool="{}/192.0.2.0-24"}}"#,
        env.ns
    );
    assert_eq!(metric_value(&text, &series), 1.0, "{text}");
    env.stop().await;
}

#[tokio::test]
async fn bad_input_is_reported_not_fatal() {
    let mut env = Env::new("ctl-bad").await;
    // A NAD that is not JSON, a pool with malformed keys, a pod with a malformed annotation.
    let nad = NetworkAttachmentDefinition::new(
        "broken",
        NetworkAttachmentDefinitionSpec {
            config: Some("this is not json".into()),
        },
    );
    Api::<NetworkAttachmentDefinition>::namespaced(env.client.clone(), &env.ns)
        .create(&PostParams::default(), &nad)
        .await
        .unwrap();
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-a", "odd-0")])
        .await;
    let patch = serde_json::json!({"spec": {"allocations": {
        "not-a-number": {"id": "sb-x", "podref": format!("{}/gone", env.ns)},
        "999": {"id": "sb-y", "podref": format!("{}/gone", env.ns)},
    }}});
    env.pools()
        .patch(
            "192.0.2.0-24",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .unwrap();
    let mut pod = testenv::fixtures::pod_with_network_status("odd-0", "{not json");
    pod = env
        .pods()
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    assert!(pod.metadata.uid.is_some());
    env.start(&[]).await;
    wait_for("metrics for the bad input", || async {
        let m = env.metrics_text().await;
        m.contains("ipreclaim_nad_config_errors 1")
            && m.contains("ipreclaim_malformed_network_status_pods 1")
            && m.contains("ipreclaim_pool_problem_entries{pool=")
    })
    .await;
    // Malformed entries are never touched; the pod with a malformed annotation keeps its address.
    let mut keys = env.keys("192.0.2.0-24").await;
    keys.sort();
    assert_eq!(keys, ["10", "999", "not-a-number"]);
    // And every other pod is still processed.
    env.pool("198.18.0.0-24", "198.18.0.0/24", &[(7, "sb-ok", "ok-0")])
        .await;
    env.pod("ok-0", "macvlan", Some(&["198.18.0.7"])).await;
    env.delete_pod("ok-0").await;
    env.wait_keys("198.18.0.0-24", &[]).await;
    env.stop().await;
}

#[tokio::test]
async fn scan_reports_what_the_rules_would_release_and_writes_nothing() {
    let env = Env::new("scan").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[
            (10, "sb-a", "gone-0"),
            (20, "sb-1", "web-0"),
            (21, "sb-2", "web-0"),
        ],
    )
    .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.21"])).await;
    let rows = ipreclaim::scan::scan(env.client.clone(), &env.ns, Default::default())
        .await
        .expect("scan");
    let got: Vec<(String, String, String, String, String)> = rows
        .iter()
        .map(|r| {
            (
                r.ip.clone(),
                r.podref.clone(),
                r.sandbox.clone(),
                r.decision.clone(),
                r.reason.clone(),
            )
        })
        .collect();
    let ns = &env.ns;
    let row = |ip: &str, pod: &str, sb: &str, reason: &str| {
        (
            ip.to_string(),
            format!("{ns}/{pod}"),
            sb.to_string(),
            "candidate".to_string(),
            reason.to_string(),
        )
    };
    assert_eq!(
        got,
        [
            row("192.0.2.10", "gone-0", "sb-a", "PodMissing"),
            row("192.0.2.20", "web-0", "sb-1", "IPNotOnPod")
        ]
    );
    assert_eq!(rows[0].pod_age_seconds, None);
    assert!(rows[1].pod_age_seconds.is_some());
    let json = serde_json::to_value(&rows).unwrap();
    assert_eq!(json[1]["reason"], "IPNotOnPod");
    assert_eq!(json[1]["pool"], "192.0.2.0-24");
    assert_eq!(json[0]["pod_age_seconds"], serde_json::Value::Null);
    let table = ipreclaim::scan::table(&rows);
    assert!(table.starts_with("POOL"), "{table}");
    assert_eq!(table.lines().count(), 3, "{table}");
    assert_eq!(
        env.keys("192.0.2.0-24").await,
        ["10", "20", "21"],
        "scan is read-only"
    );
}

#[tokio::test]
async fn a_release_that_keeps_failing_ends_in_a_warning_event_with_the_cause() {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject,
    };
    let mut env = Env::new("ctl-fail").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web", "web-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;

    // A ServiceAccount that may read everything it watches and write Events, but not patch pools.
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let name = format!("{}-readonly", env.ns);
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        rules: Some(vec![
            rule(&[""], &["pods", "nodes"], &["get", "list", "watch"]),
            rule(
                &["whereabouts.cni.cncf.io"],
                &["ippools", "overlappingrangeipreservations"],
                &["get", "list", "watch"],
            ),
            rule(
                &["k8s.cni.cncf.io"],
                &["network-attachment-definitions"],
                &["get", "list", "watch"],
            ),
            rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
            rule(&["ipreclaim.io"], &["ipfences"], &["get", "list", "watch"]),
        ]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(env.client.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "ctl".into(),
            namespace: Some(env.ns.clone()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(env.client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let sa = ControlPlane::shared()
        .service_account_client(&env.client, &env.ns, "ctl")
        .await
        .expect("ServiceAccount client");
    env.start_as(sa, &["--max-retries=2"]).await;

    env.delete_pod("web-0").await;
    let failed = env.wait_events("IPAddressGarbageCollectionFailed").await;
    assert_eq!(failed[0].0, "web-0");
    assert!(
        failed[0].2.contains("forbidden"),
        "the cause is named: {failed:?}"
    );
    assert_eq!(
        env.keys("192.0.2.0-24").await,
        ["10"],
        "nothing was released"
    );
    assert!(env.events("IPAddressGarbageCollected").await.is_empty());
    env.wait_metric(r#"ipreclaim_release_failures_total{cause="api"} 3"#)
        .await;
    env.wait_metric("ipreclaim_queue_retries_total 2").await;
    env.stop().await;
}

#[tokio::test]
async fn with_two_replicas_only_the_lease_holder_writes() {
    let mut first = Env::new("ctl-ha").await;
    first.nad("macvlan", "192.0.2.0/24").await;
    first
        .pool(
            "192.0.2.0-24",
            "192.0.2.0/24",
            &[(10, "sb-web", "web-0"), (11, "sb-db", "db-0")],
        )
        .await;
    first.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    first.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    let lease = [
        "--leader-election=true".to_string(),
        format!("--lease-namespace={}", first.ns),
    ];
    let lease: Vec<&str> = lease.iter().map(String::as_str).collect();
    first.start(&lease).await;
    let mut second = Env::with(first.client.clone(), first.ns.clone());
    second.start(&lease).await;

    first.delete_pod("web-0").await;
    first.wait_keys("192.0.2.0-24", &["11"]).await;
    first.delete_pod("db-0").await;
    first.wait_keys("192.0.2.0-24", &[]).await;
    let patches = |text: String| {
        text.lines()
            .find_map(|l| l.strip_prefix(r#"ipreclaim_api_writes_total{verb="patch"} "#))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    let (a, b) = (
        patches(first.metrics_text().await),
        patches(second.metrics_text().await),
    );
    assert!(a == 0 || b == 0, "both replicas wrote: {a} and {b} patches");
    assert!(a + b >= 1, "someone wrote");
    let events = first.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(
        events.len(),
        2,
        "one Event per address, from the leader: {events:?}"
    );
    first.stop().await;
    second.stop().await;
}

/// The leader's own connection to the apiserver is cut (a partition: a proxy that passes no
/// byte either way) while the standby's works. The leader stops writing before its Lease can
/// expire (its `ipreclaim_leader` goes to 0 before the standby leads), the standby takes over
/// and releases web-0 and db-0 (db-0's deletion was queued on the old leader: refused at its
/// gate, never sent late; web-0's was seen by the standby while it did not lead: kept as a
/// tombstone, not queued, and judged at takeover), and after the partition heals no two
/// replicas lead at once. Before,
/// a leader whose renewals failed was never told and kept leading.
#[tokio::test]
async fn a_leader_cut_off_from_the_apiserver_stops_writing_before_a_standby_takes_over() {
    let cp = ControlPlane::shared();
    let mut a = Env::new("ctl-partition").await;
    a.nad("macvlan", "192.0.2.0/24").await;
    a.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-web", "web-0"), (11, "sb-db", "db-0")],
    )
    .await;
    a.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    a.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    let flags = [
        "--leader-election=true".to_string(),
        format!("--lease-namespace={}", a.ns),
        "--lease-duration=6s".to_string(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let proxy = testenv::proxy::Proxy::start(cp.apiserver_addr())
        .await
        .expect("proxy");
    let through = cp.client_through(&proxy).await;
    a.start_as(through, &flags).await;
    a.wait_metric("ipreclaim_leader 1").await;
    let mut b = Env::with(a.client.clone(), a.ns.clone());
    b.start(&flags).await;
    b.wait_metric("ipreclaim_leader 0").await;
    // Things to do queued on the leader just before the cut: it cannot send them.
    a.delete_pod("db-0").await;
    proxy.cut();
    let cut = std::time::Instant::now();
    // Deleted while the standby does not lead: it keeps the tombstone, not a queue item (a
    // standby's queue used to grow with every deletion, forever), and judges it at takeover.
    a.delete_pod("web-0").await;
    // The standby sets its queue gauge every 200 ms (its sweep loop, which sweeps only when
    // it leads): five rounds.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = b.metrics_text().await;
    assert_eq!(
        metric_value(&text, "ipreclaim_leader"),
        0.0,
        "still the standby"
    );
    assert_eq!(
        metric_value(&text, "ipreclaim_queue_depth"),
        0.0,
        "nothing queued on the standby"
    );
    let demoted = async {
        a.wait_metric("ipreclaim_leader 0").await;
        cut.elapsed()
    };
    let took_over = async {
        b.wait_metric("ipreclaim_leader 1").await;
        cut.elapsed()
    };
    let (demoted, took_over) = tokio::join!(demoted, took_over);
    eprintln!(
        "partition: the cut-off leader stopped writing {demoted:.1?} after the cut, the standby led {took_over:.1?} after it"
    );
    assert!(
        demoted < took_over,
        "the old leader stopped writing ({demoted:?}) before the standby led ({took_over:?})"
    );
    b.wait_keys("192.0.2.0-24", &[]).await;
    // Healed, the old leader's watches resume (and kube-lease-manager may take the Lease back
    // for it): never two writers at once, sampled every 100 ms.
    proxy.heal();
    for _ in 0..60 {
        let (ta, tb) = (a.metrics_text().await, b.metrics_text().await);
        let leads = |t: &str| metric_value(t, "ipreclaim_leader") == 1.0;
        assert!(!(leads(&ta) && leads(&tb)), "two replicas lead at once");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let events = b.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(events.len(), 2, "one release Event per address: {events:?}");
    a.stop().await;
    b.stop().await;
}

/// A controller on a private control plane of two apiservers, watching through the first,
/// which is down; web-0 (192.0.2.10) was deleted through the second meanwhile, db-0
/// (192.0.2.11) lives. The second apiserver stops when its handle is dropped.
async fn web_0_deleted_while_the_watched_apiserver_is_down(
    prefix: &str,
) -> (ControlPlane, Env, testenv::controlplane::SecondApiServer) {
    let (cp, mut env) = Env::private(prefix).await;
    let ns = env.ns.clone();
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-web", "web-0"), (11, "sb-db", "db-0")],
    )
    .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.start(&[]).await;

    let (second, other) = cp.start_second_apiserver().await.expect("second apiserver");
    cp.stop_apiserver().expect("stop the first apiserver");
    Api::<Pod>::namespaced(other, &ns)
        .delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    (cp, env, second)
}

#[tokio::test]
async fn after_a_long_outage_the_watches_resume_as_soon_as_the_apiserver_answers() {
    let (cp, mut env, _second) =
        web_0_deleted_while_the_watched_apiserver_is_down("ctl-outage").await;
    // The fault: an outage long enough for the watches' retry delays to grow past 10 s.
    tokio::time::sleep(Duration::from_secs(20)).await;
    cp.start_apiserver()
        .await
        .expect("restart the first apiserver");
    // Well under the grown delay: the watches retry once the apiserver answers.
    testenv::poll::wait_for_within(
        "the release within 5 s of the apiserver's return",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { env.keys("192.0.2.0-24").await == ["11"] },
    )
    .await;
    env.stop().await;
}

#[tokio::test]
async fn a_pod_deleted_while_the_watched_apiserver_is_down_is_released() {
    let (cp, mut env, _second) = web_0_deleted_while_the_watched_apiserver_is_down("ctl-gap").await;
    cp.start_apiserver()
        .await
        .expect("restart the first apiserver");
    // The watch resumes (replayed Delete, or a re-list and its gap diff: unit-tested in
    // controller::watch); either way the address is released and the live pod's stays.
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(
    Env,
    dual_stack_release_deletes_reservations_with_one_event_per_network,
    "ctl-ds"
);
async fn dual_stack_release_deletes_reservations_with_one_event_per_network(mut env: Env) {
    use ipreclaim::api::{OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};
    let nad = NetworkAttachmentDefinition::new(
        "macvlan",
        NetworkAttachmentDefinitionSpec {
            config: Some(
                r#"{"type":"macvlan","ipam":{"type":"whereabouts","ipRanges":[{"range":"192.0.2.0/24"},{"range":"2001:db8::/64"}]}}"#.into(),
            ),
        },
    );
    Api::<NetworkAttachmentDefinition>::namespaced(env.client.clone(), &env.ns)
        .create(&PostParams::default(), &nad)
        .await
        .unwrap();
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web", "web-0")])
        .await;
    env.pool("2001-db8---64", "2001:db8::/64", &[(5, "sb-web", "web-0")])
        .await;
    let reservations =
        Api::<OverlappingRangeIPReservation>::namespaced(env.client.clone(), &env.ns);
    for name in ["192.0.2.10", "2001-db8--5"] {
        let r = OverlappingRangeIPReservation::new(
            name,
            OverlappingRangeIPReservationSpec {
                containerid: Some("sb-web".into()),
                podref: format!("{}/web-0", env.ns),
                ifname: Some("net1".into()),
                ipamclaimref: None,
            },
        );
        reservations
            .create(&PostParams::default(), &r)
            .await
            .unwrap();
    }
    env.pod("web-0", "macvlan", Some(&["192.0.2.10", "2001:db8::5"]))
        .await;
    env.start(&[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.wait_keys("2001-db8---64", &[]).await;
    wait_for("reservations deleted", || async {
        reservations
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    let events = env.wait_events("IPAddressGarbageCollected").await;
    let ns = &env.ns;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        events[0].2,
        format!(
            "successful cleanup of IP address [192.0.2.10 2001:db8::5] from network {ns}/macvlan"
        )
    );
    env.stop().await;
}

testenv::as_admin_and_as_the_chart!(
    Env,
    a_succeeded_pod_is_released_and_a_late_orphan_waits_for_the_grace,
    "ctl-done"
);
async fn a_succeeded_pod_is_released_and_a_late_orphan_waits_for_the_grace(mut env: Env) {
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-job", "job-0"), (11, "sb-web", "web-0")],
    )
    .await;
    env.pod("job-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.pods()
        .patch_status(
            "job-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    env.start(&["--leak-grace=3s"]).await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodTerminal"} 1"#)
        .await;

    // An allocation for a pod that never existed appears after start: only the sweep, after
    // the grace period, may release it.
    let patch = serde_json::json!({"spec": {"allocations": {"12": {"id": "sb-x", "podref": format!("{}/ghost", env.ns)}}}});
    env.pools()
        .patch(
            "192.0.2.0-24",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .unwrap();
    let appeared = std::time::Instant::now();
    let sweeps = env.sweeps().await;
    wait_for("two sweeps that see the orphan", || async {
        env.sweeps().await >= sweeps + 2
    })
    .await;
    if appeared.elapsed() < Duration::from_secs(3) {
        assert_eq!(
            env.keys("192.0.2.0-24").await,
            ["11", "12"],
            "not before the grace period"
        );
        env.wait_metric(r#"ipreclaim_gc_candidates{reason="PodMissing"} 1"#)
            .await;
    }
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    assert!(
        appeared.elapsed() >= Duration::from_secs(3),
        "released only after the grace"
    );
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodMissing"} 1"#)
        .await;
    env.stop().await;
}

#[tokio::test]
async fn a_concurrent_allocator_loses_nothing_during_a_mass_release() {
    let mut env = Env::new("ctl-race").await;
    env.nad("macvlan", "198.18.0.0/16").await;
    let names: Vec<String> = (0..100).map(|i| format!("p{i}")).collect();
    let sandboxes: Vec<String> = (0..100).map(|i| format!("sb-{i}")).collect();
    let allocs: Vec<(u32, &str, &str)> = (0..100)
        .map(|i| (i as u32, sandboxes[i].as_str(), names[i].as_str()))
        .collect();
    env.pool("198.18.0.0-16", "198.18.0.0/16", &allocs).await;
    for (i, n) in names.iter().enumerate() {
        let ip = format!("198.18.0.{i}");
        env.pod(n, "macvlan", Some(&[ip.as_str()])).await;
    }
    // The new allocations are for pods this test never creates: keep the sweep off them.
    env.start(&["--leak-grace=10m"]).await;

    // The CNI's way: read, then JSON patch with a resourceVersion test, retried on conflict.
    let pools = env.pools();
    let ns = env.ns.clone();
    let allocator = tokio::spawn(async move {
        for i in 0..100u32 {
            loop {
                let pool = pools.get("198.18.0.0-16").await.unwrap();
                let rv = pool.metadata.resource_version.unwrap();
                let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "add", "path": format!("/spec/allocations/{}", 1000 + i),
                     "value": {"id": format!("new-{i}"), "podref": format!("{ns}/new-{i}")}},
                ]))
                .unwrap();
                match pools
                    .patch(
                        "198.18.0.0-16",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::<()>::Json(patch),
                    )
                    .await
                {
                    Ok(_) => break,
                    Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => continue,
                    Err(e) => panic!("allocator: {e}"),
                }
            }
        }
    });
    for n in &names {
        env.delete_pod(n).await;
    }
    allocator.await.unwrap();
    let want: Vec<String> = (1000..1100).map(|k: u32| k.to_string()).collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    let mut sorted = want.clone();
    sorted.sort();
    env.wait_keys("198.18.0.0-16", &sorted).await;
    env.stop().await;
}

#[tokio::test]
async fn when_the_leader_stops_the_standby_takes_over_and_nothing_is_released_twice() {
    let mut first = Env::new("ctl-failover").await;
    first.nad("macvlan", "192.0.2.0/24").await;
    first
        .pool(
            "192.0.2.0-24",
            "192.0.2.0/24",
            &[(10, "sb-a", "a-0"), (11, "sb-b", "b-0")],
        )
        .await;
    first.pod("a-0", "macvlan", Some(&["192.0.2.10"])).await;
    first.pod("b-0", "macvlan", Some(&["192.0.2.11"])).await;
    let flags = [
        "--leader-election=true".to_string(),
        format!("--lease-namespace={}", first.ns),
        "--lease-duration=3s".into(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    first.start(&flags).await;
    first.delete_pod("a-0").await;
    first.wait_keys("192.0.2.0-24", &["11"]).await;
    let mut second = Env::with(first.client.clone(), first.ns.clone());
    second.start(&flags).await;
    first.stop().await;

    second.delete_pod("b-0").await;
    second.wait_keys("192.0.2.0-24", &[]).await;
    second
        .wait_metric(r#"ipreclaim_releases_total{reason="PodDeleted"} 1"#)
        .await;
    let events = second.wait_events("IPAddressGarbageCollected").await;
    let mut objects: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    objects.sort();
    assert_eq!(
        objects,
        ["a-0", "b-0"],
        "each address released once: {events:?}"
    );
    second.stop().await;
}

testenv::as_admin_and_as_the_chart!(
    Env,
    orphaned_reservations_are_swept_and_live_ones_kept,
    "ctl-orip"
);
async fn orphaned_reservations_are_swept_and_live_ones_kept(mut env: Env) {
    use ipreclaim::api::{OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web", "web-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let reservations =
        Api::<OverlappingRangeIPReservation>::namespaced(env.client.clone(), &env.ns);
    for (name, pod) in [("192.0.2.10", "web-0"), ("192.0.2.99", "ghost-0")] {
        let r = OverlappingRangeIPReservation::new(
            name,
            OverlappingRangeIPReservationSpec {
                containerid: Some("sb".into()),
                podref: format!("{}/{pod}", env.ns),
                ifname: Some("net1".into()),
                ipamclaimref: None,
            },
        );
        reservations
            .create(&PostParams::default(), &r)
            .await
            .unwrap();
    }
    env.start(&[]).await;
    wait_for("the orphaned reservation deleted", || async {
        let names: Vec<String> = reservations
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|r| r.metadata.name)
            .collect();
        names == ["192.0.2.10"]
    })
    .await;
    env.wait_metric(r#"ipreclaim_api_writes_total{verb="delete"} 1"#)
        .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"]);
    env.stop().await;
}

#[tokio::test]
async fn every_metric_the_readme_names_is_on_metrics() {
    let mut env = Env::new("ctl-metrics-doc").await;
    // A pool and its network, so that the per-pool and per-network series exist; nothing
    // else has happened yet.
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[]).await;
    env.start(&[]).await;
    let ns = env.ns.clone();
    for series in [
        "breaker_holds_total",
        "allocations",
        "pool_problem_entries",
        "pool_allocated",
        "pool_fenced",
        "pool_leak_candidates",
        "pool_held",
    ] {
        env.wait_metric(&format!(
            r#"ipreclaim_{series}{{pool="{ns}/192.0.2.0-24"}} 0"#
        ))
        .await;
    }
    // Its size is its range's, less network and broadcast (the NAD narrows nothing).
    for series in ["pool_size", "pool_free"] {
        env.wait_metric(&format!(
            r#"ipreclaim_{series}{{pool="{ns}/192.0.2.0-24"}} 254"#
        ))
        .await;
    }
    for series in ["network_size", "network_free"] {
        env.wait_metric(&format!(
            r#"ipreclaim_{series}{{network="{ns}/macvlan"}} 254"#
        ))
        .await;
    }
    testenv::docs::assert_readme_metrics_on(&env.metrics_text().await, "ipreclaim_", 15);
    // A deleted pool's series go with it (one pool label format everywhere).
    env.pools()
        .delete("192.0.2.0-24", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the deleted pool's series removed", || async {
        !env.metrics_text().await.contains("192.0.2.0-24")
    })
    .await;
    env.stop().await;
}

#[tokio::test]
async fn text_logs_to_a_pipe_carry_no_colour_codes() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    cp.install_crds(&client).await.expect("install crds/");
    let ns = cp.namespace(&client, "ctl-log-colour").await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
        .args([
            "controller",
            "--leader-election=false",
            "--metrics-addr=127.0.0.1:0",
            "--log-format=text",
        ])
        .arg(format!("--whereabouts-namespace={ns}"))
        .env("KUBECONFIG", cp.kubeconfig_path())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the ipreclaim binary");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        child.stderr.take().expect("stderr"),
    ));
    let mut seen = Vec::new();
    let ready = tokio::time::timeout(WAIT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            let done = line.contains("caches synced");
            seen.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await;
    child.kill().await.expect("stop the controller");
    assert_eq!(ready, Ok(true), "the controller logged readiness: {seen:?}");
    assert!(
        seen.iter().all(|l| !l.contains('\u{1b}')),
        "ANSI escape codes in piped logs: {seen:?}"
    );
}

// Fencing against the real apiserver. The Nodes here are stand-ins (Node objects whose Ready
// condition the test sets; no kubelet): the real node's own CNI DEL frees a fenced entry as
// soon as its kubelet tears the sandbox down, so only a stand-in lets the settle period, a
// restart while fenced and the release by ipreclaim itself be seen. The e2e scenarios on the
// real node show the rest.

const FENCED: &str = "IPAddressGarbageCollectionFenced";

impl Env {
    /// A Node named after the test's namespace, with its Ready condition `status`.
    async fn fence_node(&self, status: &str) -> String {
        let name = format!("{}-node", self.ns);
        let node = k8s_openapi::api::core::v1::Node {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<k8s_openapi::api::core::v1::Node>::all(self.client.clone())
            .create(&PostParams::default(), &node)
            .await
            .unwrap();
        self.set_ready(&name, status).await;
        name
    }

    /// Sets a Node's Ready condition, its transition now.
    async fn set_ready(&self, node: &str, status: &str) {
        self.set_ready_at(node, status, jiff::Timestamp::now())
            .await;
    }

    /// Sets a Node's Ready condition as a node whose clock reads `clock` reports it.
    async fn set_ready_at(&self, node: &str, status: &str, clock: jiff::Timestamp) {
        let now = clock.to_string();
        let patch = serde_json::json!({"status": {"conditions": [{
            "type": "Ready", "status": status, "reason": "SetByTest",
            "lastHeartbeatTime": now, "lastTransitionTime": now,
        }]}});
        Api::<k8s_openapi::api::core::v1::Node>::all(self.client.clone())
            .patch_status(
                node,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(patch),
            )
            .await
            .unwrap();
    }

    async fn delete_node(&self, node: &str) {
        Api::<k8s_openapi::api::core::v1::Node>::all(self.client.clone())
            .delete(node, &DeleteParams::default())
            .await
            .unwrap();
    }

    async fn reservation(&self, ip: &str, pod: &str) {
        use ipreclaim::api::{OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec};
        let r = OverlappingRangeIPReservation::new(
            ip,
            OverlappingRangeIPReservationSpec {
                containerid: Some(format!("sb-{pod}")),
                podref: format!("{}/{pod}", self.ns),
                ifname: Some("net1".into()),
                ipamclaimref: None,
            },
        );
        Api::<OverlappingRangeIPReservation>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &r)
            .await
            .unwrap();
    }

    async fn reservation_names(&self) -> Vec<String> {
        Api::<ipreclaim::api::OverlappingRangeIPReservation>::namespaced(
            self.client.clone(),
            &self.ns,
        )
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .collect()
    }

    /// (podref, fence record's spec as JSON) of `key` in `pool`.
    async fn entry_and_fence(&self, pool: &str, key: &str) -> (Option<String>, Option<String>) {
        let p = self.pools().get(pool).await.unwrap();
        let podref = p.spec.allocations.get(key).map(|a| a.podref.clone());
        let name = ipreclaim::ipam::fence::fence_object_name(pool, key);
        let fence = Api::<ipreclaim::api::IPFence>::namespaced(self.client.clone(), &self.ns)
            .get_opt(&name)
            .await
            .unwrap()
            .map(|f| serde_json::to_string(&f.spec).unwrap());
        (podref, fence)
    }

    /// web-0 (192.0.2.10, with its reservation) and db-0 (192.0.2.11) on `node`; the
    /// controller runs with `extra`; web-0 is force-deleted and its Fenced Event awaited.
    async fn fenced_web_0(&mut self, node: &str, extra: &[&str]) -> String {
        self.nad("macvlan", "192.0.2.0/24").await;
        self.pool(
            "192.0.2.0-24",
            "192.0.2.0/24",
            &[(10, "sb-web-0", "web-0"), (11, "sb-db-0", "db-0")],
        )
        .await;
        self.reservation("192.0.2.10", "web-0").await;
        let uid = self
            .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(node))
            .await;
        self.pod_on("db-0", "macvlan", Some(&["192.0.2.11"]), Some(node))
            .await;
        self.start(extra).await;
        self.delete_pod("web-0").await;
        let events = self.wait_events(FENCED).await;
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(
            (events[0].0.as_str(), events[0].1.as_str()),
            ("web-0", uid.as_str())
        );
        assert!(
            events[0].2.contains(&format!(
                "node {node} was not Ready (Ready=Unknown (SetByTest))"
            )),
            "{}",
            events[0].2
        );
        uid
    }

    /// web-0's entry (offset 10) is fenced for `node`, with its record.
    async fn assert_web_0_fenced_alone(&self, node: &str) {
        wait_for("web-0's entry fenced", || async {
            self.entry_and_fence("192.0.2.0-24", "10").await.0
                == Some(format!("{}/web-0:fenced", self.ns))
        })
        .await;
        let (_, fence) = self.entry_and_fence("192.0.2.0-24", "10").await;
        let fence: serde_json::Value = serde_json::from_str(&fence.expect("fence record")).unwrap();
        assert_eq!(fence["node"], node);
    }

    async fn assert_web_0_fenced(&self, node: &str) {
        let (podref, fence) = self.entry_and_fence("192.0.2.0-24", "10").await;
        assert_eq!(podref, Some(format!("{}/web-0:fenced", self.ns)));
        let fence: serde_json::Value =
            serde_json::from_str(&fence.expect("fence annotation")).unwrap();
        assert_eq!(fence["node"], node);
        assert_eq!(fence["podref"], format!("{}/web-0", self.ns));
        assert_eq!(self.keys("192.0.2.0-24").await, ["10", "11"]);
        assert_eq!(
            self.reservation_names().await,
            ["192.0.2.10"],
            "the reservation stays with the fence"
        );
        assert!(self.events("IPAddressGarbageCollected").await.is_empty());
    }

    /// web-0's address, reservation and fence record are gone, with one release Event.
    async fn wait_web_0_released(&self, uid: &str) {
        self.wait_keys("192.0.2.0-24", &["11"]).await;
        wait_for("web-0's reservation deleted", || async {
            self.reservation_names().await.is_empty()
        })
        .await;
        // The record goes after the entry (a lift removes the entry first).
        wait_for("web-0's entry and fence record gone", || async {
            self.entry_and_fence("192.0.2.0-24", "10").await == (None, None)
        })
        .await;
        let ns = &self.ns;
        assert_eq!(
            self.wait_events("IPAddressGarbageCollected").await,
            [(
                "web-0".to_string(),
                uid.to_string(),
                format!("successful cleanup of IP address [192.0.2.10] from network {ns}/macvlan")
            )]
        );
    }
}

testenv::as_admin_and_as_the_chart!(
    Env,
    a_pod_deleted_from_an_unready_node_is_fenced_across_a_restart_until_the_node_settles,
    "ctl-fence"
);
async fn a_pod_deleted_from_an_unready_node_is_fenced_across_a_restart_until_the_node_settles(
    mut env: Env,
) {
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &["--fence-settle=2s"]).await;
    env.assert_web_0_fenced(&node).await;
    env.wait_metric("ipreclaim_fenced_addresses 1").await;
    env.wait_metric("ipreclaim_fences_total 1").await;
    let rows = ipreclaim::scan::scan(env.client.clone(), &env.ns, Default::default())
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (row, fence) = (&rows[0], rows[0].fence.as_ref().expect("a fenced row"));
    assert_eq!(
        (row.ip.as_str(), row.podref.as_str(), row.decision.as_str()),
        ("192.0.2.10", format!("{}/web-0", env.ns).as_str(), "fenced")
    );
    assert_eq!(fence.node, node);
    assert!(
        ipreclaim::scan::table(&rows).contains(&format!("{node} for ")),
        "{}",
        ipreclaim::scan::table(&rows)
    );

    // A restart while fenced: the fence is read back from the pool, nothing is released.
    env.stop().await;
    env.start(&["--fence-settle=2s"]).await;
    env.wait_metric("ipreclaim_fenced_addresses 1").await;
    env.wait_sweeps(2.0).await;
    env.assert_web_0_fenced(&node).await;

    env.set_ready(&node, "True").await;
    env.wait_web_0_released(&uid).await;
    env.wait_metric("ipreclaim_fenced_addresses 0").await;
    env.wait_metric(r#"ipreclaim_releases_total{reason="PodDeleted"} 1"#)
        .await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["11"], "db-0 untouched");
    env.stop().await;
    env.delete_node(&node).await;
}

/// A node whose clock lags an hour comes back: its Ready transition reads an hour ago, yet the
/// fence holds for the whole settle on the controller's own clock (it lifted at once before).
#[tokio::test]
async fn a_node_back_with_a_lagging_clock_still_waits_the_settle() {
    let mut env = Env::new("ctl-fence-lag").await;
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &["--fence-settle=5s"]).await;
    env.assert_web_0_fenced(&node).await;
    // The node stays down longer than the settle: a settle counted from the fence (or from the
    // node's lagging transition time) would be over the moment it is back.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    env.assert_web_0_fenced(&node).await;
    let hour_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1);
    // The controller sees the node Ready after this, so the settle ends 5 s after it at the
    // earliest. (Not `ipreclaim_unready_nodes`: it counts other tests' stand-in Nodes too.)
    let set_ready = std::time::Instant::now();
    env.set_ready_at(&node, "True", hour_ago).await;
    // Fences are checked every second: three passes with the node Ready, still fenced.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    env.assert_web_0_fenced(&node).await;
    env.wait_web_0_released(&uid).await;
    assert!(
        set_ready.elapsed() >= std::time::Duration::from_secs(5),
        "released {:?} after the node was set Ready, settle 5s",
        set_ready.elapsed()
    );
    env.stop().await;
    env.delete_node(&node).await;
}

#[tokio::test]
async fn a_fence_lifts_at_once_when_its_node_is_deleted() {
    let mut env = Env::new("ctl-fence-gone").await;
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &[]).await;
    env.assert_web_0_fenced(&node).await;
    env.delete_node(&node).await;
    env.wait_web_0_released(&uid).await;
    env.stop().await;
}

/// Non-graceful node shutdown: the operator taints the node `node.kubernetes.io/out-of-service`
/// (it is powered off). Its fences lift at once, with the usual release Event, while the node
/// is still NotReady and the settle (default 30 s) has not begun; a pod deleted from it later
/// is released, not fenced.
#[tokio::test]
async fn a_node_tainted_out_of_service_lifts_its_fences_at_once() {
    let mut env = Env::new("ctl-fence-oos").await;
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &[]).await;
    env.assert_web_0_fenced(&node).await;
    let taint = serde_json::json!({"spec": {"taints": [{
        "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute",
    }]}});
    Api::<k8s_openapi::api::core::v1::Node>::all(env.client.clone())
        .patch(
            &node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(taint),
        )
        .await
        .unwrap();
    env.wait_web_0_released(&uid).await;
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert_eq!(env.events(FENCED).await.len(), 1, "db-0 was not fenced");
    env.stop().await;
    env.delete_node(&node).await;
}

#[tokio::test]
async fn a_fence_timeout_releases_with_the_node_still_down() {
    let mut env = Env::new("ctl-fence-timeout").await;
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &["--fence-timeout=5s"]).await;
    env.assert_web_0_fenced(&node).await;
    env.wait_web_0_released(&uid).await;
    env.stop().await;
    env.delete_node(&node).await;
}

impl Env {
    /// Writes `gone` as the node agent's report into fence `name`'s status.
    async fn report_gone(&self, name: &str, gone: serde_json::Value) {
        let status = serde_json::json!({"status": {"sandboxesGone": gone}});
        Api::<ipreclaim::api::IPFence>::namespaced(self.client.clone(), &self.ns)
            .patch_status(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(status),
            )
            .await
            .unwrap();
    }
}

/// The node agent's evidence lifts a fence at once though the settle is an hour and the node
/// is still down, with a release Event that says why; evidence naming another node, another
/// pod or another fence object (an earlier fence of the same address: stale), or malformed,
/// is counted and never lifts. Each rejection is awaited on its metric, so the fence held
/// through a pass that saw it.
#[tokio::test]
async fn a_fence_lifts_at_once_on_its_node_agents_evidence_and_never_on_wrong_or_stale_evidence() {
    let mut env = Env::new("ctl-fence-evidence").await;
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &["--fence-settle=1h"]).await;
    env.assert_web_0_fenced_alone(&node).await;
    let name = ipreclaim::ipam::fence::fence_object_name("192.0.2.0-24", "10");
    let fence = Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &env.ns)
        .get(&name)
        .await
        .unwrap();
    let fence_uid = fence.metadata.uid.clone().unwrap();
    assert_eq!(
        fence
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ipreclaim::ipam::fence::NODE_LABEL)),
        Some(&node),
        "the agent finds its node's fences by label"
    );
    let good = serde_json::json!({
        "node": node, "podUid": uid, "fenceUid": fence_uid, "observedAt": jiff::Timestamp::now().to_string(),
    });
    let with = |field: &str, value: &str| {
        let mut v = good.clone();
        v[field] = value.into();
        v
    };
    for (report, reason) in [
        (with("node", "another-node"), "wrong_node"),
        (with("podUid", "another-pod"), "wrong_pod"),
        (with("fenceUid", "an-earlier-fence"), "other_fence"),
        (with("observedAt", "yesterday"), "malformed"),
    ] {
        env.report_gone(&name, report).await;
        env.wait_metric(&format!(
            r#"ipreclaim_fence_evidence_rejected_total{{reason="{reason}"}} 1"#
        ))
        .await;
        env.assert_web_0_fenced(&node).await;
    }
    let reported = std::time::Instant::now();
    env.report_gone(&name, good).await;
    env.wait_keys("192.0.2.0-24", &["11"]).await;
    wait_for("web-0's entry and fence record gone", || async {
        env.entry_and_fence("192.0.2.0-24", "10").await == (None, None)
    })
    .await;
    let released = env.wait_events("IPAddressGarbageCollected").await;
    assert_eq!(released.len(), 1, "{released:?}");
    assert_eq!(
        (released[0].0.as_str(), released[0].1.as_str()),
        ("web-0", uid.as_str())
    );
    assert!(
        released[0].2.starts_with(&format!(
            "successful cleanup of IP address [192.0.2.10] from network {}/macvlan (fence lifted: the node agent on its node saw the pod's sandboxes gone)",
            env.ns
        )),
        "{}",
        released[0].2
    );
    wait_for("web-0's reservation deleted", || async {
        env.reservation_names().await.is_empty()
    })
    .await;
    println!(
        "lifted {:?} after the report (settle 1h)",
        reported.elapsed()
    );
    env.stop().await;
    env.delete_node(&node).await;
}

#[tokio::test]
async fn with_fencing_off_a_pod_of_an_unready_node_is_released_at_once_and_old_fences_lift() {
    let mut env = Env::new("ctl-fence-off").await;
    let node = env.fence_node("Unknown").await;
    let uid = env.fenced_web_0(&node, &[]).await;
    env.assert_web_0_fenced(&node).await;
    env.stop().await;
    // Restarted with fencing off: the fence an earlier run set is released.
    env.start(&["--fence-unready-nodes=false"]).await;
    env.wait_web_0_released(&uid).await;
    // And a new deletion on the still unready node is released at once, unfenced.
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert_eq!(
        env.events(FENCED).await.len(),
        1,
        "only web-0's, from the first run"
    );
    env.stop().await;
    env.delete_node(&node).await;
}

#[tokio::test]
async fn a_pod_deleted_from_a_ready_node_is_released_unfenced() {
    let mut env = Env::new("ctl-fence-ready").await;
    let node = env.fence_node("True").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web-0", "web-0")])
        .await;
    env.pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node))
        .await;
    env.start(&[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.wait_events("IPAddressGarbageCollected").await;
    assert!(env.events(FENCED).await.is_empty());
    env.stop().await;
    env.delete_node(&node).await;
}

/// The node goes down while the controller runs and the pod is deleted as soon as the controller
/// has seen it: the pod's node is known from the pod watch, so nothing has to be listed first.
/// (Before, the pods of a node were listed only once it went down, and a pod deleted before that
/// list was released unfenced.)
#[tokio::test]
async fn a_pod_deleted_right_after_its_node_goes_down_is_fenced() {
    let mut env = Env::new("ctl-fence-now").await;
    let node = env.fence_node("True").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-web-0", "web-0"), (11, "sb-db-0", "db-0")],
    )
    .await;
    env.reservation("192.0.2.10", "web-0").await;
    let uid = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node))
        .await;
    env.pod_on("db-0", "macvlan", Some(&["192.0.2.11"]), Some(&node))
        .await;
    env.start(&[]).await;
    env.wait_metric("ipreclaim_unready_nodes 0").await;
    env.set_ready(&node, "Unknown").await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;
    env.delete_pod("web-0").await;
    let events = env.wait_events(FENCED).await;
    assert_eq!(
        events
            .iter()
            .map(|(name, u, _)| (name.as_str(), u.as_str()))
            .collect::<Vec<_>>(),
        [("web-0", uid.as_str())]
    );
    env.assert_web_0_fenced(&node).await;
    env.stop().await;
    env.delete_node(&node).await;
}

/// web-0 recreated, and given 192.0.2.10 back by a new sandbox as whereabouts does by podref.
async fn web_0_recreated_with_its_address(env: &Env) {
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let patch = serde_json::json!({"spec": {"allocations": {"10": {
        "id": "sb-web-0-new", "podref": format!("{}/web-0", env.ns), "ifname": "net1",
    }}}});
    env.pools()
        .patch(
            "192.0.2.0-24",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(patch),
        )
        .await
        .unwrap();
}

/// web-0 is deleted and its entry released; its reservation delete waits for its budget (here:
/// one delete per 5 s, the token taken by a-0's). Meanwhile web-0 is recreated and gets its old
/// address back, as whereabouts' CNI ADD does it: the reservation names the same pod, so it is
/// kept as it is, and a new entry is written. The reservation must stay: it is a live
/// allocation's. (Before, the delete went out guarded by the reservation's uid only.) The pool
/// write stands in for the CNI here; the real plugin does the same on the real node.
#[tokio::test]
async fn a_reservation_whose_address_a_recreated_pod_got_back_is_never_deleted() {
    let mut env = Env::new("ctl-res-guard").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[(10, "sb-web-0", "web-0"), (11, "sb-a-0", "a-0")],
    )
    .await;
    env.reservation("192.0.2.10", "web-0").await;
    env.reservation("192.0.2.11", "a-0").await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    env.pod("a-0", "macvlan", Some(&["192.0.2.11"])).await;
    env.start(&[
        "--reservation-delete-qps=0.2",
        "--reservation-delete-burst=1",
    ])
    .await;
    env.delete_pod("a-0").await;
    wait_for("a-0's reservation deleted", || async {
        env.reservation_names().await == ["192.0.2.10"]
    })
    .await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    // The recreated web-0 gets its address back before the reservation delete goes out.
    web_0_recreated_with_its_address(&env).await;
    env.wait_metric("ipreclaim_reservations_kept_total 1").await;
    assert_eq!(
        env.reservation_names().await,
        ["192.0.2.10"],
        "the live allocation's reservation stays"
    );
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"]);
    env.stop().await;
}

/// A look after a reservation delete that cannot read the pool is not a "no". The delete is
/// held in flight while the recreated web-0 gets its address back (whereabouts keeps the
/// reservation naming it), and from then the pool cannot be read and the controller's pool
/// watch lags (fault proxy) for 20 s, longer than the three looks. Once the pool reads again,
/// the reservation is put back. (The previous version passes too: kube's client retries a 503
/// for minutes, so its one read rode out the outage, and stalled every other look meanwhile;
/// reads now give up after 2 s and the look is tried again every second.)
#[tokio::test]
async fn a_look_that_cannot_read_the_pool_tries_again_and_puts_the_reservation_back() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let mut env = Env::new("ctl-look-retry").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web-0", "web-0")])
        .await;
    env.reservation("192.0.2.10", "web-0").await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
    let proxy = FaultProxy::start(env.client.clone(), 1).await.unwrap();
    let through = ControlPlane::shared().client_through_faults(&proxy).await;
    proxy.set_rules(vec![Rule::new(
        Some("delete"),
        Some("overlappingrangeipreservations"),
        Action::Hold,
    )]);
    env.start_as(through, &[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    wait_for("the reservation delete held in flight", || async {
        proxy
            .injected()
            .contains_key("hold delete overlappingrangeipreservations")
    })
    .await;
    proxy.set_rules(vec![
        Rule::new(Some("get"), Some("ippools"), Action::Status(503)),
        Rule::new(Some("list"), Some("ippools"), Action::Status(503)),
        Rule::new(
            Some("watch"),
            Some("ippools"),
            Action::DelayEvents(Duration::from_secs(60)),
        ),
    ]);
    proxy.cut_watches();
    web_0_recreated_with_its_address(&env).await;
    proxy.release_held();
    wait_for("the held delete to land", || async {
        env.reservation_names().await.is_empty()
    })
    .await;
    // The outage lasts 20 s from the delete: longer than the three looks (0.3 s, 1 s, 5 s)
    // with the client's own retries of each read. (The fault's length, not a wait for the
    // controller.)
    tokio::time::sleep(Duration::from_secs(20)).await;
    let failed_reads = proxy
        .injected()
        .get("503 get ippools")
        .copied()
        .unwrap_or(0);
    assert!(
        failed_reads >= 3,
        "the looks read the pool: {failed_reads} failed reads"
    );
    proxy.clear();
    wait_for("the reservation put back", || async {
        env.reservation_names().await == ["192.0.2.10"]
    })
    .await;
    env.wait_metric("ipreclaim_reservations_restored_total 1")
        .await;
    env.stop().await;
}

/// A zone outage: 2,000 pods of 20 nodes that stop reporting, in one pool of 4,096 addresses
/// with 200 pods of a Ready node, and a second pool of that node. All are deleted at once
/// (operators force-delete what ran in the zone). Nothing of the zone's is freed while its
/// nodes are down (2,000 fences; the pool no longer grows with them: the records are objects);
/// the Ready node's pods in both pools are released meanwhile; once the nodes are back, every
/// fenced address is freed within the settle plus seconds. Prints the figures and what the
/// controller wrote. Stand-in Nodes on a private control plane (its own metrics and load).
#[tokio::test]
async fn a_zone_outage_fences_thousands_in_one_pool_and_frees_them_when_the_zone_returns() {
    use futures::StreamExt;
    const ZONE_NODES: usize = 20;
    const ZONE_PODS: usize = 2000;
    const READY_PODS: usize = 200;
    let (_cp, mut env) = Env::private("ctl-zone").await;
    let ns = env.ns.clone();
    let mut zone = Vec::new();
    for i in 0..ZONE_NODES {
        let node = format!("{ns}-zone-{i}");
        let object = k8s_openapi::api::core::v1::Node {
            metadata: ObjectMeta {
                name: Some(node.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<k8s_openapi::api::core::v1::Node>::all(env.client.clone())
            .create(&PostParams::default(), &object)
            .await
            .unwrap();
        env.set_ready(&node, "True").await;
        zone.push(node);
    }
    let ready = env.fence_node("True").await;
    env.nad("big", "198.18.0.0/20").await;
    env.nad("small", "198.19.0.0/24").await;
    // (name, node, address, pool)
    let mut pods: Vec<(String, String, String, &str)> = Vec::new();
    for i in 0..ZONE_PODS {
        let ip =
            std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(198, 18, 0, 10)) + i as u32);
        pods.push((
            format!("z-{i}"),
            zone[i % ZONE_NODES].clone(),
            ip.to_string(),
            "big",
        ));
    }
    for i in 0..READY_PODS {
        let off = ZONE_PODS + i;
        let ip = std::net::Ipv4Addr::from(
            u32::from(std::net::Ipv4Addr::new(198, 18, 0, 10)) + off as u32,
        );
        pods.push((format!("r-{i}"), ready.clone(), ip.to_string(), "big"));
    }
    for i in 0..READY_PODS / 2 {
        pods.push((
            format!("s-{i}"),
            ready.clone(),
            format!("198.19.0.{}", 10 + i),
            "small",
        ));
    }
    let entries = |pool: &str| -> Vec<(u32, String, String)> {
        pods.iter()
            .filter(|p| p.3 == pool)
            .map(|(name, _, ip, _)| {
                let ip: std::net::Ipv4Addr = ip.parse().unwrap();
                let base = if pool == "big" {
                    [198, 18, 0, 0]
                } else {
                    [198, 19, 0, 0]
                };
                let off = u32::from(ip) - u32::from(std::net::Ipv4Addr::from(base));
                (off, format!("sb-{name}"), name.clone())
            })
            .collect()
    };
    for (pool, range) in [("198.18.0.0-20", "big"), ("198.19.0.0-24", "small")] {
        let e = entries(range);
        let refs: Vec<(u32, &str, &str)> = e
            .iter()
            .map(|(o, sb, n)| (*o, sb.as_str(), n.as_str()))
            .collect();
        let cidr = if range == "big" {
            "198.18.0.0/20"
        } else {
            "198.19.0.0/24"
        };
        env.pool(pool, cidr, &refs).await;
    }
    futures::stream::iter(&pods)
        .for_each_concurrent(32, |(name, node, ip, nad)| {
            let env = &env;
            async move {
                env.pod_on(name, nad, Some(&[ip.as_str()]), Some(node))
                    .await;
            }
        })
        .await;
    env.start(&["--fence-settle=3s", "--sweep-interval=1s"])
        .await;
    for node in &zone {
        env.set_ready(node, "Unknown").await;
    }
    env.wait_metric(&format!("ipreclaim_unready_nodes {ZONE_NODES}"))
        .await;
    let deleting = std::time::Instant::now();
    futures::stream::iter(&pods)
        .for_each_concurrent(32, |(name, _, _, _)| {
            let env = &env;
            async move { env.delete_pod(name).await }
        })
        .await;
    let deleted_in = deleting.elapsed();
    // The Ready node's pods go, in both pools, while the zone is fenced.
    let zone_keys = |keys: Vec<String>| keys.len();
    wait_for(
        "the Ready node's addresses released in both pools",
        || async {
            env.keys("198.19.0.0-24").await.is_empty()
                && zone_keys(env.keys("198.18.0.0-20").await) == ZONE_PODS
        },
    )
    .await;
    env.wait_metric(&format!("ipreclaim_fenced_addresses {ZONE_PODS}"))
        .await;
    let fenced_in = deleting.elapsed();
    let records = Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(records, ZONE_PODS, "one fence record per fenced address");
    env.wait_sweeps(3.0).await;
    let pool = env.pools().get("198.18.0.0-20").await.unwrap();
    assert_eq!(
        pool.spec.allocations.len(),
        ZONE_PODS,
        "nothing of the zone freed"
    );
    assert!(
        pool.spec
            .allocations
            .values()
            .all(|a| a.podref.ends_with(":fenced")),
        "every zone entry fenced"
    );
    assert!(
        pool.metadata.annotations.unwrap_or_default().is_empty(),
        "the pool does not grow with fences"
    );
    // Events follow their releases through their own queue.
    wait_for("a release Event per Ready pod", || async {
        env.events("IPAddressGarbageCollected").await.len() >= READY_PODS + READY_PODS / 2
    })
    .await;
    let released = env.events("IPAddressGarbageCollected").await.len();
    assert_eq!(
        released,
        READY_PODS + READY_PODS / 2,
        "only the Ready node's released"
    );

    let back = std::time::Instant::now();
    for node in &zone {
        env.set_ready(node, "True").await;
    }
    wait_for("every fenced address freed", || async {
        env.keys("198.18.0.0-20").await.is_empty()
    })
    .await;
    let freed_in = back.elapsed();
    let text = env.metrics_text().await;
    println!(
        "zone outage: {ZONE_PODS} pods of {ZONE_NODES} NotReady nodes + {} of a Ready node deleted in {deleted_in:.1?}; \
         Ready node's released and the zone's fenced {fenced_in:.1?} after the first delete; \
         after the nodes returned, all {ZONE_PODS} freed in {freed_in:.1?} (settle 3s); \
         writes: {} pool patches, {} creates, {} deletes",
        READY_PODS + READY_PODS / 2,
        metric_value(&text, r#"ipreclaim_api_writes_total{verb="patch"}"#),
        metric_value(&text, r#"ipreclaim_api_writes_total{verb="create"}"#),
        metric_value(&text, r#"ipreclaim_api_writes_total{verb="delete"}"#),
    );
    assert!(
        freed_in >= Duration::from_secs(3),
        "not before the settle: {freed_in:?}"
    );
    wait_for("every fence record gone", || async {
        Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &ns)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    env.stop().await;
}

/// A ValidatingAdmissionPolicy (a real apiserver's admission, bound to the test's namespace)
/// that refuses any pool write marking entry `key` fenced: stands for any refusal of one
/// entry's write (too large, invalid, forbidden). Returns its name (also the binding's).
async fn refuse_fencing_entry(env: &Env, key: &str) -> String {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let name = format!("{}-refuse-fence", env.ns);
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["whereabouts.cni.cncf.io"], "apiVersions": ["*"],
                "operations": ["UPDATE"], "resources": ["ippools"],
            }]},
            "validations": [{
                "expression": format!(
                    "!('{key}' in object.spec.allocations) || !object.spec.allocations['{key}'].podref.endsWith(':fenced')"
                ),
                "message": "refused by the test's admission policy",
            }],
        },
    }))
    .unwrap();
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": env.ns},
            }},
        },
    }))
    .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(env.client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(env.client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    name
}

/// Waits until a dry-run of marking entry `key` of `pool` fenced is refused (`refused`) or not.
async fn wait_fencing_refused(env: &Env, pool: &str, key: &str, refused: bool) {
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "replace", "path": format!("/spec/allocations/{key}/podref"), "value": "x/y:fenced"},
    ]))
    .unwrap();
    wait_for("the admission policy in force", || async {
        let params = kube::api::PatchParams::default().dry_run();
        let result = env
            .pools()
            .patch(pool, &params, &kube::api::Patch::<()>::Json(patch.clone()))
            .await;
        result.is_err() == refused
    })
    .await;
}

/// A fence the apiserver refuses holds: the entry stays allocated, the failure is retried and
/// reported on the deleted pod, and the sweep never releases it; db-0 and x-0, deleted from a
/// Ready node in the same pool meanwhile (in the same patch when the writer batches them), are
/// released at once. Before, a refused patch failed its whole batch and, after the retries,
/// the sweep released web-0 with its node still down. The node comes back before the refusal
/// ends: the fence is still written (the deletion was seen while the node was down) and lifts
/// after the settle.
#[tokio::test]
async fn a_fence_the_apiserver_refuses_holds_and_the_rest_of_the_pool_is_released() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let mut env = Env::new("ctl-fence-refused").await;
    let down = env.fence_node("Unknown").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(
        "192.0.2.0-24",
        "192.0.2.0/24",
        &[
            (10, "sb-web-0", "web-0"),
            (11, "sb-db-0", "db-0"),
            (12, "sb-x-0", "x-0"),
        ],
    )
    .await;
    let policy = refuse_fencing_entry(&env, "10").await;
    wait_fencing_refused(&env, "192.0.2.0-24", "10", true).await;
    let web = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&down))
        .await;
    let db = env.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
    let x = env.pod("x-0", "macvlan", Some(&["192.0.2.12"])).await;
    env.start(&["--max-retries=1", "--fence-settle=5s"]).await;
    // x-0's patch goes at once; web-0's and db-0's, within the pool's spacing, go together.
    env.delete_pod("x-0").await;
    env.delete_pod("web-0").await;
    env.delete_pod("db-0").await;
    env.wait_keys("192.0.2.0-24", &["10"]).await;
    let failed = env.wait_events("IPAddressGarbageCollectionFailed").await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].1, web, "on the deleted web-0: {failed:?}");
    assert!(failed[0].2.contains("fence not written"), "{}", failed[0].2);
    env.wait_metric("ipreclaim_fence_write_failures_total 3")
        .await;
    env.wait_sweeps(5.0).await;
    let entries = env
        .pools()
        .get("192.0.2.0-24")
        .await
        .unwrap()
        .spec
        .allocations;
    assert_eq!(
        entries.get("10").map(|a| a.podref.as_str()),
        Some(format!("{}/web-0", env.ns).as_str()),
        "web-0's entry kept while its fence cannot be written"
    );
    let mut released: Vec<String> = env
        .events("IPAddressGarbageCollected")
        .await
        .into_iter()
        .map(|e| e.1)
        .collect();
    released.sort();
    let mut want = vec![db, x];
    want.sort();
    assert_eq!(released, want, "only db-0 and x-0 released");
    assert!(
        metric_value(
            &env.metrics_text().await,
            r#"ipreclaim_release_failures_total{cause="refused"}"#
        ) >= 1.0,
        "the refusal is counted by its cause"
    );
    // The node is back before the refusal ends. The deletion was seen while it was down, so
    // the retried fence is still written, and it lifts only after the settle.
    env.set_ready(&down, "True").await;
    Api::<ValidatingAdmissionPolicyBinding>::all(env.client.clone())
        .delete(&policy, &DeleteParams::default())
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(env.client.clone())
        .delete(&policy, &DeleteParams::default())
        .await
        .unwrap();
    testenv::poll::wait_for_within(
        "web-0's fence written once the refusal ended (retries are up to 30 s apart)",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            env.entry_and_fence("192.0.2.0-24", "10").await.0
                == Some(format!("{}/web-0:fenced", env.ns))
        },
    )
    .await;
    let fenced_at = std::time::Instant::now();
    let events = env.wait_events(FENCED).await;
    assert_eq!(events[0].1, web);
    env.assert_web_0_fenced_alone(&down).await;
    env.wait_keys("192.0.2.0-24", &[]).await;
    assert!(
        fenced_at.elapsed() >= Duration::from_secs(4),
        "released {:?} after the fence was written, settle 5s",
        fenced_at.elapsed()
    );
    env.stop().await;
    env.delete_node(&down).await;
}

/// The controller's watch resumes after an outage of the apiserver it watches through, during
/// which web-0 (on a node that is not Ready) was force-deleted and its replacement created
/// (no network-status yet): its watch sees the replacement and never web-0's Delete. The
/// replacement is in the cache before the deletion is judged, and the cache alone keeps the
/// entry (its allocation may race the annotation); the deleted pod's node still decides: fenced.
#[tokio::test]
async fn a_replacement_known_before_the_deletion_is_judged_still_gets_the_old_address_fenced() {
    let (cp, mut env) = Env::private("ctl-fence-replaced").await;
    let ns = env.ns.clone();
    let down = env.fence_node("Unknown").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web-0", "web-0")])
        .await;
    let old = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&down))
        .await;
    env.start(&[]).await;
    env.wait_metric("ipreclaim_unready_nodes 1").await;

    let (second, other) = cp.start_second_apiserver().await.expect("second apiserver");
    cp.stop_apiserver().expect("stop the first apiserver");
    let pods = Api::<Pod>::namespaced(other, &ns);
    pods.delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    pods.create(
        &PostParams::default(),
        &testenv::fixtures::pod("web-0", None),
    )
    .await
    .unwrap();
    cp.start_apiserver()
        .await
        .expect("restart the first apiserver");
    let events = env.wait_events(FENCED).await;
    assert_eq!(
        events.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(),
        [old.as_str()],
        "the deleted web-0's address is fenced"
    );
    let (podref, _) = env.entry_and_fence("192.0.2.0-24", "10").await;
    assert_eq!(podref, Some(format!("{ns}/web-0:fenced")));
    env.wait_sweeps(3.0).await;
    assert_eq!(env.keys("192.0.2.0-24").await, ["10"], "kept");
    env.stop().await;
    drop(second);
}

/// Creates `object` (raw JSON, so that fields our types require can be left out) in the test
/// namespace.
async fn create_raw<K: kube::Resource<DynamicType = ()>>(env: &Env, object: serde_json::Value) {
    let resource = kube::api::ApiResource::erase::<K>(&());
    let object: kube::api::DynamicObject = serde_json::from_value(object).unwrap();
    Api::<kube::api::DynamicObject>::namespaced_with(env.client.clone(), &env.ns, &resource)
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
}

/// Warning Events with `reason` as (object name, message, count).
async fn warnings(env: &Env, reason: &str) -> Vec<(String, String, i32)> {
    testenv::events::with_reason(&env.client, &env.ns, reason, None)
        .await
        .into_iter()
        .map(|e| {
            let count = testenv::events::count(&e);
            (
                e.involved_object.name.unwrap_or_default(),
                e.message.unwrap_or_default(),
                count,
            )
        })
        .collect()
}

#[tokio::test]
async fn objects_that_do_not_fit_are_skipped_and_reported_once_and_the_rest_goes_on() {
    let mut env = Env::new("ctl-unfit").await;
    let ns = env.ns.clone();
    // Upstream's schemas accept all of these.
    create_raw::<IPPool>(
        &env,
        serde_json::json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
            "metadata": {"name": "nospec"}}),
    )
    .await;
    create_raw::<NetworkAttachmentDefinition>(
        &env,
        serde_json::json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": "config-on-the-node"}}),
    )
    .await;
    let broken = NetworkAttachmentDefinition::new(
        "broken",
        NetworkAttachmentDefinitionSpec {
            config: Some("this is not json".into()),
        },
    );
    Api::<NetworkAttachmentDefinition>::namespaced(env.client.clone(), &ns)
        .create(&PostParams::default(), &broken)
        .await
        .unwrap();
    env.nad("macvlan", "192.0.2.0/24").await;
    create_raw::<IPPool>(
        &env,
        serde_json::json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": "192.0.2.0-24"},
        "spec": {"range": "192.0.2.0/24", "allocations": {
            "10": {"id": "sb-odd", "podref": format!("{ns}/odd-0"), "ifname": "net1"},
            "11": {"id": "sb-nopodref"},
            "12": {"podref": format!("{ns}/noid-0")},
            "13": {"id": "sb-x", "podref": "Not A Pod"},
            "14": {"id": "sb-web", "podref": format!("{ns}/web-0"), "ifname": "net1"},
        }}}),
    )
    .await;
    let odd = testenv::fixtures::pod_with_network_status("odd-0", "{not json");
    env.pods()
        .create(&PostParams::default(), &odd)
        .await
        .unwrap();
    env.pod("web-0", "macvlan", Some(&["192.0.2.14"])).await;

    env.start(&[]).await;
    env.delete_pod("web-0").await;
    env.wait_keys("192.0.2.0-24", &["10", "11", "12", "13"])
        .await;
    env.wait_metric(r#"ipreclaim_invalid_objects{kind="IPPool"} 1"#)
        .await;

    let want = [
        ("InvalidObject", "nospec", "spec"),
        ("InvalidNetworkConfig", "broken", "config cannot be used"),
        ("MalformedNetworkStatus", "odd-0", "network-status"),
        (
            "UnreadablePoolEntries",
            "192.0.2.0-24",
            "allocation 11 has no podref",
        ),
        (
            "UnreadablePoolEntries",
            "192.0.2.0-24",
            "allocation 12 has no id",
        ),
        (
            "UnreadablePoolEntries",
            "192.0.2.0-24",
            r#"podref "Not A Pod", which names no pod"#,
        ),
    ];
    for (reason, object, text) in want {
        wait_for(
            &format!("a {reason} Warning on {object} naming {text:?}"),
            || async {
                warnings(&env, reason)
                    .await
                    .iter()
                    .any(|(o, m, _)| o == object && m.contains(text))
            },
        )
        .await;
    }
    // Reported once, not once per sweep; a NAD without spec is no problem at all. (Counted
    // per reporting controller: other tests' controllers watch NADs cluster-wide and report
    // this one too.)
    env.wait_sweeps(5.0).await;
    for reason in [
        "InvalidObject",
        "InvalidNetworkConfig",
        "MalformedNetworkStatus",
        "UnreadablePoolEntries",
    ] {
        let events = testenv::events::with_reason(&env.client, &ns, reason, None).await;
        let mut by_reporter: BTreeMap<String, Vec<(String, i32)>> = BTreeMap::new();
        for e in &events {
            let reporter = e.reporting_instance.clone().unwrap_or_default();
            let object = e.involved_object.name.clone().unwrap_or_default();
            by_reporter
                .entry(reporter)
                .or_default()
                .push((object, testenv::events::count(e)));
        }
        assert!(!by_reporter.is_empty(), "{reason}: none");
        for (reporter, w) in &by_reporter {
            assert_eq!(w.len(), 1, "{reason} from {reporter}: {w:?}");
            assert_eq!(w[0].1, 1, "{reason} reported once by {reporter}: {w:?}");
            assert!(w[0].0 != "config-on-the-node", "{w:?}");
        }
    }
    // scan reads the same objects.
    let rows = ipreclaim::scan::scan(env.client.clone(), &ns, Default::default())
        .await
        .expect("scan despite the objects that do not fit");
    assert!(rows.is_empty(), "nothing to release: {rows:?}");
    env.stop().await;
}

#[tokio::test]
async fn a_restart_never_releases_what_the_breaker_holds_and_pods_gone_meanwhile_still_go_fast() {
    let mut env = Env::new("ctl-restart-held").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    // 40 allocations whose pods do not exist: a sweep would free all of them.
    let names: Vec<String> = (0..40).map(|i| format!("gone-{i}")).collect();
    env.pool_of_pods("192.0.2.0-24", "192.0.2.0/24", &names)
        .await;
    let flags = ["--max-release-ratio=0.5"];
    env.start(&flags).await;
    let held = env.wait_events("IPAddressGarbageCollectionHeld").await;
    assert!(held[0].2.contains("40 of 40"), "{held:?}");
    env.stop().await;

    // While it is down, a pod of a small pool is deleted; then it restarts (same flags).
    env.nad("small", "198.18.1.0/24").await;
    env.pool("198.18.1.0-24", "198.18.1.0/24", &[(7, "sb-x", "live-1")])
        .await;
    env.pod("live-1", "small", Some(&["198.18.1.7"])).await;
    env.delete_pod("live-1").await;
    env.start(&flags).await;
    env.wait_keys("198.18.1.0-24", &[]).await;
    env.wait_sweeps(5.0).await;
    assert_eq!(
        env.keys("192.0.2.0-24").await.len(),
        40,
        "the restart released what the breaker holds"
    );
    let released = env.events("IPAddressGarbageCollected").await;
    assert_eq!(
        released.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
        ["live-1"],
        "{released:?}"
    );
    env.stop().await;
}

#[tokio::test]
async fn a_pod_that_lists_its_address_between_sweeps_keeps_it() {
    let mut env = Env::new("ctl-flap").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool("192.0.2.0-24", "192.0.2.0/24", &[(10, "sb-web", "web-0")])
        .await;
    env.pod("web-0", "macvlan", Some(&["192.0.2.99"])).await;
    env.start(&["--leak-grace=1s"]).await;
    let status = |ip: &str| {
        let s = serde_json::json!([
            {"name": format!("{}/macvlan", env.ns), "interface": "net1", "ips": [ip]},
        ]);
        serde_json::json!({"metadata": {"annotations": {STATUS: s.to_string()}}})
    };
    // web-0 lists its address briefly every 400 ms: the sweep (every 200 ms) mostly samples the
    // other one, but the address never goes a whole grace (1 s) unlisted.
    for _ in 0..15 {
        for (ip, ms) in [("192.0.2.10", 50), ("192.0.2.99", 350)] {
            env.pods()
                .patch(
                    "web-0",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(status(ip)),
                )
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        assert_eq!(
            env.keys("192.0.2.0-24").await,
            ["10"],
            "released while in use"
        );
    }
    // Unlisted for good: released after the grace.
    env.wait_keys("192.0.2.0-24", &[]).await;
    env.stop().await;
}

/// An `ipreclaim controller` process (the binary, so that it can be killed with SIGKILL).
fn controller_process(env: &Env, flags: &[&str]) -> std::process::Child {
    controller_process_logging(env, flags, None)
}

/// The same, logging at info level into `log` when given (warnings to stderr otherwise).
fn controller_process_logging(
    env: &Env,
    flags: &[&str],
    log: Option<&std::path::Path>,
) -> std::process::Child {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ipreclaim"));
    command
        .arg("controller")
        .arg(format!("--whereabouts-namespace={}", env.ns))
        .arg("--metrics-addr=127.0.0.1:0")
        .args(flags)
        .env("KUBECONFIG", ControlPlane::shared().kubeconfig_path())
        .env("RUST_LOG", if log.is_some() { "info" } else { "warn" })
        .stdout(std::process::Stdio::null());
    if let Some(log) = log {
        command.stderr(std::fs::File::create(log).expect("a log file for the controller"));
    }
    command.spawn().expect("start the ipreclaim binary")
}

/// The Lease's holder identity and when it acquired the Lease.
async fn lease(env: &Env) -> Option<(String, jiff::Timestamp)> {
    let l =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(env.client.clone(), &env.ns)
            .get_opt("ipreclaim-controller")
            .await
            .unwrap()?;
    let spec = l.spec?;
    let at = spec.acquire_time.or(spec.renew_time)?;
    Some((spec.holder_identity?, at.0))
}

#[tokio::test]
async fn when_the_leader_is_killed_the_standby_leads_within_the_lease_and_one_renew_period() {
    let env = Env::new("ctl-kill-leader").await;
    let (duration, grace) = (4u64, 1u64);
    let lease_ns = format!("--lease-namespace={}", env.ns);
    let flags = ["--leader-election=true", "--lease-duration=4s", &lease_ns];
    let mut replicas = [
        controller_process(&env, &flags),
        controller_process(&env, &flags),
    ];
    wait_for("a leader", || async { lease(&env).await.is_some() }).await;
    let (holder, _) = lease(&env).await.unwrap();
    // The identity is `<host>_<pid>-<run>-<nanos>`.
    let pid: u32 = holder
        .rsplit_once('_')
        .and_then(|(_, rest)| rest.split('-').next()?.parse().ok())
        .unwrap_or_else(|| panic!("a pid in the identity {holder:?}"));
    let leader = replicas
        .iter_mut()
        .position(|c| c.id() == pid)
        .unwrap_or_else(|| panic!("the holder {holder} is one of the replicas"));
    replicas[leader].kill().unwrap();
    let killed_at = jiff::Timestamp::now();
    replicas[leader].wait().unwrap();
    wait_for("the standby to hold the Lease", || async {
        lease(&env).await.is_some_and(|(h, _)| h != holder)
    })
    .await;
    let (_, acquired) = lease(&env).await.unwrap();
    let took = acquired.duration_since(killed_at);
    let bound = jiff::SignedDuration::from_secs((duration + (duration - grace)) as i64);
    eprintln!(
        "failover: the standby acquired the Lease {took:#} after the leader's SIGKILL (bound {bound:#})"
    );
    assert!(
        took <= bound,
        "failover took {took:#}, more than the Lease duration plus one renew period ({bound:#})"
    );
    for c in &mut replicas {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The identity's pid (`<host>_<pid>-<run>-<nanos>`).
fn holder_pid(holder: &str) -> u32 {
    holder
        .rsplit_once('_')
        .and_then(|(_, rest)| rest.split('-').next()?.parse().ok())
        .unwrap_or_else(|| panic!("a pid in the identity {holder:?}"))
}

/// A replica that starts while another holds the Lease stands for it only later, so that a
/// standby that was running (and saw the deletions of the takeover gap: the nodes of the pods
/// to fence) takes over first. Before, the newcomer and the standby both tried at expiry and
/// either could win.
#[tokio::test]
async fn a_replica_that_just_started_lets_the_running_standby_take_over() {
    let env = Env::new("ctl-newcomer").await;
    let lease_ns = format!("--lease-namespace={}", env.ns);
    let flags = ["--leader-election=true", "--lease-duration=4s", &lease_ns];
    let logs = ControlPlane::shared()
        .dir()
        .join(format!("{}-logs", env.ns));
    std::fs::create_dir_all(&logs).unwrap();
    let start = |name: &str| controller_process_logging(&env, &flags, Some(&logs.join(name)));
    let standing = |name: &str| {
        std::fs::read_to_string(logs.join(name)).is_ok_and(|l| l.contains("standing for the Lease"))
    };
    let mut leader = start("leader.log");
    wait_for("a leader", || async { lease(&env).await.is_some() }).await;
    let (holder, _) = lease(&env).await.unwrap();
    assert_eq!(holder_pid(&holder), leader.id());
    let mut standby = start("standby.log");
    wait_for("the standby to stand for the Lease", || async {
        standing("standby.log")
    })
    .await;
    leader.kill().unwrap();
    leader.wait().unwrap();
    let mut newcomer = start("newcomer.log");
    wait_for("a new holder", || async {
        lease(&env).await.is_some_and(|(h, _)| h != holder)
    })
    .await;
    let (now_holder, _) = lease(&env).await.unwrap();
    let waited = std::fs::read_to_string(logs.join("newcomer.log")).unwrap_or_default();
    for c in [&mut standby, &mut newcomer] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(
        waited.contains("standing for it after a wait"),
        "the newcomer did not wait: {waited}"
    );
    assert_eq!(
        holder_pid(&now_holder),
        standby.id(),
        "the replica that just started took the Lease before the running standby"
    );
}
