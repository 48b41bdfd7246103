//! The built binary's command line against the real kube-apiserver: `ipreclaim scan` in each
//! output format with its exit code, and `kubectl ipreclaim scan` driven by the real kubectl
//! through a `kubectl-ipreclaim` symlink on PATH.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::Value;
use testenv::ControlPlane;
use testenv::procs::{exit_code, explain};

const BIN: &str = env!("CARGO_BIN_EXE_ipreclaim");
/// A sandbox id as containerd writes them (64 hex digits).
const LONG_ID: &str = "3f9c2a7be41d5c06a8f1e2d3c4b5a69788796a5b4c3d2e1f0a9b8c7d6e5f4a3b";

/// A namespace (also the whereabouts namespace) with a NAD, a live pod web-0 listing
/// 192.0.2.21, and a pool holding 192.0.2.10 for gone-0 (no such pod: PodMissing),
/// 192.0.2.20 for web-0 (not listed: IPNotOnPod) and 192.0.2.21 for web-0 (kept).
async fn leaky_namespace(prefix: &str) -> (Client, String) {
    let cp = ControlPlane::shared();
    let (client, ns) = cp.client_crds_and_namespace(prefix).await;
    let config = r#"{"cniVersion":"0.3.1","type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.0/24"}}"#;
    support::create_nad(&client, &ns, "macvlan", config).await;
    let entry = |id: &str, pod: &str| support::allocation(&ns, pod, id);
    let allocations = BTreeMap::from([
        ("10".to_string(), entry("sb-gone", "gone-0")),
        ("20".to_string(), entry(LONG_ID, "web-0")),
        ("21".to_string(), entry("sb-web-now", "web-0")),
    ]);
    support::create_pool(&client, &ns, "192.0.2.0-24", "192.0.2.0/24", allocations).await;
    let status = serde_json::json!([
        {"name": "cbr0", "interface": "eth0", "ips": ["10.244.0.5"], "default": true},
        {"name": format!("{ns}/macvlan"), "interface": "net1", "ips": ["192.0.2.21"]},
    ]);
    let pod = testenv::fixtures::annotated_pod(
        "web-0",
        ipreclaim::ipam::NETWORK_STATUS_ANNOTATION,
        &status.to_string(),
    );
    Api::<Pod>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    (client, ns)
}

fn kubeconfig() -> PathBuf {
    ControlPlane::shared().kubeconfig_path()
}

/// Runs `ipreclaim <args>` with no kubeconfig in the environment (`--kubeconfig` is passed
/// where a test wants one).
/// `ipreclaim scan --whereabouts-namespace=<ns> --kubeconfig <kc> <extra>`, for each `extra`.
fn scanner(ns: &str, kc: &Path) -> impl Fn(&[&str]) -> Output + use<> {
    let wns = format!("--whereabouts-namespace={ns}");
    let kc = kc.to_str().unwrap().to_string();
    move |extra| {
        let mut args = vec!["scan", &wns, "--kubeconfig", &kc];
        args.extend_from_slice(extra);
        ipreclaim(&args)
    }
}

/// What `out` printed, once it exited `want` (`why` says why it should).
fn printed(out: &Output, want: i32, why: &str) -> String {
    assert_eq!(exit_code(out), want, "{why}: {}", explain(out));
    stdout(out)
}

/// `rows` without their `pod_age_seconds`.
fn without_ages(mut rows: Value) -> Value {
    for row in rows.as_array_mut().into_iter().flatten() {
        if let Some(row) = row.as_object_mut() {
            row.remove("pod_age_seconds");
        }
    }
    rows
}

fn ipreclaim(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("WHEREABOUTS_NAMESPACE")
        .env("HOME", "/nonexistent")
        .output()
        .expect("run the ipreclaim binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("UTF-8 output")
}

/// (ip, decision, reason) of each JSON row.
fn json_rows(text: &str) -> Vec<(String, String, String)> {
    let rows: Vec<Value> = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    rows.iter()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (s("ip"), s("decision"), s("reason"))
        })
        .collect()
}

fn expected_rows() -> Vec<(String, String, String)> {
    [
        ("192.0.2.10", "candidate", "PodMissing"),
        ("192.0.2.20", "candidate", "IPNotOnPod"),
    ]
    .iter()
    .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
    .collect()
}

