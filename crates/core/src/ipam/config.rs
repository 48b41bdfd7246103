//! The whereabouts IPAM configuration inside a NetworkAttachmentDefinition's `spec.config`.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::Value;

use super::naming::ippool_name;

/// One address range of a whereabouts IPAM config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpRange {
    /// The range, reduced to its network (pool names and offsets count from here).
    pub range: IpNet,
    /// First address to hand out, if limited.
    pub range_start: Option<IpAddr>,
    /// Last address to hand out, if limited.
    pub range_end: Option<IpAddr>,
    /// Addresses never handed out.
    pub exclude: Vec<IpNet>,
}

/// The parts of a whereabouts IPAM config that matter for reclaiming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpamConfig {
    /// The CNI network's own `name` (top level of the config or conflist).
    pub cni_name: Option<String>,
    /// `network_name`: prefixes pool and reservation names.
    pub network_name: Option<String>,
    /// `enable_overlapping_ranges` (default true): reservations exist for each address.
    pub enable_overlapping_ranges: bool,
    /// `node_slice_size`: pools are per-node slices named with the node.
    pub node_slice_size: Option<String>,
    /// `range` (first) then every `ipRanges` entry.
    pub ranges: Vec<IpRange>,
}

impl IpamConfig {
    /// The IPPool name of each range (`node` for node-slice pools, where the range is the
    /// node's slice).
    pub fn pool_names(&self, node: Option<&str>) -> Vec<(IpNet, String)> {
        self.ranges
            .iter()
            .map(|r| {
                (
                    r.range,
                    ippool_name(&r.range, self.network_name.as_deref(), node),
                )
            })
            .collect()
    }

    /// The NodeSlicePool holding this network's node slices: named by `network_name`, else by
    /// the CNI network's `name` (as whereabouts' node-slice controller names it).
    pub fn node_slice_pool_name(&self) -> Option<&str> {
        self.network_name.as_deref().or(self.cni_name.as_deref())
    }
}

/// Why a NAD's config cannot be used. Reported per NAD (Event, metric); never a crash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NadConfigError {
    /// `spec.config` is not JSON.
    #[error("config is not valid JSON: {0}")]
    NotJson(String),
    /// The config (or a conflist plugin) is not a JSON object.
    #[error("config is not a JSON object")]
    NotAnObject,
    /// No plugin has an `ipam` section.
    #[error("config has no ipam section")]
    MissingIpam,
    /// A whereabouts config without any range.
    #[error("whereabouts ipam config has no range and no ipRanges")]
    NoRange,
    /// A field has the wrong type or an unparsable value.
    #[error("whereabouts ipam field {field}: {value:?} is invalid: {reason}")]
    BadField {
        /// The field.
        field: String,
        /// Its value as written.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

fn bad(field: &str, value: &Value, reason: &str) -> NadConfigError {
    NadConfigError::BadField {
        field: field.into(),
        value: match value {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        },
        reason: reason.into(),
    }
}

fn opt_str<'a>(
    obj: &'a serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<&'a str>, NadConfigError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.trim())),
        Some(other) => Err(bad(field, other, "expected a string")),
    }
}

