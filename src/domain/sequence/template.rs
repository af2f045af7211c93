//! Format templates: `{project}-{type}-{seq}`, `{type}{date:%Y%m%d}{seq:4}`.
//!
//! A template has exactly one sequence token, so every formatted ID is
//! `head + number + tail`. [`Template::shape`] renders head and tail once per
//! request; formatting 10,000 IDs is then 10,000 integer writes.
//!
//! Every `{date:...}` item is classified when the template is parsed: how
//! many characters it prints, from which set, and which part of the calendar
//! it names. That is what [`Template::pattern`] and the definition checks
//! work from; nothing is learnt by sampling clocks.

use std::fmt::Write as _;

use chrono::format::{Fixed, Item, Numeric, Pad, StrftimeItems};
use chrono::{DateTime, TimeZone, Timelike};

use super::pattern::{Ambiguous, CharSet, Field, Part, Pattern};

/// Widest `{seq:N}` padding accepted: an i64 has at most 19 digits.
pub const MAX_SEQ_WIDTH: usize = 19;
/// Longest template source accepted.
pub const MAX_TEMPLATE_LEN: usize = 256;
/// Most `{...}` tokens in one template.
pub const MAX_TOKENS: usize = 16;
/// Most strftime items over all `{date:...}` tokens of one template.
pub const MAX_DATE_ITEMS: usize = 32;

/// Parts of the calendar a date item names; a reset period needs its IDs
/// to name it (see `Calendar::names_the_day`, `names_the_month`, `names_the_year`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calendar(u16);

impl Calendar {
    const YEAR: u16 = 1;
    const YEAR_OF_CENTURY: u16 = 1 << 2;
    const ISO_YEAR: u16 = 1 << 3;
    const MONTH: u16 = 1 << 4;
    const DAY: u16 = 1 << 5;
    const DAY_OF_YEAR: u16 = 1 << 6;
    const WEEK: u16 = 1 << 7;
    const ISO_WEEK: u16 = 1 << 8;
    const WEEKDAY: u16 = 1 << 9;
    const TIMESTAMP: u16 = 1 << 10;

    fn has(self, flags: u16) -> bool {
        self.0 & flags == flags
    }

    fn with(self, other: Calendar) -> Calendar {
        Calendar(self.0 | other.0)
    }

    fn year(self) -> bool {
        // A two-digit year counts: its IDs repeat after a century.
        self.has(Self::YEAR) || self.has(Self::YEAR_OF_CENTURY)
    }

    pub fn names_the_day(self) -> bool {
        self.has(Self::TIMESTAMP)
            || (self.year()
                && ((self.has(Self::MONTH) && self.has(Self::DAY))
                    || self.has(Self::DAY_OF_YEAR)
                    || (self.has(Self::WEEK) && self.has(Self::WEEKDAY))))
            || (self.has(Self::ISO_YEAR) && self.has(Self::ISO_WEEK) && self.has(Self::WEEKDAY))
    }

    pub fn names_the_month(self) -> bool {
        self.names_the_day() || (self.year() && self.has(Self::MONTH))
    }

    pub fn names_the_year(self) -> bool {
        self.names_the_month() || self.year()
    }
}

