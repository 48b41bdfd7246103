use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// Reclaims leaked IP addresses from whereabouts-style IPAM pools.
#[derive(Debug, Parser)]
#[command(name = "ipreclaim", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the controller: release the addresses of deleted pods and sweep for leaks.
    Controller(Box<ipreclaim::controller::ControllerArgs>),
    /// Run the node agent: relist the node's container runtime, release the addresses of
    /// sandboxes that died while their pod lives on, and report fenced pods whose sandboxes are
    /// gone.
    NodeAgent(Box<ipreclaim::node::NodeAgentArgs>),
    /// Report every allocation that would be released or is a leak candidate (read-only).
    Scan {
        /// Namespace of the IPPools.
        #[arg(long, env = "WHEREABOUTS_NAMESPACE", default_value = "kube-system")]
        whereabouts_namespace: String,
        /// Count Succeeded/Failed pods' addresses as leaks.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        release_terminal_pods: bool,
        /// Output format.
        #[arg(long, value_enum, default_value = "table")]
        output: ScanOutput,
    },
    /// Print the CRDs ipreclaim works with (whereabouts' and the NetworkAttachmentDefinition) as YAML.
    Crds {
        /// Write one file per CRD into this directory instead of printing.
        #[arg(long, value_name = "DIR")]
        write_dir: Option<PathBuf>,
    },
}

async fn client() -> anyhow::Result<kube::Client> {
    let mut config = kube::Config::infer()
        .await
        .context("no Kubernetes client config (set KUBECONFIG, or run in a pod)")?;
    // Writes handle 429 themselves (every write pauses for the Retry-After, within the
    // budgets); the client's own retry would resend outside them. Reads are retried by
    // their watch or the next pass.
    config.default_retry = false;
    kube::Client::try_from(config).context("building the Kubernetes client")
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

async fn run_controller(args: ipreclaim::controller::ControllerArgs) -> anyhow::Result<()> {
    ipreclaim::telemetry::init_logging(args.log_format);
    ipreclaim::controller::run(client().await?, args, shutdown_signal(), |_| {}).await
}

async fn run_node_agent(args: ipreclaim::node::NodeAgentArgs) -> anyhow::Result<()> {
    ipreclaim::telemetry::init_logging(args.log_format);
    ipreclaim::node::run(client().await?, args, shutdown_signal(), |_| {}).await
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ScanOutput {
    Table,
    Json,
}

async fn run_scan(
    namespace: String,
    release_terminal_pods: bool,
    output: ScanOutput,
) -> anyhow::Result<()> {
    ipreclaim::telemetry::init_logging(ipreclaim::telemetry::LogFormat::Text);
    let client = client().await?;
    let reclaim = ipreclaim::reclaim::ReclaimConfig {
        release_terminal_pods,
    };
    let rows = ipreclaim::scan::scan(client, &namespace, reclaim).await?;
    match output {
        ScanOutput::Table => print!("{}", ipreclaim::scan::table(&rows)),
        ScanOutput::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Controller(args) => {
            ipreclaim::controller::limit_malloc_arenas();
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(run_controller(*args))?
        }
        Command::NodeAgent(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
            .block_on(run_node_agent(*args))?,
        Command::Scan {
            whereabouts_namespace,
            release_terminal_pods,
            output,
        } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(run_scan(
                whereabouts_namespace,
                release_terminal_pods,
                output,
            ))?,
        Command::Crds { write_dir: None } => print!("{}", ipreclaim::api::crds_yaml()?),
        Command::Crds {
            write_dir: Some(dir),
        } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            for (name, yaml) in ipreclaim::api::crd_files()? {
                let path = dir.join(name);
                std::fs::write(&path, yaml).with_context(|| format!("write {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}
