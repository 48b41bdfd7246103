//! A client whose pod lists come in protobuf, read into the JSON [`PodView`] reads
//! (`ipreclaim_core::api::protobuf`): the apiserver serves a page in half to four fifths
//! of its JSON's time, and only the fields a `PodView` keeps are read from it, pod by pod as
//! the page arrives (a page is never held whole in protobuf). Everything else the client
//! sends (watches, gets, other kinds) goes as it came. Only for readers of `PodView`: the
//! lists' items carry nothing else.
//!
//! A response that is not protobuf (an apiserver or proxy that answered in JSON) is passed on
//! as it is; one that cannot be read is asked again in JSON, with a warning: a start is never
//! lost to this path.
//!
//! [`PodView`]: ipreclaim_core::api::slim::PodView

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{HeaderValue, Request, Response, header};
use ipreclaim_core::api::protobuf::PodListReader;

use crate::request_deadline::{Asked, REQUEST_DEADLINE, each_part, is_protobuf};
use kube::client::Body;

/// What a pod list asks for: protobuf, or JSON from a server that has no protobuf.
const ACCEPT_PROTOBUF: &str = "application/vnd.kubernetes.protobuf, application/json";
const JSON: &str = "application/json";

/// `client`, with its pod lists read in protobuf. It shares `client`'s connections.
pub fn pod_list_client(client: kube::Client) -> kube::Client {
    let layer = ProtobufPodLists {
        client: client.clone(),
        warned: Arc::default(),
    };
    crate::client_layer::client(&client, layer)
}

/// Marks a response read from protobuf (in its extensions), for tests and traces to tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadFromProtobuf;

#[derive(Clone)]
struct ProtobufPodLists {
    client: kube::Client,
    /// Whether a page that could not be read was reported (once per client, that is per watch
    /// or scan: the next ones go to debug).
    warned: Arc<AtomicBool>,
}

impl crate::client_layer::Layer for ProtobufPodLists {
    async fn send(&self, request: Request<Body>) -> Result<Response<Body>, kube::Error> {
        if !is_pod_list(&request) {
            return self.client.send(request).await;
        }
        // A list has no body: the request is made again with another Accept when needed.
        let (parts, _) = request.into_parts();
        let ask = |accept: &'static str| {
            let mut request = Request::new(Body::from(Vec::new()));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            *request.extensions_mut() = parts.extensions.clone();
            request
                .headers_mut()
                .insert(header::ACCEPT, HeaderValue::from_static(accept));
            request
        };
        let first = ask(ACCEPT_PROTOBUF);
        let asked = Asked::of(&first);
        let response = self.client.send(first).await?;
        if !is_protobuf(&response) {
            // Read by the deadline layer below, as any answer that is not protobuf.
            return Ok(response);
        }
        let (mut head, body) = response.into_parts();
        let mut reader = PodListReader::default();
        let read = each_part(body, REQUEST_DEADLINE, |part| reader.push(part))
            .await
            .map_err(|e| e.into_kube(&asked, REQUEST_DEADLINE))?
            .and_then(|()| reader.finish());
        match read {
            Ok(json) => {
                head.headers
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static(JSON));
                head.headers.remove(header::CONTENT_LENGTH);
                head.extensions.insert(ReadFromProtobuf);
                Ok(Response::from_parts(head, Body::from(json)))
            }
            Err(e) => {
                let uri = parts.uri.to_string();
                if self.warned.swap(true, Ordering::Relaxed) {
                    tracing::debug!(error = %e, uri, "a pod list in protobuf could not be read; asking again in JSON");
                } else {
                    tracing::warn!(error = %e, uri, "a pod list in protobuf could not be read; asking again in JSON (reported once: the next ones are logged at debug)");
                }
                self.client.send(ask(JSON)).await
            }
        }
    }
}

/// A GET of the pods of the cluster or of one namespace, not a watch, asking for JSON (kube's
/// lists send no Accept; a request that asks for something else, metadata only or a Table,
/// gets what it asked for).
fn is_pod_list<B>(request: &Request<B>) -> bool {
    if request.method() != http::Method::GET {
        return false;
    }
    let asks_json = request
        .headers()
        .get(header::ACCEPT)
        .is_none_or(|a| a.as_bytes() == JSON.as_bytes());
    if !asks_json {
        return false;
    }
    let uri = request.uri();
    let segments: Vec<&str> = uri.path().trim_end_matches('/').split('/').collect();
    let pods = match segments.as_slice() {
        ["", "api", "v1", "pods"] => true,
        ["", "api", "v1", "namespaces", ns, "pods"] => !ns.is_empty(),
        _ => false,
    };
    pods && !crate::request_deadline::is_watch(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(uri: &str) -> Request<()> {
        Request::get(uri).body(()).unwrap()
    }

    #[test]
    fn only_pod_lists_are_asked_in_protobuf() {
        assert!(is_pod_list(&get("/api/v1/pods?limit=500")));
        assert!(is_pod_list(&get(
            "/api/v1/namespaces/ns/pods?limit=500&continue=x"
        )));
        assert!(is_pod_list(&get("/api/v1/pods")));
        assert!(!is_pod_list(&get(
            "/api/v1/pods?watch=true&resourceVersion=5"
        )));
        assert!(!is_pod_list(&get("/api/v1/pods?resourceVersion=5&watch=1")));
        assert!(!is_pod_list(&get("/api/v1/namespaces/ns/pods/web-0")));
        assert!(!is_pod_list(&get("/api/v1/nodes?limit=500")));
        assert!(!is_pod_list(&get(
            "/apis/whereabouts.cni.cncf.io/v1alpha1/ippools"
        )));
        assert!(!is_pod_list(&get("/api/v1/namespaces//pods")));
        let delete = Request::delete("/api/v1/namespaces/ns/pods")
            .body(())
            .unwrap();
        assert!(!is_pod_list(&delete));
        let json = Request::get("/api/v1/pods")
            .header("accept", JSON)
            .body(())
            .unwrap();
        assert!(is_pod_list(&json));
        let metadata = Request::get("/api/v1/pods")
            .header(
                "accept",
                "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
            )
            .body(())
            .unwrap();
        assert!(!is_pod_list(&metadata));
    }
}
