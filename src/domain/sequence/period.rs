//! Reset periods: each one is a counter of its own, starting at `start`.

use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

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
    strum::EnumString,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Reset {
    #[default]
    Never,
    Daily,
    Monthly,
    Yearly,
}

impl Reset {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(s: &str) -> Option<Self> {
        s.parse().ok()
    }

    /// The period `now` falls in, in time zone `tz`.
    pub fn period_at(self, tz: Tz, now: DateTime<Utc>) -> Period {
        let local = now.with_timezone(&tz).date_naive();
        let first_day = match self {
            Reset::Never => return Period::never(),
            Reset::Daily => local,
            Reset::Monthly => local.with_day(1).unwrap_or(local),
            Reset::Yearly => NaiveDate::from_ymd_opt(local.year(), 1, 1).unwrap_or(local),
        };
        self.period(tz, self.key_of(first_day), first_day)
    }

    /// The period of this reset that starts on `first_day`, named `key`.
    fn period(self, tz: Tz, key: String, first_day: NaiveDate) -> Period {
        let starts_at = start_of_day(tz, first_day);
        let next = match self {
            Reset::Never => None,
            Reset::Daily => first_day.succ_opt(),
            Reset::Monthly => first_day.checked_add_months(chrono::Months::new(1)),
            Reset::Yearly => first_day.checked_add_months(chrono::Months::new(12)),
        };
        Period {
            key,
            starts_at: Some(starts_at),
            ends_at: next.map(|day| start_of_day(tz, day)),
        }
    }

    /// The period named `key` (as shown by the API), if it is one of this reset's keys.
    pub fn period_named(self, tz: Tz, key: &str) -> Option<Period> {
        let first_day = match self {
            Reset::Never => return key.is_empty().then(Period::never),
            Reset::Daily => NaiveDate::parse_from_str(key, "%Y%m%d").ok()?,
            Reset::Monthly => NaiveDate::parse_from_str(&format!("{key}01"), "%Y%m%d").ok()?,
            Reset::Yearly => NaiveDate::parse_from_str(&format!("{key}0101"), "%Y%m%d").ok()?,
        };
        (self.key_of(first_day) == key).then(|| self.period(tz, key.to_owned(), first_day))
    }

    fn key_of(self, day: NaiveDate) -> String {
        match self {
            Reset::Never => String::new(),
            Reset::Daily => day.format("%Y%m%d").to_string(),
            Reset::Monthly => day.format("%Y%m").to_string(),
            Reset::Yearly => day.format("%Y").to_string(),
        }
    }
}

/// Midnight of `day` in `tz`, or the first instant of that day where a DST
/// change skips midnight.
pub fn start_of_day(tz: Tz, day: NaiveDate) -> DateTime<Utc> {
    let mut time = day.and_hms_opt(0, 0, 0).unwrap_or_default();
    for _ in 0..4 {
        if let Some(instant) = tz.from_local_datetime(&time).earliest() {
            return instant.with_timezone(&Utc);
        }
        time += chrono::Duration::minutes(30);
    }
    time.and_utc()
}

/// One reset period of a sequence: `""` for `never`, `20261122` for daily.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Period {
    key: String,
    starts_at: Option<DateTime<Utc>>,
    /// Where the next period starts; `None` for `never`.
    ends_at: Option<DateTime<Utc>>,
}

