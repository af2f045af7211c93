//! First uses joined: the definitions concurrent requests miss in the
//! cache are read, and those never defined created with the defaults, for
//! all of them at once: one statement finds the defined ones, one short
//! transaction creates the rest (their projects locked in one order, room
//! and formats checked per project, every row inserted by one statement).
//! Ten thousand projects making their first request at once thus cost a
//! few statements per batch, not a transaction each, and one project's
//! first use waits for no other project's lock.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::conflicts::non_default_patterns;
use super::{SequenceRow, StoreError, cache_key, sequence_rows};
use crate::domain::sequence::{Definition, ProjectCode, TypeCode};
use crate::infra::db::Db;
use crate::records::batch::Batcher;

/// What one ask gets: the stored row, or why there is none. A failure of
/// the batch's statements is shared by its asks.
pub(super) type Found = Result<SequenceRow, Arc<StoreError>>;

struct Ask {
    project: ProjectCode,
    doc_type: TypeCode,
    reply: oneshot::Sender<Found>,
}

/// The joined reads and creations of definitions on first use.
pub(super) struct FirstUses {
    asks: Batcher<Ask>,
}

impl FirstUses {
    pub(super) fn spawn(db: Db, max_per_project: usize) -> Self {
        // Its loop ends with the store; nothing waits for it.
        let tasks = TaskTracker::new();
        let asks = Batcher::spawn(&tasks, "first uses", 1024, move |batch| {
            let db = db.clone();
            async move { serve(&db, max_per_project, batch).await }
        });
        Self { asks }
    }

    /// The definition of `project`/`doc_type`, created with the defaults
    /// if it was never defined.
    pub(super) async fn get_or_create(&self, project: &ProjectCode, doc_type: &TypeCode) -> Found {
        let (reply, answer) = oneshot::channel();
        let ask = Ask {
            project: project.clone(),
            doc_type: doc_type.clone(),
            reply,
        };
        if self.asks.submit(ask).await.is_err() {
            return Err(Arc::new(StoreError::Db(sqlx::Error::PoolClosed)));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(Arc::new(StoreError::Db(sqlx::Error::PoolClosed))))
    }
}

async fn serve(db: &Db, max_per_project: usize, batch: Vec<Ask>) {
    let mut asks: HashMap<String, Vec<Ask>> = HashMap::new();
    for ask in batch {
        asks.entry(cache_key(ask.project.as_str(), ask.doc_type.as_str()))
            .or_default()
            .push(ask);
    }
    let pairs: Vec<(ProjectCode, TypeCode)> = asks
        .values()
        .map(|group| (group[0].project.clone(), group[0].doc_type.clone()))
        .collect();
    let mut found = match read_or_create(db, max_per_project, &pairs).await {
        Ok(found) => found,
        Err(e) => {
            let e = Arc::new(e);
            for ask in asks.into_values().flatten() {
                let _ = ask.reply.send(Err(e.clone()));
            }
            return;
        }
    };
    for (key, group) in asks {
        let outcome = found
            .remove(&key)
            .unwrap_or_else(|| Err(StoreError::Corrupt(key.clone(), "not found".into())));
        let outcome = outcome.map_err(Arc::new);
        for ask in group {
            let _ = ask.reply.send(match &outcome {
                Ok(row) => Ok(row.clone()),
                Err(e) => Err(e.clone()),
            });
        }
    }
}

