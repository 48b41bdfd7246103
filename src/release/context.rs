//! What the writer's jobs share: the client and namespace, the write budgets, the metrics and
//! Events, `--dry-run`, the ledger, and fresh pool reads.
//!
//! A fresh pool read is as fresh as a GET at a fraction of the apiserver's cost. A GET without
//! a resourceVersion reads etcd and decodes the whole pool, and pools are large; a LIST by name
//! without one is a consistent read too, which kube-apiserver 1.31 and later serve from the
//! watch cache once it has caught up with etcd (older ones read the one key from etcd). The
//! re-checks after reservation deletes read pools this way several times a second under churn.
//! Where RBAC grants `get` but not `list`, a GET (the refusal is remembered); the node agent,
//! granted no list on purpose, always reads with GET.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kube::Client;
use kube::api::{Api, ListParams};

use super::budget::Budgets;
use super::ledger::Ledger;
use super::reports::events::Events;
use super::types::ReleaseError;
use crate::api::IPPool;
use crate::telemetry::WriteMetrics;

/// What the writer's jobs share.
pub struct WriteContext {
    pub(crate) client: Client,
    pub(crate) namespace: String,
    pub(crate) budgets: Budgets,
    pub(crate) metrics: WriteMetrics,
    pub(crate) events: Events,
    /// `--dry-run`: reports, writes nothing.
    pub(crate) dry_run: bool,
    /// What it knows of the allocations, and where it tells what it wrote.
    pub(crate) ledger: Arc<dyn Ledger>,
    /// Fresh pool reads are GETs, not LISTs by name: RBAC refused the list, or the program is
    /// granted none.
    pub(crate) read_by_get: AtomicBool,
}

impl WriteContext {
    /// The pools' API.
    pub(crate) fn pools_api(&self) -> Api<IPPool> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// `name`'s pool now (`None`: there is none).
    pub(crate) async fn read_pool(&self, name: &str) -> Result<Option<IPPool>, kube::Error> {
        let pools = self.pools_api();
        if !self.read_by_get.load(Ordering::Relaxed) {
            let by_name = ListParams::default().fields(&format!("metadata.name={name}"));
            match pools.list(&by_name).await {
                Ok(list) => {
                    return Ok(list
                        .items
                        .into_iter()
                        .find(|p| p.metadata.name.as_deref() == Some(name)));
                }
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    tracing::info!(error = %s, "listing pools is not allowed: reading them one by one with GET");
                    self.read_by_get.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        pools.get_opt(name).await
    }
}

/// A failed API call on `pool` as a release error (the write gate's refusal: not leader).
pub(crate) fn api_error(pool: &str, e: &kube::Error) -> ReleaseError {
    if super::budget::is_not_leader(e) {
        return ReleaseError::NotLeader;
    }
    ReleaseError::Api {
        pool: pool.into(),
        message: e.to_string(),
    }
}
