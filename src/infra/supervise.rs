//! Work that lives as long as the process: every such task is tracked, a
//! task that panics is restarted (after a pause that grows while it keeps
//! failing), and shutdown waits for all of them, for a while.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::infra::stats::Stats;

pub struct Supervisor {
    tasks: TaskTracker,
    stop: CancellationToken,
    stats: Arc<Stats>,
}

impl Supervisor {
    pub fn new(stop: CancellationToken, stats: Arc<Stats>) -> Self {
        Self {
            tasks: TaskTracker::new(),
            stop,
            stats,
        }
    }

    /// Runs `make()`'s future until it returns (which a task does once
    /// `stop` is cancelled); after a panic, logs it and runs a new one.
    pub fn spawn<F, Fut>(&self, name: &'static str, make: F)
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stop = self.stop.clone();
        let stats = self.stats.clone();
        self.tasks.spawn(async move {
            let mut pause = Duration::from_millis(100);
            loop {
                match AssertUnwindSafe(make()).catch_unwind().await {
                    Ok(()) => return,
                    Err(panic) => {
                        stats.task_panics.inc();
                        tracing::error!(
                            task = name,
                            panic = panic_message(panic.as_ref()),
                            "background task panicked; restarting it"
                        );
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(10));
            }
        });
    }

    /// Cancels the tasks' `stop` and waits up to `limit` for them to end.
    pub async fn stop(&self, limit: Duration) {
        self.stop.cancel();
        self.finish(limit).await;
    }

    /// Waits up to `limit` for every task to end (after `stop`).
    pub async fn finish(&self, limit: Duration) {
        self.tasks.close();
        if tokio::time::timeout(limit, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.tasks.len(),
                "background tasks still running at shutdown"
            );
        }
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_panics_is_run_again_and_shutdown_waits_for_it() {
        let stop = CancellationToken::new();
        let stats = Arc::new(Stats::default());
        let supervisor = Supervisor::new(stop.clone(), stats.clone());
        let (runs, mut started) = tokio::sync::watch::channel(0usize);
        let runs = Arc::new(runs);
        let token = stop.clone();
        supervisor.spawn("flaky", move || {
            let runs = runs.clone();
            let stop = token.clone();
            async move {
                let mut this_run = 0;
                runs.send_modify(|n| {
                    *n += 1;
                    this_run = *n;
                });
                if this_run <= 2 {
                    panic!("first runs fail");
                }
                stop.cancelled().await;
            }
        });
        let third_run = tokio::time::timeout(Duration::from_secs(5), started.wait_for(|n| *n >= 3));
        assert!(third_run.await.is_ok(), "the task was not restarted");
        assert_eq!(stats.task_panics.get(), 2, "each panic is counted");
        stop.cancel();
        supervisor.finish(Duration::from_secs(5)).await;
        assert!(supervisor.tasks.is_empty(), "the task ended at stop");
    }
}
