use clap::Parser;

/// Reclaims leaked IP addresses from whereabouts-style IPAM pools.
#[derive(Debug, Parser)]
#[command(name = "ipreclaim", version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
