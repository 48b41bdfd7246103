//! A node's sandbox inventory: the sandboxes its node agent last saw live, written into a Lease
//! per node. A controller that never saw a pod's deletion (no replica ran, or none reached the
//! apiserver) finds the pod's node here: the one whose agent listed the entry's sandbox.
//!
//! The Lease is `ipreclaim-sandboxes-<node>` in the pools' namespace; `spec.holderIdentity` is
//! the node, `spec.renewTime` when its agent wrote it, and the annotation
//! [`INVENTORY_ANNOTATION`] the sandboxes: `<id prefix>=<pod uid>` separated by spaces. Ids are
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

/// The annotation value for `sandboxes` (id -> pod uid).
pub fn encode<'a>(sandboxes: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut tokens: Vec<String> = sandboxes
        .into_iter()
        .map(|(id, uid)| format!("{}={uid}", id_prefix(id)))
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
    /// Sandbox id prefix -> pod uid.
    pub sandboxes: BTreeMap<String, String>,
    /// Every live sandbox of the node is listed.
    pub complete: bool,
}

/// Why an inventory could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    /// Past [`MAX_VALUE_BYTES`].
    #[error("the inventory is {0} bytes, past the {MAX_VALUE_BYTES} read")]
    TooLarge(usize),
    /// A token that is not `<id prefix>=<uid>`.
    #[error("inventory token {0:?} is not <sandbox id prefix>=<pod uid>")]
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
        let (id, uid) = token.split_once('=').ok_or_else(malformed)?;
        if id.is_empty() || id.len() > ID_PREFIX_LEN || uid.is_empty() || uid.len() > MAX_UID_LEN {
            return Err(malformed());
        }
        inventory.sandboxes.insert(id.to_owned(), uid.to_owned());
    }
    Ok(inventory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_cut_to_their_prefix_and_read_back_with_their_pod() {
        let long = "0123456789abcdef0123456789abcdef";
        let value = encode([(long, "uid-1"), ("short", "uid-2")]);
        assert_eq!(value, "0123456789abcdef=uid-1 short=uid-2");
        let read = decode(&value).unwrap();
        assert!(read.complete);
        assert_eq!(read.sandboxes[id_prefix(long)], "uid-1");
        assert_eq!(read.sandboxes["short"], "uid-2");
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
        let value = encode(ids.iter().map(|id| (id.as_str(), "u")));
        let read = decode(&value).unwrap();
        assert!(!read.complete);
        assert_eq!(read.sandboxes.len(), MAX_SANDBOXES);
        assert!(value.len() < MAX_VALUE_BYTES, "{}", value.len());
    }

    #[test]
    fn bad_values_are_refused_with_what_was_wrong() {
        for bad in ["nouid", "=u", "a=", "0123456789abcdef0=u"] {
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
