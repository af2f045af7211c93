//! A webhook target inside the test: records every delivery, can be told to
//! fail, and notices two deliveries of one document at the same time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

#[derive(Debug, Clone, Copy)]
pub enum Behaviour {
    Succeed,
    /// Fail the first `n` deliveries of each document.
    FailFirst(usize),
    AlwaysFail,
    /// Fail documents whose metadata says `"fail": true`; take the rest.
    FailFlagged,
}

#[derive(Debug, Clone)]
pub struct Received {
    pub document_id: String,
    pub idempotency_key: Option<String>,
    pub instance: Option<String>,
    pub body: serde_json::Value,
    pub at: Instant,
}

#[derive(Default)]
struct Inner {
    behaviour: Option<Behaviour>,
    delay: Duration,
    /// Bytes of body every answer carries.
    answer_body: usize,
    received: Vec<Received>,
    attempts: HashMap<String, usize>,
    in_flight: HashMap<String, usize>,
    most_at_once_per_document: usize,
}

#[derive(Clone, Default)]
pub struct Webhook {
    inner: Arc<Mutex<Inner>>,
    pub url: String,
    /// TCP connections the target accepted.
    connections: Arc<std::sync::atomic::AtomicUsize>,
}

impl Webhook {
    pub async fn start(behaviour: Behaviour) -> Self {
        let mut webhook = Webhook::default();
        webhook.inner.lock().unwrap().behaviour = Some(behaviour);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        webhook.url = format!("http://{}/hook", listener.local_addr().unwrap());
        let connections = webhook.connections.clone();
        let listener = axum::serve::ListenerExt::tap_io(listener, move |_| {
            connections.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(webhook.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        webhook
    }

    pub fn set(&self, behaviour: Behaviour) {
        self.inner.lock().unwrap().behaviour = Some(behaviour);
    }

    /// Each delivery takes this long before it is answered.
    pub fn slow_down(&self, delay: Duration) {
        self.inner.lock().unwrap().delay = delay;
    }

    /// Every answer carries `bytes` of body from now on.
    pub fn answer_with_body(&self, bytes: usize) {
        self.inner.lock().unwrap().answer_body = bytes;
    }

    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn received(&self) -> Vec<Received> {
        self.inner.lock().unwrap().received.clone()
    }

    pub fn most_at_once_per_document(&self) -> usize {
        self.inner.lock().unwrap().most_at_once_per_document
    }
}

async fn receive(
    State(webhook): State<Webhook>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let arrived = Instant::now();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    let document_id = body["id"].as_str().unwrap_or_default().to_owned();
    let (delay, answer, answer_body) = {
        let mut inner = webhook.inner.lock().unwrap();
        let at_once = {
            let n = inner.in_flight.entry(document_id.clone()).or_default();
            *n += 1;
            *n
        };
        inner.most_at_once_per_document = inner.most_at_once_per_document.max(at_once);
        let attempt = {
            let n = inner.attempts.entry(document_id.clone()).or_default();
            *n += 1;
            *n
        };
        let answer = match inner.behaviour.unwrap_or(Behaviour::Succeed) {
            Behaviour::Succeed => StatusCode::OK,
            Behaviour::FailFirst(n) if attempt <= n => StatusCode::INTERNAL_SERVER_ERROR,
            Behaviour::FailFirst(_) => StatusCode::OK,
            Behaviour::AlwaysFail => StatusCode::INTERNAL_SERVER_ERROR,
            Behaviour::FailFlagged if body["metadata"]["fail"] == true => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Behaviour::FailFlagged => StatusCode::OK,
        };
        (inner.delay, answer, "x".repeat(inner.answer_body))
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await; // the test target is slow on purpose
    }
    let mut inner = webhook.inner.lock().unwrap();
    if let Some(n) = inner.in_flight.get_mut(&document_id) {
        *n -= 1;
    }
    inner.received.push(Received {
        document_id,
        idempotency_key: headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        instance: headers
            .get("idpool-instance")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        body,
        at: arrived,
    });
    (answer, answer_body)
}
