//! Offsets and addresses of a pool, and a pool's allocations as typed entries.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::IpNet;

use super::entry_key::EntryKey;
use crate::api::IPPoolSpec;

/// Number of addresses in `net`, or `None` for an IPv6 /0 (2^128 does not fit in a u128).
pub fn range_size(net: &IpNet) -> Option<u128> {
    let host_bits = u32::from(net.max_prefix_len() - net.prefix_len());
    1u128.checked_shl(host_bits)
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The address at `offset` from the network address of `net`, if it lies within `net`.
pub fn ip_at(net: &IpNet, offset: u128) -> Option<IpAddr> {
    if range_size(net).is_some_and(|size| offset >= size) {
        return None;
    }
    let value = to_u128(net.network()).checked_add(offset)?;
    Some(match net {
        IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(u32::try_from(value).ok()?)),
        IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(value)),
    })
}

/// The offset of `ip` from the network address of `net`, if `ip` lies within `net`.
pub fn offset_of(net: &IpNet, ip: IpAddr) -> Option<u128> {
    if !net.contains(&ip) {
        return None;
    }
    Some(to_u128(ip) - to_u128(net.network()))
}

/// One allocation of a pool, with its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolEntry {
    /// The map key as stored (decimal offset), inline.
    pub key: EntryKey,
    /// The offset it parses to.
    pub offset: u128,
    /// network(range) + offset.
    pub ip: IpAddr,
    /// The sandbox (container) id that holds it.
    pub id: String,
    /// `namespace/name` of the owning pod.
    pub podref: String,
    /// Interface in the pod, if recorded: one copy per name and pool (a pool's entries name a
    /// few interfaces, `net1` above all; 100,000 copies of it were 3 MB).
    pub ifname: Option<Arc<str>>,
}

/// Something wrong with one entry of a pool: reported, never acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolProblem {
    /// The key is not a non-negative decimal integer.
    #[error("allocation key {key:?} is not a decimal offset")]
    MalformedKey {
        /// The key as stored.
        key: String,
    },
    /// The entry has no `id` or no `podref`: whose it is cannot be told.
    #[error("allocation {key} has no {field}")]
    MissingField {
        /// The key as stored.
        key: String,
        /// `id` or `podref`.
        field: &'static str,
    },
    /// The podref is not `<namespace>/<pod name>`: no pod can be looked up for it.
    #[error("allocation {key} has podref {podref:?}, which names no pod")]
    BadPodref {
        /// The key as stored.
        key: String,
        /// The podref as stored.
        podref: String,
    },
    /// The offset lies outside the pool's range.
    #[error("allocation offset {key} is outside range {range}")]
    OutOfRange {
        /// The key as stored.
        key: String,
        /// The pool's range.
        range: IpNet,
    },
}

/// Why a whole pool cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool range {range:?} is not a CIDR")]
pub struct BadPoolRange {
    /// The range as stored.
    pub range: String,
}

/// A pool's allocations, split into usable entries and reported problems.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolAllocations {
    /// The pool's range, reduced to its network.
    pub range: IpNet,
    /// Entries whose key maps to an address in the range.
    pub entries: Vec<PoolEntry>,
    /// Entries that do not; they stay in the pool untouched.
    pub problems: Vec<PoolProblem>,
}

/// Parses a pool range as stored in `spec.range`, reduced to its network.
pub fn parse_pool_range(range: &str) -> Result<IpNet, BadPoolRange> {
    range
        .trim()
        .parse::<IpNet>()
        .map(|n| n.trunc())
        .map_err(|_| BadPoolRange {
            range: range.into(),
        })
}

/// Whether any allocation of a pool holds `ip`, whoever's and whatever its fields (fenced,
/// cooling, a podref that does not parse): every key whereabouts reads as that offset. A range
/// that does not parse holds everything (nothing can be told about it).
pub fn holds_address(spec: &IPPoolSpec, ip: IpAddr) -> bool {
    let Ok(range) = parse_pool_range(&spec.range) else {
        return true;
    };
    let Some(offset) = offset_of(&range, ip) else {
        return false;
    };
    spec.allocations
        .keys()
        .any(|k| k.trim().parse::<u128>().ok() == Some(offset))
}

