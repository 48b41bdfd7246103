//! Reports: Kubernetes Events with whereabouts' reasons (`events`, written through
//! `recorder`), the audit trail (`audit`), and what a dry run reported (`dry_run`).

pub mod audit;
pub mod dry_run;
pub mod events;
pub mod recorder;
