//! `idpool import`: a customer's legacy documents, streamed from a JSON-lines
//! or CSV file into `POST /api/v1/documents/batch`.
//!
//! Every document is sent with its `source_id`, which the server records
//! with it (one document per source id of a project and type, for ever):
//! a run killed at any moment and started again, days later or with
//! another key, gets every document it already sent answered from the
//! server's records (same ID, `replayed`) and creates no document twice.
//! A document the server refuses is a reject line, never the end of the
//! run. The file is read as it is sent: memory holds the batches in flight
//! and 8 bytes per source id seen (to find duplicates), whatever the file's
//! size.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::domain::sequence::{ProjectCode, TypeCode};
use crate::features::documents::{MAX_BATCH, MAX_METADATA_BYTES};

/// Bodies stay well under the server's 32 MiB batch limit.
const MAX_BATCH_BYTES: usize = 16 * 1024 * 1024;
/// Retries of one batch the server cannot take now (429, 503, a lost
/// connection) before the run gives up.
const MAX_ATTEMPTS: u32 = 12;

#[derive(Debug, Clone)]
pub struct Settings {
    /// A file path, or `-` for standard input.
    pub file: String,
    pub project: ProjectCode,
    pub doc_type: TypeCode,
    pub url: String,
    pub key: Option<String>,
    pub batch: usize,
    pub concurrency: usize,
    /// The mapping; standard output when `None`.
    pub out: Option<PathBuf>,
}

/// What a run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub imported: u64,
    pub replayed: u64,
    pub rejected: u64,
}

/// One line of the mapping, in input order.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Mapped {
    pub source_id: String,
    pub id: String,
    pub replayed: bool,
}

/// One line the run could not import, and why.
#[derive(Debug, Serialize)]
struct Reject {
    line: u64,
    source_id: Option<String>,
    reason: String,
}

/// A line read from the file.
enum Entry {
    Document { source_id: String, body: String },
    Reject(Reject),
}

/// What became of a line.
enum LineFate {
    Mapped(Mapped),
    Reject(Reject),
}

/// Where rejects go: `MAP.rejects.jsonl` beside `--out MAP.jsonl`, else
/// `import.rejects.jsonl` in the working directory.
pub fn rejects_path(out: Option<&Path>) -> PathBuf {
    match out {
        Some(out) => {
            let stem = out
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "import".into());
            out.with_file_name(format!("{stem}.rejects.jsonl"))
        }
        None => PathBuf::from("import.rejects.jsonl"),
    }
}

pub async fn run(settings: Settings) -> anyhow::Result<Report> {
    refuse_overwriting_the_input(&settings)?;
    let settings = std::sync::Arc::new(settings);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let (chunks_tx, chunks_rx) =
        tokio::sync::mpsc::channel::<Vec<(u64, Entry)>>(settings.concurrency.max(1));
    let total_bytes = (settings.file != "-")
        .then(|| std::fs::metadata(&settings.file).map(|m| m.len()).ok())
        .flatten();
    let progress = ImportProgress::new(total_bytes);
    let read_progress = progress.bytes_handle();
    let reader_settings = settings.clone();
    let reader = tokio::task::spawn_blocking(move || {
        read_file(&reader_settings, &chunks_tx, &read_progress)
    });
    let mut out: Box<dyn Write + Send> = match &settings.out {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
    };
    let rejects_at = rejects_path(settings.out.as_deref());
    let mut rejects: Option<std::io::BufWriter<std::fs::File>> = None;
    let mut report = Report::default();
    // Batches go out `concurrency` at a time and come back in input order.
    let mut results = tokio_stream_of(chunks_rx)
        .map(|chunk| {
            let (client, settings) = (client.clone(), settings.clone());
            async move { send_chunk(&client, &settings, chunk).await }
        })
        .buffered(settings.concurrency.max(1));
    while let Some(fates) = results.next().await {
        for fate in fates? {
            match fate {
                LineFate::Mapped(mapped) => {
                    report.imported += 1;
                    report.replayed += u64::from(mapped.replayed);
                    serde_json::to_writer(&mut out, &mapped)?;
                    out.write_all(b"\n")?;
                }
                LineFate::Reject(reject) => {
                    report.rejected += 1;
                    let file = match &mut rejects {
                        Some(file) => file,
                        None => rejects.insert(std::io::BufWriter::new(
                            std::fs::File::create(&rejects_at)
                                .with_context(|| format!("creating {}", rejects_at.display()))?,
                        )),
                    };
                    serde_json::to_writer(&mut *file, &reject)?;
                    file.write_all(b"\n")?;
                }
            }
        }
        out.flush()?;
        progress.update(&report);
    }
    reader.await??;
    if let Some(mut file) = rejects {
        file.flush()?;
    }
    progress.finish(&report);
    Ok(report)
}

