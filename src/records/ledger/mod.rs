//! The issuance ledger: every number handed to a caller, written before the
//! caller hears of it.
//!
//! Writes of concurrent requests share one statement and one commit, and
//! numbers that follow each other become one range row, so a burst of 64
//! single-ID requests on one sequence is usually one row. Documents ride
//! along: their outbox rows go into the same transaction as their numbers.
//! The table's exclusion constraint refuses any number issued before; such a
//! number (a stale pool list) is reported back so the caller takes another.

mod grouped;
mod leases;
mod numbering;
pub mod outbox_rows;
pub mod reservations;

use crate::infra::db::{Db, Link};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::domain::numbers::{SeqRange, runs, subtract};
use crate::infra::db::sqlstate;
use crate::infra::log_limit::Repeated;
use crate::infra::stats::Stats;
use crate::records::counter::Counter;
use outbox_rows::OutboxRow;

use grouped::Grouped;
pub use leases::{
    LeaseReport, LeaseWait, end_expired_leases, lease_waits, record_handouts, release_lease,
};
use numbering::number;
pub use numbering::{GaplessTake, Unnumbered, numbered_in};

/// How long after it is recorded a lease may hand out its numbers, on
/// Postgres' clock (`lease_expires_at`). Its holder stops earlier by its
/// own clock; past it, an attach of one of its numbers that no handout
/// record names may end the lease and attach the number (so an attach of
/// an ID answered by an instance killed before reporting it waits at most
/// this long). Well above the age at which a lease is given back
/// (`LeaseSettings::max_age`, 1 s), so a live instance's leases never get
/// there but across an outage.
pub const LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(5);

/// Who received numbers: `POST /ids`, `POST /documents`, or this
/// instance's lease (handed out from memory, reported later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Via {
    Ids,
    Document,
    Lease,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Ids => "ids",
            Via::Document => "document",
            Via::Lease => "lease",
        }
    }
}

