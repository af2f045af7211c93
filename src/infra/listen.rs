//! Postgres notifications every instance acts on. Each owner of a cache or
//! a wake-up subscribes to its own channel; this module knows channels and
//! payloads, not what they mean.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::infra::backoff::Backoff;
use crate::infra::log_limit::Repeated;

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

/// How often, where nothing can be listened for, every subscriber is told
/// it missed what was sent: the longest a revoked key, a changed
/// definition or a document waiting for delivery goes unseen.
pub const POLL: Duration = Duration::from_secs(1);

/// Where notifications come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A connection of the pool, kept for listening (no pooler, or one in
    /// session mode: the server session stays the listener's).
    Pool(crate::infra::db::Db),
    /// A connection of its own, straight to Postgres.
    Url(String),
    /// Nothing to listen on (behind a pooler in transaction mode, which
    /// would drop notifications or hand them to other clients): every
    /// `POLL`, each subscriber is told it missed what was sent.
    Poll,
}

/// Which `Source` a configuration leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Pool,
    Url,
    Poll,
}

impl Source {
    pub fn new(db: &crate::infra::db::Db, listen_url: Option<&str>) -> Self {
        match (
            Self::new_kind(db.pooler(), listen_url.is_some()),
            listen_url,
        ) {
            (Kind::Url, Some(url)) => Source::Url(url.to_owned()),
            (Kind::Poll, _) => Source::Poll,
            _ => Source::Pool(db.clone()),
        }
    }

    pub fn new_kind(pooler: crate::infra::db::Pooler, listen_url: bool) -> Kind {
        match (listen_url, pooler) {
            (true, _) => Kind::Url,
            (false, crate::infra::db::Pooler::Transaction) => Kind::Poll,
            (false, _) => Kind::Pool,
        }
    }
}

pub async fn run(source: Source, subscribers: Subscribers, stop: CancellationToken) {
    if let Source::Poll = source {
        return poll(&subscribers, &stop).await;
    }
    let by_channel: HashMap<&'static str, Arc<dyn Subscriber>> = subscribers
        .iter()
        .map(|s| (s.channel(), s.clone()))
        .collect();
    // On a standby or during a failover every attempt fails at once: the
    // attempts back off, and their failures are said once, then counted.
    static TROUBLE: Repeated = Repeated::new(
        "cannot listen for notifications; polling every second until listening again",
    );
    let mut backoff = Backoff::background();
    loop {
        match listen(&source, &by_channel).await {
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
        // Not listening: what is sent meanwhile is missed, so every
        // subscriber is told so every `POLL` until the next attempt (a
        // revoked key is refused as soon as it would be by polling).
        let retry_at = tokio::time::Instant::now() + backoff.next_pause();
        loop {
            for subscriber in &subscribers {
                subscriber.missed();
            }
            let next = (tokio::time::Instant::now() + POLL).min(retry_at);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            if next >= retry_at {
                break;
            }
        }
    }
}

async fn poll(subscribers: &Subscribers, stop: &CancellationToken) {
    let mut every = tokio::time::interval(POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        for subscriber in subscribers {
            subscriber.missed();
        }
    }
}

async fn listen(
    source: &Source,
    by_channel: &HashMap<&'static str, Arc<dyn Subscriber>>,
) -> Result<PgListener, sqlx::Error> {
    let mut listener = match source {
        Source::Pool(db) => PgListener::connect_with(db.raw()).await?,
        Source::Url(url) => {
            let options = crate::infra::db::connect_options(url).map_err(|e| {
                sqlx::Error::Configuration(format!("IDPOOL_PG_LISTEN_URL: {e}").into())
            })?;
            PgListener::connect_with(&sqlx::PgPool::connect_lazy_with(options))
                .await
                .map_err(|e| {
                    sqlx::Error::Configuration(
                        format!("IDPOOL_PG_LISTEN_URL does not answer: {e}").into(),
                    )
                })?
        }
        Source::Poll => {
            return Err(sqlx::Error::Configuration("nothing to listen on".into()));
        }
    };
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
