//! `ipreclaim unfence` (`kubectl ipreclaim unfence`): lifts fences by hand through the
//! controller's own guarded writes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::ExitCode;

use ipreclaim::api::slim::NodeReadyView;
use ipreclaim::api::{IPFence, ObjectId};
use ipreclaim::index::Index;
use ipreclaim::release::manual::{self, FenceSelect, Planned};
use ipreclaim::release::reports::events::Lifted;
use ipreclaim::release::{EntryWrite, ReleaseOutcome, ReleaseRequest};
use kube::api::Api;

use super::exit;
use super::writes::{self, Session, WriteArgs, place};

/// `unfence`'s flags.
#[derive(Debug, clap::Args)]
#[command(
    group = clap::ArgGroup::new("which").required(true).args(["ip", "node", "all"]),
    after_help = "\
Each fence is lifted as the controller lifts one: the pool entry is removed with `test`s of its \
sandbox id and fenced podref (an entry changed meanwhile is left alone), then its IPFence record \
is deleted with its uid as precondition, and the reservation the deleted pod held for the address \
is deleted unless a live allocation of that pod holds it. Each lift leaves a release Event on the \
deleted pod (reporting instance `ipreclaim-cli`) and an audit log line on stderr.

A fence whose node is not Ready, or Ready for less than --fence-settle or the deleted pod's \
termination grace period plus 15s if longer (by its Ready condition's last transition), or on \
which the node agent reports a sandbox of the pod still present, is refused without --force: the node may still run the pod, whose address a \
freed entry hands to another. The safe way to free the addresses of a node that does not come \
back is to declare it powered off: `kubectl taint node NODE \
node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`; the controller then lifts its fences, \
and so does this command. A fence whose Node is deleted, or on which the node agent there \
reported the pod's sandboxes gone, is lifted as the controller lifts it.

--all is the uninstall path: it also deletes IPFence records left over or pending, then checks \
that no `:fenced` entry or IPFence is left. Stop the controller first (scale it to 0), or it may fence again.

Exit status: 0 when every fence asked for was lifted (or none was left to lift with --all), 1 when \
something was refused, failed, or not found, 2 on an error (nothing read).")]
pub struct UnfenceArgs {
    /// Lift the fences of this address (in any pool).
    #[arg(long, value_name = "ADDR")]
    pub ip: Option<IpAddr>,
    /// Lift the fences of pods deleted from this node.
    #[arg(long, value_name = "NODE")]
    pub node: Option<String>,
    /// Lift every fence and delete every ipreclaim fence record (uninstall).
    #[arg(long)]
    pub all: bool,
    /// Lift a fence even when a live pod's network-status lists its address, or when its node
    /// is not Ready or Ready for less than --fence-settle (by default each is refused: the pod
    /// may be using the address, and a freed address can be handed to another pod). For a node
    /// that is down, tainting it out-of-service is the safe way (see below).
    #[arg(long)]
    pub force: bool,
    /// How long a node must have been Ready before its fences are lifted here (the
    /// controller's --fence-settle: time for its kubelet to stop what it should no longer run).
    #[arg(long, value_name = "DURATION", env = "IPRECLAIM_FENCE_SETTLE", default_value = "60s", value_parser = ipreclaim::flags::parse_duration)]
    pub fence_settle: std::time::Duration,
    #[command(flatten)]
    pub write: WriteArgs,
}

impl UnfenceArgs {
    fn select(&self) -> FenceSelect {
        match (&self.ip, &self.node) {
            (Some(ip), _) => FenceSelect::Ip(*ip),
            (None, Some(node)) => FenceSelect::Node(node.clone()),
            (None, None) => FenceSelect::All,
        }
    }
}

/// Runs `unfence`.
pub fn run(args: UnfenceArgs) -> ExitCode {
    writes::run(unfence(args))
}

/// How a fence is described: the deleted pod and its node.
fn fence_of(r: &ReleaseRequest) -> String {
    match &r.write {
        EntryWrite::Unfence(record, _) => {
            format!(
                "pod {} deleted on node {}",
                record.podref,
                if record.node.is_empty() {
                    "<unknown>"
                } else {
                    &record.node
                }
            )
        }
        _ => format!("{} marked fenced with no record", r.judged.entry.podref),
    }
}

