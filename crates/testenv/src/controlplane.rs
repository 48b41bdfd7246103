//! A real kube-apiserver backed by a real etcd, on loopback ports, secure serving with a
//! generated CA, RBAC on, and service-account tokens that work.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};
use rand::Rng;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::procs::{
    ChildGuard, binary, free_port, run_dir, spawn_supervised, workspace_root, write_file,
};

/// How long to wait for etcd or kube-apiserver to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// How a control plane serves. The default serves tests on 127.0.0.1 and a free port; a real
/// node's serves where its pods reach it (see [`Options::for_node`]).
#[derive(Clone, Debug)]
pub struct Options {
    pub address: Ipv4Addr,
    /// A free port when `None`.
    pub secure_port: Option<u16>,
    pub service_cluster_ip_range: String,
    /// The node whose kubelet this control plane serves: Node authorization, NodeRestriction,
    /// ServiceAccount admission, a kubelet token and the certificates the kubelet and
    /// kube-controller-manager need.
    pub node_name: Option<String>,
    /// API Priority and Fairness on, as in production (off by default: a test process shares
    /// one control plane, and its priority levels would make tests wait on each other).
    pub priority_and_fairness: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            address: Ipv4Addr::LOCALHOST,
            secure_port: None,
            // Data only: no service traffic exists here.
            service_cluster_ip_range: "10.0.0.0/24".into(),
            node_name: None,
            priority_and_fairness: false,
        }
    }
}

impl Options {
    /// Serves on `address:443` with the service range `address/24` whose first address (the
    /// `kubernetes` Service's ClusterIP) is `address` itself, so in-cluster clients reach the
    /// apiserver without kube-proxy.
    pub fn for_node(address: Ipv4Addr, node_name: &str) -> Options {
        let [a, b, c, _] = address.octets();
        Options {
            address,
            secure_port: Some(443),
            service_cluster_ip_range: format!("{a}.{b}.{c}.0/24"),
            node_name: Some(node_name.into()),
            priority_and_fairness: false,
        }
    }
}

/// A running etcd + kube-apiserver.
pub struct ControlPlane {
    dir: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    admin_token: String,
    /// The kubelet's token (user `system:node:<name>`), when started for a node.
    kubelet_token: Option<String>,
    etcd: Mutex<Child>,
    etcd_cmd: Vec<String>,
    apiserver: Mutex<Child>,
    apiserver_cmd: Vec<String>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("dir", &self.dir)
            .finish()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for child in [&self.apiserver, &self.etcd] {
            if let Ok(mut c) = child.lock() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// A certificate for `sans` and `names` with `usage`, signed by `issuer`, as `<file>.pem` and
/// `<file>-key.pem` in `dir`.
fn issue_leaf(
    dir: &Path,
    file: &str,
    issuer: &Issuer<'_, KeyPair>,
    sans: Vec<String>,
    names: &[(DnType, &str)],
    usage: ExtendedKeyUsagePurpose,
) -> Result<()> {
    let mut params = CertificateParams::new(sans)?;
    for (kind, value) in names {
        params.distinguished_name.push(kind.clone(), *value);
    }
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    write_file(&dir.join(format!("{file}.pem")), cert.pem())?;
    write_file(&dir.join(format!("{file}-key.pem")), key.serialize_pem())
}

/// The CA (and its key, for kube-controller-manager's signer), the serving certificate for
/// `sans`, a client certificate the apiserver shows kubelets, and the service-account key, as
/// files in `dir`.
fn write_pki(dir: &Path, sans: Vec<String>) -> Result<()> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "ipreclaim-testenv-ca");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    write_file(&dir.join("ca-key.pem"), ca_key.serialize_pem())?;
    let issuer = Issuer::new(ca, ca_key);

