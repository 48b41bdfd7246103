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

/// A program's flags (`ControllerArgs`, `NodeAgentArgs`) as a command line.
#[derive(Parser)]
struct Cli<A: clap::Args> {
    #[command(flatten)]
    args: A,
}

type ControllerCli = Cli<ControllerArgs>;
type NodeCli = Cli<NodeAgentArgs>;

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

/// The Kubernetes version `helm template` renders for: a helm built with `go install` assumes
/// v1.20, below the chart's `kubeVersion`.
fn kube_version() -> String {
    testenv::procs::pinned_version("KUBERNETES_VERSION").expect("e2e/controlplane/versions.env")
}

/// `helm template` of the chart with `args` (e.g. `--set k=v`, `-f file`) after its own.
fn template_with(args: &[&str]) -> Result<String, anyhow::Error> {
    let chart = chart_dir();
    let kube = kube_version();
    let mut all = vec![
        "template",
        "rel",
        chart.to_str().unwrap(),
        "--namespace",
        "ipr",
        "--kube-version",
        &kube,
    ];
    all.extend(args);
    helm(None, &all)
}

fn template(sets: &[&str]) -> Vec<Value> {
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
    documents(&template_with(&args).expect("helm template"))
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

/// Every long flag of `program`'s `cmd` is in `args`, but for `unless` (given only when set).
fn assert_flags_set(program: &str, cmd: clap::Command, args: &[String], unless: &[&str]) {
    let missing: Vec<String> = long_flags(cmd)
        .difference(&flags_in(args))
        .filter(|f| !unless.contains(&f.as_str()))
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "{program} flags not set from values: {missing:?}"
    );
}

/// Each of `wants` is one of `args`.
fn assert_args_contain(args: &[String], wants: &[&str]) {
    for want in wants {
        assert!(args.contains(&want.to_string()), "{want} in {args:?}");
    }
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
    // Only given when on or set (checked below).
    assert_flags_set(
        "controller",
        ControllerCli::command(),
        &controller_args,
        &["--dry-run", "--fence-timeout"],
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
    // maxUnavailable, never minAvailable: with one replica a drain can still evict it.
    let pdb = &find(&docs, "PodDisruptionBudget", "-controller")["spec"];
    assert_eq!(pdb["maxUnavailable"], 1, "{pdb}");
    assert!(pdb.get("minAvailable").is_none(), "{pdb}");
    assert_eq!(pdb["unhealthyPodEvictionPolicy"], "AlwaysAllow");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["priorityClassName"],
        "system-cluster-critical"
    );

    let daemonset = find(&docs, "DaemonSet", "-node-agent");
    let agent_args = args_of(daemonset);
    assert_eq!(agent_args[0], "node-agent");
    // The node name and the pod uid come from the downward API; --dry-run only when on
    // (checked below).
    assert_flags_set(
        "node-agent",
        NodeCli::command(),
        &agent_args,
        &["--node-name", "--pod-uid", "--dry-run"],
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
    assert_eq!(
        env("POD_UID")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.uid"
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
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert_eq!(pod["securityContext"]["runAsUser"], 0);
    assert!(
        !docs
            .iter()
            .any(|d| d["kind"] == "ServiceMonitor" || d["kind"] == "PodMonitor")
    );

    // Values reach the flags.
    let docs = template(&[
        "controller.dryRun=true",
        "controller.leakGrace=5m",
        "controller.fence.timeout=10m",
        "nodeAgent.criSocket=/run/crio/crio.sock",
        "nodeAgent.dryRun=true",
        "controller.serviceMonitor.enabled=true",
        "nodeAgent.podMonitor.enabled=true",
        "whereaboutsNamespace=ipam",
    ]);
    let controller_args = args_of(find(&docs, "Deployment", "-controller"));
    assert_args_contain(
        &controller_args,
        &[
            "--dry-run",
            "--leak-grace=5m",
            "--fence-timeout=10m",
            "--whereabouts-namespace=ipam",
        ],
    );
    let agent_args = args_of(find(&docs, "DaemonSet", "-node-agent"));
    assert_args_contain(
        &agent_args,
        &["--cri-endpoint=unix:///run/crio/crio.sock", "--dry-run"],
    );
    let monitors: Vec<_> = docs
        .iter()
        .filter(|d| d["kind"] == "ServiceMonitor" || d["kind"] == "PodMonitor")
        .map(|d| format!("{} {}", d["kind"], d["metadata"]["name"]))
        .collect();
    assert_eq!(
        monitors.iter().map(String::as_str).collect::<BTreeSet<_>>(),
        BTreeSet::from([
            r#""ServiceMonitor" "rel-ipreclaim-controller""#,
            r#""PodMonitor" "rel-ipreclaim-node-agent""#
        ])
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

    // The node agents' report policy is on by default, and off with its value or the agent.
    let policies = |docs: &[Value]| {
        docs.iter()
            .filter(|d| {
                d["kind"]
                    .as_str()
                    .unwrap()
                    .starts_with("ValidatingAdmissionPolicy")
            })
            .count()
    };
    assert_eq!(policies(&template(&[])), 4);
    assert_eq!(
        policies(&template(&["nodeAgent.ownNodeReportsOnly=false"])),
        0
    );
    assert_eq!(policies(&template(&["nodeAgent.enabled=false"])), 0);
    // The marked-entries policy is opt-in.
    assert_eq!(
        policies(&template(&["controller.otherWriters.refuse=true"])),
        6
    );
    assert_eq!(
        policies(&template(&[
            "controller.otherWriters.refuse=true",
            "controller.enabled=false"
        ])),
        4
    );
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
    let (client, ns) = cp.client_crds_and_namespace(prefix).await;
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
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
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
    // The notes say what to check first, with this release's names.
    let notes = helm(
        Some(ControlPlane::shared()),
        &["get", "notes", &it.ns, "--namespace", &it.ns],
    )
    .expect("helm get notes");
    for want in [
        format!(
            "kubectl -n {} get pods -l app.kubernetes.io/instance={}",
            it.ns, it.ns
        ),
        format!("kubectl -n {} logs deploy/{}-controller", it.ns, it.prefix),
        "kubectl get crd ipfences.ipreclaim.io".to_string(),
        format!(
            "kubectl label namespace {} pod-security.kubernetes.io/enforce=privileged",
            it.ns
        ),
        format!("helm test {} -n {}", it.ns, it.ns),
        "get lease ipreclaim-controller".to_string(),
        "kubectl get events -A --field-selector reason=IPAddressGarbageCollected".to_string(),
    ] {
        assert!(notes.contains(&want), "{want:?} in the notes:\n{notes}");
    }
    assert!(!notes.contains("DRY RUN"), "{notes}");
}

/// Asserts that `result` is a 403.
fn forbidden<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

/// Creates `obj` in namespace `ns` as `client`.
async fn create_in<K>(client: &Client, ns: &str, obj: &K)
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + serde::Serialize,
    K::DynamicType: Default,
{
    Api::<K>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), obj)
        .await
        .unwrap();
}

/// A JSON merge patch of `name` through `api`.
async fn merge_patch<K>(api: &Api<K>, name: &str, patch: Value) -> Result<K, kube::Error>
where
    K: Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

#[tokio::test]
async fn the_charts_service_accounts_are_denied_what_the_programs_must_not_do() {
    let it = install_chart("chart-rbac").await;
    let cp = ControlPlane::shared();
    let admin = &it.client;
    // Things to be denied on.
    create_in(admin, &it.ns, &testenv::fixtures::pod("victim", None)).await;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "s"}, "stringData": {"k": "v"}
    }))
    .unwrap();
    create_in(admin, &it.ns, &secret).await;
    let lease: Lease =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses"}})).unwrap();
    create_in(admin, &it.ns, &lease).await;
    let nad = ipreclaim::api::NetworkAttachmentDefinition::new(
        "net",
        ipreclaim::api::NetworkAttachmentDefinitionSpec {
            config: Some("{}".into()),
        },
    );
    create_in(admin, &it.ns, &nad).await;

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
        if who == "node-agent" {
            // RBAC lets it write Leases here (its node's inventory); the inventory policy
            // refuses every other, once the apiserver has loaded it.
            let leases = Api::<Lease>::namespaced(client.clone(), &it.ns);
            testenv::poll::wait_for("the inventory policy in force", || async {
                merge_patch(&leases, "someone-elses", other.clone())
                    .await
                    .is_err()
            })
            .await;
        }
        forbidden(
            &format!("{who} updates another Lease"),
            merge_patch(
                &Api::<Lease>::namespaced(client.clone(), &it.ns),
                "someone-elses",
                other,
            )
            .await,
        );
        forbidden(
            &format!("{who} patches a NAD"),
            merge_patch(
                &Api::<ipreclaim::api::NetworkAttachmentDefinition>::namespaced(
                    client.clone(),
                    &it.ns,
                ),
                "net",
                json!({"spec": {"config": "{\"x\":1}"}}),
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
    let node = format!("{}-n", it.ns);
    fence_of(admin, &it.ns, "f", &node).await;
    let fences = Api::<ipreclaim::api::IPFence>::namespaced(agent, &it.ns);
    forbidden(
        "node-agent patches a fence's spec",
        merge_patch(&fences, "f", json!({"spec": {"node": "other"}})).await,
    );
    forbidden(
        "node-agent deletes a fence",
        fences.delete("f", &DeleteParams::default()).await,
    );
    // Its status, as the agent of the fence's node (see the report policy's test below).
    let fences = Api::<ipreclaim::api::IPFence>::namespaced(
        testenv::helm::node_agent_client_on(cp, admin, &it.ns, &node).await,
        &it.ns,
    );
    merge_patch(&fences, "f", json!({"spec": {"node": "other"}}))
        .await
        .expect_err("node-agent patches a fence's spec");
    report(&fences, "f", "sandboxesGone", &node)
        .await
        .expect("node-agent patches a fence's status");
}

/// A fence of node `node` in `ns`, named `name`, written as admin.
async fn fence_of(admin: &Client, ns: &str, name: &str, node: &str) {
    let spec: ipreclaim::api::IPFenceSpec = serde_json::from_value(json!({
        "pool": "p", "key": "1", "address": "192.0.2.1", "sandbox": "sb", "podref": "ns/a",
        "uid": "u", "node": node, "since": "2026-11-24T10:00:00Z",
    }))
    .unwrap();
    create_in(admin, ns, &ipreclaim::api::IPFence::new(name, spec)).await;
}

/// Writes a report (`sandboxesGone` or `sandboxesPresent`) naming `node` into fence `name`'s
/// status through `fences`, the way the node agent does (a JSON patch of the whole status).
async fn report(
    fences: &Api<ipreclaim::api::IPFence>,
    name: &str,
    kind: &str,
    node: &str,
) -> Result<ipreclaim::api::IPFence, kube::Error> {
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "add", "path": "/status", "value": {kind: {
            "node": node, "podUid": "u", "fenceUid": "", "observedAt": "2026-11-24T10:01:00Z",
        }}},
    ]))
    .unwrap();
    fences
        .patch_status(name, &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
}

