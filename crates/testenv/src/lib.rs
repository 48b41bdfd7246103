//! Test support for ipreclaim: real parts, started on this machine.
//!
//! - [`ControlPlane`]: kube-apiserver + etcd built from their Go modules (`scripts/setup.sh`),
//!   one per test process via [`ControlPlane::shared`], a namespace per test.
//! - [`Containerd`]: a real containerd with a locally built sandbox image and an IP-only CNI
//!   plugin, for the node agent's tests.
//!
//! What cannot be found or started is an error that says how to get it; nothing is skipped.

pub mod containerd;
pub mod controlplane;
pub mod fixtures;
pub mod helm;
pub mod poll;
pub mod procs;

pub use containerd::Containerd;
pub use controlplane::ControlPlane;