    issue_leaf(
        dir,
        "apiserver",
        &issuer,
        sans,
        &[(DnType::CommonName, "kube-apiserver")],
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    issue_leaf(
        dir,
        "kubelet-client",
        &issuer,
        Vec::new(),
        &[
            (DnType::CommonName, "kube-apiserver-kubelet-client"),
            (DnType::OrganizationName, "system:masters"),
        ],
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    write_file(&dir.join("ca.pem"), ca_cert.pem())?;
    let sa_key = KeyPair::generate()?;
    write_file(&dir.join("sa-key.pem"), sa_key.serialize_pem())?;
    write_file(&dir.join("sa.pub"), sa_key.public_key_pem())?;
    Ok(())
}

fn random_suffix(len: usize) -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..len)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

impl ControlPlane {
    /// The control plane shared by every test of this process, started on first use.
    /// Panics with the reason (and how to fix it) if it cannot start.
    pub fn shared() -> &'static ControlPlane {
        static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
        let started = SHARED.get_or_init(|| {
            // Own thread: start() blocks on a runtime of its own, which cannot nest in a test's.
            std::thread::spawn(|| ControlPlane::start().map_err(|e| format!("{e:#}")))
                .join()
                .unwrap_or_else(|_| Err("control plane start panicked".into()))
        });
        match started {
            Ok(cp) => cp,
            Err(e) => panic!("testenv: cannot start the control plane: {e}"),
        }
    }

    /// Starts a private etcd + kube-apiserver (blocking; call it outside an async runtime or
    /// from `spawn_blocking`). They stop when it is dropped or the process exits.
    pub fn start() -> Result<ControlPlane> {
        Self::start_with(Options::default())
    }

    /// A private control plane ([`start`](Self::start)) from async code; a test that cannot
    /// get one fails with the reason.
    pub async fn start_for_test() -> ControlPlane {
        tokio::task::spawn_blocking(ControlPlane::start)
            .await
            .expect("control plane start task")
            .unwrap_or_else(|e| panic!("cannot start a private control plane: {e:#}"))
    }

    /// [`start`](Self::start) with `options`.
    pub fn start_with(options: Options) -> Result<ControlPlane> {
        // A port picked free can be taken (by an outgoing connection, another test run) before
        // etcd or the apiserver binds it: start again on new ports, unless the port was given.
        const ATTEMPTS: usize = 3;
        let mut attempt = 1;
        loop {
            match Self::start_once(options.clone()) {
                Err(e)
                    if attempt < ATTEMPTS
                        && options.secure_port.is_none()
                        && format!("{e:#}").contains("address already in use") =>
                {
                    eprintln!("testenv: a port was taken before the control plane bound it; again");
                    attempt += 1;
                }
                started => return started,
            }
        }
    }

    fn start_once(options: Options) -> Result<ControlPlane> {
        let etcd_bin = binary("etcd")?;
        let apiserver_bin = binary("kube-apiserver")?;
        let dir = run_dir("controlplane")?;
        let address = options.address.to_string();
        let mut sans = vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            "kubernetes.default.svc".to_string(),
            "kubernetes.default.svc.cluster.local".to_string(),
        ];
        if !sans.contains(&address) {
            sans.push(address.clone());
        }
        write_pki(&dir, sans)?;
        let admin_token = random_suffix(32);
        let mut tokens = format!("{admin_token},testenv-admin,testenv-admin,\"system:masters\"\n");
        let kubelet_token = options.node_name.as_ref().map(|node| {
            let token = random_suffix(32);
            tokens.push_str(&format!(
                "{token},system:node:{node},system:node:{node},\"system:nodes\"\n"
            ));
            token
        });
        write_file(&dir.join("tokens.csv"), tokens)?;

