//! What a format can print, as a pattern of literal text and fields (a
//! field: so many characters from a set), and the two questions asked of it:
//! which number does an ID carry (attaching an ID), and can two formats print
//! the same string (two sequences of a project, a format and its
//! predecessors).
//!
//! A pattern is only built for formats that read back one way: every field
//! whose width varies, except the last, is followed by literal text starting
//! with a character the field cannot print. Reading an ID is then one pass
//! from the left, linear in the ID, with no backtracking.

use std::collections::VecDeque;
use std::fmt;

/// A set of ASCII characters (fields never print anything else).
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct CharSet(u128);

impl CharSet {
    pub const DIGITS: CharSet = CharSet::range(b'0', b'9');
    pub const LETTERS: CharSet = CharSet::range(b'a', b'z').union(CharSet::range(b'A', b'Z'));

    pub const fn range(from: u8, to: u8) -> Self {
        let mut bits = 0u128;
        let mut c = from;
        while c <= to {
            bits |= 1 << c;
            c += 1;
        }
        CharSet(bits)
    }

    pub const fn of(chars: &[u8]) -> Self {
        let mut bits = 0u128;
        let mut i = 0;
        while i < chars.len() {
            bits |= 1 << chars[i];
            i += 1;
        }
        CharSet(bits)
    }

    pub const fn union(self, other: CharSet) -> Self {
        CharSet(self.0 | other.0)
    }

    pub fn contains(self, c: char) -> bool {
        c.is_ascii() && self.0 & (1 << c as u32) != 0
    }

    fn intersect(self, other: CharSet) -> CharSet {
        CharSet(self.0 & other.0)
    }

    /// Some character of the set, for examples.
    fn any(self) -> Option<char> {
        (self.0 != 0).then(|| char::from(self.0.trailing_zeros() as u8))
    }

    /// Every character seen in `text`, if all are ASCII.
    pub fn seen_in(text: &str) -> Option<Self> {
        text.chars()
            .try_fold(0u128, |bits, c| c.is_ascii().then(|| bits | 1 << c as u32))
            .map(CharSet)
    }
}

impl fmt::Debug for CharSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let chars: String = (0u8..128)
            .filter(|c| self.0 & (1 << c) != 0)
            .map(char::from)
            .collect();
        write!(f, "CharSet({chars:?})")
    }
}

/// So many characters, each from `chars`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub min: usize,
    pub max: usize,
    pub chars: CharSet,
    /// `Some(width)` for the sequence number (`{seq}` is width 0).
    pub seq: Option<usize>,
    /// The token as written, for messages.
    pub label: String,
}

impl Field {
    pub fn varies(&self) -> bool {
        self.min != self.max
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Text(String),
    Field(Field),
}

/// Why a format cannot be read back one way.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error(
    "{label} prints a varying number of characters, so it must be followed by literal text \
     starting with a character it never prints (such as '-'), not by {next}; otherwise two \
     different IDs could read alike"
)]
pub struct Ambiguous {
    pub label: String,
    pub next: String,
}

/// The parts of a format with project and type filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    parts: Vec<Part>,
    /// The last field whose width varies: it takes what the fixed parts
    /// after it leave.
    last_varying: Option<usize>,
    /// Characters the parts after `last_varying` take.
    suffix_chars: usize,
}

