//! `POST /api/v1/ids/void`: a reserved ID of a gapless sequence voided with
//! the caller's reason.

use axum::extract::State;
use axum::response::Response;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::within_scope;
use super::extract::Json;
use super::idempotent::{self, Answer, IdempotencyKey, Keyed};
use super::ids::parse_codes;
use super::problem::{ApiError, Problem};
use super::responses::{JsonBodyProblems, KeyReused};
use crate::domain::sequence::MAX_ID_LEN;
use crate::issuance::reservations::{VoidError, Voided};
use crate::records::auth::Caller;
use crate::records::idempotency;

/// Longest reason of a void, in characters (SPEC).
const MAX_REASON_CHARS: usize = 200;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VoidRequest {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    /// An ID `POST /ids` reserved on this gapless sequence.
    #[schema(
        example = "INV-2026-0042",
        min_length = 1,
        max_length = 64,
        pattern = r"^[^\u0000-\u001f\u007f-\u009f]*$"
    )]
    pub id: String,
    /// Why the number is not used: 1 to 200 visible characters (not only
    /// spaces; no control characters, no invisible formatting such as
    /// zero-width spaces or direction overrides), kept for the auditor and
    /// shown as the gap's `note`.
    #[schema(
        example = "customer cancelled the order",
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\u0000-\u001f\u007f-\u009f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u115f-\u1160\u17b4-\u17b5\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb]*[^\s\u0000-\u001f\u007f-\u009f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u115f-\u1160\u17b4-\u17b5\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb][^\u0000-\u001f\u007f-\u009f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u115f-\u1160\u17b4-\u17b5\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb]*$"
    )]
    pub reason: String,
}

/// Always `voided`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum VoidStatus {
    Voided,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct VoidedId {
    #[schema(example = "INV-2026-0042")]
    pub id: String,
    pub status: VoidStatus,
    /// The caller's reason, or `reservation_expired` when the deadline had
    /// passed.
    #[schema(example = "customer cancelled the order")]
    pub reason: String,
    pub voided_at: DateTime<Utc>,
}

impl From<Voided> for VoidedId {
    fn from(v: Voided) -> Self {
        Self {
            id: v.id,
            status: VoidStatus::Voided,
            reason: v.reason,
            voided_at: v.voided_at,
        }
    }
}

impl From<VoidError> for ApiError {
    fn from(e: VoidError) -> Self {
        match e {
            VoidError::NotFound { .. } => Self::not_found("id_not_found", e.to_string()),
            VoidError::Attached(_) => Self::conflict("id_attached", e.to_string()),
            VoidError::Store(e) => e.into(),
            VoidError::Db(e) => super::problem::db_error(e),
        }
    }
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(void_id))
}

fn printable(text: &str) -> bool {
    !text.chars().any(char::is_control)
}

/// A reason an auditor can read: printable, nothing invisible, not only
/// spaces.
fn readable(text: &str) -> bool {
    printable(text) && !text.chars().any(crate::domain::text::invisible) && !text.trim().is_empty()
}

fn check_id_and_reason(body: &VoidRequest) -> Result<(), ApiError> {
    let id_chars = body.id.chars().count();
    if !(1..=MAX_ID_LEN).contains(&id_chars) || !printable(&body.id) {
        return Err(ApiError::bad_request(
            "invalid_id",
            format!("id must be 1 to {MAX_ID_LEN} printable characters"),
        ));
    }
    let reason_chars = body.reason.chars().count();
    if !(1..=MAX_REASON_CHARS).contains(&reason_chars) || !readable(&body.reason) {
        return Err(ApiError::bad_request(
            "invalid_reason",
            format!(
                "reason must be 1 to {MAX_REASON_CHARS} visible characters, not only spaces, \
                 without control characters or invisible formatting"
            ),
        ));
    }
    Ok(())
}

