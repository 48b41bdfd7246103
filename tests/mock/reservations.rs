//! The reservation delete's answers: each delete is checked against a fresh read of its pool
//! and sent with its uid as precondition; 404 (gone) and 409 (replaced: the uid differs) mean
//! not ours, anything else fails it (counted, and the sweep queues it again). Only a delete
//! that went through is looked at again after (see `release::reservation`).
//! Paused time: the looks are due 0.3 to 5 s after a delete, and waiting for them costs nothing.

use std::time::Duration;

use super::apiserver::Call;
use super::fixtures::{Rig, reservation};
use super::pool::Pool;

/// Longer than the last look after a delete (5 s) and its retries.
const LOOKS_DONE: Duration = Duration::from_secs(30);

/// Queues the delete of reservation `r-5`, answers its check's pool read (the entry is gone:
/// nothing holds the address), and returns the DELETE.
async fn delete_sent(rig: &mut Rig) -> Call {
    rig.writer.delete_reservations(vec![reservation(5)]);
    let mut pool = Pool::numbered(0);
    pool.answer(rig.apiserver.next().await);
    let delete = rig.apiserver.next().await;
    assert_eq!(delete.what(), "DELETE overlappingrangeipreservations/r-5");
    assert_eq!(delete.body["preconditions"]["uid"], "uid-r-5");
    delete
}

#[tokio::test(start_paused = true)]
async fn a_reservation_gone_or_replaced_meanwhile_is_not_ours_and_not_a_failure() {
    for (code, reason) in [(404, "NotFound"), (409, "Conflict")] {
        let mut rig = Rig::new();
        delete_sent(&mut rig)
            .await
            .fail(code, reason, "Precondition failed: UID in precondition");
        // Not deleted by us: nothing to look at again, nothing failed.
        rig.apiserver.expect_silence(LOOKS_DONE).await;
        assert_eq!(rig.failures("reservation"), 0, "{code}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_reservation_delete_the_apiserver_fails_is_counted_and_queued_again_later() {
    let mut rig = Rig::new();
    delete_sent(&mut rig)
        .await
        .fail(500, "InternalError", "etcdserver: leader changed");
    rig.apiserver.expect_silence(LOOKS_DONE).await;
    assert_eq!(rig.failures("reservation"), 1);
    // Done with (failed): the next sweep's queueing of it is not dropped as already pending.
    delete_sent(&mut rig).await.fail(404, "NotFound", "gone");
    rig.apiserver.expect_silence(LOOKS_DONE).await;
    assert_eq!(rig.failures("reservation"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_deleted_reservation_is_looked_at_again() {
    let mut rig = Rig::new();
    let success = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success"});
    delete_sent(&mut rig).await.respond(200, &success);
    // The first look reads the pool again (the control for the two tests above: their silence
    // is the absence of this read).
    let look = rig.apiserver.next_within(Duration::from_secs(1)).await;
    let look = look.expect("a look within a second of the delete");
    assert_eq!(look.what(), "GET ippools");
    assert_eq!(rig.failures("reservation"), 0);
}
