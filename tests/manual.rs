//! The manual commands, `ipreclaim unfence` and `ipreclaim release`, run as the built binary
//! (and once as `kubectl ipreclaim unfence` through the real kubectl) against the real
//! kube-apiserver. The fenced state is written directly: pool entries with podref
//! `<ns>/<pod>:fenced` and their `IPFence` records.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ipreclaim::api::{
    IPAllocation, IPFence, IPPool, IPPoolSpec, NetworkAttachmentDefinition,
    NetworkAttachmentDefinitionSpec, OverlappingRangeIPReservation,
    OverlappingRangeIPReservationSpec,
};
use ipreclaim::ipam::fence::FenceRecord;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use testenv::ControlPlane;
use testenv::procs::{exit_code, explain, stdout};

const BIN: &str = env!("CARGO_BIN_EXE_ipreclaim");
const POOL: &str = "192.0.2.0-24";
const GC_DONE: &str = "IPAddressGarbageCollected";

/// A namespace (also the whereabouts namespace) with a NAD `macvlan` over 192.0.2.0/24 and its
/// pool holding:
/// - 10 fenced for deleted pod `a` (node-1), its IPFence and its reservation;
/// - 11 fenced for deleted pod `b` (node-2) and its IPFence;
/// - 12 fenced for deleted pod `c` (node-1) and its IPFence; when `listed`, a live pod `web-0`
///   lists 192.0.2.12 (a new pod got the address over another network) and 192.0.2.20;
/// - 20 held by `web-0`;
/// - 30 held by `gone-0` (no such pod) with its reservation.
///
/// Tests run at once on one apiserver, and pods of other namespaces list addresses too: each
/// test has its own range, written as `192.0.2.0/24` in the test and renamed at the boundary
/// (objects and arguments going in, outputs coming back).
struct Env {
    client: Client,
    ns: String,
    /// This test's first three octets.
    net: String,
}

fn entry(id: &str, podref: String) -> IPAllocation {
    IPAllocation {
        id: id.into(),
        podref,
        ifname: Some("net1".into()),
        ipamclaimref: None,
    }
}

impl Env {
    /// `n`: this test's range, 198.18.`n`.0/24 (1 to 19).
    async fn new(prefix: &str, listed: bool, n: u8) -> Env {
        assert!((1..20).contains(&n));
        let cp = ControlPlane::shared();
        let (client, ns) = cp.client_crds_and_namespace(prefix).await;
        let net = format!("198.18.{n}");
        let env = Env { client, ns, net };
        env.nad("macvlan", None).await;
        let ns = &env.ns;
        let allocations = BTreeMap::from([
            ("10".to_string(), entry("sb-a", format!("{ns}/a:fenced"))),
            ("11".to_string(), entry("sb-b", format!("{ns}/b:fenced"))),
            ("12".to_string(), entry("sb-c", format!("{ns}/c:fenced"))),
            ("20".to_string(), entry("sb-web", format!("{ns}/web-0"))),
            ("30".to_string(), entry("sb-gone", format!("{ns}/gone-0"))),
        ]);
        env.pool(POOL, allocations, None).await;
        env.fence("10", "a", "sb-a", "node-1").await;
        env.fence("11", "b", "sb-b", "node-2").await;
        env.fence("12", "c", "sb-c", "node-1").await;
        env.reservation("192.0.2.10", "a").await;
        env.reservation("192.0.2.30", "gone-0").await;
        if listed {
            let status = serde_json::json!([
                {"name": "cbr0", "interface": "eth0", "ips": ["10.244.0.5"], "default": true},
                {"name": format!("{ns}/macvlan"), "interface": "net1", "ips": [env.fwd("192.0.2.12"), env.fwd("192.0.2.20")]},
            ]);
            let pod = testenv::fixtures::annotated_pod(
                "web-0",
                ipreclaim::ipam::NETWORK_STATUS_ANNOTATION,
                &status.to_string(),
            );
            Api::<Pod>::namespaced(env.client.clone(), ns)
                .create(&PostParams::default(), &pod)
                .await
                .unwrap();
        }
        env
    }

    /// The test's name for `s` (its range).
    fn fwd(&self, s: &str) -> String {
        s.replace("192.0.2", &self.net)
    }

    /// `s` with the test's range written back as `192.0.2`.
    fn back(&self, s: &str) -> String {
        s.replace(&self.net, "192.0.2")
    }

