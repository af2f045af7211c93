//! A hostile neighbour: while one tenant's `POST /ids` is timed, another
//! tenant and a stranger do their worst at once — made-up API keys, clients
//! that never read their answers, batch bodies sent a byte at a time, the
//! largest outbox listings a key may ask for, and `POST /ids` of 10,000
//! numbers at a time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::header::HeaderValue;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};

use crate::load::connect;
use tokio::task::JoinHandle;

/// How hard each kind of flood pushes.
pub struct Intensity {
    pub made_up_key_connections: usize,
    pub slow_readers: usize,
    pub trickled_batches: usize,
    pub listing_connections: usize,
    pub large_count_connections: usize,
}

pub const INTENSITY: Intensity = Intensity {
    made_up_key_connections: 8,
    slow_readers: 64,
    trickled_batches: 4,
    listing_connections: 4,
    large_count_connections: 4,
};

impl Intensity {
    /// Only the floods named (`keys`, `readers`, `trickles`, `listings`,
    /// `counts`).
    pub fn only(names: &[String]) -> Intensity {
        let on = |name: &str, n: usize| {
            if names.iter().any(|x| x == name) {
                n
            } else {
                0
            }
        };
        Intensity {
            made_up_key_connections: on("keys", INTENSITY.made_up_key_connections),
            slow_readers: on("readers", INTENSITY.slow_readers),
            trickled_batches: on("trickles", INTENSITY.trickled_batches),
            listing_connections: on("listings", INTENSITY.listing_connections),
            large_count_connections: on("counts", INTENSITY.large_count_connections),
        }
    }
}

/// What the flood sent, for the table.
#[derive(Debug, Default)]
pub struct Sent {
    pub made_up_keys: u64,
    pub listings: u64,
    pub listed_rows: u64,
    pub numbers: u64,
}

pub struct Flood {
    stop: Arc<AtomicBool>,
    counted: Vec<JoinHandle<()>>,
    held: Vec<JoinHandle<()>>,
    made_up_keys: Arc<AtomicU64>,
    listings: Arc<AtomicU64>,
    listed_rows: Arc<AtomicU64>,
    numbers: Arc<AtomicU64>,
}

/// Starts every flood at once; `hostile_key` is the neighbour's own key
/// (a project key of `project`).
pub fn start(
    addr: SocketAddr,
    hostile_key: HeaderValue,
    project: &'static str,
    intensity: &Intensity,
) -> Flood {
    let stop = Arc::new(AtomicBool::new(false));
    let made_up_keys = Arc::new(AtomicU64::new(0));
    let listings = Arc::new(AtomicU64::new(0));
    let listed_rows = Arc::new(AtomicU64::new(0));
    let numbers = Arc::new(AtomicU64::new(0));
    let mut counted = Vec::new();
    let mut held = Vec::new();
    for n in 0..intensity.made_up_key_connections {
        let (stop, sent) = (stop.clone(), made_up_keys.clone());
        counted.push(tokio::spawn(async move {
            let _ = made_up_key_requests(addr, n as u64, &stop, &sent).await;
        }));
    }
    for _ in 0..intensity.listing_connections {
        let (stop, sent, rows) = (stop.clone(), listings.clone(), listed_rows.clone());
        let key = hostile_key.clone();
        counted.push(tokio::spawn(async move {
            let _ = big_listings(addr, key, project, &stop, &sent, &rows).await;
        }));
    }
    for _ in 0..intensity.large_count_connections {
        let (stop, numbers) = (stop.clone(), numbers.clone());
        let key = hostile_key.clone();
        counted.push(tokio::spawn(async move {
            let _ = large_counts(addr, key, project, &stop, &numbers).await;
        }));
    }
    for _ in 0..intensity.slow_readers {
        held.push(tokio::spawn(async move {
            let _ = never_read(addr).await;
        }));
    }
    for _ in 0..intensity.trickled_batches {
        let key = hostile_key.clone();
        held.push(tokio::spawn(async move {
            let _ = trickle_a_batch(addr, key).await;
        }));
    }
    Flood {
        stop,
        counted,
        held,
        made_up_keys,
        listings,
        listed_rows,
        numbers,
    }
}

