//! The rate policy: how many numbers a lease should carry.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// How quickly the rate estimate forgets: a burst counts for about this long.
const RATE_MEMORY: Duration = Duration::from_millis(100);

/// Numbers asked of one pool per second on this instance, as an
/// exponentially decaying sum (a steady rate r reads r).
#[derive(Debug, Clone, Copy, Default)]
pub struct Rate {
    per_second: f64,
    at: Option<DateTime<Utc>>,
}

impl Rate {
    fn decayed(&self, now: DateTime<Utc>) -> f64 {
        let Some(at) = self.at else {
            return 0.0;
        };
        let elapsed = (now - at).to_std().unwrap_or_default();
        self.per_second * (-elapsed.as_secs_f64() / RATE_MEMORY.as_secs_f64()).exp()
    }

    pub fn add(&mut self, numbers: usize, now: DateTime<Utc>) {
        self.per_second = self.decayed(now) + numbers as f64 / RATE_MEMORY.as_secs_f64();
        self.at = Some(now.max(self.at.unwrap_or(now)));
    }

    pub fn per_second(&self, now: DateTime<Utc>) -> f64 {
        self.decayed(now)
    }
}

/// The smallest lease worth taking: a lease costs a commit, as a request
/// recorded on its own does, and a smaller one saves few. It also keeps a
/// short burst on a quiet sequence (a handful of requests within
/// milliseconds reads as tens a second) on the strictly ordered path.
pub const MIN_LEASE: usize = 8;

/// The lease to take for a request still missing `missing` numbers, at
/// `rate`: about `traffic` of it, at most `pool_size`. None when that is
/// no more than the request or less than [`MIN_LEASE`] (the request is
/// recorded on its own).
pub fn lease_size(rate: f64, traffic: Duration, missing: usize, pool_size: usize) -> Option<usize> {
    let size = (rate * traffic.as_secs_f64()).ceil() as usize;
    let size = size.min(pool_size);
    (size > missing && size >= MIN_LEASE).then_some(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(ms: i64) -> DateTime<Utc> {
        Utc.timestamp_millis_opt(1_800_000_000_000 + ms).unwrap()
    }

    #[test]
    fn a_steady_rate_reads_as_itself() {
        let mut rate = Rate::default();
        // 10,000 numbers a second: one every 100 µs, for a second.
        for i in 0..10_000 {
            rate.add(1, at(0) + chrono::Duration::microseconds(i * 100));
        }
        let read = rate.per_second(at(1000));
        assert!((9_000.0..11_000.0).contains(&read), "{read}");
    }

    #[test]
    fn a_quiet_sequence_gets_no_lease_and_a_busy_one_gets_50_ms_of_traffic() {
        let traffic = Duration::from_millis(50);
        // One request a second: the lease would be the request.
        let mut rate = Rate::default();
        for s in 0..10 {
            rate.add(1, at(s * 1000));
        }
        assert_eq!(
            lease_size(rate.per_second(at(9000)), traffic, 1, 1000),
            None
        );
        // 20,000 a second: 1,000 numbers is 50 ms of it.
        let mut rate = Rate::default();
        for i in 0..20_000 {
            rate.add(1, at(0) + chrono::Duration::microseconds(i * 50));
        }
        let size = lease_size(rate.per_second(at(1000)), traffic, 1, 5000).unwrap();
        assert!((900..=1100).contains(&size), "{size}");
        // Never more than the pool holds.
        assert_eq!(
            lease_size(rate.per_second(at(1000)), traffic, 1, 100),
            Some(100)
        );
        // A burst of six requests within milliseconds: no lease.
        let mut rate = Rate::default();
        for ms in 0..6 {
            rate.add(1, at(ms));
        }
        assert_eq!(lease_size(rate.per_second(at(6)), traffic, 1, 1000), None);
    }

    #[test]
    fn the_rate_forgets_a_burst() {
        let mut rate = Rate::default();
        rate.add(10_000, at(0));
        assert!(lease_size(rate.per_second(at(0)), Duration::from_millis(50), 1, 1000).is_some());
        assert_eq!(
            lease_size(
                rate.per_second(at(2000)),
                Duration::from_millis(50),
                1,
                1000
            ),
            None
        );
    }
}
