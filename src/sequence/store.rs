//! Sequence definitions in Postgres, with a per-instance cache for the hot path.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::{
    Definition, DefinitionError, Layout, ProjectCode, Reset, Sequence, Template, TypeCode,
};

/// Postgres channel that tells every instance a definition changed.
pub const CHANGED_CHANNEL: &str = "idpool_sequences";
/// How long a cached definition is trusted without a change notification.
const CACHE_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("stored definition of {0} is unreadable: {1}")]
    Corrupt(String, String),
    #[error(transparent)]
    Definition(#[from] DefinitionError),
}

#[derive(Debug, thiserror::Error)]
pub enum PutError {
    #[error(
        "the sequence has issued numbers; changing format, layout, reset or timezone needs \"force\": true"
    )]
    InUse,
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub struct PutOutcome {
    pub sequence: Arc<Sequence>,
    pub created: bool,
    /// The previous definition, when this PUT changed how IDs read.
    pub replaced_identity: Option<Arc<Sequence>>,
}

struct Cached {
    sequence: Arc<Sequence>,
    loaded: Instant,
}

pub struct SequenceStore {
    db: PgPool,
    cache: RwLock<HashMap<String, Cached>>,
}

fn cache_key(project: &str, doc_type: &str) -> String {
    format!("{project}/{doc_type}")
}

#[derive(sqlx::FromRow)]
struct SequenceRow {
    id: i64,
    project: String,
    doc_type: String,
    format: String,
    layout: String,
    epoch: Option<DateTime<Utc>>,
    start_seq: i64,
    max_seq: Option<i64>,
    reset: String,
    timezone: String,
    pool_size: i32,
    refill_at: f64,
    version: i32,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

const SELECT_COLUMNS: &str = "id, project, doc_type, format, layout, epoch, start_seq, max_seq, \
     reset, timezone, pool_size, refill_at, version, created_at, updated_at";

impl SequenceRow {
    fn into_sequence(self) -> Result<Sequence, StoreError> {
        let name = cache_key(&self.project, &self.doc_type);
        let corrupt = |what: &str| StoreError::Corrupt(name.clone(), what.to_owned());
        let layout = match (self.layout.as_str(), self.epoch) {
            ("text", _) => Layout::Text,
            ("int64", Some(epoch)) => Layout::Int64 { epoch },
            _ => return Err(corrupt("layout")),
        };
        Ok(Sequence {
            id: self.id,
            project: ProjectCode::parse(&self.project).map_err(|e| corrupt(&e.to_string()))?,
            doc_type: TypeCode::parse(&self.doc_type).map_err(|e| corrupt(&e.to_string()))?,
            definition: Definition {
                format: Template::parse(&self.format).map_err(|e| corrupt(&e.to_string()))?,
                layout,
                start: self.start_seq,
                max: self.max_seq,
                reset: Reset::parse(&self.reset).ok_or_else(|| corrupt("reset"))?,
                timezone: self.timezone.parse().map_err(|_| corrupt("timezone"))?,
                pool_size: u32::try_from(self.pool_size).map_err(|_| corrupt("pool_size"))?,
                refill_at: self.refill_at,
            },
            version: self.version,
            created_at: self.created_at,
            updated_at: self.updated_at,
        })
    }
}

impl SequenceStore {
    pub fn new(db: PgPool) -> Self {
        Self {
            db,
            cache: RwLock::new(HashMap::new()),
        }
    }

    fn cached(&self, key: &str) -> Option<Arc<Sequence>> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache
            .get(key)
            .filter(|c| c.loaded.elapsed() < CACHE_TTL)
            .map(|c| c.sequence.clone())
    }

    fn remember(&self, sequence: Sequence) -> Arc<Sequence> {
        let sequence = Arc::new(sequence);
        let key = cache_key(sequence.project.as_str(), sequence.doc_type.as_str());
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        cache.insert(
            key,
            Cached {
                sequence: sequence.clone(),
                loaded: Instant::now(),
            },
        );
        sequence
    }

