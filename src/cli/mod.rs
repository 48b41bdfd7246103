//! The command line: `ipreclaim <subcommand>`, or `kubectl ipreclaim <subcommand>` when the
//! binary runs under a name starting with `kubectl-ipreclaim` (a symlink or copy on PATH, as
//! krew installs it): see [`plugin`].
//!
//! Adding a subcommand: a variant of [`Command`] with its `clap::Args` struct (in a module of
//! its own), and its arm in [`dispatch`] returning an [`ExitCode`]. Commands for a person at a
//! terminal take [`kube::KubeArgs`] (flattened) for `--kubeconfig` and `--context`, and list
//! themselves in [`plugin::PLUGIN_COMMANDS`] to be shown in kubectl plugin mode.

mod approve;
mod daemon;
pub mod kube;
pub mod plugin;
mod release;
mod scan;
mod unfence;
mod writes;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use ipreclaim::telemetry::LogFormat;

/// Exit codes, as `kubectl diff` uses them.
pub mod exit {
    /// Success; for `scan`: nothing would be released.
    pub const OK: u8 = 0;
    /// `scan`: something would be released. `unfence`, `release`: something was refused,
    /// failed or not found. Daemons: stopped on an error.
    pub const FOUND_OR_FAILED: u8 = 1;
    /// `scan`: an error (no report). Any command: invalid flags.
    pub const ERROR: u8 = 2;
}

/// Reclaims leaked IP addresses from whereabouts-style IPAM pools.
#[derive(Debug, Parser)]
#[command(name = "ipreclaim", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the controller: release the addresses of deleted pods and sweep for leaks.
    Controller(Box<daemon::ControllerCmd>),
    /// Run the node agent: relist the node's container runtime, release the addresses of
    /// sandboxes that died while their pod lives on, and report fenced pods whose sandboxes are
    /// gone.
    NodeAgent(Box<daemon::NodeAgentCmd>),
    /// Report every allocation that would be released, is a leak candidate, or is fenced
    /// (read-only).
    ///
    /// Exit code: 0 nothing would be released, 1 something would, 2 an error.
    Scan(scan::ScanArgs),
    /// Let the breaker release a pool's held sweep once (an annotation the controller honours
    /// at its next sweep and removes).
    ApproveHold(approve::ApproveArgs),
    /// Lift fences by hand (--ip, --node, or --all to uninstall), through the controller's
    /// guarded writes; refuses an address a live pod lists, and a fence whose node is not Ready
    /// or not settled, unless --force.
    ///
    /// Exit code: 0 done, 1 something refused, failed or not found, 2 an error.
    Unfence(unfence::UnfenceArgs),
    /// Release allocations by hand (--ip [--network] or --pod), through the controller's
    /// guarded writes; refuses what the controller's rules keep unless --force, and a pod
    /// changed since the listing.
    ///
    /// Exit code: 0 done, 1 something refused, failed or not found, 2 an error.
    Release(release::ReleaseArgs),
    /// Print the CRDs ipreclaim works with (whereabouts' and the NetworkAttachmentDefinition) as YAML.
    Crds {
        /// Write one file per CRD into this directory instead of printing.
        #[arg(long, value_name = "DIR")]
        write_dir: Option<PathBuf>,
    },
}

/// Runs the command line of this process.
pub fn main() -> ExitCode {
    run(std::env::args_os().collect())
}

/// Parses `argv` (with its program name first) and runs the command.
pub fn run(argv: Vec<OsString>) -> ExitCode {
    let mode = plugin::Mode::of(argv.first());
    let matches = match mode.command(Cli::command()).try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(e) => return usage_error(e, &argv),
    };
    match Cli::from_arg_matches(&matches) {
        Ok(cli) => dispatch(cli.command),
        Err(e) => usage_error(e, &argv),
    }
}

fn dispatch(command: Command) -> ExitCode {
    match command {
        Command::Controller(cmd) => daemon::controller(*cmd),
        Command::NodeAgent(cmd) => daemon::node_agent(*cmd),
        Command::Scan(args) => scan::run(args),
        Command::ApproveHold(args) => approve::run(args),
        Command::Unfence(args) => unfence::run(args),
        Command::Release(args) => release::run(args),
        Command::Crds { write_dir } => match crds(write_dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(exit::FOUND_OR_FAILED)
            }
        },
    }
}

