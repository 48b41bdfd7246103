//! Duplicate addresses (`index::duplicates`: two or more live pods list one address on one
//! network), shown where an operator looks: `ipreclaim_duplicate_addresses{network}` on every
//! replica (from its own cache, 0 once resolved), and from the leader a Warning
//! `IPAddressDuplicate` Event on each pod and on the pool that holds the address (the NAD when
//! no pool is known), once per episode through [`report::Reporter`], and a log line naming the
//! pods. Nothing here writes to a pool: a duplicate is never a reason to release.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;

use super::report::{self, Problem};
use crate::index::{Duplicate, DuplicatePod, Duplicates, EntryOwner, Index, IndexLock};
use crate::ipam::PodKey;
use crate::release::reports::events::IP_ADDRESS_DUPLICATE;
use crate::release::reports::recorder::{NOTE_MAX, fit};
use crate::telemetry::ControllerMetrics;

/// Most duplicates named in one Event, and most pods named per duplicate (in an Event or a log
/// line): hundreds of pods can list one address.
const NAMED: usize = 5;

/// Shared addresses resolved (uids, pools) per read of the index: the lock is let go between.
const RESOLVED_PER_READ: usize = 1024;

/// What was exported and logged, to set resolved series to 0 and log each episode once.
#[derive(Debug, Default)]
pub struct DuplicateReporter {
    /// Networks with a series.
    series: HashSet<String>,
    /// Duplicates logged (the leader's): a hash of their pods, and the first few named.
    logged: HashMap<(String, IpAddr), (u64, String)>,
    /// The last look, at this listing generation of the index.
    last: Option<(u64, Arc<Duplicates>)>,
}

impl DuplicateReporter {
    /// The duplicates in `index`, looked for again only when what pods list, pools or NADs
    /// changed since the last look. Off the lock: what pods list is copied out under one short
    /// read (a reference count per pod), the pass over it runs with the lock let go, and the
    /// addresses found are resolved to uids and pools a thousand per short read.
    pub fn found(&mut self, index: &IndexLock) -> Arc<Duplicates> {
        let (generation, listings) = {
            let st = index.read().expect("index lock");
            let generation = st.listing_generation();
            if let Some((g, last)) = &self.last
                && *g == generation
            {
                return last.clone();
            }
            (generation, st.listings())
        };
        let shared = listings.shared();
        drop(listings);
        let mut found = Vec::new();
        for chunk in shared.addresses.chunks(RESOLVED_PER_READ) {
            found.extend(index.read().expect("index lock").resolve(chunk));
        }
        let found = Arc::new(Duplicates {
            found,
            unreadable: shared.unreadable,
        });
        self.last = Some((generation, found.clone()));
        found
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
            let mut hasher = DefaultHasher::new();
            d.pods.iter().for_each(|p| p.podref.hash(&mut hasher));
            let hash = hasher.finish();
            let changed = self.logged.get(&key).is_none_or(|(h, _)| *h != hash);
            let pods = if changed {
                named(&d.pods, None)
            } else {
                self.logged.remove(&key).expect("logged").1
            };
            if changed {
                tracing::warn!(
                    network = %d.network,
                    address = %d.ip,
                    pods = %pods,
                    pool = d.pool.as_deref().unwrap_or(""),
                    entry = d.entry.as_ref().map_or("", |h| h.podref.as_str()),
                    "duplicate address: live pods list the same address on one network; none is released"
                );
            }
            now.insert(key, (hash, pods));
        }
        for ((network, ip), (_, pods)) in &self.logged {
            if !now.contains_key(&(network.clone(), *ip)) {
                tracing::info!(%network, address = %ip, %pods, "duplicate address resolved");
            }
        }
        self.logged = now;
    }
}

/// One object's notes: its uid, the first [`NAMED`] texts, and how many there are.
type Notes = (String, Vec<String>, usize);

/// The Events' problems: one per pod and one per pool (or NAD), each naming its first
/// duplicates (one Event per object, so that the reporter keeps one message per object). A
/// text is made only for the first few of an object: the rest are counted.
pub fn problems(st: &Index, found: &Duplicates, namespace: &str) -> Vec<Problem> {
    let mut notes: BTreeMap<(&'static str, String, String), Notes> = BTreeMap::new();
    let mut note =
        |kind: &'static str, ns: &str, name: &str, uid: &str, text: &dyn Fn() -> String| {
            let key = (kind, ns.to_owned(), name.to_owned());
            let entry = notes
                .entry(key)
                .or_insert_with(|| (uid.to_owned(), vec![], 0));
            if entry.1.len() < NAMED {
                entry.1.push(text());
            }
            entry.2 += 1;
        };
    for d in &found.found {
        for p in &d.pods {
            let pod = PodKey::lenient(&p.podref);
            let text = || {
                format!(
                    "address {} on network {} is also listed by live pod {}",
                    d.ip,
                    d.network,
                    named(&d.pods, Some(&p.podref))
                )
            };
            note("Pod", &pod.namespace, &pod.name, &p.uid, &text);
        }
        match &d.pool {
            Some(pool) => {
                let uid = st.pools().get(pool).map_or("", |p| p.uid.as_str());
                note("IPPool", namespace, pool, uid, &|| pool_note(d));
            }
            None => {
                let (ns, name) = d.network.split_once('/').unwrap_or(("", &d.network));
                let text = || format!("{}; no known pool holds it", listed_by(d));
                note("NetworkAttachmentDefinition", ns, name, "", &text);
            }
        }
    }
    notes
        .into_iter()
        .map(|((kind, ns, name), (uid, texts, n))| Problem {
            reference: report::reference(kind, &ns, &name, &uid),
            reason: IP_ADDRESS_DUPLICATE,
            message: message(&texts, n),
        })
        .collect()
}

/// The podrefs of `pods` but `but`, the first [`NAMED`] of them and how many more.
fn named(pods: &[DuplicatePod], but: Option<&str>) -> String {
    let mut others = pods.iter().filter(|p| Some(p.podref.as_str()) != but);
    let first: Vec<&str> = others
        .by_ref()
        .take(NAMED)
        .map(|p| p.podref.as_str())
        .collect();
    let rest = others.count();
    let mut out = first.join(", ");
    if rest > 0 {
        out.push_str(&format!(" and {rest} more"));
    }
    out
}

/// "address A on network N is listed by K live pods: a, b".
fn listed_by(d: &Duplicate) -> String {
    format!(
        "address {} on network {} is listed by {} live pods: {}",
        d.ip,
        d.network,
        d.pods.len(),
        named(&d.pods, None)
    )
}

/// What the pool's Event says of one duplicate: who lists it and who its entry names.
fn pool_note(d: &Duplicate) -> String {
    match &d.entry {
        Some(EntryOwner {
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

/// One object's notes as one message (of `n` in all), within an Event's note.
fn message(texts: &[String], n: usize) -> String {
    let mut out = format!("duplicate address: {}", texts.join("; "));
    if n > texts.len() {
        out.push_str(&format!("; and {} more", n - texts.len()));
    }
    out.push_str(" (ipreclaim releases none of them; give one pod another address)");
    fit(&out, NOTE_MAX).into_owned()
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
        let lock = IndexLock::default();
        *lock.write().unwrap() = ix;
        let first = reporter.found(&lock);
        assert_eq!(first.found.len(), 1);
        assert!(
            Arc::ptr_eq(&first, &reporter.found(&lock)),
            "kept while nothing changed"
        );
        listing(&mut lock.write().unwrap(), "b", "192.0.2.11");
        assert!(
            reporter.found(&lock).found.is_empty(),
            "renewed after b moved"
        );
    }
}
