//! What the controller's tasks share: the client, the index, the deletion queue, the writer,
//! Events, metrics and the nodes' readiness.

use std::sync::{Arc, RwLock};

use kube::Client;
use podlife::queue::WorkQueue;

use super::fresh_node::NodeReads;
use crate::index::{NodeIndex, SharedIndex};
use crate::release::{Events, writer};
use crate::telemetry::ControllerMetrics;

/// What the deletion workers, the sweep, the fence lifter and the reports share.
#[derive(Clone)]
pub struct Ctx {
    pub(crate) client: Client,
    pub(crate) index: SharedIndex,
    pub(crate) queue: Arc<WorkQueue<String>>,
    pub(crate) writer: writer::WriterHandle,
    pub(crate) events: Events,
    pub(crate) metrics: ControllerMetrics,
    /// Nodes' readiness (`None`: fencing is off).
    pub(crate) nodes: Option<Arc<RwLock<NodeIndex>>>,
    /// Fresh node reads in flight, shared by the deletions they serve.
    pub(crate) node_reads: Arc<NodeReads>,
}

impl Ctx {
    /// What the tasks share, fencing off (no nodes' readiness): for a test that drives one
    /// task (the sweep) against a mock apiserver. The controller builds its own with fencing.
    pub fn new(
        client: Client,
        index: SharedIndex,
        queue: Arc<WorkQueue<String>>,
        writer: writer::WriterHandle,
        events: Events,
        metrics: ControllerMetrics,
    ) -> Ctx {
        Ctx {
            client,
            index,
            queue,
            writer,
            events,
            metrics,
            nodes: None,
            node_reads: Arc::default(),
        }
    }
}
