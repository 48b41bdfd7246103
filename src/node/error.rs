//! What goes wrong in the node agent's own work: reading what a dead sandbox held, writing its
//! releases, reporting a fenced pod's sandboxes gone.

use crate::release::ReleaseError;

/// A failure of the node agent's release or fence report (retried; its text goes into the
/// Warning Event when retries run out).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    /// A targeted read (the pod, a NAD, a node slice, a pool) failed.
    #[error("{what}: {message}")]
    Read {
        /// What was read.
        what: String,
        /// What the API said.
        message: String,
    },
    /// The container runtime could not confirm a sandbox's death (nothing is released).
    #[error("asking the runtime about sandbox {sandbox}: {message}")]
    Runtime {
        /// The sandbox.
        sandbox: String,
        /// What the runtime said.
        message: String,
    },
    /// The pool writer failed (what was written stays written).
    #[error(transparent)]
    Write(#[from] ReleaseError),
    /// A fence report's patch could not be built.
    #[error("report patch: {0}")]
    ReportPatch(String),
    /// A fence report was not written.
    #[error("{0}")]
    Report(String),
    /// The release task ended without an outcome (it panicked); retried like a failure.
    #[error("the release task failed: {0}")]
    Task(String),
}

impl NodeError {
    /// A read of `what` failed with `e`.
    pub fn read(what: String, e: &kube::Error) -> NodeError {
        NodeError::Read {
            what,
            message: e.to_string(),
        }
    }

    /// A short stable name of what failed, for logs; a write's is its `release_failures_total`
    /// cause.
    pub fn label(&self) -> &'static str {
        match self {
            NodeError::Read { .. } => "read",
            NodeError::Runtime { .. } => "runtime",
            NodeError::Write(e) => e.label(),
            NodeError::ReportPatch(_) => "report_patch",
            NodeError::Report(_) => "report",
            NodeError::Task(_) => "task",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_errors_read_as_before_and_name_what_failed() {
        let read = NodeError::Read {
            what: "get pool p".into(),
            message: "boom".into(),
        };
        assert_eq!(read.to_string(), "get pool p: boom");
        assert_eq!(read.label(), "read");
        let runtime = NodeError::Runtime {
            sandbox: "s1".into(),
            message: "unavailable".into(),
        };
        assert_eq!(
            runtime.to_string(),
            "asking the runtime about sandbox s1: unavailable"
        );
        assert_eq!(runtime.label(), "runtime");
        let write = NodeError::from(ReleaseError::Conflict { pool: "p".into() });
        assert_eq!(write.to_string(), "pool p kept changing while releasing");
        assert_eq!(write.label(), "conflict");
        assert_eq!(
            NodeError::ReportPatch("bad".into()).to_string(),
            "report patch: bad"
        );
        assert_eq!(NodeError::Report("gone".into()).to_string(), "gone");
    }
}
