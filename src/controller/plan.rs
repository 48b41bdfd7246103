//! What a deletion writes, from its judgement: the releases it calls for, and which of them
//! (and of the allocations judged kept) must be fences because the deleted pod's node is not
//! trusted. Pure: the worker in `deletion` calls it under one read of the index and the node
//! view.

use std::time::Instant;

use super::fence::record_for;
use crate::index::{Index, NodeIndex, Tombstone};
use crate::release::{EntryWrite, ReleaseRequest};
use crate::rules::{Decision, Judged, Reason};

/// The releases the judgement calls for (deleted at `deleted_at`, for the latency metric).
pub(crate) fn releases_of(judged: &[Judged], deleted_at: Option<Instant>) -> Vec<ReleaseRequest> {
    judged
        .iter()
        .filter_map(|j| match j.decision {
            Decision::Release(reason) => Some(ReleaseRequest {
                judged: j.clone(),
                reason,
                deleted_at,
                cooldown: None,
                write: Default::default(),
            }),
            _ => None,
        })
        .collect()
}

/// Why the deletion `t` is fenced: its node was not trusted when the deletion was seen, or is
/// not now; never when its Node is gone or tainted out-of-service now (declared dead).
fn fence_reason(t: &Tombstone, view: &NodeIndex) -> Option<String> {
    let node = t.node.as_deref()?;
    let now = view.node(node)?;
    if now.out_of_service {
        return None;
    }
    // A tombstone the pod watch has not judged (made by a fresh read) is judged now, by the
    // same rules.
    let judged = if t.node_judged {
        t.distrust.clone()
    } else {
        view.distrust_deleted(t)
    };
    judged.or_else(|| view.distrust_pod(Some(node), t.grace_seconds))
}

