//! API keys in Postgres: created and revoked by the CLI, checked on every
//! protected request against every key of the installation held in memory,
//! so a request costs no query.
//!
//! The keys are loaded when an instance starts and kept: a key in use is
//! never looked up again on a timer. Creations and revocations reach every
//! instance as notifications; an id this instance has not seen (a key
//! created a moment ago, or a made-up one) waits for one shared look for
//! keys created since the last, paced, so however many made-up keys arrive
//! they cost the database a few small queries a second, and a valid key
//! never waits behind them. Revoked keys stay known, as revoked.
//!
//! A key reads `idp_<id>_<secret>`: the id (12 characters, shown in lists and
//! logs) finds the row, the secret (256 random bits, shown once) is compared
//! with the stored SHA-256 in constant time. A hash made for passwords would
//! add nothing: nobody can guess 256 random bits.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::infra::db::Db;
use crate::infra::log_limit::Repeated;
use crate::infra::retrying::Retrying;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use rand::Rng;
use serde::Serialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::sequence::ProjectCode;

/// Postgres channel that tells every instance a key was created
/// (`+<id>`) or revoked (`<id>`).
pub const REVOKED_CHANNEL: &str = "idpool_keys";
const PREFIX: &str = "idp_";
const ID_LEN: usize = 12;
const ID_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// Longest name a key may have (it is shown in lists and logs).
const MAX_NAME_CHARS: usize = 100;

/// `id` as an error may show it: an argument that cannot be a key's id
/// (a whole key pasted by mistake, say) is not repeated, since it may
/// hold a secret.
fn shown_id(id: &str) -> String {
    let id_shaped = id.len() <= PREFIX.len() + ID_LEN
        && id.bytes().all(|b| ID_ALPHABET.contains(&b) || b == b'_');
    match id_shaped {
        true => id.to_owned(),
        false => "(not a key's id, and not repeated: it may be a secret)".to_owned(),
    }
}
/// Base64url of 32 bytes, unpadded.
const SECRET_LEN: usize = 43;
/// Shortest time between two looks for new keys: unknown ids arriving
/// meanwhile share the next one.
const LOOK_GAP: Duration = Duration::from_millis(25);
/// How far back a look for new keys reaches before the last one began (by
/// the database's clock): a key whose insert began earlier but committed
/// later is still found.
const LOOK_OVERLAP_SECONDS: f64 = 60.0;

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

/// `query_as!` of `KeyRow`s: `$before` and `$after` surround the column
/// list, which stays one literal sqlx checks at compile time.
macro_rules! key_rows {
    ($before:tt, $after:tt $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            KeyRow,
            $before + " id, name, admin, projects, created_at, revoked_at, last_used_at, secret_hash "
                + $after
            $(, $arg)*
        )
    };
}

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
    #[error("a key's name is 1 to {MAX_NAME_CHARS} characters, none of them a control character")]
    Name,
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
    /// The key is not known here and the database could not be asked.
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

/// Where the looks for new keys stand.
#[derive(Default)]
struct Looks {
    /// When the last look began (this instance's clock).
    began: Option<Instant>,
    /// Keys created at or after this (the database's clock) are looked for.
    since: Option<DateTime<Utc>>,
}

pub struct KeyStore {
    db: Db,
    /// Every key of the installation, revoked ones included, by id.
    keys: RwLock<HashMap<String, Arc<ApiKey>>>,
    /// One look for new keys at a time; waiters queue here.
    looks: tokio::sync::Mutex<Looks>,
    /// Keys that answered a request since the last flush.
    used: Mutex<HashSet<String>>,
    /// Set when notifications may have been missed: every key is read again.
    reload: tokio::sync::Notify,
    /// The pause before reading every key again after a failed read.
    reload_failures: Mutex<Retrying>,
    failures: crate::infra::log_limit::Repeated,
}

/// A read of every key again that failed (Postgres down): said once, then
/// counted, like every repeated failure.
static USE_NOT_RECORDED: Repeated = Repeated::new("could not record when keys were last used");

