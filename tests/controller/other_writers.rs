//! A second cleaner in the cluster (whereabouts' ip-reconciler, the telekom fork's operator)
//! frees the entries ipreclaim fenced or cooled: each removal by a write that is not
//! ipreclaim's gets a Warning `MarkedEntryRemovedByOtherWriter` on the IPPool (and on the
//! fence record) and is counted; ipreclaim's own lifts and ends are not. The other writer here
//! removes entries as whereabouts' reconciler does: a JSON patch pinned to the resourceVersion.

use kube::api::{Patch, PatchParams};
use serde_json::json;
use testenv::poll::wait_for;

use crate::harness::{Env, FENCED, warnings};

const REASON: &str = "MarkedEntryRemovedByOtherWriter";
const POOL: &str = "192.0.2.0-24";

impl Env {
    /// Removes the entry at `key` of `pool` as another cleaner does (whereabouts' `Update`: a
    /// JSON patch that tests the resourceVersion it read, then removes the entry).
    async fn remove_as_other_writer(&self, pool: &str, key: &str) {
        let read = self.pools().get(pool).await.unwrap();
        let rv = read.metadata.resource_version.unwrap();
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "remove", "path": format!("/spec/allocations/{key}")},
        ]))
        .unwrap();
        self.pools()
            .patch(pool, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
            .unwrap_or_else(|e| panic!("the other writer removes {pool}/{key}: {e}"));
    }

    /// Waits until the Warnings about the entry at `key` are on the pool and, when `fence`,
    /// on its fence record too; returns every `MarkedEntryRemovedByOtherWriter` Warning.
    async fn wait_other_writer_warned(&self, key: &str, fence: bool) -> Vec<(String, String, i32)> {
        self.wait_other_writer_warned_in(POOL, key, fence).await
    }

    /// [`wait_other_writer_warned`](Self::wait_other_writer_warned) about `pool`'s entry.
    async fn wait_other_writer_warned_in(
        &self,
        pool: &str,
        key: &str,
        fence: bool,
    ) -> Vec<(String, String, i32)> {
        let record = ipreclaim::ipam::fence::fence_object_name(pool, key);
        let entry = format!("entry {key} (");
        let want: Vec<&str> = if fence {
            vec![pool, record.as_str()]
        } else {
            vec![pool]
        };
        testenv::poll::wait_seen(
            &format!("{REASON} Warnings about entry {key} on {want:?}"),
            || warnings(self, REASON),
            |seen| {
                want.iter()
                    .all(|o| seen.iter().any(|(n, m, _)| n == o && m.contains(&entry)))
            },
            |seen| format!("{seen:?}"),
        )
        .await
    }
}

