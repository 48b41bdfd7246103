//! Throughput at scale on one real control plane, with what whereabouts writes: 4 pools, one
//! OverlappingRangeIPReservation per allocation, keeper pods that must keep their addresses.
//! ipreclaim runs as its own process (the release binary, default flags but no leader
//! election: one replica). Prints, phase by phase:
//! - whereabouts' ip-control-loop (built from ../shared/third_party, run as its DaemonSet runs
//!   it: in-cluster config, `NODENAME`, pools in its namespace) on W pods, then ipreclaim on
//!   the same W pods, and the ratio;
//! - N pods deleted at once (64 deletes in flight): when each pool entry and reservation went;
//! - N pods deleted while the controller was down: released after it is ready;
//! - M deletions at R/s: deletion-to-release latency, in pools of three sizes;
//! - the controller's memory with F pods, and again after S restarts (default 1) that list them
//!   all, each with its time to ready and the CPU seconds the controller and the control plane
//!   spent on it; then the apiserver's part alone: the same pod pages read and dropped;
//! - hostile: the steady phase again beside `--forged` pods (default 400) whose network-status
//!   a tenant forged (large, many-attachment, many-IP, shared-address), with the controller's
//!   memory against the chart's limit (not in the default phases).
//!
//! `cargo bench --bench scale [-- --pods N --whereabouts-pods W --trickle M --rate R
//! --footprint F --restarts S --forged H --phases whereabouts,mass,restart,steady,footprint,hostile --steady-keepers K,...
//! --controller-arg FLAG... --timeline]` (defaults: 2000, 100, 1000, 50, 20000, all phases, 64,300,600,
//! ipreclaim's default flags). Each phase has 4 pools of its own (the footprint one per 5,000 pods); live pods ("keepers") in
//! them: W in the side-by-side, N/10 in the mass delete, 1.2 N in the restart (more than it
//! deletes: the sweep's breaker holds a pool it would free more than half of), K per pool in
//! each steady run; the pool patch's cost at the apiserver grows with the pool. Pods are the
//! size of a Deployment's (two containers with env, probes, resources), not bare; those to be
//! deleted are Failed first, as their kubelet leaves a pod it stopped before deleting it.
//! `--timeline`: the steady phase also splits each release's latency by stage, from the
//! controller's trace events (see `benches/timeline`).
//! `SCALE_WRAP="heaptrack -o /tmp/ht/c"` runs the controller under the given program.

mod common;
mod timeline;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt, stream};
use ipreclaim::api::{
    IPAllocation, IPPool, IPPoolSpec, NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec,
    OverlappingRangeIPReservation, OverlappingRangeIPReservationSpec,
};
use ipreclaim::ipam::{NETWORK_STATUS_ANNOTATION, NETWORKS_ANNOTATION};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use testenv::ControlPlane;

const POOLS: usize = 4;
/// Pods per pool in the footprint phase, at most.
const PODS_PER_FOOTPRINT_POOL: usize = 5000;
const NODE: &str = "bench-node";
/// Deletes in flight at once.
const CONCURRENT_DELETES: usize = 64;

struct Options {
    pods: usize,
    whereabouts_pods: usize,
    trickle: usize,
    rate: f64,
    footprint: usize,
    /// Forged pods in the hostile phase.
    forged: usize,
    /// Restarts of the controller in the footprint phase (each a fresh list of them all).
    restarts: usize,
    phases: Vec<String>,
    /// Live pods per pool in the steady phase, one run each.
    steady_keepers: Vec<usize>,
    /// Flags added to ipreclaim's defaults.
    controller_args: Vec<String>,
    /// The steady and mass phases split each release's latency by stage (the controller's
    /// `ipreclaim::timeline` trace events).
    timeline: bool,
}

