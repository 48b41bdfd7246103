//! The judgement over the index: each allocation's `rules::decide` inputs, built from what
//! the index knows of its pod, its pool's networks and its fence.

use super::Index;
use super::pods::{LiveInfo, Tombstone};
use crate::ipam::PoolEntry;
use crate::rules::{
    self, Allocation, Decision, DeletedPod, Judged, LivePod, PodKnowledge, PodPhase, PodRef,
    PoolContext, ReclaimConfig,
};

impl Index {
    /// Judges every allocation of `podref`.
    pub fn judge_podref(&self, podref: &str, config: &ReclaimConfig) -> Vec<Judged> {
        let mut out = Vec::new();
        for (pool, key) in self.pools.slots(podref) {
            if let Some(entry) = self.pools.entry(pool, key) {
                out.push(self.judge(pool, entry, config));
            }
        }
        out.sort_by(|a, b| (&a.pool, &a.entry.key).cmp(&(&b.pool, &b.entry.key)));
        out
    }

    /// Every allocation that is not kept: releases and leak candidates (the sweep's and
    /// `scan`'s work; without materializing the kept majority, which at scale is most).
    pub fn judge_leaks(&self, config: &ReclaimConfig) -> Vec<Judged> {
        let mut out = Vec::new();
        for (name, pool) in self.pools.all() {
            for entry in pool.entries.values() {
                let j = self.judge(name, entry, config);
                if !matches!(j.decision, Decision::Keep(_)) {
                    out.push(j);
                }
            }
        }
        out
    }

    /// Judges every allocation of every pool.
    pub fn judge_all(&self, config: &ReclaimConfig) -> Vec<Judged> {
        let mut out = Vec::new();
        for (name, pool) in self.pools.all() {
            for entry in pool.entries.values() {
                out.push(self.judge(name, entry, config));
            }
        }
        out
    }

    fn judge(&self, pool: &str, entry: &PoolEntry, config: &ReclaimConfig) -> Judged {
        if self.pending_fence(pool, entry).is_some() {
            // Its fence record is written, the entry not yet rewritten: the fence's.
            return Judged {
                pool: pool.to_owned(),
                decision: Decision::Keep(rules::KeepReason::FencePending),
                network: pool.to_owned(),
                pod: PodRef::from_podref(&entry.podref, String::new()),
                node: None,
                entry: entry.clone(),
            };
        }
        let live = self.pods.live(&entry.podref);
        let tombstones = self.pods.tombstones(&entry.podref);
        let deleted: Vec<DeletedPod<'_>> = tombstones
            .iter()
            .map(|t| DeletedPod {
                uid: &t.uid,
                networks: t.networks.as_deref(),
                entry_replaced: t
                    .entries
                    .iter()
                    .any(|h| h.pool == pool && h.key == entry.key && h.id != entry.id),
            })
            .collect();
        let live_uid = live.map(|l| l.uid.to_string());
        let knowledge = PodKnowledge {
            live: live.zip(live_uid.as_deref()).map(|(l, uid)| LivePod {
                uid,
                phase: if l.terminal {
                    PodPhase::Succeeded
                } else {
                    PodPhase::Running
                },
                networks: l.networks.as_deref(),
            }),
            deleted: &deleted,
            dead_sandboxes: &[],
        };
        let pool_networks = self.networks.of_pool(pool);
        let alloc = Allocation::from(entry);
        let decision = rules::decide(
            &alloc,
            &PoolContext {
                networks: pool_networks,
            },
            &knowledge,
            config,
        );
        // Name the network the pod itself recorded for this address, else the pool's NAD.
        let network = listed_network(tombstones, live, entry)
            .or_else(|| pool_networks.and_then(|n| n.first().cloned()))
            .unwrap_or_else(|| pool.to_owned());
        let (uid, node) = match decision {
            Decision::Release(rules::Reason::PodDeleted) => deleted_pod(tombstones, entry)
                .map(|t| (t.uid.clone(), t.node.clone()))
                .unwrap_or_default(),
            _ => live
                .map(|l| (l.uid.to_string(), l.node.clone()))
                .unwrap_or_default(),
        };
        Judged {
            pool: pool.to_owned(),
            entry: entry.clone(),
            decision,
            network,
            pod: PodRef::from_podref(&entry.podref, uid),
            node: node.map(|n| n.to_string()),
        }
    }
}

/// The network a pod of the entry's podref (deleted or live) recorded for its address.
fn listed_network(
    tombstones: &[Tombstone],
    live: Option<&LiveInfo>,
    entry: &PoolEntry,
) -> Option<String> {
    tombstones
        .iter()
        .filter_map(|t| t.networks.as_deref())
        .chain(live.and_then(|l| l.networks.as_deref()))
        .flatten()
        .find(|n| n.ips.contains(&entry.ip))
        .map(|n| n.name.to_string())
}

/// The newest deleted pod that held the entry's address (or listed nothing).
fn deleted_pod<'t>(tombstones: &'t [Tombstone], entry: &PoolEntry) -> Option<&'t Tombstone> {
    tombstones.iter().rev().find(|t| {
        t.networks
            .as_deref()
            .is_none_or(|n| n.iter().any(|a| a.ips.contains(&entry.ip)))
    })
}
