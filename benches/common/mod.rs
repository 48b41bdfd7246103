#![allow(dead_code)] // each benchmark binary uses a part of this module
//! Shared setup of the cluster benchmarks: a private control plane, a pool with one allocation
//! per pod, the pods themselves, and an in-process controller.

use std::net::SocketAddr;
use std::time::Instant;

use futures::{StreamExt, stream};
use ipreclaim::api::IPPool;
use ipreclaim::ipam::NETWORK_STATUS_ANNOTATION;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use testenv::ControlPlane;

#[path = "../../tests/support/mod.rs"]
pub mod support;

/// The pool every benchmark uses.
pub const POOL: &str = "198.18.0.0-16";

/// A private control plane with the CRDs, a namespace, `n` pods and their allocations.
pub struct Cluster {
    /// Keeps the control plane running.
    pub _control_plane: ControlPlane,
    /// Admin client.
    pub client: Client,
    /// The namespace (also the whereabouts namespace).
    pub ns: String,
}

fn pod(ns: &str, i: usize) -> Pod {
    let ip = format!("198.18.{}.{}", i / 256, i % 256);
    let status = format!(r#"[{{"name":"{ns}/macvlan","interface":"net1","ips":["{ip}"]}}]"#);
    testenv::fixtures::annotated_pod(&format!("p{i}"), NETWORK_STATUS_ANNOTATION, &status)
}

/// How many pods: the first command-line argument that is a number, or `default`.
pub fn pods_arg(default: usize) -> usize {
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Starts a control plane and creates `n` pods with one allocation each.
pub async fn cluster(n: usize) -> anyhow::Result<Cluster> {
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    let client = cp.client().await;
    cp.install_crds(&client).await?;
    let ns = cp.namespace(&client, "bench").await;
    let allocations = (0..n)
        .map(|i| {
            let alloc = support::allocation(&ns, &format!("p{i}"), &format!("sandbox-{i}"));
            (i.to_string(), alloc)
        })
        .collect();
    support::create_pool(&client, &ns, POOL, "198.18.0.0/16", allocations).await;
    let cluster = Cluster {
        _control_plane: cp,
        client,
        ns,
    };
    cluster.add_pods(n).await?;
    Ok(cluster)
}

impl Cluster {
    /// Creates pods p0..p(n-1), each listing its address on the benchmark network.
    pub async fn add_pods(&self, n: usize) -> anyhow::Result<()> {
        if n == 0 {
            return Ok(());
        }
        let pods = self.pods();
        let ns = self.ns.clone();
        let started = Instant::now();
        stream::iter(0..n)
            .map(|i| {
                let (pods, ns) = (pods.clone(), ns.clone());
                async move { pods.create(&PostParams::default(), &pod(&ns, i)).await }
            })
            .buffer_unordered(32)
            .for_each(|r| async move {
                r.expect("create pod");
            })
            .await;
        eprintln!(
            "created {n} pods in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// The admin kubeconfig file of the control plane.
    pub fn kubeconfig(&self) -> std::path::PathBuf {
        self._control_plane.kubeconfig_path()
    }

    /// Runs the controller in this process with default flags (no leader election) and waits
    /// until it is ready; it runs until the returned handle is dropped or stopped.
    pub async fn start_controller(&self) -> support::Program {
        support::controller(self.client.clone(), &self.ns, &["--leader-election=false"]).await
    }

    /// The pods API of the namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The pools API of the namespace.
    pub fn pools(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
}

/// The sum of the series of a metric whose line starts with `prefix`.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// GET /metrics.
pub async fn metrics_text(addr: SocketAddr) -> String {
    get(addr, "/metrics").await.expect("metrics server")
}

/// A plain HTTP GET of `path`; the whole response, status line included.
pub async fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

/// The `q` quantile (0..=1) of `samples`.
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    if samples.is_empty() {
        return f64::NAN;
    }
    let i = ((samples.len() - 1) as f64 * q).round() as usize;
    samples[i]
}

/// A field of `/proc/PID/status` (`"VmRSS:"`, `"VmHWM:"`, ...) in KiB; `None` when the process
/// or the field is gone.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// User + system CPU seconds of process `pid` so far (0 when it is gone).
pub fn cpu_seconds_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf reads a constant of the running system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // utime and stime are fields 14 and 15 of the line, 11 and 12 after the state field.
    (ticks(11) + ticks(12)) / per_second
}