    /// Drops a cached definition (after a change notification).
    pub fn evict(&self, key: &str) {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        cache.remove(key);
    }

    pub fn evict_all(&self) {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        cache.clear();
    }

    /// The sequence, created with the default definition on first use.
    pub async fn get_or_create(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
    ) -> Result<Arc<Sequence>, StoreError> {
        let key = cache_key(project.as_str(), doc_type.as_str());
        if let Some(sequence) = self.cached(&key) {
            return Ok(sequence);
        }
        if let Some(sequence) = self.load(project.as_str(), doc_type.as_str()).await? {
            return Ok(self.remember(sequence));
        }
        let definition = Definition::defaults(project, doc_type)?;
        if let Some(created) = insert_defaults(&self.db, project, doc_type, &definition).await? {
            return Ok(self.remember(created.into_sequence()?));
        }
        // Another request created it first.
        let sequence = self
            .load(project.as_str(), doc_type.as_str())
            .await?
            .ok_or_else(|| StoreError::Corrupt(key, "vanished after insert".into()))?;
        Ok(self.remember(sequence))
    }

    /// The sequence if it was defined or used, read fresh from Postgres.
    pub async fn get(
        &self,
        project: &str,
        doc_type: &str,
    ) -> Result<Option<Arc<Sequence>>, StoreError> {
        Ok(self
            .load(project, doc_type)
            .await?
            .map(|s| self.remember(s)))
    }

    pub async fn by_id(&self, id: i64) -> Result<Option<Sequence>, StoreError> {
        let sql = format!("SELECT {SELECT_COLUMNS} FROM sequences WHERE id = $1");
        let row: Option<SequenceRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.db)
            .await?;
        row.map(SequenceRow::into_sequence).transpose()
    }

    async fn load(&self, project: &str, doc_type: &str) -> Result<Option<Sequence>, StoreError> {
        let sql =
            format!("SELECT {SELECT_COLUMNS} FROM sequences WHERE project = $1 AND doc_type = $2");
        let row: Option<SequenceRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(project)
            .bind(doc_type)
            .fetch_optional(&self.db)
            .await?;
        row.map(SequenceRow::into_sequence).transpose()
    }

    /// Sequences ordered by (project, type), after the given pair.
    pub async fn list(
        &self,
        after: Option<(&str, &str)>,
        limit: i64,
    ) -> Result<Vec<Sequence>, StoreError> {
        let (after_project, after_type) = after.unwrap_or(("", ""));
        let sql = format!(
            "SELECT {SELECT_COLUMNS} FROM sequences WHERE (project, doc_type) > ($1, $2) \
             ORDER BY project, doc_type LIMIT $3"
        );
        let rows: Vec<SequenceRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(after_project)
            .bind(after_type)
            .bind(limit)
            .fetch_all(&self.db)
            .await?;
        rows.into_iter().map(SequenceRow::into_sequence).collect()
    }

    /// Creates or replaces a definition, refusing identity changes of a
    /// sequence with issued numbers unless `force`.
    pub async fn put(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
        definition: &Definition,
        force: bool,
    ) -> Result<PutOutcome, PutError> {
        let mut tx = self.db.begin().await.map_err(StoreError::from)?;
        let sql = format!(
            "SELECT {SELECT_COLUMNS} FROM sequences WHERE project = $1 AND doc_type = $2 FOR UPDATE"
        );
        let existing: Option<SequenceRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(project.as_str())
            .bind(doc_type.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(StoreError::from)?;
        let existing = existing.map(SequenceRow::into_sequence).transpose()?;
        let mut replaced_identity = None;
        match &existing {
            None => insert_definition(&mut *tx, project, doc_type, definition)
                .await
                .map_err(StoreError::from)?,
            Some(current) => {
                if current.definition.changes_identity(definition) {
                    let issued: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM issuance_ledger WHERE sequence_id = $1)",
                    )
                    .bind(current.id)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(StoreError::from)?;
                    if issued && !force {
                        return Err(PutError::InUse);
                    }
                    replaced_identity = Some(Arc::new(current.clone()));
                }
                update_definition(&mut *tx, current.id, definition)
                    .await
                    .map_err(StoreError::from)?;
            }
        }
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANGED_CHANNEL)
            .bind(cache_key(project.as_str(), doc_type.as_str()))
            .execute(&mut *tx)
            .await
            .map_err(StoreError::from)?;
        tx.commit().await.map_err(StoreError::from)?;
        let sequence = self
            .load(project.as_str(), doc_type.as_str())
            .await?
            .ok_or_else(|| {
                StoreError::Corrupt(
                    cache_key(project.as_str(), doc_type.as_str()),
                    "vanished".into(),
                )
            })?;
        Ok(PutOutcome {
            sequence: self.remember(sequence),
            created: existing.is_none(),
            replaced_identity,
        })
    }
}

