//! The harness of the controller's tests: [`Env`] (a namespace, the objects tests create in
//! it, the controller started in process, and the waits on its effects), the stand-in Nodes
//! and fences of the fencing tests, and the controller run as its own process for the
//! leadership tests.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use ipreclaim::api::{IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use testenv::ControlPlane;
use testenv::poll::{http_get, metric_value, wait_for, wait_metric_line};
use testenv::procs::ChildGuard;

use crate::support::{self, Program, TEST_TIMINGS, allocation};

/// The reason of the Event a fenced release publishes.
pub const FENCED: &str = "IPAddressGarbageCollectionFenced";

/// A test's namespace on the shared control plane (or a private one), and the controller
/// it runs there.
pub struct Env {
    pub client: Client,
    pub ns: String,
    /// The chart's controller ServiceAccount client, when the chart is installed.
    pub chart: Option<Client>,
    pub metrics: SocketAddr,
    pub program: Option<Program>,
    /// The controller's client for [`start`](Self::start) without the chart, when not the
    /// admin `client` (one through a fault proxy).
    pub through: Option<Client>,
}

impl Env {
    pub async fn new(prefix: &str) -> Env {
        support::log_to_test_output();
        let cp = ControlPlane::shared();
        let (client, ns) = cp.client_crds_and_namespace(prefix).await;
        Env::with(client, ns)
    }

    /// Like [`new`](Self::new), with the chart installed in the namespace (also the
    /// whereabouts namespace); [`start`](Self::start) then acts as the chart's ServiceAccount.
    pub async fn new_chart(prefix: &str) -> Env {
        let mut env = Env::new(&format!("{prefix}-sa")).await;
        let cp = ControlPlane::shared();
        env.chart = Some(testenv::helm::install_as(cp, &env.client, &env.ns, "controller").await);
        env
    }

    /// An environment on a control plane of its own (started here; it stops when the returned
    /// handle is dropped), with the CRDs and a namespace.
    pub async fn private(prefix: &str) -> (ControlPlane, Env) {
        let cp = ControlPlane::start_for_test().await;
        let (client, ns) = cp.client_crds_and_namespace(prefix).await;
        (cp, Env::with(client, ns))
    }

    /// An environment on an existing namespace (a second replica, or a private control plane).
    pub fn with(client: Client, ns: String) -> Env {
        Env {
            client,
            ns,
            chart: None,
            metrics: "127.0.0.1:0".parse().unwrap(),
            program: None,
            through: None,
        }
    }

