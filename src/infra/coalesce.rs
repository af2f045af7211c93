//! One answer shared by everyone who asks meanwhile: for things anyone may
//! ask for as often as they like (readiness, metrics), so asking costs one
//! probe per interval however many ask.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

pub struct Coalesced<T> {
    /// Shortest time between two probes.
    gap: Duration,
    last: tokio::sync::Mutex<Option<(Instant, T)>>,
}

impl<T: Clone> Coalesced<T> {
    pub fn new(gap: Duration) -> Self {
        Self {
            gap,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// An answer from a probe that began after this call did: the last
    /// one, if so, or a new one, at least `gap` after the last began.
    /// Callers queue (in order) while a probe runs.
    pub async fn get<F, Fut>(&self, probe: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        let asked = Instant::now();
        let mut last = self.last.lock().await;
        if let Some((began, answer)) = &*last {
            if *began >= asked {
                return answer.clone();
            }
            tokio::time::sleep_until(*began + self.gap).await;
        }
        let began = Instant::now();
        let answer = probe().await;
        *last = Some((began, answer.clone()));
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn many_askers_share_a_probe_that_began_after_they_asked() {
        let shared = Arc::new(Coalesced::new(Duration::from_millis(50)));
        let probes = Arc::new(AtomicUsize::new(0));
        let askers: Vec<_> = (0..100)
            .map(|_| {
                let (shared, probes) = (shared.clone(), probes.clone());
                tokio::spawn(async move {
                    shared
                        .get(|| async {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            probes.fetch_add(1, Ordering::SeqCst)
                        })
                        .await
                })
            })
            .collect();
        for asker in askers {
            asker.await.unwrap();
        }
        let probed = probes.load(Ordering::SeqCst);
        assert!((1..=2).contains(&probed), "{probed} probes for 100 askers");
        // Asked after that: a fresh probe.
        let next = shared
            .get(|| async { probes.fetch_add(1, Ordering::SeqCst) })
            .await;
        assert_eq!(next, probed);
    }
}
