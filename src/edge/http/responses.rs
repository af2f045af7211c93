//! Problem answers several routes share, for their OpenAPI blocks: each
//! set is written once here and named in `responses(...)` of every route
//! that gives it, beside the answers that route alone gives.

use std::collections::BTreeMap;

use utoipa::IntoResponses;
use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response, ResponseBuilder};

/// Problem answers with these statuses and descriptions.
fn problems(answers: &[(u16, &str)]) -> BTreeMap<String, RefOr<Response>> {
    answers
        .iter()
        .map(|(status, description)| {
            let content = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Problem")))
                .build();
            let response = ResponseBuilder::new()
                .description(*description)
                .content("application/problem+json", content)
                .build();
            (status.to_string(), RefOr::T(response))
        })
        .collect()
}

/// A route that reads a JSON body: it may arrive too slowly, or not be
/// JSON.
pub struct JsonBodyProblems;

impl IntoResponses for JsonBodyProblems {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problems(&[
            (
                408,
                "body_timeout: the body did not arrive within the request timeout",
            ),
            (415, "Body is not JSON"),
        ])
    }
}

/// A route that takes numbers: Postgres may be away, the request may run
/// out of time, or the definition may change meanwhile; each is retried.
pub struct IssuingUnavailable;

impl IntoResponses for IssuingUnavailable {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problems(&[(
            503,
            "Postgres unavailable, the request timed out, or the definition changed meanwhile (retry)",
        )])
    }
}

/// A route that takes an `Idempotency-Key`.
pub struct KeyReused;

impl IntoResponses for KeyReused {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problems(&[(422, "idempotency_key_reused")])
    }
}

/// A route under a project that may not be the key's.
pub struct ProjectNotFound;

impl IntoResponses for ProjectNotFound {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problems(&[(
            404,
            "project_not_found: the project is not one of the key's",
        )])
    }
}

/// A route that names a document by its ID.
pub struct NoSuchDocument;

impl IntoResponses for NoSuchDocument {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        problems(&[(404, "No such document")])
    }
}
