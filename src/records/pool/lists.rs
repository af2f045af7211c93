//! The pools' lists in Redis: pop, the refill lock, push in parts,
//! discard, give back, and what a pool holds. Each call runs one bounded
//! script through the connection's circuit breaker.

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;

use super::redis::{PoolKeys, RedisFailure, RedisLink};
use crate::domain::numbers::SeqRange;

/// Names one give-back of numbers to a pool, kept across its retries:
/// the pool takes the numbers once per token, and only until the
/// deadline set when a try was first sent (see
/// [`super::scripts::GIVE_BACK`]). Clones share the deadline.
#[derive(Debug, Clone)]
pub struct GiveBackToken {
    id: String,
    /// Ms on the server's clock; 0 while it was unknown.
    deadline: Arc<std::sync::OnceLock<i64>>,
}

impl PartialEq for GiveBackToken {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for GiveBackToken {}

impl GiveBackToken {
    pub fn new() -> Self {
        Self {
            id: format!("{:016x}", rand::random::<u64>()),
            deadline: Arc::default(),
        }
    }
}

impl Default for GiveBackToken {
    fn default() -> Self {
        Self::new()
    }
}

/// The pools' lists, over the link (whose circuit breaker every call
/// goes through). Every handle of one link shares the link's book of pops.
#[derive(Clone)]
pub struct PoolLists {
    link: Arc<RedisLink>,
}

impl PoolLists {
    pub fn new(link: Arc<RedisLink>) -> Self {
        Self { link }
    }

