//! Documents: accepted with their ID in one Postgres transaction (the
//! transactional outbox), then delivered to the target store by the outbox
//! processor.

pub mod delivery_queue;
mod handout_waits;
pub mod processor;
pub mod sink;

pub use handout_waits::HandoutWaits;

use std::collections::HashMap;
use std::sync::Arc;

use crate::infra::db::Tx;
use chrono::{DateTime, Utc};

use crate::domain::sequence::{IdShape, Numbering, ProjectCode, Register, Sequence, TypeCode};
use crate::domain::verifactu::Invoice;
use crate::infra::db::Link;
use crate::issuance::Placement;
use crate::issuance::{IssueError, Issuer, Want};
use crate::records::ledger::outbox_rows::{Attachment, DocumentStatus, OutboxRow};
use crate::records::ledger::reservations::{self, ReservationStatus};
use crate::records::ledger::{self, LedgerError, Via};

/// Largest `metadata` object (SPEC).
pub const MAX_METADATA_BYTES: usize = 256 * 1024;
/// Deepest nesting of arrays and objects in metadata (the metadata object
/// itself is level 1). Postgres parses the metadata as `jsonb`; far deeper
/// nesting exhausts its stack, which must never be a request's doing.
pub const MAX_METADATA_DEPTH: usize = 64;

/// How deeply the arrays and objects of well-formed JSON `raw` nest: one
/// pass over its bytes, brackets inside strings not counted.
pub fn nesting_depth(raw: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for byte in raw.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}
/// Why Postgres could not store, or would print far larger, the numbers
/// of well-formed JSON `raw`: `jsonb` keeps a number as `numeric` and
/// prints it in full, so `1e131000` (8 bytes sent) is 131,001 characters
/// in every read of the outbox and every delivery. Checked before any
/// number is taken for the document.
pub fn unstorable_numbers(raw: &str) -> Option<NumbersRefused> {
    use crate::domain::json_number::{Decimal, literals};
    let mut printed = raw.len() as u64;
    for literal in literals(raw) {
        let number = Decimal::parse(&raw[literal.clone()]);
        if !number.fits_postgres() {
            let text = &raw[literal];
            let shown = match text.char_indices().nth(24) {
                Some((cut, _)) => format!("{}…", &text[..cut]),
                None => text.to_owned(),
            };
            return Some(NumbersRefused::Unstorable(shown));
        }
        printed = printed
            .saturating_add(number.printed_len())
            .saturating_sub(literal.len() as u64);
    }
    (printed > MAX_METADATA_BYTES as u64).then_some(NumbersRefused::TooLargePrinted(printed))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NumbersRefused {
    /// A number past `numeric`'s digits (its first characters).
    Unstorable(String),
    /// The metadata's length with every number printed in full.
    TooLargePrinted(u64),
}

/// Most documents in one batch (SPEC).
pub const MAX_BATCH: usize = 1000;

/// A validated document to accept.
#[derive(Debug, Clone)]
pub struct DocumentInput {
    pub project: ProjectCode,
    pub doc_type: TypeCode,
    /// The metadata object, as sent.
    pub metadata: Arc<str>,
    /// An ID from `POST /ids` to attach instead of taking a new number.
    pub id: Option<String>,
    /// The document's legacy id: a document with this one already in the
    /// project and type is answered instead of writing another.
    pub source_id: Option<Arc<str>>,
    /// The invoice fields of a document of a VERI*FACTU register (checked).
    pub invoice: Option<Arc<Invoice>>,
}

impl DocumentInput {
    /// What the document's outbox row carries besides its number.
    pub fn attachment(&self) -> Attachment {
        Attachment {
            project: self.project.to_string(),
            doc_type: self.doc_type.to_string(),
            payload: self.metadata.clone(),
            source_id: self.source_id.clone(),
            invoice: self
                .invoice
                .as_ref()
                .map(|i| Arc::from(serde_json::to_string(i.as_ref()).unwrap_or_default())),
        }
    }
}

/// A document accepted: written to the outbox with its ID.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub id: String,
    pub project: String,
    pub doc_type: String,
    /// The number its ID prints.
    pub seq: i64,
    pub status: DocumentStatus,
    pub created_at: DateTime<Utc>,
    /// A VERI*FACTU register's record of it.
    pub verifactu: Option<VerifactuRecord>,
}

