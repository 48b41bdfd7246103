//! What operators read from the built binary against the real kube-apiserver: flat JSON logs
//! (every line parsed), the audit lines of a real release and a real fence, leadership lines,
//! start-up errors in the chosen format, --log-level, and /metrics with build_info and process
//! metrics over IPv6 and IPv4 loopback from the default `[::]` listener, for the controller and
//! the node agent.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Map, Value};
use testenv::ControlPlane;
use testenv::poll::{http_get, metric_value, wait_for};
use tokio::io::AsyncBufReadExt;

const BIN: &str = env!("CARGO_BIN_EXE_ipreclaim");
const STATUS: &str = ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;

/// A running binary whose stderr lines are collected.
struct Proc {
    child: tokio::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S], env: &[(&str, &str)]) -> Proc {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.args(args)
            .env_remove("RUST_LOG")
            .env_remove("IPRECLAIM_LOG_LEVEL")
            .env_remove("IPRECLAIM_LOG_FORMAT")
            .env_remove("NODE_NAME")
            .env("KUBECONFIG", ControlPlane::shared().kubeconfig_path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("run the ipreclaim binary");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut reader = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = lines.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = reader.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        Proc { child, lines }
    }

    /// Runs `ipreclaim <program> --log-format=json --metrics-addr=[::]:0 <flags>` and returns
    /// it with the /metrics address it logged in its `starting` line.
    async fn serving(program: &str, starting: &str, flags: &[&str]) -> (Proc, SocketAddr) {
        let args = [program, "--log-format=json", "--metrics-addr=[::]:0"];
        let p = Proc::spawn(&[&args[..], flags].concat(), &[]);
        let addr = p.metrics_addr(starting).await;
        (p, addr)
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Every line so far, each parsed as a flat JSON object.
    fn json(&self) -> Vec<Map<String, Value>> {
        self.lines().iter().map(|l| flat(l)).collect()
    }

    /// Waits for a JSON line whose fields include `want`, and returns it.
    async fn wait_line(&self, what: &str, want: &[(&str, &str)]) -> Map<String, Value> {
        let found = Arc::new(Mutex::new(None));
        wait_for(what, || {
            let hit = self.json().into_iter().find(|l| {
                want.iter()
                    .all(|(k, v)| l.get(*k).and_then(Value::as_str) == Some(v))
            });
            let ok = hit.is_some();
            *found.lock().unwrap() = hit;
            async move { ok }
        })
        .await;
        found.lock().unwrap().take().unwrap()
    }

    /// The address the program logged it serves /metrics on (`metrics_addr`).
    async fn metrics_addr(&self, message: &str) -> SocketAddr {
        let line = self.wait_line(message, &[("message", message)]).await;
        line["metrics_addr"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("a metrics_addr field: {line:?}"))
    }
}

/// `line` as a JSON object whose values are all scalars, with the fixed keys at the top level.
fn flat(line: &str) -> Map<String, Value> {
    let v: Map<String, Value> =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}"));
    for key in ["timestamp", "level", "message", "target"] {
        assert!(
            v.get(key).is_some_and(Value::is_string),
            "{key} at the top level: {line}"
        );
    }
    assert!(
        v.values().all(|x| !x.is_object() && !x.is_array()),
        "flat, nothing nested: {line}"
    );
    assert!(
        ["error", "warn", "info", "debug", "trace"].contains(&v["level"].as_str().unwrap()),
        "{line}"
    );
    v
}

async fn setup(prefix: &str) -> (Client, String) {
    ControlPlane::shared()
        .client_crds_and_namespace(prefix)
        .await
}

/// A pod listing `ip` on `ns/macvlan`, on `node` if given; its uid.
async fn pod(client: &Client, ns: &str, name: &str, ip: &str, node: Option<&str>) -> String {
    let status = serde_json::json!([
        {"name": format!("{ns}/macvlan"), "interface": "net1", "ips": [ip]},
    ]);
    let mut pod = testenv::fixtures::pod(
        name,
        Some(BTreeMap::from([(STATUS.to_string(), status.to_string())])),
    );
    if let Some(node) = node {
        pod.spec.as_mut().unwrap().node_name = Some(node.into());
    }
    testenv::fixtures::create(&Api::<Pod>::namespaced(client.clone(), ns), &pod).await
}

