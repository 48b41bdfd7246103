//! The chaos suite (opt-in, bounded, seeded): `scripts/chaos.sh [--seed S] [--trials N]`.
//!
//! On a private control plane, two `ipreclaim controller` processes (leader election) watch a
//! pool that a stand-in allocator fills like the whereabouts CNI (an entry per pod, added with a
//! JSON patch that never overwrites) while pods are deleted and faults are injected: SIGKILL of
//! the leader in the middle of a batch, kube-apiserver and etcd restarts during a mass deletion,
//! a leader kill, StatefulSet-style churn (same names, new addresses) with the allocator adding
//! pods meanwhile, and network-status that flaps. After each trial:
//! - no live pod's listed address was ever freed (checked every 100 ms during the trial),
//! - no allocation added concurrently was lost,
//! - every dead pod's address was freed within sweep interval + grace (+ the Lease takeover when
//!   the leader was killed) after the fault ended,
//! - no controller panicked.
//!
//! Prints each trial's seed and a table; exits 1 on any violation.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use ipreclaim::api::{
    IPPool, IPPoolSpec, NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use testenv::ControlPlane;

const SWEEP: Duration = Duration::from_secs(1);
const GRACE: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(4);
/// Lease duration plus one renew period (the Lease is renewed a third of it before expiry).
const TAKEOVER: Duration = Duration::from_secs(4 + 3);
/// What a 2-core machine under load adds to any bound.
const SLACK: Duration = Duration::from_secs(3);
const KINDS: [Kind; 5] = [
    Kind::KillMidBatch,
    Kind::ApiserverAndEtcdRestart,
    Kind::LeaderKill,
    Kind::ChurnWithAllocator,
    Kind::FlappingStatus,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    KillMidBatch,
    ApiserverAndEtcdRestart,
    LeaderKill,
    ChurnWithAllocator,
    FlappingStatus,
}

/// A pod as the allocator made it: name, uid, address offset.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Allocated {
    name: String,
    uid: String,
    offset: u32,
}

struct Trial {
    client: Client,
    ns: String,
    kubeconfig: std::path::PathBuf,
    controllers: Vec<Child>,
    logs: std::path::PathBuf,
    next_offset: u32,
    /// Live pods by name.
    live: BTreeMap<String, Allocated>,
    /// Allocations of deleted pods.
    dead: Vec<Allocated>,
}

const POOL: &str = "10.64.0.0-16";

fn ip(offset: u32) -> String {
    format!("10.64.{}.{}", offset / 256, offset % 256)
}

impl Trial {
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
    fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn status(&self, offset: u32) -> String {
        json!([{"name": format!("{}/net", self.ns), "interface": "net1", "ips": [ip(offset)]}])
            .to_string()
    }

