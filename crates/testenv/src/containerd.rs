//! A real containerd (Debian's package) with its own root, state and socket, a sandbox image
//! built here from a static binary and imported locally (nothing is pulled), and a CNI plugin
//! that only reports one address per sandbox from a benchmark range.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ImageSpec, LinuxPodSandboxConfig,
    ListPodSandboxRequest, PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest,
    PodSandboxStatusResponse, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopPodSandboxRequest, VersionRequest,
};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::image;
use crate::procs::{run, run_dir, spawn_supervised};

/// The sandbox image name: fully qualified, with no short-name tag beside it.
pub const SANDBOX_IMAGE: &str = "localhost/ipreclaim/pause:1";
/// An image whose process ignores SIGTERM (it logs each one): the kubelet must wait a pod's
/// whole termination grace period before its SIGKILL, StopPodSandbox and CNI DEL.
pub const IGNORE_SIGTERM_IMAGE: &str = "localhost/ipreclaim/ignore-sigterm:1";
/// The CNI network name the test plugin serves.
pub const CNI_NETWORK: &str = "ipreclaim-test";
/// The range the test CNI plugin hands addresses out of (benchmark range: data only).
pub const CNI_SUBNET: &str = "198.18.0.0/16";

const CONTAINERD: &str = "/usr/bin/containerd";
const CTR: &str = "/usr/bin/ctr";
const CNI_PLUGINS: &str = "/usr/lib/cni";
const READY_TIMEOUT: Duration = Duration::from_secs(60);

const PAUSE_C: &str = r#"
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; exit(0); }
int main(void) {
    signal(SIGINT, quit);
    signal(SIGTERM, quit);
    for (;;) pause();
}
"#;

/// Logs each SIGTERM (and SIGINT) and goes on waiting; only SIGKILL ends it.
const IGNORE_SIGTERM_C: &str = r#"
#include <signal.h>
#include <string.h>
#include <unistd.h>
static void ignored(int sig) {
    static const char term[] = "SIGTERM received, ignored\n";
    static const char other[] = "signal received, ignored\n";
    if (sig == SIGTERM) write(1, term, sizeof term - 1);
    else write(1, other, sizeof other - 1);
}
int main(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = ignored;
    sigaction(SIGTERM, &sa, 0);
    sigaction(SIGINT, &sa, 0);
    static const char up[] = "running; SIGTERM is ignored\n";
    write(1, up, sizeof up - 1);
    for (;;) pause();
}
"#;

const CNI_PLUGIN: &str = r#"#!/bin/bash
# Test CNI plugin: hands out one address per ADD from a counter and sets up nothing.
set -euo pipefail
cat >/dev/null
state="@STATE@"
case "${CNI_COMMAND:-}" in
  ADD)
    exec 9>"$state/lock"
    flock 9
    n=$(cat "$state/next" 2>/dev/null || echo 0)
    echo $((n + 1)) >"$state/next"
    echo "$CNI_CONTAINERID $n" >>"$state/leases"
    printf '{"cniVersion":"1.0.0","ips":[{"address":"198.18.%d.%d/16"}]}' $((n / 250)) $((n % 250 + 2))
    ;;
  DEL|CHECK|GC|STATUS) ;;
  VERSION) echo '{"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0"]}' ;;
  *) echo '{"cniVersion":"1.0.0","code":4,"msg":"unknown CNI_COMMAND"}'; exit 1 ;;
esac
"#;

/// A running containerd with the CRI plugin.
pub struct Containerd {
    dir: PathBuf,
    /// The CRI (and containerd) socket.
    pub socket: PathBuf,
    child: Mutex<Option<Child>>,
}

impl std::fmt::Debug for Containerd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Containerd")
            .field("socket", &self.socket)
            .finish()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let running = self.child.lock().map(|c| c.is_some()).unwrap_or(false);
        if running {
            // Remove the sandboxes first, or their shims and mounts outlive the test.
            let _ = std::thread::scope(|s| {
                s.spawn(|| -> Result<()> {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    rt.block_on(self.remove_all_sandboxes())
                })
                .join()
            });
        }
        let _ = self.stop();
    }
}

