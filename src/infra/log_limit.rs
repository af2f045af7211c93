//! Log lines that a caller can cause repeatedly (a made-up key, a failing
//! target, a database that is down) are written once when the trouble
//! starts, then at most once per interval with how many times it happened
//! meanwhile, and once when it ends: no request can flood the log.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most one repeated trouble writes: one line per this long.
pub const LINE_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct State {
    /// When the trouble started (None: all is well).
    since: Option<Instant>,
    last_line: Option<Instant>,
    /// The latest occurrence: after a quiet spell as long as the interval,
    /// the next one starts anew (for troubles nobody reports ending).
    last_seen: Option<Instant>,
    /// Times it happened since the last line.
    unsaid: u64,
    total: u64,
}

/// One kind of repeated trouble.
#[derive(Debug)]
pub struct Repeated {
    what: &'static str,
    every: Duration,
    state: Mutex<State>,
}

/// What to write for one occurrence: a line (with how many occurrences it
/// stands for), or nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Say {
    /// The first occurrence after a quiet spell.
    Started,
    /// `n` occurrences since the last line (this one included).
    Again(u64),
    Quiet,
}

impl Repeated {
    pub const fn new(what: &'static str) -> Self {
        Self::every(what, LINE_EVERY)
    }

    pub const fn every(what: &'static str, every: Duration) -> Self {
        Self {
            what,
            every,
            state: Mutex::new(State {
                since: None,
                last_line: None,
                last_seen: None,
                unsaid: 0,
                total: 0,
            }),
        }
    }

    /// Counts one occurrence and says whether to write a line for it.
    pub fn occurred(&self) -> Say {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let quiet = state
            .last_seen
            .is_some_and(|at| now.duration_since(at) >= self.every);
        state.last_seen = Some(now);
        if quiet && state.unsaid == 0 {
            state.since = None;
            state.total = 0;
        }
        state.total += 1;
        state.unsaid += 1;
        if state.since.is_none() {
            state.since = Some(now);
            state.last_line = Some(now);
            state.unsaid = 0;
            return Say::Started;
        }
        if state
            .last_line
            .is_none_or(|at| now.duration_since(at) >= self.every)
        {
            state.last_line = Some(now);
            let n = std::mem::take(&mut state.unsaid);
            return Say::Again(n);
        }
        Say::Quiet
    }

    /// Writes a warning for an occurrence, as [`Repeated::occurred`] says.
    pub fn warn(&self, error: &dyn std::fmt::Display) {
        match self.occurred() {
            Say::Started => tracing::warn!(error = %error, "{}", self.what),
            Say::Again(times) => {
                tracing::warn!(error = %error, times, "{} (again; times since the last line)", self.what)
            }
            Say::Quiet => {}
        }
    }

    /// The trouble is over: one line saying how long it lasted and how
    /// often it happened, if it happened at all.
    pub fn ended(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(since) = state.since.take() else {
            return;
        };
        let total = std::mem::take(&mut state.total);
        state.unsaid = 0;
        state.last_line = None;
        drop(state);
        tracing::info!(
            lasted_ms = since.elapsed().as_millis() as u64,
            times = total,
            "{}: over",
            self.what
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_writes_one_line_then_counts() {
        let repeated = Repeated::every("trouble", Duration::from_millis(50));
        assert_eq!(repeated.occurred(), Say::Started);
        for _ in 0..1000 {
            assert_eq!(repeated.occurred(), Say::Quiet);
        }
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(repeated.occurred(), Say::Again(1001));
        assert_eq!(repeated.occurred(), Say::Quiet);
        repeated.ended();
        assert_eq!(repeated.occurred(), Say::Started);
    }
}
