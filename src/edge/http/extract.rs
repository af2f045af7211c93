//! Axum's extractors, answering rejections in our problem format.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use super::problem::ApiError;

/// A JSON object body. Unlike `axum::Json` it refuses a top-level array,
/// which serde would otherwise map onto a struct field by field.
pub struct Json<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as UTF-8 JSON with Content-Type: application/json, not compressed",
            ));
        }
        let _ = state;
        let deadline = req.extensions().get::<BodyDeadline>().copied();
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(super::SMALL_BODY_LIMIT, |l| l.0);
        // A declared length past what would be drained is answered at
        // once: waiting for a body that is never sent holds the
        // connection until the body timeout.
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|length| length > (limit + DRAIN_PAST_LIMIT) as u64) {
            return Err(too_large().with_header(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            ));
        }
        let read = read_body(req.into_body(), limit);
        let read = match deadline {
            Some(BodyDeadline(at)) => tokio::time::timeout_at(at, read).await.map_err(|_| {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    "the request body did not arrive in time",
                )
            })?,
            None => read.await,
        };
        let bytes = read?;
        if let Some(what) = unstorable_escape(&bytes) {
            let refused = ApiError::bad_request(
                "invalid_character",
                format!("the body contains {what}, which cannot be stored; remove it"),
            );
            return Err(match first_batch_item_holding_unstorable(&bytes) {
                Some(index) => refused.at_index(index),
                None => refused,
            });
        }
        match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(b'{') => {}
            None => {
                return Err(ApiError::bad_request(
                    "invalid_json",
                    "the body is empty; send a JSON object",
                ));
            }
            // JSON has no byte-order mark (RFC 8259 §8.1), and a client
            // that sent one is told so rather than that it sent no object.
            Some(_) if bytes.starts_with(b"\xEF\xBB\xBF") => {
                return Err(ApiError::bad_request(
                    "invalid_body",
                    "the body starts with a UTF-8 byte-order mark; send the JSON object without it",
                ));
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid_body",
                    "the body must be a JSON object",
                ));
            }
        }
        // Parsed once as is; only a body that fails is parsed again the
        // way axum does, to say where it went wrong (the path tracking
        // costs a valid request a third of its parse).
        if let Ok(value) = serde_json::from_slice::<T>(&bytes) {
            return Ok(Json(value));
        }
        let axum::Json(value) = axum::Json::<T>::from_bytes(&bytes)?;
        Ok(Json(value))
    }
}

/// A JSON object body that may be left out: no body at all (no
/// `Content-Type`, no length or length 0) is `None`; anything sent is read
/// as [`Json`] reads it.
pub struct OptionalJson<T>(pub Option<T>);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let headers = req.headers();
        let length = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let chunked = headers.contains_key(header::TRANSFER_ENCODING);
        let absent =
            !headers.contains_key(header::CONTENT_TYPE) && !chunked && length.unwrap_or(0) == 0;
        if absent {
            return Ok(OptionalJson(None));
        }
        let Json(value) = Json::<T>::from_request(req, state).await?;
        Ok(OptionalJson(Some(value)))
    }
}

/// The largest body a route takes (set on its router).
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// Bytes past a route's limit that are read and dropped before the 413 is
/// answered: a client still sending its body reads the answer instead of a
/// reset connection. Past this, the connection is closed.
const DRAIN_PAST_LIMIT: usize = 1024 * 1024;

/// The body, if it holds at most `limit` bytes.
async fn read_body(body: axum::body::Body, limit: usize) -> Result<Bytes, ApiError> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut bytes = bytes::BytesMut::new();
    let mut read = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::bad_request("invalid_body", e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        read += data.len();
        if read <= limit {
            bytes.extend_from_slice(&data);
        } else if read > limit + DRAIN_PAST_LIMIT {
            break;
        }
    }
    if read > limit {
        return Err(too_large());
    }
    Ok(bytes.freeze())
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "the request body is larger than this route accepts",
    )
}

/// In a batch body (`{"documents": [...]}`), the first item holding an
/// [`unstorable_escape`]: SPEC names a batch's first bad item by index.
fn first_batch_item_holding_unstorable(body: &[u8]) -> Option<usize> {
    #[derive(serde::Deserialize)]
    struct Batch<'a> {
        #[serde(borrow)]
        documents: Vec<&'a serde_json::value::RawValue>,
    }
    let batch: Batch = serde_json::from_slice(body).ok()?;
    batch
        .documents
        .iter()
        .position(|item| unstorable_escape(item.get().as_bytes()).is_some())
}

