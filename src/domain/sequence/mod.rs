//! Sequences: a (project, type) pair and the definition of how its IDs look
//! and count.

pub mod name;
pub mod pattern;
mod period;
mod template;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use name::{CodeError, ProjectCode, TypeCode};
pub use pattern::Pattern;
pub use period::{Period, Reset, start_of_day};
pub use template::{Template, TemplateError, TextShape};

/// Longest formatted ID (SPEC).
pub const MAX_ID_LEN: usize = 64;
/// Cap for sequences without `max`: the largest integer a JSON number keeps
/// exactly in every client (2^53 - 1), and one Lua in Redis counts exactly.
pub const MAX_TEXT_SEQ: i64 = (1 << 53) - 1;
/// The 64-bit layout keeps its per-day counter in the low 32 bits.
pub const MAX_INT64_SEQ: i64 = (1 << 32) - 1;
pub const DEFAULT_FORMAT: &str = "{project}-{type}-{seq}";
pub const DEFAULT_POOL_SIZE: u32 = 1000;
pub const MAX_POOL_SIZE: u32 = 100_000;
pub const DEFAULT_REFILL_AT: f64 = 0.75;

/// How a number becomes an ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKind {
    /// The `format` template.
    #[default]
    Text,
    /// The coupon-order layout: 31-bit seconds since `epoch` (of the start of
    /// the day) above a 32-bit per-day counter, as one 64-bit integer.
    Int64,
}

/// Where a sequence's numbers come from (SPEC "Gapless sequences").
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    ToSchema,
    Default,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Numbering {
    /// Redis pools and leases over the counter; every gap explained.
    #[default]
    Pooled,
    /// Taken inside the transaction that writes the documents: no hole,
    /// every number a document or a recorded void.
    Gapless,
}

impl Numbering {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(word: &str) -> Option<Self> {
        match word {
            "pooled" => Some(Self::Pooled),
            "gapless" => Some(Self::Gapless),
            _ => None,
        }
    }
}

/// What a gapless sequence's events are chained into (SPEC "Registers an
/// auditor can verify").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RegisterKind {
    /// A hash chain of its own, one RFC 8785 entry per event.
    Chain,
    /// VERI*FACTU's records (alta, anulación), chained per issuer.
    Verifactu,
}

/// A sequence's register, as defined.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Register {
    #[default]
    None,
    Chain,
    /// With the issuer's NIF.
    Verifactu {
        issuer: String,
    },
}

impl Register {
    pub fn kind(&self) -> Option<RegisterKind> {
        match self {
            Register::None => None,
            Register::Chain => Some(RegisterKind::Chain),
            Register::Verifactu { .. } => Some(RegisterKind::Verifactu),
        }
    }

    pub fn issuer(&self) -> Option<&str> {
        match self {
            Register::Verifactu { issuer } => Some(issuer),
            _ => None,
        }
    }

    /// As stored: the kind's word and the issuer.
    pub fn parse(kind: Option<&str>, issuer: Option<String>) -> Option<Self> {
        match (kind, issuer) {
            (None, None) => Some(Register::None),
            (Some("chain"), None) => Some(Register::Chain),
            (Some("verifactu"), Some(issuer)) => Some(Register::Verifactu { issuer }),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&'static str> {
        match self {
            Register::None => None,
            Register::Chain => Some("chain"),
            Register::Verifactu { .. } => Some("verifactu"),
        }
    }
}

/// A NIF as AEAT writes it: nine letters and digits, upper case.
pub fn valid_issuer(issuer: &str) -> bool {
    issuer.len() == 9
        && issuer
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase())
}

#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    Text,
    Int64 { epoch: DateTime<Utc> },
}

/// Default epoch of the 64-bit layout (the seed's 2022-01-01T00:00:00Z).
pub fn default_int64_epoch() -> DateTime<Utc> {
    Utc.timestamp_opt(1_640_995_200, 0)
        .single()
        .unwrap_or_default()
}

