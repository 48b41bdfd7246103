//! The real whereabouts CNI IPAM binary (v0.9.4, built by `scripts/setup.sh`) invoked as a
//! container runtime invokes it: `CNI_COMMAND=ADD`/`DEL`, the network config on stdin, the pod
//! in `CNI_ARGS`, a kubeconfig in its flat configuration file. Allocation, reuse by podref and
//! reservations are upstream's own.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use tokio::io::AsyncWriteExt;

use crate::ControlPlane;

/// One network served by whereabouts in one namespace (its pools live there).
pub struct WhereaboutsCni {
    binary: PathBuf,
    netconf: String,
}

impl WhereaboutsCni {
    /// Writes the kubeconfig and flat file under `dir`; pools go to `namespace`.
    pub fn new(cp: &ControlPlane, namespace: &str, dir: &Path, range: &str) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let kubeconfig = dir.join("whereabouts.kubeconfig");
        cp.write_admin_kubeconfig_in(namespace, &kubeconfig)?;
        let flat = dir.join("whereabouts.conf");
        std::fs::write(
            &flat,
            serde_json::to_vec_pretty(&serde_json::json!({
                "datastore": "kubernetes",
                "kubernetes": {"kubeconfig": kubeconfig},
                "log_file": dir.join("whereabouts.log"),
                "log_level": "error",
            }))?,
        )?;
        let netconf = serde_json::json!({
            "cniVersion": "0.3.1",
            "name": "net",
            "type": "macvlan",
            "ipam": {"type": "whereabouts", "range": range, "configuration_path": flat},
        })
        .to_string();
        Ok(WhereaboutsCni {
            binary: crate::procs::binary("whereabouts")?,
            netconf,
        })
    }

    /// The network config a NAD of this network would carry.
    pub fn netconf(&self) -> &str {
        &self.netconf
    }

    /// CNI ADD for sandbox `container` of pod `namespace/name`: the address whereabouts gave.
    pub async fn add(&self, namespace: &str, name: &str, container: &str) -> Result<Ipv4Addr> {
        let out = self.run("ADD", namespace, name, container).await?;
        let result: serde_json::Value =
            serde_json::from_str(&out).with_context(|| format!("ADD result {out:?}"))?;
        let address = result["ips"][0]["address"]
            .as_str()
            .with_context(|| format!("no address in the ADD result {out}"))?;
        let ip = address.split('/').next().unwrap_or_default();
        ip.parse()
            .with_context(|| format!("bad address {address:?} in the ADD result"))
    }

    /// CNI DEL for sandbox `container` of pod `namespace/name`.
    pub async fn del(&self, namespace: &str, name: &str, container: &str) -> Result<()> {
        self.run("DEL", namespace, name, container).await.map(drop)
    }

    async fn run(&self, command: &str, ns: &str, name: &str, container: &str) -> Result<String> {
        let dir = self.binary.parent().unwrap_or(Path::new("/"));
        let mut child = tokio::process::Command::new(&self.binary)
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", container)
            .env("CNI_NETNS", format!("/var/run/netns/chaos-{container}"))
            .env("CNI_IFNAME", "net1")
            .env("CNI_PATH", dir)
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={container}"
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("running {}", self.binary.display()))?;
        let mut stdin = child.stdin.take().context("whereabouts stdin")?;
        stdin.write_all(self.netconf.as_bytes()).await?;
        drop(stdin);
        let out = child.wait_with_output().await?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "whereabouts {command} for {ns}/{name} failed ({}): {stdout} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(stdout)
    }
}
