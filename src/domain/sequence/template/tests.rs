use super::*;
use chrono::{TimeZone, Utc};
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
    assert!(t.calendar().names_the_day());
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
    assert!(matches!(
        Template::parse("{date:%Q}{seq}"),
        Err(TemplateError::DateItem { .. })
    ));
    assert_eq!(
        Template::parse("{date:}{seq}"),
        Err(TemplateError::DateFormat("".into()))
    );
    assert_eq!(
        Template::parse("a\u{0}{seq}"),
        Err(TemplateError::ControlCharacter('\u{0}'))
    );
    assert_eq!(
        Template::parse("{date:%n}{seq}"),
        Err(TemplateError::ControlCharacter('\n'))
    );
    assert!(matches!(
        Template::parse("{date:%Z}{seq}"),
        Err(TemplateError::DateItem { .. })
    ));
    // An item chrono reads but cannot print.
    for format in ["{date:%#z}{seq}", "{project}-{date:%Y%m%d%#z}-{seq}"] {
        assert!(
            matches!(Template::parse(format), Err(TemplateError::DateItem { .. })),
            "{format}"
        );
    }
}

#[test]
fn bounds_are_inclusive_and_positions_count_from_the_start() {
    // At each bound exactly: accepted.
    let longest = format!("{}{{seq}}", "x".repeat(MAX_TEMPLATE_LEN - 5));
    assert!(Template::parse(&longest).is_ok());
    let most = format!("{}{{seq}}", "{project}".repeat(MAX_TOKENS - 1));
    assert!(Template::parse(&most).is_ok());
    let items = format!("{{date:{}}}{{seq}}", "%Y".repeat(MAX_DATE_ITEMS));
    assert!(Template::parse(&items).is_ok());
    // Items are counted over every date token.
    let spread = format!(
        "{{date:{}}}-{{date:{}}}{{seq}}",
        "%Y".repeat(17),
        "%m".repeat(17)
    );
    assert_eq!(
        Template::parse(&spread),
        Err(TemplateError::TooManyDateItems(34))
    );
    // Byte positions of the whole template, past earlier tokens.
    assert_eq!(
        Template::parse("ab{seq}cd{project"),
        Err(TemplateError::Unclosed(9))
    );
    assert_eq!(
        Template::parse("ab{seq}cd}"),
        Err(TemplateError::StrayClose(9))
    );
    assert!(!Template::parse("{project}-{seq}").unwrap().has_date());
    // The number's token is named as written.
    for (source, named) in [
        ("{date:%-d}{seq}", "{seq}"),
        ("{date:%-d}{seq:3}", "{seq:3}"),
    ] {
        let refused = Template::parse(source).unwrap().pattern("P", "T", 16);
        assert!(
            matches!(&refused, Err(TemplateError::Ambiguous(a)) if a.next == named),
            "{source}: {refused:?}"
        );
    }
}

#[test]
fn templates_are_bounded() {
    assert_eq!(
        Template::parse(&format!("{}{{seq}}", "x".repeat(300))),
        Err(TemplateError::TooLong(305))
    );
    let many = format!("{}{{seq}}", "{project}".repeat(16));
    assert_eq!(
        Template::parse(&many),
        Err(TemplateError::TooManyTokens(17))
    );
    let items = format!("{{date:{}}}{{seq}}", "%Y".repeat(33));
    assert_eq!(
        Template::parse(&items),
        Err(TemplateError::TooManyDateItems(33))
    );
}

#[test]
fn varying_items_next_to_the_number_are_refused() {
    for source in [
        "{date:%Y%m%-d}{seq}",
        "{date:%.f}{date:%.f}{seq}",
        "{date:%-m%-d}-{seq}",
        "{date:%B}{seq}",
        "{seq}{date:%-H}",
    ] {
        let t = Template::parse(source).unwrap();
        assert!(
            matches!(t.pattern("P", "T", 16), Err(TemplateError::Ambiguous(_))),
            "{source} should be refused"
        );
    }
    for source in [
        "{date:%Y%m%d}{seq}",
        "{date:%-d}-{seq}",
        "{date:%B}-{seq}",
        "{seq}{date:%H}",
        "{project}-{type}-{seq}",
        "{date:%Y}{date:%Y}{seq:4}",
    ] {
        let t = Template::parse(source).unwrap();
        assert!(
            t.pattern("P", "T", 16).is_ok(),
            "{source} should be accepted"
        );
    }
}

