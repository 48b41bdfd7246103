//! What only testenv's real node can show: the chart installed as pods from an image built
//! here, a node crash with force-deleted pods, and a node reboot.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use ipreclaim::api::OverlappingRangeIPReservation;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use testenv::Node;
use testenv::image;
use testenv::procs::{binary, pinned_version, run, unpacked_source, workspace_root};

use crate::cluster::{
    CONTROLLER_REPLICAS, Cluster, IMAGE, RELEASE_NS, wait_chart_ready, wait_long,
};
use crate::{GC_DONE, Platform, expect_clean_releases, pool_entries, wait_pool_matches_live_pods};

/// ipreclaim's image built from the project's Dockerfile by `scripts/image.sh` (buildah on
/// stand-in base images made on this machine, then the scanner checks of
/// `scripts/image-check.sh`), saved as a docker-archive named [`IMAGE`]. Its cached layers make
/// the call quick when `./scripts/test.sh` or `e2e/node/run.sh` built it already.
fn dockerfile_image_archive() -> PathBuf {
    let root = workspace_root();
    let out = root.join("target/image-oci");
    let (name, arch) = IMAGE.rsplit_once('-').expect("IMAGE ends in -<arch>");
    run(Command::new(root.join("scripts/image.sh"))
        .arg(arch)
        .env("IMAGE", name)
        .env("OUT", &out))
    .expect("scripts/image.sh: ipreclaim's image from the Dockerfile");
    out.join(format!("ipreclaim-{arch}.tar"))
}

/// The ipreclaim image from the Dockerfile, imported into the node's containerd.
fn import_ipreclaim_image(node: &Node) {
    let archive = dockerfile_image_archive();
    node.containerd()
        .import_image(&archive)
        .unwrap_or_else(|e| panic!("import {}: {e:#}", archive.display()));
}

/// `files` as image `name` (entrypoint `entrypoint --help`, uid 65532), imported into the
/// node's containerd.
fn import_image(node: &Node, files: &[image::File], name: &str, entrypoint: &str) {
    let archive = node.dir().join(format!(
        "{}.tar",
        name.rsplit('/').next().unwrap().replace(':', "-")
    ));
    let config = image::Config {
        name,
        entrypoint: &[entrypoint],
        cmd: &["--help"],
        user: "65532:65532",
    };
    image::write_oci_archive(files, &config, &archive)
        .unwrap_or_else(|e| panic!("write the image {name}: {e:#}"));
    node.containerd()
        .import_image(&archive)
        .unwrap_or_else(|e| panic!("import the image {name}: {e:#}"));
}

/// The image the chart's `helm test` pod runs (`tests.image`): Debian's GNU wget and dash (with
/// their libraries) as `/bin/wget` and `/bin/sh`, uid 65532, imported into the node's containerd. (Debian's busybox
/// wget crashes on `-T`, which the test pod passes; the chart's default busybox does not.)
pub const WGET_IMAGE: &str = "localhost/ipreclaim/wget:e2e";

fn import_wget_image(node: &Node) {
    let wget = std::path::Path::new("/usr/bin/wget");
    assert!(
        wget.exists(),
        "/usr/bin/wget is missing: `apt-get install wget` (scripts/setup.sh installs it)"
    );
    let mut files = image::binary_image_files(wget, "/bin/wget").expect("wget image files");
    // The test pod runs its request through `sh -c`: Debian's dash as /bin/sh.
    let dash = std::path::Path::new("/bin/dash");
    for f in image::binary_image_files(dash, "/bin/sh").expect("dash image files") {
        if !files.iter().any(|have| have.path == f.path) {
            files.push(f);
        }
    }
    import_image(node, &files, WGET_IMAGE, "/bin/wget");
}

/// [`testenv::containerd::IGNORE_SIGTERM_IMAGE`], imported into the node's containerd once per
/// test process.
pub async fn import_ignore_sigterm_image(node: &'static Node) {
    static IMPORTED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    IMPORTED
        .get_or_init(|| async {
            tokio::task::spawn_blocking(move || {
                let archive = testenv::containerd::build_ignore_sigterm_image(node.dir())
                    .expect("build the SIGTERM-ignoring image");
                node.containerd()
                    .import_image(&archive)
                    .expect("import the SIGTERM-ignoring image");
            })
            .await
            .unwrap()
        })
        .await;
}

