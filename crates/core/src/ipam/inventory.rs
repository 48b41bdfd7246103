//! A node's sandbox inventory: the sandboxes its node agent last saw live, written into a Lease
//! per node. A controller that never saw a pod's deletion (no replica ran, or none reached the
//! apiserver) finds the pod's node here: the one whose agent listed the entry's sandbox.
//!
//! The Lease is `ipreclaim-sandboxes-<node>` in the pools' namespace; `spec.holderIdentity` is
//! the node, `spec.renewTime` when its agent wrote it, and the annotation
//! [`INVENTORY_ANNOTATION`] the sandboxes: `<id prefix>=<pod uid>[:<grace seconds>]` separated
//! by spaces (the pod's termination grace period when the runtime knows it). Ids are
//! cut to [`ID_PREFIX_LEN`] characters (a collision only keeps an address longer), and a node
//! of more than [`MAX_SANDBOXES`] is written as incomplete ([`INCOMPLETE`] first).

use std::collections::BTreeMap;

/// The Lease annotation holding the sandboxes.
pub const INVENTORY_ANNOTATION: &str = "ipreclaim.io/live-sandboxes";
/// The label every inventory Lease carries (the controller lists by it).
pub const INVENTORY_LABEL: &str = "ipreclaim.io/node-sandboxes";
/// How an inventory Lease's name begins (the node's name follows).
pub const INVENTORY_LEASE_PREFIX: &str = "ipreclaim-sandboxes-";
/// Characters of a sandbox id kept.
pub const ID_PREFIX_LEN: usize = 16;
/// Sandboxes one inventory holds; a node with more is written incomplete (kubelets run at
/// most a few hundred pods).
pub const MAX_SANDBOXES: usize = 2048;
/// The first token of an incomplete inventory.
pub const INCOMPLETE: &str = "incomplete";
/// The longest annotation value read: [`MAX_SANDBOXES`] ids and uids, and some slack.
pub const MAX_VALUE_BYTES: usize = 128 * 1024;
/// The longest pod uid read (a uid is 36 characters).
const MAX_UID_LEN: usize = 64;

/// The inventory Lease of `node`, or `None` when the name would pass the API's 253
/// characters (that node publishes none).
pub fn lease_name(node: &str) -> Option<String> {
    let name = format!("{INVENTORY_LEASE_PREFIX}{node}");
    (!node.is_empty() && name.len() <= 253).then_some(name)
}

/// The part of a sandbox id an inventory keeps.
pub fn id_prefix(id: &str) -> &str {
    match id.char_indices().nth(ID_PREFIX_LEN) {
        Some((at, _)) => &id[..at],
        None => id,
    }
}

/// A sandbox as an inventory lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its pod's uid (the pod in the API: a static pod's is its mirror pod's).
    pub pod_uid: String,
    /// Its pod's termination grace period, when known.
    pub grace_seconds: Option<i64>,
}

/// The annotation value for `sandboxes` (full id, and what is listed of it).
pub fn encode<'a>(sandboxes: impl IntoIterator<Item = (&'a str, &'a Listed)>) -> String {
    let mut tokens: Vec<String> = sandboxes
        .into_iter()
        .map(|(id, l)| match l.grace_seconds {
            Some(g) => format!("{}={}:{g}", id_prefix(id), l.pod_uid),
            None => format!("{}={}", id_prefix(id), l.pod_uid),
        })
        .collect();
    tokens.sort();
    tokens.dedup();
    if tokens.len() > MAX_SANDBOXES {
        tokens.truncate(MAX_SANDBOXES);
        tokens.insert(0, INCOMPLETE.to_owned());
    }
    tokens.join(" ")
}

/// A node's inventory as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    /// Sandbox id prefix -> what is listed of it.
    pub sandboxes: BTreeMap<String, Listed>,
    /// Every live sandbox of the node is listed.
    pub complete: bool,
}

/// Why an inventory could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    /// Past [`MAX_VALUE_BYTES`].
    #[error("the inventory is {0} bytes, past the {MAX_VALUE_BYTES} read")]
    TooLarge(usize),
    /// A token that is not `<id prefix>=<uid>[:<grace>]`.
    #[error("inventory token {0:?} is not <sandbox id prefix>=<pod uid>[:<grace seconds>]")]
    Malformed(String),
}