        let (client_port, peer_port) = (free_port()?, free_port()?);
        let secure_port = match options.secure_port {
            Some(p) => p,
            None => free_port()?,
        };
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd_cmd: Vec<String> = vec![
            etcd_bin.display().to_string(),
            "--name=testenv".into(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=testenv={peer_url}"),
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        let etcd = Self::spawn_etcd(&etcd_cmd, &dir)?;

        let d = |f: &str| dir.join(f).display().to_string();
        let mut apiserver_cmd: Vec<String> = vec![
            apiserver_bin.display().to_string(),
            format!("--etcd-servers={etcd_url}"),
            format!("--cert-dir={}", d("certs")),
            format!("--tls-cert-file={}", d("apiserver.pem")),
            format!("--tls-private-key-file={}", d("apiserver-key.pem")),
            format!("--client-ca-file={}", d("ca.pem")),
            format!("--token-auth-file={}", d("tokens.csv")),
            format!("--secure-port={secure_port}"),
            format!("--bind-address={address}"),
            format!("--advertise-address={address}"),
            format!(
                "--service-cluster-ip-range={}",
                options.service_cluster_ip_range
            ),
            "--allow-privileged=true".into(),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa-key.pem")),
            format!(
                "--enable-priority-and-fairness={}",
                options.priority_and_fairness
            ),
            "--v=1".into(),
        ];
        if options.node_name.is_some() {
            apiserver_cmd.extend([
                "--authorization-mode=Node,RBAC".into(),
                "--enable-admission-plugins=NodeRestriction".into(),
                format!("--kubelet-client-certificate={}", d("kubelet-client.pem")),
                format!("--kubelet-client-key={}", d("kubelet-client-key.pem")),
                // Else `kubectl logs` looks the node name up in DNS.
                "--kubelet-preferred-address-types=InternalIP".into(),
            ]);
        } else {
            apiserver_cmd.extend([
                // No kube-controller-manager mints tokens here.
                "--disable-admission-plugins=ServiceAccount".into(),
                "--authorization-mode=RBAC".into(),
            ]);
        }
        let cp = ControlPlane {
            server: format!("https://{address}:{secure_port}"),
            admin_token,
            kubelet_token,
            etcd: Mutex::new(etcd),
            etcd_cmd,
            apiserver: Mutex::new(Self::spawn_apiserver(&apiserver_cmd, &dir)?),
            apiserver_cmd,
            dir,
        };
        write_file(&cp.kubeconfig_path(), cp.kubeconfig_yaml(&cp.admin_token))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(cp.wait_ready())?;
        Ok(cp)
    }

    fn spawn_apiserver(cmd: &[String], dir: &Path) -> Result<Child> {
        let mut c = Command::new(&cmd[0]);
        c.args(&cmd[1..]);
        spawn_supervised(c, &dir.join("kube-apiserver.log"))
    }

    /// The directory with this control plane's certificates, logs and kubeconfig.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A kubeconfig file with admin credentials.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// A kubeconfig file for the kubelet of the node this control plane was started for.
    pub fn write_kubelet_kubeconfig(&self, path: &Path) -> Result<()> {
        self.write_kubelet_kubeconfig_via(path, &self.server)
    }

    /// The kubelet's kubeconfig with `server` as the apiserver's URL (a forwarder in front of
    /// it; the serving certificate names 127.0.0.1 too).
    pub fn write_kubelet_kubeconfig_via(&self, path: &Path, server: &str) -> Result<()> {
        let token = self
            .kubelet_token
            .as_ref()
            .context("this control plane was not started for a node")?;
        write_file(path, self.kubeconfig_yaml_for(server, token))
    }

    /// A kubeconfig with admin credentials whose context namespace is `namespace` (the
    /// whereabouts CNI keeps its pools in its kubeconfig's namespace).
    pub fn write_admin_kubeconfig_in(&self, namespace: &str, path: &Path) -> Result<()> {
        let yaml = self
            .kubeconfig_yaml(&self.admin_token)
            .replace("namespace: default", &format!("namespace: {namespace}"));
        write_file(path, yaml)
    }

    fn kubeconfig_yaml(&self, token: &str) -> String {
        self.kubeconfig_yaml_for(&self.server, token)
    }

    fn kubeconfig_yaml_for(&self, server: &str, token: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testenv\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n- name: testenv\n  context:\n    cluster: testenv\n    user: user\n    namespace: default\ncurrent-context: testenv\n",
            ca = self.dir.join("ca.pem").display(),
        )
    }

    async fn client_with_token(&self, token: &str) -> Result<Client> {
        self.client_for(&self.server, token).await
    }

    async fn client_for(&self, server: &str, token: &str) -> Result<Client> {
        Ok(Client::try_from(self.config_for(server, token).await?)?)
    }

    async fn config_for(&self, server: &str, token: &str) -> Result<Config> {
        let kubeconfig = Kubeconfig::from_yaml(&self.kubeconfig_yaml_for(server, token))?;
        Ok(Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?)
    }