/// After `--all`: reads the cluster again and says what is left (`false`: something is).
async fn all_gone(args: &UnfenceArgs) -> anyhow::Result<bool> {
    let again = writes::index(&args.write).await?.1;
    let left = Leftovers::of(&again, &FenceSelect::All);
    let marked = marked_entries(&again);
    if marked.is_empty() && left.is_empty() {
        println!("no :fenced entry or IPFence is left");
        return Ok(true);
    }
    for (pool, ip, podref) in &marked {
        println!(
            "left: {} is still marked fenced ({podref})",
            place(pool, *ip)
        );
    }
    for ObjectId { name, .. } in &left.records {
        println!("left: IPFence {name}");
    }
    Ok(false)
}

async fn unfence(args: UnfenceArgs) -> anyhow::Result<u8> {
    let select = args.select();
    let (client, index) = writes::index(&args.write).await?;
    let planned = manual::fences(&index, &select);
    let mut code = exit::OK;
    if planned.is_empty() && select != FenceSelect::All {
        let what = match &select {
            FenceSelect::Ip(ip) => format!("address {ip}"),
            FenceSelect::Node(node) => format!("node {node}"),
            FenceSelect::All => unreachable!(),
        };
        println!("no fence of {what}");
        code = exit::FOUND_OR_FAILED;
    }
    let nodes = nodes_of(&client, &planned).await;
    let now = jiff::Timestamp::now();
    let node_holds = |p: &Planned| node_refusal(p, &nodes, now, args.fence_settle);
    let fence = |p: &Planned| fence_of(&p.request);
    let (go, any_refused) =
        writes::refuse_unsafe(planned, args.force, fence, node_holds, "lifts it");
    if any_refused {
        code = exit::FOUND_OR_FAILED;
    }
    let leftovers = Leftovers::of(&index, &select);
    if args.write.dry_run {
        for p in &go {
            let j = &p.request.judged;
            println!(
                "would unfence {}: {}",
                place(&j.pool, j.entry.ip),
                fence_of(&p.request)
            );
        }
        leftovers.print(true);
        return Ok(code);
    }
    let session = Session::start(client.clone(), &args.write.whereabouts_namespace);
    let reqs: Vec<ReleaseRequest> = go.into_iter().map(|p| p.request).collect();
    let outcomes = session.writer.release(reqs.clone()).await;
    let results: Vec<_> = reqs.iter().zip(&outcomes).collect();
    let (lifts, marks): (Vec<_>, Vec<_>) = results
        .iter()
        .copied()
        .partition(|(r, _)| matches!(r.write, EntryWrite::Unfence(..)));
    let why = Lifted {
        why: "lifted by hand with ipreclaim unfence",
        action: "Manual",
    };
    session.events.released_all_because(lifts, Some(why)).await;
    session
        .events
        .released_by_hand(marks, "ipreclaim unfence")
        .await;
    for (r, o) in &results {
        if *o == &Ok(ReleaseOutcome::Released) {
            after_lift(&session, &index, r);
        }
    }
    leftovers.clean(&session).await;
    session.finish().await;
    let fences: Api<IPFence> = Api::namespaced(client.clone(), &args.write.whereabouts_namespace);
    for (r, o) in &results {
        if !report(&fences, r, o).await {
            code = exit::FOUND_OR_FAILED;
        }
    }
    leftovers.print(false);
    if select == FenceSelect::All && !all_gone(&args).await? {
        code = exit::FOUND_OR_FAILED;
    }
    Ok(code)
}

/// The Nodes of the fences in `planned`, read now, by name (`None`: no such Node), or why one
/// cannot be read.
async fn nodes_of(
    client: &kube::Client,
    planned: &[Planned],
) -> BTreeMap<String, Result<Option<NodeReadyView>, String>> {
    let api: Api<NodeReadyView> = Api::all(client.clone());
    let mut nodes = BTreeMap::new();
    for p in planned {
        let EntryWrite::Unfence(record, _) = &p.request.write else {
            continue;
        };
        if record.node.is_empty() || nodes.contains_key(&record.node) {
            continue;
        }
        let node = api.get_opt(&record.node).await.map_err(|e| e.to_string());
        nodes.insert(record.node.clone(), node);
    }
    nodes
}