#[test]
fn the_pattern_bounds_every_id_it_prints() {
    // Seven sub-second tokens printed 73 characters; the bound knows.
    let t = Template::parse(
        "{date:%.3f}{date:%.3f}{date:%.3f}{date:%.3f}{date:%.3f}{date:%.3f}{date:%.3f}{seq}",
    )
    .unwrap();
    let pattern = t.pattern("P", "T", 16).unwrap();
    assert_eq!(pattern.max_len(), 7 * 4 + 16);
    let long = Template::parse("{date:%A %B}-{seq}").unwrap();
    assert_eq!(
        long.pattern("P", "T", 3).unwrap().max_len(),
        9 + 1 + 9 + 1 + 3
    );
}

#[test]
fn calendar_parts_are_read_from_the_items() {
    let named = |s: &str| Template::parse(s).unwrap().calendar();
    assert!(named("{date:%Y%m%d}{seq}").names_the_day());
    assert!(named("{date:%y%j}{seq}").names_the_day());
    assert!(named("{date:%G-W%V-%u}-{seq}").names_the_day());
    assert!(!named("{date:%Y%m}{seq}").names_the_day());
    assert!(named("{date:%Y%m}{seq}").names_the_month());
    // Month and day alone repeat every year.
    assert!(!named("{date:%m%d}{seq}").names_the_day());
    assert!(!named("{date:%H}{seq}").names_the_year());
    assert!(named("{date:%s}-{seq}").names_the_day());
    // Every part is needed: no month, no week, no weekday, no ISO year.
    assert!(!named("{date:%Y-%d}-{seq}").names_the_day());
    assert!(!named("{date:%Y-%u}-{seq}").names_the_day());
    assert!(!named("{date:%Y-%U}-{seq}").names_the_day());
    assert!(named("{date:%Y-%U-%u}-{seq}").names_the_day());
    assert!(!named("{date:%V-%u}-{seq}").names_the_day());
    assert!(!named("{date:%G-%u}-{seq}").names_the_day());
    assert!(!named("{date:%G-W%V}-{seq}").names_the_day());
    assert!(!named("{date:%u}-{seq}").names_the_year());
    assert!(!named("{date:%Y}-{seq}").names_the_month());
    assert!(named("{date:%Y}-{seq}").names_the_year());
    assert!(named("{date:%y}-{seq}").names_the_year());
    // The century alone is no year.
    assert!(!named("{date:%C}-{seq}").names_the_year());
    // A part written twice is still named.
    assert!(named("{date:%Y%m%d}-{date:%Y}-{seq}").names_the_day());
}

/// Every specifier chrono's strftime prints, as users write them.
const PRINTED_SPECIFIERS: &[&str] = &[
    "%Y", "%C", "%y", "%q", "%m", "%b", "%B", "%h", "%d", "%e", "%a", "%A", "%w", "%u", "%U", "%W",
    "%G", "%g", "%V", "%j", "%D", "%x", "%F", "%v", "%H", "%k", "%I", "%l", "%P", "%p", "%M", "%S",
    "%f", "%.f", "%.3f", "%.6f", "%.9f", "%3f", "%6f", "%9f", "%R", "%T", "%X", "%r", "%z", "%:z",
    "%::z", "%:::z", "%c", "%s", "%%", "%-d", "%_m", "%0e", "%-j",
];

/// Instants at which every item prints its shortest and its longest:
/// every month (names of 3 to 9 letters) on days of one and two digits,
/// so every weekday (6 to 9 letters), morning and afternoon, and fractions
/// of a second of every precision.
fn extreme_instants() -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    for month in 1..=12 {
        for day in [1, 3, 5, 9, 10, 28] {
            for (hour, nanos) in [
                (0, 0),
                (9, 120_000_000),
                (12, 123_456_000),
                (23, 123_456_789),
            ] {
                let at = Utc.with_ymd_and_hms(2026, month, day, hour, 5, 7).unwrap();
                out.push(at.with_nanosecond(nanos).unwrap());
            }
        }
    }
    out
}