impl Pattern {
    /// Joins neighbouring text and checks that the pattern reads back one way.
    pub fn new(parts: Vec<Part>) -> Result<Self, Ambiguous> {
        let joined = join(parts);
        let varying: Vec<usize> = joined
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Part::Field(f) if f.varies()))
            .map(|(i, _)| i)
            .collect();
        let last_varying = varying.last().copied();
        for &i in varying.iter().rev().skip(1) {
            let Part::Field(field) = &joined[i] else {
                continue;
            };
            let next = joined.get(i + 1);
            let delimited = matches!(next, Some(Part::Text(text))
                if text.chars().next().is_some_and(|c| !field.chars.contains(c)));
            if !delimited {
                return Err(Ambiguous {
                    label: field.label.clone(),
                    next: match next {
                        Some(Part::Field(f)) => f.label.clone(),
                        Some(Part::Text(t)) => format!("{t:?}"),
                        None => "the end".into(),
                    },
                });
            }
        }
        let suffix_chars = last_varying.map_or(0, |last| {
            joined[last + 1..]
                .iter()
                .map(|p| match p {
                    Part::Text(t) => t.chars().count(),
                    Part::Field(f) => f.max,
                })
                .sum()
        });
        Ok(Self {
            parts: joined,
            last_varying,
            suffix_chars,
        })
    }

    /// A pattern that may not read back one way (a definition stored before
    /// the rule): good for asking what it could print, not for reading.
    pub fn loose(parts: Vec<Part>) -> Self {
        Self {
            parts: join(parts),
            last_varying: None,
            suffix_chars: 0,
        }
    }

    /// A pattern of a single field (the int64 layout: a decimal number).
    pub fn number(max_digits: usize, label: &str) -> Self {
        Self {
            parts: vec![Part::Field(Field {
                min: 1,
                max: max_digits,
                chars: CharSet::DIGITS,
                seq: Some(0),
                label: label.to_owned(),
            })],
            // The only field takes the whole ID (when its width is fixed,
            // reading never asks which field varies last).
            last_varying: Some(0),
            suffix_chars: 0,
        }
    }

    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Longest string the pattern prints, in characters.
    pub fn max_len(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.chars().count(),
                Part::Field(f) => f.max,
            })
            .sum()
    }

    /// The number `id` carries, if it reads as this pattern (dates are not
    /// checked: the caller formats the number again and compares).
    pub fn seq_of(&self, id: &str) -> Option<i64> {
        self.read(id, &mut 0)
    }

    /// One pass from the left. `steps` counts characters looked at, so
    /// tests can check the work is linear in the length of `id`.
    fn read(&self, id: &str, steps: &mut usize) -> Option<i64> {
        let mut left = id.chars().count();
        *steps += left;
        let mut rest = id;
        let mut seq = None;
        for (i, part) in self.parts.iter().enumerate() {
            match part {
                Part::Text(text) => {
                    *steps += text.len();
                    rest = rest.strip_prefix(text.as_str())?;
                    left -= text.chars().count();
                }
                Part::Field(field) => {
                    let take = if !field.varies() {
                        field.min
                    } else if Some(i) == self.last_varying {
                        left.checked_sub(self.suffix_chars)?
                    } else {
                        // Delimited: the text after it starts with a
                        // character the field never prints (a run longer
                        // than `max` fails on that text).
                        rest.chars()
                            .take(field.max)
                            .take_while(|c| field.chars.contains(*c))
                            .count()
                    };
                    if take < field.min || take > field.max {
                        return None;
                    }
                    let mut end = 0;
                    for c in rest.chars().take(take) {
                        *steps += 1;
                        if !field.chars.contains(c) {
                            return None;
                        }
                        end += c.len_utf8();
                    }
                    if end < take {
                        return None;
                    }
                    let (piece, after) = rest.split_at(end);
                    if let Some(width) = field.seq {
                        seq = Some(read_number(piece, width)?);
                    }
                    rest = after;
                    left -= take;
                }
            }
        }
        if rest.is_empty() { seq } else { None }
    }

    /// A string both patterns print, if there is one: the patterns as
    /// automata over character positions, explored together.
    pub fn common_example(&self, other: &Pattern) -> Option<String> {
        let a = Slots::of(self);
        let b = Slots::of(other);
        let width = b.len() + 1;
        let mut parent: Vec<Option<(usize, char)>> = vec![None; (a.len() + 1) * width];
        let mut seen = vec![false; (a.len() + 1) * width];
        let mut queue = VecDeque::new();
        for start_a in a.closure(0) {
            for start_b in b.closure(0) {
                let state = start_a * width + start_b;
                if !seen[state] {
                    seen[state] = true;
                    queue.push_back(state);
                }
            }
        }
        while let Some(state) = queue.pop_front() {
            let (pa, pb) = (state / width, state % width);
            if pa == a.len() && pb == b.len() {
                let mut example = Vec::new();
                let mut at = state;
                while let Some((from, c)) = parent[at] {
                    example.push(c);
                    at = from;
                }
                return Some(example.into_iter().rev().collect());
            }
            let (Some(sa), Some(sb)) = (a.slot(pa), b.slot(pb)) else {
                continue;
            };
            let Some(c) = sa.meet(sb) else {
                continue;
            };
            for na in a.closure(pa + 1) {
                for nb in b.closure(pb + 1) {
                    let next = na * width + nb;
                    if !seen[next] {
                        seen[next] = true;
                        parent[next] = Some((state, c));
                        queue.push_back(next);
                    }
                }
            }
        }
        None
    }
}

