//! Postgres notifications every instance acts on. Each owner of a cache or
//! a wake-up subscribes to its own channel; this module knows channels and
//! payloads, not what they mean.

use std::collections::HashMap;
use std::sync::Arc;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::log_limit::Repeated;

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
    // On a standby or during a failover every attempt fails at once: the
    // attempts back off, and their failures are said once, then counted.
    static TROUBLE: Repeated = Repeated::new("cannot listen for notifications; retrying");
    let mut backoff = Backoff::background();
    loop {
        match listen(&db, &by_channel).await {
            Ok(mut listener) => {
                TROUBLE.ended();
                backoff.reset();
                for subscriber in &subscribers {
                    subscriber.missed();
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    e = deliver(&mut listener, &by_channel) => TROUBLE.warn(&e),
                }
            }
            Err(e) => TROUBLE.warn(&e),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_pause()) => {}
        }
    }
}

async fn listen(
    db: &PgPool,
    by_channel: &HashMap<&'static str, Arc<dyn Subscriber>>,
) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(db).await?;
    listener.listen_all(by_channel.keys().copied()).await?;
    Ok(listener)
}

/// Hands notifications to their subscribers until the connection fails.
async fn deliver(
    listener: &mut PgListener,
    by_channel: &HashMap<&'static str, Arc<dyn Subscriber>>,
) -> String {
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                if let Some(subscriber) = by_channel.get(notification.channel()) {
                    subscriber.notified(notification.payload());
                }
            }
            Ok(None) => return "the notification connection dropped".to_owned(),
            Err(e) => return e.to_string(),
        }
    }
}