/// What one strftime item prints.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Printed {
    Text(String),
    Field {
        min: usize,
        max: usize,
        chars: CharSet,
        calendar: Calendar,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct DateItem {
    item: Item<'static>,
    printed: Printed,
    /// The item as written, for messages (`%-d in {date:%Y%m%-d}`).
    label: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Project,
    Type,
    Seq { width: usize },
    Date(Vec<DateItem>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    segments: Vec<Segment>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TemplateError {
    #[error("unknown token {{{0}}}: use {{project}}, {{type}}, {{seq}}, {{seq:N}} or {{date:FMT}}")]
    UnknownToken(String),
    #[error("a '{{' at byte {0} is never closed")]
    Unclosed(usize),
    #[error("a '}}' at byte {0} has no opening '{{'")]
    StrayClose(usize),
    #[error("the template needs exactly one {{seq}} or {{seq:N}} token, found {0}")]
    SeqCount(usize),
    #[error("{{seq:N}} needs N between 1 and {MAX_SEQ_WIDTH}, got {0:?}")]
    SeqWidth(String),
    #[error("{{date:{0}}} is not a valid strftime format")]
    DateFormat(String),
    #[error("{{date:{format}}}: {item} is not supported in IDs ({why})")]
    DateItem {
        format: String,
        item: String,
        why: &'static str,
    },
    #[error("the template may not contain control characters (found {0:?})")]
    ControlCharacter(char),
    #[error("the template is empty")]
    Empty,
    #[error("the template is {0} bytes long; the limit is {MAX_TEMPLATE_LEN}")]
    TooLong(usize),
    #[error("the template has {0} tokens; the limit is {MAX_TOKENS}")]
    TooManyTokens(usize),
    #[error("the template's {{date}} tokens hold {0} items; the limit is {MAX_DATE_ITEMS}")]
    TooManyDateItems(usize),
    #[error(transparent)]
    Ambiguous(#[from] Ambiguous),
}

impl Template {
    pub fn parse(source: &str) -> Result<Self, TemplateError> {
        if source.is_empty() {
            return Err(TemplateError::Empty);
        }
        if source.len() > MAX_TEMPLATE_LEN {
            return Err(TemplateError::TooLong(source.len()));
        }
        if let Some(c) = source.chars().find(|c| c.is_control()) {
            return Err(TemplateError::ControlCharacter(c));
        }
        let mut segments = Vec::new();
        let mut literal = String::new();
        let mut rest = source;
        let mut offset = 0;
        let mut tokens = 0;
        let mut date_items = 0;
        while let Some(pos) = rest.find(['{', '}']) {
            literal.push_str(&rest[..pos]);
            if rest.as_bytes()[pos] == b'}' {
                return Err(TemplateError::StrayClose(offset + pos));
            }
            let after_open = &rest[pos + 1..];
            let close = after_open
                .find('}')
                .ok_or(TemplateError::Unclosed(offset + pos))?;
            let token = &after_open[..close];
            if !literal.is_empty() {
                segments.push(Segment::Literal(std::mem::take(&mut literal)));
            }
            tokens += 1;
            if tokens > MAX_TOKENS {
                return Err(TemplateError::TooManyTokens(tokens));
            }
            let segment = parse_token(token)?;
            if let Segment::Date(items) = &segment {
                date_items += items.len();
                if date_items > MAX_DATE_ITEMS {
                    return Err(TemplateError::TooManyDateItems(date_items));
                }
            }
            segments.push(segment);
            let consumed = pos + 1 + close + 1;
            rest = &rest[consumed..];
            offset += consumed;
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            segments.push(Segment::Literal(literal));
        }
        let seq_tokens = segments
            .iter()
            .filter(|s| matches!(s, Segment::Seq { .. }))
            .count();
        if seq_tokens != 1 {
            return Err(TemplateError::SeqCount(seq_tokens));
        }
        Ok(Self {
            source: source.to_owned(),
            segments,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }

    pub fn has_date(&self) -> bool {
        self.segments.iter().any(|s| matches!(s, Segment::Date(_)))
    }

    /// The parts of the calendar the IDs name.
    pub fn calendar(&self) -> Calendar {
        self.date_items()
            .filter_map(|d| match d.printed {
                Printed::Field { calendar, .. } => Some(calendar),
                Printed::Text(_) => None,
            })
            .fold(Calendar::default(), Calendar::with)
    }

    fn date_items(&self) -> impl Iterator<Item = &DateItem> {
        self.segments.iter().flat_map(|s| match s {
            Segment::Date(items) => items.as_slice(),
            _ => &[],
        })
    }

    /// What IDs of this template print for the sequence `project`/`doc_type`
    /// whose numbers have at most `max_digits` digits; refused when two
    /// IDs could read alike.
    pub fn pattern(
        &self,
        project: &str,
        doc_type: &str,
        max_digits: usize,
    ) -> Result<Pattern, TemplateError> {
        Ok(Pattern::new(self.parts(project, doc_type, max_digits))?)
    }

    /// The parts of [`Template::pattern`], unchecked.
    pub fn parts(&self, project: &str, doc_type: &str, max_digits: usize) -> Vec<Part> {
        let mut parts = Vec::new();
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => parts.push(Part::Text(text.clone())),
                Segment::Project => parts.push(Part::Text(project.to_owned())),
                Segment::Type => parts.push(Part::Text(doc_type.to_owned())),
                Segment::Seq { width } => parts.push(Part::Field(Field {
                    min: (*width).max(1),
                    max: max_digits.max(*width),
                    chars: CharSet::DIGITS,
                    seq: Some(*width),
                    label: if *width == 0 {
                        "{seq}".into()
                    } else {
                        format!("{{seq:{width}}}")
                    },
                })),
                Segment::Date(items) => {
                    for item in items {
                        parts.push(match &item.printed {
                            Printed::Text(text) => Part::Text(text.clone()),
                            Printed::Field {
                                min, max, chars, ..
                            } => Part::Field(Field {
                                min: *min,
                                max: *max,
                                chars: *chars,
                                seq: None,
                                label: item.label.clone(),
                            }),
                        });
                    }
                }
            }
        }
        parts
    }

    /// Renders everything but the number for IDs issued at `at`.
    pub fn shape<Tz: TimeZone>(&self, project: &str, doc_type: &str, at: &DateTime<Tz>) -> TextShape
    where
        Tz::Offset: std::fmt::Display,
    {
        let mut head = String::new();
        let mut tail = String::new();
        let mut width = 0;
        let mut out = &mut head;
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => out.push_str(text),
                Segment::Project => out.push_str(project),
                Segment::Type => out.push_str(doc_type),
                Segment::Date(items) => {
                    // Validated at parse time, so writing cannot fail.
                    let _ = write!(
                        out,
                        "{}",
                        at.format_with_items(items.iter().map(|d| &d.item))
                    );
                }
                Segment::Seq { width: w } => {
                    width = *w;
                    out = &mut tail;
                }
            }
        }
        TextShape { head, tail, width }
    }
}

fn parse_token(token: &str) -> Result<Segment, TemplateError> {
    match token {
        "project" => return Ok(Segment::Project),
        "type" => return Ok(Segment::Type),
        "seq" => return Ok(Segment::Seq { width: 0 }),
        _ => {}
    }
    if let Some(width) = token.strip_prefix("seq:") {
        return match width.parse::<usize>() {
            Ok(w)
                if (1..=MAX_SEQ_WIDTH).contains(&w)
                    && width.bytes().all(|b| b.is_ascii_digit()) =>
            {
                Ok(Segment::Seq { width: w })
            }
            _ => Err(TemplateError::SeqWidth(width.to_owned())),
        };
    }
    if let Some(format) = token.strip_prefix("date:") {
        if format.is_empty() {
            return Err(TemplateError::DateFormat(String::new()));
        }
        return parse_date(format).map(Segment::Date);
    }
    Err(TemplateError::UnknownToken(token.to_owned()))
}

fn parse_date(format: &str) -> Result<Vec<DateItem>, TemplateError> {
    let mut items = Vec::new();
    for written in specifiers(format) {
        let label = format!("{written} in {{date:{format}}}");
        let refuse = |why: &'static str| TemplateError::DateItem {
            format: format.to_owned(),
            item: written.to_owned(),
            why,
        };
        // A specifier parses alike alone and in context; some (`%F`)
        // stand for several items.
        for item in StrftimeItems::new(written) {
            let (item, printed) = classify(item, &refuse)?;
            items.push(DateItem {
                item,
                printed,
                label: label.clone(),
            });
        }
    }
    Ok(items)
}

/// A strftime format cut into specifiers (`%Y`, `%-d`, `%.3f`, `%%`) and
/// the literal text between them.
fn specifiers(format: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = format;
    while !rest.is_empty() {
        let end = if let Some(spec) = rest.strip_prefix('%') {
            let flags = spec.len() - spec.trim_start_matches(['-', '0', '_', '#']).len();
            let after_flags = &spec[flags.min(1)..];
            // The offsets `%:z`, `%::z`, `%:::z`: the colons are the item's.
            let colons = (after_flags.len() - after_flags.trim_start_matches(':').len()).min(3);
            let after_colons = &after_flags[colons..];
            let dot = usize::from(after_colons.starts_with('.'));
            let digits = after_colons[dot..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            let head = 1 + flags.min(1) + colons + dot + digits;
            head + rest[head..].chars().next().map_or(0, char::len_utf8)
        } else {
            rest.find('%').unwrap_or(rest.len())
        };
        let (piece, after) = rest.split_at(end.min(rest.len()));
        out.push(piece);
        rest = after;
    }
    out
}

fn classify(
    item: Item<'_>,
    refuse: &dyn Fn(&'static str) -> TemplateError,
) -> Result<(Item<'static>, Printed), TemplateError> {
    let text = |s: &str| -> Result<Printed, TemplateError> {
        match s.chars().find(|c| c.is_control()) {
            Some(c) => Err(TemplateError::ControlCharacter(c)),
            None => Ok(Printed::Text(s.to_owned())),
        }
    };
    Ok(match item {
        Item::Literal(s) => (Item::OwnedLiteral(s.into()), text(s)?),
        Item::OwnedLiteral(s) => {
            let printed = text(&s)?;
            (Item::OwnedLiteral(s), printed)
        }
        Item::Space(s) => (Item::OwnedSpace(s.into()), text(s)?),
        Item::OwnedSpace(s) => {
            let printed = text(&s)?;
            (Item::OwnedSpace(s), printed)
        }
        Item::Numeric(numeric, pad) => {
            let printed = numeric_printed(&numeric, &pad, refuse)?;
            (Item::Numeric(numeric, pad), printed)
        }
        Item::Fixed(fixed) => {
            let printed = fixed_printed(&fixed, refuse)?;
            (Item::Fixed(fixed), printed)
        }
        Item::Error => return Err(refuse("not a strftime item")),
    })
}

fn field(min: usize, max: usize, chars: CharSet, calendar: u16) -> Printed {
    Printed::Field {
        min,
        max,
        chars,
        calendar: Calendar(calendar),
    }
}

/// What a numeric item (`%Y`, `%m`, `%-d`, ...) prints.
fn numeric_printed(
    numeric: &Numeric,
    pad: &Pad,
    refuse: &dyn Fn(&'static str) -> TemplateError,
) -> Result<Printed, TemplateError> {
    let (width, calendar) = match numeric {
        Numeric::Year => (4, Calendar::YEAR),
        // The century alone names no part of the calendar a reset needs.
        Numeric::YearDiv100 => (2, 0),
        Numeric::YearMod100 => (2, Calendar::YEAR_OF_CENTURY),
        Numeric::IsoYear => (4, Calendar::ISO_YEAR),
        Numeric::IsoYearMod100 => (2, Calendar::ISO_YEAR),
        Numeric::Quarter => (1, 0),
        Numeric::Month => (2, Calendar::MONTH),
        Numeric::Day => (2, Calendar::DAY),
        Numeric::WeekFromSun | Numeric::WeekFromMon => (2, Calendar::WEEK),
        Numeric::IsoWeek => (2, Calendar::ISO_WEEK),
        Numeric::NumDaysFromSun | Numeric::WeekdayFromMon => (1, Calendar::WEEKDAY),
        Numeric::Ordinal => (3, Calendar::DAY_OF_YEAR),
        Numeric::Hour | Numeric::Hour12 | Numeric::Minute | Numeric::Second => (2, 0),
        Numeric::Nanosecond => (9, 0),
        Numeric::Timestamp => return Ok(field(1, 12, CharSet::DIGITS, Calendar::TIMESTAMP)),
        _ => return Err(refuse("an item chrono keeps internal")),
    };
    Ok(match pad {
        Pad::Zero => field(width, width, CharSet::DIGITS, calendar),
        Pad::Space => field(
            width,
            width,
            CharSet::DIGITS.union(CharSet::of(b" ")),
            calendar,
        ),
        Pad::None => field(1, width, CharSet::DIGITS, calendar),
    })
}

/// What a fixed item (month and weekday names, offsets, fractions) prints.
/// Items chrono's strftime never yields (`RFC2822`, the `Z` offsets) are
/// refused as unknown, like any chrono may add.
fn fixed_printed(
    fixed: &Fixed,
    refuse: &dyn Fn(&'static str) -> TemplateError,
) -> Result<Printed, TemplateError> {
    let offset = CharSet::DIGITS.union(CharSet::of(b"+-:"));
    let fraction = CharSet::DIGITS.union(CharSet::of(b"."));
    Ok(match fixed {
        Fixed::ShortMonthName => field(3, 3, CharSet::LETTERS, Calendar::MONTH),
        Fixed::LongMonthName => field(3, 9, CharSet::LETTERS, Calendar::MONTH),
        Fixed::ShortWeekdayName => field(3, 3, CharSet::LETTERS, Calendar::WEEKDAY),
        Fixed::LongWeekdayName => field(6, 9, CharSet::LETTERS, Calendar::WEEKDAY),
        Fixed::LowerAmPm | Fixed::UpperAmPm => field(2, 2, CharSet::LETTERS, 0),
        Fixed::Nanosecond => field(0, 10, fraction, 0),
        Fixed::Nanosecond3 => field(4, 4, fraction, 0),
        Fixed::Nanosecond6 => field(7, 7, fraction, 0),
        Fixed::Nanosecond9 => field(10, 10, fraction, 0),
        Fixed::TimezoneOffset => field(5, 5, offset, 0),
        Fixed::TimezoneOffsetColon => field(6, 6, offset, 0),
        Fixed::TimezoneOffsetDoubleColon => field(9, 9, offset, 0),
        Fixed::TimezoneOffsetTripleColon => field(3, 3, offset, 0),
        Fixed::TimezoneName => {
            return Err(refuse("zone names are ambiguous; use %z for the offset"));
        }
        Fixed::RFC3339 => {
            return Err(refuse("use the date and time items it is made of"));
        }
        _ => internal_fixed(fixed).ok_or_else(|| refuse("unknown item"))?,
    })
}

/// chrono's internal items (`%3f`, `%6f`, `%9f`: digits of the second
/// without the dot) are opaque; their width is read off renderings.
fn internal_fixed(fixed: &Fixed) -> Option<Printed> {
    let item = Item::Fixed(fixed.clone());
    let base = DateTime::from_timestamp(1_767_225_600, 0)?;
    let mut widths = Vec::new();
    let mut chars = CharSet::default();
    for nanos in [0, 1, 123_456_789, 999_999_999] {
        let at = base.with_nanosecond(nanos)?;
        // Items chrono only reads (`%#z`) fail to print: refused.
        let mut printed = String::new();
        write!(printed, "{}", at.format_with_items(std::iter::once(&item))).ok()?;
        chars = chars.union(CharSet::seen_in(&printed)?);
        widths.push(printed.len());
    }
    let (min, max) = (*widths.iter().min()?, *widths.iter().max()?);
    let digits_only = CharSet::DIGITS.union(chars) == CharSet::DIGITS;
    (min == max && digits_only).then_some(Printed::Field {
        min,
        max,
        chars: CharSet::DIGITS,
        calendar: Calendar::default(),
    })
}

/// A template rendered for one instant: only the number is left to fill in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextShape {
    head: String,
    tail: String,
    width: usize,
}

impl TextShape {
    pub fn format(&self, seq: i64) -> String {
        let mut id = String::with_capacity(self.head.len() + self.tail.len() + 20);
        id.push_str(&self.head);
        let _ = write!(id, "{seq:0width$}", width = self.width);
        id.push_str(&self.tail);
        id
    }

    /// Length in characters of the ID of a number with `digits` digits.
    pub fn len_with_digits(&self, digits: usize) -> usize {
        self.head.chars().count() + digits.max(self.width) + self.tail.chars().count()
    }
}

#[cfg(test)]
mod tests;