fn opt_ip(
    obj: &serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<IpAddr>, NadConfigError> {
    let Some(s) = opt_str(obj, field)? else {
        return Ok(None);
    };
    // Written either as an address or as an address with a prefix.
    let addr = s.split('/').next().unwrap_or(s);
    addr.parse()
        .map(Some)
        .map_err(|_| bad(field, &Value::String(s.into()), "expected an IP address"))
}

/// `a.b.c.d/p`, or `start-end/p`; returns (network, start, end).
fn parse_range(
    field: &str,
    s: &str,
) -> Result<(IpNet, Option<IpAddr>, Option<IpAddr>), NadConfigError> {
    let err = |reason: &str| bad(field, &Value::String(s.into()), reason);
    let (addrs, prefix) = s.split_once('/').ok_or_else(|| err("expected a CIDR"))?;
    let (first, end) = match addrs.split_once('-') {
        Some((a, b)) => (a, Some(b)),
        None => (addrs, None),
    };
    let first: IpAddr = first.trim().parse().map_err(|_| err("expected a CIDR"))?;
    let prefix: u8 = prefix
        .trim()
        .parse()
        .map_err(|_| err("bad prefix length"))?;
    let net = IpNet::new(first, prefix).map_err(|_| err("prefix length too long"))?;
    let end = end
        .map(|e| e.trim().parse::<IpAddr>().map_err(|_| err("bad range end")))
        .transpose()?;
    let start = (end.is_some() || first != net.network()).then_some(first);
    if let Some(e) = end
        && !net.contains(&e)
    {
        return Err(err("range end outside the range"));
    }
    Ok((net.trunc(), start, end))
}

fn parse_exclude(value: Option<&Value>, field: &str) -> Result<Vec<IpNet>, NadConfigError> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let Value::Array(items) = value else {
        return Err(bad(field, value, "expected a list"));
    };
    items
        .iter()
        .map(|item| {
            let s = item
                .as_str()
                .ok_or_else(|| bad(field, item, "expected a string"))?
                .trim();
            s.parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| bad(field, item, "expected a CIDR or an IP"))
        })
        .collect()
}

fn parse_ip_range(
    obj: &serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<IpRange>, NadConfigError> {
    let Some(range) = opt_str(obj, "range")? else {
        return Ok(None);
    };
    let (net, start, end) = parse_range(field, range)?;
    Ok(Some(IpRange {
        range: net,
        range_start: opt_ip(obj, "range_start")?.or(start),
        range_end: opt_ip(obj, "range_end")?.or(end),
        exclude: parse_exclude(obj.get("exclude"), &format!("{field}.exclude"))?,
    }))
}

fn parse_whereabouts(
    ipam: &serde_json::Map<String, Value>,
    cni_name: Option<&str>,
) -> Result<IpamConfig, NadConfigError> {
    let mut ranges = Vec::new();
    if let Some(first) = parse_ip_range(ipam, "range")? {
        ranges.push(first);
    }
    match ipam.get("ipRanges") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let field = format!("ipRanges[{i}]");
                let obj = item
                    .as_object()
                    .ok_or_else(|| bad(&field, item, "expected an object"))?;
                let r = parse_ip_range(obj, &format!("{field}.range"))?
                    .ok_or_else(|| bad(&field, item, "has no range"))?;
                ranges.push(r);
            }
        }
        Some(other) => return Err(bad("ipRanges", other, "expected a list")),
    }
    if ranges.is_empty() {
        return Err(NadConfigError::NoRange);
    }
    let enable_overlapping_ranges = match ipam.get("enable_overlapping_ranges") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(bad(
                "enable_overlapping_ranges",
                other,
                "expected true or false",
            ));
        }
    };
    Ok(IpamConfig {
        cni_name: cni_name.map(str::to_owned),
        network_name: opt_str(ipam, "network_name")?.map(str::to_owned),
        enable_overlapping_ranges,
        node_slice_size: opt_str(ipam, "node_slice_size")?.map(str::to_owned),
        ranges,
    })
}

