//! The chaos suite (opt-in, bounded, seeded): `scripts/chaos.sh [--seed S] [--trials N]
//! [--kinds a,b]`.
//!
//! On a private control plane, two `ipreclaim controller` processes (leader election) each talk
//! to the apiserver through a fault proxy of their own (`testenv::faultproxy`). The allocator is
//! the real whereabouts v0.9.4 CNI binary, invoked as the runtime invokes it, for pods on
//! stand-in Nodes in two zones; Multus's part (the pod's network-status) is written right after
//! each ADD. Pods are deleted as a kubelet that stopped them leaves them (phase Failed first)
//! but without CNI DEL (the leaks ipreclaim exists for) while one fault
//! is injected per trial (see [`Kind`]):
//! - `KillMidBatch`, `LeaderKill`: the leader SIGKILLed during or before the deletions;
//! - `ApiserverAndEtcdRestart`: the control plane restarted during a mass deletion;
//! - `LeaderPartition`: the leader (or only its Lease renewals) cut off by its proxy;
//! - `StatefulSetRecreate`, `ChurnWithAllocator`: names recreated at once, new pods coming;
//! - `ZoneOutage`, `ZoneRecreate`: a zone NotReady, its pods fenced (and recreated elsewhere);
//! - `WriteStorm`: 422/429/5xx on writes and reads, watches cut and slowed;
//! - `FlappingStatus`: live pods whose network-status lists their address now and then;
//! - `ReservationDeletesRefused`: every reservation DELETE refused (5xx, 429) or slowed for
//!   3-6 s, a third of the names recreated meanwhile; the sweep finds the failed deletes again;
//! - `LeaderLostBetweenPatchAndDelete`: the leader's proxy cuts it right after answering its
//!   pool patch (`Action::CutAfter`), before any reservation delete; killed or healed later;
//! - `ForgedAnnotations`: 100-200 Pending tenant pods with forged network-status (past each
//!   cap, or listing every allocated address) created while deletions flow;
//! - `ManualRaces`: `ipreclaim release` run against each deleted pod's allocation while the
//!   name is recreated and allocated by the real CNI (controllers' writes held in half);
//! - `ForeignCleaner`: another cleaner frees ipreclaim's fenced entries during a zone outage,
//!   new pods take the addresses, then the zone returns and the fences lift.
//!
//! Checked every 100 ms during the trial:
//! - every live pod's pool entry and reservation are there and name it;
//! - every address of a pod deleted from a NotReady node (fenced) keeps its entry and
//!   reservation until its node has been Ready for the settle (measured from when the trial set
//!   it Ready, which the controller can only see later);
//! - no ADD hands a live or fenced address to another pod;
//! - no replica sends a pool patch or reservation delete while the other held the Lease the
//!   whole second around it (writes in flight across a partition count from when the replica
//!   sent them);
//! - every replica's RSS stays under [`RSS_LIMIT_MIB`] (half the chart's limit).
//!
//! After the fault ends, every dead pod's entry and reservation must be freed within the
//! trial's bound; no controller may panic. Prints each trial's seed and a table, exits 1 on any
//! violation.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use ipreclaim::api::{
    IPPool, NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec,
    OverlappingRangeIPReservation,
};
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use testenv::ControlPlane;
use testenv::faultproxy::{Action, FaultProxy, Rule};
use testenv::whereabouts::WhereaboutsCni;

const SWEEP: Duration = Duration::from_secs(1);
const GRACE: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(4);
const SETTLE: Duration = Duration::from_secs(4);
/// Lease duration plus one renew period (the Lease is renewed a third of it before expiry).
const TAKEOVER: Duration = Duration::from_secs(4 + 3);
/// What a 2-core machine under load adds to any bound.
const SLACK: Duration = Duration::from_secs(3);
const RSS_LIMIT_MIB: u64 = 128;
/// How long a live allocation's reservation may be missing before it counts as deleted:
/// whereabouts reads the reservation before it writes the pool entry, so a delete can land in
/// between whatever the check before it saw; ipreclaim looks again 0.3 s after each delete and
/// puts it back (docs/concepts/reservations.md). Each such gap is counted and printed.
const RESERVATION_GAP: Duration = Duration::from_millis(1500);
/// How long a live allocation's reservation may be missing when no ipreclaim process deleted
/// it since its ADD began: whereabouts v0.9.4 never made it (a retried pool update that ends
/// on another address than its first try keeps the first try's "the reservation is there
/// already"). The leader creates it once it has seen it missing for 6 s with the pod listing
/// the address (past its looks after a delete), at its next sweep; plus the machine's slack.
const UNMADE_RESERVATION_GAP: Duration = Duration::from_secs(6 + 1 + 3);
const RANGE: &str = "10.64.0.0/23";
const POOL: &str = "10.64.0.0-23";
const ZONE_NODES: usize = 3;

const KINDS: [Kind; 16] = [
    Kind::KillMidBatch,
    Kind::ApiserverAndEtcdRestart,
    Kind::LeaderKill,
    Kind::LeaderPartition,
    Kind::StatefulSetRecreate,
    Kind::ZoneOutage,
    Kind::ZoneRecreate,
    Kind::WriteStorm,
    Kind::ChurnWithAllocator,
    Kind::FlappingStatus,
    Kind::SecondCleaner,
    Kind::ReservationDeletesRefused,
    Kind::LeaderLostBetweenPatchAndDelete,
    Kind::ForgedAnnotations,
    Kind::ManualRaces,
    Kind::ForeignCleaner,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// SIGKILL of the leader while a batch of deletions comes in; a new replica starts.
    KillMidBatch,
    /// kube-apiserver, then etcd restarted during a mass deletion.
    ApiserverAndEtcdRestart,
    /// The leader killed before the deletions; a new replica starts.
    LeaderKill,
    /// The leader's proxy partitions it from the apiserver while the standby's works, 0-300 ms
    /// into a batch of deletions; healed after the standby led for a while.
    LeaderPartition,
    /// Pods deleted and recreated under the same name within milliseconds (whereabouts hands
    /// the replacement the old address by podref), while every reservation delete is held.
    StatefulSetRecreate,
    /// A zone's nodes NotReady (their clocks an hour behind); pods deleted in both zones; the
    /// zone returns reporting a transition an hour ago.
    ZoneOutage,
    /// A zone NotReady; its StatefulSet pods force-deleted and their replacements created at
    /// once on the other zone (known to the controller before their sandboxes exist), the
    /// replacements' ADD 0.5-1.5 s later as scheduler and kubelet take; in half the trials the
    /// leader is killed right after the deletions (the replacements' ADD then waits for the new
    /// leader: a fence needs one). The old addresses must stay fenced, never handed to the
    /// replacements by podref.
    ZoneRecreate,
    /// 422 and 429 (Retry-After) on pool patches and reservation deletes, 5xx on reads, cut
    /// and slowed watches, during the deletions.
    WriteStorm,
    /// StatefulSet-style churn (same names, new sandboxes) with new pods coming meanwhile.
    ChurnWithAllocator,
    /// Live pods whose network-status lists their address only now and then.
    FlappingStatus,
    /// A zone cut off (Ready Unknown), its pods deleted and fenced; a second cleaner (whereabouts'
    /// ip-reconciler: one JSON patch pinned to the resourceVersion) frees some of the fenced
    /// entries while the zone is still down, and new pods come (and may get those addresses).
    /// ipreclaim must warn of each freed entry and of nothing else, and free no live address.
    SecondCleaner,
    /// Every reservation DELETE refused (503, 500, 429 with Retry-After) or slowed for 3-6 s
    /// while pods go, a third of them recreated under their names at once (StatefulSet style:
    /// the reservations left behind name a live pod). The sweep must find the failed deletes
    /// again: every leaked reservation freed within the bound after the fault.
    ReservationDeletesRefused,
    /// The leader's proxy partitions it right after it answered the leader's first pool patch
    /// of the deletions (`Action::CutAfter`): the entries are gone, their reservations' deletes
    /// never arrive. In half the trials the cut leader is then killed and a new replica starts;
    /// in the other half it stays cut until the new leader has freed everything, then returns
    /// with its held requests. The new leader must delete the reservations.
    LeaderLostBetweenPatchAndDelete,
    /// 100-200 tenant pods, Pending and never allocated, with forged network-status (each past
    /// one of the caps, or within them listing the first 256 addresses of the range: every
    /// allocated address, live or leaked) and 100 KiB of other annotations each, created while
    /// pods are deleted in small groups. Leaks freed within the bound, RSS under the limit.
    ForgedAnnotations,
    /// `ipreclaim release` (the CLI, through a proxy that slows its pool patches 0.3-1.2 s) run
    /// by an operator against each deleted pod's allocation (by `--pod`, `--ip`, or `--ip` with
    /// the `--sandbox` seen) while the pod is recreated under its name and allocated by the real
    /// CNI, and new pods come; in half the trials the controllers' pool patches and reservation
    /// deletes are held meanwhile (the operator frees what the controller cannot). No live
    /// pod's entry may be released.
    ManualRaces,
    /// A second cleaner (whereabouts' own reconciler, the telekom fork's operator) frees
    /// ipreclaim's fenced entries and their reservations with a write of its own while a zone is
    /// NotReady; new pods then get those addresses from the real CNI. When the zone returns and
    /// the fences lift, ipreclaim must release no address now held by a live pod. (Whether
    /// ipreclaim warns of each foreign write is [`Kind::SecondCleaner`]'s check.)
    ForeignCleaner,
}

