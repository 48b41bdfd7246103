//! What the manual commands (`ipreclaim unfence`, `ipreclaim release`) would write, planned
//! from an [`Index`] of the cluster built by the controller's own rules. Pure: the commands
//! hand the planned requests to a [`Writer`](super::Writer), which pins each entry by its id
//! and podref as it does for the controller.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::index::{CoolingEntry, FenceSource, Index, PodUid, UnrecordedMark};
use crate::ipam::fence::{FENCED_PODREF_SUFFIX, FenceRecord};
use crate::ipam::{PodKey, PoolEntry};
use crate::reclaim::{Decision, Judged, PodRef, Reason};

use super::types::{EntryWrite, ReleaseRequest};

/// Which fences `unfence` lifts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceSelect {
    /// The fences of one address (in any pool).
    Ip(IpAddr),
    /// The fences of pods deleted from one node.
    Node(String),
    /// Every fence (the uninstall path).
    All,
}

/// One planned write, and the live pods whose network-status lists its address (a write
/// they list is refused unless forced).
#[derive(Debug, Clone)]
pub struct Planned {
    /// The request for the writer.
    pub request: ReleaseRequest,
    /// Live (not finished) pods listing the address, as `namespace/name`.
    pub listed_by: Vec<String>,
}

/// Live pods that have not finished whose network-status lists `ip` on a network that
/// allocates from `pool` (on any network when none is known to), as `namespace/name` (sorted).
pub fn listed_by(index: &Index, pool: &str, ip: IpAddr) -> Vec<String> {
    let networks = index.networks().of_pool(pool).filter(|n| !n.is_empty());
    let pods = index.pods();
    let mut out: Vec<String> = pods
        .live_pods()
        .into_iter()
        .filter_map(|PodUid { podref, .. }| {
            let live = pods.live(&podref)?;
            let lists = live.networks.as_ref().is_some_and(|n| {
                n.iter().any(|a| {
                    a.ips.contains(&ip)
                        && networks.is_none_or(|ns| ns.iter().any(|m| *m == *a.name))
                })
            });
            (lists && !live.terminal).then_some(podref)
        })
        .collect();
    out.sort();
    out
}

/// The network to name in Events for an entry of `pool`: the first NAD known to allocate
/// from it, else the pool's name.
fn network_of(index: &Index, pool: &str) -> String {
    index
        .networks()
        .of_pool(pool)
        .and_then(|n| n.first().cloned())
        .unwrap_or_else(|| pool.to_owned())
}

fn request(
    pool: &str,
    entry: &PoolEntry,
    network: String,
    pod: PodRef,
    reason: Reason,
    write: EntryWrite,
) -> ReleaseRequest {
    ReleaseRequest {
        judged: Judged {
            pool: pool.to_owned(),
            entry: entry.clone(),
            decision: Decision::Release(reason),
            network,
            pod,
            node: None,
        },
        reason,
        deleted_at: None,
        cooldown: None,
        write,
    }
}

/// The lift of a recorded fence, as the controller writes it.
fn lift(
    pool: &str,
    entry: &PoolEntry,
    record: &FenceRecord,
    source: FenceSource,
) -> ReleaseRequest {
    let network = record.network_or(pool);
    let pod = PodRef::from_podref(&record.podref, record.uid.clone());
    let write = EntryWrite::Unfence(record.clone(), source);
    request(pool, entry, network, pod, Reason::PodDeleted, write)
}

