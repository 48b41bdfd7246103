//! Resource names exactly as the whereabouts CNI plugin makes them.

use std::net::IpAddr;

use ipnet::IpNet;

/// whereabouts' normalization: append `0` to a string ending in `:`, then turn every `:` and
/// `/` into `-`.
fn normalize(s: &str) -> String {
    let mut out = s.to_string();
    if out.ends_with(':') {
        out.push('0');
    }
    out.replace([':', '/'], "-")
}

fn prefixed(parts: &[Option<&str>], last: String) -> String {
    let mut name = String::new();
    for p in parts.iter().flatten().filter(|p| !p.is_empty()) {
        name.push_str(p);
        name.push('-');
    }
    name.push_str(&last);
    name
}

/// The IPPool name for `range`: `[<network_name>-][<node>-]<normalized range>`, the range
/// first reduced to its network (`192.168.2.225/28` names pool `192.168.2.224-28`).
pub fn ippool_name(range: &IpNet, network_name: Option<&str>, node: Option<&str>) -> String {
    prefixed(&[network_name, node], normalize(&range.trunc().to_string()))
}

/// Whether `pool` (with range `pool_range`) is the pool whereabouts makes for one node's slice
/// of a node-slice network over `range` named `network_name`: the slice lies in the range and
/// the name is `[<network_name>-]<node>-<normalized slice>` for some non-empty node name.
pub fn is_node_slice_pool(
    pool: &str,
    pool_range: &IpNet,
    range: &IpNet,
    network_name: Option<&str>,
) -> bool {
    if !range.trunc().contains(&pool_range.trunc()) {
        return false;
    }
    let prefix = prefixed(&[network_name], String::new());
    let suffix = format!("-{}", normalize(&pool_range.trunc().to_string()));
    pool.strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix(&suffix))
        .is_some_and(|node| !node.is_empty())
}

/// The OverlappingRangeIPReservation name for `ip`: `[<network_name>-]<normalized IP>`.
pub fn reservation_name(ip: IpAddr, network_name: Option<&str>) -> String {
    prefixed(&[network_name], normalize(&ip.to_string()))
}

/// The `<network_name>` parts `p` for which `name` is `p-<normalized IP>` (a name can split
/// more than one way: `a-fd00--1` ends in both `fd00--1` and `a-fd00--1`). Each split is checked
/// forward: the rest must be exactly the name of the address it parses to.
pub fn reservation_prefixes(name: &str) -> impl Iterator<Item = &str> {
    name.match_indices('-').filter_map(move |(i, _)| {
        let rest = &name[i + 1..];
        let ip: IpAddr = rest.replace('-', ":").parse().ok()?;
        (i > 0 && reservation_name(ip, None) == rest).then(|| &name[..i])
    })
}

/// The readings of a reservation's name: (its network's name, the address), the whole name's
/// (no network name) and the rest's of each split of [`reservation_prefixes`] (a name can read
/// more than one way).
pub fn reservation_readings(name: &str) -> Vec<(Option<&str>, IpAddr)> {
    let parse = |s: &str| {
        let ip: IpAddr = s.replace('-', ":").parse().ok()?;
        (reservation_name(ip, None) == s).then_some(ip)
    };
    let whole = parse(name).map(|ip| (None, ip));
    let splits =
        reservation_prefixes(name).filter_map(|p| Some((Some(p), parse(&name[p.len() + 1..])?)));
    whole.into_iter().chain(splits).collect()
}

/// An RFC 1123 label (a namespace name): at most 63 of `a-z0-9-`, alphanumeric at both ends.
fn is_label(s: &str) -> bool {
    s.len() <= 63 && is_label_text(s)
}

