//! Fence records: the `IPFence` object of each fence, written before its entry's rewrite (a
//! crash in between leaves a pending fence, which the lifter completes).

use std::collections::BTreeMap;

use futures::StreamExt;
use kube::api::{Api, PostParams};

use super::ObjectWriter;
use super::{ObjectDelete, RESERVATION_DELETERS};
use crate::api::{IPFence, ObjectId};
use crate::ipam::fence::{FenceRecord, fence_object_name, fence_spec};
use crate::release::budget::WriteKind;
use crate::release::context::api_error;
use crate::release::types::{EntryWrite, ReleaseError, ReleaseRequest};

/// A fence record as a fence's write found or made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceObjectWritten {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// This write created it (else it was there: a retry, or another writer's).
    pub created: bool,
}

impl ObjectWriter {
    /// Writes the `IPFence` record of each fence in `reqs` (`None` for other writes): its
    /// (name, uid), or why it could not be written.
    pub(in crate::release) async fn write_fence_records(
        &self,
        pool: &str,
        reqs: &[ReleaseRequest],
    ) -> Vec<Option<Result<FenceObjectWritten, ReleaseError>>> {
        let mut writes = Vec::with_capacity(reqs.len());
        for r in reqs {
            writes.push(self.fence_record_of(pool, r));
        }
        futures::stream::iter(writes)
            .buffered(RESERVATION_DELETERS)
            .collect()
            .await
    }

    async fn fence_record_of(
        &self,
        pool: &str,
        req: &ReleaseRequest,
    ) -> Option<Result<FenceObjectWritten, ReleaseError>> {
        let EntryWrite::Fence(record) = &req.write else {
            return None;
        };
        Some(self.write_fence_record(pool, req, record).await)
    }

    /// Creates the `IPFence` record of one fence. One already there for the same entry (a
    /// retry, or a pending fence being completed) is used; one left over from an earlier
    /// fence of the same address is replaced.
    async fn write_fence_record(
        &self,
        pool: &str,
        req: &ReleaseRequest,
        record: &FenceRecord,
    ) -> Result<FenceObjectWritten, ReleaseError> {
        let e = &req.judged.entry;
        let name = fence_object_name(pool, &e.key);
        let spec = fence_spec(pool, &e.key, e.ip, &e.id, record);
        let api: Api<IPFence> = Api::namespaced(self.cx.client.clone(), &self.cx.namespace);
        let refused = |err: &kube::Error| match err {
            e if crate::release::budget::is_not_leader(e) => ReleaseError::NotLeader,
            kube::Error::Api(s) if (400..500).contains(&s.code) => ReleaseError::Refused {
                pool: pool.into(),
                message: format!("fence record {name}: {}", s.message),
            },
            other => api_error(pool, other),
        };
        let params = PostParams::default();
        for _ in 0..2 {
            let mut object = IPFence::new(&name, spec.clone());
            object.metadata.labels = Some(BTreeMap::from([(
                crate::ipam::fence::NODE_LABEL.to_owned(),
                crate::ipam::fence::node_label_value(&spec.node),
            )]));
            let created = self
                .send_object_write("create", || api.create(&params, &object))
                .await;
            let existing = match created {
                Ok(o) => {
                    return Ok(FenceObjectWritten {
                        name: name.clone(),
                        uid: o.metadata.uid.unwrap_or_default(),
                        created: true,
                    });
                }
                Err(kube::Error::Api(s)) if s.code == 409 => self
                    .cx
                    .budgets
                    .send(WriteKind::Reservation, || api.get_opt(&name))
                    .await
                    .map_err(|err| refused(&err))?,
                Err(err) => return Err(refused(&err)),
            };
            let Some(existing) = existing else {
                continue; // deleted meanwhile: create again
            };
            let uid = existing.metadata.uid.clone().unwrap_or_default();
            let same = (
                &existing.spec.pool,
                &existing.spec.key,
                &existing.spec.sandbox,
            ) == (&spec.pool, &spec.key, &spec.sandbox)
                && existing.spec.podref == spec.podref;
            if same {
                return Ok(FenceObjectWritten {
                    name: name.clone(),
                    uid,
                    created: false,
                });
            }
            // Left over from an earlier fence of this address (its entry is another sandbox's
            // now): replace it.
            self.delete_object(ObjectDelete::Fence(ObjectId {
                name: name.clone(),
                uid,
            }))
            .await;
        }
        Err(ReleaseError::Conflict { pool: pool.into() })
    }
}
