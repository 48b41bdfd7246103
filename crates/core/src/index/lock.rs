//! The index behind its lock. Acquisitions are counted: how often the deletion path and the
//! watches take the lock is a number the benchmarks print (and /metrics shows).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LockResult, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::Index;

/// The index shared by the watches, the workers and the writer.
pub type SharedIndex = Arc<IndexLock>;

/// A read-write lock over the [`Index`] that counts its acquisitions.
#[derive(Debug, Default)]
pub struct IndexLock {
    lock: RwLock<Index>,
    reads: AtomicU64,
    writes: AtomicU64,
}

/// Acquisitions so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Acquisitions {
    /// Shared (read) acquisitions.
    pub reads: u64,
    /// Exclusive (write) acquisitions.
    pub writes: u64,
}

impl IndexLock {
    /// A shared look at the index.
    pub fn read(&self) -> LockResult<RwLockReadGuard<'_, Index>> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.lock.read()
    }

    /// The index, to change.
    pub fn write(&self) -> LockResult<RwLockWriteGuard<'_, Index>> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.lock.write()
    }

    /// Acquisitions so far.
    pub fn acquisitions(&self) -> Acquisitions {
        Acquisitions {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_acquisition_is_counted_by_mode() {
        let ix = IndexLock::default();
        drop(ix.read().unwrap());
        drop(ix.read().unwrap());
        drop(ix.write().unwrap());
        assert_eq!(
            ix.acquisitions(),
            Acquisitions {
                reads: 2,
                writes: 1
            }
        );
    }
}
