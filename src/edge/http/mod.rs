//! The HTTP surface: routes, the OpenAPI document, and the layers every
//! request passes (request id, tracing, timeout, panic guard).

pub mod auth;
pub mod conn_guard;
mod connections;
mod documents;
mod endpoints;
pub mod extract;
mod gaps;
pub mod health;
mod idempotent;
pub mod ids;
mod outbox;
mod page;
pub mod problem;
mod registers;
mod responses;
mod schema;
mod sequences;
pub mod server;
mod voids;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::infra::db::Db;
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::http::{HeaderName, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_swagger_ui::SwaggerUi;

use crate::domain::clock::Clock;
use crate::features::documents::Documents;
use crate::features::gaps::reconcile::Reconciler;
use crate::infra::commitment::Commitment;
use crate::infra::fair::FairSlots;
use crate::infra::stats::{RequestLabels, Stats};
use crate::issuance::Issuer;
use crate::records::auth::Authenticator;
use crate::records::pool::PoolService;
use crate::records::sequence_store::SequenceStore;
use problem::ApiError;

/// Largest body the ID and sequence routes accept.
pub const SMALL_BODY_LIMIT: usize = 64 * 1024;

pub struct AppInner {
    pub auth: Arc<Authenticator>,
    pub issuer: Arc<Issuer>,
    pub documents: Documents,
    pub reconciler: Arc<Reconciler>,
    /// Projects' own delivery endpoints.
    pub endpoints: crate::features::endpoints::Endpoints,
    /// Registers an auditor can verify.
    pub registers: Arc<crate::features::registers::Registers>,
    pub sequences: Arc<SequenceStore>,
    pub pools: Arc<PoolService>,
    pub stats: Arc<Stats>,
    pub clock: Arc<dyn Clock>,
    pub db: Db,
    pub request_timeout: Duration,
    /// Turns, shared fairly by keys, to work on a document batch
    /// (`IDPOOL_BATCH_CONCURRENCY`); taken once its body is read.
    pub batch_turns: Arc<FairSlots>,
    /// Batch bodies one key may be sending at once (each up to 32 MiB).
    pub batch_bodies: Arc<FairSlots>,
    /// Turns, shared fairly by keys, to work on the request pool of
    /// Postgres: every request that holds a connection of its own (lists,
    /// reads, keyed and batched writes) takes one first.
    pub db_turns: Arc<FairSlots>,
    /// Requests one key may have in flight, answers being sent included
    /// (`IDPOOL_MAX_IN_FLIGHT_PER_KEY`).
    pub in_flight: Arc<FairSlots>,
    /// Readiness and metrics, probed once for everyone asking at once.
    pub probes: health::Probes,
}

impl AppInner {
    /// A turn on the request pool for `caller` (see `db_turns`).
    pub async fn db_turn(&self, caller: &crate::records::auth::Caller) -> crate::infra::fair::Turn {
        self.db_turns.acquire(caller.id()).await
    }
}

#[derive(Clone)]
pub struct AppState(pub Arc<AppInner>);

impl std::ops::Deref for AppState {
    type Target = AppInner;

    fn deref(&self) -> &AppInner {
        &self.0
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idpool",
        description = "Tenant-formatted sequential IDs (`PROJ-9012-1001`) from Redis pools over a Postgres \
                       counter of record. Every error is `application/problem+json` with a stable `code`.",
        license(name = "MIT")
    ),
    tags(
        (name = "ids", description = "Issue IDs"),
        (name = "documents", description = "Accept documents through the transactional outbox"),
        (name = "outbox", description = "Outbox operations: dead letters"),
        (name = "endpoints", description = "A project's own delivery endpoints, their secrets and attempts"),
        (name = "registers", description = "Hash-chained registers, signed checkpoints and proofs"),
        (name = "gaps", description = "Every number that carries no document, and why"),
        (name = "sequences", description = "Sequence definitions"),
        (name = "operations", description = "Health, readiness, metrics"),
    ),
    components(schemas(problem::Problem, crate::records::pool::DiscardCause))
)]
struct ApiDoc;

/// Every documented route, for the router and for `idpool openapi`.
pub fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(ids::router())
        .merge(voids::router())
        .merge(documents::router())
        .merge(outbox::router())
        .merge(endpoints::router())
        .merge(registers::router())
        .merge(gaps::router())
        .merge(sequences::router())
        .merge(health::router())
}

/// The OpenAPI document, built without any running dependency.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut document = api_router().into_openapi();
    short_paths(&mut document);
    secure(&mut document);
    document
}

/// The short paths of the two routes clients call most, each served by
/// the same handler as its full path (see `ids::router`,
/// `documents::router`).
const SHORT_PATHS: [(&str, &str); 2] =
    [("/ids", "/api/v1/ids"), ("/documents", "/api/v1/documents")];

