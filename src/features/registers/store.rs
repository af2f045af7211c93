//! SQL of the registers: entries, the tree's nodes, checkpoints and keys.
//! Entries are appended by triggers (`0016_registers.sql`), never here.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::{Executor, Postgres};

use crate::domain::merkle::{Hash, NodeId};
use crate::infra::db::Db;

/// An entry as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct EntryRow {
    pub log_index: i64,
    pub chain: String,
    pub seq: i64,
    pub number: i64,
    pub id: String,
    pub event: String,
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
    pub at: DateTime<Utc>,
}

const ENTRY_COLUMNS: &str = "log_index, chain, seq, number, id, event, body, prev_hash, hash, at";

/// The hash (huella) of the alta record of document `id` of sequence
/// `sequence_id`.
pub async fn alta_hash<'e>(
    executor: impl Executor<'e, Database = Postgres>,
    sequence_id: i64,
    id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT hash FROM register_entries \
          WHERE sequence_id = $1 AND id = $2 AND event = 'attached' LIMIT 1",
    )
    .bind(sequence_id)
    .bind(id)
    .fetch_optional(executor)
    .await
}

/// Up to `limit` entries of a chain, in chain order from position `from`.
pub async fn chain_page(
    db: &Db,
    project: &str,
    chain: &str,
    from: i64,
    limit: i64,
) -> Result<Vec<EntryRow>, sqlx::Error> {
    let sql = format!(
        "SELECT {ENTRY_COLUMNS} FROM register_entries \
          WHERE project = $1 AND chain = $2 AND seq >= $3 ORDER BY seq, log_index LIMIT $4"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(project)
        .bind(chain)
        .bind(from)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// Every entry of a project in log order, streamed (the export).
pub fn project_entries<'a>(
    db: &'a Db,
    project: &'a str,
) -> futures::stream::BoxStream<'a, Result<EntryRow, sqlx::Error>> {
    Box::pin(
        sqlx::query_as::<_, EntryRow>(
            "SELECT log_index, chain, seq, number, id, event, body, prev_hash, hash, at \
               FROM register_entries WHERE project = $1 ORDER BY log_index",
        )
        .bind(project)
        .fetch(db),
    )
}

/// The log's size, none when the project has no register entries.
pub async fn log_size(db: &Db, project: &str) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT size FROM register_logs WHERE project = $1")
        .bind(project)
        .fetch_optional(db)
        .await
}

/// The perfect subtrees asked for; missing ones are left out. A leaf's
/// hash is computed from its entry's body (leaves are not stored twice).
pub async fn nodes(
    db: &Db,
    project: &str,
    ids: &[NodeId],
) -> Result<HashMap<NodeId, Hash>, sqlx::Error> {
    let (leaves, inner): (Vec<&NodeId>, Vec<&NodeId>) = ids.iter().partition(|n| n.level == 0);
    let leaf_indexes: Vec<i64> = leaves.iter().map(|n| n.index as i64).collect();
    let bodies: Vec<(i64, String)> = sqlx::query_as(
        "SELECT log_index, body FROM register_entries WHERE project = $1 AND log_index = ANY($2)",
    )
    .bind(project)
    .bind(&leaf_indexes)
    .fetch_all(db)
    .await?;
    let mut found: HashMap<NodeId, Hash> = bodies
        .into_iter()
        .map(|(index, body)| {
            (
                NodeId {
                    level: 0,
                    index: index as u64,
                },
                crate::domain::merkle::leaf_hash(body.as_bytes()),
            )
        })
        .collect();
    let levels: Vec<i16> = inner.iter().map(|n| n.level as i16).collect();
    let indexes: Vec<i64> = inner.iter().map(|n| n.index as i64).collect();
    let rows: Vec<(i16, i64, Vec<u8>)> = sqlx::query_as(
        "SELECT n.level, n.idx, n.hash FROM register_nodes n \
           JOIN UNNEST($2::smallint[], $3::bigint[]) AS w(level, idx) \
             ON n.level = w.level AND n.idx = w.idx \
          WHERE n.project = $1",
    )
    .bind(project)
    .bind(&levels)
    .bind(&indexes)
    .fetch_all(db)
    .await?;
    found.extend(rows.into_iter().filter_map(|(level, idx, hash)| {
        Some((
            NodeId {
                level: level as u32,
                index: idx as u64,
            },
            Hash::try_from(hash).ok()?,
        ))
    }));
    Ok(found)
}