    async fn nad(&self, name: &str, network_name: Option<&str>) {
        let mut ipam =
            serde_json::json!({"type": "whereabouts", "range": self.fwd("192.0.2.0/24")});
        if let Some(n) = network_name {
            ipam["network_name"] = n.into();
        }
        let config = serde_json::json!({"cniVersion": "0.3.1", "type": "macvlan", "ipam": ipam});
        let nad = NetworkAttachmentDefinition::new(
            name,
            NetworkAttachmentDefinitionSpec {
                config: Some(config.to_string()),
            },
        );
        Api::<NetworkAttachmentDefinition>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &nad)
            .await
            .unwrap();
    }

    async fn pool(
        &self,
        name: &str,
        allocations: BTreeMap<String, IPAllocation>,
        annotations: Option<BTreeMap<String, String>>,
    ) {
        let mut pool = IPPool::new(
            &self.fwd(name),
            IPPoolSpec {
                range: self.fwd("192.0.2.0/24"),
                allocations,
            },
        );
        pool.metadata.annotations = annotations;
        Api::<IPPool>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &pool)
            .await
            .unwrap();
    }

    fn record(&self, pod: &str, node: &str) -> FenceRecord {
        FenceRecord {
            podref: format!("{}/{pod}", self.ns),
            uid: format!("uid-{pod}"),
            node: node.into(),
            why: "Ready=Unknown".into(),
            network: format!("{}/macvlan", self.ns),
            since: jiff::Timestamp::now(),
            grace_seconds: None,
        }
    }

    /// The `IPFence` of the entry at `key` of [`POOL`] (named as the controller names it).
    async fn fence(&self, key: &str, pod: &str, sandbox: &str, node: &str) {
        self.fence_in(POOL, key, pod, sandbox, node).await;
    }

    /// The `IPFence` of the entry at `key` of `pool`.
    async fn fence_in(&self, pool: &str, key: &str, pod: &str, sandbox: &str, node: &str) {
        let ip: std::net::IpAddr = self.fwd(&format!("192.0.2.{key}")).parse().unwrap();
        let pool = self.fwd(pool);
        let spec =
            ipreclaim::ipam::fence::fence_spec(&pool, key, ip, sandbox, &self.record(pod, node));
        let name = ipreclaim::ipam::fence::fence_object_name(&pool, key);
        Api::<IPFence>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &IPFence::new(&name, spec))
            .await
            .unwrap();
    }

    async fn reservation(&self, name: &str, pod: &str) {
        let r = OverlappingRangeIPReservation::new(
            &self.fwd(name),
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

    async fn pool_now(&self, name: &str) -> IPPool {
        Api::<IPPool>::namespaced(self.client.clone(), &self.ns)
            .get(&self.fwd(name))
            .await
            .unwrap()
    }

    /// The pool's entries as key -> podref.
    async fn entries(&self, name: &str) -> BTreeMap<String, String> {
        self.pool_now(name)
            .await
            .spec
            .allocations
            .into_iter()
            .map(|(k, a)| (k, a.podref))
            .collect()
    }

    async fn fences(&self) -> Vec<String> {
        let mut names: Vec<String> = Api::<IPFence>::namespaced(self.client.clone(), &self.ns)
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|f| Some(self.back(&f.metadata.name?)))
            .collect();
        names.sort();
        names
    }

    async fn reservations(&self) -> Vec<String> {
        let mut names: Vec<String> =
            Api::<OverlappingRangeIPReservation>::namespaced(self.client.clone(), &self.ns)
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .filter_map(|r| Some(self.back(&r.metadata.name?)))
                .collect();
        names.sort();
        names
    }

    /// Release Events on pod `pod`: their messages.
    async fn released(&self, pod: &str) -> Vec<String> {
        testenv::events::with_reason(&self.client, &self.ns, GC_DONE, Some(pod))
            .await
            .into_iter()
            .map(|e| self.back(&e.message.unwrap_or_default()))
            .collect()
    }

    /// Every Event in the namespace (a dry run must leave none).
    async fn all_events(&self) -> usize {
        Api::<k8s_openapi::api::core::v1::Event>::namespaced(self.client.clone(), &self.ns)
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len()
    }

    /// [`run`](Self::run)s the command and checks it exited `want`.
    fn run_exits(&self, command: &str, args: &[&str], want: i32) -> Output {
        let out = self.run(command, args);
        assert_eq!(exit_code(&out), want, "{}", explain(&out));
        out
    }

    /// [`run_exits`](Self::run_exits), and checks its stdout says each of `says`.
    fn run_says(&self, command: &str, args: &[&str], want: i32, says: &[&str]) -> Output {
        let out = self.run_exits(command, args, want);
        let text = stdout(&out);
        for s in says {
            assert!(text.contains(s), "{s:?} in {}", explain(&out));
        }
        out
    }

    /// Runs `ipreclaim <command> <args> --whereabouts-namespace <ns> --kubeconfig <path>`.
    fn run(&self, command: &str, args: &[&str]) -> Output {
        let kc = ControlPlane::shared().kubeconfig_path();
        let out = Command::new(BIN)
            .arg(command)
            .args(args.iter().map(|a| self.fwd(a)))
            .args(["--whereabouts-namespace", &self.ns, "--kubeconfig"])
            .arg(kc)
            .env_remove("KUBECONFIG")
            .env_remove("WHEREABOUTS_NAMESPACE")
            .env_remove("IPRECLAIM_RELEASE_COOLDOWN")
            .env("HOME", "/nonexistent")
            .output()
            .expect("run the ipreclaim binary");
        self.written_back(out)
    }

    /// `out` with the test's range written back as `192.0.2`.
    fn written_back(&self, mut out: Output) -> Output {
        out.stdout = self
            .back(&String::from_utf8_lossy(&out.stdout))
            .into_bytes();
        out.stderr = self
            .back(&String::from_utf8_lossy(&out.stderr))
            .into_bytes();
        out
    }
}

fn fenced(ns: &str, pod: &str) -> String {
    format!("{ns}/{pod}:fenced")
}

#[tokio::test]
async fn unfence_ip_lifts_one_fence_and_leaves_the_others() {
    let env = Env::new("unfence-ip", true, 1).await;
    let ns = env.ns.clone();

    let out = env.run_says(
        "unfence",
        &["--ip", "192.0.2.10"],
        0,
        &[
            "unfenced 192.0.2.10 (pool 192.0.2.0-24)",
            "IPFence 192.0.2.0-24-10 deleted",
        ],
    );
    let entries = env.entries(POOL).await;
    assert!(!entries.contains_key("10"), "{entries:?}");
    assert_eq!(entries["11"], fenced(&ns, "b"), "{entries:?}");
    assert_eq!(entries["12"], fenced(&ns, "c"), "{entries:?}");
    assert_eq!(entries["20"], format!("{ns}/web-0"));
    assert_eq!(
        env.fences().await,
        ["192.0.2.0-24-11", "192.0.2.0-24-12"],
        "only the lifted fence's record is gone"
    );
    assert_eq!(
        env.reservations().await,
        ["192.0.2.30"],
        "the deleted pod's reservation of the address went with it"
    );
    // The release Event on the deleted pod, written before the command exited.
    let events = env.released("a").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].contains("[192.0.2.10]") && events[0].contains("lifted by hand"),
        "{events:?}"
    );
    assert!(env.released("b").await.is_empty());
    // The audit line, on stderr.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ipreclaim::audit") && stderr.contains("released 192.0.2.10"),
        "{stderr}"
    );

    // Lifted already: nothing of that address is fenced now (1, and nothing written).
    env.run_says(
        "unfence",
        &["--ip", "192.0.2.10"],
        1,
        &["no fence of address 192.0.2.10"],
    );
}