/// Reads an annotation value written by [`encode`].
pub fn decode(value: &str) -> Result<Inventory, InventoryError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(InventoryError::TooLarge(value.len()));
    }
    let mut inventory = Inventory {
        complete: true,
        ..Default::default()
    };
    for (i, token) in value.split_ascii_whitespace().enumerate() {
        if i == 0 && token == INCOMPLETE {
            inventory.complete = false;
            continue;
        }
        let malformed = || InventoryError::Malformed(token.chars().take(80).collect());
        let (id, listed) = token.split_once('=').ok_or_else(malformed)?;
        let (uid, grace) = match listed.split_once(':') {
            Some((uid, g)) => (uid, Some(g.parse::<i64>().map_err(|_| malformed())?)),
            None => (listed, None),
        };
        if id.is_empty() || id.len() > ID_PREFIX_LEN || uid.is_empty() || uid.len() > MAX_UID_LEN {
            return Err(malformed());
        }
        let listed = Listed {
            pod_uid: uid.to_owned(),
            grace_seconds: grace,
        };
        inventory.sandboxes.insert(id.to_owned(), listed);
    }
    Ok(inventory)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(uid: &str, grace: Option<i64>) -> Listed {
        Listed {
            pod_uid: uid.into(),
            grace_seconds: grace,
        }
    }

    #[test]
    fn ids_are_cut_to_their_prefix_and_read_back_with_their_pod_and_grace() {
        let long = "0123456789abcdef0123456789abcdef";
        let (one, two) = (listed("uid-1", Some(600)), listed("uid-2", None));
        let value = encode([(long, &one), ("short", &two)]);
        assert_eq!(value, "0123456789abcdef=uid-1:600 short=uid-2");
        let read = decode(&value).unwrap();
        assert!(read.complete);
        assert_eq!(read.sandboxes[id_prefix(long)], one);
        assert_eq!(read.sandboxes["short"], two);
        assert_eq!(
            decode("").unwrap(),
            Inventory {
                complete: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_node_past_the_cap_is_written_and_read_as_incomplete() {
        let ids: Vec<String> = (0..MAX_SANDBOXES + 5)
            .map(|i| format!("{i:016x}"))
            .collect();
        let u = listed("u", Some(30));
        let value = encode(ids.iter().map(|id| (id.as_str(), &u)));
        let read = decode(&value).unwrap();
        assert!(!read.complete);
        assert_eq!(read.sandboxes.len(), MAX_SANDBOXES);
        assert!(value.len() < MAX_VALUE_BYTES, "{}", value.len());
    }

    #[test]
    fn bad_values_are_refused_with_what_was_wrong() {
        for bad in [
            "nouid",
            "=u",
            "a=",
            "0123456789abcdef0=u",
            "a=u:",
            "a=u:x",
            "a=:5",
        ] {
            assert!(
                matches!(decode(bad), Err(InventoryError::Malformed(_))),
                "{bad}"
            );
        }
        let uid = "u".repeat(MAX_UID_LEN + 1);
        assert!(decode(&format!("a={uid}")).is_err());
        let huge = "a=u ".repeat(MAX_VALUE_BYTES);
        assert_eq!(decode(&huge), Err(InventoryError::TooLarge(huge.len())));
    }

    #[test]
    fn a_lease_name_stays_within_the_apis_length() {
        assert_eq!(lease_name("n1").as_deref(), Some("ipreclaim-sandboxes-n1"));
        assert_eq!(lease_name(""), None);
        let long = "n".repeat(253 - INVENTORY_LEASE_PREFIX.len());
        assert_eq!(lease_name(&long).map(|n| n.len()), Some(253));
        assert_eq!(lease_name(&format!("{long}x")), None);
        assert_eq!(id_prefix("ab"), "ab");
        assert_eq!(
            id_prefix("ééééééééééééééééé").chars().count(),
            ID_PREFIX_LEN
        );
    }
}