/// whereabouts' and Multus's own CRDs, as they ship them, and ipreclaim's IPFence CRD.
async fn install_upstream_crds(client: &Client) {
    let wb = unpacked_source(&format!(
        "whereabouts-{}",
        pinned_version("WHEREABOUTS_VERSION").unwrap()
    ))
    .unwrap();
    let multus = unpacked_source(&format!(
        "multus-cni-{}",
        pinned_version("MULTUS_VERSION").unwrap()
    ))
    .unwrap();
    let crds = wb.join("doc/crds");
    let files = vec![
        crds.join("whereabouts.cni.cncf.io_ippools.yaml"),
        crds.join("whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml"),
        crds.join("whereabouts.cni.cncf.io_nodeslicepools.yaml"),
        // The NetworkAttachmentDefinition CRD is in Multus's DaemonSet manifest.
        multus.join("deployments/multus-daemonset.yml"),
    ];
    let names = testenv::controlplane::install_crd_files(client, &files)
        .await
        .expect("install whereabouts' and Multus's CRDs");
    assert_eq!(names.len(), 4, "CRDs installed: {names:?}");
    // ipreclaim's own CRD, as an operator who installs the chart with --skip-crds applies it.
    let ours =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/ipfences.ipreclaim.io.yaml");
    testenv::controlplane::install_crd_files(client, &[ours])
        .await
        .expect("install crds/ipfences.ipreclaim.io.yaml");
}

/// Once per test process: upstream CRDs, the image, and `helm install` of the chart (two
/// controller replicas with leader election, the node agent on the node's CRI socket), then
/// waits until its pods are Ready.
pub async fn install_ipreclaim(node: &'static Node, client: &Client) {
    install_upstream_crds(client).await;
    tokio::task::spawn_blocking(move || {
        import_ipreclaim_image(node);
        import_wget_image(node);
    })
    .await
    .unwrap();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": RELEASE_NS}})).unwrap();
    let _ = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await;
    let sets = chart_values(node, &[]);
    let cp = &node.cp;
    tokio::task::spawn_blocking(move || {
        testenv::helm::install(cp, "ipreclaim", RELEASE_NS, &sets).expect("helm install")
    })
    .await
    .unwrap();
    wait_chart_ready(client, RELEASE_NS, CONTROLLER_REPLICAS).await;
}

