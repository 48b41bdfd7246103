//! A kube client over another, that handles each request with an async function of its own
//! (the deadline, the protobuf pod lists). It shares the inner client's connections.

use std::future::Future;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http::{Request, Response};
use kube::client::Body;

/// What a layer does with each request it is given.
pub(crate) trait Layer: Clone + Send + Sync + 'static {
    fn send(
        &self,
        request: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, kube::Error>> + Send;
}

/// A client that hands each request to `layer`, with `inner`'s default namespace.
pub(crate) fn client(inner: &kube::Client, layer: impl Layer) -> kube::Client {
    kube::Client::new(Service(layer), inner.default_namespace().to_owned())
}

#[derive(Clone)]
struct Service<L>(L);

impl<L: Layer> tower::Service<Request<Body>> for Service<L> {
    type Response = Response<Body>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, kube::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), kube::Error>> {
        // The inner client has its own buffer and waits for readiness itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let layer = self.0.clone();
        Box::pin(async move { layer.send(request).await })
    }
}
