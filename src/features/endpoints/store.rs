//! SQL of the `endpoints` table: a project's own delivery endpoints.

use chrono::{DateTime, Utc};

use crate::infra::db::{Db, Link};

use super::{Endpoint, EndpointError, EndpointPatch};

/// The columns an [`Endpoint`] is read from (never the secrets).
const COLUMNS: &str = "id, project, url, description, types, disabled, disabled_reason, \
                       failing_since, created_at, updated_at";

/// A new endpoint, its id and secret made by the caller.
pub struct NewRow<'a> {
    pub id: &'a str,
    pub project: &'a str,
    pub url: &'a str,
    pub description: &'a str,
    pub types: Option<&'a [String]>,
    pub disabled: bool,
    pub secret: &'a str,
}

/// Inserts an endpoint unless its project has `max` already; the count is
/// taken under a lock of the project's endpoints, so two creations at
/// once cannot both pass it.
pub async fn insert(db: &Db, row: &NewRow<'_>, max: i64) -> Result<Endpoint, EndpointError> {
    let mut tx = db.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idpool:endpoints'), hashtext($1))")
        .bind(row.project)
        .execute(&mut tx)
        .await?;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM endpoints WHERE project = $1")
        .bind(row.project)
        .fetch_one(&mut tx)
        .await?;
    if count >= max {
        return Err(EndpointError::LimitReached(max));
    }
    let sql = format!(
        "INSERT INTO endpoints (id, project, url, description, types, disabled, disabled_reason, secret) \
         VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $6 THEN 'manual' END, $7) RETURNING {COLUMNS}"
    );
    let endpoint: Endpoint = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(row.id)
        .bind(row.project)
        .bind(row.url)
        .bind(row.description)
        .bind(row.types)
        .bind(row.disabled)
        .bind(row.secret)
        .fetch_one(&mut tx)
        .await?;
    tx.commit().await?;
    Ok(endpoint)
}

/// One endpoint, if the caller's projects (None: all) hold it.
pub async fn find(
    db: &Db,
    id: &str,
    projects: Option<&[String]>,
) -> Result<Option<Endpoint>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM endpoints WHERE id = $1 AND ($2::text[] IS NULL OR project = ANY($2))"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .bind(projects)
        .fetch_optional(db)
        .await
}

/// A page of a project's endpoints, in the order they were made, after
/// the endpoint `after` (of the same project).
pub async fn list(
    db: &Db,
    project: &str,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<Endpoint>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM endpoints WHERE project = $1 \
           AND ($2::text IS NULL OR (created_at, id) > \
                (SELECT created_at, id FROM endpoints WHERE id = $2 AND project = $1)) \
         ORDER BY project, created_at, id LIMIT $3"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(project)
        .bind(after)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// Whether `id` is an endpoint of `project` (a cursor must name one).
pub async fn belongs(db: &Db, id: &str, project: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM endpoints WHERE id = $1 AND project = $2)")
        .bind(id)
        .bind(project)
        .fetch_one(db)
        .await
}