/// The chart's values for the node: the image built here, two controller replicas, short test
/// timings, plus `extra` (`key=value`).
fn chart_values(node: &Node, extra: &[&str]) -> Vec<String> {
    let (repository, tag) = IMAGE.rsplit_once(':').unwrap();
    let mut sets = vec![
        format!("image.repository={repository}"),
        format!("image.tag={tag}"),
        "image.pullPolicy=Never".into(),
        format!(
            "tests.image.repository={}",
            WGET_IMAGE.rsplit_once(':').unwrap().0
        ),
        format!("tests.image.tag={}", WGET_IMAGE.rsplit_once(':').unwrap().1),
        "tests.image.pullPolicy=Never".into(),
        format!(
            "whereaboutsNamespace={}",
            testenv::node::WHEREABOUTS_NAMESPACE
        ),
        format!("controller.replicas={CONTROLLER_REPLICAS}"),
        "controller.sweepInterval=5s".into(),
        "controller.leakGrace=10s".into(),
        format!("nodeAgent.criSocket={}", node.cri_socket().display()),
        "nodeAgent.sandboxGrace=5s".into(),
        "controller.fence.settle=10s".into(),
        "logLevel=info\\,ipreclaim=debug".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

static CHART_VALUES_CHANGED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// `helm upgrade`s the installation to [`chart_values`] with `extra` and waits until the
/// controller Deployment has rolled out (every replica updated and Ready, no old one left).
pub async fn set_chart_values(node: &'static Node, client: &Client, extra: &[&str]) {
    let sets = chart_values(node, extra);
    CHART_VALUES_CHANGED.store(!extra.is_empty(), std::sync::atomic::Ordering::SeqCst);
    let cp = &node.cp;
    tokio::task::spawn_blocking(move || {
        testenv::helm::upgrade(cp, "ipreclaim", RELEASE_NS, &sets).expect("helm upgrade")
    })
    .await
    .unwrap();
    let deployments = Api::<Deployment>::namespaced(client.clone(), RELEASE_NS);
    wait_long("the controller rolled out with the new values", || async {
        let d = deployments.get("ipreclaim-controller").await.unwrap();
        let generation = d.metadata.generation.unwrap_or(0);
        let s = d.status.unwrap_or_default();
        s.observed_generation.unwrap_or(0) >= generation
            && s.updated_replicas.unwrap_or(0) == CONTROLLER_REPLICAS
            && s.ready_replicas.unwrap_or(0) == CONTROLLER_REPLICAS
            && s.replicas.unwrap_or(0) == CONTROLLER_REPLICAS
    })
    .await;
    wait_chart_ready(client, RELEASE_NS, CONTROLLER_REPLICAS).await;
    // The Deployment counts no terminating pod, but an old pod still runs (and may lead, with
    // the old values) until its kubelet has stopped it: a scenario that kills the kubelet
    // right after would leave it leading for good. Wait until only the new pods exist and one
    // of them holds the Lease.
    let pods = Api::<Pod>::namespaced(client.clone(), RELEASE_NS);
    let leases =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), RELEASE_NS);
    wait_long(
        "only the new controller pods, one of them leading",
        || async {
            let listed = pods
                .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
                .await
                .unwrap()
                .items;
            let names: Vec<String> = listed
                .iter()
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            let holder = leases
                .get_opt("ipreclaim-controller")
                .await
                .unwrap()
                .and_then(|l| l.spec?.holder_identity)
                .unwrap_or_default();
            listed.len() == CONTROLLER_REPLICAS as usize
                && listed
                    .iter()
                    .all(|p| p.metadata.deletion_timestamp.is_none())
                && names.iter().any(|n| holder.starts_with(&format!("{n}_")))
        },
    )
    .await;
}

/// Puts the chart's values back when a scenario that changed them failed before doing so.
pub async fn ensure_default_chart_values(node: &'static Node, client: &Client) {
    if CHART_VALUES_CHANGED.load(std::sync::atomic::Ordering::SeqCst) {
        set_chart_values(node, client, &[]).await;
    }
}