    pub async fn pop(&self, keys: &PoolKeys, count: usize) -> Result<Popped, RedisFailure> {
        if !self.link.is_up() {
            return Err(RedisFailure::Open);
        }
        self.link.stats.pool_pops.inc();
        let token = format!("{:016x}", rand::random::<u64>());
        let forget = self
            .pop_book()
            .to_forget
            .remove(&keys.inflight)
            .unwrap_or_default();
        // Past our command timeout, on the server's clock, the pop takes
        // nothing: a pop queued in a hung server runs when it wakes.
        let mut args = vec![
            count.to_string(),
            token.clone(),
            self.deadline().to_string(),
        ];
        args.extend(forget.iter().cloned());
        let reply = self
            .link
            .guarded(self.link.eval(
                &self.link.scripts.pop,
                vec![
                    keys.pool.clone(),
                    keys.meta.clone(),
                    keys.inflight.clone(),
                    keys.lock.clone(),
                ],
                args,
            ))
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                // Whether it ran is unknown: settled before pools are used
                // again (`resolve_pops_in_doubt`).
                let mut book = self.pop_book();
                book.to_forget
                    .entry(keys.inflight.clone())
                    .or_default()
                    .extend(forget);
                book.in_doubt.push((keys.clone(), token));
                return Err(e);
            }
        };
        let popped = Self::read_pop(reply)?;
        self.saw_server_clock(popped.1);
        if !popped.0.seqs.is_empty() {
            self.pop_book()
                .to_forget
                .entry(keys.inflight.clone())
                .or_default()
                .push(token);
        }
        Ok(popped.0)
    }

    /// A pop's answer, and the server's time it carries.
    fn read_pop(reply: Value) -> Result<(Popped, i64), RedisFailure> {
        let mut parts = array(reply)?.into_iter();
        let seqs = match parts.next() {
            Some(Value::Array(values)) => {
                let bounds: Vec<i64> = values.iter().filter_map(integer).collect();
                bounds
                    .chunks_exact(2)
                    .flat_map(|pair| pair[0]..=pair[1])
                    .collect()
            }
            Some(Value::Null) | None => Vec::new(),
            Some(other) => return Err(RedisFailure::Reply(format!("pop runs: {other:?}"))),
        };
        let depth = parts.next().as_ref().and_then(integer).unwrap_or(0);
        let target = parts.next().as_ref().and_then(integer).unwrap_or(0);
        let server_ms = parts.next().as_ref().and_then(integer).unwrap_or(0);
        let popped = Popped {
            seqs,
            depth,
            target,
        };
        Ok((popped, server_ms))
    }

    /// Forgets, in each pool's `inflight`, the pops whose answers arrived
    /// (otherwise forgotten with the pool's next pop, which a quiet pool
    /// never gets: its last pop would look like one whose answer was lost
    /// when the pool is given up).
    pub async fn forget_answered(&self) {
        if !self.link.is_up() {
            return;
        }
        let answered = std::mem::take(&mut self.pop_book().to_forget);
        let forgets = answered.into_iter().map(|(inflight, tokens)| async move {
            let client = self.link.clients.next().with_options(&self.link.options);
            let forgot: Result<i64, _> = client.hdel(inflight.as_str(), tokens.clone()).await;
            (inflight, tokens, forgot.is_ok())
        });
        for (inflight, tokens, forgot) in futures::future::join_all(forgets).await {
            if !forgot {
                self.pop_book()
                    .to_forget
                    .entry(inflight)
                    .or_default()
                    .extend(tokens);
            }
        }
    }

    pub(super) fn pop_book(&self) -> std::sync::MutexGuard<'_, super::redis::PopBook> {
        self.link.pops.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When our command timeout ends, on the server's clock (0 while its
    /// clock is unknown): a script past it does nothing.
    fn deadline(&self) -> i64 {
        self.deadline_after(self.link.command_timeout)
    }

    /// `after` from now, on the server's clock (0 while it is unknown).
    fn deadline_after(&self, after: Duration) -> i64 {
        self.server_clock_offset()
            .map_or(0, |offset| now_ms() + offset + after.as_millis() as i64)
    }

    fn server_clock_offset(&self) -> Option<i64> {
        *self
            .link
            .clock_offset_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The server said it is `server_ms`: seen after it said so, our clock
    /// is late by the answer's trip at most, so the offset errs early.
    fn saw_server_clock(&self, server_ms: i64) {
        if server_ms > 0 {
            *self
                .link
                .clock_offset_ms
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(server_ms - now_ms());
        }
    }

    /// Reads the server's clock (before pops are allowed again).
    pub async fn read_server_clock(&self) -> Result<(), RedisFailure> {
        let reply = self
            .link
            .eval(&self.link.scripts.clock, vec![], vec![])
            .await?;
        self.saw_server_clock(integer(&reply).unwrap_or(0));
        Ok(())
    }

    /// Settles every pop whose caller got no answer: what one took goes
    /// back to its pool; one that did not run yet is cancelled. Before the
    /// pools are used again; an error leaves the rest for the next try.
    pub async fn resolve_pops_in_doubt(&self) -> Result<usize, RedisFailure> {
        let in_doubt = std::mem::take(&mut self.pop_book().in_doubt);
        let mut returned = 0;
        for (n, (keys, token)) in in_doubt.iter().enumerate() {
            let settled = self
                .link
                .eval(
                    &self.link.scripts.resolve_pop,
                    vec![keys.pool.clone(), keys.inflight.clone()],
                    vec![token.clone()],
                )
                .await;
            match settled {
                Ok(back) => returned += integer(&back).unwrap_or(0) as usize,
                Err(e) => {
                    self.pop_book()
                        .in_doubt
                        .extend(in_doubt[n..].iter().cloned());
                    return Err(e);
                }
            }
        }
        if returned > 0 {
            tracing::info!(
                returned,
                "numbers of pops whose answers were lost given back to their pools"
            );
        }
        Ok(returned)
    }

    /// Takes the pool's refill lock; `None` when another holder has it.
    pub async fn acquire(
        &self,
        keys: &PoolKeys,
        token: &str,
        ttl: Duration,
    ) -> Result<Option<LockedPool>, RedisFailure> {
        self.link
            .guarded(async {
                let reply = self
                    .link
                    .eval(
                        &self.link.scripts.acquire,
                        vec![keys.lock.clone(), keys.pool.clone(), keys.meta.clone()],
                        vec![token.to_owned(), ttl.as_millis().to_string()],
                    )
                    .await?;
                if matches!(reply, Value::Null | Value::Boolean(false)) {
                    return Ok(None);
                }
                let parts = array(reply)?;
                let get = |i: usize| parts.get(i).and_then(integer).unwrap_or(0);
                Ok(Some(LockedPool {
                    depth: get(0),
                    target: get(1),
                    refilled_at_ms: get(2),
                }))
            })
            .await
    }

    /// Appends `block` (one run, whatever its size) and releases the
    /// lock; a lost lock or a failure leaves the block out.
    pub async fn push(
        &self,
        keys: &PoolKeys,
        token: &str,
        block: SeqRange,
        target: i64,
        now_ms: i64,
    ) -> Pushed {
        let pushed = self
            .link
            .guarded(async {
                let reply = self
                    .link
                    .eval(
                        &self.link.scripts.push,
                        vec![keys.lock.clone(), keys.pool.clone(), keys.meta.clone()],
                        vec![
                            token.to_owned(),
                            block.start.to_string(),
                            block.end.to_string(),
                            target.to_string(),
                            now_ms.to_string(),
                        ],
                    )
                    .await?;
                integer(&reply).ok_or_else(|| RedisFailure::Reply(format!("push: {reply:?}")))
            })
            .await;
        match pushed {
            Err(e) => Pushed::Failed(e, block),
            Ok(depth) if depth < 0 => Pushed::LockLost(block),
            Ok(depth) => Pushed::All(depth),
        }
    }

    pub async fn release(&self, keys: &PoolKeys, token: &str) -> Result<(), RedisFailure> {
        self.link
            .guarded(async {
                self.link
                    .eval(
                        &self.link.scripts.release,
                        vec![keys.lock.clone()],
                        vec![token.to_owned()],
                    )
                    .await
                    .map(|_| ())
            })
            .await
    }

    /// Empties the pool (with `keep_if_filled_here`, only if the server
    /// holding it did not fill it: a restart, a promoted replica), returning
    /// the numbers it held. The pool is emptied in one step; its numbers are
    /// then read back in parts of [`PART`], so that no script holds
    /// Redis for long. Parts a failure left unread are logged and expire.
    pub async fn discard(
        &self,
        keys: &PoolKeys,
        keep_if_filled_here: bool,
    ) -> Result<Vec<SeqRange>, RedisFailure> {
        let mode = if keep_if_filled_here {
            "foreign"
        } else {
            "all"
        };
        let drain = keys.drain_key();
        let moved = self
            .link
            .guarded(async {
                let reply = self
                    .link
                    .eval(
                        &self.link.scripts.discard,
                        vec![keys.pool.clone(), keys.meta.clone(), drain.clone()],
                        vec![mode.to_owned()],
                    )
                    .await?;
                Ok(integer(&reply) == Some(1))
            })
            .await?;
        if !moved {
            return Ok(Vec::new());
        }
        Ok(self.drain(keys, &drain).await)
    }

    /// Reads an emptied pool's list back, [`PART`] runs at a time, each
    /// read taking them off; runs that touch are joined. Parts a failure
    /// left unread are logged and expire with the list.
    async fn drain(&self, keys: &PoolKeys, drain: &str) -> Vec<SeqRange> {
        let mut ranges: Vec<SeqRange> = Vec::new();
        loop {
            let part = self
                .link
                .guarded(async {
                    let reply = self
                        .link
                        .eval(
                            &self.link.scripts.drain,
                            vec![drain.to_owned()],
                            vec![PART.to_string()],
                        )
                        .await?;
                    counted_runs(reply)
                })
                .await;
            match part {
                Ok((left, runs)) => {
                    merge_runs(&mut ranges, runs);
                    if left <= 0 {
                        return ranges;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, pool = %keys.pool, drained = ?ranges,
                        "emptied pool only partly read back; the rest goes unrecorded");
                    return ranges;
                }
            }
        }
    }

    /// Removes the numbers above `max` and returns them, [`PART`] at
    /// a time.
    pub async fn trim_above(
        &self,
        keys: &PoolKeys,
        max: i64,
    ) -> Result<Vec<SeqRange>, RedisFailure> {
        let mut ranges: Vec<SeqRange> = Vec::new();
        loop {
            let (more, runs) = self
                .link
                .guarded(async {
                    let reply = self
                        .link
                        .eval(
                            &self.link.scripts.trim_above,
                            vec![keys.pool.clone()],
                            vec![max.to_string(), PART.to_string()],
                        )
                        .await?;
                    counted_runs(reply)
                })
                .await?;
            merge_runs(&mut ranges, runs);
            if more == 0 {
                return Ok(ranges);
            }
        }
    }

    /// Puts numbers back in the pool where they belong: it stays
    /// ascending, so they are the next ones taken (see
    /// [`super::scripts::GIVE_BACK`]). Pushed at the head as they came, numbers
    /// given back after lower ones went back sat above them: handed out
    /// out of order. `Ok(false)`: the give-back's window had passed and
    /// nothing was put back (the caller records the numbers instead).
    pub async fn give_back(
        &self,
        keys: &PoolKeys,
        seqs: &[i64],
        token: &GiveBackToken,
    ) -> Result<bool, RedisFailure> {
        self.give_back_runs(keys, &crate::domain::numbers::runs(seqs), token)
            .await
    }

    /// [`PoolLists::give_back`] of runs.
    pub async fn give_back_runs(
        &self,
        keys: &PoolKeys,
        runs: &[SeqRange],
        token: &GiveBackToken,
    ) -> Result<bool, RedisFailure> {
        if !self.link.is_up() {
            return Err(RedisFailure::Open);
        }
        if runs.is_empty() {
            return Ok(true);
        }
        // The window opens with the first try that reaches Redis: one that
        // never left cannot have landed.
        let deadline = match token.deadline.get() {
            Some(deadline) => *deadline,
            None => {
                let deadline = self.deadline_after(self.link.give_back_window());
                if deadline > 0 {
                    let _ = token.deadline.set(deadline);
                }
                deadline
            }
        };
        let mut args = vec![token.id.clone(), deadline.to_string()];
        for run in runs.iter().filter(|run| !run.is_empty()) {
            args.push(run.start.to_string());
            args.push(run.last().to_string());
        }
        let depth: i64 = self
            .link
            .guarded(async {
                Ok(self
                    .link
                    .eval(
                        &self.link.scripts.give_back,
                        vec![keys.pool.clone(), keys.inflight.clone(), keys.meta.clone()],
                        args,
                    )
                    .await?
                    .convert()?)
            })
            .await?;
        Ok(depth != GIVE_BACK_TOO_LATE)
    }

    /// The lowest number waiting in the pool, if any.
    pub async fn head(&self, keys: &PoolKeys) -> Result<Option<i64>, RedisFailure> {
        Ok(self.depth_and_head(keys).await?.1)
    }

    pub async fn depth(&self, keys: &PoolKeys) -> Result<i64, RedisFailure> {
        Ok(self.depth_and_head(keys).await?.0)
    }

    /// How many numbers the pool holds, and its lowest.
    async fn depth_and_head(&self, keys: &PoolKeys) -> Result<(i64, Option<i64>), RedisFailure> {
        self.link
            .guarded(async {
                let reply = self
                    .link
                    .eval(&self.link.scripts.depth, vec![keys.pool.clone()], vec![])
                    .await?;
                let parts = array(reply)?;
                let depth = parts.first().and_then(integer).unwrap_or(0);
                Ok((depth, parts.get(1).and_then(integer)))
            })
            .await
    }

    /// The runs of the pool, lowest first (a few: one per block pushed and
    /// per give-back that joined no neighbour).
    pub async fn runs(&self, keys: &PoolKeys) -> Result<Vec<SeqRange>, RedisFailure> {
        self.link
            .guarded(async {
                let client = self.link.clients.next().with_options(&self.link.options);
                let runs: Vec<String> = client.lrange(keys.pool.as_str(), 0, -1).await?;
                Ok(runs.iter().filter_map(|r| run_of(r)).collect())
            })
            .await
    }

    /// Gives up the pool if nobody popped from it or gave back to it for
    /// `idle` (see [`super::scripts::SWEEP`]): what it held, lowest first,
    /// and the numbers of pops whose answers never came; or, in use, its
    /// lowest number.
    pub async fn sweep(&self, keys: &PoolKeys, idle: Duration) -> Result<Swept, RedisFailure> {
        let drain = keys.drain_key();
        let reply = self
            .link
            .guarded(async {
                self.link
                    .eval(
                        &self.link.scripts.sweep,
                        vec![
                            keys.lock.clone(),
                            keys.pool.clone(),
                            keys.meta.clone(),
                            keys.inflight.clone(),
                            drain.clone(),
                        ],
                        vec![idle.as_millis().to_string()],
                    )
                    .await
            })
            .await?;
        let parts = array(reply)?;
        if parts.first().and_then(integer) != Some(1) {
            return Ok(Swept::Kept {
                lowest: parts.get(1).and_then(integer),
            });
        }
        let drained = parts.get(1).and_then(integer) == Some(1);
        let popped: Vec<i64> = match parts.into_iter().nth(2) {
            Some(values) => array(values)?.iter().filter_map(integer).collect(),
            None => Vec::new(),
        };
        let mut popped: Vec<SeqRange> = popped
            .chunks_exact(2)
            .map(|pair| SeqRange::new(pair[0], pair[1] + 1))
            .collect();
        popped.sort();
        let held = if drained {
            self.drain(keys, &drain).await
        } else {
            Vec::new()
        };
        Ok(Swept::GivenUp { held, popped })
    }

    /// The highest block end ever pushed into the pool; 0 when none.
    pub async fn max_end(&self, keys: &PoolKeys) -> Result<i64, RedisFailure> {
        self.link
            .guarded(async {
                let client = self.link.clients.next().with_options(&self.link.options);
                let value: Option<String> = client.hget(keys.meta.as_str(), "max_end").await?;
                Ok(value.and_then(|v| v.parse().ok()).unwrap_or(0))
            })
            .await
    }
}

