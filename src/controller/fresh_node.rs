//! The pod watch and the Node watch are separate streams: a pod's Delete event can come before
//! its node's NotReady update. So before a deletion's allocations are removed on the word of
//! the Node cache, each node the cache still trusts is read fresh (one read serves every
//! deletion seen before it began, also while it is in flight: a drain's pods, deleted at once,
//! read their node a few times, not once each); a node found not Ready is recorded in the
//! cache, and the deletion is judged again: its releases become fences.

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use kube::api::Api;
use tokio::sync::watch;

use super::ctx::Ctx;
use crate::api::slim::NodeReadyView;
use crate::index::NodeIndex;
use crate::release::{EntryWrite, ReleaseRequest};

/// A node of a deletion could not be read fresh.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reading node {node} before releasing its addresses: {message}")]
pub struct NodeReadError {
    /// The node.
    pub node: String,
    /// What the API said.
    pub message: String,
}

/// Reads fresh the nodes whose allocations `releases` would remove while the cache trusts
/// them (unless a read begun after `deleted_seen` already did); whether one turned out not
/// Ready, so that the deletion must be judged again. A read that fails is returned (the caller
/// retries the item): nothing is removed on a word that could not be checked.
pub(crate) async fn distrusted_when_read(
    ctx: &Ctx,
    podref: &str,
    releases: &[ReleaseRequest],
    deleted_seen: Instant,
) -> Result<bool, NodeReadError> {
    let Some(view) = &ctx.nodes else {
        return Ok(false);
    };
    let mut nodes: Vec<&str> = releases
        .iter()
        .filter(|r| r.write == EntryWrite::Remove)
        .filter_map(|r| r.judged.node.as_deref())
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    let to_read: Vec<String> = {
        let v = view.read().expect("node view lock");
        // The cache distrusts a node now that it trusted when the deletion was judged (its
        // NotReady arrived meanwhile): judge again, and the releases become fences.
        if nodes.iter().any(|n| v.distrust(Some(n)).is_some()) {
            return Ok(true);
        }
        nodes
            .into_iter()
            .filter(|n| v.node(n).is_some())
            .filter(|n| !v.read_since(n, deleted_seen))
            .map(str::to_owned)
            .collect()
    };
    let mut distrusted = false;
    for node in to_read {
        if let Some(why) = ctx
            .node_reads
            .read(&ctx.client, view, &node, deleted_seen)
            .await?
        {
            tracing::info!(%podref, %node, %why, "a fresh read of the node says it is not Ready: fenced, not released");
            distrusted = true;
        }
    }
    Ok(distrusted)
}

/// What a fresh read of a node found: why the node is distrusted (`None`: trusted, or gone).
type ReadVerdict = Result<Option<String>, NodeReadError>;

/// Where a read in flight will give its verdict.
type Verdict = watch::Receiver<Option<ReadVerdict>>;

/// Fresh node reads in flight, by node, each with when it began and where its verdict goes.
#[derive(Default)]
pub(crate) struct NodeReads {
    in_flight: Mutex<HashMap<String, (Instant, Verdict)>>,
}

impl NodeReads {
    /// The verdict of a fresh read of `node` begun at or after `deleted_seen`: one in flight,
    /// or a new one (recorded in `view`).
    async fn read(
        &self,
        client: &kube::Client,
        view: &RwLock<NodeIndex>,
        node: &str,
        deleted_seen: Instant,
    ) -> ReadVerdict {
        let joined = {
            let flights = self.in_flight.lock().expect("node reads lock");
            flights
                .get(node)
                .filter(|(began, _)| *began >= deleted_seen)
                .map(|(_, done)| done.clone())
        };
        if let Some(mut done) = joined {
            // A read abandoned before its verdict (its worker stopped) leaves this one to read.
            if let Ok(verdict) = done.wait_for(Option::is_some).await {
                return verdict.clone().expect("waited for a verdict");
            }
        }
        let began = Instant::now();
        let (tx, rx) = watch::channel(None);
        let flight = Flight {
            reads: self,
            node,
            began,
        };
        self.in_flight
            .lock()
            .expect("node reads lock")
            .insert(node.to_owned(), (began, rx));
        let verdict = read_now(client, view, node, began).await;
        drop(flight);
        tx.send_replace(Some(verdict.clone()));
        verdict
    }
}

/// A read in flight, taken off the map when it ends, finished or abandoned (unless a later
/// read has taken its place).
struct Flight<'a> {
    reads: &'a NodeReads,
    node: &'a str,
    began: Instant,
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        let mut flights = self.reads.in_flight.lock().expect("node reads lock");
        if flights
            .get(self.node)
            .is_some_and(|(b, _)| *b == self.began)
        {
            flights.remove(self.node);
        }
    }
}

