//! The pause before trying again: doubling from a floor to a ceiling, with
//! jitter so instances that failed together do not retry together; back to
//! the floor once something succeeds.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    floor: Duration,
    ceiling: Duration,
    failures: u32,
}

impl Backoff {
    /// From `floor` doubling up to `ceiling`.
    pub fn between(floor: Duration, ceiling: Duration) -> Self {
        Self {
            floor,
            ceiling: ceiling.max(floor),
            failures: 0,
        }
    }

    /// For background retry loops: about 100 ms to 10 s.
    pub fn background() -> Self {
        Self::between(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// The pause after one more failure: between half and all of the
    /// current step.
    pub fn next_pause(&mut self) -> Duration {
        let step = self
            .floor
            .saturating_mul(1 << self.failures.min(16))
            .min(self.ceiling);
        self.failures = self.failures.saturating_add(1);
        let half = step / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    /// Something succeeded: the next failure starts again at the floor.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_ceiling_and_start_again_after_a_success() {
        let mut backoff = Backoff::between(Duration::from_millis(100), Duration::from_secs(10));
        let steps: Vec<Duration> = (0..12).map(|_| backoff.next_pause()).collect();
        for (n, pause) in steps.iter().enumerate() {
            let step = Duration::from_millis(100 * (1 << n)).min(Duration::from_secs(10));
            assert!(*pause >= step / 2 && *pause <= step, "{n}: {pause:?}");
        }
        backoff.reset();
        assert!(backoff.next_pause() <= Duration::from_millis(100));
    }
}