/// Reads a pool's allocations. Malformed keys and out-of-range offsets are reported, not dropped.
pub fn pool_allocations(spec: &IPPoolSpec) -> Result<PoolAllocations, BadPoolRange> {
    let range = parse_pool_range(&spec.range)?;
    let mut entries = Vec::with_capacity(spec.allocations.len());
    let mut problems = Vec::new();
    let mut ifnames: HashMap<&str, Arc<str>> = HashMap::new();
    for (key, alloc) in &spec.allocations {
        // Only plain decimal digits: no sign, no spaces, no hex.
        let offset = if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) {
            key.parse::<u128>().ok()
        } else {
            None
        };
        let Some(offset) = offset else {
            problems.push(PoolProblem::MalformedKey { key: key.clone() });
            continue;
        };
        if let Some(field) = [("id", &alloc.id), ("podref", &alloc.podref)]
            .into_iter()
            .find_map(|(f, v)| v.is_empty().then_some(f))
        {
            problems.push(PoolProblem::MissingField {
                key: key.clone(),
                field,
            });
            continue;
        }
        // A fenced or cooling entry's podref carries a marker after the pod's (see `fence`,
        // `cooldown`).
        let podref = &alloc.podref;
        let pod = podref
            .strip_suffix(super::fence::FENCED_PODREF_SUFFIX)
            .or_else(|| podref.strip_suffix(super::cooldown::COOLING_PODREF_SUFFIX))
            .unwrap_or(podref);
        if !super::naming::is_pod_ref(pod) {
            problems.push(PoolProblem::BadPodref {
                key: key.clone(),
                podref: podref.clone(),
            });
            continue;
        }
        let Some(ip) = ip_at(&range, offset) else {
            problems.push(PoolProblem::OutOfRange {
                key: key.clone(),
                range,
            });
            continue;
        };
        entries.push(PoolEntry {
            key: key.into(),
            offset,
            ip,
            id: alloc.id.clone(),
            podref: alloc.podref.clone(),
            ifname: alloc.ifname.as_deref().map(|name| {
                let shared = ifnames.entry(name).or_insert_with(|| name.into());
                Arc::clone(shared)
            }),
        });
    }
    Ok(PoolAllocations {
        range,
        entries,
        problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::IPAllocation;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn offsets_at_range_edges() {
        let two64 = 1u128 << 64;
        let two80 = 1u128 << 80;
        // (range, offset, address or None when outside)
        let cases: &[(&str, u128, Option<&str>)] = &[
            ("192.0.2.0/24", 0, Some("192.0.2.0")),
            ("192.0.2.0/24", 1, Some("192.0.2.1")),
            ("192.0.2.0/24", 255, Some("192.0.2.255")),
            ("192.0.2.0/24", 256, None),
            ("198.18.0.0/15", 131_071, Some("198.19.255.255")),
            ("198.18.0.0/15", 131_072, None),
            ("192.0.2.7/32", 0, Some("192.0.2.7")),
            ("192.0.2.7/32", 1, None),
            ("0.0.0.0/0", u128::from(u32::MAX), Some("255.255.255.255")),
            ("0.0.0.0/0", 1 << 32, None),
            ("2001:db8::/64", 0, Some("2001:db8::")),
            ("2001:db8::/64", 1 << 63, Some("2001:db8::8000:0:0:0")),
            ("2001:db8::/64", (1 << 63) + 5, Some("2001:db8::8000:0:0:5")),
            (
                "2001:db8::/64",
                two64 - 1,
                Some("2001:db8::ffff:ffff:ffff:ffff"),
            ),
            ("2001:db8::/64", two64, None),
            ("2001:db8:1::/48", 1 << 63, Some("2001:db8:1:0:8000::")),
            (
                "2001:db8:1::/48",
                two80 - 1,
                Some("2001:db8:1:ffff:ffff:ffff:ffff:ffff"),
            ),
            ("2001:db8:1::/48", two80, None),
            (
                "::/0",
                u128::MAX,
                Some("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ),
        ];
        for (range, offset, want) in cases {
            let n = net(range);
            let got = ip_at(&n, *offset);
            let want: Option<IpAddr> = want.map(|w| w.parse().unwrap());
            assert_eq!(got, want, "{range} + {offset}");
            if let Some(ip) = got {
                assert_eq!(
                    offset_of(&n, ip),
                    Some(*offset),
                    "{range}: back to the offset"
                );
            }
        }
        assert_eq!(
            offset_of(&net("192.0.2.0/24"), "192.0.3.0".parse().unwrap()),
            None
        );
        assert_eq!(
            offset_of(&net("2001:db8::/64"), "192.0.2.1".parse().unwrap()),
            None
        );
    }

    fn alloc(id: &str) -> IPAllocation {
        IPAllocation {
            id: id.into(),
            podref: "ns/pod".into(),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        }
    }

    #[test]
    fn malformed_keys_and_out_of_range_offsets_are_reported_not_dropped() {
        let spec = IPPoolSpec {
            range: "192.0.2.0/28".into(),
            allocations: BTreeMap::from([
                ("1".to_string(), alloc("a")),
                ("15".to_string(), alloc("b")),
                ("16".to_string(), alloc("c")),
                ("-1".to_string(), alloc("d")),
                ("0x2".to_string(), alloc("e")),
                (" 3".to_string(), alloc("f")),
                ("".to_string(), alloc("g")),
                (
                    "999999999999999999999999999999999999999999".to_string(),
                    alloc("h"),
                ),
            ]),
        };
        let pool = pool_allocations(&spec).unwrap();
        let ips: Vec<_> = pool
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.ip.to_string()))
            .collect();
        assert_eq!(
            ips,
            [
                ("1", "192.0.2.1".to_string()),
                ("15", "192.0.2.15".to_string())
            ]
        );
        assert_eq!(pool.problems.len(), 6);
        assert!(pool.problems.contains(&PoolProblem::OutOfRange {
            key: "16".into(),
            range: net("192.0.2.0/28")
        }));
        for key in [
            "-1",
            "0x2",
            " 3",
            "",
            "999999999999999999999999999999999999999999",
        ] {
            assert!(
                pool.problems
                    .contains(&PoolProblem::MalformedKey { key: key.into() }),
                "{key:?} reported"
            );
        }
    }

    #[test]
    fn pool_range_is_reduced_to_its_network_and_garbage_is_an_error() {
        assert_eq!(
            parse_pool_range("192.0.2.225/28").unwrap(),
            net("192.0.2.224/28")
        );
        assert!(parse_pool_range("not-a-range").is_err());
        let spec = IPPoolSpec {
            range: "10.0.0.0".into(),
            allocations: BTreeMap::new(),
        };
        assert_eq!(pool_allocations(&spec).unwrap_err().range, "10.0.0.0");
    }

    fn any_net() -> impl Strategy<Value = IpNet> {
        prop_oneof![
            (any::<u32>(), 0u8..=32)
                .prop_map(|(a, p)| IpNet::new(IpAddr::V4(a.into()), p).unwrap().trunc()),
            (any::<u128>(), 0u8..=128)
                .prop_map(|(a, p)| IpNet::new(IpAddr::V6(a.into()), p).unwrap().trunc()),
        ]
    }

    proptest! {
        #[test]
        fn offset_ip_offset_round_trips_within_the_range(n in any_net(), raw in any::<u128>()) {
            let offset = match range_size(&n) { Some(size) => raw % size, None => raw };
            let ip = ip_at(&n, offset).expect("an offset below the size is in range");
            prop_assert!(n.contains(&ip));
            prop_assert_eq!(offset_of(&n, ip), Some(offset));
        }

        #[test]
        fn offsets_past_the_end_have_no_address(n in any_net(), extra in any::<u64>()) {
            if let Some(size) = range_size(&n) {
                prop_assert_eq!(ip_at(&n, size.saturating_add(u128::from(extra))), None);
            }
        }
    }
}