#[tokio::test]
async fn unfence_refuses_a_live_pods_address_unless_forced_and_a_dry_run_writes_nothing() {
    let env = Env::new("unfence-force", true, 2).await;
    let ns = env.ns.clone();
    let before = env.pool_now(POOL).await.metadata.resource_version;

    // A dry run of the whole node: says what it would do, writes nothing.
    let out = env.run_exits("unfence", &["--node", "node-1", "--dry-run", "--force"], 0);
    let text = stdout(&out);
    assert!(
        text.contains("would unfence 192.0.2.10") && text.contains("would unfence 192.0.2.12"),
        "{text}"
    );
    assert!(!text.contains("192.0.2.11"), "node-2's fence: {text}");
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);
    assert_eq!(env.fences().await.len(), 3);
    assert_eq!(env.all_events().await, 0, "a dry run publishes no Event");

    // web-0 lists 192.0.2.12: refused (exit 1), nothing written.
    let live = format!("live pod {ns}/web-0 lists the address");
    env.run_says(
        "unfence",
        &["--ip", "192.0.2.12"],
        1,
        &["refused 192.0.2.12", &live],
    );
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);
    assert_eq!(env.fences().await.len(), 3);

    // --force says what it overrides, and lifts it.
    let help = stdout(&env.run("unfence", &["--help"]));
    assert!(
        help.contains("--force") && help.contains("live pod's network-status lists"),
        "{help}"
    );
    env.run_exits("unfence", &["--ip", "192.0.2.12", "--force"], 0);
    let entries = env.entries(POOL).await;
    assert!(!entries.contains_key("12"), "{entries:?}");
    assert_eq!(entries["10"], fenced(&ns, "a"));
    assert_eq!(env.fences().await, ["192.0.2.0-24-10", "192.0.2.0-24-11"]);
    assert_eq!(env.released("c").await.len(), 1);
}

#[tokio::test]
async fn unfence_all_leaves_no_fenced_entry_or_record() {
    let env = Env::new("unfence-all", false, 3).await;
    let ns = env.ns.clone();
    // Besides the three recorded fences: a fence in a second pool, a left-over IPFence whose
    // entry is gone, and a pending IPFence (written, its entry not rewritten yet).
    let annotations = BTreeMap::from([("keep".to_string(), "me".to_string())]);
    env.nad("blue", Some("blue")).await;
    let allocations = BTreeMap::from([
        ("50".to_string(), entry("sb-e", fenced(&ns, "e"))),
        ("60".to_string(), entry("sb-p", format!("{ns}/p"))),
    ]);
    env.pool("blue-192.0.2.0-24", allocations, Some(annotations))
        .await;
    env.fence_in("blue-192.0.2.0-24", "50", "e", "sb-e", "node-3")
        .await;
    env.fence("99", "gone-2", "sb-gone-2", "node-3").await;
    let spec = ipreclaim::ipam::fence::fence_spec(
        &env.fwd("blue-192.0.2.0-24"),
        "60",
        env.fwd("192.0.2.60").parse().unwrap(),
        "sb-p",
        &env.record("p", "node-3"),
    );
    Api::<IPFence>::namespaced(env.client.clone(), &ns)
        .create(&PostParams::default(), &IPFence::new("pending-60", spec))
        .await
        .unwrap();

    // The dry run lists all of it and writes nothing.
    let out = env.run_exits("unfence", &["--all", "--dry-run"], 0);
    let text = stdout(&out);
    for want in [
        "would unfence 192.0.2.10",
        "would unfence 192.0.2.11",
        "would unfence 192.0.2.12",
        "would unfence 192.0.2.50",
        "would delete IPFence 192.0.2.0-24-99",
        "would delete IPFence pending-60",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }
    assert_eq!(env.fences().await.len(), 6);
    assert_eq!(env.all_events().await, 0);

    env.run_says(
        "unfence",
        &["--all"],
        0,
        &["no :fenced entry or IPFence is left"],
    );
    for pool in [POOL, "blue-192.0.2.0-24"] {
        let p = env.pool_now(pool).await;
        assert!(
            p.spec
                .allocations
                .values()
                .all(|a| !a.podref.ends_with(":fenced")),
            "{pool}: {:?}",
            p.spec.allocations
        );
        let annotations = p.metadata.annotations.unwrap_or_default();
        if pool != POOL {
            assert_eq!(annotations.get("keep").map(String::as_str), Some("me"));
        }
    }
    assert!(env.fences().await.is_empty(), "{:?}", env.fences().await);
    // What was not fenced stays: web-0's, gone-0's and the pending fence's entries.
    assert_eq!(
        env.entries(POOL).await.keys().collect::<Vec<_>>(),
        ["20", "30"]
    );
    assert_eq!(
        env.entries("blue-192.0.2.0-24").await["60"],
        format!("{ns}/p")
    );
    for pod in ["a", "b", "c", "e"] {
        assert_eq!(env.released(pod).await.len(), 1, "an Event on {pod}");
    }

    // Nothing left: a second run has nothing to do and says so (0).
    env.run_exits("unfence", &["--all"], 0);
}

