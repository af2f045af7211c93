//! Target stores the outbox processor delivers to (`IDPOOL_SINK`). Delivery
//! is at least once; each sink makes a repeat harmless.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures::StreamExt;
use serde::Serialize;

use crate::domain::clock::Clock;
use crate::infra::db::{Link, Tx};
use serde_json::value::RawValue;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkConfig {
    /// The `documents` table, upserted by ID.
    Postgres,
    /// One JSON file per document, `<dir>/<id>.json`, written atomically.
    Dir(PathBuf),
    /// POST of the document JSON, `Idempotency-Key: <id>`; 2xx = delivered.
    Webhook(String),
}

impl FromStr for SinkConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "postgres" {
            return Ok(SinkConfig::Postgres);
        }
        if let Some(dir) = s.strip_prefix("dir:") {
            if dir.is_empty() {
                return Err("dir: needs a path, as in dir:/var/lib/idpool/documents".into());
            }
            return Ok(SinkConfig::Dir(PathBuf::from(dir)));
        }
        if let Some(url) = s.strip_prefix("webhook:") {
            return usable_webhook_url(url).map(|()| SinkConfig::Webhook(url.to_owned()));
        }
        // The value may be a URL with credentials written without its
        // prefix: it is not repeated.
        Err("unknown sink: use postgres, dir:/path or webhook:https://...".into())
    }
}

/// Refuses at start a webhook URL no delivery could use, rather than
/// dead-lettering every document later. Reasons never repeat the URL,
/// which may hold a password.
fn usable_webhook_url(url: &str) -> Result<(), String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err("webhook: needs an http:// or https:// URL".into());
    }
    let parsed =
        url::Url::parse(url).map_err(|e| format!("webhook: the URL is not usable: {e}"))?;
    // `https:///in` parses with the host `in`: not what anyone wrote.
    let authority = url.split_once("://").map_or("", |(_, rest)| rest);
    if parsed.host_str().is_none_or(str::is_empty) || authority.starts_with('/') {
        return Err("webhook: the URL names no host".into());
    }
    // A fragment is never sent; one here is most often a `#` in a
    // password, which makes the rest of the password part of the URL.
    if parsed.fragment().is_some() {
        return Err(
            "webhook: the URL has a fragment (#), which is never sent; write a # in a password as %23"
                .into(),
        );
    }
    Ok(())
}

/// A claimed outbox row, ready to deliver.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Delivery {
    pub row_id: i64,
    pub document_id: String,
    pub project: String,
    pub doc_type: String,
    pub seq: i64,
    pub created_at: DateTime<Utc>,
    /// The metadata; not fetched for the Postgres sink, which copies it in SQL.
    pub payload: Option<String>,
}

