//! SQL of the outbox (`id_outbox`) after a document's row is written:
//! reading, listing, retrying, abandoning.

use crate::infra::db::{Db, Link, Tx};
use chrono::{DateTime, Utc};
use serde::Serialize;

pub use crate::records::ledger::outbox_rows::DocumentStatus;
use utoipa::ToSchema;

use super::sink::Delivery;

mod listing;
use listing::VIEW_COLUMNS;
pub use listing::{DocumentView, ListError, ListFilter, find, list};

/// The index (in `ids`) of the first document ID another document has.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn first_taken(conn: &mut Tx<'_>, ids: &[&str]) -> Result<Option<usize>, sqlx::Error> {
    let taken: Vec<String> = sqlx::query_scalar!(
        "SELECT document_id FROM id_outbox WHERE document_id = ANY($1)",
        ids as &[&str],
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(ids.iter().position(|id| taken.iter().any(|t| t == id)))
}

/// A document found by its source id.
#[derive(Debug)]
pub struct KnownSource {
    pub project: String,
    pub doc_type: String,
    pub source_id: String,
    pub id: String,
    pub seq: i64,
    pub status: DocumentStatus,
    pub created_at: DateTime<Utc>,
}

impl KnownSource {
    pub fn accepted(self) -> crate::features::documents::Accepted {
        crate::features::documents::Accepted {
            id: self.id,
            project: self.project,
            doc_type: self.doc_type,
            seq: self.seq,
            status: self.status,
            created_at: self.created_at,
            verifactu: None,
        }
    }
}

/// The documents that carry these `(project, type, source id)`s.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn by_source_ids(
    conn: &mut Tx<'_>,
    keys: &[(&str, &str, &str)],
) -> Result<Vec<KnownSource>, sqlx::Error> {
    let projects: Vec<&str> = keys.iter().map(|k| k.0).collect();
    let types: Vec<&str> = keys.iter().map(|k| k.1).collect();
    let sources: Vec<&str> = keys.iter().map(|k| k.2).collect();
    sqlx::query_as!(
        KnownSource,
        "SELECT o.tenant_code AS project, o.entity_type_id AS doc_type, \
                o.source_id AS \"source_id!\", o.document_id AS id, o.seq_number AS seq, \
                o.status::text AS \"status!: DocumentStatus\", o.created_at \
         FROM unnest($1::text[], $2::text[], $3::text[]) AS k(p, t, s) \
         JOIN id_outbox o ON o.tenant_code = k.p AND o.entity_type_id = k.t AND o.source_id = k.s",
        &projects as &[&str],
        &types as &[&str],
        &sources as &[&str],
    )
    .fetch_all(&mut *conn)
    .await
}

/// Whether number `seq` of the sequence period carries a document.
pub async fn carries_document(
    conn: &mut Tx<'_>,
    sequence_id: i64,
    period: &str,
    seq: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT EXISTS (SELECT 1 FROM id_outbox WHERE sequence_id = $1 AND period = $2 AND seq = $3) \
         AS \"carries!\"",
        sequence_id,
        period,
        seq,
    )
    .fetch_one(&mut *conn)
    .await
}

#[derive(Debug, thiserror::Error)]
pub enum TransitionError {
    #[error("no document {0}")]
    NotFound(String),
    #[error("document {id} is {status}; {action} applies to {allowed}")]
    NotAllowed {
        id: String,
        status: &'static str,
        action: &'static str,
        allowed: &'static str,
    },
    /// An attempt is under way: the target may be taking the document.
    #[error(
        "a delivery of {id} is under way (its claim ends at {until}); abandon it once the attempt has ended"
    )]
    InFlight { id: String, until: DateTime<Utc> },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// A status change an operator may ask for.
struct Transition {
    action: &'static str,
    /// The statuses it applies to, as the refusal names them.
    allowed_text: &'static str,
    allowed: &'static [DocumentStatus],
    to: DocumentStatus,
    /// The other columns it sets.
    also_set: &'static str,
    /// Refused while an attempt is under way (its outcome would contradict
    /// the answer).
    not_in_flight: bool,
}