/// Asserts that `result` is a 403 whose message contains `says`.
fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>, says: &str) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains(says) => {}
        other => panic!("{what}: expected 403 Forbidden saying {says:?}, got {other:?}"),
    }
}

/// The chart's ValidatingAdmissionPolicy ties a node agent's report to its node, as the real
/// apiserver names it in a token bound to the agent's pod on that node: the agent of node A
/// reports on A's fences as A, and is refused on B's fence and when its report names B; a
/// token of the agent's ServiceAccount bound to no pod (no node claim) is refused. Other
/// identities (here admin) are not matched.
#[tokio::test]
async fn a_node_agent_reports_only_on_its_own_nodes_fences() {
    let it = install_chart("chart-reports").await;
    let cp = ControlPlane::shared();
    let admin = &it.client;
    let (a, b) = (format!("{}-a", it.ns), format!("{}-b", it.ns));
    fence_of(admin, &it.ns, "fa", &a).await;
    fence_of(admin, &it.ns, "fb", &b).await;
    let fences = |client: Client| Api::<ipreclaim::api::IPFence>::namespaced(client, &it.ns);
    let unbound = fences(service_account_client(cp, admin, &it.ns, "node-agent").await);
    let agent_a = fences(testenv::helm::node_agent_client_on(cp, admin, &it.ns, &a).await);
    // The apiserver loads a new policy a moment after it is created: wait until it refuses.
    testenv::poll::wait_for(
        "the report policy refusing a token with no node",
        || async { report(&unbound, "fa", "sandboxesGone", &a).await.is_err() },
    )
    .await;
    refused(
        "a token bound to no pod reports",
        report(&unbound, "fa", "sandboxesGone", &a).await,
        "names no node",
    );

    for kind in ["sandboxesPresent", "sandboxesGone"] {
        let fence = report(&agent_a, "fa", kind, &a)
            .await
            .unwrap_or_else(|e| panic!("A's agent reports {kind} on A's fence: {e}"));
        assert_eq!(
            serde_json::to_value(fence.status).unwrap()[kind]["node"],
            json!(a)
        );
        refused(
            &format!("A's agent reports {kind} on B's fence"),
            report(&agent_a, "fb", kind, &a).await,
            &format!("fence fb is of node {b}"),
        );
        refused(
            &format!("A's agent reports {kind} naming B on B's fence"),
            report(&agent_a, "fb", kind, &b).await,
            &format!("fence fb is of node {b}"),
        );
        refused(
            &format!("A's agent reports {kind} naming B on A's fence"),
            report(&agent_a, "fa", kind, &b).await,
            &format!("must name the reporting node {a}"),
        );
    }
    let stored = fences(admin.clone()).get("fb").await.unwrap();
    assert!(stored.status.is_none(), "B's fence untouched: {stored:?}");
    report(&fences(admin.clone()), "fb", "sandboxesGone", &b)
        .await
        .expect("admin writes B's fence's status");
}

