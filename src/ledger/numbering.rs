//! Documents of gapless sequences in a shared write: numbered inside the
//! write's transaction, from their counters, in commit order.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use crate::db::Link;

use super::outbox::Attachment;
use super::{LedgerError, LedgerWrite};
use crate::sequence::IdShape;

/// A document whose number is taken when it is written.
#[derive(Debug, Clone)]
pub struct Unnumbered {
    pub attachment: Arc<Attachment>,
    /// How its ID prints.
    pub shape: IdShape,
}

/// Takes numbers of gapless sequences for a shared write, inside its
/// transaction (the counter row stays locked until the commit).
pub trait GaplessCounter: Sync {
    /// `n` numbers of the sequence period of `writes` (indexes of the
    /// writes given to [`write_shared`], all of one sequence period, to be
    /// numbered in this order); the first of them.
    fn take(
        &self,
        conn: &mut impl Link,
        writes: &[usize],
        n: i64,
    ) -> impl Future<Output = Result<i64, LedgerError>> + Send;
}

/// For writes that carry no unnumbered document.
pub struct NoGapless;

impl GaplessCounter for NoGapless {
    async fn take(&self, _: &mut impl Link, _: &[usize], _: i64) -> Result<i64, LedgerError> {
        Err(LedgerError::DefinitionChanged)
    }
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
    gapless: &impl GaplessCounter,
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
        let taken = gapless.take(&mut *conn, &shared, n as i64).await;
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
