//! A second cleaner in the cluster (whereabouts' ip-reconciler, the telekom fork's operator,
//! OpenShift's): every second each replica takes the fenced and cooling entries its pool watch
//! saw go (`index::other_writers`); the leader judges each (`rules::other_writers`) and reports
//! another writer's with a Warning `MarkedEntryRemovedByOtherWriter` on the IPPool and on the
//! entry's IPFence record, a log line and `ipreclaim_marked_entries_removed_by_others_total`.
//! A standby judges the same and keeps only what still waits (the leader reports the rest): a
//! removal whose wait spans a change of leader is reported by the new one (by both, at worst),
//! never by neither.

use std::time::{Duration, Instant};

use crate::index::{GoneFence, MarkedGone, MarkedKind};
use crate::release::reports::events::MARKED_ENTRY_REMOVED;
use crate::rules::other_writers::{Gone, Kubelet, Verdict, judge};

use super::report::reference;

/// Reports the marked entries other writers remove.
pub struct OtherWriters {
    pub(crate) ctx: super::ctx::Ctx,
    /// `--other-writer-wait`: how long a fenced entry's node must stay silent after the removal.
    pub(crate) wait: Duration,
    /// The whereabouts namespace (the pools' and fence records').
    pub(crate) namespace: String,
    /// Removals waiting for their node to speak, or for the wait to pass.
    pub(crate) waiting: Vec<(MarkedGone, Gone)>,
}

impl OtherWriters {
    /// What the fence's node `node` says of its kubelet now (`None`: no fence record).
    fn kubelet(&self, node: Option<&str>) -> Kubelet {
        match (&self.ctx.nodes, node) {
            (Some(view), Some(node)) => Kubelet::of(view.read().expect("node lock").node(node)),
            _ => Kubelet::Unknown,
        }
    }

    /// One pass: takes what the pool watch saw go and judges it; on the leader, reports another
    /// writer's.
    pub async fn pass(&mut self, leader: bool) {
        let now = Instant::now();
        let (taken, dropped) = self
            .ctx
            .index
            .write()
            .expect("index lock")
            .take_marked_gone();
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "too many marked entries went at once: some were not judged"
            );
        }
        for g in taken {
            let node = g.fence.as_ref().map(|f| f.node.as_str());
            let gone = Gone {
                ours: g.ours,
                fenced: g.kind == MarkedKind::Fenced,
                recorded: g.fence.is_some(),
                then: self.kubelet(node),
                seen: now,
            };
            self.waiting.push((g, gone));
        }
        let mut still = Vec::new();
        for (g, gone) in std::mem::take(&mut self.waiting) {
            let node = g.fence.as_ref().map(|f| f.node.as_str());
            match judge(&gone, self.kubelet(node), now, self.wait) {
                Verdict::Wait => still.push((g, gone)),
                // The leader reports (and logs) it.
                _ if !leader => {}
                Verdict::Ours => {}
                Verdict::OtherWriter => self.report(&g).await,
                Verdict::CniDel => {
                    tracing::info!(pool = %g.pool, ip = %g.ip(), pod = g.pod(), node, "fenced entry removed as its node came back: taken for that node's own CNI DEL")
                }
                Verdict::Unjudged => {
                    tracing::info!(pool = %g.pool, ip = %g.ip(), pod = g.pod(), "fenced entry removed by a write not ipreclaim's; whose cannot be told (no fence record, or Nodes not watched)")
                }
            }
        }
        still.truncate(crate::index::other_writers::MAX_WAITING);
        self.waiting = still;
    }

    /// The Warning Events, the log line and the count of another writer's removal.
    async fn report(&self, g: &MarkedGone) {
        let kind = g.kind.as_str();
        let note = note(g);
        tracing::warn!(reason = MARKED_ENTRY_REMOVED, pool = %g.pool, ip = %g.ip(), pod = g.pod(), kind, "{note}");
        self.ctx
            .metrics
            .marked_removed_by_others
            .get_or_create(&kind.to_string().into())
            .inc();
        let events = &self.ctx.events;
        let pool = reference("IPPool", &self.namespace, &g.pool, &g.pool_uid);
        events
            .marked_entry_removed(&pool, g.ip(), note.clone())
            .await;
        if let Some(GoneFence { object, .. }) = &g.fence {
            let fence = reference("IPFence", &self.namespace, &object.name, &object.uid);
            events.marked_entry_removed(&fence, g.ip(), note).await;
        }
    }
}

