//! Object writes, around a pool's entries: a fence's `IPFence` record before its entry
//! (`fence_records`), then the reservations of what was released (each guarded at the moment
//! it goes out, `reservation`, and re-checked after, `rechecks`) and the records of lifted
//! fences, each deleted with its uid as precondition, as many at once as the budgets allow;
//! and a missing reservation created again for a live entry (`repair`).

pub(super) mod fence_records;
pub mod rechecks;
pub mod repair;
pub mod reservation;

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::api::{Api, DeleteParams, Preconditions};
use tokio::sync::mpsc;

use super::budget::{Paid, WriteKind};
use super::context::WriteContext;
use super::types::{Deleted, ReservationDelete};
use crate::api::{IPFence, ObjectId};

/// Reservation deletes (and fence record writes) sent at once at most (the shared in-flight
/// cap may allow fewer).
pub(super) const RESERVATION_DELETERS: usize = 16;

/// An object to delete after the pool entries it belongs to, with its uid as precondition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectDelete {
    /// An OverlappingRangeIPReservation, unless a live allocation holds its address.
    Reservation(ReservationDelete),
    /// An `IPFence` record whose entry was released or is gone.
    Fence(ObjectId),
}

/// The object writes, and the reservation deletes queued or under way.
pub struct ObjectWriter {
    pub(crate) cx: Arc<WriteContext>,
    pub(crate) pending: PendingDeletes,
}

impl ObjectWriter {
    /// The object writes of `cx`, nothing queued yet.
    pub(crate) fn new(cx: Arc<WriteContext>) -> Self {
        ObjectWriter {
            cx,
            pending: PendingDeletes::default(),
        }
    }
}

/// Reservation deletes queued or under way: the sweep finds a reservation it queued again
/// until the delete is done, and it is queued once.
#[derive(Debug, Default)]
pub struct PendingDeletes(Mutex<HashSet<ObjectId>>);

impl PendingDeletes {
    /// Whether `id` is new here (and now pending).
    pub(super) fn queue(&self, id: ObjectId) -> bool {
        self.0.lock().expect("pending lock").insert(id)
    }

    /// `id`'s delete is done, whatever became of it.
    fn done(&self, id: &ObjectId) {
        self.0.lock().expect("pending lock").remove(id);
    }
}

/// Delete parameters that touch only the object of uid `uid`: one replaced since (another
/// pod's, another fence's) is left alone.
pub(super) fn delete_only_uid(uid: String) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}

impl ObjectWriter {
    /// Sends one write of a reservation or fence record under their budget, counted as an API
    /// write of `verb`.
    pub(super) async fn send_object_write<T, F, Fut>(
        &self,
        verb: &str,
        write: F,
    ) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let metrics = &self.cx.metrics;
        self.cx
            .budgets
            .send_counted(WriteKind::Reservation, Paid::No, metrics, verb, write)
            .await
    }

    /// A reservation create past the leadership gate: putting back one this replica deleted,
    /// for an allocation that appeared meanwhile (no other replica knows it is due; a create
    /// decides nothing and is refused if one exists).
    pub(super) async fn send_restore<T, F, Fut>(&self, write: F) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let write = super::budget::counted(&self.cx.metrics, "create", write);
        self.cx
            .budgets
            .send_ungated(WriteKind::Reservation, write)
            .await
    }
}

impl ObjectWriter {
    /// Deletes queued objects, as many at once as the budgets allow; once every sender is gone,
    /// ends when the deletes and the re-checks after them are done.
    pub(super) async fn delete_queued(self: Arc<Self>, rx: mpsc::UnboundedReceiver<ObjectDelete>) {
        let (rechecks, rechecking) = self.spawn_rechecks();
        let queued =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        queued
            .for_each_concurrent(RESERVATION_DELETERS, |d| {
                let (w, rechecks) = (self.clone(), rechecks.clone());
                async move {
                    match d {
                        ObjectDelete::Reservation(d) => {
                            let done = w.delete_reservation(d.clone()).await;
                            let id = ObjectId {
                                name: d.name.clone(),
                                uid: d.uid.clone(),
                            };
                            w.pending.done(&id);
                            if done == Deleted::Deleted {
                                let _ = rechecks.send(d);
                            }
                        }
                        other => w.delete_object(other).await,
                    }
                }
            })
            .await;
        drop(rechecks);
        let _ = rechecking.await;
    }

    /// Deletes one fence record with its uid as precondition (reservations go through
    /// `delete_reservation`).
    pub(super) async fn delete_object(&self, object: ObjectDelete) {
        let ObjectDelete::Fence(ObjectId { name, uid }) = object else {
            return;
        };
        let params = delete_only_uid(uid);
        let api: Api<IPFence> = Api::namespaced(self.cx.client.clone(), &self.cx.namespace);
        let result = self
            .send_object_write("delete", || api.delete(&name, &params))
            .await;
        match result {
            Ok(_) => {}
            // Gone already, or replaced by a new record (uid changed): not ours.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => {
                self.cx.metrics.failed(Deleted::FAILED_LABEL);
                tracing::warn!(record = %name, error = %e, "could not delete fence record");
            }
        }
    }
}
