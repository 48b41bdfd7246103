//! `ipreclaim scan`: a read-only report of every allocation the rules would release or hold as a
//! candidate, and of every duplicate address (`duplicates`), from one list of each resource.
//! Writes nothing.

mod age;
mod duplicates;

use std::collections::BTreeMap;

use anyhow::Context;
use kube::Client;
use kube::api::{Api, ListParams};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::lenient::Lenient;
use crate::api::slim::PodView;
use crate::api::{IPFence, IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation};
use crate::index::Index;
use crate::index::kinds::{Fences, Nads, Pods, Pools, Reservations};
use crate::index::relist::{Kind, Relist, Step};
use crate::ipam::PodKey;
use crate::paged::{POD_PAGE, POOL_PAGE, RESERVATION_PAGE, for_each_listed};
use crate::rules::{Decision, ReclaimConfig};

pub use age::human_duration;
pub use duplicates::{DUPLICATE, ScanDuplicate};

/// One reported allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScanRow {
    /// Pool name.
    pub pool: String,
    /// Address.
    pub ip: String,
    /// `namespace/name` recorded with it.
    pub podref: String,
    /// Sandbox id recorded with it.
    pub sandbox: String,
    /// `release` (direct evidence), `candidate` (released after the grace period), `fenced`,
    /// `cooling` or `duplicate` (not releases).
    pub decision: String,
    /// Reason code.
    pub reason: String,
    /// Age of the live pod holding the podref (none when no pod of that name exists).
    pub pod_age_seconds: Option<i64>,
    /// For a fenced address: the node it waits for, why, and how long.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<ScanFence>,
    /// For an address in its release cooldown: when it returns to the pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cooldown: Option<ScanCooldown>,
    /// For a duplicate address: its network and the live pods that list it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duplicate: Option<ScanDuplicate>,
}

/// A release cooldown, as `scan` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScanCooldown {
    /// When it ends (RFC 3339), if its marker can be read.
    pub until: Option<String>,
    /// Seconds left (0 once over: the leader removes it within a second).
    pub remaining_seconds: Option<i64>,
    /// Why its end cannot be read (the entry is kept, and reported).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The reason code of a cooling row.
pub const COOLDOWN_REASON: &str = "ReleaseCooldown";

/// The rows of addresses in their release cooldown at `now`.
fn cooling_rows(index: &Index, now: jiff::Timestamp) -> Vec<ScanRow> {
    index
        .cooling()
        .into_iter()
        .map(|(pool, c)| ScanRow {
            pool,
            ip: c.entry.ip.to_string(),
            podref: c.pod,
            sandbox: String::new(),
            decision: "cooling".into(),
            reason: COOLDOWN_REASON.into(),
            pod_age_seconds: None,
            fence: None,
            cooldown: Some(ScanCooldown {
                until: c.until.as_ref().ok().map(ToString::to_string),
                remaining_seconds: c
                    .until
                    .as_ref()
                    .ok()
                    .map(|u| crate::ipam::cooldown::remaining(*u, now).as_secs() as i64),
                error: c.until.as_ref().err().map(ToString::to_string),
            }),
            duplicate: None,
        })
        .collect()
}

/// A fence, as `scan` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScanFence {
    /// The node the deleted pod was on.
    pub node: String,
    /// Its Ready condition when the fence was set.
    pub why: String,
    /// Seconds since the fence was set.
    pub age_seconds: i64,
}

/// Lists pods (stripped, paged), pools and NADs, and judges every allocation.
pub async fn scan(
    client: Client,
    namespace: &str,
    reclaim: ReclaimConfig,
) -> anyhow::Result<Vec<ScanRow>> {
    let wall = jiff::Timestamp::now();
    let (index, created) = index_cluster(client, namespace, wall).await?;
    let mut rows: Vec<ScanRow> = index
        .judge_leaks(&reclaim)
        .into_iter()
        .filter_map(|j| {
            let (decision, reason) = match j.decision {
                Decision::Release(r) => ("release", r),
                Decision::Candidate(r) => ("candidate", r),
                Decision::Keep(_) => return None,
            };
            Some(ScanRow {
                pool: j.pool,
                ip: j.entry.ip.to_string(),
                pod_age_seconds: created.get(&j.entry.podref).copied(),
                podref: j.entry.podref,
                sandbox: j.entry.id,
                decision: decision.into(),
                reason: reason.as_str().into(),
                fence: None,
                cooldown: None,
                duplicate: None,
            })
        })
        .collect();
    // Fenced addresses: a deleted pod's, kept until its node is trusted again.
    rows.extend(index.fenced().into_iter().map(|f| ScanRow {
        pool: f.pool,
        ip: f.entry.ip.to_string(),
        pod_age_seconds: None,
        podref: f.record.podref,
        sandbox: f.entry.id,
        decision: "fenced".into(),
        reason: crate::rules::Reason::PodDeleted.as_str().into(),
        fence: Some(ScanFence {
            node: f.record.node,
            why: f.record.why,
            age_seconds: wall.duration_since(f.record.since).as_secs(),
        }),
        cooldown: None,
        duplicate: None,
    }));
    // Released addresses kept out of the pool for a while: neither live nor leaked.
    rows.extend(cooling_rows(&index, wall));
    rows.sort_by(|a, b| (&a.pool, &a.ip).cmp(&(&b.pool, &b.ip)));
    // After the rows of allocations, as the tables show them (in network, address order).
    rows.extend(duplicates::rows(index.duplicates(), &created));
    Ok(rows)
}