/// Compiles C program `source` as a static binary `/<name>` and packs it alone as image
/// `image_name` (an OCI image archive for `ctr import`, run as root) in `dir`.
fn build_static_image(dir: &Path, name: &str, source: &str, image_name: &str) -> Result<PathBuf> {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source)?;
    let bin = dir.join(name);
    run(Command::new("cc")
        .args(["-static", "-Os", "-o"])
        .arg(&bin)
        .arg(&src))
    .with_context(|| format!("build the static {name} binary (needs gcc and libc6-dev)"))?;
    let path = dir.join(format!("{name}-image.tar"));
    let entrypoint = format!("/{name}");
    let files = [image::File::from_host_to(&bin, &entrypoint)?];
    let config = image::Config {
        name: image_name,
        entrypoint: &[&entrypoint],
        cmd: &[],
        user: "",
    };
    image::write_oci_archive(&files, &config, &path)?;
    Ok(path)
}

/// Compiles the static pause binary and packs it as an OCI image archive for `ctr import`.
pub fn build_sandbox_image(dir: &Path) -> Result<PathBuf> {
    build_static_image(dir, "pause", PAUSE_C, SANDBOX_IMAGE)
}

/// The [`IGNORE_SIGTERM_IMAGE`] as an OCI image archive in `dir`, for `ctr import`.
pub fn build_ignore_sigterm_image(dir: &Path) -> Result<PathBuf> {
    build_static_image(
        dir,
        "ignore-sigterm",
        IGNORE_SIGTERM_C,
        IGNORE_SIGTERM_IMAGE,
    )
}

/// The test CNI setup: `loopback` and the IP-only plugin in `dir/cni-bin`, its conflist in
/// `dir/cni-conf`. Returns (bin dir, conf dir).
fn install_test_cni(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let cni_bin = dir.join("cni-bin");
    let cni_conf = dir.join("cni-conf");
    let cni_state = dir.join("cni-state");
    for d in [&cni_bin, &cni_conf, &cni_state] {
        std::fs::create_dir_all(d)?;
    }
    link_host_cni_plugins(&cni_bin, &["loopback"])?;
    let plugin = cni_bin.join("ipreclaim-test-ip");
    std::fs::write(
        &plugin,
        CNI_PLUGIN.replace("@STATE@", &cni_state.display().to_string()),
    )?;
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755))?;
    std::fs::write(
        cni_conf.join("10-ipreclaim-test.conflist"),
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": CNI_NETWORK,
            "plugins": [{ "type": "ipreclaim-test-ip", "subnet": CNI_SUBNET }],
        })
        .to_string(),
    )?;
    Ok((cni_bin, cni_conf))
}

/// Links Debian's containernetworking-plugins `names` into `cni_bin`.
pub fn link_host_cni_plugins(cni_bin: &Path, names: &[&str]) -> Result<()> {
    for name in names {
        let plugin = Path::new(CNI_PLUGINS).join(name);
        if !plugin.is_file() {
            bail!(
                "{} not found: apt-get install containernetworking-plugins",
                plugin.display()
            );
        }
        let link = cni_bin.join(name);
        if !link.exists() {
            std::os::unix::fs::symlink(&plugin, &link)?;
        }
    }
    Ok(())
}

fn write_config(dir: &Path, socket: &Path, cni_bin: &Path, cni_conf: &Path) -> Result<PathBuf> {
    let d = |p: &str| dir.join(p).display().to_string();
    let config = format!(
        r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = "{debug}"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{image}"
  restrict_oom_score_adj = true
  # Network namespaces under our state, not /run/netns: a stop or a "reboot" cleans them.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"#,
        root = d("root"),
        state = d("state"),
        socket = socket.display(),
        debug = d("debug.sock"),
        opt = d("opt"),
        image = SANDBOX_IMAGE,
        cni_bin = cni_bin.display(),
        cni_conf = cni_conf.display(),
    );
    let path = dir.join("config.toml");
    std::fs::File::create(&path)?.write_all(config.as_bytes())?;
    Ok(path)
}