fn join(parts: Vec<Part>) -> Vec<Part> {
    let mut joined: Vec<Part> = Vec::with_capacity(parts.len());
    for part in parts {
        match (joined.last_mut(), part) {
            (_, Part::Text(text)) if text.is_empty() => {}
            (Some(Part::Text(previous)), Part::Text(text)) => previous.push_str(&text),
            (_, part) => joined.push(part),
        }
    }
    joined
}

/// A number as the sequence token prints it: at least `width` digits,
/// zero-padded, and no other leading zero.
fn read_number(digits: &str, width: usize) -> Option<i64> {
    let padded_exactly = digits.len() == width.max(1);
    if !padded_exactly && digits.starts_with('0') {
        return None;
    }
    digits.parse().ok()
}

/// One character position of a pattern.
#[derive(Clone, Copy)]
enum Slot {
    Char(char),
    /// A character of a field; `skip_to` is where the field ends when
    /// this and later positions of the field are optional.
    Of {
        chars: CharSet,
        skip_to: Option<usize>,
    },
}

impl Slot {
    /// A character both positions accept.
    fn meet(self, other: Slot) -> Option<char> {
        match (self, other) {
            (Slot::Char(a), Slot::Char(b)) => (a == b).then_some(a),
            (Slot::Char(c), Slot::Of { chars, .. }) | (Slot::Of { chars, .. }, Slot::Char(c)) => {
                chars.contains(c).then_some(c)
            }
            (Slot::Of { chars: a, .. }, Slot::Of { chars: b, .. }) => a.intersect(b).any(),
        }
    }
}

struct Slots(Vec<Slot>);

