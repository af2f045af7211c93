//! `POST /documents`, `POST /api/v1/documents`, `POST /api/v1/documents/batch`,
//! `GET /api/v1/documents/{id}`.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::within_scope;
use super::extract::{Json, Path};
use super::ids::parse_codes;
use super::problem::{ApiError, Problem, db_error, key_reused};
use crate::auth::Caller;
use crate::documents::outbox::{self, DocumentView};
use crate::documents::{AcceptedDocument, DocumentInput, MAX_BATCH, MAX_METADATA_BYTES};
use crate::idempotency::{self, Claimed};

/// Largest single-document body: the metadata limit plus room for the rest.
pub const DOCUMENT_BODY_LIMIT: usize = MAX_METADATA_BYTES + 16 * 1024;
/// Largest batch body.
pub const BATCH_BODY_LIMIT: usize = 32 * 1024 * 1024;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateDocument {
    /// Project code, `[A-Za-z0-9_]{1,32}`.
    #[schema(
        example = "PROJ",
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub project: String,
    /// Document type code, `[A-Za-z0-9_]{1,32}`.
    #[serde(rename = "type")]
    #[schema(
        example = "9012",
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub doc_type: String,
    #[schema(value_type = super::schema::Metadata)]
    pub metadata: Box<RawValue>,
    /// An ID this project got from `POST /ids` and has not attached yet.
    #[schema(min_length = 1, max_length = 64, example = "PROJ-9012-1001")]
    pub id: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchItem {
    /// Project code, `[A-Za-z0-9_]{1,32}`.
    #[schema(
        example = "PROJ",
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub project: String,
    /// Document type code, `[A-Za-z0-9_]{1,32}`.
    #[serde(rename = "type")]
    #[schema(
        example = "9012",
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub doc_type: String,
    #[schema(value_type = super::schema::Metadata)]
    pub metadata: Box<RawValue>,
    /// An ID this project got from `POST /ids` and has not attached yet.
    #[schema(min_length = 1, max_length = 64)]
    pub id: Option<String>,
    /// Makes this item idempotent: sent again, it returns its first result.
    #[schema(
        pattern = r"^[ -~]{1,255}$",
        min_length = 1,
        max_length = 255,
        example = "legacy-42"
    )]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// 1 to 1,000 documents, accepted in one transaction: all or none.
    #[schema(min_items = 1, max_items = 1000)]
    pub documents: Vec<BatchItem>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BatchResult {
    #[serde(flatten)]
    pub document: AcceptedDocument,
    /// The item's idempotency key was used before: this is its first result.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BatchAccepted {
    /// Results in request order.
    pub documents: Vec<BatchResult>,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_document))
        .routes(routes!(create_document_short))
        .layer(DefaultBodyLimit::max(DOCUMENT_BODY_LIMIT))
        .merge(
            OpenApiRouter::new()
                .routes(routes!(create_batch))
                .layer(DefaultBodyLimit::max(BATCH_BODY_LIMIT)),
        )
        .merge(OpenApiRouter::new().routes(routes!(get_document)))
}

fn document_input(
    project: &str,
    doc_type: &str,
    metadata: &RawValue,
    id: Option<&str>,
) -> Result<DocumentInput, ApiError> {
    let (project, doc_type) = parse_codes(project, doc_type)?;
    let raw = metadata.get();
    if !raw.trim_start().starts_with('{') {
        return Err(ApiError::bad_request(
            "invalid_metadata",
            "metadata must be a JSON object",
        ));
    }
    if raw.len() > MAX_METADATA_BYTES {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "metadata_too_large",
            format!(
                "metadata is {} bytes; the limit is {MAX_METADATA_BYTES}",
                raw.len()
            ),
        ));
    }
    if let Some(id) = id
        && !(1..=crate::sequence::MAX_ID_LEN).contains(&id.chars().count())
    {
        return Err(ApiError::bad_request(
            "invalid_id",
            "id must be 1 to 64 characters",
        ));
    }
    Ok(DocumentInput {
        project,
        doc_type,
        metadata: raw.to_owned(),
        id: id.map(str::to_owned),
    })
}

/// The request as fingerprinted for its idempotency key.
fn fingerprint(input: &DocumentInput) -> Result<Vec<u8>, ApiError> {
    let metadata: Value = serde_json::from_str(&input.metadata)
        .map_err(|e| ApiError::bad_request("invalid_metadata", e.to_string()))?;
    let canonical = serde_json::json!({
        "project": input.project.as_str(),
        "type": input.doc_type.as_str(),
        "metadata": metadata,
        "id": input.id,
    });
    Ok(idempotency::fingerprint("document", &canonical))
}

