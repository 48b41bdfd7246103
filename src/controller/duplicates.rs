//! Duplicate addresses (`index::duplicates`: two or more live pods list one address on one
//! network), shown where an operator looks: `ipreclaim_duplicate_addresses{network}` on every
//! replica (from its own cache, 0 once resolved), and from the leader a Warning
//! `IPAddressDuplicate` Event on each pod and on the pool that holds the address (the NAD when
//! no pool is known), once per episode through [`report::Reporter`], and a log line naming the
//! pods. Nothing here writes to a pool: a duplicate is never a reason to release.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;

use super::report::{self, IP_ADDRESS_DUPLICATE, Problem};
use crate::index::{Duplicate, Duplicates, Holder, Index};
use crate::ipam::PodKey;
use crate::telemetry::ControllerMetrics;

/// Most duplicates named in one Event.
const NAMED: usize = 5;

/// What was exported and logged, to set resolved series to 0 and log each episode once.
#[derive(Debug, Default)]
pub struct DuplicateReporter {
    /// Networks with a series.
    series: HashSet<String>,
    /// Duplicates logged (the leader's), with their pods.
    logged: HashMap<(String, IpAddr), Vec<String>>,
    /// The last look, at this listing generation of the index.
    last: Option<(u64, Duplicates)>,
}

impl DuplicateReporter {
    /// The duplicates in `st`, looked for again only when what pods list, pools or NADs
    /// changed since the last look (at 100,000 pods a look is a pass over them all).
    pub fn found(&mut self, st: &Index) -> &Duplicates {
        let generation = st.listing_generation();
        if self.last.as_ref().is_none_or(|(g, _)| *g != generation) {
            self.last = Some((generation, st.duplicates()));
        }
        &self.last.as_ref().expect("just set").1
    }

    /// Sets the gauges (every replica), logs new and resolved duplicates (the leader), and
    /// returns the Events' problems (published by the leader's [`report::Reporter`]).
    pub fn pass(
        &mut self,
        st: &Index,
        found: &Duplicates,
        metrics: &ControllerMetrics,
        namespace: &str,
        leader: bool,
    ) -> Vec<Problem> {
        self.export(st, found, metrics);
        if leader {
            self.log(found);
        } else {
            self.logged.clear();
        }
        problems(st, found, namespace)
    }

    /// One series per known network and per network with a duplicate; a network gone (no NAD,
    /// no duplicate) loses its series.
    fn export(&mut self, st: &Index, found: &Duplicates, metrics: &ControllerMetrics) {
        let per_network = found.per_network();
        let mut networks: HashSet<String> = st.networks().keys().into_iter().collect();
        networks.extend(per_network.keys().map(|n| n.to_string()));
        for n in &networks {
            let count = per_network.get(n.as_str()).copied().unwrap_or(0);
            let label = n.clone().into();
            metrics
                .duplicate_addresses
                .get_or_create(&label)
                .set(count as i64);
        }
        for gone in self.series.difference(&networks) {
            metrics.duplicate_addresses.remove(&gone.clone().into());
        }
        self.series = networks;
    }

    /// A log line per duplicate as it starts (or its pods change), and one as it ends.
    fn log(&mut self, found: &Duplicates) {
        let mut now = HashMap::with_capacity(found.found.len());
        for d in &found.found {
            let key = (d.network.clone(), d.ip);
            let pods: Vec<String> = d.pods.iter().map(|p| p.podref.clone()).collect();
            if self.logged.get(&key) != Some(&pods) {
                tracing::warn!(
                    network = %d.network,
                    address = %d.ip,
                    pods = %pods.join(", "),
                    pool = d.pool.as_deref().unwrap_or(""),
                    entry = d.entry.as_ref().map_or("", |h| h.podref.as_str()),
                    "duplicate address: live pods list the same address on one network; none is released"
                );
            }
            now.insert(key, pods);
        }
        for ((network, ip), pods) in &self.logged {
            if !now.contains_key(&(network.clone(), *ip)) {
                tracing::info!(%network, address = %ip, pods = %pods.join(", "), "duplicate address resolved");
            }
        }
        self.logged = now;
    }
}

