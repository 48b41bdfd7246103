//! `helm test` on testenv's real node: the chart's test pod (Debian's GNU `wget`, built into
//! an image here) asks the controller's Service for /readyz through kube-proxy. It passes with
//! the chart's security contexts and with non-default ones, and fails while no controller
//! replica answers (so it can fail).

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use testenv::Node;

use crate::Platform;
use crate::cluster::{Cluster, RELEASE_NS};
use crate::node_only::set_chart_values;

/// `helm test ipreclaim` with the test pod's logs: helm's output, or its error.
fn helm_test(node: &'static Node) -> anyhow::Result<String> {
    testenv::helm::helm(
        Some(&node.cp),
        &[
            "test",
            "ipreclaim",
            "-n",
            RELEASE_NS,
            "--timeout",
            "120s",
            "--logs",
        ],
    )
}

/// Whether helm's output says the test pod succeeded (`Phase:   Succeeded`).
fn succeeded(out: &str) -> bool {
    out.lines()
        .any(|l| l.trim_start().starts_with("Phase:") && l.contains("Succeeded"))
}

/// [`helm_test`]; a failure carries the test pod's log and status (helm keeps a failed pod).
async fn run_helm_test(node: &'static Node) -> anyhow::Result<String> {
    let result = tokio::task::spawn_blocking(move || helm_test(node))
        .await
        .unwrap();
    let Err(e) = result else { return result };
    let pods = Api::<Pod>::namespaced(node.client().await, RELEASE_NS);
    let log = pods
        .logs("ipreclaim-test-readyz", &Default::default())
        .await
        .unwrap_or_else(|e| format!("(no log: {e})"));
    let status = pods
        .get_opt("ipreclaim-test-readyz")
        .await
        .ok()
        .flatten()
        .and_then(|p| p.status)
        .map(|s| format!("{:?}", s.container_statuses))
        .unwrap_or_default();
    Err(e.context(format!(
        "the test pod's log: {log}\nits containers: {status}"
    )))
}

/// Waits until the controller Service's EndpointSlices list `n` ready endpoints: the
/// precondition of `helm test` (Ready pods reach the Service's endpoints, and kube-proxy, a
/// moment later).
async fn wait_ready_endpoints(c: &Cluster, n: usize) {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let slices = Api::<EndpointSlice>::namespaced(c.client().clone(), RELEASE_NS);
    let selector = "kubernetes.io/service-name=ipreclaim-controller";
    crate::cluster::wait_long(&format!("{n} ready controller endpoints"), || async {
        let ready: usize = slices
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap()
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .count();
        ready == n
    })
    .await;
}

/// `helm test` once the Service has every replica: tried up to three times, 2 s apart, as
/// kube-proxy writes the endpoints a moment after the EndpointSlice lists them.
async fn helm_test_passes(c: &Cluster) -> String {
    wait_ready_endpoints(c, crate::cluster::CONTROLLER_REPLICAS as usize).await;
    let mut failures = Vec::new();
    for _ in 0..3 {
        match run_helm_test(c.node_handle()).await {
            Ok(out) => return out,
            Err(e) => failures.push(format!("{e:#}")),
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
    panic!(
        "helm test failed three times:\n{}",
        failures.join("\n---\n")
    );
}

/// The uid every container of the component's pods runs as (pod or container level).
async fn run_as_users(c: &Cluster, component: &str) -> Vec<Option<i64>> {
    let pods = Api::<Pod>::namespaced(c.client().clone(), RELEASE_NS)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/component={component}")))
        .await
        .unwrap();
    pods.items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .flat_map(|p| {
            let spec = p.spec.as_ref().unwrap();
            let pod_uid = spec.security_context.as_ref().and_then(|s| s.run_as_user);
            spec.containers.iter().map(move |c| {
                c.security_context
                    .as_ref()
                    .and_then(|s| s.run_as_user)
                    .or(pod_uid)
            })
        })
        .collect()
}

/// Non-default security contexts: another non-root uid and group for the controller, with
/// fsGroup, and the node agent's container with an explicit uid 0 group 0 and no privilege.
const NON_DEFAULT_SECURITY: [&str; 6] = [
    "controller.podSecurityContext.runAsUser=10001",
    "controller.podSecurityContext.runAsGroup=10001",
    "controller.podSecurityContext.fsGroup=10001",
    "nodeAgent.podSecurityContext.runAsGroup=0",
    "nodeAgent.securityContext.privileged=false",
    "nodeAgent.securityContext.runAsNonRoot=false",
];

pub async fn helm_test_passes_with_default_and_non_default_security_contexts(mut c: Cluster) {
    let node = c.node_handle();
    let client = c.client().clone();

    let out = helm_test_passes(&c).await;
    assert!(
        succeeded(&out) && out.contains("ok"),
        "helm test output:\n{out}"
    );

    // No replica answers: the Service has no endpoint, the test pod fails.
    c.scale_controller(0).await;
    wait_ready_endpoints(&c, 0).await;
    let failed = run_helm_test(node).await;
    c.scale_controller(1).await;
    let why = format!(
        "{:#}",
        failed.expect_err("helm test passed with no controller replica")
    );
    assert!(
        why.contains("Connection refused"),
        "the test pod reached the Service and nothing answered: {why}"
    );

    set_chart_values(node, &client, &NON_DEFAULT_SECURITY).await;
    crate::cluster::wait_chart_ready(&client, RELEASE_NS, crate::cluster::CONTROLLER_REPLICAS)
        .await;
    let uids = run_as_users(&c, "controller").await;
    assert!(
        !uids.is_empty() && uids.iter().all(|u| *u == Some(10001)),
        "controller containers' uids: {uids:?}"
    );
    let agent = Api::<DaemonSet>::namespaced(client.clone(), RELEASE_NS)
        .get("ipreclaim-node-agent")
        .await
        .unwrap();
    let agent_pod = agent.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        agent_pod.security_context.unwrap().run_as_group,
        Some(0),
        "the node agent's values reached its DaemonSet"
    );
    let out = helm_test_passes(&c).await;
    assert!(succeeded(&out), "with non-default security contexts: {out}");
    let deployment = Api::<Deployment>::namespaced(client.clone(), RELEASE_NS)
        .get("ipreclaim-controller")
        .await
        .unwrap();
    assert_eq!(
        deployment.status.unwrap().ready_replicas,
        Some(crate::cluster::CONTROLLER_REPLICAS)
    );
    set_chart_values(node, &client, &[]).await;
}

mod node_scenarios {
    on_the_node! {
        helm_test_passes_with_default_and_non_default_security_contexts: "helm-test",
    }
}