/// Each pair's row, or why it could not be created; an error of the
/// statements themselves is the whole batch's.
async fn read_or_create(
    db: &Db,
    max_per_project: usize,
    pairs: &[(ProjectCode, TypeCode)],
) -> Result<HashMap<String, Result<SequenceRow, StoreError>>, StoreError> {
    let mut found: HashMap<String, Result<SequenceRow, StoreError>> = HashMap::new();
    for row in defined(db, pairs).await? {
        found.insert(cache_key(&row.project, &row.doc_type), Ok(row));
    }
    let missing: Vec<&(ProjectCode, TypeCode)> = pairs
        .iter()
        .filter(|(p, t)| !found.contains_key(&cache_key(p.as_str(), t.as_str())))
        .collect();
    if missing.is_empty() {
        return Ok(found);
    }
    let mut creating: Vec<(&ProjectCode, &TypeCode, Definition)> = Vec::new();
    for (project, doc_type) in missing {
        match Definition::defaults(project, doc_type) {
            Ok(definition) => creating.push((project, doc_type, definition)),
            Err(reason) => {
                let sequence = cache_key(project.as_str(), doc_type.as_str());
                found.insert(
                    sequence.clone(),
                    Err(StoreError::NoDefault { sequence, reason }),
                );
            }
        }
    }
    if creating.is_empty() {
        return Ok(found);
    }
    let mut tx = db.begin().await?;
    // Projects locked in one order, so two batches naming the same
    // projects cannot wait for each other (nor for a PUT, which locks one).
    let mut projects: Vec<&str> = creating.iter().map(|(p, _, _)| p.as_str()).collect();
    projects.sort_unstable();
    projects.dedup();
    sqlx::query!(
        "SELECT count(pg_advisory_xact_lock(hashtextextended('idpool:project:' || p, 0))) AS \"locked!\" \
         FROM unnest($1::text[]) AS p",
        &projects as &[&str],
    )
    .fetch_one(&mut tx)
    .await?;
    // Created by another instance while we waited for the locks.
    let others: Vec<(ProjectCode, TypeCode)> = creating
        .iter()
        .map(|(p, t, _)| ((*p).clone(), (*t).clone()))
        .collect();
    let mut raced: HashMap<String, SequenceRow> = HashMap::new();
    for row in defined(&mut tx, &others).await? {
        raced.insert(cache_key(&row.project, &row.doc_type), row);
    }
    let counts: HashMap<String, i64> = sqlx::query!(
        r#"SELECT project AS "project!", count(*) AS "count!" FROM sequences
           WHERE project = ANY($1) GROUP BY project"#,
        &projects as &[&str],
    )
    .fetch_all(&mut tx)
    .await?
    .into_iter()
    .map(|r| (r.project, r.count))
    .collect();
    let patterns = non_default_patterns(&mut tx, &projects).await?;
    let mut room: HashMap<&str, i64> = projects
        .iter()
        .map(|p| {
            let used = counts.get(*p).copied().unwrap_or(0);
            (*p, max_per_project as i64 - used)
        })
        .collect();
    let mut inserting: Vec<(&ProjectCode, &TypeCode, &Definition)> = Vec::new();
    for (project, doc_type, definition) in &creating {
        let key = cache_key(project.as_str(), doc_type.as_str());
        if let Some(row) = raced.remove(&key) {
            found.insert(key, Ok(row));
            continue;
        }
        let left = room.entry(project.as_str()).or_default();
        if *left <= 0 {
            found.insert(
                key,
                Err(StoreError::TooMany {
                    project: project.to_string(),
                    limit: max_per_project,
                }),
            );
            continue;
        }
        // A default sequence never prints like another default one of its
        // project (a code holds no `-`): only the others are checked.
        match clash(
            project,
            doc_type,
            definition,
            patterns.get(project.as_str()),
        ) {
            Ok(()) => {
                *left -= 1;
                inserting.push((project, doc_type, definition));
            }
            Err(e) => {
                found.insert(key, Err(e));
            }
        }
    }
    for row in insert_defaults(&mut tx, &inserting).await? {
        found.insert(cache_key(&row.project, &row.doc_type), Ok(row));
    }
    tx.commit().await?;
    Ok(found)
}

/// The stored rows of those of `pairs` that are defined.
async fn defined<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    pairs: &[(ProjectCode, TypeCode)],
) -> Result<Vec<SequenceRow>, StoreError> {
    let projects: Vec<&str> = pairs.iter().map(|(p, _)| p.as_str()).collect();
    let types: Vec<&str> = pairs.iter().map(|(_, t)| t.as_str()).collect();
    Ok(sequence_rows!(
        "SELECT",
        "FROM sequences WHERE (project, doc_type) IN \
         (SELECT * FROM unnest($1::text[], $2::text[]))",
        &projects as &[&str],
        &types as &[&str],
    )
    .fetch_all(db)
    .await?)
}

/// Refuses a default definition whose IDs could read like those of one
/// of `others` (the project's sequences that do not print the default).
fn clash(
    project: &ProjectCode,
    doc_type: &TypeCode,
    definition: &Definition,
    others: Option<&Vec<super::Printed>>,
) -> Result<(), StoreError> {
    let Some(others) = others else {
        return Ok(());
    };
    let pattern = definition
        .pattern(project.as_str(), doc_type.as_str())
        .map_err(crate::domain::sequence::DefinitionError::from)?;
    for printed in others {
        if let Some(example) = pattern.common_example(&printed.pattern) {
            return Err(StoreError::Conflict {
                sequence: cache_key(project.as_str(), doc_type.as_str()),
                other: format!("of {}", printed.name),
                example,
            });
        }
    }
    Ok(())
}

/// Inserts default definitions, one statement for all.
async fn insert_defaults(
    tx: &mut crate::infra::db::Tx<'_>,
    rows: &[(&ProjectCode, &TypeCode, &Definition)],
) -> Result<Vec<SequenceRow>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let projects: Vec<&str> = rows.iter().map(|(p, _, _)| p.as_str()).collect();
    let types: Vec<&str> = rows.iter().map(|(_, t, _)| t.as_str()).collect();
    // Every row is the default definition, the same for all but its codes.
    let d = rows[0].2;
    Ok(sequence_rows!(
        "INSERT INTO sequences (project, doc_type, format, layout, epoch, start_seq, max_seq, \
         reset, timezone, pool_size, refill_at, numbering, register, register_issuer) \
         SELECT p, t, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14 \
         FROM unnest($1::text[], $2::text[]) AS u(p, t) RETURNING",
        "",
        &projects as &[&str],
        &types as &[&str],
        d.format.as_str(),
        super::writes::layout_name(d),
        d.epoch(),
        d.start,
        d.max,
        d.reset.as_str(),
        d.timezone.name(),
        d.pool_size as i32,
        d.refill_at,
        d.numbering.as_str(),
        d.register.as_str(),
        d.register.issuer(),
    )
    .fetch_all(&mut *tx)
    .await?)
}
