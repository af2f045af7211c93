//! `Idempotency-Key`: a request retried with its key gets the stored answer
//! instead of new numbers.
//!
//! The key's row is inserted at the start of the request's transaction and
//! its answer stored in the same commit as the work. A concurrent twin's
//! insert waits on that row (up to 2 s, the transaction's lock timeout),
//! then finds the answer committed and replays it, or times out: 409.

use std::time::Duration;

use crate::domain::json_number;
use crate::infra::db::{Conn, Db, Tx, Witness, xmin_of};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// How long an answer is kept for replay (SPEC).
pub const KEY_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long a request waits for a twin holding its key before answering 409.
pub const WAIT_FOR_TWIN: &str = "2s";

/// Whose records these are: an API key's id (`anonymous` with
/// authentication off). Two keys never see each other's answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner(String);

impl Owner {
    pub fn key(id: &str) -> Self {
        Owner(format!("key:{id}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdempotencyKeyError {
    #[error("Idempotency-Key must be 1 to 255 printable ASCII characters")]
    Malformed,
}

/// 1–255 printable ASCII characters (SPEC).
pub fn validate_key(key: &str) -> Result<(), IdempotencyKeyError> {
    if (1..=255).contains(&key.len()) && key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        Ok(())
    } else {
        Err(IdempotencyKeyError::Malformed)
    }
}

/// What a request is, for telling a retry from a different request under
/// the same key: the route and the body in RFC 8785 canonical form (keys
/// sorted, numbers and strings written one way), so a retry whose keys
/// come in another order, or whose `1.0` is now `1`, is the same request
/// whatever the map type of the JSON parser.
pub fn fingerprint(route: &str, body: &Value) -> Vec<u8> {
    let mut hasher = Sha256::new();
    hasher.update(route.as_bytes());
    hasher.update([0]);
    match serde_json_canonicalizer::to_vec(body) {
        Ok(canonical) => hasher.update(&canonical),
        // Only a number JSON cannot write (not a parsed body's): its
        // text stands for it.
        Err(_) => hasher.update(body.to_string().as_bytes()),
    }
    // RFC 8785 writes numbers as doubles, so integers past 2^53 that
    // differ would print alike: each goes in exactly, in an order that
    // does not depend on the body's key order.
    let mut exact = Vec::new();
    integers_past_doubles(body, &mut exact);
    for integer in exact {
        hasher.update([0]);
        hasher.update(integer.as_bytes());
    }
    hasher.finalize().to_vec()
}

/// JSON text kept as sent (a document's metadata), parsed for a
/// [`fingerprint`] with each number exact: parsed as such, a number is a
/// double, so `1e-400` and `0`, or two decimals past a double's precision,
/// would be one request, and the second one's value lost as a replay
/// though the payload keeps its text. Each number becomes a string no
/// stored JSON can hold (NUL, refused in every body, then its
/// [`json_number::Decimal::exact`] form); one pass over the text, then one parse.
pub fn with_exact_numbers(raw: &str) -> Result<Value, serde_json::Error> {
    let mut rewritten = String::with_capacity(raw.len() + raw.len() / 4);
    let mut copied = 0;
    for literal in json_number::literals(raw) {
        rewritten.push_str(&raw[copied..literal.start]);
        rewritten.push_str("\"\\u0000");
        rewritten.push_str(&json_number::Decimal::parse(&raw[literal.clone()]).exact());
        rewritten.push('"');
        copied = literal.end;
    }
    rewritten.push_str(&raw[copied..]);
    serde_json::from_str(&rewritten)
}

/// The integers of `value` a double cannot hold exactly, as text, walking
/// object keys in sorted order.
fn integers_past_doubles(value: &Value, into: &mut Vec<String>) {
    const EXACT: u64 = 1 << 53;
    match value {
        Value::Number(n) => {
            let past = n.as_u64().is_some_and(|u| u > EXACT)
                || n.as_i64().is_some_and(|i| i.unsigned_abs() > EXACT);
            if past {
                into.push(n.to_string());
            }
        }
        Value::Array(items) => items.iter().for_each(|v| integers_past_doubles(v, into)),
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            for key in keys {
                integers_past_doubles(&map[key], into);
            }
        }
        _ => {}
    }
}

/// A stored answer.
#[derive(Debug, Clone)]
pub struct Stored {
    pub status: u16,
    pub response: Value,
}

#[derive(Debug)]
pub enum Claimed {
    /// First use: do the work and `store` its answer before committing.
    New,
    /// Same key, same request, finished: answer with this.
    Replay(Stored),
    /// Same key, another request.
    Mismatch,
}

#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("a request with this Idempotency-Key is still running")]
    InUse,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    use crate::infra::db::sqlstate::{DEADLOCK_DETECTED, LOCK_NOT_AVAILABLE};
    matches!(
        crate::infra::db::sqlstate::of(e).as_deref(),
        Some(LOCK_NOT_AVAILABLE | DEADLOCK_DETECTED)
    )
}

