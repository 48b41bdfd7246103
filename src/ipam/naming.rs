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

/// The OverlappingRangeIPReservation name for `ip`: `[<network_name>-]<normalized IP>`.
pub fn reservation_name(ip: IpAddr, network_name: Option<&str>) -> String {
    prefixed(&[network_name], normalize(&ip.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