/// How long a written VERI*FACTU document's answer waits to read its
/// record before it goes without.
const RECORD_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// The alta record a VERI*FACTU document got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifactuRecord {
    pub huella: String,
    pub qr_url: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    #[error(transparent)]
    Issue(IssueError),
    #[error("{id} cannot be attached: {reason}")]
    NotAttachable { id: String, reason: String },
    /// The request's own ID (never another tenant's data).
    #[error(
        "the ID {0} printed for this document is another document's already (two sequences print \
         the same IDs; give this one a format of its own)"
    )]
    IdTaken(String),
    /// Two items of one request carry the same source id.
    #[error("its source_id is the same as item {0}'s")]
    SourceIdRepeated(usize),
    /// A concurrent request wrote a document with the same source id.
    #[error("another request is writing a document with the same source_id; send this again")]
    SourceIdInUse,
    /// A document of a VERI*FACTU register came without its invoice.
    #[error(
        "{0} is a VERI*FACTU register: its documents carry \"invoice\" (date, type, tax_total, total)"
    )]
    InvoiceMissing(String),
    /// An invoice for a sequence that is no VERI*FACTU register.
    #[error("{0} is not a VERI*FACTU register: \"invoice\" would be ignored")]
    InvoiceUnexpected(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// Whether `input` carries an invoice exactly when its sequence is a
/// VERI*FACTU register.
fn check_invoice(sequence: &Sequence, input: &DocumentInput) -> Result<(), DocumentError> {
    let name = || format!("{}/{}", sequence.project, sequence.doc_type);
    match (&sequence.definition.register, &input.invoice) {
        (Register::Verifactu { .. }, None) => Err(DocumentError::InvoiceMissing(name())),
        (Register::Verifactu { .. }, Some(_)) | (_, None) => Ok(()),
        (_, Some(_)) => Err(DocumentError::InvoiceUnexpected(name())),
    }
}

/// The alta record of document `id` of `sequence` (a VERI*FACTU
/// register), written by the insert's trigger in the same transaction.
async fn verifactu_record<'e>(
    executor: impl sqlx::Executor<'e, Database = sqlx::Postgres>,
    sequence: &Sequence,
    input: &DocumentInput,
    id: &str,
) -> Result<Option<VerifactuRecord>, DocumentError> {
    let (Register::Verifactu { issuer }, Some(invoice)) =
        (&sequence.definition.register, &input.invoice)
    else {
        return Ok(None);
    };
    let huella = crate::features::registers::store::alta_hash(executor, sequence.id, id).await?;
    Ok(huella.map(|huella| VerifactuRecord {
        huella,
        qr_url: crate::domain::verifactu::qr_url(issuer, id, invoice),
    }))
}

impl From<LedgerError> for DocumentError {
    fn from(e: LedgerError) -> Self {
        IssueError::Ledger(e).into()
    }
}

impl From<IssueError> for DocumentError {
    fn from(e: IssueError) -> Self {
        match e {
            IssueError::Ledger(LedgerError::AlreadyAttached) => DocumentError::NotAttachable {
                id: String::new(),
                reason: "a concurrent request attached it first".into(),
            },
            other => DocumentError::Issue(other),
        }
    }
}

/// A failure in a batch; `index` names the item when one item caused it.
#[derive(Debug)]
pub struct BatchError {
    pub index: Option<usize>,
    pub error: DocumentError,
}

impl BatchError {
    fn at(index: usize) -> impl FnOnce(DocumentError) -> BatchError {
        move |error| BatchError {
            index: Some(index),
            error,
        }
    }

    fn whole(error: impl Into<DocumentError>) -> BatchError {
        BatchError {
            index: None,
            error: error.into(),
        }
    }
}

pub struct Documents {
    pub issuer: Arc<Issuer>,
    pub handout_waits: Arc<HandoutWaits>,
}

/// The placement of each (project, type) of a batch.
pub type Placements = HashMap<(String, String), Arc<Placement>>;

fn accepted(row: &OutboxRow, created_at: DateTime<Utc>) -> Accepted {
    Accepted {
        id: row.document_id.clone(),
        project: row.project.clone(),
        doc_type: row.doc_type.clone(),
        seq: row.seq_number,
        status: DocumentStatus::Pending,
        created_at,
        verifactu: None,
    }
}