/// Documents each short path as its full path's operation, under an
/// operation id of its own (`<id>_short`) and a summary that names the
/// full path.
fn short_paths(document: &mut utoipa::openapi::OpenApi) {
    for (short, full) in SHORT_PATHS {
        let Some(mut item) = document.paths.paths.get(full).cloned() else {
            continue;
        };
        if let Some(operation) = item.post.as_mut() {
            operation.operation_id = operation
                .operation_id
                .take()
                .map(|id| format!("{id}_short"));
            operation.summary = operation.summary.take().map(|summary| {
                let summary = summary.trim_end_matches('.');
                format!("{summary} (short path of `POST {full}`).")
            });
            operation.description = None;
        }
        document.paths.paths.insert(short.to_owned(), item);
    }
}

/// States what the authentication layer does: the bearer scheme and the
/// 401/429 answers on every protected operation.
fn secure(document: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::security::{
        HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
    };
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder, header::HeaderBuilder};
    let components = document.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .bearer_format("idp_<id>_<secret>")
                .description(Some("An API key from `idpool keys create`"))
                .build(),
        ),
    );
    let problem = |description: &str, header: (&str, &str)| {
        ResponseBuilder::new()
            .description(description)
            .header(
                header.0,
                HeaderBuilder::new()
                    .schema(Some(utoipa::openapi::schema::Object::with_type(
                        utoipa::openapi::schema::Type::String,
                    )))
                    .description(Some(header.1))
                    .build(),
            )
            .content(
                "application/problem+json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            )
            .build()
    };
    let unauthorized = problem(
        "unauthorized: no API key, or one that is not valid or was revoked",
        ("WWW-Authenticate", "Bearer realm=\"idpool\""),
    );
    let limited = problem(
        "rate_limited: this key sent more requests than IDPOOL_RATE_LIMIT allows",
        ("Retry-After", "seconds to wait"),
    );
    for (path, item) in document.paths.paths.iter_mut() {
        if !auth::is_protected(path) {
            continue;
        }
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ];
        for operation in operations.into_iter().flatten() {
            operation.security = Some(vec![SecurityRequirement::new(
                "bearer",
                Vec::<String>::new(),
            )]);
            let responses = &mut operation.responses.responses;
            responses.insert("401".into(), unauthorized.clone().into());
            responses.insert("429".into(), limited.clone().into());
        }
    }
}

/// The whole application: the routes, wrapped once in the layers every
/// request passes. (Layers added with `Router::layer` wrap each route on
/// its own and box the request's future once per layer.)
pub fn app(
    state: AppState,
) -> impl tower::Service<
    Request,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<Response, std::convert::Infallible>> + Send,
> + Clone
+ Send
+ Sync
+ 'static {
    let request_id = HeaderName::from_static("x-request-id");
    let timeout = state.request_timeout;
    let authenticator = state.auth.clone();
    let in_flight = state.in_flight.clone();
    let stats = state.stats.clone();
    tower::ServiceBuilder::new()
        .map_response(IntoResponse::into_response)
        .layer(middleware::from_fn(move |req, next| {
            record_latency(stats.clone(), req, next)
        }))
        .map_request(keep_a_plain_request_id)
        .layer(SetRequestIdLayer::new(
            request_id.clone(),
            RequestIds::new(),
        ))
        .layer(PropagateRequestIdLayer::new(request_id))
        .layer(
            TraceLayer::new_for_http()
                .on_response(log_request)
                // Failures are logged by whoever knows their cause (the
                // problem answers, throttled), not once more per request.
                .on_failure(())
                .make_span_with(|req: &Request| {
                    let id = req
                        .headers()
                        .get("x-request-id")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    tracing::info_span!(
                        "request",
                        request_id = id,
                        method = %req.method(),
                        path = %req.uri().path(),
                        key_id = tracing::field::Empty,
                    )
                }),
        )
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::internal("handler panicked").into_response()
        }))
        .layer(middleware::from_fn(move |req, next| {
            guard(timeout, req, next)
        }))
        .layer(middleware::from_fn(move |req, next| {
            auth::authenticate(authenticator.clone(), in_flight.clone(), req, next)
        }))
        .service(router(state))
}

