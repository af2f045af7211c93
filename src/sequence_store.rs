//! Sequence definitions in Postgres, with a per-instance cache for the hot path.
//!
//! Creating a sequence and changing how its IDs read happen under a lock per
//! project, and are refused when the new IDs could read like IDs another
//! sequence of the project prints, or like IDs the sequence printed before.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use crate::sequence::pattern::{Part, Pattern};
use crate::sequence::{
    CounterFloor, DEFAULT_FORMAT, Definition, DefinitionError, Layout, ProjectCode, Reset,
    Sequence, Template, TypeCode,
};

/// Postgres channel that tells every instance a definition changed.
pub const CHANGED_CHANNEL: &str = "idpool_sequences";
/// How long a cached definition is trusted without a change notification.
const CACHE_TTL: Duration = Duration::from_secs(30);
/// Most definitions one instance keeps; idle ones go first.
const MAX_CACHED: usize = 10_000;
/// After a forced reset change, periods beginning this soon still share
/// printed dates with the old definition (time zones lie up to 26 hours
/// apart; one more day for the period itself).
const FLOOR_SPAN: chrono::Duration = chrono::Duration::hours(50);
/// Default of `IDPOOL_MAX_SEQUENCES_PER_PROJECT`.
pub const DEFAULT_MAX_PER_PROJECT: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("stored definition of {0} is unreadable: {1}")]
    Corrupt(String, String),
    #[error(transparent)]
    Definition(#[from] DefinitionError),
    #[error(
        "IDs of {sequence} could read like IDs {other} (both could print {example:?}); \
         choose a format that cannot"
    )]
    Conflict {
        sequence: String,
        other: String,
        example: String,
    },
    #[error("project {project} has {limit} sequences, the most one project may have")]
    TooMany { project: String, limit: usize },
    #[error(
        "{sequence} was never defined, and the default definition does not fit it ({reason}); \
         define it with PUT /api/v1/sequences/{sequence} first"
    )]
    NoDefault {
        sequence: String,
        reason: DefinitionError,
    },
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
    /// The definition before this PUT, if there was one.
    pub previous: Option<Arc<Sequence>>,
}

struct Cached {
    sequence: Arc<Sequence>,
    loaded: Instant,
}

pub struct SequenceStore {
    db: PgPool,
    cache: RwLock<HashMap<String, Cached>>,
    max_per_project: usize,
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
    identity_version: i32,
    counter_floor: Option<i64>,
    floor_until: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

const SELECT_COLUMNS: &str = "id, project, doc_type, format, layout, epoch, start_seq, max_seq, \
     reset, timezone, pool_size, refill_at, version, identity_version, counter_floor, floor_until, \
     created_at, updated_at";

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
            identity_version: self.identity_version,
            floor: self
                .counter_floor
                .zip(self.floor_until)
                .map(|(value, until)| CounterFloor { value, until }),
            created_at: self.created_at,
            updated_at: self.updated_at,
        })
    }
}

/// What IDs of one definition (current or retired) of a sequence print.
struct Printed {
    sequence_id: i64,
    /// `PROJ/IS`, or `PROJ/IS (before: {old format})`.
    name: String,
    pattern: Pattern,
}