/// Why a delivery failed; its text is the outbox row's `last_error`. One
/// failure may stand for a whole batch, so sources are shared.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeliveryError {
    #[error("the outbox row has no payload loaded")]
    PayloadNotLoaded,
    #[error("stored metadata: {0}")]
    StoredMetadata(#[source] Arc<serde_json::Error>),
    #[error("postgres sink: {0}")]
    Postgres(#[source] Arc<sqlx::Error>),
    #[error("writing {}: {source}", .path.display())]
    File {
        path: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("syncing {}: {source}", .dir.display())]
    SyncDir {
        dir: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("writer task failed: {0}")]
    Writer(#[source] Arc<tokio::task::JoinError>),
    #[error("webhook {url} timed out: {source}")]
    WebhookTimedOut {
        url: String,
        #[source]
        source: Arc<reqwest::Error>,
    },
    #[error("webhook {url} unreachable: {source}")]
    WebhookUnreachable {
        url: String,
        #[source]
        source: Arc<reqwest::Error>,
    },
    #[error("webhook {url} leads to an address deliveries may not go to")]
    AddressNotAllowed { url: String },
    #[error("webhook {url} answered {status}; redirects are not followed")]
    WebhookRedirected {
        url: String,
        status: reqwest::StatusCode,
    },
    #[error("webhook {url} answered {status}: {excerpt}")]
    WebhookRefused {
        url: String,
        status: reqwest::StatusCode,
        excerpt: String,
    },
}

impl DeliveryError {
    /// The HTTP status a target answered, where it answered one.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            DeliveryError::WebhookRedirected { status, .. }
            | DeliveryError::WebhookRefused { status, .. } => Some(status.as_u16()),
            _ => None,
        }
    }

    /// What a tenant reads in `last_error`: a short classification (an HTTP
    /// status, a timeout, a refused connection, a full disk). Never the
    /// target's answer, a path or an internal message: operators find
    /// those in the log line of the failure.
    pub fn classification(&self) -> String {
        match self {
            DeliveryError::PayloadNotLoaded
            | DeliveryError::StoredMetadata(_)
            | DeliveryError::Writer(_) => "internal error".into(),
            DeliveryError::Postgres(e) => match crate::infra::db::sqlstate::of(e) {
                Some(code) if code == crate::infra::db::sqlstate::DISK_FULL => {
                    "storage full".into()
                }
                Some(_) => "target store refused the document".into(),
                None => "target store unreachable".into(),
            },
            DeliveryError::File { source, .. } | DeliveryError::SyncDir { source, .. } => {
                match source.kind() {
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => {
                        "storage full".into()
                    }
                    std::io::ErrorKind::PermissionDenied
                    | std::io::ErrorKind::ReadOnlyFilesystem => "permission denied".into(),
                    _ => "write failed".into(),
                }
            }
            DeliveryError::WebhookTimedOut { .. } => "timeout".into(),
            DeliveryError::AddressNotAllowed { .. } => "address not allowed".into(),
            DeliveryError::WebhookUnreachable { source, .. } => unreachable_because(source).into(),
            DeliveryError::WebhookRedirected { status, .. } => {
                format!("HTTP {} (redirects are not followed)", status.as_u16())
            }
            DeliveryError::WebhookRefused { status, .. } => format!("HTTP {}", status.as_u16()),
        }
    }
}

/// Why a webhook could not be reached, told apart by the causes under
/// reqwest's error: an operator fixes a refused port, an unknown host and
/// a dropped connection in different places.
fn unreachable_because(error: &reqwest::Error) -> &'static str {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return "connection refused";
        }
        // hyper-util's resolver failure has no type of its own to match.
        if e.to_string().starts_with("dns error") {
            return "host not found";
        }
        cause = e.source();
    }
    "connection failed"
}

/// The JSON a document is delivered as. The same document always gives the
/// same bytes, so a repeated delivery writes the same content.
#[derive(Serialize)]
struct DocumentJson<'a> {
    id: &'a str,
    project: &'a str,
    #[serde(rename = "type")]
    doc_type: &'a str,
    seq: i64,
    metadata: &'a RawValue,
    created_at: String,
}

impl Delivery {
    fn json(&self) -> Result<Vec<u8>, DeliveryError> {
        let payload = self
            .payload
            .as_deref()
            .ok_or(DeliveryError::PayloadNotLoaded)?;
        let stored = |e| DeliveryError::StoredMetadata(Arc::new(e));
        let metadata: &RawValue = serde_json::from_str(payload).map_err(stored)?;
        serde_json::to_vec(&DocumentJson {
            id: &self.document_id,
            project: &self.project,
            doc_type: &self.doc_type,
            seq: self.seq,
            metadata,
            created_at: self.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        })
        .map_err(stored)
    }
}

/// Largest webhook answer read (only an excerpt is kept, for `last_error`).
const MAX_WEBHOOK_ANSWER: usize = 64 * 1024;
/// Shortest signing key accepted (Standard Webhooks asks for 24 to 64 bytes).
const MIN_SECRET_BYTES: usize = 16;

pub struct SinkSettings {
    /// Webhook: time allowed per delivery.
    pub timeout: Duration,
    /// Webhook: deliveries in flight.
    pub concurrency: usize,
    pub instance_id: String,
    /// Webhook: the signing key (`whsec_<base64>`, or the bytes as given).
    pub secret: Option<String>,
    /// Webhook: the time each delivery is signed with.
    pub clock: Arc<dyn Clock>,
}

pub struct Webhook {
    url: String,
    /// The URL without credentials, query or fragment: what errors and
    /// logs may show.
    shown_url: String,
    client: reqwest::Client,
    concurrency: usize,
    /// Time allowed per delivery.
    timeout: Duration,
    instance_id: String,
    key: Vec<u8>,
    clock: Arc<dyn Clock>,
}

pub enum Sink {
    Postgres,
    Dir(PathBuf),
    Webhook(Box<Webhook>),
}

