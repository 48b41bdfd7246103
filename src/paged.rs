//! Lists read a page at a time: a page is handled and dropped before the next is read, so a
//! large cluster's list never sits in memory whole. The continue token pins the first page's
//! resourceVersion, so the pages together are one consistent snapshot.

use std::future::Future;

use kube::api::{ListParams, ObjectList};

/// Pods per page of a list of whole pods (the controller's watch and `scan`, in protobuf: see
/// `protobuf_lists`). A page is read pod by pod as it arrives, so what it costs is the JSON
/// each pod keeps (a Deployment's pod about 1 KB; one whose tenant filled its network-status
/// 32 KiB, escaped up to twice that for its newlines): about 0.5 MB a page, 32 MB for a page of
/// such pods, less than one page of 250 such pods cost when it was read whole (64 MB in
/// protobuf, and their JSON). An apiserver (or proxy) that answers in JSON sends the page
/// whole, as the reader's fallback asks it: up to 500 pods' whole JSON (a tenant's 256 KiB of
/// annotations each, escaped), as a JSON page always cost. Each page costs the apiserver a walk
/// of its cache's list: at 100,000 pods, pages of 250 took it twice as long as pages of 500
/// (docs/development.md, Benches).
pub const POD_PAGE: u32 = 500;
/// Pools per page: a pool of 5,000 entries is about 1.5 MB of text with its managedFields, and
/// as much again while it is read (the controller reads the pod and reservation lists at the
/// same time: the start's peak is their pages' sum).
pub const POOL_PAGE: u32 = 1;
/// Reservations per page: one is under 1 KB of text, and each page costs the apiserver a walk
/// of its cache's whole list (kube's default of 500 made 200 walks of 100,000 at 100,000
/// reservations, beside the pods' pages).
pub const RESERVATION_PAGE: u32 = 2000;

/// Calls `each` on every item of a list fetched `limit` items at a time by `fetch`.
pub async fn for_each_listed<T, F, Fut>(
    limit: u32,
    mut fetch: F,
    mut each: impl FnMut(T),
) -> Result<(), kube::Error>
where
    T: Clone,
    F: FnMut(ListParams) -> Fut,
    Fut: Future<Output = Result<ObjectList<T>, kube::Error>>,
{
    let mut params = ListParams::default().limit(limit);
    loop {
        let list = fetch(params.clone()).await?;
        list.items.into_iter().for_each(&mut each);
        match list.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page as the apiserver sends it: items, and a continue token unless it is the last.
    fn page(items: &[&str], next: Option<&str>) -> ObjectList<String> {
        serde_json::from_value(serde_json::json!({
            "metadata": {"continue": next.unwrap_or(""), "resourceVersion": "7"},
            "items": items,
        }))
        .expect("an ObjectList")
    }

    #[tokio::test]
    async fn every_page_is_read_with_the_token_of_the_one_before() {
        let mut asked = Vec::new();
        let mut seen = Vec::new();
        for_each_listed(
            2,
            |params: ListParams| {
                asked.push((params.limit, params.continue_token.clone()));
                let reply = match params.continue_token.as_deref() {
                    None => page(&["a", "b"], Some("t1")),
                    Some("t1") => page(&["c", "d"], Some("t2")),
                    Some(_) => page(&["e"], None),
                };
                async move { Ok(reply) }
            },
            |item| seen.push(item),
        )
        .await
        .expect("listed");
        assert_eq!(seen, ["a", "b", "c", "d", "e"]);
        assert_eq!(
            asked,
            [
                (Some(2), None),
                (Some(2), Some("t1".to_string())),
                (Some(2), Some("t2".to_string())),
            ]
        );
    }

    #[tokio::test]
    async fn a_failed_page_fails_the_list() {
        let mut calls = 0;
        let result = for_each_listed(
            2,
            |params: ListParams| {
                calls += 1;
                let reply = match params.continue_token {
                    None => Ok(page(&["a", "b"], Some("t1"))),
                    Some(_) => Err(kube::Error::Api(
                        serde_json::from_value(serde_json::json!({
                            "status": "Failure", "message": "continue token expired",
                            "reason": "Expired", "code": 410,
                        }))
                        .expect("a Status"),
                    )),
                };
                async move { reply }
            },
            |_: String| {},
        )
        .await;
        assert!(matches!(result, Err(kube::Error::Api(s)) if s.code == 410));
        assert_eq!(calls, 2);
    }
}
