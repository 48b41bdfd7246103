//! Metrics registry, the /metrics /healthz /readyz server, and logging setup.

pub mod logging;
pub mod metrics;
pub mod server;

pub use logging::{LogFormat, init_logging};
pub use metrics::ControllerMetrics;
pub use server::{Health, serve};
