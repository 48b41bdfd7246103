//! `ipreclaim approve-hold --pool POOL` (`kubectl ipreclaim approve-hold`): lets the breaker
//! release the held set of a pool's sweep once, without a restart or a global ratio change.
//! It sets an annotation on the IPPool that the leading controller honours at its next sweep
//! (the releases still pass the grace and a fresh confirmation) and then removes.

use std::process::ExitCode;

use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use ipreclaim::api::IPPool;
use ipreclaim::index::APPROVE_HOLD_ANNOTATION;
use ipreclaim::rules::breaker::approval_value;

use super::exit;
use super::writes::WriteArgs;

/// `approve-hold`'s flags.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
The controller releases the held set at its next sweep (each address still after its grace and \
a fresh look at its pod), emits an Event on the pool, and removes the annotation \
(ipreclaim.io/approve-hold); a later sweep over the ratio is held again. An approval that \
finds nothing held at that sweep is removed as well. With --releases N (the number the hold's \
Event names), a sweep that would release more than N stays held and says so in a new Event, \
and the approval is used up. Without it, the same as: \
kubectl annotate ippool POOL ipreclaim.io/approve-hold=<anything>.

Exit status: 0 approved (or would be, with --dry-run), 2 on an error (no such pool, no access).")]
pub struct ApproveArgs {
    /// The IPPool whose held sweep may release once.
    #[arg(long)]
    pub pool: String,
    /// Release at most this many (the number in the hold's Event): a held set that grew since
    /// stays held. Without it, whatever the next sweep holds goes.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub releases: Option<u64>,
    #[command(flatten)]
    pub write: WriteArgs,
}

/// Runs `approve-hold`.
pub fn run(args: ApproveArgs) -> ExitCode {
    super::writes::run(async {
        println!("{}", approve(&args).await?);
        Ok(exit::OK)
    })
}

async fn approve(args: &ApproveArgs) -> anyhow::Result<String> {
    let client = args.write.kube.client(true).await?;
    let ns = &args.write.whereabouts_namespace;
    let pools: Api<IPPool> = Api::namespaced(client, ns);
    let pool = &args.pool;
    // The pool must exist: an annotation on nothing would approve nothing, silently.
    pools
        .get_metadata(pool)
        .await
        .map_err(|e| anyhow::anyhow!("IPPool {ns}/{pool}: {e}"))?;
    if args.write.dry_run {
        return Ok(format!(
            "ippool {ns}/{pool}: hold would be approved (dry run)"
        ));
    }
    let releases = args
        .releases
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let value = approval_value(releases, jiff::Timestamp::now());
    let patch = json!({"metadata": {"annotations": {APPROVE_HOLD_ANNOTATION: value}}});
    pools
        .patch(pool, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| anyhow::anyhow!("annotating IPPool {ns}/{pool}: {e}"))?;
    Ok(format!(
        "ippool {ns}/{pool}: hold approved once ({APPROVE_HOLD_ANNOTATION}={value}); the controller releases at its next sweep"
    ))
}