/// `kubectl get events` as an operator runs it, for `reason` in `ns`: one line per Event,
/// `<object name> <message>`.
pub(crate) fn kubectl_events(node: &Node, ns: &str, reason: &str) -> Vec<String> {
    let out = Command::new(binary("kubectl").unwrap())
        .env("KUBECONFIG", node.cp.kubeconfig_path())
        .args(["get", "events", "-n", ns, "--field-selector"])
        .arg(format!("reason={reason}"))
        .args([
            "-o",
            "custom-columns=OBJ:.involvedObject.name,MSG:.message",
            "--no-headers",
        ])
        .output()
        .expect("run kubectl");
    assert!(out.status.success(), "kubectl get events: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// The reservations of this scenario's network (named `<network_name>-<ip>`), as
/// `name podref`.
pub(crate) async fn reservations(c: &Cluster) -> Vec<String> {
    let api = Api::<OverlappingRangeIPReservation>::namespaced(c.client().clone(), c.pool_ns());
    testenv::fixtures::list_all(&api)
        .await
        .into_iter()
        .filter(|r| {
            r.metadata
                .name
                .as_ref()
                .is_some_and(|n| n.starts_with(&format!("{}-", c.ns())))
        })
        .map(|r| format!("{} {}", r.metadata.name.unwrap_or_default(), r.spec.podref))
        .collect()
}

/// `/metrics` of a chart component (`controller`, `node-agent`), scraped through its Service
/// (the apiserver's service proxy picks one of the controller's two replicas).
async fn metrics_through_the_service(client: &Client, component: &str) -> String {
    let path = format!(
        "/api/v1/namespaces/{RELEASE_NS}/services/ipreclaim-{component}:metrics/proxy/metrics"
    );
    proxy_get(client, path).await.unwrap_or_default()
}

/// GET through the apiserver's proxy, bounded (a dead endpoint must not hang a check).
async fn proxy_get(client: &Client, path: String) -> Result<String, String> {
    let req = http::Request::get(path).body(Vec::new()).unwrap();
    match tokio::time::timeout(std::time::Duration::from_secs(10), client.request_text(req)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("no answer in 10 s".into()),
    }
}

/// `/metrics` of the controller pod `pod`, through the apiserver's pod proxy.
pub(crate) async fn controller_pod_metrics(client: &Client, pod: &str) -> Result<String, String> {
    let path = format!("/api/v1/namespaces/{RELEASE_NS}/pods/{pod}:8080/proxy/metrics");
    proxy_get(client, path).await
}

/// `/metrics` of each controller replica, through the apiserver's pod proxy.
pub(crate) async fn controller_pods_metrics(client: &Client) -> Vec<String> {
    let pods = Api::<Pod>::namespaced(client.clone(), RELEASE_NS)
        .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
        .await
        .unwrap();
    let mut out = Vec::new();
    for p in pods.items {
        let name = p.metadata.name.unwrap();
        let text = controller_pod_metrics(client, &name).await;
        out.push(text.unwrap_or_else(|e| panic!("scrape controller pod {name}: {e}")));
    }
    assert_eq!(
        out.len(),
        CONTROLLER_REPLICAS as usize,
        "every controller replica"
    );
    out
}

/// The kubelet is killed and the pods are force-deleted, as an operator does for a crashed
/// node, and the node is tainted out-of-service (its operator declares it powered off: the
/// containers still run here, and without the taint the force-deleted pods stay fenced until
/// the kubelet is back): no CNI DEL can run. Plain pods' entries and reservations are
/// ipreclaim's to free. A
/// StatefulSet pod is recreated under its name at once; while the replacement has no
/// network-status its podref's entry is kept (the replacement's ADD may already have taken it
/// over: whereabouts reuses a podref+ifname's entry and rewrites its id), and when the kubelet
/// returns the replacement gets an address either way.
async fn a_node_crash_with_force_deleted_pods_releases_every_address(mut c: Cluster) {
    let node = c.node_handle();
    c.create_pod("c-0").await;
    c.create_pod("c-1").await;
    c.scale_statefulset(2).await;
    wait_pool_matches_live_pods(&c).await;
    let old = pool_entries(&c).await;
    assert_eq!(
        old.len(),
        4,
        "whereabouts allocated c-0, c-1, web-0, web-1: {old:?}"
    );
    assert_eq!(
        reservations(&c).await.len(),
        4,
        "and reserved their addresses"
    );
    let plain: Vec<_> = old.iter().filter(|(n, _, _)| n.starts_with("c-")).collect();

    node.kill_kubelet().unwrap();
    let pods = Api::<Pod>::namespaced(c.client().clone(), c.ns());
    for (name, _, _) in &old {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    // NoSchedule: NoExecute would also evict the controller's replicas, which run on this one
    // node (in a cluster they run elsewhere).
    crate::fencing::taint_out_of_service_with(&c, true, "NoSchedule").await;
    let plain_ips: BTreeSet<String> = plain.iter().map(|(_, ip, _)| ip.clone()).collect();
    wait_long(
        "ipreclaim to release the plain pods' entries and reservations",
        || async {
            let entries = pool_entries(&c).await;
            let held = entries.iter().any(|(_, ip, _)| plain_ips.contains(ip));
            let reserved = reservations(&c).await;
            !held
                && !reserved
                    .iter()
                    .any(|r| plain_ips.iter().any(|ip| r.contains(&format!("-{ip} "))))
        },
    )
    .await;
    let ns = c.ns().to_string();
    wait_long("IPAddressGarbageCollected Events in kubectl", || async {
        let events = kubectl_events(node, &ns, GC_DONE);
        plain.iter().all(|(name, ip, _)| {
            events
                .iter()
                .any(|e| e.starts_with(&format!("{name} ")) && e.contains(&format!("[{ip}]")))
        })
    })
    .await;

    // Repaired: the taint goes and the kubelet comes back.
    crate::fencing::taint_out_of_service_with(&c, false, "NoSchedule").await;
    node.start_kubelet().await.unwrap();
    // Through the Service once the node is Ready again (its endpoints are not ready while
    // the node is down). Only the leader releases; the proxy picks either replica.
    let client = c.client().clone();
    wait_long("releases in /metrics through the Service", || async {
        let text = metrics_through_the_service(&client, "controller").await;
        // The deletion path's (PodDeleted), or the sweep's after its grace (PodMissing).
        testenv::poll::metric_sum(&text, "ipreclaim_releases_total") >= 2.0
    })
    .await;
    for name in ["web-0", "web-1"] {
        c.wait_running_with_address(name).await;
    }
    // The old sandboxes' CNI DEL runs once the kubelet is back; whereabouts' DEL for an old
    // container id must then find nothing of the new pods'.
    let old_ids: BTreeSet<String> = old.iter().map(|(_, _, id)| id.clone()).collect();
    wait_long("the orphaned sandboxes torn down", || async {
        !node.cni_result_cached_for(&old_ids)
    })
    .await;
    wait_pool_matches_live_pods(&c).await;
    let now = pool_entries(&c).await;
    assert_eq!(now.len(), 2, "web-0 and web-1 only: {now:?}");
    assert!(
        now.iter().all(|(_, _, id)| !old_ids.contains(id)),
        "held by the new sandboxes: {now:?}"
    );
    let reserved = reservations(&c).await;
    assert_eq!(reserved.len(), 2, "reservations {reserved:?} of {now:?}");
    let events = kubectl_events(node, &ns, GC_DONE);
    for name in ["c-0", "c-1"] {
        let n = events
            .iter()
            .filter(|e| e.starts_with(&format!("{name} ")))
            .count();
        assert_eq!(n, 1, "one release of {name}: {events:?}");
    }
    expect_clean_releases(&c).await;
}

async fn a_node_reboot_recreates_sandboxes_and_only_dead_sandboxes_lose_entries(mut c: Cluster) {
    let node = c.node_handle();
    c.create_pod("r-0").await;
    c.create_pod("r-1").await;
    wait_pool_matches_live_pods(&c).await;
    let old = pool_entries(&c).await;
    let old_ids: BTreeSet<String> = old.iter().map(|(_, _, id)| id.clone()).collect();

    node.reboot().await.unwrap();
    wait_long("new sandboxes holding the pods' entries", || async {
        let now = pool_entries(&c).await;
        now.len() == 2 && now.iter().all(|(_, _, id)| !old_ids.contains(id))
    })
    .await;
    for name in ["r-0", "r-1"] {
        c.wait_running_with_address(name).await;
    }
    wait_pool_matches_live_pods(&c).await;
    // The node agent (restarted with the node) judged the dead sandboxes: whoever freed
    // their entries first (the kubelet's CNI DEL or the agent), nothing failed.
    let client = c.client().clone();
    let outcome = |text: &str, o: &str| {
        testenv::poll::metric_value(
            text,
            &format!("ipreclaim_node_dead_sandboxes_total{{outcome=\"{o}\"}}"),
        )
    };
    wait_long("the node agent to judge the dead sandboxes", || async {
        let text = metrics_through_the_service(&client, "node-agent").await;
        outcome(&text, "released") + outcome(&text, "no_allocation") >= 2.0
    })
    .await;
    let text = metrics_through_the_service(&client, "node-agent").await;
    assert_eq!(outcome(&text, "failed"), 0.0, "{text}");
    wait_pool_matches_live_pods(&c).await;
    expect_clean_releases(&c).await;
}

/// whereabouts' ip-control-loop, built from its release source, run the way its DaemonSet
/// runs it (in kube-system as the `whereabouts` ServiceAccount with upstream's RBAC, in-cluster
/// config, `NODENAME`, the host's CNI config under `/host`), as a pod on the node.
async fn start_whereabouts_control_loop(node: &'static Node, client: &Client) {
    const NAME: &str = "whereabouts-control-loop";
    const LOOP_IMAGE: &str = "localhost/ipreclaim/whereabouts-control-loop:e2e";
    tokio::task::spawn_blocking(move || {
        let bin = binary("whereabouts-controlloop").unwrap();
        let files = image::binary_image_files(&bin, "/ip-control-loop").unwrap();
        let archive = node.dir().join("whereabouts-control-loop.tar");
        let config = image::Config {
            name: LOOP_IMAGE,
            entrypoint: &["/ip-control-loop"],
            cmd: &["-log-level", "debug"],
            user: "",
        };
        image::write_oci_archive(&files, &config, &archive).unwrap();
        node.containerd().import_image(&archive).unwrap();
    })
    .await
    .unwrap();
    // Upstream's ServiceAccount and RBAC (not its DaemonSet: that would pull an image).
    let wb = unpacked_source(&format!(
        "whereabouts-{}",
        pinned_version("WHEREABOUTS_VERSION").unwrap()
    ))
    .unwrap();
    let text = std::fs::read_to_string(wb.join("doc/crds/daemonset-install.yaml")).unwrap();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let obj: kube::api::DynamicObject = serde::Deserialize::deserialize(doc).unwrap();
        let kind = obj
            .types
            .as_ref()
            .map(|t| t.kind.clone())
            .unwrap_or_default();
        if !["ServiceAccount", "ClusterRole", "ClusterRoleBinding"].contains(&kind.as_str()) {
            continue;
        }
        let gvk = kube::api::GroupVersionKind::try_from(obj.types.as_ref().unwrap()).unwrap();
        let (ar, _) = kube::discovery::pinned_kind(client, &gvk).await.unwrap();
        let api: Api<kube::api::DynamicObject> = match obj.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        api.patch(
            &obj.metadata.name.clone().unwrap(),
            &kube::api::PatchParams::apply("e2e").force(),
            &kube::api::Patch::Apply(&obj),
        )
        .await
        .unwrap();
    }
    let dir = node.dir().display().to_string();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": NAME, "namespace": "kube-system"},
        "spec": {
            "serviceAccountName": "whereabouts",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "ip-control-loop",
                "image": LOOP_IMAGE,
                "imagePullPolicy": "Never",
                "env": [{"name": "NODENAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                // NADs name the flat file by its host path; the loop reads the kubeconfig it
                // names under /host, as its DaemonSet mounts the host.
                "volumeMounts": [
                    {"name": "node", "mountPath": dir, "readOnly": true},
                    {"name": "node", "mountPath": format!("/host{dir}"), "readOnly": true},
                ],
            }],
            "volumes": [{"name": "node", "hostPath": {"path": dir}}],
        }
    }))
    .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), "kube-system");
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_long("whereabouts' control loop running", || async {
        pods.get(NAME)
            .await
            .unwrap()
            .status
            .and_then(|s| s.phase)
            .as_deref()
            == Some("Running")
    })
    .await;
}