impl Documents {
    /// Accepts one document with a new number through the shared writer:
    /// its ledger record and outbox row commit together with those of
    /// concurrent requests.
    pub async fn accept(&self, input: Arc<DocumentInput>) -> Result<Accepted, DocumentError> {
        let placement = self.issuer.place(&input.project, &input.doc_type).await?;
        check_invoice(&placement.sequence, &input)?;
        let sequence = placement.sequence.clone();
        let attachment = Arc::new(input.attachment());
        let issued = self
            .issuer
            .issue(placement, Want::Document { attachment })
            .await?;
        let (row, created_at) = issued
            .document
            .ok_or_else(|| DocumentError::from(LedgerError::Closed))?;
        let mut answer = accepted(&row, created_at);
        if sequence.definition.register.issuer().is_some() {
            answer.verifactu = self
                .committed_verifactu_record(&sequence, &input, &row.document_id)
                .await;
        }
        Ok(answer)
    }

    /// The alta record of a VERI*FACTU document the shared commit wrote:
    /// committed already, so the answer is 202 whatever happens now. Read
    /// on a pool connection, tried for up to `RECORD_PATIENCE`; past that
    /// the answer goes without it (the register's entries show it).
    async fn committed_verifactu_record(
        &self,
        sequence: &Sequence,
        input: &DocumentInput,
        id: &str,
    ) -> Option<VerifactuRecord> {
        let deadline = std::time::Instant::now() + RECORD_PATIENCE;
        let mut pause = std::time::Duration::from_millis(50);
        loop {
            match verifactu_record(self.issuer.db(), sequence, input, id).await {
                Ok(record) => return record,
                Err(e) if std::time::Instant::now() + pause < deadline => {
                    tracing::debug!(error = %e, id, "reading a VERI*FACTU record again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_millis(500));
                }
                Err(e) => {
                    tracing::warn!(error = %e, id, "a VERI*FACTU document was written; its record could not be read for the answer");
                    return None;
                }
            }
        }
    }

    /// Where each input's number comes from, decided before the caller's
    /// transaction begins (placing may read or create the sequence, which
    /// takes a connection of its own).
    pub async fn place_all(&self, inputs: &[DocumentInput]) -> Result<Placements, BatchError> {
        let mut placements = Placements::new();
        // Sequences first used by this batch are created together: an item
        // refused here leaves none of them behind.
        let mut first_use: Vec<(ProjectCode, TypeCode)> = Vec::new();
        let mut first_index: Vec<usize> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (index, input) in inputs.iter().enumerate() {
            if seen.insert((input.project.as_str(), input.doc_type.as_str())) {
                first_use.push((input.project.clone(), input.doc_type.clone()));
                first_index.push(index);
            }
        }
        self.issuer
            .sequences()
            .create_missing(&first_use)
            .await
            .map_err(|(pair, e)| BatchError::at(first_index[pair])(IssueError::from(e).into()))?;
        for (index, input) in inputs.iter().enumerate() {
            let key = (input.project.to_string(), input.doc_type.to_string());
            if let std::collections::hash_map::Entry::Vacant(slot) = placements.entry(key) {
                let placement = self
                    .issuer
                    .place(&input.project, &input.doc_type)
                    .await
                    .map_err(|e| BatchError::at(index)(e.into()))?;
                slot.insert(placement);
            }
        }
        Ok(placements)
    }

    /// Waits until every ID of `inputs` to attach that another instance
    /// answered from a lease is on record: its handout written (a few
    /// milliseconds after the answer), or its lease past its expiry and
    /// ended (its instance died before writing it; at most
    /// `ledger::LEASE_TTL`). Before the caller's transaction and its
    /// database turn, with every other attach of this instance in one
    /// statement per look ([`HandoutWaits`]). Whether an ID may be
    /// attached is decided after, in the transaction
    /// ([`Documents::accept_in`]).
    pub async fn wait_for_handouts(&self, inputs: &[DocumentInput], placements: &Placements) {
        let mut numbers = Vec::new();
        for input in inputs {
            let Some(id) = &input.id else { continue };
            let key = (input.project.to_string(), input.doc_type.to_string());
            let Some(placement) = placements.get(&key) else {
                continue;
            };
            let sequence = &placement.sequence;
            if sequence.definition.numbering == Numbering::Gapless {
                continue;
            }
            if let Some(seq) = sequence.seq_of(id) {
                numbers.push((sequence.id, seq));
            }
        }
        numbers.sort_unstable();
        numbers.dedup();
        self.handout_waits.settled(&numbers).await;
    }

    /// Accepts documents inside the caller's transaction: all or none.
    /// Items whose `source_id` has a document already are answered with
    /// it (marked true); the others are written. Numbers are taken with one
    /// pool call per sequence period; attached IDs are checked before any
    /// number is taken.
    pub async fn accept_in(
        &self,
        conn: &mut Tx<'_>,
        inputs: &[DocumentInput],
        placements: &Placements,
    ) -> Result<Vec<(Accepted, bool)>, BatchError> {
        let mut answers: Vec<Option<(Accepted, bool)>> = vec![None; inputs.len()];
        for (index, known) in known_sources(conn, inputs).await? {
            answers[index] = Some((known, true));
        }
        let fresh: Vec<usize> = (0..inputs.len())
            .filter(|i| answers[*i].is_none())
            .collect();
        let fresh_inputs: Vec<DocumentInput> = fresh.iter().map(|i| inputs[*i].clone()).collect();
        let written = self
            .write_new(conn, &fresh_inputs, placements)
            .await
            .map_err(|mut e| {
                e.index = e.index.map(|i| fresh[i]);
                e
            })?;
        for (index, accepted) in fresh.into_iter().zip(written) {
            answers[index] = Some((accepted, false));
        }
        Ok(answers.into_iter().flatten().collect())
    }

    /// Writes documents none of which is known by its source id.
    async fn write_new(
        &self,
        conn: &mut Tx<'_>,
        inputs: &[DocumentInput],
        placements: &Placements,
    ) -> Result<Vec<Accepted>, BatchError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let placement_of = |input: &DocumentInput| {
            &placements[&(input.project.to_string(), input.doc_type.to_string())]
        };
        for (index, input) in inputs.iter().enumerate() {
            check_invoice(&placement_of(input).sequence, input).map_err(BatchError::at(index))?;
        }
        // One outbox row per item, in request order, filled in below.
        let mut rows: Vec<Option<PlacedRow>> = vec![None; inputs.len()];
        for (index, input) in inputs.iter().enumerate() {
            if let Some(id) = &input.id {
                let row = attachable(conn, placement_of(input), input, id)
                    .await
                    .map_err(BatchError::at(index))?;
                rows[index] = Some(row);
            }
        }
        // New numbers, grouped by sequence period, in request order within
        // each group.
        let mut groups: Vec<(&Arc<Placement>, Vec<usize>)> = Vec::new();
        for (index, input) in inputs.iter().enumerate().filter(|(_, i)| i.id.is_none()) {
            let placement = placement_of(input);
            match groups
                .iter_mut()
                .find(|(p, _)| p.pool.keys == placement.pool.keys)
            {
                Some((_, members)) => members.push(index),
                None => groups.push((placement, vec![index])),
            }
        }
        // Counters are taken in one order (sequence, then period), as the
        // shared write stage takes them: two batches naming the same
        // gapless sequences in opposite orders would otherwise deadlock.
        groups.sort_by(|(a, _), (b, _)| {
            (a.sequence.id, a.period.key()).cmp(&(b.sequence.id, b.period.key()))
        });
        for (placement, members) in groups {
            self.number_group(conn, placement, members, inputs, &mut rows)
                .await?;
        }
        let rows: Vec<PlacedRow> = rows.into_iter().flatten().collect();
        let mut written = write_rows(conn, &rows).await?;
        for (index, (input, answer)) in inputs.iter().zip(written.iter_mut()).enumerate() {
            let sequence = &placement_of(input).sequence;
            if sequence.definition.register.issuer().is_some() {
                answer.verifactu = verifactu_record(conn.statements(), sequence, input, &answer.id)
                    .await
                    .map_err(BatchError::at(index))?;
            }
        }
        Ok(written)
    }

