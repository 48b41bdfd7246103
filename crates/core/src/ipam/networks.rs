//! The pod annotation `k8s.v1.cni.cncf.io/networks`: the secondary networks a pod asked for,
//! as Multus reads it (a comma-separated list of `[namespace/]name[@interface]`, or a JSON
//! list of `{name, namespace, interface}`).

use serde::Deserialize;

/// The annotation key.
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";

/// A malformed annotation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {NETWORKS_ANNOTATION} annotation: {0}")]
pub struct NetworksError(pub String);

#[derive(Deserialize)]
struct Selection {
    name: String,
    #[serde(default)]
    namespace: Option<String>,
}

fn qualified(
    namespace: Option<&str>,
    name: &str,
    pod_namespace: &str,
) -> Result<String, NetworksError> {
    let name = name.trim();
    if name.is_empty() || name.contains('/') {
        return Err(NetworksError(format!("{name:?} is not a network name")));
    }
    let ns = namespace
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .unwrap_or(pod_namespace);
    Ok(format!("{ns}/{name}"))
}

/// The requested networks as `namespace/name` (the pod's namespace when none is given),
/// in order, without repeats.
pub fn parse_networks(annotation: &str, pod_namespace: &str) -> Result<Vec<String>, NetworksError> {
    let text = annotation.trim();
    let mut out: Vec<String> = Vec::new();
    if text.starts_with('[') {
        let list: Vec<Selection> =
            serde_json::from_str(text).map_err(|e| NetworksError(e.to_string()))?;
        for s in list {
            out.push(qualified(s.namespace.as_deref(), &s.name, pod_namespace)?);
        }
    } else {
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let without_if = item.split('@').next().unwrap_or(item);
            let (ns, name) = match without_if.split_once('/') {
                Some((ns, name)) => (Some(ns), name),
                None => (None, without_if),
            };
            out.push(qualified(ns, name, pod_namespace)?);
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|n| seen.insert(n.clone()));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comma_separated_with_namespaces_and_interfaces() {
        assert_eq!(
            parse_networks("macvlan, other/sriov@net2,macvlan@net3", "app").unwrap(),
            ["app/macvlan", "other/sriov"]
        );
    }

    #[test]
    fn json_list() {
        assert_eq!(
            parse_networks(
                r#"[{"name":"macvlan","interface":"net1"},{"name":"b","namespace":"infra"}]"#,
                "app"
            )
            .unwrap(),
            ["app/macvlan", "infra/b"]
        );
    }

    #[test]
    fn empty_is_no_networks_and_garbage_is_an_error() {
        assert!(parse_networks("", "app").unwrap().is_empty());
        assert!(parse_networks("[{", "app").is_err());
        assert!(parse_networks("a/b/c", "app").is_err());
        assert!(parse_networks(r#"[{"name":""}]"#, "app").is_err());
    }
}