/// A signed checkpoint as kept.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CheckpointRow {
    pub project: String,
    pub size: i64,
    pub root: Vec<u8>,
    pub note: String,
    pub key_name: String,
    pub signed_at: DateTime<Utc>,
}

pub async fn latest_checkpoint(
    db: &Db,
    project: &str,
) -> Result<Option<CheckpointRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT project, size, root, note, key_name, signed_at FROM register_checkpoints \
          WHERE project = $1 ORDER BY size DESC LIMIT 1",
    )
    .bind(project)
    .fetch_optional(db)
    .await
}

pub async fn all_checkpoints(db: &Db, project: &str) -> Result<Vec<CheckpointRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT project, size, root, note, key_name, signed_at FROM register_checkpoints \
          WHERE project = $1 ORDER BY size",
    )
    .bind(project)
    .fetch(db)
    .try_collect()
    .await
}

/// Projects whose log grew past their last checkpoint, with the log's
/// size and frontier (read together, under no lock: a later append only
/// makes a later checkpoint).
pub async fn logs_to_checkpoint(
    db: &Db,
    limit: i64,
) -> Result<Vec<(String, i64, Vec<Option<Vec<u8>>>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT l.project, l.size, l.frontier FROM register_logs l \
          WHERE l.size > coalesce((SELECT max(c.size) FROM register_checkpoints c \
                                    WHERE c.project = l.project), 0) \
          ORDER BY l.project LIMIT $1",
    )
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn insert_checkpoint(
    db: &Db,
    project: &str,
    size: i64,
    root: &Hash,
    note: &str,
    key_name: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO register_checkpoints (project, size, root, note, key_name) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (project, size) DO NOTHING",
    )
    .bind(project)
    .bind(size)
    .bind(root.as_slice())
    .bind(note)
    .bind(key_name)
    .execute(db)
    .await?;
    Ok(())
}

/// A signing key as kept: its verifier text, and its private text when
/// the installation made it itself.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct KeyRow {
    pub key_name: String,
    pub verifier: String,
    pub private_key: Option<String>,
    pub first_used: DateTime<Utc>,
}

pub async fn keys(db: &Db) -> Result<Vec<KeyRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT key_name, verifier, private_key, first_used FROM register_keys ORDER BY first_used, key_name",
    )
    .fetch_all(db)
    .await
}

/// Records a key (once; the first writer's row stays). Returns the row.
pub async fn record_key(
    db: &Db,
    key_name: &str,
    verifier: &str,
    private_key: Option<&str>,
) -> Result<KeyRow, sqlx::Error> {
    sqlx::query(
        "INSERT INTO register_keys (key_name, verifier, private_key) VALUES ($1, $2, $3) \
         ON CONFLICT (key_name) DO NOTHING",
    )
    .bind(key_name)
    .bind(verifier)
    .bind(private_key)
    .execute(db)
    .await?;
    sqlx::query_as(
        "SELECT key_name, verifier, private_key, first_used FROM register_keys WHERE key_name = $1",
    )
    .bind(key_name)
    .fetch_one(db)
    .await
}

/// The generated key the installation signs with when no key is
/// configured: the oldest one that has its private half.
pub async fn generated_key(db: &Db) -> Result<Option<KeyRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT key_name, verifier, private_key, first_used FROM register_keys \
          WHERE private_key IS NOT NULL ORDER BY first_used LIMIT 1",
    )
    .fetch_optional(db)
    .await
}
