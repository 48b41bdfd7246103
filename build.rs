//! Build facts for `ipreclaim_build_info`: the compiler's version, and the git commit.
//!
//! The commit is `$IPRECLAIM_GIT_COMMIT` when set (an image build without `.git`), else, for
//! release builds only, `git rev-parse` of the checkout (none: empty). Debug builds leave it
//! empty, so that a commit does not rebuild the crate and every test binary.

use std::path::{Path, PathBuf};
use std::process::Command;

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!s.is_empty()).then_some(s)
}

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    output(Command::new("git").current_dir(dir).args(args))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=IPRECLAIM_GIT_COMMIT");

    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = output(Command::new(rustc).arg("--version"))
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
        .unwrap_or_default();
    println!("cargo:rustc-env=IPRECLAIM_RUSTC_VERSION={version}");

    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let commit = match std::env::var("IPRECLAIM_GIT_COMMIT") {
        Ok(c) => c.trim().to_owned(),
        Err(_) if release => match git(&dir, &["rev-parse", "--short=12", "HEAD"]) {
            Some(commit) => {
                // Built again when HEAD moves: the files git reads it from.
                let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
                if let Some(r) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
                    watch.push(r);
                }
                for name in watch {
                    // (a missing file would make cargo run this script on every build)
                    if let Some(p) = git(&dir, &["rev-parse", "--git-path", &name])
                        .map(|p| dir.join(p))
                        .filter(|p| p.exists())
                    {
                        println!("cargo:rerun-if-changed={}", p.display());
                    }
                }
                commit
            }
            None => String::new(),
        },
        Err(_) => String::new(),
    };
    println!("cargo:rustc-env=IPRECLAIM_GIT_COMMIT={commit}");
}
