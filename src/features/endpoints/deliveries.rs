//! SQL of deliveries to endpoints (`endpoint_deliveries`) and of their
//! attempts (`delivery_attempts`): claims, outcomes, what a tenant reads.
//!
//! A claim is one statement, committed before anything is sent: it moves
//! the delivery's due time to the end of the claim, which is also its
//! token. The outcome is recorded only where the token is still there, so
//! a late outcome (its claim expired and another dispatcher took the
//! delivery) changes nothing.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use crate::infra::db::Db;

use super::store;
use crate::features::documents::delivery_queue::{
    self, DocumentStatus, DocumentView, TransitionError,
};

/// An enabled endpoint that has pending deliveries, with what a
/// dispatcher needs to send to it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Target {
    pub id: String,
    pub project: String,
    pub url: String,
    pub secret: String,
    /// The previous secret while it still signs.
    pub previous_secret: Option<String>,
    pub consecutive_failures: i32,
    /// Seconds until its soonest delivery is due and its circuit closed
    /// (zero or less: now), by the database's clock.
    pub wait_s: f64,
}

impl Target {
    pub fn due(&self) -> bool {
        self.wait_s <= 0.0
    }
}

/// The enabled endpoints with pending deliveries, found by skipping
/// through the index of pending deliveries: one probe per endpoint that
/// has any, and one for its soonest, however many it has.
pub async fn targets(db: &Db) -> Result<Vec<Target>, sqlx::Error> {
    sqlx::query_as(
        "WITH RECURSIVE t(id) AS ( \
             (SELECT endpoint_id FROM endpoint_deliveries WHERE status = 'pending' \
              ORDER BY endpoint_id LIMIT 1) \
             UNION ALL \
             SELECT (SELECT d.endpoint_id FROM endpoint_deliveries d \
                     WHERE d.status = 'pending' AND d.endpoint_id > t.id \
                     ORDER BY d.endpoint_id LIMIT 1) \
             FROM t WHERE t.id IS NOT NULL) \
         SELECT e.id, e.project, e.url, e.secret, \
                CASE WHEN e.previous_expires_at > now() THEN e.previous_secret END AS previous_secret, \
                e.consecutive_failures, \
                extract(epoch FROM greatest(d.next_attempt_at, \
                    coalesce(e.circuit_open_until, '-infinity')) - clock_timestamp())::float8 AS wait_s \
           FROM t JOIN endpoints e ON e.id = t.id \
           CROSS JOIN LATERAL ( \
                SELECT next_attempt_at FROM endpoint_deliveries \
                 WHERE endpoint_id = e.id AND status = 'pending' \
                 ORDER BY endpoint_id, next_attempt_at LIMIT 1) d \
          WHERE NOT e.disabled",
    )
    .fetch_all(db)
    .await
}

/// A claimed delivery, with its document.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Claimed {
    pub outbox_id: i64,
    pub endpoint_id: String,
    /// The claim's token: the due time it set.
    pub claim: DateTime<Utc>,
    pub document_id: String,
    pub project: String,
    pub doc_type: String,
    pub seq: i64,
    pub created_at: DateTime<Utc>,
    pub payload: String,
}

/// Claims up to `room[i]` due deliveries of endpoint `endpoints[i]`, in
/// due order, skipping those another dispatcher holds; each is not due
/// again until `lease` has passed.
pub async fn claim(
    db: &Db,
    endpoints: &[String],
    room: &[i32],
    lease: std::time::Duration,
) -> Result<Vec<Claimed>, sqlx::Error> {
    if endpoints.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        "WITH picked AS ( \
             SELECT c.outbox_id, c.endpoint_id \
               FROM unnest($1::text[], $2::int[]) AS w(endpoint_id, room) \
               CROSS JOIN LATERAL ( \
                   SELECT outbox_id, endpoint_id FROM endpoint_deliveries x \
                    WHERE x.endpoint_id = w.endpoint_id AND x.status = 'pending' \
                      AND x.next_attempt_at <= now() \
                    ORDER BY x.endpoint_id, x.next_attempt_at LIMIT w.room \
                    FOR UPDATE SKIP LOCKED) c), \
         claimed AS ( \
             UPDATE endpoint_deliveries d \
                SET (next_attempt_at, claimed_until) = \
                    (SELECT c, c FROM (SELECT clock_timestamp() + make_interval(secs => $3)) AS x(c)) \
               FROM picked p \
              WHERE d.outbox_id = p.outbox_id AND d.endpoint_id = p.endpoint_id \
             RETURNING d.outbox_id, d.endpoint_id, d.next_attempt_at) \
         SELECT c.outbox_id, c.endpoint_id, c.next_attempt_at AS claim, o.document_id, \
                o.tenant_code AS project, o.entity_type_id AS doc_type, o.seq_number AS seq, \
                o.created_at, o.payload::text AS payload \
           FROM claimed c JOIN id_outbox o ON o.id = c.outbox_id",
    )
    .bind(endpoints)
    .bind(room)
    .bind(lease.as_secs_f64())
    .fetch_all(db)
    .await
}

