//! The Helm chart: lint and template with the Go-built helm, every flag reachable from
//! values, installed into the real apiserver, and its RBAC denying what the programs must not
//! do. (The programs running under the chart's ServiceAccounts are in `controller.rs` and
//! `node_agent.rs`.)

use std::collections::BTreeSet;

use clap::{CommandFactory, Parser};
use ipreclaim::controller::ControllerArgs;
use ipreclaim::node::NodeAgentArgs;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Client;
use kube::api::{
    Api, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::discovery::pinned_kind;
use serde::Deserialize;
use serde_json::{Value, json};
use testenv::ControlPlane;
use testenv::helm::{chart_dir, helm, install_in, service_account_client};

#[derive(Parser)]
struct ControllerCli {
    #[command(flatten)]
    args: ControllerArgs,
}

#[derive(Parser)]
struct NodeCli {
    #[command(flatten)]
    args: NodeAgentArgs,
}

fn long_flags(cmd: clap::Command) -> BTreeSet<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| *l != "help")
        .map(|l| format!("--{l}"))
        .collect()
}

fn documents(yaml: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(yaml)
        .filter_map(|d| {
            let v = Value::deserialize(d).expect("valid YAML from helm");
            (!v.is_null()).then_some(v)
        })
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name_suffix: &str) -> &'a Value {
    docs.iter()
        .find(|d| {
            d["kind"] == kind
                && d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with(name_suffix))
        })
        .unwrap_or_else(|| panic!("no {kind} *{name_suffix} in the chart's output"))
}

fn template(sets: &[&str]) -> Vec<Value> {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        "rel",
        chart.to_str().unwrap(),
        "--namespace",
        "ipr",
    ];
    for s in sets {
        args.extend(["--set", s]);
    }
    documents(&helm(None, &args).expect("helm template"))
}

fn args_of(workload: &Value) -> Vec<String> {
    workload["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn flags_in(args: &[String]) -> BTreeSet<String> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| format!("--{}", a.split('=').next().unwrap()))
        .collect()
}

#[test]
fn the_charts_crds_are_the_repositorys_crds() {
    let root = chart_dir().join("../..");
    let list = |dir: &std::path::Path| -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    };
    let (ours, chart) = (root.join("crds"), chart_dir().join("crds"));
    assert_eq!(
        list(&ours),
        list(&chart),
        "same files in crds/ and the chart's crds/"
    );
    for f in list(&ours) {
        assert_eq!(
            std::fs::read(ours.join(&f)).unwrap(),
            std::fs::read(chart.join(&f)).unwrap(),
            "charts/ipreclaim/crds/{f} differs from crds/{f}: cp crds/*.yaml charts/ipreclaim/crds/"
        );
    }
}

