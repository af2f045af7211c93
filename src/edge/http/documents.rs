//! `POST /documents`, `POST /api/v1/documents`, `POST /api/v1/documents/batch`,
//! `GET /api/v1/documents/{id}`.

use std::sync::Arc;

use crate::domain::verifactu::Invoice;
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
use super::idempotent::{self, Answer, IdempotencyKey, Keyed};
use super::ids::parse_codes;
use super::problem::{ApiError, Problem, db_error};
use super::responses::{
    IssuingUnavailable, JsonBodyProblems, KeyReused, NoSuchDocument, ProjectNotFound,
};
use crate::features::documents::delivery_queue::{self, DocumentView};
use crate::features::documents::{
    Accepted, DocumentInput, MAX_BATCH, MAX_METADATA_BYTES, MAX_METADATA_DEPTH, NumbersRefused,
    Placements, nesting_depth, unstorable_numbers,
};
use crate::records::auth::Caller;
use crate::records::idempotency;
use crate::records::ledger::outbox_rows::DocumentStatus;
use chrono::{DateTime, Utc};

/// Largest single-document body: the metadata limit plus room for the rest.
pub const DOCUMENT_BODY_LIMIT: usize = MAX_METADATA_BYTES + 16 * 1024;
/// Largest batch body.
pub const BATCH_BODY_LIMIT: usize = 32 * 1024 * 1024;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateDocument {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    #[schema(value_type = super::schema::Metadata)]
    pub metadata: Box<RawValue>,
    /// An ID this project got from `POST /ids` and has not attached yet.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = r"^[^\u0000]*$",
        example = "PROJ-9012-1001"
    )]
    pub id: Option<String>,
    /// The invoice fields, for a VERI*FACTU register's documents (and only
    /// for them): strings, kept exactly as sent.
    pub invoice: Option<Invoice>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchItem {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    #[schema(value_type = super::schema::Metadata)]
    pub metadata: Box<RawValue>,
    /// An ID this project got from `POST /ids` and has not attached yet.
    #[schema(min_length = 1, max_length = 64, pattern = r"^[^\u0000]*$")]
    pub id: Option<String>,
    /// The invoice fields, for a VERI*FACTU register's documents.
    pub invoice: Option<Invoice>,
    /// Makes this item idempotent: sent again, it returns its first result.
    #[schema(
        pattern = r"^[ -~]{1,255}$",
        min_length = 1,
        max_length = 255,
        example = "legacy-42"
    )]
    pub idempotency_key: Option<String>,
    /// The document's id in the system it comes from: one document per
    /// source id of a project and type, for ever. An item whose source id
    /// has a document already is answered with that document, marked
    /// `replayed`, whoever sent it and whenever.
    #[schema(
        pattern = r"^[^\u0000-\u001f\u007f-\u009f]{1,255}$",
        min_length = 1,
        max_length = 255,
        example = "legacy-42"
    )]
    pub source_id: Option<String>,
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
        // Its short path: the same handler, documented by `super::short_paths`.
        .route("/documents", axum::routing::post(create_document))
        .layer(DefaultBodyLimit::max(DOCUMENT_BODY_LIMIT))
        .layer(axum::Extension(super::extract::BodyLimit(
            DOCUMENT_BODY_LIMIT,
        )))
        .merge(
            OpenApiRouter::new()
                .routes(routes!(create_batch))
                .layer(DefaultBodyLimit::max(BATCH_BODY_LIMIT))
                .layer(axum::Extension(super::extract::BodyLimit(BATCH_BODY_LIMIT))),
        )
        .merge(OpenApiRouter::new().routes(routes!(get_document)))
}