/// Where to read how to turn the other cleaners off.
const MIGRATING: &str =
    "docs/operations/install.md, \"Migrating from whereabouts' ip-control-loop and ip-reconciler\"";

/// The Events' note on another writer's removal of `g`.
pub fn note(g: &MarkedGone) -> String {
    let (key, ip, pod) = (&g.entry.key, g.ip(), g.pod());
    let what = match &g.now {
        None => "removed".to_string(),
        Some(e) => format!("rewritten (now id {:?}, podref {:?})", e.id, e.podref),
    };
    let harm = match (&g.kind, &g.fence) {
        (MarkedKind::Fenced, Some(f)) => format!(
            "fenced entry {key} ({ip}, deleted pod {pod}) was {what} by a write that is not \
             ipreclaim's while node {} was not heard from: the address can go to a new pod while \
             the old one may still run there",
            f.node
        ),
        (MarkedKind::Fenced, None) => {
            format!(
                "fenced entry {key} ({ip}, deleted pod {pod}) was {what} by a write that is not ipreclaim's"
            )
        }
        (MarkedKind::Cooling, _) => format!(
            "cooling entry {key} ({ip}, released from pod {pod}) was {what} by a write that is \
             not ipreclaim's: the address returns to the pool before its cooldown ends"
        ),
    };
    format!(
        "{harm}. Another cleaner runs beside ipreclaim, most likely whereabouts' ip-reconciler \
         (Deployment whereabouts-reconciler, or CronJob ip-reconciler), the telekom/whereabouts \
         fork's operator, or OpenShift's network operator's reconciler; turn it off (see {MIGRATING})"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::GoneFence;
    use crate::ipam::PoolEntry;

    fn gone(kind: MarkedKind, podref: &str, now: Option<PoolEntry>) -> MarkedGone {
        MarkedGone {
            pool: "p".into(),
            pool_uid: "u".into(),
            entry: PoolEntry {
                key: "10".into(),
                offset: 10,
                ip: "192.0.2.10".parse().unwrap(),
                id: "sb".into(),
                podref: podref.into(),
                ifname: Some("net1".into()),
            },
            kind,
            now,
            ours: false,
            fence: (kind == MarkedKind::Fenced).then(|| GoneFence {
                node: "node-a".into(),
                object: crate::api::ObjectId {
                    name: "p-1".into(),
                    uid: "u-p-1".into(),
                },
            }),
        }
    }

    #[test]
    fn the_note_names_the_entry_the_harm_the_likely_cleaners_and_the_way_out() {
        let fenced = note(&gone(MarkedKind::Fenced, "ns/web-0:fenced", None));
        for want in [
            "fenced entry 10 (192.0.2.10, deleted pod ns/web-0) was removed",
            "node node-a was not heard from",
            "ip-reconciler",
            "telekom",
            "OpenShift",
            "Migrating",
        ] {
            assert!(fenced.contains(want), "{want:?} in {fenced}");
        }
        let mut rewritten = gone(MarkedKind::Cooling, "ns/web-0:cooldown", None);
        rewritten.now = Some(PoolEntry {
            podref: "ns/other".into(),
            ..rewritten.entry.clone()
        });
        let cooling = note(&rewritten);
        assert!(
            cooling.contains(
                "cooling entry 10 (192.0.2.10, released from pod ns/web-0) was rewritten"
            ),
            "{cooling}"
        );
        assert!(cooling.contains("\"ns/other\""), "{cooling}");
        assert!(
            cooling.len() < crate::release::reports::recorder::NOTE_MAX,
            "{}",
            cooling.len()
        );
    }
}