    /// Creates pod `name` and, like the CNI, its allocation (never overwriting an entry).
    async fn allocate(&mut self, name: &str) -> anyhow::Result<()> {
        let offset = self.next_offset;
        self.next_offset += 1;
        let pod = testenv::fixtures::pod_with_network_status(name, &self.status(offset));
        let created = self.pods().create(&PostParams::default(), &pod).await?;
        let uid = created.metadata.uid.unwrap_or_default();
        let path = format!("/spec/allocations/{offset}");
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": path, "value": null},
            {"op": "add", "path": path, "value": {
                "id": format!("sb-{uid}"), "podref": format!("{}/{name}", self.ns), "ifname": "net1"}},
        ]))?;
        self.pools()
            .patch(POOL, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await?;
        self.live.insert(
            name.into(),
            Allocated {
                name: name.into(),
                uid,
                offset,
            },
        );
        Ok(())
    }

    /// Deletes pods `names` at once (64 in flight).
    async fn delete(&mut self, names: &[String]) {
        delete_pods(self.pods(), names).await;
        self.bury(names);
    }

    /// Moves deleted pods' allocations to the dead.
    fn bury(&mut self, names: &[String]) {
        for n in names {
            if let Some(a) = self.live.remove(n) {
                self.dead.push(a);
            }
        }
    }

    fn spawn_controller(&mut self) -> anyhow::Result<()> {
        let n = self.controllers.len();
        let log = std::fs::File::create(self.logs.join(format!("controller-{n}.log")))?;
        let child = Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
            .args([
                "controller",
                &format!("--whereabouts-namespace={}", self.ns),
                &format!("--lease-namespace={}", self.ns),
                "--leader-election=true",
                &format!("--lease-duration={}s", LEASE.as_secs()),
                &format!("--sweep-interval={}s", SWEEP.as_secs()),
                &format!("--leak-grace={}s", GRACE.as_secs()),
                &format!("--missing-pod-grace={}s", GRACE.as_secs()),
                "--metrics-addr=127.0.0.1:0",
            ])
            .env("KUBECONFIG", &self.kubeconfig)
            .env("RUST_LOG", "info")
            .env("POD_NAME", format!("chaos-{n}"))
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
            let lease = Api::<Lease>::namespaced(self.client.clone(), &self.ns)
                .get_opt("ipreclaim-controller")
                .await
                .ok()
                .flatten();
            let holder = lease
                .and_then(|l| l.spec?.holder_identity)
                .unwrap_or_default();
            if let Some(i) = holder
                .strip_prefix("chaos-")
                .and_then(|r| r.split('_').next()?.parse().ok())
            {
                return Ok(i);
            }
            anyhow::ensure!(Instant::now() < deadline, "no leader after 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn kill_leader(&mut self) -> anyhow::Result<()> {
        let i = self.leader().await?;
        self.controllers[i].kill()?;
        self.controllers[i].wait()?;
        Ok(())
    }

    async fn entries(&self) -> anyhow::Result<BTreeMap<u32, (String, String)>> {
        let pool = self.pools().get(POOL).await?;
        Ok(pool
            .spec
            .allocations
            .into_iter()
            .filter_map(|(k, a)| Some((k.parse().ok()?, (a.id, a.podref))))
            .collect())
    }

    fn panicked(&self) -> bool {
        (0..self.controllers.len()).any(|n| {
            std::fs::read_to_string(self.logs.join(format!("controller-{n}.log")))
                .is_ok_and(|l| l.contains("panicked"))
        })
    }
}

