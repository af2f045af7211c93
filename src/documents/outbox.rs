//! SQL of the outbox (`id_outbox`) after a document's row is written:
//! reading, listing, retrying, abandoning.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

pub use crate::ledger::outbox::DocumentStatus;
use utoipa::ToSchema;

use super::sink::Delivery;

/// The index (in `ids`) of the first document ID another document has.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn first_taken(
    conn: &mut PgConnection,
    ids: &[&str],
) -> Result<Option<usize>, sqlx::Error> {
    let taken: Vec<String> =
        sqlx::query_scalar("SELECT document_id FROM id_outbox WHERE document_id = ANY($1)")
            .bind(ids)
            .fetch_all(&mut *conn)
            .await?;
    Ok(ids.iter().position(|id| taken.iter().any(|t| t == id)))
}

/// Whether number `seq` of the sequence period carries a document.
pub async fn carries_document(
    conn: &mut PgConnection,
    sequence_id: i64,
    period: &str,
    seq: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM id_outbox WHERE sequence_id = $1 AND period = $2 AND seq = $3)",
    )
    .bind(sequence_id)
    .bind(period)
    .bind(seq)
    .fetch_one(&mut *conn)
    .await
}

/// One outbox row as operators and clients see it.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct DocumentView {
    #[schema(example = "PROJ-9012-1001")]
    pub id: String,
    #[schema(example = "PROJ")]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(example = "9012")]
    pub doc_type: String,
    #[schema(example = 1001)]
    pub seq: i64,
    pub status: DocumentStatus,
    /// Failed delivery attempts so far.
    pub retry_count: i32,
    pub last_error: Option<String>,
    /// When the next delivery attempt is due (pending documents only).
    pub next_retry_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// When it was delivered, dead-lettered or abandoned.
    pub processed_at: Option<DateTime<Utc>>,
    #[serde(skip)]
    #[schema(ignore)]
    pub row_id: i64,
}

// `pending` spelt out: a constant needs a literal (DocumentStatus::Pending).
const VIEW_COLUMNS: &str = "document_id AS id, tenant_code AS project, entity_type_id AS doc_type, \
     seq_number AS seq, status::text AS status, retry_count, last_error, \
     CASE WHEN status = 'pending' THEN next_retry_at END AS next_retry_at, \
     created_at, processed_at, id AS row_id";

