//! The pod watch's lists in protobuf (`ipreclaim::protobuf_lists`), for the answers a real
//! apiserver does not give on demand: a protobuf page that cannot be read, and a server that
//! answers a protobuf ask in JSON. The real apiserver's pages are read in
//! `tests/controller/pod_lists.rs`.

use ipreclaim::api::slim::PodView;
use ipreclaim::protobuf_lists::pod_list_client;
use kube::Api;
use kube::api::ListParams;
use serde_json::json;

use crate::apiserver::pair;

const PROTOBUF_ASK: &str = "application/vnd.kubernetes.protobuf, application/json";

fn json_page() -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "12"},
        "items": [{"metadata": {"name": "web-0", "namespace": "ns", "uid": "u0"},
                   "spec": {"nodeName": "node-a"}, "status": {"phase": "Running"}}],
    })
}

#[tokio::test]
async fn a_protobuf_page_that_cannot_be_read_is_asked_again_in_json() {
    let (client, mut apiserver) = pair();
    let pods = Api::<PodView>::namespaced(pod_list_client(client), "ns");
    let list = tokio::spawn(async move { pods.list(&ListParams::default().limit(250)).await });

    let first = apiserver.next().await;
    assert_eq!(first.what(), "GET pods");
    assert_eq!(first.accept.as_deref(), Some(PROTOBUF_ASK));
    let query = first.query.clone();
    assert!(query.contains("limit=250"), "{query}");
    // The magic, then a field whose length runs past the end.
    first.respond_bytes(
        200,
        "application/vnd.kubernetes.protobuf",
        b"k8s\0\x12\x7f".to_vec(),
    );
    let again = apiserver.next().await;
    assert_eq!(again.what(), "GET pods");
    assert_eq!(again.query, query, "the same page asked again");
    assert_eq!(again.accept.as_deref(), Some("application/json"));
    again.respond(200, &json_page());

    let list = list.await.unwrap().expect("the page, read in JSON");
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.items[0].node.as_deref(), Some("node-a"));
}

#[tokio::test]
async fn a_json_answer_to_a_protobuf_ask_is_read_as_it_is() {
    let (client, mut apiserver) = pair();
    let pods = Api::<PodView>::all(pod_list_client(client));
    let list = tokio::spawn(async move { pods.list(&ListParams::default()).await });
    let call = apiserver.next().await;
    assert_eq!(call.accept.as_deref(), Some(PROTOBUF_ASK));
    call.respond(200, &json_page());
    let list = list.await.unwrap().expect("the page");
    assert_eq!(list.items[0].phase.as_deref(), Some("Running"));
    apiserver
        .expect_silence(std::time::Duration::from_millis(200))
        .await;
}

#[tokio::test]
async fn watches_and_gets_go_as_they_came() {
    let (client, mut apiserver) = pair();
    let pods = Api::<PodView>::namespaced(pod_list_client(client), "ns");
    let get = {
        let pods = pods.clone();
        tokio::spawn(async move { pods.get("web-0").await })
    };
    let call = apiserver.next().await;
    assert_eq!(call.what(), "GET pods/web-0");
    assert_eq!(call.accept, None, "kube's own: no Accept");
    call.respond(200, &json_page()["items"][0]);
    assert_eq!(
        get.await.unwrap().expect("the pod").node.as_deref(),
        Some("node-a")
    );

    let watch = tokio::spawn(async move {
        use futures::StreamExt;
        let params = kube::api::WatchParams::default().timeout(1);
        let stream = pods.watch(&params, "12").await?;
        Ok::<_, kube::Error>(stream.count().await)
    });
    let call = apiserver.next().await;
    assert!(call.query.contains("watch=true"), "{}", call.query);
    assert_eq!(call.accept, None, "kube's own: no Accept");
    call.respond_bytes(200, "application/json", Vec::new());
    assert_eq!(watch.await.unwrap().expect("an empty watch"), 0);
}