#[tokio::test]
async fn release_frees_an_entry_and_its_reservation_and_refuses_a_listed_address() {
    let env = Env::new("release", true, 4).await;
    let ns = env.ns.clone();

    // A dry run: says what it would do (the reservation too), writes nothing.
    let before = env.pool_now(POOL).await.metadata.resource_version;
    env.run_says(
        "release",
        &["--ip", "192.0.2.30", "--dry-run"],
        0,
        &[
            "would release 192.0.2.30 (pool 192.0.2.0-24)",
            "would delete reservation 192.0.2.30",
        ],
    );
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);
    assert_eq!(env.reservations().await, ["192.0.2.10", "192.0.2.30"]);
    assert_eq!(env.all_events().await, 0);

    env.run_says(
        "release",
        &["--ip", "192.0.2.30"],
        0,
        &["released 192.0.2.30", "reservation 192.0.2.30 deleted"],
    );
    assert!(!env.entries(POOL).await.contains_key("30"));
    assert_eq!(env.reservations().await, ["192.0.2.10"]);
    let events = env.released("gone-0").await;
    assert!(
        events.len() == 1 && events[0].contains("released by hand"),
        "{events:?}"
    );

    // web-0 lists 192.0.2.20: refused, nothing written; --pod of web-0 is refused the same way.
    let before = env.pool_now(POOL).await.metadata.resource_version;
    let live = format!("live pod {ns}/web-0 lists the address");
    for args in [["--ip", "192.0.2.20"], ["--pod", &format!("{ns}/web-0")]] {
        env.run_says("release", &args, 1, &["refused 192.0.2.20", &live]);
    }
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);

    // A fenced address is unfence's.
    env.run_says(
        "release",
        &["--ip", "192.0.2.11"],
        1,
        &["unfence --ip 192.0.2.11"],
    );
    // Nothing at that address.
    env.run_says(
        "release",
        &["--ip", "192.0.2.99"],
        1,
        &["no allocation of 192.0.2.99"],
    );
}

/// `release --release-cooldown`: the entry is marked cooling (podref `<ns>/<pod>:cooldown`, id
/// `ipreclaim-cooldown:<end>`) in the same guarded write, the reservation stays, and the Event
/// says until when; its dry run says so and writes nothing.
#[tokio::test]
async fn release_with_a_cooldown_marks_the_entry_and_keeps_the_reservation() {
    let env = Env::new("release-cool", false, 7).await;
    let ns = env.ns.clone();
    let args = ["--ip", "192.0.2.30", "--release-cooldown", "10m"];

    let before = env.pool_now(POOL).await.metadata.resource_version;
    let out = env.run_says(
        "release",
        &[&args[..], &["--dry-run"]].concat(),
        0,
        &[
            "would release 192.0.2.30 (pool 192.0.2.0-24)",
            "would keep it out of the pool for 10m (release cooldown",
        ],
    );
    assert!(
        !stdout(&out).contains("would delete reservation"),
        "{}",
        explain(&out)
    );
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);
    assert_eq!(env.all_events().await, 0);

    let started = jiff::Timestamp::now();
    env.run_says(
        "release",
        &args,
        0,
        &["released 192.0.2.30 (pool 192.0.2.0-24) into its cooldown until"],
    );
    let entry = env.pool_now(POOL).await.spec.allocations["30"].clone();
    assert_eq!(entry.podref, format!("{ns}/gone-0:cooldown"));
    let until = ipreclaim::ipam::cooldown::cooldown_until(&entry.id).expect("a cooldown marker");
    // 10 minutes from the write, which came after `started` (and well within a minute).
    let left = until.duration_since(started).as_secs();
    assert!(
        (600..=660).contains(&left),
        "ends {until}, {left}s after the start"
    );
    assert_eq!(
        env.reservations().await,
        ["192.0.2.10", "192.0.2.30"],
        "kept while it cools"
    );
    let events = env.released("gone-0").await;
    assert!(
        events.len() == 1
            && events[0].contains("released by hand")
            && events[0].contains("(in cooldown until "),
        "{events:?}"
    );
    // Released again: a cooling address is refused without --force...
    env.run_says(
        "release",
        &["--ip", "192.0.2.30"],
        1,
        &["192.0.2.30 is cooling"],
    );
    // ...and with it the cooldown ends now, never into another one: entry and reservation go.
    let out = env.run_exits("release", &[&args[..], &["--force"]].concat(), 0);
    assert!(
        !env.entries(POOL).await.contains_key("30"),
        "{}",
        explain(&out)
    );
    assert_eq!(
        env.reservations().await,
        ["192.0.2.10"],
        "{}",
        explain(&out)
    );
}

#[tokio::test]
async fn release_of_an_address_in_several_pools_needs_its_network() {
    let env = Env::new("release-net", false, 5).await;
    let ns = env.ns.clone();
    env.nad("blue", Some("blue")).await;
    let allocations = BTreeMap::from([("30".to_string(), entry("sb-blue", format!("{ns}/x-0")))]);
    env.pool("blue-192.0.2.0-24", allocations, None).await;
    env.reservation("blue-192.0.2.30", "x-0").await;

    let out = env.run_exits("release", &["--ip", "192.0.2.30"], 1);
    let text = stdout(&out);
    assert!(
        text.contains("several pools")
            && text.contains(&format!("192.0.2.0-24 (network {ns}/macvlan)"))
            && text.contains(&format!("blue-192.0.2.0-24 (network {ns}/blue)")),
        "{text}"
    );
    assert!(env.entries(POOL).await.contains_key("30"));

    let blue = format!("{ns}/blue");
    env.run_says(
        "release",
        &["--ip", "192.0.2.30", "--network", &blue],
        0,
        &["reservation blue-192.0.2.30 deleted"],
    );
    assert!(env.entries("blue-192.0.2.0-24").await.is_empty());
    assert!(
        env.entries(POOL).await.contains_key("30"),
        "the other pool's"
    );
    assert_eq!(env.reservations().await, ["192.0.2.10", "192.0.2.30"]);

    // --pod: every allocation of the pod (gone-0 holds 30 in the macvlan pool).
    env.run_exits("release", &["--pod", &format!("{ns}/gone-0")], 0);
    assert!(!env.entries(POOL).await.contains_key("30"));
    assert_eq!(env.reservations().await, ["192.0.2.10"]);
}