/// Lower-case letters, digits and `-`, neither first nor last: a label's text. In a subdomain
/// (a pod's name) a label's length is not limited, only the whole's (Kubernetes'
/// `IsDNS1123Subdomain`: a pod may be named by 253 characters without a dot).
fn is_label_text(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `podref` is `<namespace>/<pod name>` with names Kubernetes accepts (a pod name is
/// an RFC 1123 subdomain: dot-separated labels, at most 253 characters).
pub fn is_pod_ref(podref: &str) -> bool {
    super::pod_key::split(podref).is_some_and(|(namespace, name)| {
        is_label(namespace) && name.len() <= 253 && name.split('.').all(is_label_text)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_refs_are_namespace_and_pod_name() {
        let longest = format!("{}/{}", "n".repeat(63), "p".repeat(253));
        for good in ["ns/web-0", "kube-system/a.b-c", "a/b", &longest] {
            assert!(is_pod_ref(good), "{good}");
        }
        let too_long = [
            format!("{}/p", "n".repeat(64)),
            format!("ns/{}", "p".repeat(254)),
        ];
        assert!(too_long.iter().all(|p| !is_pod_ref(p)));
        for bad in [
            "",
            "web-0",
            "ns/",
            "/web-0",
            "ns/Web-0",
            "ns/web_0",
            "ns/web-0/x",
            "ns/-a",
            "ns/a..b",
            "ns/web-0:fenced",
            "ns /a",
        ] {
            assert!(!is_pod_ref(bad), "{bad}");
        }
        assert!(!is_pod_ref(&format!("ns/{}", "a".repeat(254))));
    }

    #[test]
    fn ippool_names_from_compat() {
        // (range, network_name, node, name)
        let cases = [
            ("10.0.0.0/8", None, None, "10.0.0.0-8"),
            ("10.0.0.0/8", Some("test"), None, "test-10.0.0.0-8"),
            ("10.0.0.0/8", None, Some("testnode"), "testnode-10.0.0.0-8"),
            (
                "10.0.0.0/8",
                Some("testnetwork"),
                Some("testnode"),
                "testnetwork-testnode-10.0.0.0-8",
            ),
            ("fd00::/64", None, None, "fd00---64"),
            ("192.168.2.225/28", None, None, "192.168.2.224-28"),
            (
                "2001:db8:0:1::/64",
                Some("net"),
                None,
                "net-2001-db8-0-1---64",
            ),
            ("10.0.0.0/8", Some(""), None, "10.0.0.0-8"),
        ];
        for (range, network, node, want) in cases {
            let range: IpNet = range.parse().unwrap();
            assert_eq!(
                ippool_name(&range, network, node),
                want,
                "{range} {network:?} {node:?}"
            );
        }
    }

    #[test]
    fn reservation_names_from_compat() {
        let cases = [
            ("10.0.0.5", None, "10.0.0.5"),
            ("fd00::", None, "fd00--0"),
            ("fd00::5", None, "fd00--5"),
            ("10.0.0.5", Some("test"), "test-10.0.0.5"),
            ("2001:db8::1", Some("test"), "test-2001-db8--1"),
        ];
        for (ip, network, want) in cases {
            assert_eq!(
                reservation_name(ip.parse().unwrap(), network),
                want,
                "{ip} {network:?}"
            );
        }
    }

    #[test]
    fn reservation_names_are_read_back_every_way_they_split() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        type Reading<'a> = (Option<&'a str>, IpAddr);
        let cases: [(&str, Vec<Reading>); 6] = [
            ("10.0.0.5", vec![(None, ip("10.0.0.5"))]),
            ("test-10.0.0.5", vec![(Some("test"), ip("10.0.0.5"))]),
            ("fd00--5", vec![(None, ip("fd00::5"))]),
            (
                "test-2001-db8--1",
                vec![
                    (Some("test"), ip("2001:db8::1")),
                    (Some("test-2001"), ip("db8::1")),
                ],
            ),
            ("net-10.0.0.05", vec![]),
            ("not-an-address", vec![]),
        ];
        for (name, want) in cases {
            assert_eq!(reservation_readings(name), want, "{name}");
        }
    }

    #[test]
    fn reservation_prefixes_are_every_forward_split() {
        let cases: [(&str, &[&str]); 7] = [
            ("10.0.0.5", &[]),
            ("test-10.0.0.5", &["test"]),
            ("a-b-10.0.0.5", &["a-b"]),
            ("test-2001-db8--1", &["test", "test-2001"]),
            ("fd00--5", &[]),
            ("net-fd00--0", &["net"]),
            ("net-10.0.0.05", &[]),
        ];
        for (name, want) in cases {
            let got: Vec<&str> = reservation_prefixes(name).collect();
            assert_eq!(got, want, "{name}");
        }
        // Every split names the address forward.
        for p in reservation_prefixes("test-2001-db8--1") {
            let rest = &"test-2001-db8--1"[p.len() + 1..];
            let ip: IpAddr = rest.replace('-', ":").parse().unwrap();
            assert_eq!(reservation_name(ip, Some(p)), "test-2001-db8--1");
        }
    }

    #[test]
    fn node_slice_pools_are_recognized_by_name_and_range() {
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let whole = net("10.0.0.0/8");
        let slice = net("10.0.4.0/22");
        // (pool name, network_name, is one of its node slices)
        let cases = [
            ("node-a-10.0.4.0-22", None, true),
            ("testnetwork-node-a-10.0.4.0-22", Some("testnetwork"), true),
            ("10.0.4.0-22", None, false),
            ("testnetwork-10.0.4.0-22", Some("testnetwork"), false),
            ("other-node-a-10.0.4.0-22", Some("testnetwork"), false),
            ("node-a-10.0.8.0-22", None, false),
        ];
        for (pool, network_name, want) in cases {
            assert_eq!(
                is_node_slice_pool(pool, &slice, &whole, network_name),
                want,
                "{pool} {network_name:?}"
            );
        }
        assert!(!is_node_slice_pool(
            "node-a-192.0.2.0-28",
            &net("192.0.2.0/28"),
            &whole,
            None
        ));
        let v6 = net("fd00::/48");
        assert!(is_node_slice_pool(
            "node-a-fd00-0-0-1---64",
            &net("fd00:0:0:1::/64"),
            &v6,
            None
        ));
    }
}