async fn connect(socket: &Path) -> Result<Channel> {
    let socket = socket.to_path_buf();
    Ok(Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await?)
}

impl Containerd {
    /// Starts containerd as root with everything under a directory of its own, imports the
    /// sandbox image, and waits until the CRI answers. Blocking: call it outside a runtime or
    /// via `spawn_blocking`. Fails with the reason (never skips) when it cannot.
    pub fn start() -> Result<Containerd> {
        let dir = run_dir("containerd")?;
        let (cni_bin, cni_conf) = install_test_cni(&dir)?;
        Self::start_in(dir, &cni_bin, &cni_conf)
    }

    /// [`start`](Self::start) in `dir` with the CNI plugins of `cni_bin` and the network
    /// configs of `cni_conf`.
    pub fn start_in(dir: PathBuf, cni_bin: &Path, cni_conf: &Path) -> Result<Containerd> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("containerd tests must run as root (containerd and runc need it)");
        }
        for bin in [CONTAINERD, CTR] {
            if !Path::new(bin).is_file() {
                bail!("{bin} not found: apt-get install containerd runc");
            }
        }
        std::fs::create_dir_all(dir.join("pod-logs"))?;
        let socket = dir.join("containerd.sock");
        let image = build_sandbox_image(&dir)?;
        let config = write_config(&dir, &socket, cni_bin, cni_conf)?;
        let mut cmd = Command::new(CONTAINERD);
        cmd.arg("--config").arg(&config);
        let child = spawn_supervised(cmd, &dir.join("containerd.log"))?;
        let c = Containerd {
            dir,
            socket,
            child: Mutex::new(Some(child)),
        };
        c.wait_ready_blocking()?;
        c.import_image(&image).context("import the sandbox image")?;
        Ok(c)
    }

    /// Imports an OCI image archive (see [`crate::image`]) into the CRI's namespace.
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        run(Command::new(CTR)
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", "k8s.io", "images", "import"])
            .arg(archive))
    }

    /// [`start`](Self::start) from async code; a test that cannot get containerd fails with
    /// the reason.
    pub async fn start_for_test() -> Containerd {
        tokio::task::spawn_blocking(Containerd::start)
            .await
            .expect("containerd start task")
            .unwrap_or_else(|e| panic!("cannot start containerd: {e:#}"))
    }

    /// A pod sandbox config for `namespace/name` with `uid`, logging under this containerd's
    /// directory.
    pub fn sandbox_config(&self, name: &str, uid: &str, namespace: &str) -> PodSandboxConfig {
        let log_dir = self.dir.join("pod-logs");
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: uid.into(),
                namespace: namespace.into(),
                attempt: 0,
            }),
            hostname: name.into(),
            log_directory: log_dir.display().to_string(),
            linux: Some(LinuxPodSandboxConfig::default()),
            ..Default::default()
        }
    }

    /// Runs a pod sandbox for `namespace/name` with `uid` (CRI RunPodSandbox with
    /// [`sandbox_config`](Self::sandbox_config)) and returns its id.
    pub async fn run_sandbox(&self, name: &str, uid: &str, namespace: &str) -> Result<String> {
        let config = self.sandbox_config(name, uid, namespace);
        let id = self
            .client()
            .await?
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config),
                runtime_handler: String::new(),
            })
            .await
            .with_context(|| {
                format!(
                    "RunPodSandbox {namespace}/{name}; see {}",
                    self.log_path().display()
                )
            })?
            .into_inner()
            .pod_sandbox_id;
        Ok(id)
    }

    /// Creates and starts container `name` of the [`SANDBOX_IMAGE`] in sandbox `sandbox_id`,
    /// which [`run_sandbox`](Self::run_sandbox) made for `namespace/pod` with `uid`; returns
    /// the container's id.
    pub async fn run_container(
        &self,
        sandbox_id: &str,
        name: &str,
        (pod, uid, namespace): (&str, &str, &str),
    ) -> Result<String> {
        let mut client = self.client().await?;
        let id = client
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox_id.into(),
                config: Some(ContainerConfig {
                    metadata: Some(ContainerMetadata {
                        name: name.into(),
                        attempt: 0,
                    }),
                    image: Some(ImageSpec {
                        image: SANDBOX_IMAGE.into(),
                        ..Default::default()
                    }),
                    log_path: format!("{name}.log"),
                    ..Default::default()
                }),
                sandbox_config: Some(self.sandbox_config(pod, uid, namespace)),
            })
            .await
            .with_context(|| format!("CreateContainer {name} in {sandbox_id}"))?
            .into_inner()
            .container_id;
        client
            .start_container(StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .with_context(|| format!("StartContainer {name} in {sandbox_id}"))?;
        Ok(id)
    }

    /// Stops sandbox `id` (CRI StopPodSandbox): NOTREADY, its network torn down.
    pub async fn stop_sandbox(&self, id: &str) -> Result<()> {
        self.client()
            .await?
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await
            .with_context(|| format!("StopPodSandbox {id}"))?;
        Ok(())
    }

    /// Removes sandbox `id` (CRI RemovePodSandbox; stopped first when it runs).
    pub async fn remove_sandbox(&self, id: &str) -> Result<()> {
        self.client()
            .await?
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await
            .with_context(|| format!("RemovePodSandbox {id}"))?;
        Ok(())
    }

    /// Sandbox `id`'s status (CRI PodSandboxStatus, `verbose` adds containerd's info); the
    /// error is the CRI's status (NotFound for a removed sandbox).
    pub async fn sandbox_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<PodSandboxStatusResponse, tonic::Status> {
        let mut client = self
            .client()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("{e:#}")))?;
        Ok(client
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.into(),
                verbose,
            })
            .await?
            .into_inner())
    }

    fn wait_ready_blocking(&self) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(self.wait_ready())
    }

    /// Waits until the CRI Version call answers.
    pub async fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let last = match self.client().await {
                Ok(mut client) => match client.version(VersionRequest::default()).await {
                    Ok(_) => return Ok(()),
                    Err(e) => e.to_string(),
                },
                Err(e) => format!("{e:#}"),
            };
            if let Some(child) = self.child.lock().expect("containerd lock").as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "containerd exited ({status}); see {}",
                    self.log_path().display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd not ready after {READY_TIMEOUT:?}: {last}; see {}",
                    self.log_path().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A CRI runtime client over the unix socket.
    pub async fn client(&self) -> Result<RuntimeServiceClient<Channel>> {
        Ok(RuntimeServiceClient::new(connect(&self.socket).await?))
    }

    /// containerd's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("containerd.log")
    }

    /// The directory holding its root, state, config and the CNI plugin's state.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops and removes every pod sandbox (and so its containers).
    pub async fn remove_all_sandboxes(&self) -> Result<()> {
        let mut client = self.client().await?;
        let sandboxes = client
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await?
            .into_inner()
            .items;
        for sb in sandboxes {
            self.stop_sandbox(&sb.id).await?;
            self.remove_sandbox(&sb.id).await?;
        }
        Ok(())
    }

    /// Stops containerd (its sandboxes' shims keep running, as on a real node).
    pub fn stop(&self) -> Result<()> {
        if let Some(mut child) = self.child.lock().expect("containerd lock").take() {
            // SAFETY: sending SIGTERM to our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            child.wait()?;
        }
        Ok(())
    }

    /// Kills containerd with SIGKILL, as a crash or a reboot does (its shims keep running).
    pub fn kill(&self) -> Result<()> {
        if let Some(mut child) = self.child.lock().expect("containerd lock").take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Its state directory (sockets, task bundles, network namespaces): what a reboot empties.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Starts containerd again after [`stop`](Self::stop), with the same state.
    pub async fn restart(&self) -> Result<()> {
        {
            let mut guard = self.child.lock().expect("containerd lock");
            if guard.is_none() {
                let mut cmd = Command::new(CONTAINERD);
                cmd.arg("--config").arg(self.dir.join("config.toml"));
                *guard = Some(spawn_supervised(cmd, &self.log_path())?);
            }
        }
        self.wait_ready().await
    }
}