/// `node`'s sandbox inventory Lease named for `name_node`, applied through `leases` as the
/// node agent writes it.
async fn inventory(leases: &Api<Lease>, name_node: &str, node: &str) -> Result<Lease, kube::Error> {
    use ipreclaim::ipam::inventory;
    let name = inventory::lease_name(name_node).unwrap();
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {
            "name": name,
            "labels": {inventory::INVENTORY_LABEL: "true"},
            "annotations": {inventory::INVENTORY_ANNOTATION: ""},
        },
        "spec": {"holderIdentity": node},
    });
    let apply = PatchParams::apply("ipreclaim-node-agent").force();
    leases.patch(&name, &apply, &Patch::Apply(&lease)).await
}

/// The chart's inventory policy ties a node agent's sandbox inventory to its node as its
/// bound token names it: A's agent writes `ipreclaim-sandboxes-A` held by A, and is refused
/// B's inventory, its own held by B, and the controller's election Lease; a token bound to no
/// pod is refused. A forged inventory would fence (delay) the release of another node's pods.
#[tokio::test]
async fn a_node_agent_writes_only_its_own_nodes_inventory() {
    let it = install_chart("chart-inventory").await;
    let cp = ControlPlane::shared();
    let admin = &it.client;
    let (a, b) = (format!("{}-a", it.ns), format!("{}-b", it.ns));
    let election: Lease =
        serde_json::from_value(json!({"metadata": {"name": "ipreclaim-controller"}})).unwrap();
    create_in(admin, &it.ns, &election).await;
    let leases = |client: Client| Api::<Lease>::namespaced(client, &it.ns);
    let unbound = leases(service_account_client(cp, admin, &it.ns, "node-agent").await);
    let agent_a = leases(testenv::helm::node_agent_client_on(cp, admin, &it.ns, &a).await);
    testenv::poll::wait_for(
        "the inventory policy refusing a token with no node",
        || async { inventory(&unbound, &a, &a).await.is_err() },
    )
    .await;
    refused(
        "a token bound to no pod writes an inventory",
        inventory(&unbound, &a, &a).await,
        "names no node",
    );
    inventory(&agent_a, &a, &a)
        .await
        .expect("A's agent writes A's inventory");
    let only = format!("writes only the Lease ipreclaim-sandboxes-{a}");
    refused(
        "A's agent writes B's inventory",
        inventory(&agent_a, &b, &b).await,
        &only,
    );
    refused(
        "A's agent writes B's inventory as A",
        inventory(&agent_a, &b, &a).await,
        &only,
    );
    refused(
        "A's agent writes its own inventory held by B",
        inventory(&agent_a, &a, &b).await,
        &only,
    );
    refused(
        "A's agent takes the controller's Lease",
        merge_patch(
            &agent_a,
            "ipreclaim-controller",
            json!({"spec": {"holderIdentity": a}}),
        )
        .await,
        &only,
    );
    inventory(&leases(admin.clone()), &b, &b)
        .await
        .expect("admin writes B's inventory");
}

/// A pool in `ns` holding (key, id, podref) entries, written as admin.
async fn pool_of(admin: &Client, ns: &str, name: &str, entries: &[(&str, &str, &str)]) {
    let allocations: serde_json::Map<String, Value> = entries
        .iter()
        .map(|(k, id, podref)| {
            (
                k.to_string(),
                json!({"id": id, "podref": podref, "ifname": "net1"}),
            )
        })
        .collect();
    let pool: ipreclaim::api::IPPool = serde_json::from_value(json!({
        "apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": name},
        "spec": {"range": "192.0.2.0/24", "allocations": allocations},
    }))
    .unwrap();
    create_in(admin, ns, &pool).await;
}