impl KeyStore {
    pub fn new(db: Db) -> Self {
        Self {
            db,
            keys: RwLock::new(HashMap::new()),
            looks: tokio::sync::Mutex::new(Looks::default()),
            used: Mutex::new(HashSet::new()),
            reload: tokio::sync::Notify::new(),
            reload_failures: Mutex::new(Retrying::new(
                "could not read the API keys again; retrying",
            )),
            failures: crate::infra::log_limit::Repeated::new(
                "API keys could not be read; unknown keys are answered 503",
            ),
        }
    }

    /// Reads every key (at start, and after notifications may have been
    /// missed). Merges: a key revoked here stays revoked.
    pub async fn load_all(&self) -> Result<(), sqlx::Error> {
        let mut looks = self.looks.lock().await;
        let began = Instant::now();
        let (rows, since) = self.read_keys(None).await?;
        self.merge(rows);
        looks.began = Some(began);
        looks.since = Some(since);
        Ok(())
    }

    /// Keys created at or after `since` (all keys when None), and the
    /// database's time of the read less the overlap: where the next look
    /// starts.
    async fn read_keys(
        &self,
        since: Option<DateTime<Utc>>,
    ) -> Result<(Vec<KeyRow>, DateTime<Utc>), sqlx::Error> {
        let mut conn = self.db.acquire().await?;
        let next = sqlx::query_scalar!(
            r#"SELECT statement_timestamp() - make_interval(secs => $1) AS "next!""#,
            LOOK_OVERLAP_SECONDS,
        )
        .fetch_one(&mut conn)
        .await?;
        let rows = key_rows!(
            "SELECT",
            "FROM api_keys WHERE $1::timestamptz IS NULL OR created_at >= $1",
            since
        )
        .fetch_all(&mut conn)
        .await?;
        Ok((rows, next))
    }

    fn merge(&self, rows: Vec<KeyRow>) {
        let mut keys = self.keys.write().unwrap_or_else(|e| e.into_inner());
        for row in rows {
            let key = ApiKey::from(row);
            let known_revoked = keys.get(&key.id).is_some_and(|k| k.revoked_at.is_some());
            if !known_revoked {
                keys.insert(key.id.clone(), Arc::new(key));
            }
        }
    }

    /// Waits for a look for new keys that began after `arrived`: the one
    /// running (if it began after), or the next, which begins at least
    /// [`LOOK_GAP`] after the last.
    async fn look_for_new_keys(&self, arrived: Instant) -> Result<(), sqlx::Error> {
        let mut looks = self.looks.lock().await;
        if looks.began.is_some_and(|began| began >= arrived) {
            return Ok(());
        }
        if let Some(began) = looks.began {
            tokio::time::sleep_until((began + LOOK_GAP).into()).await;
        }
        let began = Instant::now();
        let since = looks.since;
        let (rows, next) = self.read_keys(since).await?;
        self.merge(rows);
        looks.began = Some(began);
        looks.since = Some(next);
        Ok(())
    }

