//! A zone outage at scale: thousands of fences in one pool, freed when the zone returns.

use std::time::Duration;

use kube::api::{Api, ListParams};
use testenv::poll::{metric_value, wait_for};

use crate::harness::Env;

/// A zone outage: 2,000 pods of 20 nodes that stop reporting, in one pool of 4,096 addresses
/// with 200 pods of a Ready node, and a second pool of that node. All are deleted at once
/// (operators force-delete what ran in the zone). Nothing of the zone's is freed while its
/// nodes are down (2,000 fences; the pool no longer grows with them: the records are objects);
/// the Ready node's pods in both pools are released meanwhile; once the nodes are back, every
/// fenced address is freed within the settle plus seconds, the fences read fresh with a list
/// per node (not a GET each). Prints the figures and what the controller wrote. Stand-in Nodes
/// on a private control plane (its own metrics and load).
#[tokio::test]
async fn a_zone_outage_fences_thousands_in_one_pool_and_frees_them_when_the_zone_returns() {
    use futures::StreamExt;
    const ZONE_NODES: usize = 20;
    const ZONE_PODS: usize = 2000;
    const READY_PODS: usize = 200;
    let (_cp, mut env) = Env::private("ctl-zone").await;
    let ns = env.ns.clone();
    let mut zone = Vec::new();
    for i in 0..ZONE_NODES {
        let node = format!("{ns}-zone-{i}");
        env.create_node(&node, "True").await;
        zone.push(node);
    }
    let ready = env.fence_node("True").await;
    env.nad("big", "198.18.0.0/20").await;
    env.nad("small", "198.19.0.0/24").await;
    // (name, node, address, pool)
    let mut pods: Vec<(String, String, String, &str)> = Vec::new();
    for i in 0..ZONE_PODS {
        let ip =
            std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(198, 18, 0, 10)) + i as u32);
        pods.push((
            format!("z-{i}"),
            zone[i % ZONE_NODES].clone(),
            ip.to_string(),
            "big",
        ));
    }
    for i in 0..READY_PODS {
        let off = ZONE_PODS + i;
        let ip = std::net::Ipv4Addr::from(
            u32::from(std::net::Ipv4Addr::new(198, 18, 0, 10)) + off as u32,
        );
        pods.push((format!("r-{i}"), ready.clone(), ip.to_string(), "big"));
    }
    for i in 0..READY_PODS / 2 {
        pods.push((
            format!("s-{i}"),
            ready.clone(),
            format!("198.19.0.{}", 10 + i),
            "small",
        ));
    }
    let entries = |pool: &str| -> Vec<(u32, String, String)> {
        pods.iter()
            .filter(|p| p.3 == pool)
            .map(|(name, _, ip, _)| {
                let ip: std::net::Ipv4Addr = ip.parse().unwrap();
                let base = if pool == "big" {
                    [198, 18, 0, 0]
                } else {
                    [198, 19, 0, 0]
                };
                let off = u32::from(ip) - u32::from(std::net::Ipv4Addr::from(base));
                (off, format!("sb-{name}"), name.clone())
            })
            .collect()
    };
    for (pool, range) in [("198.18.0.0-20", "big"), ("198.19.0.0-24", "small")] {
        let cidr = if range == "big" {
            "198.18.0.0/20"
        } else {
            "198.19.0.0/24"
        };
        env.pool(pool, cidr, &entries(range)).await;
    }
    futures::stream::iter(&pods)
        .for_each_concurrent(32, |(name, node, ip, nad)| {
            let env = &env;
            async move {
                env.pod_on(name, nad, Some(&[ip.as_str()]), Some(node))
                    .await;
            }
        })
        .await;
    env.start(&["--fence-settle=3s", "--sweep-interval=1s"])
        .await;
    for node in &zone {
        env.set_ready(node, "Unknown").await;
    }
    env.wait_metric(&format!("ipreclaim_unready_nodes {ZONE_NODES}"))
        .await;
    // The Ready node's kubelet stopped its pods (phase Failed) before they are deleted, as
    // kubelets do; the zone's kubelets are cut off, and its pods are force-deleted Running.
    futures::stream::iter(pods.iter().filter(|p| !zone.contains(&p.1)))
        .for_each_concurrent(32, |(name, _, _, _)| {
            let env = &env;
            async move { env.set_phase(name, "Failed").await }
        })
        .await;
    let deleting = std::time::Instant::now();
    futures::stream::iter(&pods)
        .for_each_concurrent(32, |(name, _, _, _)| {
            let env = &env;
            async move { env.delete_pod(name).await }
        })
        .await;
    let deleted_in = deleting.elapsed();
    // The Ready node's pods go, in both pools, while the zone is fenced.
    let zone_keys = |keys: Vec<String>| keys.len();
    wait_for(
        "the Ready node's addresses released in both pools",
        || async {
            env.keys("198.19.0.0-24").await.is_empty()
                && zone_keys(env.keys("198.18.0.0-20").await) == ZONE_PODS
        },
    )
    .await;
    env.wait_metric(&format!("ipreclaim_fenced_addresses {ZONE_PODS}"))
        .await;
    let fenced_in = deleting.elapsed();
    let records = Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(records, ZONE_PODS, "one fence record per fenced address");
    env.wait_sweeps(3.0).await;
    let pool = env.pools().get("198.18.0.0-20").await.unwrap();
    assert_eq!(
        pool.spec.allocations.len(),
        ZONE_PODS,
        "nothing of the zone freed"
    );
    assert!(
        pool.spec
            .allocations
            .values()
            .all(|a| a.podref.ends_with(":fenced")),
        "every zone entry fenced"
    );
    assert!(
        pool.metadata.annotations.unwrap_or_default().is_empty(),
        "the pool does not grow with fences"
    );
    // Events follow their releases through their own queue.
    wait_for("a release Event per Ready pod", || async {
        env.events("IPAddressGarbageCollected").await.len() >= READY_PODS + READY_PODS / 2
    })
    .await;
    let released = env.events("IPAddressGarbageCollected").await.len();
    assert_eq!(
        released,
        READY_PODS + READY_PODS / 2,
        "only the Ready node's released"
    );

    let fence_reads_before = fence_reads(&env.client).await;
    let back = std::time::Instant::now();
    for node in &zone {
        env.set_ready(node, "True").await;
    }
    wait_for("every fenced address freed", || async {
        env.keys("198.18.0.0-20").await.is_empty()
    })
    .await;
    let freed_in = back.elapsed();
    let fence_reads_after = fence_reads(&env.client).await;
    let (gets, lists) = (
        fence_reads_after.0 - fence_reads_before.0,
        fence_reads_after.1 - fence_reads_before.1,
    );
    let text = env.metrics_text().await;
    println!(
        "zone outage: {ZONE_PODS} pods of {ZONE_NODES} NotReady nodes + {} of a Ready node deleted in {deleted_in:.1?}; \
         Ready node's released and the zone's fenced {fenced_in:.1?} after the first delete; \
         after the nodes returned, all {ZONE_PODS} freed in {freed_in:.1?} (settle 3s); \
         writes: {} pool patches, {} creates, {} deletes",
        READY_PODS + READY_PODS / 2,
        metric_value(&text, r#"ipreclaim_api_writes_total{verb="patch"}"#),
        metric_value(&text, r#"ipreclaim_api_writes_total{verb="create"}"#),
        metric_value(&text, r#"ipreclaim_api_writes_total{verb="delete"}"#),
    );
    println!("zone outage: the settle's fresh fence reads: {lists} lists, {gets} gets");
    // Read with a list per node by its label, not a GET per fence.
    assert!(
        lists >= ZONE_NODES as f64,
        "a list of each node's fences: {lists}"
    );
    assert_eq!(gets, 0.0, "fences read one by one");
    assert!(
        freed_in >= Duration::from_secs(3),
        "not before the settle: {freed_in:?}"
    );
    wait_for("every fence record gone", || async {
        Api::<ipreclaim::api::IPFence>::namespaced(env.client.clone(), &ns)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    env.stop().await;
}

/// The apiserver's GETs and LISTs of IPFences so far (its `apiserver_request_total`).
async fn fence_reads(client: &kube::Client) -> (f64, f64) {
    let request = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(request).await.unwrap();
    let count = |verb: &str| {
        text.lines()
            .filter(|l| l.starts_with("apiserver_request_total{"))
            .filter(|l| {
                l.contains("resource=\"ipfences\"") && l.contains(&format!("verb=\"{verb}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    (count("GET"), count("LIST"))
}
