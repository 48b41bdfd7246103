//! `ipreclaim controller` against the real kube-apiserver: each test runs a controller in
//! process (or as its own process, where it must be killed), with its own namespace as the
//! whereabouts namespace. The harness is [`harness::Env`]; the scenarios are grouped by family.

#[path = "../support/mod.rs"]
mod support;

mod harness;

mod bad_input;
mod cooldown;
mod deletion;
mod duplicates;
mod fencing;
mod forged;
mod leadership;
mod manual;
mod observability;
mod other_writers;
mod outages;
mod pod_lists;
mod reservations;
mod sweep;
mod unseen;
mod zone_outage;
