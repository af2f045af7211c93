//! Delivery endpoints per project: a project's documents go to URLs of
//! its own, each with its own signing secret, retries, failures and log
//! of attempts, instead of the installation's sink. Documents are routed
//! when their outbox rows are written (a trigger, see the migration
//! `0015_endpoints.sql`); the [`dispatcher::Dispatcher`] delivers them.

pub mod deliveries;
pub mod dispatcher;
pub mod store;
pub mod url_guard;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;

use crate::infra::db::Db;
use url_guard::{Refused, UrlPolicy};

/// An endpoint as its project reads it (never its secrets).
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct Endpoint {
    #[schema(example = "ep_5f0c3b8e2a9d41c7b6e1f0a2")]
    pub id: String,
    pub project: String,
    pub url: String,
    pub description: String,
    /// The document types delivered to it; null: every type.
    pub types: Option<Vec<String>>,
    pub disabled: bool,
    /// Why it is disabled: `manual` (asked for) or `failing` (every
    /// attempt failed for `IDPOOL_ENDPOINT_DISABLE_AFTER_S`).
    pub disabled_reason: Option<String>,
    /// Since when every attempt has failed; null after a success.
    pub failing_since: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A new endpoint, with its secret (shown only here and at rotation).
#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedEndpoint {
    #[serde(flatten)]
    pub endpoint: Endpoint,
    /// The Standard Webhooks signing secret, `whsec_<base64>`.
    pub secret: String,
}

/// `POST /api/v1/endpoints`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEndpoint {
    #[schema(pattern = r"^[A-Za-z0-9_]{1,32}$")]
    pub project: String,
    /// `https://` or `http://`; a public address unless the installation
    /// allows private ones.
    #[schema(max_length = 2048, pattern = "^[Hh][Tt][Tt][Pp][Ss]?://")]
    pub url: String,
    #[schema(max_length = 500)]
    pub description: Option<String>,
    /// Document types to deliver (every type when left out).
    #[schema(min_items = 1, max_items = 100)]
    pub types: Option<Vec<String>>,
    pub disabled: Option<bool>,
}

/// `PATCH /api/v1/endpoints/{id}`: what is given changes.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointPatch {
    #[schema(max_length = 2048, pattern = "^[Hh][Tt][Tt][Pp][Ss]?://")]
    pub url: Option<String>,
    #[schema(max_length = 500)]
    pub description: Option<String>,
    /// A list of types, or null for every type.
    #[serde(default, deserialize_with = "given")]
    #[schema(value_type = Option<Vec<String>>, min_items = 1, max_items = 100)]
    pub types: Option<Option<Vec<String>>>,
    /// false enables it again (and forgets its failures).
    pub disabled: Option<bool>,
}

/// A field that is present, null or not: `Some(None)` for null.
fn given<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// `POST /api/v1/endpoints/{id}/rotate-secret`.
#[derive(Debug, Serialize, ToSchema)]
pub struct RotatedSecret {
    pub secret: String,
    /// Until then the previous secret signs too.
    pub previous_expires_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("no endpoint {0}")]
    NotFound(String),
    #[error("the project has {0} endpoints, the most allowed (IDPOOL_MAX_ENDPOINTS_PER_PROJECT)")]
    LimitReached(i64),
    #[error("{0}")]
    InvalidUrl(#[from] Refused),
    #[error("{0}")]
    Invalid(String),
    #[error(
        "the secret rotated out last still signs until {}, as its rotation promised; rotate again after that",
        .0.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )]
    RotationPending(chrono::DateTime<chrono::Utc>),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Longest description kept.
pub const MAX_DESCRIPTION: usize = 500;
/// Most types one endpoint may name.
pub const MAX_TYPES: usize = 100;

#[derive(Debug, Clone)]
pub struct EndpointSettings {
    /// `IDPOOL_MAX_ENDPOINTS_PER_PROJECT`.
    pub max_per_project: i64,
    /// `IDPOOL_SECRET_OVERLAP_S`: how long a rotated secret still signs.
    pub secret_overlap: Duration,
    /// `IDPOOL_ENDPOINTS_ALLOW_PRIVATE`.
    pub policy: UrlPolicy,
}