fn tokio_stream_of<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Reads the file into chunks of at most `batch` documents (and
/// `MAX_BATCH_BYTES`), rejecting lines it can tell are bad.
fn read_file(
    settings: &Settings,
    chunks: &tokio::sync::mpsc::Sender<Vec<(u64, Entry)>>,
    bytes_read: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> anyhow::Result<()> {
    let mut input: Box<dyn BufRead> = if settings.file == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(&settings.file)
                .with_context(|| format!("opening {}", settings.file))?,
        ))
    };
    skip_byte_order_mark(&mut input).context("reading the input")?;
    let mut chunker = Chunker {
        settings,
        chunks,
        seen: HashSet::new(),
        chunk: Vec::new(),
        documents: 0,
        bytes: 0,
        batch: settings.batch.clamp(1, MAX_BATCH),
    };
    let set_read = |n: u64| bytes_read.store(n, std::sync::atomic::Ordering::Relaxed);
    if settings.file.to_ascii_lowercase().ends_with(".csv") {
        let mut reader = csv::ReaderBuilder::new().flexible(false).from_reader(input);
        let headers = reader.headers().context("reading the CSV header")?.clone();
        let source_column = csv_source_column(&headers)?;
        for (n, record) in reader.records().enumerate() {
            let parsed = match record {
                Err(e) => Err((None, format!("not a CSV record: {e}"))),
                Ok(record) => {
                    set_read(record.position().map_or(0, |p| p.byte()));
                    csv_document(&headers, source_column, &record)
                }
            };
            chunker.push(n as u64 + 2, parsed)?;
        }
    } else {
        // Lines as bytes: one that is not UTF-8 is a reject of its own,
        // never the end of the run.
        let mut read = 0u64;
        for (n, bytes) in input.split(b'\n').enumerate() {
            let mut bytes = bytes.context("reading the input")?;
            read += bytes.len() as u64 + 1;
            set_read(read);
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
            let line = n as u64 + 1;
            match String::from_utf8(bytes) {
                Ok(text) if text.trim().is_empty() => {}
                Ok(text) => chunker.push(line, json_document(&text))?,
                Err(e) => {
                    let reason = format!("not UTF-8 text: {}", e.utf8_error());
                    chunker.push(line, Err((None, reason)))?;
                }
            }
        }
    }
    chunker.send()
}

/// A UTF-8 byte-order mark at the start of the input is no part of its
/// first line (editors on Windows write one).
fn skip_byte_order_mark(input: &mut dyn BufRead) -> std::io::Result<()> {
    const MARK: &[u8] = b"\xEF\xBB\xBF";
    if input.fill_buf()?.starts_with(MARK) {
        input.consume(MARK.len());
    }
    Ok(())
}

/// Which column of a CSV header is `source_id`. A header that names a
/// column twice is refused: one of the two would silently become the
/// other's value (or a second `source_id` part of the metadata).
fn csv_source_column(headers: &csv::StringRecord) -> anyhow::Result<usize> {
    let mut seen = HashSet::new();
    for (i, name) in headers.iter().enumerate() {
        if !seen.insert(name) {
            let first = headers.iter().position(|h| h == name).unwrap_or(i);
            bail!(
                "the CSV header names the column {name:?} twice (columns {} and {}); \
                 each column must have a name of its own",
                first + 1,
                i + 1
            );
        }
    }
    headers
        .iter()
        .position(|h| h == "source_id")
        .context("the CSV file has no source_id column")
}

/// A line read: `(source_id, metadata)`, or why it is no document.
type Parsed = Result<(String, String), (Option<String>, String)>;

/// Turns parsed lines into entries and entries into chunks for the sender.
struct Chunker<'a> {
    settings: &'a Settings,
    chunks: &'a tokio::sync::mpsc::Sender<Vec<(u64, Entry)>>,
    /// Hashes of the source ids seen so far.
    /// 128 bits of each source id's SHA-256: in a run of a billion lines
    /// two different ids share one with a chance of about 1 in 10^20 (64
    /// bits: 1 in 40); 16 bytes a line.
    seen: HashSet<u128>,
    chunk: Vec<(u64, Entry)>,
    documents: usize,
    bytes: usize,
    batch: usize,
}

