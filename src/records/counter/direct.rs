//! Direct reservations joined: what concurrent requests outside any
//! transaction take straight from the counter (their pool still short
//! after its refill wait, a sequence's first use, or Redis away) is
//! reserved on one request connection per batch, in one statement for
//! every counter asked, each counter's block split among its askers in
//! order. A thousand pools drained at once, or ten thousand sequences used
//! for the first time, then cost a statement and a commit, rather than a
//! turn each on three request connections (which timed out under load) or
//! a statement and a commit each (about 140 µs a counter). The statement
//! takes a counter only if nobody holds it or its definition: one held is
//! asked again in a statement of its own that waits for it. A statement
//! that waited for counters while holding others deadlocked with batches
//! that lock definitions in their items' order; one that never waits
//! cannot.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::{Counter, DirectAsk, Reserved};
use crate::domain::numbers::SeqRange;
use crate::domain::sequence::{Period, Sequence};
use crate::infra::db::{Db, Link};
use crate::records::batch::Batcher;

/// Why a joined reservation failed, shared by every request it served.
pub type DirectError = Arc<sqlx::Error>;

type Reply = Result<Reserved<SeqRange>, DirectError>;

struct Ask {
    sequence: Arc<Sequence>,
    period: Period,
    n: i64,
    reply: oneshot::Sender<Reply>,
}

/// The asks of one counter in one round, in arrival order: one block of
/// their total, split among them in that order.
struct Group {
    asks: Vec<Ask>,
    total: i64,
}

impl Group {
    fn of(ask: Ask) -> Self {
        Self {
            total: ask.n,
            asks: vec![ask],
        }
    }

    fn sequence(&self) -> &Sequence {
        &self.asks[0].sequence
    }

    fn period(&self) -> &Period {
        &self.asks[0].period
    }

    fn answer_all(self, reply: impl Fn() -> Reply) {
        for ask in self.asks {
            let _ = ask.reply.send(reply());
        }
    }

    /// Each ask gets its share of `range`, in order.
    fn share(self, range: SeqRange) {
        let mut next = range.start;
        for ask in self.asks {
            let share = SeqRange::new(next, next + ask.n);
            next += ask.n;
            let _ = ask.reply.send(Ok(Reserved::Got(share)));
        }
    }
}

/// Reservations straight from the counter for requests without a
/// transaction of their own, joined per batch.
pub struct DirectReservations {
    asks: Batcher<Ask>,
}

impl DirectReservations {
    /// Starts the batch worker on `tasks`; its statements run on `db`.
    pub fn spawn(counter: Arc<Counter>, db: Db, tasks: &TaskTracker) -> Self {
        let asks = Batcher::spawn(tasks, "direct reservations", 4096, move |batch| {
            let (counter, db) = (counter.clone(), db.clone());
            async move { reserve_batch(&counter, &db, batch).await }
        });
        Self { asks }
    }

    /// Exactly `n` numbers of `sequence`'s `period`, committed by
    /// themselves; they are issued once the caller's ledger record
    /// commits. A statement whose answer was lost is looked up by its
    /// block's tag: numbers that landed are the caller's.
    pub async fn reserve(
        &self,
        sequence: &Arc<Sequence>,
        period: &Period,
        n: i64,
    ) -> Result<Reserved<SeqRange>, DirectError> {
        let (reply, answer) = oneshot::channel();
        let ask = Ask {
            sequence: sequence.clone(),
            period: period.clone(),
            n,
            reply,
        };
        // A stopped worker sent nothing: nothing is in doubt.
        if self.asks.submit(ask).await.is_err() {
            return Err(Arc::new(sqlx::Error::PoolClosed));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(Arc::new(sqlx::Error::PoolClosed)))
    }
}

/// A round holds each counter once. Asks of a counter under another
/// definition than its group's (one of the two stale) wait for the next
/// round; the asks of a group its counter cannot serve whole are tried
/// one by one, so those that fit below `max` still get theirs.
async fn reserve_batch(counter: &Counter, db: &Db, batch: Vec<Ask>) {
    let mut queued = batch;
    let mut held: VecDeque<Group> = VecDeque::new();
    let mut one_by_one: VecDeque<Ask> = VecDeque::new();
    loop {
        // A first round takes only counters nobody holds; a counter held
        // meanwhile, and each ask tried alone, get a round of their own,
        // where they wait for it.
        let (groups, wait) = if !queued.is_empty() {
            let (groups, later) = first_round(std::mem::take(&mut queued));
            queued = later;
            (groups, false)
        } else if let Some(group) = held.pop_front() {
            (vec![group], true)
        } else if let Some(ask) = one_by_one.pop_front() {
            (vec![Group::of(ask)], true)
        } else {
            return;
        };
        let round = reserve_round(counter, db, groups, wait).await;
        for split in round.split {
            one_by_one.extend(split.asks);
        }
        held.extend(round.held);
    }
}

