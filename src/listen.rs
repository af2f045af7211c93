//! Postgres notifications every instance acts on. Each owner of a cache or
//! a wake-up subscribes to its own channel; this module knows channels and
//! payloads, not what they mean.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

/// Acts on the notifications of one channel.
pub trait Subscriber: Send + Sync {
    /// The channel the subscriber listens on.
    fn channel(&self) -> &'static str;
    /// A notification arrived with `payload`.
    fn notified(&self, payload: &str);
    /// The listener (re)connected: what was sent meanwhile was missed.
    fn missed(&self);
}

pub type Subscribers = Vec<Arc<dyn Subscriber>>;

pub async fn run(db: PgPool, subscribers: Subscribers, stop: CancellationToken) {
    let by_channel: HashMap<&'static str, Arc<dyn Subscriber>> = subscribers
        .iter()
        .map(|s| (s.channel(), s.clone()))
        .collect();
    loop {
        let mut listener = match PgListener::connect_with(&db).await {
            Ok(listener) => listener,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for notifications; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        if let Err(e) = listener.listen_all(by_channel.keys().copied()).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            continue;
        }
        for subscriber in &subscribers {
            subscriber.missed();
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                received = listener.try_recv() => match received {
                    Ok(Some(notification)) => {
                        if let Some(subscriber) = by_channel.get(notification.channel()) {
                            subscriber.notified(notification.payload());
                        }
                    }
                    // The connection dropped: listen again on a new one.
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "notification listener failed");
                        break;
                    }
                }
            }
        }
    }
}
