//! The open connections of an instance, at most `IDPOOL_MAX_CONNECTIONS`.
//! When every slot is taken, a new client takes the slot of a connection
//! that does nothing for anyone: one waiting between requests or for a
//! request head, or whose answer has stopped leaving. Connections that
//! never carried a valid key go first, then those of the key holding the
//! most. So idle connections, a stranger's or one key's, never keep a
//! tenant from connecting. When none does nothing, a key holding more than
//! half of the connections gives up one whose request body is still
//! arriving (nothing was done for it yet): one key's slow bodies never
//! keep others out. Otherwise a new client waits while every slot is busy
//! serving a request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::conn_guard::Activity;

/// How long an answer must have stopped leaving before its connection
/// counts as doing nothing (a slow reader is not closed at once).
const STALL: Duration = Duration::from_secs(1);
/// Connections looked at to choose one to close: all of them up to this
/// many, a random sample of this many beyond (so a full instance spends
/// the same on every new client, however many it holds).
const LOOKED_AT: usize = 64;

#[derive(Debug)]
pub struct Connections {
    state: Mutex<State>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct State {
    open: Vec<Option<Open>>,
    free: Vec<usize>,
}

#[derive(Debug)]
struct Open {
    activity: Arc<Activity>,
    close: CancellationToken,
}

/// A connection's place; freed when dropped.
#[derive(Debug)]
pub struct Slot {
    connections: Arc<Connections>,
    index: usize,
    /// Cancelled when another client takes this slot.
    pub closed: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.connections.state();
        state.open[self.index] = None;
        state.free.push(self.index);
        drop(state);
        self.connections.freed.notify_one();
    }
}

impl Connections {
    pub fn new(capacity: usize) -> Arc<Self> {
        let capacity = capacity.max(1);
        Arc::new(Self {
            state: Mutex::new(State {
                open: (0..capacity).map(|_| None).collect(),
                free: (0..capacity).rev().collect(),
            }),
            freed: Notify::new(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a new connection, if one is free.
    pub fn open(self: &Arc<Self>, activity: Arc<Activity>) -> Option<Slot> {
        let mut state = self.state();
        let index = state.free.pop()?;
        let close = CancellationToken::new();
        state.open[index] = Some(Open {
            activity,
            close: close.clone(),
        });
        Some(Slot {
            connections: self.clone(),
            index,
            closed: close,
        })
    }

    /// Closes the connection whose slot a new client may take, if any
    /// does nothing now; true when one was told to close.
    pub fn close_one_unused(&self) -> bool {
        let now = Instant::now();
        let state = self.state();
        let looked_at = looked_at(&state.open);
        let candidates = unused(&state.open, &looked_at, now);
        let chosen = choose(&candidates).or_else(|| hogging(&state.open, &looked_at));
        match chosen {
            Some(index) => {
                if let Some(open) = &state.open[index] {
                    open.close.cancel();
                }
                true
            }
            None => false,
        }
    }

    /// Waits until a slot is freed (or one was free already).
    pub async fn wait_for_free(&self) {
        let freed = self.freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        if !self.state().free.is_empty() {
            return;
        }
        freed.await;
    }
}

struct Candidate<'a> {
    index: usize,
    key: Option<&'a Arc<str>>,
    since: Instant,
}

/// The slots looked at: all of them up to `LOOKED_AT`, else a sample.
fn looked_at(open: &[Option<Open>]) -> Vec<usize> {
    if open.len() <= LOOKED_AT {
        return (0..open.len()).collect();
    }
    (0..LOOKED_AT)
        .map(|_| rand::random_range(0..open.len()))
        .collect()
}

/// Open connections not told to close yet among `indexes`.
fn live<'a>(
    open: &'a [Option<Open>],
    indexes: &'a [usize],
) -> impl Iterator<Item = (usize, &'a Open)> {
    indexes.iter().filter_map(|&index| {
        let open = open[index].as_ref()?;
        (!open.close.is_cancelled()).then_some((index, open))
    })
}

/// Connections doing nothing now among those looked at.
fn unused<'a>(
    open: &'a [Option<Open>],
    looked_at: &'a [usize],
    now: Instant,
) -> Vec<Candidate<'a>> {
    live(open, looked_at)
        .filter_map(|(index, open)| {
            let since = open.activity.unused_since(now, STALL)?;
            Some(Candidate {
                index,
                key: open.activity.key(),
                since,
            })
        })
        .collect()
}

/// A connection still receiving its request body, of the key holding more
/// than half of the connections looked at, if one does.
fn hogging(open: &[Option<Open>], looked_at: &[usize]) -> Option<usize> {
    let mut held: HashMap<&str, usize> = HashMap::new();
    let mut total = 0;
    for (_, open) in live(open, looked_at) {
        total += 1;
        if let Some(key) = open.activity.key() {
            *held.entry(key).or_default() += 1;
        }
    }
    let (hog, _) = held.into_iter().find(|(_, n)| *n * 2 > total)?;
    live(open, looked_at)
        .find(|(_, o)| o.activity.receiving_body() && o.activity.key().map(|k| &**k) == Some(hog))
        .map(|(index, _)| index)
}

/// Which connection gives up its slot: the one unused longest of those
/// that never carried a key; else of the key holding the most of them.
fn choose(candidates: &[Candidate<'_>]) -> Option<usize> {
    let oldest =
        |of: &mut dyn Iterator<Item = &Candidate<'_>>| of.min_by_key(|c| c.since).map(|c| c.index);
    if let Some(index) = oldest(&mut candidates.iter().filter(|c| c.key.is_none())) {
        return Some(index);
    }
    let mut held: HashMap<&str, usize> = HashMap::new();
    for key in candidates.iter().filter_map(|c| c.key) {
        *held.entry(key).or_default() += 1;
    }
    let (most, _) = held.into_iter().max_by_key(|(_, n)| *n)?;
    oldest(
        &mut candidates
            .iter()
            .filter(|c| c.key.map(|k| &**k) == Some(most)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(index: usize, key: Option<&Arc<str>>, age_s: u64) -> Candidate<'_> {
        Candidate {
            index,
            key,
            since: Instant::now() - Duration::from_secs(age_s),
        }
    }

    #[tokio::test]
    async fn a_connection_without_a_key_goes_before_any_keyed_one() {
        let a: Arc<str> = Arc::from("a");
        let candidates = [
            candidate(0, Some(&a), 50),
            candidate(1, None, 1),
            candidate(2, None, 5),
        ];
        assert_eq!(choose(&candidates), Some(2));
    }

    #[tokio::test]
    async fn among_keyed_ones_the_key_holding_most_gives_one_up() {
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let candidates = [
            candidate(0, Some(&a), 50),
            candidate(1, Some(&b), 1),
            candidate(2, Some(&b), 3),
            candidate(3, Some(&b), 2),
        ];
        assert_eq!(choose(&candidates), Some(2));
        assert_eq!(choose(&[]), None);
    }
}
