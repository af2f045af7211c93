//! API keys in Postgres: created and revoked by the CLI, checked on every
//! protected request through a cache, so a request costs no query.
//!
//! A key reads `idp_<id>_<secret>`: the id (12 characters, shown in lists and
//! logs) finds the row, the secret (256 random bits, shown once) is compared
//! with the stored SHA-256 in constant time. A hash made for passwords would
//! add nothing: nobody can guess 256 random bits.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use chrono::{DateTime, Utc};
use rand::Rng;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use subtle::ConstantTimeEq;

use crate::sequence::ProjectCode;

/// Postgres channel that tells every instance a key was revoked.
pub const REVOKED_CHANNEL: &str = "idpool_keys";
const PREFIX: &str = "idp_";
const ID_LEN: usize = 12;
const ID_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// Base64url of 32 bytes, unpadded.
const SECRET_LEN: usize = 43;
/// How long a key read from Postgres is trusted without a revocation notice.
const KEY_TTL: Duration = Duration::from_secs(60);
/// How long an id that names no key is remembered as such.
const UNKNOWN_TTL: Duration = Duration::from_secs(10);
/// Most ids one instance remembers.
const MAX_CACHED: usize = 100_000;
/// Lookups of ids not in the cache, per second (burst twice that): a
/// flood of made-up keys cannot take the database from everyone else.
const LOOKUPS_PER_SECOND: u32 = 200;

#[derive(Debug, Clone, Serialize)]
pub struct ApiKey {
    pub id: String,
    pub name: Option<String>,
    /// Every project, when true.
    pub admin: bool,
    pub projects: Vec<String>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
    #[serde(skip)]
    secret_hash: Vec<u8>,
}

impl ApiKey {
    pub fn may_use(&self, project: &str) -> bool {
        self.admin || self.projects.iter().any(|p| p == project)
    }
}

#[derive(sqlx::FromRow)]
struct KeyRow {
    id: String,
    name: Option<String>,
    admin: bool,
    projects: Vec<String>,
    created_at: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
    last_used_at: Option<DateTime<Utc>>,
    secret_hash: Vec<u8>,
}

impl From<KeyRow> for ApiKey {
    fn from(row: KeyRow) -> Self {
        Self {
            id: row.id,
            name: row.name,
            admin: row.admin,
            projects: row.projects,
            created_at: row.created_at,
            revoked_at: row.revoked_at,
            last_used_at: row.last_used_at,
            secret_hash: row.secret_hash,
        }
    }
}

const COLUMNS: &str =
    "id, name, admin, projects, created_at, revoked_at, last_used_at, secret_hash";

/// What `idpool keys create` asks for.
pub struct NewKey {
    pub name: Option<String>,
    pub admin: bool,
    pub projects: Vec<ProjectCode>,
}