impl Chunker<'_> {
    fn push(&mut self, line: u64, parsed: Parsed) -> anyhow::Result<()> {
        let entry = self.entry(line, parsed);
        if let Entry::Document { body, .. } = &entry {
            if self.documents >= self.batch || self.bytes + body.len() > MAX_BATCH_BYTES {
                self.send()?;
            }
            self.documents += 1;
            self.bytes += body.len() + 1;
        }
        self.chunk.push((line, entry));
        Ok(())
    }

    /// Hands the chunk so far to the sender (nothing if it is empty).
    fn send(&mut self) -> anyhow::Result<()> {
        self.documents = 0;
        self.bytes = 0;
        if self.chunk.is_empty() {
            return Ok(());
        }
        self.chunks
            .blocking_send(std::mem::take(&mut self.chunk))
            .map_err(|_| anyhow::anyhow!("the sender stopped"))
    }

    fn entry(&mut self, line: u64, parsed: Parsed) -> Entry {
        let reject = |source_id, reason| {
            Entry::Reject(Reject {
                line,
                source_id,
                reason,
            })
        };
        let (source_id, metadata) = match parsed {
            Err((source_id, reason)) => return reject(source_id, reason),
            Ok(document) => document,
        };
        if source_id.contains('\0') {
            let reason = "source_id contains NUL, which cannot be stored".into();
            return reject(Some(source_id.replace('\0', "\\u0000")), reason);
        }
        if !self.seen.insert(fingerprint(&source_id)) {
            let reason = "duplicate source_id: an earlier line has it".into();
            return reject(Some(source_id), reason);
        }
        if let Some(what) = crate::edge::http::extract::unstorable_escape(metadata.as_bytes()) {
            let reason = format!("metadata contains {what}, which cannot be stored");
            return reject(Some(source_id), reason);
        }
        if metadata.len() > MAX_METADATA_BYTES {
            let reason = format!(
                "metadata is {} bytes; the limit is {MAX_METADATA_BYTES}",
                metadata.len()
            );
            return reject(Some(source_id), reason);
        }
        let body = document_body(self.settings, &source_id, &metadata);
        Entry::Document { source_id, body }
    }
}

/// A line of a JSON lines file. Any other field is refused, as the HTTP
/// API refuses unknown fields: a misspelt `metadata` must not import a
/// document without its metadata.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonLine<'a> {
    #[serde(borrow)]
    source_id: Option<&'a RawValue>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
}

/// `(source_id, metadata)` of a JSON line.
fn json_document(text: &str) -> Result<(String, String), (Option<String>, String)> {
    let line: JsonLine = serde_json::from_str(text).map_err(|e| match e.classify() {
        // A JSON object, with a field it may not have: its source id, if
        // it has one, names the reject.
        serde_json::error::Category::Data => (loose_source_id(text), e.to_string()),
        _ => (None, format!("not a JSON object: {e}")),
    })?;
    let source_id = match line
        .source_id
        .map(|raw| serde_json::from_str::<Value>(raw.get()))
    {
        Some(Ok(Value::String(s))) if !s.is_empty() => s,
        // As written: parsed, a number past 2^64 would become a float and
        // two such ids one.
        Some(Ok(Value::Number(_))) => line.source_id.map_or("", |raw| raw.get().trim()).to_owned(),
        _ => return Err((None, "no source_id (a non-empty string or a number)".into())),
    };
    let metadata = match line.metadata {
        Some(raw) if raw.get().trim_start().starts_with('{') => raw.get().to_owned(),
        Some(_) => return Err((Some(source_id), "metadata must be a JSON object".into())),
        None => "{}".to_owned(),
    };
    Ok((source_id, metadata))
}

/// The `source_id` of a line refused for its other fields, when it is a
/// string or a number.
fn loose_source_id(text: &str) -> Option<String> {
    let object: std::collections::HashMap<&str, &RawValue> = serde_json::from_str(text).ok()?;
    let raw = object.get("source_id")?.get().trim();
    match serde_json::from_str::<Value>(raw).ok()? {
        Value::String(s) if !s.is_empty() => Some(s),
        // As written, like an accepted line's.
        Value::Number(_) => Some(raw.to_owned()),
        _ => None,
    }
}