/// Feeds one complete listing of kind `K` to the index, by the controller's own rules.
fn listed<K: Kind<Store = Index>>(index: &mut Index, objects: impl IntoIterator<Item = K::Object>) {
    let now = std::time::Instant::now();
    let mut relist = Relist::<K>::default();
    relist.step(index, Step::Begin, now);
    for o in objects {
        relist.step(index, Step::Listed(o), now);
    }
    relist.step(index, Step::Done, now);
}

/// Lists `api` into `index` a page of `limit` at a time (a page is handled and dropped before
/// the next is read), each object shown to `inspect` first. A failed page leaves part of the
/// kind in `index`: for the kinds whose failure fails the command (pools, pods, reservations
/// when strict); the ones a scan does without are read whole by [`listed`].
async fn list_paged<K>(
    index: &mut Index,
    api: Api<K::Object>,
    limit: u32,
    mut inspect: impl FnMut(&K::Object),
) -> Result<(), kube::Error>
where
    K: Kind<Store = Index>,
    K::Object: Clone + DeserializeOwned + std::fmt::Debug,
{
    let now = std::time::Instant::now();
    let mut relist = Relist::<K>::default();
    relist.step(index, Step::Begin, now);
    for_each_listed(
        limit,
        |page| {
            let api = api.clone();
            async move { api.list(&page).await }
        },
        |o| {
            inspect(&o);
            relist.step(index, Step::Listed(o), now);
        },
    )
    .await?;
    relist.step(index, Step::Done, now);
    Ok(())
}

/// The index the manual commands (`unfence`, `release`) write from: pools, fence records,
/// reservations, NADs and then pods of the cluster now, by the controller's own rules. Unlike
/// `scan`, a kind that cannot be listed fails it (a write must not rest on a partial view).
pub async fn index_for_writes(client: Client, namespace: &str) -> anyhow::Result<Index> {
    let wall = jiff::Timestamp::now();
    let (index, _) = index_of(client, namespace, wall, true).await?;
    Ok(index)
}

/// The index of what the cluster holds now (pods, pools, fence records, NADs), and each pod's
/// age in seconds by podref. Fence records and NADs that cannot be listed are said and done
/// without: fewer rows, not a failed scan.
async fn index_cluster(
    client: Client,
    namespace: &str,
    wall: jiff::Timestamp,
) -> anyhow::Result<(Index, BTreeMap<String, i64>)> {
    index_of(client, namespace, wall, false).await
}

/// [`index_cluster`]; `strict` (for writes): reservations are listed too, and fence records and
/// NADs that cannot be listed fail it.
///
/// Pools are listed before pods: an entry in the pools read was allocated before the pod
/// listing began, and the CNI allocates only for a pod that exists, so its pod (unless deleted
/// since) is in the listing. Pods listed first would miss a pod created, and given an entry,
/// between the two lists (a StatefulSet pod recreated under the same name): its entry would look
/// like a missing pod's.
async fn index_of(
    client: Client,
    namespace: &str,
    wall: jiff::Timestamp,
    strict: bool,
) -> anyhow::Result<(Index, BTreeMap<String, i64>)> {
    let mut index = Index::default();
    let pools = Api::<Lenient<IPPool>>::namespaced(client.clone(), namespace);
    list_paged::<Pools>(&mut index, pools, POOL_PAGE, |p| {
        if let Some((name, error)) = invalid(p) {
            tracing::warn!(pool = %name, %error, "IPPool skipped: it does not fit the schema");
        }
    })
    .await
    .with_context(|| format!("list IPPools in {namespace}"))?;
    // Fence records: without them fenced entries show as unrecorded, pending ones as leaks.
    match Api::<Lenient<IPFence>>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
    {
        Ok(fences) => listed::<Fences>(&mut index, fences),
        Err(e) if strict => {
            return Err(e).with_context(|| format!("list IPFences in {namespace}"));
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot list IPFences: fenced addresses are not shown")
        }
    }
    if strict {
        let reservations =
            Api::<Lenient<OverlappingRangeIPReservation>>::namespaced(client.clone(), namespace);
        list_paged::<Reservations>(&mut index, reservations, RESERVATION_PAGE, |_| {})
            .await
            .with_context(|| format!("list OverlappingRangeIPReservations in {namespace}"))?;
    }
    match Api::<Lenient<NetworkAttachmentDefinition>>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(nads) => listed::<Nads>(&mut index, nads),
        Err(e) if strict => return Err(e).context("list NetworkAttachmentDefinitions"),
        // Without NADs the rules fall back to interface names: still a useful report.
        Err(e) => tracing::warn!(error = %e, "cannot list NetworkAttachmentDefinitions"),
    }
    let created = list_pods(&mut index, client, wall).await?;
    Ok((index, created))
}