    /// Numbers for the items `members` of one sequence period, recorded in
    /// the ledger in the caller's transaction, in request order.
    async fn number_group(
        &self,
        conn: &mut Tx<'_>,
        placement: &Arc<Placement>,
        members: Vec<usize>,
        inputs: &[DocumentInput],
        rows: &mut [Option<PlacedRow>],
    ) -> Result<(), BatchError> {
        let issued = self
            .issuer
            .issue_in(conn, placement, members.len(), Via::Document)
            .await
            .map_err(|e| BatchError::whole(DocumentError::from(e)))?;
        let period = placement.period.key();
        for (index, seq) in members.into_iter().zip(issued.seqs) {
            let row = inputs[index].attachment().row(&placement.shape, seq);
            rows[index] = Some((placement.sequence.id, period.to_owned(), row));
        }
        Ok(())
    }
}

/// An outbox row with the sequence and period its number belongs to.
type PlacedRow = (i64, String, OutboxRow);

/// The items whose source id has a document already, with that document
/// (its project and type are the item's, so inside the caller's scope).
/// Two items of one request with the same source id are refused.
async fn known_sources(
    conn: &mut Tx<'_>,
    inputs: &[DocumentInput],
) -> Result<Vec<(usize, Accepted)>, BatchError> {
    let mut first_of: HashMap<(&str, &str, &str), usize> = HashMap::new();
    for (index, input) in inputs.iter().enumerate() {
        let Some(source_id) = input.source_id.as_deref() else {
            continue;
        };
        let key = (input.project.as_str(), input.doc_type.as_str(), source_id);
        if let Some(first) = first_of.insert(key, index) {
            return Err(BatchError::at(index)(DocumentError::SourceIdRepeated(
                first,
            )));
        }
    }
    if first_of.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<(&str, &str, &str)> = first_of.keys().copied().collect();
    let found = delivery_queue::by_source_ids(conn, &keys)
        .await
        .map_err(BatchError::whole)?;
    Ok(found
        .into_iter()
        .filter_map(|known| {
            let key = (
                known.project.as_str(),
                known.doc_type.as_str(),
                known.source_id.as_str(),
            );
            let index = *first_of.get(&key)?;
            Some((index, known.accepted()))
        })
        .collect())
}

