//! The one re-list driver. A watch reports no Delete for objects that vanished during a gap:
//! what the index knew that a re-list (from `Begin` to `Done`) did not list again is gone. Every
//! kind is fed through [`Relist::step`], so that diff is written once.

use std::collections::HashSet;
use std::hash::Hash;
use std::time::Instant;

/// One step of a watch, as the index sees it (the shell converts the watcher's events).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<T> {
    /// A re-list begins.
    Begin,
    /// An object listed by the re-list.
    Listed(T),
    /// An object added or changed.
    Changed(T),
    /// An object deleted (its final state).
    Deleted(T),
    /// The re-list is complete.
    Done,
}

/// A kind of object the index holds, and how one observation of it changes the store.
pub trait Kind {
    /// The store the kind lives in (the index, or a view of its own).
    type Store;
    /// The object as watched.
    type Object;
    /// What identifies an object across a re-list.
    type Key: Eq + Hash + Clone;
    /// What an observation produced that the shell acts on (a tombstone, a transition).
    type Effect;

    /// The object's key (`None`: it cannot be identified and is ignored).
    fn key(object: &Self::Object) -> Option<Self::Key>;
    /// Records an object added, changed or listed.
    fn apply(
        store: &mut Self::Store,
        key: &Self::Key,
        object: Self::Object,
        now: Instant,
    ) -> Option<Self::Effect>;
    /// Records an object's deletion, from its final state.
    fn delete(
        store: &mut Self::Store,
        key: &Self::Key,
        object: Self::Object,
        now: Instant,
    ) -> Option<Self::Effect>;
    /// Forgets an object the re-list did not list again (no final state is known).
    fn vanish(store: &mut Self::Store, key: &Self::Key, now: Instant) -> Option<Self::Effect>;
    /// The keys the store knows (usable or not).
    fn known(store: &Self::Store) -> Vec<Self::Key>;
    /// The re-list is complete (after the vanished are forgotten).
    fn listed(_store: &mut Self::Store) {}
}

/// What one step changed.
#[derive(Debug)]
pub struct Applied<K: Kind> {
    /// Effects, in order.
    pub effects: Vec<K::Effect>,
    /// Keys found gone by the re-list that just completed.
    pub vanished: Vec<K::Key>,
}

impl<K: Kind> Default for Applied<K> {
    fn default() -> Self {
        Applied {
            effects: Vec::new(),
            vanished: Vec::new(),
        }
    }
}

/// Re-list bookkeeping for one watch of kind `K`.
pub struct Relist<K: Kind> {
    /// Keys the store knew at `Begin` that the re-list has not listed yet (`None` outside a
    /// re-list). Only these can vanish: so the first list, into an empty store, keeps no set
    /// at all (a set of every key listed, 100,000 pods, would cost megabytes for nothing and
    /// leave its holes all over the heap).
    unlisted: Option<HashSet<K::Key>>,
}

impl<K: Kind> Default for Relist<K> {
    fn default() -> Self {
        Relist { unlisted: None }
    }
}

impl<K: Kind> Relist<K> {
    /// Applies one step to `store`.
    pub fn step(
        &mut self,
        store: &mut K::Store,
        step: Step<K::Object>,
        now: Instant,
    ) -> Applied<K> {
        let mut out = Applied::default();
        match step {
            Step::Begin => self.unlisted = Some(K::known(store).into_iter().collect()),
            Step::Listed(object) | Step::Changed(object) => {
                let Some(key) = K::key(&object) else {
                    return out;
                };
                if let Some(unlisted) = &mut self.unlisted {
                    unlisted.remove(&key);
                }
                out.effects.extend(K::apply(store, &key, object, now));
            }
            Step::Deleted(object) => {
                if let Some(key) = K::key(&object) {
                    out.effects.extend(K::delete(store, &key, object, now));
                }
            }
            Step::Done => {
                // Dropped, not cleared: a cleared set keeps its table (megabytes at scale).
                // A `Done` without its `Begin` says nothing of what vanished.
                let unlisted = self.unlisted.take().unwrap_or_default();
                if !unlisted.is_empty() {
                    // Known then and now, and not listed: gone. (A key known at `Begin` and
                    // forgotten since, a pod replaced under its name, has nothing to forget.)
                    for key in K::known(store) {
                        if unlisted.contains(&key) {
                            out.effects.extend(K::vanish(store, &key, now));
                            out.vanished.push(key);
                        }
                    }
                }
                K::listed(store);
            }
        }
        out
    }
}