/// Applies a change. Enabling an endpoint clears its failure record and
/// circuit, so it is tried at once.
pub async fn update(
    db: &Db,
    id: &str,
    projects: Option<&[String]>,
    patch: &EndpointPatch,
) -> Result<Option<Endpoint>, sqlx::Error> {
    let types_given = patch.types.is_some();
    let types = patch.types.clone().flatten();
    let sql = format!(
        "UPDATE endpoints SET \
             url = coalesce($3, url), \
             description = coalesce($4, description), \
             types = CASE WHEN $5 THEN $6 ELSE types END, \
             disabled = coalesce($7, disabled), \
             disabled_reason = CASE WHEN $7 THEN coalesce(disabled_reason, 'manual') \
                                    WHEN NOT $7 THEN NULL ELSE disabled_reason END, \
             failing_since = CASE WHEN $7 = false THEN NULL ELSE failing_since END, \
             consecutive_failures = CASE WHEN $7 = false THEN 0 ELSE consecutive_failures END, \
             circuit_open_until = CASE WHEN $7 = false THEN NULL ELSE circuit_open_until END, \
             updated_at = now() \
         WHERE id = $1 AND ($2::text[] IS NULL OR project = ANY($2)) RETURNING {COLUMNS}"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .bind(projects)
        .bind(patch.url.as_deref())
        .bind(patch.description.as_deref())
        .bind(types_given)
        .bind(types)
        .bind(patch.disabled)
        .fetch_optional(db)
        .await
}

/// Deletes an endpoint, at once: what it leaves (undelivered documents,
/// to be abandoned for it; its attempts) is swept afterwards, in bounded
/// steps ([`sweep_deleted`]). False when the caller has no such endpoint.
pub async fn delete(db: &Db, id: &str, projects: Option<&[String]>) -> Result<bool, sqlx::Error> {
    let mut tx = db.begin().await?;
    let deleted: Option<String> = sqlx::query_scalar(
        "DELETE FROM endpoints WHERE id = $1 AND ($2::text[] IS NULL OR project = ANY($2)) RETURNING id",
    )
    .bind(id)
    .bind(projects)
    .fetch_optional(&mut tx)
    .await?;
    if deleted.is_none() {
        return Ok(false);
    }
    sqlx::query("INSERT INTO endpoints_deleted (id) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(id)
        .execute(&mut tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

/// One bounded step of sweeping a deleted endpoint: up to `chunk` of its
/// pending deliveries, then of its dead letters, abandoned (`endpoint
/// deleted`) and their documents settled, and up to `chunk` of its
/// attempts removed; the endpoint is forgotten once nothing is left.
/// Returns the rows it changed (0: nothing to sweep).
pub async fn sweep_deleted(db: &Db, chunk: i64) -> Result<u64, sqlx::Error> {
    let mut tx = db.begin().await?;
    let id: Option<String> = sqlx::query_scalar(
        "SELECT id FROM endpoints_deleted ORDER BY deleted_at LIMIT 1 FOR UPDATE SKIP LOCKED",
    )
    .fetch_optional(&mut tx)
    .await?;
    let Some(id) = id else {
        return Ok(0);
    };
    let mut changed = 0;
    for status in ["pending", "dead_letter"] {
        // The status spelt out, so the planner matches its partial index.
        let sql = format!(
            "UPDATE endpoint_deliveries d SET status = 'abandoned', last_error = 'endpoint deleted' \
             FROM (SELECT outbox_id FROM endpoint_deliveries \
                    WHERE endpoint_id = $1 AND status = '{status}' LIMIT $2) p \
             WHERE d.outbox_id = p.outbox_id AND d.endpoint_id = $1 RETURNING d.outbox_id"
        );
        let abandoned: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(&id)
            .bind(chunk)
            .fetch_all(&mut tx)
            .await?;
        settle(&mut tx, &abandoned).await?;
        changed += abandoned.len() as u64;
    }
    changed += sqlx::query(
        "DELETE FROM delivery_attempts WHERE ctid = ANY (ARRAY( \
             SELECT ctid FROM delivery_attempts WHERE endpoint_id = $1 LIMIT $2))",
    )
    .bind(&id)
    .bind(chunk)
    .execute(&mut tx)
    .await?
    .rows_affected();
    if changed == 0 {
        sqlx::query("DELETE FROM endpoints_deleted WHERE id = $1")
            .bind(&id)
            .execute(&mut tx)
            .await?;
        changed = 1;
    }
    tx.commit().await?;
    Ok(changed)
}

/// What became of a rotation ([`rotate_secret`]).
#[derive(Debug)]
pub enum Rotation {
    /// The new secret signs; the one before it until this time.
    Rotated(DateTime<Utc>),
    /// A secret rotated out earlier still signs until this time, as its
    /// rotation's answer promised: nothing changed.
    Pending(DateTime<Utc>),
    /// The caller has no such endpoint.
    NotFound,
}

/// Makes a new secret the one that signs; the one before keeps signing
/// until the answer's time. Refused while a secret rotated out earlier
/// still signs: only two secrets sign at once, and dropping that one
/// would break the time its rotation promised. One statement, so of
/// rotations at once one wins and the others find it pending.
pub async fn rotate_secret(
    db: &Db,
    id: &str,
    projects: Option<&[String]>,
    secret: &str,
    overlap: std::time::Duration,
) -> Result<Rotation, sqlx::Error> {
    let rotated: Option<DateTime<Utc>> = sqlx::query_scalar(
        "UPDATE endpoints SET previous_secret = secret, secret = $3, \
             previous_expires_at = now() + make_interval(secs => $4), updated_at = now() \
         WHERE id = $1 AND ($2::text[] IS NULL OR project = ANY($2)) \
           AND (previous_expires_at IS NULL OR previous_expires_at <= now()) \
         RETURNING previous_expires_at",
    )
    .bind(id)
    .bind(projects)
    .bind(secret)
    .bind(overlap.as_secs_f64())
    .fetch_optional(db)
    .await?;
    if let Some(until) = rotated {
        return Ok(Rotation::Rotated(until));
    }
    let pending: Option<Option<DateTime<Utc>>> = sqlx::query_scalar(
        "SELECT previous_expires_at FROM endpoints \
         WHERE id = $1 AND ($2::text[] IS NULL OR project = ANY($2))",
    )
    .bind(id)
    .bind(projects)
    .fetch_optional(db)
    .await?;
    Ok(match pending {
        Some(Some(until)) => Rotation::Pending(until),
        // Its earlier secret lapsed between the two statements: the
        // caller may simply ask again.
        Some(None) => Rotation::Pending(Utc::now()),
        None => Rotation::NotFound,
    })
}

/// Sets the status of routed documents from their deliveries (see the
/// migration's `idpool_settle_routed`).
pub async fn settle(conn: &mut impl Link, outbox_ids: &[i64]) -> Result<(), sqlx::Error> {
    if outbox_ids.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT idpool_settle_routed($1)")
        .bind(outbox_ids)
        .execute(conn.statements())
        .await?;
    Ok(())
}
