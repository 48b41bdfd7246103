//! A real Kubernetes node on this machine: a control plane served where pods reach it,
//! kube-controller-manager, kube-scheduler, a private containerd with Multus (thin) as the
//! primary CNI plugin delegating to `bridge` + `host-local`, the whereabouts IPAM plugin for
//! secondary networks, and a kubelet. One per machine at a time (a lock); everything it
//! changes on the host is recorded first and put back when it stops, or at the next start
//! after a killed run.
//!
//! Addresses are documentation and benchmark ranges: the apiserver (and the `kubernetes`
//! Service's ClusterIP) is 198.19.0.1 on `lo`; pods' default network is 198.18.64.0/24 on a
//! bridge with no route out (IP forwarding stays off); secondary networks use the bridge
//! [`SECONDARY_BRIDGE`], which has no address at all.

use std::net::Ipv4Addr;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod, ServiceAccount};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams};

use crate::containerd::{Containerd, link_host_cni_plugins};
use crate::controlplane::{ControlPlane, Options};
use crate::host::{self, Changes};
use crate::link::Link;
use crate::procs::{binary, free_port, spawn_supervised, workspace_root, write_file};

/// The node's name.
pub const NODE_NAME: &str = "ipreclaim-node";
/// The apiserver's address (on `lo`), the node's InternalIP and the `kubernetes` ClusterIP.
pub const API_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);
/// The bridge secondary networks attach to (type `bridge`, no address, no route).
pub const SECONDARY_BRIDGE: &str = "iprc-net1";
/// Where the whereabouts CNI keeps its pools (its kubeconfig's namespace), as installs do.
pub const WHEREABOUTS_NAMESPACE: &str = "kube-system";
/// The primary CNI network (Multus's conflist name).
pub const PRIMARY_NETWORK: &str = "ipreclaim-node";

const POD_BRIDGE: &str = "iprc-pods";
const POD_GATEWAY: &str = "198.18.64.1";
/// Locally administered.
const POD_BRIDGE_MAC: &str = "02:00:c6:12:40:01";
const POD_SUBNET: &str = "198.18.64.0/24";
const LOCK: &str = "/run/lock/ipreclaim-testenv-node.lock";
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// kube-controller-manager's `--node-monitor-grace-period`: how long after the kubelet's last
/// heartbeat the Node turns NotReady (Ready=Unknown).
pub const NODE_MONITOR_GRACE: Duration = Duration::from_secs(16);

/// A running node with its control plane.
pub struct Node {
    /// The control plane the node registers with (admin client: [`ControlPlane::client`]).
    pub cp: ControlPlane,
    dir: PathBuf,
    changes: Changes,
    containerd: Containerd,
    kubelet: Mutex<Option<Child>>,
    kubelet_cmd: Vec<String>,
    /// The kubelet's way to the apiserver (cut to partition it).
    kubelet_link: Link,
    others: Mutex<Vec<Child>>,
    _lock: std::fs::File,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("dir", &self.dir).finish()
    }
}

fn take_lock() -> Result<std::fs::File> {
    std::fs::create_dir_all(Path::new(LOCK).parent().expect("lock has a parent"))?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK)
        .with_context(|| format!("open {LOCK}"))?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(LOCK).unwrap_or_default();
        bail!(
            "another process runs a real node on this machine ({LOCK} is held by pid {}): one \
             kubelet per machine; wait for it to finish or stop it",
            holder.trim()
        );
    }
    std::fs::write(LOCK, std::process::id().to_string())?;
    Ok(file)
}

/// The Service range, which holds the apiserver's address.
fn service_range() -> String {
    Options::for_node(API_ADDRESS, NODE_NAME).service_cluster_ip_range
}

