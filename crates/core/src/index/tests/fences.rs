//! Fence records joined with their entries: fenced, pending, left over, unrecorded.

use super::*;
use crate::api::ObjectId;
use crate::api::SandboxReport;
use crate::index::{InvalidKey, UnrecordedMark};
use crate::rules::KeepReason;

#[test]
fn fence_records_and_entries_are_joined_whichever_comes_first() {
    for records_first in [true, false] {
        let mut ix = Index::default();
        let listed = pool(&[
            ("5", "sb", "ns/web-0:fenced"),
            // Record written, rewrite not yet (a crash between the two writes).
            ("6", "sb-6", "ns/db-0"),
            ("7", "sb-7", "ns/other-0"),
        ]);
        let add_records = |ix: &mut Index| {
            ix.upsert_fence_object("p", "5", object("p-5", "sb", "ns/web-0"));
            ix.upsert_fence_object("p", "6", object("p-6", "sb-6", "ns/db-0"));
            // Its entry is another allocation now: left over.
            ix.upsert_fence_object("p", "7", object("p-7", "sb-old", "ns/gone-0"));
            // Its entry is gone.
            ix.upsert_fence_object("p", "8", object("p-8", "sb-8", "ns/gone-1"));
        };
        if records_first {
            add_records(&mut ix);
            ix.upsert_pool(&listed);
        } else {
            ix.upsert_pool(&listed);
            add_records(&mut ix);
        }
        ix.set_pools_listed();
        let fenced = ix.fenced();
        assert_eq!(fenced.len(), 1);
        assert_eq!(fenced[0].record.podref, "ns/web-0");
        assert_eq!(
            fenced[0].object,
            ObjectId {
                name: "p-5".into(),
                uid: "uid-p-5".into()
            }
        );
        let pending: Vec<String> = ix
            .pending_fences()
            .into_iter()
            .map(|p| p.entry.key.to_string())
            .collect();
        assert_eq!(pending, ["6"]);
        let judged = ix.judge_all(&ReclaimConfig::default());
        let decision = |key: &str| judged.iter().find(|j| j.entry.key == key).unwrap().decision;
        assert_eq!(
            decision("6"),
            Decision::Keep(KeepReason::FencePending),
            "a pending fence's entry is never the sweep's"
        );
        assert!(matches!(decision("7"), Decision::Candidate(_)));
        let mut stale: Vec<String> = ix
            .stale_fence_objects()
            .into_iter()
            .map(|s| s.name)
            .collect();
        stale.sort();
        assert_eq!(stale, ["p-7", "p-8"]);
        assert!(ix.unrecorded_marks().is_empty());
        assert!(ix.fenced_podrefs().contains("ns/db-0"));
    }
}

#[test]
fn records_of_a_pool_that_cannot_be_read_or_is_not_listed_yet_are_never_left_over() {
    let mut ix = Index::default();
    ix.upsert_fence_object("p", "5", object("p-5", "sb", "ns/web-0"));
    assert!(ix.stale_fence_objects().is_empty(), "pools not listed yet");
    ix.set_invalid(
        InvalidKey {
            kind: "IPPool".into(),
            namespace: "ns".into(),
            name: "p".into(),
        },
        "uid".into(),
        "bad".into(),
    );
    ix.set_pools_listed();
    assert!(ix.stale_fence_objects().is_empty(), "unreadable pool");
    ix.clear_invalid(&InvalidKey {
        kind: "IPPool".into(),
        namespace: "ns".into(),
        name: "p".into(),
    });
    assert_eq!(ix.stale_fence_objects().len(), 1, "a deleted pool's record");
}

