//! The mock-apiserver tier: the programs' in-process parts against a `tower_test` mock of the
//! apiserver, for the branches a real apiserver does not produce on demand (a refusal of one
//! entry, a pool changed between two requests, a 500, a bound reached). Seconds, no control
//! plane, no root. Beside the real-apiserver tests (`--test controller` and the others), never
//! instead of them: the mock answers as the test says, the real one as Kubernetes does.

mod apiserver;
mod fixtures;
mod pod_lists;
mod pool;
mod pool_writes;
mod reservations;
mod sweep;