/// `/api/v1/documents/<id>`, the ID percent-encoded as one path segment.
pub fn location(id: &str) -> String {
    let mut path = String::from("/api/v1/documents/");
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            path.push(byte as char);
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
    path
}

fn accepted_response(status: StatusCode, body: Value, replayed: bool) -> Response {
    let location = body["id"].as_str().map(location);
    let mut response = (status, axum::Json(body)).into_response();
    if let Some(location) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    if replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

/// Accept a document and assign its ID.
///
/// The ID and the outbox row are written in one Postgres transaction: a 202
/// means the document will be delivered (or dead-lettered); an error means
/// nothing was written. With `Idempotency-Key`, a retry replays the first
/// answer (`Idempotent-Replayed: true`).
#[utoipa::path(
    post,
    path = "/api/v1/documents",
    tag = "documents",
    operation_id = "create_document",
    request_body = CreateDocument,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 printable ASCII characters; kept 24 h", pattern = r"^[ -~]{1,255}$", min_length = 1, max_length = 255),
    ),
    responses(
        (status = 202, description = "Accepted", body = AcceptedDocument,
         headers(("Location" = String, description = "/api/v1/documents/{id}"),
                 ("Idempotent-Replayed" = String, description = "true when this answers a retry"))),
        (status = 400, description = "Invalid project, type, metadata, id or key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found: the project is not one of the key's", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "body_timeout: the body did not arrive within the request timeout", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "id_not_attachable, sequence_exhausted, idempotency_key_in_use, document_id_taken, format_conflict, sequence_limit_reached or sequence_not_defined (a new sequence), id_too_long", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body or metadata too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "idempotency_key_reused", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Postgres unavailable, the request timed out, or the definition changed meanwhile (retry)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn create_document(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<CreateDocument>,
) -> Result<Response, ApiError> {
    let input = document_input(
        &body.project,
        &body.doc_type,
        &body.metadata,
        body.id.as_deref(),
    )?;
    within_scope(&caller, input.project.as_str())?;
    let key = idempotency::key_from_headers(&headers)?;
    if key.is_none() && input.id.is_none() {
        // The hot path: numbers are popped and recorded inside the shared
        // batch, so a client hanging up cannot leave one half-taken.
        let document = state.documents.accept(Arc::new(input)).await?;
        return Ok(accepted_response(
            StatusCode::ACCEPTED,
            to_value(&document)?,
            false,
        ));
    }
    let caller = idempotency::Caller::key(caller.id());
    // In a task of its own: a client hanging up must not cancel a
    // transaction between taking a number and recording it.
    tokio::spawn(async move {
        let inputs = std::slice::from_ref(&input);
        // Before the transaction: placing may read or create the sequence.
        let placements = state.documents.place_all(inputs).await?;
        match key {
            None => {
                let mut tx = state.db.begin().await.map_err(db_error)?;
                let mut documents = state
                    .documents
                    .accept_in(&mut tx, inputs, &placements)
                    .await?;
                tx.commit().await.map_err(db_error)?;
                let document = documents
                    .pop()
                    .ok_or_else(|| ApiError::internal("no document accepted"))?;
                Ok(accepted_response(
                    StatusCode::ACCEPTED,
                    to_value(&document)?,
                    false,
                ))
            }
            Some(key) => {
                let hash = fingerprint(&input)?;
                let mut tx = state.db.begin().await.map_err(db_error)?;
                idempotency::wait_for_twins_briefly(&mut tx)
                    .await
                    .map_err(db_error)?;
                let claimed = idempotency::claim(&mut tx, &caller, &[(key.clone(), hash)]).await?;
                match claimed.into_iter().next() {
                    Some(Claimed::Replay(stored)) => Ok(accepted_response(
                        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::ACCEPTED),
                        stored.response,
                        true,
                    )),
                    Some(Claimed::Mismatch) => Err(key_reused()),
                    Some(Claimed::New) | None => {
                        let mut documents = state
                            .documents
                            .accept_in(&mut tx, inputs, &placements)
                            .await?;
                        let document = documents
                            .pop()
                            .ok_or_else(|| ApiError::internal("no document accepted"))?;
                        let body = to_value(&document)?;
                        idempotency::store(&mut tx, &caller, &[(key.as_str(), 202, body.clone())])
                            .await
                            .map_err(db_error)?;
                        tx.commit().await.map_err(db_error)?;
                        Ok(accepted_response(StatusCode::ACCEPTED, body, false))
                    }
                }
            }
        }
    })
    .await
    .map_err(ApiError::internal)?
}

/// Accept a document (short path of `POST /api/v1/documents`).
#[utoipa::path(
    post,
    path = "/documents",
    tag = "documents",
    operation_id = "create_document_short",
    request_body = CreateDocument,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 printable ASCII characters; kept 24 h", pattern = r"^[ -~]{1,255}$", min_length = 1, max_length = 255),
    ),
    responses(
        (status = 202, description = "Accepted", body = AcceptedDocument,
         headers(("Location" = String, description = "/api/v1/documents/{id}"),
                 ("Idempotent-Replayed" = String, description = "true when this answers a retry"))),
        (status = 400, description = "Invalid project, type, metadata, id or key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found: the project is not one of the key's", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "body_timeout: the body did not arrive within the request timeout", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "id_not_attachable, sequence_exhausted, idempotency_key_in_use, document_id_taken, format_conflict, sequence_limit_reached or sequence_not_defined (a new sequence), id_too_long", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body or metadata too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "idempotency_key_reused", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Postgres unavailable, the request timed out, or the definition changed meanwhile (retry)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn create_document_short(
    state: State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Json<CreateDocument>,
) -> Result<Response, ApiError> {
    create_document(state, caller, headers, body).await
}

fn to_value(document: &AcceptedDocument) -> Result<Value, ApiError> {
    serde_json::to_value(document).map_err(ApiError::internal)
}

/// Accept up to 1,000 documents in one transaction.
///
/// All are accepted (202, results in request order) or none (4xx naming the
/// first bad item by `index`). Items with an `idempotency_key` used before
/// return their first result, marked `replayed`.
#[utoipa::path(
    post,
    path = "/api/v1/documents/batch",
    tag = "documents",
    request_body = BatchRequest,
    responses(
        (status = 202, description = "All accepted", body = BatchAccepted),
        (status = 400, description = "A bad item (see index) or batch size", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found: the project is not one of the key's", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "body_timeout: the body did not arrive within the request timeout", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "An item's id is not attachable, a sequence is exhausted, a key is in use, or a new sequence cannot be created (format_conflict, sequence_limit_reached, sequence_not_defined)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body or an item's metadata too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "An item's key was used for another document", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Postgres unavailable, the request timed out, or the definition changed meanwhile (retry)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn create_batch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    _turn: BatchTurn,
    Json(body): Json<BatchRequest>,
) -> Result<(StatusCode, axum::Json<BatchAccepted>), ApiError> {
    if headers.contains_key("idempotency-key") {
        return Err(ApiError::bad_request(
            "idempotency_key_unsupported",
            "a batch takes an idempotency_key per item, not the Idempotency-Key header",
        ));
    }
    let count = body.documents.len();
    if !(1..=MAX_BATCH).contains(&count) {
        return Err(ApiError::bad_request(
            "invalid_batch_size",
            format!("a batch holds 1 to {MAX_BATCH} documents, got {count}"),
        ));
    }
    let mut inputs = Vec::with_capacity(count);
    let mut keys: Vec<Option<(String, Vec<u8>)>> = Vec::with_capacity(count);
    for (index, item) in body.documents.iter().enumerate() {
        let input = document_input(
            &item.project,
            &item.doc_type,
            &item.metadata,
            item.id.as_deref(),
        )
        .map_err(|e| e.at_index(index))?;
        within_scope(&caller, input.project.as_str()).map_err(|e| e.at_index(index))?;
        let key = match &item.idempotency_key {
            None => None,
            Some(key) => {
                idempotency::validate_key(key).map_err(|e| ApiError::from(e).at_index(index))?;
                Some((
                    key.clone(),
                    fingerprint(&input).map_err(|e| e.at_index(index))?,
                ))
            }
        };
        inputs.push(input);
        keys.push(key);
    }
    drop(body);
    let caller = idempotency::Caller::key(caller.id());
    tokio::spawn(async move { accept_batch(state, caller, inputs, keys).await })
        .await
        .map_err(ApiError::internal)?
        .map(|documents| {
            (
                StatusCode::ACCEPTED,
                axum::Json(BatchAccepted { documents }),
            )
        })
}

/// A turn to work on a document batch. Taken before the body is read (an
/// extractor ahead of the body), so batches waiting for a turn cost no
/// memory beyond their sockets' buffers.
pub struct BatchTurn(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

impl axum::extract::FromRequestParts<AppState> for BatchTurn {
    type Rejection = ApiError;

    async fn from_request_parts(
        _parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, ApiError> {
        state
            .batch_slots
            .clone()
            .acquire_owned()
            .await
            .map(BatchTurn)
            .map_err(ApiError::internal)
    }
}

/// What becomes of each batch item.
enum Fate {
    Accept,
    Replay(Value),
    /// The same key and document as an earlier item: the same result.
    Mirror(usize),
}

async fn accept_batch(
    state: AppState,
    caller: idempotency::Caller,
    inputs: Vec<DocumentInput>,
    keys: Vec<Option<(String, Vec<u8>)>>,
) -> Result<Vec<BatchResult>, ApiError> {
    let mut fates: Vec<Fate> = Vec::with_capacity(inputs.len());
    let mut first_with_key: std::collections::HashMap<&str, usize> =
        std::collections::HashMap::new();
    let mut to_claim: Vec<(String, Vec<u8>)> = Vec::new();
    let mut claim_owner: Vec<usize> = Vec::new();
    for (index, key) in keys.iter().enumerate() {
        let fate = match key {
            None => Fate::Accept,
            Some((name, hash)) => match first_with_key.get(name.as_str()) {
                Some(&first) if keys[first].as_ref().map(|k| &k.1) == Some(hash) => {
                    Fate::Mirror(first)
                }
                Some(_) => return Err(key_reused().at_index(index)),
                None => {
                    first_with_key.insert(name, index);
                    to_claim.push((name.clone(), hash.clone()));
                    claim_owner.push(index);
                    Fate::Accept
                }
            },
        };
        fates.push(fate);
    }

    let placements = state
        .documents
        .place_all(&inputs)
        .await
        .map_err(ApiError::from)?;
    let mut tx = state.db.begin().await.map_err(db_error)?;
    if !to_claim.is_empty() {
        idempotency::wait_for_twins_briefly(&mut tx)
            .await
            .map_err(db_error)?;
        let claims = idempotency::claim(&mut tx, &caller, &to_claim).await?;
        for (claimed, index) in claims.into_iter().zip(&claim_owner) {
            match claimed {
                Claimed::New => {}
                Claimed::Replay(stored) => fates[*index] = Fate::Replay(stored.response),
                Claimed::Mismatch => return Err(key_reused().at_index(*index)),
            }
        }
    }
    let fresh: Vec<usize> = (0..inputs.len())
        .filter(|i| matches!(fates[*i], Fate::Accept))
        .collect();
    let fresh_inputs: Vec<DocumentInput> = fresh.iter().map(|i| inputs[*i].clone()).collect();
    let accepted = if fresh_inputs.is_empty() {
        Vec::new()
    } else {
        state
            .documents
            .accept_in(&mut tx, &fresh_inputs, &placements)
            .await
            .map_err(|mut e| {
                e.index = e.index.map(|i| fresh[i]);
                ApiError::from(e)
            })?
    };
    let mut results: Vec<Option<(Value, bool)>> = vec![None; inputs.len()];
    for (index, document) in fresh.iter().zip(&accepted) {
        results[*index] = Some((
            serde_json::to_value(document).map_err(ApiError::internal)?,
            false,
        ));
    }
    let answers: Vec<(&str, u16, Value)> = fresh
        .iter()
        .filter_map(|i| {
            let (key, _) = keys[*i].as_ref()?;
            let (body, _) = results[*i].as_ref()?;
            Some((key.as_str(), 202, body.clone()))
        })
        .collect();
    idempotency::store(&mut tx, &caller, &answers)
        .await
        .map_err(db_error)?;
    tx.commit().await.map_err(db_error)?;

    for index in 0..inputs.len() {
        match &fates[index] {
            Fate::Replay(response) => results[index] = Some((response.clone(), true)),
            Fate::Mirror(first) => results[index] = results[*first].clone(),
            Fate::Accept => {}
        }
    }
    results
        .into_iter()
        .map(|result| {
            let (body, replayed) =
                result.ok_or_else(|| ApiError::internal("batch item without a result"))?;
            let document: AcceptedDocument =
                serde_json::from_value(body).map_err(ApiError::internal)?;
            Ok(BatchResult { document, replayed })
        })
        .collect()
}

/// Status of one document.
#[utoipa::path(
    get,
    path = "/api/v1/documents/{id}",
    tag = "documents",
    params(("id" = String, Path, description = "The document ID, e.g. PROJ-9012-1001 (percent-encoded)", min_length = 1, max_length = 64)),
    responses(
        (status = 200, description = "The document and its delivery status", body = DocumentView),
        (status = 404, description = "No such document", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get_document(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<DocumentView>, ApiError> {
    outbox::find(&state.db, &id, caller.projects())
        .await
        .map_err(db_error)?
        .map(axum::Json)
        .ok_or_else(|| ApiError::not_found("document_not_found", format!("no document {id}")))
}

#[cfg(test)]
mod tests {
    use super::location;

    #[test]
    fn locations_encode_the_id_as_one_segment() {
        assert_eq!(
            location("PROJ-9012-1001"),
            "/api/v1/documents/PROJ-9012-1001"
        );
        assert_eq!(location("PROJ/001"), "/api/v1/documents/PROJ%2F001");
        assert_eq!(location("a b?"), "/api/v1/documents/a%20b%3F");
    }
}
