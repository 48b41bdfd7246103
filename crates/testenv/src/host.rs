//! What a real node changes on this host, and putting it back: one record of the changes,
//! written before they are made, so that a run killed half-way is cleaned at the next start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Where the record of a node's host changes lives while the node runs.
pub const RECORD: &str = "/var/lib/ipreclaim-testenv/node.json";
/// The sysctls the kubelet sets at every start.
pub const KUBELET_SYSCTLS: [&str; 3] = [
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
];

/// The sysctls the node sets for kube-proxy (forwarding, so that a Service address on the pod
/// bridge reaches a pod on it) or that kube-proxy could set; put back when the node stops.
pub const PROXY_SYSCTLS: [&str; 2] = ["net.ipv4.ip_forward", "net.ipv4.conf.all.route_localnet"];
/// The mangle chain that keeps forwarding to the pod bridge (see [`forward_within`]). `KUBE-`
/// so that the kube chain cleanup removes it.
pub const ISOLATE_CHAIN: &str = "KUBE-TESTENV-ISOLATE";
/// The filter chain after kube-proxy's (see [`forward_within`]).
pub const GUARD_CHAIN: &str = "KUBE-TESTENV-GUARD";

/// Everything a node changes on the host.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Changes {
    /// The node's directory: mounts under it are undone.
    pub dir: PathBuf,
    /// containerd's socket: its shims are killed.
    pub containerd_socket: PathBuf,
    /// Addresses added to `lo` (`a.b.c.d/32`).
    pub lo_addresses: Vec<String>,
    /// Bridges created.
    pub bridges: Vec<String>,
    /// Sysctl values before the kubelet first ran.
    pub sysctls: BTreeMap<String, String>,
    /// CNI network names whose cached results (`/var/lib/cni/results`) are removed: those
    /// made while the node ran (containerd keeps its loopback results as `cni-loopback-*`).
    pub cni_networks: Vec<String>,
    /// The cached results there before the node started (left alone).
    pub cni_results_before: Vec<String>,
    /// [`PROXY_SYSCTLS`] before the node started (a record of an older run has none).
    #[serde(default)]
    pub proxy_sysctls: BTreeMap<String, String>,
}

impl Changes {
    /// Writes the record (before the changes are made).
    pub fn record(&self) -> Result<()> {
        let path = Path::new(RECORD);
        std::fs::create_dir_all(path.parent().expect("record has a parent"))?;
        std::fs::write(path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("write {RECORD}"))
    }

