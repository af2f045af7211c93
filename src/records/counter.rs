//! The counter of record: Postgres reserves blocks of numbers per sequence
//! period, one atomic `UPDATE` each, and records every block.

mod direct;

use std::collections::HashSet;
use std::sync::Mutex;

use crate::infra::db::{Db, Link};
use chrono::{DateTime, Utc};

use crate::domain::numbers::SeqRange;
use crate::domain::sequence::{Period, Sequence};

pub use self::direct::{DirectError, DirectReservations};

/// What a reservation came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved<T> {
    Got(T),
    /// Fewer numbers are left in the period than asked for.
    Exhausted,
    /// The sequence's definition changed since it was read: numbers placed
    /// under the old one could print IDs the new one prints.
    Stale,
    /// Postgres is on another timeline than the one its counters were last
    /// checked against Redis on (a failover): nothing was handed out, and
    /// nothing is until the pools' service has fenced the counters.
    Unfenced,
}

/// Most periods one instance remembers having seen a counter for.
const MAX_KNOWN_PERIODS: usize = 100_000;

/// Which Postgres server and history the counters are on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresIdentity {
    /// None where the role may not read it.
    pub system: Option<String>,
    pub timeline: String,
}

/// A block reserved for a Redis pool.
#[derive(Debug, Clone, Copy)]
pub struct PoolBlock {
    pub id: i64,
    pub range: SeqRange,
}

pub struct Counter {
    /// Connections of their own for refills, so a flood of requests waiting
    /// on the main pool never starves the refills that would relieve it.
    refill_db: Db,
    instance_id: String,
    /// Periods whose counter row this instance has already seen to exist.
    known_periods: Mutex<HashSet<(i64, String)>>,
    /// The Postgres timeline the counters were last fenced on (None until
    /// the first reservation or check).
    fenced_timeline: Mutex<Option<String>>,
    /// Woken when a reservation found another timeline.
    moved: tokio::sync::Notify,
    /// Direct reservations made so far (their blocks' tags).
    direct_reservations: std::sync::atomic::AtomicU64,
}

