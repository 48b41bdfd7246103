//! `ipreclaim release` (`kubectl ipreclaim release`): frees allocations by hand through the
//! controller's own guarded writes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::ExitCode;

use ipreclaim::api::OverlappingRangeIPReservation;
use ipreclaim::api::slim::PodView;
use ipreclaim::index::Index;
use ipreclaim::ipam::PodKey;
use ipreclaim::ipam::inventory;
use ipreclaim::release::inventories;
use ipreclaim::release::manual::{self, Planned, PodReading, ReleaseTarget};
use ipreclaim::release::objects::reservation::ReservationDelete;
use ipreclaim::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};
use kube::api::Api;

use super::exit;
use super::writes::{self, Session, WriteArgs, place};

/// `release`'s flags.
#[derive(Debug, clap::Args)]
#[command(
    group = clap::ArgGroup::new("what").required(true).args(["ip", "pod"]),
    after_help = "\
Each allocation is judged by the controller's rules and removed as the controller removes one. \
Pools are read before pods (an entry allocated after the pod listing is never taken for a \
missing pod's), and each target's pod is read again right before the write: a pod changed since \
the listing (another uid, or its network-status now lists the address) is refused, even with \
--force. The pool entry is removed with `test`s of its sandbox id and podref (an entry changed \
meanwhile, such as a recreated pod's allocation, is left alone), then the pod's reservation of \
the address is deleted with its uid as precondition, unless a live allocation of that pod holds \
the address again. Each release leaves a release Event on the pod (reporting \
instance `ipreclaim-cli`) and an audit log line on stderr. A fenced address is not released \
here: `ipreclaim unfence --ip ADDR` lifts its fence. An address in its release cooldown \
(`--release-cooldown`) is refused; with --force its cooldown ends now (the marked entry is \
removed, then the old pod's reservation of it). With --release-cooldown the released entries \
are marked cooling instead of removed, as the controller's are under its flag: the controller's \
leader returns them to the pool, and deletes the reservations, when the time is up.

Exit status: 0 when everything asked for was released, 1 when something was refused (what the \
controller keeps, without --force; a pod changed since the listing; another sandbox than \
--sandbox; an address in several pools without --network), failed or not found, 2 on an error \
(nothing read).")]
pub struct ReleaseArgs {
    /// Release this address.
    #[arg(long, value_name = "ADDR")]
    pub ip: Option<IpAddr>,
    /// With --ip: the network (NetworkAttachmentDefinition) whose pools hold the address, as
    /// NAMESPACE/NAME; needed when it is allocated in several pools.
    #[arg(long, value_name = "NS/NAD", requires = "ip")]
    pub network: Option<String>,
    /// Release every allocation of this pod (NAMESPACE/NAME).
    #[arg(long, value_name = "NS/NAME", value_parser = PodKey::parse)]
    pub pod: Option<PodKey>,
    /// Release what the controller's rules keep (by default refused: the pod may be using it,
    /// and a freed address can be handed to another pod): an address a live pod's
    /// network-status lists, the address of a live pod that has no network-status yet (its
    /// allocation may be in flight) or whose network-status says nothing of the network, an
    /// entry whose fence is being written, an entry whose sandbox a node agent lists live for
    /// another pod than the one holding it (a pod deleted while its node still runs it), and go
    /// on when the inventories cannot be read. With
    /// --ip, also end the address's release cooldown now. Never overrides a pod changed since
    /// the listing, nor --sandbox.
    #[arg(long)]
    pub force: bool,
    /// Release only what this sandbox holds: the entry you saw (the whole id, or 12 characters
    /// or more of its start, as `ipreclaim scan` shows it). An address held by another sandbox
    /// now is refused, even with --force; the write tests the entry's whole id.
    #[arg(long, value_name = "ID")]
    pub sandbox: Option<String>,
    /// Keep each released address out of the pool this long (its entry is marked cooling, its
    /// reservation kept; the controller's leader returns it), as the controller's flag does. 0:
    /// removed now.
    #[arg(long, value_name = "DURATION", env = "IPRECLAIM_RELEASE_COOLDOWN", default_value = "0s", value_parser = ipreclaim::flags::parse_duration)]
    pub release_cooldown: std::time::Duration,
    /// The namespace ipreclaim runs in, where the node agents' sandbox inventories are
    /// (default: every namespace).
    #[arg(long, value_name = "NS", env = "IPRECLAIM_INVENTORY_NAMESPACE")]
    pub inventory_namespace: Option<String>,
    #[command(flatten)]
    pub write: WriteArgs,
}

/// Runs `release`.
pub fn run(args: ReleaseArgs) -> ExitCode {
    writes::run(release(args))
}

