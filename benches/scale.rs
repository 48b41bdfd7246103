//! Throughput at scale on one real control plane, with what whereabouts writes: 4 pools, one
//! OverlappingRangeIPReservation per allocation, keeper pods that must keep their addresses.
//! ipreclaim runs as its own process (the release binary, default flags but no leader
//! election: one replica). Prints, phase by phase:
//! - whereabouts' ip-control-loop (built from ../shared/third_party, run as its DaemonSet runs
//!   it: in-cluster config, `NODENAME`, pools in its namespace) on W pods, then ipreclaim on
//!   the same W pods, and the ratio;
//! - N pods deleted at once (64 deletes in flight): when each pool entry and reservation went;
//! - N pods deleted while the controller was down: released after it is ready;
//! - M deletions at R/s: deletion-to-release latency;
//! - the controller's memory with F pods.
//!
//! `cargo bench --bench scale [-- --pods N --whereabouts-pods W --trickle M --rate R
//! --footprint F --skip-whereabouts]`

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
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
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use testenv::ControlPlane;

const POOLS: usize = 4;
const NODE: &str = "bench-node";
/// Deletes in flight at once.
const CONCURRENT_DELETES: usize = 64;

struct Options {
    pods: usize,
    whereabouts_pods: usize,
    trickle: usize,
    rate: f64,
    footprint: usize,
    skip_whereabouts: bool,
}

