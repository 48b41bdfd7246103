//! Test support for ipreclaim: real parts, started on this machine.
//!
//! - [`ControlPlane`]: kube-apiserver + etcd built from their Go modules (`scripts/setup.sh`),
//!   one per test process via [`ControlPlane::shared`], a namespace per test.
//! - [`Containerd`]: a real containerd with a locally built sandbox image and an IP-only CNI
//!   plugin, for the node agent's tests.
//! - [`Node`]: a real node (kubelet, kube-controller-manager, kube-scheduler, containerd with
//!   Multus and whereabouts) on a control plane of its own, for the end-to-end scenarios.
//! - [`prometheus::Prometheus`]: Debian's Prometheus scraping what a test gives it, with
//!   `promtool` beside it.
//!
//! What cannot be found or started is an error that says how to get it; nothing is skipped.

pub mod containerd;
pub mod controlplane;
pub mod docs;
pub mod events;
pub mod faultproxy;
pub mod fixtures;
pub mod helm;
pub mod host;
pub mod image;
pub mod link;
pub mod node;
pub mod poll;
pub mod procs;
pub mod program;
pub mod prometheus;
pub mod whereabouts;

pub use containerd::Containerd;
pub use controlplane::ControlPlane;
pub use node::Node;

/// Runs each scenario `async fn $name(env: $env)` of the table twice: as admin
/// (`$env::new($prefix)`), and with the program acting through the chart's ServiceAccount
/// (`$env::new_chart($prefix)`), which proves the chart's RBAC is enough. Expands to a module
/// `$name` with two `#[tokio::test]`s for each:
///
/// ```text
/// testenv::as_admin_and_as_the_chart!(Env {
///     a_scenario: "ns-prefix",
/// });
/// ```
#[macro_export]
macro_rules! as_admin_and_as_the_chart {
    ($env:ident { $($name:ident: $prefix:literal),+ $(,)? }) => {$(
        mod $name {
            #[tokio::test]
            async fn as_admin() {
                super::$name(super::$env::new($prefix).await).await
            }

            #[tokio::test]
            async fn as_the_charts_service_account() {
                super::$name(super::$env::new_chart($prefix).await).await
            }
        }
    )+};
}