async fn release(args: ReleaseArgs) -> anyhow::Result<u8> {
    let target = match (&args.ip, &args.pod) {
        (Some(ip), _) => ReleaseTarget::Ip {
            ip: *ip,
            network: args.network.clone(),
        },
        (None, Some(pod)) => ReleaseTarget::Pod(pod.clone()),
        (None, None) => anyhow::bail!("--ip or --pod is required"),
    };
    let (client, index) = writes::index(&args.write).await?;
    let planned = match manual::releases(&index, &target, args.force, args.sandbox.as_deref()) {
        Ok(p) => p,
        Err(why) => {
            println!("refused: {why}");
            return Ok(exit::FOUND_OR_FAILED);
        }
    };
    let mut code = exit::OK;
    let held = |p: &Planned| format!("held by {}", p.request.judged.entry.podref);
    let requests: Vec<ReleaseRequest> = planned.iter().map(|p| p.request.clone()).collect();
    let wanted = inventories::wanted(&requests);
    // As the controller's sweep: a sandbox a node agent lists live for another pod than the
    // one holding the entry (none, when it is gone) may still run there.
    let ns = args.inventory_namespace.as_deref();
    let sightings = match inventories::sightings(&client, ns, &wanted).await {
        Ok(s) => s,
        Err(e) if args.force => {
            let where_ = ns.unwrap_or("any namespace");
            println!(
                "warning: cannot read the node agents' sandbox inventories ({where_}): {e}; --force goes on without them"
            );
            Default::default()
        }
        Err(e) => {
            let where_ = ns.unwrap_or("any namespace");
            println!(
                "refused: cannot read the node agents' sandbox inventories ({where_}): {e}; nothing written (--inventory-namespace names the namespace ipreclaim runs in; --force goes on without them)"
            );
            return Ok(exit::FOUND_OR_FAILED);
        }
    };
    let live_elsewhere = |p: &Planned| {
        let j = &p.request.judged;
        let s = sightings.get(inventory::id_prefix(&j.entry.id))?;
        (s.pod_uid != j.pod.uid).then(|| {
            format!(
                "the node agent of {} lists its sandbox live for pod uid {} (inventory written {}): that pod may still run there",
                s.node, s.pod_uid, s.written
            )
        })
    };
    let (go, any_refused) =
        writes::refuse_unsafe(planned, args.force, held, live_elsewhere, "releases it");
    if any_refused {
        code = exit::FOUND_OR_FAILED;
    }
    if args.write.dry_run {
        print_dry_run(&args, &index, &go);
        return Ok(code);
    }
    let (go, any_changed) = read_pods_again(&client, &index, go).await;
    if any_changed {
        code = exit::FOUND_OR_FAILED;
    }
    let session = Session::start_cooling(
        client.clone(),
        &args.write.whereabouts_namespace,
        args.release_cooldown,
    );
    let reqs: Vec<ReleaseRequest> = go.into_iter().map(|p| p.request).collect();
    let outcomes = session.writer.release(reqs.clone()).await;
    let how = match &target {
        ReleaseTarget::Ip { ip, .. } => format!("ipreclaim release --ip {ip}"),
        ReleaseTarget::Pod(pod) => format!("ipreclaim release --pod {pod}"),
    };
    session
        .events
        .released_by_hand(reqs.iter().zip(&outcomes), &how)
        .await;
    let mut deletes = Vec::new();
    for (r, o) in reqs.iter().zip(&outcomes) {
        if *o == Ok(ReleaseOutcome::Released) {
            deletes.push(reservations_of(&index, r));
        } else {
            deletes.push(Vec::new());
        }
    }
    session
        .writer
        .delete_reservations(deletes.iter().flatten().cloned().collect());
    session.finish().await;
    let api: Api<OverlappingRangeIPReservation> =
        Api::namespaced(client, &args.write.whereabouts_namespace);
    for ((r, o), reservations) in reqs.iter().zip(&outcomes).zip(&deletes) {
        if !report(&api, r, o, reservations).await {
            code = exit::FOUND_OR_FAILED;
        }
    }
    Ok(code)
}

