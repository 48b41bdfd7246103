//! `ipreclaim scan` (`kubectl ipreclaim scan`): what the rules would release, with kubectl's
//! flags and `kubectl diff`'s exit codes.

use std::process::ExitCode;

use ipreclaim::rules::ReclaimConfig;
use ipreclaim::scan::ScanRow;

use super::exit;
use super::kube::KubeArgs;

/// Output formats (`-o`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns, short sandbox ids, human ages.
    Table,
    /// The table with whole sandbox ids and why each fence was set.
    Wide,
    /// A JSON list of rows (ages in seconds).
    Json,
    /// The same list as YAML.
    Yaml,
}

/// `scan`'s flags.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Decisions: `release` (direct evidence: released at once by the controller), `candidate` \
(released once it has looked leaked for the leak grace), `fenced` (a deleted pod's address kept \
until its node is trusted again; not counted as a release), `cooling` (released, and kept out of \
the pool by --release-cooldown until the time its REASON shows; not counted either), `duplicate` \
(an address two or more live pods list on one network: shown in its own section under the \
table, never released, not counted).

Exit status: 0 when nothing would be released, 1 when something would (a `release` or \
`candidate` row), 2 on an error (like `kubectl diff`).")]
pub struct ScanArgs {
    /// Namespace of the IPPools, reservations and fences (where the whereabouts CNI writes them).
    #[arg(long, env = "WHEREABOUTS_NAMESPACE", default_value = "kube-system")]
    pub whereabouts_namespace: String,
    /// Only allocations of pods in this namespace (the namespace of their podref).
    #[arg(
        short = 'n',
        long,
        value_name = "NS",
        conflicts_with = "all_namespaces"
    )]
    pub namespace: Option<String>,
    /// Allocations of pods in every namespace (the default: pools serve every namespace).
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
    /// Leave out the header line of tables.
    #[arg(long)]
    pub no_headers: bool,
    /// Count Succeeded/Failed pods' addresses as leaks.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub release_terminal_pods: bool,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// Runs the scan: the report on stdout, errors on stderr; the exit code says what it found.
pub fn run(args: ScanArgs) -> ExitCode {
    super::writes::run(async {
        let rows = rows(&args).await?;
        print!("{}", render(&rows, args.output, !args.no_headers)?);
        Ok(code(&rows))
    })
}

async fn rows(args: &ScanArgs) -> anyhow::Result<Vec<ScanRow>> {
    let client = args.kube.client(true).await?;
    let reclaim = ReclaimConfig {
        release_terminal_pods: args.release_terminal_pods,
    };
    let rows = ipreclaim::scan::scan(client, &args.whereabouts_namespace, reclaim).await?;
    Ok(match &args.namespace {
        Some(ns) if !args.all_namespaces => ipreclaim::scan::in_namespace(rows, ns),
        _ => rows,
    })
}

/// The report in `output`.
fn render(rows: &[ScanRow], output: Output, headers: bool) -> anyhow::Result<String> {
    Ok(match output {
        Output::Table => ipreclaim::scan::render(rows, false, headers),
        Output::Wide => ipreclaim::scan::render(rows, true, headers),
        Output::Json => serde_json::to_string_pretty(rows)? + "\n",
        Output::Yaml => serde_norway::to_string(rows)?,
    })
}

/// 1 when a row would be released, else 0.
fn code(rows: &[ScanRow]) -> u8 {
    if rows.iter().any(ipreclaim::scan::would_release) {
        exit::FOUND_OR_FAILED
    } else {
        exit::OK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(decision: &str) -> ScanRow {
        ScanRow {
            pool: "192.0.2.0-24".into(),
            ip: "192.0.2.10".into(),
            podref: "ns/web-0".into(),
            sandbox: "sb".into(),
            decision: decision.into(),
            reason: "PodMissing".into(),
            pod_age_seconds: None,
            fence: None,
            cooldown: None,
            duplicate: None,
        }
    }

    #[test]
    fn the_exit_code_says_whether_anything_would_be_released() {
        assert_eq!(code(&[]), 0);
        assert_eq!(code(&[row("fenced")]), 0);
        assert_eq!(code(&[row("cooling")]), 0);
        assert_eq!(code(&[row("fenced"), row("candidate")]), 1);
        assert_eq!(code(&[row("release")]), 1);
        assert_eq!(
            code(&[row("duplicate")]),
            0,
            "a duplicate is never released"
        );
    }

    #[test]
    fn json_and_yaml_hold_the_same_rows() {
        let rows = [row("release")];
        let json: serde_json::Value =
            serde_json::from_str(&render(&rows, Output::Json, true).unwrap()).unwrap();
        let yaml: serde_json::Value =
            serde_norway::from_str(&render(&rows, Output::Yaml, true).unwrap()).unwrap();
        assert_eq!(json, yaml);
        assert_eq!(json[0]["decision"], "release");
        assert_eq!(render(&[], Output::Json, true).unwrap(), "[]\n");
    }
}