impl Sink {
    pub fn build(config: &SinkConfig, settings: &SinkSettings) -> anyhow::Result<Self> {
        Ok(match config {
            SinkConfig::Postgres => Sink::Postgres,
            SinkConfig::Dir(dir) => {
                std::fs::create_dir_all(dir)?;
                Sink::Dir(dir.clone())
            }
            SinkConfig::Webhook(url) => {
                let secret = settings.secret.as_deref().ok_or_else(|| {
                    anyhow::anyhow!(
                        "IDPOOL_WEBHOOK_SECRET is required with a webhook: sink (deliveries are signed)"
                    )
                })?;
                Sink::Webhook(Box::new(Webhook {
                    url: url.clone(),
                    shown_url: crate::infra::redact::url_without_secrets(url),
                    // A redirect would send the document somewhere the
                    // operator did not name: it counts as a failure.
                    client: reqwest::Client::builder()
                        .timeout(settings.timeout)
                        .redirect(reqwest::redirect::Policy::none())
                        .build()?,
                    concurrency: settings.concurrency.max(1),
                    timeout: settings.timeout,
                    instance_id: settings.instance_id.clone(),
                    key: signing_key(secret)?,
                    clock: settings.clock.clone(),
                }))
            }
        })
    }

    pub fn needs_payload(&self) -> bool {
        !matches!(self, Sink::Postgres)
    }

    /// Delivers each document; one result per delivery, in order. The
    /// Postgres sink writes inside the processor's transaction.
    pub async fn deliver(
        &self,
        conn: &mut Tx<'_>,
        batch: &[Delivery],
    ) -> Vec<Result<(), DeliveryError>> {
        match self {
            Sink::Postgres => {
                let outcome = upsert_documents(conn, batch)
                    .await
                    .map_err(|e| DeliveryError::Postgres(Arc::new(e)));
                batch.iter().map(|_| outcome.clone()).collect()
            }
            Sink::Dir(dir) => {
                let dir = dir.clone();
                let batch = batch.to_vec();
                let count = batch.len();
                tokio::task::spawn_blocking(move || write_files(&dir, &batch))
                    .await
                    .unwrap_or_else(|e| vec![Err(DeliveryError::Writer(Arc::new(e))); count])
            }
            Sink::Webhook(_) => self.deliver_unheld(batch).await,
        }
    }

    /// The webhook, whose deliveries hold no transaction.
    pub fn webhook(&self) -> Option<&Webhook> {
        match self {
            Sink::Webhook(webhook) => Some(webhook),
            _ => None,
        }
    }

    /// Delivers each document to the webhook (the other sinks need a
    /// transaction: nothing is delivered); one result per delivery.
    pub async fn deliver_unheld(&self, batch: &[Delivery]) -> Vec<Result<(), DeliveryError>> {
        let Sink::Webhook(webhook) = self else {
            return batch
                .iter()
                .map(|_| Err(DeliveryError::PayloadNotLoaded))
                .collect();
        };
        // Owned futures: borrowed ones trip the compiler's Send check
        // for higher-ranked lifetimes inside a spawned task.
        let posts: Vec<_> = batch
            .iter()
            .cloned()
            .map(|delivery| {
                let client = webhook.client.clone();
                let target = Target {
                    url: webhook.url.clone(),
                    shown_url: webhook.shown_url.clone(),
                    instance_id: webhook.instance_id.clone(),
                    keys: vec![webhook.key.clone()],
                    clock: webhook.clock.clone(),
                };
                async move { post(&client, &target, &delivery).await.map(|_| ()) }
            })
            .collect();
        futures::stream::iter(posts)
            .buffered(webhook.concurrency)
            .collect()
            .await
    }
}

impl Webhook {
    /// Rows one step claims: a few rounds of its concurrency, so a claim
    /// need not outlast more than a few timeouts.
    pub fn batch_limit(&self) -> i64 {
        (self.concurrency * WEBHOOK_ROUNDS) as i64
    }

    /// The longest a batch of [`Webhook::batch_limit`] can take, and a
    /// margin: how long its claim holds.
    pub fn longest_batch(&self) -> Duration {
        self.timeout * WEBHOOK_ROUNDS as u32 + Duration::from_secs(30)
    }
}

/// Rounds of the webhook's concurrency in one batch.
const WEBHOOK_ROUNDS: usize = 4;

