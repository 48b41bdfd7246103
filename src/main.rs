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
    /// Print the CRDs ipreclaim works with (whereabouts' and the NetworkAttachmentDefinition) as YAML.
    Crds {
        /// Write one file per CRD into this directory instead of printing.
        #[arg(long, value_name = "DIR")]
        write_dir: Option<PathBuf>,
    },
}

async fn run_controller(args: ipreclaim::controller::ControllerArgs) -> anyhow::Result<()> {
    ipreclaim::telemetry::init_logging(args.log_format);
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes client config (set KUBECONFIG, or run in a pod)")?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    ipreclaim::controller::run(client, args, shutdown, |_| {}).await
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Controller(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(run_controller(*args))?,
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