/// Why the fence of `p` is not lifted without --force: its node may still run the pod (with
/// the safe way to free it), or cannot be read.
fn node_refusal(
    p: &Planned,
    nodes: &BTreeMap<String, Result<Option<NodeReadyView>, String>>,
    now: jiff::Timestamp,
    settle: std::time::Duration,
) -> Option<String> {
    let EntryWrite::Unfence(record, _) = &p.request.write else {
        return None;
    };
    if p.sandboxes_gone {
        return None;
    }
    let why = match nodes.get(&record.node)? {
        Err(e) => format!("cannot read node {}: {e}", record.node),
        Ok(node) => manual::node_holds(p, node.as_ref(), now, settle)?,
    };
    Some(format!(
        "{why}; if it is down for good, declare it powered off with `{}` (the safe way) and run \
         again",
        manual::out_of_service_command(&record.node)
    ))
}

/// After a lift: the deleted pod's reservations of the address (guarded by the writer).
fn after_lift(session: &Session, index: &Index, r: &ReleaseRequest) {
    let j = &r.judged;
    let podref = match &r.write {
        EntryWrite::Unfence(record, _) => record.podref.clone(),
        _ => j.pod.podref(),
    };
    let deletes = index
        .reservations()
        .of(&podref, j.entry.ip)
        .into_iter()
        .map(|r| {
            ipreclaim::release::objects::reservation::ReservationDelete::after_release(
                r, &podref, j,
            )
        })
        .collect();
    session.writer.delete_reservations(deletes);
}

/// Prints what became of one lift; whether it went as asked.
async fn report(
    fences: &Api<IPFence>,
    r: &ReleaseRequest,
    o: &Result<ReleaseOutcome, ipreclaim::release::ReleaseError>,
) -> bool {
    let j = &r.judged;
    let at = place(&j.pool, j.entry.ip);
    match o {
        Ok(ReleaseOutcome::Released) => {
            let record = match &r.write {
                EntryWrite::Unfence(_, ObjectId { name, .. }) => match fences.get_opt(name).await {
                    Ok(None) => format!("; IPFence {name} deleted"),
                    Ok(Some(_)) => format!("; IPFence {name} is still there"),
                    Err(e) => format!("; IPFence {name}: {e}"),
                },
                _ => String::new(),
            };
            println!("unfenced {at}: {}; entry removed{record}", fence_of(r));
            true
        }
        other => writes::report_unwritten(&at, other),
    }
}

/// Entries still marked fenced, as (pool, address, podref).
fn marked_entries(index: &Index) -> Vec<(String, IpAddr, String)> {
    let mut out: Vec<_> = index
        .pools()
        .all()
        .values()
        .flat_map(|p| {
            p.marked
                .values()
                .map(|e| (p.name.clone(), e.ip, e.podref.clone()))
        })
        .collect();
    out.sort();
    out
}

/// What `--all` deletes besides the fences it lifts: records left over or pending.
#[derive(Default)]
struct Leftovers {
    records: Vec<ObjectId>,
}

impl Leftovers {
    fn of(index: &Index, select: &FenceSelect) -> Leftovers {
        if *select != FenceSelect::All {
            return Leftovers::default();
        }
        let mut records = index.stale_fence_objects();
        // Pending: written, the entry not rewritten (the controller stopped between the two).
        records.extend(index.pending_fences().into_iter().map(|p| p.object.id()));
        records.sort();
        Leftovers { records }
    }

    fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    async fn clean(&self, session: &Session) {
        session.writer.delete_fence_records(self.records.clone());
    }

    fn print(&self, dry_run: bool) {
        let delete = if dry_run { "would delete" } else { "deleted" };
        for ObjectId { name, .. } in &self.records {
            println!("{delete} IPFence {name} (left over or pending)");
        }
    }
}