/// Reads the pod of each of `go`'s entries again, right before the write, and refuses (even
/// with --force: what was forced was the listing's view) each whose pod changed since the
/// listing: another pod now (a StatefulSet's new pod), or one the controller's rules judge
/// otherwise. The ends of cooldowns name no pod's allocation and go ahead. Whether anything
/// was refused.
async fn read_pods_again(
    client: &kube::Client,
    index: &Index,
    go: Vec<Planned>,
) -> (Vec<Planned>, bool) {
    let mut looked: BTreeMap<String, Result<Option<PodReading>, String>> = BTreeMap::new();
    let mut kept = Vec::new();
    let mut any_changed = false;
    for p in go {
        let j = &p.request.judged;
        if p.request.write == EntryWrite::EndCooldown {
            kept.push(p);
            continue;
        }
        let podref = j.entry.podref.clone();
        if !looked.contains_key(&podref) {
            let key = PodKey::lenient(&podref);
            let pods: Api<PodView> = Api::namespaced(client.clone(), &key.namespace);
            let fresh = pods
                .get_opt(&key.name)
                .await
                .map(|p| p.as_ref().map(PodReading::of))
                .map_err(|e| format!("cannot read pod {podref} again before the write: {e}"));
            looked.insert(podref.clone(), fresh);
        }
        let why = match &looked[&podref] {
            Ok(fresh) => manual::changed_since_listing(index, &p, fresh.as_ref()),
            Err(e) => Some(e.clone()),
        };
        match why {
            None => kept.push(p),
            Some(why) => {
                any_changed = true;
                println!(
                    "refused {}: held by {podref}; {why} (nothing written: look again)",
                    place(&j.pool, j.entry.ip)
                );
            }
        }
    }
    (kept, any_changed)
}

/// Prints what `release --dry-run` would write.
fn print_dry_run(args: &ReleaseArgs, index: &Index, go: &[Planned]) {
    for p in go {
        let j = &p.request.judged;
        let cools = cools(args, &p.request);
        let reservations = match cools {
            true => Vec::new(),
            false => reservations_of(index, &p.request),
        };
        println!(
            "would release {}: held by {} (sandbox {}){}{}",
            place(&j.pool, j.entry.ip),
            j.entry.podref,
            ipreclaim::scan::short_id(&j.entry.id),
            names(&reservations, "; would delete reservation "),
            match cools {
                true => format!(
                    "; would keep it out of the pool for {} (release cooldown; its reservation stays until then)",
                    humantime::format_duration(args.release_cooldown)
                ),
                false => String::new(),
            }
        );
    }
}

/// Whether `r`, written, goes into a release cooldown (the end of one never does).
fn cools(args: &ReleaseArgs, r: &ReleaseRequest) -> bool {
    !args.release_cooldown.is_zero() && r.write != EntryWrite::EndCooldown
}

/// The reservations of the pod that held the address, for that address (found by name, as
/// whereabouts names them, among those listed).
fn reservations_of(index: &Index, r: &ReleaseRequest) -> Vec<ReservationDelete> {
    let j = &r.judged;
    index
        .reservations()
        .of(r.podref(), j.entry.ip)
        .into_iter()
        .map(|id| ReservationDelete::after_release(id, r.podref(), j))
        .collect()
}

fn names(reservations: &[ReservationDelete], prefix: &str) -> String {
    reservations
        .iter()
        .map(|d| format!("{prefix}{}", d.name))
        .collect()
}

/// Prints what became of one release; whether it went as asked.
async fn report(
    api: &Api<OverlappingRangeIPReservation>,
    r: &ReleaseRequest,
    o: &Result<ReleaseOutcome, ReleaseError>,
    reservations: &[ReservationDelete],
) -> bool {
    let j = &r.judged;
    let at = place(&j.pool, j.entry.ip);
    match o {
        Ok(ReleaseOutcome::Released) => {
            let mut done = String::new();
            let mut ok = true;
            for d in reservations {
                match api.get_opt(&d.name).await {
                    Ok(None) => done.push_str(&format!("; reservation {} deleted", d.name)),
                    Ok(Some(now)) if now.metadata.uid.as_deref() != Some(d.uid.as_str()) => done
                        .push_str(&format!(
                            "; reservation {} was replaced (now {}'s)",
                            d.name, now.spec.podref
                        )),
                    Ok(Some(_)) => {
                        ok = false;
                        done.push_str(&format!(
                            "; reservation {} kept (a live allocation of the pod holds the address, or its delete failed)",
                            d.name
                        ))
                    }
                    Err(e) => {
                        ok = false;
                        done.push_str(&format!("; reservation {}: {e}", d.name))
                    }
                }
            }
            println!(
                "released {at}: held by {} (sandbox {}); entry removed{done}",
                j.entry.podref,
                ipreclaim::scan::short_id(&j.entry.id)
            );
            ok
        }
        Ok(ReleaseOutcome::Cooling(until)) => {
            println!(
                "released {at} into its cooldown until {until}: held by {} (sandbox {}); entry \
                 marked cooling, reservation kept (the controller's leader returns both when the \
                 time is up)",
                j.entry.podref,
                ipreclaim::scan::short_id(&j.entry.id)
            );
            true
        }
        other => writes::report_unwritten(&at, other),
    }
}