impl Counter {
    pub fn new(refill_db: Db, instance_id: String) -> Self {
        Self {
            refill_db,
            instance_id,
            known_periods: Mutex::new(HashSet::new()),
            fenced_timeline: Mutex::new(None),
            moved: tokio::sync::Notify::new(),
            direct_reservations: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether a reservation made on `timeline` may be handed out: it is the
    /// timeline the counters were fenced on (the first one seen counts as
    /// fenced: at start, the pools' check runs before anything is served).
    fn on_fenced_timeline(&self, timeline: &str) -> bool {
        let mut fenced = self
            .fenced_timeline
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match fenced.as_deref() {
            Some(known) if known == timeline => true,
            Some(_) => {
                drop(fenced);
                self.moved.notify_one();
                false
            }
            None => {
                *fenced = Some(timeline.to_owned());
                true
            }
        }
    }

    /// The counters were checked against Redis on `timeline`.
    pub fn fenced_on(&self, timeline: String) {
        *self
            .fenced_timeline
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(timeline);
    }

    /// Until a reservation finds Postgres on another timeline.
    pub async fn moved(&self) {
        self.moved.notified().await
    }

    /// The timeline of the Postgres the counters are on now.
    pub async fn timeline(&self) -> Result<String, sqlx::Error> {
        // The timeline of the Postgres a statement runs on (a promoted
        // standby starts a new one), readable by any role on a primary; the
        // two reservations below return it with the same expression.
        sqlx::query_scalar!(
            r#"SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS "timeline!""#
        )
        .fetch_one(&self.refill_db)
        .await
    }

    pub fn refill_db(&self) -> &Db {
        &self.refill_db
    }

    /// Records numbers that left a pool without being issued, with why
    /// (`pool_discards.cause`), on the refills' connections.
    pub async fn record_discards(
        &self,
        sequence_id: i64,
        period: &str,
        ranges: &[SeqRange],
        cause: &str,
    ) -> Result<(), sqlx::Error> {
        let starts: Vec<i64> = ranges.iter().map(|r| r.start).collect();
        let ends: Vec<i64> = ranges.iter().map(|r| r.end).collect();
        sqlx::query!(
            "INSERT INTO pool_discards (sequence_id, period, seqs, cause) \
             SELECT $1, $2, int8range(s, e), $3 FROM UNNEST($4::bigint[], $5::bigint[]) AS t(s, e)",
            sequence_id,
            period,
            cause,
            &starts,
            &ends,
        )
        .execute(&self.refill_db)
        .await?;
        Ok(())
    }

    /// [`Counter::record_discards`] in the caller's transaction.
    pub async fn record_discards_in(
        conn: &mut impl Link,
        sequence_id: i64,
        period: &str,
        ranges: &[SeqRange],
        cause: &str,
    ) -> Result<(), sqlx::Error> {
        if ranges.is_empty() {
            return Ok(());
        }
        let starts: Vec<i64> = ranges.iter().map(|r| r.start).collect();
        let ends: Vec<i64> = ranges.iter().map(|r| r.end).collect();
        sqlx::query!(
            "INSERT INTO pool_discards (sequence_id, period, seqs, cause) \
             SELECT $1, $2, int8range(s, e), $3 FROM UNNEST($4::bigint[], $5::bigint[]) AS t(s, e)",
            sequence_id,
            period,
            cause,
            &starts,
            &ends,
        )
        .execute(conn.statements())
        .await?;
        Ok(())
    }

    /// Numbers a pool gave up that nobody took (its period ended, or it
    /// went unused): the run at its top, if it ends where the counter
    /// stands, goes back to the counter, which moves down to its first
    /// number, and the blocks that held it no longer do; as if never
    /// taken, so a quiet sequence loses none of them. Only under the
    /// definition they were taken under (a forced change since must not
    /// see its counter below numbers it printed). Returns the runs that
    /// did not go back (below numbers taken since: the caller records
    /// them) and where the counter stands.
    pub async fn take_back(
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &str,
        held: &[SeqRange],
    ) -> Result<(Vec<SeqRange>, Option<i64>), sqlx::Error> {
        let Some(top) = held.last().copied() else {
            return Ok((Vec::new(), None));
        };
        let row = sqlx::query!(
            "WITH lowered AS ( \
                 UPDATE counters SET next_seq = $3 \
                 WHERE sequence_id = $1 AND period = $2 AND next_seq = $4 \
                   AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $5 FOR KEY SHARE) \
                 RETURNING next_seq \
             ), trimmed AS ( \
                 UPDATE blocks SET seqs = seqs - int8range($3, $4) \
                 WHERE sequence_id = $1 AND period = $2 AND seqs && int8range($3, $4) \
                   AND lower(seqs) < $3 AND EXISTS (SELECT 1 FROM lowered) \
                 RETURNING 1 \
             ), removed AS ( \
                 DELETE FROM blocks \
                 WHERE sequence_id = $1 AND period = $2 AND seqs <@ int8range($3, $4) \
                   AND EXISTS (SELECT 1 FROM lowered) \
                 RETURNING 1 \
             ) \
             SELECT (SELECT next_seq FROM lowered) AS lowered, \
                    (SELECT next_seq FROM counters WHERE sequence_id = $1 AND period = $2) AS next",
            sequence.id,
            period,
            top.start,
            top.end,
            sequence.identity_version,
        )
        .fetch_one(conn.statements())
        .await?;
        match row.lowered {
            Some(next) => Ok((held[..held.len() - 1].to_vec(), Some(next))),
            None => Ok((held.to_vec(), row.next)),
        }
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// Creates the period's counter at its first number the first time it
    /// is used, committed on its own: inside a caller's transaction that
    /// rolls back, the row would vanish while this instance remembers it
    /// as created (and concurrent first users would not see it yet). A
    /// counter at its first number has given out nothing.
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
        create_counter(db, sequence, period).await?;
        self.now_known(key);
        Ok(())
    }

    /// [`Counter::ensure_period`] of many periods in one statement (the
    /// joined direct reservations' first uses).
    pub(super) async fn ensure_periods<'e, E: sqlx::PgExecutor<'e>>(
        &self,
        db: E,
        periods: &[(&Sequence, &Period)],
    ) -> Result<(), sqlx::Error> {
        let unknown: Vec<&(&Sequence, &Period)> = periods
            .iter()
            .filter(|(sequence, period)| !self.known(&(sequence.id, period.key().to_owned())))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = unknown.iter().map(|(s, _)| s.id).collect();
        let keys: Vec<&str> = unknown.iter().map(|(_, p)| p.key()).collect();
        let firsts: Vec<i64> = unknown.iter().map(|(s, p)| s.first_number(p)).collect();
        sqlx::query!(
            "INSERT INTO counters (sequence_id, period, next_seq) \
             SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[]) \
             ON CONFLICT (sequence_id, period) DO NOTHING",
            &ids,
            &keys as &[&str],
            &firsts,
        )
        .execute(db)
        .await?;
        for (sequence, period) in unknown {
            self.now_known((sequence.id, period.key().to_owned()));
        }
        Ok(())
    }

    /// The counter of `(sequence id, period)` exists.
    fn now_known(&self, key: (i64, String)) {
        let mut known = self.known_periods.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= MAX_KNOWN_PERIODS {
            known.clear();
        }
        known.insert(key);
    }

    fn known(&self, key: &(i64, String)) -> bool {
        self.known_periods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(key)
    }

    /// Reserves up to `want` numbers for a pool (fewer near `max`).
    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn reserve_pool_block(
        &self,
        sequence: &Sequence,
        period: &Period,
        want: i64,
        lock_acquired_at: DateTime<Utc>,
    ) -> Result<Reserved<PoolBlock>, sqlx::Error> {
        self.ensure_period(&self.refill_db, sequence, period)
            .await?;
        // In a transaction, so a block taken on a timeline the counters were
        // not fenced on is undone rather than pushed. The definition row is
        // locked (FOR KEY SHARE, here and in every other reservation) until
        // the commit: a PUT changing it (which locks it FOR UPDATE) waits
        // and then sees these numbers as taken, or this reservation waits
        // and finds the new definition (so a change of `numbering` can
        // never race a first refill).
        let mut tx = self.refill_db.begin().await?;
        let row = sqlx::query!(
            "WITH taken AS ( \
                 UPDATE counters SET last_grant = LEAST($3, $4 - next_seq + 1), \
                                     next_seq = next_seq + LEAST($3, $4 - next_seq + 1) \
                 WHERE sequence_id = $1 AND period = $2 AND next_seq <= $4 \
                   AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $7 FOR KEY SHARE) \
                 RETURNING next_seq - last_grant AS first, next_seq AS next \
             ), due AS ( \
                 INSERT INTO reconcile_due (sequence_id, period) SELECT $1, $2 FROM taken \
                 ON CONFLICT DO NOTHING \
             ) \
             INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id, lock_acquired_at) \
             SELECT $1, $2, int8range(first, next), 'pool', $5, $6 FROM taken \
             RETURNING id, lower(seqs) AS \"start!\", upper(seqs) AS \"end!\", \
                       substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS \"timeline!\"",
            sequence.id,
            period.key(),
            want,
            sequence.definition.max_seq(),
            &self.instance_id,
            lock_acquired_at,
            sequence.identity_version,
        )
        .fetch_optional(&mut tx)
        .await?
        .map(|r| (r.id, r.start, r.end, r.timeline));
        match row {
            Some((_, _, _, timeline)) if !self.on_fenced_timeline(&timeline) => {
                tx.rollback().await?;
                Ok(Reserved::Unfenced)
            }
            Some((id, start, end, _)) => {
                let block = PoolBlock {
                    id,
                    range: SeqRange::new(start, end),
                };
                // Which session commits: a commit in doubt waits for its end.
                let session = tx.session().await;
                match tx.commit().await {
                    Ok(()) => Ok(Reserved::Got(block)),
                    // The connection broke before the commit's answer (a
                    // crash, a failover): once the server answers again,
                    // a block that landed is pushed like any other instead
                    // of being written off.
                    Err(e) if self.block_landed(&block, session).await == Some(true) => {
                        tracing::info!(error = %e, block = id, "a block whose commit was in doubt had landed");
                        Ok(Reserved::Got(block))
                    }
                    Err(e) => Err(e),
                }
            }
            None => {
                tx.rollback().await?;
                self.why_not(&self.refill_db, sequence).await
            }
        }
    }

    /// Whether a pool block whose commit was in doubt is there, asked once
    /// the server answers again; None when it did not in time.
    async fn block_landed(
        &self,
        block: &PoolBlock,
        session: Option<crate::infra::db::Session>,
    ) -> Option<bool> {
        let (id, start, end) = (block.id, block.range.start, block.range.end);
        crate::infra::db::once_answering(&self.refill_db, crate::infra::db::IN_DOUBT_PATIENCE, session, |mut conn| async move {
            sqlx::query_scalar!(
                r#"SELECT EXISTS (SELECT 1 FROM blocks WHERE id = $1 AND seqs = int8range($2, $3)) AS "landed!""#,
                id,
                start,
                end,
            )
            .fetch_one(&mut conn)
            .await
        })
        .await
    }

    /// A reservation found no row: the counter is spent, or the definition
    /// it was asked under is no longer the sequence's.
    async fn why_not<'e, T, E: sqlx::PgExecutor<'e>>(
        &self,
        db: E,
        sequence: &Sequence,
    ) -> Result<Reserved<T>, sqlx::Error> {
        let current: Option<i32> = sqlx::query_scalar!(
            "SELECT identity_version FROM sequences WHERE id = $1",
            sequence.id
        )
        .fetch_optional(db)
        .await?;
        Ok(if current == Some(sequence.identity_version) {
            Reserved::Exhausted
        } else {
            Reserved::Stale
        })
    }

    /// Postgres was found behind Redis: a pool of this period was filled
    /// up to `max_end`, but the counter is below it (a failover to a standby
    /// that missed the last commits). Moves the counter past `max_end` and
    /// records the numbers it skips as a block taken, so they are never
    /// reserved again and reconciliation accounts for them. The skipped
    /// range, if the counter was behind.
    pub async fn fence(
        &self,
        sequence: &Sequence,
        period: &Period,
        max_end: i64,
    ) -> Result<Option<SeqRange>, sqlx::Error> {
        let mut tx = self.refill_db.begin().await?;
        create_counter(&mut tx, sequence, period).await?;
        let next: i64 = sqlx::query_scalar!(
            "SELECT next_seq FROM counters WHERE sequence_id = $1 AND period = $2 FOR UPDATE",
            sequence.id,
            period.key(),
        )
        .fetch_one(&mut tx)
        .await?;
        if next >= max_end {
            return Ok(None);
        }
        sqlx::query!(
            "UPDATE counters SET next_seq = $3 WHERE sequence_id = $1 AND period = $2",
            sequence.id,
            period.key(),
            max_end,
        )
        .execute(&mut tx)
        .await?;
        sqlx::query!(
            "WITH due AS ( \
                 INSERT INTO reconcile_due (sequence_id, period) VALUES ($1, $2) ON CONFLICT DO NOTHING \
             ) \
             INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id) \
             VALUES ($1, $2, int8range($3, $4), 'pool', $5)",
            sequence.id,
            period.key(),
            next,
            max_end,
            format!("fence:{}", self.instance_id),
        )
        .execute(&mut tx)
        .await?;
        tx.commit().await?;
        Ok(Some(SeqRange::new(next, max_end)))
    }

    /// Of `seen` (project, type, period, highest block end in Redis), those
    /// whose counter in Postgres is below that end, or missing.
    pub async fn behind(
        &self,
        seen: &[(String, String, String, i64)],
    ) -> Result<Vec<(String, String, String, i64)>, sqlx::Error> {
        let projects: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        let types: Vec<&str> = seen.iter().map(|s| s.1.as_str()).collect();
        let periods: Vec<&str> = seen.iter().map(|s| s.2.as_str()).collect();
        let ends: Vec<i64> = seen.iter().map(|s| s.3).collect();
        let rows = sqlx::query!(
            "SELECT w.p AS \"project!\", w.t AS \"doc_type!\", w.pe AS \"period!\", w.e AS \"end!\" \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[]) AS w(p, t, pe, e) \
             LEFT JOIN sequences s ON s.project = w.p AND s.doc_type = w.t \
             LEFT JOIN counters c ON c.sequence_id = s.id AND c.period = w.pe \
             WHERE c.next_seq IS NULL OR c.next_seq < w.e",
            &projects as &[&str],
            &types as &[&str],
            &periods as &[&str],
            &ends,
        )
        .fetch_all(&self.refill_db)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.project, r.doc_type, r.period, r.end))
            .collect())
    }

    /// Which Postgres this is: its system identifier (where the role may
    /// read it) and its timeline, which a promoted standby changes.
    pub async fn postgres_identity(&self) -> Result<PostgresIdentity, sqlx::Error> {
        let timeline = self.timeline().await?;
        let system: Option<String> = sqlx::query_scalar!(
            r#"SELECT system_identifier::text AS "system!" FROM pg_control_system()"#
        )
        .fetch_one(&self.refill_db)
        .await
        .ok();
        Ok(PostgresIdentity { system, timeline })
    }

    pub async fn mark_pushed(&self, block_id: i64) -> Result<(), sqlx::Error> {
        sqlx::query!(
            "UPDATE blocks SET pushed_at = clock_timestamp() WHERE id = $1",
            block_id
        )
        .execute(&self.refill_db)
        .await?;
        Ok(())
    }

    /// Reserves exactly `n` numbers for one caller, straight from the
    /// counter (no pool), inside the caller's transaction; they are issued
    /// once its ledger record commits. `tag` names the block (see
    /// [`Counter::direct_tag`]). Callers without a transaction are joined
    /// in [`DirectReservations`].
    pub async fn reserve_direct(
        &self,
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &Period,
        n: i64,
        tag: &str,
    ) -> Result<Reserved<SeqRange>, sqlx::Error> {
        self.ensure_period(&self.refill_db, sequence, period)
            .await?;
        self.take_direct(conn, sequence, period, n, tag).await
    }

    /// [`Counter::reserve_direct`] once the period's counter exists. It
    /// locks one definition (FOR KEY SHARE, while its conditions are
    /// checked) and then one counter row, no more: a statement that locked
    /// several at once waited in a cycle with a batch that locks
    /// definitions FOR UPDATE in its items' order (a deadlock, seen).
    async fn take_direct(
        &self,
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &Period,
        n: i64,
        tag: &str,
    ) -> Result<Reserved<SeqRange>, sqlx::Error> {
        let fenced = self.fenced_timeline();
        // On a timeline the counters were not fenced on nothing is taken
        // (without a transaction to roll back, numbers taken there could
        // never be handed out).
        let taken = sqlx::query!(
            "WITH taken AS ( \
                 UPDATE counters SET last_grant = $3, next_seq = next_seq + $3 \
                 WHERE sequence_id = $1 AND period = $2 AND next_seq + $3 - 1 <= $4 \
                   AND ($7::text IS NULL OR substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) = $7) \
                   AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $6 FOR KEY SHARE) \
                 RETURNING next_seq - $3 AS first, next_seq AS next \
             ), due AS ( \
                 INSERT INTO reconcile_due (sequence_id, period) SELECT $1, $2 FROM taken \
                 ON CONFLICT DO NOTHING \
             ) \
             INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id) \
             SELECT $1, $2, int8range(first, next), 'direct', $5 FROM taken \
             RETURNING lower(seqs) AS \"first!\", \
                       substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS \"timeline!\"",
            sequence.id,
            period.key(),
            n,
            sequence.definition.max_seq(),
            tag,
            sequence.identity_version,
            fenced,
        )
        .fetch_optional(conn.statements())
        .await?
        .map(|r| (r.first, r.timeline));
        match taken {
            Some((first, timeline)) if self.on_fenced_timeline(&timeline) => {
                Ok(Reserved::Got(SeqRange::new(first, first + n)))
            }
            // Fenced meanwhile on another timeline; the caller's
            // transaction rolls back (and without one, see above).
            Some(_) => Ok(Reserved::Unfenced),
            None => match &fenced {
                // Not exhausted: Postgres is on another timeline than the
                // one asked for (a failover, fenced since or not yet).
                Some(asked) if *asked != self.timeline_of(&mut *conn).await? => {
                    Ok(Reserved::Unfenced)
                }
                _ => self.why_not(conn.statements(), sequence).await,
            },
        }
    }

    /// [`Counter::take_direct`] for many counters in one statement, each
    /// taken only if nobody holds it or its definition: `None` for those
    /// held (they are asked again, each in a statement that waits), or
    /// not taken for another reason (exhausted, a changed definition, a
    /// failover: the waiting statement tells which). Never waiting for a
    /// lock, it can be in no deadlock, however many it locks (a statement
    /// that waited for counters while holding others deadlocked with
    /// batches that lock definitions in their items' order). One counter
    /// appears once among `asks`.
    ///
    /// `free` is materialized and carries its definition's version: the
    /// update then probes each counter once. Inlined and joined with
    /// `defined` again, Postgres's generic plan (an `unnest` is guessed at
    /// ten rows) probed every counter once per ask, so a batch cost the
    /// square of its size: 200 fresh counters 113-139 ms, now 15-19 ms
    /// (BENCHMARKS.md, "A direct reservation's square").
    pub(super) async fn take_direct_unless_locked(
        &self,
        conn: &mut impl Link,
        asks: &[DirectAsk<'_>],
    ) -> Result<Vec<Option<Reserved<SeqRange>>>, sqlx::Error> {
        let fenced = self.fenced_timeline();
        let ids: Vec<i64> = asks.iter().map(|a| a.sequence.id).collect();
        let periods: Vec<&str> = asks.iter().map(|a| a.period.key()).collect();
        let ns: Vec<i64> = asks.iter().map(|a| a.n).collect();
        let maxes: Vec<i64> = asks
            .iter()
            .map(|a| a.sequence.definition.max_seq())
            .collect();
        let versions: Vec<i32> = asks.iter().map(|a| a.sequence.identity_version).collect();
        let tags: Vec<&str> = asks.iter().map(|a| a.tag).collect();
        let rows = sqlx::query!(
            "WITH asks AS ( \
                 SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], \
                                      $5::int[], $6::text[]) WITH ORDINALITY \
                     AS a(sid, period, n, mx, iv, tag, ord) \
             ), locked AS ( \
                 SELECT c.sequence_id, c.period FROM counters c \
                 JOIN asks a ON c.sequence_id = a.sid AND c.period = a.period \
                 FOR UPDATE OF c SKIP LOCKED \
             ), defined AS ( \
                 SELECT s.id, s.identity_version FROM sequences s \
                 WHERE s.id IN (SELECT sid FROM asks) \
                 FOR KEY SHARE OF s SKIP LOCKED \
             ), free AS MATERIALIZED ( \
                 SELECT a.*, d.identity_version AS defined_iv FROM asks a \
                 JOIN locked l ON l.sequence_id = a.sid AND l.period = a.period \
                 JOIN defined d ON d.id = a.sid \
             ), taken AS ( \
                 UPDATE counters c SET last_grant = f.n, next_seq = c.next_seq + f.n \
                 FROM free f \
                 WHERE c.sequence_id = f.sid AND c.period = f.period \
                   AND f.defined_iv = f.iv AND c.next_seq + f.n - 1 <= f.mx \
                   AND ($7::text IS NULL OR substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) = $7) \
                 RETURNING c.sequence_id, c.period, c.next_seq - f.n AS first, c.next_seq AS next, f.tag \
             ), due AS ( \
                 INSERT INTO reconcile_due (sequence_id, period) SELECT sequence_id, period FROM taken \
                 ON CONFLICT DO NOTHING \
             ), block AS ( \
                 INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id) \
                 SELECT sequence_id, period, int8range(first, next), 'direct', tag FROM taken \
                 RETURNING sequence_id, period, lower(seqs) AS first \
             ) \
             SELECT a.ord AS \"ord!\", b.first, \
                    substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS \"timeline!\" \
             FROM asks a LEFT JOIN block b ON b.sequence_id = a.sid AND b.period = a.period \
             ORDER BY a.ord",
            &ids,
            &periods as &[&str],
            &ns,
            &maxes,
            &versions,
            &tags as &[&str],
            fenced,
        )
        .fetch_all(conn.statements())
        .await?;
        // Taken on a timeline the counters were not fenced on: nothing
        // can be handed out (committed already, reconciliation names them).
        let on_fenced = rows
            .iter()
            .find(|r| r.first.is_some())
            .is_none_or(|r| self.on_fenced_timeline(&r.timeline));
        let mut out = vec![None; asks.len()];
        for row in rows {
            let (Ok(i), Some(first)) = (usize::try_from(row.ord - 1), row.first) else {
                continue;
            };
            if let Some(ask) = asks.get(i) {
                out[i] = Some(if on_fenced {
                    Reserved::Got(SeqRange::new(first, first + ask.n))
                } else {
                    Reserved::Unfenced
                });
            }
        }
        Ok(out)
    }

    /// A name for one direct reservation's block, unique to it: this
    /// instance and a count.
    pub fn direct_tag(&self) -> String {
        let n = self
            .direct_reservations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}/direct-{n}", self.instance_id)
    }

    /// A direct reservation whose commit was in doubt (no transaction of
    /// the caller's: the statement committed by itself), looked up by its
    /// tag once the server answers again: its numbers if it landed. None
    /// when it did not, or Postgres never answered in time.
    pub(super) async fn direct_landed(
        &self,
        sequence: &Sequence,
        period: &Period,
        tag: &str,
    ) -> Option<SeqRange> {
        let (id, period, tag) = (sequence.id, period.key().to_owned(), tag.to_owned());
        // The statement's session is not known (its answer was lost): a
        // cut connection to a live server could still be committing it.
        let found = crate::infra::db::once_answering(&self.refill_db, crate::infra::db::IN_DOUBT_PATIENCE, None, |mut conn| {
            let (period, tag) = (period.clone(), tag.clone());
            async move {
                // Among the period's latest blocks (an index scan from the
                // top): the reservation was the latest a moment ago.
                sqlx::query!(
                    r#"SELECT lower(b.seqs) AS "start!", upper(b.seqs) AS "end!",
                              substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS "timeline!"
                       FROM (SELECT seqs, instance_id FROM blocks WHERE sequence_id = $1 AND period = $2
                             ORDER BY lower(seqs) DESC LIMIT 10000) b
                       WHERE b.instance_id = $3"#,
                    id,
                    &period,
                    &tag,
                )
                .fetch_optional(&mut conn)
                .await
            }
        })
        .await
        .flatten()?;
        // Landed on a timeline the counters were not fenced on: those
        // numbers cannot be handed out (reconciliation names them).
        self.on_fenced_timeline(&found.timeline)
            .then(|| SeqRange::new(found.start, found.end))
    }

    fn fenced_timeline(&self) -> Option<String> {
        self.fenced_timeline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    async fn timeline_of(&self, conn: &mut impl Link) -> Result<String, sqlx::Error> {
        sqlx::query_scalar!(
            r#"SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS "timeline!""#
        )
        .fetch_one(conn.statements())
        .await
    }
}

