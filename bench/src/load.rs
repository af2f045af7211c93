//! The load generator: N keep-alive HTTP/1.1 connections, each sending its
//! next request as soon as the previous answer is read, latency into an
//! HDR histogram, and every number answered collected for the duplicate check.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;

/// One request to send: method, path, JSON body, and the sequence its
/// numbers belong to (for the duplicate check; None: do not check). Cheap
/// to build: the load generator shares the machine it measures.
pub struct Call {
    pub method: hyper::Method,
    pub path: &'static str,
    pub body: Bytes,
    pub sequence: Option<Arc<str>>,
}

pub enum Until {
    /// Keep sending for this long.
    Elapsed(Duration),
    /// Send this many requests in all.
    Count(u64),
}

#[derive(Default)]
pub struct Outcome {
    pub requests: u64,
    pub failed: u64,
    pub statuses: BTreeMap<u16, u64>,
    pub elapsed: Duration,
    /// Microseconds.
    pub latency: Option<Histogram<u64>>,
    /// Every number answered, by sequence.
    pub numbers: HashMap<Arc<str>, Vec<i64>>,
}

impl Outcome {
    pub fn per_second(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    pub fn quantile_ms(&self, quantile: f64) -> f64 {
        self.latency
            .as_ref()
            .map(|h| h.value_at_quantile(quantile) as f64 / 1000.0)
            .unwrap_or(f64::NAN)
    }
}

#[derive(Deserialize)]
struct Answer {
    seqs: Option<Vec<i64>>,
    seq: Option<i64>,
    documents: Option<Vec<Document>>,
}

#[derive(Deserialize)]
struct Document {
    seq: i64,
}

pub type Connection = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// A keep-alive HTTP/1.1 connection to `addr`.
pub async fn connect(addr: SocketAddr) -> anyhow::Result<Connection> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// `Authorization` values: the load connections send project keys, one
/// per connection in turn (the bench is many customers, each within its
/// rate); single requests (setting up, polling) send the admin key. A
/// scenario against an installation of its own swaps in its keys.
static KEYS: RwLock<Option<Arc<Keys>>> = RwLock::new(None);

pub struct Keys {
    load: Vec<hyper::header::HeaderValue>,
    admin: hyper::header::HeaderValue,
}

/// Sets the API keys every later request sends; the ones set before.
pub fn use_keys(load: &[String], admin: &str) -> anyhow::Result<Option<Arc<Keys>>> {
    let bearer = |k: &str| hyper::header::HeaderValue::from_str(&format!("Bearer {k}"));
    let keys = Keys {
        load: load
            .iter()
            .map(|k| bearer(k))
            .collect::<Result<Vec<_>, _>>()?,
        admin: bearer(admin)?,
    };
    Ok(restore_keys(Some(Arc::new(keys))))
}

/// Puts back keys `use_keys` replaced; the ones set until now.
pub fn restore_keys(keys: Option<Arc<Keys>>) -> Option<Arc<Keys>> {
    std::mem::replace(&mut *KEYS.write().unwrap_or_else(|e| e.into_inner()), keys)
}

/// The `Authorization` value load connection `connection` sends.
pub fn key_of(connection: usize) -> Option<hyper::header::HeaderValue> {
    key_for(Some(connection))
}

/// The key of load connection `connection`, or the admin key (`None`).
fn key_for(connection: Option<usize>) -> Option<hyper::header::HeaderValue> {
    let keys = KEYS.read().unwrap_or_else(|e| e.into_inner()).clone()?;
    match connection {
        Some(c) if !keys.load.is_empty() => Some(keys.load[c % keys.load.len()].clone()),
        _ => Some(keys.admin.clone()),
    }
}

/// Whose key a load run's connections send.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    /// A project key per connection, in turn.
    Tenants,
    /// The admin key on every connection (a crowd of projects no project
    /// key covers).
    Admin,
}

fn request(
    method: hyper::Method,
    path: &str,
    body: Bytes,
    connection: Option<usize>,
) -> anyhow::Result<Request<Full<Bytes>>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "bench")
        .header("content-type", "application/json");
    if let Some(key) = key_for(connection) {
        builder = builder.header("authorization", key);
    }
    Ok(builder.body(Full::new(body))?)
}

