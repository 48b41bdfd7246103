//! Metrics registry, the /metrics /healthz /readyz server, logging setup.
//!
//! Imports the pure modules below it; `release`, the programs and the watch retry import it.

pub mod logging;
pub mod metrics;
pub mod node_metrics;
pub mod process;
pub mod repeats;
pub mod server;

pub use logging::{LogFormat, init_logging, init_logging_at};
pub use metrics::{ControllerMetrics, WriteMetrics};
pub use node_metrics::NodeMetrics;
pub use server::{Health, serve};