/// Lists every pod (stripped, paged) into `index`; each pod's age in seconds by podref.
async fn list_pods(
    index: &mut Index,
    client: Client,
    wall: jiff::Timestamp,
) -> anyhow::Result<BTreeMap<String, i64>> {
    let mut created: BTreeMap<String, i64> = BTreeMap::new();
    let pods = Api::<PodView>::all(crate::protobuf_lists::pod_list_client(client));
    // Paged: a page of full pods is read, stripped and dropped before the next.
    list_paged::<Pods>(index, pods, POD_PAGE, |p| {
        if let (Some(pod), Some(t)) = (PodKey::of_meta(&p.metadata), &p.metadata.creation_timestamp)
        {
            let age = wall.duration_since(t.0).as_secs();
            created.insert(pod.podref(), age);
        }
    })
    .await
    .context("list pods")?;
    Ok(created)
}

/// An object that does not fit its schema: its name and what is wrong.
fn invalid<K>(object: &Lenient<K>) -> Option<(String, String)> {
    match object {
        Lenient::Valid(_) => None,
        Lenient::Invalid { metadata, error } => {
            Some((metadata.name.clone().unwrap_or_default(), error.clone()))
        }
    }
}

/// Rows of pods in `namespace` only (the namespace of each row's podref; for a duplicate, of
/// any pod that lists it).
pub fn in_namespace(rows: Vec<ScanRow>, namespace: &str) -> Vec<ScanRow> {
    let inside = |podref: &str| PodKey::namespace_of(podref) == namespace;
    rows.into_iter()
        .filter(|r| match &r.duplicate {
            Some(d) => d.pods.iter().any(|p| inside(p)),
            None => inside(&r.podref),
        })
        .collect()
}

/// Whether a row would be released (now, or after the leak grace): fenced and cooling rows
/// are kept on purpose and do not count.
pub fn would_release(row: &ScanRow) -> bool {
    matches!(row.decision.as_str(), "release" | "candidate")
}

/// Renders rows as an aligned table: short sandbox ids and human ages, as kubectl shows them.
pub fn table(rows: &[ScanRow]) -> String {
    render(rows, false, true)
}

/// Renders rows as a table with whole sandbox ids and why each fence was set (`-o wide`).
pub fn wide(rows: &[ScanRow]) -> String {
    render(rows, true, true)
}

/// The table or the wide table, with or without its header line; then the duplicate addresses'
/// section, when there are any.
pub fn render(rows: &[ScanRow], wide: bool, headers: bool) -> String {
    let (duplicates, rows): (Vec<ScanRow>, Vec<ScanRow>) =
        rows.iter().cloned().partition(|r| r.duplicate.is_some());
    let mut out = allocations(&rows, wide, headers);
    out.push_str(&duplicates::section(&duplicates, wide, headers));
    out
}

/// The table of allocations.
fn allocations(rows: &[ScanRow], wide: bool, headers: bool) -> String {
    let mut header = vec![
        "POOL",
        "IP",
        "POD",
        "SANDBOX",
        "DECISION",
        "REASON",
        "POD AGE",
        "FENCED ON",
    ];
    if wide {
        header.push("FENCED BECAUSE");
    }
    let none = || "<none>".to_string();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let sandbox = if r.sandbox.is_empty() {
                none()
            } else if wide {
                r.sandbox.clone()
            } else {
                short_id(&r.sandbox).to_owned()
            };
            let mut row = vec![
                r.pool.clone(),
                r.ip.clone(),
                r.podref.clone(),
                sandbox,
                r.decision.clone(),
                reason_cell(r),
                r.pod_age_seconds
                    .map_or_else(none, |s| human_duration(seconds(s))),
                r.fence.as_ref().map_or_else(none, |f| {
                    format!("{} for {}", f.node, human_duration(seconds(f.age_seconds)))
                }),
            ];
            if wide {
                row.push(
                    r.fence
                        .as_ref()
                        .map(|f| f.why.clone())
                        .filter(|w| !w.is_empty())
                        .unwrap_or_else(none),
                );
            }
            row
        })
        .collect();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    aligned(headers.then_some(&header), &cells)
}

