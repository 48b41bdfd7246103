//! The pod annotation `k8s.v1.cni.cncf.io/network-status` written by Multus.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;

use serde::Deserialize;

/// The annotation key.
pub const NETWORK_STATUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";

/// One secondary network attachment of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkAttachment {
    /// `namespace/nad-name` of the network (shared: the controller keeps one copy of each
    /// name for all its pods, see `index::pods`).
    pub name: Arc<str>,
    /// Interface inside the pod (shared likewise).
    pub interface: Option<Arc<str>>,
    /// Addresses of that interface.
    pub ips: Vec<IpAddr>,
}

/// A malformed annotation: reported on the pod and treated as missing (no information).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {NETWORK_STATUS_ANNOTATION} annotation: {0}")]
pub struct NetworkStatusError(pub String);

#[derive(Deserialize)]
struct RawEntry {
    name: String,
    #[serde(default)]
    interface: Option<String>,
    #[serde(default)]
    ips: Vec<String>,
    #[serde(default)]
    default: bool,
}

/// Parses the annotation and returns the secondary networks only: entries marked
/// `default: true` are the cluster network and are never considered.
pub fn parse_network_status(
    annotation: &str,
) -> Result<Vec<NetworkAttachment>, NetworkStatusError> {
    let raw: Vec<RawEntry> =
        serde_json::from_str(annotation).map_err(|e| NetworkStatusError(e.to_string()))?;
    raw.into_iter()
        .filter(|e| !e.default)
        .map(|e| {
            let ips = e
                .ips
                .iter()
                .map(|s| {
                    // Some writers add a prefix length; the address is what counts.
                    let addr = s.split('/').next().unwrap_or(s).trim();
                    addr.parse::<IpAddr>().map_err(|_| {
                        NetworkStatusError(format!(
                            "network {}: {s:?} is not an IP address",
                            e.name
                        ))
                    })
                })
                .collect::<Result<_, _>>()?;
            Ok(NetworkAttachment {
                name: e.name.into(),
                interface: e.interface.filter(|i| !i.is_empty()).map(Into::into),
                ips,
            })
        })
        .collect()
}

/// A network-status `name` as `namespace/nad`: a name without namespace is in the pod's own
/// namespace (as Multus resolves a NAD named without one).
pub fn qualified_network<'a>(name: &'a str, pod_namespace: &str) -> Cow<'a, str> {
    if name.contains('/') {
        Cow::Borrowed(name)
    } else {
        Cow::Owned(format!("{pod_namespace}/{name}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_network_entries_are_excluded() {
        let status = r#"[
            {"name":"cbr0","interface":"eth0","ips":["10.244.1.5"],"mac":"aa","default":true,"dns":{}},
            {"name":"ns1/macvlan","interface":"net1","ips":["192.0.2.7","2001:db8::7"],"mac":"bb","dns":{}},
            {"name":"ns1/other","interface":"net2","ips":["198.18.0.9/16"]}
        ]"#;
        let got = parse_network_status(status).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(&*got[0].name, "ns1/macvlan");
        assert_eq!(got[0].interface.as_deref(), Some("net1"));
        assert_eq!(
            got[0].ips,
            [
                "192.0.2.7".parse::<IpAddr>().unwrap(),
                "2001:db8::7".parse().unwrap()
            ]
        );
        assert_eq!(got[1].ips, ["198.18.0.9".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn malformed_annotations_are_errors_not_panics() {
        for bad in [
            "",
            "{",
            "{}",
            "[{\"interface\":\"net1\"}]",
            r#"[{"name":"n","ips":["not-an-ip"]}]"#,
            "null",
        ] {
            assert!(parse_network_status(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_network_status("[]"), Ok(vec![]));
    }

    #[test]
    fn a_network_without_namespace_is_in_the_pods() {
        assert_eq!(qualified_network("macvlan", "app"), "app/macvlan");
        assert_eq!(qualified_network("infra/macvlan", "app"), "infra/macvlan");
    }
}