async fn upsert_documents(conn: &mut Tx<'_>, batch: &[Delivery]) -> Result<(), sqlx::Error> {
    let ids: Vec<i64> = batch.iter().map(|d| d.row_id).collect();
    // A savepoint: a failed insert must not abort the claim transaction.
    let mut savepoint = conn.begin().await?;
    sqlx::query!(
        "INSERT INTO documents (document_id, project, doc_type, seq, metadata, created_at) \
         SELECT document_id, tenant_code, entity_type_id, seq_number, payload, created_at \
         FROM id_outbox WHERE id = ANY($1) \
         ON CONFLICT (document_id) DO UPDATE SET metadata = EXCLUDED.metadata, delivered_at = now()",
        &ids,
    )
    .execute(&mut savepoint)
    .await?;
    savepoint.commit().await
}

/// Letters, digits, `-`, `_` and `.` stay as they are.
const FILE_NAME_KEEPS: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.');

/// `PROJ/001` → `PROJ%2F001`: anything else is percent-encoded, and so is
/// a leading `.` (no hidden files, no `..`), so every ID is one safe file
/// name.
pub fn file_name(document_id: &str) -> String {
    let (first, rest) = match document_id.strip_prefix('.') {
        Some(rest) => ("%2E", rest),
        None => ("", document_id),
    };
    format!(
        "{first}{}.json",
        percent_encoding::utf8_percent_encode(rest, FILE_NAME_KEEPS)
    )
}

/// Writes every file, then syncs the directory once, so the renames of
/// the whole batch are durable before the batch is recorded as delivered.
fn write_files(dir: &Path, batch: &[Delivery]) -> Vec<Result<(), DeliveryError>> {
    write_files_then(dir, batch, |dir| std::fs::File::open(dir)?.sync_all())
}

/// [`write_files`] with the directory's sync given, so a test can watch
/// when it happens.
fn write_files_then(
    dir: &Path,
    batch: &[Delivery],
    sync_dir: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Vec<Result<(), DeliveryError>> {
    let mut outcomes: Vec<_> = batch.iter().map(|d| write_file(dir, d)).collect();
    if outcomes.iter().any(Result::is_ok) {
        let synced = sync_dir(dir);
        if let Err(e) = synced {
            let error = DeliveryError::SyncDir {
                dir: dir.to_owned(),
                source: Arc::new(e),
            };
            for outcome in outcomes.iter_mut().filter(|o| o.is_ok()) {
                *outcome = Err(error.clone());
            }
        }
    }
    outcomes
}

/// The file is written under a hidden temporary name beside its target,
/// synced, then renamed over it: a reader sees the old file or the whole
/// new one. The temporary file is removed on every way out short of the
/// rename, a panic included.
fn write_file(dir: &Path, delivery: &Delivery) -> Result<(), DeliveryError> {
    use std::io::Write;
    let body = delivery.json()?;
    let name = file_name(&delivery.document_id);
    let target = dir.join(&name);
    let write = || -> std::io::Result<()> {
        let mut file = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".tmp")
            .tempfile_in(dir)?;
        file.write_all(&body)?;
        file.as_file().sync_all()?;
        file.persist(&target).map_err(|e| e.error)?;
        Ok(())
    };
    write().map_err(|e| DeliveryError::File {
        path: target,
        source: Arc::new(e),
    })
}

/// What one delivery needs of its target: where it goes, what may be
/// shown of that, and the keys it is signed with (several during a
/// rotation of an endpoint's secret, one signature each).
pub struct Target {
    pub url: String,
    pub shown_url: String,
    pub instance_id: String,
    pub keys: Vec<Vec<u8>>,
    pub clock: Arc<dyn Clock>,
}

/// The HMAC key: Standard Webhooks secrets are `whsec_` and base64.
pub fn signing_key(secret: &str) -> anyhow::Result<Vec<u8>> {
    use base64::Engine as _;
    let key = match secret.strip_prefix("whsec_") {
        Some(encoded) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|_| {
                anyhow::anyhow!("IDPOOL_WEBHOOK_SECRET: whsec_ must be followed by base64")
            })?,
        None => secret.as_bytes().to_vec(),
    };
    if key.len() < MIN_SECRET_BYTES {
        anyhow::bail!("IDPOOL_WEBHOOK_SECRET must hold at least {MIN_SECRET_BYTES} bytes");
    }
    Ok(key)
}