async fn delete_pods(pods: Api<Pod>, names: &[String]) {
    stream::iter(names.to_vec())
        .map(|n| {
            let pods = pods.clone();
            async move {
                let _ = pods
                    .delete(&n, &DeleteParams::default().grace_period(0))
                    .await;
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
}

/// Live allocations that must stay, shared with the checker that polls the pool.
type Guarded = Arc<Mutex<BTreeSet<(u32, String)>>>;

fn guarded(t: &Trial) -> BTreeSet<(u32, String)> {
    t.live
        .values()
        .map(|a| (a.offset, format!("sb-{}", a.uid)))
        .collect()
}

/// Polls the pool every 100 ms; records every guarded allocation found missing.
fn spawn_checker(
    pools: Api<IPPool>,
    guard: Guarded,
    violations: Arc<Mutex<Vec<String>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            // Read the guard first: an allocation added after the read is not judged yet.
            let want = guard.lock().unwrap().clone();
            if let Ok(Some(pool)) = pools.get_opt(POOL).await {
                for (offset, id) in &want {
                    let still = guard.lock().unwrap().contains(&(*offset, id.clone()));
                    let present = pool
                        .spec
                        .allocations
                        .get(&offset.to_string())
                        .is_some_and(|a| a.id == *id);
                    if still && !present {
                        violations
                            .lock()
                            .unwrap()
                            .push(format!("live allocation {} ({id}) freed", ip(*offset)));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

struct Outcome {
    pods: usize,
    deleted: usize,
    freed_in: Duration,
    bound: Duration,
    violations: Vec<String>,
}

async fn run_trial(cp: &ControlPlane, kind: Kind, seed: u64) -> anyhow::Result<Outcome> {
    let mut rng = StdRng::seed_from_u64(seed);
    let client = cp.client().await;
    let ns = cp.namespace(&client, "chaos").await;
    let logs = cp.dir().join(format!("chaos-{ns}"));
    std::fs::create_dir_all(&logs)?;
    let nad = NetworkAttachmentDefinition::new(
        "net",
        NetworkAttachmentDefinitionSpec {
            config: Some(
                r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.64.0.0/16"}}"#.into(),
            ),
        },
    );
    Api::<NetworkAttachmentDefinition>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &nad)
        .await?;
    let spec = IPPoolSpec {
        range: "10.64.0.0/16".into(),
        allocations: BTreeMap::new(),
    };
    Api::<IPPool>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &IPPool::new(POOL, spec))
        .await?;
    let mut t = Trial {
        client,
        ns,
        kubeconfig: cp.kubeconfig_path(),
        controllers: Vec::new(),
        logs,
        next_offset: 1,
        live: BTreeMap::new(),
        dead: Vec::new(),
    };
    let n = rng.random_range(60..=150);
    for i in 0..n {
        t.allocate(&format!("p-{i}")).await?;
    }
    t.spawn_controller()?;
    t.spawn_controller()?;
    t.leader().await?;

    let guard: Guarded = Arc::new(Mutex::new(guarded(&t)));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let checker = spawn_checker(t.pools(), guard.clone(), violations.clone());
    let victims: Vec<String> = {
        let mut names: Vec<String> = t.live.keys().cloned().collect();
        let k = names.len() / 2;
        let mut picked = Vec::new();
        for _ in 0..k {
            picked.push(names.swap_remove(rng.random_range(0..names.len())));
        }
        picked
    };
    let unguard = |t: &Trial, names: &[String]| {
        let mut g = guard.lock().unwrap();
        for n in names {
            if let Some(a) = t.live.get(n) {
                g.remove(&(a.offset, format!("sb-{}", a.uid)));
            }
        }
    };
    let mut bound = SWEEP + GRACE + SLACK;
    match kind {
        Kind::KillMidBatch => {
            unguard(&t, &victims);
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
        }
        Kind::ApiserverAndEtcdRestart => {
            unguard(&t, &victims);
            let (first, second) = victims.split_at(victims.len() / 2);
            t.delete(first).await;
            cp.restart_apiserver().await?;
            t.delete(second).await;
            cp.restart_etcd().await?;
            // The Lease may lapse while the apiserver is away.
            bound += TAKEOVER;
        }
        Kind::LeaderKill => {
            unguard(&t, &victims);
            t.kill_leader().await?;
            t.delete(&victims).await;
            t.spawn_controller()?;
            bound += TAKEOVER;
        }
        Kind::ChurnWithAllocator => {
            // Same names, new addresses (a StatefulSet's pods recreated), while new pods come.
            for (round, name) in victims.iter().enumerate() {
                unguard(&t, std::slice::from_ref(name));
                t.delete(std::slice::from_ref(name)).await;
                t.allocate(name).await?;
                t.allocate(&format!("new-{round}")).await?;
                *guard.lock().unwrap() = guarded(&t);
            }
        }
        Kind::FlappingStatus => {
            // Some live pods list their address only now and then (never for a whole grace).
            let flappers: Vec<Allocated> = t
                .live
                .values()
                .filter(|a| !victims.contains(&a.name))
                .take(10)
                .cloned()
                .collect();
            unguard(&t, &victims);
            let deleting = delete_pods(t.pods(), &victims);
            let (pods, ns) = (t.pods(), t.ns.clone());
            let flapping = async {
                for step in 0..20 {
                    for f in &flappers {
                        let offset = if step % 3 == 0 { f.offset } else { 60_000 };
                        let status = json!([{"name": format!("{ns}/net"), "interface": "net1", "ips": [ip(offset)]}]);
                        let patch = json!({"metadata": {"annotations": {
                            "k8s.v1.cni.cncf.io/network-status": status.to_string()}}});
                        let _ = pods
                            .patch(&f.name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            };
            tokio::join!(deleting, flapping);
            t.bury(&victims);
            // Each flapper ends listing its own address again.
            for f in &flappers {
                let patch = json!({"metadata": {"annotations": {
                    "k8s.v1.cni.cncf.io/network-status": t.status(f.offset)}}});
                t.pods()
                    .patch(&f.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
        }
    }
    let fault_end = Instant::now();
    let dead: BTreeSet<(u32, String)> = t
        .dead
        .iter()
        .map(|a| (a.offset, format!("sb-{}", a.uid)))
        .collect();
    let deadline = fault_end + bound + Duration::from_secs(30);
    let freed_in = loop {
        let entries = t.entries().await?;
        let left = dead
            .iter()
            .filter(|(o, id)| entries.get(o).is_some_and(|(i, _)| i == id))
            .count();
        if left == 0 {
            break fault_end.elapsed();
        }
        if Instant::now() > deadline {
            violations
                .lock()
                .unwrap()
                .push(format!("{left} dead pods' addresses still allocated"));
            break fault_end.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // One more look with everything settled: every live allocation is there.
    tokio::time::sleep(SWEEP * 2).await;
    checker.abort();
    let entries = t.entries().await?;
    let mut violations = violations.lock().unwrap().clone();
    for a in t.live.values() {
        if entries
            .get(&a.offset)
            .is_none_or(|(id, _)| *id != format!("sb-{}", a.uid))
        {
            violations.push(format!("allocation of live pod {} lost", a.name));
        }
    }
    if freed_in > bound {
        violations.push(format!(
            "dead pods freed {:.1}s after the fault, bound {:.1}s",
            freed_in.as_secs_f64(),
            bound.as_secs_f64()
        ));
    }
    if t.panicked() {
        violations.push(format!(
            "a controller panicked (logs in {})",
            t.logs.display()
        ));
    }
    for c in &mut t.controllers {
        let _ = c.kill();
        let _ = c.wait();
    }
    Ok(Outcome {
        pods: n,
        deleted: t.dead.len(),
        freed_in,
        bound,
        violations,
    })
}

fn arg(name: &str) -> Option<u64> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1)?.parse().ok())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let seed = arg("--seed").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs())
    });
    let trials = arg("--trials").unwrap_or(KINDS.len() as u64);
    println!("chaos: seed {seed}, {trials} trials (rerun one with --seed <trial seed> --trials 1)");
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    cp.install_crds(&cp.client().await).await?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = Vec::new();
    let mut failed = 0;
    for i in 0..trials {
        let kind = KINDS[i as usize % KINDS.len()];
        let trial_seed: u64 = if trials == 1 { seed } else { rng.random() };
        let o = run_trial(&cp, kind, trial_seed).await?;
        for v in &o.violations {
            eprintln!("trial {i} ({kind:?}, seed {trial_seed}): VIOLATION {v}");
        }
        failed += usize::from(!o.violations.is_empty());
        rows.push((i, kind, trial_seed, o));
    }
    println!(
        "{:<5} {:<24} {:<21} {:>5} {:>7} {:>9} {:>7} {:>10}",
        "trial", "fault", "seed", "pods", "deleted", "freed in", "bound", "violations"
    );
    for (i, kind, s, o) in &rows {
        println!(
            "{:<5} {:<24} {:<21} {:>5} {:>7} {:>8.1}s {:>6.0}s {:>10}",
            i,
            format!("{kind:?}"),
            s,
            o.pods,
            o.deleted,
            o.freed_in.as_secs_f64(),
            o.bound.as_secs_f64(),
            o.violations.len()
        );
    }
    println!("chaos: {} trials, {failed} with violations", rows.len());
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