impl Counter {
    /// The next `n` numbers of a gapless sequence's period, taken inside
    /// the caller's transaction: the counter row stays locked until that
    /// transaction ends, so numbers follow commit order and a rollback
    /// gives them back (no block is recorded: nothing outside the
    /// transaction ever holds them).
    pub async fn take_gapless(
        &self,
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &Period,
        n: i64,
    ) -> Result<Reserved<SeqRange>, sqlx::Error> {
        self.ensure_period(&self.refill_db, sequence, period)
            .await?;
        let first = sqlx::query_scalar!(
            "UPDATE counters SET next_seq = next_seq + $3 \
             WHERE sequence_id = $1 AND period = $2 AND next_seq + $3 - 1 <= $4 \
               AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $5 \
                           AND numbering = 'gapless' FOR KEY SHARE) \
             RETURNING next_seq - $3 AS \"first!\"",
            sequence.id,
            period.key(),
            n,
            sequence.definition.max_seq(),
            sequence.identity_version,
        )
        .fetch_optional(conn.statements())
        .await?;
        match first {
            Some(first) => Ok(Reserved::Got(SeqRange::new(first, first + n))),
            None => self.why_not(conn.statements(), sequence).await,
        }
    }

    /// [`Counter::take_gapless`] for a commit shared by many sequences:
    /// `None`, at once, when another transaction holds the counter (a
    /// batch of that sequence, another instance's shared commit), rather
    /// than making every document of the commit wait for it. With what it
    /// took, the id of the caller's transaction (`txid_current()`, read in
    /// the same round trip): should the commit's answer be lost, that id
    /// says whether these numbers were written (after a rollback another
    /// document takes the same numbers, so the rows alone cannot say).
    pub async fn take_gapless_unless_held(
        &self,
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &Period,
        n: i64,
    ) -> Result<Option<(Reserved<SeqRange>, i64)>, sqlx::Error> {
        self.ensure_period(&self.refill_db, sequence, period)
            .await?;
        // One round trip: the lock (skipped when held), then the update of
        // the row it locked.
        let taken = sqlx::query!(
            "WITH locked AS ( \
               SELECT 1 FROM counters WHERE sequence_id = $1 AND period = $2 \
               FOR UPDATE SKIP LOCKED \
             ), taken AS ( \
               UPDATE counters SET next_seq = next_seq + $3 \
               WHERE sequence_id = $1 AND period = $2 AND next_seq + $3 - 1 <= $4 \
                 AND EXISTS (SELECT 1 FROM locked) \
                 AND EXISTS (SELECT 1 FROM sequences WHERE id = $1 AND identity_version = $5 \
                             AND numbering = 'gapless' FOR KEY SHARE) \
               RETURNING next_seq - $3 AS first \
             ) \
             SELECT EXISTS (SELECT 1 FROM locked) AS \"locked!\", \
                    (SELECT first FROM taken) AS first, txid_current() AS \"xid!\"",
            sequence.id,
            period.key(),
            n,
            sequence.definition.max_seq(),
            sequence.identity_version,
        )
        .fetch_one(conn.statements())
        .await?;
        let reserved = match (taken.locked, taken.first) {
            (false, _) => return Ok(None),
            (true, Some(first)) => Reserved::Got(SeqRange::new(first, first + n)),
            (true, None) => self.why_not(conn.statements(), sequence).await?,
        };
        Ok(Some((reserved, taken.xid)))
    }
}

/// One counter's share of a joined direct reservation.
pub(super) struct DirectAsk<'a> {
    pub sequence: &'a Sequence,
    pub period: &'a Period,
    pub n: i64,
    /// The name its block is recorded under.
    pub tag: &'a str,
}

/// The period's counter at its first number, unless it exists.
async fn create_counter<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    sequence: &Sequence,
    period: &Period,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO counters (sequence_id, period, next_seq) VALUES ($1, $2, $3) \
         ON CONFLICT (sequence_id, period) DO NOTHING",
        sequence.id,
        period.key(),
        sequence.first_number(period),
    )
    .execute(db)
    .await?;
    Ok(())
}
