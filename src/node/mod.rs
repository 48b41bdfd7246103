//! The node agent's parts. So far: the CRI pod source the PLEG relists.

pub mod cri;