    fn known(&self, id: &str) -> Option<Arc<ApiKey>> {
        self.keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn create(&self, new: &NewKey) -> Result<Created, KeyError> {
        if let Some(name) = &new.name {
            let chars = name.chars().count();
            if chars == 0 || chars > MAX_NAME_CHARS || name.chars().any(char::is_control) {
                return Err(KeyError::Name);
            }
        }
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
            let created = sqlx::query_scalar!(
                "INSERT INTO api_keys (id, name, secret_hash, admin, projects) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (id) DO NOTHING RETURNING created_at",
                &id,
                new.name.as_deref(),
                hash(&secret),
                new.admin,
                &projects,
            )
            .fetch_optional(&self.db)
            .await?;
            // An id drawn twice (one chance in 4·10^18) draws again.
            if let Some(created_at) = created {
                // Every instance learns of the key before its first use.
                sqlx::query_scalar!(
                    "SELECT pg_notify($1, $2)",
                    REVOKED_CHANNEL,
                    format!("+{id}"),
                )
                .fetch_one(&self.db)
                .await?;
                self.merge(vec![KeyRow {
                    id: id.clone(),
                    name: new.name.clone(),
                    admin: new.admin,
                    projects: projects.clone(),
                    created_at,
                    revoked_at: None,
                    last_used_at: None,
                    secret_hash: hash(&secret),
                }]);
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
        let rows = key_rows!("SELECT", "FROM api_keys ORDER BY created_at, id")
            .fetch_all(&self.db)
            .await?;
        Ok(rows.into_iter().map(ApiKey::from).collect())
    }

    /// Revokes a key; every instance forgets it at once.
    #[tracing::instrument(skip_all, level = "debug")]
    pub async fn revoke(&self, id: &str) -> Result<ApiKey, KeyError> {
        let mut tx = self.db.begin().await?;
        let revoked = key_rows!(
            "UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL RETURNING",
            "",
            id
        )
        .fetch_optional(&mut tx)
        .await?;
        let Some(revoked) = revoked else {
            let exists = sqlx::query_scalar!(
                r#"SELECT EXISTS (SELECT 1 FROM api_keys WHERE id = $1) AS "exists!""#,
                id,
            )
            .fetch_one(&mut tx)
            .await?;
            return Err(if exists {
                KeyError::AlreadyRevoked(id.to_owned())
            } else {
                KeyError::NotFound(shown_id(id))
            });
        };
        sqlx::query_scalar!("SELECT pg_notify($1, $2)", REVOKED_CHANNEL, id)
            .fetch_one(&mut tx)
            .await?;
        tx.commit().await?;
        self.revoked(id);
        Ok(revoked.into())
    }

    /// The key a request presents, if it is one and not revoked.
    pub async fn authenticate(&self, token: &str) -> Result<Arc<ApiKey>, Rejected> {
        let arrived = Instant::now();
        let (id, secret) = parse(token).ok_or(Rejected::Invalid)?;
        let key = match self.known(id) {
            Some(key) => key,
            None => {
                match self.look_for_new_keys(arrived).await {
                    Ok(()) => self.failures.ended(),
                    Err(e) => {
                        self.failures.warn(&e);
                        return Err(Rejected::Db(e));
                    }
                }
                self.known(id).ok_or(Rejected::Invalid)?
            }
        };
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

    /// A key was revoked (here or elsewhere): refused from now on.
    pub fn revoked(&self, id: &str) {
        let mut keys = self.keys.write().unwrap_or_else(|e| e.into_inner());
        if let Some(key) = keys.get_mut(id) {
            let mut revoked = ApiKey::clone(key);
            revoked.revoked_at.get_or_insert_with(Utc::now);
            *key = Arc::new(revoked);
        }
    }

    /// Keys created or revoked while notifications were not heard: every
    /// key is read again by [`KeyStore::maintain`].
    pub fn reload_soon(&self) {
        self.reload.notify_one();
    }

    /// Until `stop`: every 30 s writes which keys were used, and reads
    /// every key again when asked to ([`KeyStore::reload_soon`]).
    pub async fn maintain(&self, stop: &tokio_util::sync::CancellationToken) -> bool {
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(Duration::from_secs(30)) => {
                match self.record_use().await {
                    Ok(()) => USE_NOT_RECORDED.ended(),
                    Err(e) => USE_NOT_RECORDED.warn(&e),
                }
                true
            }
            _ = self.reload.notified() => {
                let reloaded = self.load_all().await;
                let pause = {
                    let mut failures =
                        self.reload_failures.lock().unwrap_or_else(|e| e.into_inner());
                    match reloaded {
                        Ok(()) => {
                            failures.succeeded();
                            None
                        }
                        Err(e) => Some(failures.failed(&e)),
                    }
                };
                if let Some(pause) = pause {
                    // Asked again every second while notifications are
                    // not heard: the pause, not the asking, sets the pace.
                    self.reload_soon();
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
                true
            }
        }
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
        sqlx::query!(
            "UPDATE api_keys SET last_used_at = now() WHERE id = ANY($1)",
            &used,
        )
        .execute(&self.db)
        .await?;
        Ok(())
    }
}

/// Keys revoked by another instance leave this one's cache at once.
impl crate::infra::listen::Subscriber for KeyStore {
    fn channel(&self) -> &'static str {
        REVOKED_CHANNEL
    }

    fn notified(&self, payload: &str) {
        match payload.strip_prefix('+') {
            // Created elsewhere: read now, before its first request.
            Some(_) => self.reload_soon(),
            None => self.revoked(payload),
        }
    }

    fn missed(&self) {
        self.reload_soon();
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