    /// Starts the controller with test timings plus `extra` flags; waits until it is ready.
    pub async fn start(&mut self, extra: &[&str]) {
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
                let client = self.through.clone().unwrap_or_else(|| self.client.clone());
                self.start_as(client, extra).await;
            }
        }
    }

    /// Like [`start`](Self::start), with the controller acting through `client`.
    pub async fn start_as(&mut self, client: Client, extra: &[&str]) {
        let mut flags = TEST_TIMINGS.to_vec();
        flags.push("--leader-election=false");
        flags.extend_from_slice(extra);
        let program = support::controller(client, &self.ns, &flags).await;
        self.metrics = program.metrics;
        self.program = Some(program);
    }

    pub async fn stop(&mut self) {
        if let Some(program) = &mut self.program {
            program.stop().await;
        }
    }

    pub fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// A macvlan NAD `name` with whereabouts IPAM over `range`.
    pub async fn nad(&self, name: &str, range: &str) {
        self.nad_config(name, &format!(
            r#"{{"cniVersion":"0.3.1","type":"macvlan","master":"eth0","ipam":{{"type":"whereabouts","range":"{range}"}}}}"#
        ))
        .await;
    }

    /// A NAD `name` with CNI config `config` (any text).
    pub async fn nad_config(&self, name: &str, config: &str) {
        support::create_nad(&self.client, &self.ns, name, config).await;
    }

    pub async fn delete_nad(&self, name: &str) {
        Api::<NetworkAttachmentDefinition>::namespaced(self.client.clone(), &self.ns)
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    /// A pool holding (offset, sandbox, pod name) allocations.
    pub async fn pool<S: AsRef<str>, P: AsRef<str>>(
        &self,
        name: &str,
        range: &str,
        allocations: &[(u32, S, P)],
    ) {
        let allocations = allocations
            .iter()
            .map(|(offset, id, pod)| {
                let entry = allocation(&self.ns, pod.as_ref(), id.as_ref());
                (offset.to_string(), entry)
            })
            .collect();
        support::create_pool(&self.client, &self.ns, name, range, allocations).await;
    }

    /// The macvlan NAD over 192.0.2.0/24 and its pool 192.0.2.0-24 holding (offset, sandbox,
    /// pod name) allocations: what most scenarios start from.
    pub async fn macvlan(&self, allocations: &[(u32, &str, &str)]) {
        self.nad("macvlan", "192.0.2.0/24").await;
        self.pool("192.0.2.0-24", "192.0.2.0/24", allocations).await;
    }

    /// Merge-patches pool `pool` with `patch` (entries written as the CNI or a person would).
    pub async fn merge_pool(&self, pool: &str, patch: serde_json::Value) {
        testenv::fixtures::merge(&self.pools(), pool, patch).await;
    }

    /// `name` recreated under its name (a StatefulSet's pod) and given 192.0.2.`offset` by the
    /// CNI in sandbox `sandbox`: the pod listing it, then its entry in the macvlan pool.
    /// Returns the new pod's uid.
    pub async fn recreate(&self, name: &str, offset: u32, sandbox: &str) -> String {
        let uid = self
            .pod(name, "macvlan", Some(&[&format!("192.0.2.{offset}")]))
            .await;
        self.give_back(name, offset, sandbox).await;
        uid
    }

    /// whereabouts gives pod `name` the macvlan pool's entry at `offset` for sandbox
    /// `sandbox` (it reuses an entry by podref: the same name gets its entry back).
    pub async fn give_back(&self, name: &str, offset: u32, sandbox: &str) {
        let entry = allocation(&self.ns, name, sandbox);
        let patch = serde_json::json!({"spec": {"allocations": {offset.to_string(): entry}}});
        self.merge_pool("192.0.2.0-24", patch).await;
    }

    /// Multus writes pod `name`'s network-status: `ips` on the macvlan network.
    pub async fn list_on(&self, name: &str, ips: &[&str]) {
        let status = support::network_status(&self.ns, "macvlan", ips);
        let patch = serde_json::json!({"metadata": {"annotations": {
            NETWORK_STATUS_ANNOTATION: status}}});
        testenv::fixtures::merge(&self.pods(), name, patch).await;
    }

    /// The usual pair: the macvlan NAD over 192.0.2.0/24, web-0 (192.0.2.10, sandbox sb-web)
    /// and db-0 (192.0.2.11, sb-db) with their entries in pool 192.0.2.0-24. Returns web-0's uid.
    pub async fn web_0_and_db_0(&self) -> String {
        self.macvlan(&[(10, "sb-web", "web-0"), (11, "sb-db", "db-0")])
            .await;
        let web_uid = self.pod("web-0", "macvlan", Some(&["192.0.2.10"])).await;
        self.pod("db-0", "macvlan", Some(&["192.0.2.11"])).await;
        web_uid
    }

    /// [`macvlan`](Self::macvlan) with one allocation per pod of `names`: offsets 10, 11, ...,
    /// sandboxes sb-0, sb-1, ...
    pub async fn macvlan_of_pods(&self, names: &[String]) {
        let sandboxes: Vec<String> = (0..names.len()).map(|i| format!("sb-{i}")).collect();
        let allocations: Vec<(u32, &str, &str)> = names
            .iter()
            .zip(&sandboxes)
            .enumerate()
            .map(|(i, (n, sb))| (10 + i as u32, sb.as_str(), n.as_str()))
            .collect();
        self.macvlan(&allocations).await;
    }

    /// A pod whose network-status lists `ips` on network `nad` (None: no annotation).
    pub async fn pod(&self, name: &str, nad: &str, ips: Option<&[&str]>) -> String {
        self.pod_on(name, nad, ips, None).await
    }

    /// Like [`pod`](Self::pod), bound to `node`, with a termination grace period of 1 s (a
    /// stand-in stops at once; a graceful delete still leaves it Terminating).
    pub async fn pod_on(
        &self,
        name: &str,
        nad: &str,
        ips: Option<&[&str]>,
        node: Option<&str>,
    ) -> String {
        let pod = self.pod_object(name, nad, ips, node, 1);
        testenv::fixtures::create(&self.pods(), &pod).await
    }

    /// The pod [`pod_on`](Self::pod_on) creates, with termination grace `grace` seconds.
    pub fn pod_object(
        &self,
        name: &str,
        nad: &str,
        ips: Option<&[&str]>,
        node: Option<&str>,
        grace: i64,
    ) -> Pod {
        let annotations = ips.map(|ips| {
            let status = support::network_status(&self.ns, nad, ips);
            BTreeMap::from([(NETWORK_STATUS_ANNOTATION.to_string(), status)])
        });
        let mut pod = testenv::fixtures::pod(name, annotations);
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_name = node.map(Into::into);
            spec.termination_grace_period_seconds = Some(grace);
        }
        pod
    }

    /// Deletes pod `name` at once, in whatever phase it is (a force deletion: on a live node,
    /// its kubelet would only start stopping it now).
    pub async fn delete_pod(&self, name: &str) {
        self.pods()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    /// Deletes pod `name` as its kubelet does once it has stopped it: phase Failed first
    /// (kubelets since 1.27), then the delete.
    pub async fn delete_stopped_pod(&self, name: &str) {
        self.set_phase(name, "Failed").await;
        self.delete_pod(name).await;
    }

    /// Sets pod `name`'s `status.phase`.
    pub async fn set_phase(&self, name: &str, phase: &str) {
        let status = serde_json::json!({"status": {"phase": phase}});
        testenv::fixtures::merge_status(&self.pods(), name, status).await;
    }

    pub async fn keys(&self, pool: &str) -> Vec<String> {
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

    pub async fn wait_keys(&self, pool: &str, want: &[&str]) {
        let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        wait_for(&format!("pool {pool} keys {want:?}"), || {
            let want = want.clone();
            async move { self.keys(pool).await == want }
        })
        .await;
    }

    /// Events with `reason` in the test namespace, as (object name, uid, message).
    pub async fn events(&self, reason: &str) -> Vec<(String, String, String)> {
        let events = testenv::events::with_reason(&self.client, &self.ns, reason, None).await;
        events.into_iter().map(name_uid_message).collect()
    }

    /// Waits for the Event with `reason`: there is one, about `pod` (`uid`). Returns its message.
    pub async fn wait_one_event(&self, reason: &str, pod: &str, uid: &str) -> String {
        let events = self.wait_events(reason).await;
        assert_eq!(events.len(), 1, "{events:?}");
        let (name, u, message) = events.into_iter().next().unwrap();
        assert_eq!((name.as_str(), u.as_str()), (pod, uid));
        message
    }

    /// Waits until at least one Event with `reason` exists and returns them.
    pub async fn wait_events(&self, reason: &str) -> Vec<(String, String, String)> {
        let events = testenv::events::wait_with_reason(&self.client, &self.ns, reason).await;
        events.into_iter().map(name_uid_message).collect()
    }

    /// Waits until each of `pods` has an `IPAddressGarbageCollected` Event, and checks that no
    /// other pod has one and none has two (each address released once).
    pub async fn wait_released_once(&self, pods: &[&str]) {
        let reason = "IPAddressGarbageCollected";
        let events = testenv::poll::wait_seen(
            &format!("{reason} Events about {pods:?}"),
            || self.events(reason),
            |events| pods.iter().all(|p| events.iter().any(|e| e.0 == *p)),
            |events| format!("{events:?}"),
        )
        .await;
        let mut objects: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
        objects.sort();
        assert_eq!(objects, pods, "each address released once: {events:?}");
    }

    /// Waits for Events with `reason` (see [`wait_events`](Self::wait_events)) and checks that
    /// the first one's message says each of `says`.
    pub async fn wait_events_saying(
        &self,
        reason: &str,
        says: &[&str],
    ) -> Vec<(String, String, String)> {
        let events = self.wait_events(reason).await;
        for s in says {
            assert!(events[0].2.contains(s), "{s:?} in {events:?}");
        }
        events
    }

    /// Waits until /metrics has a line starting with `line`: counters are bumped when the
    /// write returns, which may be after the test already sees its effect.
    pub async fn wait_metric(&self, line: &str) {
        wait_metric_line(self.metrics, line).await;
    }

    /// Waits until `n` more sweeps have run.
    pub async fn wait_sweeps(&self, n: f64) {
        let count = "ipreclaim_sweep_duration_seconds_count";
        let start = metric_value(&self.metrics_text().await, count);
        wait_for(&format!("{n} more sweeps"), || async {
            metric_value(&self.metrics_text().await, count) >= start + n
        })
        .await;
    }

    pub async fn metrics_text(&self) -> String {
        http_get(self.metrics, "/metrics").await.1
    }
}

/// Held by the tests that count malformed objects (NADs, pods' network-status) on /metrics, or
/// make duplicate addresses (which `scan` and every controller would report): the controller
/// watches them in every namespace, so each test would count the other's. Each
/// removes its malformed objects before it lets go (namespaces stay: no namespace controller
/// runs here).
pub async fn one_bad_input_test_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static BAD_INPUT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    BAD_INPUT.lock().await
}