fn document_input(
    project: &str,
    doc_type: &str,
    metadata: &RawValue,
    id: Option<&str>,
    invoice: Option<&Invoice>,
) -> Result<DocumentInput, ApiError> {
    let (project, doc_type) = parse_codes(project, doc_type)?;
    if let Some(invoice) = invoice {
        invoice
            .check()
            .map_err(|e| ApiError::bad_request("invalid_invoice", e.to_string()))?;
    }
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
    if nesting_depth(raw) > MAX_METADATA_DEPTH {
        return Err(ApiError::bad_request(
            "invalid_metadata",
            format!("metadata nests arrays and objects deeper than {MAX_METADATA_DEPTH} levels"),
        ));
    }
    match unstorable_numbers(raw) {
        None => {}
        Some(NumbersRefused::Unstorable(number)) => {
            return Err(ApiError::bad_request(
                "unstorable_value",
                format!(
                    "metadata holds the number {number}, which has more digits than the database \
                     stores (131,072 before the point, 16,383 after)"
                ),
            ));
        }
        Some(NumbersRefused::TooLargePrinted(printed)) => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "metadata_too_large",
                format!(
                    "metadata is {printed} bytes with its numbers written out in full, as it is \
                     stored and delivered; the limit is {MAX_METADATA_BYTES}"
                ),
            ));
        }
    }
    if let Some(id) = id
        && !(1..=crate::domain::sequence::MAX_ID_LEN).contains(&id.chars().count())
    {
        return Err(ApiError::bad_request(
            "invalid_id",
            "id must be 1 to 64 characters",
        ));
    }
    Ok(DocumentInput {
        project,
        doc_type,
        metadata: Arc::from(raw),
        id: id.map(str::to_owned),
        source_id: None,
        invoice: invoice.map(|i| Arc::new(i.clone())),
    })
}

/// The request as fingerprinted for its idempotency key.
fn fingerprint(input: &DocumentInput) -> Result<Vec<u8>, ApiError> {
    let metadata = idempotency::with_exact_numbers(&input.metadata)
        .map_err(|e| ApiError::bad_request("invalid_metadata", e.to_string()))?;
    let mut canonical = serde_json::json!({
        "project": input.project.as_str(),
        "type": input.doc_type.as_str(),
        "metadata": metadata,
        "id": input.id,
    });
    // A batch item's source id is part of what it asks (another one is
    // another document); only when sent, so other requests keep the
    // fingerprints stored before.
    if let Some(source_id) = &input.source_id {
        canonical["source_id"] = serde_json::Value::from(source_id.as_ref());
    }
    if let Some(invoice) = &input.invoice {
        canonical["invoice"] =
            serde_json::to_value(invoice.as_ref()).map_err(ApiError::internal)?;
    }
    Ok(idempotency::fingerprint("document", &canonical))
}

/// Everything but RFC 3986's unreserved characters.
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// `/api/v1/documents/<id>`, the ID percent-encoded as one path segment.
pub fn location(id: &str) -> String {
    format!(
        "/api/v1/documents/{}",
        percent_encoding::utf8_percent_encode(id, PATH_SEGMENT)
    )
}