/// Gives claims back unsent: each delivery is due again after `pause`
/// (where its claim still holds).
pub async fn release(
    db: &Db,
    claims: &[Claimed],
    pause: std::time::Duration,
) -> Result<(), sqlx::Error> {
    if claims.is_empty() {
        return Ok(());
    }
    let outbox_ids: Vec<i64> = claims.iter().map(|c| c.outbox_id).collect();
    let endpoint_ids: Vec<&str> = claims.iter().map(|c| c.endpoint_id.as_str()).collect();
    let tokens: Vec<DateTime<Utc>> = claims.iter().map(|c| c.claim).collect();
    sqlx::query(
        "UPDATE endpoint_deliveries d SET next_attempt_at = clock_timestamp() + make_interval(secs => $4) \
         FROM unnest($1::bigint[], $2::text[], $3::timestamptz[]) AS c(outbox_id, endpoint_id, claim) \
         WHERE d.outbox_id = c.outbox_id AND d.endpoint_id = c.endpoint_id \
           AND d.next_attempt_at = c.claim AND d.status = 'pending'",
    )
    .bind(&outbox_ids)
    .bind(&endpoint_ids)
    .bind(&tokens)
    .bind(pause.as_secs_f64())
    .execute(db)
    .await?;
    Ok(())
}

/// What one attempt came to.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub outbox_id: i64,
    pub endpoint_id: String,
    pub claim: DateTime<Utc>,
    pub document_id: String,
    pub attempted_at: DateTime<Utc>,
    /// The HTTP status the endpoint answered, if it answered.
    pub status_code: Option<i32>,
    /// The classification of a failure (None: delivered).
    pub error: Option<String>,
    pub duration_ms: i32,
}

/// How failed deliveries are retried and endpoints judged.
#[derive(Debug, Clone)]
pub struct Judgement {
    pub retry: crate::features::documents::delivery_queue::Retry,
    /// Failures in a row that open an endpoint's circuit.
    pub circuit_after: i32,
    /// The first pause of an open circuit, doubled each time it opens
    /// again, up to `circuit_max`.
    pub circuit_base: std::time::Duration,
    pub circuit_max: std::time::Duration,
    /// An endpoint whose every attempt failed this long is disabled.
    pub disable_after: std::time::Duration,
}

/// What recording a batch of attempts did.
#[derive(Debug, Default)]
pub struct Recorded {
    pub delivered: usize,
    pub failed: usize,
    pub dead_lettered: usize,
    /// Endpoints disabled for failing.
    pub disabled: Vec<String>,
    /// Seconds from acceptance to delivery, per delivered row.
    pub lags: Vec<f64>,
}

