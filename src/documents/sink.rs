//! Target stores the outbox processor delivers to (`IDPOOL_SINK`). Delivery
//! is at least once; each sink makes a repeat harmless.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures::StreamExt;
use serde::Serialize;
use serde_json::value::RawValue;
use sqlx::PgConnection;

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
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err("webhook: needs an http:// or https:// URL".into());
            }
            return Ok(SinkConfig::Webhook(url.to_owned()));
        }
        Err(format!(
            "unknown sink {s:?}: use postgres, dir:/path or webhook:https://..."
        ))
    }
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
    fn json(&self) -> Result<Vec<u8>, String> {
        let payload = self.payload.as_deref().ok_or("payload not loaded")?;
        let metadata: &RawValue =
            serde_json::from_str(payload).map_err(|e| format!("stored metadata: {e}"))?;
        serde_json::to_vec(&DocumentJson {
            id: &self.document_id,
            project: &self.project,
            doc_type: &self.doc_type,
            seq: self.seq,
            metadata,
            created_at: self.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        })
        .map_err(|e| e.to_string())
    }
}

pub enum Sink {
    Postgres,
    Dir(PathBuf),
    Webhook {
        url: String,
        client: reqwest::Client,
        concurrency: usize,
        instance_id: String,
    },
}

impl Sink {
    pub fn build(
        config: &SinkConfig,
        webhook_timeout: Duration,
        concurrency: usize,
        instance_id: &str,
    ) -> anyhow::Result<Self> {
        Ok(match config {
            SinkConfig::Postgres => Sink::Postgres,
            SinkConfig::Dir(dir) => {
                std::fs::create_dir_all(dir)?;
                Sink::Dir(dir.clone())
            }
            SinkConfig::Webhook(url) => Sink::Webhook {
                url: url.clone(),
                client: reqwest::Client::builder()
                    .timeout(webhook_timeout)
                    .build()?,
                concurrency: concurrency.max(1),
                instance_id: instance_id.to_owned(),
            },
        })
    }

    pub fn needs_payload(&self) -> bool {
        !matches!(self, Sink::Postgres)
    }

    /// Delivers each document; one result per delivery, in order. The
    /// Postgres sink writes inside the processor's transaction.
    pub async fn deliver(
        &self,
        conn: &mut PgConnection,
        batch: &[Delivery],
    ) -> Vec<Result<(), String>> {
        match self {
            Sink::Postgres => {
                let outcome = upsert_documents(conn, batch)
                    .await
                    .map_err(|e| e.to_string());
                batch.iter().map(|_| outcome.clone()).collect()
            }
            Sink::Dir(dir) => {
                let dir = dir.clone();
                let batch = batch.to_vec();
                let count = batch.len();
                tokio::task::spawn_blocking(move || {
                    batch.iter().map(|d| write_file(&dir, d)).collect()
                })
                .await
                .unwrap_or_else(|e| vec![Err(format!("writer task failed: {e}")); count])
            }
            Sink::Webhook {
                url,
                client,
                concurrency,
                instance_id,
            } => {
                // Owned futures: borrowed ones trip the compiler's Send check
                // for higher-ranked lifetimes inside a spawned task.
                let posts: Vec<_> = batch
                    .iter()
                    .cloned()
                    .map(|delivery| {
                        let client = client.clone();
                        let url = url.clone();
                        let instance_id = instance_id.clone();
                        async move { post(&client, &url, &instance_id, &delivery).await }
                    })
                    .collect();
                futures::stream::iter(posts)
                    .buffered(*concurrency)
                    .collect()
                    .await
            }
        }
    }
}

async fn upsert_documents(conn: &mut PgConnection, batch: &[Delivery]) -> Result<(), sqlx::Error> {
    let ids: Vec<i64> = batch.iter().map(|d| d.row_id).collect();
    // A savepoint: a failed insert must not abort the claim transaction.
    let mut savepoint = sqlx::Connection::begin(&mut *conn).await?;
    sqlx::query(
        "INSERT INTO documents (document_id, project, doc_type, seq, metadata, created_at) \
         SELECT document_id, tenant_code, entity_type_id, seq_number, payload, created_at \
         FROM id_outbox WHERE id = ANY($1) \
         ON CONFLICT (document_id) DO UPDATE SET metadata = EXCLUDED.metadata, delivered_at = now()",
    )
    .bind(&ids)
    .execute(&mut *savepoint)
    .await?;
    savepoint.commit().await
}

/// `PROJ/001` → `PROJ%2F001`: anything but letters, digits, `-`, `_` and
/// `.` is percent-encoded, so every ID is one safe file name.
pub fn file_name(document_id: &str) -> String {
    let mut name = String::with_capacity(document_id.len() + 5);
    for byte in document_id.bytes() {
        if byte.is_ascii_alphanumeric()
            || matches!(byte, b'-' | b'_')
            || (byte == b'.' && !name.is_empty())
        {
            name.push(byte as char);
        } else {
            name.push_str(&format!("%{byte:02X}"));
        }
    }
    name.push_str(".json");
    name
}

fn write_file(dir: &Path, delivery: &Delivery) -> Result<(), String> {
    use std::io::Write;
    let body = delivery.json()?;
    let target = dir.join(file_name(&delivery.document_id));
    let temp = dir.join(format!(
        ".{}.{}.tmp",
        file_name(&delivery.document_id),
        uuid::Uuid::new_v4().simple()
    ));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&temp)?;
        file.write_all(&body)?;
        file.sync_all()?;
        std::fs::rename(&temp, &target)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        format!("writing {}: {e}", target.display())
    })
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    instance_id: &str,
    delivery: &Delivery,
) -> Result<(), String> {
    let body = delivery.json()?;
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .header("idempotency-key", &delivery.document_id)
        .header("idpool-instance", instance_id)
        .body(body)
        .send()
        .await
        .map_err(|e| {
            if e.is_timeout() {
                format!("webhook timed out: {e}")
            } else {
                format!("webhook unreachable: {e}")
            }
        })?;
    let status = response.status();
    if status.is_success() {
        Ok(())
    } else {
        let text = response.text().await.unwrap_or_default();
        let excerpt: String = text.chars().take(200).collect();
        Err(format!("webhook answered {status}: {excerpt}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn every_id_becomes_one_safe_file_name() {
        assert_eq!(file_name("PROJ-9012-1001"), "PROJ-9012-1001.json");
        assert_eq!(file_name("PROJ/001"), "PROJ%2F001.json");
        assert_eq!(file_name(".."), "%2E..json");
        assert_ne!(file_name("a/b"), file_name("a%2Fb"));
    }
}
