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
}

proptest! {
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