/// An Event as (object name, uid, message).
fn name_uid_message(e: Event) -> (String, String, String) {
    (
        e.involved_object.name.unwrap_or_default(),
        e.involved_object.uid.unwrap_or_default(),
        e.message.unwrap_or_default(),
    )
}

// Fencing against the real apiserver. The Nodes here are stand-ins (Node objects whose Ready
// condition the test sets; no kubelet): the real node's own CNI DEL frees a fenced entry as
// soon as its kubelet tears the sandbox down, so only a stand-in lets the settle period, a
// restart while fenced and the release by ipreclaim itself be seen. The e2e scenarios on the
// real node show the rest.

impl Env {
    /// A Node named after the test's namespace, with its Ready condition `status`.
    pub async fn fence_node(&self, status: &str) -> String {
        let name = format!("{}-node", self.ns);
        self.create_node(&name, status).await;
        name
    }

    /// A stand-in Node `name` with its Ready condition `status`.
    pub async fn create_node(&self, name: &str, status: &str) {
        Api::<Node>::all(self.client.clone())
            .create(&PostParams::default(), &testenv::fixtures::node(name))
            .await
            .unwrap();
        self.set_ready(name, status).await;
    }

    /// Sets a Node's Ready condition, its transition now.
    pub async fn set_ready(&self, node: &str, status: &str) {
        self.set_ready_at(node, status, jiff::Timestamp::now())
            .await;
    }