impl Kind {
    fn parse(s: &str) -> Option<Kind> {
        KINDS
            .into_iter()
            .find(|k| format!("{k:?}").eq_ignore_ascii_case(s))
    }
}

/// A pod as the allocator made it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Alloc {
    name: String,
    uid: String,
    ip: Ipv4Addr,
    sandbox: String,
    node: String,
}

/// What the checker guards, shared with the trial.
#[derive(Default)]
struct Guard {
    /// Live allocations: address -> podref.
    live: BTreeMap<Ipv4Addr, String>,
    /// Fenced addresses: address -> (sandbox, guarded until).
    fenced: BTreeMap<Ipv4Addr, (String, Option<Instant>)>,
    /// When each live allocation's ADD began.
    began: BTreeMap<Ipv4Addr, Instant>,
    /// The fault proxies every ipreclaim process (controllers, CLI) talks through: their
    /// reservation deletes tell a reservation ipreclaim took from one whereabouts never made.
    ipreclaim: Vec<Arc<FaultProxy>>,
}

impl Guard {
    /// Whether an ipreclaim process deleted reservation `ip` (answered 2xx) after the ADD of
    /// its live allocation began (a delete still in flight counts from when it was sent).
    fn taken_by_ipreclaim(&self, ip: Ipv4Addr) -> bool {
        let Some(began) = self.began.get(&ip) else {
            return true;
        };
        let name = ip.to_string();
        self.ipreclaim.iter().flat_map(|p| p.writes()).any(|w| {
            w.verb == "delete"
                && w.resource == "overlappingrangeipreservations"
                && w.name.as_deref() == Some(name.as_str())
                && match w.answer {
                    Some((status, at)) => (200..300).contains(&status) && at >= *began,
                    None => true,
                }
        })
    }
}

type Shared<T> = Arc<Mutex<T>>;

struct Trial<'a> {
    cp: &'a ControlPlane,
    client: Client,
    ns: String,
    dir: PathBuf,
    cni: WhereaboutsCni,
    proxies: Vec<Arc<FaultProxy>>,
    controllers: Vec<Child>,
    nodes: Vec<String>,
    next_pod: usize,
    live: BTreeMap<String, Alloc>,
    /// Pods deleted without CNI DEL: their entries and reservations are leaks.
    dead: Vec<Alloc>,
    /// Forged (tenant) pods, deleted after the trial.
    forged: Vec<String>,
    guard: Shared<Guard>,
    violations: Shared<Vec<String>>,
}

