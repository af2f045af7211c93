//! Postgres notifications every instance acts on: definitions changed
//! elsewhere, and new outbox rows to deliver.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::auth::KeyStore;
use crate::auth::keys::REVOKED_CHANNEL;
use crate::sequence::store::{CHANGED_CHANNEL, SequenceStore};

/// Channel the outbox trigger notifies on insert.
pub const OUTBOX_CHANNEL: &str = "idpool_outbox";

/// What acts on notifications.
#[derive(Clone)]
pub struct Listeners {
    pub sequences: Arc<SequenceStore>,
    pub keys: Arc<KeyStore>,
    pub outbox_wake: Arc<Notify>,
}

pub async fn run(db: PgPool, listeners: Listeners, stop: CancellationToken) {
    let Listeners {
        sequences,
        keys,
        outbox_wake,
    } = listeners;
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
        if let Err(e) = listener
            .listen_all([CHANGED_CHANNEL, OUTBOX_CHANNEL, REVOKED_CHANNEL])
            .await
        {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            continue;
        }
        // What happened while we were not listening was missed.
        sequences.evict_all();
        keys.forget_all();
        outbox_wake.notify_one();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                received = listener.try_recv() => match received {
                    Ok(Some(notification)) => match notification.channel() {
                        OUTBOX_CHANNEL => outbox_wake.notify_one(),
                        REVOKED_CHANNEL => keys.forget(notification.payload()),
                        _ => sequences.evict(notification.payload()),
                    },
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
