//! The pools' lists in Redis: pop, the refill lock, push in parts,
//! discard, give back, and what a pool holds. Each call runs one bounded
//! script through the connection's circuit breaker.

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;

use super::redis::{PoolKeys, RedisFailure, RedisLink};
use crate::domain::numbers::SeqRange;

/// Names one give-back of numbers to a pool, kept across its retries:
/// the pool takes the numbers once per token (see
/// [`super::scripts::GIVE_BACK`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiveBackToken(String);

impl GiveBackToken {
    pub fn new() -> Self {
        Self(format!("{:016x}", rand::random::<u64>()))
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
                vec![keys.pool.clone(), keys.meta.clone(), keys.inflight.clone()],
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
            Some(Value::Array(values)) => values.into_iter().filter_map(|v| integer(&v)).collect(),
            Some(Value::Null) | None => Vec::new(),
            Some(other) => return Err(RedisFailure::Reply(format!("pop list: {other:?}"))),
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

    pub(super) fn pop_book(&self) -> std::sync::MutexGuard<'_, super::redis::PopBook> {
        self.link.pops.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When our command timeout ends, on the server's clock (0 while its
    /// clock is unknown): a script past it does nothing.
    fn deadline(&self) -> i64 {
        self.server_clock_offset().map_or(0, |offset| {
            now_ms() + offset + self.link.command_timeout.as_millis() as i64
        })
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

    /// Appends `block` and releases the lock. The block goes in parts of at
    /// most [`PUSH_PART`] numbers, one script each, so other pools' pops run
    /// between them; what a lost lock or a failure left out is reported.
    pub async fn push(
        &self,
        keys: &PoolKeys,
        token: &str,
        block: SeqRange,
        target: i64,
        now_ms: i64,
    ) -> Pushed {
        let mut start = block.start;
        loop {
            let end = start.saturating_add(PUSH_PART).min(block.end);
            let last = end >= block.end;
            let part = self
                .link
                .guarded(async {
                    let reply = self
                        .link
                        .eval(
                            &self.link.scripts.push,
                            vec![keys.lock.clone(), keys.pool.clone(), keys.meta.clone()],
                            vec![
                                token.to_owned(),
                                start.to_string(),
                                end.to_string(),
                                target.to_string(),
                                now_ms.to_string(),
                                if last { "1" } else { "0" }.to_owned(),
                            ],
                        )
                        .await?;
                    integer(&reply).ok_or_else(|| RedisFailure::Reply(format!("push: {reply:?}")))
                })
                .await;
            let rest = SeqRange {
                start,
                end: block.end,
            };
            match part {
                Err(e) => return Pushed::Failed(e, rest),
                Ok(depth) if depth < 0 => return Pushed::LockLost(rest),
                Ok(depth) if last => return Pushed::All(depth),
                Ok(_) => start = end,
            }
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
    /// then read back in parts of [`PUSH_PART`], so that no script holds
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
        let mut ranges: Vec<SeqRange> = Vec::new();
        if !moved {
            return Ok(ranges);
        }
        loop {
            let part = self
                .link
                .guarded(async {
                    let reply = self
                        .link
                        .eval(
                            &self.link.scripts.drain,
                            vec![drain.clone()],
                            vec![PUSH_PART.to_string()],
                        )
                        .await?;
                    counted_runs(reply)
                })
                .await;
            match part {
                Ok((left, runs)) => {
                    merge_runs(&mut ranges, runs);
                    if left <= 0 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, pool = %keys.pool, drained = ?ranges,
                        "emptied pool only partly read back; the rest goes unrecorded");
                    break;
                }
            }
        }
        Ok(ranges)
    }

    /// Removes the numbers above `max` and returns them, [`PUSH_PART`] at
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
                            vec![max.to_string(), PUSH_PART.to_string()],
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
    /// out of order, and the lower ones judged lost by reconciliation,
    /// which trusts the head to be the pool's lowest number.
    pub async fn give_back(
        &self,
        keys: &PoolKeys,
        seqs: &[i64],
        token: &GiveBackToken,
    ) -> Result<(), RedisFailure> {
        if !self.link.is_up() {
            return Err(RedisFailure::Open);
        }
        if seqs.is_empty() {
            return Ok(());
        }
        for (i, part) in seqs.chunks(PUSH_PART as usize).enumerate() {
            let mut args = vec![format!("{}.{i}", token.0)];
            args.extend(part.iter().map(i64::to_string));
            self.link
                .guarded(async {
                    let _: i64 = self
                        .link
                        .eval(
                            &self.link.scripts.give_back,
                            vec![keys.pool.clone(), keys.inflight.clone()],
                            args,
                        )
                        .await?
                        .convert()?;
                    Ok(())
                })
                .await?;
        }
        Ok(())
    }

    /// The lowest number waiting in the pool, if any.
    pub async fn head(&self, keys: &PoolKeys) -> Result<Option<i64>, RedisFailure> {
        self.link
            .guarded(async {
                let client = self.link.clients.next().with_options(&self.link.options);
                let head: Option<String> = client.lindex(keys.pool.as_str(), 0).await?;
                Ok(head.and_then(|h| h.parse().ok()))
            })
            .await
    }

    pub async fn depth(&self, keys: &PoolKeys) -> Result<i64, RedisFailure> {
        self.link
            .guarded(async {
                let client = self.link.clients.next().with_options(&self.link.options);
                Ok(client.llen(keys.pool.as_str()).await?)
            })
            .await
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

/// Most numbers one push script appends: about 2 ms of Redis, which every
/// other pool waits for.
pub const PUSH_PART: i64 = 8_192;

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
