//! The writes of a shared write, grouped into ledger rows.

use std::collections::{HashMap, HashSet};

use super::{Group, LedgerWrite, Row};
use crate::domain::numbers::runs;

/// The writes of one batch grouped by (sequence, period, via), each number
/// claimed by the first write that holds it.
pub(super) struct Grouped {
    pub(super) groups: Vec<Group>,
    /// Per group, the numbers it records.
    pub(super) claimed: Vec<HashSet<i64>>,
    /// Per write: its group, and numbers it repeats (a list holding a
    /// number twice, or two requests of this batch popping the same one),
    /// which it must not get.
    pub(super) placed: Vec<(usize, Vec<i64>)>,
}

impl Grouped {
    pub(super) fn of(batch: &[LedgerWrite]) -> Self {
        let mut grouped = Grouped {
            groups: Vec::new(),
            claimed: Vec::new(),
            placed: Vec::with_capacity(batch.len()),
        };
        let mut group_index: HashMap<Group, usize> = HashMap::new();
        // Numbers of each sequence period already in this batch, whoever
        // (`POST /ids` or a document) holds them.
        let mut in_batch: HashMap<(i64, &str), HashSet<i64>> = HashMap::new();
        for write in batch {
            let group = Group {
                sequence_id: write.sequence_id,
                period: write.period.clone(),
                via: write.via,
            };
            let index = *group_index.entry(group.clone()).or_insert_with(|| {
                grouped.groups.push(group);
                grouped.claimed.push(HashSet::new());
                grouped.groups.len() - 1
            });
            let seen = in_batch
                .entry((write.sequence_id, write.period.as_str()))
                .or_default();
            let mut repeats = Vec::new();
            for seq in &write.seqs {
                if seen.insert(*seq) {
                    grouped.claimed[index].insert(*seq);
                } else {
                    repeats.push(*seq);
                }
            }
            grouped.placed.push((index, repeats));
        }
        grouped
    }

    /// One row per run of consecutive numbers of a group.
    pub(super) fn rows(&self) -> Vec<Row> {
        self.claimed
            .iter()
            .enumerate()
            .flat_map(|(group, seqs)| {
                let seqs: Vec<i64> = seqs.iter().copied().collect();
                runs(&seqs)
                    .into_iter()
                    .map(move |range| Row { group, range })
            })
            .collect()
    }
}