fn crds(write_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let Some(dir) = write_dir else {
        print!("{}", ipreclaim::api::crds_yaml()?);
        return Ok(());
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    for (name, yaml) in ipreclaim::api::crd_files()? {
        let path = dir.join(name);
        std::fs::write(&path, yaml).with_context(|| format!("write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Help and version go to stdout (exit 0); a usage error is printed as clap prints it, or as
/// one JSON log line when the command asked for JSON logs (exit 2).
fn usage_error(e: clap::Error, argv: &[OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = e.print();
        return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
            ExitCode::from(exit::ERROR)
        } else {
            ExitCode::SUCCESS
        };
    }
    match requested_log_format(argv, std::env::var_os("IPRECLAIM_LOG_FORMAT")) {
        LogFormat::Json => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            let error = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!(
                "{}",
                ipreclaim::telemetry::logging::early_error_line(
                    LogFormat::Json,
                    "invalid arguments",
                    error
                )
            );
        }
        LogFormat::Text => {
            let _ = e.print();
        }
    }
    ExitCode::from(exit::ERROR)
}

/// The log format the arguments (or the environment) ask for, read without clap (for errors
/// clap reports before anything is parsed).
fn requested_log_format(argv: &[OsString], env: Option<OsString>) -> LogFormat {
    let mut wanted = env.and_then(|v| v.into_string().ok());
    let mut args = argv.iter().filter_map(|a| a.to_str());
    while let Some(arg) = args.next() {
        if arg == "--" {
            break;
        } else if let Some(v) = arg.strip_prefix("--log-format=") {
            wanted = Some(v.to_owned());
        } else if arg == "--log-format" {
            wanted = args.next().map(str::to_owned);
        }
    }
    match wanted.as_deref() {
        Some("json") => LogFormat::Json,
        _ => LogFormat::Text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<OsString> {
        s.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_cli_is_consistent() {
        Cli::command().debug_assert();
        plugin::Mode::Kubectl.command(Cli::command()).debug_assert();
    }

    #[test]
    fn json_is_asked_for_by_flag_or_environment() {
        let f = |a: &[&str], env: Option<&str>| requested_log_format(&args(a), env.map(Into::into));
        assert_eq!(
            f(&["ipreclaim", "controller", "--log-format=json"], None),
            LogFormat::Json
        );
        assert_eq!(
            f(&["ipreclaim", "controller", "--log-format", "json"], None),
            LogFormat::Json
        );
        assert_eq!(
            f(&["ipreclaim", "controller"], Some("json")),
            LogFormat::Json
        );
        assert_eq!(
            f(
                &["ipreclaim", "controller", "--log-format=text"],
                Some("json")
            ),
            LogFormat::Text
        );
        assert_eq!(
            f(
                &["ipreclaim", "controller", "--", "--log-format=json"],
                None
            ),
            LogFormat::Text
        );
        assert_eq!(f(&["ipreclaim", "controller"], None), LogFormat::Text);
    }

    #[test]
    fn scan_flags_parse_as_kubectl_flags_do() {
        let cli = Cli::try_parse_from([
            "ipreclaim",
            "scan",
            "-o",
            "wide",
            "-n",
            "team-a",
            "--context",
            "prod",
        ])
        .unwrap();
        let Command::Scan(s) = cli.command else {
            panic!("scan")
        };
        assert_eq!(s.output, scan::Output::Wide);
        assert_eq!(s.namespace.as_deref(), Some("team-a"));
        assert_eq!(s.kube.context.as_deref(), Some("prod"));
        assert!(Cli::try_parse_from(["ipreclaim", "scan", "-A", "-n", "x"]).is_err());
        assert!(Cli::try_parse_from(["ipreclaim", "scan", "-o", "name"]).is_err());
        for o in ["table", "wide", "json", "yaml"] {
            assert!(
                Cli::try_parse_from(["ipreclaim", "scan", "-o", o]).is_ok(),
                "{o}"
            );
        }
    }
}
