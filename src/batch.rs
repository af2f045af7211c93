//! Group work of concurrent requests into shared round trips.
//!
//! Requests queue on a channel; a collector takes everything queued once the
//! previous batch is done and hands it to the handler as one batch. While a
//! batch runs the queue grows, so batches grow with load and cost one round
//! trip each; at light load a batch is a single request and waits for
//! nothing.

use std::future::Future;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

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
    /// Starts the collector, which runs one batch of at most `max_batch`
    /// items at a time. It stops once every `Batcher` handle is dropped and
    /// the queue is drained.
    pub fn spawn<F, Fut>(max_batch: usize, handler: F) -> (Self, JoinHandle<()>)
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<T>(max_batch * 4);
        let collector = tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = Vec::with_capacity(max_batch.min(64));
                batch.push(first);
                while batch.len() < max_batch {
                    match rx.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
                handler(batch).await;
            }
        });
        (Self { tx }, collector)
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

    #[tokio::test]
    async fn concurrent_items_share_batches_and_all_get_answers() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let (batcher, collector) =
            Batcher::spawn(16, move |batch: Vec<(u32, oneshot::Sender<u32>)>| {
                let seen = seen.clone();
                async move {
                    seen.lock().unwrap().push(batch.len());
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    for (n, reply) in batch {
                        let _ = reply.send(n * 2);
                    }
                }
            });
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
        collector.await.unwrap();
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 100);
        assert!(sizes.iter().all(|&s| s <= 16));
        // With each batch busy for 5 ms, later items must have been grouped.
        assert!(sizes.len() < 100, "no batching happened: {sizes:?}");
    }
}
