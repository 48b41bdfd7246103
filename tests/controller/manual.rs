//! The manual commands beside a running controller: its index follows what they write (its
//! gauges drop with them) and it writes nothing after them, nor counts a failure.

use crate::harness::{Env, cli};

#[tokio::test]
async fn the_controllers_index_follows_a_manual_unfence_and_a_forced_release() {
    let mut env = Env::new("ctl-manual").await;
    let node = env.fence_node("Unknown").await;
    // The node never settles within the test: only the operator lifts the fence. A range of
    // its own: the commands refuse an address any live pod lists, and other tests' pods list
    // 192.0.2.x.
    env.fenced_web_0_in("198.18.9", &node, &["--fence-settle=1h"])
        .await;
    let pool = format!("{}/198.18.9.0-24", env.ns);
    env.wait_metric("ipreclaim_fenced_addresses 1").await;
    env.wait_metric(&format!(r#"ipreclaim_pool_fenced{{pool="{pool}"}} 1"#))
        .await;
    env.wait_metric(&format!(r#"ipreclaim_pool_allocated{{pool="{pool}"}} 2"#))
        .await;

    // Its node is still NotReady: the operator overrides that.
    cli(&env, "unfence", &["--ip", "198.18.9.10", "--force"]);
    env.wait_keys("198.18.9.0-24", &["11"]).await;
    env.wait_metric("ipreclaim_fenced_addresses 0").await;
    env.wait_metric(&format!(r#"ipreclaim_pool_fenced{{pool="{pool}"}} 0"#))
        .await;
    env.wait_metric(&format!(r#"ipreclaim_pool_allocated{{pool="{pool}"}} 1"#))
        .await;

    // db-0 lives and lists 198.18.9.11: only --force frees it, under its own reason code.
    cli(&env, "release", &["--ip", "198.18.9.11", "--force"]);
    env.wait_keys("198.18.9.0-24", &[]).await;
    env.wait_metric(&format!(r#"ipreclaim_pool_allocated{{pool="{pool}"}} 0"#))
        .await;
    let released = env.wait_events("IPAddressGarbageCollected").await;
    assert!(
        released
            .iter()
            .any(|(pod, _, note)| pod == "db-0" && note.contains("released by hand")),
        "{released:?}"
    );

    // Two sweeps later the controller has written nothing of its own and failed nothing.
    env.wait_sweeps(2.0).await;
    let metrics = env.metrics_text().await;
    for line in [
        r#"ipreclaim_releases_total{reason="PodDeleted"} 0"#,
        r#"ipreclaim_releases_total{reason="Forced"} 0"#,
        "ipreclaim_fenced_addresses 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("ipreclaim_release_failures_total{") && !l.ends_with(" 0")),
        "{metrics}"
    );
    env.finish(&node).await;
}