/// The fences a deletion calls for, whatever the cache holds now. The node of a deleted pod
/// is known whenever its deletion was observed (a Delete event, a re-list's diff, a pod
/// replaced under its name), and the fence follows from that node: a release of a pod deleted
/// from a node that is not Ready becomes a fence; so does an allocation that pod held (same
/// pool, key and sandbox id as when its deletion was seen, its address listed by it) that is
/// judged kept only because a replacement of the same name is known without network-status
/// yet. Left unfenced, that entry would later be released as `IPNotOnPod`, its node still down.
pub(crate) fn plan_fences(
    st: &Index,
    view: &NodeIndex,
    podref: &str,
    judged: &[Judged],
    releases: &mut Vec<ReleaseRequest>,
) {
    // A static pod's mirror deleted: the static pod runs on, so its entries are fenced when
    // its node is not trusted and kept otherwise (the node's CNI DEL and the sweep remain).
    let mut mirrors = Vec::new();
    for r in releases.iter_mut() {
        if r.reason != Reason::PodDeleted || r.judged.pod.uid.is_empty() {
            continue;
        }
        let Some(t) = st.pods().deleted_pod(podref, &r.judged.pod.uid) else {
            continue;
        };
        if let Some(why) = fence_reason(t, view) {
            let node = t.node.as_deref().unwrap_or_default().to_owned();
            r.write = EntryWrite::Fence(record_for(&r.judged, node, why, t.grace_seconds));
        } else if t.mirror {
            mirrors.push((r.judged.pool.clone(), r.judged.entry.key.clone()));
        }
    }
    releases.retain(|r| !mirrors.contains(&(r.judged.pool.clone(), r.judged.entry.key.clone())));
    let live = st.pods().live(podref);
    let live_lists = |ip| {
        live.and_then(|l| l.networks.as_deref())
            .is_some_and(|n| n.iter().any(|a| a.ips.contains(&ip)))
    };
    for t in st.pods().tombstones(podref) {
        let Some(why) = fence_reason(t, view) else {
            continue;
        };
        if t.uid.is_empty() {
            continue;
        }
        for j in judged {
            let e = &j.entry;
            let planned = releases
                .iter()
                .any(|r| (&r.judged.pool, &r.judged.entry.key) == (&j.pool, &e.key));
            let its = t
                .entries
                .iter()
                .any(|h| (&*h.pool, &*h.key, &*h.id) == (&*j.pool, &*e.key, &*e.id));
            let listed = match t.networks.as_deref() {
                Some(n) => n.iter().any(|a| a.ips.contains(&e.ip)),
                // Without its network-status, only while no pod of the name lives.
                None => live.is_none(),
            };
            if planned || !its || !listed || live_lists(e.ip) {
                continue;
            }
            let mut fenced = j.clone();
            fenced.decision = Decision::Release(Reason::PodDeleted);
            fenced.pod.uid = t.uid.clone();
            let node = t.node.as_deref().unwrap_or_default().to_owned();
            let record = record_for(&fenced, node, why.clone(), t.grace_seconds);
            releases.push(ReleaseRequest {
                judged: fenced,
                reason: Reason::PodDeleted,
                deleted_at: Some(t.seen_at),
                cooldown: None,
                write: EntryWrite::Fence(record),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::NodeCondition;

    use super::*;
    use crate::api::slim::NodeReadyView;
    use crate::api::{IPAllocation, IPPool, IPPoolSpec};
    use crate::index::PodSeen;
    use crate::rules::ReclaimConfig;

    const WEB: &str = "ns/web-0";

    fn status(ip: &str) -> BTreeMap<String, String> {
        let s = format!(r#"[{{"name":"ns/net","interface":"net1","ips":["{ip}"]}}]"#);
        BTreeMap::from([(crate::ipam::NETWORK_STATUS_ANNOTATION.to_string(), s)])
    }

    fn pool(id: &str) -> IPPool {
        let entry = IPAllocation {
            id: id.into(),
            podref: WEB.into(),
            ifname: Some("net1".into()),
            ipamclaimref: None,
        };
        IPPool::new(
            "192.0.2.0-24",
            IPPoolSpec {
                range: "192.0.2.0/24".into(),
                allocations: BTreeMap::from([("10".to_string(), entry)]),
            },
        )
    }

    fn view(ready: &str) -> NodeIndex {
        let mut n = NodeReadyView::default();
        n.metadata.name = Some("node-a".into());
        n.ready = Some(NodeCondition {
            type_: "Ready".into(),
            status: ready.into(),
            reason: Some("NodeStatusUnknown".into()),
            ..Default::default()
        });
        let mut v = NodeIndex::default();
        v.upsert(&n, Instant::now());
        v
    }

    /// web-0 (old-uid, 192.0.2.10, sandbox sb-old) on node-a was deleted; then a replacement
    /// web-0 (new-uid) is known, with the network-status `replacement` (None: not yet).
    fn replaced(replacement: Option<&str>) -> Index {
        let mut st = Index::default();
        st.upsert_pool(&pool("sb-old"));
        delete_and_replace(&mut st, replacement);
        st
    }

    /// web-0 (old-uid, 192.0.2.10) on node-a deleted, and a replacement web-0 (new-uid) known
    /// on node-b with the network-status `replacement` (None: not yet).
    fn delete_and_replace(st: &mut Index, replacement: Option<&str>) {
        delete_in_phase_and_replace(st, false, replacement);
    }

    /// [`delete_and_replace`], web-0 deleted in phase Failed (`stopped`: its kubelet stopped
    /// it) or Running.
    fn delete_in_phase_and_replace(st: &mut Index, stopped: bool, replacement: Option<&str>) {
        let old = status("192.0.2.10");
        let on_a = |annotations| PodSeen {
            annotations,
            node: Some("node-a"),
            terminal: false,
            mirror: false,
            grace_seconds: None,
        };
        let now = Instant::now();
        st.upsert_pod(WEB, "old-uid", on_a(Some(&old)), now);
        let last = PodSeen {
            terminal: stopped,
            ..on_a(Some(&old))
        };
        st.delete_pod(WEB, "old-uid", last, now);
        let new = replacement.map(status);
        let seen = PodSeen {
            annotations: new.as_ref(),
            node: Some("node-b"),
            terminal: false,
            mirror: false,
            grace_seconds: None,
        };
        st.upsert_pod(WEB, "new-uid", seen, now);
    }

    fn plan(st: &Index, v: &NodeIndex) -> Vec<(String, String, bool)> {
        let judged = st.judge_podref(WEB, &ReclaimConfig::default());
        let mut releases = releases_of(&judged, None);
        plan_fences(st, v, WEB, &judged, &mut releases);
        releases
            .into_iter()
            .map(|r| {
                let fence = matches!(r.write, EntryWrite::Fence(_));
                (r.judged.entry.key.to_string(), r.judged.pod.uid, fence)
            })
            .collect()
    }

    #[test]
    fn the_deleted_pods_node_decides_the_fence_even_when_the_replacement_is_known_first() {
        // The replacement has no network-status yet: the cache alone judges the entry kept
        // (the allocation may be racing the annotation), and it used to be left unfenced.
        let st = replaced(None);
        let judged = st.judge_podref(WEB, &ReclaimConfig::default());
        assert!(
            matches!(judged[0].decision, Decision::Keep(_)),
            "{judged:?}"
        );
        assert_eq!(
            plan(&st, &view("Unknown")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
        // On a Ready node (listed) nothing is fenced once its kubelet stopped the pod, and a
        // kept entry stays kept; deleted Running, its kubelet is only now stopping it: fenced.
        let mut ready = view("True");
        ready.set_listed();
        let mut stopped = Index::default();
        stopped.upsert_pool(&pool("sb-old"));
        delete_in_phase_and_replace(&mut stopped, true, None);
        assert_eq!(plan(&stopped, &ready), []);
        assert_eq!(
            plan(&st, &ready),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
    }

    #[test]
    fn a_replacement_that_lists_the_address_or_reused_the_entry_is_never_fenced() {
        // It lists the address (whereabouts gave it back by podref): it is the replacement's.
        assert_eq!(plan(&replaced(Some("192.0.2.10")), &view("Unknown")), []);
        // The entry's sandbox changed since the deletion was seen (reused by the replacement).
        let mut st = replaced(None);
        st.upsert_pool(&pool("sb-new"));
        assert_eq!(plan(&st, &view("Unknown")), []);
    }

    #[test]
    fn the_old_address_allocated_again_for_the_replacement_is_not_the_tombstones() {
        // The deleted pod's entry went (its CNI DEL), and the replacement's new sandbox got
        // the address again; its network-status still shows its first sandbox's address.
        let mut st = replaced(Some("192.0.2.20"));
        st.upsert_pool(&pool("sb-new"));
        let judged = st.judge_podref(WEB, &ReclaimConfig::default());
        assert_eq!(
            judged[0].decision,
            Decision::Candidate(Reason::IPNotOnPod),
            "{judged:?}"
        );
        assert_eq!(plan(&st, &view("Unknown")), []);
    }

    #[test]
    fn an_entry_the_pools_had_not_shown_when_the_deletion_was_seen_is_still_the_deleted_pods() {
        // The pool watch is behind: the deletion is seen before the entry, its slot unknown.
        let mut st = Index::default();
        delete_and_replace(&mut st, Some("192.0.2.20"));
        st.upsert_pool(&pool("sb-old"));
        assert_eq!(
            plan(&st, &view("Unknown")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
    }

    #[test]
    fn a_replacement_listing_another_address_makes_the_old_one_a_fence() {
        assert_eq!(
            plan(&replaced(Some("192.0.2.20")), &view("Unknown")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
    }

    /// web-0 (192.0.2.10) on node-a deleted in a final phase that is `terminal` or not, its
    /// node judged as the pod watch does, by `view` (listed).
    fn deleted_in_phase(terminal: bool, view: &mut NodeIndex) -> Index {
        let mut st = Index::default();
        st.upsert_pool(&pool("sb-old"));
        let old = status("192.0.2.10");
        let seen = PodSeen {
            annotations: Some(&old),
            node: Some("node-a"),
            terminal,
            mirror: false,
            grace_seconds: Some(600),
        };
        let now = Instant::now();
        st.upsert_pod(
            WEB,
            "old-uid",
            PodSeen {
                terminal: false,
                ..seen
            },
            now,
        );
        st.delete_pod(WEB, "old-uid", seen, now);
        view.set_listed();
        st.judge_deleted_nodes(WEB, |t| view.distrust_deleted(t));
        st
    }

    #[test]
    fn a_pod_deleted_on_a_ready_node_before_its_kubelet_stopped_it_is_fenced() {
        let mut v = view("True");
        // Forced: deleted Running, its kubelet stops it only now, for up to 600 s.
        let st = deleted_in_phase(false, &mut v);
        assert_eq!(
            plan(&st, &v),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
        // Deleted by its kubelet once stopped (Failed first): released.
        let st = deleted_in_phase(true, &mut v);
        assert_eq!(
            plan(&st, &v),
            [("10".to_string(), "old-uid".to_string(), false)]
        );
    }

    #[test]
    fn a_deletion_seen_while_its_node_was_down_is_fenced_even_if_the_node_is_back_when_judged() {
        let mut st = replaced(Some("192.0.2.20"));
        let down = view("Unknown");
        st.judge_deleted_nodes(WEB, |t| down.distrust(t.node.as_deref()));
        // Judged later: the node is Ready again (its settle has not passed).
        assert_eq!(
            plan(&st, &view("True")),
            [("10".to_string(), "old-uid".to_string(), true)]
        );
        // Declared dead since: released, not fenced.
        let mut gone = view("Unknown");
        let mut tainted = NodeReadyView::default();
        tainted.metadata.name = Some("node-a".into());
        tainted.out_of_service = true;
        gone.upsert(&tainted, Instant::now());
        assert_eq!(
            plan(&st, &gone),
            [("10".to_string(), "old-uid".to_string(), false)]
        );
    }
}