    /// Sets a Node's Ready condition as a node whose clock reads `clock` reports it.
    pub async fn set_ready_at(&self, node: &str, status: &str, clock: jiff::Timestamp) {
        let now = clock.to_string();
        let patch = testenv::fixtures::ready_condition(status, "SetByTest", &now);
        testenv::fixtures::merge_status(&Api::<Node>::all(self.client.clone()), node, patch).await;
    }

    pub async fn delete_node(&self, node: &str) {
        Api::<Node>::all(self.client.clone())
            .delete(node, &DeleteParams::default())
            .await
            .unwrap();
    }

    /// The reservation of `ip` for pod `pod`'s sandbox `sb-<pod>`.
    pub async fn reservation(&self, ip: &str, pod: &str) {
        self.reservation_of(ip, &format!("sb-{pod}"), pod).await;
    }

    /// The reservation of `ip` for sandbox `sandbox` of pod `pod`.
    pub async fn reservation_of(&self, ip: &str, sandbox: &str, pod: &str) {
        support::create_reservation(&self.client, &self.ns, ip, sandbox, pod).await;
    }

    pub fn reservations(&self) -> Api<OverlappingRangeIPReservation> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub async fn reservation_names(&self) -> Vec<String> {
        support::reservation_names(&self.client, &self.ns).await
    }

