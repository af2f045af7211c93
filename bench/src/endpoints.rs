//! Deliveries to projects' own endpoints: the rate to one keep-alive
//! endpoint and to a hundred (one per project), and tenant B's delivery
//! latency p99 while tenant A's endpoint hangs with a backlog, divided by
//! B's alone.
//!
//! One idpool of its own (its own database and Redis prefix, private
//! addresses allowed: the targets are on loopback).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Method;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use crate::load;
use crate::services::{Idpool, Postgres};
use crate::{Bench, Sizes, metadata, wait_for_mode};

/// A batch of documents as the intake takes it.
const BATCH: usize = 500;

/// An endpoint on a free port: keeps the arrival time of every document
/// it takes (by its id), answers 204, or never answers while `hang`.
struct Endpoint {
    addr: SocketAddr,
    arrivals: Arc<Mutex<HashMap<String, Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Endpoint {
    async fn start(hang: Arc<std::sync::atomic::AtomicBool>) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let seen = arrivals.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (seen, hang) = (seen.clone(), hang.clone());
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        let (seen, hang) = (seen.clone(), hang.clone());
                        async move {
                            let body = request.into_body().collect().await.map(|b| b.to_bytes());
                            if hang.load(std::sync::atomic::Ordering::Relaxed) {
                                std::future::pending::<()>().await;
                            }
                            if let Ok(body) = body
                                && let Ok(document) = serde_json::from_slice::<Value>(&body)
                                && let Some(id) = document["id"].as_str()
                            {
                                seen.lock()
                                    .expect("arrivals")
                                    .entry(id.to_owned())
                                    .or_insert_with(Instant::now);
                            }
                            let mut answer = hyper::Response::new(Full::new(Bytes::new()));
                            *answer.status_mut() = hyper::StatusCode::NO_CONTENT;
                            Ok::<_, Infallible>(answer)
                        }
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        Ok(Self {
            addr,
            arrivals,
            task,
        })
    }

