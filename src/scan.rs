//! `ipreclaim scan`: a read-only report of every allocation the rules would release or hold as a
//! candidate, from one list of each resource. Writes nothing.

use std::collections::BTreeMap;

use anyhow::Context;
use kube::Client;
use kube::api::{Api, ListParams};
use serde::Serialize;

use crate::api::lenient::Lenient;
use crate::api::paged::for_each_listed;
use crate::api::slim::PodView;
use crate::api::{IPFence, IPPool, NetworkAttachmentDefinition};
use crate::controller::watch::POD_PAGE;
use crate::index::Index;
use crate::index::kinds::seen;
use crate::reclaim::{Decision, ReclaimConfig};

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
    /// `release` (direct evidence) or `candidate` (released after the grace period).
    pub decision: String,
    /// Reason code.
    pub reason: String,
    /// Age of the live pod holding the podref (none when no pod of that name exists).
    pub pod_age_seconds: Option<i64>,
    /// For a fenced address: the node it waits for, why, and how long.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<ScanFence>,
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
    let pods = Api::<PodView>::all(client.clone());
    let mut state = Index::default();
    let now = std::time::Instant::now();
    let mut created: BTreeMap<String, i64> = BTreeMap::new();
    let wall = jiff::Timestamp::now();
    // Paged: a page of full pods is read, stripped and dropped before the next.
    for_each_listed(
        POD_PAGE,
        |page| {
            let pods = pods.clone();
            async move { pods.list(&page).await }
        },
        |p| {
            let (Some(ns), Some(name), Some(uid)) =
                (&p.metadata.namespace, &p.metadata.name, &p.metadata.uid)
            else {
                return;
            };
            let podref = format!("{ns}/{name}");
            if let Some(t) = &p.metadata.creation_timestamp {
                created.insert(podref.clone(), wall.duration_since(t.0).as_secs());
            }
            state.upsert_pod(&podref, uid, seen(&p), now);
        },
    )
    .await
    .context("list pods")?;
    let pools = Api::<Lenient<IPPool>>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .with_context(|| format!("list IPPools in {namespace}"))?;
    for pool in &pools {
        match pool {
            Lenient::Valid(pool) => state.upsert_pool(pool),
            Lenient::Invalid { metadata, error } => {
                tracing::warn!(pool = ?metadata.name, %error, "IPPool skipped: it does not fit the schema")
            }
        }
    }
    state.set_pools_listed();
    // Fence records: without them fenced entries show as unrecorded, pending ones as leaks.
    match Api::<Lenient<IPFence>>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
    {
        Ok(fences) => {
            for f in fences.iter().filter_map(Lenient::valid) {
                let name = f.metadata.name.clone().unwrap_or_default();
                match crate::ipam::fence::fence_record(&f.spec) {
                    Ok(record) => state.upsert_fence_object(
                        &f.spec.pool,
                        &f.spec.key,
                        crate::index::FenceObject {
                            name,
                            uid: f.metadata.uid.clone().unwrap_or_default(),
                            sandbox: f.spec.sandbox.clone(),
                            record,
                            evidence: None,
                        },
                    ),
                    Err(error) => tracing::warn!(fence = %name, %error, "IPFence skipped"),
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot list IPFences: fenced addresses are not shown")
        }
    }
    match Api::<Lenient<NetworkAttachmentDefinition>>::all(client)
        .list(&ListParams::default())
        .await
    {
        Ok(nads) => nads
            .iter()
            .filter_map(Lenient::valid)
            .for_each(|n| state.upsert_nad(n)),
        // Without NADs the rules fall back to interface names: still a useful report.
        Err(e) => tracing::warn!(error = %e, "cannot list NetworkAttachmentDefinitions"),
    }
    let mut rows: Vec<ScanRow> = state
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
            })
        })
        .collect();
    // Fenced addresses: a deleted pod's, kept until its node is trusted again.
    rows.extend(state.fenced().into_iter().map(|(pool, f)| ScanRow {
        pool,
        ip: f.entry.ip.to_string(),
        pod_age_seconds: None,
        podref: f.record.podref,
        sandbox: f.entry.id,
        decision: "fenced".into(),
        reason: crate::reclaim::Reason::PodDeleted.as_str().into(),
        fence: Some(ScanFence {
            node: f.record.node,
            why: f.record.why,
            age_seconds: wall.duration_since(f.record.since).as_secs(),
        }),
    }));
    rows.sort_by(|a, b| (&a.pool, &a.ip).cmp(&(&b.pool, &b.ip)));
    Ok(rows)
}

/// Renders rows as an aligned table.
pub fn table(rows: &[ScanRow]) -> String {
    let header = [
        "POOL",
        "IP",
        "PODREF",
        "SANDBOX",
        "DECISION",
        "REASON",
        "POD AGE",
        "FENCED ON",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|r| {
            [
                r.pool.clone(),
                r.ip.clone(),
                r.podref.clone(),
                r.sandbox.clone(),
                r.decision.clone(),
                r.reason.clone(),
                r.pod_age_seconds.map_or("-".into(), |s| format!("{s}s")),
                r.fence.as_ref().map_or("-".into(), |f| {
                    format!("{} for {}s ({})", f.node, f.age_seconds, f.why)
                }),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cols: &[String]| {
        let parts: Vec<String> = cols
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(&header.map(String::from));
    for row in &cells {
        line(row);
    }
    out
}