/// Inserts the outbox rows, after checking no other document has one of
/// their IDs (naming the first item that collides).
async fn write_rows(conn: &mut Tx<'_>, rows: &[PlacedRow]) -> Result<Vec<Accepted>, BatchError> {
    let ids: Vec<&str> = rows
        .iter()
        .map(|(_, _, r)| r.document_id.as_str())
        .collect();
    if let Some(index) = delivery_queue::first_taken(conn, &ids)
        .await
        .map_err(BatchError::whole)?
    {
        let (sequence_id, period, row) = &rows[index];
        crate::issuance::never_reuse(Some((*sequence_id, period, row.seq)));
        return Err(BatchError::at(index)(DocumentError::IdTaken(
            row.document_id.clone(),
        )));
    }
    let refs: Vec<(i64, &str, &OutboxRow)> =
        rows.iter().map(|(s, p, r)| (*s, p.as_str(), r)).collect();
    let created = ledger::outbox_rows::insert(conn, &refs)
        .await
        .map_err(|e| {
            let e: LedgerError = e.into();
            match e {
                LedgerError::SourceIdTaken => BatchError::whole(DocumentError::SourceIdInUse),
                LedgerError::DocumentIdTaken => {
                    // Taken meanwhile by a concurrent write: which row's ID,
                    // the constraint does not say.
                    crate::issuance::never_reuse(None);
                    BatchError::whole(LedgerError::DocumentIdTaken)
                }
                e => BatchError::whole(e),
            }
        })?;
    Ok(rows
        .iter()
        .zip(created)
        .map(|((_, _, row), created_at)| accepted(row, created_at))
        .collect())
}

