//! Direct reservations joined: what concurrent requests outside any
//! transaction take straight from the counter (their pool still short
//! after its refill wait, or Redis away) is reserved on one request
//! connection per batch, one statement per counter for all its askers. A
//! thousand pools drained at once then take a thousand short statements
//! on one connection, rather than a thousand turns on three request
//! connections (and on the refills' one, where each first use created its
//! counter), which timed out under load. Each statement locks one
//! definition and one counter, as a single request's did: a statement
//! over many counters deadlocked with batches that lock definitions in
//! their items' order.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::{Counter, Reserved};
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
    let mut one_by_one: VecDeque<Ask> = VecDeque::new();
    loop {
        let groups = if !queued.is_empty() {
            let (groups, later) = first_round(std::mem::take(&mut queued));
            queued = later;
            groups
        } else if let Some(ask) = one_by_one.pop_front() {
            vec![Group::of(ask)]
        } else {
            return;
        };
        for split in reserve_round(counter, db, groups).await {
            one_by_one.extend(split.asks);
        }
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

/// Reserves every group's total on one connection, a statement each, and
/// answers its asks; returns the groups of several asks their counter
/// could not serve whole.
async fn reserve_round(counter: &Counter, db: &Db, groups: Vec<Group>) -> Vec<Group> {
    let mut conn = match db.acquire().await {
        Ok(conn) => conn,
        Err(e) => {
            // Nothing was sent.
            let e = Arc::new(e);
            for group in groups {
                group.answer_all(|| Err(e.clone()));
            }
            return Vec::new();
        }
    };
    let mut split = Vec::new();
    let mut groups = groups.into_iter();
    while let Some(group) = groups.next() {
        let (sequence, period) = (group.sequence(), group.period());
        let tag = counter.direct_tag();
        let reserved = match counter
            .ensure_period(conn.statements(), sequence, period)
            .await
        {
            Ok(()) => {
                counter
                    .take_direct(&mut conn, sequence, period, group.total, &tag)
                    .await
            }
            Err(e) => Err(e),
        };
        match reserved {
            Ok(Reserved::Got(range)) => group.share(range),
            Ok(Reserved::Exhausted) if group.asks.len() > 1 => split.push(group),
            Ok(other) => group.answer_all(|| Ok(other)),
            Err(e) => {
                // The statement committed by itself: if its answer was
                // lost, its block is looked up rather than written off.
                // The groups after it were never sent.
                drop(conn);
                let landed = match crate::infra::db::may_have_committed(&e) {
                    true => counter.direct_landed(sequence, period, &tag).await,
                    false => None,
                };
                let e = Arc::new(e);
                match landed {
                    Some(range) => group.share(range),
                    None => group.answer_all(|| Err(e.clone())),
                }
                for rest in groups {
                    rest.answer_all(|| Err(e.clone()));
                }
                return split;
            }
        }
    }
    split
}

#[cfg(test)]
mod tests;
