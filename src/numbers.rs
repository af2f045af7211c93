//! Ranges of sequence numbers, half-open like Postgres' `int8range`.

use sqlx::postgres::types::PgRange;
use std::ops::Bound;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqRange {
    pub start: i64,
    /// One past the last number.
    pub end: i64,
}

impl SeqRange {
    pub fn new(start: i64, end: i64) -> Self {
        debug_assert!(start <= end);
        Self { start, end }
    }

    pub fn single(seq: i64) -> Self {
        Self::new(seq, seq + 1)
    }

    pub fn len(&self) -> i64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    pub fn last(&self) -> i64 {
        self.end - 1
    }

    pub fn contains(&self, seq: i64) -> bool {
        (self.start..self.end).contains(&seq)
    }

    pub fn iter(&self) -> std::ops::Range<i64> {
        self.start..self.end
    }

    /// Reads a canonical (`[)`) Postgres int8range.
    pub fn from_pg(range: &PgRange<i64>) -> Option<Self> {
        match (range.start, range.end) {
            (Bound::Included(s), Bound::Excluded(e)) if s < e => Some(Self::new(s, e)),
            _ => None,
        }
    }

    pub fn to_pg(self) -> PgRange<i64> {
        PgRange {
            start: Bound::Included(self.start),
            end: Bound::Excluded(self.end),
        }
    }
}

/// Collapses numbers into the fewest ranges: `[1, 2, 3, 7]` → `[1,4) [7,8)`.
/// The input need not be sorted; duplicates are kept out.
pub fn runs(seqs: &[i64]) -> Vec<SeqRange> {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<SeqRange> = Vec::new();
    for seq in sorted {
        match out.last_mut() {
            Some(last) if last.end == seq => last.end = seq + 1,
            _ => out.push(SeqRange::single(seq)),
        }
    }
    out
}

/// `whole` minus the sorted, disjoint `taken` ranges.
pub fn subtract(whole: SeqRange, taken: &[SeqRange]) -> Vec<SeqRange> {
    let mut out = Vec::new();
    let mut cursor = whole.start;
    for t in taken {
        if t.end <= cursor || t.start >= whole.end {
            continue;
        }
        if t.start > cursor {
            out.push(SeqRange::new(cursor, t.start));
        }
        cursor = cursor.max(t.end);
    }
    if cursor < whole.end {
        out.push(SeqRange::new(cursor, whole.end));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn runs_merge_neighbours() {
        assert_eq!(
            runs(&[7, 1, 3, 2, 2]),
            vec![SeqRange::new(1, 4), SeqRange::new(7, 8)]
        );
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn subtract_leaves_the_holes() {
        let whole = SeqRange::new(1, 11);
        let taken = [
            SeqRange::new(0, 2),
            SeqRange::new(4, 6),
            SeqRange::new(9, 20),
        ];
        assert_eq!(
            subtract(whole, &taken),
            vec![SeqRange::new(2, 4), SeqRange::new(6, 9)]
        );
        assert_eq!(subtract(whole, &[]), vec![whole]);
    }

    proptest! {
        #[test]
        fn runs_cover_exactly_the_input(seqs in proptest::collection::vec(0i64..500, 0..200)) {
            let ranges = runs(&seqs);
            let mut expanded: Vec<i64> = ranges.iter().flat_map(|r| r.iter()).collect();
            let mut expected = seqs.clone();
            expected.sort_unstable();
            expected.dedup();
            prop_assert_eq!(&expanded, &expected);
            // Maximal: no two ranges touch.
            for pair in ranges.windows(2) {
                prop_assert!(pair[0].end < pair[1].start);
            }
            expanded.clear();
        }

        #[test]
        fn subtract_and_taken_partition_the_whole(cuts in proptest::collection::vec(0i64..100, 0..20)) {
            let taken = runs(&cuts);
            let whole = SeqRange::new(10, 90);
            let left = subtract(whole, &taken);
            for seq in whole.iter() {
                let in_left = left.iter().any(|r| r.contains(seq));
                let in_taken = taken.iter().any(|r| r.contains(seq));
                prop_assert!(in_left != in_taken);
            }
        }
    }
}