/// A directory holding `kubectl-ipreclaim`, a symlink to the built binary.
fn plugin_dir() -> PathBuf {
    let dir = testenv::procs::run_dir("kubectl-plugin-manual").expect("a run directory");
    std::os::unix::fs::symlink(BIN, dir.join("kubectl-ipreclaim")).expect("symlink");
    dir
}

fn kubectl(env: &Env, plugin_dir: &Path, args: &[&str]) -> Output {
    let kubectl = testenv::procs::binary("kubectl").expect("kubectl");
    let path = format!(
        "{}:{}",
        plugin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(kubectl)
        .args(args.iter().map(|a| env.fwd(a)))
        .env("PATH", path)
        .env("KUBECONFIG", ControlPlane::shared().kubeconfig_path())
        .env_remove("WHEREABOUTS_NAMESPACE")
        .output()
        .expect("run kubectl");
    env.written_back(out)
}

#[tokio::test]
async fn kubectl_ipreclaim_unfence_lifts_a_fence() {
    let env = Env::new("unfence-kubectl", true, 6).await;
    let dir = plugin_dir();
    let wns = format!("--whereabouts-namespace={}", env.ns);

    let out = kubectl(&env, &dir, &["ipreclaim", "--help"]);
    let help = stdout(&out);
    assert!(
        help.contains("unfence") && help.contains("release"),
        "listed in plugin mode: {help}"
    );
    let out = kubectl(&env, &dir, &["ipreclaim", "unfence", "--help"]);
    assert!(
        stdout(&out).contains(
            "Usage: kubectl ipreclaim unfence [OPTIONS] <--ip <ADDR>|--node <NODE>|--all>"
        ),
        "{}",
        explain(&out)
    );

    let out = kubectl(
        &env,
        &dir,
        &["ipreclaim", "unfence", "--ip", "192.0.2.12", &wns],
    );
    assert_eq!(
        exit_code(&out),
        1,
        "refused, and kubectl passes the code on: {}",
        explain(&out)
    );
    let out = kubectl(
        &env,
        &dir,
        &["ipreclaim", "unfence", "--ip", "192.0.2.11", &wns],
    );
    assert_eq!(exit_code(&out), 0, "{}", explain(&out));
    assert!(!env.entries(POOL).await.contains_key("11"));
    assert_eq!(env.fences().await, ["192.0.2.0-24-10", "192.0.2.0-24-12"]);
    assert_eq!(env.released("b").await.len(), 1);

    // Flags: neither --ip nor --node nor --all is a usage error (2).
    let out = kubectl(&env, &dir, &["ipreclaim", "unfence", &wns]);
    assert_eq!(exit_code(&out), 2, "{}", explain(&out));
}

// Manual commands as safe as the controller (issue 35, item 3): the controller's decision rules
// (a `Keep` needs --force), pools read before pods, a fresh read of each target pod right before
// the write, a `--sandbox` pin, and no fence lifted on a node that may still run the pod.

impl Env {
    /// Adds entry `key` held by sandbox `id` for `podref` to pool `name` (as the CNI does).
    async fn add_entry(&self, name: &str, key: &str, id: &str, podref: &str) {
        let patch = serde_json::json!([{
            "op": "add",
            "path": format!("/spec/allocations/{key}"),
            "value": {"id": id, "podref": podref, "ifname": "net1"},
        }]);
        let patch: json_patch::Patch = serde_json::from_value(patch).unwrap();
        Api::<IPPool>::namespaced(self.client.clone(), &self.ns)
            .patch(
                &self.fwd(name),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::<()>::Json(patch),
            )
            .await
            .unwrap();
    }

    /// Sets the sandbox id of entry `key` of pool `name` (whereabouts' ADD of a recreated pod
    /// reuses its podref's entry and rewrites only the id).
    async fn set_entry_id(&self, name: &str, key: &str, id: &str) {
        let patch = serde_json::json!({"spec": {"allocations": {key: {"id": id}}}});
        testenv::fixtures::merge(
            &Api::<IPPool>::namespaced(self.client.clone(), &self.ns),
            &self.fwd(name),
            patch,
        )
        .await;
    }

    /// Creates pod `name`, with a network-status listing `ips` on `macvlan` when given (none:
    /// Multus has not written it yet); its uid.
    async fn create_pod(&self, name: &str, ips: Option<&[&str]>) -> String {
        let pod = match ips {
            Some(ips) => {
                let ips: Vec<String> = ips.iter().map(|i| self.fwd(i)).collect();
                let status = serde_json::json!([
                    {"name": format!("{}/macvlan", self.ns), "interface": "net1", "ips": ips},
                ]);
                testenv::fixtures::annotated_pod(
                    name,
                    ipreclaim::ipam::NETWORK_STATUS_ANNOTATION,
                    &status.to_string(),
                )
            }
            None => testenv::fixtures::pod(name, None),
        };
        testenv::fixtures::create(&Api::<Pod>::namespaced(self.client.clone(), &self.ns), &pod)
            .await
    }

    /// Entry `key` of pool `name`: (id, podref), if there.
    async fn entry_of(&self, name: &str, key: &str) -> Option<(String, String)> {
        let pool = self.pool_now(name).await;
        pool.spec
            .allocations
            .get(key)
            .map(|a| (a.id.clone(), a.podref.clone()))
    }

    /// Starts `ipreclaim <command> <args>` talking to the apiserver through `proxy`.
    fn spawn_through(
        &self,
        proxy: &testenv::faultproxy::FaultProxy,
        command: &str,
        args: &[&str],
    ) -> std::process::Child {
        let dir = testenv::procs::run_dir(&format!("manual-proxy-{}", self.ns)).unwrap();
        let kc = dir.join("kubeconfig");
        ControlPlane::shared()
            .write_kubeconfig_through_faults(proxy, &self.ns, &kc)
            .unwrap();
        Command::new(BIN)
            .arg(command)
            .args(args.iter().map(|a| self.fwd(a)))
            .args(["--whereabouts-namespace", &self.ns, "--kubeconfig"])
            .arg(kc)
            .env_remove("KUBECONFIG")
            .env_remove("WHEREABOUTS_NAMESPACE")
            .env_remove("IPRECLAIM_RELEASE_COOLDOWN")
            .env("HOME", "/nonexistent")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run the ipreclaim binary")
    }

    /// A Node `name` (cluster-wide: name it after the namespace) whose Ready condition is
    /// `status`, its last transition at `at`.
    async fn node(&self, name: &str, status: &str, at: jiff::Timestamp) {
        let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(self.client.clone());
        if nodes.get_opt(name).await.unwrap().is_none() {
            testenv::fixtures::create(&nodes, &testenv::fixtures::node(name)).await;
        }
        let patch = testenv::fixtures::ready_condition(status, "SetByTest", &at.to_string());
        testenv::fixtures::merge_status(&nodes, name, patch).await;
    }
}

/// Waits (bounded) until `proxy` has seen `request` ("verb resource"); false when the command
/// exited first (it never sent one).
async fn sent(
    proxy: &testenv::faultproxy::FaultProxy,
    child: &mut std::process::Child,
    request: &str,
) -> bool {
    let seen = || proxy.requests().get(request).copied().unwrap_or(0) > 0;
    testenv::poll::wait_for(request, || {
        let done = seen() || child.try_wait().unwrap().is_some();
        async move { done }
    })
    .await;
    seen()
}

/// The command's output once it exits, with the test's range written back (waited for off the
/// runtime, which runs the proxy the command talks through).
async fn finished(env: &Env, child: std::process::Child) -> Output {
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    env.written_back(out)
}

/// A live pod whose network-status is not written yet holds an allocation that may be in flight:
/// the controller keeps it (`KeepReason::NoNetworkStatus`), and so does `release`, unless forced.
#[tokio::test]
async fn release_keeps_the_address_of_a_live_pod_without_network_status_unless_forced() {
    let env = Env::new("release-nostatus", false, 8).await;
    let ns = env.ns.clone();
    env.create_pod("new-0", None).await;
    env.add_entry(POOL, "40", "sb-new", &format!("{ns}/new-0"))
        .await;
    let before = env.pool_now(POOL).await.metadata.resource_version;

    let out = env.run("release", &["--ip", "192.0.2.40"]);
    assert!(
        env.entries(POOL).await.contains_key("40"),
        "released the address of live pod new-0, which has no network-status yet: {}",
        explain(&out)
    );
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    let text = stdout(&out);
    assert!(
        text.contains("refused 192.0.2.40")
            && text.contains(&format!("live pod {ns}/new-0 has no network-status yet"))
            && text.contains("--force"),
        "{}",
        explain(&out)
    );
    env.run_says(
        "release",
        &["--pod", &format!("{ns}/new-0")],
        1,
        &["refused 192.0.2.40"],
    );
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);

    // --force says what it overrides, and releases it.
    let help = stdout(&env.run("release", &["--help"]));
    assert!(
        help.contains("no network-status yet") && help.contains("live pod's network-status lists"),
        "{help}"
    );
    env.run_says(
        "release",
        &["--ip", "192.0.2.40", "--force"],
        0,
        &["released 192.0.2.40"],
    );
    assert!(!env.entries(POOL).await.contains_key("40"));
}