/// Records attempts in one transaction: each delivery's outcome (where its
/// claim still holds; a delivery abandoned while its attempt was under way
/// and taken by the endpoint is recorded delivered: the target has it), the attempts log, the endpoints' health (circuit,
/// disabling), and the status of documents whose deliveries all ended.
pub async fn record(
    db: &Db,
    attempts: &[Attempt],
    judgement: &Judgement,
) -> Result<Recorded, sqlx::Error> {
    let mut recorded = Recorded::default();
    if attempts.is_empty() {
        return Ok(recorded);
    }
    let outbox_ids: Vec<i64> = attempts.iter().map(|a| a.outbox_id).collect();
    let endpoint_ids: Vec<&str> = attempts.iter().map(|a| a.endpoint_id.as_str()).collect();
    let claims: Vec<DateTime<Utc>> = attempts.iter().map(|a| a.claim).collect();
    let errors: Vec<Option<&str>> = attempts.iter().map(|a| a.error.as_deref()).collect();
    let at: Vec<DateTime<Utc>> = attempts.iter().map(|a| a.attempted_at).collect();
    let documents: Vec<&str> = attempts.iter().map(|a| a.document_id.as_str()).collect();
    let codes: Vec<Option<i32>> = attempts.iter().map(|a| a.status_code).collect();
    let durations: Vec<i32> = attempts.iter().map(|a| a.duration_ms).collect();
    let retry = &judgement.retry;
    let mut tx = db.begin().await?;
    // Outcomes, where the claim still holds.
    let ended: Vec<(i64, String, Option<f64>)> = sqlx::query_as(
        "UPDATE endpoint_deliveries d SET \
             attempts = d.attempts + 1, \
             last_attempt_at = f.at, \
             last_error = f.error, \
             status = CASE WHEN f.error IS NULL THEN 'committed' \
                           WHEN d.attempts + 1 >= $5 THEN 'dead_letter' ELSE 'pending' END, \
             delivered_at = CASE WHEN f.error IS NULL THEN clock_timestamp() END, \
             next_attempt_at = CASE WHEN f.error IS NULL THEN d.next_attempt_at ELSE \
                 clock_timestamp() + make_interval(secs => \
                     LEAST($6 * power(2, LEAST(d.attempts + 1, 40)), $7) * (1 + 0.25 * random())) END \
         FROM unnest($1::bigint[], $2::text[], $3::timestamptz[], $4::text[], $8::timestamptz[]) \
              AS f(outbox_id, endpoint_id, claim, error, at) \
         WHERE d.outbox_id = f.outbox_id AND d.endpoint_id = f.endpoint_id \
           AND d.next_attempt_at = f.claim \
           AND (d.status = 'pending' OR (f.error IS NULL AND d.status = 'abandoned')) \
         RETURNING d.outbox_id, d.status, \
                   CASE WHEN d.status = 'committed' THEN \
                        extract(epoch FROM d.delivered_at - (SELECT created_at FROM id_outbox WHERE id = d.outbox_id))::float8 END",
    )
    .bind(&outbox_ids)
    .bind(&endpoint_ids)
    .bind(&claims)
    .bind(&errors)
    .bind(retry.max_retries)
    .bind(retry.backoff_base.as_secs_f64())
    .bind(retry.backoff_max.as_secs_f64())
    .bind(&at)
    .fetch_all(&mut tx)
    .await?;
    let mut settled = Vec::new();
    for (outbox_id, status, lag) in ended {
        match status.as_str() {
            "committed" => {
                recorded.delivered += 1;
                recorded.lags.extend(lag);
                settled.push(outbox_id);
            }
            "dead_letter" => {
                recorded.failed += 1;
                recorded.dead_lettered += 1;
                settled.push(outbox_id);
            }
            _ => recorded.failed += 1,
        }
    }
    sqlx::query(
        "INSERT INTO delivery_attempts \
             (endpoint_id, document_id, attempted_at, status_code, error, duration_ms) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int[], $5::text[], $6::int[])",
    )
    .bind(&endpoint_ids)
    .bind(&documents)
    .bind(&at)
    .bind(&codes)
    .bind(&errors)
    .bind(&durations)
    .execute(&mut tx)
    .await?;
    recorded.disabled = judge_endpoints(&mut tx, attempts, judgement).await?;
    settled.sort_unstable();
    settled.dedup();
    store::settle(&mut tx, &settled).await?;
    tx.commit().await?;
    Ok(recorded)
}

