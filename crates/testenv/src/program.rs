//! A program (the controller, the node agent) running inside the test process until stopped.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::poll::wait_for;

/// Completes when the test stops the program.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A spawned program; [`stop`](Self::stop) ends it and checks how it ended.
pub struct InProcess {
    what: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl InProcess {
    /// Spawns `run(shutdown, started)`. The program sends what it exposes (health, metrics
    /// address) through `started` once it serves; this waits for that, then until `ready`
    /// holds for it, and returns it.
    pub async fn start<R, F, Fut>(what: &str, run: F, ready: impl Fn(&R) -> bool) -> (InProcess, R)
    where
        R: Send + 'static,
        F: FnOnce(Shutdown, oneshot::Sender<R>) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let (started_tx, started) = oneshot::channel();
        let shutdown: Shutdown = Box::pin(async move {
            let _ = stopped.await;
        });
        let task = tokio::spawn(run(shutdown, started_tx));
        let exposed = match started.await {
            Ok(r) => r,
            Err(_) => panic!(
                "{what} ended before it started: {:?}",
                task.await.expect("program task")
            ),
        };
        wait_for(&format!("{what} ready"), || {
            let ok = ready(&exposed);
            async move { ok }
        })
        .await;
        let program = InProcess {
            what: what.into(),
            stop: Some(stop),
            task: Some(task),
        };
        (program, exposed)
    }

    /// Stops the program and fails the test if it ended with an error. Stopping twice is a no-op.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await
                .expect("program task")
                .unwrap_or_else(|e| panic!("{} ran with an error: {e:#}", self.what));
        }
    }
}
