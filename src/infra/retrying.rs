//! A background loop's failures: the first said, the rest counted
//! ([`Repeated`]), each waited out longer than the last ([`Backoff`]),
//! until a success says how long the trouble lasted and starts the pauses
//! again from the floor.

use std::time::Duration;

use crate::infra::backoff::Backoff;
use crate::infra::log_limit::Repeated;

pub struct Retrying {
    said: Repeated,
    backoff: Backoff,
}

impl Retrying {
    /// Failures of `what`, waited out as background work's are (about
    /// 100 ms doubling to 10 s).
    pub fn new(what: &'static str) -> Self {
        Self::with(what, Backoff::background())
    }

    /// Failures of `what`, waited out as `backoff` says.
    pub fn with(what: &'static str, backoff: Backoff) -> Self {
        Self {
            said: Repeated::new(what),
            backoff,
        }
    }

    /// One more failure, warned of as [`Repeated::warn`] says: the pause
    /// before the next try.
    pub fn failed(&mut self, error: &dyn std::fmt::Display) -> Duration {
        self.said.warn(error);
        self.backoff.next_pause()
    }

    /// A success: the trouble, if any, is over.
    pub fn succeeded(&mut self) {
        self.said.ended();
        self.backoff.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_with_failures_and_start_again_after_a_success() {
        let floor = Duration::from_millis(100);
        let mut retrying = Retrying::with("test", Backoff::between(floor, floor * 8));
        let pauses: Vec<Duration> = (0..5).map(|_| retrying.failed(&"down")).collect();
        assert!(pauses[0] <= floor, "{pauses:?}");
        assert!(pauses[3] >= floor * 4, "{pauses:?}");
        assert!(pauses[4] <= floor * 8, "{pauses:?}");
        retrying.succeeded();
        assert!(retrying.failed(&"down again") <= floor);
    }
}