/// Why a ledger write failed. One failure may answer every request of a
/// shared write, so the database error is shared, not copied into text.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LedgerError {
    /// The connection failed: whether the write committed is unknown.
    #[error("ledger write failed: {0}")]
    Db(#[source] Arc<sqlx::Error>),
    /// The database refused the statement and rolled it back; the
    /// connection is fine.
    #[error("ledger write refused: {0}")]
    Statement(#[source] Arc<sqlx::Error>),
    /// The server takes no writes (a standby, a demoted primary): nothing
    /// was written.
    #[error("ledger write refused: the database is read-only now")]
    ReadOnly(#[source] Arc<sqlx::Error>),
    /// The statement waited too long (for a lock another transaction
    /// holds, or at all) and was cancelled.
    #[error("ledger write waited too long: {}", database_message(.0))]
    Waited(#[source] Arc<sqlx::Error>),
    /// The database cannot store a value of the request (SQLSTATE class
    /// 22: a number out of range, a character it cannot hold).
    #[error("the database cannot store a value of this request: {}", unstorable_what(.0))]
    Unstorable(#[source] Arc<sqlx::Error>),
    /// The connection failed, and once the server answered again the
    /// write was found not to have committed: nothing was written.
    #[error("ledger write lost with its connection; nothing was written")]
    NotCommitted(#[source] Arc<sqlx::Error>),
    /// The write was sent, its answer was lost, and Postgres did not say
    /// whether it committed in all the time it was asked.
    #[error("ledger write sent; whether it committed is unknown: {0}")]
    OutcomeUnknown(#[source] Arc<sqlx::Error>),
    #[error("the ledger writer has stopped")]
    Closed,
    /// The request was withdrawn at its deadline before this write was
    /// sent: nothing was written.
    #[error("the request timed out before its write was sent; nothing was written")]
    Withdrawn,
    /// Another document has the ID this one was printed. (No detail: the
    /// other document may be another tenant's.)
    #[error("the ID printed for this document is another document's already")]
    DocumentIdTaken,
    #[error("the number carries a document already")]
    AlreadyAttached,
    /// Another document of the project and type has this source id.
    #[error("another document has this source_id")]
    SourceIdTaken,
    /// A gapless sequence's counter has fewer numbers left than asked.
    #[error("the sequence has no numbers left in this period")]
    Exhausted,
    /// A gapless sequence's counter is held by another transaction: its
    /// document was left out of a shared commit rather than make the
    /// others wait (the caller tries again).
    #[error("the sequence's counter is held by another write; try again")]
    CounterHeld,
    /// A gapless sequence's definition changed since the request placed
    /// its numbers.
    #[error("the sequence's definition changed while this request ran")]
    DefinitionChanged,
}

/// What the database said, without sqlx's prefix.
fn database_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    }
}

/// Which kind of value the database could not store, in our words (its
/// own message names its internals: types, formats, encodings).
fn unstorable_what(e: &sqlx::Error) -> &'static str {
    match sqlstate::of(e).as_deref() {
        Some("22003") => "a number out of the range it can hold",
        Some("22021") => "a character it cannot hold",
        Some("22001") => "a text longer than it can hold",
        _ => "a value it cannot hold",
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        let sqlx::Error::Database(db) = &e else {
            return LedgerError::Db(Arc::new(e));
        };
        if crate::infra::db::distrust_server_after(&e) {
            // No request is at fault, and the connection is not to be used
            // again. A read-only server wrote nothing; one going away may
            // have committed.
            return match db.code().as_deref() {
                Some(sqlstate::READ_ONLY_SQL_TRANSACTION) => LedgerError::ReadOnly(Arc::new(e)),
                _ => LedgerError::Db(Arc::new(e)),
            };
        }
        match db.constraint() {
            Some(outbox_rows::DOCUMENT_ID_TAKEN) => return LedgerError::DocumentIdTaken,
            Some(outbox_rows::NUMBER_ATTACHED) => return LedgerError::AlreadyAttached,
            Some(outbox_rows::SOURCE_ID_TAKEN) => return LedgerError::SourceIdTaken,
            _ => {}
        }
        match db.code().as_deref() {
            Some(code) if code.starts_with(sqlstate::DATA_EXCEPTION_CLASS) => {
                LedgerError::Unstorable(Arc::new(e))
            }
            Some(sqlstate::LOCK_NOT_AVAILABLE | sqlstate::QUERY_CANCELED) => {
                LedgerError::Waited(Arc::new(e))
            }
            _ => LedgerError::Statement(Arc::new(e)),
        }
    }
}

impl LedgerError {
    /// The write surely rolled back and its numbers did nothing wrong: a
    /// number it carried may be used again. (Not after a connection
    /// failure, whose outcome is unknown, nor when the ID a number prints
    /// is another document's.)
    pub fn numbers_reusable(&self) -> bool {
        matches!(
            self,
            LedgerError::Statement(_)
                | LedgerError::Waited(_)
                | LedgerError::Unstorable(_)
                | LedgerError::ReadOnly(_)
                | LedgerError::NotCommitted(_)
                | LedgerError::Withdrawn
        )
    }

    /// The write gave up waiting for a lock another transaction holds on
    /// a number it carried: a number that may be that transaction's once
    /// it commits. Given back to its pool, it would be popped by the next
    /// request, which would wait and fail the same way.
    pub fn lock_held_elsewhere(&self) -> bool {
        let LedgerError::Waited(e) = self else {
            return false;
        };
        e.as_database_error()
            .and_then(|db| db.code())
            .is_some_and(|code| code == sqlstate::LOCK_NOT_AVAILABLE)
    }

    /// Whether the write may have committed although it failed: its
    /// connection broke before the answer came.
    pub fn in_doubt(&self) -> bool {
        matches!(self, LedgerError::Db(_))
    }

    /// The statement failed and was rolled back: writing the requests of a
    /// shared write one at a time finds the one at fault.
    fn statement_failed(&self) -> bool {
        // Read-only refuses every request alike: splitting finds no culprit.
        !matches!(
            self,
            LedgerError::ReadOnly(_) | LedgerError::NotCommitted(_) | LedgerError::Withdrawn
        ) && self.numbers_reusable()
            || matches!(
                self,
                LedgerError::DocumentIdTaken
                    | LedgerError::AlreadyAttached
                    | LedgerError::SourceIdTaken
                    | LedgerError::Exhausted
            )
    }
}

/// Which numbers the ledger took and which it refused; for documents, when
/// their outbox rows were created.
#[derive(Debug, Default)]
pub struct Recorded {
    pub refused: Vec<i64>,
    pub documents: HashMap<String, DateTime<Utc>>,
    /// The rows written for the write's unnumbered documents, numbered.
    pub numbered: Vec<OutboxRow>,
    /// Its gapless counter was held elsewhere: nothing of it was written.
    pub held: bool,
}

/// Numbers of one sequence period to record, and the documents they carry.
#[derive(Debug, Clone)]
pub struct LedgerWrite {
    pub sequence_id: i64,
    pub period: String,
    /// Empty for a document on a leased number (recorded with its lease).
    pub seqs: Vec<i64>,
    pub via: Via,
    pub documents: Vec<OutboxRow>,
    /// Documents of a gapless sequence: numbered inside the write's
    /// transaction, from its counter, in commit order (no ledger row: the
    /// counter and the documents are the record).
    pub unnumbered: Vec<Unnumbered>,
}

/// Rounds of "find what is taken, insert the rest" before a number that
/// keeps conflicting is given up as issued.
const CONFLICT_ROUNDS: usize = 3;

/// Records `seqs` inside the caller's transaction (idempotent requests and
/// batches, whose ledger rows must commit with the rest of their work).
/// Returns the refused numbers.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn record_in(
    conn: &mut impl Link,
    stats: &Stats,
    sequence_id: i64,
    period: &str,
    seqs: &[i64],
    via: Via,
) -> Result<Vec<i64>, sqlx::Error> {
    let groups = [Group {
        sequence_id,
        period: period.to_owned(),
        via,
    }];
    let mut unique = seqs.to_vec();
    unique.sort_unstable();
    let repeats: Vec<i64> = unique
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    let rows = runs(&unique)
        .into_iter()
        .map(|range| Row { group: 0, range })
        .collect();
    let refused = insert_resolving_conflicts(conn, stats, &groups, rows).await?;
    let mut refused_seqs = repeats;
    if let Some(ranges) = refused.get(&0) {
        refused_seqs.extend(
            seqs.iter()
                .copied()
                .filter(|s| ranges.iter().any(|r| r.contains(*s))),
        );
    }
    Ok(refused_seqs)
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Group {
    sequence_id: i64,
    period: String,
    via: Via,
}

struct Row {
    group: usize,
    range: SeqRange,
}

/// The same failure for every write.
pub fn failed_all(
    writes: &[LedgerWrite],
    error: &LedgerError,
) -> Vec<Result<Recorded, LedgerError>> {
    writes.iter().map(|_| Err(error.clone())).collect()
}

/// Writes all `writes` on `conn` with one statement and one commit (a
/// transaction when documents are among them). One outcome per write, in
/// order. How `counter` numbered the writes' unnumbered documents (gapless
/// ones) inside each attempt's transaction is pushed to `gapless_takes` as it
/// happens, so a caller that stops waiting for the answer still knows
/// which transaction to ask about; when a shared write must be split to
/// find the request at fault, what commits is numbered again.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn write_shared(
    conn: &mut impl Link,
    stats: &Stats,
    counter: &Counter,
    writes: &[LedgerWrite],
    gapless_takes: &std::sync::Mutex<Vec<GaplessTake>>,
) -> Vec<Result<Recorded, LedgerError>> {
    let mut outcomes: Vec<Option<Result<Recorded, LedgerError>>> =
        writes.iter().map(|_| None).collect();
    // One request may spoil a shared statement (a value the database
    // cannot store, an ID another document has, a number whose lock it
    // waited on too long). The database rolled it back, so the requests are
    // written again until the one at fault is alone with its error, and
    // every other request is answered as if it had been written alone. A
    // refusal is found by halving (one bad request among n costs about
    // 2·log2(n) statements); a wait by writing each request on its own, so
    // only the one at fault waits again.
    let mut pending = Vec::with_capacity(writes.len().min(64));
    pending.push(0..writes.len());
    let mut split = false;
    while let Some(range) = pending.pop() {
        let part = &writes[range.clone()];
        match write_part(conn, stats, part, range.start, counter, gapless_takes).await {
            Ok(recorded) => {
                for (slot, recorded) in outcomes[range].iter_mut().zip(recorded) {
                    *slot = Some(match recorded.held {
                        true => Err(LedgerError::CounterHeld),
                        false => Ok(recorded),
                    });
                }
            }
            Err(e) if part.len() > 1 && e.statement_failed() => {
                if !split {
                    // A caller can send a refused value as often as it
                    // likes: said once, then with a count.
                    static SPLITS: Repeated =
                        Repeated::new("shared ledger write failed; finding the request at fault");
                    SPLITS.warn(&e);
                    stats.ledger_writes_split.inc();
                    split = true;
                }
                if matches!(e, LedgerError::Waited(_)) {
                    pending.extend(range.rev().map(|i| i..i + 1));
                } else {
                    let middle = range.start + part.len() / 2;
                    pending.push(middle..range.end);
                    pending.push(range.start..middle);
                }
            }
            Err(e) if part.len() == 1 => outcomes[range.start] = Some(Err(e)),
            Err(e) => {
                static FAILED: Repeated = Repeated::new("ledger batch failed");
                FAILED.warn(&e);
                for slot in &mut outcomes[range] {
                    *slot = Some(Err(e.clone()));
                }
            }
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Err(LedgerError::Closed)))
        .collect()
}

/// One statement (and, with documents, one transaction) for `writes`,
/// which start at `offset` of the shared write.
async fn write_part(
    conn: &mut impl Link,
    stats: &Stats,
    writes: &[LedgerWrite],
    offset: usize,
    counter: &Counter,
    gapless_takes: &std::sync::Mutex<Vec<GaplessTake>>,
) -> Result<Vec<Recorded>, LedgerError> {
    let unnumbered = writes.iter().any(|w| !w.unnumbered.is_empty());
    let documents = writes.iter().any(|w| !w.documents.is_empty());
    let ledger_rows = writes.iter().any(|w| !w.seqs.is_empty());
    let one_statement = !(unnumbered || documents && ledger_rows);
    if one_statement {
        // A single INSERT commits by itself: one round trip.
        return write_together(&mut *conn, stats, writes).await;
    }
    // The writer keeps its connection between batches: a failed write
    // must leave no transaction open on it.
    crate::infra::db::in_transaction(conn, async |tx| {
        if !unnumbered {
            return write_together(tx, stats, writes).await;
        }
        let (numbered, held) = number(&mut *tx, writes, offset, counter, gapless_takes).await?;
        let mut recorded = write_together(tx, stats, &numbered).await?;
        for ((recorded, write), given) in recorded.iter_mut().zip(&numbered).zip(writes) {
            if !given.unnumbered.is_empty() {
                recorded.numbered = write.documents[given.documents.len()..].to_vec();
            }
        }
        for index in held {
            recorded[index].held = true;
        }
        Ok(recorded)
    })
    .await
}

/// Ledger rows for every write, then the outbox rows of documents whose
/// numbers were taken. Answers per write, in order.
async fn write_together(
    conn: &mut impl Link,
    stats: &Stats,
    batch: &[LedgerWrite],
) -> Result<Vec<Recorded>, LedgerError> {
    let grouped = Grouped::of(batch);
    let refused = insert_resolving_conflicts(conn, stats, &grouped.groups, grouped.rows()).await?;
    let mut answers: Vec<Recorded> = Vec::with_capacity(batch.len());
    let mut documents: Vec<(usize, &OutboxRow)> = Vec::new();
    for (n, (write, (group, mut refused_here))) in batch.iter().zip(grouped.placed).enumerate() {
        if let Some(ranges) = refused.get(&group) {
            refused_here.extend(
                write
                    .seqs
                    .iter()
                    .copied()
                    .filter(|s| ranges.iter().any(|r| r.contains(*s))),
            );
        }
        documents.extend(
            write
                .documents
                .iter()
                .filter(|d| !refused_here.contains(&d.seq))
                .map(|d| (n, d)),
        );
        answers.push(Recorded {
            refused: refused_here,
            documents: HashMap::new(),
            numbered: Vec::new(),
            held: false,
        });
    }
    if !documents.is_empty() {
        let rows: Vec<(i64, &str, &OutboxRow)> = documents
            .iter()
            .map(|(n, d)| (batch[*n].sequence_id, batch[*n].period.as_str(), *d))
            .collect();
        let created = outbox_rows::insert(conn, &rows).await?;
        for ((n, document), created_at) in documents.iter().zip(created) {
            answers[*n]
                .documents
                .insert(document.document_id.clone(), created_at);
        }
    }
    Ok(answers)
}

/// Inserts the rows; for any that conflict, inserts what is still free and
/// returns, per group, the ranges that were already issued.
async fn insert_resolving_conflicts(
    conn: &mut impl Link,
    stats: &Stats,
    groups: &[Group],
    mut rows: Vec<Row>,
) -> Result<HashMap<usize, Vec<SeqRange>>, sqlx::Error> {
    let mut refused: HashMap<usize, Vec<SeqRange>> = HashMap::new();
    for round in 0..=CONFLICT_ROUNDS {
        if rows.is_empty() {
            break;
        }
        let conflicting = insert_rows(conn, stats, groups, &rows).await?;
        if conflicting.is_empty() {
            break;
        }
        if round == CONFLICT_ROUNDS {
            for row in conflicting {
                refused.entry(row.group).or_default().push(row.range);
            }
            break;
        }
        // Split each conflicting range into what the ledger already holds
        // (refused) and what is free (tried again).
        rows = Vec::new();
        for row in conflicting {
            let group = &groups[row.group];
            let taken = issued_within(conn, group, row.range).await?;
            refused
                .entry(row.group)
                .or_default()
                .extend(taken.iter().filter_map(|t| t.intersect(row.range)));
            rows.extend(subtract(row.range, &taken).into_iter().map(|range| Row {
                group: row.group,
                range,
            }));
        }
    }
    Ok(refused)
}

/// One statement for all rows; returns the rows the constraint refused.
async fn insert_rows(
    conn: &mut impl Link,
    stats: &Stats,
    groups: &[Group],
    rows: &[Row],
) -> Result<Vec<Row>, sqlx::Error> {
    let sequence_ids: Vec<i64> = rows.iter().map(|r| groups[r.group].sequence_id).collect();
    let periods: Vec<&str> = rows
        .iter()
        .map(|r| groups[r.group].period.as_str())
        .collect();
    let starts: Vec<i64> = rows.iter().map(|r| r.range.start).collect();
    let ends: Vec<i64> = rows.iter().map(|r| r.range.end).collect();
    let vias: Vec<&str> = rows.iter().map(|r| groups[r.group].via.as_str()).collect();
    let inserted: Vec<(i64, String, i64, String)> = sqlx::query!(
        "INSERT INTO issuance_ledger (sequence_id, period, seqs, via, lease_expires_at) \
         SELECT s, p, int8range(a, b), v, \
                CASE WHEN v = 'lease' THEN clock_timestamp() + $6::bigint * interval '1 millisecond' END \
         FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::text[]) AS t(s, p, a, b, v) \
         ON CONFLICT DO NOTHING \
         RETURNING sequence_id, period, lower(seqs) AS \"start!\", via",
        &sequence_ids,
        &periods as &[&str],
        &starts,
        &ends,
        &vias as &[&str],
        LEASE_TTL.as_millis() as i64,
    )
    .fetch_all(conn.statements())
    .await?
    .into_iter()
    .map(|r| (r.sequence_id, r.period, r.start, r.via))
    .collect();
    stats.ledger_batches.inc();
    stats.ledger_rows.inc_by(inserted.len() as u64);
    if inserted.len() == rows.len() {
        return Ok(Vec::new());
    }
    // A row is identified by its group (sequence, period, via) and start:
    // within a group ranges never overlap.
    let done: HashSet<(i64, &str, i64, &str)> = inserted
        .iter()
        .map(|(s, p, start, via)| (*s, p.as_str(), *start, via.as_str()))
        .collect();
    Ok(rows
        .iter()
        .filter(|r| {
            let g = &groups[r.group];
            !done.contains(&(
                g.sequence_id,
                g.period.as_str(),
                r.range.start,
                g.via.as_str(),
            ))
        })
        .map(|r| Row {
            group: r.group,
            range: r.range,
        })
        .collect())
}

/// Of shared writes whose commit is in doubt (the connection broke before
/// its answer), what landed: per write, its record when every number and
/// document of it is there, None when none is. (A write is one
/// transaction's: all or nothing. One partly there is left in doubt.)
pub async fn landed(
    conn: &mut impl Link,
    writes: &[LedgerWrite],
) -> Result<Vec<Landed>, sqlx::Error> {
    let (mut indexes, mut sequence_ids, mut periods, mut seqs, mut vias) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut doc_indexes, mut doc_sequences, mut doc_seqs, mut doc_ids) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, write) in writes.iter().enumerate() {
        for seq in &write.seqs {
            indexes.push(i as i32);
            sequence_ids.push(write.sequence_id);
            periods.push(write.period.as_str());
            seqs.push(*seq);
            vias.push(write.via.as_str());
        }
        for document in &write.documents {
            doc_indexes.push(i as i32);
            doc_sequences.push(write.sequence_id);
            doc_seqs.push(document.seq);
            doc_ids.push(document.document_id.as_str());
        }
    }
    let numbers_found = sqlx::query!(
        "SELECT w.i AS \"index!\", count(*) AS \"found!\" \
         FROM UNNEST($1::int[], $2::bigint[], $3::text[], $4::bigint[], $5::text[]) AS w(i, s, p, seq, v) \
         WHERE EXISTS (SELECT 1 FROM issuance_ledger l WHERE l.sequence_id = w.s AND l.period = w.p \
                       AND l.seqs @> w.seq AND l.via = w.v) \
         GROUP BY w.i",
        &indexes,
        &sequence_ids,
        &periods as &[&str],
        &seqs,
        &vias as &[&str],
    )
    .fetch_all(conn.statements())
    .await?;
    let documents_found = sqlx::query!(
        "SELECT w.i AS \"index!\", o.document_id AS \"document_id!\", o.created_at AS \"created_at!\" \
         FROM UNNEST($1::int[], $2::bigint[], $3::bigint[], $4::text[]) AS w(i, s, seq, d) \
         JOIN id_outbox o ON o.document_id = w.d AND o.sequence_id = w.s AND o.seq = w.seq",
        &doc_indexes,
        &doc_sequences,
        &doc_seqs,
        &doc_ids as &[&str],
    )
    .fetch_all(conn.statements())
    .await?;
    let mut numbers: Vec<usize> = vec![0; writes.len()];
    for row in numbers_found {
        numbers[row.index as usize] = row.found as usize;
    }
    let mut documents: Vec<HashMap<String, DateTime<Utc>>> = vec![HashMap::new(); writes.len()];
    for row in documents_found {
        documents[row.index as usize].insert(row.document_id, row.created_at);
    }
    Ok(writes
        .iter()
        .zip(numbers)
        .zip(documents)
        .map(|((write, numbers), documents)| {
            if !write.unnumbered.is_empty() {
                // Numbered inside the lost transaction: which numbers it
                // took is not known here.
                return Landed::Partly;
            }
            let all = numbers == write.seqs.len() && documents.len() == write.documents.len();
            let none = numbers == 0 && documents.is_empty();
            match (all, none) {
                (true, _) => Landed::Yes(Recorded {
                    documents,
                    ..Recorded::default()
                }),
                (false, true) => Landed::No,
                (false, false) => Landed::Partly,
            }
        })
        .collect())
}

