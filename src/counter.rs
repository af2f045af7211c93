//! The counter of record: Postgres reserves blocks of numbers per sequence
//! period, one atomic `UPDATE` each, and records every block.

use std::collections::HashSet;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use crate::numbers::SeqRange;
use crate::sequence::{Period, Sequence};

/// Who received numbers: `POST /ids` or `POST /documents`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Via {
    Ids,
    Document,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Ids => "ids",
            Via::Document => "document",
        }
    }
}

/// What a reservation came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved<T> {
    Got(T),
    /// Fewer numbers are left in the period than asked for.
    Exhausted,
    /// The sequence's definition changed since it was read: numbers placed
    /// under the old one could print IDs the new one prints.
    Stale,
}

/// Most periods one instance remembers having seen a counter for.
const MAX_KNOWN_PERIODS: usize = 100_000;

/// A block reserved for a Redis pool.
#[derive(Debug, Clone, Copy)]
pub struct PoolBlock {
    pub id: i64,
    pub range: SeqRange,
}

pub struct Counter {
    /// Connections of their own for refills, so a flood of requests waiting
    /// on the main pool never starves the refills that would relieve it.
    refill_db: PgPool,
    instance_id: String,
    /// Periods whose counter row this instance has already seen to exist.
    known_periods: Mutex<HashSet<(i64, String)>>,
}

impl Counter {
    pub fn new(refill_db: PgPool, instance_id: String) -> Self {
        Self {
            refill_db,
            instance_id,
            known_periods: Mutex::new(HashSet::new()),
        }
    }

    pub fn refill_db(&self) -> &PgPool {
        &self.refill_db
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// Creates the period's counter at its first number the first time it
    /// is used.
    async fn ensure_period<'e, E: sqlx::PgExecutor<'e>>(
        &self,
        db: E,
        sequence: &Sequence,
        period: &Period,
    ) -> Result<(), sqlx::Error> {
        let key = (sequence.id, period.key().to_owned());
        if self.known(&key) {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO counters (sequence_id, period, next_seq) VALUES ($1, $2, $3) \
             ON CONFLICT (sequence_id, period) DO NOTHING",
        )
        .bind(sequence.id)
        .bind(period.key())
        .bind(sequence.first_number(period))
        .execute(db)
        .await?;
        let mut known = self.known_periods.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= MAX_KNOWN_PERIODS {
            known.clear();
        }
        known.insert(key);
        Ok(())
    }

    fn known(&self, key: &(i64, String)) -> bool {
        self.known_periods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(key)
    }

    /// Reserves up to `want` numbers for a pool (fewer near `max`).
    pub async fn reserve_pool_block(
        &self,
        sequence: &Sequence,
        period: &Period,
        want: i64,
        lock_acquired_at: DateTime<Utc>,
    ) -> Result<Reserved<PoolBlock>, sqlx::Error> {
        self.ensure_period(&self.refill_db, sequence, period)
            .await?;
        let row: Option<(i64, i64, i64)> = sqlx::query_as(
            "WITH taken AS ( \
                 UPDATE counters SET last_grant = LEAST($3, $4 - next_seq + 1), \
                                     next_seq = next_seq + LEAST($3, $4 - next_seq + 1) \
                 WHERE sequence_id = $1 AND period = $2 AND next_seq <= $4 \
                   AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $7) \
                 RETURNING next_seq - last_grant AS first, next_seq AS next \
             ) \
             INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id, lock_acquired_at) \
             SELECT $1, $2, int8range(first, next), 'pool', $5, $6 FROM taken \
             RETURNING id, lower(seqs), upper(seqs)",
        )
        .bind(sequence.id)
        .bind(period.key())
        .bind(want)
        .bind(sequence.definition.max_seq())
        .bind(&self.instance_id)
        .bind(lock_acquired_at)
        .bind(sequence.identity_version)
        .fetch_optional(&self.refill_db)
        .await?;
        match row {
            Some((id, start, end)) => Ok(Reserved::Got(PoolBlock {
                id,
                range: SeqRange::new(start, end),
            })),
            None => self.why_not(&self.refill_db, sequence).await,
        }
    }

    /// A reservation found no row: the counter is spent, or the definition
    /// it was asked under is no longer the sequence's.
    async fn why_not<'e, T, E: sqlx::PgExecutor<'e>>(
        &self,
        db: E,
        sequence: &Sequence,
    ) -> Result<Reserved<T>, sqlx::Error> {
        let current: Option<i32> =
            sqlx::query_scalar("SELECT identity_version FROM sequences WHERE id = $1")
                .bind(sequence.id)
                .fetch_optional(db)
                .await?;
        Ok(if current == Some(sequence.identity_version) {
            Reserved::Exhausted
        } else {
            Reserved::Stale
        })
    }

    pub async fn mark_pushed(&self, block_id: i64) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE blocks SET pushed_at = clock_timestamp() WHERE id = $1")
            .bind(block_id)
            .execute(&self.refill_db)
            .await?;
        Ok(())
    }

    /// Reserves exactly `n` numbers for one caller, straight from the
    /// counter (no pool), on the caller's connection (inside its
    /// transaction, if it has one). They are issued once the caller's
    /// ledger record commits.
    pub async fn reserve_direct(
        &self,
        conn: &mut PgConnection,
        sequence: &Sequence,
        period: &Period,
        n: i64,
    ) -> Result<Reserved<SeqRange>, sqlx::Error> {
        self.ensure_period(&mut *conn, sequence, period).await?;
        let first: Option<i64> = sqlx::query_scalar(
            "WITH taken AS ( \
                 UPDATE counters SET last_grant = $3, next_seq = next_seq + $3 \
                 WHERE sequence_id = $1 AND period = $2 AND next_seq + $3 - 1 <= $4 \
                   AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $6) \
                 RETURNING next_seq - $3 AS first, next_seq AS next \
             ) \
             INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id) \
             SELECT $1, $2, int8range(first, next), 'direct', $5 FROM taken \
             RETURNING lower(seqs)",
        )
        .bind(sequence.id)
        .bind(period.key())
        .bind(n)
        .bind(sequence.definition.max_seq())
        .bind(&self.instance_id)
        .bind(sequence.identity_version)
        .fetch_optional(&mut *conn)
        .await?;
        match first {
            Some(first) => Ok(Reserved::Got(SeqRange::new(first, first + n))),
            None => self.why_not(&mut *conn, sequence).await,
        }
    }
}