/// The Events' problems: one per pod and one per pool (or NAD), each naming all its
/// duplicates (one Event per object, so that the reporter keeps one message per object).
pub fn problems(st: &Index, found: &Duplicates, namespace: &str) -> Vec<Problem> {
    let mut notes: BTreeMap<(&'static str, String, String), (String, Vec<String>)> =
        BTreeMap::new();
    let mut note = |kind: &'static str, ns: &str, name: &str, uid: &str, text: String| {
        let key = (kind, ns.to_owned(), name.to_owned());
        let entry = notes.entry(key).or_insert_with(|| (uid.to_owned(), vec![]));
        entry.1.push(text);
    };
    for d in &found.found {
        for p in &d.pods {
            let others: Vec<&str> = d
                .pods
                .iter()
                .filter(|o| o.podref != p.podref)
                .map(|o| o.podref.as_str())
                .collect();
            let pod = PodKey::lenient(&p.podref);
            let text = format!(
                "address {} on network {} is also listed by live pod {}",
                d.ip,
                d.network,
                others.join(", ")
            );
            note("Pod", &pod.namespace, &pod.name, &p.uid, text);
        }
        match &d.pool {
            Some(pool) => {
                let uid = st.pools().get(pool).map_or("", |p| p.uid.as_str());
                note("IPPool", namespace, pool, uid, pool_note(d));
            }
            None => {
                let (ns, name) = d.network.split_once('/').unwrap_or(("", &d.network));
                let text = format!("{}; no known pool holds it", listed_by(d));
                note("NetworkAttachmentDefinition", ns, name, "", text);
            }
        }
    }
    notes
        .into_iter()
        .map(|((kind, ns, name), (uid, texts))| Problem {
            reference: report::reference(kind, &ns, &name, &uid),
            reason: IP_ADDRESS_DUPLICATE,
            message: message(&texts),
        })
        .collect()
}

/// "address A on network N is listed by K live pods: a, b".
fn listed_by(d: &Duplicate) -> String {
    let pods: Vec<&str> = d.pods.iter().map(|p| p.podref.as_str()).collect();
    format!(
        "address {} on network {} is listed by {} live pods: {}",
        d.ip,
        d.network,
        pods.len(),
        pods.join(", ")
    )
}

/// What the pool's Event says of one duplicate: who lists it and who its entry names.
fn pool_note(d: &Duplicate) -> String {
    match &d.entry {
        Some(Holder {
            podref,
            id: sandbox,
        }) => format!(
            "{}; the pool's entry names {podref} (sandbox {})",
            listed_by(d),
            sandbox.get(..12).unwrap_or(sandbox)
        ),
        None => format!("{}; the pool has no entry for it", listed_by(d)),
    }
}

/// One object's notes as one message.
fn message(texts: &[String]) -> String {
    let n = texts.len();
    let mut out = format!("duplicate address: {}", texts[..n.min(NAMED)].join("; "));
    if n > NAMED {
        out.push_str(&format!("; and {} more", n - NAMED));
    }
    out.push_str(" (ipreclaim releases none of them; give one pod another address)");
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use super::*;
    use crate::index::PodSeen;

    fn listing(ix: &mut Index, name: &str, ip: &str) {
        let status = serde_json::json!([{"name": "ns/net", "interface": "net1", "ips": [ip]}]);
        let annotations = BTreeMap::from([(
            crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(),
            status.to_string(),
        )]);
        let seen = PodSeen {
            annotations: Some(&annotations),
            ..Default::default()
        };
        ix.upsert_pod(&format!("ns/{name}"), name, seen, Instant::now());
    }

    #[test]
    fn a_kept_look_is_renewed_as_soon_as_what_pods_list_changes() {
        let mut ix = Index::default();
        let nad = serde_json::json!({
            "metadata": {"name": "net", "namespace": "ns"},
            "spec": {"config": r#"{"cniVersion":"0.3.1","type":"macvlan","ipam":{"type":"whereabouts","range":"192.0.2.0/24"}}"#},
        });
        ix.upsert_nad(&serde_json::from_value(nad).unwrap());
        let mut reporter = DuplicateReporter::default();
        listing(&mut ix, "a", "192.0.2.10");
        listing(&mut ix, "b", "192.0.2.10");
        assert_eq!(reporter.found(&ix).found.len(), 1);
        assert_eq!(
            reporter.found(&ix).found.len(),
            1,
            "kept while nothing changed"
        );
        listing(&mut ix, "b", "192.0.2.11");
        assert!(
            reporter.found(&ix).found.is_empty(),
            "renewed after b moved"
        );
    }
}