fn accepted_response(status: StatusCode, body: Value, replayed: bool) -> Response {
    let location = body["id"].as_str().map(location);
    let mut response = (status, axum::Json(body)).into_response();
    if let Some(location) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    super::idempotent::mark_replayed(&mut response, replayed);
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
        ProjectNotFound,
        (status = 409, description = "id_not_attachable, sequence_exhausted, idempotency_key_in_use, document_id_taken, format_conflict, sequence_limit_reached or sequence_not_defined (a new sequence), id_too_long", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body or metadata too large", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
        KeyReused,
        IssuingUnavailable,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn create_document(
    State(state): State<AppState>,
    caller: Caller,
    IdempotencyKey(key): IdempotencyKey,
    Json(body): Json<CreateDocument>,
) -> Result<Response, ApiError> {
    let input = document_input(
        &body.project,
        &body.doc_type,
        &body.metadata,
        body.id.as_deref(),
        body.invoice.as_ref(),
    )?;
    within_scope(&caller, input.project.as_str())?;
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
    let keyed = match key {
        Some(key) => Some(Keyed {
            key,
            fingerprint: fingerprint(&input)?,
        }),
        None => None,
    };
    let inputs = vec![input];
    let placements = prepare(&state, &inputs, false).await?;
    // Keyed and attaching requests hold a connection for their transaction.
    let db_turn = state.db_turn(&caller).await;
    let caller = idempotency::Owner::key(caller.id());
    // Detached: a client hanging up must not cancel a transaction between
    // taking a number and recording it.
    let issuer = state.issuer.clone();
    let answer = issuer
        .detached(async move {
            let keys = vec![keyed];
            let answer = accept_keyed(&state, &caller, inputs, keys, &placements, false).await;
            drop(db_turn);
            answer
        })
        .await
        .map_err(ApiError::internal)??
        .pop()
        .ok_or_else(|| ApiError::internal("no document accepted"))?;
    Ok(accepted_response(
        StatusCode::ACCEPTED,
        answer.body,
        answer.replayed,
    ))
}

/// Where each document's number comes from, and every ID to attach on
/// record: before the caller's turns and transaction (placing may read or
/// create a sequence; an attach may wait for another instance's handout).
async fn prepare(
    state: &AppState,
    inputs: &[DocumentInput],
    itemized: bool,
) -> Result<Placements, ApiError> {
    // A single document's problem names no item.
    let placements = state.documents.place_all(inputs).await.map_err(|mut e| {
        e.index = e.index.filter(|_| itemized);
        ApiError::from(e)
    })?;
    state.documents.wait_for_handouts(inputs, &placements).await;
    Ok(placements)
}

/// Accepts documents in one transaction under their keys (the attach and
/// keyed paths, and batches), placed by [`prepare`].
async fn accept_keyed(
    state: &AppState,
    caller: &idempotency::Owner,
    inputs: Vec<DocumentInput>,
    keys: Vec<Option<Keyed>>,
    placements: &Placements,
    itemized: bool,
) -> Result<Vec<Answer>, ApiError> {
    let item = |index: Option<usize>| index.filter(|_| itemized);
    let documents = &state.documents;
    idempotent::run(state, caller, &keys, 202, itemized, async |tx, fresh| {
        let fresh_inputs: Vec<DocumentInput> = fresh.iter().map(|i| inputs[*i].clone()).collect();
        let accepted = documents
            .accept_in(tx, &fresh_inputs, placements)
            .await
            .map_err(|mut e| {
                e.index = item(e.index.map(|i| fresh[i]));
                ApiError::from(e)
            })?;
        accepted
            .iter()
            .map(|(document, replayed)| {
                Ok(Answer {
                    body: to_value(document)?,
                    replayed: *replayed,
                })
            })
            .collect()
    })
    .await
}

/// A source id: 1 to 255 characters, none of them a control character.
fn check_source_id(source_id: &str) -> Result<Arc<str>, ApiError> {
    let length = source_id.chars().count();
    if !(1..=255).contains(&length) || source_id.chars().any(char::is_control) {
        return Err(ApiError::bad_request(
            "invalid_source_id",
            "source_id must be 1 to 255 characters, none of them a control character",
        ));
    }
    Ok(Arc::from(source_id))
}

fn to_value(document: &Accepted) -> Result<Value, ApiError> {
    serde_json::to_value(AcceptedDocument::from(document)).map_err(ApiError::internal)
}

/// The answer to an accepted document (202).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AcceptedDocument {
    #[schema(example = "PROJ-9012-1001")]
    pub id: String,
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    #[schema(example = 1001)]
    pub seq: i64,
    pub status: DocumentStatus,
    pub created_at: DateTime<Utc>,
    /// A VERI*FACTU register's alta record of the document.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verifactu: Option<VerifactuView>,
}

/// A document's VERI*FACTU alta record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VerifactuView {
    /// The record's huella: 64 uppercase hex digits.
    #[schema(example = "3C464DAF61ACB827C65FDA19F352A4E3BDC2C640E9E9FC4CC058073F38F12F60")]
    pub huella: String,
    /// AEAT's ValidarQR URL of the invoice, for its QR code.
    pub qr_url: String,
}

