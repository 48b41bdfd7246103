//! The pod annotation `k8s.v1.cni.cncf.io/network-status` written by Multus.

use std::borrow::Cow;
use std::marker::PhantomData;
use std::net::IpAddr;
use std::sync::Arc;

use serde::Deserialize;
use serde::de::{Deserializer, SeqAccess, Visitor};

use super::attachment_ips::AttachmentIps;

pub use crate::api::slim::{MAX_NETWORK_STATUS_BYTES, NETWORK_STATUS_ANNOTATION};

/// One secondary network attachment of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkAttachment {
    /// `namespace/nad-name` of the network (shared: the controller keeps one copy of each
    /// name for all its pods, see `index::pods`).
    pub name: Arc<str>,
    /// Interface inside the pod (shared likewise).
    pub interface: Option<Arc<str>>,
    /// Addresses of that interface (one inline).
    pub ips: AttachmentIps,
}

/// Most attachments (the cluster network's included) one annotation may list.
pub const MAX_ATTACHMENTS: usize = 32;
/// Most addresses one attachment may list (whereabouts gives one per range of `ipRanges`).
pub const MAX_IPS_PER_ATTACHMENT: usize = 16;
/// Most bytes of the reason why an annotation cannot be read (it may quote what it read).
const MAX_ERROR_BYTES: usize = 256;

/// A malformed annotation: reported on the pod and treated as missing (no information).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {NETWORK_STATUS_ANNOTATION} annotation: {0}")]
pub struct NetworkStatusError(pub String);

impl NetworkStatusError {
    /// The error saying `why`, cut to a bounded length (a parser's message may quote the text).
    fn new(why: impl std::fmt::Display) -> NetworkStatusError {
        let mut why = why.to_string();
        if why.len() > MAX_ERROR_BYTES {
            let mut end = MAX_ERROR_BYTES;
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            why.truncate(end);
            why.push('…');
        }
        NetworkStatusError(why)
    }
}

/// How many items a list may hold, and what they are called in the error.
trait Cap {
    const MAX: usize;
    const WHAT: &'static str;
}

struct Attachments;
impl Cap for Attachments {
    const MAX: usize = MAX_ATTACHMENTS;
    const WHAT: &'static str = "attachments";
}

struct Ips;
impl Cap for Ips {
    const MAX: usize = MAX_IPS_PER_ATTACHMENT;
    const WHAT: &'static str = "IPs on one attachment";
}

/// A list of at most `C::MAX` items: the parse stops at the first one past it.
struct AtMost<T, C>(Vec<T>, PhantomData<C>);

impl<'de, T: Deserialize<'de>, C: Cap> Deserialize<'de> for AtMost<T, C> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Items<T, C>(PhantomData<(T, C)>);
        impl<'de, T: Deserialize<'de>, C: Cap> Visitor<'de> for Items<T, C> {
            type Value = AtMost<T, C>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "a list of at most {} {}", C::MAX, C::WHAT)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(C::MAX));
                while let Some(item) = seq.next_element()? {
                    if items.len() == C::MAX {
                        return Err(serde::de::Error::custom(format_args!(
                            "more than {} {}",
                            C::MAX,
                            C::WHAT
                        )));
                    }
                    items.push(item);
                }
                Ok(AtMost(items, PhantomData))
            }
        }
        d.deserialize_seq(Items(PhantomData))
    }
}

fn no_ips<C>() -> AtMost<String, C> {
    AtMost(Vec::new(), PhantomData)
}

#[derive(Deserialize)]
struct RawEntry {
    name: String,
    #[serde(default)]
    interface: Option<String>,
    #[serde(default = "no_ips")]
    ips: AtMost<String, Ips>,
    #[serde(default)]
    default: bool,
}

