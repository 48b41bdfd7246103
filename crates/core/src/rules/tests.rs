use super::*;
use crate::ipam::parse_network_status;
use proptest::prelude::*;

const X: &str = "192.0.2.10";
const Y: &str = "192.0.2.11";
const NET: &str = "apps/macvlan";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn on(network: &str, ifname: &str, ips: &[&str]) -> NetworkAttachment {
    NetworkAttachment {
        name: network.into(),
        interface: Some(ifname.into()),
        ips: ips.iter().map(|s| ip(s)).collect(),
    }
}

/// An owned scenario, so that the table can hold the borrowed inputs' data.
#[derive(Clone, Default)]
struct Case {
    name: &'static str,
    alloc_ip: &'static str,
    sandbox: &'static str,
    ifname: Option<&'static str>,
    pool_networks: Option<Vec<String>>,
    live: Option<(&'static str, PodPhase, Option<Vec<NetworkAttachment>>)>,
    deleted: Vec<(&'static str, Option<Vec<NetworkAttachment>>)>,
    dead: Vec<String>,
    /// The entry's slot held another sandbox when the deletions were seen (allocated since).
    entry_newer_than_deletions: bool,
    release_terminal: bool,
    want: Option<Decision>,
}

impl Case {
    fn new(name: &'static str) -> Self {
        Case {
            name,
            alloc_ip: X,
            sandbox: "sb-1",
            ifname: Some("net1"),
            pool_networks: Some(vec![NET.into()]),
            release_terminal: true,
            ..Default::default()
        }
    }

    fn decide(&self) -> Decision {
        let deleted: Vec<DeletedPod<'_>> = self
            .deleted
            .iter()
            .map(|(uid, nets)| DeletedPod {
                uid,
                networks: nets.as_deref(),
                entry_replaced: self.entry_newer_than_deletions,
            })
            .collect();
        let pods = PodKnowledge {
            live: self.live.as_ref().map(|(uid, phase, nets)| LivePod {
                uid,
                phase: *phase,
                networks: nets.as_deref(),
            }),
            deleted: &deleted,
            dead_sandboxes: &self.dead,
        };
        let alloc = Allocation {
            ip: ip(self.alloc_ip),
            sandbox_id: self.sandbox,
            podref: "apps/web-0",
            ifname: self.ifname,
        };
        let pool = PoolContext {
            networks: self.pool_networks.as_deref(),
        };
        let config = ReclaimConfig {
            release_terminal_pods: self.release_terminal,
        };
        decide(&alloc, &pool, &pods, &config)
    }
}

fn cases() -> Vec<Case> {
    use Decision::*;
    use PodPhase::*;
    let listing = |ips: &[&str]| Some(vec![on(NET, "net1", ips)]);
    vec![
        Case {
            live: Some(("uid-1", Running, listing(&[X]))),
            want: Some(Keep(KeepReason::ListedOnPod)),
            ..Case::new("live pod listing the IP keeps it")
        },
        Case {
            live: Some(("uid-1", Running, None)),
            want: Some(Keep(KeepReason::NoNetworkStatus)),
            ..Case::new("live pod without network-status keeps everything")
        },
        Case {
            live: Some(("uid-2", Pending, None)),
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Keep(KeepReason::NoNetworkStatus)),
            ..Case::new("recreated pod without network-status yet keeps even a tombstone's IP")
        },
        Case {
            live: Some(("uid-2", Running, listing(&[Y]))),
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Release(Reason::PodDeleted)),
            ..Case::new("StatefulSet: web-0 recreated with another IP, the old IP goes")
        },
        Case {
            sandbox: "sb-3",
            live: Some(("uid-2", Running, listing(&[Y]))),
            deleted: vec![("uid-1", listing(&[X]))],
            entry_newer_than_deletions: true,
            want: Some(Candidate(Reason::IPNotOnPod)),
            ..Case::new(
                "StatefulSet: the old IP given to the recreated pod's new sandbox is not the tombstone's",
            )
        },
        Case {
            alloc_ip: Y,
            sandbox: "sb-2",
            live: Some(("uid-2", Running, listing(&[Y]))),
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Keep(KeepReason::ListedOnPod)),
            ..Case::new("StatefulSet: the recreated pod keeps its new IP")
        },
        Case {
            live: Some(("uid-2", Running, listing(&[X]))),
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Keep(KeepReason::ListedOnPod)),
            ..Case::new("recreated pod that got the same IP keeps it")
        },
        Case {
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Release(Reason::PodDeleted)),
            ..Case::new("tombstone listing the IP releases it")
        },
        Case {
            deleted: vec![("uid-1", None)],
            want: Some(Release(Reason::PodDeleted)),
            ..Case::new("tombstone without network-status releases its podref's allocations")
        },
        Case {
            deleted: vec![("uid-1", listing(&[Y]))],
            want: Some(Candidate(Reason::PodMissing)),
            ..Case::new("tombstone listing other IPs: only a sweep candidate")
        },
        Case {
            want: Some(Candidate(Reason::PodMissing)),
            ..Case::new("no pod at all: sweep candidate")
        },
        Case {
            pool_networks: None,
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Release(Reason::PodDeleted)),
            ..Case::new("deleted NAD: the deletion path still releases")
        },
        Case {
            live: Some(("uid-1", Running, listing(&[Y]))),
            want: Some(Candidate(Reason::IPNotOnPod)),
            ..Case::new("live pod lists another IP on this pool's network")
        },
        Case {
            pool_networks: None,
            live: Some(("uid-1", Running, listing(&[Y]))),
            want: Some(Candidate(Reason::IPNotOnPod)),
            ..Case::new("NAD unknown: the interface name ties the entry to the allocation")
        },
        Case {
            pool_networks: None,
            ifname: None,
            live: Some(("uid-1", Running, listing(&[Y]))),
            want: Some(Keep(KeepReason::NoInformationForNetwork)),
            ..Case::new("NAD unknown and no interface recorded: no evidence")
        },
        Case {
            ifname: Some("net2"),
            live: Some(("uid-1", Running, Some(vec![on("apps/other", "net1", &[Y])]))),
            want: Some(Keep(KeepReason::NoInformationForNetwork)),
            ..Case::new("network-status says nothing about this pool's network")
        },
        Case {
            live: Some(("uid-1", Succeeded, listing(&[X]))),
            want: Some(Candidate(Reason::PodTerminal)),
            ..Case::new("completed pod: candidate even though it lists the IP")
        },
        Case {
            live: Some(("uid-1", Failed, None)),
            want: Some(Candidate(Reason::PodTerminal)),
            ..Case::new("failed pod without network-status")
        },
        Case {
            live: Some(("uid-1", Succeeded, listing(&[X]))),
            release_terminal: false,
            want: Some(Keep(KeepReason::TerminalReleaseDisabled)),
            ..Case::new("terminal release turned off")
        },
        Case {
            live: Some(("uid-1", Running, listing(&[Y]))),
            dead: vec!["sb-1".into()],
            want: Some(Release(Reason::SandboxGone)),
            ..Case::new("the sandbox that held it died; the pod runs on in a new one")
        },
        Case {
            live: Some(("uid-1", Running, None)),
            dead: vec!["sb-1".into()],
            want: Some(Release(Reason::SandboxGone)),
            ..Case::new("dead sandbox: no annotation race to wait for")
        },
        Case {
            live: Some(("uid-1", Running, listing(&[X]))),
            dead: vec!["sb-1".into()],
            want: Some(Keep(KeepReason::ListedOnPod)),
            ..Case::new("dead sandbox but the pod lists the IP: kept")
        },
        Case {
            live: Some(("uid-1", Running, listing(&[Y]))),
            dead: vec!["sb-9".into()],
            want: Some(Candidate(Reason::IPNotOnPod)),
            ..Case::new("another sandbox died: no SandboxGone for this one")
        },
        Case {
            live: Some(("uid-1", Running, listing(&[Y]))),
            deleted: vec![("uid-1", listing(&[X]))],
            want: Some(Candidate(Reason::IPNotOnPod)),
            ..Case::new("a tombstone with the live pod's own uid is stale and ignored")
        },
    ]
}