/// The CNI setup: plugins linked into `bin`, Multus's conflist in `conf`.
fn write_cni(dir: &Path, cp: &ControlPlane, bin: &Path, conf: &Path) -> Result<()> {
    std::fs::create_dir_all(bin)?;
    std::fs::create_dir_all(conf)?;
    link_host_cni_plugins(bin, &["loopback", "bridge", "host-local"])?;
    for plugin in ["multus", "whereabouts"] {
        let link = bin.join(plugin);
        if !link.exists() {
            std::os::unix::fs::symlink(binary(plugin)?, &link)?;
        }
    }
    let kubeconfig = dir.join("cni.kubeconfig");
    cp.write_admin_kubeconfig_in(WHEREABOUTS_NAMESPACE, &kubeconfig)?;
    let d = |p: &str| dir.join(p).display().to_string();
    let multus = serde_json::json!({
        "cniVersion": "0.3.1",
        "name": PRIMARY_NETWORK,
        "plugins": [{
            "type": "multus",
            "cniVersion": "0.3.1",
            "name": PRIMARY_NETWORK,
            "kubeconfig": kubeconfig,
            "confDir": d("multus.d"),
            "cniDir": d("multus-cache"),
            "binDir": bin,
            "logFile": d("multus.log"),
            "logLevel": "verbose",
            "delegates": [{
                "cniVersion": "0.3.1",
                "name": "pods",
                "type": "bridge",
                "bridge": POD_BRIDGE,
                "isGateway": false,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                    // Only the Service range (the apiserver's address is in it, and
                    // kube-proxy rewrites the others to pods): no route out of the pods.
                    "routes": [{"dst": service_range()}],
                    "dataDir": d("host-local"),
                },
            }],
        }],
    });
    std::fs::create_dir_all(dir.join("multus.d"))?;
    write_file(
        &conf.join("00-multus.conflist"),
        serde_json::to_vec_pretty(&multus)?,
    )?;
    // whereabouts' flat file: NADs name it with `configuration_path`.
    write_file(
        &dir.join("whereabouts.conf"),
        serde_json::to_vec_pretty(&serde_json::json!({
            "datastore": "kubernetes",
            "kubernetes": {"kubeconfig": kubeconfig},
            "log_file": d("whereabouts.log"),
            "log_level": "debug",
        }))?,
    )
}

fn kubelet_config(dir: &Path, cp: &ControlPlane, socket: &Path) -> Result<String> {
    let d = |p: &str| dir.join(p).display().to_string();
    let port = free_port()?;
    let config = serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": false,
        "failSwapOn": false,
        "evictionHard": {},
        "address": API_ADDRESS.to_string(),
        "port": port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": cp.dir().join("ca.pem")},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": format!("unix://{}", socket.display()),
        "podLogsDir": d("pod-logs"),
        "volumePluginDir": d("volume-plugins"),
        "clusterDomain": "cluster.local",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "registerNode": true,
        // A short lease and status period, with kube-controller-manager's short grace: a killed
        // kubelet makes the Node NotReady in about 16 s instead of 50 s.
        "nodeLeaseDurationSeconds": 8,
        "nodeStatusUpdateFrequency": "4s",
    });
    let path = dir.join("kubelet.yaml");
    write_file(&path, serde_json::to_vec_pretty(&config)?)?;
    Ok(path.display().to_string())
}