/// Parses the annotation and returns the secondary networks only: entries marked
/// `default: true` are the cluster network and are never considered. An annotation past
/// [`MAX_NETWORK_STATUS_BYTES`], [`MAX_ATTACHMENTS`] or [`MAX_IPS_PER_ATTACHMENT`] is malformed:
/// what a pod keeps in memory is bounded whatever its annotation says.
pub fn parse_network_status(
    annotation: &str,
) -> Result<Vec<NetworkAttachment>, NetworkStatusError> {
    if annotation.len() > MAX_NETWORK_STATUS_BYTES {
        return Err(NetworkStatusError::new(format_args!(
            "more than {MAX_NETWORK_STATUS_BYTES} bytes (ipreclaim reads no more)"
        )));
    }
    let raw: AtMost<RawEntry, Attachments> =
        serde_json::from_str(annotation).map_err(NetworkStatusError::new)?;
    raw.0
        .into_iter()
        .filter(|e| !e.default)
        .map(|e| {
            let ips = e
                .ips
                .0
                .iter()
                .map(|s| {
                    // Some writers add a prefix length; the address is what counts.
                    let addr = s.split('/').next().unwrap_or(s).trim();
                    addr.parse::<IpAddr>().map_err(|_| {
                        NetworkStatusError::new(format_args!(
                            "network {}: {s:?} is not an IP address",
                            e.name
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(NetworkAttachment {
                name: e.name.into(),
                interface: e.interface.filter(|i| !i.is_empty()).map(Into::into),
                ips: ips.into(),
            })
        })
        .collect()
}

/// The network-status a pod's `annotations` hold, if present and readable (a malformed one
/// reads as none: no information).
pub fn network_status_of(
    annotations: Option<&std::collections::BTreeMap<String, String>>,
) -> Option<Vec<NetworkAttachment>> {
    let status = annotations?.get(super::NETWORK_STATUS_ANNOTATION)?;
    parse_network_status(status).ok()
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

    /// An annotation of `attachments` entries on `ns/net`, each listing `ips` addresses.
    fn status(attachments: usize, ips: usize) -> String {
        let ips: Vec<String> = (0..ips)
            .map(|i| format!("198.18.{}.{}", i / 256, i % 256))
            .collect();
        let entries: Vec<_> = (0..attachments)
            .map(|i| serde_json::json!({"name": "ns/net", "interface": format!("net{i}"), "ips": ips}))
            .collect();
        serde_json::Value::from(entries).to_string()
    }

    #[test]
    fn an_annotation_within_every_cap_is_read() {
        let got = parse_network_status(&status(MAX_ATTACHMENTS, MAX_IPS_PER_ATTACHMENT)).unwrap();
        assert_eq!(got.len(), MAX_ATTACHMENTS);
        assert!(got.iter().all(|a| a.ips.len() == MAX_IPS_PER_ATTACHMENT));
    }

    #[test]
    fn an_annotation_past_a_cap_is_malformed_and_says_which() {
        let cases = [
            (status(MAX_ATTACHMENTS + 1, 1), "more than 32 attachments"),
            (
                status(1, MAX_IPS_PER_ATTACHMENT + 1),
                "more than 16 IPs on one attachment",
            ),
            (
                format!("[{}]", " ".repeat(MAX_NETWORK_STATUS_BYTES)),
                "more than 32768 bytes",
            ),
        ];
        for (annotation, says) in cases {
            let e = parse_network_status(&annotation).unwrap_err();
            assert!(e.to_string().contains(says), "{e} should say {says:?}");
        }
    }

    #[test]
    fn what_a_malformed_annotation_says_is_bounded() {
        // serde quotes a string where a list was expected; a bad address is quoted too.
        let long = "x".repeat(10_000);
        for annotation in [
            serde_json::Value::from(long.clone()).to_string(),
            serde_json::json!([{"name": long, "ips": [long]}]).to_string(),
        ] {
            let e = parse_network_status(&annotation).unwrap_err();
            assert!(
                e.0.len() <= MAX_ERROR_BYTES + '…'.len_utf8(),
                "{}",
                e.0.len()
            );
        }
    }

    #[test]
    fn a_network_without_namespace_is_in_the_pods() {
        assert_eq!(qualified_network("macvlan", "app"), "app/macvlan");
        assert_eq!(qualified_network("infra/macvlan", "app"), "infra/macvlan");
    }
}
