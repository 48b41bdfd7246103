//! Reservations and pool entries out of step, as the index sees them (the sweep waits its grace
//! and the writer reads fresh before it acts):
//! - a reservation left behind for a live pod of its name: no entry holds its address and the
//!   pod does not list it (a delete that failed once while the name lives on, a StatefulSet's;
//!   whereabouts #712). It blocks the address network-wide for the pod's whole life.
//! - a live entry whose reservation is missing (a crash between whereabouts' pool write and its
//!   create, or inside the looks after our delete): an overlapping range of its network can
//!   hand the address out again.

use std::net::IpAddr;

use super::{Index, NamedReservation};
use crate::ipam::naming::reservation_readings;
use crate::ipam::{PoolEntry, reservation_name};

/// A reservation left behind for a live pod of its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftBehind {
    /// The reservation.
    pub reservation: NamedReservation,
    /// The uid of the live pod it was judged against (a pod recreated since is judged anew).
    pub pod_uid: String,
}

/// A live entry of a network with overlapping ranges whose reservation is missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingReservation {
    /// The entry's pool.
    pub pool: String,
    /// The entry.
    pub entry: PoolEntry,
    /// The reservation whereabouts would have made for it.
    pub name: String,
    /// The uid of its pod when that pod's network-status lists the address: the CNI ADD that
    /// wrote the entry has returned, so whereabouts will not create the reservation any more
    /// (its v0.9.4 skips the create for good when a retried pool update ends on another
    /// address than its first try). `None`: no network-status yet, an ADD may be in flight.
    pub listed_by: Option<String>,
}

impl Index {
    /// Reservations left behind for live pods (see the module). Kept, never listed: a pod
    /// without network-status (an allocation may be in flight), a pod that lists the address
    /// on any network, any entry holding the address in a pool of the reservation's network
    /// (whoever's, fenced and cooling ones too), the pod's own entry of it anywhere, a fenced
    /// or cooling pod of that name, a name that reads as no address, and one whose network has
    /// no pool holding the address known here (there is nothing to read fresh).
    pub fn left_behind_reservations(&self) -> Vec<LeftBehind> {
        let fenced = self.fenced_podrefs();
        let cooling = self.cooling_podrefs();
        self.reservations
            .iter()
            .filter_map(|r| {
                let live = self.pods.live(&r.podref)?;
                let networks = live.networks.as_ref()?;
                if fenced.contains(r.podref.as_str()) || cooling.contains(r.podref.as_str()) {
                    return None;
                }
                let readings = reservation_readings(&r.name);
                let lists = |ip: IpAddr| networks.iter().any(|n| n.ips.contains(&ip));
                let mut pools_read = 0;
                for (network, ip) in readings {
                    if lists(ip) || self.pools.holder(&r.podref, ip).is_some() {
                        return None;
                    }
                    for pool in self.pools_of_reservation(network, ip) {
                        if self.address_held(&pool, ip) {
                            return None;
                        }
                        pools_read += 1;
                    }
                }
                (pools_read > 0).then(|| LeftBehind {
                    pod_uid: live.uid.to_string(),
                    reservation: r,
                })
            })
            .collect()
    }

    /// Whether any entry of `pool` (live, fenced or cooling) holds `ip`.
    fn address_held(&self, pool: &str, ip: IpAddr) -> bool {
        let Some(p) = self.pools.get(pool) else {
            return false;
        };
        p.entries.values().any(|e| e.ip == ip)
            || p.marked.values().any(|e| e.ip == ip)
            || p.cooling.values().any(|c| c.entry.ip == ip)
    }

    /// The pools (with the address) where an allocation a reservation named `name` stands for
    /// can be: for each way its name reads, its network's pools whose range holds the address.
    pub fn reservation_pools(&self, name: &str) -> Vec<(String, IpAddr)> {
        reservation_readings(name)
            .into_iter()
            .flat_map(|(network, ip)| {
                let pools = self.pools_of_reservation(network, ip);
                pools.into_iter().map(move |pool| (pool, ip))
            })
            .collect()
    }

    /// Live entries whose reservation is missing (see the module): in pools whose every
    /// network has `enable_overlapping_ranges` (and one `network_name`), of live pods that
    /// list the address or have no network-status yet (an entry its pod does not list is a
    /// leak the sweep judges; a terminal pod's too), with no reservation of that name at all
    /// (one naming another pod is never replaced).
    pub fn missing_reservations(&self) -> Vec<MissingReservation> {
        let mut out = Vec::new();
        for (name, pool) in self.pools.all() {
            let Some(network) = self.networks.reservation_network(name) else {
                continue;
            };
            for e in pool.entries.values() {
                let Some(live) = self.pods.live(&e.podref) else {
                    continue;
                };
                let listed = live
                    .networks
                    .as_ref()
                    .map(|n| n.iter().any(|n| n.ips.contains(&e.ip)));
                if live.terminal || listed == Some(false) {
                    continue;
                }
                let reservation = reservation_name(e.ip, network);
                if self.reservations.get(&reservation).is_none() {
                    out.push(MissingReservation {
                        pool: name.clone(),
                        entry: e.clone(),
                        name: reservation,
                        listed_by: (listed == Some(true)).then(|| live.uid.to_string()),
                    });
                }
            }
        }
        out.sort_by(|a, b| (&a.pool, a.entry.offset).cmp(&(&b.pool, b.entry.offset)));
        out
    }
}