impl Node {
    /// The node of this test process, started on first use; panics with the reason (and how to
    /// fix it) when it cannot start. It is stopped, and the host put back, when the process
    /// exits.
    pub fn shared() -> &'static Node {
        static SHARED: OnceLock<Result<Node, String>> = OnceLock::new();
        let started = SHARED.get_or_init(|| {
            let r = std::thread::spawn(|| Node::start().map_err(|e| format!("{e:#}")))
                .join()
                .unwrap_or_else(|_| Err("node start panicked".into()));
            if r.is_ok() {
                extern "C" fn stop_at_exit() {
                    if let Some(Ok(node)) = SHARED.get() {
                        let _ = std::thread::scope(|s| s.spawn(|| node.stop()).join());
                    }
                }
                // SAFETY: registers a plain extern "C" fn; it runs once at exit.
                unsafe { libc::atexit(stop_at_exit) };
            }
            r
        });
        match started {
            Ok(node) => node,
            Err(e) => panic!("testenv: cannot start the node: {e}"),
        }
    }

    /// Starts the node (blocking; call it outside an async runtime). Takes the machine's node
    /// lock, puts back what a killed run left, then makes its host changes and starts it all.
    pub fn start() -> Result<Node> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("a real node needs root (kubelet, containerd, bridges, cgroups)");
        }
        let lock = take_lock()?;
        if let Some(left) = Changes::leftover()? {
            eprintln!(
                "testenv: putting back what a killed node run left ({})",
                left.dir.display()
            );
            left.put_back()?;
        }
        for bin in [
            "kubelet",
            "kube-controller-manager",
            "kube-scheduler",
            "kube-proxy",
            "multus",
            "whereabouts",
        ] {
            binary(bin)?;
        }
        let dir = workspace_root().join("target/testenv/node");
        if dir.exists() {
            host::unmount_under(&dir)?;
            std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir)?;
        let containerd_dir = dir.join("containerd");
        std::fs::create_dir_all(&containerd_dir)?;
        let changes = Changes {
            dir: dir.clone(),
            containerd_socket: containerd_dir.join("containerd.sock"),
            lo_addresses: vec![format!("{API_ADDRESS}/32")],
            bridges: vec![POD_BRIDGE.into(), SECONDARY_BRIDGE.into()],
            sysctls: host::read_sysctls()?,
            cni_networks: vec![PRIMARY_NETWORK.into(), "cni-loopback".into()],
            cni_results_before: host::cni_results(),
            proxy_sysctls: host::read_sysctls_of(&host::PROXY_SYSCTLS)?,
        };
        changes.record()?;
        match Self::start_recorded(dir, containerd_dir, changes.clone(), lock) {
            Ok(node) => Ok(node),
            Err(e) => {
                if let Err(back) = changes.put_back() {
                    eprintln!("testenv: {back:#}");
                }
                Err(e)
            }
        }
    }

    fn start_recorded(
        dir: PathBuf,
        containerd_dir: PathBuf,
        changes: Changes,
        lock: std::fs::File,
    ) -> Result<Node> {
        let started = Instant::now();
        host::ip(&["addr", "add", &format!("{API_ADDRESS}/32"), "dev", "lo"])?;
        // A fixed MAC: a bridge without one takes the lowest of its ports' MACs, so it changes
        // as pods come and go, and pods that cached the gateway's old MAC cannot open new
        // connections until their ARP entry expires (seen as 30 s connect timeouts to the
        // apiserver after a rollout).
        host::ip(&[
            "link",
            "add",
            POD_BRIDGE,
            "address",
            POD_BRIDGE_MAC,
            "type",
            "bridge",
        ])?;
        host::ip(&[
            "addr",
            "add",
            &format!("{POD_GATEWAY}/24"),
            "dev",
            POD_BRIDGE,
        ])?;
        host::ip(&["link", "set", POD_BRIDGE, "up"])?;
        host::ip(&["link", "add", SECONDARY_BRIDGE, "type", "bridge"])?;
        host::ip(&["link", "set", SECONDARY_BRIDGE, "up"])?;

        let cp = ControlPlane::start_with(Options::for_node(API_ADDRESS, NODE_NAME))?;
        let cni_bin = dir.join("cni-bin");
        let cni_conf = dir.join("cni-conf");
        write_cni(&dir, &cp, &cni_bin, &cni_conf)?;
        let containerd = Containerd::start_in(containerd_dir, &cni_bin, &cni_conf)?;

        let admin_kubeconfig = cp.kubeconfig_path().display().to_string();
        let pki = |f: &str| cp.dir().join(f).display().to_string();
        let mut kcm = Command::new(binary("kube-controller-manager")?);
        kcm.args([
            format!("--kubeconfig={admin_kubeconfig}"),
            format!("--authentication-kubeconfig={admin_kubeconfig}"),
            format!("--authorization-kubeconfig={admin_kubeconfig}"),
            "--controllers=*".into(),
            "--use-service-account-credentials=true".into(),
            format!("--service-account-private-key-file={}", pki("sa-key.pem")),
            format!("--root-ca-file={}", pki("ca.pem")),
            format!("--cluster-signing-cert-file={}", pki("ca.pem")),
            format!("--cluster-signing-key-file={}", pki("ca-key.pem")),
            "--leader-elect=false".into(),
            format!(
                "--node-monitor-grace-period={}s",
                NODE_MONITOR_GRACE.as_secs()
            ),
            "--node-monitor-period=1s".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            "--v=1".into(),
        ]);
        let mut scheduler = Command::new(binary("kube-scheduler")?);
        scheduler.args([
            format!("--kubeconfig={admin_kubeconfig}"),
            format!("--authentication-kubeconfig={admin_kubeconfig}"),
            format!("--authorization-kubeconfig={admin_kubeconfig}"),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            "--v=1".into(),
        ]);
        let others = vec![
            spawn_supervised(kcm, &dir.join("kube-controller-manager.log"))?,
            spawn_supervised(scheduler, &dir.join("kube-scheduler.log"))?,
        ];

        let kubelet_kubeconfig = dir.join("kubelet.kubeconfig");
        // Through a link a test can cut: a partitioned kubelet keeps running, and keeps its
        // copy of the pods, where a killed one forgets them.
        let kubelet_link = Link::start(std::net::SocketAddr::from((API_ADDRESS, 443)))?;
        cp.write_kubelet_kubeconfig_via(
            &kubelet_kubeconfig,
            &format!("https://{}", kubelet_link.addr()),
        )?;
        let config = kubelet_config(&dir, &cp, &containerd.socket)?;
        let kubelet_cmd = vec![
            binary("kubelet")?.display().to_string(),
            format!("--config={config}"),
            format!("--kubeconfig={}", kubelet_kubeconfig.display()),
            format!("--hostname-override={NODE_NAME}"),
            format!("--node-ip={API_ADDRESS}"),
            format!("--root-dir={}", dir.join("kubelet").display()),
            "--v=2".into(),
        ];
        let node = Node {
            cp,
            dir,
            changes,
            containerd,
            kubelet: Mutex::new(None),
            kubelet_cmd,
            kubelet_link,
            others: Mutex::new(others),
            _lock: lock,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            node.start_kubelet().await?;
            node.wait_default_service_account().await
        })?;
        node.start_kube_proxy()?;
        eprintln!(
            "testenv: node {NODE_NAME} ready in {:.1}s ({})",
            started.elapsed().as_secs_f64(),
            node.dir.display()
        );
        Ok(node)
    }

    /// The node's directory (logs: kubelet.log, containerd/containerd.log, multus.log,
    /// whereabouts.log, kube-*.log, pod-logs-at-stop/; the control plane's are under
    /// [`ControlPlane::dir`]).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CRI socket of the node's containerd (the node agent's `--cri-endpoint`).
    pub fn cri_socket(&self) -> &Path {
        &self.containerd.socket
    }

    /// The node's containerd.
    pub fn containerd(&self) -> &Containerd {
        &self.containerd
    }

    /// whereabouts' flat configuration file: NAD configs name it as `configuration_path`.
    pub fn whereabouts_conf(&self) -> PathBuf {
        self.dir.join("whereabouts.conf")
    }

    /// Whether libcni still caches an ADD result of any of `sandboxes` on the primary network
    /// (it drops it once their CNI DEL succeeded).
    pub fn cni_result_cached_for<S: AsRef<str>>(
        &self,
        sandboxes: impl IntoIterator<Item = S>,
    ) -> bool {
        sandboxes.into_iter().any(|id| {
            Path::new("/var/lib/cni/results")
                .join(format!("{PRIMARY_NETWORK}-{}-eth0", id.as_ref()))
                .exists()
        })
    }

    /// An admin client of the node's control plane.
    pub async fn client(&self) -> Client {
        self.cp.client().await
    }

    /// Starts the kubelet (if it is not running) and waits for the Node to be Ready, then puts
    /// back the sysctls it set.
    pub async fn start_kubelet(&self) -> Result<()> {
        {
            let mut kubelet = self.kubelet.lock().expect("kubelet lock");
            if kubelet.is_none() {
                let mut cmd = Command::new(&self.kubelet_cmd[0]);
                cmd.args(&self.kubelet_cmd[1..]);
                *kubelet = Some(spawn_supervised(cmd, &self.dir.join("kubelet.log"))?);
            }
        }
        self.wait_node_ready(true).await?;
        host::restore_sysctls(&self.changes.sysctls)
    }

    /// kube-proxy in iptables mode, so that Service addresses reach pods (the `kubernetes`
    /// Service needs none: its address is the apiserver's). Every Service connection is
    /// masqueraded (`--masquerade-all`): a reply from a pod on the same bridge then goes back
    /// through the host, which rewrites it. It sets no sysctl (conntrack and localhost node
    /// ports are left alone); its `KUBE-*` chains go with [`host::remove_kube_chains`].
    fn start_kube_proxy(&self) -> Result<()> {
        let was_forwarding = self.changes.proxy_sysctls.get("net.ipv4.ip_forward");
        let was_forwarding = was_forwarding.is_some_and(|v| v == "1");
        host::forward_within(POD_BRIDGE, &service_range(), was_forwarding)?;
        let mut proxy = Command::new(binary("kube-proxy")?);
        proxy.args([
            format!("--kubeconfig={}", self.cp.kubeconfig_path().display()),
            format!("--hostname-override={NODE_NAME}"),
            "--proxy-mode=iptables".into(),
            format!("--cluster-cidr={POD_SUBNET}"),
            "--masquerade-all".into(),
            "--conntrack-max-per-core=0".into(),
            "--conntrack-tcp-timeout-established=0".into(),
            "--conntrack-tcp-timeout-close-wait=0".into(),
            "--iptables-localhost-nodeports=false".into(),
            format!("--healthz-bind-address=127.0.0.1:{}", free_port()?),
            format!("--metrics-bind-address=127.0.0.1:{}", free_port()?),
            "--v=2".into(),
        ]);
        let child = spawn_supervised(proxy, &self.dir.join("kube-proxy.log"))?;
        self.others.lock().expect("others lock").push(child);
        Ok(())
    }

    /// Starts containerd and the kubelet where they are down (a scenario that crashed the node
    /// and failed before bringing it back) and waits for the Node to be Ready.
    pub async fn ensure_running(&self) -> Result<()> {
        self.kubelet_link.heal();
        self.containerd.restart().await?;
        self.start_kubelet().await
    }

    /// Partitions the kubelet from the control plane: its connections to the apiserver are cut
    /// and new ones go unanswered, while the kubelet, its pods and its memory of them live on
    /// (the Node turns NotReady after [`NODE_MONITOR_GRACE`]).
    pub fn cut_kubelet_off(&self) {
        self.kubelet_link.cut();
    }

    /// Ends [`cut_kubelet_off`](Self::cut_kubelet_off): the kubelet dials the apiserver again.
    pub fn reconnect_kubelet(&self) {
        self.kubelet_link.heal();
    }

    /// Kills the kubelet with SIGKILL, as a node crash does: no pod is torn down, no CNI DEL.
    pub fn kill_kubelet(&self) -> Result<()> {
        if let Some(mut k) = self.kubelet.lock().expect("kubelet lock").take() {
            k.kill()?;
            k.wait()?;
        }
        Ok(())
    }

    /// What a reboot does to the runtime: kubelet and containerd killed, every pod process and
    /// shim gone, containerd's state directory (tasks, network namespaces) emptied; its root
    /// (metadata, images) and the kubelet's directory stay. Then both start again and the Node
    /// is Ready. Pods' sandboxes are recreated by the kubelet.
    pub async fn reboot(&self) -> Result<()> {
        self.kill_kubelet()?;
        self.containerd.kill()?;
        host::kill_pod_processes()?;
        host::kill_shims(&self.containerd.socket)?;
        let state = self.containerd.state_dir();
        host::unmount_under(&state)?;
        host::unmount_under(&self.dir.join("kubelet"))?;
        if state.exists() {
            std::fs::remove_dir_all(&state)?;
        }
        self.containerd.restart().await?;
        self.start_kubelet().await
    }

    /// Waits until the Node's Ready condition is `ready` (True) or not (False/Unknown).
    pub async fn wait_node_ready(&self, ready: bool) -> Result<()> {
        let nodes = Api::<NodeObject>::all(self.client().await);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let status = nodes
                .get_opt(NODE_NAME)
                .await
                .ok()
                .flatten()
                .and_then(|n| n.status?.conditions)
                .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
                .map(|c| c.status);
            if (status.as_deref() == Some("True")) == ready && status.is_some() {
                return Ok(());
            }
            if let Some(k) = self.kubelet.lock().expect("kubelet lock").as_mut()
                && let Some(exit) = k.try_wait()?
            {
                bail!(
                    "kubelet exited ({exit}); see {}",
                    self.dir.join("kubelet.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "node {NODE_NAME} not {} after {READY_TIMEOUT:?} (Ready={status:?}); see {}",
                    if ready { "Ready" } else { "NotReady" },
                    self.dir.join("kubelet.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn wait_default_service_account(&self) -> Result<()> {
        let sas = Api::<ServiceAccount>::namespaced(self.client().await, "default");
        let deadline = Instant::now() + READY_TIMEOUT;
        while sas.get_opt("default").await?.is_none() {
            if Instant::now() > deadline {
                bail!("no default ServiceAccount: is kube-controller-manager running?");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(())
    }

    /// Stops everything and puts the host back. Pods are deleted while the kubelet still runs
    /// (so their CNI DEL and unmounts happen), then the rest is stopped and undone.
    pub fn stop(&self) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // The kubelet removes a deleted pod's logs: keep a copy for whoever reads a failure.
        let _ = Command::new("cp")
            .arg("-a")
            .arg(self.dir.join("pod-logs"))
            .arg(self.dir.join("pod-logs-at-stop"))
            .status();
        if let Err(e) = rt.block_on(self.delete_all_pods()) {
            eprintln!("testenv: node stop: deleting pods: {e:#}");
        }
        // Each step best-effort: the host is put back whatever failed before.
        if let Err(e) = self.kill_kubelet() {
            eprintln!("testenv: node stop: killing the kubelet: {e:#}");
        }
        for mut c in self.others.lock().expect("others lock").drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Err(e) = rt.block_on(self.containerd.remove_all_sandboxes()) {
            eprintln!("testenv: node stop: removing sandboxes: {e:#}");
        }
        if let Err(e) = self.containerd.stop() {
            eprintln!("testenv: node stop: stopping containerd: {e:#}");
        }
        self.changes.put_back()
    }

    /// Stops the controllers that would recreate pods, deletes every pod, and waits (bounded)
    /// until the runtime has no ready sandbox left.
    async fn delete_all_pods(&self) -> Result<()> {
        if self.kubelet.lock().expect("kubelet lock").is_none() {
            return Ok(());
        }
        if let Some(kcm) = self.others.lock().expect("others lock").first_mut() {
            let _ = kcm.kill();
        }
        let client = self.client().await;
        let pods = Api::<Pod>::all(client.clone());
        for p in pods.list(&ListParams::default()).await?.items {
            let (Some(ns), Some(name)) = (p.metadata.namespace, p.metadata.name) else {
                continue;
            };
            let _ = Api::<Pod>::namespaced(client.clone(), &ns)
                .delete(&name, &DeleteParams::default().grace_period(0))
                .await;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut cri = self.containerd.client().await?;
        loop {
            let ready = cri
                .list_pod_sandbox(k8s_cri::v1::ListPodSandboxRequest::default())
                .await?
                .into_inner()
                .items
                .iter()
                .filter(|s| s.state == k8s_cri::v1::PodSandboxState::SandboxReady as i32)
                .count();
            if ready == 0 || Instant::now() > deadline {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