/// Reads `node` now (the read began at `began`) into `view`; why it is distrusted.
async fn read_now(
    client: &kube::Client,
    view: &RwLock<NodeIndex>,
    node: &str,
    began: Instant,
) -> ReadVerdict {
    let fresh = Api::<NodeReadyView>::all(client.clone())
        .get_opt(node)
        .await
        .map_err(|e| NodeReadError {
            node: node.to_owned(),
            message: e.to_string(),
        })?;
    // Gone: the Node watch will drop it, and a pod of a deleted Node is released.
    let Some(fresh) = fresh else { return Ok(None) };
    let mut v = view.write().expect("node view lock");
    v.upsert(&fresh, began);
    let why = v.distrust(Some(node));
    // Only a read that found it Ready spares later reads: a watch event older than a
    // NotReady read may still arrive and say Ready again.
    v.record_read(node, began, why.is_none());
    Ok(why)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use http::{Request, Response};
    use kube::client::Body;
    use tower_test::mock;

    use super::*;

    type Handle = mock::Handle<Request<Body>, Response<Body>>;

    fn node(ready: &str) -> Response<Body> {
        let node = serde_json::json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}
        });
        Response::new(Body::from(serde_json::to_vec(&node).unwrap()))
    }

    /// Answers the next request, a GET of node n1, with `ready`.
    async fn answer(handle: &mut Handle, ready: &str) {
        let (request, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("a node read")
            .expect("a request");
        assert_eq!(request.uri().path(), "/api/v1/nodes/n1");
        send.send_response(node(ready));
    }

    /// A client to a mock apiserver, its handle, no reads in flight and an empty view.
    fn setup() -> (kube::Client, Handle, Arc<NodeReads>, Arc<RwLock<NodeIndex>>) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        (client, handle, Arc::default(), Arc::default())
    }

    /// Deletions seen before a read of their node began share it while it is in flight, and
    /// its verdict; a deletion seen after it began reads again.
    #[tokio::test]
    async fn deletions_seen_before_a_read_began_share_it_and_one_seen_after_reads_again() {
        let (client, mut handle, reads, view) = setup();
        view.write().unwrap().upsert(
            &ipreclaim_core::fixtures::node("n1", Some("True")),
            Instant::now(),
        );
        let spawn_read = |seen: Instant| {
            let (reads, view, client) = (reads.clone(), view.clone(), client.clone());
            tokio::spawn(async move { reads.read(&client, &view, "n1", seen).await })
        };
        let seen = Instant::now();
        let first = spawn_read(seen);
        let (request, send) = handle.next_request().await.expect("the first read");
        assert_eq!(request.uri().path(), "/api/v1/nodes/n1");
        let joined: Vec<_> = (0..10).map(|_| spawn_read(seen)).collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // Seen after the read began: it may have said Ready before this deletion.
        let later = spawn_read(Instant::now());
        send.send_response(node("Unknown"));
        let down = Some("Ready=Unknown".to_string());
        assert_eq!(first.await.unwrap(), Ok(down.clone()));
        for j in joined {
            let verdict = tokio::time::timeout(Duration::from_secs(10), j)
                .await
                .expect("no read of its own");
            assert_eq!(verdict.unwrap(), Ok(down.clone()), "the shared verdict");
        }
        answer(&mut handle, "True").await;
        assert_eq!(later.await.unwrap(), Ok(None));
        // Nothing in flight: the next read is its own.
        let last = spawn_read(Instant::now());
        answer(&mut handle, "True").await;
        assert_eq!(last.await.unwrap(), Ok(None));
        assert!(reads.in_flight.lock().unwrap().is_empty());
    }

    /// A read whose worker stops before the verdict leaves those waiting on it to read
    /// themselves, and nothing stale in flight.
    #[tokio::test]
    async fn a_read_abandoned_in_flight_leaves_its_waiters_to_read() {
        let (client, mut handle, reads, view) = setup();
        let seen = Instant::now();
        let spawn_read = || {
            let (reads, view, client) = (reads.clone(), view.clone(), client.clone());
            tokio::spawn(async move { reads.read(&client, &view, "n1", seen).await })
        };
        // Alone: abandoned, it leaves nothing in flight.
        let alone = spawn_read();
        let (_request, _send) = handle.next_request().await.expect("a read");
        alone.abort();
        assert!(alone.await.unwrap_err().is_cancelled());
        assert!(reads.in_flight.lock().unwrap().is_empty());
        let first = spawn_read();
        let (_request, _send) = handle.next_request().await.expect("the first read");
        let waiter = spawn_read();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        first.abort();
        answer(&mut handle, "True").await;
        assert_eq!(waiter.await.unwrap(), Ok(None));
        assert!(reads.in_flight.lock().unwrap().is_empty());
    }
}
