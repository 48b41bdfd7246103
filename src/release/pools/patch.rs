//! The one builder of the JSON patches the writer sends to pools: each entry pinned by `test`s
//! on its `id` and `podref`, then removed or fenced; annotations removed pinned by their value.
//! Pure.

use serde_json::{Value, json};

use crate::ipam::cooldown::{cooldown_id, cooling_podref};
use crate::ipam::fence::fenced_podref;
use crate::ipam::own_write::OWN_WRITE_ANNOTATION;

use crate::release::types::{EntryWrite, ReleaseRequest};

/// A JSON pointer token (RFC 6901).
fn pointer_token(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// The path of the annotation `name`.
fn annotation_path(name: &str) -> String {
    format!("/metadata/annotations/{}", pointer_token(name))
}

/// The JSON patch of one batch: each entry pinned by `test`s on its `id` and `podref`, then
/// removed or fenced (its podref rewritten; the record is an object written before). A patch that
/// removes or rewrites a marked entry (a lifted fence, an ended cooldown) sets the pool's
/// [`OWN_WRITE_ANNOTATION`] to `signature` (see `ipam::own_write`).
pub fn entries_patch(batch: &[&ReleaseRequest], has_annotations: bool, signature: &str) -> Value {
    let mut ops = Vec::with_capacity(batch.len() * 4 + 2);
    for r in batch {
        let e = &r.judged.entry;
        let path = format!("/spec/allocations/{}", pointer_token(&e.key));
        ops.push(json!({"op": "test", "path": format!("{path}/id"), "value": e.id}));
        ops.push(json!({"op": "test", "path": format!("{path}/podref"), "value": e.podref}));
        let cool = |ops: &mut Vec<Value>, until| {
            ops.push(
                json!({"op": "replace", "path": format!("{path}/id"), "value": cooldown_id(until)}),
            );
            ops.push(json!({"op": "replace", "path": format!("{path}/podref"), "value": cooling_podref(r.podref())}));
        };
        match (&r.write, r.cooldown) {
            (EntryWrite::Remove, Some(until)) => cool(&mut ops, until),
            (EntryWrite::Remove | EntryWrite::EndCooldown, _) => {
                ops.push(json!({"op": "remove", "path": path}))
            }
            (EntryWrite::Fence(record), _) => {
                ops.push(json!({"op": "replace", "path": format!("{path}/podref"), "value": fenced_podref(&record.podref)}));
            }
            (EntryWrite::Unfence(..), Some(until)) => cool(&mut ops, until),
            (EntryWrite::Unfence(..), None) => ops.push(json!({"op": "remove", "path": path})),
        }
    }
    if reads_annotations(batch) {
        sign(&mut ops, has_annotations, signature);
    }
    Value::Array(ops)
}

/// Whether the patch of `batch` depends on the pool having an annotations map: it removes or
/// rewrites a marked entry (signed).
pub fn reads_annotations(batch: &[&ReleaseRequest]) -> bool {
    batch
        .iter()
        .any(|r| matches!(r.write, EntryWrite::Unfence(..) | EntryWrite::EndCooldown))
}

/// Sets [`OWN_WRITE_ANNOTATION`] to `signature`. A pool with no annotations gets the map, pinned
/// by a `test` that it is still absent (the apiserver's JSON patch takes a `null` test as
/// "missing", as whereabouts' own patches rely on): a map created meanwhile is never replaced.
fn sign(ops: &mut Vec<Value>, has_annotations: bool, signature: &str) {
    if has_annotations {
        let path = annotation_path(OWN_WRITE_ANNOTATION);
        ops.push(json!({"op": "add", "path": path, "value": signature}));
    } else {
        ops.push(json!({"op": "test", "path": "/metadata/annotations", "value": null}));
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {OWN_WRITE_ANNOTATION: signature}}));
    }
}

/// The JSON patch removing annotations `(name, value)`, each pinned by a `test` of its
/// value (one rewritten meanwhile is not removed).
pub fn annotations_patch(annotations: &[(String, String)]) -> Value {
    let mut ops = Vec::with_capacity(annotations.len() * 2);
    for (name, value) in annotations {
        let path = annotation_path(name);
        ops.push(json!({"op": "test", "path": path, "value": value}));
        ops.push(json!({"op": "remove", "path": path}));
    }
    Value::Array(ops)
}