/// Columns aligned to their widest cell, three spaces apart, after `header` when given.
fn aligned(header: Option<&Vec<String>>, cells: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.map_or_else(
        || vec![0; cells.first().map_or(0, Vec::len)],
        |h| h.iter().map(|h| h.chars().count()).collect(),
    );
    for row in cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for cols in header.into_iter().chain(cells) {
        let parts: Vec<String> = cols
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(parts.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// The REASON cell: a cooling row says how long it has left.
fn reason_cell(r: &ScanRow) -> String {
    match &r.cooldown {
        Some(ScanCooldown {
            remaining_seconds: Some(s),
            ..
        }) => format!("{} ({} left)", r.reason, human_duration(seconds(*s))),
        Some(_) => format!("{} (unreadable end)", r.reason),
        None => r.reason.clone(),
    }
}

fn seconds(s: i64) -> jiff::SignedDuration {
    jiff::SignedDuration::from_secs(s)
}

/// The first 12 characters of a sandbox id, as crictl and the Events show them.
pub fn short_id(id: &str) -> &str {
    id.char_indices().nth(12).map_or(id, |(i, _)| &id[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(podref: &str, decision: &str, fence: Option<ScanFence>) -> ScanRow {
        ScanRow {
            pool: "192.0.2.0-24".into(),
            ip: "192.0.2.10".into(),
            podref: podref.into(),
            sandbox: "0123456789abcdef0123".into(),
            decision: decision.into(),
            reason: "PodMissing".into(),
            pod_age_seconds: Some(190),
            fence,
            cooldown: None,
            duplicate: None,
        }
    }

    #[test]
    fn cooling_addresses_show_their_time_left_and_do_not_count_as_releases() {
        let mut ix = Index::default();
        let entry = |id: &str| serde_json::json!({"id": id, "podref": "ns/old-0:cooldown"});
        let spec = serde_json::json!({"range": "192.0.2.0/24", "allocations": {
            "7": entry("ipreclaim-cooldown:2026-11-25T10:01:10Z"),
            "8": entry("ipreclaim-cooldown:soon")}});
        let pool = crate::api::IPPool::new("p", serde_json::from_value(spec).unwrap());
        ix.upsert_pool(&pool);
        let now: jiff::Timestamp = "2026-11-25T10:00:00Z".parse().unwrap();
        let rows = cooling_rows(&ix, now);
        assert_eq!(rows.len(), 2);
        let c = rows[0].cooldown.as_ref().unwrap();
        assert_eq!(c.until.as_deref(), Some("2026-11-25T10:01:10Z"));
        assert_eq!(c.remaining_seconds, Some(70));
        assert_eq!(rows[0].podref, "ns/old-0");
        // A malformed marker: shown with its error, never dropped.
        assert!(rows[1].cooldown.as_ref().unwrap().error.is_some());
        assert!(rows.iter().all(|r| !would_release(r)));
        let t = table(&rows);
        assert!(t.contains("ReleaseCooldown (70s left)"), "{t}");
        assert!(t.contains("ReleaseCooldown (unreadable end)"), "{t}");
    }

    #[test]
    fn tables_show_short_ids_and_ages_and_wide_the_whole_id_and_why() {
        let fence = ScanFence {
            node: "node-a".into(),
            why: "Ready=Unknown".into(),
            age_seconds: 49 * 3600,
        };
        let rows = [
            row("ns/web-0", "candidate", None),
            row("ns/db-0", "fenced", Some(fence)),
        ];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("POOL "), "{t}");
        assert!(lines[1].contains(" 0123456789ab "), "{t}");
        assert!(!t.contains("0123456789abc"), "{t}");
        assert!(lines[1].contains(" 3m10s "), "{t}");
        assert!(lines[1].ends_with("<none>"), "{t}");
        assert!(lines[2].contains("node-a for 2d1h"), "{t}");
        let w = wide(&rows);
        assert!(w.lines().next().unwrap().ends_with("FENCED BECAUSE"), "{w}");
        assert!(w.contains("0123456789abcdef0123"), "{w}");
        assert!(w.lines().nth(2).unwrap().ends_with("Ready=Unknown"), "{w}");
        assert_eq!(render(&rows, false, false).lines().count(), 2);
    }

    #[test]
    fn namespaces_filter_by_podref_and_fences_do_not_count_as_releases() {
        let rows = vec![
            row("a/web-0", "candidate", None),
            row("b/web-0", "release", None),
            row("ab/web-0", "fenced", None),
        ];
        let a = in_namespace(rows.clone(), "a");
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].podref, "a/web-0");
        assert!(rows[..2].iter().all(would_release));
        assert!(!would_release(&rows[2]));
    }
}