/// A JSON patch of pool `name` through `client`: `ops` (whereabouts' CNI and reconciler write
/// JSON patches too).
async fn patch_pool(
    client: &Client,
    ns: &str,
    name: &str,
    ops: Value,
) -> Result<ipreclaim::api::IPPool, kube::Error> {
    let patch: json_patch::Patch = serde_json::from_value(ops).unwrap();
    Api::<ipreclaim::api::IPPool>::namespaced(client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
}

fn remove(key: &str) -> Value {
    json!([{"op": "remove", "path": format!("/spec/allocations/{key}")}])
}

/// The opt-in policy on fenced and cooling entries, with real tokens against the real apiserver:
/// another cleaner's ServiceAccount (granted pool writes by RBAC) may not remove or rewrite a
/// fenced or cooling entry, nor may admin; it may remove and add other entries. The whereabouts
/// CNI's ServiceAccount may (its DEL frees a fenced entry when the node comes back), unless its
/// pod-bound token names the reconciler Deployment's pod; ipreclaim's controller may.
#[tokio::test]
async fn the_marked_entries_policy_refuses_other_writers_but_not_ipreclaim_or_the_cni() {
    let cp = ControlPlane::shared();
    let (admin, ns) = cp.client_crds_and_namespace("chart-marked").await;
    let admin = &admin;
    let cni = format!("system:serviceaccount:{ns}:whereabouts");
    testenv::helm::install(
        cp,
        &ns,
        &ns,
        &[
            format!("whereaboutsNamespace={ns}"),
            "controller.otherWriters.refuse=true".into(),
            format!("controller.otherWriters.usernames[0]={cni}"),
        ],
    )
    .expect("helm install");
    let (web, db, old) = (
        format!("{ns}/web-0:fenced"),
        format!("{ns}/db-0:fenced"),
        format!("{ns}/old-0:cooldown"),
    );
    let cooling = "ipreclaim-cooldown:2099-01-01T00:00:00Z";
    pool_of(
        admin,
        &ns,
        "p",
        &[
            ("10", "sb-10", &web),
            ("11", cooling, &old),
            ("12", "sb-12", "x/live-0"),
            ("13", "sb-13", &db),
            ("14", "sb-14", &web),
            ("15", "sb-15", &web),
        ],
    )
    .await;
    // Pool writes for the other cleaner and the CNI, as whereabouts' install grants them.
    let role: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({
        "metadata": {"name": "pool-writers"},
        "rules": [{"apiGroups": ["whereabouts.cni.cncf.io"], "resources": ["ippools"],
                   "verbs": ["get", "list", "patch", "update"]}],
    }))
    .unwrap();
    create_in(admin, &ns, &role).await;
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "pool-writers"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pool-writers"},
        "subjects": [
            {"kind": "ServiceAccount", "name": "cleaner", "namespace": ns},
            {"kind": "ServiceAccount", "name": "whereabouts", "namespace": ns},
        ],
    }))
    .unwrap();
    create_in(admin, &ns, &binding).await;
    let cleaner = cp
        .service_account_client(admin, &ns, "cleaner")
        .await
        .unwrap();
    let cni_client = cp
        .service_account_client(admin, &ns, "whereabouts")
        .await
        .unwrap();
    let reconciler_pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "whereabouts-reconciler-5d9f-abcde"},
        "spec": {"serviceAccountName": "whereabouts",
                 "containers": [{"name": "c", "image": "localhost/none:1"}]},
    }))
    .unwrap();
    create_in(admin, &ns, &reconciler_pod).await;
    let reconciler_pod = Api::<Pod>::namespaced(admin.clone(), &ns)
        .get("whereabouts-reconciler-5d9f-abcde")
        .await
        .unwrap();
    let reconciler = cp
        .pod_bound_client(admin, &ns, "whereabouts", &reconciler_pod)
        .await
        .unwrap();
    let controller = service_account_client(cp, admin, &ns, "controller").await;

    testenv::poll::wait_for("the marked-entries policy in force", || async {
        let dry = PatchParams::default().dry_run();
        let patch: json_patch::Patch = serde_json::from_value(remove("10")).unwrap();
        Api::<ipreclaim::api::IPPool>::namespaced(cleaner.clone(), &ns)
            .patch("p", &dry, &Patch::<()>::Json(patch))
            .await
            .is_err()
    })
    .await;
    let says = "are fenced or cooling";
    refused(
        "the other cleaner removes a fenced entry",
        patch_pool(&cleaner, &ns, "p", remove("10")).await,
        "entries 10 are fenced or cooling",
    );
    refused(
        "the other cleaner rewrites a cooling entry's podref",
        patch_pool(&cleaner, &ns, "p", json!([
            {"op": "replace", "path": "/spec/allocations/11/podref", "value": format!("{ns}/old-0")},
        ]))
        .await,
        says,
    );
    // The message names every marked entry (in the map's order).
    match patch_pool(
        &cleaner,
        &ns,
        "p",
        json!([
            {"op": "replace", "path": "/spec/allocations", "value": {}},
        ]),
    )
    .await
    {
        Err(kube::Error::Api(s)) if s.code == 403 => {
            let named = s
                .message
                .split("entries ")
                .nth(1)
                .unwrap()
                .split(" are ")
                .next()
                .unwrap();
            let mut named: Vec<&str> = named.split(", ").collect();
            named.sort();
            assert_eq!(named, ["10", "11", "13", "14", "15"], "{}", s.message);
            assert!(
                s.message
                    .ends_with(&format!("not system:serviceaccount:{ns}:cleaner")),
                "{}",
                s.message
            );
        }
        other => panic!("the other cleaner replaces the whole map: {other:?}"),
    }
    refused(
        "admin removes a fenced entry",
        patch_pool(admin, &ns, "p", remove("15")).await,
        says,
    );
    refused(
        "the CNI's ServiceAccount from the reconciler's pod removes a fenced entry",
        patch_pool(&reconciler, &ns, "p", remove("14")).await,
        says,
    );
    // Entries that are not marked are anyone's.
    patch_pool(&cleaner, &ns, "p", remove("12"))
        .await
        .expect("the other cleaner removes a live entry");
    patch_pool(&reconciler, &ns, "p", json!([
        {"op": "add", "path": "/spec/allocations/20", "value": {"id": "sb-20", "podref": "x/new-0"}},
    ]))
    .await
    .expect("the reconciler's pod adds an entry");
    // The CNI's DEL of the fenced sandbox, and ipreclaim's own lift and end.
    patch_pool(&cni_client, &ns, "p", remove("10"))
        .await
        .expect("the CNI removes a fenced entry");
    patch_pool(&controller, &ns, "p", remove("13"))
        .await
        .expect("ipreclaim lifts a fence");
    patch_pool(&controller, &ns, "p", remove("11"))
        .await
        .expect("ipreclaim ends a cooldown");
    let left: Vec<String> = Api::<ipreclaim::api::IPPool>::namespaced(admin.clone(), &ns)
        .get("p")
        .await
        .unwrap()
        .spec
        .allocations
        .into_keys()
        .collect();
    assert_eq!(left, ["14", "15", "20"]);
}

