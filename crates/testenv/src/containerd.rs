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
    LinuxPodSandboxConfig, ListPodSandboxRequest, PodSandboxConfig, PodSandboxMetadata,
    RemovePodSandboxRequest, StopPodSandboxRequest, VersionRequest,
};
use sha2::{Digest, Sha256};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::procs::{run_dir, spawn_supervised};

/// The sandbox image name: fully qualified, with no short-name tag beside it.
pub const SANDBOX_IMAGE: &str = "localhost/ipreclaim/pause:1";
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

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Compiles the static pause binary and packs it as an OCI image archive for `ctr import`.
fn build_sandbox_image(dir: &Path) -> Result<PathBuf> {
    let src = dir.join("pause.c");
    std::fs::write(&src, PAUSE_C)?;
    let bin = dir.join("pause");
    run(Command::new("cc")
        .args(["-static", "-Os", "-o"])
        .arg(&bin)
        .arg(&src))
    .context("build the static pause binary (needs gcc and libc6-dev)")?;

    let mut layer = tar::Builder::new(Vec::new());
    let data = std::fs::read(&bin)?;
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o755);
    header.set_cksum();
    layer.append_data(&mut header, "pause", data.as_slice())?;
    let layer = layer.into_inner()?;
    let layer_digest = sha256_hex(&layer);

    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": ["/pause"] },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{layer_digest}")] },
    })
    .to_string();
    let config_digest = sha256_hex(config.as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer_digest}"),
            "size": layer.len(),
        }],
    })
    .to_string();
    let manifest_digest = sha256_hex(manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest.len(),
            "annotations": { "io.containerd.image.name": SANDBOX_IMAGE },
        }],
    })
    .to_string();

    let mut archive = tar::Builder::new(Vec::new());
    let mut add = |name: String, data: &[u8]| -> Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        archive.append_data(&mut h, name, data)?;
        Ok(())
    };
    add("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json".into(), index.as_bytes())?;
    add(format!("blobs/sha256/{layer_digest}"), &layer)?;
    add(format!("blobs/sha256/{config_digest}"), config.as_bytes())?;
    add(
        format!("blobs/sha256/{manifest_digest}"),
        manifest.as_bytes(),
    )?;
    let path = dir.join("pause-image.tar");
    std::fs::write(&path, archive.into_inner()?)?;
    Ok(path)
}

fn write_config(dir: &Path, socket: &Path) -> Result<PathBuf> {
    let cni_bin = dir.join("cni-bin");
    let cni_conf = dir.join("cni-conf");
    let cni_state = dir.join("cni-state");
    for d in [&cni_bin, &cni_conf, &cni_state] {
        std::fs::create_dir_all(d)?;
    }
    let loopback = Path::new(CNI_PLUGINS).join("loopback");
    if !loopback.is_file() {
        bail!(
            "{} not found: apt-get install containernetworking-plugins",
            loopback.display()
        );
    }
    let link = cni_bin.join("loopback");
    if !link.exists() {
        std::os::unix::fs::symlink(&loopback, &link)?;
    }
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
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("containerd tests must run as root (containerd and runc need it)");
        }
        for bin in [CONTAINERD, CTR] {
            if !Path::new(bin).is_file() {
                bail!("{bin} not found: apt-get install containerd runc");
            }
        }
        let dir = run_dir("containerd")?;
        std::fs::create_dir_all(dir.join("pod-logs"))?;
        let socket = dir.join("containerd.sock");
        let image = build_sandbox_image(&dir)?;
        let config = write_config(&dir, &socket)?;
        let mut cmd = Command::new(CONTAINERD);
        cmd.arg("--config").arg(&config);
        let child = spawn_supervised(cmd, &dir.join("containerd.log"))?;
        let c = Containerd {
            dir,
            socket,
            child: Mutex::new(Some(child)),
        };
        c.wait_ready_blocking()?;
        run(Command::new(CTR)
            .arg("--address")
            .arg(&c.socket)
            .args(["--namespace", "k8s.io", "images", "import"])
            .arg(&image))
        .context("import the sandbox image")?;
        Ok(c)
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
            let id = sb.id;
            client
                .stop_pod_sandbox(StopPodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                })
                .await?;
            client
                .remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: id })
                .await?;
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