/// A CSV record: `source_id` and the other columns as metadata strings.
fn csv_document(
    headers: &csv::StringRecord,
    source_column: usize,
    record: &csv::StringRecord,
) -> Result<(String, String), (Option<String>, String)> {
    let source_id = record.get(source_column).unwrap_or("").to_owned();
    if source_id.is_empty() {
        return Err((None, "no source_id".into()));
    }
    let metadata: serde_json::Map<String, Value> = headers
        .iter()
        .zip(record.iter())
        .enumerate()
        .filter(|(i, _)| *i != source_column)
        .map(|(_, (name, value))| (name.to_owned(), Value::String(value.to_owned())))
        .collect();
    let metadata =
        serde_json::to_string(&metadata).map_err(|e| (Some(source_id.clone()), e.to_string()))?;
    Ok((source_id, metadata))
}

/// One item of the batch body, ready to join.
fn document_body(settings: &Settings, source_id: &str, metadata: &str) -> String {
    let source_id = Value::String(source_id.to_owned());
    format!(
        r#"{{"project":"{}","type":"{}","source_id":{source_id},"metadata":{metadata}}}"#,
        settings.project, settings.doc_type
    )
}

#[derive(Deserialize)]
struct Imported {
    documents: Vec<AcceptedItem>,
}

#[derive(Deserialize)]
struct AcceptedItem {
    id: String,
    #[serde(default)]
    replayed: bool,
}

#[derive(Deserialize)]
struct LineProblem {
    code: Option<String>,
    detail: Option<String>,
    index: Option<usize>,
}

/// Sends a chunk's documents until each is accepted or rejected.
async fn send_chunk(
    client: &reqwest::Client,
    settings: &Settings,
    chunk: Vec<(u64, Entry)>,
) -> anyhow::Result<Vec<LineFate>> {
    let (mut fates, mut pending) = split_chunk(chunk);
    let url = format!(
        "{}/api/v1/documents/batch",
        settings.url.trim_end_matches('/')
    );
    let mut attempt = 0;
    while !pending.is_empty() {
        let body = batch_body(pending.iter().map(|(_, _, _, item)| item.as_str()));
        let (status, text, retry_after) =
            post_batch(client, &url, settings.key.as_deref(), body).await;
        match status {
            Some(s) if s.as_u16() == 202 => map_accepted(&text, &mut pending, &mut fates)?,
            Some(s) if let Some(index) = item_at_fault(s, &text, pending.len()) => {
                let problem: Option<LineProblem> = serde_json::from_str(&text).ok();
                // One document is at fault: it is rejected, the rest go again.
                let (slot, line, source_id, _) = pending.remove(index);
                let reason = problem.map_or_else(|| s.to_string(), rejection_reason);
                fates[slot] = Some(LineFate::Reject(Reject {
                    line,
                    source_id: Some(source_id),
                    reason,
                }));
                attempt = 0;
            }
            Some(s) if s.is_client_error() && !matches!(s.as_u16(), 408 | 409 | 429) => {
                let problem: Option<LineProblem> = serde_json::from_str(&text).ok();
                let detail = problem.and_then(|p| p.detail.or(p.code)).unwrap_or(text);
                bail!("the server refused a batch: {s} {detail}");
            }
            // 408, 409 for the whole batch (a concurrent run writing the
            // same source ids), 429, 5xx, no answer: the same batch again,
            // after a while.
            _ => {
                attempt += 1;
                if attempt >= MAX_ATTEMPTS {
                    let what = status.map_or_else(|| text.clone(), |s| format!("{s} {text}"));
                    bail!("a batch failed {MAX_ATTEMPTS} times; the last answer: {what}");
                }
                tokio::time::sleep(retry_wait(attempt, retry_after)).await;
            }
        }
    }
    Ok(fates.into_iter().flatten().collect())
}

/// A document on its way: its place among the chunk's fates, its line,
/// its source id and its batch item.
type Pending = (usize, u64, String, String);

/// The chunk's rejects, in place, and the documents still to send.
fn split_chunk(chunk: Vec<(u64, Entry)>) -> (Vec<Option<LineFate>>, Vec<Pending>) {
    let mut fates: Vec<Option<LineFate>> = Vec::with_capacity(chunk.len());
    let mut pending = Vec::new();
    for (line, entry) in chunk {
        match entry {
            Entry::Reject(reject) => fates.push(Some(LineFate::Reject(reject))),
            Entry::Document { source_id, body } => {
                pending.push((fates.len(), line, source_id, body));
                fates.push(None);
            }
        }
    }
    (fates, pending)
}

