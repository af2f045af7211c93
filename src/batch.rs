//! Group work of concurrent requests into shared round trips.
//!
//! Requests queue on a channel; a collector takes everything queued once a
//! slot is free and hands it to the handler as one batch. While all slots are
//! busy the queue grows, so batches grow with load and cost one round trip
//! each; at light load a batch is a single request and waits for nothing.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc};
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
    /// Starts the collector. It stops once every `Batcher` handle is dropped
    /// and the queue is drained, after its batches in flight finish.
    pub fn spawn<F, Fut>(
        max_batch: usize,
        max_in_flight: usize,
        handler: F,
    ) -> (Self, JoinHandle<()>)
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::channel::<T>(max_batch * max_in_flight * 4);
        let slots = Arc::new(Semaphore::new(max_in_flight));
        let handler = Arc::new(handler);
        let collector = tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    break;
                };
                let mut batch = Vec::with_capacity(max_batch.min(64));
                batch.push(first);
                while batch.len() < max_batch {
                    match rx.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
                if max_in_flight == 1 {
                    // One batch at a time: no task of its own to spawn and wake.
                    handler(batch).await;
                    drop(slot);
                    continue;
                }
                let handler = handler.clone();
                tokio::spawn(async move {
                    handler(batch).await;
                    drop(slot);
                });
            }
            // Wait for the batches still in flight.
            let _ = slots.acquire_many(max_in_flight as u32).await;
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
    use std::sync::Mutex;
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn concurrent_items_share_batches_and_all_get_answers() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let (batcher, collector) =
            Batcher::spawn(16, 1, move |batch: Vec<(u32, oneshot::Sender<u32>)>| {
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
        // With one slot busy for 5 ms, later items must have been grouped.
        assert!(sizes.len() < 100, "no batching happened: {sizes:?}");
    }
}