/// Makes lock waits of this transaction give up after [`WAIT_FOR_TWIN`].
pub async fn wait_for_twins_briefly(conn: &mut Tx<'_>) -> Result<(), sqlx::Error> {
    // set_config(.., true) is SET LOCAL with the value bound.
    sqlx::query_scalar!("SELECT set_config('lock_timeout', $1, true)", WAIT_FOR_TWIN)
        .fetch_one(&mut *conn)
        .await?;
    Ok(())
}

/// Claims `keys` (key, fingerprint) for `caller` in one round trip (plus
/// one to read the answers of keys used before). In key order, so two
/// batches sharing keys cannot deadlock.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn claim(
    conn: &mut Tx<'_>,
    caller: &Owner,
    keys: &[(String, Vec<u8>)],
) -> Result<Vec<Claimed>, ClaimError> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by(|a, b| keys[*a].0.cmp(&keys[*b].0));
    let names: Vec<&str> = order.iter().map(|i| keys[*i].0.as_str()).collect();
    let hashes: Vec<&[u8]> = order.iter().map(|i| keys[*i].1.as_slice()).collect();
    let inserted: Vec<String> = sqlx::query_scalar!(
        "INSERT INTO idempotency_keys (caller, key, request_hash, status_code, response) \
         SELECT $1, k, h, 0, 'null'::jsonb FROM UNNEST($2::text[], $3::bytea[]) WITH ORDINALITY AS t(k, h, n) \
         ORDER BY n \
         ON CONFLICT (caller, key) DO NOTHING RETURNING key",
        caller.as_str(),
        &names as &[&str],
        &hashes as &[&[u8]],
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| if is_lock_timeout(&e) { ClaimError::InUse } else { ClaimError::Db(e) })?;
    let used_before: Vec<&str> = names
        .iter()
        .copied()
        .filter(|k| !inserted.iter().any(|i| i == k))
        .collect();
    let mut stored: std::collections::HashMap<String, (Vec<u8>, i16, Value)> =
        std::collections::HashMap::new();
    if !used_before.is_empty() {
        let rows = sqlx::query!(
            "SELECT key, request_hash, status_code, response FROM idempotency_keys \
             WHERE caller = $1 AND key = ANY($2)",
            caller.as_str(),
            &used_before as &[&str],
        )
        .fetch_all(&mut *conn)
        .await?;
        stored = rows
            .into_iter()
            .map(|r| (r.key, (r.request_hash, r.status_code, r.response)))
            .collect();
    }
    keys.iter()
        .map(|(key, hash)| match stored.remove(key) {
            None if inserted.iter().any(|i| i == key) => Ok(Claimed::New),
            // Pruned between our insert and read: take it as new next time.
            None => Err(ClaimError::InUse),
            Some((stored_hash, _, _)) if &stored_hash != hash => Ok(Claimed::Mismatch),
            Some((_, 0, _)) => Err(ClaimError::InUse),
            Some((_, status, response)) => Ok(Claimed::Replay(Stored {
                status: status as u16,
                response,
            })),
        })
        .collect()
}

/// The keys a request claims, as the witness of its transaction
/// (`db::Witness`): a key it claimed new was inserted by that transaction,
/// whose id is the row's `xmin`. A request that claims no key has nothing
/// to look for, and the server's word stands.
pub struct ClaimWitness<'a> {
    caller: &'a Owner,
    keys: Vec<&'a str>,
}

impl<'a> ClaimWitness<'a> {
    /// Borrows what the request already holds: nothing is copied on the
    /// way to an answer for a lookup that almost never runs.
    pub fn new(caller: &'a Owner, keys: Vec<&'a str>) -> Self {
        Self { caller, keys }
    }
}

