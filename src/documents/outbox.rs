//! SQL of the outbox (`id_outbox`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use utoipa::ToSchema;

/// A document's outbox row as written with its number.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub seq: i64,
    pub document_id: String,
    pub project: String,
    pub doc_type: String,
    pub seq_number: i64,
    /// The metadata, as the client sent it (a JSON object).
    pub payload: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, sqlx::Type)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum DocumentStatus {
    Pending,
    Committed,
    DeadLetter,
    Abandoned,
}

impl DocumentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DocumentStatus::Pending => "pending",
            DocumentStatus::Committed => "committed",
            DocumentStatus::DeadLetter => "dead_letter",
            DocumentStatus::Abandoned => "abandoned",
        }
    }
}

/// Inserts outbox rows `(sequence_id, period, row)`; returns each row's
/// `created_at`, in the order given.
pub async fn insert(
    conn: &mut PgConnection,
    rows: &[(i64, &str, &OutboxRow)],
) -> Result<Vec<DateTime<Utc>>, sqlx::Error> {
    let document_ids: Vec<&str> = rows
        .iter()
        .map(|(_, _, r)| r.document_id.as_str())
        .collect();
    let projects: Vec<&str> = rows.iter().map(|(_, _, r)| r.project.as_str()).collect();
    let types: Vec<&str> = rows.iter().map(|(_, _, r)| r.doc_type.as_str()).collect();
    let payloads: Vec<&str> = rows.iter().map(|(_, _, r)| r.payload.as_str()).collect();
    let sequence_ids: Vec<i64> = rows.iter().map(|(s, _, _)| *s).collect();
    let periods: Vec<&str> = rows.iter().map(|(_, p, _)| *p).collect();
    let seqs: Vec<i64> = rows.iter().map(|(_, _, r)| r.seq).collect();
    let numbers: Vec<i64> = rows.iter().map(|(_, _, r)| r.seq_number).collect();
    let created: Vec<(String, DateTime<Utc>)> = sqlx::query_as(
        "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, sequence_id, period, seq, seq_number) \
         SELECT d, p, t, j::jsonb, s, pe, n, sn \
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::bigint[], $8::bigint[]) \
              AS u(d, p, t, j, s, pe, n, sn) \
         RETURNING document_id, created_at",
    )
    .bind(&document_ids)
    .bind(&projects)
    .bind(&types)
    .bind(&payloads)
    .bind(&sequence_ids)
    .bind(&periods)
    .bind(&seqs)
    .bind(&numbers)
    .fetch_all(&mut *conn)
    .await?;
    let by_id: std::collections::HashMap<String, DateTime<Utc>> = created.into_iter().collect();
    Ok(document_ids
        .iter()
        .map(|id| by_id.get(*id).copied().unwrap_or_else(Utc::now))
        .collect())
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

const VIEW_COLUMNS: &str = "document_id AS id, tenant_code AS project, entity_type_id AS doc_type, \
     seq_number AS seq, status::text AS status, retry_count, last_error, \
     CASE WHEN status = 'pending' THEN next_retry_at END AS next_retry_at, \
     created_at, processed_at, id AS row_id";

/// A document of one of `projects` (`None`: any project).
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

/// Back to `pending`, retry count reset: for dead letters (and abandoned
/// documents an operator wants back).
pub async fn retry(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<DocumentView, TransitionError> {
    transition(
        db,
        document_id,
        projects,
        "retry",
        "dead_letter or abandoned documents",
        &[DocumentStatus::DeadLetter, DocumentStatus::Abandoned],
        "status = 'pending', retry_count = 0, next_retry_at = now(), processed_at = NULL",
    )
    .await
}

/// Gives up on a document: its number becomes an `abandoned` gap.
pub async fn abandon(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<DocumentView, TransitionError> {
    transition(
        db,
        document_id,
        projects,
        "abandon",
        "pending, dead_letter or abandoned documents",
        &[
            DocumentStatus::Pending,
            DocumentStatus::DeadLetter,
            DocumentStatus::Abandoned,
        ],
        "status = 'abandoned', processed_at = coalesce(processed_at, now())",
    )
    .await
}

async fn transition(
    db: &PgPool,
    document_id: &str,
    projects: Option<&[String]>,
    action: &'static str,
    allowed_text: &'static str,
    allowed: &[DocumentStatus],
    set: &'static str,
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
    if !allowed.contains(&current) {
        return Err(TransitionError::NotAllowed {
            id: document_id.to_owned(),
            status: current.as_str(),
            action,
            allowed: allowed_text,
        });
    }
    let sql = format!("UPDATE id_outbox SET {set} WHERE document_id = $1 RETURNING {VIEW_COLUMNS}");
    let view: DocumentView = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(document_id)
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
