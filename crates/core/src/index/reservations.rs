//! Reservations (`OverlappingRangeIPReservation`) by name, with the network-name prefixes their
//! names carry: a release looks its reservations up by name instead of scanning them all.

use std::collections::HashMap;
use std::net::IpAddr;

use super::uid::Uid;
use crate::api::{ObjectId, OverlappingRangeIPReservation};
use crate::ipam::{reservation_name, reservation_prefixes};

/// A reservation, stripped (a boxed string: a third smaller than a `String`, and the uid in
/// its 16 bytes: 100,000 times).
#[derive(Debug, Clone)]
pub struct ReservationInfo {
    /// Its uid (for the delete precondition).
    pub uid: Uid,
    /// The podref it names.
    pub podref: Box<str>,
}

/// A reservation by name, with its uid and podref.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedReservation {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// The podref it names.
    pub podref: String,
}

impl NamedReservation {
    /// Its name and uid (a delete's precondition).
    pub fn id(&self) -> ObjectId {
        ObjectId {
            name: self.name.clone(),
            uid: self.uid.clone(),
        }
    }
}

/// Reservations.
#[derive(Debug, Default)]
pub struct ReservationIndex {
    by_name: HashMap<Box<str>, ReservationInfo>,
    /// The `<network_name>` parts of reservation names, with how many names have each.
    prefixes: HashMap<String, usize>,
}

impl ReservationIndex {
    /// Records a reservation.
    pub fn upsert(&mut self, r: &OverlappingRangeIPReservation) {
        let Some(name) = &r.metadata.name else { return };
        let info = ReservationInfo {
            uid: Uid::of(r.metadata.uid.as_deref().unwrap_or_default()),
            podref: r.spec.podref.as_str().into(),
        };
        if self.by_name.insert(name.as_str().into(), info).is_none() {
            for p in reservation_prefixes(name) {
                *self.prefixes.entry(p.to_owned()).or_default() += 1;
            }
        }
    }

    /// Forgets a reservation.
    pub fn remove(&mut self, name: &str) {
        if self.by_name.remove(name).is_none() {
            return;
        }
        for p in reservation_prefixes(name) {
            if let Some(n) = self.prefixes.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    self.prefixes.remove(p);
                }
            }
        }
    }

    /// Reservations of `podref` for `ip`: named `[<network_name>-]<normalized ip>`, matched by
    /// computing the IP's name forward (bare, and with each prefix seen).
    pub fn of(&self, podref: &str, ip: IpAddr) -> Vec<ObjectId> {
        let bare = reservation_name(ip, None);
        let prefixed = self.prefixes.keys().map(|p| reservation_name(ip, Some(p)));
        std::iter::once(bare)
            .chain(prefixed)
            .filter_map(|name| {
                let r = self.by_name.get(name.as_str())?;
                (&*r.podref == podref).then(|| ObjectId {
                    name,
                    uid: r.uid.to_string(),
                })
            })
            .collect()
    }

    /// The reservation named `name`.
    pub fn get(&self, name: &str) -> Option<&ReservationInfo> {
        self.by_name.get(name)
    }

    /// Every reservation.
    pub fn iter(&self) -> impl Iterator<Item = NamedReservation> + '_ {
        self.by_name.iter().map(|(name, r)| NamedReservation {
            name: name.to_string(),
            uid: r.uid.to_string(),
            podref: r.podref.to_string(),
        })
    }

    /// Every reservation's name.
    pub fn names(&self) -> Vec<String> {
        self.by_name.keys().map(|n| n.to_string()).collect()
    }

    /// Whether a network-name prefix is known (tests).
    pub fn prefix_count(&self, prefix: &str) -> usize {
        self.prefixes.get(prefix).copied().unwrap_or(0)
    }
}
