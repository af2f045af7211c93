//! The outbox rows that documents write with their numbers, in the same
//! transaction as the ledger rows (so the ledger never needs to know what
//! a document is: it writes rows for it).

use std::sync::Arc;

use crate::infra::db::Link;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::domain::sequence::IdShape;

/// The unique constraint of a document ID (migration 0002).
pub const DOCUMENT_ID_TAKEN: &str = "id_outbox_document_id_key";
/// The unique constraint of one document per number (migration 0002).
pub const NUMBER_ATTACHED: &str = "id_outbox_sequence_id_period_seq_key";
/// The unique index of one document per source id of a project and type
/// (migration 0010).
pub const SOURCE_ID_TAKEN: &str = "id_outbox_source";

/// What a document brings to the row its number will carry.
#[derive(Debug, Clone)]
pub struct Attachment {
    pub project: String,
    pub doc_type: String,
    /// The metadata, as the client sent it (a JSON object); shared, not
    /// copied, by the rows made of it.
    pub payload: Arc<str>,
    /// The document's legacy id, unique per project and type.
    pub source_id: Option<Arc<str>>,
    /// A VERI*FACTU document's invoice fields (JSON), as sent.
    pub invoice: Option<Arc<str>>,
}

impl Attachment {
    /// The row for this attachment on number `seq`, printed as `shape` prints.
    pub fn row(&self, shape: &IdShape, seq: i64) -> OutboxRow {
        OutboxRow {
            seq,
            document_id: shape.id(seq),
            project: self.project.clone(),
            doc_type: self.doc_type.clone(),
            seq_number: shape.number(seq),
            payload: self.payload.clone(),
            source_id: self.source_id.clone(),
            invoice: self.invoice.clone(),
        }
    }
}

/// A document's outbox row as written with its number.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub seq: i64,
    pub document_id: String,
    pub project: String,
    pub doc_type: String,
    pub seq_number: i64,
    /// The metadata, as the client sent it (a JSON object).
    pub payload: Arc<str>,
    /// The document's legacy id (`idpool import`), if it has one.
    pub source_id: Option<Arc<str>>,
    /// A VERI*FACTU document's invoice fields (JSON).
    pub invoice: Option<Arc<str>>,
}

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    ToSchema,
    sqlx::Type,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum DocumentStatus {
    Pending,
    Committed,
    DeadLetter,
    Abandoned,
}

impl DocumentStatus {
    pub const ALL: [DocumentStatus; 4] = [
        DocumentStatus::Pending,
        DocumentStatus::Committed,
        DocumentStatus::DeadLetter,
        DocumentStatus::Abandoned,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Inserts outbox rows `(sequence_id, period, row)`; returns each row's
/// `created_at`, in the order given. A row whose project has an enabled
/// endpoint for its type is written routed, with no due time of its own
/// (the insert trigger writes its deliveries; see `0015_endpoints.sql`).
#[tracing::instrument(skip_all, level = "debug")]
pub async fn insert(
    conn: &mut impl Link,
    rows: &[(i64, &str, &OutboxRow)],
) -> Result<Vec<DateTime<Utc>>, sqlx::Error> {
    let document_ids: Vec<&str> = rows
        .iter()
        .map(|(_, _, r)| r.document_id.as_str())
        .collect();
    let projects: Vec<&str> = rows.iter().map(|(_, _, r)| r.project.as_str()).collect();
    let types: Vec<&str> = rows.iter().map(|(_, _, r)| r.doc_type.as_str()).collect();
    let payloads: Vec<&str> = rows.iter().map(|(_, _, r)| r.payload.as_ref()).collect();
    let sequence_ids: Vec<i64> = rows.iter().map(|(s, _, _)| *s).collect();
    let periods: Vec<&str> = rows.iter().map(|(_, p, _)| *p).collect();
    let seqs: Vec<i64> = rows.iter().map(|(_, _, r)| r.seq).collect();
    let numbers: Vec<i64> = rows.iter().map(|(_, _, r)| r.seq_number).collect();
    let sources: Vec<Option<&str>> = rows
        .iter()
        .map(|(_, _, r)| r.source_id.as_deref())
        .collect();
    let invoices: Vec<Option<&str>> = rows.iter().map(|(_, _, r)| r.invoice.as_deref()).collect();
    let created = sqlx::query!(
        "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, sequence_id, period, seq, seq_number, source_id, \
                                invoice, routed, next_retry_at) \
         SELECT d, p, t, j::jsonb, s, pe, n, sn, so, inv::jsonb, r.routed, \
                CASE WHEN r.routed THEN 'infinity'::timestamptz ELSE now() END \
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::bigint[], $8::bigint[], $9::text[], $10::text[]) \
              AS u(d, p, t, j, s, pe, n, sn, so, inv) \
         CROSS JOIN LATERAL (SELECT EXISTS (SELECT 1 FROM endpoints e \
              WHERE e.project = u.p AND NOT e.disabled AND (e.types IS NULL OR u.t = ANY (e.types))) AS routed) r \
         RETURNING document_id, created_at",
        &document_ids as &[&str],
        &projects as &[&str],
        &types as &[&str],
        &payloads as &[&str],
        &sequence_ids,
        &periods as &[&str],
        &seqs,
        &numbers,
        &sources as &[Option<&str>],
        &invoices as &[Option<&str>],
    )
    .fetch_all(conn.statements())
    .await?;
    let by_id: std::collections::HashMap<String, DateTime<Utc>> = created
        .into_iter()
        .map(|r| (r.document_id, r.created_at))
        .collect();
    document_ids
        .iter()
        .map(|id| {
            by_id.get(*id).copied().ok_or_else(|| {
                sqlx::Error::Protocol(format!("the outbox insert did not return document {id}"))
            })
        })
        .collect()
}

/// Whether a document of the sequence carries the ID `document_id`.
pub async fn carries_id(
    conn: &mut impl Link,
    sequence_id: i64,
    document_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT EXISTS (SELECT 1 FROM id_outbox WHERE document_id = $1 AND sequence_id = $2) \
         AS \"carries!\"",
        document_id,
        sequence_id,
    )
    .fetch_one(conn.statements())
    .await
}