/// Checks that `id` was issued by `POST /ids` for this sequence and carries
/// no document yet; the outbox row that attaches it.
async fn attachable(
    conn: &mut Tx<'_>,
    placement: &Placement,
    input: &DocumentInput,
    id: &str,
) -> Result<(i64, String, OutboxRow), DocumentError> {
    let not_attachable = |reason: &str| DocumentError::NotAttachable {
        id: id.to_owned(),
        reason: reason.to_owned(),
    };
    let sequence = &placement.sequence;
    let definition = &sequence.definition;
    // One pass over the ID: the number it carries, if it reads as this
    // sequence's format at all.
    let candidate = sequence.seq_of(id);
    if definition.numbering == Numbering::Gapless {
        let Some(seq) = candidate else {
            return Err(not_attachable("it was not reserved by POST /ids"));
        };
        return confirm_reservation(conn, placement, input, id, seq).await;
    }
    if let Some(seq) = candidate {
        let issued = ledger::issued_via_ids(conn, sequence.id, seq).await?;
        for (period_key, issued_at) in issued {
            let Some(period) = definition
                .reset
                .period_named(definition.timezone, &period_key)
            else {
                continue;
            };
            let Ok(shape) = definition.shape(
                sequence.project.as_str(),
                sequence.doc_type.as_str(),
                &period,
                issued_at,
            ) else {
                continue;
            };
            if shape.id(seq) != id {
                continue;
            }
            let attached =
                delivery_queue::carries_document(conn, sequence.id, &period_key, seq).await?;
            if attached {
                return Err(not_attachable("it carries a document already"));
            }
            return Ok((
                sequence.id,
                period_key,
                attached_row(input, id, seq, &shape),
            ));
        }
    }
    Err(not_attachable(&format!(
        "it was not issued by POST /ids for {}/{}",
        sequence.project, sequence.doc_type
    )))
}

/// Confirms the reservation of `seq` printed as `id` on a gapless
/// sequence (locked until the caller's transaction ends): refused when it
/// is not this sequence's, carries a document, was voided, or its
/// deadline passed (the expiry sweep voids it). The outbox row that
/// attaches it.
async fn confirm_reservation(
    conn: &mut Tx<'_>,
    placement: &Placement,
    input: &DocumentInput,
    id: &str,
    seq: i64,
) -> Result<(i64, String, OutboxRow), DocumentError> {
    let not_attachable = |reason: String| DocumentError::NotAttachable {
        id: id.to_owned(),
        reason,
    };
    let sequence = &placement.sequence;
    let definition = &sequence.definition;
    let reservation = reservations::lock(&mut *conn, sequence.id, seq, id)
        .await?
        .ok_or_else(|| {
            not_attachable(format!(
                "it was not reserved by POST /ids for {}/{}",
                sequence.project, sequence.doc_type
            ))
        })?;
    match reservation.status {
        ReservationStatus::Reserved if reservation.reserved_until > placement.at => {}
        ReservationStatus::Reserved => {
            return Err(not_attachable(format!(
                "its reservation expired at {}",
                reservation.reserved_until.to_rfc3339()
            )));
        }
        ReservationStatus::Confirmed => {
            return Err(not_attachable("it carries a document already".into()));
        }
        ReservationStatus::Voided | ReservationStatus::ReservationExpired => {
            return Err(not_attachable(format!(
                "it was voided ({})",
                reservation.status.as_str()
            )));
        }
    }
    let period = definition
        .reset
        .period_named(definition.timezone, &reservation.period)
        .ok_or_else(|| not_attachable("its period no longer reads as this sequence's".into()))?;
    let shape = definition
        .shape(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            &period,
            reservation.reserved_at,
        )
        .map_err(|e| not_attachable(e.to_string()))?;
    reservations::confirm(&mut *conn, sequence.id, &reservation).await?;
    let row = attached_row(input, id, seq, &shape);
    Ok((sequence.id, reservation.period, row))
}

/// The outbox row of `input` attached to number `seq`, printed `id`.
fn attached_row(input: &DocumentInput, id: &str, seq: i64, shape: &IdShape) -> OutboxRow {
    OutboxRow {
        seq,
        document_id: id.to_owned(),
        project: input.project.to_string(),
        doc_type: input.doc_type.to_string(),
        seq_number: shape.number(seq),
        payload: input.metadata.clone(),
        source_id: input.source_id.clone(),
        invoice: input.attachment().invoice,
    }
}

#[cfg(test)]
mod tests {
    use super::nesting_depth;

    #[test]
    fn nesting_counts_arrays_and_objects_but_not_brackets_in_strings() {
        assert_eq!(nesting_depth("{}"), 1);
        assert_eq!(nesting_depth(r#"{"a": [1, {"b": []}]}"#), 4);
        assert_eq!(nesting_depth(r#"{"a": "[[[{{{", "b": "\"[[["}"#), 1);
        assert_eq!(nesting_depth(r#"{"a": "\\", "b": [[]]}"#), 3);
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(500), "]".repeat(500));
        assert_eq!(nesting_depth(&deep), 501);
    }
}