/// A batch accepted: each pending document gets the ID it was given.
fn map_accepted(
    text: &str,
    pending: &mut Vec<Pending>,
    fates: &mut [Option<LineFate>],
) -> anyhow::Result<()> {
    let accepted: Imported = serde_json::from_str(text).context("reading the batch answer")?;
    if accepted.documents.len() != pending.len() {
        bail!(
            "the server answered {} results for {} documents",
            accepted.documents.len(),
            pending.len()
        );
    }
    for ((slot, _, source_id, _), item) in pending.drain(..).zip(accepted.documents) {
        fates[slot] = Some(LineFate::Mapped(Mapped {
            source_id,
            id: item.id,
            replayed: item.replayed,
        }));
    }
    Ok(())
}

/// The item a refusal names (`index`), if the server blamed one: that
/// document is rejected and the rest of the batch goes again.
fn item_at_fault(status: reqwest::StatusCode, text: &str, items: usize) -> Option<usize> {
    if !status.is_client_error() || matches!(status.as_u16(), 408 | 429) {
        return None;
    }
    let problem: LineProblem = serde_json::from_str(text).ok()?;
    problem.index.filter(|i| *i < items)
}

/// `{"documents":[…]}` of documents already serialised.
fn batch_body<'a>(items: impl Iterator<Item = &'a str> + Clone) -> String {
    let size: usize = items.clone().map(|item| item.len() + 1).sum();
    let mut body = String::with_capacity(size + 20);
    body.push_str(r#"{"documents":["#);
    for (i, item) in items.enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push_str("]}");
    body
}

/// POSTs one batch: the answer's status, text and `Retry-After`, or no
/// status and what went wrong on the way.
async fn post_batch(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: String,
) -> (Option<reqwest::StatusCode>, String, Option<Duration>) {
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    match request.send().await {
        Ok(response) => {
            let status = response.status();
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|value| retry_after(value, std::time::SystemTime::now()));
            let text = response.text().await.unwrap_or_default();
            (Some(status), text, retry_after)
        }
        Err(e) => (None, e.without_url().to_string(), None),
    }
}

/// `code: detail` of a problem about one document, without the
/// `documents[i]: ` the server puts before the detail.
fn rejection_reason(problem: LineProblem) -> String {
    let code = problem.code.unwrap_or_default();
    let detail = problem.detail.unwrap_or_default();
    let detail = detail
        .split_once(": ")
        .filter(|(head, _)| head.starts_with("documents["))
        .map_or(detail.as_str(), |(_, rest)| rest);
    format!("{code}: {detail}")
}

/// The mapping and the rejects are created empty before the input is
/// read: naming the input for either would wipe it.
fn refuse_overwriting_the_input(settings: &Settings) -> anyhow::Result<()> {
    if settings.file == "-" {
        return Ok(());
    }
    let Ok(input) = std::fs::canonicalize(&settings.file) else {
        // Not there: reading it says so.
        return Ok(());
    };
    let outputs = [
        settings.out.clone(),
        Some(rejects_path(settings.out.as_deref())),
    ];
    for output in outputs.into_iter().flatten() {
        if std::fs::canonicalize(&output).is_ok_and(|output| output == input) {
            bail!(
                "{} is the input file; the mapping and the rejects go to other files (--out)",
                output.display()
            );
        }
    }
    Ok(())
}

/// The first 128 bits of `source_id`'s SHA-256.
fn fingerprint(source_id: &str) -> u128 {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(source_id.as_bytes());
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    u128::from_be_bytes(first)
}

/// The longest `Retry-After` the import honours: a server asking for more
/// is waited on for a minute, then asked again.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// `Retry-After` within [`MAX_RETRY_AFTER`]: seconds (what idpool sends,
/// however many digits) or an HTTP date (what a proxy in front may send).
fn retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    let asked = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(value.parse().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(value).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    Some(asked.min(MAX_RETRY_AFTER))
}

/// How long to wait before sending a batch again: at least what the
/// server asked for, else the backoff.
fn retry_wait(attempt: u32, retry_after: Option<Duration>) -> Duration {
    let backoff = backoff(attempt);
    retry_after.map_or(backoff, |asked| asked.max(backoff))
}

/// 200 ms doubling up to 10 s, with jitter so concurrent batches spread.
fn backoff(attempt: u32) -> Duration {
    let base = 200u64.saturating_mul(1 << attempt.min(6)).min(10_000);
    let jitter = rand::random_range(0..=base / 2);
    Duration::from_millis(base / 2 + jitter)
}

mod progress;
use progress::ImportProgress;

#[cfg(test)]
mod tests;
