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
    /// Print the CRDs ipreclaim works with (whereabouts' and the NetworkAttachmentDefinition) as YAML.
    Crds {
        /// Write one file per CRD into this directory instead of printing.
        #[arg(long, value_name = "DIR")]
        write_dir: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
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
