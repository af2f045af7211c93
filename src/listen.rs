//! Postgres notifications every instance acts on.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::sequence::store::{CHANGED_CHANNEL, SequenceStore};

/// Drops cached definitions when another instance changes one.
pub async fn run(db: PgPool, sequences: Arc<SequenceStore>, stop: CancellationToken) {
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
        if let Err(e) = listener.listen(CHANGED_CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            continue;
        }
        // Changes made while we were not listening were missed.
        sequences.evict_all();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                received = listener.try_recv() => match received {
                    Ok(Some(notification)) => sequences.evict(notification.payload()),
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