impl Flood {
    /// Stops every flood and closes its connections.
    pub async fn stop(self) -> Sent {
        self.stop.store(true, Ordering::Relaxed);
        for task in &self.held {
            task.abort();
        }
        for task in self.held {
            let _ = task.await;
        }
        for task in self.counted {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        Sent {
            made_up_keys: self.made_up_keys.load(Ordering::Relaxed),
            listings: self.listings.load(Ordering::Relaxed),
            listed_rows: self.listed_rows.load(Ordering::Relaxed),
            numbers: self.numbers.load(Ordering::Relaxed),
        }
    }
}

/// A well-formed key nobody created: `idp_<12>_<43>`, new every time.
fn made_up_key(seed: u64) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state as usize) % n
    };
    let id: String = (0..12)
        .map(|_| char::from(ALPHABET[next(ALPHABET.len())]))
        .collect();
    let secret: String = (0..43)
        .map(|_| char::from(ALPHABET[next(ALPHABET.len())]))
        .collect();
    format!("idp_{id}_{secret}")
}

async fn made_up_key_requests(
    addr: SocketAddr,
    connection: u64,
    stop: &AtomicBool,
    sent: &AtomicU64,
) -> anyhow::Result<()> {
    let mut sender = connect(addr).await?;
    let mut i = connection << 40;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let request = Request::builder()
            .uri("/api/v1/sequences")
            .header("host", "bench")
            .header("authorization", format!("Bearer {}", made_up_key(i)))
            .body(Full::new(Bytes::new()))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let _ = response.into_body().collect().await?;
        sent.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

async fn big_listings(
    addr: SocketAddr,
    key: HeaderValue,
    project: &str,
    stop: &AtomicBool,
    sent: &AtomicU64,
    rows: &AtomicU64,
) -> anyhow::Result<()> {
    let mut sender = connect(addr).await?;
    let path = format!("/api/v1/outbox?project={project}&status=committed&limit=1000");
    while !stop.load(Ordering::Relaxed) {
        let request = Request::builder()
            .uri(path.as_str())
            .header("host", "bench")
            .header("authorization", key.clone())
            .body(Full::new(Bytes::new()))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let body = response.into_body().collect().await?.to_bytes();
        let listed = body.windows(6).filter(|w| w == b"\"seq\":").count();
        sent.fetch_add(1, Ordering::Relaxed);
        rows.fetch_add(listed as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// `POST /ids` of the largest count, one after another.
async fn large_counts(
    addr: SocketAddr,
    key: HeaderValue,
    project: &str,
    stop: &AtomicBool,
    numbers: &AtomicU64,
) -> anyhow::Result<()> {
    let mut sender = connect(addr).await?;
    let body = Bytes::from(format!(
        r#"{{"project": "{project}", "type": "numbers", "count": 10000}}"#
    ));
    while !stop.load(Ordering::Relaxed) {
        let request = Request::builder()
            .method("POST")
            .uri("/ids")
            .header("host", "bench")
            .header("content-type", "application/json")
            .header("authorization", key.clone())
            .body(Full::new(body.clone()))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let ok = response.status().is_success();
        response.into_body().collect().await?;
        if ok {
            numbers.fetch_add(10_000, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// A client with a small receive buffer that asks for the largest asset
/// many times over and never reads an answer.
async fn never_read(addr: SocketAddr) -> anyhow::Result<()> {
    let socket = TcpSocket::new_v4()?;
    socket.set_recv_buffer_size(4096)?;
    let mut stream = socket.connect(addr).await?;
    let request = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: bench\r\n\r\n";
    for _ in 0..32 {
        stream.write_all(request).await?;
    }
    std::future::pending::<()>().await;
    Ok(())
}

/// A batch request whose body arrives a byte at a time, for ever.
async fn trickle_a_batch(addr: SocketAddr, key: HeaderValue) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(addr).await?;
    let head = format!(
        "POST /api/v1/documents/batch HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n\
         authorization: {}\r\ncontent-length: 100000\r\n\r\n",
        key.to_str()?
    );
    stream.write_all(head.as_bytes()).await?;
    loop {
        stream.write_all(b" ").await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
