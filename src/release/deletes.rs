//! What goes after a pool's entries: their reservations (each guarded, see `reservation`) and
//! the fence records of lifted fences, each deleted with its uid as precondition, as many at
//! once as the budgets allow.

use std::sync::Arc;

use futures::StreamExt;
use kube::api::Api;
use tokio::sync::mpsc;

use super::types::Deleted;
use super::writer::{ObjectDelete, RESERVATION_DELETERS, Writer, delete_only_uid};
use crate::api::{IPFence, ObjectId};

impl Writer {
    /// Deletes queued objects, as many at once as the budgets allow; once every sender is gone,
    /// ends when the deletes and the second looks after them are done.
    pub(super) async fn delete_queued(self: Arc<Self>, rx: mpsc::UnboundedReceiver<ObjectDelete>) {
        let (looks, looking) = self.spawn_rechecks();
        let queued =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        queued
            .for_each_concurrent(RESERVATION_DELETERS, |d| {
                let (w, looks) = (self.clone(), looks.clone());
                async move {
                    match d {
                        ObjectDelete::Reservation(d) => {
                            let done = w.delete_reservation(d.clone()).await;
                            let id = ObjectId {
                                name: d.name.clone(),
                                uid: d.uid.clone(),
                            };
                            w.pending_deletes.lock().expect("pending lock").remove(&id);
                            if done == Deleted::Deleted {
                                let _ = looks.send(d);
                            }
                        }
                        other => w.delete_object(other).await,
                    }
                }
            })
            .await;
        drop(looks);
        let _ = looking.await;
    }

    /// Deletes one fence record with its uid as precondition (reservations go through
    /// `delete_reservation`).
    pub(super) async fn delete_object(&self, object: ObjectDelete) {
        let ObjectDelete::Fence(ObjectId { name, uid }) = object else {
            return;
        };
        let params = delete_only_uid(uid);
        let api: Api<IPFence> = Api::namespaced(self.client.clone(), &self.namespace);
        let result = self
            .send_object_write("delete", || api.delete(&name, &params))
            .await;
        match result {
            Ok(_) => {}
            // Gone already, or replaced by a new record (uid changed): not ours.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => {
                self.metrics.failed(Deleted::FAILED_LABEL);
                tracing::warn!(record = %name, error = %e, "could not delete fence record");
            }
        }
    }
}