/// Runs helm (no cluster) and returns whether it succeeded and its stdout and stderr together:
/// `helm lint` prints its findings on stdout.
fn helm_outcome(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(testenv::procs::binary("helm").expect("helm"))
        .args(args)
        .output()
        .expect("run helm");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn lint(args: &[&str]) -> (bool, String) {
    let chart = chart_dir();
    let mut all = vec!["lint", "--strict", chart.to_str().unwrap()];
    all.extend(args);
    helm_outcome(&all)
}

/// A value set to something other than its default for every value the chart has beyond the
/// programs' flags (ServiceAccounts, security contexts, scheduling, monitors, the test image).
const EVERY_NEW_VALUE: &str = r#"
controller:
  replicas: 3
  serviceAccount:
    create: false
    name: existing-controller-sa
  podDisruptionBudget:
    maxUnavailable: 2
  priorityClassName: ""
  podSecurityContext:
    runAsNonRoot: true
    runAsUser: 1001
    runAsGroup: 1001
    fsGroup: 1001
    seccompProfile:
      type: RuntimeDefault
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    runAsNonRoot: true
    capabilities:
      drop: ["ALL"]
  nodeSelector:
    kubernetes.io/os: linux
  tolerations:
    - key: dedicated
      operator: Equal
      value: infra
      effect: NoSchedule
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - key: node-role.example/infra
                operator: Exists
  topologySpreadConstraints:
    - maxSkew: 1
      topologyKey: topology.kubernetes.io/zone
      whenUnsatisfiable: DoNotSchedule
    - maxSkew: 2
      topologyKey: kubernetes.io/hostname
      whenUnsatisfiable: ScheduleAnyway
      labelSelector:
        matchLabels:
          team: net
  serviceMonitor:
    enabled: true
    interval: 15s
    labels:
      release: prom
nodeAgent:
  serviceAccount:
    name: agent-sa
    annotations:
      iam.example/role: ipreclaim-agent
  priorityClassName: ""
  podSecurityContext:
    runAsUser: 0
    supplementalGroups: [1234]
    seccompProfile:
      type: RuntimeDefault
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    privileged: false
    capabilities:
      drop: ["ALL"]
  nodeSelector:
    ipreclaim.example/agent: "true"
  tolerations:
    - key: node.kubernetes.io/not-ready
      operator: Exists
      effect: NoExecute
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - key: kubernetes.io/os
                operator: In
                values: [linux]
  podMonitor:
    enabled: true
    interval: 10s
    labels:
      release: prom
tests:
  image:
    repository: registry.example/mirror/busybox
    tag: "1.36"
    pullPolicy: Never
"#;

/// Writes `text` to a file under target/testenv and returns its path.
fn values_file(name: &str, text: &str) -> String {
    let dir = testenv::procs::workspace_root().join("target/testenv");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("chart-values-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn the_values_schema_refuses_unknown_keys_and_wrong_types() {
    let (ok, out) = lint(&[]);
    assert!(ok, "helm lint --strict with the chart's own values:\n{out}");
    let every = values_file("every", EVERY_NEW_VALUE);
    let (ok, out) = lint(&["-f", &every]);
    assert!(ok, "helm lint --strict with every new value set:\n{out}");
    for (set, want) in [
        ("bogus=1", "additional properties 'bogus' not allowed"),
        (
            "controller.sweepIntervall=1m",
            "at '/controller': additional properties 'sweepIntervall' not allowed",
        ),
        // Where the ServiceMonitor switch and the PDB's minAvailable were before.
        (
            "serviceMonitor.enabled=true",
            "additional properties 'serviceMonitor' not allowed",
        ),
        (
            "controller.podDisruptionBudget.minAvailable=1",
            "additional properties 'minAvailable' not allowed",
        ),
        (
            "nodeAgent.serviceAccount.bogus=x",
            "at '/nodeAgent/serviceAccount': additional properties 'bogus' not allowed",
        ),
        (
            "controller.replicas=two",
            "at '/controller/replicas': got string, want integer",
        ),
        (
            "controller.sweepInterval=60",
            "at '/controller/sweepInterval': got number, want string",
        ),
        (
            "nodeAgent.tolerations=none",
            "at '/nodeAgent/tolerations': got string, want array",
        ),
        (
            "controller.extraArgs[0]=1",
            "at '/controller/extraArgs/0': got number, want string",
        ),
        (
            "controller.podDisruptionBudget.maxUnavailable=0",
            "at '/controller/podDisruptionBudget/maxUnavailable': minimum",
        ),
        (
            "controller.maxReleaseRatio=2",
            "at '/controller/maxReleaseRatio': maximum",
        ),
        (
            "nodeAgent.maxReleaseRatio=3",
            "at '/nodeAgent/maxReleaseRatio': maximum",
        ),
        ("logFormat=xml", "at '/logFormat'"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
        (
            "nodeAgent.criSocket=run/crio.sock",
            "at '/nodeAgent/criSocket'",
        ),
    ] {
        let (ok, out) = lint(&["--set", set]);
        assert!(!ok, "helm lint passed with --set {set}:\n{out}");
        assert!(
            out.contains(want),
            "helm lint --set {set} should say {want:?}:\n{out}"
        );
        // install, upgrade and template validate the same way.
        let err = template_with(&["--set", set]).expect_err(set);
        assert!(format!("{err:#}").contains(want), "helm template: {err:#}");
    }
}

/// `over` merged into `base` as Helm merges values: maps key by key, anything else replaced.
fn merged(base: &Value, over: &Value) -> Value {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            let mut out = b.clone();
            for (k, v) in o {
                let m = b.get(k).map_or_else(|| v.clone(), |bv| merged(bv, v));
                out.insert(k.clone(), m);
            }
            Value::Object(out)
        }
        _ => over.clone(),
    }
}

/// A program's pod spec carries its values' security contexts and scheduling.
fn assert_pod_settings(pod: &Value, values: &Value) {
    assert_eq!(pod["securityContext"], values["podSecurityContext"]);
    assert_eq!(
        pod["containers"][0]["securityContext"],
        values["securityContext"]
    );
    assert_eq!(pod["nodeSelector"], values["nodeSelector"]);
    assert_eq!(pod["tolerations"], values["tolerations"]);
    assert_eq!(pod["affinity"], values["affinity"]);
}

/// The monitor `kind` of `component`: the release label, its endpoint (the list `endpoints`,
/// scraped every `interval`) and the pods it selects.
fn assert_monitor(docs: &[Value], kind: &str, component: &str, endpoints: &str, interval: &str) {
    let m = find(docs, kind, &format!("-{component}"));
    assert_eq!(m["metadata"]["labels"]["release"], "prom");
    assert_eq!(
        m["spec"][endpoints],
        json!([{"port": "metrics", "path": "/metrics", "interval": interval}])
    );
    assert_eq!(
        m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        component
    );
}

#[test]
fn every_new_value_reaches_its_place() {
    let every = values_file("every", EVERY_NEW_VALUE);
    let defaults: Value =
        serde_norway::from_str(&std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap())
            .unwrap();
    // What the chart gets: its defaults with these values merged in (a default field such as
    // the containers' seccompProfile stays unless set to null).
    let want = merged(
        &defaults,
        &serde_norway::from_str::<Value>(EVERY_NEW_VALUE).unwrap(),
    );
    let docs = documents(&template_with(&["-f", &every]).expect("helm template -f"));
    let (c, n) = (&want["controller"], &want["nodeAgent"]);

    let deployment = find(&docs, "Deployment", "-controller");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "existing-controller-sa");
    assert!(
        pod.get("priorityClassName").is_none(),
        "an empty priorityClassName is left out: {pod}"
    );
    assert_pod_settings(pod, c);
    // A constraint without a labelSelector gets the controller pods' own; a given one is kept.
    let own = json!({"matchLabels": {
        "app.kubernetes.io/name": "ipreclaim",
        "app.kubernetes.io/instance": "rel",
        "app.kubernetes.io/component": "controller",
    }});
    let mut spread = c["topologySpreadConstraints"].clone();
    spread[0]["labelSelector"] = own.clone();
    assert_eq!(pod["topologySpreadConstraints"], spread);
    assert_eq!(
        deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"],
        "controller",
        "the default labelSelector selects the controller's pods"
    );
    assert!(
        !docs.iter().any(|d| d["kind"] == "ServiceAccount"
            && d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.contains("controller"))),
        "serviceAccount.create=false renders no controller ServiceAccount"
    );
    let subjects_of = |kind: &str, suffix: &str| find(&docs, kind, suffix)["subjects"].clone();
    for (kind, suffix) in [
        ("ClusterRoleBinding", "-controller-ipr"),
        ("RoleBinding", "-controller-pools"),
        ("RoleBinding", "-controller-lease"),
    ] {
        assert_eq!(
            subjects_of(kind, suffix),
            json!([{"kind": "ServiceAccount", "name": "existing-controller-sa", "namespace": "ipr"}]),
            "{kind} *{suffix}"
        );
    }
    let pdb = &find(&docs, "PodDisruptionBudget", "-controller")["spec"];
    assert_eq!(pdb["maxUnavailable"], 2);
    assert_monitor(&docs, "ServiceMonitor", "controller", "endpoints", "15s");

    let daemonset = find(&docs, "DaemonSet", "-node-agent");
    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "agent-sa");
    assert!(pod.get("priorityClassName").is_none(), "{pod}");
    assert_pod_settings(pod, n);
    let sa = find(&docs, "ServiceAccount", "agent-sa");
    assert_eq!(
        sa["metadata"]["annotations"],
        json!({"iam.example/role": "ipreclaim-agent"})
    );
    for (kind, suffix) in [
        ("ClusterRoleBinding", "-node-agent-ipr"),
        ("RoleBinding", "-node-agent-pools"),
    ] {
        assert_eq!(
            subjects_of(kind, suffix),
            json!([{"kind": "ServiceAccount", "name": "agent-sa", "namespace": "ipr"}]),
            "{kind} *{suffix}"
        );
    }
    assert_monitor(
        &docs,
        "PodMonitor",
        "node-agent",
        "podMetricsEndpoints",
        "10s",
    );
    // The node agent's pods carry the metrics port the PodMonitor names.
    assert_eq!(pod["containers"][0]["ports"][0]["name"], "metrics");

    let test = find(&docs, "Pod", "-test-readyz");
    assert_eq!(
        test["spec"]["containers"][0]["image"],
        "registry.example/mirror/busybox:1.36"
    );
    assert_eq!(test["spec"]["containers"][0]["imagePullPolicy"], "Never");

    // PDB off, and monitors off by default.
    let docs = template(&["controller.podDisruptionBudget.enabled=false"]);
    assert!(!docs.iter().any(|d| d["kind"] == "PodDisruptionBudget"));
}

