//! Helm (built from its Go module by `scripts/setup.sh`) run against the shared control plane.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::controlplane::ControlPlane;
use crate::procs::{binary, workspace_root};

/// The chart in this repository.
pub fn chart_dir() -> PathBuf {
    workspace_root().join("charts/ipreclaim")
}

/// Runs helm with `args` (admin kubeconfig of `cp` when given) and returns its stdout; a
/// failure carries helm's stderr.
pub fn helm(cp: Option<&ControlPlane>, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new(binary("helm")?);
    cmd.args(args);
    // Helm keeps caches and config under HOME/XDG: keep them out of the user's.
    let home = workspace_root().join("target/testenv/helm-home");
    std::fs::create_dir_all(&home)?;
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    if let Some(cp) = cp {
        cmd.env("KUBECONFIG", cp.kubeconfig_path());
    }
    let out = cmd.output().context("run helm")?;
    if !out.status.success() {
        bail!(
            "helm {} failed ({}):\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Installs the chart as `release` into `namespace` with `--set` values, and returns the
/// manifest helm applied. CRDs are skipped (the control plane has them from `crds/`).
pub fn install(
    cp: &ControlPlane,
    release: &str,
    namespace: &str,
    sets: &[String],
) -> Result<String> {
    with_chart(cp, &["install", release], namespace, sets)?;
    helm(
        Some(cp),
        &["get", "manifest", release, "--namespace", namespace],
    )
}

/// Upgrades `release` in `namespace` to the chart with its defaults plus `sets` (values set
/// before and not set now go back to the chart's defaults).
pub fn upgrade(cp: &ControlPlane, release: &str, namespace: &str, sets: &[String]) -> Result<()> {
    let command = ["upgrade", release, "--reset-values"];
    with_chart(cp, &command, namespace, sets).map(|_| ())
}

/// Runs `helm <command..> <chart> --namespace <namespace> --skip-crds` with a `--set` for each
/// of `sets`.
fn with_chart(
    cp: &ControlPlane,
    command: &[&str],
    namespace: &str,
    sets: &[String],
) -> Result<String> {
    let chart = chart_dir();
    let mut args = command.to_vec();
    args.extend([
        chart.to_str().expect("utf-8 path"),
        "--namespace",
        namespace,
        "--skip-crds",
    ]);
    for s in sets {
        args.extend(["--set", s]);
    }
    helm(Some(cp), &args)
}

/// Installs the chart into the test namespace `ns` as release `ns`, with `ns` also its
/// whereabouts namespace (what the tests that run the programs under the chart's RBAC need).
pub fn install_in(cp: &ControlPlane, ns: &str) -> Result<String> {
    install(cp, ns, ns, &[format!("whereaboutsNamespace={ns}")])
}

/// The chart's ServiceAccount of `component` (`controller` or `node-agent`) in a release made by
/// [`install_in`].
pub fn service_account(ns: &str, component: &str) -> String {
    format!("{ns}-ipreclaim-{component}")
}

/// Installs the chart into the test namespace `ns` ([`install_in`]) and returns a client acting
/// as its ServiceAccount of `component` (`controller` or `node-agent`).
pub async fn install_as(
    cp: &ControlPlane,
    admin: &kube::Client,
    ns: &str,
    component: &str,
) -> kube::Client {
    install_in(cp, ns).expect("helm install");
    service_account_client(cp, admin, ns, component).await
}

/// A client acting as that ServiceAccount, with its own token.
pub async fn service_account_client(
    cp: &ControlPlane,
    admin: &kube::Client,
    ns: &str,
    component: &str,
) -> kube::Client {
    cp.service_account_client(admin, ns, &service_account(ns, component))
        .await
        .unwrap_or_else(|e| panic!("token of the chart's {component} ServiceAccount: {e:#}"))
}

/// A client acting as the chart's node-agent ServiceAccount (a release made by [`install_in`])
/// the way the DaemonSet's pod on `node` does: with a token bound to a pod of that
/// ServiceAccount scheduled on `node`, so the apiserver names `node` in it. The stand-in Node
/// `node` is created if missing (a pod-bound token of a scheduled pod needs its Node), and the
/// pod `<ServiceAccount>-on-<node>` (never started: no kubelet runs).
pub async fn node_agent_client_on(
    cp: &ControlPlane,
    admin: &kube::Client,
    ns: &str,
    node: &str,
) -> kube::Client {
    use k8s_openapi::api::core::v1::{Node, Pod};
    use kube::api::{Api, PostParams};
    let nodes = Api::<Node>::all(admin.clone());
    if nodes.get_opt(node).await.expect("get node").is_none() {
        match nodes
            .create(&PostParams::default(), &crate::fixtures::node(node))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create node {node}: {e}"),
        }
    }
    let sa = service_account(ns, "node-agent");
    let mut pod = crate::fixtures::pod(&format!("{sa}-on-{node}"), None);
    let spec = pod.spec.as_mut().expect("a pod spec");
    spec.node_name = Some(node.into());
    spec.service_account_name = Some(sa.clone());
    let pod = Api::<Pod>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("the node agent's pod on {node}: {e}"));
    cp.pod_bound_client(admin, ns, &sa, &pod)
        .await
        .unwrap_or_else(|e| {
            panic!("pod-bound token of the chart's node-agent ServiceAccount: {e:#}")
        })
}
