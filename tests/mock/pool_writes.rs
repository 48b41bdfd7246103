//! The pool writer's retry, split and refusal branches (`patch_with_retry`): each batch of
//! releases of one pool goes out as one JSON patch; what the apiserver answers decides what
//! happens next. A real apiserver refuses a write only when the pool changed or an admission
//! policy says so: these are the answers it cannot give on demand.

use ipreclaim::ipam::cooldown::{cooldown_id, cooling_podref};
use ipreclaim::ipam::own_write::OWN_WRITE_ANNOTATION;
use ipreclaim::release::{EntryWrite, ReleaseError, ReleaseOutcome, ReleaseRequest};
use serde_json::json;

use super::apiserver::Call;
use super::fixtures::{POOL, Rig, release, request};
use super::pool::{Pool, patched_keys};

type Outcome = Result<ReleaseOutcome, ReleaseError>;

/// Releases `reqs` through the writer while `serve` answers every request it sends; returns
/// each request's outcome once the writer has answered them all.
async fn release_serving(
    rig: &mut Rig,
    reqs: Vec<ReleaseRequest>,
    mut serve: impl FnMut(Call),
) -> Vec<Outcome> {
    let writer = rig.writer.clone();
    let mut release = tokio::spawn(async move { writer.release(reqs).await });
    loop {
        tokio::select! {
            out = &mut release => return out.expect("the release task"),
            call = rig.apiserver.next() => serve(call),
        }
    }
}

fn is_patch(call: &Call) -> bool {
    call.what() == format!("PATCH ippools/{POOL}")
}

const RELEASED: Outcome = Ok(ReleaseOutcome::Released);

#[tokio::test]
async fn a_write_refused_with_its_pool_unchanged_is_split_until_only_its_entry_fails() {
    let mut rig = Rig::new();
    let mut pool = Pool::numbered(4);
    let out = release_serving(&mut rig, (1..=4).map(release).collect(), |call| {
        // An admission policy refusing any write of entry 3; the pool does not change.
        if is_patch(&call) && patched_keys(&call.body).contains(&"3".to_string()) {
            pool.patches += 1;
            return call.fail(422, "Invalid", "spec.allocations[3]: Too long");
        }
        pool.answer(call)
    })
    .await;
    let refused = Err(ReleaseError::Refused {
        pool: POOL.into(),
        message: "spec.allocations[3]: Too long".into(),
    });
    assert_eq!(out, [RELEASED, RELEASED, refused, RELEASED]);
    assert_eq!(pool.keys(), ["3"], "only the refused entry is left");
    // [1-4] refused, [3,4] refused, [4], [3] refused, [1,2]; a read after each refusal.
    assert_eq!((pool.patches, pool.reads), (5, 3));
    assert_eq!(rig.failures("refused"), 1);
}

#[tokio::test]
async fn a_write_refused_because_its_pool_changed_settles_what_is_not_ours_and_retries_the_rest() {
    let mut rig = Rig::new();
    let mut pool = Pool::numbered(4);
    let mut first = true;
    let out = release_serving(&mut rig, (1..=4).map(release).collect(), |call| {
        if is_patch(&call) && std::mem::take(&mut first) {
            // Before the first patch lands: the CNI's DEL of entry 2, and entry 4 freed and
            // handed to another pod. The patch's `test`s of 2 and 4 fail: 422.
            pool.free("2");
            pool.allocate("4", "sb-new", "ns/new");
        }
        pool.answer(call)
    })
    .await;
    let gone = Ok(ReleaseOutcome::AlreadyGone);
    let changed = Ok(ReleaseOutcome::Changed);
    assert_eq!(out, [RELEASED, gone, RELEASED, changed]);
    assert_eq!(pool.keys(), ["4"]);
    assert_eq!(pool.object["spec"]["allocations"]["4"]["id"], "sb-new");
    // The refused patch, one read, and 1 and 3 again together (not split apart).
    assert_eq!((pool.patches, pool.reads), (2, 1));
    assert_eq!(rig.failures("conflict") + rig.failures("refused"), 0);
}