/// The fences `select` names, each as an `Unfence` request (the entry removed pinned by its id
/// and fenced podref, then its record deleted with its uid as precondition), sorted by pool
/// and address. With [`FenceSelect::Ip`] and [`FenceSelect::All`], entries marked fenced whose
/// record is nowhere (deleted by hand) come too, as plain removals of the marked entry.
pub fn fences(index: &Index, select: &FenceSelect) -> Vec<Planned> {
    let mut out: Vec<Planned> = index
        .fenced()
        .into_iter()
        .filter(|f| match select {
            FenceSelect::Ip(ip) => f.entry.ip == *ip,
            FenceSelect::Node(node) => f.record.node == *node,
            FenceSelect::All => true,
        })
        .map(|f| Planned {
            listed_by: listed_by(index, &f.pool, f.entry.ip),
            request: lift(&f.pool, &f.entry, &f.record, f.source),
        })
        .collect();
    if !matches!(select, FenceSelect::Node(_)) {
        for UnrecordedMark {
            pool,
            key,
            podref: marked,
        } in index.unrecorded_marks()
        {
            let Some(entry) = index.pools().get(&pool).and_then(|p| p.marked.get(&key)) else {
                continue;
            };
            if matches!(select, FenceSelect::Ip(ip) if entry.ip != *ip) {
                continue;
            }
            let podref = marked.strip_suffix(FENCED_PODREF_SUFFIX).unwrap_or(&marked);
            let pod = PodRef::from_podref(podref, String::new());
            let network = network_of(index, &pool);
            out.push(Planned {
                listed_by: listed_by(index, &pool, entry.ip),
                request: request(
                    &pool,
                    entry,
                    network,
                    pod,
                    Reason::PodDeleted,
                    EntryWrite::Remove,
                ),
            });
        }
    }
    out.sort_by(|a, b| {
        let key = |p: &Planned| (p.request.judged.pool.clone(), p.request.judged.entry.ip);
        key(a).cmp(&key(b))
    });
    out
}

/// What `release` frees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseTarget {
    /// One address, in the pools of `network` (`namespace/nad`) when given.
    Ip {
        /// The address.
        ip: IpAddr,
        /// The NAD whose pools are meant.
        network: Option<String>,
    },
    /// Every allocation of one pod.
    Pod(PodKey),
}

/// Why `release` plans nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPlanned {
    /// No pool entry matches.
    #[error("no allocation of {0}")]
    Nothing(String),
    /// The address is allocated in several pools and no network says which.
    #[error("{ip} is allocated in several pools: {pools}; say which with --network NAMESPACE/NAD")]
    Ambiguous {
        /// The address.
        ip: IpAddr,
        /// The pools, each with the networks known to allocate from it.
        pools: String,
    },
    /// The address is held only by fences: `unfence` lifts them.
    #[error("{ip} is fenced ({pools}): lift the fence with `ipreclaim unfence --ip {ip}`")]
    Fenced {
        /// The address.
        ip: IpAddr,
        /// The pools that hold it fenced.
        pools: String,
    },
    /// The address was released and is in its release cooldown: it returns to the pool then.
    #[error(
        "{ip} is cooling ({pools}): released, and kept out of the pool until {until} \
         (--release-cooldown); --force ends the cooldown now"
    )]
    Cooling {
        /// The address.
        ip: IpAddr,
        /// The pools that hold it cooling.
        pools: String,
        /// When its cooldown ends (the latest, if in several pools), or why it cannot be read.
        until: String,
    },
}

/// The reason code a manual release of `entry` carries: what the controller's rules say of
/// the pod named in it (the audit line and the Event also say it was done by hand), or
/// [`Reason::Forced`] when a live pod lists the address (written only with `--force`).
fn manual_reason(index: &Index, entry: &PoolEntry, listed_by: &[String]) -> Reason {
    if !listed_by.is_empty() {
        return Reason::Forced;
    }
    match index.pods().live(&entry.podref) {
        None => Reason::PodMissing,
        Some(l) if l.terminal => Reason::PodTerminal,
        Some(_) => Reason::IPNotOnPod,
    }
}

/// The removals `target` names (each pinned by its id and podref), sorted by pool and address,
/// or why there are none. A cooling address (`--release-cooldown`) is refused, or with `force`
/// its cooldown ends now.
pub fn releases(
    index: &Index,
    target: &ReleaseTarget,
    force: bool,
) -> Result<Vec<Planned>, NotPlanned> {
    let found = targeted(index, target);
    if let ReleaseTarget::Ip { ip, network } = target {
        match refuse_ip(index, &found, *ip, network.as_deref()) {
            Err(NotPlanned::Cooling { .. }) if force => {
                return Ok(end_cooldowns(index, *ip, network.as_deref()));
            }
            result => result?,
        }
    }
    if let (ReleaseTarget::Pod(podref), true) = (target, found.is_empty()) {
        return Err(NotPlanned::Nothing(format!("pod {podref}")));
    }
    Ok(found
        .into_iter()
        .map(|(pool, entry)| {
            let network = match target {
                ReleaseTarget::Ip {
                    network: Some(n), ..
                } => n.clone(),
                _ => network_of(index, &pool),
            };
            let uid = index
                .pods()
                .live(&entry.podref)
                .map(|l| l.uid.clone())
                .unwrap_or_default();
            let pod = PodRef::from_podref(&entry.podref, uid);
            let listed_by = listed_by(index, &pool, entry.ip);
            let reason = manual_reason(index, &entry, &listed_by);
            Planned {
                listed_by,
                request: request(&pool, &entry, network, pod, reason, EntryWrite::Remove),
            }
        })
        .collect())
}

