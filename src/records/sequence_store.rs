//! Sequence definitions in Postgres, with a per-instance cache for the hot path.
//!
//! Creating a sequence and changing how its IDs read happen under a lock per
//! project, and are refused when the new IDs could read like IDs another
//! sequence of the project prints, or like IDs the sequence printed before.

mod conflicts;
mod first_use;
mod writes;

use conflicts::{check_against_other_projects, check_against_project, stored_pattern};
use writes::{insert_definition, replace_definition};

use std::sync::Arc;

use crate::infra::commitment::Commitment;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::infra::db::{Db, Tx};
use chrono::{DateTime, Utc};

use crate::domain::sequence::pattern::{Part, Pattern};
use crate::domain::sequence::{
    CounterFloor, DEFAULT_FORMAT, Definition, DefinitionError, Layout, Numbering, ProjectCode,
    Register, Reset, Sequence, Template, TypeCode,
};

/// Postgres channel that tells every instance a definition changed.
pub const CHANGED_CHANNEL: &str = "idpool_sequences";
/// How long a cached definition is trusted without a change notification.
const CACHE_TTL: Duration = Duration::from_secs(30);
/// Most definitions one instance keeps; the least used go first.
pub const MAX_CACHED: u64 = 10_000;
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
    /// One failure shared by every request a joined statement served.
    #[error(transparent)]
    Shared(Arc<StoreError>),
}

#[derive(Debug, thiserror::Error)]
pub enum PutError {
    #[error(
        "the sequence has issued numbers; changing format, layout, reset or timezone needs \"force\": true"
    )]
    InUse,
    #[error(
        "the sequence has taken numbers from its counter; \"numbering\" cannot change, even with \"force\""
    )]
    NumberingInUse,
    #[error(
        "the sequence has taken numbers; \"register\" and \"issuer\" cannot change, even with \"force\""
    )]
    RegisterInUse,
    #[error(
        "the gapless sequence has taken numbers; its format, layout, reset, timezone, start and numbering cannot change, even with \"force\""
    )]
    GaplessInUse,
    #[error(
        "the sequence has taken numbers and its max is {max}; a definition without \"max\" would remove it: send \"max\" again, or \"force\": true to remove it"
    )]
    MaxDropped { max: i64 },
    /// The request's deadline passed before the change was sent.
    #[error("the request was withdrawn at its deadline before anything was written")]
    Withdrawn,
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

pub struct SequenceStore {
    db: Db,
    /// Definitions by `project/type`: each trusted for [`CACHE_TTL`] from
    /// its load, at most [`MAX_CACHED`] of them, the least used evicted
    /// first (and a newcomer used once does not push out one used often);
    /// concurrent misses of one definition wait for one load.
    cache: moka::future::Cache<String, Arc<Sequence>>,
    /// Definitions read from Postgres by name, since start.
    loads: AtomicU64,
    max_per_project: usize,
    /// Reads and creations of definitions missing from the cache, joined
    /// across concurrent requests (started at the first miss).
    first_uses: std::sync::OnceLock<first_use::FirstUses>,
}

fn cache_key(project: &str, doc_type: &str) -> String {
    format!("{project}/{doc_type}")
}

#[derive(Clone)]
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
    numbering: String,
    register: Option<String>,
    register_issuer: Option<String>,
    version: i32,
    identity_version: i32,
    counter_floor: Option<i64>,
    floor_until: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

