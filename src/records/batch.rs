//! Group work of concurrent requests into shared round trips.
//!
//! Requests queue on a channel; a collector takes everything queued once the
//! previous batch is done and hands it to the handler as one batch. While a
//! batch runs the queue grows, so batches grow with load and cost one round
//! trip each; at light load a batch is a single request and waits for
//! nothing.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

pub struct Batcher<T> {
    tx: mpsc::Sender<T>,
}

impl<T> Clone for Batcher<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
        }
    }
}

/// The batch worker has stopped; the item comes back.
pub struct BatcherClosed<T>(pub T);

impl<T> std::fmt::Debug for BatcherClosed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatcherClosed")
    }
}

impl<T: Send + 'static> Batcher<T> {
    /// Starts the collector on `tasks`; it runs one batch of at most
    /// `max_batch` items at a time and stops once every `Batcher` handle is
    /// dropped and the queue is drained. A batch whose handler panics is
    /// lost (its callers' answers are dropped, so they see an error); the
    /// collector goes on with the next one.
    pub fn spawn<F, Fut>(
        tasks: &TaskTracker,
        name: &'static str,
        max_batch: usize,
        handler: F,
    ) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<T>(max_batch * 4);
        tasks.spawn(async move {
            let mut batch = Vec::with_capacity(max_batch.min(64));
            while rx.recv_many(&mut batch, max_batch).await > 0 {
                let work = std::mem::replace(&mut batch, Vec::with_capacity(max_batch.min(64)));
                if AssertUnwindSafe(handler(work))
                    .catch_unwind()
                    .await
                    .is_err()
                {
                    tracing::error!(batcher = name, "a batch handler panicked; its batch failed");
                }
            }
        });
        Self { tx }
    }

    pub async fn submit(&self, item: T) -> Result<(), BatcherClosed<T>> {
        self.tx.send(item).await.map_err(|e| BatcherClosed(e.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::sync::oneshot;
    use tokio_util::task::TaskTracker;

    #[tokio::test]
    async fn concurrent_items_share_batches_and_all_get_answers() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let tasks = TaskTracker::new();
        let batcher = Batcher::spawn(
            &tasks,
            "test",
            16,
            move |batch: Vec<(u32, oneshot::Sender<u32>)>| {
                let seen = seen.clone();
                async move {
                    seen.lock().unwrap().push(batch.len());
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    for (n, reply) in batch {
                        let _ = reply.send(n * 2);
                    }
                }
            },
        );
        let mut waiting = Vec::new();
        for n in 0..100u32 {
            let (tx, rx) = oneshot::channel();
            batcher.submit((n, tx)).await.unwrap();
            waiting.push((n, rx));
        }
        for (n, rx) in waiting {
            assert_eq!(rx.await.unwrap(), n * 2);
        }
        drop(batcher);
        tasks.close();
        tasks.wait().await;
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 100);
        assert!(sizes.iter().all(|&s| s <= 16));
        // With each batch busy for 5 ms, later items must have been grouped.
        assert!(sizes.len() < 100, "no batching happened: {sizes:?}");
    }

    #[tokio::test]
    async fn a_panicking_batch_fails_alone_and_later_batches_are_served() {
        let tasks = TaskTracker::new();
        let batcher = Batcher::spawn(
            &tasks,
            "test",
            1,
            |batch: Vec<(u32, oneshot::Sender<u32>)>| async move {
                for (n, reply) in batch {
                    assert_ne!(n, 13, "poisoned item");
                    let _ = reply.send(n);
                }
            },
        );
        let (tx, poisoned) = oneshot::channel();
        batcher.submit((13, tx)).await.unwrap();
        assert!(poisoned.await.is_err(), "the poisoned item gets no answer");
        for n in 0..5 {
            let (tx, rx) = oneshot::channel();
            batcher.submit((n, tx)).await.unwrap();
            assert_eq!(rx.await.unwrap(), n, "the collector kept serving");
        }
    }
}