#[tokio::test]
async fn a_pool_that_is_gone_leaves_nothing_to_release() {
    let mut rig = Rig::new();
    let mut calls = Vec::new();
    let out = release_serving(&mut rig, vec![release(1), release(2)], |call| {
        calls.push(call.what());
        call.fail(
            404,
            "NotFound",
            "ippools.whereabouts.cni.cncf.io \"p\" not found",
        );
    })
    .await;
    let gone = Ok(ReleaseOutcome::AlreadyGone);
    assert_eq!(out, [gone.clone(), gone]);
    assert_eq!(calls, ["PATCH ippools/p"], "no read after a 404");
    assert_eq!(rig.failures("api"), 0);
}

#[tokio::test]
async fn a_failing_apiserver_fails_the_batch_for_a_later_retry() {
    let mut rig = Rig::new();
    let mut calls = Vec::new();
    let out = release_serving(&mut rig, vec![release(1), release(2)], |call| {
        calls.push(call.what());
        call.fail(500, "InternalError", "etcdserver: request timed out");
    })
    .await;
    for o in &out {
        assert!(
            matches!(o, Err(ReleaseError::Api { pool, message })
                if pool == POOL && message.contains("etcdserver: request timed out")),
            "{o:?}"
        );
    }
    assert_eq!(
        calls,
        ["PATCH ippools/p"],
        "no read nor retry within the batch"
    );
    assert_eq!(rig.failures("api"), 2);
}

#[tokio::test]
async fn a_batch_refused_again_and_again_stops_after_64_patches() {
    let mut rig = Rig::new();
    let mut pool = Pool::numbered(100);
    let out = release_serving(&mut rig, (1..=100).map(release).collect(), |call| {
        // Every write of this pool refused (a policy gone wrong): each entry alone is reached
        // only after halvings, and a batch may cost at most 64 patches.
        if is_patch(&call) {
            pool.patches += 1;
            return call.fail(422, "Invalid", "refused by policy");
        }
        pool.answer(call)
    })
    .await;
    let conflicts = out
        .iter()
        .filter(|o| matches!(o, Err(ReleaseError::Conflict { .. })))
        .count();
    let refused = out
        .iter()
        .filter(|o| matches!(o, Err(ReleaseError::Refused { .. })))
        .count();
    assert_eq!(pool.patches, 64);
    assert_eq!(pool.reads, 64);
    assert_eq!(refused + conflicts, 100, "{out:?}");
    assert!(
        conflicts > 0 && refused > 0,
        "{refused} refused, {conflicts} left"
    );
    assert_eq!(pool.keys().len(), 100, "nothing written");
    assert_eq!(rig.failures("conflict"), conflicts as u64);
}

#[tokio::test]
async fn an_annotations_map_made_between_read_and_patch_is_signed_into_on_the_retry() {
    let mut rig = Rig::new();
    let until: jiff::Timestamp = "2026-11-25T10:00:31Z".parse().unwrap();
    let (id, podref) = (cooldown_id(until), cooling_podref("ns/web-0"));
    // A cooling entry whose cooldown ended: its removal is a write of a marked entry, signed
    // in the pool's annotations; the pool has no annotations map when the patch is built.
    let mut pool = Pool::new(&[("5", &id, &podref)]);
    let mut first = true;
    let end = request(5, &id, &podref, EntryWrite::EndCooldown);
    let out = release_serving(&mut rig, vec![end], |call| {
        if is_patch(&call) && std::mem::take(&mut first) {
            pool.object["metadata"]["annotations"] = json!({"example.com/other": "x"});
        }
        pool.answer(call)
    })
    .await;
    assert_eq!(out, [RELEASED]);
    assert_eq!(pool.keys(), Vec::<String>::new());
    let annotations = &pool.object["metadata"]["annotations"];
    assert_eq!(annotations["example.com/other"], "x", "the other map kept");
    assert!(
        annotations[OWN_WRITE_ANNOTATION].is_string(),
        "{annotations}"
    );
    assert_eq!((pool.patches, pool.reads), (2, 1));
}