/// A StatefulSet pod recreated while the command reads the cluster: its CNI ADD reuses the old
/// pod's entry (same podref, the id rewritten) before Multus writes its network-status. Listing
/// pods before pools saw no pod and then the new pod's entry, and freed it; pools are read
/// first now, so the pod listed after them is seen, without network-status, and kept.
#[tokio::test]
async fn release_reads_pools_before_pods_so_a_pod_recreated_meanwhile_keeps_its_address() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let env = Env::new("release-order", false, 9).await;
    let ns = env.ns.clone();
    let proxy = FaultProxy::start(env.client.clone(), 35).await.unwrap();
    proxy.set_rules(vec![Rule::new(Some("list"), Some("ippools"), Action::Hold)]);
    let mut child = env.spawn_through(&proxy, "release", &["--ip", "192.0.2.30"]);
    assert!(
        sent(&proxy, &mut child, "list ippools").await,
        "no pool list"
    );
    // While the pool list is held: gone-0 comes back and its ADD takes its old entry.
    env.create_pod("gone-0", None).await;
    env.set_entry_id(POOL, "30", "sb-gone-new").await;
    proxy.clear();
    let out = finished(&env, child).await;

    assert_eq!(
        env.entry_of(POOL, "30").await,
        Some(("sb-gone-new".into(), format!("{ns}/gone-0"))),
        "freed the address of the recreated pod: {}",
        explain(&out)
    );
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    assert!(
        stdout(&out).contains("refused 192.0.2.30"),
        "{}",
        explain(&out)
    );
    assert_eq!(env.reservations().await, ["192.0.2.10", "192.0.2.30"]);
}