    /// (podref, fence record's spec as JSON) of `key` in `pool`.
    pub async fn entry_and_fence(&self, pool: &str, key: &str) -> (Option<String>, Option<String>) {
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

    /// A test namespace with web-0 fenced on an unready node (see
    /// [`fenced_web_0`](Self::fenced_web_0)), the controller running with `extra`. Returns it,
    /// the node and web-0's uid.
    pub async fn with_web_0_fenced(prefix: &str, extra: &[&str]) -> (Env, String, String) {
        let mut env = Env::new(prefix).await;
        let node = env.fence_node("Unknown").await;
        let uid = env.fenced_web_0(&node, extra).await;
        (env, node, uid)
    }

    /// [`with_web_0_fenced`](Self::with_web_0_fenced), then
    /// [`assert_web_0_fenced`](Self::assert_web_0_fenced).
    pub async fn with_web_0_seen_fenced(prefix: &str, extra: &[&str]) -> (Env, String, String) {
        let (env, node, uid) = Env::with_web_0_fenced(prefix, extra).await;
        env.assert_web_0_fenced(&node).await;
        (env, node, uid)
    }

    /// Stops the controller, then deletes `node` (Nodes are not namespaced: each test removes
    /// its own).
    pub async fn finish(&mut self, node: &str) {
        self.stop().await;
        self.delete_node(node).await;
    }

    /// web-0 (192.0.2.10, with its reservation) and db-0 (192.0.2.11) on `node`; the
    /// controller runs with `extra`; web-0 is force-deleted and its Fenced Event awaited.
    pub async fn fenced_web_0(&mut self, node: &str, extra: &[&str]) -> String {
        self.fenced_web_0_in("192.0.2", node, extra).await
    }

    /// [`fenced_web_0`](Self::fenced_web_0) over `net`.0/24 (NAD `macvlan`, pool
    /// `net`.0-24): a range no other test's live pod lists, for a test whose commands read
    /// pods cluster-wide (every test's NAD is in the same cluster, and NADs of one range map
    /// to one pool).
    pub async fn fenced_web_0_in(&mut self, net: &str, node: &str, extra: &[&str]) -> String {
        self.fenced_web_0_with(net, node, 1, extra).await
    }

    /// [`fenced_web_0_in`](Self::fenced_web_0_in), web-0 with termination grace `grace` s.
    pub async fn fenced_web_0_with(
        &mut self,
        net: &str,
        node: &str,
        grace: i64,
        extra: &[&str],
    ) -> String {
        let (web, db) = (format!("{net}.10"), format!("{net}.11"));
        self.nad("macvlan", &format!("{net}.0/24")).await;
        let allocations = [(10, "sb-web-0", "web-0"), (11, "sb-db-0", "db-0")];
        self.pool(&format!("{net}.0-24"), &format!("{net}.0/24"), &allocations)
            .await;
        self.reservation(&web, "web-0").await;
        self.reservation(&db, "db-0").await;
        let web_0 = self.pod_object("web-0", "macvlan", Some(&[&web]), Some(node), grace);
        let uid = testenv::fixtures::create(&self.pods(), &web_0).await;
        self.pod_on("db-0", "macvlan", Some(&[&db]), Some(node))
            .await;
        self.start(extra).await;
        self.delete_pod("web-0").await;
        let message = self.wait_one_event(FENCED, "web-0", &uid).await;
        assert!(
            message.contains(&format!(
                "node {node} was not Ready (Ready=Unknown (SetByTest))"
            )),
            "{message}"
        );
        uid
    }

    /// web-0's entry (offset 10) is fenced for `node`, with its record.
    pub async fn assert_web_0_fenced_alone(&self, node: &str) {
        wait_for("web-0's entry fenced", || async {
            self.entry_and_fence("192.0.2.0-24", "10").await.0
                == Some(format!("{}/web-0:fenced", self.ns))
        })
        .await;
        let (_, fence) = self.entry_and_fence("192.0.2.0-24", "10").await;
        let fence: serde_json::Value = serde_json::from_str(&fence.expect("fence record")).unwrap();
        assert_eq!(fence["node"], node);
    }

    pub async fn assert_web_0_fenced(&self, node: &str) {
        let (podref, fence) = self.entry_and_fence("192.0.2.0-24", "10").await;
        assert_eq!(podref, Some(format!("{}/web-0:fenced", self.ns)));
        let fence: serde_json::Value = serde_json::from_str(&fence.expect("fence record")).unwrap();
        assert_eq!(fence["node"], node);
        assert_eq!(fence["podref"], format!("{}/web-0", self.ns));
        assert_eq!(self.keys("192.0.2.0-24").await, ["10", "11"]);
        assert!(
            self.reservation_names()
                .await
                .contains(&"192.0.2.10".to_string()),
            "the reservation stays with the fence"
        );
        assert!(self.events("IPAddressGarbageCollected").await.is_empty());
    }

    /// web-0's address, reservation and fence record are gone, with one release Event.
    pub async fn wait_web_0_released(&self, uid: &str) {
        self.wait_keys("192.0.2.0-24", &["11"]).await;
        // db-0's, if it has one (a live entry its pod lists gets one), stays.
        wait_for("web-0's reservation deleted", || async {
            !self
                .reservation_names()
                .await
                .contains(&"192.0.2.10".to_string())
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

impl Env {
    /// The node agent's report on the fence of entry `key` of `pool`, as the agent on `node`
    /// writes it for pod `uid` now (bound to the fence object's uid): the object's name and the
    /// report.
    pub async fn agent_report(
        &self,
        pool: &str,
        key: &str,
        node: &str,
        uid: &str,
    ) -> (String, serde_json::Value) {
        let name = ipreclaim::ipam::fence::fence_object_name(pool, key);
        let fence = Api::<ipreclaim::api::IPFence>::namespaced(self.client.clone(), &self.ns)
            .get(&name)
            .await
            .unwrap();
        let report = serde_json::json!({
            "node": node, "podUid": uid, "fenceUid": fence.metadata.uid.unwrap(),
            "observedAt": jiff::Timestamp::now().to_string(),
        });
        (name, report)
    }

    /// The node agent on `node` reports web-0's (`uid`) sandbox still present on its fence, then
    /// `node` is Ready again: the fence's name and the report.
    pub async fn web_0_present_then_ready(
        &self,
        node: &str,
        uid: &str,
    ) -> (String, serde_json::Value) {
        let (name, report) = self.agent_report("192.0.2.0-24", "10", node, uid).await;
        let present = serde_json::json!({"sandboxesPresent": report.clone()});
        self.report(&name, present).await;
        self.set_ready(node, "True").await;
        (name, report)
    }

    /// Writes `gone` as the node agent's report into fence `name`'s status.
    pub async fn report_gone(&self, name: &str, gone: serde_json::Value) {
        self.report(
            name,
            serde_json::json!({"sandboxesGone": gone, "sandboxesPresent": null}),
        )
        .await;
    }

    /// Writes `status` (the node agent's reports) into fence `name`'s status.
    pub async fn report(&self, name: &str, status: serde_json::Value) {
        let status = serde_json::json!({ "status": status });
        testenv::fixtures::merge_status(
            &Api::<ipreclaim::api::IPFence>::namespaced(self.client.clone(), &self.ns),
            name,
            status,
        )
        .await;
    }
}

/// Creates `object` (raw JSON, so that fields our types require can be left out) in the test
/// namespace.
pub async fn create_raw<K: kube::Resource<DynamicType = ()>>(env: &Env, object: serde_json::Value) {
    let resource = kube::api::ApiResource::erase::<K>(&());
    let object: kube::api::DynamicObject = serde_json::from_value(object).unwrap();
    Api::<kube::api::DynamicObject>::namespaced_with(env.client.clone(), &env.ns, &resource)
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
}

/// Warning Events with `reason` as (object name, message, count).
pub async fn warnings(env: &Env, reason: &str) -> Vec<(String, String, i32)> {
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

/// An `ipreclaim controller` process (the binary, so that it can be killed with SIGKILL),
/// killed when dropped.
pub fn controller_process(env: &Env, flags: &[&str]) -> ChildGuard {
    controller_process_logging(env, flags, None)
}

/// The same, logging at info level into `log` when given (warnings to stderr otherwise).
pub fn controller_process_logging(
    env: &Env,
    flags: &[&str],
    log: Option<&std::path::Path>,
) -> ChildGuard {
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
    ChildGuard::spawn(&mut command).expect("start the ipreclaim binary")
}

/// The Lease's holder identity and when it acquired the Lease.
pub async fn lease(env: &Env) -> Option<(String, jiff::Timestamp)> {
    let l =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(env.client.clone(), &env.ns)
            .get_opt("ipreclaim-controller")
            .await
            .unwrap()?;
    let spec = l.spec?;
    let at = spec.acquire_time.or(spec.renew_time)?;
    Some((spec.holder_identity?, at.0))
}

/// The identity's pid (`<host>_<pid>-<run>-<nanos>`).
pub fn holder_pid(holder: &str) -> u32 {
    holder
        .rsplit_once('_')
        .and_then(|(_, rest)| rest.split('-').next()?.parse().ok())
        .unwrap_or_else(|| panic!("a pid in the identity {holder:?}"))
}

/// Runs `kubectl ipreclaim <command> <args>` as an operator would (the real kubectl running the
/// built binary as its plugin), against the test's namespace (also its whereabouts namespace);
/// fails the test unless it exits 0.
pub fn cli(env: &Env, command: &str, args: &[&str]) -> std::process::Output {
    let out = support::kubectl_ipreclaim(&ControlPlane::shared().kubeconfig_path())
        .arg(command)
        .args(args)
        .arg(format!("--whereabouts-namespace={}", env.ns))
        .output()
        .unwrap_or_else(|e| panic!("run kubectl ipreclaim {command}: {e}"));
    assert!(
        out.status.success(),
        "kubectl ipreclaim {command} {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A ValidatingAdmissionPolicy and its binding (a real apiserver's admission, bound to the
/// test's namespace) that refuse IPPool updates failing a CEL `expression`: stands for any
/// refusal of one write (too large, invalid, forbidden). [`lift`](Self::lift) ends it.
pub struct PoolRefusal {
    name: String,
    client: Client,
}

impl PoolRefusal {
    /// Refuses the updates of the namespace's pools for which `expression` is false.
    pub async fn new(env: &Env, tag: &str, expression: &str) -> PoolRefusal {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        let name = format!("{}-{tag}", env.ns);
        let policy: ValidatingAdmissionPolicy = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": ["whereabouts.cni.cncf.io"], "apiVersions": ["*"],
                    "operations": ["UPDATE"], "resources": ["ippools"],
                }]},
                "validations": [{
                    "expression": expression,
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
        PoolRefusal {
            name,
            client: env.client.clone(),
        }
    }

    /// Waits until a dry-run JSON `patch` of `pool` is refused (`refused`) or accepted: the
    /// apiserver applies a new policy a moment after it is created or deleted.
    pub async fn wait_in_force(env: &Env, pool: &str, patch: serde_json::Value, refused: bool) {
        let patch: json_patch::Patch = serde_json::from_value(patch).unwrap();
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

    /// Ends the refusal.
    pub async fn lift(self) {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
        };
        Api::<ValidatingAdmissionPolicyBinding>::all(self.client.clone())
            .delete(&self.name, &DeleteParams::default())
            .await
            .unwrap();
        Api::<ValidatingAdmissionPolicy>::all(self.client)
            .delete(&self.name, &DeleteParams::default())
            .await
            .unwrap();
    }
}
