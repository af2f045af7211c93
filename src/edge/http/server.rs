//! The accept loop: HTTP/1.1 over hyper, every connection under deadlines
//! (headers, idle keep-alive, writes that make no progress: `conn_guard`)
//! and bounded buffers, and a cap on open connections, so no client can
//! hold more than its share of the process.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use super::conn_guard::{Activity, AnswerDone, Deadlines, Guarded, Holding, ReadToEnd};
use super::connections::{Connections, Slot};
use crate::infra::log_limit::Repeated;

#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// Deadlines of every connection: headers, idle keep-alive, writes.
    pub deadlines: Deadlines,
    /// Connections open at once; a further client takes the slot of an
    /// unused connection, or waits for one to end (`connections`).
    pub max_connections: usize,
    /// How long requests in flight may take to finish at shutdown.
    pub drain: Duration,
}

/// Most bytes one connection buffers: a request head (start line and
/// headers) must fit, and body bytes are read on in pieces of this size, so
/// `IDPOOL_MAX_CONNECTIONS` connections hold at most this many times that.
pub const CONNECTION_BUFFER: usize = 16 * 1024;
/// Most header fields a request may carry.
pub const MAX_HEADERS: usize = 64;

/// Serves `app` on `listener` until `stop`, then lets requests in flight
/// finish (up to `limits.drain`).
pub async fn serve<S, L>(listener: L, app: S, limits: ServerLimits, stop: CancellationToken)
where
    S: tower::Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    L: std::borrow::Borrow<TcpListener>,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    // The deadlines are the socket wrapper's (conn_guard): hyper's header
    // timer would count idle keep-alive time as header time.
    http.timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(CONNECTION_BUFFER)
        .max_header_size(CONNECTION_BUFFER)
        .max_headers(MAX_HEADERS)
        .keep_alive(true);
    let connections = Connections::new(limits.max_connections);
    let tasks = TaskTracker::new();
    loop {
        let Some(stream) = accept_next(listener.borrow(), &stop).await else {
            break;
        };
        let activity = Arc::new(Activity::new(limits.deadlines));
        let Some(slot) = take_slot(&connections, &activity, &stop).await else {
            break;
        };
        // Answers go out as soon as they are written, not after the
        // client's ACK of the previous one (Nagle).
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        let (started, done) = (activity.clone(), activity.clone());
        let service = app
            .clone()
            .map_request(move |request| request_started(&started, request))
            .map_response(move |response| answer_started(&done, response));
        let connection = http.serve_connection(
            TokioIo::new(Guarded::new(stream, activity)),
            TowerToHyperService::new(service),
        );
        let stop = stop.clone();
        tasks.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                biased;
                ended = connection.as_mut() => ended,
                // Another client took the slot of this unused connection.
                _ = slot.closed.cancelled() => Ok(()),
                _ = stop.cancelled() => {
                    // Requests in flight are answered; idle ones close now.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    // Owned, the socket closes here: no new connection waits unserved
    // while the last requests finish. (Borrowed, its owner serves on.)
    drop(listener);
    tasks.close();
    if tokio::time::timeout(limits.drain, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("requests still running at shutdown were cut off");
    }
}

/// The next connection; None once `stop` is cancelled.
async fn accept_next(
    listener: &TcpListener,
    stop: &CancellationToken,
) -> Option<tokio::net::TcpStream> {
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => return Some(stream),
                Err(e) => {
                    // Out of file descriptors and the like: wait rather
                    // than spin; a client's reset connection is nothing.
                    if !is_connection_error(&e) {
                        tracing::error!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            },
        }
    }
}

/// A request starts on a connection: its activity says so, and carries
/// its key once the key check has run.
fn request_started(activity: &Arc<Activity>, request: hyper::Request<Incoming>) -> Request {
    activity.request_started();
    // A body the answer leaves unread (a refused key, a wrong media type)
    // ends the connection: the answer says so, so the client opens a new
    // one instead of meeting a reset.
    let unread = !hyper::body::Body::is_end_stream(request.body());
    activity.body_unread(unread);
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(activity.clone());
    let body = if unread {
        Body::new(ReadToEnd::new(body, activity.clone()))
    } else {
        Body::new(body)
    };
    Request::from_parts(parts, body)
}

/// An answer leaves: the connection is busy until its body is sent.
fn answer_started(activity: &Arc<Activity>, mut response: Response) -> Response {
    if activity.is_body_unread() {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    let done = activity.clone();
    response.map(|body| Body::new(Holding::new(body, AnswerDone(done))))
}

/// A slot for a new connection: a free one, else one an unused connection
/// gives up, else the first freed. `None` when the server stops meanwhile.
async fn take_slot(
    connections: &Arc<Connections>,
    activity: &Arc<Activity>,
    stop: &CancellationToken,
) -> Option<Slot> {
    static FULL: Repeated =
        Repeated::new("connection limit reached; unused connections give up their slots");
    let mut asked_to_close = false;
    loop {
        if let Some(slot) = connections.open(activity.clone()) {
            return Some(slot);
        }
        if !asked_to_close {
            FULL.warn(&"every connection slot is taken");
            asked_to_close = connections.close_one_unused();
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return None,
            _ = connections.wait_for_free() => {}
            // Every connection was busy: look again once some may not be.
            _ = tokio::time::sleep(Duration::from_millis(100)), if !asked_to_close => {}
        }
    }
}

fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}