/// `v1,<base64 of HMAC-SHA256 over "{id}.{timestamp}.{body}">`.
pub fn signature(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    use base64::Engine as _;
    use hmac::{KeyInit, Mac};
    let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key)
        .expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let tag = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag)
    )
}

/// Posts one document; the status the target answered when it took it.
pub async fn post(
    client: &reqwest::Client,
    target: &Target,
    delivery: &Delivery,
) -> Result<reqwest::StatusCode, DeliveryError> {
    let body = delivery.json()?;
    let timestamp = target.clock.now().timestamp();
    // Standard Webhooks: several signatures are separated by spaces, and a
    // verifier accepts the message when one of them matches.
    let signed = target
        .keys
        .iter()
        .map(|key| signature(key, &delivery.document_id, timestamp, &body))
        .collect::<Vec<_>>()
        .join(" ");
    let shown = &target.shown_url;
    let mut response = client
        .post(&target.url)
        .header("content-type", "application/json")
        .header("idempotency-key", &delivery.document_id)
        .header("webhook-id", &delivery.document_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signed)
        .header("idpool-instance", &target.instance_id)
        .body(body)
        .send()
        .await
        .map_err(|e| {
            // reqwest's message names the full URL; ours names what may be shown.
            let e = e.without_url();
            let url = shown.clone();
            if e.is_timeout() {
                DeliveryError::WebhookTimedOut {
                    url,
                    source: Arc::new(e),
                }
            } else {
                DeliveryError::WebhookUnreachable {
                    url,
                    source: Arc::new(e),
                }
            }
        })?;
    let status = response.status();
    if status.is_success() {
        // Read to its end (within the bound) though nobody looks at it:
        // only a connection whose answer was read goes back to the pool
        // for the next delivery; an unread one costs a new connection (and
        // TLS handshake) per delivery. A read that fails after the 2xx
        // changes nothing: the target took the document.
        read_answer(&mut response, false).await;
        return Ok(status);
    }
    let answer = read_answer(&mut response, true).await;
    // For the operator's log line only, with control characters escaped
    // (a target may answer NUL, binary or gzip).
    let excerpt: String = String::from_utf8_lossy(&answer)
        .chars()
        .take(200)
        .collect::<String>()
        .escape_debug()
        .to_string();
    if status.is_redirection() {
        return Err(DeliveryError::WebhookRedirected {
            url: shown.clone(),
            status,
        });
    }
    Err(DeliveryError::WebhookRefused {
        url: shown.clone(),
        status,
        excerpt,
    })
}

