//! How many addresses a range hands out, the way whereabouts counts them: from the first to
//! the last usable address (network and broadcast never), narrowed by `range_start` and
//! `range_end` when they fall inside it (else ignored, as whereabouts silently does), less the
//! excluded subnets.

use std::net::IpAddr;

use ipnet::IpNet;

use super::config::IpRange;

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The first and last address whereabouts hands out from `range` (`None`: a /31, /32, /127
/// or /128 has none).
fn usable(range: &IpRange) -> Option<(u128, u128)> {
    let net = range.range;
    if net.max_prefix_len() - net.prefix_len() <= 1 {
        return None;
    }
    let mut first = to_u128(net.network()) + 1;
    let mut last = to_u128(net.broadcast()) - 1;
    let same_family = |ip: &IpAddr| ip.is_ipv4() == net.addr().is_ipv4();
    if let Some(start) = range.range_start.filter(same_family).map(to_u128)
        && (first..=last).contains(&start)
    {
        first = start;
    }
    if let Some(end) = range.range_end.filter(same_family).map(to_u128)
        && (first..=last).contains(&end)
    {
        last = end;
    }
    Some((first, last))
}

/// The addresses of `[first, last]` inside `nets` (which may overlap), counted once.
fn covered(first: u128, last: u128, nets: &[IpNet]) -> u128 {
    let mut spans: Vec<(u128, u128)> = nets
        .iter()
        .map(|n| (to_u128(n.network()), to_u128(n.broadcast())))
        .filter_map(|(a, b)| {
            let (a, b) = (a.max(first), b.min(last));
            (a <= b).then_some((a, b))
        })
        .collect();
    spans.sort_unstable();
    let mut total = 0u128;
    let mut reach: Option<u128> = None;
    for (a, b) in spans {
        let from = match reach {
            Some(r) if r >= b => continue,
            Some(r) if r >= a => r + 1,
            _ => a,
        };
        total += b - from + 1;
        reach = Some(b);
    }
    total
}

/// The addresses `range` can hand out.
pub fn capacity(range: &IpRange) -> u128 {
    let Some((first, last)) = usable(range) else {
        return 0;
    };
    let same_family: Vec<IpNet> = range
        .exclude
        .iter()
        .filter(|n| n.addr().is_ipv4() == range.range.addr().is_ipv4())
        .copied()
        .collect();
    (last - first + 1) - covered(first, last, &same_family)
}

/// The addresses a pool of `range` can hand out when nothing else is known of it.
pub fn default_capacity(range: IpNet) -> u128 {
    capacity(&IpRange {
        range,
        range_start: None,
        range_end: None,
        exclude: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(net: &str, start: Option<&str>, end: Option<&str>, exclude: &[&str]) -> IpRange {
        IpRange {
            range: net.parse().unwrap(),
            range_start: start.map(|s| s.parse().unwrap()),
            range_end: end.map(|s| s.parse().unwrap()),
            exclude: exclude.iter().map(|e| e.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn network_and_broadcast_are_never_handed_out() {
        assert_eq!(default_capacity("192.0.2.0/24".parse().unwrap()), 254);
        assert_eq!(default_capacity("192.0.2.0/30".parse().unwrap()), 2);
        assert_eq!(default_capacity("192.0.2.0/31".parse().unwrap()), 0);
        assert_eq!(default_capacity("fd00::/120".parse().unwrap()), 254);
        assert_eq!(
            default_capacity("fd00::/64".parse().unwrap()),
            (1u128 << 64) - 2
        );
    }

    #[test]
    fn a_start_and_end_inside_the_range_narrow_it_and_outside_are_ignored() {
        let r = range("192.0.2.0/24", Some("192.0.2.10"), Some("192.0.2.19"), &[]);
        assert_eq!(capacity(&r), 10);
        // As whereabouts: a start outside the usable range is silently ignored.
        let r = range("192.0.2.0/24", Some("192.0.3.10"), Some("192.0.2.19"), &[]);
        assert_eq!(capacity(&r), 19);
        let r = range(
            "192.0.2.0/24",
            Some("192.0.2.200"),
            Some("192.0.2.100"),
            &[],
        );
        assert_eq!(capacity(&r), 55, "an end before the start is ignored");
    }

    #[test]
    fn excluded_subnets_count_once_and_only_inside_the_range() {
        let r = range(
            "192.0.2.0/24",
            Some("192.0.2.10"),
            Some("192.0.2.29"),
            &[
                "192.0.2.8/29",
                "192.0.2.12/30",
                "192.0.2.28/30",
                "10.0.0.0/8",
            ],
        );
        // 10..=29 is 20 addresses; 10..=15 and 28..=29 are excluded.
        assert_eq!(capacity(&r), 12);
    }
}