/// Most runs one script reads off a drained pool or looks at from a
/// pool's tail: every other pool waits for a script.
pub const PART: i64 = 8_192;

/// What [`super::scripts::GIVE_BACK`] answers past the give-back's deadline.
const GIVE_BACK_TOO_LATE: i64 = -2;

/// What a sweep found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Swept {
    /// The pool was used within the idle time, or a refill holds it (or
    /// there is none); its lowest number.
    Kept { lowest: Option<i64> },
    /// The pool and its keys are gone: the runs it held, and those of
    /// pops whose answers never came (`inflight`), each lowest first.
    GivenUp {
        held: Vec<SeqRange>,
        popped: Vec<SeqRange>,
    },
}

/// A list element: `first-last`, or a bare number (earlier versions).
fn run_of(element: &str) -> Option<SeqRange> {
    let (first, last) = match element.split_once('-') {
        Some((first, last)) => (first.parse().ok()?, last.parse().ok()?),
        None => {
            let n: i64 = element.parse().ok()?;
            (n, n)
        }
    };
    (first <= last).then(|| SeqRange::new(first, last + 1))
}

/// What became of a block pushed to its pool.
pub enum Pushed {
    /// All of it is in the pool, now this deep.
    All(i64),
    /// The refill lock expired; the numbers from this range on are not in
    /// the pool.
    LockLost(SeqRange),
    /// Redis failed; the numbers from this range on may not be in the pool.
    Failed(RedisFailure, SeqRange),
}

