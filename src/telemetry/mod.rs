//! Metrics registry, the /metrics /healthz /readyz server, logging setup.
//!
//! Imports the pure modules below it; `release`, the programs and the watch retry import it.

// Macros for the metrics modules below: defined before them, so in scope there.

/// Registers each metric in registry `r`: `name, help, metric;` for each, in order (the order of
/// /metrics). The registry holds a clone, which shares the metric's value.
macro_rules! register_metrics {
    ($r:expr; $($name:literal, $help:literal, $metric:expr;)+) => {
        $($r.register($name, $help, $metric.clone());)+
    };
}

/// Declares each `Name { field }`: the label set of one label `field` (its value a string),
/// with the `From<String>` that `metrics::labels` and `metrics::zero` build it by.
macro_rules! one_label {
    ($($(#[$doc:meta])* $name:ident { $field:ident })+) => {$(
        $(#[$doc])*
        #[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
        pub struct $name {
            #[doc = concat!("The `", stringify!($field), "` value.")]
            pub $field: String,
        }

        impl From<String> for $name {
            fn from($field: String) -> Self {
                $name { $field }
            }
        }
    )+};
}

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