impl From<&Accepted> for AcceptedDocument {
    fn from(accepted: &Accepted) -> Self {
        Self {
            id: accepted.id.clone(),
            project: accepted.project.clone(),
            doc_type: accepted.doc_type.clone(),
            seq: accepted.seq,
            status: accepted.status,
            created_at: accepted.created_at,
            verifactu: accepted.verifactu.as_ref().map(|v| VerifactuView {
                huella: v.huella.clone(),
                qr_url: v.qr_url.clone(),
            }),
        }
    }
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
        ProjectNotFound,
        (status = 409, description = "An item's id is not attachable, a sequence is exhausted, a key is in use, or a new sequence cannot be created (format_conflict, sequence_limit_reached, sequence_not_defined)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body or an item's metadata too large", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
        (status = 422, description = "An item's key was used for another document", body = Problem, content_type = "application/problem+json"),
        IssuingUnavailable,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn create_batch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    _sending: BatchBody,
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
    let mut keys: Vec<Option<Keyed>> = Vec::with_capacity(count);
    for (index, item) in body.documents.iter().enumerate() {
        let (input, key) = batch_item(&caller, item).map_err(|e| e.at_index(index))?;
        inputs.push(input);
        keys.push(key);
    }
    drop(body);
    let placements = prepare(&state, &inputs, true).await?;
    // The batch is complete and checked: now it waits its turn, shared
    // fairly with other keys' batches, then for a connection of its own.
    let turn = state.batch_turns.acquire(caller.id()).await;
    let db_turn = state.db_turn(&caller).await;
    let caller = idempotency::Owner::key(caller.id());
    let issuer = state.issuer.clone();
    let answers = issuer
        .detached(async move {
            let answers = accept_keyed(&state, &caller, inputs, keys, &placements, true).await;
            drop((turn, db_turn));
            answers
        })
        .await
        .map_err(ApiError::internal)??;
    let documents = answers
        .into_iter()
        .map(|Answer { body, replayed }| {
            let document: AcceptedDocument =
                serde_json::from_value(body).map_err(ApiError::internal)?;
            Ok(BatchResult { document, replayed })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(BatchAccepted { documents }),
    ))
}

/// One item of a batch, checked: the document and its idempotency key.
fn batch_item(
    caller: &Caller,
    item: &BatchItem,
) -> Result<(DocumentInput, Option<Keyed>), ApiError> {
    let input = document_input(
        &item.project,
        &item.doc_type,
        &item.metadata,
        item.id.as_deref(),
        item.invoice.as_ref(),
    )?;
    within_scope(caller, input.project.as_str())?;
    let input = DocumentInput {
        source_id: item.source_id.as_deref().map(check_source_id).transpose()?,
        ..input
    };
    let key = match &item.idempotency_key {
        None => None,
        Some(key) => {
            idempotency::validate_key(key)?;
            Some(Keyed {
                key: key.clone(),
                fingerprint: fingerprint(&input)?,
            })
        }
    };
    Ok((input, key))
}

/// One of the batch bodies a key may be sending at once: taken before the
/// body is read (an extractor ahead of the body), so a key's slow or huge
/// bodies hold up only its own further batches, and its memory is bounded.
pub struct BatchBody(#[allow(dead_code)] crate::infra::fair::Turn);

impl axum::extract::FromRequestParts<AppState> for BatchBody {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, ApiError> {
        let caller = Caller::from_request_parts(parts, state).await?;
        Ok(BatchBody(state.batch_bodies.acquire(caller.id()).await))
    }
}

/// Status of one document.
#[utoipa::path(
    get,
    path = "/api/v1/documents/{id}",
    tag = "documents",
    params(("id" = String, Path, description = "The document ID, e.g. PROJ-9012-1001 (percent-encoded)", min_length = 1, max_length = 64, pattern = r"^[^\u0000]*$")),
    responses(
        (status = 200, description = "The document and its delivery status", body = DocumentView),
        NoSuchDocument,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn get_document(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<DocumentView>, ApiError> {
    let _turn = state.db_turn(&caller).await;
    delivery_queue::find(&state.db, &id, caller.projects())
        .await
        .map_err(db_error)?
        .map(axum::Json)
        .ok_or_else(|| ApiError::not_found("document_not_found", format!("no document {id}")))
}

#[cfg(test)]
mod tests;