/// Waits until whereabouts' control loop logged the deletion of each of `pods` in `ns`.
async fn wait_loop_saw_deletions(client: &Client, ns: &str, pods: &[&str]) {
    let api = Api::<Pod>::namespaced(client.clone(), "kube-system");
    wait_long("whereabouts' control loop seeing the deletions", || async {
        let logs = api
            .logs("whereabouts-control-loop", &Default::default())
            .await
            .unwrap_or_default();
        pods.iter()
            .all(|p| logs.contains(&format!("deleted pod [{ns}/{p}]")))
    })
    .await;
}

/// Pods running whereabouts' control loop, in any namespace.
async fn whereabouts_control_loops(client: &Client) -> Vec<String> {
    testenv::fixtures::list_all(&Api::<Pod>::all(client.clone()))
        .await
        .into_iter()
        .filter(|p| {
            p.spec.as_ref().is_some_and(|s| {
                s.containers.iter().any(|c| {
                    let words = c.command.iter().chain(c.args.iter()).flatten();
                    c.image
                        .as_deref()
                        .is_some_and(|i| i.contains("control-loop"))
                        || words.into_iter().any(|w| w.contains("ip-control-loop"))
                })
            })
        })
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// whereabouts' own cleanup is off (docs/operations/install.md, migrating); started next to
/// ipreclaim anyway, the two race on every leak: each leaked address is freed, no live pod's address or
/// allocation is lost, and ipreclaim records no failure.
async fn whereabouts_control_loop_beside_ipreclaim_frees_nothing_twice(mut c: Cluster) {
    let node = c.node_handle();
    let client = c.client().clone();
    assert!(
        whereabouts_control_loops(&client).await.is_empty(),
        "whereabouts' control loop is not part of the installation"
    );
    start_whereabouts_control_loop(node, &client).await;
    for name in ["w-0", "w-1", "w-2", "w-3", "probe"] {
        c.create_pod(name).await;
    }
    // Its informers are up once it reports a deletion.
    c.delete_pod("probe").await;
    wait_loop_saw_deletions(&client, c.ns(), &["probe"]).await;
    c.scale_statefulset(2).await;
    wait_pool_matches_live_pods(&c).await;
    let before = pool_entries(&c).await;

    // Leaks for both cleaners: deleted while the kubelet is down. ipreclaim fences them (its
    // kubelet may be alive, and the containers run on); whereabouts' loop frees what it finds
    // under the pods' names; the returning kubelet's CNI DEL frees the rest.
    node.kill_kubelet().unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), c.ns());
    for name in ["w-0", "w-1", "web-1"] {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    let gone: BTreeSet<String> = before
        .iter()
        .filter(|(n, _, _)| ["w-0", "w-1"].contains(&n.as_str()))
        .map(|(_, ip, _)| ip.clone())
        .collect();
    node.start_kubelet().await.unwrap();
    wait_long("the leaked addresses freed", || async {
        pool_entries(&c)
            .await
            .iter()
            .all(|(_, ip, _)| !gone.contains(ip))
    })
    .await;
    // whereabouts' loop really raced: it saw the deletions.
    wait_loop_saw_deletions(&client, c.ns(), &["w-0", "w-1"]).await;
    c.wait_running_with_address("web-1").await;
    // New pods take the freed addresses while both cleaners still look at the old ones.
    for name in ["w-4", "w-5"] {
        c.create_pod(name).await;
    }
    wait_pool_matches_live_pods(&c).await;
    let after = pool_entries(&c).await;
    for kept in ["w-2", "w-3", "web-0"] {
        let b: Vec<_> = before.iter().filter(|e| e.0 == kept).collect();
        let a: Vec<_> = after.iter().filter(|e| e.0 == kept).collect();
        assert_eq!(a, b, "{kept}'s allocation untouched");
    }
    assert_eq!(
        reservations(&c).await.len(),
        after.len(),
        "a reservation per live allocation: {after:?}"
    );
    let failed = kubectl_events(node, c.ns(), crate::GC_FAILED);
    assert!(
        failed.iter().all(|e| !e.contains("ipreclaim")),
        "ipreclaim failures: {failed:?}"
    );
    for text in controller_pods_metrics(&client).await {
        let failures = testenv::poll::metric_sum(&text, "ipreclaim_release_failures_total");
        assert_eq!(failures, 0.0, "release failures in {text}");
    }
    Api::<Pod>::namespaced(client.clone(), "kube-system")
        .delete(
            "whereabouts-control-loop",
            &DeleteParams::default().grace_period(0),
        )
        .await
        .unwrap();
}

mod node_scenarios {
    use crate::cluster::Cluster;

    #[tokio::test]
    async fn a_node_crash_with_force_deleted_pods_releases_every_address() {
        super::a_node_crash_with_force_deleted_pods_releases_every_address(
            Cluster::node("node-crash").await,
        )
        .await
    }

    #[tokio::test]
    async fn whereabouts_control_loop_beside_ipreclaim_frees_nothing_twice() {
        super::whereabouts_control_loop_beside_ipreclaim_frees_nothing_twice(
            Cluster::node("wb-control-loop").await,
        )
        .await
    }

    #[tokio::test]
    async fn a_node_reboot_recreates_sandboxes_and_only_dead_sandboxes_lose_entries() {
        super::a_node_reboot_recreates_sandboxes_and_only_dead_sandboxes_lose_entries(
            Cluster::node("node-reboot").await,
        )
        .await
    }
}