/// Back to `pending`, retry count reset: for dead letters (and abandoned
/// documents an operator wants back).
const RETRY: Transition = Transition {
    action: "retry",
    allowed_text: "dead_letter or abandoned documents",
    allowed: &[DocumentStatus::DeadLetter, DocumentStatus::Abandoned],
    to: DocumentStatus::Pending,
    also_set: "retry_count = 0, next_retry_at = now(), processed_at = NULL",
    not_in_flight: false,
};

/// Gives up on a document: its number becomes an `abandoned` gap.
const ABANDON: Transition = Transition {
    action: "abandon",
    allowed_text: "pending, dead_letter or abandoned documents",
    allowed: &[
        DocumentStatus::Pending,
        DocumentStatus::DeadLetter,
        DocumentStatus::Abandoned,
    ],
    to: DocumentStatus::Abandoned,
    also_set: "processed_at = coalesce(processed_at, now())",
    not_in_flight: true,
};

/// Back to `pending`, retry count reset: for dead letters (and abandoned
/// documents an operator wants back).
pub async fn retry(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<DocumentView, TransitionError> {
    transition(db, document_id, projects, &RETRY).await
}

/// Gives up on a document: its number becomes an `abandoned` gap.
pub async fn abandon(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<DocumentView, TransitionError> {
    transition(db, document_id, projects, &ABANDON).await
}

async fn transition(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
    change: &Transition,
) -> Result<DocumentView, TransitionError> {
    let mut tx = db.begin().await?;
    // Locked, so a processor's claim skips it meanwhile; one whose attempt
    // is under way (its claim still holds) has the row unlocked, and is
    // told apart by its claim.
    let found = sqlx::query!(
        "SELECT status::text AS \"status!: DocumentStatus\", \
                CASE WHEN status = 'pending' THEN idpool_attempt_ends(claimed_until, next_retry_at) END \
                    AS in_flight_until \
           FROM id_outbox WHERE document_id = $1 \
         AND ($2::text[] IS NULL OR tenant_code = ANY($2)) FOR UPDATE",
        document_id,
        projects,
    )
    .fetch_optional(&mut tx)
    .await?;
    let Some(found) = found else {
        return Err(TransitionError::NotFound(document_id.to_owned()));
    };
    if change.not_in_flight
        && let Some(until) = found.in_flight_until
    {
        return Err(TransitionError::InFlight {
            id: document_id.to_owned(),
            until,
        });
    }
    let current = found.status;
    if !change.allowed.contains(&current) {
        return Err(TransitionError::NotAllowed {
            id: document_id.to_owned(),
            status: current.as_str(),
            action: change.action,
            allowed: change.allowed_text,
        });
    }
    let also_set = change.also_set;
    let sql = format!(
        "UPDATE id_outbox SET status = $2, {also_set} WHERE document_id = $1 RETURNING {VIEW_COLUMNS}"
    );
    let view: DocumentView = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(document_id)
        .bind(change.to)
        .fetch_one(&mut tx)
        .await?;
    if current != DocumentStatus::Pending {
        // Wake processors for a document that is due again.
        sqlx::query_scalar!("SELECT pg_notify('idpool_outbox', '')")
            .fetch_one(&mut tx)
            .await?;
    }
    tx.commit().await?;
    Ok(view)
}

/// Deliveries to the Postgres or directory sink that may run at once
/// across every instance behind a pooler. Such a delivery keeps its
/// transaction open while it writes, and behind a pooler that holds one of
/// the server connections every instance shares. (A webhook's deliveries
/// hold no transaction while the target answers.)
pub const DELIVERY_SLOTS: i32 = 2;

/// Takes one of the `DELIVERY_SLOTS` for as long as `tx` lasts; false when
/// every one is taken.
pub async fn take_delivery_slot(tx: &mut Tx<'_>) -> Result<bool, sqlx::Error> {
    // Tried one after another: the first free one is taken, no other.
    for slot in 0..DELIVERY_SLOTS {
        let taken = sqlx::query_scalar!(
            r#"SELECT pg_try_advisory_xact_lock(hashtext('idpool:outbox-delivery'), $1) AS "taken!""#,
            slot,
        )
        .fetch_one(&mut *tx)
        .await?;
        if taken {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Claims up to `limit` due rows for delivery (locked until the caller's
/// transaction ends; rows another processor holds are skipped). Their
/// payload is read only when the sink needs it.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn claim_due(
    conn: &mut Tx<'_>,
    limit: i64,
    with_payload: bool,
    tenants: &[String],
) -> Result<Vec<Delivery>, sqlx::Error> {
    // Deliveries (a webhook's answers) keep this transaction open while
    // no statement runs; their own timeouts bound that, not Postgres'.
    // The claim walks the index of pending rows in due order and stops
    // after `limit`. Until autovacuum has analyzed a fast-growing outbox
    // (a fresh install taking a migration), the planner believes a few
    // hundred rows are pending and reads all of them, then sorts (the
    // claim's cost at 150,000 pending is in BENCHMARKS.md, "Leases").
    // Every statement of this transaction finds its rows by an index, in
    // the order it reads them: a tenant's pending rows by due time, never
    // all of them sorted (which the planner thinks cheap for a tenant whose
    // rows its statistics have not seen yet).
    sqlx::raw_sql(
        "SET LOCAL idle_in_transaction_session_timeout = 0; \
         SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off; \
         SET LOCAL enable_sort = off",
    )
    .execute(&mut *conn)
    .await?;
    let payload = if with_payload {
        "payload::text"
    } else {
        "NULL::text"
    };
    // Every tenant with pending rows gets an equal share of the batch, so
    // one tenant's backlog (a migration of millions) delays another's
    // documents by one batch, not by the backlog. What the shares leave of
    // the batch goes to the tenants that filled theirs.
    if tenants.is_empty() {
        return Ok(Vec::new());
    }
    let share = (limit / tenants.len() as i64).max(1);
    // The status spelt out, so the planner matches the partial index of
    // pending rows by tenant: one statement per tenant, on the only index
    // that orders a tenant's pending rows by due time (none walks every
    // tenant's rows, so a plan for any tenant is the right plan).
    let pending = DocumentStatus::Pending.as_str();
    // Rows this transaction holds already are not skipped by SKIP LOCKED
    // (it holds their locks): `$3` names them.
    let sql = format!(
        "SELECT id AS row_id, document_id, tenant_code AS project, entity_type_id AS doc_type, \
                seq_number AS seq, created_at, {payload} AS payload \
         FROM id_outbox \
         WHERE tenant_code = $1 AND status = '{pending}' AND next_retry_at <= now() \
           AND id <> ALL($3) \
         ORDER BY tenant_code, next_retry_at LIMIT $2 FOR UPDATE SKIP LOCKED"
    );
    let mut claimed: Vec<Delivery> = Vec::new();
    for tenant in tenants {
        claimed.extend(claim_of(conn, &sql, tenant, share, &[]).await?);
    }
    if tenants.len() > 1 {
        claim_what_shares_left(conn, &sql, tenants, limit, share, &mut claimed).await?;
    }
    Ok(claimed)
}

/// What the shares left of the batch goes to the tenants that filled
/// theirs (their rows may be due; the others had no more).
async fn claim_what_shares_left(
    conn: &mut Tx<'_>,
    sql: &str,
    tenants: &[String],
    limit: i64,
    share: i64,
    claimed: &mut Vec<Delivery>,
) -> Result<(), sqlx::Error> {
    let mut room = limit - claimed.len() as i64;
    for tenant in tenants {
        if room <= 0 {
            break;
        }
        let held: Vec<i64> = claimed
            .iter()
            .filter(|d| d.project == *tenant)
            .map(|d| d.row_id)
            .collect();
        if (held.len() as i64) < share {
            continue;
        }
        let more = claim_of(conn, sql, tenant, room, &held).await?;
        room -= more.len() as i64;
        claimed.extend(more);
    }
    Ok(())
}

/// Up to `limit` due rows of `tenant` that no other transaction holds,
/// leaving out `held` (this one's).
async fn claim_of(
    conn: &mut Tx<'_>,
    sql: &str,
    tenant: &str,
    limit: i64,
    held: &[i64],
) -> Result<Vec<Delivery>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(tenant)
        .bind(limit)
        .bind(held)
        .fetch_all(&mut *conn)
        .await
}

/// How long until `tenant`'s next pending row is due (zero when one is due
/// now), by the database's clock (which set the due times); None when it
/// has none pending for the sink (rows routed to endpoints are never due
/// here: their due time is infinity). Inside the claim's transaction: the due-order index of
/// the tenant's pending rows is the one read.
pub async fn next_due_of(
    conn: &mut Tx<'_>,
    tenant: &str,
) -> Result<Option<std::time::Duration>, sqlx::Error> {
    // `pending` spelt out (DocumentStatus::Pending), so the planner matches
    // the partial index.
    let seconds = sqlx::query_scalar!(
        "SELECT extract(epoch FROM next_retry_at - clock_timestamp())::float8 AS \"seconds!\" \
         FROM id_outbox WHERE tenant_code = $1 AND status = 'pending' \
           AND next_retry_at < 'infinity' \
         ORDER BY tenant_code, next_retry_at LIMIT 1",
        tenant,
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(seconds.map(|s| std::time::Duration::try_from_secs_f64(s).unwrap_or_default()))
}

/// How long the oldest pending row has waited, in seconds (0 with none):
/// what an operator is alerted on when delivery stalls.
pub async fn oldest_pending_age(db: &Db) -> Result<f64, sqlx::Error> {
    let seconds = sqlx::query_scalar!(
        "SELECT extract(epoch FROM clock_timestamp() - created_at)::float8 AS \"seconds!\" \
         FROM id_outbox WHERE status = 'pending' ORDER BY status, id LIMIT 1"
    )
    .fetch_optional(db)
    .await?;
    Ok(seconds.unwrap_or(0.0).max(0.0))
}

/// The tenants that have pending rows, found by skipping through the index
/// of pending rows by tenant: one probe per such tenant, however many rows
/// each holds.
pub async fn tenants_with_pending_rows(conn: &mut Tx<'_>) -> Result<Vec<String>, sqlx::Error> {
    // `pending` spelt out (DocumentStatus::Pending), so the planner matches
    // the partial index.
    sqlx::query_scalar!(
        "WITH RECURSIVE t(code) AS ( \
             (SELECT tenant_code FROM id_outbox WHERE status = 'pending' \
              ORDER BY tenant_code LIMIT 1) \
             UNION ALL \
             SELECT (SELECT o.tenant_code FROM id_outbox o \
                     WHERE o.status = 'pending' AND o.tenant_code > t.code \
                     ORDER BY o.tenant_code LIMIT 1) \
             FROM t WHERE t.code IS NOT NULL) \
         SELECT code AS \"code!\" FROM t WHERE code IS NOT NULL",
    )
    .fetch_all(&mut *conn)
    .await
}

/// Holds claimed rows past this transaction: they are not due again
/// until `lease` has passed. Returns each row's claim `(id, due time)`,
/// the token its outcome is recorded with.
pub async fn hold(
    conn: &mut Tx<'_>,
    row_ids: &[i64],
    lease: std::time::Duration,
) -> Result<Vec<(i64, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE id_outbox SET (next_retry_at, claimed_until) = \
             (SELECT c, c FROM (SELECT clock_timestamp() + make_interval(secs => $2)) AS x(c)) \
         WHERE id = ANY($1) RETURNING id, next_retry_at",
    )
    .bind(row_ids)
    .bind(lease.as_secs_f64())
    .fetch_all(&mut *conn)
    .await
}

/// Of these claims, the rows still held by them (pending, due when the
/// claim said), locked for recording their outcomes.
pub async fn still_held(
    conn: &mut Tx<'_>,
    claims: &[(i64, DateTime<Utc>)],
) -> Result<Vec<i64>, sqlx::Error> {
    let (ids, dues): (Vec<i64>, Vec<DateTime<Utc>>) = claims.iter().copied().unzip();
    sqlx::query_scalar(
        "SELECT o.id FROM id_outbox o \
           JOIN unnest($1::bigint[], $2::timestamptz[]) AS c(id, due) \
             ON o.id = c.id AND o.next_retry_at = c.due AND o.status = 'pending' \
         ORDER BY o.id FOR UPDATE OF o",
    )
    .bind(&ids)
    .bind(&dues)
    .fetch_all(&mut *conn)
    .await
}

/// What recording a batch's outcomes did.
#[derive(Debug, Default)]
pub struct Outcomes {
    /// Seconds from acceptance to delivery, per delivered row.
    pub lags: Vec<f64>,
    pub dead_lettered: usize,
}

/// Records a delivery batch's outcomes in the claim transaction: rows
/// delivered, and rows failed `(row id, classification)`. Each statement
/// runs in a savepoint, and one the database refuses is run again row by
/// row: whatever one row brings, the others' outcomes are kept (else the
/// claim would roll back and every row of the batch be delivered again on
/// every loop). A row refused even alone is left for the next claim and
/// logged.
pub async fn record_outcomes(
    conn: &mut Tx<'_>,
    delivered: &[i64],
    failed: &[(i64, String)],
    retry: &Retry,
) -> Result<Outcomes, sqlx::Error> {
    let mut outcomes = Outcomes::default();
    for marking in [
        Marking::Delivered(delivered),
        Marking::Failed(failed, retry),
    ] {
        if marking.is_empty() {
            continue;
        }
        match marking.in_savepoint(conn).await {
            Ok(done) => outcomes.add(done),
            // The server went away (a failover, a shutdown): no row is at
            // fault; the step fails and is retried with its backoff.
            Err(e) if crate::infra::db::distrust_server_after(&e) => return Err(e),
            Err(sqlx::Error::Database(e)) => {
                tracing::error!(error = %e, "recording delivery outcomes failed; recording them row by row");
                for one in marking.each() {
                    match one.in_savepoint(conn).await {
                        Ok(done) => outcomes.add(done),
                        Err(sqlx::Error::Database(e)) => {
                            tracing::error!(error = %e, "a delivery outcome could not be recorded")
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(outcomes)
}

impl Outcomes {
    fn add(&mut self, (lags, dead): (Vec<f64>, usize)) {
        self.lags.extend(lags);
        self.dead_lettered += dead;
    }
}

/// One statement of [`record_outcomes`].
#[derive(Clone, Copy)]
enum Marking<'a> {
    Delivered(&'a [i64]),
    Failed(&'a [(i64, String)], &'a Retry),
}

impl<'a> Marking<'a> {
    fn is_empty(&self) -> bool {
        match self {
            Marking::Delivered(rows) => rows.is_empty(),
            Marking::Failed(rows, _) => rows.is_empty(),
        }
    }

    /// The same marking, one row at a time.
    fn each(self) -> Vec<Marking<'a>> {
        match self {
            Marking::Delivered(rows) => rows
                .iter()
                .map(|r| Marking::Delivered(std::slice::from_ref(r)))
                .collect(),
            Marking::Failed(rows, retry) => rows
                .iter()
                .map(|r| Marking::Failed(std::slice::from_ref(r), retry))
                .collect(),
        }
    }

    async fn in_savepoint(&self, conn: &mut Tx<'_>) -> Result<(Vec<f64>, usize), sqlx::Error> {
        let mut savepoint = conn.begin().await?;
        let done = match self {
            Marking::Delivered(rows) => mark_delivered(&mut savepoint, rows)
                .await
                .map(|lags| (lags, 0)),
            Marking::Failed(rows, retry) => mark_failed(&mut savepoint, rows, retry)
                .await
                .map(|dead| (Vec::new(), dead)),
        };
        match done {
            Ok(done) => {
                savepoint.commit().await?;
                Ok(done)
            }
            Err(e) => {
                savepoint.rollback().await?;
                Err(e)
            }
        }
    }
}

/// Marks rows delivered (and forgets the error of an earlier attempt);
/// returns each one's seconds from acceptance to delivery.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn mark_delivered(conn: &mut Tx<'_>, row_ids: &[i64]) -> Result<Vec<f64>, sqlx::Error> {
    if row_ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar!(
        "UPDATE id_outbox SET status = $2, processed_at = clock_timestamp(), last_error = NULL \
         WHERE id = ANY($1) \
         RETURNING extract(epoch FROM processed_at - created_at)::float8 AS \"lag!\"",
        row_ids,
        DocumentStatus::Committed.as_str(),
    )
    .fetch_all(&mut *conn)
    .await
}

/// How failed deliveries are retried: after failure n the next attempt
/// waits base × 2^n, at most `backoff_max`, plus up to a quarter of that
/// at random, so deliveries that failed together (a target's outage) do
/// not all come back in the same instant.
#[derive(Debug, Clone)]
pub struct Retry {
    /// Failed attempts after which a document is dead-lettered.
    pub max_retries: i32,
    pub backoff_base: std::time::Duration,
    pub backoff_max: std::time::Duration,
}

impl Retry {
    /// The most a document can wait in all between its first attempt and
    /// its dead letter: every wait at its cap and its full jitter.
    pub fn longest_total_wait(&self) -> std::time::Duration {
        let total_secs: f64 = (1..self.max_retries.max(1))
            .map(|n| self.nominal_wait_secs(n) * (1.0 + JITTER))
            .sum();
        std::time::Duration::from_secs_f64(total_secs)
    }

    /// The wait after failure `n` before jitter, as the UPDATE below
    /// computes it (the exponent is bounded so the power stays finite).
    fn nominal_wait_secs(&self, n: i32) -> f64 {
        let doubled = self.backoff_base.as_secs_f64() * 2f64.powi(n.min(MAX_DOUBLINGS));
        doubled.min(self.backoff_max.as_secs_f64())
    }
}

/// The random part of a wait, as a fraction of it.
pub const JITTER: f64 = 0.25;

/// Past this many doublings every wait is at its cap anyway (base ≥ 1 ms,
/// cap ≤ 1 day is at most 27 doublings); bounded so Postgres' power() is
/// never asked for a number it cannot hold.
const MAX_DOUBLINGS: i32 = 40;

/// Records failed deliveries `(row id, error)`: due again after the
/// backoff, or dead-lettered after the last attempt. Returns how many were
/// dead-lettered.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn mark_failed(
    conn: &mut Tx<'_>,
    failed: &[(i64, String)],
    retry: &Retry,
) -> Result<usize, sqlx::Error> {
    if failed.is_empty() {
        return Ok(0);
    }
    let (ids, errors): (Vec<i64>, Vec<&str>) =
        failed.iter().map(|(id, e)| (*id, e.as_str())).unzip();
    let dead: Vec<bool> = sqlx::query_scalar!(
        "UPDATE id_outbox o SET \
             retry_count = o.retry_count + 1, \
             last_error = f.error, \
             status = CASE WHEN o.retry_count + 1 >= $3 THEN $5 ELSE $6 END, \
             processed_at = CASE WHEN o.retry_count + 1 >= $3 THEN clock_timestamp() END, \
             next_retry_at = clock_timestamp() + make_interval(secs => \
                 LEAST($4 * power(2, LEAST(o.retry_count + 1, $8)), $7) * (1 + $9 * random())) \
         FROM UNNEST($1::bigint[], $2::text[]) AS f(id, error) \
         WHERE o.id = f.id \
         RETURNING o.status = $5 AS \"dead!\"",
        &ids,
        &errors as &[&str],
        retry.max_retries,
        retry.backoff_base.as_secs_f64(),
        DocumentStatus::DeadLetter.as_str(),
        DocumentStatus::Pending.as_str(),
        retry.backoff_max.as_secs_f64(),
        MAX_DOUBLINGS,
        JITTER,
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(dead.iter().filter(|d| **d).count())
}

#[cfg(test)]
mod tests;
