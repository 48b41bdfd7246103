//! Where the core reads the time: the programs pass their own clock (a test's is fake), so
//! that a rule measured on this process's monotonic clock can be tested without waiting.

use std::fmt;
use std::time::Instant;

/// This process's monotonic clock, as the core reads it.
pub trait Now: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The real monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemNow;

impl Now for SystemNow {
    fn now(&self) -> Instant {
        Instant::now()
    }
}