/// Parses a NAD's `spec.config`: a single CNI config or a conflist, looking at every plugin.
/// `Ok(None)` when no plugin uses whereabouts (another IPAM type: nothing to do here).
pub fn parse_nad_config(config: &str) -> Result<Option<IpamConfig>, NadConfigError> {
    let value: Value =
        serde_json::from_str(config).map_err(|e| NadConfigError::NotJson(e.to_string()))?;
    let top = value.as_object().ok_or(NadConfigError::NotAnObject)?;
    let plugins: Vec<&Value> = match top.get("plugins") {
        Some(Value::Array(list)) => list.iter().collect(),
        Some(other) => return Err(bad("plugins", other, "expected a list")),
        None => vec![&value],
    };
    let mut saw_ipam = false;
    for plugin in plugins {
        let obj = plugin.as_object().ok_or(NadConfigError::NotAnObject)?;
        let Some(ipam) = obj.get("ipam") else {
            continue;
        };
        let Some(ipam) = ipam.as_object() else {
            return Err(bad("ipam", ipam, "expected an object"));
        };
        saw_ipam = true;
        if ipam.get("type").and_then(Value::as_str) == Some("whereabouts") {
            return parse_whereabouts(ipam, opt_str(top, "name")?).map(Some);
        }
    }
    if saw_ipam {
        Ok(None)
    } else {
        Err(NadConfigError::MissingIpam)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn range(r: &str) -> IpRange {
        IpRange {
            range: net(r),
            range_start: None,
            range_end: None,
            exclude: vec![],
        }
    }

    #[test]
    fn parses_single_configs_and_conflists() {
        let single = r#"{"cniVersion":"0.3.1","name":"net1","type":"macvlan","master":"eth0",
            "ipam":{"type":"whereabouts","range":"192.0.2.0/24"}}"#;
        let cfg = parse_nad_config(single).unwrap().unwrap();
        assert_eq!(cfg.ranges, vec![range("192.0.2.0/24")]);
        assert!(cfg.enable_overlapping_ranges);
        assert_eq!(
            cfg.pool_names(None),
            vec![(net("192.0.2.0/24"), "192.0.2.0-24".to_string())]
        );

        // The whereabouts plugin is not the first of the conflist.
        let conflist = r#"{"cniVersion":"0.4.0","name":"net2","plugins":[
            {"type":"tuning","sysctl":{}},
            {"type":"bridge","ipam":{"type":"host-local","subnet":"198.51.100.0/24"}},
            {"type":"macvlan","ipam":{"type":"whereabouts","range":"198.18.0.0/16","network_name":"blue",
              "enable_overlapping_ranges":false}}]}"#;
        let cfg = parse_nad_config(conflist).unwrap().unwrap();
        assert_eq!(cfg.network_name.as_deref(), Some("blue"));
        assert!(!cfg.enable_overlapping_ranges);
        assert_eq!(cfg.pool_names(None)[0].1, "blue-198.18.0.0-16");
    }

    #[test]
    fn other_ipam_types_are_skipped_and_broken_configs_are_errors() {
        let host_local =
            r#"{"type":"macvlan","ipam":{"type":"host-local","subnet":"192.0.2.0/24"}}"#;
        assert_eq!(parse_nad_config(host_local), Ok(None));
        assert_eq!(
            parse_nad_config(r#"{"type":"macvlan"}"#),
            Err(NadConfigError::MissingIpam)
        );
        assert_eq!(
            parse_nad_config(r#"{"plugins":[{"type":"macvlan"},{"type":"tuning"}]}"#),
            Err(NadConfigError::MissingIpam)
        );
        assert!(matches!(
            parse_nad_config("type: macvlan"),
            Err(NadConfigError::NotJson(_))
        ));
        assert!(matches!(
            parse_nad_config(""),
            Err(NadConfigError::NotJson(_))
        ));
        assert_eq!(parse_nad_config("[1,2]"), Err(NadConfigError::NotAnObject));
        assert_eq!(
            parse_nad_config(r#"{"type":"macvlan","ipam":{"type":"whereabouts"}}"#),
            Err(NadConfigError::NoRange)
        );
        let bad_range =
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"300.0.0.0/24"}}"#;
        assert!(matches!(
            parse_nad_config(bad_range),
            Err(NadConfigError::BadField { .. })
        ));
        let bad_type = r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.0/24","enable_overlapping_ranges":"yes"}}"#;
        assert!(matches!(
            parse_nad_config(bad_type),
            Err(NadConfigError::BadField { .. })
        ));
        let bad_exclude = r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.0/24","exclude":"192.0.2.1"}}"#;
        assert!(matches!(
            parse_nad_config(bad_exclude),
            Err(NadConfigError::BadField { .. })
        ));
    }

    #[test]
    fn exclude_start_end_and_host_bits() {
        let cfg = parse_nad_config(
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.225/28",
                "range_end":"192.0.2.230","exclude":["192.0.2.226/32","192.0.2.228"]}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            cfg.ranges,
            vec![IpRange {
                range: net("192.0.2.224/28"),
                range_start: Some(ip("192.0.2.225")),
                range_end: Some(ip("192.0.2.230")),
                exclude: vec![net("192.0.2.226/32"), net("192.0.2.228/32")],
            }]
        );
        assert_eq!(cfg.pool_names(None)[0].1, "192.0.2.224-28");

        let dashed = parse_nad_config(
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"2001:db8::10-2001:db8::20/64"}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(dashed.ranges[0].range, net("2001:db8::/64"));
        assert_eq!(dashed.ranges[0].range_start, Some(ip("2001:db8::10")));
        assert_eq!(dashed.ranges[0].range_end, Some(ip("2001:db8::20")));
        assert_eq!(dashed.pool_names(None)[0].1, "2001-db8---64");
    }

    #[test]
    fn ip_ranges_dual_stack_with_range_first() {
        let cfg = parse_nad_config(
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","network_name":"ds","ipRanges":[
                {"range":"192.0.2.0/24","exclude":["192.0.2.0/30"]},
                {"range":"2001:db8:1::/64","range_start":"2001:db8:1::5"}]}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(cfg.ranges.len(), 2);
        assert_eq!(cfg.ranges[0].exclude, vec![net("192.0.2.0/30")]);
        assert_eq!(cfg.ranges[1].range_start, Some(ip("2001:db8:1::5")));
        let names: Vec<String> = cfg.pool_names(None).into_iter().map(|(_, n)| n).collect();
        assert_eq!(names, ["ds-192.0.2.0-24", "ds-2001-db8-1---64"]);

        // `range` counts as the first entry of ipRanges.
        let both = parse_nad_config(
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"198.18.0.0/24",
                "ipRanges":[{"range":"2001:db8::/64"}]}}"#,
        )
        .unwrap()
        .unwrap();
        let ranges: Vec<String> = both.ranges.iter().map(|r| r.range.to_string()).collect();
        assert_eq!(ranges, ["198.18.0.0/24", "2001:db8::/64"]);
    }

    #[test]
    fn node_slice_pools_are_named_with_the_node() {
        let cfg = parse_nad_config(
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/8","node_slice_size":"/22",
                "network_name":"testnetwork"}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(cfg.node_slice_size.as_deref(), Some("/22"));
        assert_eq!(
            cfg.pool_names(Some("testnode"))[0].1,
            "testnetwork-testnode-10.0.0.0-8"
        );
        assert_eq!(cfg.node_slice_pool_name(), Some("testnetwork"));
    }

    #[test]
    fn the_node_slice_pool_is_named_by_the_cni_name_without_a_network_name() {
        let single = parse_nad_config(
            r#"{"name":"slicenet","type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/8","node_slice_size":"/22"}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(single.node_slice_pool_name(), Some("slicenet"));
        let list = parse_nad_config(
            r#"{"cniVersion":"0.4.0","name":"listnet","plugins":[{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/8","node_slice_size":"/22"}}]}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(list.node_slice_pool_name(), Some("listnet"));
        let unnamed = parse_nad_config(
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/8"}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(unnamed.node_slice_pool_name(), None);
        assert!(matches!(
            parse_nad_config(r#"{"name":7,"ipam":{"type":"whereabouts","range":"10.0.0.0/8"}}"#),
            Err(NadConfigError::BadField { .. })
        ));
    }
}