    /// A client for the program under test, built as `ipreclaim` builds its own: without kube's
    /// retry of 429/503/504 answers, which would resend a write after the leadership gate
    /// passed it (the program's budgets and release retries decide every resend).
    async fn program_client_for(&self, server: &str, token: &str) -> Result<Client> {
        let mut config = self.config_for(server, token).await?;
        config.default_retry = false;
        Ok(Client::try_from(config)?)
    }

    /// An admin client for the program under test that goes through the fault proxy `proxy`
    /// (plain HTTP to it).
    pub async fn client_through_faults(&self, proxy: &crate::faultproxy::FaultProxy) -> Client {
        self.program_client_for(&proxy.url(), &self.admin_token)
            .await
            .expect("admin client through the fault proxy")
    }

    /// A kubeconfig with admin credentials whose server is the fault proxy `proxy`, context
    /// namespace `namespace` (for a controller process run through it).
    pub fn write_kubeconfig_through_faults(
        &self,
        proxy: &crate::faultproxy::FaultProxy,
        namespace: &str,
        path: &Path,
    ) -> Result<()> {
        let yaml = self
            .kubeconfig_yaml_for(&proxy.url(), &self.admin_token)
            .replace("namespace: default", &format!("namespace: {namespace}"));
        write_file(path, yaml)
    }

    /// An admin client (group system:masters). Create one per test: a client belongs to the
    /// tokio runtime it was made in.
    pub async fn client(&self) -> Client {
        self.client_with_token(&self.admin_token)
            .await
            .expect("admin client from a generated kubeconfig")
    }