/// Void a reserved ID.
///
/// A number `POST /ids` reserved on a gapless sequence that will carry no
/// document: it becomes a gap with reason `voided` and the caller's text
/// as its note. Voiding it again answers the first void; a reservation
/// whose deadline passed is voided as `reservation_expired`.
#[utoipa::path(
    post,
    path = "/api/v1/ids/void",
    tag = "ids",
    operation_id = "void_id",
    request_body = VoidRequest,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 printable ASCII characters; a retry with it gets the same answer (kept 24 h)", pattern = r"^[ -~]{1,255}$", min_length = 1, max_length = 255),
    ),
    responses(
        (status = 200, description = "The ID is voided", body = VoidedId,
         headers(("Idempotent-Replayed" = String, description = "true when this answers a retry"))),
        (status = 400, description = "Invalid project, type, id, reason or body", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found (not one of the key's) or id_not_found (no reservation of a gapless sequence prints it)", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "id_attached (it carries a document), idempotency_key_in_use", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
        KeyReused,
        (status = 503, description = "Postgres unavailable or the request timed out (retry)", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn void_id(
    State(state): State<AppState>,
    caller: Caller,
    IdempotencyKey(key): IdempotencyKey,
    Json(body): Json<VoidRequest>,
) -> Result<Response, ApiError> {
    let (project, doc_type) = parse_codes(&body.project, &body.doc_type)?;
    check_id_and_reason(&body)?;
    within_scope(&caller, project.as_str())?;
    let keyed = key.map(|key| Keyed {
        key,
        fingerprint: idempotency::fingerprint(
            "void",
            &serde_json::json!({
                "project": project.as_str(),
                "type": doc_type.as_str(),
                "id": body.id,
                "reason": body.reason,
            }),
        ),
    });
    // Before the transaction: reading the definition may need a
    // connection of its own.
    let target = state
        .issuer
        .reservations()
        .void_target(&project, &doc_type, &body.id)
        .await?;
    // The transaction holds a connection: a database turn first, and
    // detached, so a client hanging up cannot cut it short.
    let db_turn = state.db_turn(&caller).await;
    let caller = idempotency::Owner::key(caller.id());
    let issuer = state.issuer.clone();
    issuer
        .detached(async move {
            let issuer = state.issuer.clone();
            let answers = idempotent::run(&state, &caller, &[keyed], 200, false, async |tx, _| {
                let voided = (issuer.reservations())
                    .void_in(tx, &target, &body.reason)
                    .await?;
                let body =
                    serde_json::to_value(VoidedId::from(voided)).map_err(ApiError::internal)?;
                Ok(vec![Answer {
                    body,
                    replayed: false,
                }])
            })
            .await;
            drop(db_turn);
            idempotent::only_answer(answers?)
        })
        .await
        .map_err(ApiError::internal)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reason's pattern as the OpenAPI document publishes it.
    fn published_pattern() -> String {
        let document = serde_json::to_value(super::super::openapi()).expect("openapi as JSON");
        document["components"]["schemas"]["VoidRequest"]["properties"]["reason"]["pattern"]
            .as_str()
            .expect("a reason pattern")
            .to_owned()
    }

    /// Generation needs the pattern without its anchors (it makes whole
    /// strings anyway).
    fn unanchored(pattern: &str) -> &str {
        pattern
            .strip_prefix('^')
            .and_then(|p| p.strip_suffix('$'))
            .expect("an anchored pattern")
    }

    proptest! {
        /// What a client generated from the schema sends is accepted.
        #[test]
        fn every_reason_the_schema_allows_is_readable(
            reason in proptest::string::string_regex(unanchored(&published_pattern())).expect("pattern")
        ) {
            prop_assume!((1..=MAX_REASON_CHARS).contains(&reason.chars().count()));
            prop_assert!(readable(&reason), "{reason:?}");
        }
    }

    #[test]
    fn reasons_an_auditor_could_not_read_are_refused() {
        for reason in [
            " ",
            "\u{3000}",
            "\u{200B}",
            "a\u{202E}b",
            "a\u{00AD}b",
            "\u{FEFF}x",
            "a\u{2066}b",
            "\u{2800}",
            "\u{3164}",
            "\u{115F}",
            "\u{034F}",
            "\u{17B4}",
            "\u{FE0F}",
            "\u{0600}",
        ] {
            assert!(!readable(reason), "{reason:?}");
        }
        for reason in ["order cancelled", "Kunde storniert ü", "取消", "a b"] {
            assert!(readable(reason), "{reason:?}");
        }
    }
}