#[test]
fn every_item_chrono_prints_is_accepted_and_bounds_its_renderings_tightly() {
    let instants = extreme_instants();
    for spec in PRINTED_SPECIFIERS {
        let source = format!("{{date:{spec}}}|{{seq}}");
        let t = Template::parse(&source).unwrap_or_else(|e| panic!("{spec} refused: {e}"));
        let pattern = t
            .pattern("P", "T", 16)
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        // The bounds of what the item prints: every part but the number,
        // less the '|' after the item.
        let (min, max) = pattern
            .parts()
            .iter()
            .map(|part| match part {
                Part::Text(text) => (text.chars().count(), text.chars().count()),
                Part::Field(field) if field.seq.is_some() => (0, 0),
                Part::Field(field) => (field.min, field.max),
            })
            .fold((0, 0), |(min, max), (a, b)| (min + a, max + b));
        let (min, max) = (min - 1, max - 1);
        let mut seen = (usize::MAX, 0);
        for at in &instants {
            let id = t.shape("P", "T", at).format(42);
            assert_eq!(
                pattern.seq_of(&id),
                Some(42),
                "{spec}: {id:?} does not read back"
            );
            let printed = id.chars().count() - "|42".len();
            seen = (seen.0.min(printed), seen.1.max(printed));
        }
        if *spec == "%s" {
            // Seconds since 1970: one digit to twelve, never all in one test.
            assert!(
                min <= seen.0 && seen.1 <= max,
                "{spec}: printed {seen:?}, bounds ({min}, {max})"
            );
        } else {
            assert_eq!(
                seen,
                (min, max),
                "{spec}: what it printed against its bounds"
            );
        }
    }
}

#[test]
fn items_ids_cannot_carry_are_refused_with_the_reason() {
    let why = |spec: &str| match Template::parse(&format!("{{date:{spec}}}{{seq}}")) {
        Err(TemplateError::DateItem { why, .. }) => why,
        other => panic!("{spec}: {other:?}"),
    };
    assert_eq!(why("%Z"), "zone names are ambiguous; use %z for the offset");
    assert_eq!(why("%+"), "use the date and time items it is made of");
    assert_eq!(why("%#z"), "unknown item");
    assert_eq!(why("%Q"), "not a strftime item");
}

proptest! {
    #[test]
    fn an_ids_length_is_known_before_it_is_printed(
        project in "[A-Z\u{c4}\u{d6}]{1,4}",
        width in 0usize..=MAX_SEQ_WIDTH,
        seq in 0i64..i64::MAX,
    ) {
        let source = if width == 0 { "{project}-{seq}/x".to_owned() } else { format!("{{project}}-{{seq:{width}}}/x") };
        let shape = Template::parse(&source).unwrap().shape(&project, "T", &at("2026-01-01T00:00:00Z"));
        let id = shape.format(seq);
        prop_assert_eq!(shape.len_with_digits(seq.to_string().len()), id.chars().count(), "{}", id);
    }

    #[test]
    fn formatted_ids_read_back(seq in 0i64..10_000_000, width in 0usize..8) {
        let source = if width == 0 { "{project}/{seq}".to_owned() } else { format!("{{project}}/{{seq:{width}}}") };
        let t = Template::parse(&source).unwrap();
        let id = t.shape("P", "T", &at("2026-01-01T00:00:00Z")).format(seq);
        prop_assert_eq!(t.pattern("P", "T", 16).unwrap().seq_of(&id), Some(seq));
    }

    #[test]
    fn dated_ids_read_back_at_any_instant(
        seconds in 0i64..4_102_444_800,
        nanos in 0u32..1_000_000_000,
        seq in 0i64..100_000_000,
        format in prop::sample::select(vec![
            "{type}{date:%Y%m%d}{seq:4}",
            "{project}-{date:%y%j}-{seq}",
            "{date:%B}-{date:%-d}-{seq:3}-{date:%H%M%S%.3f}",
            "{seq}{date:%Y}",
            "{date:%G-W%V-%u}/{seq:6}",
            "{date:%.f}x{seq}",
            "{date:%a %e %b}:{seq}",
        ]),
    ) {
        let t = Template::parse(format).unwrap();
        let instant = DateTime::from_timestamp(seconds, nanos).unwrap();
        let id = t.shape("PROJ", "IS", &instant).format(seq);
        let pattern = t.pattern("PROJ", "IS", 16).unwrap();
        prop_assert!(id.chars().count() <= pattern.max_len(), "{} longer than {}", id, pattern.max_len());
        prop_assert_eq!(pattern.seq_of(&id), Some(seq), "{}", id);
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