    /// Waits until `/readyz` answers ok, failing early if the apiserver process exited.
    pub async fn wait_ready(&self) -> Result<()> {
        let client = self.client_with_token(&self.admin_token).await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let req = http::Request::get("/readyz").body(Vec::new())?;
            let last = match client.request_text(req).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => body,
                Err(e) => e.to_string(),
            };
            if let Some(status) = self.apiserver.lock().expect("apiserver lock").try_wait()? {
                bail!(
                    "kube-apiserver exited ({status}); last log lines:\n{}",
                    log_tail(&self.dir.join("kube-apiserver.log"))
                );
            }
            if let Some(status) = self.etcd.lock().expect("etcd lock").try_wait()? {
                bail!(
                    "etcd exited ({status}); last log lines:\n{}",
                    log_tail(&self.dir.join("etcd.log"))
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready after {READY_TIMEOUT:?} ({last}); last log lines:\n{}",
                    log_tail(&self.dir.join("kube-apiserver.log"))
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills kube-apiserver (etcd keeps the data) and starts it again on the same port.
    pub async fn restart_apiserver(&self) -> Result<()> {
        {
            let mut child = self.apiserver.lock().expect("apiserver lock");
            child.kill()?;
            child.wait()?;
            *child = Self::spawn_apiserver(&self.apiserver_cmd, &self.dir)?;
        }
        self.wait_ready().await
    }

    fn spawn_etcd(cmd: &[String], dir: &Path) -> Result<Child> {
        let mut etcd = Command::new(&cmd[0]);
        etcd.args(&cmd[1..]);
        spawn_supervised(etcd, &dir.join("etcd.log"))
    }

    /// Kills etcd (SIGKILL; its data stays on disk) and starts it again on the same ports; waits
    /// until kube-apiserver answers again.
    pub async fn restart_etcd(&self) -> Result<()> {
        {
            let mut child = self.etcd.lock().expect("etcd lock");
            child.kill()?;
            child.wait()?;
            *child = Self::spawn_etcd(&self.etcd_cmd, &self.dir)?;
        }
        self.wait_ready().await
    }

    /// Kills kube-apiserver and leaves it down until [`start_apiserver`](Self::start_apiserver).
    pub fn stop_apiserver(&self) -> Result<()> {
        let mut child = self.apiserver.lock().expect("apiserver lock");
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Starts kube-apiserver again after [`stop_apiserver`](Self::stop_apiserver).
    pub async fn start_apiserver(&self) -> Result<()> {
        {
            let mut child = self.apiserver.lock().expect("apiserver lock");
            *child = Self::spawn_apiserver(&self.apiserver_cmd, &self.dir)?;
        }
        self.wait_ready().await
    }

    /// Starts a second kube-apiserver on the same etcd (another port), as in an HA control
    /// plane; returns it with an admin client. It stops when dropped.
    pub async fn start_second_apiserver(&self) -> Result<(SecondApiServer, Client)> {
        let port = free_port()?;
        let cmd: Vec<String> = self
            .apiserver_cmd
            .iter()
            .map(|a| {
                if a.starts_with("--secure-port=") {
                    format!("--secure-port={port}")
                } else {
                    a.clone()
                }
            })
            .collect();
        let mut c = Command::new(&cmd[0]);
        c.args(&cmd[1..]);
        let child = spawn_supervised(c, &self.dir.join("kube-apiserver-2.log"))?;
        let second = SecondApiServer {
            _child: child.into(),
        };
        let server = format!("https://127.0.0.1:{port}");
        let client = self.client_for(&server, &self.admin_token).await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let req = http::Request::get("/readyz").body(Vec::new())?;
            if client
                .request_text(req)
                .await
                .is_ok_and(|b| b.trim() == "ok")
            {
                return Ok((second, client));
            }
            if Instant::now() > deadline {
                bail!("second kube-apiserver not ready after {READY_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Creates a fresh namespace named after `prefix` with a random suffix, and returns its name.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> String {
        let clean: String = prefix
            .to_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(50)
            .collect();
        let name = format!("{}-{}", clean.trim_matches('-'), random_suffix(6));
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        name
    }

    /// Applies every CRD in the workspace's `crds/` directory and waits until each is established.
    pub async fn install_crds(&self, client: &Client) -> Result<Vec<String>> {
        install_crds_from(client, &workspace_root().join("crds")).await
    }

    /// An admin client and a fresh namespace named after `prefix`.
    pub async fn client_and_namespace(&self, prefix: &str) -> (Client, String) {
        let client = self.client().await;
        let ns = self.namespace(&client, prefix).await;
        (client, ns)
    }

    /// An admin client with the CRDs of `crds/` installed, and a fresh namespace named after
    /// `prefix`: where most tests start. Fails the test if the CRDs cannot be installed.
    pub async fn client_crds_and_namespace(&self, prefix: &str) -> (Client, String) {
        let client = self.client().await;
        self.install_crds(&client).await.expect("install crds/");
        let ns = self.namespace(&client, prefix).await;
        (client, ns)
    }

    /// An admin client, a fresh namespace named after `prefix`, and a client acting as a new
    /// ServiceAccount `sa` of it, which no RBAC binds. Fails the test if it gets no token.
    pub async fn namespace_and_rightless_client(
        &self,
        prefix: &str,
        sa: &str,
    ) -> (Client, String, Client) {
        let (admin, ns) = self.client_and_namespace(prefix).await;
        let client = self
            .service_account_client(&admin, &ns, sa)
            .await
            .unwrap_or_else(|e| panic!("token of ServiceAccount {ns}/{sa}: {e:#}"));
        (admin, ns, client)
    }

    /// A client that acts as ServiceAccount `namespace/name` (created if missing), with a
    /// token from the TokenRequest API.
    pub async fn service_account_client(
        &self,
        admin: &Client,
        namespace: &str,
        name: &str,
    ) -> Result<Client> {
        let token = self.service_account_token(admin, namespace, name).await?;
        self.client_with_token(&token).await
    }

    /// A client that acts as ServiceAccount `namespace/name` with a token bound to pod `pod`
    /// (of that namespace, existing): the token a kubelet mounts, which the apiserver gives the
    /// pod's node when it is scheduled (`authentication.kubernetes.io/node-name` in the user's
    /// extra), and which dies with the pod.
    pub async fn pod_bound_client(
        &self,
        admin: &Client,
        namespace: &str,
        name: &str,
        pod: &Pod,
    ) -> Result<Client> {
        let bound = BoundObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: pod.metadata.name.clone(),
            uid: pod.metadata.uid.clone(),
        };
        let token = self
            .token_bound_to(admin, namespace, name, Some(bound))
            .await?;
        self.client_with_token(&token).await
    }

    /// A token (an hour long) of ServiceAccount `namespace/name`, created if missing.
    pub async fn service_account_token(
        &self,
        admin: &Client,
        namespace: &str,
        name: &str,
    ) -> Result<String> {
        self.token_bound_to(admin, namespace, name, None).await
    }

    async fn token_bound_to(
        &self,
        admin: &Client,
        namespace: &str,
        name: &str,
        bound: Option<BoundObjectReference>,
    ) -> Result<String> {
        let sas = Api::<ServiceAccount>::namespaced(admin.clone(), namespace);
        if sas.get_opt(name).await?.is_none() {
            let sa = ServiceAccount {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            sas.create(&PostParams::default(), &sa).await?;
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: Some(vec!["https://kubernetes.default.svc".into()]),
                expiration_seconds: Some(3600),
                bound_object_ref: bound,
            }),
            ..Default::default()
        };
        let token = sas
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .context("TokenRequest")?
            .status
            .and_then(|s| s.token)
            .ok_or_else(|| anyhow!("TokenRequest returned no token"))?;
        Ok(token)
    }

    /// What a program using client-go's in-cluster config needs, with admin credentials:
    /// `token` and `ca.crt` written into `dir` (mount or copy it to
    /// `/var/run/secrets/kubernetes.io/serviceaccount`), and the environment
    /// (`KUBERNETES_SERVICE_HOST`, `KUBERNETES_SERVICE_PORT`).
    pub fn write_in_cluster_credentials(&self, dir: &Path) -> Result<Vec<(String, String)>> {
        write_file(&dir.join("token"), &self.admin_token)?;
        std::fs::copy(self.dir.join("ca.pem"), dir.join("ca.crt"))
            .context("copying the CA certificate")?;
        let authority = self.server.trim_start_matches("https://");
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| anyhow!("no port in {}", self.server))?;
        Ok(vec![
            ("KUBERNETES_SERVICE_HOST".into(), host.into()),
            ("KUBERNETES_SERVICE_PORT".into(), port.into()),
        ])
    }

    /// A kubeconfig for `token` (for tools such as kubectl and helm run by tests).
    pub fn write_kubeconfig_for_token(&self, token: &str, path: &Path) -> Result<()> {
        write_file(path, self.kubeconfig_yaml(token))
    }
}

/// A second kube-apiserver on the same etcd; killed when dropped.
pub struct SecondApiServer {
    _child: ChildGuard,
}

/// Applies every `*.yaml` CRD document under `dir` and waits until each is established.
pub async fn install_crds_from(client: &Client, dir: &Path) -> Result<Vec<String>> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    entries.sort();
    if entries.is_empty() {
        bail!("no CRD YAML in {}", dir.display());
    }
    install_crd_files(client, &entries).await
}

/// Applies the CustomResourceDefinition documents of `files` (other kinds in them are
/// skipped) and waits until each is established.
pub async fn install_crd_files(client: &Client, files: &[PathBuf]) -> Result<Vec<String>> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut names = Vec::new();
    for path in files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        for doc in serde_norway::Deserializer::from_str(&text) {
            let value: serde_norway::Value = serde::Deserialize::deserialize(doc)?;
            if value.get("kind").and_then(|k| k.as_str()) != Some("CustomResourceDefinition") {
                continue;
            }
            let crd: CustomResourceDefinition = serde_norway::from_value(value)
                .with_context(|| format!("parse {}", path.display()))?;
            let name = crd.metadata.name.clone().context("CRD without a name")?;
            api.patch(
                &name,
                &PatchParams::apply("testenv").force(),
                &Patch::Apply(&crd),
            )
            .await
            .with_context(|| format!("apply CRD {name}"))?;
            names.push(name);
        }
    }
    for name in &names {
        let established = await_condition(api.clone(), name, conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established)
            .await
            .with_context(|| format!("CRD {name} not established in 30s"))??;
    }
    Ok(names)
}
