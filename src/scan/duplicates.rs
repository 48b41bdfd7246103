//! `scan`'s duplicate addresses: each address two or more live pods list on one network, as a
//! row with decision `duplicate` (in JSON and YAML, beside the other rows) and as its own
//! "Duplicate addresses" section under the tables. Never counted as a release: the exit code
//! stays about releases.

use std::collections::BTreeMap;

use serde::Serialize;

use super::ScanRow;
use crate::index::{Duplicates, EntryOwner};
use crate::release::reports::events::IP_ADDRESS_DUPLICATE;

/// The decision of a duplicate's row.
pub const DUPLICATE: &str = "duplicate";

/// A duplicate address, as `scan` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScanDuplicate {
    /// The network (`namespace/nad`) the pods list it on.
    pub network: String,
    /// The live pods that list it (`namespace/name`).
    pub pods: Vec<String>,
}

/// One row per duplicate: the pool holding the address (empty when none is known), and the
/// podref and sandbox of its entry there (empty when it has none).
pub(super) fn rows(found: Duplicates, created: &BTreeMap<String, i64>) -> Vec<ScanRow> {
    found
        .found
        .into_iter()
        .map(|d| {
            let EntryOwner {
                podref,
                id: sandbox,
            } = d.entry.unwrap_or_default();
            ScanRow {
                pool: d.pool.unwrap_or_default(),
                ip: d.ip.to_string(),
                pod_age_seconds: created.get(&podref).copied(),
                podref,
                sandbox,
                decision: DUPLICATE.into(),
                reason: IP_ADDRESS_DUPLICATE.into(),
                fence: None,
                cooldown: None,
                duplicate: Some(ScanDuplicate {
                    network: d.network,
                    pods: d.pods.into_iter().map(|p| p.podref).collect(),
                }),
            }
        })
        .collect()
}

/// The section under the table: a title and a header (unless `headers` is off), then a line
/// per duplicate; nothing when there is none.
pub(super) fn section(rows: &[ScanRow], wide: bool, headers: bool) -> String {
    let none = || "<none>".to_string();
    let or_none = |s: &str| {
        if s.is_empty() { none() } else { s.to_owned() }
    };
    let cells: Vec<Vec<String>> = rows
        .iter()
        .filter_map(|r| Some((r, r.duplicate.as_ref()?)))
        .map(|(r, d)| {
            let mut row = vec![
                d.network.clone(),
                r.ip.clone(),
                d.pods.join(","),
                or_none(&r.pool),
                or_none(&r.podref),
            ];
            if wide {
                row.push(or_none(&r.sandbox));
            }
            row
        })
        .collect();
    if cells.is_empty() {
        return String::new();
    }
    let mut header = vec!["NETWORK", "IP", "PODS", "POOL", "ENTRY OF"];
    if wide {
        header.push("ENTRY SANDBOX");
    }
    let header: Vec<String> = header.into_iter().map(String::from).collect();
    let mut out = String::from("\n");
    if headers {
        out.push_str(
            "Duplicate addresses (live pods listing one address on one network; never released):\n",
        );
    }
    out.push_str(&super::aligned(headers.then_some(&header), &cells));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::{in_namespace, render, would_release};

    fn duplicate(pods: &[&str], entry: Option<(&str, &str)>) -> ScanRow {
        let (podref, sandbox) = entry.unwrap_or_default();
        ScanRow {
            pool: if entry.is_some() { "192.0.2.0-24" } else { "" }.into(),
            ip: "192.0.2.10".into(),
            podref: podref.into(),
            sandbox: sandbox.into(),
            decision: DUPLICATE.into(),
            reason: IP_ADDRESS_DUPLICATE.into(),
            pod_age_seconds: None,
            fence: None,
            cooldown: None,
            duplicate: Some(ScanDuplicate {
                network: "a/macvlan".into(),
                pods: pods.iter().map(|p| p.to_string()).collect(),
            }),
        }
    }

    #[test]
    fn duplicates_are_their_own_section_and_never_a_release() {
        let long = "0123456789abcdef0123";
        let rows = [
            duplicate(&["a/web-0", "b/db-0"], Some(("b/db-0", long))),
            duplicate(&["a/x", "a/y"], None),
        ];
        let t = render(&rows, false, true);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("POOL "),
            "the allocations' header: {t}"
        );
        assert_eq!(lines[1], "", "{t}");
        assert!(lines[2].starts_with("Duplicate addresses"), "{t}");
        assert!(
            lines[3].starts_with("NETWORK ") && lines[3].ends_with("ENTRY OF"),
            "{t}"
        );
        assert!(lines[4].contains("a/web-0,b/db-0"), "{t}");
        assert!(
            lines[4].contains(" 192.0.2.0-24 ") && lines[4].ends_with("b/db-0"),
            "{t}"
        );
        let last: Vec<&str> = lines[5].split_whitespace().collect();
        assert_eq!(last[3..], ["<none>", "<none>"], "no pool, no entry: {t}");
        assert!(!t.contains(long), "{t}");
        let w = render(&rows, true, true);
        assert!(w.lines().nth(3).unwrap().ends_with("ENTRY SANDBOX"), "{w}");
        assert!(w.lines().nth(4).unwrap().ends_with(long), "{w}");
        let bare = render(&rows, false, false);
        assert_eq!(
            bare.lines().count(),
            3,
            "a blank line, then the two: {bare}"
        );
        assert!(!rows.iter().any(would_release));
        // -n: a duplicate shows in the namespace of any pod that lists it.
        assert_eq!(in_namespace(rows.to_vec(), "b").len(), 1);
        assert_eq!(in_namespace(rows.to_vec(), "a").len(), 2);
        assert_eq!(in_namespace(rows.to_vec(), "c").len(), 0);
    }

    #[test]
    fn no_duplicates_no_section() {
        assert_eq!(section(&[], true, true), "");
        assert_eq!(render(&[], false, true).lines().count(), 1);
    }
}