impl Witness for ClaimWitness<'_> {
    async fn written_by(&self, conn: &mut Conn, xid: i64) -> Result<bool, sqlx::Error> {
        if self.keys.is_empty() {
            return Ok(true);
        }
        sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM idempotency_keys
                              WHERE caller = $1 AND key = ANY($2) AND xmin::text = $3) AS "written!""#,
            self.caller.as_str(),
            &self.keys as &[&str],
            xmin_of(xid),
        )
        .fetch_one(&mut *conn)
        .await
    }
}

/// Stores the answers of claimed keys; commits with the caller's work.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn store(
    conn: &mut Tx<'_>,
    caller: &Owner,
    answers: &[(&str, u16, Value)],
) -> Result<(), sqlx::Error> {
    if answers.is_empty() {
        return Ok(());
    }
    let keys: Vec<&str> = answers.iter().map(|(k, _, _)| *k).collect();
    let statuses: Vec<i16> = answers.iter().map(|(_, s, _)| *s as i16).collect();
    let responses: Vec<&Value> = answers.iter().map(|(_, _, r)| r).collect();
    sqlx::query!(
        "UPDATE idempotency_keys i SET status_code = a.s, response = a.r \
         FROM UNNEST($2::text[], $3::smallint[], $4::jsonb[]) AS a(k, s, r) \
         WHERE i.caller = $1 AND i.key = a.k",
        caller.as_str(),
        &keys as &[&str],
        &statuses,
        &responses as &[&Value],
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Deletes answers older than `ttl`; returns how many.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn prune(db: &Db, ttl: Duration) -> Result<u64, sqlx::Error> {
    let result = sqlx::query!(
        "DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(secs => $1)",
        ttl.as_secs_f64(),
    )
    .execute(db)
    .await?;
    Ok(result.rows_affected())
}

/// Prunes expired keys every ten minutes until `stop`.
pub async fn prune_periodically(db: Db, stop: CancellationToken) {
    loop {
        match prune(&db, KEY_TTL).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(pruned = n, "expired idempotency keys deleted"),
            Err(e) => tracing::warn!(error = %e, "idempotency key pruning failed"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(600)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Commits one transaction that runs `work`; returns its id.
    async fn committed_transaction(db: &Db, work: impl AsyncFnOnce(&mut Tx<'_>)) -> i64 {
        let mut tx = db.begin().await.expect("begin");
        let xid: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&mut tx)
            .await
            .expect("txid_current");
        work(&mut tx).await;
        tx.commit().await.expect("commit");
        xid
    }

    /// After a crash the server may give the id of a keyed request's
    /// transaction, lost before its commit reached the disk, to another
    /// transaction that then commits: the server's "committed" is that
    /// stranger's, and the request must not be told its answer was written.
    #[tokio::test]
    async fn a_committed_id_is_a_keyed_requests_only_when_its_claim_carries_it() {
        use crate::infra::db::{Unwitnessed, transaction_committed};
        let db = crate::infra::db::scratch().await;
        let caller = Owner::key("witnessed");
        let ours = committed_transaction(&db, async |tx| {
            let claimed = claim(tx, &caller, &[("order-1".to_owned(), vec![1])])
                .await
                .expect("claim");
            assert!(matches!(claimed[..], [Claimed::New]));
        })
        .await;
        let stranger = committed_transaction(&db, async |tx| {
            claim(
                tx,
                &Owner::key("stranger"),
                &[("order-1".to_owned(), vec![1])],
            )
            .await
            .expect("the stranger's claim");
        })
        .await;
        let witness = ClaimWitness::new(&caller, vec!["order-1"]);
        assert_eq!(
            transaction_committed(&db, stranger, None, &Unwitnessed).await,
            Some(true),
            "the server's word for the stranger's id"
        );
        assert_eq!(
            transaction_committed(&db, stranger, None, &witness).await,
            Some(false),
            "a stranger's commit under the request's id is not the request's"
        );
        assert_eq!(
            transaction_committed(&db, ours, None, &witness).await,
            Some(true),
            "the request's own commit"
        );
        let keyless = ClaimWitness::new(&caller, Vec::new());
        assert_eq!(
            transaction_committed(&db, stranger, None, &keyless).await,
            Some(true),
            "a request that claimed no key has nothing to look for"
        );
    }

    #[test]
    fn keys_are_printable_ascii_up_to_255() {
        assert!(validate_key("order-42").is_ok());
        assert!(validate_key(&"k".repeat(255)).is_ok());
        assert_eq!(validate_key(""), Err(IdempotencyKeyError::Malformed));
        assert_eq!(
            validate_key(&"k".repeat(256)),
            Err(IdempotencyKeyError::Malformed)
        );
        assert_eq!(
            validate_key("tab\there"),
            Err(IdempotencyKeyError::Malformed)
        );
        assert_eq!(validate_key("ключ"), Err(IdempotencyKeyError::Malformed));
    }

    #[test]
    fn fingerprints_ignore_key_order_but_not_values() {
        let a: Value =
            serde_json::from_str(r#"{"project":"P","type":"T","metadata":{"b":1,"a":2}}"#).unwrap();
        let b: Value =
            serde_json::from_str(r#"{"metadata":{"a":2,"b":1},"type":"T","project":"P"}"#).unwrap();
        let c: Value =
            serde_json::from_str(r#"{"project":"P","type":"T","metadata":{"b":1,"a":3}}"#).unwrap();
        assert_eq!(fingerprint("document", &a), fingerprint("document", &b));
        assert_ne!(fingerprint("document", &a), fingerprint("document", &c));
        assert_ne!(fingerprint("document", &a), fingerprint("ids", &a));
        // RFC 8785 writes a number one way: 1.0, 1 and 1e0 are one value.
        let whole: Value = serde_json::from_str(r#"{"n":1}"#).unwrap();
        let point: Value = serde_json::from_str(r#"{"n":1.0}"#).unwrap();
        let exp: Value = serde_json::from_str(r#"{"n":1e0}"#).unwrap();
        assert_eq!(
            fingerprint("document", &whole),
            fingerprint("document", &point)
        );
        assert_eq!(
            fingerprint("document", &whole),
            fingerprint("document", &exp)
        );
        // Integers a double cannot hold stay apart (they once did not:
        // 2^53 + 1 and 2^53 were one request).
        for (a, b) in [
            ("9007199254740993", "9007199254740992"),
            ("18446744073709551615", "18446744073709551614"),
            ("-9007199254740993", "-9007199254740992"),
        ] {
            let a: Value = serde_json::from_str(&format!(r#"{{"b":[{a}],"a":1}}"#)).unwrap();
            let b: Value = serde_json::from_str(&format!(r#"{{"a":1,"b":[{b}]}}"#)).unwrap();
            assert_ne!(
                fingerprint("document", &a),
                fingerprint("document", &b),
                "{a} {b}"
            );
        }
        let big: Value =
            serde_json::from_str(r#"{"b":9007199254740993,"a":9007199254740995}"#).unwrap();
        let reordered: Value =
            serde_json::from_str(r#"{"a":9007199254740995,"b":9007199254740993}"#).unwrap();
        assert_eq!(
            fingerprint("document", &big),
            fingerprint("document", &reordered)
        );
    }

    #[test]
    fn a_documents_numbers_count_as_written() {
        let document = |metadata: &str| {
            let metadata = with_exact_numbers(metadata).unwrap();
            fingerprint("document", &serde_json::json!({"metadata": metadata}))
        };
        // The same value written another way, keys in another order; a
        // string holding digits, quotes and escapes is left alone.
        assert_eq!(
            document(r#"{"a": 1, "b": [2.50, {"c": 0, "s": "1.0 \" -2"}]}"#),
            document(r#"{"b": [25e-1, {"s": "1.0 \" -2", "c": -0.0}], "a": 1.0}"#)
        );
        assert_ne!(
            document(r#"{"s": "1.0 \" -2"}"#),
            document(r#"{"s": "1 \" -2"}"#)
        );
        // Values a double cannot tell apart.
        for (a, b) in [
            ("1e-400", "0"),
            ("0.30000000000000000001", "0.3"),
            ("9007199254740993.5", "9007199254740993.25"),
        ] {
            assert_ne!(
                document(&format!(r#"{{"n": [{a}]}}"#)),
                document(&format!(r#"{{"n": [{b}]}}"#)),
                "{a} {b}"
            );
        }
        // A number is not the string of its form.
        assert_ne!(document(r#"{"n": 1}"#), document(r#"{"n": "1e0"}"#));
        assert_ne!(
            document(r#"{"a": 1, "b": 2}"#),
            document(r#"{"a": 2, "b": 1}"#)
        );
    }

    #[test]
    fn records_are_keyed_by_the_key_id() {
        assert_eq!(Owner::key("abc").as_str(), "key:abc");
        assert_ne!(Owner::key("abc"), Owner::key("abd"));
    }
}