/// A patch built here as the typed patch kube sends.
pub fn typed(patch: Value) -> Result<json_patch::Patch, serde_json::Error> {
    serde_json::from_value(patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::fixtures::{fence_object, record, request};

    #[test]
    fn a_fence_pins_the_entry_and_rewrites_its_podref_and_nothing_else() {
        let fence = request("5", "ns/web-0", EntryWrite::Fence(record()));
        // The record is an object written before: the pool itself does not grow.
        for has_annotations in [false, true] {
            assert_eq!(
                entries_patch(&[&fence], has_annotations, "sig"),
                json!([
                    {"op": "test", "path": "/spec/allocations/5/id", "value": "sb"},
                    {"op": "test", "path": "/spec/allocations/5/podref", "value": "ns/web-0"},
                    {"op": "replace", "path": "/spec/allocations/5/podref", "value": "ns/web-0:fenced"},
                ])
            );
        }
    }

    #[test]
    fn an_unfence_removes_the_pinned_marked_entry_and_signs_the_write() {
        let lift = request(
            "5",
            "ns/web-0:fenced",
            EntryWrite::Unfence(record(), fence_object()),
        );
        let entry_ops = json!([
            {"op": "test", "path": "/spec/allocations/5/id", "value": "sb"},
            {"op": "test", "path": "/spec/allocations/5/podref", "value": "ns/web-0:fenced"},
            {"op": "remove", "path": "/spec/allocations/5"},
        ]);
        let signed = json!({"op": "add", "path": "/metadata/annotations/ipreclaim.io~1marked-write", "value": "sig"});
        let mut ops = entry_ops.as_array().unwrap().clone();
        ops.push(signed);
        assert_eq!(entries_patch(&[&lift], true, "sig"), json!(ops));
    }

    #[test]
    fn a_cooldown_rewrites_the_pinned_entry_with_its_end_and_a_lifted_fence_too() {
        let until: jiff::Timestamp = "2026-11-25T10:00:31Z".parse().unwrap();
        let mut release = request("5", "ns/web-0", EntryWrite::Remove);
        release.cooldown = Some(until);
        let cooled = json!([
            {"op": "test", "path": "/spec/allocations/5/id", "value": "sb"},
            {"op": "test", "path": "/spec/allocations/5/podref", "value": "ns/web-0"},
            {"op": "replace", "path": "/spec/allocations/5/id", "value": "ipreclaim-cooldown:2026-11-25T10:00:31Z"},
            {"op": "replace", "path": "/spec/allocations/5/podref", "value": "ns/web-0:cooldown"},
        ]);
        assert_eq!(
            entries_patch(&[&release], false, "sig"),
            cooled,
            "a live entry's release is not signed"
        );
        // A lifted fence cools under the pod's own name, not the fenced one.
        let mut lift = request(
            "5",
            "ns/web-0:fenced",
            EntryWrite::Unfence(record(), fence_object()),
        );
        lift.cooldown = Some(until);
        let ops = entries_patch(&[&lift], true, "sig");
        assert_eq!(ops[3]["value"], "ns/web-0:cooldown");
        assert_eq!(
            ops[4]["path"],
            "/metadata/annotations/ipreclaim.io~1marked-write"
        );
        // Its end removes it, pinned by the marker.
        let mut end = request("5", "ns/web-0:cooldown", EntryWrite::EndCooldown);
        end.judged.entry.id = "ipreclaim-cooldown:2026-11-25T10:00:31Z".into();
        assert_eq!(
            entries_patch(&[&end], false, "sig"),
            json!([
                {"op": "test", "path": "/spec/allocations/5/id", "value": "ipreclaim-cooldown:2026-11-25T10:00:31Z"},
                {"op": "test", "path": "/spec/allocations/5/podref", "value": "ns/web-0:cooldown"},
                {"op": "remove", "path": "/spec/allocations/5"},
                // A pool without annotations gets the map, pinned as absent.
                {"op": "test", "path": "/metadata/annotations", "value": null},
                {"op": "add", "path": "/metadata/annotations", "value": {"ipreclaim.io/marked-write": "sig"}},
            ])
        );
    }

    #[test]
    fn annotations_are_removed_only_as_they_were_read() {
        let patch = annotations_patch(&[("ipreclaim.io/approve-hold".into(), "v5".into())]);
        assert_eq!(
            patch,
            json!([
                {"op": "test", "path": "/metadata/annotations/ipreclaim.io~1approve-hold", "value": "v5"},
                {"op": "remove", "path": "/metadata/annotations/ipreclaim.io~1approve-hold"},
            ])
        );
        assert!(typed(patch).is_ok());
        assert_eq!(pointer_token("a/b~c"), "a~1b~0c");
    }
}