/// Reads up to [`MAX_WEBHOOK_ANSWER`] bytes of an answer, whatever the
/// server sends; returns them when `keep`.
async fn read_answer(response: &mut reqwest::Response, keep: bool) -> Vec<u8> {
    let mut answer = Vec::new();
    let mut read = 0;
    while read < MAX_WEBHOOK_ANSWER {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                read += chunk.len();
                if keep {
                    answer.extend_from_slice(&chunk);
                }
            }
            _ => break,
        }
    }
    answer.truncate(MAX_WEBHOOK_ANSWER);
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target answering 8 MiB: the answer is read up to 64 KiB (and a
    /// last chunk), the rest left unread, however much the target sends.
    #[tokio::test]
    async fn an_answer_is_read_up_to_64_kib_whatever_its_size() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const SENT: usize = 8 * 1024 * 1024;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            let head = format!("HTTP/1.1 500 Oops\r\ncontent-length: {SENT}\r\n\r\n");
            let _ = socket.write_all(head.as_bytes()).await;
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..SENT / chunk.len() {
                if socket.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
        let mut response = reqwest::Client::new()
            .post(format!("http://{address}/"))
            .send()
            .await
            .unwrap();
        let kept = read_answer(&mut response, true).await;
        assert_eq!(kept.len(), MAX_WEBHOOK_ANSWER);
        let mut left = 0;
        while let Ok(Some(chunk)) = response.chunk().await {
            left += chunk.len();
        }
        let consumed = SENT - left;
        assert!(
            consumed <= 2 * MAX_WEBHOOK_ANSWER,
            "{consumed} bytes of the answer were read"
        );
    }

    #[test]
    fn sinks_parse_from_their_spec_names() {
        assert_eq!("postgres".parse(), Ok(SinkConfig::Postgres));
        assert_eq!(
            "dir:/tmp/docs".parse(),
            Ok(SinkConfig::Dir("/tmp/docs".into()))
        );
        assert_eq!(
            "webhook:https://example.test/hook".parse(),
            Ok(SinkConfig::Webhook("https://example.test/hook".into()))
        );
        assert!("dir:".parse::<SinkConfig>().is_err());
        assert!("webhook:ftp://x".parse::<SinkConfig>().is_err());
        assert!("s3:bucket".parse::<SinkConfig>().is_err());
    }

    #[test]
    fn webhook_urls_no_delivery_could_use_are_refused_without_repeating_them() {
        for unusable in [
            "webhook:https://hooks.example:999999/in",
            "webhook:http://",
            "webhook:https:///in",
            "webhook:https://u:12#Secret@hooks.example/in",
            "webhook:ftp://u:Secret@hooks.example/in",
            "s3://u:Secret@bucket",
        ] {
            let reason = unusable.parse::<SinkConfig>().expect_err(unusable);
            assert!(!reason.contains("Secret"), "{unusable}: {reason}");
            assert!(!reason.contains("hooks.example"), "{unusable}: {reason}");
        }
        assert!(
            "webhook:https://u:12%23Secret@hooks.example:8443/in?t=1"
                .parse::<SinkConfig>()
                .is_ok()
        );
    }

    #[tokio::test]
    async fn an_unreachable_webhook_is_told_apart_by_its_cause() {
        let client = reqwest::Client::new();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        for (url, said) in [
            (format!("http://127.0.0.1:{port}/"), "connection refused"),
            ("http://no-such-host.invalid/".into(), "host not found"),
        ] {
            let error = client.post(&url).send().await.expect_err(&url);
            assert_eq!(unreachable_because(&error), said, "{url}: {error:?}");
        }
    }

    #[test]
    fn signatures_follow_standard_webhooks() {
        // The example of the Standard Webhooks specification.
        let key = signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signature(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert!(signing_key("short").is_err());
        assert!(signing_key("whsec_!!!").is_err());
    }

    fn delivery(document_id: &str) -> Delivery {
        Delivery {
            row_id: 1,
            document_id: document_id.to_owned(),
            project: "PROJ".into(),
            doc_type: "1".into(),
            seq: 1,
            created_at: Utc::now(),
            payload: Some(r#"{"n": 1}"#.into()),
        }
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The directory is synced once per batch, after every file of it is
    /// in place under its own name and no temporary file is left; a sync
    /// that fails fails every delivery it was to make durable.
    #[test]
    fn the_dir_sink_syncs_the_directory_after_the_renames() {
        let dir = tempfile::tempdir().expect("temp dir");
        let batch = [delivery("PROJ-1-1"), delivery("PROJ-1-2")];
        let mut seen_at_sync = None;
        let outcomes = write_files_then(dir.path(), &batch, |at| {
            seen_at_sync = Some(names_in(at));
            Ok(())
        });
        assert!(outcomes.iter().all(Result::is_ok));
        assert_eq!(
            seen_at_sync.expect("the directory was synced"),
            ["PROJ-1-1.json", "PROJ-1-2.json"]
        );

        let failed = write_files_then(dir.path(), &batch, |_| {
            Err(std::io::Error::other("no sync"))
        });
        assert!(
            failed
                .iter()
                .all(|o| matches!(o, Err(DeliveryError::SyncDir { .. })))
        );
    }

    #[test]
    fn a_file_that_cannot_be_put_in_place_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        // The target name is taken by a directory that is not empty: the
        // rename fails.
        let blocking = dir.path().join("PROJ-1-1.json");
        std::fs::create_dir(&blocking).expect("dir");
        std::fs::write(blocking.join("inside"), b"x").expect("file");
        let outcome = write_file(dir.path(), &delivery("PROJ-1-1"));
        assert!(matches!(outcome, Err(DeliveryError::File { .. })));
        assert_eq!(names_in(dir.path()), ["PROJ-1-1.json"]);
    }

    #[test]
    fn every_id_becomes_one_safe_file_name() {
        assert_eq!(file_name("PROJ-9012-1001"), "PROJ-9012-1001.json");
        assert_eq!(file_name("PROJ/001"), "PROJ%2F001.json");
        assert_eq!(file_name(".."), "%2E..json");
        assert_ne!(file_name("a/b"), file_name("a%2Fb"));
    }
}
