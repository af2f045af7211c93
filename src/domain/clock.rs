//! Time as the service sees it; tests move it to cross period boundaries.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use chrono::{DateTime, Duration, Utc};

pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that stands still until told otherwise.
pub struct ManualClock(Mutex<DateTime<Utc>>);

impl ManualClock {
    pub fn new(at: DateTime<Utc>) -> Self {
        Self(Mutex::new(at))
    }

    pub fn set(&self, at: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    pub fn advance(&self, by: Duration) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The system's clock running a given number of milliseconds ahead (or
/// behind), changeable while the process runs: a benchmark moves an
/// instance past midnight (`IDPOOL_CLOCK_OFFSET_FILE`).
#[derive(Default)]
pub struct OffsetClock {
    offset_ms: AtomicI64,
}

impl OffsetClock {
    pub fn set_offset(&self, offset: Duration) {
        self.offset_ms
            .store(offset.num_milliseconds(), Ordering::Relaxed);
    }
}

impl Clock for OffsetClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + Duration::milliseconds(self.offset_ms.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_clock_runs_its_offset_ahead_of_the_system() {
        let clock = OffsetClock::default();
        let ahead = Duration::hours(5);
        clock.set_offset(ahead);
        let before = Utc::now();
        let shifted = clock.now();
        let after = Utc::now();
        assert!(shifted >= before + ahead && shifted <= after + ahead);
        clock.set_offset(Duration::seconds(-30));
        assert!(clock.now() < Utc::now());
    }
}