/// The fenced web-0 (node silent: Ready Unknown) loses its entry to another cleaner: a Warning
/// on the pool and one on the IPFence naming the entry, the deleted pod, the node and the
/// likely cleaners, and the count; after `--other-writer-wait` only, since a returning kubelet's
/// own CNI DEL would have its node report within it.
#[tokio::test]
async fn a_second_cleaner_freeing_a_fence_of_a_silent_node_is_warned_and_counted() {
    let (mut env, node, _) =
        Env::with_web_0_seen_fenced("otherw-fence", &["--other-writer-wait=2s"]).await;
    env.remove_as_other_writer(POOL, "10").await;
    let removed = std::time::Instant::now();
    let seen = env.wait_other_writer_warned("10", true).await;
    assert!(
        removed.elapsed() >= std::time::Duration::from_secs(2),
        "judged only after the wait: {seen:?}"
    );
    assert_eq!(seen.len(), 2, "{seen:?}");
    let ns = &env.ns;
    for (_, message, _) in &seen {
        for want in [
            format!(
                "fenced entry 10 (192.0.2.10, deleted pod {ns}/web-0) was removed by a write that is not ipreclaim's while node {node} was not heard from"
            ),
            "ip-reconciler".to_string(),
            "Migrating from whereabouts".to_string(),
        ] {
            assert!(message.contains(&want), "{want:?} in {message}");
        }
    }
    env.wait_metric(r#"ipreclaim_marked_entries_removed_by_others_total{kind="fenced"} 1"#)
        .await;
    env.wait_metric(r#"ipreclaim_marked_entries_removed_by_others_total{kind="cooling"} 0"#)
        .await;
    env.finish(&node).await;
}

/// Cooling entries: ipreclaim ends a due one itself (its signed write: no Warning), and another
/// writer's removal of one still cooling is warned at once (no CNI DEL can match its marker).
/// That Warning comes after ipreclaim's own end was seen, so none about the own end means none.
#[tokio::test]
async fn a_second_cleaner_freeing_a_cooling_entry_is_warned_and_ipreclaims_own_end_is_not() {
    let mut env = Env::new("otherw-cooling").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    let due = "ipreclaim-cooldown:2026-01-01T00:00:00Z";
    let later = "ipreclaim-cooldown:2099-01-01T00:00:00Z";
    env.pool(
        POOL,
        "192.0.2.0/24",
        &[(3, due, "old-0:cooldown"), (4, later, "old-1:cooldown")],
    )
    .await;
    env.start(&["--other-writer-wait=30s"]).await;
    env.wait_keys(POOL, &["4"]).await;
    env.remove_as_other_writer(POOL, "4").await;
    let seen = env.wait_other_writer_warned("4", false).await;
    let ns = &env.ns;
    assert_eq!(
        seen.len(),
        1,
        "none about ipreclaim's own end of 3: {seen:?}"
    );
    assert!(
        seen[0].1.starts_with(&format!("cooling entry 4 (192.0.2.4, released from pod {ns}/old-1) was removed by a write that is not ipreclaim's: the address returns to the pool before its cooldown ends")),
        "{seen:?}"
    );
    env.wait_metric(r#"ipreclaim_marked_entries_removed_by_others_total{kind="cooling"} 1"#)
        .await;
    // The own end signed the pool.
    let pool = env.pools().get(POOL).await.unwrap();
    let annotations = pool.metadata.annotations.unwrap_or_default();
    assert!(
        annotations.contains_key(ipreclaim::ipam::own_write::OWN_WRITE_ANNOTATION),
        "{annotations:?}"
    );
    env.stop().await;
}

/// ipreclaim lifts web-0's fence on its node agent's word while the node is still silent
/// (Ready Unknown): its own signed write, no Warning. Then db-0, deleted from the same node,
/// is fenced and another cleaner frees it: warned, and only that one.
#[tokio::test]
async fn ipreclaims_own_lift_while_the_node_is_silent_is_not_warned() {
    let (mut env, node, uid) = Env::with_web_0_seen_fenced(
        "otherw-own",
        &["--fence-settle=1h", "--other-writer-wait=1s"],
    )
    .await;
    let (name, report) = env.agent_report(POOL, "10", &node, &uid).await;
    env.report_gone(&name, report).await;
    env.wait_keys(POOL, &["11"]).await;
    let released = env
        .wait_one_event("IPAddressGarbageCollected", "web-0", &uid)
        .await;
    assert!(
        released.contains("the node agent on its node saw"),
        "{released}"
    );

    let db_uid = env.pods().get("db-0").await.unwrap().metadata.uid.unwrap();
    env.delete_pod("db-0").await;
    wait_for("db-0 fenced", || async {
        env.events(FENCED).await.iter().any(|e| e.1 == db_uid)
            && env.entry_and_fence(POOL, "11").await.0 == Some(format!("{}/db-0:fenced", env.ns))
    })
    .await;
    env.remove_as_other_writer(POOL, "11").await;
    let seen = env.wait_other_writer_warned("11", true).await;
    assert_eq!(
        seen.len(),
        2,
        "only db-0's entry 11, on pool and fence: {seen:?}"
    );
    env.wait_metric(r#"ipreclaim_marked_entries_removed_by_others_total{kind="fenced"} 1"#)
        .await;
    env.finish(&node).await;
}

/// An operator lifts web-0's fence by hand (`kubectl ipreclaim unfence --force`, another process
/// with its own credentials) while the controller runs and the node is silent: ipreclaim's own
/// write, signed like the controller's, no Warning. db-0's fence freed by another cleaner after
/// it is warned, and alone.
#[tokio::test]
async fn a_manual_unfence_is_ipreclaims_own_and_not_warned() {
    let mut env = Env::new("otherw-manual").await;
    let node = env.fence_node("Unknown").await;
    // A range of its own: the commands refuse an address any live pod lists cluster-wide.
    let pool = "198.18.77.0-24";
    env.fenced_web_0_in(
        "198.18.77",
        &node,
        &["--fence-settle=1h", "--other-writer-wait=1s"],
    )
    .await;
    crate::harness::cli(&env, "unfence", &["--ip", "198.18.77.10", "--force"]);
    env.wait_keys(pool, &["11"]).await;
    let db_uid = env.pods().get("db-0").await.unwrap().metadata.uid.unwrap();
    env.delete_pod("db-0").await;
    wait_for("db-0 fenced", || async {
        env.events(FENCED).await.iter().any(|e| e.1 == db_uid)
            && env.entry_and_fence(pool, "11").await.0 == Some(format!("{}/db-0:fenced", env.ns))
    })
    .await;
    env.remove_as_other_writer(pool, "11").await;
    let seen = env.wait_other_writer_warned_in(pool, "11", true).await;
    assert_eq!(
        seen.len(),
        2,
        "only db-0's entry 11, on pool and fence: {seen:?}"
    );
    env.finish(&node).await;
}

/// The returning kubelet's own CNI DEL frees the fenced entry as its node reports again: not
/// another writer's. Another cleaner's removal of a cooling entry after it is warned, and it
/// alone: the passes judge in order, and the DEL's verdict needs no wait (its node reports).
#[tokio::test]
async fn the_returning_kubelets_cni_del_of_a_fenced_entry_is_not_warned() {
    let (mut env, node, _) = Env::with_web_0_seen_fenced(
        "otherw-cnidel",
        &["--fence-settle=1h", "--other-writer-wait=1s"],
    )
    .await;
    let cooling = json!({"id": "ipreclaim-cooldown:2099-01-01T00:00:00Z",
                         "podref": format!("{}/old-0:cooldown", env.ns), "ifname": "net1"});
    env.merge_pool(POOL, json!({"spec": {"allocations": {"12": cooling}}}))
        .await;
    env.set_ready(&node, "True").await;
    // The controller saw the node Ready again: db-0, deleted now, is fenced as settling.
    let db_uid = env.pods().get("db-0").await.unwrap().metadata.uid.unwrap();
    env.delete_pod("db-0").await;
    wait_for("db-0 fenced while its node settles", || async {
        env.events(FENCED)
            .await
            .iter()
            .any(|e| e.1 == db_uid && e.2.contains("Ready=True again"))
    })
    .await;
    // The kubelet stops web-0's sandbox: whereabouts' DEL removes its entry.
    env.remove_as_other_writer(POOL, "10").await;
    env.remove_as_other_writer(POOL, "12").await;
    let seen = env.wait_other_writer_warned("12", false).await;
    assert_eq!(
        seen.len(),
        1,
        "the CNI DEL of entry 10 is not warned: {seen:?}"
    );
    env.wait_metric(r#"ipreclaim_marked_entries_removed_by_others_total{kind="fenced"} 0"#)
        .await;
    env.finish(&node).await;
}

/// Another cleaner frees web-0's fence and the leader is SIGKILLed right after, within
/// `--other-writer-wait`: the standby, which saw the removal too and kept it waiting, reports it
/// once it leads.
#[tokio::test]
async fn a_removal_whose_wait_spans_a_change_of_leader_is_reported_by_the_new_leader() {
    use crate::harness::{controller_process, holder_pid, lease};
    let env = Env::new("otherw-takeover").await;
    let node = env.fence_node("Unknown").await;
    env.nad("macvlan", "192.0.2.0/24").await;
    env.pool(POOL, "192.0.2.0/24", &[(10, "sb-web-0", "web-0")])
        .await;
    let uid = env
        .pod_on("web-0", "macvlan", Some(&["192.0.2.10"]), Some(&node))
        .await;
    let lease_ns = format!("--lease-namespace={}", env.ns);
    let flags = [
        "--leader-election=true",
        "--lease-duration=4s",
        "--other-writer-wait=8s",
        &lease_ns,
    ];
    let mut replicas = [
        controller_process(&env, &flags),
        controller_process(&env, &flags),
    ];
    wait_for("a leader", || async { lease(&env).await.is_some() }).await;
    env.delete_pod("web-0").await;
    env.wait_one_event(FENCED, "web-0", &uid).await;
    wait_for("web-0's entry fenced", || async {
        env.entry_and_fence(POOL, "10").await.0 == Some(format!("{}/web-0:fenced", env.ns))
    })
    .await;
    let (holder, _) = lease(&env).await.unwrap();
    let leader = replicas
        .iter()
        .position(|c| c.id() == holder_pid(&holder))
        .unwrap();
    env.remove_as_other_writer(POOL, "10").await;
    replicas[leader].kill().unwrap();
    replicas[leader].wait().unwrap();
    let seen = env.wait_other_writer_warned("10", true).await;
    let (new_holder, _) = lease(&env).await.unwrap();
    assert_ne!(new_holder, holder, "reported by the new leader: {seen:?}");
    drop(replicas);
    env.delete_node(&node).await;
}