/// A definition as a client writes it; every field optional, defaults as SPEC.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DefinitionInput {
    /// Template with `{project}`, `{type}`, `{seq}`, `{seq:N}`, `{date:FMT}`.
    #[schema(
        example = "{project}-{type}-{seq}",
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\u0000]*$"
    )]
    pub format: Option<String>,
    pub layout: Option<LayoutKind>,
    /// Epoch of the `int64` layout (RFC 3339); default 2022-01-01T00:00:00Z.
    pub epoch: Option<DateTime<Utc>>,
    /// First number of each period (default 1).
    #[serde(
        default,
        deserialize_with = "crate::domain::numbers::whole::option_i64"
    )]
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub start: Option<i64>,
    /// Last number of each period; past it the sequence is exhausted.
    #[serde(
        default,
        deserialize_with = "crate::domain::numbers::whole::option_i64"
    )]
    #[schema(minimum = 0, maximum = 9007199254740991_i64)]
    pub max: Option<i64>,
    pub reset: Option<Reset>,
    /// IANA time zone of the periods and `{date}` tokens (default `UTC`).
    #[schema(example = "UTC", pattern = r"^[^\u0000]*$")]
    pub timezone: Option<String>,
    /// Numbers kept ready in the Redis pool (default 1000).
    #[serde(
        default,
        deserialize_with = "crate::domain::numbers::whole::option_u32"
    )]
    #[schema(minimum = 1, maximum = 100000)]
    pub pool_size: Option<u32>,
    /// Fraction of the pool consumed that triggers a refill (default 0.75).
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub refill_at: Option<f64>,
    /// `pooled` (default) or `gapless`; cannot change once numbers were
    /// issued, even with `force`.
    pub numbering: Option<Numbering>,
    /// `chain` or `verifactu` (gapless sequences only): every event of a
    /// number appends a hash-chained entry; cannot change once numbers
    /// were taken.
    pub register: Option<RegisterKind>,
    /// The issuer's NIF (nine letters and digits), for `verifactu`.
    #[schema(example = "89890001K")]
    pub issuer: Option<String>,
    /// Allow changing `format`, `layout`, `reset` or `timezone` after numbers were issued.
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DefinitionError {
    #[error("format: {0}")]
    Format(#[from] TemplateError),
    #[error("timezone {0:?} is not an IANA time zone")]
    Timezone(String),
    #[error("start must be between 0 and {max}, got {start}")]
    Start { start: i64, max: i64 },
    #[error("max must be at least start ({start}) and at most {cap}, got {max}")]
    Max { max: i64, start: i64, cap: i64 },
    #[error("pool_size must be between 1 and {MAX_POOL_SIZE}, got {0}")]
    PoolSize(u32),
    #[error("refill_at must be greater than 0 and at most 1, got {0}")]
    RefillAt(f64),
    #[error("the int64 layout counts per day: reset must be daily, got {0}")]
    Int64Reset(&'static str),
    #[error("epoch must be on or after 1970-01-01T00:00:00Z")]
    Epoch,
    #[error(
        "a {0} sequence needs {{date:...}} tokens that change every period (naming the {1}, such as \
         {2}), or its IDs would repeat"
    )]
    PeriodNotInFormat(&'static str, &'static str, &'static str),
    #[error("IDs would be up to {0} characters long; the limit is {MAX_ID_LEN}")]
    TooLong(usize),
    #[error("a register needs \"numbering\": \"gapless\"")]
    RegisterNotGapless,
    #[error("a verifactu register needs \"issuer\", the issuer's NIF (nine letters and digits)")]
    Issuer,
    #[error("\"issuer\" belongs to a verifactu register only")]
    IssuerWithoutVerifactu,
    #[error("a verifactu register's IDs are invoice numbers: its format may not contain & or =")]
    VerifactuFormat,
}

/// A validated sequence definition.
#[derive(Debug, Clone, PartialEq)]
pub struct Definition {
    pub format: Template,
    pub layout: Layout,
    pub start: i64,
    pub max: Option<i64>,
    pub reset: Reset,
    pub timezone: Tz,
    pub pool_size: u32,
    pub refill_at: f64,
    pub numbering: Numbering,
    pub register: Register,
}

impl Definition {
    /// Validates `input` for the sequence `project`/`doc_type`, filling in defaults.
    pub fn from_input(
        input: &DefinitionInput,
        project: &ProjectCode,
        doc_type: &TypeCode,
    ) -> Result<Self, DefinitionError> {
        let layout = match input.layout.unwrap_or_default() {
            LayoutKind::Text => Layout::Text,
            LayoutKind::Int64 => {
                let epoch = input.epoch.unwrap_or_else(default_int64_epoch);
                if epoch.timestamp() < 0 {
                    return Err(DefinitionError::Epoch);
                }
                Layout::Int64 { epoch }
            }
        };
        let reset = match (&layout, input.reset) {
            (Layout::Int64 { .. }, None | Some(Reset::Daily)) => Reset::Daily,
            (Layout::Int64 { .. }, Some(other)) => {
                return Err(DefinitionError::Int64Reset(other.as_str()));
            }
            (Layout::Text, reset) => reset.unwrap_or_default(),
        };
        let format_text = input.format.as_deref().unwrap_or(DEFAULT_FORMAT);
        let format = Template::parse(format_text)?;
        let tz_name = input.timezone.as_deref().unwrap_or("UTC");
        let timezone: Tz = tz_name
            .parse()
            .map_err(|_| DefinitionError::Timezone(tz_name.to_owned()))?;
        let cap = match layout {
            Layout::Text => MAX_TEXT_SEQ,
            Layout::Int64 { .. } => MAX_INT64_SEQ,
        };
        let start = input.start.unwrap_or(1);
        if !(0..=cap).contains(&start) {
            return Err(DefinitionError::Start { start, max: cap });
        }
        if let Some(max) = input.max
            && !(start..=cap).contains(&max)
        {
            return Err(DefinitionError::Max { max, start, cap });
        }
        let pool_size = input.pool_size.unwrap_or(DEFAULT_POOL_SIZE);
        if !(1..=MAX_POOL_SIZE).contains(&pool_size) {
            return Err(DefinitionError::PoolSize(pool_size));
        }
        let refill_at = input.refill_at.unwrap_or(DEFAULT_REFILL_AT);
        if !(refill_at > 0.0 && refill_at <= 1.0) {
            return Err(DefinitionError::RefillAt(refill_at));
        }
        let definition = Definition {
            format,
            layout,
            start,
            max: input.max,
            reset,
            timezone,
            pool_size,
            refill_at,
            numbering: input.numbering.unwrap_or_default(),
            register: Self::register_of(input, format_text)?,
        };
        if definition.register != Register::None && definition.numbering != Numbering::Gapless {
            return Err(DefinitionError::RegisterNotGapless);
        }
        definition.check_periods_distinct()?;
        definition.check_pattern(project, doc_type)?;
        Ok(definition)
    }

    fn register_of(input: &DefinitionInput, format: &str) -> Result<Register, DefinitionError> {
        match (input.register, &input.issuer) {
            (None, None) => Ok(Register::None),
            (Some(RegisterKind::Chain), None) => Ok(Register::Chain),
            (Some(RegisterKind::Verifactu), Some(issuer)) if valid_issuer(issuer) => {
                // AEAT's text joins `campo=valor` with &: an ID holding
                // either would read two ways.
                if format.contains(['&', '=']) {
                    return Err(DefinitionError::VerifactuFormat);
                }
                Ok(Register::Verifactu {
                    issuer: issuer.clone(),
                })
            }
            (Some(RegisterKind::Verifactu), _) => Err(DefinitionError::Issuer),
            (_, Some(_)) => Err(DefinitionError::IssuerWithoutVerifactu),
        }
    }

    pub fn defaults(project: &ProjectCode, doc_type: &TypeCode) -> Result<Self, DefinitionError> {
        Self::from_input(&DefinitionInput::default(), project, doc_type)
    }

    /// Largest number a period can issue.
    pub fn max_seq(&self) -> i64 {
        self.max.unwrap_or(match self.layout {
            Layout::Text => MAX_TEXT_SEQ,
            Layout::Int64 { .. } => MAX_INT64_SEQ,
        })
    }

    pub fn layout_kind(&self) -> LayoutKind {
        match self.layout {
            Layout::Text => LayoutKind::Text,
            Layout::Int64 { .. } => LayoutKind::Int64,
        }
    }

    pub fn epoch(&self) -> Option<DateTime<Utc>> {
        match self.layout {
            Layout::Text => None,
            Layout::Int64 { epoch } => Some(epoch),
        }
    }

    pub fn period_at(&self, now: DateTime<Utc>) -> Period {
        self.reset.period_at(self.timezone, now)
    }

    /// Whether going from `self` to `next` changes how existing numbers read
    /// or where numbers come from, which SPEC refuses without `force` once
    /// numbers were issued (and a change of `numbering` even with it).
    pub fn changes_identity(&self, next: &Definition) -> bool {
        self.format != next.format
            || self.layout != next.layout
            || self.reset != next.reset
            || self.timezone != next.timezone
            || self.numbering != next.numbering
    }

    /// The instant to print a number of `period` at, given when it was
    /// recorded: the recorded time, kept inside the period, so `{date}`
    /// tokens always name the number's own period even when the recording
    /// clock and the issuing clock straddle a boundary.
    pub fn time_within(&self, period: &Period, recorded: DateTime<Utc>) -> DateTime<Utc> {
        let Some(start) = period.starts_at() else {
            return recorded;
        };
        let end = period
            .ends_at()
            .map(|next| next - chrono::Duration::microseconds(1))
            .unwrap_or(recorded);
        recorded.clamp(start, end.max(start))
    }

    /// How the IDs of numbers issued at `at` in `period` read.
    pub fn shape(
        &self,
        project: &str,
        doc_type: &str,
        period: &Period,
        at: DateTime<Utc>,
    ) -> Result<IdShape, LayoutRangeError> {
        match self.layout {
            Layout::Text => Ok(IdShape::Text(self.format.shape(
                project,
                doc_type,
                &at.with_timezone(&self.timezone),
            ))),
            Layout::Int64 { epoch } => {
                let day_start = period.starts_at().unwrap_or(at);
                let seconds = (day_start - epoch).num_seconds();
                if !(0..(1 << 31)).contains(&seconds) {
                    return Err(LayoutRangeError { seconds });
                }
                Ok(IdShape::Int64 {
                    base: seconds << 32,
                })
            }
        }
    }

    /// What IDs of this definition print, for reading them back and for
    /// telling whether two definitions could print the same ID.
    pub fn pattern(&self, project: &str, doc_type: &str) -> Result<Pattern, TemplateError> {
        match self.layout {
            Layout::Text => self
                .format
                .pattern(project, doc_type, digits(self.max_seq())),
            Layout::Int64 { .. } => Ok(Pattern::number(19, "the int64 layout")),
        }
    }

    /// For the int64 layout: the times of day (seconds after the epoch's
    /// time of day, 0 to 86,399) at which its periods begin, over every
    /// day the layout can express. A number's upper half counts seconds
    /// from the epoch to its day's start, so two int64 definitions whose
    /// sets share nothing never print the same number.
    pub fn int64_day_offsets(&self) -> Option<std::collections::BTreeSet<i64>> {
        let Layout::Int64 { epoch } = self.layout else {
            return None;
        };
        let mut offsets = std::collections::BTreeSet::new();
        let first = epoch.with_timezone(&self.timezone).date_naive();
        let last = (epoch + chrono::Duration::seconds(1 << 31))
            .with_timezone(&self.timezone)
            .date_naive();
        let mut day = first;
        while day <= last {
            let start = start_of_day(self.timezone, day);
            offsets.insert((start - epoch).num_seconds().rem_euclid(86_400));
            match day.succ_opt() {
                Some(next) => day = next,
                None => break,
            }
        }
        Some(offsets)
    }

    /// Longest ID a number of this definition can have; every ID issued is
    /// checked against it.
    pub fn longest_id(&self, shape: &IdShape) -> usize {
        match shape {
            IdShape::Text(text) => text.len_with_digits(digits(self.max_seq())),
            IdShape::Int64 { .. } => 19,
        }
    }

    /// Each period's IDs must name the period, or a counter that starts
    /// again would print the IDs of an earlier period.
    fn check_periods_distinct(&self) -> Result<(), DefinitionError> {
        if matches!(self.layout, Layout::Int64 { .. }) {
            return Ok(());
        }
        let calendar = self.format.calendar();
        let (named, what, example) = match self.reset {
            Reset::Never => return Ok(()),
            Reset::Daily => (calendar.names_the_day(), "day", "%Y%m%d or %y%j"),
            Reset::Monthly => (calendar.names_the_month(), "month", "%Y%m"),
            Reset::Yearly => (calendar.names_the_year(), "year", "%Y"),
        };
        if named {
            Ok(())
        } else {
            Err(DefinitionError::PeriodNotInFormat(
                self.reset.as_str(),
                what,
                example,
            ))
        }
    }

    /// Reads back one way and fits the 64-character limit at every instant.
    fn check_pattern(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
    ) -> Result<(), DefinitionError> {
        let longest = self.pattern(project.as_str(), doc_type.as_str())?.max_len();
        if longest > MAX_ID_LEN {
            return Err(DefinitionError::TooLong(longest));
        }
        Ok(())
    }
}

/// Decimal digits of a non-negative number.
fn digits(n: i64) -> usize {
    n.max(0).checked_ilog10().map_or(1, |d| d as usize + 1)
}

#[derive(Debug, thiserror::Error)]
#[error("the int64 layout cannot express a day {seconds} s after its epoch (0 to 2^31 - 1)")]
pub struct LayoutRangeError {
    pub seconds: i64,
}

/// What turns numbers of one request into IDs.
#[derive(Debug, Clone)]
pub enum IdShape {
    Text(TextShape),
    Int64 { base: i64 },
}

impl IdShape {
    pub fn id(&self, seq: i64) -> String {
        match self {
            IdShape::Text(shape) => shape.format(seq),
            IdShape::Int64 { base } => (base | seq).to_string(),
        }
    }

    /// The number clients see in `seqs`: the counter, or the whole 64-bit value.
    pub fn number(&self, seq: i64) -> i64 {
        match self {
            IdShape::Text(_) => seq,
            IdShape::Int64 { base } => base | seq,
        }
    }
}

/// A stored sequence.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: i64,
    pub project: ProjectCode,
    pub doc_type: TypeCode,
    pub definition: Definition,
    pub version: i32,
    /// Bumped by every change of how IDs read; counter reservations are
    /// refused to an instance placing numbers under an older one.
    pub identity_version: i32,
    /// Where counters of early periods start after a forced reset change.
    pub floor: Option<CounterFloor>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Counters of periods that began before `until` start at `value` (or
/// above): the numbers below it may have been printed under the old reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterFloor {
    pub value: i64,
    pub until: DateTime<Utc>,
}

impl Sequence {
    /// The number `id` carries, if it reads as an ID of this sequence's
    /// current definition at all (its period is not checked).
    pub fn seq_of(&self, id: &str) -> Option<i64> {
        let definition = &self.definition;
        match definition.layout {
            Layout::Text => definition
                .pattern(self.project.as_str(), self.doc_type.as_str())
                .ok()
                .and_then(|pattern| pattern.seq_of(id)),
            Layout::Int64 { .. } => id.parse::<i64>().ok().map(|n| n & 0xFFFF_FFFF),
        }
    }

    /// First number of a period's counter.
    pub fn first_number(&self, period: &Period) -> i64 {
        let start = self.definition.start;
        match self.floor {
            Some(floor) if period.starts_at().is_none_or(|s| s < floor.until) => {
                start.max(floor.value)
            }
            _ => start,
        }
    }
}

#[cfg(test)]
mod tests;