/// Between the listing and the write, gone-0 is recreated and given the address (its
/// network-status lists it): the command reads each target pod again right before the write
/// and refuses what changed, even with --force (what was forced was the old view).
#[tokio::test]
async fn release_reads_the_target_pod_again_right_before_the_write() {
    use testenv::faultproxy::{Action, FaultProxy, Rule};
    let env = Env::new("release-fresh", false, 10).await;
    let ns = env.ns.clone();
    for force in [false, true] {
        // A proxy of its own per run: its request counts are this run's.
        let proxy = FaultProxy::start(env.client.clone(), 35).await.unwrap();
        proxy.set_rules(vec![Rule::new(Some("get"), Some("pods"), Action::Hold)]);
        let args: &[&str] = match force {
            false => &["--ip", "192.0.2.30"],
            true => &["--ip", "192.0.2.30", "--force"],
        };
        // The forced run lists the first new gone-0 (which lists the address: forced) and sees
        // a second one on its fresh read.
        let mut child = env.spawn_through(&proxy, "release", args);
        let read_again = sent(&proxy, &mut child, "get pods").await;
        // While the fresh read is held: the StatefulSet's new gone-0, listing the address.
        let uid = match force {
            false => env.create_pod("gone-0", Some(&["192.0.2.30"])).await,
            true => {
                let pods = Api::<Pod>::namespaced(env.client.clone(), &ns);
                pods.delete(
                    "gone-0",
                    &kube::api::DeleteParams::default().grace_period(0),
                )
                .await
                .unwrap();
                env.create_pod("gone-0", Some(&["192.0.2.30"])).await
            }
        };
        proxy.clear();
        let out = finished(&env, child).await;
        assert!(
            env.entries(POOL).await.contains_key("30"),
            "released 192.0.2.30 with no fresh read of its pod (read again: {read_again}): {}",
            explain(&out)
        );
        assert_eq!(exit_code(&out), 1, "{}", explain(&out));
        let text = stdout(&out);
        assert!(
            text.contains("refused 192.0.2.30")
                && text.contains(&format!("pod {ns}/gone-0 changed since the listing"))
                && text.contains(&uid),
            "{}",
            explain(&out)
        );
    }
    assert!(env.released("gone-0").await.is_empty());
    assert_eq!(env.reservations().await, ["192.0.2.10", "192.0.2.30"]);
}

/// `--sandbox ID` pins the entry the operator saw: when the address is held by another sandbox
/// now (here: the recreated pod's ADD took the entry), nothing is written, even with --force.
#[tokio::test]
async fn release_with_a_sandbox_pin_refuses_an_entry_held_by_another_sandbox() {
    let env = Env::new("release-pin", false, 11).await;
    let ns = env.ns.clone();
    // The operator saw sb-gone at .30 (ipreclaim scan); gone-0 came back and its ADD took the
    // entry, Multus has not written its network-status yet.
    env.create_pod("gone-0", None).await;
    env.set_entry_id(POOL, "30", "sb-gone-new").await;
    let before = env.pool_now(POOL).await.metadata.resource_version;
    let out = env.run(
        "release",
        &["--ip", "192.0.2.30", "--sandbox", "sb-gone", "--force"],
    );
    assert_eq!(env.pool_now(POOL).await.metadata.resource_version, before);
    assert_eq!(exit_code(&out), 1, "{}", explain(&out));
    assert!(
        stdout(&out).contains("held by sandbox sb-gone-new now, not sb-gone (--sandbox)"),
        "{}",
        explain(&out)
    );
    let help = stdout(&env.run("release", &["--help"]));
    assert!(help.contains("--sandbox <ID>"), "{help}");

    // The pin of the sandbox seen, by a prefix of 12 characters or more as `scan` shows it.
    env.add_entry(POOL, "50", "0123456789abcdef0123", &format!("{ns}/gone-5"))
        .await;
    env.run_says(
        "release",
        &["--ip", "192.0.2.50", "--sandbox", "0123456789ab"],
        0,
        &["released 192.0.2.50"],
    );
    assert!(!env.entries(POOL).await.contains_key("50"));
    // --pod with a pin: only that sandbox's entries.
    env.add_entry(POOL, "51", "sb-x1", &format!("{ns}/gone-6"))
        .await;
    env.add_entry(POOL, "52", "sb-x2", &format!("{ns}/gone-6"))
        .await;
    env.run_says(
        "release",
        &["--pod", &format!("{ns}/gone-6"), "--sandbox", "sb-x2"],
        0,
        &["released 192.0.2.52"],
    );
    let entries = env.entries(POOL).await;
    assert!(
        entries.contains_key("51") && !entries.contains_key("52"),
        "{entries:?}"
    );
}