/// Updates each endpoint's health from its attempts of the batch: a
/// success closes its circuit and forgets its failures; failures count
/// up, open the circuit every `circuit_after` in a row (for a pause that
/// doubles, up to `circuit_max`), and disable an endpoint whose attempts
/// have all failed for `disable_after`. Returns the endpoints disabled.
async fn judge_endpoints(
    tx: &mut crate::infra::db::Tx<'_>,
    attempts: &[Attempt],
    judgement: &Judgement,
) -> Result<Vec<String>, sqlx::Error> {
    let mut health: std::collections::BTreeMap<&str, (i32, bool, DateTime<Utc>)> =
        Default::default();
    for attempt in attempts {
        let entry =
            health
                .entry(attempt.endpoint_id.as_str())
                .or_insert((0, false, attempt.attempted_at));
        match attempt.error {
            None => entry.1 = true,
            Some(_) => entry.0 += 1,
        }
        entry.2 = entry.2.min(attempt.attempted_at);
    }
    let ids: Vec<&str> = health.keys().copied().collect();
    let failures: Vec<i32> = health.values().map(|h| h.0).collect();
    let succeeded: Vec<bool> = health.values().map(|h| h.1).collect();
    let first: Vec<DateTime<Utc>> = health.values().map(|h| h.2).collect();
    sqlx::query_scalar(
        "UPDATE endpoints e SET \
             consecutive_failures = CASE WHEN h.ok THEN 0 ELSE e.consecutive_failures + h.failures END, \
             failing_since = CASE WHEN h.ok THEN NULL ELSE coalesce(e.failing_since, h.first) END, \
             circuit_open_until = CASE \
                 WHEN h.ok THEN NULL \
                 WHEN e.consecutive_failures + h.failures >= $5 \
                 THEN clock_timestamp() + make_interval(secs => LEAST($6 * power(2, \
                        LEAST(e.consecutive_failures + h.failures - $5, 30)), $7)) \
                 ELSE e.circuit_open_until END, \
             disabled = e.disabled OR (NOT h.ok AND coalesce(e.failing_since, h.first) \
                 <= clock_timestamp() - make_interval(secs => $8)), \
             disabled_reason = CASE WHEN NOT e.disabled AND NOT h.ok AND coalesce(e.failing_since, h.first) \
                 <= clock_timestamp() - make_interval(secs => $8) THEN 'failing' ELSE e.disabled_reason END \
         FROM unnest($1::text[], $2::int[], $3::bool[], $4::timestamptz[]) AS h(id, failures, ok, first) \
         WHERE e.id = h.id \
         RETURNING CASE WHEN e.disabled AND e.disabled_reason = 'failing' AND NOT h.ok THEN e.id END",
    )
    .bind(&ids)
    .bind(&failures)
    .bind(&succeeded)
    .bind(&first)
    .bind(judgement.circuit_after.max(1))
    .bind(judgement.circuit_base.as_secs_f64())
    .bind(judgement.circuit_max.as_secs_f64())
    .bind(judgement.disable_after.as_secs_f64())
    .fetch_all(&mut *tx)
    .await
    .map(|rows: Vec<Option<String>>| rows.into_iter().flatten().collect())
}

/// One endpoint's delivery of a document, as its project reads it.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct DeliveryView {
    pub endpoint_id: String,
    /// `pending`, `committed`, `dead_letter` or `abandoned`.
    pub status: String,
    pub attempts: i32,
    /// A short classification of the last failure.
    pub last_error: Option<String>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// When a pending delivery is next tried.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
}

/// A document's deliveries, if the caller's projects hold the document
/// (None: no such document for the caller).
pub async fn of_document(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<Option<Vec<DeliveryView>>, sqlx::Error> {
    let mut conn = db.acquire().await?;
    let conn = &mut conn;
    let outbox_id: Option<i64> = sqlx::query_scalar(
        "SELECT id FROM id_outbox WHERE document_id = $1 AND ($2::text[] IS NULL OR tenant_code = ANY($2))",
    )
    .bind(document_id)
    .bind(projects)
    .fetch_optional(crate::infra::db::Link::statements(conn))
    .await?;
    let Some(outbox_id) = outbox_id else {
        return Ok(None);
    };
    sqlx::query_as(
        "SELECT endpoint_id, status::text AS status, attempts, last_error, last_attempt_at, \
                CASE WHEN status = 'pending' THEN next_attempt_at END AS next_attempt_at, delivered_at \
           FROM endpoint_deliveries WHERE outbox_id = $1 ORDER BY endpoint_id",
    )
    .bind(outbox_id)
    .fetch_all(crate::infra::db::Link::statements(conn))
    .await
    .map(Some)
}

/// One attempt, as the endpoint's project reads it.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct AttemptView {
    pub document_id: String,
    pub attempted_at: DateTime<Utc>,
    /// The HTTP status answered, if the endpoint answered.
    pub status_code: Option<i32>,
    /// A short classification of the failure; null when delivered.
    pub error: Option<String>,
    pub duration_ms: i32,
}

