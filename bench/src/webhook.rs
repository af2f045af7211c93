//! Webhook delivery against a keep-alive target that answers 2xx with an
//! empty body, with 1 KiB and with 32 KiB. idpool reads an answer to its
//! end, so a body costs no new connection: the rates stay close to the
//! empty answer's, and the connections the target sees stay at most the
//! deliveries in flight.
//!
//! Each target has an idpool of its own (its own database and Redis
//! prefix), fed the same documents in alternating rounds.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Method;
use hyper_util::rt::TokioIo;
use serde_json::json;

use crate::load;
use crate::services::{Idpool, Postgres};
use crate::{Bench, Sizes, median, metadata, wait_for_mode};

/// The answer sizes, the first being the baseline.
const ANSWERS: [(usize, &str); 3] = [(0, "empty"), (1024, "1 KiB"), (32 * 1024, "32 KiB")];
/// Deliveries in flight per idpool: two processor loops of this many.
const CONCURRENCY: u64 = 16;
const WORKERS: u64 = 2;
/// A batch of documents as the intake takes it.
const BATCH: u64 = 500;

/// A webhook receiver on a free port: counts deliveries and accepted
/// connections, answers 200 with `answer` bytes, keeps connections alive.
struct Target {
    addr: SocketAddr,
    delivered: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Target {
    async fn start(answer: usize) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let delivered = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let body = Bytes::from(vec![b'x'; answer]);
        let (count, accepted) = (delivered.clone(), connections.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::Relaxed);
                let (count, body) = (count.clone(), body.clone());
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        let (count, body) = (count.clone(), body.clone());
                        async move {
                            // The whole request is read, as a receiver would.
                            let _ = request.into_body().collect().await;
                            count.fetch_add(1, Ordering::Relaxed);
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(body)))
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
            delivered,
            connections,
            task,
        })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `documents` sent in batches to the idpool at `addr`; documents per
/// second from the first batch sent until the target has them all.
async fn deliver(
    addr: SocketAddr,
    target: &Target,
    documents: u64,
    round: usize,
) -> anyhow::Result<f64> {
    let before = target.delivered.load(Ordering::Relaxed);
    let started = Instant::now();
    let mut sent = 0;
    while sent < documents {
        let items: Vec<_> = (sent..(sent + BATCH).min(documents))
            .map(|i| json!({"project": "HOOK", "type": format!("r{round}"), "metadata": metadata(i)}))
            .collect();
        sent += items.len() as u64;
        let body = Bytes::from(json!({ "documents": items }).to_string());
        let (status, answer) =
            load::send(addr, Method::POST, "/api/v1/documents/batch", body).await?;
        if status != 202 {
            bail!(
                "the batch was answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }
    let deadline = started + Duration::from_secs(120);
    while target.delivered.load(Ordering::Relaxed) < before + documents {
        if Instant::now() > deadline {
            bail!(
                "{} of {documents} documents delivered after 120 s",
                target.delivered.load(Ordering::Relaxed) - before
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(documents as f64 / started.elapsed().as_secs_f64())
}

pub async fn answer_bodies(
    bench: &mut Bench,
    binary: &Path,
    env: &[(String, String)],
    postgres: &Postgres,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let mut instances = Vec::new();
    for (size, _) in ANSWERS {
        let target = Target::start(size).await?;
        let mut env: Vec<(String, String)> = env
            .iter()
            .filter(|(key, _)| !matches!(key.as_str(), "DATABASE_URL" | "IDPOOL_REDIS_PREFIX"))
            .cloned()
            .collect();
        env.extend([
            (
                "DATABASE_URL".to_owned(),
                postgres.url(&format!("idpool_bench_webhook_{size}")),
            ),
            ("IDPOOL_REDIS_PREFIX".to_owned(), format!("hook{size}")),
            ("IDPOOL_AUTH".to_owned(), "off".to_owned()),
            (
                "IDPOOL_SINK".to_owned(),
                format!("webhook:http://{}/hook", target.addr),
            ),
            (
                "IDPOOL_WEBHOOK_SECRET".to_owned(),
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned(),
            ),
            (
                "IDPOOL_WEBHOOK_CONCURRENCY".to_owned(),
                CONCURRENCY.to_string(),
            ),
            ("IDPOOL_OUTBOX_WORKERS".to_owned(), WORKERS.to_string()),
        ]);
        let idpool = Idpool::start(binary, &env)?;
        let addr: SocketAddr = format!("127.0.0.1:{}", idpool.port).parse()?;
        wait_for_mode(addr, "pool")
            .await
            .context("an idpool with a webhook sink")?;
        instances.push((target, idpool, addr));
    }
    let documents = sizes.webhook_documents;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); ANSWERS.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); ANSWERS.len()];
    for round in 0..sizes.rounds {
        let mut this = Vec::new();
        for (target, _, addr) in &instances {
            this.push(deliver(*addr, target, documents, round).await?);
        }
        for (i, rate) in this.iter().enumerate() {
            rates[i].push(*rate);
            ratios[i].push(rate / this[0]);
        }
    }
    // Connections stay near the deliveries in flight, whatever the
    // number of deliveries: a few more, because a delivery may start
    // before the connection that just finished is back in hyper's pool.
    // An answer left unread costs one connection per delivery.
    let in_flight = CONCURRENCY * WORKERS;
    for (i, (size, name)) in ANSWERS.into_iter().enumerate() {
        bench.context(
            &format!(
                "webhook deliveries/s, target answering 2xx with {name} (median of {})",
                sizes.rounds
            ),
            median(&mut rates[i]),
            "docs/s",
        );
        let connections = instances[i].0.connections.load(Ordering::Relaxed);
        bench.row(
            &format!(
                "connections the {name}-answer target accepted for {} deliveries",
                documents * sizes.rounds as u64
            ),
            connections as f64,
            "conns",
            &format!("<= {}", 2 * in_flight),
            Some(connections <= 2 * in_flight),
        );
        if i > 0 {
            let ratio = median(&mut ratios[i]);
            let figure =
                format!("webhook rate with a {name} answer / with an empty one (median of rounds)");
            // The goal is the 1 KiB answer's: a receiver's usual
            // acknowledgement. 32 KiB shows what reading more costs on a
            // machine where target, idpool and load share two cores.
            if size <= 1024 {
                bench.row(&figure, ratio, "x", ">= 0.90", Some(ratio >= 0.90));
            } else {
                bench.context(&figure, ratio, "x");
            }
        }
    }
    Ok(())
}
