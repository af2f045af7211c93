//! A project's delivery endpoint inside the test: keeps every request as
//! it came (headers and exact body), answers a status it is told, or
//! hangs (accepts the request and never answers) until told otherwise.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Answer(u16),
    /// Accept the request and never answer it (until the mode changes).
    Hang,
}

/// One request as the endpoint got it.
#[derive(Debug, Clone)]
pub struct Request {
    pub webhook_id: String,
    pub timestamp: String,
    pub signature: String,
    pub body: Vec<u8>,
    pub document_id: String,
    pub arrived: Instant,
    /// The status it was answered with (None: it hung until the sender
    /// gave up).
    pub status: Option<u16>,
}

#[derive(Clone)]
pub struct Endpoint {
    pub url: String,
    requests: Arc<Mutex<Vec<Request>>>,
    mode: Arc<watch::Sender<Mode>>,
}

impl Endpoint {
    pub async fn start(mode: Mode) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let endpoint = Endpoint {
            url: format!("http://{}/in", listener.local_addr().expect("address")),
            requests: Default::default(),
            mode: Arc::new(watch::channel(mode).0),
        };
        let app = Router::new()
            .route("/in", post(receive))
            .with_state(endpoint.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        endpoint
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().expect("requests").clone()
    }

    /// Distinct documents answered with a 2xx.
    pub fn delivered(&self) -> usize {
        let requests = self.requests.lock().expect("requests");
        let mut seen: Vec<&str> = requests
            .iter()
            .filter(|r| r.status.is_some_and(|s| (200..300).contains(&s)))
            .map(|r| r.document_id.as_str())
            .collect();
        seen.sort_unstable();
        seen.dedup();
        seen.len()
    }

    /// Requests per document.
    pub fn requests_per_document(&self) -> HashMap<String, Vec<Request>> {
        let mut by_document: HashMap<String, Vec<Request>> = HashMap::new();
        for request in self.requests() {
            by_document
                .entry(request.document_id.clone())
                .or_default()
                .push(request);
        }
        by_document
    }
}

async fn receive(State(endpoint): State<Endpoint>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let arrived = Instant::now();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let document: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut request = Request {
        webhook_id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body: body.to_vec(),
        document_id: document["id"].as_str().unwrap_or_default().to_owned(),
        arrived,
        status: None,
    };
    // Hangs while told to; a sender that gives up drops this future, and
    // the request stays recorded as unanswered.
    let mut mode = endpoint.mode.subscribe();
    let index = {
        let mut requests = endpoint.requests.lock().expect("requests");
        requests.push(request.clone());
        requests.len() - 1
    };
    let status = loop {
        let now = *mode.borrow_and_update();
        match now {
            Mode::Answer(status) => break status,
            Mode::Hang => {
                if mode.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    };
    request.status = Some(status);
    endpoint.requests.lock().expect("requests")[index] = request;
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}