impl Default for EndpointSettings {
    fn default() -> Self {
        Self {
            max_per_project: 20,
            secret_overlap: Duration::from_secs(86_400),
            policy: UrlPolicy {
                allow_private: false,
            },
        }
    }
}

/// Endpoint management, as the routes ask for it.
#[derive(Debug, Clone)]
pub struct Endpoints {
    db: Db,
    settings: EndpointSettings,
}

impl Endpoints {
    pub fn new(db: Db, settings: EndpointSettings) -> Self {
        Self { db, settings }
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    /// A URL as saved: parsed, and its addresses checked (a name resolved).
    /// Called before a database turn is taken: resolving may take seconds.
    pub async fn checked_url(&self, raw: &str) -> Result<url::Url, EndpointError> {
        let url = url_guard::parse(raw, self.settings.policy)?;
        url_guard::check_resolved(&url, self.settings.policy).await?;
        Ok(url)
    }

    /// Saves a new endpoint with `url` from [`Endpoints::checked_url`].
    pub async fn create(
        &self,
        new: &NewEndpoint,
        url: &url::Url,
    ) -> Result<CreatedEndpoint, EndpointError> {
        let description = checked_description(new.description.as_deref())?;
        let types = checked_types(new.types.as_deref())?;
        let id = format!("ep_{}", random_hex::<12>());
        let secret = new_secret();
        let endpoint = store::insert(
            &self.db,
            &store::NewRow {
                id: &id,
                project: &new.project,
                url: url.as_str(),
                description,
                types,
                disabled: new.disabled.unwrap_or(false),
                secret: &secret,
            },
            self.settings.max_per_project,
        )
        .await?;
        Ok(CreatedEndpoint { endpoint, secret })
    }

    /// Applies a change whose URL (if any) came from
    /// [`Endpoints::checked_url`].
    pub async fn update(
        &self,
        id: &str,
        projects: Option<&[String]>,
        patch: EndpointPatch,
    ) -> Result<Endpoint, EndpointError> {
        checked_description(patch.description.as_deref())?;
        if let Some(Some(types)) = &patch.types {
            checked_types(Some(types))?;
        }
        store::update(&self.db, id, projects, &patch)
            .await?
            .ok_or_else(|| EndpointError::NotFound(id.to_owned()))
    }

    pub async fn rotate_secret(
        &self,
        id: &str,
        projects: Option<&[String]>,
    ) -> Result<RotatedSecret, EndpointError> {
        let secret = new_secret();
        let rotation = store::rotate_secret(
            &self.db,
            id,
            projects,
            &secret,
            self.settings.secret_overlap,
        )
        .await?;
        let previous_expires_at = match rotation {
            store::Rotation::Rotated(until) => until,
            store::Rotation::Pending(until) => return Err(EndpointError::RotationPending(until)),
            store::Rotation::NotFound => return Err(EndpointError::NotFound(id.to_owned())),
        };
        Ok(RotatedSecret {
            secret,
            previous_expires_at,
        })
    }
}

fn checked_description(description: Option<&str>) -> Result<&str, EndpointError> {
    let description = description.unwrap_or("");
    if description.chars().count() > MAX_DESCRIPTION {
        return Err(EndpointError::Invalid(format!(
            "description: at most {MAX_DESCRIPTION} characters"
        )));
    }
    Ok(description)
}

fn checked_types(types: Option<&[String]>) -> Result<Option<&[String]>, EndpointError> {
    let Some(types) = types else { return Ok(None) };
    if types.is_empty() || types.len() > MAX_TYPES {
        return Err(EndpointError::Invalid(format!(
            "types: 1 to {MAX_TYPES} document types, or leave it out for every type"
        )));
    }
    for (i, doc_type) in types.iter().enumerate() {
        crate::domain::sequence::TypeCode::parse(doc_type)
            .map_err(|e| EndpointError::Invalid(format!("types: {e}")))?;
        if types[..i].contains(doc_type) {
            return Err(EndpointError::Invalid(format!(
                "types: {doc_type} is named twice"
            )));
        }
    }
    Ok(Some(types))
}

/// A Standard Webhooks secret: `whsec_` and 32 random bytes in base64.
pub fn new_secret() -> String {
    use base64::Engine as _;
    let bytes: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn random_hex<const N: usize>() -> String {
    let bytes: [u8; N] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