fn options() -> anyhow::Result<Options> {
    let mut o = Options {
        pods: 2000,
        whereabouts_pods: 100,
        trickle: 1000,
        rate: 50.0,
        footprint: 20_000,
        skip_whereabouts: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).context("a flag without its value");
        match args[i].as_str() {
            "--pods" => o.pods = value()?.parse()?,
            "--whereabouts-pods" => o.whereabouts_pods = value()?.parse()?,
            "--trickle" => o.trickle = value()?.parse()?,
            "--rate" => o.rate = value()?.parse()?,
            "--footprint" => o.footprint = value()?.parse()?,
            "--skip-whereabouts" => {
                o.skip_whereabouts = true;
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
    violations: Vec<String>,
}

impl Tracker {
    fn pool_seen(&mut self, pool: &IPPool, now: Instant) {
        let name = pool.metadata.name.clone().unwrap_or_default();
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
    /// Next free offset per pool.
    next_offset: Vec<usize>,
    rounds: usize,
}

/// A process and how to read its CPU time and memory.
struct Proc {
    child: Child,
    name: &'static str,
}

impl Proc {
    fn status_kib(&self, field: &str) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
            .unwrap_or(0)
    }
    fn rss_mib(&self) -> f64 {
        self.status_kib("VmRSS:") as f64 / 1024.0
    }
    fn peak_rss_mib(&self) -> f64 {
        self.status_kib("VmHWM:") as f64 / 1024.0
    }
    /// User + system CPU seconds so far.
    fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // Fields after the command name (which may hold spaces) start at ") ".
        let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // utime and stime are fields 14 and 15, i.e. 11 and 12 after the state field.
        (ticks(11) + ticks(12)) / 100.0
    }
    fn stop(mut self) {
        // SIGTERM first: a clean shutdown, as a rollout does.
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!("{} did not stop on SIGTERM; killed", self.name);
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

impl Bench {
    async fn start() -> anyhow::Result<Bench> {
        let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
        let client = cp.client().await;
        cp.install_crds(&client).await?;
        let ns = cp.namespace(&client, "scale").await;
        let node = Node {
            metadata: ObjectMeta {
                name: Some(NODE.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Node>::all(client.clone())
            .create(&PostParams::default(), &node)
            .await?;
        let nads: Api<NetworkAttachmentDefinition> = Api::namespaced(client.clone(), &ns);
        let pools: Api<IPPool> = Api::namespaced(client.clone(), &ns);
        for p in 0..POOLS {
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
            pools
                .create(&PostParams::default(), &IPPool::new(&pool_name(p), spec))
                .await?;
        }
        let bench = Bench {
            cp,
            client,
            ns,
            tracker: Default::default(),
            next_offset: vec![1; POOLS],
            rounds: 0,
        };
        bench.watch();
        Ok(bench)
    }

    /// Follows pools and reservations into the tracker for the whole run.
    fn watch(&self) {
        let (pools, tracker) = (self.pools(), self.tracker.clone());
        tokio::spawn(async move {
            let mut events = watcher::watcher(pools, watcher::Config::default()).boxed();
            while let Some(e) = events.next().await {
                if let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = e {
                    tracker.lock().unwrap().pool_seen(&p, Instant::now());
                }
            }
        });
        let (reservations, tracker) = (self.reservations(), self.tracker.clone());
        tokio::spawn(async move {
            let mut events = watcher::watcher(reservations, watcher::Config::default()).boxed();
            while let Some(e) = events.next().await {
                if let Ok(watcher::Event::Delete(r)) = e {
                    let name = r.metadata.name.unwrap_or_default();
                    tracker
                        .lock()
                        .unwrap()
                        .reservation_deleted(&name, Instant::now());
                }
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
            let pool = i % POOLS;
            let offset = self.next_offset[pool];
            self.next_offset[pool] += 1;
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
        for p in 0..POOLS {
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
        t.entries = victims.iter().map(|a| (a.key(), (false, None))).collect();
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
    async fn start_ipreclaim(&self) -> anyhow::Result<(Proc, std::net::SocketAddr)> {
        let port = testenv::procs::free_port()?;
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let log = std::fs::File::create(self.cp.dir().join(format!("ipreclaim-{port}.log")))?;
        let child = Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
            .args([
                "controller",
                &format!("--whereabouts-namespace={}", self.ns),
                "--leader-election=false",
                &format!("--metrics-addr={addr}"),
            ])
            .env("KUBECONFIG", self.cp.kubeconfig_path())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let proc = Proc {
            child,
            name: "ipreclaim",
        };
        while !common::get(addr, "/readyz")
            .await
            .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
        {
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

fn pod(ns: &str, a: &Alloc) -> Pod {
    let status = serde_json::json!([{
        "name": format!("{ns}/{}", network(a.pool)), "interface": "net1",
        "ips": [address(a.pool, a.offset)], "mac": "02:00:00:00:00:01", "dns": {},
    }]);
    let mut p = testenv::fixtures::pod_with_network_status(&a.pod, &status.to_string());
    let annotations = p.metadata.annotations.get_or_insert_default();
    annotations.insert("k8s.v1.cni.cncf.io/networks".into(), network(a.pool));
    if let Some(spec) = p.spec.as_mut() {
        spec.node_name = Some(NODE.into());
    }
    p
}

/// Pool patches, reservation deletes and 429s counted by the controller.
async fn writes(addr: std::net::SocketAddr) -> (f64, f64, f64) {
    let text = common::metrics_text(addr).await;
    (
        common::metric(&text, "ipreclaim_api_writes_total{verb=\"patch\"}"),
        common::metric(&text, "ipreclaim_api_writes_total{verb=\"delete\"}"),
        common::metric(&text, "ipreclaim_api_throttled_total"),
    )
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
    let cpu_before = releaser.cpu_seconds();
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
        "{label}: {} CPU {:.1}s, RSS {:.1} MiB (peak {:.1} MiB), {:.1} addresses/s",
        releaser.name,
        releaser.cpu_seconds() - cpu_before,
        releaser.rss_mib(),
        releaser.peak_rss_mib(),
        n as f64 / all,
    );
    Ok(all)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let o = options()?;
    let mut bench = Bench::start().await?;
    // Keepers: live pods with allocations and reservations in every pool, more than any
    // phase deletes, so the sweep's breaker (half a pool) never holds a phase.
    bench.add(o.pods + o.pods / 5, true).await?;

    if o.skip_whereabouts {
        println!("whereabouts: skipped (--skip-whereabouts)");
    } else {
        let w = o.whereabouts_pods;
        println!(
            "whereabouts: its ip-control-loop takes about 0.8 s per address here, so this phase uses {w} pods (--whereabouts-pods), not {}",
            o.pods
        );
        let loop_ = bench.start_whereabouts().await?;
        let wt = delete_at_once(
            &mut bench,
            "whereabouts ip-control-loop",
            w,
            &loop_,
            Duration::from_secs(60 + 5 * w as u64),
        )
        .await?;
        loop_.stop();
        let (ipreclaim, _) = bench.start_ipreclaim().await?;
        let it = delete_at_once(
            &mut bench,
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
    }

    let (ipreclaim, addr) = bench.start_ipreclaim().await?;
    let before = writes(addr).await;
    delete_at_once(
        &mut bench,
        "mass delete",
        o.pods,
        &ipreclaim,
        Duration::from_secs(300),
    )
    .await?;
    let after = writes(addr).await;
    let (patches, deletes) = (after.0 - before.0, after.1 - before.1);
    println!(
        "mass delete: {patches} pool patches ({:.3} per address), {deletes} reservation deletes, {} answered 429",
        patches / o.pods as f64,
        after.2 - before.2,
    );

    // Down while the pods go.
    let victims = bench.add(o.pods, false).await?;
    bench.track(&victims);
    ipreclaim.stop();
    bench.delete_all(&victims).await?;
    let (ipreclaim, addr) = bench.start_ipreclaim().await?;
    let ready = Instant::now();
    let r = bench.released(ready, Duration::from_secs(300)).await?;
    println!(
        "restart: {} pods deleted while the controller was down; after it was ready: every pool entry freed in {:.2}s (median {:.2}s), every reservation in {:.2}s",
        o.pods,
        r.last_entry(),
        median(&r.entries),
        r.last_reservation(),
    );

    // A steady rate: latency of each pod's release from its delete request.
    let victims = bench.add(o.trickle, false).await?;
    bench.track(&victims);
    let before = writes(addr).await;
    let sent: Arc<Mutex<HashMap<(String, String), Instant>>> = Default::default();
    let period = Duration::from_secs_f64(1.0 / o.rate);
    let mut tick = tokio::time::interval(period);
    let mut deletes = Vec::new();
    for a in victims.clone() {
        tick.tick().await;
        let (pods, sent) = (bench.pods(), sent.clone());
        sent.lock().unwrap().insert(a.key(), Instant::now());
        deletes.push(tokio::spawn(async move {
            pods.delete(&a.pod, &DeleteParams::default().grace_period(0))
                .await
        }));
    }
    for d in deletes {
        d.await??;
    }
    bench
        .released(Instant::now(), Duration::from_secs(120))
        .await?;
    let mut latency: Vec<f64> = {
        let t = bench.tracker.lock().unwrap();
        let sent = sent.lock().unwrap();
        t.entries
            .iter()
            .map(|(k, (_, gone))| {
                gone.expect("gone")
                    .saturating_duration_since(sent[k])
                    .as_secs_f64()
            })
            .collect()
    };
    let after = writes(addr).await;
    println!(
        "steady: {} deletions at {}/s; delete request to pool entry freed: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {} pool patches, {} reservation deletes",
        o.trickle,
        o.rate,
        common::quantile(&mut latency, 0.5) * 1000.0,
        common::quantile(&mut latency, 0.99) * 1000.0,
        common::quantile(&mut latency, 1.0) * 1000.0,
        after.0 - before.0,
        after.1 - before.1,
    );

    // Memory with many pods cached.
    let have = o.pods + o.pods / 5;
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
    println!(
        "footprint: controller RSS with {} pods, allocations and reservations cached: {:.1} MiB (peak over the whole run {:.1} MiB)",
        o.footprint,
        ipreclaim.rss_mib(),
        ipreclaim.peak_rss_mib(),
    );
    let violations = bench.tracker.lock().unwrap().violations.clone();
    println!(
        "keepers: {} live pods' entries and reservations checked through every phase; {} freed",
        bench.tracker.lock().unwrap().keeper_entries.len(),
        violations.len()
    );
    ipreclaim.stop();
    if !violations.is_empty() {
        bail!("live addresses freed: {violations:?}");
    }
    Ok(())
}
