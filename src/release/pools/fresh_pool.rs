//! A pool read as fresh as a GET, at a fraction of the apiserver's cost. A GET without a
//! resourceVersion reads etcd and decodes the whole pool, and pools are large; a LIST by name
//! without one is a consistent read too, which kube-apiserver 1.31 and later serve from the
//! watch cache once it has caught up with etcd (older ones read the one key from etcd). The
//! looks after reservation deletes read pools this way several times a second under churn.
//! Where RBAC grants `get` but not `list`, a GET (the refusal is remembered); the node agent,
//! granted no list on purpose, always reads with GET.

use std::sync::atomic::Ordering;

use kube::api::ListParams;

use crate::api::IPPool;
use crate::release::writer::Writer;

impl Writer {
    /// `name`'s pool now (`None`: there is none).
    pub(crate) async fn read_pool(&self, name: &str) -> Result<Option<IPPool>, kube::Error> {
        let pools = self.pools_api();
        if !self.pools.read_by_get.load(Ordering::Relaxed) {
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
                    self.pools.read_by_get();
                }
                Err(e) => return Err(e),
            }
        }
        pools.get_opt(name).await
    }
}