/// What became of a write whose commit was in doubt.
#[derive(Debug)]
pub enum Landed {
    /// It committed: its record, as if the answer had arrived.
    Yes(Recorded),
    /// Nothing of it is there.
    No,
    /// Some of it is there (not one transaction's work): still unknown.
    Partly,
}

/// Issued ranges overlapping `range`, sorted.
async fn issued_within(
    conn: &mut impl Link,
    group: &Group,
    range: SeqRange,
) -> Result<Vec<SeqRange>, sqlx::Error> {
    let rows = sqlx::query!(
        "SELECT lower(seqs) AS \"start!\", upper(seqs) AS \"end!\" FROM issuance_ledger \
         WHERE sequence_id = $1 AND period = $2 AND seqs && int8range($3, $4) ORDER BY lower(seqs)",
        group.sequence_id,
        &group.period,
        range.start,
        range.end,
    )
    .fetch_all(conn.statements())
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| SeqRange::new(r.start, r.end))
        .collect())
}

/// The periods in which number `seq` of the sequence was issued to
/// `POST /ids`, with when (an attached ID is checked against each): per
/// request, from a lease whose instance reported handing it out, or from
/// a lease an attach ended (its holder may have answered it unreported).
pub async fn issued_via_ids(
    conn: &mut impl Link,
    sequence_id: i64,
    seq: i64,
) -> Result<Vec<(String, DateTime<Utc>)>, sqlx::Error> {
    let rows = sqlx::query!(
        "SELECT period AS \"period!\", issued_at AS \"issued_at!\" FROM issuance_ledger \
         WHERE sequence_id = $1 AND seqs @> $2::bigint \
           AND (via = $3 OR via = $4 AND lease_ended_at IS NOT NULL) \
         UNION ALL \
         SELECT period, reported_at FROM lease_handouts \
         WHERE sequence_id = $1 AND seqs @> $2::bigint",
        sequence_id,
        seq,
        Via::Ids.as_str(),
        Via::Lease.as_str(),
    )
    .fetch_all(conn.statements())
    .await?;
    Ok(rows.into_iter().map(|r| (r.period, r.issued_at)).collect())
}

/// Numbers of one sequence period a lease handed to callers, or gave back.
/// The highest number of `period` recorded as issued, and how many pool
/// refills the sequence has had (a sequence's live figures).
pub async fn last_issued_and_refills(
    db: &Db,
    sequence_id: i64,
    period: &str,
) -> Result<(Option<i64>, i64), sqlx::Error> {
    let row = sqlx::query!(
        "SELECT (SELECT upper(seqs) - 1 FROM issuance_ledger WHERE sequence_id = $1 AND period = $2 \
                 ORDER BY lower(seqs) DESC LIMIT 1) AS last_issued, \
                (SELECT count(*) FROM blocks WHERE sequence_id = $1 AND purpose = 'pool') AS \"refills!\"",
        sequence_id,
        period,
    )
    .fetch_one(db)
    .await?;
    Ok((row.last_issued, row.refills))
}