    fn delivered(&self) -> usize {
        self.arrivals.lock().expect("arrivals").len()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn register(addr: SocketAddr, project: &str, endpoint: &Endpoint) -> anyhow::Result<()> {
    let body = json!({"project": project, "url": format!("http://{}/in", endpoint.addr)});
    let (status, answer) = load::send(
        addr,
        Method::POST,
        "/api/v1/endpoints",
        Bytes::from(body.to_string()),
    )
    .await?;
    if status != 201 {
        bail!(
            "endpoint of {project}: {status} {}",
            String::from_utf8_lossy(&answer)
        );
    }
    Ok(())
}

/// Sends `documents` spread over `projects` in batches; when each was
/// accepted, by id.
async fn send(
    addr: SocketAddr,
    projects: &[String],
    documents: usize,
) -> anyhow::Result<HashMap<String, Instant>> {
    let mut accepted = HashMap::new();
    let mut sent = 0;
    while sent < documents {
        let items: Vec<Value> = (sent..(sent + BATCH).min(documents))
            .map(|i| {
                json!({"project": projects[i % projects.len()], "type": "INV", "metadata": metadata(i as u64)})
            })
            .collect();
        sent += items.len();
        let body = Bytes::from(json!({ "documents": items }).to_string());
        let (status, answer) =
            load::send(addr, Method::POST, "/api/v1/documents/batch", body).await?;
        if status != 202 {
            bail!(
                "the batch was answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        let at = Instant::now();
        let answer: Value = serde_json::from_slice(&answer)?;
        for document in answer["documents"].as_array().into_iter().flatten() {
            if let Some(id) = document["id"].as_str() {
                accepted.insert(id.to_owned(), at);
            }
        }
    }
    Ok(accepted)
}

/// Waits until `endpoints` together hold `count` documents.
async fn until_delivered(endpoints: &[Endpoint], count: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while endpoints.iter().map(Endpoint::delivered).sum::<usize>() < count {
        if Instant::now() > deadline {
            bail!("deliveries stalled");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// Tenant B sends a document at a time, `count` of them; each one's
/// delay from acceptance to its endpoint.
async fn tenant_b_delays(addr: SocketAddr, b: &Endpoint, count: usize) -> anyhow::Result<Vec<f64>> {
    let mut accepted = HashMap::new();
    for i in 0..count {
        let body = json!({"project": "TB", "type": "INV", "metadata": metadata(i as u64)});
        let (status, answer) = load::send(
            addr,
            Method::POST,
            "/documents",
            Bytes::from(body.to_string()),
        )
        .await?;
        if status != 202 {
            bail!("B's document was answered {status}");
        }
        let at = Instant::now();
        let answer: Value = serde_json::from_slice(&answer)?;
        let id = answer["id"].as_str().context("an id")?.to_owned();
        accepted.insert(id, at);
        // A steady trickle, as a tenant's own traffic.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let arrivals = b.arrivals.lock().expect("arrivals").clone();
        if accepted.keys().all(|id| arrivals.contains_key(id)) {
            return Ok(accepted
                .iter()
                .map(|(id, at)| arrivals[id].duration_since(*at).as_secs_f64() * 1000.0)
                .collect());
        }
        if Instant::now() > deadline {
            bail!("B's documents not delivered in 120 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn p99(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64) * 0.99).ceil() as usize;
    values[index.saturating_sub(1).min(values.len() - 1)]
}

pub async fn deliveries(
    bench: &mut Bench,
    binary: &Path,
    env: &[(String, String)],
    postgres: &Postgres,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let mut env: Vec<(String, String)> = env
        .iter()
        .filter(|(key, _)| !matches!(key.as_str(), "DATABASE_URL" | "IDPOOL_REDIS_PREFIX"))
        .cloned()
        .collect();
    env.extend(
        [
            ("DATABASE_URL", postgres.url("idpool_bench_endpoints")),
            ("IDPOOL_REDIS_PREFIX", "endpoints".to_owned()),
            ("IDPOOL_AUTH", "off".to_owned()),
            ("IDPOOL_ENDPOINTS_ALLOW_PRIVATE", "true".to_owned()),
            ("IDPOOL_MAX_ENDPOINTS_PER_PROJECT", "200".to_owned()),
            ("IDPOOL_WEBHOOK_TIMEOUT_MS", "1000".to_owned()),
            ("IDPOOL_OUTBOX_BACKOFF_BASE_MS", "100".to_owned()),
            ("IDPOOL_OUTBOX_BACKOFF_MAX_MS", "1000".to_owned()),
            ("IDPOOL_OUTBOX_MAX_RETRIES", "100".to_owned()),
            ("IDPOOL_ENDPOINT_CIRCUIT_MAX_S", "2".to_owned()),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    let idpool = Idpool::start(binary, &env)?;
    let addr: SocketAddr = format!("127.0.0.1:{}", idpool.port).parse()?;
    wait_for_mode(addr, "pool")
        .await
        .context("an idpool for endpoints")?;
    let steady = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let documents = (20_000.0 * sizes.scale) as usize;

    // One endpoint.
    let one = [Endpoint::start(steady.clone()).await?];
    register(addr, "ONE", &one[0]).await?;
    let started = Instant::now();
    send(addr, &["ONE".to_owned()], documents).await?;
    until_delivered(&one, documents).await?;
    let rate_one = documents as f64 / started.elapsed().as_secs_f64();
    bench.context(
        &format!("deliveries/s to 1 endpoint ({documents} documents, keep-alive)"),
        rate_one,
        "docs/s",
    );

    // A hundred endpoints, one per project.
    let mut hundred = Vec::new();
    let mut projects = Vec::new();
    for i in 0..100 {
        let endpoint = Endpoint::start(steady.clone()).await?;
        let project = format!("H{i:03}");
        register(addr, &project, &endpoint).await?;
        hundred.push(endpoint);
        projects.push(project);
    }
    let started = Instant::now();
    send(addr, &projects, documents).await?;
    until_delivered(&hundred, documents).await?;
    let rate_hundred = documents as f64 / started.elapsed().as_secs_f64();
    bench.context(
        &format!("deliveries/s to 100 endpoints ({documents} documents over 100 projects)"),
        rate_hundred,
        "docs/s",
    );

    // Tenant B alone, then beside tenant A whose endpoint hangs.
    let b = Endpoint::start(steady.clone()).await?;
    register(addr, "TB", &b).await?;
    let trickle = (500.0 * sizes.scale.max(0.2)) as usize;
    let mut alone = tenant_b_delays(addr, &b, trickle).await?;
    let hanging = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let a = Endpoint::start(hanging.clone()).await?;
    register(addr, "TA", &a).await?;
    send(addr, &["TA".to_owned()], documents).await?;
    let mut beside = tenant_b_delays(addr, &b, trickle).await?;
    let (alone_p99, beside_p99) = (p99(&mut alone), p99(&mut beside));
    bench.context("tenant B's delivery delay p99, alone", alone_p99, "ms");
    bench.context(
        &format!("tenant B's delivery delay p99, A's endpoint hanging with {documents} due"),
        beside_p99,
        "ms",
    );
    let ratio = beside_p99 / alone_p99;
    bench.row(
        "B's delivery p99 with A's endpoint hanging / B alone",
        ratio,
        "x",
        "<= 1.5",
        Some(ratio <= 1.5),
    );
    // A answers again: its backlog is delivered.
    hanging.store(false, std::sync::atomic::Ordering::Relaxed);
    let started = Instant::now();
    until_delivered(std::slice::from_ref(&a), documents).await?;
    bench.context(
        "A's backlog delivered after its endpoint answers again",
        started.elapsed().as_secs_f64(),
        "s",
    );
    bench
        .peak_rss
        .push(("endpoints".to_owned(), idpool.peak_rss_mib()));
    Ok(())
}