impl SequenceStore {
    pub fn new(db: PgPool, max_per_project: usize) -> Self {
        Self {
            db,
            cache: RwLock::new(HashMap::new()),
            max_per_project: max_per_project.max(1),
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
        if cache.len() >= MAX_CACHED && !cache.contains_key(&key) {
            // Entries past their time are reloaded anyway: drop them first.
            cache.retain(|_, c| c.loaded.elapsed() < CACHE_TTL);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
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

    /// Drops the cached definition of one sequence (it changed meanwhile).
    pub fn forget(&self, sequence: &Sequence) {
        self.evict(&cache_key(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
        ));
    }

    pub fn evict_all(&self) {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        cache.clear();
    }

    pub fn cached_len(&self) -> usize {
        self.cache.read().unwrap_or_else(|e| e.into_inner()).len()
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
        let definition =
            Definition::defaults(project, doc_type).map_err(|reason| StoreError::NoDefault {
                sequence: cache_key(project.as_str(), doc_type.as_str()),
                reason,
            })?;
        let mut tx = self.db.begin().await?;
        lock_project(&mut tx, project).await?;
        // Another request may have created it while we waited for the lock.
        let created = match select_for_update(&mut tx, project, doc_type).await? {
            Some(row) => row,
            None => {
                self.check_room(&mut tx, project).await?;
                check_against_project(&mut tx, project, doc_type, None, &definition).await?;
                insert_definition(&mut tx, project, doc_type, &definition).await?
            }
        };
        tx.commit().await?;
        Ok(self.remember(created.into_sequence()?))
    }

    /// Creates with the default definition every one of `pairs` not yet
    /// defined, all in one transaction: when one of them cannot be created
    /// (no room left in its project, a default that clashes), none is, and
    /// the error names the index of that pair. A batch refused for one
    /// item thus leaves no sequence behind.
    pub async fn create_missing(
        &self,
        pairs: &[(ProjectCode, TypeCode)],
    ) -> Result<(), (usize, StoreError)> {
        let mut missing: Vec<usize> = Vec::new();
        for (index, (project, doc_type)) in pairs.iter().enumerate() {
            if self
                .cached(&cache_key(project.as_str(), doc_type.as_str()))
                .is_none()
            {
                missing.push(index);
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        let first = missing[0];
        let whole = |e: StoreError| (first, e);
        let mut tx = self.db.begin().await.map_err(|e| whole(e.into()))?;
        // Projects locked in one order, so two batches naming the same
        // projects cannot wait for each other.
        let mut projects: Vec<&ProjectCode> = missing.iter().map(|i| &pairs[*i].0).collect();
        projects.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        projects.dedup_by(|a, b| a.as_str() == b.as_str());
        for project in &projects {
            lock_project(&mut tx, project).await.map_err(whole)?;
        }
        let mut created = Vec::new();
        for index in missing {
            let (project, doc_type) = &pairs[index];
            let at = |e: StoreError| (index, e);
            if let Some(row) = select_for_update(&mut tx, project, doc_type)
                .await
                .map_err(at)?
            {
                created.push(row);
                continue;
            }
            let definition = Definition::defaults(project, doc_type).map_err(|reason| {
                at(StoreError::NoDefault {
                    sequence: cache_key(project.as_str(), doc_type.as_str()),
                    reason,
                })
            })?;
            self.check_room(&mut tx, project).await.map_err(at)?;
            check_against_project(&mut tx, project, doc_type, None, &definition)
                .await
                .map_err(at)?;
            created.push(
                insert_definition(&mut tx, project, doc_type, &definition)
                    .await
                    .map_err(at)?,
            );
        }
        tx.commit().await.map_err(|e| whole(e.into()))?;
        for row in created {
            if let Ok(sequence) = row.into_sequence() {
                self.remember(sequence);
            }
        }
        Ok(())
    }

    /// The sequence if it was defined or used, read fresh from Postgres.
    #[tracing::instrument(skip_all, level = "debug")]
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

    /// Sequences of `projects` (`None`: all) ordered by (project, type),
    /// after the given pair.
    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn list(
        &self,
        after: Option<(&str, &str)>,
        limit: i64,
        projects: Option<&[String]>,
    ) -> Result<Vec<Sequence>, StoreError> {
        let (after_project, after_type) = after.unwrap_or(("", ""));
        // A key of some projects walks each of them from the cursor (the
        // unique index on (project, doc_type)): its page costs its own
        // sequences, however many other projects hold.
        let sql = match projects {
            Some(_) => format!(
                "SELECT s.* FROM unnest($4::text[]) AS p(code) CROSS JOIN LATERAL ( \
                     SELECT {SELECT_COLUMNS} FROM sequences \
                     WHERE project = p.code AND (project, doc_type) > ($1, $2) \
                     ORDER BY project, doc_type LIMIT $3) s \
                 ORDER BY s.project, s.doc_type LIMIT $3"
            ),
            None => format!(
                "SELECT {SELECT_COLUMNS} FROM sequences WHERE (project, doc_type) > ($1, $2) \
                 AND $4::text[] IS NULL ORDER BY project, doc_type LIMIT $3"
            ),
        };
        let rows: Vec<SequenceRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(after_project)
            .bind(after_type)
            .bind(limit)
            .bind(projects)
            .fetch_all(&self.db)
            .await?;
        rows.into_iter().map(SequenceRow::into_sequence).collect()
    }

    /// The identity version the sequence has now (to tell a stale
    /// definition from a spent counter).
    pub async fn identity_version(&self, id: i64) -> Result<Option<i32>, sqlx::Error> {
        sqlx::query_scalar("SELECT identity_version FROM sequences WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.db)
            .await
    }

    /// Creates or replaces a definition, refusing identity changes of a
    /// sequence with issued numbers unless `force`, and any definition whose
    /// IDs could read like IDs of another sequence of the project or like
    /// IDs this one printed under an earlier format.
    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn put(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
        definition: &Definition,
        force: bool,
    ) -> Result<PutOutcome, PutError> {
        let mut tx = self.db.begin().await.map_err(StoreError::from)?;
        lock_project(&mut tx, project).await?;
        let existing = select_for_update(&mut tx, project, doc_type)
            .await?
            .map(SequenceRow::into_sequence)
            .transpose()?;
        let mut replaced_identity = None;
        match &existing {
            None => {
                self.check_room(&mut tx, project).await?;
                check_against_project(&mut tx, project, doc_type, None, definition).await?;
                check_against_other_projects(&mut tx, project, doc_type, definition).await?;
                insert_definition(&mut tx, project, doc_type, definition).await?;
            }
            Some(current) => {
                check_against_project(&mut tx, project, doc_type, Some(current.id), definition)
                    .await?;
                check_against_other_projects(&mut tx, project, doc_type, definition).await?;
                let changes_identity = current.definition.changes_identity(definition);
                if changes_identity {
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
                    if issued {
                        retire(&mut tx, current, definition).await?;
                    }
                    replaced_identity = Some(Arc::new(current.clone()));
                }
                update_definition(&mut tx, current.id, definition, changes_identity)
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
            previous: existing.map(Arc::new),
        })
    }

    /// Refuses a new sequence in a project that has as many as it may.
    async fn check_room(
        &self,
        conn: &mut PgConnection,
        project: &ProjectCode,
    ) -> Result<(), StoreError> {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM sequences WHERE project = $1")
            .bind(project.as_str())
            .fetch_one(&mut *conn)
            .await?;
        if count as usize >= self.max_per_project {
            return Err(StoreError::TooMany {
                project: project.to_string(),
                limit: self.max_per_project,
            });
        }
        Ok(())
    }
}

/// Serialises creations and changes of one project's sequences, so two of
/// them cannot each pass the conflict check against the other's old state.
async fn lock_project(conn: &mut PgConnection, project: &ProjectCode) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('idpool:project:' || $1, 0))")
        .bind(project.as_str())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn select_for_update(
    conn: &mut PgConnection,
    project: &ProjectCode,
    doc_type: &TypeCode,
) -> Result<Option<SequenceRow>, StoreError> {
    let sql = format!(
        "SELECT {SELECT_COLUMNS} FROM sequences WHERE project = $1 AND doc_type = $2 FOR UPDATE"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(project.as_str())
        .bind(doc_type.as_str())
        .fetch_optional(&mut *conn)
        .await?)
}

/// The pattern of a stored (or retired) definition. One stored before the
/// reading rule existed still tells what it could print.
fn stored_pattern(
    layout: &str,
    format: &str,
    project: &str,
    doc_type: &str,
    max_digits: usize,
) -> Option<Pattern> {
    if layout == "int64" {
        return Some(Pattern::number(19, "the int64 layout"));
    }
    let template = Template::parse(format).ok()?;
    Some(Pattern::loose(
        template.parts(project, doc_type, max_digits),
    ))
}

/// Every pattern the project's sequences print or printed. With
/// `skip_default`, sequences printing the default format are left out: two
/// of them never print alike (a code holds no `-`), so a project of
/// default sequences costs nothing to check.
async fn project_patterns(
    conn: &mut PgConnection,
    project: &ProjectCode,
    skip_default: bool,
) -> Result<Vec<Printed>, StoreError> {
    let rows: Vec<(i64, String, String, String, Option<i64>, bool)> = sqlx::query_as(
        "SELECT s.id, s.doc_type, s.layout, s.format, s.max_seq, true FROM sequences s \
          WHERE s.project = $1 AND NOT ($2 AND s.layout = 'text' AND s.format = $3) \
         UNION ALL \
         SELECT s.id, s.doc_type, f.layout, f.format, NULL, false FROM sequence_formats f \
           JOIN sequences s ON s.id = f.sequence_id \
          WHERE s.project = $1 AND NOT ($2 AND f.layout = 'text' AND f.format = $3)",
    )
    .bind(project.as_str())
    .bind(skip_default)
    .bind(DEFAULT_FORMAT)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(id, doc_type, layout, format, max, current)| {
            let digits = max.map_or(19, |m| m.max(0).to_string().len());
            let pattern = stored_pattern(&layout, &format, project.as_str(), &doc_type, digits)?;
            let name = if current {
                format!("{project}/{doc_type}")
            } else {
                format!("{project}/{doc_type} printed with its earlier format {format:?}")
            };
            Some(Printed {
                sequence_id: id,
                name,
                pattern,
            })
        })
        .collect())
}

/// Refuses `definition` for `project`/`doc_type` when its IDs could read
/// like IDs another sequence of the project prints or printed. The
/// sequence's own earlier formats are checked when it is changed.
async fn check_against_project(
    conn: &mut PgConnection,
    project: &ProjectCode,
    doc_type: &TypeCode,
    own_id: Option<i64>,
    definition: &Definition,
) -> Result<(), StoreError> {
    let pattern = definition
        .pattern(project.as_str(), doc_type.as_str())
        .map_err(DefinitionError::from)?;
    let is_default =
        definition.layout == Layout::Text && definition.format.as_str() == DEFAULT_FORMAT;
    for printed in project_patterns(conn, project, is_default).await? {
        if Some(printed.sequence_id) == own_id {
            continue;
        }
        if let Some(example) = pattern.common_example(&printed.pattern) {
            return Err(StoreError::Conflict {
                sequence: format!("{project}/{doc_type}"),
                other: format!("of {}", printed.name),
                example,
            });
        }
    }
    Ok(())
}

/// What any project's default sequences print: `{project}-{type}-{seq}`
/// with any codes. A code holds no `-`, so the text before the first `-`
/// names the project.
fn default_of_any_project() -> Pattern {
    use crate::sequence::pattern::{CharSet, Field, Part};
    let code = |label: &str| {
        Part::Field(Field {
            min: 1,
            max: crate::sequence::name::MAX_CODE_LEN,
            chars: CharSet::LETTERS
                .union(CharSet::DIGITS)
                .union(CharSet::of(b"_")),
            seq: None,
            label: label.to_owned(),
        })
    };
    Pattern::loose(vec![
        code("{project}"),
        Part::Text("-".into()),
        code("{type}"),
        Part::Text("-".into()),
        Part::Field(Field {
            min: 1,
            max: 19,
            chars: CharSet::DIGITS,
            seq: Some(0),
            label: "{seq}".into(),
        }),
    ])
}

/// Serialises every definition that could clash across projects, so two
/// of them saved at once cannot each pass the check against the other's
/// old state.
async fn lock_formats(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('idpool:formats', 0))")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Refuses `definition` when its IDs could read like IDs of another
/// project: like those its default sequences print (now or once they are
/// first used), or like those its other sequences print or printed. Then
/// a document ID never blocks or reveals another tenant's. Definitions
/// with the default format pass: what they print starts with their own
/// project code and a `-`, and every other definition was checked against
/// that when it was saved.
async fn check_against_other_projects(
    conn: &mut PgConnection,
    project: &ProjectCode,
    doc_type: &TypeCode,
    definition: &Definition,
) -> Result<(), StoreError> {
    if definition.layout == Layout::Text && definition.format.as_str() == DEFAULT_FORMAT {
        return Ok(());
    }
    lock_formats(conn).await?;
    let sequence = format!("{project}/{doc_type}");
    let pattern = definition
        .pattern(project.as_str(), doc_type.as_str())
        .map_err(DefinitionError::from)?;
    let own_prefix = format!("{project}-");
    let starts_with_own_code = matches!(pattern.parts().first(),
        Some(Part::Text(text)) if text.starts_with(&own_prefix));
    if !starts_with_own_code
        && let Some(example) = pattern.common_example(&default_of_any_project())
    {
        return Err(StoreError::Conflict {
            sequence,
            other: format!(
                "another project's sequences print with the default format {DEFAULT_FORMAT} \
                 (start the format with {{project}}- to keep this project's IDs its own)"
            ),
            example,
        });
    }
    let offsets = definition.int64_day_offsets();
    for other in other_projects_definitions(conn, project).await? {
        let clash = match (&offsets, other.int64_offsets()) {
            // Two int64 layouts clash only if their days can start at the
            // same time of day after their epochs.
            (Some(mine), Some(theirs)) => {
                if mine.is_disjoint(&theirs) {
                    None
                } else {
                    Some(int64_example(definition, &theirs))
                }
            }
            _ => other
                .pattern
                .as_ref()
                .and_then(|p| pattern.common_example(p)),
        };
        if let Some(example) = clash {
            return Err(StoreError::Conflict {
                sequence,
                other: format!("of {} (another project)", other.name),
                example,
            });
        }
    }
    Ok(())
}

/// A sequence of another project, as the cross-project check sees it.
struct OtherDefinition {
    name: String,
    pattern: Option<Pattern>,
    /// Its definition when it has the int64 layout (current, not retired).
    int64: Option<Definition>,
}

impl OtherDefinition {
    fn int64_offsets(&self) -> Option<std::collections::BTreeSet<i64>> {
        self.int64.as_ref().and_then(Definition::int64_day_offsets)
    }
}

/// Every definition of other projects that does not print the default
/// format, with the formats they printed before a forced change.
async fn other_projects_definitions(
    conn: &mut PgConnection,
    project: &ProjectCode,
) -> Result<Vec<OtherDefinition>, StoreError> {
    let sql = format!(
        "SELECT {SELECT_COLUMNS} FROM sequences \
         WHERE project <> $1 AND NOT (layout = 'text' AND format = $2)"
    );
    let current: Vec<SequenceRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(project.as_str())
        .bind(DEFAULT_FORMAT)
        .fetch_all(&mut *conn)
        .await?;
    let retired: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT s.project, s.doc_type, f.layout, f.format FROM sequence_formats f \
         JOIN sequences s ON s.id = f.sequence_id \
         WHERE s.project <> $1 AND NOT (f.layout = 'text' AND f.format = $2)",
    )
    .bind(project.as_str())
    .bind(DEFAULT_FORMAT)
    .fetch_all(&mut *conn)
    .await?;
    let mut others = Vec::with_capacity(current.len() + retired.len());
    for row in current {
        let sequence = row.into_sequence()?;
        let name = format!("{}/{}", sequence.project, sequence.doc_type);
        let pattern = sequence
            .definition
            .pattern(sequence.project.as_str(), sequence.doc_type.as_str())
            .ok();
        let int64 = matches!(sequence.definition.layout, Layout::Int64 { .. })
            .then(|| sequence.definition.clone());
        others.push(OtherDefinition {
            name,
            pattern,
            int64,
        });
    }
    for (other_project, other_type, layout, format) in retired {
        others.push(OtherDefinition {
            name: format!(
                "{other_project}/{other_type} printed with its earlier format {format:?}"
            ),
            pattern: stored_pattern(&layout, &format, &other_project, &other_type, 19),
            int64: None,
        });
    }
    Ok(others)
}

/// A number both int64 definitions could print: the first number of a day
/// whose start lies at a time of day `theirs` holds too.
fn int64_example(definition: &Definition, theirs: &std::collections::BTreeSet<i64>) -> String {
    let mine = definition.int64_day_offsets().unwrap_or_default();
    let shared = mine.intersection(theirs).next().copied().unwrap_or(0);
    ((shared << 32) | definition.start.max(1)).to_string()
}

/// A forced change of a sequence that printed IDs: the new format must not
/// print what any earlier format printed, and when the same format comes
/// back under another reset, counters start above every number taken so
/// far (a counter starting over would print the old IDs again).
async fn retire(
    conn: &mut PgConnection,
    current: &Sequence,
    next: &Definition,
) -> Result<(), StoreError> {
    let (project, doc_type) = (current.project.as_str(), current.doc_type.as_str());
    let name = format!("{project}/{doc_type}");
    let mut printed: Vec<(String, String)> =
        sqlx::query_as("SELECT layout, format FROM sequence_formats WHERE sequence_id = $1")
            .bind(current.id)
            .fetch_all(&mut *conn)
            .await?;
    printed.push(printed_as(&current.definition));
    let new_pattern = next
        .pattern(project, doc_type)
        .map_err(DefinitionError::from)?;
    let same_as = |earlier: &(String, String)| *earlier == printed_as(next);
    for earlier in printed.iter().filter(|p| !same_as(p)) {
        let Some(pattern) = stored_pattern(&earlier.0, &earlier.1, project, doc_type, 19) else {
            continue;
        };
        if let Some(example) = new_pattern.common_example(&pattern) {
            let earlier = match earlier.0.as_str() {
                "int64" => format!("it printed under its earlier epoch {}", earlier.1),
                _ => format!("it printed with its earlier format {:?}", earlier.1),
            };
            return Err(StoreError::Conflict {
                sequence: name,
                other: earlier,
                example,
            });
        }
    }
    sqlx::query(
        "INSERT INTO sequence_formats (sequence_id, layout, format) VALUES ($1, $2, $3) \
         ON CONFLICT DO NOTHING",
    )
    .bind(current.id)
    .bind(printed_as(&current.definition).0)
    .bind(printed_as(&current.definition).1)
    .execute(&mut *conn)
    .await?;
    let reprints = printed.iter().any(same_as);
    if reprints && current.definition.reset != next.reset {
        let floor: Option<i64> =
            sqlx::query_scalar("SELECT max(next_seq) FROM counters WHERE sequence_id = $1")
                .bind(current.id)
                .fetch_one(&mut *conn)
                .await?;
        if let Some(floor) = floor {
            sqlx::query(
                "UPDATE counters SET next_seq = GREATEST(next_seq, $2) WHERE sequence_id = $1",
            )
            .bind(current.id)
            .bind(floor)
            .execute(&mut *conn)
            .await?;
            sqlx::query(
                "UPDATE sequences SET counter_floor = GREATEST(coalesce(counter_floor, 0), $2), \
                 floor_until = now() + make_interval(secs => $3) WHERE id = $1",
            )
            .bind(current.id)
            .bind(floor)
            .bind(FLOOR_SPAN.num_seconds() as f64)
            .execute(&mut *conn)
            .await?;
        }
    }
    Ok(())
}

/// What decides the strings a definition prints, as kept in
/// `sequence_formats`: the format, or for the int64 layout its epoch (a new
/// epoch moves every day's base onto another day's).
fn printed_as(d: &Definition) -> (String, String) {
    match d.layout {
        Layout::Text => ("text".into(), d.format.as_str().to_owned()),
        Layout::Int64 { epoch } => ("int64".into(), epoch.to_rfc3339()),
    }
}

const INSERT_SEQUENCE: &str = "INSERT INTO sequences (project, doc_type, format, layout, epoch, start_seq, \
     max_seq, reset, timezone, pool_size, refill_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

async fn insert_definition(
    conn: &mut PgConnection,
    project: &ProjectCode,
    doc_type: &TypeCode,
    d: &Definition,
) -> Result<SequenceRow, StoreError> {
    let sql = format!("{INSERT_SEQUENCE} RETURNING {SELECT_COLUMNS}");
    let query = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(project.as_str())
        .bind(doc_type.as_str());
    Ok(bind_definition(query, d).fetch_one(&mut *conn).await?)
}

async fn update_definition(
    conn: &mut PgConnection,
    id: i64,
    d: &Definition,
    changes_identity: bool,
) -> Result<(), sqlx::Error> {
    let query = sqlx::query_as::<_, (i64,)>(
        "UPDATE sequences SET format = $2, layout = $3, epoch = $4, start_seq = $5, max_seq = $6, \
         reset = $7, timezone = $8, pool_size = $9, refill_at = $10, version = version + 1, \
         identity_version = identity_version + $11::int, updated_at = now() WHERE id = $1 RETURNING id",
    )
    .bind(id);
    bind_definition(query, d)
        .bind(i32::from(changes_identity))
        .fetch_one(&mut *conn)
        .await?;
    Ok(())
}

/// The definition's nine columns, in the order both statements list them.
fn bind_definition<'q, O>(
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    d: &'q Definition,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    query
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

fn layout_name(d: &Definition) -> &'static str {
    match d.layout {
        Layout::Text => "text",
        Layout::Int64 { .. } => "int64",
    }
}

/// Definitions changed by another instance are read again.
impl crate::listen::Subscriber for SequenceStore {
    fn channel(&self) -> &'static str {
        CHANGED_CHANNEL
    }

    fn notified(&self, payload: &str) {
        self.evict(payload);
    }

    fn missed(&self) {
        self.evict_all();
    }
}