fn options() -> anyhow::Result<Options> {
    let mut o = Options {
        pods: 2000,
        whereabouts_pods: 100,
        trickle: 1000,
        rate: 50.0,
        footprint: 20_000,
        forged: 400,
        restarts: 1,
        phases: ["whereabouts", "mass", "restart", "steady", "footprint"]
            .map(String::from)
            .to_vec(),
        steady_keepers: vec![64, 300, 600],
        controller_args: Vec::new(),
        timeline: false,
    };
    // `--flag=value` as well as `--flag value`.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .flat_map(|a| match a.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") && !flag.contains(' ') => {
                vec![flag.to_string(), value.to_string()]
            }
            _ => vec![a],
        })
        .collect();
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).context("a flag without its value");
        match args[i].as_str() {
            "--pods" => o.pods = value()?.parse()?,
            "--whereabouts-pods" => o.whereabouts_pods = value()?.parse()?,
            "--trickle" => o.trickle = value()?.parse()?,
            "--rate" => o.rate = value()?.parse()?,
            "--footprint" => o.footprint = value()?.parse()?,
            "--forged" => o.forged = value()?.parse()?,
            "--restarts" => o.restarts = value()?.parse()?,
            "--phases" => o.phases = value()?.split(',').map(String::from).collect(),
            "--steady-keepers" => {
                o.steady_keepers = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--controller-arg" => o.controller_args.push(value()?.clone()),
            "--timeline" => {
                o.timeline = true;
                i += 1;
                continue;
            }
            // cargo bench passes --bench.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    Ok(o)
}

/// Pool `p`: its range, name (as whereabouts names it) and network.
fn range(p: usize) -> String {
    format!("10.{}.0.0/18", 20 + p)
}
fn pool_name(p: usize) -> String {
    range(p).replace('/', "-")
}
fn network(p: usize) -> String {
    format!("net-{p}")
}
/// The address at `offset` of pool `p`.
fn address(p: usize, offset: usize) -> String {
    format!("10.{}.{}.{}", 20 + p, offset / 256, offset % 256)
}

/// One allocation the bench made: its pod, pool, offset.
#[derive(Clone)]
struct Alloc {
    pod: String,
    pool: usize,
    offset: usize,
}

impl Alloc {
    fn key(&self) -> (String, String) {
        (pool_name(self.pool), self.offset.to_string())
    }
    fn reservation(&self) -> String {
        address(self.pool, self.offset)
    }
}

/// When the watched pools and reservations lost what the bench tracks.
#[derive(Default)]
struct Tracker {
    /// Victims' pool entries: whether seen yet (a late watch event of an older pool must not
    /// count as freed), and when each went (None: still there).
    entries: HashMap<(String, String), (bool, Option<Instant>)>,
    /// Victims' reservations: when each was deleted.
    reservations: HashMap<String, Option<Instant>>,
    /// Keepers' entries and reservations: must never go.
    keeper_entries: HashSet<(String, String)>,
    keeper_reservations: HashSet<String>,
    /// The entries of each pool as last watched.
    current: HashMap<String, HashSet<String>>,
    violations: Vec<String>,
}

impl Tracker {
    fn pool_seen(&mut self, pool: &IPPool, now: Instant) {
        let name = pool.metadata.name.clone().unwrap_or_default();
        self.current.insert(
            name.clone(),
            pool.spec.allocations.keys().cloned().collect(),
        );
        let present =
            |key: &(String, String)| key.0 != name || pool.spec.allocations.contains_key(&key.1);
        for (key, (seen, gone)) in self.entries.iter_mut() {
            if present(key) {
                *seen = true;
            } else if *seen && gone.is_none() {
                *gone = Some(now);
            }
        }
        for key in &self.keeper_entries {
            if !present(key) {
                self.violations
                    .push(format!("keeper entry {}/{} freed", key.0, key.1));
            }
        }
    }

    fn reservation_deleted(&mut self, name: &str, now: Instant) {
        if let Some(gone) = self.reservations.get_mut(name) {
            gone.get_or_insert(now);
        }
        if self.keeper_reservations.contains(name) {
            self.violations
                .push(format!("keeper reservation {name} deleted"));
        }
    }

    fn all_gone(&self) -> bool {
        self.entries.values().all(|(_, g)| g.is_some())
            && self.reservations.values().all(Option::is_some)
    }
}

struct Bench {
    cp: ControlPlane,
    client: Client,
    ns: String,
    tracker: Arc<Mutex<Tracker>>,
    /// Pools made so far (pool `g` is 10.(20+g).0.0/18).
    pools_made: usize,
    /// The pools of the current phase.
    in_use: Vec<usize>,
    /// Next free offset per pool.
    next_offset: HashMap<usize, usize>,
    rounds: usize,
    /// The controller logs its `ipreclaim::timeline` trace events as JSON (`--timeline`).
    timeline: bool,
}

/// A process and how to read its CPU time and memory. Killed when dropped still running (a
/// phase that fails leaves no controller behind). It leads a process group of its own, which
/// is signalled whole: under `SCALE_WRAP` the controller is the wrapper's child, and a stop
/// that reached only the wrapper left it running, taking the CPU of the next measurements.
struct Proc {
    child: Child,
    name: &'static str,
}

impl Proc {
    fn status_kib(&self, field: &str) -> u64 {
        common::status_kib(self.child.id(), field).unwrap_or(0)
    }
    fn rss_mib(&self) -> f64 {
        self.status_kib("VmRSS:") as f64 / 1024.0
    }
    fn peak_rss_mib(&self) -> f64 {
        self.status_kib("VmHWM:") as f64 / 1024.0
    }
    /// User + system CPU seconds so far.
    fn cpu_seconds(&self) -> f64 {
        common::cpu_seconds_of(self.child.id())
    }
    /// Sends `signal` to its process group.
    fn signal_group(&self, signal: i32) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on a process group this bench made; no memory is involved.
            unsafe {
                libc::kill(-pid, signal);
            }
        }
    }
    fn stop(mut self) {
        // SIGTERM first: a clean shutdown, as a rollout does.
        self.signal_group(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.signal_group(libc::SIGKILL);
        let _ = self.child.wait();
        eprintln!("{} did not stop on SIGTERM; killed", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal_group(libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// What a phase measured.
struct Released {
    /// Entries freed, seconds after `since`, sorted.
    entries: Vec<f64>,
    /// Reservations deleted, seconds after `since`, sorted.
    reservations: Vec<f64>,
}

impl Released {
    fn last_entry(&self) -> f64 {
        self.entries.last().copied().unwrap_or(f64::NAN)
    }
    fn last_reservation(&self) -> f64 {
        self.reservations.last().copied().unwrap_or(f64::NAN)
    }
}

/// Watches `api` for the whole run (in a task of its own), handing each event to `seen`.
fn follow<K>(api: Api<K>, mut seen: impl FnMut(watcher::Event<K>) + Send + 'static)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    tokio::spawn(async move {
        let mut events = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(e) = events.next().await {
            if let Ok(e) = e {
                seen(e);
            }
        }
    });
}

impl Bench {
    async fn start() -> anyhow::Result<Bench> {
        let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
        let client = cp.client().await;
        cp.install_crds(&client).await?;
        let ns = cp.namespace(&client, "scale").await;
        let nodes = Api::<Node>::all(client.clone());
        nodes
            .create(&PostParams::default(), &testenv::fixtures::node(NODE))
            .await?;
        // Ready, as a kubelet reports it: a pod of a node that is not Ready is fenced.
        let now = jiff::Timestamp::now().to_string();
        let ready = testenv::fixtures::ready_condition("True", "KubeletReady", &now);
        nodes
            .patch_status(NODE, &PatchParams::default(), &Patch::Merge(ready))
            .await?;
        let bench = Bench {
            cp,
            client,
            ns,
            tracker: Default::default(),
            pools_made: 0,
            in_use: Vec::new(),
            next_offset: HashMap::new(),
            rounds: 0,
            timeline: false,
        };
        bench.watch();
        Ok(bench)
    }

    /// A new set of [`POOLS`] empty pools, each with its NAD, for the next phase: each phase
    /// has pools of its own size.
    async fn new_pools(&mut self) -> anyhow::Result<()> {
        self.new_pools_of(POOLS).await
    }

    /// Like [`new_pools`](Self::new_pools), `count` of them.
    async fn new_pools_of(&mut self, count: usize) -> anyhow::Result<()> {
        let nads: Api<NetworkAttachmentDefinition> = Api::namespaced(self.client.clone(), &self.ns);
        self.in_use = (self.pools_made..self.pools_made + count).collect();
        self.pools_made += count;
        for &p in &self.in_use {
            let config = serde_json::json!({
                "cniVersion": "0.3.1", "name": network(p), "type": "macvlan", "master": "eth0",
                "ipam": {"type": "whereabouts", "range": range(p),
                         "kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}},
            });
            let nad = NetworkAttachmentDefinition::new(
                &network(p),
                NetworkAttachmentDefinitionSpec {
                    config: Some(config.to_string()),
                },
            );
            nads.create(&PostParams::default(), &nad).await?;
            let spec = IPPoolSpec {
                range: range(p),
                allocations: BTreeMap::new(),
            };
            self.pools()
                .create(&PostParams::default(), &IPPool::new(&pool_name(p), spec))
                .await?;
        }
        Ok(())
    }

    /// Allocations in each pool in use, as last watched.
    fn pool_sizes(&self) -> Vec<usize> {
        let t = self.tracker.lock().unwrap();
        self.in_use
            .iter()
            .map(|p| t.current.get(&pool_name(*p)).map_or(0, HashSet::len))
            .collect()
    }

    /// Follows pools and reservations into the tracker for the whole run.
    fn watch(&self) {
        let tracker = self.tracker.clone();
        follow(self.pools(), move |e| {
            if let watcher::Event::Apply(p) | watcher::Event::InitApply(p) = e {
                tracker.lock().unwrap().pool_seen(&p, Instant::now());
            }
        });
        let tracker = self.tracker.clone();
        follow(self.reservations(), move |e| {
            if let watcher::Event::Delete(r) = e {
                let name = r.metadata.name.unwrap_or_default();
                tracker
                    .lock()
                    .unwrap()
                    .reservation_deleted(&name, Instant::now());
            }
        });
    }

    fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
    fn reservations(&self) -> Api<OverlappingRangeIPReservation> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// `n` pods spread over the pools, each with its allocation and reservation, as the
    /// whereabouts CNI leaves them; `keep` marks them keepers, else the tracker follows them.
    async fn add(&mut self, n: usize, keep: bool) -> anyhow::Result<Vec<Alloc>> {
        self.rounds += 1;
        let prefix = if keep { "k" } else { "v" };
        let mut allocs = Vec::with_capacity(n);
        for i in 0..n {
            let pool = self.in_use[i % self.in_use.len()];
            let next = self.next_offset.entry(pool).or_insert(1);
            let offset = *next;
            *next += 1;
            allocs.push(Alloc {
                pod: format!("{prefix}{}-{i}", self.rounds),
                pool,
                offset,
            });
        }
        let started = Instant::now();
        let ns = self.ns.clone();
        let pods = self.pods();
        stream::iter(allocs.clone())
            .map(|a| {
                let (pods, ns) = (pods.clone(), ns.clone());
                async move { pods.create(&PostParams::default(), &pod(&ns, &a)).await }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<_>>()
            .await
            .context("creating pods")?;
        if !keep {
            // Pods to delete are deleted as a kubelet deletes a pod it has stopped: phase
            // Failed first (one deleted Running would be fenced until its kubelet stops it).
            let failed = serde_json::json!({"status": {"phase": "Failed"}});
            stream::iter(allocs.clone())
                .map(|a| {
                    let (pods, failed) = (pods.clone(), failed.clone());
                    async move {
                        let patch = Patch::Merge(failed);
                        pods.patch_status(&a.pod, &PatchParams::default(), &patch)
                            .await
                    }
                })
                .buffer_unordered(32)
                .try_collect::<Vec<_>>()
                .await
                .context("marking pods stopped")?;
        }
        for &p in &self.in_use {
            let entries: serde_json::Map<String, serde_json::Value> = allocs
                .iter()
                .filter(|a| a.pool == p)
                .map(|a| {
                    let entry = IPAllocation {
                        id: sandbox(&a.pod),
                        podref: format!("{ns}/{}", a.pod),
                        ifname: Some("net1".into()),
                        ipamclaimref: None,
                    };
                    (a.offset.to_string(), serde_json::to_value(entry).unwrap())
                })
                .collect();
            let patch = serde_json::json!({"spec": {"allocations": entries}});
            self.pools()
                .patch(&pool_name(p), &PatchParams::default(), &Patch::Merge(patch))
                .await
                .context("adding allocations")?;
        }
        let reservations = self.reservations();
        stream::iter(allocs.clone())
            .map(|a| {
                let (api, ns) = (reservations.clone(), ns.clone());
                async move {
                    let r = OverlappingRangeIPReservation::new(
                        &a.reservation(),
                        OverlappingRangeIPReservationSpec {
                            containerid: Some(sandbox(&a.pod)),
                            podref: format!("{ns}/{}", a.pod),
                            ifname: Some("net1".into()),
                            ipamclaimref: None,
                        },
                    );
                    api.create(&PostParams::default(), &r).await
                }
            })
            .buffer_unordered(32)
            .try_collect::<Vec<_>>()
            .await
            .context("creating reservations")?;
        let mut t = self.tracker.lock().unwrap();
        for a in &allocs {
            if keep {
                t.keeper_entries.insert(a.key());
                t.keeper_reservations.insert(a.reservation());
            }
        }
        drop(t);
        eprintln!(
            "scale: {n} {} pods with allocations and reservations made in {:.1}s",
            if keep { "keeper" } else { "victim" },
            started.elapsed().as_secs_f64()
        );
        Ok(allocs)
    }

    /// Starts tracking `victims` (their entries and reservations exist now).
    fn track(&self, victims: &[Alloc]) {
        let mut t = self.tracker.lock().unwrap();
        let seen = |k: &(String, String)| t.current.get(&k.0).is_some_and(|p| p.contains(&k.1));
        t.entries = victims
            .iter()
            .map(|a| (a.key(), (seen(&a.key()), None)))
            .collect();
        t.reservations = victims.iter().map(|a| (a.reservation(), None)).collect();
    }

    /// Deletes `victims`' pods, `CONCURRENT_DELETES` at a time; returns when the last returned.
    async fn delete_all(&self, victims: &[Alloc]) -> anyhow::Result<Instant> {
        let pods = self.pods();
        stream::iter(victims.to_vec())
            .map(|a| {
                let pods = pods.clone();
                async move {
                    pods.delete(&a.pod, &DeleteParams::default().grace_period(0))
                        .await
                }
            })
            .buffer_unordered(CONCURRENT_DELETES)
            .try_collect::<Vec<_>>()
            .await
            .context("deleting pods")?;
        Ok(Instant::now())
    }

    /// Waits until every tracked entry and reservation is gone; times relative to `since`.
    async fn released(&self, since: Instant, timeout: Duration) -> anyhow::Result<Released> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let t = self.tracker.lock().unwrap();
                if !t.violations.is_empty() {
                    bail!("a live address was freed: {:?}", t.violations);
                }
                if t.all_gone() {
                    let rel = |at: &Option<Instant>| {
                        let at = at.expect("gone");
                        if at >= since {
                            at.duration_since(since).as_secs_f64()
                        } else {
                            -since.duration_since(at).as_secs_f64()
                        }
                    };
                    let mut entries: Vec<f64> = t.entries.values().map(|(_, g)| rel(g)).collect();
                    let mut reservations: Vec<f64> = t.reservations.values().map(rel).collect();
                    entries.sort_by(f64::total_cmp);
                    reservations.sort_by(f64::total_cmp);
                    return Ok(Released {
                        entries,
                        reservations,
                    });
                }
                if Instant::now() > deadline {
                    let left = t.entries.values().filter(|(_, g)| g.is_none()).count();
                    let res = t.reservations.values().filter(|g| g.is_none()).count();
                    bail!("after {timeout:?}: {left} entries and {res} reservations still there");
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The ipreclaim controller as its own process, default flags, one replica.
    async fn start_ipreclaim(
        &self,
        extra: &[String],
    ) -> anyhow::Result<(Proc, std::net::SocketAddr)> {
        let port = testenv::procs::free_port()?;
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let log = std::fs::File::create(self.cp.dir().join(format!("ipreclaim-{port}.log")))?;
        // SCALE_WRAP="heaptrack -o /tmp/ht/controller" runs it under a profiler.
        let wrap = std::env::var("SCALE_WRAP").unwrap_or_default();
        let mut wrap = wrap.split_whitespace();
        let mut command = match wrap.next() {
            Some(program) => {
                let mut c = Command::new(program);
                c.args(wrap).arg(env!("CARGO_BIN_EXE_ipreclaim"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_ipreclaim")),
        };
        let child = command
            .args([
                "controller",
                &format!("--whereabouts-namespace={}", self.ns),
                "--leader-election=false",
                &format!("--metrics-addr={addr}"),
            ])
            .args(extra)
            .args(self.timeline.then_some("--log-format=json"))
            .env("KUBECONFIG", self.cp.kubeconfig_path())
            .env(
                "RUST_LOG",
                match self.timeline {
                    true => "warn,ipreclaim::timeline=trace",
                    false => "warn",
                },
            )
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()?;
        let mut proc = Proc {
            child,
            name: "ipreclaim",
        };
        while !common::get(addr, "/readyz")
            .await
            .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
        {
            if let Some(status) = proc.child.try_wait()? {
                bail!(
                    "the controller exited before it was ready ({status}): see its log in {}",
                    self.cp.dir().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok((proc, addr))
    }

    /// whereabouts' ip-control-loop, run the way its DaemonSet runs it: in-cluster config
    /// (a chroot holding the service account files and the whereabouts flat config),
    /// `NODENAME`, pools in `WHEREABOUTS_NAMESPACE`. It has no readiness signal: this waits
    /// for its "starting network controller" log line, then for its caches (2 s).
    async fn start_whereabouts(&self) -> anyhow::Result<Proc> {
        let bin = testenv::procs::binary("whereabouts-controlloop")?;
        let root = self.cp.dir().join("whereabouts-root");
        let secrets = root.join("var/run/secrets/kubernetes.io/serviceaccount");
        std::fs::create_dir_all(&secrets)?;
        std::fs::create_dir_all(root.join("etc/cni/net.d/whereabouts.d"))?;
        std::fs::create_dir_all(root.join("tmp"))?;
        std::fs::copy(&bin, root.join("ip-control-loop"))?;
        std::fs::write(
            root.join("etc/cni/net.d/whereabouts.d/whereabouts.conf"),
            r#"{"datastore": "kubernetes", "kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}}"#,
        )?;
        let env = self.cp.write_in_cluster_credentials(&secrets)?;
        let log_path = self.cp.dir().join("ip-control-loop.log");
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new("chroot")
            .arg(&root)
            .arg("/ip-control-loop")
            .envs(env)
            .env("NODENAME", NODE)
            .env("WHEREABOUTS_NAMESPACE", &self.ns)
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("chroot (run the bench as root)")?;
        let mut proc = Proc {
            child,
            name: "ip-control-loop",
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = proc.child.try_wait() {
                bail!("ip-control-loop exited ({status}): {}", tail(&log_path));
            }
            if std::fs::read_to_string(&log_path)
                .unwrap_or_default()
                .contains("starting network controller")
            {
                break;
            }
            if Instant::now() > deadline {
                let _ = proc.child.kill();
                bail!("ip-control-loop did not start: {}", tail(&log_path));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(proc)
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

fn sandbox(pod: &str) -> String {
    format!("sandbox-{pod}")
}

/// A pod about the size of a Deployment's (labels, an owner, two containers with env,
/// resources, a probe and a mount): the controller reads whole pods off the wire and strips
/// them while reading, so their size is part of what it costs.
fn pod(ns: &str, a: &Alloc) -> Pod {
    let status = serde_json::json!([{
        "name": format!("{ns}/{}", network(a.pool)), "interface": "net1",
        "ips": [address(a.pool, a.offset)], "mac": "02:00:00:00:00:01", "dns": {},
    }]);
    let container = |name: &str| {
        let env: Vec<_> = (0..8)
            .map(|i| serde_json::json!({"name": format!("SETTING_{i}"), "value": format!("value-of-setting-{i}")}))
            .collect();
        serde_json::json!({
            "name": name, "image": "registry.example.com/team/app:1.24.3",
            "args": ["--listen=:8080", "--log-level=info"], "env": env,
            "ports": [{"name": "http", "containerPort": 8080}],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 5},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}],
        })
    };
    let pod = serde_json::json!({
        "metadata": {
            "name": a.pod,
            "labels": {"app.kubernetes.io/name": "app", "app.kubernetes.io/instance": "bench", "pod-template-hash": "5d9c7b8f4"},
            "annotations": {
                NETWORK_STATUS_ANNOTATION: status.to_string(),
                NETWORKS_ANNOTATION: network(a.pool),
            },
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "app-5d9c7b8f4",
                "uid": "6f1c9d2e-8a4b-4c3d-9e2f-1a2b3c4d5e6f", "controller": true}],
        },
        "spec": {
            "nodeName": NODE,
            "containers": [container("app"), container("sidecar")],
            "volumes": [{"name": "config", "configMap": {"name": "app-config"}}],
        },
    });
    serde_json::from_value(pod).expect("a valid pod")
}

/// Pool patches, reservation deletes, 429s, and the patches' summed seconds as counted by
/// the controller.
async fn writes(addr: std::net::SocketAddr) -> (f64, f64, f64, f64) {
    let text = common::metrics_text(addr).await;
    (
        common::metric(&text, "ipreclaim_api_writes_total{verb=\"patch\"}"),
        common::metric(&text, "ipreclaim_api_writes_total{verb=\"delete\"}"),
        common::metric(&text, "ipreclaim_api_throttled_total"),
        common::metric(&text, "ipreclaim_pool_patch_duration_seconds_sum"),
    )
}

/// The apiserver's requests so far, for the resources ipreclaim reads and writes: where the
/// apiserver's time goes. By "VERB resource" (its `apiserver_request_total`), and by "VERB
/// resource le" (its own time on them, `apiserver_request_duration_seconds`, cumulative).
async fn apiserver_requests(client: &Client) -> BTreeMap<String, f64> {
    let mut counts = BTreeMap::new();
    let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
        return counts;
    };
    let Ok(text) = client.request_text(request).await else {
        return counts;
    };
    let series = [
        ("apiserver_request_total{", false),
        ("apiserver_request_duration_seconds_bucket{", true),
    ];
    for (line, bucket) in text.lines().filter_map(|l| {
        let (_, bucket) = series.iter().find(|(p, _)| l.starts_with(p))?;
        Some((l, *bucket))
    }) {
        let label = |name: &str| {
            let at = [format!("{{{name}=\""), format!(",{name}=\"")]
                .iter()
                .find_map(|l| Some(line.find(l.as_str())? + l.len()))?;
            line[at..].split('"').next()
        };
        let (Some(verb), Some(resource)) = (label("verb"), label("resource")) else {
            continue;
        };
        if ![
            "ippools",
            "overlappingrangeipreservations",
            "pods",
            "events",
        ]
        .contains(&resource)
            || label("subresource").is_some_and(|s| !s.is_empty())
        {
            continue;
        }
        let n: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let key = match (bucket, label("le")) {
            (false, _) => format!("{verb} {resource}"),
            (true, Some(le)) => format!("{verb} {resource} {le}"),
            (true, None) => continue,
        };
        *counts.entry(key).or_default() += n;
    }
    counts
}

/// The apiserver's own time on `what` ("VERB resource") between two [`apiserver_requests`]:
/// the buckets its p50 and p99 fall in, as "p50 in (0.025, 0.05] s, p99 in (0.2, 0.4] s".
fn apiserver_time(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    what: &str,
) -> String {
    let prefix = format!("{what} ");
    let mut buckets: Vec<(f64, f64)> = after
        .iter()
        .filter_map(|(k, n)| {
            let le = k.strip_prefix(&prefix)?;
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, n - before.get(k).copied().unwrap_or(0.0)))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(_, total)) = buckets.last().filter(|(_, n)| *n > 0.0) else {
        return format!("{what}: none");
    };
    let bucket = |q: f64| {
        let i = buckets.iter().position(|(_, n)| *n >= q * total);
        let upper = i.map_or(f64::INFINITY, |i| buckets[i].0);
        let lower = i
            .and_then(|i| i.checked_sub(1))
            .map_or(0.0, |i| buckets[i].0);
        format!("({lower}, {upper}]")
    };
    format!("{what} p50 in {} s, p99 in {} s", bucket(0.5), bucket(0.99))
}

/// What grew from `before` to `after`, as "VERB resource N" items.
fn grown(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> String {
    let items: Vec<String> = after
        .iter()
        .map(|(k, n)| (k, n - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .map(|(k, d)| format!("{k} {d:.0}"))
        .collect();
    items.join(", ")
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    common::quantile(&mut v, 0.5)
}

/// Runs one "delete all at once" round with whatever releases them running; prints and
/// returns the time until every entry and reservation was gone.
async fn delete_at_once(
    bench: &mut Bench,
    label: &str,
    n: usize,
    releaser: &Proc,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let victims = bench.add(n, false).await?;
    bench.track(&victims);
    let cpu_before = (releaser.cpu_seconds(), control_plane_cpu(&bench.cp));
    let start = Instant::now();
    let last_delete = bench.delete_all(&victims).await?;
    let r = bench.released(start, timeout).await?;
    let deleted = last_delete.duration_since(start).as_secs_f64();
    let all = r.last_entry().max(r.last_reservation());
    println!(
        "{label}: {n} pods deleted in {deleted:.2}s; pool entries freed: median {:.2}s, last {:.2}s after the first delete ({:.2}s after the last returned); reservations: last {:.2}s ({:.2}s after the last delete)",
        median(&r.entries),
        r.last_entry(),
        r.last_entry() - deleted,
        r.last_reservation(),
        r.last_reservation() - deleted,
    );
    println!(
        "{label}: {} CPU {:.1}s (apiserver+etcd {:.1}s), RSS {:.1} MiB (peak {:.1} MiB), {:.1} addresses/s",
        releaser.name,
        releaser.cpu_seconds() - cpu_before.0,
        control_plane_cpu(&bench.cp) - cpu_before.1,
        releaser.rss_mib(),
        releaser.peak_rss_mib(),
        n as f64 / all,
    );
    Ok(all)
}

/// CPU seconds used so far by the control plane's processes (kube-apiserver, etcd).
fn control_plane_cpu(cp: &ControlPlane) -> f64 {
    let dir = cp.dir().to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return f64::NAN;
    };
    let mut total = 0.0;
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&dir) {
            total += common::cpu_seconds_of(pid);
        }
    }
    total
}

/// whereabouts' ip-control-loop, then ipreclaim, on the same `w` pods; prints the ratio.
async fn side_by_side(bench: &mut Bench, o: &Options) -> anyhow::Result<()> {
    let w = o.whereabouts_pods;
    bench.new_pools().await?;
    bench.add(w, true).await?;
    println!(
        "whereabouts: its ip-control-loop takes about 0.8 s per address here, so this phase uses {w} pods (--whereabouts-pods), not {}",
        o.pods
    );
    let control_loop = bench.start_whereabouts().await?;
    let wt = delete_at_once(
        bench,
        "whereabouts ip-control-loop",
        w,
        &control_loop,
        Duration::from_secs(60 + 5 * w as u64),
    )
    .await?;
    control_loop.stop();
    let (ipreclaim, _) = bench.start_ipreclaim(&o.controller_args).await?;
    let it = delete_at_once(
        bench,
        "ipreclaim (same workload)",
        w,
        &ipreclaim,
        Duration::from_secs(120),
    )
    .await?;
    ipreclaim.stop();
    println!(
        "ratio: on {w} pods with reservations, whereabouts took {wt:.1}s and ipreclaim {it:.2}s to free every entry and reservation: {:.0}x",
        wt / it
    );
    Ok(())
}

/// `n` pods deleted at once with the controller running.
async fn mass(bench: &mut Bench, o: &Options) -> anyhow::Result<()> {
    bench.new_pools().await?;
    bench.add(o.pods / 10, true).await?;
    let (ipreclaim, addr) = bench.start_ipreclaim(&o.controller_args).await?;
    let before = writes(addr).await;
    delete_at_once(
        bench,
        "mass delete",
        o.pods,
        &ipreclaim,
        Duration::from_secs(300),
    )
    .await?;
    let after = writes(addr).await;
    let (patches, deletes) = (after.0 - before.0, after.1 - before.1);
    println!(
        "mass delete: {patches} pool patches ({:.3} per address, {:.0} ms each on average), {deletes} reservation deletes, {} answered 429",
        patches / o.pods as f64,
        (after.3 - before.3) / patches * 1000.0,
        after.2 - before.2,
    );
    ipreclaim.stop();
    Ok(())
}

/// `n` pods deleted while the controller is down, released after it starts.
async fn restart(bench: &mut Bench, o: &Options) -> anyhow::Result<()> {
    // More keepers than victims: the sweep's breaker holds a pool it would free more than
    // half of (--max-release-ratio), and pods gone while it was down are the sweep's.
    bench.new_pools().await?;
    bench.add(o.pods + o.pods / 5, true).await?;
    let victims = bench.add(o.pods, false).await?;
    bench.track(&victims);
    bench.delete_all(&victims).await?;
    let (ipreclaim, _) = bench.start_ipreclaim(&o.controller_args).await?;
    let ready = Instant::now();
    let r = bench.released(ready, Duration::from_secs(300)).await?;
    println!(
        "restart: {} pods deleted while the controller was down; after it was ready: every pool entry freed in {:.2}s (median {:.2}s), every reservation in {:.2}s",
        o.pods,
        r.last_entry(),
        median(&r.entries),
        r.last_reservation(),
    );
    ipreclaim.stop();
    Ok(())
}

/// Deletions at a steady rate: latency of each pod's release from its delete request, in
/// pools with `keepers` live pods each.
async fn steady(bench: &mut Bench, o: &Options, keepers: usize) -> anyhow::Result<()> {
    steady_with(bench, o, keepers, 0).await
}

/// [`steady`], with `forged` pods of forged network-status in place before the controller
/// starts (see [`forge`]); prints the controller's memory after.
async fn steady_with(
    bench: &mut Bench,
    o: &Options,
    keepers: usize,
    forged: usize,
) -> anyhow::Result<()> {
    bench.new_pools().await?;
    bench.add(keepers * POOLS, true).await?;
    if forged > 0 {
        forge(bench, forged).await?;
    }
    let (ipreclaim, addr) = bench.start_ipreclaim(&o.controller_args).await?;
    let victims = bench.add(o.trickle, false).await?;
    println!(
        "steady: pools of {:?} entries ({keepers} live pods each, the rest to delete)",
        bench.pool_sizes()
    );
    bench.track(&victims);
    let before = writes(addr).await;
    let requests_before = apiserver_requests(&bench.client).await;
    let cpu = (ipreclaim.cpu_seconds(), control_plane_cpu(&bench.cp));
    let sent: Arc<Mutex<HashMap<(String, String), Instant>>> = Default::default();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / o.rate));
    let mut deletes = Vec::new();
    for a in victims.clone() {
        tick.tick().await;
        let (pods, sent) = (bench.pods(), sent.clone());
        sent.lock().unwrap().insert(a.key(), Instant::now());
        deletes.push(tokio::spawn(async move {
            let started = Instant::now();
            pods.delete(&a.pod, &DeleteParams::default().grace_period(0))
                .await
                .map(|_| (a.key(), started, Instant::now()))
        }));
    }
    let mut delete_took = Vec::with_capacity(deletes.len());
    let mut returned = HashMap::with_capacity(deletes.len());
    for d in deletes {
        let (key, started, done) = d.await??;
        delete_took.push((done - started).as_secs_f64());
        returned.insert(key, done);
    }
    bench
        .released(Instant::now(), Duration::from_secs(120))
        .await?;
    // From the request's start, and from its return (the pod is gone from etcd by then: the
    // time before it is the apiserver's, queueing our own delete).
    let (mut latency, mut after_return): (Vec<f64>, Vec<f64>) = {
        let t = bench.tracker.lock().unwrap();
        let sent = sent.lock().unwrap();
        t.entries
            .iter()
            .map(|(k, (_, gone))| {
                let gone = gone.expect("gone");
                (
                    gone.saturating_duration_since(sent[k]).as_secs_f64(),
                    gone.saturating_duration_since(returned[k]).as_secs_f64(),
                )
            })
            .unzip()
    };
    let after = writes(addr).await;
    if bench.timeline {
        let anchor = timeline::Anchor::now();
        let t = bench.tracker.lock().unwrap();
        let traced: Vec<timeline::Victim> = victims
            .iter()
            .map(|a| timeline::Victim {
                podref: format!("{}/{}", bench.ns, a.pod),
                pool: pool_name(a.pool),
                returned: anchor.secs(returned[&a.key()]),
                gone: anchor.secs(t.entries[&a.key()].1.expect("gone")),
            })
            .collect();
        let log = bench
            .cp
            .dir()
            .join(format!("ipreclaim-{}.log", addr.port()));
        let rows = timeline::stages(&log, &anchor, &traced);
        timeline::print("steady timeline", &rows, victims.len());
    }
    let requests_after = apiserver_requests(&bench.client).await;
    let counted: BTreeMap<String, f64> = requests_after
        .iter()
        .filter(|(k, _)| k.split(' ').count() == 2)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    println!(
        "steady: apiserver requests meanwhile (all clients): {}",
        grown(&requests_before, &counted)
    );
    // Its own time, from its histogram's buckets: what no client can make shorter.
    let own: Vec<String> = [
        "PATCH ippools",
        "DELETE pods",
        "DELETE overlappingrangeipreservations",
        "GET pods",
        "POST events",
    ]
    .iter()
    .map(|what| apiserver_time(&requests_before, &requests_after, what))
    .collect();
    println!("steady: the apiserver's own time: {}", own.join("; "));
    // Where the time went: the delete request itself, and the controller's own histogram
    // (observed deletion to pool patched).
    let text = common::metrics_text(addr).await;
    let within = |le: &str| {
        let h = "ipreclaim_deletion_to_release_seconds";
        common::metric(&text, &format!("{h}_bucket{{le=\"{le}\"}}"))
            / common::metric(&text, &format!("{h}_count"))
            * 100.0
    };
    println!(
        "steady: the delete requests took p50 {:.0} ms, p99 {:.0} ms; in the controller, deletion seen to entry released: {:.1}% within 250 ms, {:.1}% within 500 ms",
        common::quantile(&mut delete_took, 0.5) * 1000.0,
        common::quantile(&mut delete_took, 0.99) * 1000.0,
        within("0.25"),
        within("0.5"),
    );
    println!(
        "steady: the delete returned (the pod deleted) to its pool entry freed: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        common::quantile(&mut after_return, 0.5) * 1000.0,
        common::quantile(&mut after_return, 0.99) * 1000.0,
        common::quantile(&mut after_return, 1.0) * 1000.0,
    );
    println!(
        "steady: {} deletions at {}/s; delete request to pool entry freed: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {} pool patches ({:.0} ms each on average), {} reservation deletes; CPU: ipreclaim {:.1}s, apiserver+etcd {:.1}s",
        o.trickle,
        o.rate,
        common::quantile(&mut latency, 0.5) * 1000.0,
        common::quantile(&mut latency, 0.99) * 1000.0,
        common::quantile(&mut latency, 1.0) * 1000.0,
        after.0 - before.0,
        (after.3 - before.3) / (after.0 - before.0) * 1000.0,
        after.1 - before.1,
        ipreclaim.cpu_seconds() - cpu.0,
        control_plane_cpu(&bench.cp) - cpu.1,
    );
    if forged > 0 {
        let limit = chart_memory_limit_mib()?;
        println!(
            "hostile: with {forged} forged pods: controller RSS {:.1} MiB, peak {:.1} MiB; the chart's memory limit is {limit} MiB (peak at {:.0}% of it)",
            ipreclaim.rss_mib(),
            ipreclaim.peak_rss_mib(),
            ipreclaim.peak_rss_mib() / limit * 100.0,
        );
    }
    ipreclaim.stop();
    Ok(())
}

/// The steady phase with forged pods beside it: what any user who can create a pod can do
/// to the controller (issue 35, item 4).
async fn hostile(bench: &mut Bench, o: &Options) -> anyhow::Result<()> {
    let keepers = o.steady_keepers.first().copied().unwrap_or(64);
    println!("hostile: the steady phase ({keepers} live pods per pool) beside forged pods");
    steady_with(bench, o, keepers, o.forged).await
}

/// The controller's memory limit in the chart (`controller.resources.limits.memory`), in MiB.
fn chart_memory_limit_mib() -> anyhow::Result<f64> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/ipreclaim/values.yaml");
    let values: serde_json::Value = serde_norway::from_str(&std::fs::read_to_string(path)?)?;
    let limit = values["controller"]["resources"]["limits"]["memory"]
        .as_str()
        .context("controller.resources.limits.memory")?;
    limit
        .strip_suffix("Mi")
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("a limit in Mi: {limit}"))
}

/// `n` pods with forged network-status, a quarter of each kind, each also carrying 100 KiB of
/// an annotation no controller reads: `big` (130 KiB of addresses on one attachment), `wide`
/// (400 attachments), `many` (1,500 addresses on one attachment), and `shared` (within every
/// cap: 16 attachments of 16 addresses, the same 256 addresses of pool 0 on every such pod).
async fn forge(bench: &Bench, n: usize) -> anyhow::Result<()> {
    let ns = bench.ns.clone();
    let net = format!("{ns}/{}", network(bench.in_use[0]));
    let shared = |k: usize| address(bench.in_use[0], 3000 + k);
    let kinds = testenv::fixtures::FORGED_KINDS;
    let statuses: Vec<String> = kinds
        .iter()
        .map(|k| testenv::fixtures::forged_network_status(k, &net, shared))
        .collect();
    let started = Instant::now();
    let pods = bench.pods();
    stream::iter(0..n)
        .map(|i| {
            let (pods, kind) = (pods.clone(), kinds[i % kinds.len()]);
            let pod = testenv::fixtures::forged_pod(
                &format!("forged-{kind}-{i}"),
                NETWORK_STATUS_ANNOTATION,
                statuses[i % kinds.len()].clone(),
            );
            async move { pods.create(&PostParams::default(), &pod).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    println!(
        "hostile: {n} forged pods created in {:.1}s (big, wide, many, shared; 100 KiB of other annotations each)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Waits for the controller's next sweep to end: its RSS settles then, as the sweep gives back
/// what the reads left free.
async fn next_sweep(addr: std::net::SocketAddr) {
    let sweeps = |text: &str| common::metric(text, "ipreclaim_sweep_duration_seconds_count");
    let before = sweeps(&common::metrics_text(addr).await);
    while sweeps(&common::metrics_text(addr).await) <= before {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The controller's memory with `footprint` pods (with allocations and reservations).
async fn footprint(bench: &mut Bench, o: &Options) -> anyhow::Result<()> {
    // An IPPool is one etcd object (at most 1.5 MiB, about 12,000 entries): large clusters
    // spread their pods over many pools.
    bench
        .new_pools_of(POOLS.max(o.footprint.div_ceil(PODS_PER_FOOTPRINT_POOL)))
        .await?;
    let (ipreclaim, addr) = bench.start_ipreclaim(&o.controller_args).await?;
    let have = bench.tracker.lock().unwrap().keeper_entries.len();
    if o.footprint > have {
        bench.add(o.footprint - have, true).await?;
    }
    let cached = |text: &str| common::metric(text, "ipreclaim_cached_pods ");
    let deadline = Instant::now() + Duration::from_secs(300);
    while cached(&common::metrics_text(addr).await) < o.footprint as f64 {
        if Instant::now() > deadline {
            bail!("the controller did not cache {} pods", o.footprint);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let cached_rss = ipreclaim.rss_mib();
    next_sweep(addr).await;
    let one = bench.pods().list(&ListParams::default().limit(1)).await?;
    let size = serde_json::to_vec(&one.items)?.len();
    println!(
        "footprint: controller RSS with {} pods (about {size} bytes of JSON each), their allocations and reservations cached: {:.1} MiB after the next sweep ({cached_rss:.1} MiB when the last was cached, peak {:.1} MiB)",
        o.footprint,
        ipreclaim.rss_mib(),
        ipreclaim.peak_rss_mib(),
    );
    ipreclaim.stop();

    // A restart reads all of it in its first lists, a page at a time.
    for _ in 0..o.restarts {
        restart_with_all(bench, o).await?;
    }
    list_alone(bench).await
}

/// One start of the controller with every pod in place: ready, first sweep, RSS, and the CPU
/// seconds the controller and the control plane spent until it was ready (2 shared cores: the
/// two compete, so each's share says whose time the start is).
async fn restart_with_all(bench: &Bench, o: &Options) -> anyhow::Result<()> {
    let plane_before = control_plane_cpu(&bench.cp);
    let started = Instant::now();
    let (ipreclaim, addr) = bench.start_ipreclaim(&o.controller_args).await?;
    let ready = started.elapsed();
    let (own_cpu, plane_cpu) = (
        ipreclaim.cpu_seconds(),
        control_plane_cpu(&bench.cp) - plane_before,
    );
    let sweeps = |text: &str| common::metric(text, "ipreclaim_sweep_duration_seconds_count");
    while sweeps(&common::metrics_text(addr).await) < 1.0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first_sweep = started.elapsed();
    next_sweep(addr).await;
    println!(
        "footprint: restarted with them all in place: ready in {:.1}s (CPU until then: controller {own_cpu:.1}s, control plane {plane_cpu:.1}s), first sweep done {:.1}s after the start, RSS {:.1} MiB after the next sweep (peak {:.1} MiB)",
        ready.as_secs_f64(),
        first_sweep.as_secs_f64(),
        ipreclaim.rss_mib(),
        ipreclaim.peak_rss_mib(),
    );
    ipreclaim.stop();
    Ok(())
}

/// The apiserver's part of a restart's pod list, without the controller: every pod page read
/// and dropped (pages of 250, 500 and 2,000, and of the controller's size), and the streaming
/// list (a watch with `sendInitialEvents`) read to its end-of-list bookmark; in JSON (nothing is
/// parsed) and in protobuf (read into the controller's stripped JSON, as its watch does).
async fn list_alone(bench: &Bench) -> anyhow::Result<()> {
    let protobuf = ipreclaim::protobuf_lists::pod_list_client(bench.client.clone());
    let encodings = [("JSON", &bench.client), ("protobuf", &protobuf)];
    let mut limits = vec![250, 500, 2000, ipreclaim::paged::POD_PAGE];
    limits.sort();
    limits.dedup();
    for (limit, (encoding, client)) in limits.into_iter().flat_map(|l| encodings.map(|e| (l, e))) {
        let plane_before = control_plane_cpu(&bench.cp);
        let started = Instant::now();
        let (mut pages, mut bytes) = (0, 0);
        let mut token = String::new();
        loop {
            let mut url = format!("/api/v1/pods?limit={limit}");
            if !token.is_empty() {
                url += &format!("&continue={token}");
            }
            let text = client
                .request_text(http::Request::get(url).body(Vec::new())?)
                .await?;
            pages += 1;
            bytes += text.len();
            // The token is in the list's metadata (after the items when read from protobuf);
            // base64, no escapes, and no bench pod's annotation has the key.
            token = text
                .split_once(r#""continue":""#)
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(t, _)| t.to_string())
                .unwrap_or_default();
            if token.is_empty() {
                break;
            }
        }
        println!(
            "footprint: the pod list alone in {encoding} pages of {limit}: {:.1}s for {pages} pages, {:.0} MB of JSON read (control plane CPU {:.1}s)",
            started.elapsed().as_secs_f64(),
            bytes as f64 / 1e6,
            control_plane_cpu(&bench.cp) - plane_before,
        );
    }
    let plane_before = control_plane_cpu(&bench.cp);
    let started = Instant::now();
    let url = "/api/v1/pods?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true";
    let stream = bench
        .client
        .request_stream(http::Request::get(url).body(Vec::new())?)
        .await;
    match stream {
        Err(e) => println!("footprint: no streaming list: {e}"),
        Ok(body) => {
            use futures::AsyncBufReadExt;
            let mut lines = body.lines();
            let (mut events, mut bytes) = (0usize, 0usize);
            while let Some(line) = lines.next().await {
                let line = line?;
                events += 1;
                bytes += line.len();
                if line.contains("k8s.io/initial-events-end") {
                    break;
                }
            }
            println!(
                "footprint: the pod list alone as a streaming list: {:.1}s for {events} events, {:.0} MB (control plane CPU {:.1}s)",
                started.elapsed().as_secs_f64(),
                bytes as f64 / 1e6,
                control_plane_cpu(&bench.cp) - plane_before,
            );
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let result = run().await;
    if let Err(e) = &result {
        eprintln!("scale: {e:#}");
    }
    // The watch tasks would outlive the control plane (dropped with the bench) and retry it.
    std::process::exit(i32::from(result.is_err()));
}

async fn run() -> anyhow::Result<()> {
    let o = options()?;
    let mut bench = Bench::start().await?;
    bench.timeline = o.timeline;
    if !o.controller_args.is_empty() {
        println!("ipreclaim flags: defaults but {:?}", o.controller_args);
    }
    for phase in &o.phases {
        match phase.as_str() {
            "whereabouts" => side_by_side(&mut bench, &o).await?,
            "mass" => mass(&mut bench, &o).await?,
            "restart" => restart(&mut bench, &o).await?,
            "steady" => {
                for &keepers in &o.steady_keepers {
                    steady(&mut bench, &o, keepers).await?;
                }
            }
            "footprint" => footprint(&mut bench, &o).await?,
            "hostile" => hostile(&mut bench, &o).await?,
            other => {
                bail!("no phase {other:?} (whereabouts, mass, restart, steady, footprint, hostile)")
            }
        }
    }
    let t = bench.tracker.lock().unwrap();
    println!(
        "keepers: {} live pods' entries and reservations checked through every phase; {} freed",
        t.keeper_entries.len(),
        t.violations.len()
    );
    if !t.violations.is_empty() {
        bail!("live addresses freed: {:?}", t.violations);
    }
    Ok(())
}
