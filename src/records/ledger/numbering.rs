//! Documents of gapless sequences in a shared write: numbered inside the
//! write's transaction, from their counters, in commit order.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::infra::db::Link;

use super::outbox_rows::Attachment;
use super::{LedgerError, LedgerWrite};
use crate::domain::sequence::{IdShape, Period, Sequence};
use crate::records::counter::{Counter, Reserved};

/// A document whose number is taken when it is written.
#[derive(Debug, Clone)]
pub struct Unnumbered {
    pub attachment: Arc<Attachment>,
    /// How its ID prints.
    pub shape: IdShape,
    /// Whose counter numbers it.
    pub sequence: Arc<Sequence>,
    pub period: Period,
}

/// Numbers a gapless counter gave to writes of a shared write (indexes
/// into it), in order from `first`, inside transaction `xid`: what a
/// commit in doubt is settled by.
#[derive(Debug, Clone)]
pub struct GaplessTake {
    pub xid: i64,
    pub first: i64,
    pub writes: Vec<usize>,
}

/// `n` numbers of the counter of `document`'s sequence period, inside
/// the write's transaction (the row stays locked until the commit), for
/// `writes`; the first of them. Another transaction holding the counter
/// is `CounterHeld`: nothing waits for it.
async fn take(
    conn: &mut impl Link,
    counter: &Counter,
    document: &Unnumbered,
    writes: &[usize],
    n: i64,
    gapless_takes: &Mutex<Vec<GaplessTake>>,
) -> Result<i64, LedgerError> {
    let (taken, xid) = counter
        .take_gapless_unless_held(conn, &document.sequence, &document.period, n)
        .await?
        .ok_or(LedgerError::CounterHeld)?;
    match taken {
        Reserved::Got(range) => {
            gapless_takes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(GaplessTake {
                    xid,
                    first: range.start,
                    writes: writes.to_vec(),
                });
            Ok(range.start)
        }
        Reserved::Exhausted => Err(LedgerError::Exhausted),
        Reserved::Stale | Reserved::Unfenced => Err(LedgerError::DefinitionChanged),
    }
}

/// Write `index` of `writes` as the last numbering that included it
/// numbered it, and that numbering's transaction; None when none did.
pub fn numbered_in(
    gapless_takes: &[GaplessTake],
    writes: &[LedgerWrite],
    index: usize,
) -> Option<(i64, LedgerWrite)> {
    let numbering = gapless_takes
        .iter()
        .rev()
        .find(|n| n.writes.contains(&index))?;
    let mut next = numbering.first;
    for &before in numbering.writes.iter().take_while(|&&w| w != index) {
        next += writes[before].unnumbered.len() as i64;
    }
    let mut numbered = writes[index].clone();
    for document in std::mem::take(&mut numbered.unnumbered) {
        numbered
            .documents
            .push(document.attachment.row(&document.shape, next));
        next += 1;
    }
    Some((numbering.xid, numbered))
}

/// The writes with their unnumbered documents numbered: one counter
/// update per sequence period for all of them, in the order of the writes,
/// periods taken in one order (so two writers never wait on each other's
/// counters crosswise). Writes whose counter another transaction holds
/// are left out (nothing of them is written) and listed, by index.
pub(super) async fn number(
    conn: &mut impl Link,
    writes: &[LedgerWrite],
    offset: usize,
    counter: &Counter,
    gapless_takes: &Mutex<Vec<GaplessTake>>,
) -> Result<(Vec<LedgerWrite>, Vec<usize>), LedgerError> {
    let mut groups: BTreeMap<(i64, &str), Vec<usize>> = BTreeMap::new();
    for (index, write) in writes.iter().enumerate() {
        if !write.unnumbered.is_empty() {
            groups
                .entry((write.sequence_id, write.period.as_str()))
                .or_default()
                .push(index);
        }
    }
    let mut numbered = writes.to_vec();
    let mut held = Vec::new();
    for indexes in groups.values() {
        let n: usize = indexes.iter().map(|i| writes[*i].unnumbered.len()).sum();
        let shared: Vec<usize> = indexes.iter().map(|index| offset + index).collect();
        let document = &writes[indexes[0]].unnumbered[0];
        let taken = take(
            &mut *conn,
            counter,
            document,
            &shared,
            n as i64,
            gapless_takes,
        )
        .await;
        let mut next = match taken {
            Err(LedgerError::CounterHeld) => {
                for index in indexes {
                    numbered[*index].unnumbered.clear();
                    held.push(*index);
                }
                continue;
            }
            taken => taken?,
        };
        for index in indexes {
            let write = &mut numbered[*index];
            for document in std::mem::take(&mut write.unnumbered) {
                write
                    .documents
                    .push(document.attachment.row(&document.shape, next));
                next += 1;
            }
        }
    }
    Ok((numbered, held))
}