const INSERT_SEQUENCE: &str = "INSERT INTO sequences (project, doc_type, format, layout, epoch, start_seq, \
     max_seq, reset, timezone, pool_size, refill_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

/// Creates the sequence with `d` unless it exists; the new row, if any.
async fn insert_defaults(
    db: &PgPool,
    project: &ProjectCode,
    doc_type: &TypeCode,
    d: &Definition,
) -> Result<Option<SequenceRow>, sqlx::Error> {
    let sql = format!(
        "{INSERT_SEQUENCE} ON CONFLICT (project, doc_type) DO NOTHING RETURNING {SELECT_COLUMNS}"
    );
    bind_definition(
        sqlx::query_as(sqlx::AssertSqlSafe(sql)),
        project,
        doc_type,
        d,
    )
    .fetch_optional(db)
    .await
}

async fn insert_definition<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    project: &ProjectCode,
    doc_type: &TypeCode,
    d: &Definition,
) -> Result<(), sqlx::Error> {
    let sql = format!("{INSERT_SEQUENCE} RETURNING {SELECT_COLUMNS}");
    bind_definition(
        sqlx::query_as(sqlx::AssertSqlSafe(sql)),
        project,
        doc_type,
        d,
    )
    .fetch_one(db)
    .await?;
    Ok(())
}

fn bind_definition<'q>(
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, SequenceRow, sqlx::postgres::PgArguments>,
    project: &'q ProjectCode,
    doc_type: &'q TypeCode,
    d: &'q Definition,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, SequenceRow, sqlx::postgres::PgArguments> {
    query
        .bind(project.as_str())
        .bind(doc_type.as_str())
        .bind(d.format.as_str())
        .bind(layout_name(d))
        .bind(d.epoch())
        .bind(d.start)
        .bind(d.max)
        .bind(d.reset.as_str())
        .bind(d.timezone.name())
        .bind(d.pool_size as i32)
        .bind(d.refill_at)
}

async fn update_definition<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    id: i64,
    d: &Definition,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE sequences SET format = $2, layout = $3, epoch = $4, start_seq = $5, max_seq = $6, \
         reset = $7, timezone = $8, pool_size = $9, refill_at = $10, version = version + 1, \
         updated_at = now() WHERE id = $1",
    )
    .bind(id)
    .bind(d.format.as_str())
    .bind(layout_name(d))
    .bind(d.epoch())
    .bind(d.start)
    .bind(d.max)
    .bind(d.reset.as_str())
    .bind(d.timezone.name())
    .bind(d.pool_size as i32)
    .bind(d.refill_at)
    .execute(db)
    .await?;
    Ok(())
}

fn layout_name(d: &Definition) -> &'static str {
    match d.layout {
        Layout::Text => "text",
        Layout::Int64 { .. } => "int64",
    }
}