/// The entries `target` names, as (pool, entry), by pool and address.
fn targeted(index: &Index, target: &ReleaseTarget) -> Vec<(String, PoolEntry)> {
    let pools = index.pools();
    let mut found: Vec<(String, PoolEntry)> = match target {
        ReleaseTarget::Ip { ip, network } => pools
            .all()
            .values()
            .filter(|p| match network {
                Some(n) => index
                    .networks()
                    .of_pool(&p.name)
                    .is_some_and(|ns| ns.contains(n)),
                None => true,
            })
            .flat_map(|p| {
                p.entries
                    .values()
                    .filter(|e| e.ip == *ip)
                    .map(|e| (p.name.clone(), e.clone()))
            })
            .collect(),
        ReleaseTarget::Pod(pod) => pools
            .slots(&pod.podref())
            .filter_map(|(pool, key)| Some((pool.to_owned(), pools.entry(pool, key)?.clone())))
            .collect(),
    };
    found.sort_by(|a, b| (&a.0, a.1.ip).cmp(&(&b.0, b.1.ip)));
    found
}

/// Why an address (`ip`, on `network` if given) cannot be released as asked: it is in several
/// pools, fenced, or in none.
fn refuse_ip(
    index: &Index,
    found: &[(String, PoolEntry)],
    ip: IpAddr,
    network: Option<&str>,
) -> Result<(), NotPlanned> {
    let describe = |names: &BTreeSet<&str>| {
        names
            .iter()
            .map(|p| match index.networks().of_pool(p) {
                Some(n) if !n.is_empty() => format!("{p} (network {})", n.join(", ")),
                _ => format!("{p} (no known network)"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let names: BTreeSet<&str> = found.iter().map(|(p, _)| p.as_str()).collect();
    if names.len() > 1 {
        let pools = describe(&names);
        return Err(NotPlanned::Ambiguous { ip, pools });
    }
    if !found.is_empty() {
        return Ok(());
    }
    let fenced: BTreeSet<&str> = index
        .pools()
        .all()
        .values()
        .filter(|p| p.marked.values().any(|e| e.ip == ip))
        .map(|p| p.name.as_str())
        .collect();
    if !fenced.is_empty() {
        let pools = describe(&fenced);
        return Err(NotPlanned::Fenced { ip, pools });
    }
    let cooling = cooling_at(index, ip, network);
    if let Some(until) = cooling
        .iter()
        .map(|(_, c)| &c.until)
        .max_by_key(|u| u.as_ref().ok())
    {
        let names = cooling.iter().map(|(p, _)| p.as_str()).collect();
        let until = match until {
            Ok(t) => t.to_string(),
            Err(e) => e.to_string(),
        };
        let pools = describe(&names);
        return Err(NotPlanned::Cooling { ip, pools, until });
    }
    let what = match network {
        Some(n) => format!("{ip} in the pools of network {n}"),
        None => ip.to_string(),
    };
    Err(NotPlanned::Nothing(what))
}

/// The cooling entries of `ip` (in the pools of `network` when given), as (pool, entry).
fn cooling_at(index: &Index, ip: IpAddr, network: Option<&str>) -> Vec<(String, CoolingEntry)> {
    index
        .cooling()
        .into_iter()
        .filter(|(pool, c)| {
            c.entry.ip == ip
                && network.is_none_or(|n| {
                    index
                        .networks()
                        .of_pool(pool)
                        .is_some_and(|ns| ns.iter().any(|x| x == n))
                })
        })
        .collect()
}

/// The ends of the cooldowns of `ip` (`release --ip --force`), as the controller writes them.
fn end_cooldowns(index: &Index, ip: IpAddr, network: Option<&str>) -> Vec<Planned> {
    cooling_at(index, ip, network)
        .into_iter()
        .map(|(pool, c)| {
            let network = network.map_or_else(|| network_of(index, &pool), str::to_owned);
            let pod = PodRef::from_podref(&c.pod, String::new());
            let write = EntryWrite::EndCooldown;
            Planned {
                listed_by: listed_by(index, &pool, ip),
                request: request(&pool, &c.entry, network, pod, Reason::CooldownEnded, write),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use super::*;
    use crate::index::{FenceObject, PodSeen};

    use crate::index::tests::pool_named as pool;

    fn record(podref: &str, node: &str) -> FenceRecord {
        FenceRecord {
            podref: podref.into(),
            uid: format!("uid-{podref}"),
            node: node.into(),
            why: "Ready=Unknown".into(),
            network: "ns/net".into(),
            since: "2025-01-01T00:00:00Z".parse().unwrap(),
            grace_seconds: None,
        }
    }

    fn object(name: &str, sandbox: &str, podref: &str, node: &str) -> FenceObject {
        FenceObject {
            name: name.into(),
            uid: format!("uid-{name}"),
            sandbox: sandbox.into(),
            record: record(podref, node),
            evidence: Default::default(),
        }
    }

    fn live(ix: &mut Index, podref: &str, ips: &[&str], terminal: bool) {
        let ips: Vec<String> = ips.iter().map(|i| format!("\"{i}\"")).collect();
        let annotations = BTreeMap::from([(
            crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(),
            format!(
                r#"[{{"name":"ns/net","interface":"net1","ips":[{}]}}]"#,
                ips.join(",")
            ),
        )]);
        let seen = PodSeen {
            annotations: Some(&annotations),
            node: Some("node-a"),
            terminal,
            mirror: false,
            grace_seconds: None,
        };
        ix.upsert_pod(podref, &format!("uid-{podref}"), seen, Instant::now());
    }

    /// Pool p: 10 and 11 fenced (node-a, node-b), 12 marked with no record, 20 of web-0 (live,
    /// lists .20 and .10), 30 of gone-0; pool q: 30 of other-0, 40 of done-0 (finished, lists
    /// .40).
    fn index() -> Index {
        let mut ix = Index::default();
        ix.upsert_pool(&pool(
            "p",
            &[
                ("10", "sb-a", "ns/a:fenced"),
                ("11", "sb-b", "ns/b:fenced"),
                ("12", "sb-c", "ns/c:fenced"),
                ("20", "sb-web", "ns/web-0"),
                ("30", "sb-gone", "ns/gone-0"),
            ],
        ));
        ix.upsert_pool(&pool(
            "q",
            &[("30", "sb-o", "ns/other-0"), ("40", "sb-d", "ns/done-0")],
        ));
        ix.set_pools_listed();
        ix.upsert_fence_object("p", "10", object("p-10", "sb-a", "ns/a", "node-a"));
        ix.upsert_fence_object("p", "11", object("p-11", "sb-b", "ns/b", "node-b"));
        live(&mut ix, "ns/web-0", &["192.0.2.20", "192.0.2.10"], false);
        live(&mut ix, "ns/done-0", &["192.0.2.40"], true);
        ix
    }

    fn releases_of(ix: &Index, target: &ReleaseTarget) -> Result<Vec<Planned>, NotPlanned> {
        releases(ix, target, false)
    }

    fn ips(planned: &[Planned]) -> Vec<String> {
        planned
            .iter()
            .map(|p| format!("{}/{}", p.request.judged.pool, p.request.judged.entry.ip))
            .collect()
    }

    #[test]
    fn fences_are_chosen_by_address_node_or_all_with_who_lists_them() {
        let ix = index();
        let ip = |s: &str| FenceSelect::Ip(s.parse().unwrap());
        let one = fences(&ix, &ip("192.0.2.10"));
        assert_eq!(ips(&one), ["p/192.0.2.10"]);
        assert_eq!(one[0].listed_by, ["ns/web-0"]);
        let EntryWrite::Unfence(r, FenceSource::Object { name, uid }) = &one[0].request.write
        else {
            panic!("an unfence of the object: {:?}", one[0].request.write)
        };
        assert_eq!(
            (r.podref.as_str(), name.as_str(), uid.as_str()),
            ("ns/a", "p-10", "uid-p-10")
        );
        // Pinned on the entry as stored: its id and fenced podref.
        let e = &one[0].request.judged.entry;
        assert_eq!((e.id.as_str(), e.podref.as_str()), ("sb-a", "ns/a:fenced"));
        assert_eq!(one[0].request.judged.pod.podref(), "ns/a");
        assert_eq!(one[0].request.judged.network, "ns/net");

        let node = fences(&ix, &FenceSelect::Node("node-b".into()));
        assert_eq!(ips(&node), ["p/192.0.2.11"]);
        assert!(node[0].listed_by.is_empty());
        // A mark without a record: with --ip and --all, a plain removal of the marked entry.
        let all = fences(&ix, &FenceSelect::All);
        assert_eq!(ips(&all), ["p/192.0.2.10", "p/192.0.2.11", "p/192.0.2.12"]);
        assert_eq!(all[2].request.write, EntryWrite::Remove);
        assert_eq!(all[2].request.judged.entry.podref, "ns/c:fenced");
        assert_eq!(all[2].request.judged.pod.podref(), "ns/c");
        assert!(fences(&ix, &ip("192.0.2.20")).is_empty(), "not fenced");
    }

    #[test]
    fn releases_pin_each_entry_and_say_why_none_is_planned() {
        let ix = index();
        let at = |ip: &str, network: Option<&str>| ReleaseTarget::Ip {
            ip: ip.parse().unwrap(),
            network: network.map(str::to_owned),
        };
        let one = releases_of(&ix, &at("192.0.2.20", None)).unwrap();
        assert_eq!(ips(&one), ["p/192.0.2.20"]);
        assert_eq!(one[0].listed_by, ["ns/web-0"]);
        assert_eq!(one[0].request.write, EntryWrite::Remove);
        assert_eq!(one[0].request.judged.pod.uid, "uid-ns/web-0");
        // Listed by a live pod: written only with --force, and says so.
        assert_eq!(one[0].request.reason, Reason::Forced);
        // A finished pod's listing does not count.
        let done = releases_of(&ix, &at("192.0.2.40", None)).unwrap();
        assert!(done[0].listed_by.is_empty());
        assert_eq!(done[0].request.reason, Reason::PodTerminal);
        // In two pools: which one must be said.
        let err = releases_of(&ix, &at("192.0.2.30", None)).unwrap_err();
        assert!(
            matches!(&err, NotPlanned::Ambiguous { pools, .. } if pools.contains("p (") && pools.contains("q (")),
            "{err}"
        );
        let fenced = releases_of(&ix, &at("192.0.2.11", None)).unwrap_err();
        assert!(matches!(fenced, NotPlanned::Fenced { .. }), "{fenced}");
        assert!(matches!(
            releases_of(&ix, &at("192.0.2.99", None)),
            Err(NotPlanned::Nothing(_))
        ));
        let pod = releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "gone-0"))).unwrap();
        assert_eq!(ips(&pod), ["p/192.0.2.30"]);
        assert_eq!(pod[0].request.reason, Reason::PodMissing);
        assert!(matches!(
            releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "nobody"))),
            Err(NotPlanned::Nothing(_))
        ));
    }

    #[test]
    fn a_cooling_address_is_refused_and_force_ends_its_cooldown() {
        let mut ix = index();
        let marker = "ipreclaim-cooldown:2026-11-25T10:00:31Z";
        ix.upsert_pool(&pool("r", &[("50", marker, "ns/old-0:cooldown")]));
        let at = ReleaseTarget::Ip {
            ip: "192.0.2.50".parse().unwrap(),
            network: None,
        };
        let err = releases(&ix, &at, false).unwrap_err();
        let NotPlanned::Cooling { until, pools, .. } = &err else {
            panic!("cooling: {err}")
        };
        assert_eq!(until, "2026-11-25T10:00:31Z");
        assert!(pools.starts_with("r "), "{pools}");
        assert!(err.to_string().contains("--force"), "{err}");
        let forced = releases(&ix, &at, true).unwrap();
        assert_eq!(ips(&forced), ["r/192.0.2.50"]);
        let r = &forced[0].request;
        assert_eq!(r.write, EntryWrite::EndCooldown);
        // Pinned on the entry as stored; its reservation names the pod.
        assert_eq!(r.judged.entry.id, marker);
        assert_eq!(r.podref(), "ns/old-0");
        // Not a release of the pod's other addresses, nor a leak.
        assert!(releases_of(&ix, &ReleaseTarget::Pod(PodKey::new("ns", "old-0"))).is_err());
    }
}
