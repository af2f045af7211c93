use super::*;

fn codes(p: &str, t: &str) -> (ProjectCode, TypeCode) {
    (ProjectCode::parse(p).unwrap(), TypeCode::parse(t).unwrap())
}

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

#[test]
fn defaults_are_the_spec_defaults() {
    let (p, t) = codes("PROJ", "9012");
    let d = Definition::defaults(&p, &t).unwrap();
    assert_eq!(d.format.as_str(), "{project}-{type}-{seq}");
    assert_eq!((d.start, d.max, d.reset), (1, None, Reset::Never));
    assert_eq!((d.pool_size, d.refill_at), (1000, 0.75));
    assert_eq!(d.timezone, Tz::UTC);
}

#[test]
fn a_daily_sequence_needs_a_daily_date_token() {
    let (p, t) = codes("P", "IS");
    let mut input = DefinitionInput {
        format: Some("{type}{date:%Y%m}{seq:4}".into()),
        reset: Some(Reset::Daily),
        ..Default::default()
    };
    assert!(matches!(
        Definition::from_input(&input, &p, &t),
        Err(DefinitionError::PeriodNotInFormat("daily", ..))
    ));
    input.format = Some("{type}{date:%Y%m%d}{seq:4}".into());
    assert!(Definition::from_input(&input, &p, &t).is_ok());
    input.format = Some("{type}{date:%y%j}{seq:4}".into());
    assert!(Definition::from_input(&input, &p, &t).is_ok());
}

#[test]
fn ids_longer_than_64_characters_are_refused() {
    let (p, t) = codes(&"P".repeat(32), &"T".repeat(32));
    assert!(matches!(
        Definition::defaults(&p, &t),
        Err(DefinitionError::TooLong(_))
    ));
    let (p, t) = codes("PROJ", "9012");
    let input = DefinitionInput {
        format: Some(format!("{}{{seq}}", "x".repeat(60))),
        ..Default::default()
    };
    assert!(matches!(
        Definition::from_input(&input, &p, &t),
        Err(DefinitionError::TooLong(76))
    ));
}

#[test]
fn bounds_are_checked() {
    let (p, t) = codes("P", "T");
    let check = |input: DefinitionInput| Definition::from_input(&input, &p, &t);
    assert!(matches!(
        check(DefinitionInput {
            start: Some(-1),
            ..Default::default()
        }),
        Err(DefinitionError::Start { .. })
    ));
    assert!(matches!(
        check(DefinitionInput {
            start: Some(10),
            max: Some(9),
            ..Default::default()
        }),
        Err(DefinitionError::Max { .. })
    ));
    assert!(matches!(
        check(DefinitionInput {
            pool_size: Some(0),
            ..Default::default()
        }),
        Err(DefinitionError::PoolSize(0))
    ));
    assert!(matches!(
        check(DefinitionInput {
            refill_at: Some(0.0),
            ..Default::default()
        }),
        Err(DefinitionError::RefillAt(_))
    ));
    assert!(matches!(
        check(DefinitionInput {
            timezone: Some("Mars/Olympus".into()),
            ..Default::default()
        }),
        Err(DefinitionError::Timezone(_))
    ));
    assert!(matches!(
        check(DefinitionInput {
            layout: Some(LayoutKind::Int64),
            reset: Some(Reset::Never),
            ..Default::default()
        }),
        Err(DefinitionError::Int64Reset("never"))
    ));
}

#[test]
fn int64_layout_puts_day_seconds_above_the_counter() {
    let (p, t) = codes("SHOP", "coupon");
    let input = DefinitionInput {
        layout: Some(LayoutKind::Int64),
        ..Default::default()
    };
    let d = Definition::from_input(&input, &p, &t).unwrap();
    assert_eq!(d.reset, Reset::Daily);
    assert_eq!(d.max_seq(), (1 << 32) - 1);
    let now = at("2026-11-22T10:00:00Z");
    let period = d.period_at(now);
    let shape = d.shape("SHOP", "coupon", &period, now).unwrap();
    let day_seconds = at("2026-11-22T00:00:00Z").timestamp() - 1_640_995_200;
    assert_eq!(shape.number(7), (day_seconds << 32) | 7);
    assert_eq!(shape.id(7), ((day_seconds << 32) | 7).to_string());
    assert!(shape.number(8) > shape.number(7));
    let next_day = d.period_at(at("2026-11-23T00:00:00Z"));
    let later = d
        .shape("SHOP", "coupon", &next_day, at("2026-11-23T00:00:00Z"))
        .unwrap();
    assert!(later.number(1) > shape.number(d.max_seq()));
}

#[test]
fn identity_changes_are_detected() {
    let (p, t) = codes("P", "T");
    let a = Definition::defaults(&p, &t).unwrap();
    let mut b = a.clone();
    b.pool_size = 50;
    assert!(!a.changes_identity(&b));
    b.timezone = "Europe/Berlin".parse().unwrap();
    assert!(a.changes_identity(&b));
}