impl Slots {
    fn of(pattern: &Pattern) -> Self {
        let mut slots = Vec::new();
        for part in &pattern.parts {
            match part {
                Part::Text(text) => slots.extend(text.chars().map(Slot::Char)),
                Part::Field(field) => {
                    let end = slots.len() + field.max;
                    for k in 0..field.max {
                        slots.push(Slot::Of {
                            chars: field.chars,
                            skip_to: (k >= field.min).then_some(end),
                        });
                    }
                }
            }
        }
        Slots(slots)
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn slot(&self, at: usize) -> Option<Slot> {
        self.0.get(at).copied()
    }

    /// Positions reachable from `at` without reading a character.
    fn closure(&self, at: usize) -> Vec<usize> {
        let mut out = vec![at];
        let mut here = at;
        while let Some(Slot::Of {
            skip_to: Some(end), ..
        }) = self.slot(here)
        {
            out.push(end);
            here = end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn text(t: &str) -> Part {
        Part::Text(t.into())
    }

    fn digits(min: usize, max: usize, label: &str) -> Part {
        Part::Field(Field {
            min,
            max,
            chars: CharSet::DIGITS,
            seq: None,
            label: label.into(),
        })
    }

    fn seq(width: usize, max: usize) -> Part {
        Part::Field(Field {
            min: width.max(1),
            max: max.max(width),
            chars: CharSet::DIGITS,
            seq: Some(width),
            label: "{seq}".into(),
        })
    }

    #[test]
    fn a_varying_field_next_to_another_is_refused() {
        // {date:%-d}{seq}: Nov 1 number 15 and Nov 11 number 5 read alike.
        let refused = Pattern::new(vec![digits(1, 2, "%-d"), seq(0, 16)]);
        assert_eq!(
            refused,
            Err(Ambiguous {
                label: "%-d".into(),
                next: "{seq}".into()
            })
        );
        // A delimiter the day never prints makes it read one way.
        assert!(Pattern::new(vec![digits(1, 2, "%-d"), text("-"), seq(0, 16)]).is_ok());
        // Empty text is nothing: neither a delimiter nor a part.
        assert_eq!(
            Pattern::new(vec![digits(1, 2, "%-d"), text(""), seq(0, 16)]),
            Err(Ambiguous {
                label: "%-d".into(),
                next: "{seq}".into()
            })
        );
        assert_eq!(
            Pattern::new(vec![text(""), seq(0, 16), text("")]),
            Pattern::new(vec![seq(0, 16)])
        );
        // A digit is no delimiter.
        assert!(Pattern::new(vec![digits(1, 2, "%-d"), text("1"), seq(0, 16)]).is_err());
        // Fixed widths on either side of the number are fine.
        assert!(Pattern::new(vec![digits(8, 8, "%Y%m%d"), seq(0, 16), digits(2, 2, "%H")]).is_ok());
    }

    #[test]
    fn ids_read_back_to_their_numbers() {
        let p = Pattern::new(vec![text("PROJ-9012-"), seq(0, 16)]).unwrap();
        assert_eq!(p.seq_of("PROJ-9012-1001"), Some(1001));
        assert_eq!(p.seq_of("PROJ-9012-01001"), None);
        assert_eq!(p.seq_of("PROJ-9012-"), None);
        assert_eq!(p.seq_of("PROJ-9013-1001"), None);
        let daily = Pattern::new(vec![text("IS"), digits(8, 8, "%Y%m%d"), seq(4, 16)]).unwrap();
        assert_eq!(daily.seq_of("IS202611220007"), Some(7));
        assert_eq!(daily.seq_of("IS2026112212345"), Some(12345));
        assert_eq!(daily.seq_of("IS20261122007"), None);
        let suffix = Pattern::new(vec![seq(0, 16), text("/"), digits(2, 2, "%y")]).unwrap();
        assert_eq!(suffix.seq_of("123/26"), Some(123));
        assert_eq!(suffix.seq_of("123/2"), None);
    }

    #[test]
    fn overlapping_formats_are_found_with_an_example() {
        // {project}{type}{seq} for types A1 and A12 of project P.
        let a1 = Pattern::new(vec![text("PA1"), seq(0, 16)]).unwrap();
        let a12 = Pattern::new(vec![text("PA12"), seq(0, 16)]).unwrap();
        let example = a1.common_example(&a12).expect("they overlap");
        assert!(example.starts_with("PA12"), "{example}");
        assert_eq!(
            a1.seq_of(&example).is_some(),
            a12.seq_of(&example).is_some()
        );
        let a = Pattern::new(vec![text("P-A-"), seq(0, 16)]).unwrap();
        let b = Pattern::new(vec![text("P-B-"), seq(0, 16)]).unwrap();
        assert_eq!(a.common_example(&b), None);
        let a_dash = Pattern::new(vec![text("P-A1-"), seq(0, 16)]).unwrap();
        assert_eq!(a.common_example(&a_dash), None);
    }

    #[test]
    fn char_sets_combine_and_describe_themselves() {
        let ab = CharSet::of(b"ab");
        let bc = CharSet::of(b"bc");
        assert_eq!(ab.union(bc), CharSet::of(b"abc"), "overlapping sets unite");
        assert_eq!(ab.intersect(bc), CharSet::of(b"b"));
        assert_eq!(
            CharSet::DIGITS.intersect(CharSet::LETTERS),
            CharSet::default()
        );
        assert_eq!(CharSet::range(b'a', b'c'), CharSet::of(b"abc"));
        assert_eq!(
            CharSet::seen_in("abba"),
            Some(ab),
            "a character seen twice stays"
        );
        assert_eq!(CharSet::seen_in(""), Some(CharSet::default()));
        assert_eq!(CharSet::seen_in("a\u{e9}"), None, "only ASCII is a field's");
        assert!(CharSet::DIGITS.contains('7') && !CharSet::DIGITS.contains('a'));
        assert!(!CharSet::LETTERS.contains('\u{e9}'));
        assert_eq!(bc.any(), Some('b'));
        assert_eq!(CharSet::default().any(), None);
        assert_eq!(format!("{:?}", CharSet::of(b"b-a")), r#"CharSet("-ab")"#);
    }

    #[test]
    fn a_decimal_number_reads_as_itself_and_nothing_else() {
        let number = Pattern::number(19, "{seq}");
        assert_eq!(number.seq_of("9223372036854775807"), Some(i64::MAX));
        assert_eq!(number.seq_of("0"), Some(0));
        assert_eq!(number.seq_of("42"), Some(42));
        assert_eq!(number.seq_of("042"), None, "no leading zero");
        assert_eq!(number.seq_of(""), None);
        assert_eq!(number.seq_of("12345678901234567890"), None, "20 digits");
        assert_eq!(number.seq_of("12a"), None);
        let digit = Pattern::number(1, "{seq}");
        assert_eq!(digit.seq_of("7"), Some(7));
        assert_eq!(digit.seq_of("77"), None);
    }

    #[test]
    fn fields_take_exactly_their_widths() {
        // A fixed-width number and a fixed field after it: a short ID is
        // no ID, however much of it matches.
        let fixed = Pattern::new(vec![text("A"), seq(3, 3), digits(2, 2, "%y")]).unwrap();
        assert_eq!(fixed.seq_of("A12326"), Some(123));
        assert_eq!(fixed.seq_of("A1232"), None);
        assert_eq!(fixed.seq_of("A12"), None);
        assert_eq!(fixed.seq_of("A123266"), None);
        // A delimited field between its bounds only.
        let day = Pattern::new(vec![digits(2, 3, "d"), text("-"), seq(0, 16)]).unwrap();
        assert_eq!(day.seq_of("12-5"), Some(5));
        assert_eq!(day.seq_of("123-5"), Some(5));
        assert_eq!(day.seq_of("1-5"), None, "one digit is under the minimum");
        assert_eq!(
            day.seq_of("1234-5"),
            None,
            "four digits are over the maximum"
        );
        // A character outside the field's set, even one that spans bytes.
        assert_eq!(day.seq_of("1\u{e9}-5"), None);
        let letters = Pattern::new(vec![
            Part::Field(Field {
                min: 3,
                max: 3,
                chars: CharSet::LETTERS,
                seq: None,
                label: "%b".into(),
            }),
            seq(0, 16),
        ])
        .unwrap();
        assert_eq!(letters.seq_of("Nov7"), Some(7));
        assert_eq!(letters.seq_of("N\u{e9}v7"), None);
        assert_eq!(letters.seq_of("N\u{e9}7"), None);
    }

    #[test]
    fn reading_looks_at_each_character_twice() {
        // Once to count the characters, once to match them.
        let p = Pattern::new(vec![text("PROJ-9012-"), seq(0, 16)]).unwrap();
        let mut steps = 0;
        assert_eq!(p.read("PROJ-9012-1001", &mut steps), Some(1001));
        assert_eq!(steps, 2 * "PROJ-9012-1001".len());
    }

    /// Whether `pattern` prints `s`, by trying every width of every field:
    /// slow, and independent of the automaton `common_example` explores.
    fn prints(parts: &[Part], s: &str) -> bool {
        match parts.split_first() {
            None => s.is_empty(),
            Some((Part::Text(t), rest)) => {
                s.strip_prefix(t.as_str()).is_some_and(|s| prints(rest, s))
            }
            Some((Part::Field(f), rest)) => (f.min..=f.max).any(|n| {
                s.len() >= n
                    && s.is_char_boundary(n)
                    && s[..n].chars().all(|c| f.chars.contains(c))
                    && prints(rest, &s[n..])
            }),
        }
    }

    #[test]
    fn common_examples_are_printed_by_both_patterns() {
        let letters = |min, max| {
            Part::Field(Field {
                min,
                max,
                chars: CharSet::LETTERS,
                seq: None,
                label: "name".into(),
            })
        };
        // Fields whose sets never meet print nothing alike.
        let a = Pattern::loose(vec![text("P"), letters(3, 3), seq(0, 4)]);
        let b = Pattern::loose(vec![text("P"), digits(3, 3, "d"), seq(0, 4)]);
        assert_eq!(a.common_example(&b), None);
        // One ends where the other goes on: no string both print.
        let short = Pattern::loose(vec![text("P-"), seq(1, 2)]);
        let long = Pattern::loose(vec![text("P-"), seq(3, 4)]);
        assert_eq!(short.common_example(&long), None);
        // Widths that overlap in 2: the example is as long as both allow.
        let one_two = Pattern::loose(vec![text("P-"), digits(1, 2, "d"), text("x")]);
        let two_three = Pattern::loose(vec![text("P-"), digits(2, 3, "d"), text("x")]);
        let example = one_two
            .common_example(&two_three)
            .expect("two digits print alike");
        assert!(
            prints(one_two.parts(), &example) && prints(two_three.parts(), &example),
            "{example}"
        );
        assert_eq!(example.len(), "P-00x".len());
        // An optional field at the start of either.
        let optional = Pattern::loose(vec![digits(0, 2, "d"), text("Q"), seq(0, 3)]);
        let plain = Pattern::loose(vec![text("Q"), seq(0, 3)]);
        for (a, b) in [(&optional, &plain), (&plain, &optional)] {
            let example = a.common_example(b).expect("the field may print nothing");
            assert!(
                prints(a.parts(), &example) && prints(b.parts(), &example),
                "{example}"
            );
        }
    }

    fn arbitrary_part() -> impl Strategy<Value = Part> {
        prop_oneof![
            "[A-Za-z0-9_/.-]{1,3}".prop_map(Part::Text),
            (1usize..4, 0usize..3).prop_map(|(min, extra)| digits(min, min + extra, "d")),
            (1usize..4, 0usize..3).prop_map(|(min, extra)| Part::Field(Field {
                min,
                max: min + extra,
                chars: CharSet::LETTERS,
                seq: None,
                label: "name".into(),
            })),
        ]
    }

    /// A string the pattern prints, with the number it carries.
    fn sample(pattern: &Pattern, number: i64, fill: &[usize]) -> String {
        let mut out = String::new();
        let mut k = 0;
        for part in pattern.parts() {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Field(f) if f.seq.is_some() => {
                    let width = f.seq.unwrap_or(0);
                    out.push_str(&format!("{number:0width$}"));
                }
                Part::Field(f) => {
                    let n = f.min + fill.get(k).copied().unwrap_or(0) % (f.max - f.min + 1);
                    k += 1;
                    let c = f.chars.any().unwrap_or('0');
                    out.extend(std::iter::repeat_n(c, n));
                }
            }
        }
        out
    }

    proptest! {
        #[test]
        fn every_printed_id_reads_back_to_its_number(
            before in proptest::collection::vec(arbitrary_part(), 0..5),
            after in proptest::collection::vec(arbitrary_part(), 0..3),
            width in 0usize..6,
            number in 0i64..100_000_000,
            fill in proptest::collection::vec(0usize..5, 8),
        ) {
            let mut parts = before;
            parts.push(seq(width, 9));
            parts.extend(after);
            // Only formats that read one way are accepted; those must
            // give every number back.
            if let Ok(pattern) = Pattern::new(parts) {
                let id = sample(&pattern, number, &fill);
                let digits = format!("{number:0width$}").len();
                prop_assume!(digits <= 9);
                prop_assert_eq!(pattern.seq_of(&id), Some(number), "{} from {:?}", id, pattern);
            }
        }

        #[test]
        fn two_patterns_share_an_example_exactly_when_they_print_a_string_alike(
            a in proptest::collection::vec(arbitrary_part(), 1..5),
            b in proptest::collection::vec(arbitrary_part(), 1..5),
            fill in proptest::collection::vec(0usize..5, 8),
        ) {
            let (a, b) = (Pattern::loose(a), Pattern::loose(b));
            let example = a.common_example(&b);
            if let Some(example) = &example {
                prop_assert!(prints(a.parts(), example) && prints(b.parts(), example), "{:?}", example);
            }
            // A string `a` prints that `b` prints too must be found.
            let printed = sample(&a, 0, &fill);
            if prints(b.parts(), &printed) {
                prop_assert!(example.is_some(), "{} is printed by both", printed);
            }
        }

        #[test]
        fn reading_is_linear_in_the_length_of_the_id(
            parts in proptest::collection::vec(arbitrary_part(), 1..10),
            id in "[0-9a-zA-Z/._-]{0,4000}",
        ) {
            let mut parts = parts;
            parts.push(seq(0, 16));
            if let Ok(pattern) = Pattern::new(parts) {
                let mut steps = 0;
                let _ = pattern.read(&id, &mut steps);
                let bound = 3 * id.len() + pattern.max_len() + 64;
                prop_assert!(steps <= bound, "{} steps for {} characters", steps, id.len());
            }
        }
    }
}