/// When the body of the request must have arrived (set by the request
/// timeout layer).
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadline(pub tokio::time::Instant);

/// A JSON escape of a character Postgres cannot store in text or jsonb:
/// NUL (`\u0000`) or half of a surrogate pair. Strings anywhere in the body
/// count, object keys included. Raw control bytes are not valid JSON and
/// are refused by the parser.
pub fn unstorable_escape(json: &[u8]) -> Option<&'static str> {
    let hex = |at: usize| -> Option<u32> {
        let digits = json.get(at..at + 4)?;
        if !digits.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    };
    let mut i = 0;
    while let Some(found) = json
        .get(i..)
        .and_then(|rest| rest.iter().position(|b| *b == b'\\'))
    {
        let at = i + found;
        if json.get(at + 1) != Some(&b'u') {
            // Any other escape is two bytes; skipping both keeps `\\u0000`
            // (an escaped backslash, then text) from looking like NUL.
            i = at + 2;
            continue;
        }
        let Some(code) = hex(at + 2) else {
            // Not an escape the parser accepts: it will say so.
            i = at + 2;
            continue;
        };
        i = at + 6;
        match code {
            0 => return Some("NUL (\\u0000)"),
            0xD800..=0xDBFF => {
                let low = (json.get(at + 6..at + 8) == Some(b"\\u"))
                    .then(|| hex(at + 8))
                    .flatten();
                match low {
                    Some(0xDC00..=0xDFFF) => i = at + 12,
                    _ => return Some("an unpaired UTF-16 surrogate"),
                }
            }
            0xDC00..=0xDFFF => return Some("an unpaired UTF-16 surrogate"),
            _ => {}
        }
    }
    None
}

fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(content_type) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mut parts = content_type.split(';');
    let essence = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    // JSON is UTF-8 (RFC 8259); a body said to be another charset would
    // be read as something it is not.
    let other_charset = parts.any(|parameter| {
        parameter.split_once('=').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("charset")
                && !value.trim().trim_matches('"').eq_ignore_ascii_case("utf-8")
        })
    });
    // A body is read as sent: one said to be compressed is not JSON.
    let encoded = headers.get_all(header::CONTENT_ENCODING).iter().any(|v| {
        !v.to_str()
            .is_ok_and(|v| v.trim().eq_ignore_ascii_case("identity"))
    });
    (essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json")))
        && !other_charset
        && !encoded
}

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

#[cfg(test)]
mod tests {
    use super::unstorable_escape;
    use proptest::prelude::*;

    #[test]
    fn nul_and_lone_surrogates_are_found_anywhere() {
        assert!(unstorable_escape(br#"{"a":"x\u0000y"}"#).is_some());
        assert!(unstorable_escape(br#"{"x\u0000":1}"#).is_some());
        assert!(unstorable_escape(br#"{"a":{"b":["\ud800"]}}"#).is_some());
        assert!(unstorable_escape(br#"{"a":"\udc00"}"#).is_some());
        assert!(unstorable_escape(br#"{"a":"\ud83d\ude00"}"#).is_none());
        assert!(unstorable_escape(br#"{"a":"\\u0000"}"#).is_none());
        assert!(unstorable_escape(br#"{"a":"\n\u0041"}"#).is_none());
        // Cut off inside an escape: not JSON (the parser says so), and
        // nothing for the scan to report.
        for body in [&b"\\"[..], b"x\\", b"\\u", b"\\u00"] {
            assert_eq!(unstorable_escape(body), None);
        }
        assert!(unstorable_escape(b"\\ud800\\").is_some());
    }

    proptest! {
        #[test]
        fn any_bytes_are_scanned_without_failing(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = unstorable_escape(&bytes);
        }
    }

    proptest! {
        #[test]
        fn every_string_serde_writes_is_judged_like_postgres_would(text in any::<String>()) {
            let json = serde_json::to_vec(&serde_json::json!({ "k": text })).unwrap();
            prop_assert_eq!(unstorable_escape(&json).is_some(), text.contains('\0'));
        }
    }
}