/// A fence whose node is NotReady (it may still run the pod) or Ready for less than the settle
/// is refused without --force, and the refusal names the out-of-service taint; a tainted node,
/// a Node that is gone, or one Ready long enough lifts as the controller lifts.
#[tokio::test]
async fn unfence_refuses_a_fence_whose_node_may_still_run_the_pod() {
    let env = Env::new("unfence-node", false, 12).await;
    let ns = env.ns.clone();
    let down = format!("{ns}-down");
    let now = jiff::Timestamp::now();
    env.node(&down, "Unknown", now).await;
    for (key, pod) in [("13", "d"), ("14", "e")] {
        env.add_entry(POOL, key, &format!("sb-{pod}"), &fenced(&ns, pod))
            .await;
        env.fence(key, pod, &format!("sb-{pod}"), &down).await;
    }
    let before = env.pool_now(POOL).await.metadata.resource_version;
    let taint = format!(
        "kubectl taint node {down} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute"
    );
    for args in [vec!["--node", down.as_str()], vec!["--ip", "192.0.2.13"]] {
        let out = env.run("unfence", &args);
        assert_eq!(
            env.pool_now(POOL).await.metadata.resource_version,
            before,
            "lifted a fence of NotReady node {down}: {}",
            explain(&out)
        );
        assert_eq!(exit_code(&out), 1, "{}", explain(&out));
        let text = stdout(&out);
        assert!(
            text.contains("refused 192.0.2.13")
                && text.contains(&format!("node {down} is Ready=Unknown"))
                && text.contains(&taint)
                && text.contains("--force"),
            "{}",
            explain(&out)
        );
    }
    // --all lifts the fences of nodes that are gone (node-1, node-2: no such Node) and refuses
    // the NotReady node's.
    let out = env.run_exits("unfence", &["--all"], 1);
    assert!(stdout(&out).contains(&taint), "{}", explain(&out));
    let entries = env.entries(POOL).await;
    assert_eq!(
        entries.keys().collect::<Vec<_>>(),
        ["13", "14", "20", "30"],
        "{}",
        explain(&out)
    );

    // Ready again, but for less than the settle: the kubelet may still be stopping the pod.
    env.node(&down, "True", jiff::Timestamp::now()).await;
    env.run_says(
        "unfence",
        &["--ip", "192.0.2.13"],
        1,
        &["refused 192.0.2.13", "Ready for only", &taint],
    );
    let help = stdout(&env.run("unfence", &["--help"]));
    assert!(
        help.contains("not Ready")
            && help.contains("out-of-service")
            && help.contains("--fence-settle"),
        "{help}"
    );
    // Ready for longer than the settle: lifted.
    let earlier = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(600);
    env.node(&down, "True", earlier).await;
    env.run_says(
        "unfence",
        &["--ip", "192.0.2.13"],
        0,
        &["unfenced 192.0.2.13"],
    );
    // NotReady again, then tainted out-of-service by its operator: lifted.
    env.node(&down, "False", jiff::Timestamp::now()).await;
    env.run_exits("unfence", &["--ip", "192.0.2.14"], 1);
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(env.client.clone());
    let taints = serde_json::json!({"spec": {"taints": [{
        "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute",
    }]}});
    testenv::fixtures::merge(&nodes, &down, taints).await;
    env.run_says("unfence", &["--node", &down], 0, &["unfenced 192.0.2.14"]);
    assert_eq!(
        env.entries(POOL).await.keys().collect::<Vec<_>>(),
        ["20", "30"]
    );
    nodes
        .delete(&down, &kube::api::DeleteParams::default())
        .await
        .unwrap();
}

/// --force lifts a NotReady node's fence, and says what it overrode.
#[tokio::test]
async fn unfence_force_lifts_a_fence_of_a_node_that_is_not_ready() {
    let env = Env::new("unfence-node-force", false, 13).await;
    let ns = env.ns.clone();
    let down = format!("{ns}-down");
    env.node(&down, "Unknown", jiff::Timestamp::now()).await;
    env.add_entry(POOL, "13", "sb-d", &fenced(&ns, "d")).await;
    env.fence("13", "d", "sb-d", &down).await;
    env.run_says(
        "unfence",
        &["--node", &down, "--force"],
        0,
        &["unfenced 192.0.2.13"],
    );
    assert!(!env.entries(POOL).await.contains_key("13"));
    Api::<k8s_openapi::api::core::v1::Node>::all(env.client.clone())
        .delete(&down, &kube::api::DeleteParams::default())
        .await
        .unwrap();
}

/// As the controller's sweep, `release` refuses an entry whose sandbox a node agent's
/// inventory lists live for another pod than the one holding it (here gone-1, deleted while
/// its node still runs it), naming the node, with or without `--inventory-namespace`; `--force`
/// releases it. The inventory is written here as the node agent writes it (a stand-in node).
#[tokio::test]
async fn release_refuses_an_address_whose_sandbox_a_node_agent_lists_live() {
    use ipreclaim::ipam::inventory;
    use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let env = Env::new("release-inventory", false, 14).await;
    let node = format!("{}-node", env.ns);
    // A sandbox id of this test's own: the inventories of every namespace are read.
    let sandbox = format!("{}-gone", env.ns);
    env.add_entry(POOL, "40", &sandbox, &format!("{}/gone-1", env.ns))
        .await;
    let name = inventory::lease_name(&node).unwrap();
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(inventory::INVENTORY_LABEL.into(), "true".into())].into()),
            annotations: Some(
                [(
                    inventory::INVENTORY_ANNOTATION.into(),
                    inventory::encode([(
                        sandbox.as_str(),
                        &inventory::Listed {
                            pod_uid: "uid-gone-0".into(),
                            grace_seconds: None,
                        },
                    )]),
                )]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.clone()),
            ..Default::default()
        }),
    };
    Api::<Lease>::namespaced(env.client.clone(), &env.ns)
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
    let ip = env.fwd("192.0.2.40");
    let says = format!("the node agent of {node} lists its sandbox live for pod uid uid-gone-0");
    let refused = format!("refused {}", env.back(&ip));
    let ns_flag = format!("--inventory-namespace={}", env.ns);
    for args in [vec!["--ip", &ip], vec!["--ip", &ip, &ns_flag]] {
        let out = env.run_exits("release", &args, 1);
        let text = env.back(&stdout(&out));
        assert!(
            text.contains(&refused) && text.contains(&says) && text.contains("--force"),
            "{}",
            explain(&out)
        );
        assert!(env.entries(POOL).await.contains_key("40"));
    }
    let help = stdout(&env.run("release", &["--help"]));
    assert!(help.contains("lists live"), "{help}");
    env.run_exits("release", &["--ip", &ip, "--force"], 0);
    assert!(!env.entries(POOL).await.contains_key("40"));
}