/// Drives `connections` connections until `until`; `call(i)` builds the
/// i-th request (i counts across all connections).
pub async fn run(
    addr: SocketAddr,
    connections: usize,
    until: Until,
    call: impl Fn(u64) -> Call + Send + Sync + 'static,
) -> anyhow::Result<Outcome> {
    run_as(addr, connections, until, Sender::Tenants, call).await
}

/// [`run`], each connection sending `sender`'s key.
pub async fn run_as(
    addr: SocketAddr,
    connections: usize,
    until: Until,
    sender: Sender,
    call: impl Fn(u64) -> Call + Send + Sync + 'static,
) -> anyhow::Result<Outcome> {
    let call = Arc::new(call);
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = match until {
        Until::Elapsed(d) => Some(started + d),
        Until::Count(_) => None,
    };
    let limit = match until {
        Until::Count(n) => n,
        Until::Elapsed(_) => u64::MAX,
    };
    let mut tasks = Vec::with_capacity(connections);
    for connection in 0..connections {
        let (call, next) = (call.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Outcome {
                latency: Some(Histogram::new_with_bounds(1, 60_000_000, 3)?),
                ..Default::default()
            };
            let mut link = connect(addr).await?;
            loop {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= limit {
                    break;
                }
                let Call {
                    method,
                    path,
                    body,
                    sequence,
                } = call(i);
                let key = (sender == Sender::Tenants).then_some(connection);
                let request = request(method, path, body, key)?;
                let sent = Instant::now();
                let answer = async {
                    link.ready().await?;
                    let response = link.send_request(request).await?;
                    let status = response.status().as_u16();
                    let body = response.into_body().collect().await?.to_bytes();
                    anyhow::Ok((status, body))
                }
                .await;
                match answer {
                    Ok((status, body)) => {
                        if let Some(h) = out.latency.as_mut() {
                            let _ = h.record(sent.elapsed().as_micros().max(1) as u64);
                        }
                        out.requests += 1;
                        *out.statuses.entry(status).or_default() += 1;
                        if (200..300).contains(&status) {
                            if let Some(sequence) = sequence
                                && let Ok(answer) = serde_json::from_slice::<Answer>(&body)
                            {
                                let numbers = answer
                                    .seqs
                                    .unwrap_or_default()
                                    .into_iter()
                                    .chain(answer.seq)
                                    .chain(
                                        answer
                                            .documents
                                            .unwrap_or_default()
                                            .into_iter()
                                            .map(|d| d.seq),
                                    );
                                out.numbers.entry(sequence).or_default().extend(numbers);
                            }
                        } else {
                            out.failed += 1;
                        }
                    }
                    Err(_) => {
                        out.failed += 1;
                        link = connect(addr).await?;
                    }
                }
            }
            anyhow::Ok(out)
        }));
    }
    let mut total = Outcome {
        latency: Some(Histogram::new_with_bounds(1, 60_000_000, 3)?),
        ..Default::default()
    };
    for task in tasks {
        let out = task.await??;
        total.requests += out.requests;
        total.failed += out.failed;
        for (status, n) in out.statuses {
            *total.statuses.entry(status).or_default() += n;
        }
        if let (Some(all), Some(one)) = (total.latency.as_mut(), out.latency.as_ref()) {
            all.add(one)?;
        }
        for (sequence, numbers) in out.numbers {
            total.numbers.entry(sequence).or_default().extend(numbers);
        }
    }
    total.elapsed = started.elapsed();
    Ok(total)
}

/// A GET of `path` on one fresh connection; status and body.
pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Bytes)> {
    send(addr, hyper::Method::GET, path, Bytes::new()).await
}

pub async fn send(
    addr: SocketAddr,
    method: hyper::Method,
    path: &str,
    body: Bytes,
) -> anyhow::Result<(u16, Bytes)> {
    let mut sender = connect(addr).await?;
    sender.ready().await?;
    let response = sender
        .send_request(request(method, path, body, None)?)
        .await?;
    let status = response.status().as_u16();
    Ok((status, response.into_body().collect().await?.to_bytes()))
}