/// The routes and their fallbacks, without the layers of [`app`].
pub fn router(state: AppState) -> Router {
    let (api, mut document) = api_router().split_for_parts();
    short_paths(&mut document);
    secure(&mut document);
    api.layer(DefaultBodyLimit::max(SMALL_BODY_LIMIT))
        .layer(axum::Extension(extract::BodyLimit(SMALL_BODY_LIMIT)))
        .route_layer(middleware::from_fn(pass_route_on))
        .merge(SwaggerUi::new("/docs").url("/openapi.json", document))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// One line per request at `info` (target `idpool::request`): its status
/// and time, inside the request's span (method, path, request id and the
/// key's id). `RUST_LOG=info,idpool::request=warn` turns the lines off.
fn log_request<B>(response: &axum::http::Response<B>, latency: Duration, _span: &tracing::Span) {
    tracing::info!(
        target: "idpool::request",
        status = response.status().as_u16(),
        latency_us = latency.as_micros() as u64,
        "request"
    );
}

/// Times every request, whole (authentication and queueing included), by
/// the route it matched.
async fn record_latency(stats: Arc<Stats>, req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    // A fixed set, so invented methods cannot grow the metrics either.
    let method = match *req.method() {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    };
    let response = next.run(req).await;
    let route = match response.extensions().get::<MatchedPath>() {
        Some(path) => Cow::Owned(path.as_str().to_owned()),
        // Not one of our routes: one series for all of them, so a scan of
        // random paths cannot grow the metrics.
        None => Cow::Borrowed("unmatched"),
    };
    let labels = RequestLabels {
        method: Cow::Borrowed(method),
        route,
        status: response.status().as_u16(),
    };
    stats.observe_request(&labels, started.elapsed());
    response
}

/// Hands the matched route template to [`record_latency`], which runs
/// outside the router and cannot see it on the request.
async fn pass_route_on(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().cloned();
    let mut response = next.run(req).await;
    if let Some(route) = route {
        response.extensions_mut().insert(route);
    }
    response
}

/// Request ids: a random prefix per process and 64 random bits per
/// request (a counter would tell any caller how many requests others
/// sent between two of its own).
#[derive(Clone)]
struct RequestIds {
    prefix: Arc<str>,
}

impl RequestIds {
    fn new() -> Self {
        Self {
            prefix: uuid::Uuid::new_v4().simple().to_string()[..12].into(),
        }
    }
}

impl MakeRequestId for RequestIds {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<RequestId> {
        let n: u64 = rand::random();
        axum::http::HeaderValue::from_str(&format!("{}-{n:016x}", self.prefix))
            .ok()
            .map(RequestId::new)
    }
}

/// Longest `X-Request-Id` a client may choose (it is logged and echoed).
const MAX_CLIENT_REQUEST_ID: usize = 64;

/// A client's own `X-Request-Id` is kept when it is short and plain
/// (letters, digits, `-`, `_`, `.`, `:`); any other is replaced by one of
/// ours, so a log line holds no 8 KB or forged text from a caller.
fn keep_a_plain_request_id(mut req: Request) -> Request {
    let plain = req.headers().get("x-request-id").is_none_or(|id| {
        let id = id.as_bytes();
        !id.is_empty()
            && id.len() <= MAX_CLIENT_REQUEST_ID
            && id
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
    });
    if !plain {
        req.headers_mut().remove("x-request-id");
    }
    req
}

/// What every request meets first: a URL Postgres could not store is
/// refused, and the request gets `limit` to finish (its body must have
/// arrived by then: the body extractor answers 408, a moment before this
/// answers 503). At the deadline the request is withdrawn (503, nothing
/// written) unless a write of it was sent: then it waits for that write's
/// true outcome (`crate::infra::commitment`, `db::answer_in_transaction`).
async fn guard(limit: Duration, mut req: Request, next: Next) -> Response {
    let uri = req.uri();
    if has_nul_escape(uri.path()) || uri.query().is_some_and(has_nul_escape) {
        return ApiError::bad_request(
            "invalid_character",
            "the URL contains NUL (%00), which cannot be stored; remove it",
        )
        .into_response();
    }
    if let Some(refused) = read_two_ways(req.headers()) {
        return refused;
    }
    let started = tokio::time::Instant::now();
    req.extensions_mut()
        .insert(extract::BodyDeadline(started + limit));
    let grace = Duration::from_millis(200);
    let commitment = Commitment::new();
    let serving = Commitment::scope(commitment.clone(), next.run(req));
    tokio::pin!(serving);
    match tokio::time::timeout_at(started + limit + grace, serving.as_mut()).await {
        Ok(response) => response,
        Err(_) if commitment.withdraw() => problem::timed_out().into_response(),
        // A write was sent: its outcome is the answer.
        Err(_) => serving.await,
    }
}

/// A request head that a proxy in front could read otherwise than we do is
/// refused, not served by our reading: two `Authorization` headers, or two
/// `Content-Type` headers (which one a proxy checked is unknown). (A body
/// framed both by `Content-Length` and `Transfer-Encoding` never gets here:
/// hyper reads it by `Transfer-Encoding` alone and closes the connection
/// after the answer, as RFC 9112 §6.1 asks.)
fn read_two_ways(headers: &axum::http::HeaderMap) -> Option<Response> {
    use axum::http::header;
    let count = |name| headers.get_all(name).iter().count();
    if count(header::AUTHORIZATION) > 1 {
        return Some(
            ApiError::bad_request(
                "invalid_header",
                "send one Authorization header: Bearer <key>",
            )
            .into_response(),
        );
    }
    if count(header::CONTENT_TYPE) > 1 {
        return Some(
            ApiError::bad_request("invalid_header", "send one Content-Type header").into_response(),
        );
    }
    None
}

/// `%00` anywhere in a path or query: a NUL once decoded. (The URL parser
/// refuses a raw NUL byte; a decoded surrogate is not valid UTF-8, which the
/// extractors refuse.)
fn has_nul_escape(text: &str) -> bool {
    text.as_bytes().windows(3).any(|w| w == b"%00")
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(
        "not_found",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}