impl Trial<'_> {
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn violation(&self, v: String) {
        self.violations.lock().unwrap().push(v);
    }

    /// Creates pod `name` on `node`, runs the CNI ADD for a new sandbox and writes the pod's
    /// network-status as Multus does.
    async fn allocate(&mut self, name: &str, node: &str) -> anyhow::Result<()> {
        let uid = self.create_pod(name, node).await?;
        self.attach(name, uid, node).await
    }

    /// Creates pod `name` bound to `node` (no sandbox yet): its uid.
    async fn create_pod(&self, name: &str, node: &str) -> anyhow::Result<String> {
        let mut pod = testenv::fixtures::pod(name, None);
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_name = Some(node.into());
            // Stand-in nodes stop a pod at once: its 1 s grace is within the settle.
            spec.termination_grace_period_seconds = Some(1);
        }
        let created = self.pods().create(&PostParams::default(), &pod).await?;
        Ok(created.metadata.uid.unwrap_or_default())
    }

    /// The runtime's part for created pod `name`: CNI ADD for a new sandbox, then Multus's
    /// network-status.
    async fn attach(&mut self, name: &str, uid: String, node: &str) -> anyhow::Result<()> {
        let sandbox = format!("sb-{uid}");
        let began = jiff::Timestamp::now();
        let began_at = Instant::now();
        let ip = self.cni.add(&self.ns, name, &sandbox).await?;
        let podref = format!("{}/{name}", self.ns);
        // When each ADD ran, to set beside the controllers' logs.
        let line = format!(
            "{began} {} ADD {podref} {sandbox} {ip}\n",
            jiff::Timestamp::now()
        );
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("allocator.log"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()))?;
        {
            let mut g = self.guard.lock().unwrap();
            if let Some(other) = g.live.get(&ip).filter(|p| **p != podref) {
                let v = format!("ADD gave {ip} to {podref} while live pod {other} holds it");
                drop(g);
                self.violation(v);
                g = self.guard.lock().unwrap();
            }
            if g.fenced.contains_key(&ip) {
                let v = format!("ADD gave fenced address {ip} to {podref}");
                drop(g);
                self.violation(v);
                g = self.guard.lock().unwrap();
            }
            g.live.insert(ip, podref);
            g.began.insert(ip, began_at);
        }
        self.set_status(name, ip).await?;
        self.live.insert(
            name.into(),
            Alloc {
                name: name.into(),
                uid,
                ip,
                sandbox,
                node: node.into(),
            },
        );
        Ok(())
    }

    async fn set_status(&self, name: &str, ip: Ipv4Addr) -> anyhow::Result<()> {
        let status = json!([{"name": format!("{}/net", self.ns), "interface": "net1", "ips": [ip.to_string()]}]);
        let patch = json!({"metadata": {"annotations": {
            NETWORK_STATUS_ANNOTATION: status.to_string()}}});
        self.pods()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// A new pod on the next node of `zone` (0 or 1), or any node.
    async fn add_pod(&mut self, zone: Option<usize>) -> anyhow::Result<String> {
        let i = self.next_pod;
        self.next_pod += 1;
        let node = match zone {
            Some(z) => self.nodes[z * ZONE_NODES + i % ZONE_NODES].clone(),
            None => self.nodes[i % self.nodes.len()].clone(),
        };
        let name = format!("p-{i}");
        self.allocate(&name, &node).await?;
        Ok(name)
    }

    /// Guards the addresses of live pods `names` as fenced (they are about to be deleted from
    /// a NotReady node), until their zone is back and settled.
    fn guard_fenced(&self, names: &[String]) {
        let mut g = self.guard.lock().unwrap();
        for n in names {
            let a = &self.live[n];
            g.fenced.insert(a.ip, (a.sandbox.clone(), None));
        }
    }

    /// Sets `zone` Ready again (its clock `lag` behind) and guards the fenced addresses until
    /// the settle has passed from now: when it happened.
    async fn zone_back(&self, zone: usize, lag: Duration) -> anyhow::Result<Instant> {
        self.set_zone(zone, true, lag).await?;
        let back = Instant::now();
        for (_, until) in self.guard.lock().unwrap().fenced.values_mut() {
            *until = Some(back + SETTLE);
        }
        Ok(back)
    }

    /// Stops guarding `names` (they are about to be deleted).
    fn unguard(&self, names: &[String]) {
        let mut g = self.guard.lock().unwrap();
        for n in names {
            if let Some(a) = self.live.get(n) {
                g.live.remove(&a.ip);
            }
        }
    }

    /// Deletes pods `names` at once (64 in flight), without CNI DEL.
    async fn delete(&mut self, names: &[String]) {
        self.unguard(names);
        delete_pods(self.pods(), names).await;
        self.bury(names);
    }

    fn bury(&mut self, names: &[String]) {
        for n in names {
            if let Some(a) = self.live.remove(n) {
                self.dead.push(a);
            }
        }
    }

    fn spawn_controller(&mut self) -> anyhow::Result<()> {
        let n = self.controllers.len();
        let proxy = self.proxies[n].clone();
        let kubeconfig = self.dir.join(format!("controller-{n}.kubeconfig"));
        self.cp
            .write_kubeconfig_through_faults(&proxy, &self.ns, &kubeconfig)?;
        let log = std::fs::File::create(self.dir.join(format!("controller-{n}.log")))?;
        // Another build (an older commit) or extra flags, to see what the suite finds there.
        let binary = ipreclaim_binary();
        let extra = std::env::var("CHAOS_CONTROLLER_ARGS").unwrap_or_default();
        let base = [
            "controller".to_string(),
            format!("--whereabouts-namespace={}", self.ns),
            format!("--lease-namespace={}", self.ns),
            "--leader-election=true".into(),
            format!("--lease-duration={}s", LEASE.as_secs()),
            format!("--sweep-interval={}s", SWEEP.as_secs()),
            format!("--leak-grace={}s", GRACE.as_secs()),
            format!("--missing-pod-grace={}s", GRACE.as_secs()),
            format!("--fence-settle={}s", SETTLE.as_secs()),
            "--fence-grace-margin=0s".into(),
            "--metrics-addr=127.0.0.1:0".into(),
        ];
        let flag = |a: &str| a.split('=').next().unwrap_or_default().to_string();
        let overridden: BTreeSet<String> = extra.split_whitespace().map(flag).collect();
        let child = Command::new(binary)
            .args(base.iter().filter(|a| !overridden.contains(&flag(a))))
            .args(extra.split_whitespace())
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info")
            .env("POD_NAME", format!("chaos-{n}"))
            // An env var, not a flag: an older build (CHAOS_IPRECLAIM) ignores it.
            .env("IPRECLAIM_OTHER_WRITER_WAIT", "1s")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.controllers.push(child);
        Ok(())
    }

    /// The index of the controller holding the Lease.
    async fn leader(&self) -> anyhow::Result<usize> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(i) = lease_holder(&self.client, &self.ns).await {
                return Ok(i);
            }
            anyhow::ensure!(Instant::now() < deadline, "no leader after 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until a replica other than `not` logs that it writes as leader (its gate is open):
    /// the index.
    async fn writing_leader(&self, not: Option<usize>) -> anyhow::Result<usize> {
        let deadline = Instant::now() + Duration::from_secs(60);
        // Another build may not log it: its Lease holder then, 2 s after it is seen.
        if std::env::var("CHAOS_IPRECLAIM").is_ok_and(|b| !b.is_empty()) {
            loop {
                if let Some(i) = lease_holder(&self.client, &self.ns).await
                    && Some(i) != not
                {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    return Ok(i);
                }
                anyhow::ensure!(Instant::now() < deadline, "no leader after 60 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        loop {
            for i in 0..self.controllers.len() {
                let log = std::fs::read_to_string(self.dir.join(format!("controller-{i}.log")))
                    .unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| l.contains("leading: this replica"));
                if Some(i) != not && last.is_some_and(|l| !l.contains("not leading")) {
                    return Ok(i);
                }
            }
            anyhow::ensure!(Instant::now() < deadline, "no replica writes after 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        self.controllers[i].kill()?;
        self.controllers[i].wait()?;
        Ok(())
    }

    /// Sets every node of `zone` Ready or not, as a node whose clock is `lag` behind reports it.
    async fn set_zone(&self, zone: usize, ready: bool, lag: Duration) -> anyhow::Result<()> {
        let nodes = &self.nodes[zone * ZONE_NODES..(zone + 1) * ZONE_NODES];
        for node in nodes {
            set_ready(&self.client, node, ready, lag).await?;
        }
        Ok(())
    }

    fn panicked(&self) -> bool {
        (0..self.controllers.len()).any(|n| {
            std::fs::read_to_string(self.dir.join(format!("controller-{n}.log")))
                .is_ok_and(|l| l.contains("panicked"))
        })
    }
}

/// The ipreclaim binary the trials run: this build's, or `CHAOS_IPRECLAIM`.
fn ipreclaim_binary() -> String {
    std::env::var("CHAOS_IPRECLAIM")
        .ok()
        .filter(|b| !b.is_empty())
        .unwrap_or(env!("CARGO_BIN_EXE_ipreclaim").into())
}

async fn lease_holder(client: &Client, ns: &str) -> Option<usize> {
    let lease = Api::<Lease>::namespaced(client.clone(), ns)
        .get_opt("ipreclaim-controller")
        .await
        .ok()
        .flatten()?;
    let holder = lease.spec?.holder_identity?;
    holder
        .strip_prefix("chaos-")
        .and_then(|r| r.split('_').next()?.parse().ok())
}

async fn set_ready(client: &Client, node: &str, ready: bool, lag: Duration) -> anyhow::Result<()> {
    let clock = jiff::Timestamp::now() - jiff::SignedDuration::try_from(lag)?;
    let at = clock.to_string();
    let status = if ready { "True" } else { "False" };
    let patch = testenv::fixtures::ready_condition(status, "SetByChaos", &at);
    Api::<Node>::all(client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

async fn delete_pods(pods: Api<Pod>, names: &[String]) {
    stream::iter(names.to_vec())
        .map(|n| {
            let pods = pods.clone();
            async move {
                // As a kubelet leaves a pod it stopped (phase Failed, then the delete): the
                // leaks here are CNI DELs that never ran. Deleted Running, a pod is fenced on
                // any node until its kubelet may have stopped it (see docs/concepts/promise.md).
                let failed = Patch::Merge(json!({"status": {"phase": "Failed"}}));
                let _ = pods
                    .patch_status(&n, &PatchParams::default(), &failed)
                    .await;
                let _ = pods
                    .delete(&n, &DeleteParams::default().grace_period(0))
                    .await;
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
}

/// Entries by address: (sandbox id, podref).
async fn entries(
    client: &Client,
    ns: &str,
) -> anyhow::Result<BTreeMap<Ipv4Addr, (String, String)>> {
    let pool = Api::<IPPool>::namespaced(client.clone(), ns)
        .get(POOL)
        .await?;
    let base = u32::from(Ipv4Addr::new(10, 64, 0, 0));
    Ok(pool
        .spec
        .allocations
        .into_iter()
        .filter_map(|(k, a)| {
            let offset: u32 = k.parse().ok()?;
            Some((Ipv4Addr::from(base + offset), (a.id, a.podref)))
        })
        .collect())
}

/// Reservations by address: podref.
async fn reservations(client: &Client, ns: &str) -> anyhow::Result<BTreeMap<Ipv4Addr, String>> {
    let list = Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|r| Some((r.metadata.name?.parse().ok()?, r.spec.podref)))
        .collect())
}

/// Checks the guard against the pool and the reservations every 100 ms.
fn spawn_checker(
    client: Client,
    ns: String,
    guard: Shared<Guard>,
    violations: Shared<Vec<String>>,
    gap_stats: Shared<(usize, Duration)>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Live reservations seen missing, since when.
        let mut gaps: BTreeMap<(Ipv4Addr, String), (Instant, jiff::Timestamp)> = BTreeMap::new();
        loop {
            // Read the guard first: what is added after the read is not judged yet.
            let (live, fenced) = {
                let g = guard.lock().unwrap();
                (g.live.clone(), g.fenced.clone())
            };
            let read = async {
                let e = entries(&client, &ns).await.ok()?;
                let r = reservations(&client, &ns).await.ok()?;
                Some((e, r))
            };
            if let Some((entries, reserved)) = read.await {
                let read_at = Instant::now();
                let g = guard.lock().unwrap();
                let mut found = Vec::new();
                for (ip, podref) in &live {
                    if g.live.get(ip) != Some(podref) {
                        continue;
                    }
                    if entries.get(ip).is_none_or(|(_, p)| p != podref) {
                        found.push(format!("live {podref}'s entry {ip} freed"));
                    }
                    let key = (*ip, podref.clone());
                    if reserved.get(ip) == Some(podref) {
                        if let Some((since, _)) = gaps.remove(&key) {
                            let mut s = gap_stats.lock().unwrap();
                            s.0 += 1;
                            s.1 = s.1.max(read_at - since);
                        }
                    } else {
                        let (since, at) =
                            *gaps.entry(key).or_insert((read_at, jiff::Timestamp::now()));
                        let (bound, by) = if g.taken_by_ipreclaim(*ip) {
                            (RESERVATION_GAP, "deleted by ipreclaim")
                        } else {
                            (UNMADE_RESERVATION_GAP, "never made by whereabouts")
                        };
                        if read_at - since > bound {
                            found.push(format!(
                                "live {podref}'s reservation {ip} ({by}) missing for more than {bound:?} (seen missing from {at})"
                            ));
                        }
                    }
                }
                for (ip, (sandbox, until)) in &fenced {
                    let guarded = g.fenced.contains_key(ip) && until.is_none_or(|u| read_at < u);
                    if !guarded {
                        continue;
                    }
                    if entries.get(ip).is_none_or(|(id, _)| id != sandbox) {
                        found.push(format!("fenced entry {ip} ({sandbox}) freed too early"));
                    }
                    if !reserved.contains_key(ip) {
                        found.push(format!(
                            "fenced address {ip}'s reservation deleted too early"
                        ));
                    }
                }
                drop(g);
                violations.lock().unwrap().extend(found);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Samples the Lease holder every 100 ms.
fn spawn_lease_sampler(
    client: Client,
    ns: String,
    samples: Shared<Vec<(Instant, Option<usize>)>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let holder = lease_holder(&client, &ns).await;
            samples.lock().unwrap().push((Instant::now(), holder));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Samples the controllers' RSS every 500 ms; keeps the largest per replica.
fn spawn_rss_sampler(pids: Shared<Vec<u32>>, peak: Shared<u64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            for pid in pids.lock().unwrap().clone() {
                let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    .ok()
                    .and_then(|s| {
                        let line = s.lines().find(|l| l.starts_with("VmRSS:"))?.to_string();
                        line.split_whitespace().nth(1)?.parse::<u64>().ok()
                    })
                    .unwrap_or(0);
                let mut p = peak.lock().unwrap();
                *p = (*p).max(rss / 1024);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

/// Pool patches and reservation deletes a replica sent while the other held the Lease for the
/// whole second around it.
fn writes_without_lease(
    proxies: &[Arc<FaultProxy>],
    samples: &[(Instant, Option<usize>)],
) -> Vec<String> {
    let mut found = Vec::new();
    for (i, proxy) in proxies.iter().enumerate() {
        for w in proxy.writes() {
            let guarded = (w.verb == "patch" && w.resource == "ippools")
                || (w.verb == "delete" && w.resource == "overlappingrangeipreservations");
            if !guarded {
                continue;
            }
            let around: Vec<Option<usize>> = samples
                .iter()
                .filter(|(t, _)| {
                    *t + Duration::from_secs(1) >= w.entered
                        && *t <= w.entered + Duration::from_secs(1)
                })
                .map(|(_, h)| *h)
                .collect();
            if around.len() >= 5 && around.iter().all(|h| h.is_some_and(|h| h != i)) {
                found.push(format!(
                    "replica {i} sent {} {} while the other held the Lease",
                    w.verb, w.resource
                ));
            }
        }
    }
    found
}

struct Outcome {
    details: String,
    gaps: (usize, Duration),
    pods: usize,
    deleted: usize,
    fenced: usize,
    freed_in: Duration,
    bound: Duration,
    rss_mib: u64,
    faults: u64,
    violations: Vec<String>,
}

/// Dead allocations still held (entry of its sandbox or reservation naming it), live ones
/// excepted (a replacement may hold the same address by podref).
fn leaks_left(
    t: &Trial<'_>,
    entries: &BTreeMap<Ipv4Addr, (String, String)>,
    reserved: &BTreeMap<Ipv4Addr, String>,
) -> usize {
    let live: BTreeSet<Ipv4Addr> = t.live.values().map(|a| a.ip).collect();
    t.dead
        .iter()
        .filter(|a| !live.contains(&a.ip))
        .filter(|a| {
            let podref = format!("{}/{}", t.ns, a.name);
            entries.get(&a.ip).is_some_and(|(id, _)| *id == a.sandbox)
                || reserved.get(&a.ip) == Some(&podref)
        })
        .count()
}

/// Waits until every leak is freed, at most `bound` (+30 s to report how late).
async fn wait_freed(t: &Trial<'_>, since: Instant, bound: Duration) -> anyhow::Result<Duration> {
    let deadline = since + bound + Duration::from_secs(30);
    loop {
        let e = entries(&t.client, &t.ns).await?;
        let r = reservations(&t.client, &t.ns).await?;
        let left = leaks_left(t, &e, &r);
        if left == 0 {
            return Ok(since.elapsed());
        }
        if Instant::now() > deadline {
            t.violation(format!("{left} dead pods' addresses still allocated"));
            return Ok(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The other cleaner: once the fences of `fenced` are written, removes `k` of those entries in
/// one JSON patch pinned to the pool's resourceVersion (as whereabouts' reconciler writes), and
/// stops guarding them. Returns their addresses.
async fn second_cleaner(
    t: &Trial<'_>,
    fenced: &[Alloc],
    k: usize,
) -> anyhow::Result<BTreeSet<Ipv4Addr>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let fenced_now = |e: &BTreeMap<Ipv4Addr, (String, String)>| {
        fenced.iter().all(|a| {
            e.get(&a.ip)
                .is_some_and(|(id, p)| *id == a.sandbox && p.ends_with(":fenced"))
        })
    };
    while !fenced_now(&entries(&t.client, &t.ns).await?) {
        anyhow::ensure!(Instant::now() < deadline, "the fences were not written");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let chosen = &fenced[..k.min(fenced.len())];
    {
        let mut g = t.guard.lock().unwrap();
        for a in chosen {
            g.fenced.remove(&a.ip);
        }
    }
    let base = u32::from(Ipv4Addr::new(10, 64, 0, 0));
    let pools = Api::<IPPool>::namespaced(t.client.clone(), &t.ns);
    for _ in 0..50 {
        let rv = pools.get(POOL).await?.metadata.resource_version;
        let mut ops = vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv})];
        for a in chosen {
            let key = u32::from(a.ip) - base;
            ops.push(json!({"op": "remove", "path": format!("/spec/allocations/{key}")}));
        }
        let patch: json_patch::Patch = serde_json::from_value(json!(ops))?;
        match pools
            .patch(POOL, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => return Ok(chosen.iter().map(|a| a.ip).collect()),
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("the other cleaner's patch kept conflicting")
}

/// What is wrong with the Warnings `MarkedEntryRemovedByOtherWriter` on the pool: each address
/// the other cleaner freed has one, and no other address has.
async fn other_writer_warnings(
    t: &Trial<'_>,
    cleaned: &BTreeSet<Ipv4Addr>,
) -> anyhow::Result<Vec<String>> {
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(t.client.clone(), &t.ns)
        .list(&kube::api::ListParams::default().fields("reason=MarkedEntryRemovedByOtherWriter"))
        .await?
        .items;
    let warned: BTreeSet<Ipv4Addr> = events
        .iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(POOL))
        .filter_map(|e| {
            let m = e.message.as_deref()?;
            m.split(" (").nth(1)?.split(',').next()?.parse().ok()
        })
        .collect();
    let mut found: Vec<String> = cleaned
        .difference(&warned)
        .map(|ip| format!("the other cleaner freed fenced {ip}: not warned"))
        .collect();
    found.extend(
        warned
            .difference(cleaned)
            .map(|ip| format!("warned of {ip}, which no other writer removed")),
    );
    Ok(found)
}

/// Writes the trial's Events next to the controllers' logs (the control plane goes with the
/// run).
async fn dump_events(t: &Trial<'_>) {
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(t.client.clone(), &t.ns)
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    let lines: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "{} {} {} {}",
                e.last_timestamp
                    .as_ref()
                    .map(|t| t.0.to_string())
                    .unwrap_or_default(),
                e.reason.as_deref().unwrap_or_default(),
                e.involved_object.name.as_deref().unwrap_or_default(),
                e.message.as_deref().unwrap_or_default()
            )
        })
        .collect();
    let _ = std::fs::write(t.dir.join("events.txt"), lines.join("\n"));
}

fn pick(rng: &mut StdRng, names: &[String], k: usize) -> Vec<String> {
    let mut names = names.to_vec();
    let mut picked = Vec::new();
    for _ in 0..k.min(names.len()) {
        picked.push(names.swap_remove(rng.random_range(0..names.len())));
    }
    picked
}

async fn setup(cp: &ControlPlane, seed: u64) -> anyhow::Result<Trial<'_>> {
    let client = cp.client().await;
    let ns = cp.namespace(&client, "chaos").await;
    let dir = cp.dir().join(format!("chaos-{ns}"));
    std::fs::create_dir_all(&dir)?;
    let cni = WhereaboutsCni::new(cp, &ns, &dir, RANGE)?;
    let nad = NetworkAttachmentDefinition::new(
        "net",
        NetworkAttachmentDefinitionSpec {
            config: Some(cni.netconf().to_string()),
        },
    );
    Api::<NetworkAttachmentDefinition>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &nad)
        .await?;
    let mut nodes = Vec::new();
    for zone in ["a", "b"] {
        for i in 0..ZONE_NODES {
            let name = format!("{ns}-{zone}{i}");
            let node = Node {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(
                        [("topology.kubernetes.io/zone".to_string(), zone.to_string())].into(),
                    ),
                    ..Default::default()
                },
                ..Default::default()
            };
            Api::<Node>::all(client.clone())
                .create(&PostParams::default(), &node)
                .await?;
            set_ready(&client, &name, true, Duration::ZERO).await?;
            nodes.push(name);
        }
    }
    let mut proxies = Vec::new();
    for i in 0..3 {
        proxies.push(Arc::new(FaultProxy::start(client.clone(), seed ^ i).await?));
    }
    let guard = Arc::new(Mutex::new(Guard {
        ipreclaim: proxies.clone(),
        ..Guard::default()
    }));
    Ok(Trial {
        cp,
        client,
        ns,
        dir,
        cni,
        proxies,
        controllers: Vec::new(),
        nodes,
        next_pod: 0,
        live: BTreeMap::new(),
        dead: Vec::new(),
        forged: Vec::new(),
        guard,
        violations: Arc::default(),
    })
}

async fn run_trial(cp: &ControlPlane, kind: Kind, seed: u64) -> anyhow::Result<Outcome> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = setup(cp, seed).await?;
    let n = rng.random_range(40..=80);
    for _ in 0..n {
        t.add_pod(None).await?;
    }
    t.spawn_controller()?;
    t.spawn_controller()?;
    // Faults start from a steady state: a leader that writes.
    t.writing_leader(None).await?;
    let pids: Shared<Vec<u32>> =
        Arc::new(Mutex::new(t.controllers.iter().map(|c| c.id()).collect()));
    let peak: Shared<u64> = Arc::default();
    let samples: Shared<Vec<(Instant, Option<usize>)>> = Arc::default();
    let gap_stats: Shared<(usize, Duration)> = Arc::default();
    let tasks = [
        spawn_checker(
            t.client.clone(),
            t.ns.clone(),
            t.guard.clone(),
            t.violations.clone(),
            gap_stats.clone(),
        ),
        spawn_lease_sampler(t.client.clone(), t.ns.clone(), samples.clone()),
        spawn_rss_sampler(pids.clone(), peak.clone()),
    ];
    // Below the breaker's half of the pool: deletions seen by no replica go through the sweep.
    let names: Vec<String> = t.live.keys().cloned().collect();
    let victims = pick(&mut rng, &names, names.len() / 3);
    let mut bound = SWEEP + GRACE + SLACK;
    let mut details = String::new();
    let mut cleaned: Option<BTreeSet<Ipv4Addr>> = None;
    let mut heal_after = None;
    let fault_end = match kind {
        Kind::KillMidBatch => {
            t.unguard(&victims);
            let delay = Duration::from_millis(rng.random_range(0..400));
            let leader = t.leader().await?;
            let deleting = delete_pods(t.pods(), &victims);
            let controller = &mut t.controllers[leader];
            let killing = async {
                tokio::time::sleep(delay).await;
                controller.kill()
            };
            let ((), killed) = tokio::join!(deleting, killing);
            killed?;
            t.controllers[leader].wait()?;
            t.bury(&victims);
            t.spawn_controller()?;
            bound += TAKEOVER;
            Instant::now()
        }
        Kind::ApiserverAndEtcdRestart => {
            let (first, second) = victims.split_at(victims.len() / 2);
            t.delete(first).await;
            cp.restart_apiserver().await?;
            t.delete(second).await;
            cp.restart_etcd().await?;
            // The Lease may lapse while the apiserver is away.
            bound += TAKEOVER;
            Instant::now()
        }
        Kind::LeaderKill => {
            let leader = t.leader().await?;
            t.kill(leader).await?;
            t.delete(&victims).await;
            t.spawn_controller()?;
            bound += TAKEOVER;
            Instant::now()
        }
        Kind::LeaderPartition => {
            // Cut while the leader has deletions in hand: what it still sends must not arrive
            // after the standby took over.
            let leader = t.leader().await?;
            t.unguard(&victims);
            let delay = Duration::from_millis(rng.random_range(0..300));
            let proxy = t.proxies[leader].clone();
            // Half the trials cut only the Lease: its renewals fail while its writes still go.
            let leases_only = rng.random_bool(0.5);
            let cutting = async {
                tokio::time::sleep(delay).await;
                if leases_only {
                    proxy.set_rules(vec![Rule::new(None, Some("leases"), Action::Hold)]);
                } else {
                    proxy.cut();
                }
            };
            tokio::join!(delete_pods(t.pods(), &victims), cutting);
            t.bury(&victims);
            let deadline = Instant::now() + Duration::from_secs(60);
            while t.leader().await? == leader {
                anyhow::ensure!(Instant::now() < deadline, "the standby never took over");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // The standby leads while the old leader is still cut off; more pods go (an old
            // leader that still sees them must not write); then it returns.
            let rest: Vec<String> = t.live.keys().cloned().collect();
            let more = pick(&mut rng, &rest, rest.len() / 4);
            t.delete(&more).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(1000..4000))).await;
            t.proxies[leader].heal();
            t.proxies[leader].clear();
            details = if leases_only { "Lease cut" } else { "all cut" }.into();
            Instant::now()
        }
        Kind::StatefulSetRecreate => {
            for p in &t.proxies {
                p.set_rules(vec![Rule::new(
                    Some("delete"),
                    Some("overlappingrangeipreservations"),
                    Action::Hold,
                )]);
            }
            let (recreated, gone) = victims.split_at(victims.len() * 2 / 3);
            t.delete(gone).await;
            for name in recreated {
                let node = t.live[name].node.clone();
                t.delete(std::slice::from_ref(name)).await;
                t.allocate(name, &node).await?;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
            for p in &t.proxies {
                p.clear();
            }
            Instant::now()
        }
        Kind::ZoneOutage => {
            let lag = Duration::from_secs(3600);
            t.set_zone(0, false, lag).await?;
            // The controller sees the zone down before the deletions (as kube-controller-manager
            // marks nodes NotReady ~40 s before an operator force-deletes their pods).
            tokio::time::sleep(Duration::from_secs(1)).await;
            let zone_a: BTreeSet<String> = t.nodes[..ZONE_NODES].iter().cloned().collect();
            let (in_a, in_b): (Vec<String>, Vec<String>) = victims
                .iter()
                .cloned()
                .partition(|n| zone_a.contains(&t.live[n].node));
            t.guard_fenced(&in_a);
            t.delete(&in_a).await;
            t.delete(&in_b).await;
            for _ in 0..5 {
                t.add_pod(Some(1)).await?;
            }
            // Zone b's leaks are freed while zone a is down.
            let dead_b: Vec<Alloc> = t
                .dead
                .iter()
                .filter(|a| !zone_a.contains(&a.node))
                .cloned()
                .collect();
            let all_dead = std::mem::replace(&mut t.dead, dead_b);
            wait_freed(&t, Instant::now(), SWEEP + GRACE + SLACK).await?;
            t.dead = all_dead;
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
            bound = SETTLE + SLACK;
            t.zone_back(0, lag).await?
        }
        Kind::ZoneRecreate => {
            let lag = Duration::from_secs(3600);
            t.set_zone(0, false, lag).await?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let zone_a: BTreeSet<String> = t.nodes[..ZONE_NODES].iter().cloned().collect();
            let in_a: Vec<String> = victims
                .iter()
                .filter(|n| zone_a.contains(&t.live[*n].node))
                .cloned()
                .collect();
            t.guard_fenced(&in_a);
            let kill = rng.random_bool(0.5);
            let leader = t.leader().await?;
            let mut replacements = Vec::new();
            for (i, name) in in_a.iter().enumerate() {
                t.delete(std::slice::from_ref(name)).await;
                let node = t.nodes[ZONE_NODES + i % ZONE_NODES].clone();
                let uid = t.create_pod(name, &node).await?;
                replacements.push((name.clone(), uid, node));
            }
            if kill {
                tokio::time::sleep(Duration::from_millis(rng.random_range(50..300))).await;
                t.kill(leader).await?;
                t.spawn_controller()?;
                // A fence needs a leader that writes (docs/concepts/fencing.md): the
                // replacements' sandboxes come once one does, plus the time a fence takes.
                t.writing_leader(Some(leader)).await?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                details = "leader killed".into();
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
            for (name, uid, node) in replacements {
                t.attach(&name, uid, &node).await?;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
            bound = SETTLE + SLACK;
            t.zone_back(0, lag).await?
        }
        Kind::WriteStorm => {
            let storm = vec![
                Rule::new(Some("patch"), Some("ippools"), Action::Status(422)).sometimes(0.3),
                Rule::new(Some("patch"), Some("ippools"), Action::Status(429)).sometimes(0.3),
                Rule::new(
                    Some("delete"),
                    Some("overlappingrangeipreservations"),
                    Action::Status(429),
                )
                .sometimes(0.3),
                Rule::new(Some("get"), None, Action::Status(503)).sometimes(0.1),
                Rule::new(Some("list"), None, Action::Status(500)).sometimes(0.1),
                Rule::new(
                    Some("watch"),
                    Some("pods"),
                    Action::DelayEvents(Duration::from_millis(200)),
                ),
            ];
            for p in &t.proxies {
                p.set_rules(storm.clone());
            }
            let (first, second) = victims.split_at(victims.len() / 2);
            t.delete(first).await;
            for p in &t.proxies {
                p.cut_watches();
            }
            t.delete(second).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(2000..5000))).await;
            for p in &t.proxies {
                p.clear();
            }
            // A 429 pauses every write for its Retry-After.
            bound += Duration::from_secs(2);
            Instant::now()
        }
        Kind::ChurnWithAllocator => {
            for name in &victims {
                let node = t.live[name].node.clone();
                t.delete(std::slice::from_ref(name)).await;
                t.allocate(name, &node).await?;
                t.add_pod(None).await?;
            }
            Instant::now()
        }
        Kind::SecondCleaner => {
            let lag = Duration::from_secs(3600);
            // Cut off: its kubelets are not heard from (Ready Unknown), so no CNI DEL runs there.
            let at = (jiff::Timestamp::now() - jiff::SignedDuration::try_from(lag)?).to_string();
            for node in &t.nodes[..ZONE_NODES] {
                let patch = testenv::fixtures::ready_condition("Unknown", "NodeStatusUnknown", &at);
                Api::<Node>::all(t.client.clone())
                    .patch_status(node, &PatchParams::default(), &Patch::Merge(patch))
                    .await?;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let zone_a: BTreeSet<String> = t.nodes[..ZONE_NODES].iter().cloned().collect();
            let (in_a, in_b): (Vec<String>, Vec<String>) = victims
                .iter()
                .cloned()
                .partition(|n| zone_a.contains(&t.live[n].node));
            let fenced: Vec<Alloc> = in_a.iter().map(|n| t.live[n].clone()).collect();
            t.guard_fenced(&in_a);
            t.delete(&in_a).await;
            t.delete(&in_b).await;
            let k = rng.random_range(1..=fenced.len().max(1));
            let freed = second_cleaner(&t, &fenced, k).await?;
            details = format!(
                "{} of {} fences freed by the other cleaner",
                freed.len(),
                fenced.len()
            );
            cleaned = Some(freed);
            for _ in 0..5 {
                t.add_pod(Some(1)).await?;
            }
            // Past --other-writer-wait (1 s) and a pass: the zone is still silent then.
            tokio::time::sleep(Duration::from_millis(rng.random_range(3000..5000))).await;
            bound = SETTLE + SLACK;
            t.zone_back(0, lag).await?
        }
        Kind::FlappingStatus => {
            let flappers: Vec<Alloc> = t
                .live
                .values()
                .filter(|a| !victims.contains(&a.name))
                .take(10)
                .cloned()
                .collect();
            t.unguard(&victims);
            let deleting = delete_pods(t.pods(), &victims);
            let (pods, ns) = (t.pods(), t.ns.clone());
            let flapping = async {
                for step in 0..20 {
                    for f in &flappers {
                        let ip = if step % 3 == 0 {
                            f.ip.to_string()
                        } else {
                            "10.99.0.1".into()
                        };
                        let status = json!([{"name": format!("{ns}/net"), "interface": "net1", "ips": [ip]}]);
                        let patch = json!({"metadata": {"annotations": {
                            NETWORK_STATUS_ANNOTATION: status.to_string()}}});
                        let _ = pods
                            .patch(&f.name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            };
            tokio::join!(deleting, flapping);
            t.bury(&victims);
            for f in &flappers {
                t.set_status(&f.name, f.ip).await?;
            }
            Instant::now()
        }
        Kind::ReservationDeletesRefused
        | Kind::LeaderLostBetweenPatchAndDelete
        | Kind::ForgedAnnotations
        | Kind::ManualRaces
        | Kind::ForeignCleaner => {
            let fault = match kind {
                Kind::ReservationDeletesRefused => {
                    reservation_deletes_refused(&mut t, &mut rng, &victims).await?
                }
                Kind::LeaderLostBetweenPatchAndDelete => {
                    leader_lost_between_patch_and_delete(&mut t, &mut rng, &victims).await?
                }
                Kind::ForgedAnnotations => forged_annotations(&mut t, &mut rng, &victims).await?,
                Kind::ManualRaces => manual_races(&mut t, &mut rng, &victims, seed).await?,
                _ => foreign_cleaner(&mut t, &mut rng, &victims).await?,
            };
            bound = fault.bound;
            details = fault.details;
            heal_after = fault.heal_after;
            fault.end
        }
    };
    *pids.lock().unwrap() = t.controllers.iter().map(|c| c.id()).collect();
    let freed_in = wait_freed(&t, fault_end, bound).await?;
    // A replica kept cut until the leaks were freed returns, with what it holds.
    if let Some(i) = heal_after {
        t.proxies[i].clear();
        t.proxies[i].heal();
    }
    // One more look with everything settled.
    tokio::time::sleep(SWEEP * 2).await;
    for task in &tasks {
        task.abort();
    }
    let mut violations = t.violations.lock().unwrap().clone();
    violations.extend(writes_without_lease(&t.proxies, &samples.lock().unwrap()));
    if let Some(cleaned) = &cleaned {
        violations.extend(other_writer_warnings(&t, cleaned).await?);
    }
    // Every live allocation ends with its reservation (one whereabouts never made comes
    // within its bound).
    let live_reserved = |reserved: &BTreeMap<Ipv4Addr, String>| {
        t.live
            .values()
            .all(|a| reserved.get(&a.ip) == Some(&format!("{}/{}", t.ns, a.name)))
    };
    let until = Instant::now() + UNMADE_RESERVATION_GAP;
    let mut reserved = reservations(&t.client, &t.ns).await?;
    while !live_reserved(&reserved) && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        reserved = reservations(&t.client, &t.ns).await?;
    }
    for a in t.live.values() {
        let podref = format!("{}/{}", t.ns, a.name);
        if reserved.get(&a.ip) != Some(&podref) {
            violations.push(format!(
                "live {podref}'s reservation {} missing at the end",
                a.ip
            ));
        }
    }
    // The checker finds a lasting violation on every look: report each once.
    let mut seen = BTreeSet::new();
    violations.retain(|v| seen.insert(v.clone()));
    if freed_in > bound {
        violations.push(format!(
            "dead pods freed {:.1}s after the fault, bound {:.1}s",
            freed_in.as_secs_f64(),
            bound.as_secs_f64()
        ));
    }
    let rss_mib = *peak.lock().unwrap();
    if rss_mib > RSS_LIMIT_MIB {
        violations.push(format!("a replica's RSS reached {rss_mib} MiB"));
    }
    if t.panicked() {
        violations.push(format!(
            "a controller panicked (logs in {})",
            t.dir.display()
        ));
    }
    for c in &mut t.controllers {
        let _ = c.kill();
        let _ = c.wait();
    }
    // The trial's pods go with it: the next trial's namespace has a network over the same
    // range (a pool of the same name), and its pods would list these addresses too (the
    // manual commands refuse an address a live pod of any such network lists). Forged pods
    // are large besides: later trials' controllers would list them all.
    let mut left: Vec<String> = t.live.keys().cloned().collect();
    left.extend(t.forged.iter().cloned());
    delete_pods(t.pods(), &left).await;
    let faults = t
        .proxies
        .iter()
        .flat_map(|p| p.injected().into_values())
        .sum();
    let fenced = t.guard.lock().unwrap().fenced.len();
    dump_events(&t).await;
    let gaps = *gap_stats.lock().unwrap();
    Ok(Outcome {
        details,
        gaps,
        pods: t.next_pod,
        deleted: t.dead.len(),
        fenced,
        freed_in,
        bound,
        rss_mib,
        faults,
        violations,
    })
}

/// How a fault of the later kinds ended: when, the bound for the leaks from then, what to print,
/// and a replica kept cut until the leaks are freed.
struct Fault {
    end: Instant,
    bound: Duration,
    details: String,
    heal_after: Option<usize>,
}

const RESERVATIONS: &str = "overlappingrangeipreservations";

/// [`Kind::ReservationDeletesRefused`].
async fn reservation_deletes_refused(
    t: &mut Trial<'_>,
    rng: &mut StdRng,
    victims: &[String],
) -> anyhow::Result<Fault> {
    let delete = Some("delete");
    let refused = vec![
        Rule::new(
            delete,
            Some(RESERVATIONS),
            Action::Delay(Duration::from_secs(2)),
        )
        .sometimes(0.15),
        Rule::new(delete, Some(RESERVATIONS), Action::Status(429)).sometimes(0.3),
        Rule::new(delete, Some(RESERVATIONS), Action::Status(503)).sometimes(0.5),
        Rule::new(delete, Some(RESERVATIONS), Action::Status(500)),
    ];
    for p in &t.proxies {
        p.set_rules(refused.clone());
    }
    let (recreated, gone) = victims.split_at(victims.len() / 3);
    t.delete(gone).await;
    for name in recreated {
        let node = t.live[name].node.clone();
        t.delete(std::slice::from_ref(name)).await;
        // The next pod of the name comes before the controller released the old entry (it
        // gets it back by podref) or after (a reservation left behind for a live name).
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
        t.allocate(name, &node).await?;
    }
    tokio::time::sleep(Duration::from_millis(rng.random_range(3000..6000))).await;
    for p in &t.proxies {
        p.clear();
    }
    let refusals: u64 = t
        .proxies
        .iter()
        .flat_map(|p| p.injected())
        .filter(|(k, _)| k.ends_with(&format!("delete {RESERVATIONS}")))
        .map(|(_, n)| n)
        .sum();
    Ok(Fault {
        end: Instant::now(),
        // A 429 pauses every write for its Retry-After.
        bound: SWEEP + GRACE + SLACK + Duration::from_secs(2),
        details: format!(
            "{refusals} deletes refused or slowed, {} recreated",
            recreated.len()
        ),
        heal_after: None,
    })
}

/// [`Kind::LeaderLostBetweenPatchAndDelete`].
async fn leader_lost_between_patch_and_delete(
    t: &mut Trial<'_>,
    rng: &mut StdRng,
    victims: &[String],
) -> anyhow::Result<Fault> {
    let leader = t.leader().await?;
    let proxy = t.proxies[leader].clone();
    proxy.set_rules(vec![Rule::new(
        Some("patch"),
        Some("ippools"),
        Action::CutAfter,
    )]);
    t.delete(victims).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !proxy.is_cut() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the leader sent no pool patch within 30 s of the deletions"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cut = Instant::now();
    proxy.set_rules(Vec::new());
    // What the cut leader deleted before its patch: the deletes it sends now never arrive.
    let deleted_before = proxy
        .writes()
        .iter()
        .filter(|w| w.verb == "delete" && w.resource == RESERVATIONS)
        .count();
    let kill = rng.random_bool(0.5);
    if kill {
        t.kill(leader).await?;
        t.spawn_controller()?;
    }
    Ok(Fault {
        end: cut,
        bound: TAKEOVER + SWEEP + GRACE + SLACK,
        details: format!(
            "cut after its pool patch ({deleted_before} reservation deletes before), {}",
            if kill {
                "then killed"
            } else {
                "healed once freed"
            }
        ),
        heal_after: (!kill).then_some(leader),
    })
}

/// [`Kind::ForgedAnnotations`].
async fn forged_annotations(
    t: &mut Trial<'_>,
    rng: &mut StdRng,
    victims: &[String],
) -> anyhow::Result<Fault> {
    let n = rng.random_range(100..=200);
    let network = format!("{}/net", t.ns);
    let base = u32::from(Ipv4Addr::new(10, 64, 0, 0));
    // The first 256 addresses of the range: every allocated one, live or leaked.
    let shared = |k: usize| Ipv4Addr::from(base + k as u32).to_string();
    let kinds = testenv::fixtures::FORGED_KINDS;
    let statuses: Vec<String> = kinds
        .iter()
        .map(|k| testenv::fixtures::forged_network_status(k, &network, shared))
        .collect();
    let names: Vec<String> = (0..n)
        .map(|i| format!("forged-{}-{i}", kinds[i % kinds.len()]))
        .collect();
    t.forged.extend(names.iter().cloned());
    let pods = t.pods();
    let forging = stream::iter(names.iter().enumerate())
        .map(|(i, name)| {
            let pod = testenv::fixtures::forged_pod(
                name,
                NETWORK_STATUS_ANNOTATION,
                statuses[i % kinds.len()].clone(),
            );
            let pods = pods.clone();
            async move { pods.create(&PostParams::default(), &pod).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>();
    let groups: Vec<(Vec<String>, Duration)> = victims
        .chunks(4)
        .map(|g| {
            (
                g.to_vec(),
                Duration::from_millis(rng.random_range(100..600)),
            )
        })
        .collect();
    let deleting = async {
        for (group, pause) in &groups {
            t.delete(group).await;
            tokio::time::sleep(*pause).await;
        }
    };
    let (created, ()) = tokio::join!(forging, deleting);
    let refused = created.iter().filter(|c| c.is_err()).count();
    anyhow::ensure!(refused == 0, "{refused} of {n} forged pods not created");
    Ok(Fault {
        end: Instant::now(),
        bound: SWEEP + GRACE + SLACK,
        details: format!("{n} forged pods"),
        heal_after: None,
    })
}

/// `ipreclaim release <args>` as an operator runs it, with `kubeconfig`: its exit code and
/// what it printed.
async fn run_release(
    kubeconfig: PathBuf,
    ns: String,
    args: Vec<String>,
) -> anyhow::Result<(i32, String)> {
    tokio::task::spawn_blocking(move || {
        // Extra flags (`--force`), to see what the suite finds with them.
        let extra = std::env::var("CHAOS_RELEASE_ARGS").unwrap_or_default();
        let out = Command::new(ipreclaim_binary())
            .arg("release")
            .args(&args)
            .args(extra.split_whitespace())
            .args(["--whereabouts-namespace", &ns, "--kubeconfig"])
            .arg(&kubeconfig)
            .env_remove("KUBECONFIG")
            .output()?;
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.code().unwrap_or(-1), said))
    })
    .await?
}

/// [`Kind::ManualRaces`].
async fn manual_races(
    t: &mut Trial<'_>,
    rng: &mut StdRng,
    victims: &[String],
    seed: u64,
) -> anyhow::Result<Fault> {
    // The operator's own path to the apiserver, whose pool patches are slow: the window between
    // the command's last read of the pod and its write is wide.
    let operator = Arc::new(FaultProxy::start(t.client.clone(), seed ^ 0x0b5).await?);
    t.guard.lock().unwrap().ipreclaim.push(operator.clone());
    operator.set_rules(vec![
        Rule::new(
            Some("patch"),
            Some("ippools"),
            Action::Delay(Duration::from_millis(1200)),
        )
        .sometimes(0.5),
        Rule::new(
            Some("patch"),
            Some("ippools"),
            Action::Delay(Duration::from_millis(300)),
        ),
    ]);
    let kubeconfig = t.dir.join("operator.kubeconfig");
    t.cp.write_kubeconfig_through_faults(&operator, &t.ns, &kubeconfig)?;
    let held = rng.random_bool(0.5);
    if held {
        for p in &t.proxies {
            p.set_rules(vec![
                Rule::new(Some("patch"), Some("ippools"), Action::Hold),
                Rule::new(Some("delete"), Some(RESERVATIONS), Action::Hold),
            ]);
        }
    }
    let mut log = String::new();
    let mut counts = [0usize; 3];
    for name in victims {
        let old = t.live[name].clone();
        let podref = format!("{}/{name}", t.ns);
        let args: Vec<String> = match rng.random_range(0..4) {
            0 | 1 => vec!["--pod".into(), podref],
            2 => vec!["--ip".into(), old.ip.to_string()],
            _ => vec![
                "--ip".into(),
                old.ip.to_string(),
                "--sandbox".into(),
                old.sandbox.clone(),
            ],
        };
        // The command takes a moment to start and read; the pod comes before it reads, while
        // it writes, or after.
        let command_after = Duration::from_millis(rng.random_range(0..600));
        let pod_after = Duration::from_millis(rng.random_range(0..2500));
        let another = rng.random_bool(0.5);
        t.delete(std::slice::from_ref(name)).await;
        let releasing = {
            let (kubeconfig, ns, args) = (kubeconfig.clone(), t.ns.clone(), args.clone());
            async move {
                tokio::time::sleep(command_after).await;
                run_release(kubeconfig, ns, args).await
            }
        };
        let recreating = async {
            tokio::time::sleep(pod_after).await;
            t.allocate(name, &old.node).await?;
            if another {
                t.add_pod(None).await?;
            }
            anyhow::Ok(())
        };
        let (released, recreated) = tokio::join!(releasing, recreating);
        recreated?;
        let (code, said) = released?;
        counts[match code {
            0 => 0,
            1 => 1,
            _ => 2,
        }] += 1;
        log.push_str(&format!(
            "$ ipreclaim release {} (command after {command_after:?}, pod after {pod_after:?})\nexit {code}\n{said}\n",
            args.join(" ")
        ));
    }
    std::fs::write(t.dir.join("operator.log"), log)?;
    if held {
        for p in &t.proxies {
            p.clear();
        }
    }
    Ok(Fault {
        end: Instant::now(),
        bound: SWEEP + GRACE + SLACK,
        details: format!(
            "release: {} done, {} refused or nothing, {} errors{}",
            counts[0],
            counts[1],
            counts[2],
            if held { "; controllers held" } else { "" }
        ),
        heal_after: None,
    })
}

/// [`Kind::ForeignCleaner`].
async fn foreign_cleaner(
    t: &mut Trial<'_>,
    rng: &mut StdRng,
    victims: &[String],
) -> anyhow::Result<Fault> {
    let lag = Duration::from_secs(3600);
    t.set_zone(0, false, lag).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let zone_a: BTreeSet<String> = t.nodes[..ZONE_NODES].iter().cloned().collect();
    let (in_a, in_b): (Vec<String>, Vec<String>) = victims
        .iter()
        .cloned()
        .partition(|n| zone_a.contains(&t.live[n].node));
    let fenced: BTreeSet<Ipv4Addr> = in_a.iter().map(|n| t.live[n].ip).collect();
    t.guard_fenced(&in_a);
    t.delete(&in_a).await;
    t.delete(&in_b).await;
    // ipreclaim fences them: their entries name `<pod>:fenced`.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let e = entries(&t.client, &t.ns).await?;
        let marked = fenced
            .iter()
            .filter(|ip| e.get(ip).is_some_and(|(_, p)| p.ends_with(":fenced")))
            .count();
        if marked == fenced.len() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{marked} of {} entries fenced after 30 s",
            fenced.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(rng.random_range(0..2000))).await;
    // The other cleaner finds no pod `<pod>:fenced` and frees them: not ipreclaim's doing.
    {
        let mut g = t.guard.lock().unwrap();
        for ip in &fenced {
            g.fenced.remove(ip);
        }
    }
    let freed = free_as_another_cleaner(&t.client, &t.ns, &fenced).await?;
    // New pods get those addresses from the real CNI.
    let before: BTreeSet<String> = t.live.keys().cloned().collect();
    for _ in 0..fenced.len() + 2 {
        t.add_pod(Some(1)).await?;
    }
    let reused = t
        .live
        .values()
        .filter(|a| !before.contains(&a.name) && fenced.contains(&a.ip))
        .count();
    tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
    let back = t.zone_back(0, lag).await?;
    Ok(Fault {
        end: back,
        bound: SETTLE + SLACK,
        details: format!(
            "{freed} fenced entries freed by another cleaner, {reused} taken by new pods"
        ),
        heal_after: None,
    })
}

/// Removes the entries of `ips` that name a fenced pod (`<pod>:fenced`) and deletes their
/// reservations, as a cleaner that does not know ipreclaim's marks would (whereabouts'
/// reconciler finds no such pod): how many entries it removed.
async fn free_as_another_cleaner(
    client: &Client,
    ns: &str,
    ips: &BTreeSet<Ipv4Addr>,
) -> anyhow::Result<usize> {
    let base = u32::from(Ipv4Addr::new(10, 64, 0, 0));
    let held = entries(client, ns).await?;
    let mut ops = Vec::new();
    for ip in ips {
        let Some((_, podref)) = held.get(ip).filter(|(_, p)| p.ends_with(":fenced")) else {
            continue;
        };
        let path = format!("/spec/allocations/{}", u32::from(*ip) - base);
        ops.push(json!({"op": "test", "path": format!("{path}/podref"), "value": podref}));
        ops.push(json!({"op": "remove", "path": path}));
    }
    let removed = ops.len() / 2;
    if removed > 0 {
        let patch: json_patch::Patch = serde_json::from_value(json!(ops))?;
        Api::<IPPool>::namespaced(client.clone(), ns)
            .patch(POOL, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await?;
    }
    let reservations = Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), ns);
    for ip in ips {
        let _ = reservations
            .delete(&ip.to_string(), &DeleteParams::default())
            .await;
    }
    Ok(removed)
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seed = arg("--seed")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs())
        });
    let kinds: Vec<Kind> = match arg("--kinds") {
        Some(list) => list
            .split(',')
            .map(|k| Kind::parse(k).ok_or_else(|| anyhow::anyhow!("unknown fault kind {k}")))
            .collect::<anyhow::Result<_>>()?,
        None => KINDS.to_vec(),
    };
    let trials: u64 = arg("--trials")
        .and_then(|s| s.parse().ok())
        .unwrap_or(kinds.len() as u64);
    println!(
        "chaos: seed {seed}, {trials} trials (rerun one with --seed <trial seed> --trials 1 --kinds <fault>)"
    );
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    cp.install_crds(&cp.client().await).await?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = Vec::new();
    let mut failed = 0;
    for i in 0..trials {
        let kind = kinds[i as usize % kinds.len()];
        let trial_seed: u64 = if trials == 1 { seed } else { rng.random() };
        let o = run_trial(&cp, kind, trial_seed).await?;
        for v in &o.violations {
            eprintln!("trial {i} ({kind:?}, seed {trial_seed}): VIOLATION {v}");
        }
        failed += usize::from(!o.violations.is_empty());
        println!(
            "trial {i} {kind:?} seed {trial_seed} {}: {} violations, freed {:.1}s after the fault",
            o.details,
            o.violations.len(),
            o.freed_in.as_secs_f64()
        );
        rows.push((i, kind, trial_seed, o));
    }
    println!(
        "{:<5} {:<31} {:<21} {:>5} {:>7} {:>6} {:>6} {:>9} {:>6} {:>7} {:>9} {:>10} details",
        "trial",
        "fault",
        "seed",
        "pods",
        "deleted",
        "fenced",
        "faults",
        "freed in",
        "bound",
        "rss",
        "res.gaps",
        "violations"
    );
    for (i, kind, s, o) in &rows {
        println!(
            "{:<5} {:<31} {:<21} {:>5} {:>7} {:>6} {:>6} {:>8.1}s {:>5.0}s {:>4}MiB {:>9} {:>10} {}",
            i,
            format!("{kind:?}"),
            s,
            o.pods,
            o.deleted,
            o.fenced,
            o.faults,
            o.freed_in.as_secs_f64(),
            o.bound.as_secs_f64(),
            o.rss_mib,
            format!("{} <{:.1}s", o.gaps.0, o.gaps.1.as_secs_f64()),
            o.violations.len(),
            o.details
        );
    }
    println!("chaos: {} trials, {failed} with violations", rows.len());
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