/// The first round's groups, and the asks left for later rounds.
fn first_round(asks: Vec<Ask>) -> (Vec<Group>, Vec<Ask>) {
    let mut groups: Vec<Group> = Vec::new();
    let mut by_counter: HashMap<(i64, String), usize> = HashMap::new();
    let mut later = Vec::new();
    for ask in asks {
        let counter = (ask.sequence.id, ask.period.key().to_owned());
        match by_counter.get(&counter) {
            Some(&i) if same_terms(groups[i].sequence(), &ask.sequence) => {
                groups[i].total += ask.n;
                groups[i].asks.push(ask);
            }
            Some(_) => later.push(ask),
            None => {
                by_counter.insert(counter, groups.len());
                groups.push(Group::of(ask));
            }
        }
    }
    (groups, later)
}

/// Whether two reads of a sequence reserve under the same terms.
fn same_terms(a: &Sequence, b: &Sequence) -> bool {
    a.identity_version == b.identity_version && a.definition.max_seq() == b.definition.max_seq()
}

/// What one round did with its groups.
#[derive(Default)]
struct Round {
    /// Groups of several asks their counter could not serve whole.
    split: Vec<Group>,
    /// Groups whose counter another transaction held: first in a round of
    /// their own.
    held: Vec<Group>,
}

/// Reserves every group's total and answers its asks. A first round takes
/// every counter in one statement, each only if nobody holds it or its
/// definition (`Counter::take_direct_unless_locked`), committed by
/// itself: ten thousand first uses at once cost a statement and a commit
/// per round, not one each, and a counter another transaction holds
/// delays only its own asks, which get a `wait` round of their own (one
/// group, whose statement waits for its counter).
async fn reserve_round(counter: &Counter, db: &Db, groups: Vec<Group>, wait: bool) -> Round {
    let mut round = Round::default();
    let mut conn = match db.acquire().await {
        Ok(conn) => conn,
        Err(e) => {
            // Nothing was sent.
            let e = Arc::new(e);
            for group in groups {
                group.answer_all(|| Err(e.clone()));
            }
            return round;
        }
    };
    // The periods first used here get their counters in one statement. A
    // counter at its first number hands out nothing.
    let periods: Vec<(&Sequence, &Period)> =
        groups.iter().map(|g| (g.sequence(), g.period())).collect();
    if let Err(e) = counter.ensure_periods(conn.statements(), &periods).await {
        let e = Arc::new(e);
        for group in groups {
            group.answer_all(|| Err(e.clone()));
        }
        return round;
    }
    let tags: Vec<String> = groups.iter().map(|_| counter.direct_tag()).collect();
    let reserved = if wait {
        let group = &groups[0];
        counter
            .take_direct(
                &mut conn,
                group.sequence(),
                group.period(),
                group.total,
                &tags[0],
            )
            .await
            .map(|r| vec![Some(r)])
    } else {
        let asks: Vec<DirectAsk<'_>> = groups
            .iter()
            .zip(&tags)
            .map(|(g, tag)| DirectAsk {
                sequence: g.sequence(),
                period: g.period(),
                n: g.total,
                tag,
            })
            .collect();
        counter.take_direct_unless_locked(&mut conn, &asks).await
    };
    match reserved {
        Ok(reserved) => {
            for (group, reserved) in groups.into_iter().zip(reserved) {
                match reserved {
                    Some(Reserved::Got(range)) => group.share(range),
                    None => round.held.push(group),
                    Some(Reserved::Exhausted) if group.asks.len() > 1 => round.split.push(group),
                    Some(other) => group.answer_all(|| Ok(other)),
                }
            }
        }
        Err(e) => {
            // The statement committed by itself: if its answer was lost,
            // each block is looked up by its tag rather than written off.
            drop(conn);
            let in_doubt = crate::infra::db::may_have_committed(&e);
            let e = Arc::new(e);
            for (group, tag) in groups.into_iter().zip(&tags) {
                let landed = match in_doubt {
                    true => {
                        counter
                            .direct_landed(group.sequence(), group.period(), tag)
                            .await
                    }
                    false => None,
                };
                match landed {
                    Some(range) => group.share(range),
                    None => group.answer_all(|| Err(e.clone())),
                }
            }
        }
    }
    round
}

#[cfg(test)]
mod tests;
