//! `ipreclaim controller` and `ipreclaim node-agent`: logging set up from their flags first,
//! so that every error, start-up ones included, is a log line in the chosen format.

use std::future::Future;
use std::process::ExitCode;

use ipreclaim::controller::ControllerArgs;
use ipreclaim::node::NodeAgentArgs;
use ipreclaim::telemetry::init_logging_at;
use ipreclaim::telemetry::logging::{DEFAULT_LEVEL, parse_log_level};

use super::exit;
use super::kube::KubeArgs;

/// `--log-level`, shared by the daemons.
#[derive(Debug, Clone, clap::Args)]
pub struct LogLevel {
    /// Log level: error, warn, info, debug, trace, or directives like info,ipreclaim=debug.
    /// RUST_LOG, when set, wins.
    #[arg(long, env = "IPRECLAIM_LOG_LEVEL", default_value = DEFAULT_LEVEL, value_parser = parse_log_level)]
    pub log_level: String,
}

/// `ipreclaim controller`'s flags.
#[derive(Debug, clap::Args)]
pub struct ControllerCmd {
    #[command(flatten)]
    args: ControllerArgs,
    #[command(flatten)]
    log: LogLevel,
}

/// `ipreclaim node-agent`'s flags.
#[derive(Debug, clap::Args)]
pub struct NodeAgentCmd {
    #[command(flatten)]
    args: NodeAgentArgs,
    #[command(flatten)]
    log: LogLevel,
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "no SIGTERM handler; stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs `main` on `runtime`; an error is logged (in the format set up) and exits 1.
fn run_logged<F>(what: &str, runtime: std::io::Result<tokio::runtime::Runtime>, main: F) -> ExitCode
where
    F: Future<Output = anyhow::Result<()>>,
{
    let result = runtime
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(main));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "{what} stopped on an error");
            ExitCode::from(exit::FOUND_OR_FAILED)
        }
    }
}

pub fn controller(cmd: ControllerCmd) -> ExitCode {
    init_logging_at(cmd.args.log_format, &cmd.log.log_level);
    ipreclaim::controller::tune_malloc();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build();
    run_logged("controller", runtime, async move {
        // Writes handle 429 themselves (every write pauses for the Retry-After, within the
        // budgets); the client's own retry would resend outside them. Reads are retried by
        // their watch or the next pass.
        let client = KubeArgs::default().client(false).await?;
        ipreclaim::controller::run(client, cmd.args, shutdown_signal(), |_| {}).await
    })
}

pub fn node_agent(cmd: NodeAgentCmd) -> ExitCode {
    init_logging_at(cmd.args.log_format, &cmd.log.log_level);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build();
    run_logged("node agent", runtime, async move {
        let client = KubeArgs::default().client(false).await?;
        ipreclaim::node::run(client, cmd.args, shutdown_signal(), |_| {}).await
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use ipreclaim::telemetry::LogFormat;

    use super::*;

    #[derive(Parser)]
    struct C {
        #[command(flatten)]
        cmd: ControllerCmd,
    }

    #[test]
    fn the_log_level_flag_is_checked_and_defaults_to_info() {
        let c = C::try_parse_from(["c"]).unwrap();
        assert_eq!(c.cmd.log.log_level, "info");
        assert_eq!(c.cmd.args.log_format, LogFormat::Text);
        let c = C::try_parse_from(["c", "--log-level=debug", "--log-format=json"]).unwrap();
        assert_eq!(c.cmd.log.log_level, "debug");
        assert_eq!(c.cmd.args.log_format, LogFormat::Json);
        assert!(C::try_parse_from(["c", "--log-level=verbose"]).is_err());
    }
}
