//! JSON numbers as written: the text of a metadata object keeps them
//! exactly, and so do Postgres' `jsonb` (as `numeric`) and our deliveries.
//! serde_json reads a number as a double unless its `arbitrary_precision`
//! feature is on, which would change every crate of the tree that reads
//! numbers; so the few places that need a number's value as written find
//! it in the text.

use std::ops::Range;

/// Where each number literal of well-formed JSON `raw` is, in order:
/// one pass over its bytes, digits inside strings not counted.
pub fn literals(raw: &str) -> impl Iterator<Item = Range<usize>> + '_ {
    let bytes = raw.as_bytes();
    let mut at = 0;
    std::iter::from_fn(move || {
        while at < bytes.len() {
            match bytes[at] {
                b'"' => {
                    // To the closing quote, over escapes.
                    at += 1;
                    while at < bytes.len() && bytes[at] != b'"' {
                        at += if bytes[at] == b'\\' { 2 } else { 1 };
                    }
                    at += 1;
                }
                b'-' | b'0'..=b'9' => {
                    let start = at;
                    at = bytes[at..]
                        .iter()
                        .position(|b| !matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                        .map_or(bytes.len(), |n| at + n);
                    return Some(start..at);
                }
                _ => at += 1,
            }
        }
        None
    })
}

/// A JSON number literal's value: `digits × 10^exponent`, the digits
/// without leading zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decimal {
    negative: bool,
    digits: String,
    exponent: i64,
    /// The exponent as written (after `e`), saturating.
    written_exponent: i64,
}

impl Decimal {
    /// `literal` must be a JSON number (as [`literals`] finds them).
    pub fn parse(literal: &str) -> Self {
        let (negative, rest) = match literal.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, literal),
        };
        let (mantissa, exponent) = rest.split_once(['e', 'E']).unwrap_or((rest, "0"));
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let (exponent_negative, exponent_digits) = match exponent.as_bytes().first() {
            Some(b'-') => (true, &exponent[1..]),
            Some(b'+') => (false, &exponent[1..]),
            _ => (false, exponent),
        };
        // Saturating: exponents past 9e18 are not worth telling apart.
        let magnitude = exponent_digits.bytes().fold(0i64, |n, digit| {
            n.saturating_mul(10)
                .saturating_add(i64::from(digit.wrapping_sub(b'0')))
        });
        let exponent = if exponent_negative {
            -magnitude
        } else {
            magnitude
        };
        let digits = format!("{whole}{fraction}")
            .trim_start_matches('0')
            .to_owned();
        Self {
            negative,
            digits,
            exponent: exponent.saturating_sub(fraction.len() as i64),
            written_exponent: exponent,
        }
    }

    /// Whether Postgres' `numeric` takes the number: its written exponent
    /// within ±(2^31 / 2), even for a zero (`0e99999999999999999999` is
    /// refused), and its digits within [`POSTGRES_WHOLE_DIGITS`] before
    /// the point and [`POSTGRES_SCALE`] after.
    pub fn fits_postgres(&self) -> bool {
        const EXPONENT_LIMIT: i64 = i32::MAX as i64 / 2;
        let (whole, scale) = self.printed_digits();
        self.written_exponent.abs() < EXPONENT_LIMIT
            && whole <= POSTGRES_WHOLE_DIGITS
            && scale <= POSTGRES_SCALE
    }

    /// One form for one value: `-` if negative, the significant digits,
    /// `e` and the exponent (`1`, `1.0`, `10e-1` and `0.1e1` are all
    /// `1e0`; every zero is `0`).
    pub fn exact(&self) -> String {
        let significant = self.digits.trim_end_matches('0');
        if significant.is_empty() {
            return "0".into();
        }
        let exponent = self
            .exponent
            .saturating_add((self.digits.len() - significant.len()) as i64);
        let sign = if self.negative { "-" } else { "" };
        format!("{sign}{significant}e{exponent}")
    }

    /// (digits before the point, digits after it) as Postgres prints the
    /// number: in full, no exponent, keeping the scale it was written
    /// with (`1.50` prints `1.50`, `1e3` prints `1000`, `1e-3` `0.001`).
    pub fn printed_digits(&self) -> (u64, u64) {
        let digits = self.digits.len() as i64;
        if self.exponent >= 0 {
            let whole = if digits == 0 {
                1
            } else {
                digits.saturating_add(self.exponent)
            };
            (whole as u64, 0)
        } else {
            let scale = self.exponent.unsigned_abs();
            let whole = digits.saturating_sub(scale as i64).max(1);
            (whole as u64, scale)
        }
    }

    /// Characters Postgres prints for the number.
    pub fn printed_len(&self) -> u64 {
        let (whole, scale) = self.printed_digits();
        let point = if scale > 0 { 1 } else { 0 };
        u64::from(self.negative)
            .saturating_add(whole)
            .saturating_add(point)
            .saturating_add(scale)
    }
}

/// Postgres' `numeric` holds at most this many digits before the point.
pub const POSTGRES_WHOLE_DIGITS: u64 = 131_072;
/// ... and this many after it.
pub const POSTGRES_SCALE: u64 = 16_383;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_found_outside_strings_only() {
        let raw = r#"{"a": -1.5e3, "s": "2 \" 3", "b": [0, 4E+2], "t": true}"#;
        let found: Vec<&str> = literals(raw).map(|r| &raw[r]).collect();
        assert_eq!(found, ["-1.5e3", "0", "4E+2"]);
    }

    #[test]
    fn numbers_as_written_have_one_form_per_value() {
        for (literal, form) in [
            ("0", "0"),
            ("-0", "0"),
            ("0.000e5", "0"),
            ("1", "1e0"),
            ("1.0", "1e0"),
            ("1e0", "1e0"),
            ("10e-1", "1e0"),
            ("0.1E+1", "1e0"),
            ("100", "1e2"),
            ("-2.50", "-25e-1"),
            ("1e-400", "1e-400"),
            ("0.30000000000000000001", "30000000000000000001e-20"),
            ("1e99999999999999999999", "1e9223372036854775807"),
        ] {
            assert_eq!(Decimal::parse(literal).exact(), form, "{literal}");
        }
    }

    #[test]
    fn printed_lengths_are_what_postgres_prints() {
        for (literal, printed) in [
            ("0", "0"),
            ("-12", "-12"),
            ("1.50", "1.50"),
            ("1e3", "1000"),
            ("1.5e3", "1500"),
            ("1e-3", "0.001"),
            ("12.5e-1", "1.25"),
            ("0.000", "0.000"),
        ] {
            assert_eq!(
                Decimal::parse(literal).printed_len(),
                printed.len() as u64,
                "{literal}"
            );
        }
        assert_eq!(Decimal::parse("1e131000").printed_digits(), (131_001, 0));
        assert_eq!(Decimal::parse("1e-20000").printed_digits(), (1, 20_000));
    }

    #[test]
    fn what_postgres_numeric_refuses_is_known_before_it_is_sent() {
        for fits in ["0", "1e131000", "1e-16383", "0e1000000", "-12.5"] {
            assert!(Decimal::parse(fits).fits_postgres(), "{fits}");
        }
        for refused in [
            "1e131072",
            "1e-16384",
            "0e-20000",
            "0e99999999999999999999",
            "0.0e-99999999999999999999",
            "0e1073741823",
        ] {
            assert!(!Decimal::parse(refused).fits_postgres(), "{refused}");
        }
    }
}