    /// The record a killed run left behind, if any.
    pub fn leftover() -> Result<Option<Changes>> {
        match std::fs::read(RECORD) {
            Ok(data) => Ok(Some(serde_json::from_slice(&data).with_context(|| {
                format!("parse {RECORD} (remove it once the host is clean)")
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("read {RECORD}")),
        }
    }

    /// Undoes every change; each step goes on when another fails, and the failures are
    /// returned together. Idempotent. The record is removed only when all steps succeeded.
    pub fn put_back(&self) -> Result<()> {
        let mut failures = Vec::new();
        let mut step = |what: &str, r: Result<()>| {
            if let Err(e) = r {
                failures.push(format!("{what}: {e:#}"));
            }
        };
        // Forwarding off first: its isolation goes with the iptables chains below.
        step("proxy sysctls", restore_sysctls(&self.proxy_sysctls));
        step("kill pod processes", kill_pod_processes());
        step("kill shims", kill_shims(&self.containerd_socket));
        step("unmount", unmount_under(&self.dir));
        step("iptables", remove_kube_chains());
        step("cgroups", remove_kubepods_cgroups());
        for bridge in &self.bridges {
            step(
                &format!("bridge {bridge}"),
                ip_quiet(&["link", "del", bridge]),
            );
        }
        for addr in &self.lo_addresses {
            step(
                &format!("lo address {addr}"),
                ip_quiet(&["addr", "del", addr, "dev", "lo"]),
            );
        }
        step("sysctls", restore_sysctls(&self.sysctls));
        step(
            "cni cache",
            remove_cni_results(&self.cni_networks, &self.cni_results_before),
        );
        if failures.is_empty() {
            match std::fs::remove_file(RECORD) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => failures.push(format!("remove {RECORD}: {e}")),
            }
            Ok(())
        } else {
            anyhow::bail!(
                "the host could not be put back fully ({RECORD} kept):\n{}",
                failures.join("\n")
            )
        }
    }
}

/// Reads the kubelet's sysctls.
pub fn read_sysctls() -> Result<BTreeMap<String, String>> {
    read_sysctls_of(&KUBELET_SYSCTLS)
}

/// Reads `keys`.
pub fn read_sysctls_of(keys: &[&str]) -> Result<BTreeMap<String, String>> {
    keys.iter()
        .map(|k| Ok((k.to_string(), read_sysctl(k)?)))
        .collect()
}

/// Turns IP forwarding on for one purpose: a packet from a pod on `bridge` to a Service address
/// (in `services`) that kube-proxy rewrites to another pod on `bridge`, or rejects when the
/// Service has no endpoint. [`ISOLATE_CHAIN`], hooked at the head of the mangle table's FORWARD
/// (before the filter table, where kube-proxy puts its own accepts), lets bridged frames (not
/// routing), `bridge` back to `bridge`, and `bridge` to `services` through; the rest is dropped
/// when the host did not forward before (`was_forwarding`), else only what enters or leaves
/// `bridge` (the host's own routing goes on). [`GUARD_CHAIN`], at the end of the filter table's
/// FORWARD, drops what kube-proxy neither rewrote nor rejected (an address no Service has).
pub fn forward_within(bridge: &str, services: &str, was_forwarding: bool) -> Result<()> {
    let iptables = |table: &str, rule: &[&str]| -> Result<()> {
        let out = Command::new("iptables")
            .args(["-t", table])
            .args(rule)
            .output()?;
        if !out.status.success() {
            anyhow::bail!(
                "iptables -t {table} {}: {}",
                rule.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    };
    let mangle = |rule: &[&str]| iptables("mangle", rule);
    let chain = ISOLATE_CHAIN;
    mangle(&["-N", chain])?;
    mangle(&[
        "-A",
        chain,
        "-m",
        "physdev",
        "--physdev-is-bridged",
        "-j",
        "RETURN",
    ])?;
    mangle(&["-A", chain, "-i", bridge, "-o", bridge, "-j", "RETURN"])?;
    mangle(&["-A", chain, "-i", bridge, "-d", services, "-j", "RETURN"])?;
    if was_forwarding {
        mangle(&["-A", chain, "-i", bridge, "-j", "DROP"])?;
        mangle(&["-A", chain, "-o", bridge, "-j", "DROP"])?;
    } else {
        mangle(&["-A", chain, "-j", "DROP"])?;
    }
    mangle(&["-I", "FORWARD", "1", "-j", chain])?;
    let filter = |rule: &[&str]| iptables("filter", rule);
    filter(&["-N", GUARD_CHAIN])?;
    filter(&[
        "-A",
        GUARD_CHAIN,
        "-i",
        bridge,
        "!",
        "-o",
        bridge,
        "-j",
        "DROP",
    ])?;
    filter(&["-A", "FORWARD", "-j", GUARD_CHAIN])?;
    std::fs::write(sysctl_path("net.ipv4.ip_forward"), "1")
        .context("write sysctl net.ipv4.ip_forward")
}

fn sysctl_path(key: &str) -> PathBuf {
    Path::new("/proc/sys").join(key.replace('.', "/"))
}

fn read_sysctl(key: &str) -> Result<String> {
    Ok(std::fs::read_to_string(sysctl_path(key))
        .with_context(|| format!("read sysctl {key}"))?
        .trim()
        .to_string())
}

/// Writes `values` back where they differ.
pub fn restore_sysctls(values: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in values {
        if read_sysctl(k)? != *v {
            std::fs::write(sysctl_path(k), v).with_context(|| format!("write sysctl {k}"))?;
        }
    }
    Ok(())
}

/// Runs `ip args`; "does not exist" answers count as done.
fn ip_quiet(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success()
        || err.contains("Cannot find device")
        || err.contains("Cannot assign requested address")
        || err.contains("Address not found")
        || err.contains("does not exist")
    {
        return Ok(());
    }
    anyhow::bail!("ip {}: {err}", args.join(" "))
}

/// Runs `ip args`, failing with its message.
pub fn ip(args: &[&str]) -> Result<()> {
    crate::procs::run(Command::new("ip").args(args))
}

fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn kill(pid: i32) {
    // SAFETY: kill(2) with a pid read from /proc; a vanished pid is harmless.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

/// Kills every process in a `kubepods` cgroup (the pods' containers; one kubelet per host).
pub fn kill_pod_processes() -> Result<()> {
    for pid in pids() {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if cgroup.lines().any(|l| l.contains("/kubepods")) {
            kill(pid);
        }
    }
    Ok(())
}

/// Kills the containerd shims serving `socket` (they outlive containerd by design).
pub fn kill_shims(socket: &Path) -> Result<()> {
    let socket = socket.display().to_string();
    for pid in pids() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_shim = args
            .first()
            .is_some_and(|a| String::from_utf8_lossy(a).contains("containerd-shim"));
        let ours = args
            .windows(2)
            .any(|w| w[0] == b"-address" && w[1] == socket.as_bytes());
        if is_shim && ours {
            kill(pid);
        }
    }
    Ok(())
}

/// Unmounts everything mounted at or under `dir`, deepest first (lazily when busy).
pub fn unmount_under(dir: &Path) -> Result<()> {
    let dir = dir.display().to_string();
    for _ in 0..3 {
        let info = std::fs::read_to_string("/proc/self/mountinfo")?;
        let mut points: Vec<String> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(unescape_mount_path)
            .filter(|p| p == &dir || p.starts_with(&format!("{dir}/")))
            .collect();
        if points.is_empty() {
            return Ok(());
        }
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let c = std::ffi::CString::new(p)?;
            // SAFETY: a NUL-terminated path; umount2 does not keep it.
            unsafe {
                if libc::umount2(c.as_ptr(), 0) != 0 {
                    libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                }
            }
        }
    }
    let left = std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|p| p.starts_with(&dir)))
        .count();
    if left > 0 {
        anyhow::bail!("{left} mounts left under {dir}");
    }
    Ok(())
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount_path(p: &str) -> String {
    p.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Removes the kubelet's `KUBE-*` chains (and the rules jumping to them) from every table of
/// iptables and ip6tables.
pub fn remove_kube_chains() -> Result<()> {
    let mut left = Vec::new();
    for tool in ["iptables", "ip6tables"] {
        for table in ["filter", "nat", "mangle"] {
            let list = |chain: Option<&str>| -> Vec<String> {
                let mut cmd = Command::new(tool);
                cmd.args(["-t", table, "-S"]);
                cmd.args(chain);
                cmd.output()
                    .map(|o| {
                        String::from_utf8_lossy(&o.stdout)
                            .lines()
                            .map(String::from)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let all = list(None);
            let chains: Vec<String> = all
                .iter()
                .filter_map(|r| r.strip_prefix("-N ").or_else(|| r.strip_prefix("-P ")))
                .filter_map(|r| r.split(' ').next())
                .map(String::from)
                .collect();
            // Jumps into KUBE chains from the others, by position (rules may hold quoted
            // comments), last first so that positions stay valid.
            for chain in chains.iter().filter(|c| !is_kube(c)) {
                let rules: Vec<String> = list(Some(chain))
                    .into_iter()
                    .filter(|r| r.starts_with("-A "))
                    .collect();
                for (i, rule) in rules.iter().enumerate().rev() {
                    if rule.contains("-j KUBE-") {
                        let _ = Command::new(tool)
                            .args(["-t", table, "-D", chain, &(i + 1).to_string()])
                            .output();
                    }
                }
            }
            for chain in chains.iter().filter(|c| is_kube(c)) {
                let _ = Command::new(tool).args(["-t", table, "-F", chain]).output();
            }
            for chain in chains.iter().filter(|c| is_kube(c)) {
                let _ = Command::new(tool).args(["-t", table, "-X", chain]).output();
            }
            left.extend(
                list(None)
                    .into_iter()
                    .filter(|r| r.contains("KUBE-"))
                    .map(|r| format!("{tool} -t {table}: {r}")),
            );
        }
    }
    if !left.is_empty() {
        anyhow::bail!("left: {left:?}");
    }
    Ok(())
}

fn is_kube(chain: &str) -> bool {
    chain.starts_with("KUBE-")
}

/// Removes the `kubepods` cgroup trees at the root of every hierarchy (children first).
pub fn remove_kubepods_cgroups() -> Result<()> {
    let mut roots = Vec::new();
    for entry in std::fs::read_dir("/sys/fs/cgroup")? {
        let p = entry?.path();
        let k = p.join("kubepods");
        if k.is_dir() {
            roots.push(k);
        }
    }
    if Path::new("/sys/fs/cgroup/kubepods").is_dir() {
        roots.push(PathBuf::from("/sys/fs/cgroup/kubepods"));
    }
    let mut left = Vec::new();
    for root in roots {
        let mut dirs = Vec::new();
        collect_dirs(&root, &mut dirs);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            let mut removed = false;
            for _ in 0..50 {
                if std::fs::remove_dir(&d).is_ok() || !d.exists() {
                    removed = true;
                    break;
                }
                // A killed process may take a moment to leave its cgroup.
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            if !removed {
                left.push(d.display().to_string());
            }
        }
    }
    if !left.is_empty() {
        anyhow::bail!("cgroups not removed: {left:?}");
    }
    Ok(())
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&e.path(), out);
            }
        }
    }
}

const CNI_RESULTS: &str = "/var/lib/cni/results";

/// The names of libcni's cached results now.
pub fn cni_results() -> Vec<String> {
    std::fs::read_dir(CNI_RESULTS)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes libcni's cached results of `networks` that are not in `keep`.
pub fn remove_cni_results(networks: &[String], keep: &[String]) -> Result<()> {
    for name in cni_results() {
        let ours = networks.iter().any(|n| name.starts_with(&format!("{n}-")));
        if ours && !keep.contains(&name) {
            std::fs::remove_file(Path::new(CNI_RESULTS).join(&name))?;
        }
    }
    Ok(())
}