/// A key just created, with its secret: shown once.
#[derive(Debug, Serialize)]
pub struct Created {
    pub id: String,
    pub key: String,
    pub name: Option<String>,
    pub projects: Vec<String>,
    pub admin: bool,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("a key is either --admin or scoped to at least one --project")]
    NoScope,
    #[error("an admin key reaches every project; leave out --project")]
    AdminWithProjects,
    #[error("no key {0}")]
    NotFound(String),
    #[error("key {0} was revoked already")]
    AlreadyRevoked(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Why a request's key was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum Rejected {
    #[error("the API key is not valid or was revoked")]
    Invalid,
    #[error("too many unknown API keys at once; retry shortly")]
    Busy,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

fn hash(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// `(id, secret)` of a well-formed key.
fn parse(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix(PREFIX)?;
    let (id, secret) = rest.split_at_checked(ID_LEN)?;
    let secret = secret.strip_prefix('_')?;
    let id_ok = id.bytes().all(|b| ID_ALPHABET.contains(&b));
    let secret_ok = secret.len() == SECRET_LEN
        && secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    (id_ok && secret_ok).then_some((id, secret))
}

type Cached = (Option<Arc<ApiKey>>, Instant);
type Limiter = governor::DefaultDirectRateLimiter;

pub struct KeyStore {
    db: PgPool,
    cache: RwLock<HashMap<String, Cached>>,
    /// Keys that answered a request since the last flush.
    used: Mutex<HashSet<String>>,
    lookups: Limiter,
}

impl KeyStore {
    pub fn new(db: PgPool) -> Self {
        let per_second =
            std::num::NonZeroU32::new(LOOKUPS_PER_SECOND).unwrap_or(std::num::NonZeroU32::MIN);
        let burst = std::num::NonZeroU32::new(LOOKUPS_PER_SECOND * 2).unwrap_or(per_second);
        Self {
            db,
            cache: RwLock::new(HashMap::new()),
            used: Mutex::new(HashSet::new()),
            lookups: governor::RateLimiter::direct(
                governor::Quota::per_second(per_second).allow_burst(burst),
            ),
        }
    }

    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn create(&self, new: &NewKey) -> Result<Created, KeyError> {
        match (new.admin, new.projects.is_empty()) {
            (false, true) => return Err(KeyError::NoScope),
            (true, false) => return Err(KeyError::AdminWithProjects),
            _ => {}
        }
        let mut projects: Vec<String> = new.projects.iter().map(ToString::to_string).collect();
        projects.sort();
        projects.dedup();
        loop {
            let (id, secret) = {
                let mut rng = rand::rng();
                let id: String = (0..ID_LEN)
                    .map(|_| char::from(ID_ALPHABET[rng.random_range(0..ID_ALPHABET.len())]))
                    .collect();
                let bytes: [u8; 32] = rng.random();
                (
                    id,
                    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes),
                )
            };
            let created: Option<DateTime<Utc>> = sqlx::query_scalar(
                "INSERT INTO api_keys (id, name, secret_hash, admin, projects) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (id) DO NOTHING RETURNING created_at",
            )
            .bind(&id)
            .bind(&new.name)
            .bind(hash(&secret))
            .bind(new.admin)
            .bind(&projects)
            .fetch_optional(&self.db)
            .await?;
            // An id drawn twice (one chance in 4·10^18) draws again.
            if let Some(created_at) = created {
                return Ok(Created {
                    key: format!("{PREFIX}{id}_{secret}"),
                    id,
                    name: new.name.clone(),
                    projects,
                    admin: new.admin,
                    created_at,
                });
            }
        }
    }

    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn list(&self) -> Result<Vec<ApiKey>, KeyError> {
        let sql = format!("SELECT {COLUMNS} FROM api_keys ORDER BY created_at, id");
        let rows: Vec<KeyRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.db)
            .await?;
        Ok(rows.into_iter().map(ApiKey::from).collect())
    }

    /// Revokes a key; every instance forgets it at once.
    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn revoke(&self, id: &str) -> Result<ApiKey, KeyError> {
        let mut tx = self.db.begin().await?;
        let sql = format!(
            "UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL RETURNING {COLUMNS}"
        );
        let revoked: Option<KeyRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(revoked) = revoked else {
            let exists: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM api_keys WHERE id = $1)")
                    .bind(id)
                    .fetch_one(&mut *tx)
                    .await?;
            return Err(if exists {
                KeyError::AlreadyRevoked(id.to_owned())
            } else {
                KeyError::NotFound(id.to_owned())
            });
        };
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(REVOKED_CHANNEL)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.forget(id);
        Ok(revoked.into())
    }

    /// The key a request presents, if it is one and not revoked.
    pub async fn authenticate(&self, token: &str) -> Result<Arc<ApiKey>, Rejected> {
        let (id, secret) = parse(token).ok_or(Rejected::Invalid)?;
        let key = match self.cached(id) {
            Some(known) => known,
            None => {
                if self.lookups.check().is_err() {
                    return Err(Rejected::Busy);
                }
                let sql = format!("SELECT {COLUMNS} FROM api_keys WHERE id = $1");
                let row: Option<KeyRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .bind(id)
                    .fetch_optional(&self.db)
                    .await?;
                let key = row.map(|r| Arc::new(ApiKey::from(r)));
                self.remember(id, key.clone());
                key
            }
        };
        let key = key.ok_or(Rejected::Invalid)?;
        let matches: bool = hash(secret).ct_eq(&key.secret_hash).into();
        if !matches || key.revoked_at.is_some() {
            return Err(Rejected::Invalid);
        }
        self.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.id.clone());
        Ok(key)
    }

    fn cached(&self, id: &str) -> Option<Option<Arc<ApiKey>>> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        let (key, loaded) = cache.get(id)?;
        let ttl = if key.is_some() { KEY_TTL } else { UNKNOWN_TTL };
        (loaded.elapsed() < ttl).then(|| key.clone())
    }

    fn remember(&self, id: &str, key: Option<Arc<ApiKey>>) {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED {
            cache.retain(|_, (key, loaded)| key.is_some() && loaded.elapsed() < KEY_TTL);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(id.to_owned(), (key, Instant::now()));
    }

    /// Drops a key from the cache (it was revoked, here or elsewhere).
    pub fn forget(&self, id: &str) {
        self.cache
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    pub fn forget_all(&self) {
        self.cache
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Writes when the keys used since the last call were last used.
    pub async fn record_use(&self) -> Result<(), sqlx::Error> {
        let used: Vec<String> = {
            let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
            used.drain().collect()
        };
        if used.is_empty() {
            return Ok(());
        }
        sqlx::query("UPDATE api_keys SET last_used_at = now() WHERE id = ANY($1)")
            .bind(&used)
            .execute(&self.db)
            .await?;
        Ok(())
    }
}

/// Keys revoked by another instance leave this one's cache at once.
impl crate::listen::Subscriber for KeyStore {
    fn channel(&self) -> &'static str {
        REVOKED_CHANNEL
    }

    fn notified(&self, payload: &str) {
        self.forget(payload);
    }

    fn missed(&self) {
        self.forget_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_keys_are_looked_up() {
        let secret = "a".repeat(SECRET_LEN);
        let token = format!("idp_abcdefgh1234_{secret}");
        assert_eq!(parse(&token), Some(("abcdefgh1234", secret.as_str())));
        assert_eq!(parse(&format!("idp_ABCDEFGH1234_{secret}")), None);
        assert_eq!(parse(&format!("idp_abcdefgh123_{secret}")), None);
        assert_eq!(parse(&format!("idp_abcdefgh1234_{secret}x")), None);
        assert_eq!(parse(&format!("idp_abcdefgh1234-{secret}")), None);
        assert_eq!(parse("idp_"), None);
        assert_eq!(parse("Bearer x"), None);
        assert_eq!(parse("idp_ééééééééééé_"), None);
    }
}