#[test]
fn a_record_of_an_earlier_fence_of_the_same_address_and_name_never_speaks_for_a_new_one() {
    // web-0 fenced (sandbox sb-1), lifted, recreated, given the same address, fenced again
    // (sb-2) while the watch still holds the first record and its agent's report.
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("5", "sb-2", "ns/web-0:fenced")]));
    let mut old = object("p-5", "sb-1", "ns/web-0");
    old.evidence.sandboxes_gone = Some(SandboxReport {
        node: "n".into(),
        pod_uid: "uid".into(),
        fence_uid: "uid-p-5".into(),
        observed_at: "2026-11-23T10:00:00Z".into(),
    });
    ix.upsert_fence_object("p", "5", old);
    ix.set_pools_listed();
    assert!(
        ix.fenced().is_empty(),
        "the old record lifted the new fence"
    );
    assert_eq!(
        ix.stale_fence_objects().len(),
        1,
        "the old record is left over"
    );
    assert!(ix.judge_all(&ReclaimConfig::default()).is_empty());
}

#[test]
fn a_fenced_entry_without_a_record_is_reported_and_left_alone() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("5", "sb", "ns/web-0:fenced")]));
    assert!(ix.fenced().is_empty());
    assert!(ix.judge_all(&ReclaimConfig::default()).is_empty());
    assert_eq!(
        ix.unrecorded_marks(),
        [UnrecordedMark {
            pool: "p".to_string(),
            key: "5".to_string(),
            podref: "ns/web-0:fenced".to_string()
        }]
    );
}

#[test]
fn a_fenced_entry_is_kept_out_of_judgement_and_a_pool_annotation_records_no_fence() {
    let mut annotated = pool(&[
        ("5", "sb", "ns/web-0:fenced"),
        ("6", "sb-6", "ns/db-0"),
        ("7", "sb-7", "ns/app-0:fenced"),
    ]);
    // Shaped like a record, on the pool: anyone who may patch pools can write it. Only an
    // IPFence records a fence; entry 7 stays an unrecorded mark.
    annotated.metadata.annotations = Some(BTreeMap::from([(
        "ipreclaim.io/fence-7".to_string(),
        serde_json::to_string(&record("ns/app-0")).unwrap(),
    )]));
    let mut ix = Index::default();
    ix.upsert_pool(&annotated);
    ix.upsert_fence_object("p", "5", object("p-5", "sb", "ns/web-0"));
    let fenced = ix.fenced();
    assert_eq!(fenced.len(), 1);
    assert_eq!(fenced[0].record.podref, "ns/web-0");
    assert_eq!(
        ix.judge_all(&ReclaimConfig::default())
            .iter()
            .map(|j| j.entry.podref.as_str())
            .collect::<Vec<_>>(),
        ["ns/db-0"],
        "the fenced entries are the fence's, not the sweep's"
    );
    assert_eq!(
        ix.unrecorded_marks()
            .iter()
            .map(|m| m.key.as_str())
            .collect::<Vec<_>>(),
        ["7"]
    );
    assert!(
        ix.pools()
            .allocated_podrefs()
            .iter()
            .all(|p| !p.ends_with(":fenced"))
    );
}

#[test]
fn a_late_answer_to_a_fence_write_keeps_the_node_agents_report_on_that_object() {
    let mut ix = Index::default();
    ix.upsert_pool(&pool(&[("5", "sb", "ns/web-0:fenced")]));
    ix.set_pools_listed();
    // The watch brought the object with the agent's "still present" before the writer's
    // answer came back.
    let mut watched = object("p-5", "sb", "ns/web-0");
    watched.evidence.sandboxes_present = Some(SandboxReport {
        node: "node-a".into(),
        pod_uid: "uid".into(),
        fence_uid: "uid-p-5".into(),
        observed_at: "2026-11-28T00:00:00Z".into(),
    });
    ix.upsert_fence_object("p", "5", watched.clone());
    let id = |uid: &str| crate::api::ObjectId {
        name: "p-5".into(),
        uid: uid.into(),
    };
    ix.fence_written("p", "5", "sb", &watched.record, id("uid-p-5"));
    let fenced = ix.fenced();
    assert_eq!(fenced.len(), 1);
    assert_eq!(fenced[0].evidence, watched.evidence, "the report is kept");
    // An answer about another object of the name (recreated since) brings no report.
    ix.fence_written("p", "5", "sb", &watched.record, id("uid-other"));
    assert_eq!(ix.fenced()[0].evidence, Default::default());
}
