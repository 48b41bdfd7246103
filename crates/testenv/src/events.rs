//! Reading Kubernetes Events the way the tests check them.

use k8s_openapi::api::core::v1::Event;
use kube::Client;
use kube::api::{Api, ListParams};

use crate::poll::wait_seen;

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

/// Waits until `namespace` has an Event with `reason` and returns those; a failure lists the
/// Events the namespace had instead (reason, object, message).
pub async fn wait_with_reason(client: &Client, namespace: &str, reason: &str) -> Vec<Event> {
    let api = Api::<Event>::namespaced(client.clone(), namespace);
    let all = wait_seen(
        &format!("a {reason} Event in {namespace}"),
        || async {
            api.list(&ListParams::default())
                .await
                .unwrap_or_else(|e| panic!("list Events in {namespace}: {e}"))
                .items
        },
        |events| events.iter().any(|e| e.reason.as_deref() == Some(reason)),
        |events| {
            let seen: Vec<String> = events
                .iter()
                .map(|e| {
                    format!(
                        "{} on {}: {}",
                        e.reason.as_deref().unwrap_or_default(),
                        e.involved_object.name.as_deref().unwrap_or_default(),
                        e.message.as_deref().unwrap_or_default()
                    )
                })
                .collect();
            format!("{seen:?}")
        },
    )
    .await;
    all.into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

/// How many times an Event was reported (its series count, else its count, else 1).
pub fn count(e: &Event) -> i32 {
    e.series
        .as_ref()
        .and_then(|s| s.count)
        .or(e.count)
        .unwrap_or(1)
}