/// A document of one of `projects` (`None`: any project).
#[tracing::instrument(skip_all, level = "debug")]
pub async fn find(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<Option<DocumentView>, sqlx::Error> {
    let sql = format!(
        "SELECT {VIEW_COLUMNS} FROM id_outbox WHERE document_id = $1 \
         AND ($2::text[] IS NULL OR tenant_code = ANY($2))"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(document_id)
        .bind(projects)
        .fetch_optional(db)
        .await
}

pub struct ListFilter<'a> {
    pub status: Option<DocumentStatus>,
    /// The projects the caller may see; `None`: every project.
    pub projects: Option<&'a [String]>,
    pub project: Option<&'a str>,
    pub doc_type: Option<&'a str>,
    pub after_row: i64,
    pub limit: i64,
}

#[tracing::instrument(skip_all, level = "debug")]
pub async fn list(db: &PgPool, filter: &ListFilter<'_>) -> Result<Vec<DocumentView>, sqlx::Error> {
    // The status is spelt out in the SQL (it is one of four fixed words),
    // so the planner can use the index of unfinished documents for it.
    let status = match filter.status {
        Some(status) => format!("AND status = '{}'", status.as_str()),
        None => String::new(),
    };
    let sql = format!(
        "SELECT {VIEW_COLUMNS} FROM id_outbox \
         WHERE id > $1 {status} \
           AND ($2::text IS NULL OR tenant_code = $2) AND ($3::text IS NULL OR entity_type_id = $3) \
           AND ($5::text[] IS NULL OR tenant_code = ANY($5)) \
         ORDER BY id LIMIT $4"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(filter.after_row)
        .bind(filter.project)
        .bind(filter.doc_type)
        .bind(filter.limit)
        .bind(filter.projects)
        .fetch_all(db)
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
}

/// Back to `pending`, retry count reset: for dead letters (and abandoned
/// documents an operator wants back).
const RETRY: Transition = Transition {
    action: "retry",
    allowed_text: "dead_letter or abandoned documents",
    allowed: &[DocumentStatus::DeadLetter, DocumentStatus::Abandoned],
    to: DocumentStatus::Pending,
    also_set: "retry_count = 0, next_retry_at = now(), processed_at = NULL",
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
};

/// Back to `pending`, retry count reset: for dead letters (and abandoned
/// documents an operator wants back).
pub async fn retry(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<DocumentView, TransitionError> {
    transition(db, document_id, projects, &RETRY).await
}

/// Gives up on a document: its number becomes an `abandoned` gap.
pub async fn abandon(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<DocumentView, TransitionError> {
    transition(db, document_id, projects, &ABANDON).await
}

async fn transition(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
    change: &Transition,
) -> Result<DocumentView, TransitionError> {
    let mut tx = db.begin().await?;
    // Locked, so a processor holding the row finishes first.
    let current: Option<DocumentStatus> = sqlx::query_scalar(
        "SELECT status::text FROM id_outbox WHERE document_id = $1 \
         AND ($2::text[] IS NULL OR tenant_code = ANY($2)) FOR UPDATE",
    )
    .bind(document_id)
    .bind(projects)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(current) = current else {
        return Err(TransitionError::NotFound(document_id.to_owned()));
    };
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
        .fetch_one(&mut *tx)
        .await?;
    if current != DocumentStatus::Pending {
        // Wake processors for a document that is due again.
        sqlx::query("SELECT pg_notify('idpool_outbox', '')")
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(view)
}

/// Claims up to `limit` due rows for delivery (locked until the caller's
/// transaction ends; rows another processor holds are skipped). Their
/// payload is read only when the sink needs it.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn claim_due(
    conn: &mut PgConnection,
    limit: i64,
    with_payload: bool,
) -> Result<Vec<Delivery>, sqlx::Error> {
    // Deliveries (a webhook's answers) keep this transaction open while
    // no statement runs; their own timeouts bound that, not Postgres'.
    // The claim walks the index of pending rows in due order and stops
    // after `limit`. Until autovacuum has analyzed a fast-growing outbox
    // (a fresh install taking a migration), the planner believes a few
    // hundred rows are pending and reads all of them, then sorts: measured
    // 65 ms a claim at 150,000 pending, and delivery three times slower.
    // Every statement of this transaction finds its rows by an index.
    sqlx::raw_sql(
        "SET LOCAL idle_in_transaction_session_timeout = 0; \
         SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off",
    )
    .execute(&mut *conn)
    .await?;
    let payload = if with_payload {
        "payload::text"
    } else {
        "NULL::text"
    };
    // The status spelt out, so the planner matches the partial index of
    // pending rows.
    let pending = DocumentStatus::Pending.as_str();
    let sql = format!(
        "SELECT id AS row_id, document_id, tenant_code AS project, entity_type_id AS doc_type, \
                seq_number AS seq, created_at, {payload} AS payload \
         FROM id_outbox WHERE status = '{pending}' AND next_retry_at <= now() \
         ORDER BY next_retry_at LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(limit)
        .fetch_all(&mut *conn)
        .await
}

/// Marks rows delivered; returns each one's seconds from acceptance to
/// delivery.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn mark_delivered(
    conn: &mut PgConnection,
    row_ids: &[i64],
) -> Result<Vec<f64>, sqlx::Error> {
    if row_ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar(
        "UPDATE id_outbox SET status = $2, processed_at = clock_timestamp() WHERE id = ANY($1) \
         RETURNING extract(epoch FROM processed_at - created_at)::float8",
    )
    .bind(row_ids)
    .bind(DocumentStatus::Committed)
    .fetch_all(&mut *conn)
    .await
}

/// How failed deliveries are retried.
pub struct Retry {
    /// Failed attempts after which a document is dead-lettered.
    pub max_retries: i32,
    /// Retry n waits base × 2^n.
    pub backoff_base: std::time::Duration,
}

/// Records failed deliveries `(row id, error)`: due again after the
/// backoff, or dead-lettered after the last attempt. Returns how many were
/// dead-lettered.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn mark_failed(
    conn: &mut PgConnection,
    failed: &[(i64, String)],
    retry: &Retry,
) -> Result<usize, sqlx::Error> {
    if failed.is_empty() {
        return Ok(0);
    }
    let (ids, errors): (Vec<i64>, Vec<&str>) =
        failed.iter().map(|(id, e)| (*id, e.as_str())).unzip();
    let dead: Vec<bool> = sqlx::query_scalar(
        "UPDATE id_outbox o SET \
             retry_count = o.retry_count + 1, \
             last_error = f.error, \
             status = CASE WHEN o.retry_count + 1 >= $3 THEN $5 ELSE $6 END, \
             processed_at = CASE WHEN o.retry_count + 1 >= $3 THEN clock_timestamp() END, \
             next_retry_at = clock_timestamp() + make_interval(secs => $4 * power(2, o.retry_count + 1)) \
         FROM UNNEST($1::bigint[], $2::text[]) AS f(id, error) \
         WHERE o.id = f.id \
         RETURNING o.status = $5",
    )
    .bind(&ids)
    .bind(&errors)
    .bind(retry.max_retries)
    .bind(retry.backoff_base.as_secs_f64())
    .bind(DocumentStatus::DeadLetter)
    .bind(DocumentStatus::Pending)
    .fetch_all(&mut *conn)
    .await?;
    Ok(dead.iter().filter(|d| **d).count())
}
