//! The release attempts at dead sandboxes under way: a task each, and the sandbox of each task, so that a
//! task that panics still hands its sandbox back (as a failed release, retried) instead of
//! losing it.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{Id, JoinSet};

use super::error::NodeError;
use super::release::Outcome;
use super::witness::DeadSandbox;

/// Attempts under way.
#[derive(Default)]
pub struct Attempts {
    tasks: JoinSet<Outcome>,
    sandboxes: HashMap<Id, DeadSandbox>,
}

impl Attempts {
    /// Starts `look` at `sb`.
    pub fn spawn<F, Fut>(&mut self, sb: DeadSandbox, look: F)
    where
        F: FnOnce(DeadSandbox) -> Fut,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let task = self.tasks.spawn(look(sb.clone()));
        self.sandboxes.insert(task.id(), sb);
    }

    /// When the oldest sandbox under a look was first reported dead.
    pub fn oldest_death(&self) -> Option<std::time::Instant> {
        self.sandboxes.values().map(|sb| sb.since).min()
    }

    /// The next look to end, with its sandbox; `None` while none is under way. Cancel-safe.
    pub async fn next(&mut self) -> Option<(DeadSandbox, Outcome)> {
        loop {
            let (id, outcome) = match self.tasks.join_next_with_id().await? {
                Ok(done) => done,
                Err(e) => (e.id(), Outcome::Failed(NodeError::Task(e.to_string()))),
            };
            match self.sandboxes.remove(&id) {
                Some(sb) => return Some((sb, outcome)),
                None => tracing::error!(task = %id, "a look ended that was not recorded"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn sandbox(id: &str) -> DeadSandbox {
        let now = Instant::now();
        DeadSandbox {
            id: id.into(),
            pod_uid: format!("uid-{id}"),
            since: now,
            due: now,
            attempts: 0,
        }
    }

    #[tokio::test]
    async fn a_look_that_panics_hands_its_sandbox_back_as_a_failure() {
        let mut looks = Attempts::default();
        assert_eq!(looks.oldest_death(), None);
        let ok = sandbox("ok");
        let oldest = ok.since;
        looks.spawn(ok, |_| async { Outcome::NoAllocation });
        looks.spawn(sandbox("boom"), |sb| async move {
            panic!("release of {} panicked", sb.id);
        });
        assert_eq!(
            looks.oldest_death(),
            Some(oldest),
            "a look under way still waits"
        );
        let mut ended = Vec::new();
        while let Some((sb, outcome)) = looks.next().await {
            ended.push((sb.id, outcome.label(), outcome));
        }
        ended.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(ended[1].0, "ok");
        assert_eq!(ended[1].1, "no_allocation");
        assert_eq!(ended[0].0, "boom");
        assert!(
            matches!(&ended[0].2, Outcome::Failed(NodeError::Task(m)) if m.contains("panicked")),
            "{:?}",
            ended[0].2
        );
        assert!(looks.next().await.is_none(), "none left");
        assert_eq!(
            looks.oldest_death(),
            None,
            "the end of the last look ends the wait"
        );
    }
}
