//! Ranges of sequence numbers, half-open like Postgres' `int8range`.

use std::collections::HashMap;

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

    /// The numbers both ranges hold, if any.
    pub fn intersect(self, other: SeqRange) -> Option<SeqRange> {
        let start = self.start.max(other.start);
        let end = self.end.min(other.end);
        (start < end).then(|| SeqRange::new(start, end))
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

/// The ranges sorted, with overlapping or touching ones joined.
pub fn merge(mut ranges: Vec<SeqRange>) -> Vec<SeqRange> {
    ranges.sort();
    let mut out: Vec<SeqRange> = Vec::with_capacity(ranges.len());
    for range in ranges {
        match out.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => out.push(range),
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

/// `seqs` minus one occurrence per entry of `refused`.
pub fn without(seqs: Vec<i64>, refused: &[i64]) -> Vec<i64> {
    if refused.is_empty() {
        return seqs;
    }
    let mut remove: HashMap<i64, usize> = HashMap::new();
    for seq in refused {
        *remove.entry(*seq).or_default() += 1;
    }
    seqs.into_iter()
        .filter(|seq| match remove.get_mut(seq) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .collect()
}

/// Integers as JSON Schema counts them: `5` and `5.0` are the same
/// integer, `5.5` is none. (serde alone refuses `5.0` for an integer field,
/// which a client generated from the document may well send.)
pub mod whole {
    use serde::de::{Deserialize, Deserializer, Error};

    fn integer<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        let number = serde_json::Number::deserialize(d)?;
        number
            .as_i64()
            .or_else(|| {
                number
                    .as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                    .map(|f| f as i64)
            })
            .ok_or_else(|| D::Error::custom(format!("expected an integer, got {number}")))
    }

    pub fn i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        integer(d)
    }

    /// An integer as written: `2`, `2.0` and `2e0` are 2, but
    /// `1.9999999999999999999` (a double reads it as 2) is no integer and
    /// `10000.000000000000001` is not 10,000. Only serde_json's own
    /// deserializer (a request body's) keeps the text this needs.
    pub fn exact_i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        let raw = <Box<serde_json::value::RawValue>>::deserialize(d)?;
        let text = raw.get().trim();
        if let Ok(n) = text.parse::<i64>() {
            return Ok(n);
        }
        let not_integer = || D::Error::custom(format!("expected an integer, got {text}"));
        if !text.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
            return Err(not_integer());
        }
        // `-` and the significant digits, `e`, the exponent: integral when
        // the exponent is not negative.
        let exact = crate::domain::json_number::Decimal::parse(text).exact();
        let (significant, exponent) = exact.split_once('e').unwrap_or((&exact, "0"));
        let exponent: u32 = exponent.parse().map_err(|_| not_integer())?;
        let out_of_range = || D::Error::custom(format!("{text} is out of range"));
        let significant: i64 = significant.parse().map_err(|_| out_of_range())?;
        10i64
            .checked_pow(exponent)
            .and_then(|scale| significant.checked_mul(scale))
            .ok_or_else(out_of_range)
    }

    pub fn option_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        Option::<serde_json::Number>::deserialize(d)?
            .map(|n| integer(n).map_err(D::Error::custom))
            .transpose()
    }

    pub fn option_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        option_i64(d)?
            .map(|n| u32::try_from(n).map_err(|_| D::Error::custom(format!("{n} is out of range"))))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_exact_integer_is_one_as_written() {
        #[derive(serde::Deserialize)]
        struct Count {
            #[serde(deserialize_with = "whole::exact_i64")]
            count: i64,
        }
        let count = |text: &str| {
            serde_json::from_str::<Count>(&format!(r#"{{"count":{text}}}"#)).map(|c| c.count)
        };
        for (text, value) in [
            ("2", 2),
            ("2.0", 2),
            ("2e0", 2),
            ("20e-1", 2),
            ("-3", -3),
            ("1e3", 1000),
            ("0.0", 0),
        ] {
            assert_eq!(count(text).ok(), Some(value), "{text}");
        }
        for text in [
            "1.9999999999999999999",
            "0.99999999999999999999",
            "10000.000000000000001",
            "2.5",
            "1e-1",
            "\"2\"",
            "1e30",
            "true",
        ] {
            assert!(
                count(text).is_err(),
                "{text} read as {:?}",
                count(text).ok()
            );
        }
    }

    #[test]
    fn whole_floats_are_integers_and_fractions_are_not() {
        #[derive(serde::Deserialize)]
        struct T {
            #[serde(deserialize_with = "whole::i64")]
            n: i64,
            #[serde(default, deserialize_with = "whole::option_u32")]
            m: Option<u32>,
        }
        let t: T = serde_json::from_str(r#"{"n": 4812475.0, "m": 7.0}"#).unwrap();
        assert_eq!((t.n, t.m), (4812475, Some(7)));
        assert!(serde_json::from_str::<T>(r#"{"n": 1.5}"#).is_err());
        assert!(serde_json::from_str::<T>(r#"{"n": 1, "m": -1}"#).is_err());
        assert!(serde_json::from_str::<T>(r#"{"n": "3"}"#).is_err());
        let t: T = serde_json::from_str(r#"{"n": -3}"#).unwrap();
        assert_eq!((t.n, t.m), (-3, None));
    }

    #[test]
    fn without_removes_one_occurrence_per_refusal() {
        assert_eq!(without(vec![5, 6, 7], &[6]), vec![5, 7]);
        assert_eq!(without(vec![5, 5, 6], &[5]), vec![5, 6]);
        assert_eq!(without(vec![5, 6], &[5, 5, 5]), vec![6]);
        assert_eq!(without(vec![1, 2], &[]), vec![1, 2]);
    }

    #[test]
    fn intersect_is_what_both_hold() {
        let a = SeqRange::new(1, 10);
        assert_eq!(
            a.intersect(SeqRange::new(5, 20)),
            Some(SeqRange::new(5, 10))
        );
        assert_eq!(a.intersect(SeqRange::new(10, 20)), None);
    }

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