/// `query_as!` of `SequenceRow`s: `$sql` is what follows the column list
/// (`FROM sequences WHERE …`, or an INSERT's columns and values), `$before`
/// what precedes it (`SELECT`, or an INSERT ending in `RETURNING`). A macro,
/// so the query stays one literal sqlx checks at compile time.
macro_rules! sequence_rows {
    ($before:tt, $sql:tt $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            SequenceRow,
            $before + " id, project, doc_type, format, layout, epoch, start_seq, max_seq, \
             reset, timezone, pool_size, refill_at, numbering, register, register_issuer, version, \
             identity_version, counter_floor, floor_until, created_at, updated_at " + $sql
            $(, $arg)*
        )
    };
}
pub(crate) use sequence_rows;

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
                numbering: Numbering::parse(&self.numbering).ok_or_else(|| corrupt("numbering"))?,
                register: Register::parse(self.register.as_deref(), self.register_issuer)
                    .ok_or_else(|| corrupt("register"))?,
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
    pub fn new(db: Db, max_per_project: usize) -> Self {
        Self::with_cache_bound(db, max_per_project, MAX_CACHED)
    }

    /// A store keeping at most `cached` definitions (tests use a small
    /// bound to watch eviction).
    pub fn with_cache_bound(db: Db, max_per_project: usize, cached: u64) -> Self {
        Self {
            db,
            cache: moka::future::Cache::builder()
                .max_capacity(cached)
                .time_to_live(CACHE_TTL)
                .build(),
            loads: AtomicU64::new(0),
            max_per_project: max_per_project.max(1),
            first_uses: std::sync::OnceLock::new(),
        }
    }

    async fn remember(&self, sequence: Sequence) -> Arc<Sequence> {
        let sequence = Arc::new(sequence);
        let key = cache_key(sequence.project.as_str(), sequence.doc_type.as_str());
        self.cache.insert(key, sequence.clone()).await;
        sequence
    }

    /// Drops a cached definition (after a change notification, which
    /// arrives outside any task: the drop runs in a task of its own).
    pub fn evict(&self, key: &str) {
        let (cache, key) = (self.cache.clone(), key.to_owned());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { cache.invalidate(&key).await });
            }
            Err(_) => cache.invalidate_all(),
        }
    }

    /// Drops the cached definition of one sequence (it changed meanwhile).
    pub async fn forget(&self, sequence: &Sequence) {
        let key = cache_key(sequence.project.as_str(), sequence.doc_type.as_str());
        self.cache.invalidate(&key).await;
    }

    pub fn evict_all(&self) {
        self.cache.invalidate_all();
    }

    /// Definitions read from Postgres by name since start: a cache hit
    /// reads none.
    pub fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// The sequence, created with the default definition on first use.
    /// A miss joins the other misses of the moment: one statement reads
    /// every one of them that is defined, one short transaction creates
    /// the rest ([`first_use`]); concurrent misses of one definition share
    /// one ask.
    pub async fn get_or_create(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
    ) -> Result<Arc<Sequence>, StoreError> {
        let key = cache_key(project.as_str(), doc_type.as_str());
        if let Some(sequence) = self.cache.get(&key).await {
            return Ok(sequence);
        }
        let first_uses = self
            .first_uses
            .get_or_init(|| first_use::FirstUses::spawn(self.db.clone(), self.max_per_project));
        let mut failed = None;
        let found = self
            .cache
            .optionally_get_with(key, async {
                self.loads.fetch_add(1, Ordering::Relaxed);
                let row = match first_uses.get_or_create(project, doc_type).await {
                    Ok(row) => row,
                    Err(e) => {
                        failed = Some(e);
                        return None;
                    }
                };
                match row.into_sequence() {
                    Ok(sequence) => Some(Arc::new(sequence)),
                    Err(e) => {
                        failed = Some(Arc::new(e));
                        None
                    }
                }
            })
            .await;
        let shared = |e: Arc<StoreError>| Arc::try_unwrap(e).unwrap_or_else(StoreError::Shared);
        match (found, failed) {
            (Some(sequence), _) => Ok(sequence),
            (None, Some(e)) => Err(shared(e)),
            // Another request's ask, which this one waited for, failed (its
            // error is its own): this one asks for itself.
            (None, None) => {
                let row = first_uses
                    .get_or_create(project, doc_type)
                    .await
                    .map_err(shared)?;
                Ok(self.remember(row.into_sequence()?).await)
            }
        }
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
            let key = cache_key(project.as_str(), doc_type.as_str());
            if !self.cache.contains_key(&key) {
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
                self.remember(sequence).await;
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
        match self.load(project, doc_type).await? {
            Some(sequence) => Ok(Some(self.remember(sequence).await)),
            None => Ok(None),
        }
    }

    /// On the caller's connection: a job holding one for its run must not
    /// wait for a second (reconciliation did, and failed with the pool
    /// taken).
    pub async fn by_id(
        conn: &mut impl crate::infra::db::Link,
        id: i64,
    ) -> Result<Option<Sequence>, StoreError> {
        let row = sequence_rows!("SELECT", "FROM sequences WHERE id = $1", id)
            .fetch_optional(conn.statements())
            .await?;
        row.map(SequenceRow::into_sequence).transpose()
    }

    async fn load(&self, project: &str, doc_type: &str) -> Result<Option<Sequence>, StoreError> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        let row = sequence_rows!(
            "SELECT",
            "FROM sequences WHERE project = $1 AND doc_type = $2",
            project,
            doc_type
        )
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
        let rows = match projects {
            Some(projects) => {
                sequence_rows!(
                    "SELECT s.* FROM unnest($4::text[]) AS p(code) CROSS JOIN LATERAL (SELECT",
                    "FROM sequences WHERE project = p.code AND (project, doc_type) > ($1, $2) \
                     ORDER BY project, doc_type LIMIT $3) s \
                     ORDER BY s.project, s.doc_type LIMIT $3",
                    after_project,
                    after_type,
                    limit,
                    projects
                )
                .fetch_all(&self.db)
                .await?
            }
            None => {
                sequence_rows!(
                    "SELECT",
                    "FROM sequences WHERE (project, doc_type) > ($1, $2) \
                     ORDER BY project, doc_type LIMIT $3",
                    after_project,
                    after_type,
                    limit
                )
                .fetch_all(&self.db)
                .await?
            }
        };
        rows.into_iter().map(SequenceRow::into_sequence).collect()
    }

    /// The identity version the sequence has now (to tell a stale
    /// definition from a spent counter).
    pub async fn identity_version(&self, id: i64) -> Result<Option<i32>, sqlx::Error> {
        sqlx::query_scalar!("SELECT identity_version FROM sequences WHERE id = $1", id)
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
                replaced_identity = replace_definition(&mut tx, current, definition, force).await?;
            }
        }
        sqlx::query_scalar!(
            "SELECT pg_notify($1, $2)",
            CHANGED_CHANNEL,
            cache_key(project.as_str(), doc_type.as_str()),
        )
        .fetch_one(&mut tx)
        .await
        .map_err(StoreError::from)?;
        // Once the COMMIT is sent the change may land: the request is no
        // longer answered "nothing written" at its deadline (it was, after
        // a commit, while the pools' Redis did not answer).
        let commitment = Commitment::current();
        if commitment.as_ref().is_some_and(|c| !c.begin_send()) {
            let _ = tx.rollback().await;
            return Err(PutError::Withdrawn);
        }
        if let Err(e) = tx.commit().await {
            if !crate::infra::db::may_have_committed(&e)
                && let Some(commitment) = &commitment
            {
                commitment.not_written();
            }
            return Err(StoreError::from(e).into());
        }
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
            sequence: self.remember(sequence).await,
            created: existing.is_none(),
            replaced_identity,
            previous: existing.map(Arc::new),
        })
    }

    /// Refuses a new sequence in a project that has as many as it may.
    async fn check_room(&self, conn: &mut Tx<'_>, project: &ProjectCode) -> Result<(), StoreError> {
        let count = sqlx::query_scalar!(
            r#"SELECT count(*) AS "count!" FROM sequences WHERE project = $1"#,
            project.as_str(),
        )
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
async fn lock_project(conn: &mut Tx<'_>, project: &ProjectCode) -> Result<(), StoreError> {
    sqlx::query_scalar!(
        "SELECT pg_advisory_xact_lock(hashtextextended('idpool:project:' || $1, 0))",
        project.as_str(),
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(())
}

async fn select_for_update(
    conn: &mut Tx<'_>,
    project: &ProjectCode,
    doc_type: &TypeCode,
) -> Result<Option<SequenceRow>, StoreError> {
    Ok(sequence_rows!(
        "SELECT",
        "FROM sequences WHERE project = $1 AND doc_type = $2 FOR UPDATE",
        project.as_str(),
        doc_type.as_str()
    )
    .fetch_optional(&mut *conn)
    .await?)
}

/// Definitions changed by another instance are read again.
impl crate::infra::listen::Subscriber for SequenceStore {
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

#[cfg(test)]
mod tests;