#[test]
fn reclaim_rules_table() {
    for case in cases() {
        assert_eq!(Some(case.decide()), case.want, "{}", case.name);
    }
}

#[test]
fn default_network_entries_are_never_considered() {
    // The cluster network lists the address: that is no evidence either way.
    let annotation =
        format!(r#"[{{"name":"cbr0","interface":"eth0","ips":["{X}"],"default":true}}]"#);
    let networks = parse_network_status(&annotation).unwrap();
    let case = Case {
        live: Some(("uid-1", PodPhase::Running, Some(networks))),
        ..Case::new("default only")
    };
    assert_eq!(
        case.decide(),
        Decision::Keep(KeepReason::NoInformationForNetwork)
    );
}

fn attachment() -> impl Strategy<Value = NetworkAttachment> {
    (
        prop::sample::select(vec![NET, "apps/other", "x/y"]),
        prop::sample::select(vec!["net1", "net2"]),
        prop::collection::vec(prop::sample::select(vec![X, Y, "2001:db8::1"]), 0..3),
    )
        .prop_map(|(n, i, ips)| on(n, i, &ips))
}

fn phase() -> impl Strategy<Value = PodPhase> {
    prop::sample::select(vec![
        PodPhase::Pending,
        PodPhase::Running,
        PodPhase::Succeeded,
        PodPhase::Failed,
        PodPhase::Unknown,
    ])
}

proptest! {
    #[test]
    fn an_ip_listed_by_a_live_pod_is_never_released(
        mut live_nets in prop::collection::vec(attachment(), 0..3),
        listed_on in prop::sample::select(vec![NET, "apps/other"]),
        phase in phase(),
        deleted in prop::collection::vec(prop::option::of(prop::collection::vec(attachment(), 0..3)), 0..3),
        dead in prop::collection::vec(prop::sample::select(vec!["sb-1".to_string(), "sb-2".to_string()]), 0..2),
        pool_known in any::<bool>(),
        ifname in prop::option::of(prop::sample::select(vec!["net1", "net2"])),
        release_terminal in any::<bool>(),
    ) {
        live_nets.push(on(listed_on, "net1", &[X]));
        let case = Case {
            ifname,
            pool_networks: pool_known.then(|| vec![NET.to_string()]),
            live: Some(("uid-live", phase, Some(live_nets))),
            deleted: deleted.into_iter().map(|n| ("uid-old", n)).collect(),
            dead,
            release_terminal,
            ..Case::new("generated")
        };
        let decision = case.decide();
        prop_assert!(!matches!(decision, Decision::Release(_)), "released a listed IP: {:?}", decision);
    }
}