/// What one pop returned.
#[derive(Debug, Clone, Default)]
pub struct Popped {
    pub seqs: Vec<i64>,
    pub depth: i64,
    pub target: i64,
}

/// Depth, target and last refill time seen right after taking the lock.
#[derive(Debug, Clone, Copy)]
pub struct LockedPool {
    pub depth: i64,
    pub target: i64,
    pub refilled_at_ms: i64,
}

fn array(value: Value) -> Result<Vec<Value>, RedisFailure> {
    match value {
        Value::Array(values) => Ok(values),
        Value::Null => Ok(Vec::new()),
        other => Err(RedisFailure::Reply(format!(
            "expected an array, got {other:?}"
        ))),
    }
}

/// A script's `{count, {first, last, first, last, ...}}` answer.
fn counted_runs(reply: Value) -> Result<(i64, Vec<SeqRange>), RedisFailure> {
    let mut parts = array(reply)?.into_iter();
    let count = parts
        .next()
        .as_ref()
        .and_then(integer)
        .ok_or_else(|| RedisFailure::Reply("expected a count".into()))?;
    let bounds: Vec<i64> = match parts.next() {
        Some(runs) => array(runs)?.iter().filter_map(integer).collect(),
        None => Vec::new(),
    };
    Ok((
        count,
        bounds
            .chunks_exact(2)
            .map(|pair| SeqRange::new(pair[0], pair[1] + 1))
            .collect(),
    ))
}

/// Adds `runs` to `ranges`, joining a run that continues the one before.
fn merge_runs(ranges: &mut Vec<SeqRange>, runs: Vec<SeqRange>) {
    for run in runs {
        match ranges.last_mut() {
            Some(last) if last.end == run.start => last.end = run.end,
            Some(last) if run.end == last.start => last.start = run.start,
            _ => ranges.push(run),
        }
    }
}

fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Integer(i) => Some(*i),
        Value::String(s) => s.parse().ok(),
        Value::Bytes(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::Double(d) if d.fract() == 0.0 => Some(*d as i64),
        _ => None,
    }
}

/// Our clock, in ms since the epoch.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