impl Period {
    pub fn never() -> Self {
        Self {
            key: String::new(),
            starts_at: None,
            ends_at: None,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Start of the period; `None` for sequences that never reset.
    pub fn starts_at(&self) -> Option<DateTime<Utc>> {
        self.starts_at
    }

    /// The first instant past the period (the next one's start); `None`
    /// for sequences that never reset.
    pub fn ends_at(&self) -> Option<DateTime<Utc>> {
        self.ends_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn resets_read_back_as_they_are_stored_and_nothing_else() {
        for reset in [Reset::Never, Reset::Daily, Reset::Monthly, Reset::Yearly] {
            assert_eq!(Reset::parse(reset.as_str()), Some(reset));
        }
        assert_eq!(Reset::parse("weekly"), None);
        assert_eq!(Reset::parse(""), None);
    }

    #[test]
    fn a_period_ends_where_the_next_one_starts_in_its_own_time_zone() {
        let berlin: Tz = "Europe/Berlin".parse().unwrap();
        // The day the clocks go back is 25 hours long.
        let day = Reset::Daily.period_at(berlin, at("2026-10-25T12:00:00Z"));
        assert_eq!(day.starts_at(), Some(at("2026-10-24T22:00:00Z")));
        assert_eq!(day.ends_at(), Some(at("2026-10-25T23:00:00Z")));
        let month = Reset::Monthly.period_named(berlin, "202612").unwrap();
        assert_eq!(month.ends_at(), Some(at("2026-12-31T23:00:00Z")));
        let year = Reset::Yearly.period_at(Tz::UTC, at("2020-03-01T00:00:00Z"));
        assert_eq!(year.ends_at(), Some(at("2021-01-01T00:00:00Z")));
        // A yearly period begun years ago ends at its own end, to the
        // second, in its time zone (reconciliation closes it from this).
        let long_ago = Reset::Yearly.period_named(berlin, "2020").unwrap();
        assert_eq!(long_ago.ends_at(), Some(at("2020-12-31T23:00:00Z")));
        assert_eq!(
            Reset::Never
                .period_at(Tz::UTC, at("2026-01-01T00:00:00Z"))
                .ends_at(),
            None
        );
    }

    #[test]
    fn keys_follow_the_reset() {
        let now = at("2026-11-22T10:00:00Z");
        assert_eq!(Reset::Never.period_at(Tz::UTC, now).key(), "");
        assert_eq!(Reset::Daily.period_at(Tz::UTC, now).key(), "20261122");
        assert_eq!(Reset::Monthly.period_at(Tz::UTC, now).key(), "202611");
        assert_eq!(Reset::Yearly.period_at(Tz::UTC, now).key(), "2026");
    }

    #[test]
    fn the_day_changes_at_local_midnight() {
        let tz: Tz = "Asia/Tokyo".parse().unwrap();
        // 15:00 UTC is midnight in Tokyo.
        let before = Reset::Daily.period_at(tz, at("2026-11-22T14:59:59Z"));
        let after = Reset::Daily.period_at(tz, at("2026-11-22T15:00:00Z"));
        assert_eq!(before.key(), "20261122");
        assert_eq!(after.key(), "20261123");
        assert_eq!(after.starts_at(), Some(at("2026-11-22T15:00:00Z")));
    }

    #[test]
    fn named_periods_round_trip_and_reject_foreign_keys() {
        let tz = Tz::UTC;
        let p = Reset::Daily.period_named(tz, "20261122").unwrap();
        assert_eq!(p, Reset::Daily.period_at(tz, at("2026-11-22T23:00:00Z")));
        assert!(Reset::Daily.period_named(tz, "202611").is_none());
        assert!(Reset::Daily.period_named(tz, "20261340").is_none());
        assert_eq!(
            Reset::Monthly.period_named(tz, "202611").unwrap().key(),
            "202611"
        );
        assert_eq!(Reset::Never.period_named(tz, "").unwrap(), Period::never());
        assert!(Reset::Never.period_named(tz, "2026").is_none());
    }

    #[test]
    fn midnight_skipped_by_dst_starts_the_day_at_the_first_real_instant() {
        // Santiago skipped 00:00 -> 01:00 on 2022-09-11.
        let tz: Tz = "America/Santiago".parse().unwrap();
        let day = NaiveDate::from_ymd_opt(2022, 9, 11).unwrap();
        let start = start_of_day(tz, day);
        assert_eq!(start.with_timezone(&tz).date_naive(), day);
    }
}