#[tokio::test]
async fn scan_prints_each_format_and_exits_like_kubectl_diff() {
    let (_client, ns) = leaky_namespace("cli-scan").await;
    let scan = scanner(&ns, &kubeconfig());

    // table (the default): a header, two rows, short sandbox ids, human ages, <none>.
    let table = printed(&scan(&[]), 1, "something would be released");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(
        lines[0].starts_with("POOL") && lines[0].contains("POD AGE"),
        "{table}"
    );
    assert!(
        lines[1].contains("192.0.2.10") && lines[1].contains("PodMissing"),
        "{table}"
    );
    assert!(
        lines[1].contains("<none>"),
        "no pod gone-0, so no age: {table}"
    );
    assert!(lines[2].contains(&LONG_ID[..12]), "{table}");
    assert!(
        !table.contains(&LONG_ID[..13]),
        "ids are cut to 12: {table}"
    );
    let age = lines[2].split_whitespace().nth(6).unwrap();
    assert!(
        age.ends_with('s') || age.ends_with('m'),
        "a human age like 5s or 2m: {age:?} in {table}"
    );

    // wide: the whole id.
    let out = scan(&["-o", "wide"]);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    assert!(stdout(&out).contains(LONG_ID), "{}", explain(&out));
    assert!(
        stdout(&out)
            .lines()
            .next()
            .unwrap()
            .ends_with("FENCED BECAUSE")
    );

    // json and yaml: the same rows.
    let out = scan(&["-o", "json"]);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    assert_eq!(json_rows(&stdout(&out)), expected_rows());
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json[1]["sandbox"], LONG_ID, "JSON keeps the whole id");
    let out = scan(&["--output=yaml"]);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    let yaml: Value = serde_norway::from_str(&stdout(&out)).expect("YAML");
    // Two scans a second apart may see a pod one second older.
    assert_eq!(without_ages(yaml), without_ages(json));

    // -n filters by the pods' namespace: nothing of another namespace, exit 0.
    let out = scan(&["-n", "elsewhere", "-o", "json"]);
    assert_eq!(
        exit_code(&out),
        0,
        "nothing to release there: {}",
        explain(&out)
    );
    assert_eq!(stdout(&out).trim(), "[]");
    let out = scan(&["-n", &ns, "-o", "json"]);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    assert_eq!(json_rows(&stdout(&out)).len(), 2);
    let out = scan(&["-A", "--no-headers"]);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    assert_eq!(stdout(&out).lines().count(), 2, "{}", explain(&out));
    let out = scan(&["-A", "-n", &ns]);
    assert_eq!(exit_code(&out), 2, "-A and -n conflict: {}", explain(&out));

    // --context: the kubeconfig's own context works, an unknown one is an error (2).
    let out = scan(&["--context", "testenv", "-o", "json"]);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    let out = scan(&["--context", "no-such-context"]);
    assert_eq!(exit_code(&out), 2, "{}", explain(&out));
    assert!(
        out.stdout.is_empty(),
        "no report on an error: {}",
        explain(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no-such-context"),
        "{}",
        explain(&out)
    );

    // Errors: an unreadable kubeconfig, and a pools namespace scan may not list. 2 each.
    let out = scanner(&ns, Path::new("/nonexistent/kubeconfig"))(&[]);
    assert_eq!(exit_code(&out), 2, "{}", explain(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kubeconfig"),
        "{}",
        explain(&out)
    );
    let out = ipreclaim(&["scan", "-o", "name"]);
    assert_eq!(exit_code(&out), 2, "an unknown format: {}", explain(&out));
}

#[tokio::test]
async fn scan_of_a_clean_namespace_exits_zero_with_kubeconfig_from_the_environment() {
    let cp = ControlPlane::shared();
    let (_, ns) = cp.client_crds_and_namespace("cli-scan-clean").await;
    let out = Command::new(BIN)
        .args(["scan", "-o", "json", "--whereabouts-namespace", &ns])
        .env("KUBECONFIG", kubeconfig())
        .output()
        .unwrap();
    assert_eq!(exit_code(&out), 0, "{}", explain(&out));
    assert_eq!(stdout(&out).trim(), "[]");
}

/// A directory holding `kubectl-ipreclaim`, a symlink to the built binary.
fn plugin_dir() -> PathBuf {
    let dir = testenv::procs::run_dir("kubectl-plugin").expect("a run directory");
    std::os::unix::fs::symlink(BIN, dir.join("kubectl-ipreclaim")).expect("symlink");
    dir
}

fn kubectl(plugin_dir: &Path, args: &[&str]) -> Output {
    let kubectl = testenv::procs::binary("kubectl").expect("kubectl");
    let path = format!(
        "{}:{}",
        plugin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new(kubectl)
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig())
        .env_remove("WHEREABOUTS_NAMESPACE")
        .output()
        .expect("run kubectl")
}

#[tokio::test]
async fn kubectl_runs_the_binary_as_its_ipreclaim_plugin() {
    let (_client, ns) = leaky_namespace("cli-plugin").await;
    let dir = plugin_dir();

    let out = kubectl(&dir, &["plugin", "list"]);
    assert!(
        stdout(&out).contains("kubectl-ipreclaim"),
        "kubectl finds the plugin: {}",
        explain(&out)
    );

    let wns = format!("--whereabouts-namespace={ns}");
    let out = kubectl(&dir, &["ipreclaim", "scan", "-o", "json", &wns]);
    assert_eq!(
        exit_code(&out),
        1,
        "kubectl passes the exit code on: {}",
        explain(&out)
    );
    assert_eq!(json_rows(&stdout(&out)), expected_rows());

    let out = kubectl(
        &dir,
        &["ipreclaim", "scan", &wns, "-n", "elsewhere", "-o", "yaml"],
    );
    assert_eq!(exit_code(&out), 0, "{}", explain(&out));
    assert_eq!(stdout(&out).trim(), "[]");

    let kc = kubeconfig();
    let out = kubectl(
        &dir,
        &[
            "ipreclaim",
            "scan",
            &wns,
            "--kubeconfig",
            kc.to_str().unwrap(),
            "--context",
            "no-such-context",
        ],
    );
    assert_eq!(exit_code(&out), 2, "{}", explain(&out));

    // kubectl-style usage.
    let out = kubectl(&dir, &["ipreclaim", "--help"]);
    assert_eq!(exit_code(&out), 0, "{}", explain(&out));
    let help = stdout(&out);
    assert!(
        help.contains("Usage: kubectl ipreclaim <COMMAND>"),
        "{help}"
    );
    assert!(!help.contains("node-agent"), "{help}");
    let out = kubectl(&dir, &["ipreclaim", "scan", "--help"]);
    let help = stdout(&out);
    assert!(
        help.contains("Usage: kubectl ipreclaim scan [OPTIONS]"),
        "{help}"
    );
    assert!(help.contains("-o, --output"), "{help}");
    // The same binary under its own name keeps its own usage.
    let out = ipreclaim(&["scan", "--help"]);
    assert!(
        stdout(&out).contains("Usage: ipreclaim scan [OPTIONS]"),
        "{}",
        explain(&out)
    );
}

/// The krew manifest template, rendered as krew-release-bot would (a tag, each archive's
/// address and digest), is a Plugin whose every platform installs the binary as
/// `kubectl-ipreclaim` (the name that selects plugin mode).
#[test]
fn the_krew_manifest_installs_the_binary_under_the_plugin_name() {
    let path = testenv::procs::workspace_root().join("plugins/krew/ipreclaim.yaml");
    let template = std::fs::read_to_string(&path).expect("plugins/krew/ipreclaim.yaml");
    let tag = "v9.8.7";
    let mut rendered = String::new();
    for line in template.lines() {
        let line = line.replace("{{ .TagName }}", tag);
        match line.trim_start().strip_prefix("{{addURIAndSha \"") {
            Some(rest) => {
                let indent = &line[..line.len() - line.trim_start().len()];
                let (uri, tail) = rest.split_once('"').expect("a quoted address");
                assert_eq!(tail.trim(), ".TagName }}", "{line}");
                rendered.push_str(&format!(
                    "{indent}uri: {uri}\n{indent}sha256: {}\n",
                    "0".repeat(64)
                ));
            }
            None => {
                assert!(
                    !line.contains("{{"),
                    "an unrendered template action: {line}"
                );
                rendered.push_str(&line);
                rendered.push('\n');
            }
        }
    }
    let m: Value = serde_norway::from_str(&rendered).unwrap_or_else(|e| panic!("{e}:\n{rendered}"));
    assert_eq!(
        m["apiVersion"],
        "krew.googlecontainertools.github.com/v1alpha2"
    );
    assert_eq!(m["kind"], "Plugin");
    assert_eq!(m["metadata"]["name"], "ipreclaim");
    assert_eq!(m["spec"]["version"], tag);
    let platforms = m["spec"]["platforms"].as_array().expect("platforms");
    let mut arches = Vec::new();
    for p in platforms {
        let labels = &p["selector"]["matchLabels"];
        assert_eq!(labels["os"], "linux", "{p}");
        arches.push(labels["arch"].as_str().unwrap().to_string());
        let uri = p["uri"].as_str().expect("uri");
        assert!(uri.contains(tag) && uri.ends_with(".tar.gz"), "{uri}");
        assert_eq!(p["bin"], "kubectl-ipreclaim", "{p}");
        let files = p["files"].as_array().expect("files");
        assert!(
            files
                .iter()
                .any(|f| f["from"] == "ipreclaim" && f["to"] == "kubectl-ipreclaim"),
            "the binary is installed under the plugin's name: {p}"
        );
    }
    assert_eq!(arches, ["amd64", "arm64"]);
    // The name krew links it under is the one the binary recognises.
    assert!(ipreclaim_plugin_name_is("kubectl-ipreclaim"));
}

/// Whether the binary, run under `name`, shows kubectl-style usage.
fn ipreclaim_plugin_name_is(name: &str) -> bool {
    let dir = testenv::procs::run_dir("krew-name").expect("a run directory");
    let link = dir.join(name);
    std::os::unix::fs::symlink(BIN, &link).expect("symlink");
    let out = Command::new(&link).arg("--help").output().expect("run it");
    stdout(&out).contains("Usage: kubectl ipreclaim")
}

/// Two live pods listing one address on one network: `scan` shows them in a section of their
/// own (table, wide) and as `duplicate` rows (JSON, YAML), and exits 0 (nothing to release). On
/// a control plane of its own: scans list pods in every namespace, and the other tests' scans
/// must not see these.
#[tokio::test]
async fn scan_shows_duplicate_addresses_in_their_own_section_and_never_as_releases() {
    let cp = ControlPlane::start_for_test().await;
    let (client, ns) = cp.client_crds_and_namespace("cli-dup").await;
    let config = r#"{"cniVersion":"0.3.1","type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.0/24"}}"#;
    support::create_nad(&client, &ns, "macvlan", config).await;
    // b-0 holds 192.0.2.10 (a-0's entry was removed by hand); both list it.
    let allocations =
        BTreeMap::from([("10".to_string(), support::allocation(&ns, "b-0", LONG_ID))]);
    support::create_pool(&client, &ns, "192.0.2.0-24", "192.0.2.0/24", allocations).await;
    for name in ["a-0", "b-0"] {
        let status = support::network_status(&ns, "macvlan", &["192.0.2.10"]);
        let pod = testenv::fixtures::annotated_pod(
            name,
            ipreclaim::ipam::NETWORK_STATUS_ANNOTATION,
            &status,
        );
        Api::<Pod>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    let scan = scanner(&ns, &cp.kubeconfig_path());

    let table = printed(&scan(&[]), 0, "a duplicate is no release");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 5, "{table}");
    assert!(
        lines[0].starts_with("POOL"),
        "no allocation to release: {table}"
    );
    assert_eq!(lines[1], "", "{table}");
    assert!(lines[2].starts_with("Duplicate addresses"), "{table}");
    assert!(lines[3].starts_with("NETWORK"), "{table}");
    let row: Vec<&str> = lines[4].split_whitespace().collect();
    let pods = format!("{ns}/a-0,{ns}/b-0");
    let network = format!("{ns}/macvlan");
    let entry = format!("{ns}/b-0");
    assert_eq!(
        row,
        [
            network.as_str(),
            "192.0.2.10",
            pods.as_str(),
            "192.0.2.0-24",
            entry.as_str()
        ],
        "{table}"
    );
    let out = scan(&["-o", "wide"]);
    assert!(
        stdout(&out).lines().last().unwrap().ends_with(LONG_ID),
        "{}",
        explain(&out)
    );

    let out = scan(&["-o", "json"]);
    assert_eq!(exit_code(&out), 0, "{}", explain(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 1, "{json}");
    let d = &json[0];
    assert_eq!(d["decision"], "duplicate");
    assert_eq!(d["reason"], "IPAddressDuplicate");
    assert_eq!(d["ip"], "192.0.2.10");
    assert_eq!(d["podref"], entry.as_str());
    assert_eq!(d["sandbox"], LONG_ID);
    assert_eq!(d["duplicate"]["network"], network.as_str());
    assert_eq!(
        d["duplicate"]["pods"],
        serde_json::json!([format!("{ns}/a-0"), format!("{ns}/b-0")])
    );
    let out = scan(&["-o", "yaml"]);
    let yaml: Value = serde_norway::from_str(&stdout(&out)).expect("YAML");
    // Two scans a second apart may see a pod one second older.
    assert_eq!(without_ages(yaml), without_ages(json));
    let out = scan(&["-n", "elsewhere", "-o", "json"]);
    assert_eq!(stdout(&out).trim(), "[]", "{}", explain(&out));
}
