//! Child processes that die with the test process, binaries from the setup cache, free ports.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;

use anyhow::{Context, Result, bail};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Children are spawned from one thread that never exits: PR_SET_PDEATHSIG fires when the
/// spawning *thread* ends, so spawning from a test's thread would kill the shared control plane
/// as soon as that test finished. When the test process exits, the children get SIGKILL.
fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testenv-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
                    unsafe {
                        cmd.pre_exec(|| {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn testenv-spawner thread");
        tx
    })
}

/// Starts `cmd` with stdout and stderr appended to `log`; it is killed when this process exits.
pub fn spawn_supervised(mut cmd: Command, log: &Path) -> Result<Child> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("open log {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let (tx, rx) = mpsc::channel();
    spawner()
        .send((cmd, tx))
        .map_err(|_| anyhow::anyhow!("testenv spawner thread is gone"))?;
    rx.recv()
        .context("testenv spawner thread did not answer")?
        .with_context(|| format!("start {program}"))
}

/// A child process that is killed (SIGKILL) and reaped when dropped, also when the test that
/// holds it panics; it derefs to the [`Child`] (its pid, an earlier kill).
#[derive(Debug)]
pub struct ChildGuard(Child);

impl ChildGuard {
    /// Spawns `cmd` (stdio as `cmd` says) under a guard.
    pub fn spawn(cmd: &mut Command) -> Result<ChildGuard> {
        let program = cmd.get_program().to_string_lossy().into_owned();
        Ok(ChildGuard(
            cmd.spawn().with_context(|| format!("start {program}"))?,
        ))
    }
}

impl From<Child> for ChildGuard {
    fn from(child: Child) -> ChildGuard {
        ChildGuard(child)
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // An error here is a child already reaped: nothing is left to kill.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The setup cache: `$IPRECLAIM_CACHE`, else `~/.cache/ipreclaim`.
pub fn cache_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    std::env::var_os("IPRECLAIM_CACHE").map_or_else(|| home.join(".cache/ipreclaim"), PathBuf::from)
}

/// The directory with the Go-built binaries: `$IPRECLAIM_BIN_DIR`, else the setup cache's.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os("IPRECLAIM_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => cache_dir().join("bin"),
    }
}

/// A version pinned in `e2e/controlplane/versions.env` (`NAME=value`).
pub fn pinned_version(name: &str) -> Result<String> {
    let path = workspace_root().join("e2e/controlplane/versions.env");
    let text = std::fs::read_to_string(&path)?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
        .map(|v| v.trim().to_string())
        .with_context(|| format!("{name} is not in {}", path.display()))
}

/// A release source unpacked by `scripts/setup.sh` (e.g. `whereabouts-v0.9.4`), or an error
/// that says how to get it.
pub fn unpacked_source(name: &str) -> Result<PathBuf> {
    let dir = cache_dir().join("src").join(name);
    if !dir.is_dir() {
        bail!(
            "{} not found: run scripts/setup.sh (it unpacks the release sources from \
             ../shared/third_party)",
            dir.display()
        );
    }
    Ok(dir)
}

/// The path of a Go-built binary, or an error that says how to build it.
pub fn binary(name: &str) -> Result<PathBuf> {
    let path = bin_dir().join(name);
    if !path.is_file() {
        bail!(
            "{} not found: run scripts/setup.sh (or e2e/controlplane/build.sh) to build it, \
             or set IPRECLAIM_BIN_DIR to the directory that holds it",
            path.display()
        );
    }
    Ok(path)
}

/// The workspace root (where `crds/` and `target/` are).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/testenv is two levels below the workspace root")
        .to_path_buf()
}

/// A new directory under `target/testenv/` for the logs and state of one started component.
pub fn run_dir(what: &str) -> Result<PathBuf> {
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = workspace_root().join("target/testenv");
    if what == "controlplane" {
        remove_dead_runs(&base, what);
    }
    let dir = base.join(format!("{what}-{}-{seq}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

/// Removes `<what>-<pid>-<n>` run directories of processes that are gone: a control plane's
/// etcd data is 100 MB or more, and every test process leaves one (the shared control plane is
/// never dropped). Only control planes: they hold no mounts.
fn remove_dead_runs(base: &Path, what: &str) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix(&format!("{what}-"))
            .and_then(|rest| rest.split('-').next()?.parse::<u32>().ok());
        if let Some(pid) = pid
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Writes `contents` to `path`, creating its directory; the error names the path.
pub fn write_file(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, contents).with_context(|| format!("write {}", path.display()))
}

/// Runs `cmd` to completion; a failure carries its output.
pub fn run(cmd: &mut Command) -> Result<()> {
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

/// SIGINT and SIGTERM, blocked in every thread so that [`CtrlC::wait`] receives them (for the
/// binaries that run a part for a person and must put things back on the way out).
pub struct CtrlC(libc::sigset_t);

impl CtrlC {
    /// Blocks the signals; call it first in `main`, before any thread starts (threads inherit
    /// the mask).
    pub fn block() -> CtrlC {
        // SAFETY: plain signal-mask manipulation on this thread.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            CtrlC(set)
        }
    }

    /// Waits for one of them.
    pub fn wait(&self) {
        let mut sig = 0;
        // SAFETY: sigwait on a set of blocked signals.
        unsafe { libc::sigwait(&self.0, &mut sig) };
    }
}

/// Runs shellcheck with `args` over `files` and fails the test, with `what` and the findings,
/// unless it finds nothing.
pub fn assert_shellcheck_clean(what: &str, args: &[&str], files: &[PathBuf]) {
    let out = Command::new("shellcheck")
        .args(args)
        .args(files)
        .output()
        .expect("shellcheck (apt-get install shellcheck; scripts/setup.sh does)");
    assert!(
        out.status.success(),
        "{what}:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A finished command's exit code (a test fails if a signal killed it).
pub fn exit_code(out: &Output) -> i32 {
    out.status.code().expect("exited, not killed")
}

/// A finished command's stdout as text (bytes that are not UTF-8 replaced).
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A finished command's exit code, stdout and stderr, for a failure message.
pub fn explain(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        stdout(out),
        String::from_utf8_lossy(&out.stderr)
    )
}