/// A page of an endpoint's attempts, newest first, after `after` (an
/// attempt's time and document).
pub async fn attempts_of(
    db: &Db,
    endpoint_id: &str,
    after: Option<(DateTime<Utc>, &str)>,
    limit: i64,
) -> Result<Vec<AttemptView>, sqlx::Error> {
    let (at, document) = after.unzip();
    sqlx::query_as(
        "SELECT document_id, attempted_at, status_code, error, duration_ms FROM delivery_attempts \
          WHERE endpoint_id = $1 \
            AND ($2::timestamptz IS NULL OR (attempted_at, document_id) < ($2, $3)) \
          ORDER BY endpoint_id, attempted_at DESC, document_id DESC LIMIT $4",
    )
    .bind(endpoint_id)
    .bind(at)
    .bind(document)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Retries (`retry`: dead letters and abandoned deliveries back to
/// pending) or abandons (pending and dead letters) a routed document's
/// deliveries, all of them or `endpoint_id`'s, and settles its status.
/// `Ok(None)`: the document is not routed (it goes to the sink, whose
/// transitions apply) and no endpoint was named.
pub async fn transition_routed(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
    endpoint_id: Option<&str>,
    retry: bool,
) -> Result<Option<DocumentView>, TransitionError> {
    let action = if retry { "retry" } else { "abandon" };
    let mut tx = db.begin().await?;
    // Locked, so a recorder settling the document goes first or after.
    let found: Option<(bool, DocumentStatus)> = sqlx::query_as(
        "SELECT routed, status::text FROM id_outbox WHERE document_id = $1 \
           AND ($2::text[] IS NULL OR tenant_code = ANY($2)) FOR UPDATE",
    )
    .bind(document_id)
    .bind(projects)
    .fetch_optional(&mut tx)
    .await?;
    let Some((routed, status)) = found else {
        return Err(TransitionError::NotFound(document_id.to_owned()));
    };
    if !routed {
        return match endpoint_id {
            None => Ok(None),
            Some(_) => Err(TransitionError::NotAllowed {
                id: document_id.to_owned(),
                status: status.as_str(),
                action,
                allowed: "documents routed to endpoints when an endpoint_id is named",
            }),
        };
    }
    if !retry {
        // The deliveries to abandon, locked (a dispatcher's claim skips
        // them meanwhile): refused while an attempt of one is under way.
        let in_flight: Option<DateTime<Utc>> = sqlx::query_scalar(
            "SELECT max(idpool_attempt_ends(s.claimed_until, s.next_attempt_at)) \
               FROM (SELECT d.claimed_until, d.next_attempt_at FROM endpoint_deliveries d \
                       JOIN id_outbox o ON o.id = d.outbox_id \
                      WHERE o.document_id = $1 AND ($2::text IS NULL OR d.endpoint_id = $2) \
                        AND d.status = 'pending' FOR UPDATE OF d) s",
        )
        .bind(document_id)
        .bind(endpoint_id)
        .fetch_one(&mut tx)
        .await?;
        if let Some(until) = in_flight {
            return Err(TransitionError::InFlight {
                id: document_id.to_owned(),
                until,
            });
        }
    }
    let sql = match retry {
        true => {
            "UPDATE endpoint_deliveries d SET status = 'pending', attempts = 0, last_error = NULL, \
                 next_attempt_at = now() \
             FROM id_outbox o WHERE o.document_id = $1 AND d.outbox_id = o.id \
               AND ($2::text IS NULL OR d.endpoint_id = $2) \
               AND d.status IN ('dead_letter', 'abandoned') \
               AND d.endpoint_id IN (SELECT id FROM endpoints)"
        }
        false => {
            "UPDATE endpoint_deliveries d SET status = 'abandoned' \
             FROM id_outbox o WHERE o.document_id = $1 AND d.outbox_id = o.id \
               AND ($2::text IS NULL OR d.endpoint_id = $2) \
               AND d.status IN ('pending', 'dead_letter')"
        }
    };
    let changed = sqlx::query(sql)
        .bind(document_id)
        .bind(endpoint_id)
        .execute(&mut tx)
        .await?
        .rows_affected();
    if changed == 0 {
        return Err(TransitionError::NotAllowed {
            id: document_id.to_owned(),
            status: status.as_str(),
            action,
            allowed: match retry {
                true => {
                    "documents with a dead_letter or abandoned delivery (to an endpoint that exists)"
                }
                false => "documents with a pending or dead_letter delivery",
            },
        });
    }
    let outbox_id: i64 = sqlx::query_scalar("SELECT id FROM id_outbox WHERE document_id = $1")
        .bind(document_id)
        .fetch_one(&mut tx)
        .await?;
    store::settle(&mut tx, &[outbox_id]).await?;
    if retry {
        sqlx::query("SELECT pg_notify('idpool_deliveries', '')")
            .execute(&mut tx)
            .await?;
    }
    tx.commit().await?;
    delivery_queue::find(db, document_id, projects)
        .await?
        .map(Some)
        .ok_or_else(|| TransitionError::NotFound(document_id.to_owned()))
}
