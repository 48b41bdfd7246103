//! Metrics registry, the /metrics /healthz /readyz server, and logging setup.

pub mod logging;
pub mod metrics;
pub mod node_metrics;
pub mod server;

pub use logging::{LogFormat, init_logging};
pub use metrics::{ControllerMetrics, WriteMetrics};
pub use node_metrics::NodeMetrics;
pub use server::{Health, serve};