/// A Node whose Ready condition is Unknown (its kubelet stopped reporting).
async fn unready_node(client: &Client, name: &str) {
    let nodes = Api::<Node>::all(client.clone());
    nodes
        .create(&PostParams::default(), &testenv::fixtures::node(name))
        .await
        .unwrap();
    let now = jiff::Timestamp::now().to_string();
    let patch = testenv::fixtures::ready_condition("Unknown", "NodeStatusUnknown", &now);
    testenv::fixtures::merge_status(&nodes, name, patch).await;
}

/// Checks the process metrics and build info of a /metrics text.
fn assert_process_metrics(text: &str, who: &str) {
    let info = text
        .lines()
        .find(|l| l.starts_with("ipreclaim_build_info{"))
        .unwrap_or_else(|| panic!("{who}: no ipreclaim_build_info:\n{text}"));
    assert!(
        info.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION")))
            && info.ends_with(" 1"),
        "{who}: {info}"
    );
    let rss = metric_value(text, "process_resident_memory_bytes");
    assert!(rss > 1e6 && rss < 4e9, "{who}: RSS {rss}");
    let start = metric_value(text, "process_start_time_seconds");
    let now = jiff::Timestamp::now().as_second() as f64;
    assert!(
        start > now - 600.0 && start <= now + 1.0,
        "{who}: started at {start}, now {now}"
    );
    let fds = metric_value(text, "process_open_fds");
    assert!(
        fds >= 5.0 && fds <= metric_value(text, "process_max_fds"),
        "{who}: {fds} fds"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("process_cpu_seconds_total ")),
        "{who}: {text}"
    );
}

/// GETs /metrics over ::1 and over 127.0.0.1 from a listener on `[::]`; the text (the same
/// families both ways).
async fn metrics_both_ways(addr: SocketAddr, who: &str) -> String {
    assert!(
        addr.is_ipv6() && addr.ip().is_unspecified(),
        "{who} listens on [::]: {addr}"
    );
    let v6: SocketAddr = format!("[::1]:{}", addr.port()).parse().unwrap();
    let v4: SocketAddr = format!("127.0.0.1:{}", addr.port()).parse().unwrap();
    let (code6, text6) = http_get(v6, "/metrics").await;
    let (code4, text4) = http_get(v4, "/metrics").await;
    assert_eq!(
        (code6, code4),
        (200, 200),
        "{who}: /metrics over ::1 and 127.0.0.1"
    );
    assert_process_metrics(&text6, who);
    assert_process_metrics(&text4, who);
    for probe in ["/healthz", "/readyz"] {
        let (c6, _) = http_get(v6, probe).await;
        let (c4, _) = http_get(v4, probe).await;
        assert!(c6 == 200 || c6 == 503, "{who} {probe} over ::1: {c6}");
        assert_eq!(c6, c4, "{who} {probe}: the same answer over both families");
    }
    text6
}

