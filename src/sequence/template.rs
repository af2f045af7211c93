//! Format templates: `{project}-{type}-{seq}`, `{type}{date:%Y%m%d}{seq:4}`.
//!
//! A template has exactly one sequence token, so every formatted ID is
//! `head + number + tail`. [`Template::shape`] renders head and tail once per
//! request; formatting 10,000 IDs is then 10,000 integer writes.

use std::fmt::Write as _;

use chrono::format::{Item, StrftimeItems};
use chrono::{DateTime, TimeZone};

/// Widest `{seq:N}` padding accepted: an i64 has at most 19 digits.
pub const MAX_SEQ_WIDTH: usize = 19;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Project,
    Type,
    Seq { width: usize },
    Date(String),
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
    #[error("the template is empty")]
    Empty,
}

impl Template {
    pub fn parse(source: &str) -> Result<Self, TemplateError> {
        if source.is_empty() {
            return Err(TemplateError::Empty);
        }
        let mut segments = Vec::new();
        let mut literal = String::new();
        let mut rest = source;
        let mut offset = 0;
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
            segments.push(parse_token(token)?);
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
                Segment::Date(fmt) => {
                    // Validated at parse time, so writing cannot fail.
                    let _ = write!(out, "{}", at.format_with_items(StrftimeItems::new(fmt)));
                }
                Segment::Seq { width: w } => {
                    width = *w;
                    out = &mut tail;
                }
            }
        }
        TextShape { head, tail, width }
    }

    /// Numbers an ID of this template could carry: every way `id` splits
    /// into the template's parts, with dates matched loosely. The caller
    /// confirms a candidate by formatting it again.
    pub fn seq_candidates(&self, id: &str, project: &str, doc_type: &str) -> Vec<i64> {
        let mut found = Vec::new();
        self.match_from(0, id, project, doc_type, None, &mut found);
        found.sort_unstable();
        found.dedup();
        found
    }

    fn match_from(
        &self,
        segment: usize,
        rest: &str,
        project: &str,
        doc_type: &str,
        seq: Option<i64>,
        found: &mut Vec<i64>,
    ) {
        let Some(current) = self.segments.get(segment) else {
            if rest.is_empty()
                && let Some(seq) = seq
            {
                found.push(seq);
            }
            return;
        };
        let literal = match current {
            Segment::Literal(text) => Some(text.as_str()),
            Segment::Project => Some(project),
            Segment::Type => Some(doc_type),
            _ => None,
        };
        if let Some(literal) = literal {
            if let Some(after) = rest.strip_prefix(literal) {
                self.match_from(segment + 1, after, project, doc_type, seq, found);
            }
            return;
        }
        // A number or a date: try every split point.
        for end in (1..=rest.len()).filter(|&end| rest.is_char_boundary(end)) {
            let (part, after) = rest.split_at(end);
            match current {
                Segment::Seq { width } => {
                    if !part.bytes().all(|b| b.is_ascii_digit()) {
                        break;
                    }
                    // Padded to `width`, so never shorter; longer only without
                    // leading zeros.
                    let fits = part.len() == (*width).max(1)
                        || (part.len() > *width && !part.starts_with('0'));
                    if fits && let Ok(n) = part.parse::<i64>() {
                        self.match_from(segment + 1, after, project, doc_type, Some(n), found);
                    }
                }
                _ => self.match_from(segment + 1, after, project, doc_type, seq, found),
            }
        }
    }

    /// The rendered date tokens alone, to check that they tell periods apart.
    pub fn date_part<Tz: TimeZone>(&self, at: &DateTime<Tz>) -> String
    where
        Tz::Offset: std::fmt::Display,
    {
        let mut out = String::new();
        for segment in &self.segments {
            if let Segment::Date(fmt) = segment {
                let _ = write!(out, "{}", at.format_with_items(StrftimeItems::new(fmt)));
                out.push('\u{1f}');
            }
        }
        out
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
    if let Some(fmt) = token.strip_prefix("date:") {
        let valid =
            !fmt.is_empty() && StrftimeItems::new(fmt).all(|item| !matches!(item, Item::Error));
        return if valid {
            Ok(Segment::Date(fmt.to_owned()))
        } else {
            Err(TemplateError::DateFormat(fmt.to_owned()))
        };
    }
    Err(TemplateError::UnknownToken(token.to_owned()))
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

    /// Length of the ID for a number with `digits` digits.
    pub fn len_with_digits(&self, digits: usize) -> usize {
        self.head.chars().count() + digits.max(self.width) + self.tail.chars().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use proptest::prelude::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn default_template_formats_like_spec() {
        let t = Template::parse("{project}-{type}-{seq}").unwrap();
        let shape = t.shape("PROJ", "9012", &at("2026-11-22T10:00:00Z"));
        assert_eq!(shape.format(1001), "PROJ-9012-1001");
    }

    #[test]
    fn order_number_template_pads_and_dates() {
        let t = Template::parse("{type}{date:%Y%m%d}{seq:4}").unwrap();
        let shape = t.shape("P", "IS", &at("2026-11-22T10:00:00Z"));
        assert_eq!(shape.format(7), "IS202611220007");
        assert_eq!(shape.format(12345), "IS2026112212345");
        assert!(t.has_date());
    }

    #[test]
    fn refuses_malformed_templates() {
        assert_eq!(Template::parse(""), Err(TemplateError::Empty));
        assert_eq!(
            Template::parse("{project}"),
            Err(TemplateError::SeqCount(0))
        );
        assert_eq!(
            Template::parse("{seq}-{seq}"),
            Err(TemplateError::SeqCount(2))
        );
        assert_eq!(Template::parse("{seq"), Err(TemplateError::Unclosed(0)));
        assert_eq!(
            Template::parse("a}{seq}"),
            Err(TemplateError::StrayClose(1))
        );
        assert_eq!(
            Template::parse("{user}{seq}"),
            Err(TemplateError::UnknownToken("user".into()))
        );
        assert_eq!(
            Template::parse("{seq:0}"),
            Err(TemplateError::SeqWidth("0".into()))
        );
        assert_eq!(
            Template::parse("{seq:20}"),
            Err(TemplateError::SeqWidth("20".into()))
        );
        assert_eq!(
            Template::parse("{seq:+4}"),
            Err(TemplateError::SeqWidth("+4".into()))
        );
        assert_eq!(
            Template::parse("{date:%Q}{seq}"),
            Err(TemplateError::DateFormat("%Q".into()))
        );
        assert_eq!(
            Template::parse("{date:}{seq}"),
            Err(TemplateError::DateFormat("".into()))
        );
    }

    #[test]
    fn ids_parse_back_to_their_numbers() {
        let t = Template::parse("{project}-{type}-{seq}").unwrap();
        assert_eq!(
            t.seq_candidates("PROJ-9012-1001", "PROJ", "9012"),
            vec![1001]
        );
        assert!(
            t.seq_candidates("PROJ-9012-01001", "PROJ", "9012")
                .is_empty()
        );
        assert!(
            t.seq_candidates("PROJ-9013-1001", "PROJ", "9012")
                .is_empty()
        );
        assert!(t.seq_candidates("PROJ-9012-", "PROJ", "9012").is_empty());
        let daily = Template::parse("{type}{date:%Y%m%d}{seq:4}").unwrap();
        let candidates = daily.seq_candidates("IS202611220007", "P", "IS");
        assert!(candidates.contains(&7), "{candidates:?}");
        // The date part is matched loosely; formatting again decides.
        let shape = daily.shape("P", "IS", &at("2026-11-22T10:00:00Z"));
        let confirmed: Vec<i64> = candidates
            .into_iter()
            .filter(|&n| shape.format(n) == "IS202611220007")
            .collect();
        assert_eq!(confirmed, vec![7]);
    }

    proptest! {
        #[test]
        fn formatted_ids_parse_back(seq in 0i64..10_000_000, width in 0usize..8) {
            let source = if width == 0 { "{project}/{seq}".to_owned() } else { format!("{{project}}/{{seq:{width}}}") };
            let t = Template::parse(&source).unwrap();
            let id = t.shape("P", "T", &at("2026-01-01T00:00:00Z")).format(seq);
            prop_assert_eq!(t.seq_candidates(&id, "P", "T"), vec![seq]);
        }

        #[test]
        fn every_number_lands_between_head_and_tail(
            prefix in "[A-Z]{0,5}",
            suffix in "[a-z]{0,5}",
            width in 1usize..=19,
            seq in 0i64..i64::MAX,
        ) {
            let t = Template::parse(&format!("{prefix}{{seq:{width}}}{suffix}")).unwrap();
            let id = t.shape("P", "T", &at("2026-01-01T00:00:00Z")).format(seq);
            prop_assert!(id.starts_with(&prefix));
            prop_assert!(id.ends_with(&suffix));
            let digits = &id[prefix.len()..id.len() - suffix.len()];
            prop_assert!(digits.len() >= width);
            prop_assert_eq!(digits.parse::<i64>().unwrap(), seq);
        }

        #[test]
        fn distinct_numbers_give_distinct_ids(a in 0i64..1_000_000, b in 0i64..1_000_000) {
            prop_assume!(a != b);
            let shape = Template::parse("{project}-{seq:4}")
                .unwrap()
                .shape("P", "T", &at("2026-01-01T00:00:00Z"));
            prop_assert_ne!(shape.format(a), shape.format(b));
        }
    }
}