/// The `helm test` pod's script run by sh with the Service's address `address` in its
/// environment and a `wget` that prints its arguments.
fn run_test_script(script: &str, address: &str) -> String {
    let dir = testenv::procs::run_dir("chart-test-script").unwrap();
    let wget = dir.join("wget");
    std::fs::write(&wget, "#!/bin/sh\necho \"$@\"\n").unwrap();
    std::fs::set_permissions(&wget, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = std::process::Command::new("sh")
        .args(["-c", script])
        .env("PATH", format!("{}:/usr/bin:/bin", dir.display()))
        .env("REL_IPRECLAIM_CONTROLLER_SERVICE_HOST", address)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn helm_test_asks_the_controllers_service_for_readyz() {
    let docs = template(&["controller.metricsPort=9090"]);
    let test = find(&docs, "Pod", "-test-readyz");
    assert_eq!(test["metadata"]["annotations"]["helm.sh/hook"], "test");
    // Not deleted when it passes: `helm test --logs` reads its log after it ended.
    assert_eq!(
        test["metadata"]["annotations"]["helm.sh/hook-delete-policy"],
        "before-hook-creation"
    );
    let c = &test["spec"]["containers"][0];
    assert_eq!(c["command"][0], "sh");
    assert_eq!(c["command"][1], "-c");
    // The script asks the Service's address from its environment variables (no DNS needed;
    // the kubelet sets them with enableServiceLinks), an IPv6 one in brackets.
    assert_eq!(test["spec"]["enableServiceLinks"], true);
    let script = c["command"][2].as_str().unwrap();
    for (address, url) in [
        ("10.96.0.20", "http://10.96.0.20:9090/readyz"),
        ("fd00::20", "http://[fd00::20]:9090/readyz"),
    ] {
        assert_eq!(
            run_test_script(script, address),
            format!("-O- -T 5 {url}"),
            "{script}"
        );
    }
    // That Service exists, serves that port and selects the controller's pods.
    let svc = find(&docs, "Service", "-controller");
    assert_eq!(svc["metadata"]["name"], "rel-ipreclaim-controller");
    assert_eq!(svc["spec"]["ports"][0]["port"], 9090);
    assert_eq!(
        svc["spec"]["selector"]["app.kubernetes.io/component"],
        "controller"
    );
    let deployment = find(&docs, "Deployment", "-controller");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(args_of(deployment).contains(&"--metrics-addr=[::]:9090".to_string()));
    assert_eq!(c["image"], "docker.io/library/busybox:1.37");
    // No controller, no test.
    let docs = template(&["controller.enabled=false"]);
    assert!(!docs.iter().any(|d| d["kind"] == "Pod"));
}

/// `extraArgs` come after the chart's own flags, and a repeated flag takes its last value, so
/// `extraArgs` overrides any flag the chart sets: the rendered args, parsed by the programs'
/// own argument structs, carry the extra values.
#[test]
fn extra_args_come_last_and_override_the_charts_flags() {
    let docs = template(&[
        "controller.extraArgs={--sweep-interval=2m,--lease-name=other,--dry-run}",
        "nodeAgent.extraArgs={--relist-period=5s,--sandbox-grace=1m}",
    ]);
    let args = args_of(find(&docs, "Deployment", "-controller"));
    let n = args.len();
    assert_eq!(
        args[n - 3..],
        ["--sweep-interval=2m", "--lease-name=other", "--dry-run"]
    );
    assert!(
        args[..n - 3].contains(&"--sweep-interval=60s".to_string()),
        "the chart's own flag is still there, before: {args:?}"
    );
    let parsed = ControllerCli::try_parse_from(&args).expect("the rendered controller args parse");
    assert_eq!(
        parsed.args.sweep_interval,
        std::time::Duration::from_secs(120)
    );
    assert_eq!(parsed.args.lease_name, "other");
    assert!(parsed.args.dry_run);

    let mut args = args_of(find(&docs, "DaemonSet", "-node-agent"));
    let n = args.len();
    assert_eq!(args[n - 2..], ["--relist-period=5s", "--sandbox-grace=1m"]);
    assert!(args[..n - 2].contains(&"--relist-period=1s".to_string()));
    args.push("--node-name=n".into()); // the downward API's in the pod
    let parsed = NodeCli::try_parse_from(&args).expect("the rendered node-agent args parse");
    assert_eq!(parsed.args.relist_period, std::time::Duration::from_secs(5));
    assert_eq!(
        parsed.args.sandbox_grace,
        std::time::Duration::from_secs(60)
    );
}

/// The README's values table: one row per key of values.yaml (objects that are Kubernetes
/// fields, like `resources`, as one row), each with values.yaml's default; no row for a key
/// values.yaml does not have; every flag named is one of the program's, with the same default.
#[test]
fn the_chart_readme_lists_every_value_with_its_default() {
    let readme = std::fs::read_to_string(chart_dir().join("README.md")).unwrap();
    let values: Value =
        serde_norway::from_str(&std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap())
            .unwrap();
    let section = readme
        .split("\n## Values\n")
        .nth(1)
        .expect("a '## Values' section in the chart README");
    let strip = |cell: &str| -> String {
        let cell = cell.trim();
        cell.strip_prefix('`')
            .and_then(|c| c.strip_suffix('`'))
            .unwrap_or_else(|| panic!("not one `code` span: {cell:?}"))
            .to_string()
    };
    // key -> (default as written, flag)
    let mut rows = std::collections::BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').collect();
        assert!(cells.len() >= 6, "a row of 4 cells: {line}");
        let key = strip(cells[1]);
        let default: Value = serde_norway::from_str(&strip(cells[2]))
            .unwrap_or_else(|e| panic!("default of {key} is not YAML: {e}"));
        let flag = (!cells[3].trim().is_empty()).then(|| strip(cells[3]));
        assert!(
            rows.insert(key.clone(), (default, flag)).is_none(),
            "{key} listed twice"
        );
    }
    assert!(rows.len() > 50, "the table was read: {} rows", rows.len());

    fn walk(
        path: &str,
        v: &Value,
        rows: &std::collections::BTreeMap<String, (Value, Option<String>)>,
        out: &mut Vec<(String, Value)>,
    ) {
        match v.as_object() {
            Some(map) if !map.is_empty() && !rows.contains_key(path) => {
                for (k, v) in map {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(&p, v, rows, out);
                }
            }
            _ => out.push((path.to_string(), v.clone())),
        }
    }
    let mut keys = Vec::new();
    walk("", &values, &rows, &mut keys);

    let mut problems = Vec::new();
    let in_values: BTreeSet<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    for (key, value) in &keys {
        match rows.get(key) {
            None => problems.push(format!("{key} (default {value}) is not in the README")),
            Some((documented, _)) if documented != value => problems.push(format!(
                "{key}: the README says {documented}, values.yaml has {value}"
            )),
            _ => {}
        }
    }
    for key in rows.keys() {
        if !in_values.contains(key.as_str()) {
            problems.push(format!("{key} is in the README but not in values.yaml"));
        }
    }

    // Flags: the program's own, and its default is the chart's.
    let defaults = |cmd: clap::Command| -> std::collections::BTreeMap<String, Option<String>> {
        cmd.get_arguments()
            .filter_map(|a| {
                let d = a.get_default_values();
                Some((
                    format!("--{}", a.get_long()?),
                    d.first().map(|v| v.to_string_lossy().into_owned()),
                ))
            })
            .collect()
    };
    let (controller, agent) = (
        defaults(ControllerCli::command()),
        defaults(NodeCli::command()),
    );
    for (key, (default, flag)) in &rows {
        let Some(flag) = flag else { continue };
        let programs: Vec<_> = match key.split('.').next().unwrap() {
            "controller" => vec![&controller],
            "nodeAgent" => vec![&agent],
            _ => vec![&controller, &agent],
        };
        // How the chart turns the value into the flag's value.
        let as_flag = match (key.as_str(), default) {
            (k, Value::Number(p)) if k.ends_with(".metricsPort") => format!("[::]:{p}"),
            ("nodeAgent.criSocket", Value::String(p)) => format!("unix://{p}"),
            (_, Value::String(s)) => s.clone(),
            (_, v) => v.to_string(),
        };
        for flags in programs {
            match flags.get(flag) {
                None => problems.push(format!("{key}: {flag} is not a flag of the program")),
                Some(clap_default) => {
                    // A switch (--dry-run) has no default: off, the chart's `false`.
                    let clap_default = clap_default.clone().unwrap_or_else(|| {
                        if default == &Value::Bool(false) {
                            "false".into()
                        } else {
                            String::new()
                        }
                    });
                    if clap_default != as_flag {
                        problems.push(format!(
                            "{key}: the chart's default {as_flag:?} is not {flag}'s {clap_default:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "charts/ipreclaim/README.md and values.yaml disagree:\n{}",
        problems.join("\n")
    );
}

/// The Pod Security levels the chart README states, checked by the PodSecurity admission of a
/// real apiserver: the pods as the chart renders them are created (dry run) in namespaces that
/// enforce each level.
#[tokio::test]
async fn the_pods_meet_the_pod_security_levels_the_readme_states() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let docs = template(&[]);
    let pod_of = |doc: &Value, name: &str| -> Pod {
        let spec = if doc["kind"] == "Pod" {
            doc["spec"].clone()
        } else {
            doc["spec"]["template"]["spec"].clone()
        };
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    };
    let pods = [
        (
            "controller",
            pod_of(find(&docs, "Deployment", "-controller"), "controller"),
        ),
        (
            "node-agent",
            pod_of(find(&docs, "DaemonSet", "-node-agent"), "node-agent"),
        ),
        ("test", pod_of(find(&docs, "Pod", "-test-readyz"), "test")),
    ];
    // level -> which of them it admits
    let levels: [(&str, &[&str]); 3] = [
        ("restricted", &["controller", "test"]),
        ("baseline", &["controller", "test"]),
        ("privileged", &["controller", "node-agent", "test"]),
    ];
    for (level, admitted) in levels {
        let ns = cp.namespace(&client, &format!("chart-pss-{level}")).await;
        let label = json!({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": level}}});
        Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .patch(&ns, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .unwrap();
        let api = Api::<Pod>::namespaced(client.clone(), &ns);
        let dry = PostParams {
            dry_run: true,
            ..Default::default()
        };
        for (who, pod) in &pods {
            let result = api.create(&dry, pod).await;
            match (admitted.contains(who), result) {
                (true, Ok(_)) => {}
                (true, Err(e)) => panic!("{who} refused at {level}: {e}"),
                (false, Ok(_)) => panic!("{who} admitted at {level}"),
                (false, Err(kube::Error::Api(s))) => {
                    // Refused for its hostPath volume (and, at restricted, running as root).
                    assert_eq!(s.code, 403, "{who} at {level}: {s:?}");
                    assert!(
                        s.message
                            .contains(&format!("violates PodSecurity \"{level}:latest\""))
                            && s.message.contains("hostPath"),
                        "{who} at {level}: {}",
                        s.message
                    );
                }
                (false, Err(e)) => panic!("{who} at {level}: {e}"),
            }
        }
    }
}

/// A pinned prometheus-operator release: its CRDs (fetched through the Go module proxy, like the
/// control plane's sources) check the chart's ServiceMonitor and PodMonitor.
const PROMETHEUS_OPERATOR: &str = "github.com/prometheus-operator/prometheus-operator@v0.85.0";

fn prometheus_operator_crds() -> Vec<std::path::PathBuf> {
    let out = std::process::Command::new("go")
        .args(["mod", "download", "-json", PROMETHEUS_OPERATOR])
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!("run go (install Go, as scripts/setup.sh needs it; the Go module proxy must answer): {e}")
        });
    assert!(
        out.status.success(),
        "go mod download {PROMETHEUS_OPERATOR} (the Go module proxy must answer): {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let dir = std::path::PathBuf::from(info["Dir"].as_str().expect("Dir"));
    ["servicemonitors", "podmonitors"]
        .iter()
        .map(|k| {
            dir.join(format!(
                "example/prometheus-operator-crd/monitoring.coreos.com_{k}.yaml"
            ))
        })
        .collect()
}

/// Every new value, installed into the real apiserver with prometheus-operator's own
/// ServiceMonitor and PodMonitor CRDs: the apiserver accepts every object (its schemas check
/// the monitors), and what it stores is what the chart rendered.
#[tokio::test]
async fn the_chart_with_every_new_value_installs_with_the_real_monitor_crds() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    cp.install_crds(&client).await.expect("install crds/");
    let files = tokio::task::spawn_blocking(prometheus_operator_crds)
        .await
        .unwrap();
    testenv::controlplane::install_crd_files(&client, &files)
        .await
        .expect("install prometheus-operator's ServiceMonitor and PodMonitor CRDs");
    let ns = cp.namespace(&client, "chart-every").await;
    let every = values_file("every", EVERY_NEW_VALUE);
    let chart = chart_dir();
    let wns = format!("whereaboutsNamespace={ns}");
    helm(
        Some(cp),
        &[
            "install",
            &ns,
            chart.to_str().unwrap(),
            "--namespace",
            &ns,
            "--skip-crds",
            "-f",
            &every,
            "--set",
            &wns,
        ],
    )
    .expect("helm install with every new value");
    let manifest = documents(
        &helm(Some(cp), &["get", "manifest", &ns, "--namespace", &ns]).expect("manifest"),
    );
    let kinds: BTreeSet<&str> = manifest
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert!(
        kinds.contains("ServiceMonitor") && kinds.contains("PodMonitor"),
        "{kinds:?}"
    );
    for doc in &manifest {
        let live = get_dynamic(&client, doc).await;
        match doc["kind"].as_str().unwrap() {
            "ServiceMonitor" | "PodMonitor" => assert_eq!(live["spec"], doc["spec"]),
            "Deployment" | "DaemonSet" => {
                let (l, d) = (
                    &live["spec"]["template"]["spec"],
                    &doc["spec"]["template"]["spec"],
                );
                for field in ["securityContext", "affinity", "nodeSelector", "tolerations"] {
                    assert_eq!(l[field], d[field], "{} {field}", doc["kind"]);
                }
                assert_eq!(
                    l["containers"][0]["securityContext"],
                    d["containers"][0]["securityContext"]
                );
                assert_eq!(l["serviceAccountName"], d["serviceAccountName"]);
            }
            _ => {}
        }
    }
    // A ServiceMonitor the CRD's schema refuses is refused: the check above can fail.
    let bad = json!({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "bad", "namespace": ns},
        "spec": {"selector": {}, "endpoints": [{"port": "metrics", "interval": "soon"}]},
    });
    let gvk = GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor");
    let (resource, _) = pinned_kind(&client, &gvk).await.unwrap();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource);
    let obj: DynamicObject = serde_json::from_value(bad).unwrap();
    match api.create(&PostParams::default(), &obj).await {
        Err(kube::Error::Api(s)) if s.code == 422 => {}
        other => panic!("an interval of 'soon' should be refused: {other:?}"),
    }
}

/// whereabouts' and Multus's own CRDs already in the cluster (the usual case) stay exactly as
/// they are, whether the chart is installed with `--skip-crds` or without it (Helm skips a CRD
/// that exists); the chart's own versions differ from them, so a write would show.
#[tokio::test]
async fn upstreams_crds_stay_as_they_are_with_and_without_skip_crds() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use testenv::procs::{pinned_version, unpacked_source};
    let cp = ControlPlane::start_for_test().await;
    let client = cp.client().await;
    let source = |name: &str, pin: &str| {
        unpacked_source(&format!("{name}-{}", pinned_version(pin).unwrap()))
            .unwrap_or_else(|e| panic!("{e:#}"))
    };
    let wb = source("whereabouts", "WHEREABOUTS_VERSION").join("doc/crds");
    let files = vec![
        wb.join("whereabouts.cni.cncf.io_ippools.yaml"),
        wb.join("whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml"),
        wb.join("whereabouts.cni.cncf.io_nodeslicepools.yaml"),
        source("multus-cni", "MULTUS_VERSION").join("deployments/multus-daemonset.yml"),
    ];
    let names = testenv::controlplane::install_crd_files(&client, &files)
        .await
        .expect("apply whereabouts' and Multus's CRDs");
    assert_eq!(names.len(), 4, "{names:?}");
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let snapshot = || async {
        let mut out = Vec::new();
        for name in &names {
            let crd = crds.get(name).await.unwrap();
            out.push((
                name.clone(),
                crd.metadata.resource_version.clone(),
                crd.metadata.generation,
                serde_json::to_value(&crd.spec).unwrap(),
            ));
        }
        out
    };
    let before = snapshot().await;
    // The chart's own version of each differs: had Helm written one, the snapshot would differ.
    for (name, _, _, spec) in &before {
        let ours: Value = serde_norway::from_str(
            &std::fs::read_to_string(chart_dir().join(format!("crds/{name}.yaml"))).unwrap(),
        )
        .unwrap();
        assert_ne!(&ours["spec"], spec, "the chart's {name} is upstream's");
    }

    let chart = chart_dir();
    for (release, skip) in [("skip", true), ("plain", false)] {
        let ns = cp
            .namespace(&client, &format!("chart-crds-{release}"))
            .await;
        let wns = format!("whereaboutsNamespace={ns}");
        let mut args = vec![
            "install",
            release,
            chart.to_str().unwrap(),
            "--namespace",
            &ns,
            "--set",
            &wns,
        ];
        if skip {
            args.push("--skip-crds");
        }
        helm(Some(&cp), &args).unwrap_or_else(|e| panic!("helm {args:?}: {e:#}"));
        assert_eq!(
            snapshot().await,
            before,
            "helm install {release}: upstream's CRDs changed"
        );
        let ipfences = crds.get_opt("ipfences.ipreclaim.io").await.unwrap();
        if skip {
            assert!(ipfences.is_none(), "--skip-crds created the IPFence CRD");
        } else {
            // The missing one is created, as the chart has it.
            let ours: Value = serde_norway::from_str(
                &std::fs::read_to_string(chart_dir().join("crds/ipfences.ipreclaim.io.yaml"))
                    .unwrap(),
            )
            .unwrap();
            let live = serde_json::to_value(
                ipfences
                    .expect("plain install creates the IPFence CRD")
                    .spec,
            )
            .unwrap();
            assert_eq!(
                live["versions"][0]["schema"],
                ours["spec"]["versions"][0]["schema"]
            );
        }
    }
}