#[test]
fn helm_lint_and_template_pass_and_every_flag_is_reachable() {
    let chart = chart_dir();
    helm(None, &["lint", "--strict", chart.to_str().unwrap()]).expect("helm lint --strict");
    let docs = template(&[]);

    let deployment = find(&docs, "Deployment", "-controller");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let controller_args = args_of(deployment);
    assert_eq!(controller_args[0], "controller");
    let mut missing: Vec<_> = long_flags(ControllerCli::command())
        .difference(&flags_in(&controller_args))
        .cloned()
        .collect();
    // Only given when on or set (checked below).
    missing.retain(|f| f != "--dry-run" && f != "--fence-timeout");
    assert!(
        missing.is_empty(),
        "controller flags not set from values: {missing:?}"
    );
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(
        c["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(c["resources"]["limits"]["memory"].is_string());
    assert_eq!(
        find(&docs, "PodDisruptionBudget", "-controller")["spec"]["minAvailable"],
        1
    );

    let daemonset = find(&docs, "DaemonSet", "-node-agent");
    let agent_args = args_of(daemonset);
    assert_eq!(agent_args[0], "node-agent");
    let mut missing: Vec<_> = long_flags(NodeCli::command())
        .difference(&flags_in(&agent_args))
        .cloned()
        .collect();
    // The node name comes from the downward API; --dry-run only when on (checked below).
    missing.retain(|f| f != "--node-name" && f != "--dry-run");
    assert!(
        missing.is_empty(),
        "node-agent flags not set from values: {missing:?}"
    );
    let pod = &daemonset["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env = |name: &str| {
        c["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("{name} in the node agent's env: {}", c["env"]))
    };
    assert_eq!(
        env("NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    // logLevel reaches both programs as RUST_LOG.
    assert_eq!(env("RUST_LOG")["value"], "info");
    let controller =
        &find(&docs, "Deployment", "-controller")["spec"]["template"]["spec"]["containers"][0];
    assert!(
        controller["env"].as_array().is_some_and(|e| e
            .iter()
            .any(|v| v["name"] == "RUST_LOG" && v["value"] == "info")),
        "RUST_LOG in the controller's env: {}",
        controller["env"]
    );
    assert_eq!(
        pod["volumes"],
        json!([{"name": "cri-socket", "hostPath": {"path": "/run/containerd/containerd.sock", "type": "Socket"}}]),
        "the CRI socket is the only volume"
    );
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
    assert!(!docs.iter().any(|d| d["kind"] == "ServiceMonitor"));

    // Values reach the flags.
    let docs = template(&[
        "controller.dryRun=true",
        "controller.leakGrace=5m",
        "controller.fence.timeout=10m",
        "nodeAgent.criSocket=/run/crio/crio.sock",
        "nodeAgent.dryRun=true",
        "serviceMonitor.enabled=true",
        "whereaboutsNamespace=ipam",
    ]);
    let controller_args = args_of(find(&docs, "Deployment", "-controller"));
    for want in [
        "--dry-run",
        "--leak-grace=5m",
        "--fence-timeout=10m",
        "--whereabouts-namespace=ipam",
    ] {
        assert!(
            controller_args.contains(&want.to_string()),
            "{want} in {controller_args:?}"
        );
    }
    let agent_args = args_of(find(&docs, "DaemonSet", "-node-agent"));
    for want in ["--cri-endpoint=unix:///run/crio/crio.sock", "--dry-run"] {
        assert!(
            agent_args.contains(&want.to_string()),
            "{want} in {agent_args:?}"
        );
    }
    assert_eq!(
        docs.iter()
            .filter(|d| d["kind"] == "ServiceMonitor")
            .count(),
        2
    );
    assert_eq!(
        find(&docs, "Role", "-controller-pools")["metadata"]["namespace"],
        "ipam"
    );

    // Nodes are read only for fencing.
    let node_rules = |docs: &[Value]| {
        docs.iter()
            .filter(|d| {
                d["kind"] == "ClusterRole"
                    && d["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.contains("-controller"))
            })
            .flat_map(|d| d["rules"].as_array().unwrap().iter())
            .filter(|r| r["resources"] == json!(["nodes"]))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        node_rules(&template(&[])),
        [json!({"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]})]
    );
    assert!(node_rules(&template(&["controller.fence.unreadyNodes=false"])).is_empty());
}

async fn get_dynamic(client: &Client, doc: &Value) -> Value {
    let (group, version) = match doc["apiVersion"].as_str().unwrap().split_once('/') {
        Some((g, v)) => (g.to_string(), v.to_string()),
        None => (
            String::new(),
            doc["apiVersion"].as_str().unwrap().to_string(),
        ),
    };
    let gvk = GroupVersionKind::gvk(&group, &version, doc["kind"].as_str().unwrap());
    let (resource, caps) = pinned_kind(client, &gvk).await.expect("kind served");
    let name = doc["metadata"]["name"].as_str().unwrap();
    let api: Api<DynamicObject> = match doc["metadata"]["namespace"].as_str() {
        Some(ns) if caps.scope == kube::discovery::Scope::Namespaced => {
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        _ => Api::all_with(client.clone(), &resource),
    };
    let obj = api
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("{} {name} from the chart: {e}", doc["kind"]));
    serde_json::to_value(obj).unwrap()
}

struct Installed {
    client: Client,
    ns: String,
    manifest: Vec<Value>,
    prefix: String,
}

async fn install_chart(prefix: &str) -> Installed {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    cp.install_crds(&client).await.expect("install crds/");
    let ns = cp.namespace(&client, prefix).await;
    let manifest = install_in(cp, &ns).expect("helm install");
    Installed {
        client,
        prefix: format!("{ns}-ipreclaim"),
        ns,
        manifest: documents(&manifest),
    }
}

#[tokio::test]
async fn helm_install_creates_what_the_chart_says() {
    let it = install_chart("chart-install").await;
    let kinds: BTreeSet<&str> = it
        .manifest
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    let want: BTreeSet<&str> = [
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    .into();
    assert_eq!(kinds, want);
    for doc in &it.manifest {
        let live = get_dynamic(&it.client, doc).await;
        match doc["kind"].as_str().unwrap() {
            "ClusterRole" | "Role" => {
                assert_eq!(live["rules"], doc["rules"], "{}", doc["metadata"]["name"])
            }
            "ClusterRoleBinding" | "RoleBinding" => {
                assert_eq!(live["roleRef"], doc["roleRef"]);
                assert_eq!(live["subjects"], doc["subjects"]);
            }
            "Deployment" | "DaemonSet" => {
                let (l, d) = (
                    &live["spec"]["template"]["spec"],
                    &doc["spec"]["template"]["spec"],
                );
                assert_eq!(l["containers"][0]["args"], d["containers"][0]["args"]);
                assert_eq!(l["serviceAccountName"], d["serviceAccountName"]);
                assert_eq!(
                    l["containers"][0]["securityContext"],
                    d["containers"][0]["securityContext"]
                );
                assert_eq!(l["volumes"], d["volumes"]);
            }
            _ => {}
        }
    }
    let deployment = find(&it.manifest, "Deployment", "-controller");
    assert_eq!(
        deployment["metadata"]["name"],
        format!("{}-controller", it.prefix)
    );
    assert_eq!(
        get_dynamic(&it.client, deployment).await["spec"]["replicas"],
        2
    );
}

/// Asserts that `result` is a 403.
fn forbidden<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

#[tokio::test]
async fn the_charts_service_accounts_are_denied_what_the_programs_must_not_do() {
    let it = install_chart("chart-rbac").await;
    let cp = ControlPlane::shared();
    let admin = &it.client;
    // Things to be denied on.
    let pod = testenv::fixtures::pod("victim", None);
    Api::<Pod>::namespaced(admin.clone(), &it.ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "s"}, "stringData": {"k": "v"}
    }))
    .unwrap();
    Api::<Secret>::namespaced(admin.clone(), &it.ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let lease: Lease =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses"}})).unwrap();
    Api::<Lease>::namespaced(admin.clone(), &it.ns)
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
    let nad = ipreclaim::api::NetworkAttachmentDefinition::new(
        "net",
        ipreclaim::api::NetworkAttachmentDefinitionSpec {
            config: Some("{}".into()),
        },
    );
    Api::<ipreclaim::api::NetworkAttachmentDefinition>::namespaced(admin.clone(), &it.ns)
        .create(&PostParams::default(), &nad)
        .await
        .unwrap();

    for who in ["controller", "node-agent"] {
        let client = service_account_client(cp, admin, &it.ns, who).await;
        let pods = Api::<Pod>::namespaced(client.clone(), &it.ns);
        forbidden(
            &format!("{who} deletes a pod"),
            pods.delete("victim", &DeleteParams::default()).await,
        );
        forbidden(
            &format!("{who} reads a secret"),
            Api::<Secret>::namespaced(client.clone(), &it.ns)
                .get("s")
                .await,
        );
        let other = json!({"spec": {"holderIdentity": who}});
        forbidden(
            &format!("{who} updates another Lease"),
            Api::<Lease>::namespaced(client.clone(), &it.ns)
                .patch(
                    "someone-elses",
                    &PatchParams::default(),
                    &Patch::Merge(&other),
                )
                .await,
        );
        forbidden(
            &format!("{who} patches a NAD"),
            Api::<ipreclaim::api::NetworkAttachmentDefinition>::namespaced(client.clone(), &it.ns)
                .patch(
                    "net",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"config": "{\"x\":1}"}})),
                )
                .await,
        );
        // Pools elsewhere than the whereabouts namespace are out of reach.
        forbidden(
            &format!("{who} reads pools outside the whereabouts namespace"),
            Api::<ipreclaim::api::IPPool>::namespaced(client.clone(), "default")
                .get_opt("x")
                .await,
        );
        // What each must do is allowed (the programs' own scenarios prove the rest).
        pods.get("victim")
            .await
            .unwrap_or_else(|e| panic!("{who} reads a pod: {e}"));
    }
    // The node agent never lists pools.
    let agent = service_account_client(cp, admin, &it.ns, "node-agent").await;
    forbidden(
        "node-agent lists pools",
        Api::<ipreclaim::api::IPPool>::namespaced(agent.clone(), &it.ns)
            .list(&Default::default())
            .await,
    );
    // It reports on fences through their status only: their spec is out of its reach.
    let spec: ipreclaim::api::IPFenceSpec = serde_json::from_value(json!({
        "pool": "p", "key": "1", "address": "192.0.2.1", "sandbox": "sb", "podref": "ns/a",
        "uid": "u", "node": "n", "since": "2026-11-24T10:00:00Z",
    }))
    .unwrap();
    Api::<ipreclaim::api::IPFence>::namespaced(admin.clone(), &it.ns)
        .create(
            &PostParams::default(),
            &ipreclaim::api::IPFence::new("f", spec),
        )
        .await
        .unwrap();
    let fences = Api::<ipreclaim::api::IPFence>::namespaced(agent, &it.ns);
    forbidden(
        "node-agent patches a fence's spec",
        fences
            .patch(
                "f",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"node": "other"}})),
            )
            .await,
    );
    forbidden(
        "node-agent deletes a fence",
        fences.delete("f", &DeleteParams::default()).await,
    );
    let status = json!({"status": {"sandboxesGone": {"node": "n"}}});
    fences
        .patch_status("f", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("node-agent patches a fence's status");
}
