//! Reading Kubernetes Events the way the tests check them.

use k8s_openapi::api::core::v1::Event;
use kube::Client;
use kube::api::{Api, ListParams};

/// The Events in `namespace` with `reason` (and, when given, on the object named `object`).
pub async fn with_reason(
    client: &Client,
    namespace: &str,
    reason: &str,
    object: Option<&str>,
) -> Vec<Event> {
    let mut fields = format!("reason={reason}");
    if let Some(name) = object {
        fields.push_str(&format!(",involvedObject.name={name}"));
    }
    Api::<Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().fields(&fields))
        .await
        .unwrap_or_else(|e| panic!("list {reason} Events in {namespace}: {e}"))
        .items
}

/// How many times an Event was reported (its series count, else its count, else 1).
pub fn count(e: &Event) -> i32 {
    e.series
        .as_ref()
        .and_then(|s| s.count)
        .or(e.count)
        .unwrap_or(1)
}
