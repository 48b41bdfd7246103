//! kubectl plugin mode: kubectl runs `kubectl-ipreclaim` from PATH for `kubectl ipreclaim ...`
//! (argv[0] is then that path). The same binary under that name (a symlink or a copy; krew's
//! manifest in `plugins/krew/` installs one) shows kubectl-style usage, `kubectl ipreclaim
//! scan [OPTIONS]`, and lists only the commands meant for a person at a terminal.

use std::ffi::OsString;
use std::path::Path;

/// The plugin's executable name (kubectl finds `kubectl-<name>` on PATH).
pub const PLUGIN_EXECUTABLE: &str = "kubectl-ipreclaim";

/// Subcommands shown in plugin mode; the daemons stay runnable but hidden.
pub const PLUGIN_COMMANDS: &[&str] = &["scan", "unfence", "release", "approve-hold", "crds"];

/// How the binary was invoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// As `ipreclaim`.
    Standalone,
    /// As `kubectl-ipreclaim`, i.e. `kubectl ipreclaim`.
    Kubectl,
}

impl Mode {
    /// From argv[0]: plugin mode when its file name starts with `kubectl-ipreclaim` (also
    /// `kubectl-ipreclaim.exe`, or a versioned copy).
    pub fn of(argv0: Option<&OsString>) -> Mode {
        let name = argv0
            .map(Path::new)
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with(PLUGIN_EXECUTABLE) {
            Mode::Kubectl
        } else {
            Mode::Standalone
        }
    }

    /// The command line definition for this mode.
    pub fn command(self, cmd: clap::Command) -> clap::Command {
        match self {
            Mode::Standalone => cmd,
            Mode::Kubectl => {
                let names: Vec<String> = cmd
                    .get_subcommands()
                    .map(|s| s.get_name().to_owned())
                    .filter(|n| !PLUGIN_COMMANDS.contains(&n.as_str()))
                    .collect();
                let mut cmd = cmd
                    .name(PLUGIN_EXECUTABLE)
                    .bin_name("kubectl ipreclaim")
                    .display_name("kubectl ipreclaim")
                    .about(
                        "Reclaims leaked IP addresses from whereabouts IPAM pools: inspect them \
                         from kubectl (scan is read-only; unfence and release write, each with \
                         --dry-run).",
                    )
                    .after_help(
                        "Flags follow kubectl's: --kubeconfig, --context, -n/--namespace, -A, \
                         -o. Run `kubectl ipreclaim <command> --help` for a command's flags.",
                    );
                for name in names {
                    cmd = cmd.mut_subcommand(name, |s| s.hide(true));
                }
                cmd
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;
    use crate::cli::Cli;

    fn mode(argv0: &str) -> Mode {
        Mode::of(Some(&OsString::from(argv0)))
    }

    #[test]
    fn the_name_decides_the_mode() {
        assert_eq!(mode("/usr/local/bin/kubectl-ipreclaim"), Mode::Kubectl);
        assert_eq!(mode("kubectl-ipreclaim.exe"), Mode::Kubectl);
        assert_eq!(mode("/root/.krew/bin/kubectl-ipreclaim"), Mode::Kubectl);
        assert_eq!(mode("/usr/local/bin/ipreclaim"), Mode::Standalone);
        assert_eq!(mode("./target/debug/ipreclaim"), Mode::Standalone);
        assert_eq!(mode("/opt/kubectl-ipreclaim/ipreclaim"), Mode::Standalone);
        assert_eq!(Mode::of(None), Mode::Standalone);
    }

    #[test]
    fn plugin_help_reads_as_kubectl_usage() {
        let mut cmd = Mode::Kubectl.command(Cli::command());
        let help = cmd.render_help().to_string();
        assert!(
            help.contains("Usage: kubectl ipreclaim <COMMAND>"),
            "{help}"
        );
        assert!(help.contains("scan"), "{help}");
        assert!(!help.contains("node-agent"), "daemons are hidden: {help}");
        let mut cmd = Mode::Kubectl.command(Cli::command());
        cmd.build();
        let help = cmd
            .find_subcommand_mut("scan")
            .unwrap()
            .render_help()
            .to_string();
        assert!(
            help.contains("Usage: kubectl ipreclaim scan [OPTIONS]"),
            "{help}"
        );
        let mut plain = Cli::command();
        plain.build();
        let help = plain
            .find_subcommand_mut("scan")
            .unwrap()
            .render_help()
            .to_string();
        assert!(help.contains("Usage: ipreclaim scan [OPTIONS]"), "{help}");
    }
}