#[tokio::test]
async fn json_logs_are_flat_and_a_release_and_a_fence_each_leave_an_audit_line() {
    let (client, ns) = setup("tel-audit").await;
    let node = format!("{ns}-node");
    unready_node(&client, &node).await;
    let config = r#"{"cniVersion":"0.3.1","type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.0/24"}}"#;
    support::create_nad(&client, &ns, "macvlan", config).await;
    let entry = |id: &str, pod: &str| support::allocation(&ns, pod, id);
    let allocations = BTreeMap::from([
        ("10".to_string(), entry("sb-web", "web-0")),
        ("11".to_string(), entry("sb-db", "db-0")),
    ]);
    support::create_pool(&client, &ns, "192.0.2.0-24", "192.0.2.0/24", allocations).await;
    let web_uid = pod(&client, &ns, "web-0", "192.0.2.10", None).await;
    let db_uid = pod(&client, &ns, "db-0", "192.0.2.11", Some(&node)).await;

    let (wns, lns) = (
        format!("--whereabouts-namespace={ns}"),
        format!("--lease-namespace={ns}"),
    );
    let flags = [
        "--leader-election=true",
        "--lease-name=ipreclaim-controller",
        "--sweep-interval=1h",
        "--leak-grace=1h",
        "--fence-settle=1h",
        &wns,
        &lns,
    ];
    let (mut controller, addr) = Proc::serving("controller", "controller starting", &flags).await;
    controller
        .wait_line(
            "leadership gained",
            &[("message", "leadership gained; leading: this replica writes")],
        )
        .await;
    controller
        .wait_line("readiness", &[("message", "caches synced; ready")])
        .await;
    let text = metrics_both_ways(addr, "controller").await;
    assert_eq!(metric_value(&text, "ipreclaim_leader"), 1.0, "{text}");

    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    for name in ["web-0", "db-0"] {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    let target = ("target", "ipreclaim::audit");
    let released = controller
        .wait_line(
            "the release's audit line",
            &[target, ("action", "released"), ("address", "192.0.2.10")],
        )
        .await;
    let fenced = controller
        .wait_line(
            "the fence's audit line",
            &[target, ("action", "fenced"), ("address", "192.0.2.11")],
        )
        .await;
    let field = |l: &Map<String, Value>, k: &str| l[k].as_str().unwrap_or_default().to_string();
    assert_eq!(field(&released, "level"), "info");
    assert_eq!(field(&released, "pod"), format!("{ns}/web-0"));
    assert_eq!(field(&released, "uid"), web_uid);
    assert_eq!(field(&released, "pool"), "192.0.2.0-24");
    assert_eq!(field(&released, "network"), format!("{ns}/macvlan"));
    assert_eq!(field(&released, "sandbox"), "sb-web");
    assert_eq!(field(&released, "interface"), "net1");
    assert_eq!(field(&released, "reason"), "PodDeleted");
    assert!(
        field(&released, "evidence").contains("was deleted"),
        "{released:?}"
    );
    assert!(
        field(&released, "message").contains("192.0.2.10"),
        "{released:?}"
    );

    assert_eq!(field(&fenced, "pod"), format!("{ns}/db-0"));
    assert_eq!(field(&fenced, "uid"), db_uid);
    assert_eq!(field(&fenced, "node"), node);
    assert_eq!(field(&fenced, "sandbox"), "sb-db");
    assert!(
        field(&fenced, "evidence").contains(&format!("node {node} was not Ready")),
        "{fenced:?}"
    );
    // One line per address: nothing audited twice, nothing that was not written.
    let audits: Vec<_> = controller
        .json()
        .into_iter()
        .filter(|l| l["target"] == "ipreclaim::audit")
        .collect();
    assert_eq!(audits.len(), 2, "{audits:?}");

    controller.child.kill().await.unwrap();
    // Every line the controller wrote was a flat JSON object (json() asserts it per line).
    let all = controller.json();
    assert!(all.len() >= 5, "{all:?}");
}

#[tokio::test]
async fn the_node_agent_serves_build_info_and_process_metrics_on_both_families() {
    let (_client, ns) = setup("tel-agent").await;
    let (node, wns) = (
        format!("--node-name={ns}-node"),
        format!("--whereabouts-namespace={ns}"),
    );
    let flags = [
        "--cri-endpoint=unix:///nonexistent/ipreclaim-test.sock",
        &node,
        &wns,
    ];
    let (mut agent, addr) = Proc::serving("node-agent", "node agent starting", &flags).await;
    metrics_both_ways(addr, "node agent").await;
    agent.child.kill().await.unwrap();
    agent.json();
}

/// Runs the binary to its end; (exit code, stderr lines).
async fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> (i32, Vec<String>) {
    let mut p = Proc::spawn(args, env);
    let status = tokio::time::timeout(testenv::poll::WAIT, p.child.wait())
        .await
        .expect("the binary exits")
        .unwrap();
    // The reader task may still hold the last lines.
    wait_for("stderr read to its end", || {
        let done = Arc::strong_count(&p.lines) == 1;
        async move { done }
    })
    .await;
    (status.code().expect("exited"), p.lines())
}

#[tokio::test]
async fn start_up_errors_are_log_lines_in_the_chosen_format() {
    let (_client, ns) = setup("tel-startup").await;
    let wns = format!("--whereabouts-namespace={ns}");

    // A kubeconfig that cannot be read: exit 1, one error line in JSON.
    let (code, lines) = run_to_end(
        &["controller", "--log-format=json", &wns],
        &[
            ("KUBECONFIG", "/nonexistent/kubeconfig"),
            ("HOME", "/nonexistent"),
        ],
    )
    .await;
    assert_eq!(code, 1, "{lines:?}");
    let json: Vec<_> = lines.iter().map(|l| flat(l)).collect();
    let last = json.last().expect("an error line");
    assert_eq!(last["level"], "error", "{lines:?}");
    assert_eq!(last["message"], "controller stopped on an error");
    assert!(
        last["error"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/kubeconfig"),
        "{lines:?}"
    );

    // A flag value the program refuses after parsing: the node agent without a node name.
    let (code, lines) = run_to_end(
        &["node-agent", "--log-format=json", "--node-name=", &wns],
        &[],
    )
    .await;
    assert_eq!(code, 1, "{lines:?}");
    let last = flat(lines.last().expect("an error line"));
    assert_eq!(last["message"], "node agent stopped on an error");
    assert!(
        last["error"].as_str().unwrap().contains("--node-name"),
        "{lines:?}"
    );

    // A flag value clap refuses: still one JSON line (exit 2, as for any usage error).
    let (code, lines) = run_to_end(
        &["controller", "--log-format=json", "--leak-grace=soon"],
        &[],
    )
    .await;
    assert_eq!(code, 2, "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = flat(&lines[0]);
    assert_eq!(line["message"], "invalid arguments");
    assert!(
        line["error"].as_str().unwrap().contains("--leak-grace"),
        "{line:?}"
    );
    let (code, lines) = run_to_end(
        &["node-agent", "--log-level=loud"],
        &[("IPRECLAIM_LOG_FORMAT", "json")],
    )
    .await;
    assert_eq!(code, 2, "{lines:?}");
    assert!(
        flat(&lines[0])["error"].as_str().unwrap().contains("loud"),
        "{lines:?}"
    );

    // In text, the same error reads as text.
    let (code, lines) = run_to_end(
        &["controller", &wns],
        &[
            ("KUBECONFIG", "/nonexistent/kubeconfig"),
            ("HOME", "/nonexistent"),
        ],
    )
    .await;
    assert_eq!(code, 1, "{lines:?}");
    let last = lines.last().unwrap();
    assert!(
        last.contains("ERROR") && last.contains("controller stopped on an error"),
        "{lines:?}"
    );
    assert!(serde_json::from_str::<Value>(last).is_err(), "{last}");
}

#[tokio::test]
async fn the_log_level_flag_sets_the_level_and_rust_log_wins() {
    let (_client, ns) = setup("tel-level").await;
    let port = testenv::procs::free_port().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let args: Vec<String> = [
        "controller".to_string(),
        "--log-format=json".into(),
        "--log-level=warn".into(),
        "--leader-election=false".into(),
        format!("--metrics-addr={addr}"),
        format!("--whereabouts-namespace={ns}"),
    ]
    .to_vec();
    let ready = |addr| async move {
        wait_for("the controller ready", || async move {
            tokio::net::TcpStream::connect(addr).await.is_ok()
                && http_get(addr, "/readyz").await.0 == 200
        })
        .await
    };

    let mut quiet = Proc::spawn(&args, &[]);
    ready(addr).await;
    quiet.child.kill().await.unwrap();
    let _ = quiet.child.wait().await;
    let infos: Vec<_> = quiet
        .json()
        .into_iter()
        .filter(|l| l["level"] != "warn" && l["level"] != "error")
        .collect();
    assert!(infos.is_empty(), "--log-level=warn: {infos:?}");

    let port = testenv::procs::free_port().unwrap();
    let addr2: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut args = args;
    args[4] = format!("--metrics-addr={addr2}");
    let mut loud = Proc::spawn(&args, &[("RUST_LOG", "info")]);
    ready(addr2).await;
    loud.wait_line("an info line", &[("message", "caches synced; ready")])
        .await;
    loud.child.kill().await.unwrap();
}
