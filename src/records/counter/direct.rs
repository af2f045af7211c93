//! Direct reservations joined: what concurrent requests outside any
//! transaction take straight from the counter (their pool still short
//! after its refill wait, or Redis away) is reserved in one statement per
//! batch, on one request connection. A thousand pools drained at once
//! then cost a few statements rather than a thousand turns on the request
//! connections (and on the refills' one, where each first use created its
//! counter), which timed out under load.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::{Counter, Reserved};
use crate::domain::numbers::SeqRange;
use crate::domain::sequence::{Period, Sequence};
use crate::infra::db::{Conn, Db, Link};
use crate::records::batch::Batcher;

/// Most counters one statement moves.
const MAX_COUNTERS: usize = 512;

/// Why a joined reservation failed, shared by every request of its
/// statement.
pub type DirectError = Arc<sqlx::Error>;

type Reply = Result<Reserved<SeqRange>, DirectError>;

struct Ask {
    sequence: Arc<Sequence>,
    period: Period,
    n: i64,
    reply: oneshot::Sender<Reply>,
}

/// The asks of one counter in one statement, in arrival order: one
/// block of their total, split among them in that order.
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

/// One statement per round: a round holds each counter once. Asks of a
/// counter under another definition than its group's (one of the two
/// stale), or past [`MAX_COUNTERS`], wait for the next round; the asks of
/// a group its counter cannot serve whole are tried one by one, so those
/// that fit below `max` still get theirs.
async fn reserve_batch(counter: &Counter, db: &Db, batch: Vec<Ask>) {
    let mut queued = batch;
    let mut one_by_one: VecDeque<Ask> = VecDeque::new();
    loop {
        let groups = if !queued.is_empty() {
            let (groups, later) = rounds(std::mem::take(&mut queued));
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
fn rounds(asks: Vec<Ask>) -> (Vec<Group>, Vec<Ask>) {
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
            None if groups.len() >= MAX_COUNTERS => later.push(ask),
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

/// Reserves every group's total in one statement and answers its asks;
/// returns the groups of several asks their counter could not serve
/// whole.
async fn reserve_round(counter: &Counter, db: &Db, mut groups: Vec<Group>) -> Vec<Group> {
    // Counters are locked in one order, so two instances' statements
    // cannot wait for each other.
    groups.sort_by(|a, b| {
        (a.sequence().id, a.period().key()).cmp(&(b.sequence().id, b.period().key()))
    });
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
    let counters: Vec<(&Sequence, &Period)> =
        groups.iter().map(|g| (g.sequence(), g.period())).collect();
    if let Err(e) = counter.ensure_periods(&mut conn, &counters).await {
        let e = Arc::new(e);
        for group in groups {
            group.answer_all(|| Err(e.clone()));
        }
        return Vec::new();
    }
    let tag = counter.direct_tag();
    let asked: Vec<(&Sequence, &Period, i64)> = groups
        .iter()
        .map(|g| (g.sequence(), g.period(), g.total))
        .collect();
    let taken = match counter.reserve_directs(&mut conn, &asked, &tag).await {
        Ok(taken) => taken,
        Err(e) if crate::infra::db::may_have_committed(&e) => {
            drop(conn);
            let counters: Vec<(i64, &str)> = groups
                .iter()
                .map(|g| (g.sequence().id, g.period().key()))
                .collect();
            let landed = counter.directs_landed(&counters, &tag).await;
            let e = Arc::new(e);
            for group in groups {
                match landed.get(&(group.sequence().id, group.period().key().to_owned())) {
                    Some(range) => group.share(*range),
                    None => group.answer_all(|| Err(e.clone())),
                }
            }
            return Vec::new();
        }
        Err(e) => {
            let e = Arc::new(e);
            for group in groups {
                group.answer_all(|| Err(e.clone()));
            }
            return Vec::new();
        }
    };
    let mut refused = Vec::new();
    for group in groups {
        match taken
            .blocks
            .get(&(group.sequence().id, group.period().key().to_owned()))
        {
            Some(first) if taken.fenced => {
                let range = SeqRange::new(*first, *first + group.total);
                group.share(range);
            }
            // Taken on a timeline the counters were not fenced on: those
            // numbers are never handed out (reconciliation names them).
            Some(_) => group.answer_all(|| Ok(Reserved::Unfenced)),
            None => refused.push(group),
        }
    }
    if refused.is_empty() {
        return Vec::new();
    }
    let ids: Vec<i64> = refused.iter().map(|g| g.sequence().id).collect();
    let why = counter.why_refused(&mut conn, &ids).await.map_err(Arc::new);
    let mut split = Vec::new();
    for group in refused {
        match &why {
            Err(e) => group.answer_all(|| Err(e.clone())),
            Ok(Refusal::Unfenced) => group.answer_all(|| Ok(Reserved::Unfenced)),
            Ok(Refusal::Versions(current)) => {
                if current.get(&group.sequence().id) != Some(&group.sequence().identity_version) {
                    group.answer_all(|| Ok(Reserved::Stale));
                } else if group.asks.len() > 1 {
                    split.push(group);
                } else {
                    group.answer_all(|| Ok(Reserved::Exhausted));
                }
            }
        }
    }
    split
}

/// What one joined statement took: the first number of each counter's
/// block, by sequence and period, and whether it ran on the timeline the
/// counters were fenced on.
pub(super) struct Taken {
    pub blocks: HashMap<(i64, String), i64>,
    pub fenced: bool,
}

/// Why counters refused a joined statement.
pub(super) enum Refusal {
    /// Postgres is on another timeline than the one the counters were
    /// fenced on.
    Unfenced,
    /// Each sequence's identity version now: the one asked for means the
    /// counter is spent; another, that the definition changed.
    Versions(HashMap<i64, i32>),
}

impl Counter {
    /// The counters of every `(sequence, period)` not yet known to exist,
    /// created at their first numbers, committed by themselves (see
    /// [`Counter::ensure_period`]), in one statement.
    pub(super) async fn ensure_periods(
        &self,
        conn: &mut Conn,
        counters: &[(&Sequence, &Period)],
    ) -> Result<(), sqlx::Error> {
        let unknown: Vec<&(&Sequence, &Period)> = counters
            .iter()
            .filter(|(s, p)| !self.known(&(s.id, p.key().to_owned())))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = unknown.iter().map(|(s, _)| s.id).collect();
        let periods: Vec<String> = unknown.iter().map(|(_, p)| p.key().to_owned()).collect();
        let firsts: Vec<i64> = unknown.iter().map(|(s, p)| s.first_number(p)).collect();
        // In (sequence, period) order, the order the caller sorted them in:
        // two such inserts cannot wait for each other.
        sqlx::query!(
            "INSERT INTO counters (sequence_id, period, next_seq) \
             SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::bigint[]) \
             ON CONFLICT (sequence_id, period) DO NOTHING",
            &ids,
            &periods,
            &firsts,
        )
        .execute(conn.statements())
        .await?;
        for (id, period) in ids.into_iter().zip(periods) {
            self.now_known((id, period));
        }
        Ok(())
    }

    /// Moves each counter by its total in one statement, recording a
    /// `direct` block tagged `tag` for each; a counter with fewer numbers
    /// left than asked, or whose definition changed, moves not at all.
    pub(super) async fn reserve_directs(
        &self,
        conn: &mut Conn,
        asked: &[(&Sequence, &Period, i64)],
        tag: &str,
    ) -> Result<Taken, sqlx::Error> {
        let ids: Vec<i64> = asked.iter().map(|(s, _, _)| s.id).collect();
        let periods: Vec<String> = asked.iter().map(|(_, p, _)| p.key().to_owned()).collect();
        let totals: Vec<i64> = asked.iter().map(|(_, _, n)| *n).collect();
        let maxes: Vec<i64> = asked
            .iter()
            .map(|(s, _, _)| s.definition.max_seq())
            .collect();
        let versions: Vec<i32> = asked.iter().map(|(s, _, _)| s.identity_version).collect();
        let fenced = self.fenced_timeline();
        // The counters are locked in (sequence, period) order before any
        // moves (ORDER BY ... FOR UPDATE locks rows as they come out of
        // the sort), so statements naming the same counters cannot wait
        // for each other. On a timeline the counters were not fenced on
        // nothing is taken, as in `reserve_direct`.
        let rows = sqlx::query!(
            r#"WITH asked AS (
                   SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::int[])
                       AS a(sequence_id, period, n, max_seq, identity_version)
               ), locked AS (
                   SELECT c.sequence_id, c.period FROM counters c
                   JOIN asked a ON a.sequence_id = c.sequence_id AND a.period = c.period
                   ORDER BY c.sequence_id, c.period
                   FOR UPDATE OF c
               ), taken AS (
                   UPDATE counters c SET last_grant = a.n, next_seq = c.next_seq + a.n
                   FROM asked a, locked l
                   WHERE c.sequence_id = a.sequence_id AND c.period = a.period
                     AND l.sequence_id = c.sequence_id AND l.period = c.period
                     AND c.next_seq + a.n - 1 <= a.max_seq
                     AND ($6::text IS NULL OR substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) = $6)
                     AND EXISTS (SELECT 1 FROM sequences s
                                 WHERE s.id = a.sequence_id AND s.identity_version = a.identity_version
                                 FOR KEY SHARE)
                   RETURNING c.sequence_id, c.period, c.next_seq - a.n AS first, c.next_seq AS next
               )
               INSERT INTO blocks (sequence_id, period, seqs, purpose, instance_id)
               SELECT sequence_id, period, int8range(first, next), 'direct', $7 FROM taken
               RETURNING sequence_id AS "sequence_id!", period AS "period!", lower(seqs) AS "first!",
                         substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS "timeline!""#,
            &ids,
            &periods,
            &totals,
            &maxes,
            &versions,
            fenced,
            tag,
        )
        .fetch_all(conn.statements())
        .await?;
        let fenced = match rows.first() {
            Some(row) => self.on_fenced_timeline(&row.timeline),
            None => true,
        };
        Ok(Taken {
            blocks: rows
                .into_iter()
                .map(|row| ((row.sequence_id, row.period), row.first))
                .collect(),
            fenced,
        })
    }

    /// Why counters of `sequence_ids` moved not at all in a joined
    /// statement.
    pub(super) async fn why_refused(
        &self,
        conn: &mut Conn,
        sequence_ids: &[i64],
    ) -> Result<Refusal, sqlx::Error> {
        // Not exhausted: Postgres is on another timeline than the one
        // asked for (a failover, fenced since or not yet).
        if let Some(asked) = self.fenced_timeline()
            && asked != self.timeline_of(&mut *conn).await?
        {
            return Ok(Refusal::Unfenced);
        }
        let rows = sqlx::query!(
            "SELECT id, identity_version FROM sequences WHERE id = ANY($1)",
            sequence_ids
        )
        .fetch_all(conn.statements())
        .await?;
        Ok(Refusal::Versions(
            rows.into_iter()
                .map(|row| (row.id, row.identity_version))
                .collect(),
        ))
    }

    /// The blocks a joined statement whose answer was lost recorded under
    /// `tag`, by sequence and period, once the server answers again; only
    /// those on the timeline the counters were fenced on. Empty when none
    /// landed, or Postgres never answered in time.
    pub(super) async fn directs_landed(
        &self,
        counters: &[(i64, &str)],
        tag: &str,
    ) -> HashMap<(i64, String), SeqRange> {
        let ids: Vec<i64> = counters.iter().map(|(id, _)| *id).collect();
        let periods: Vec<String> = counters.iter().map(|(_, p)| (*p).to_owned()).collect();
        // The statement's session is not known (its answer was lost): a
        // cut connection to a live server could still be committing it.
        let found = crate::infra::db::once_answering(
            &self.refill_db,
            crate::infra::db::IN_DOUBT_PATIENCE,
            None,
            |mut conn| {
                let (ids, periods, tag) = (ids.clone(), periods.clone(), tag.to_owned());
                async move {
                    // Among each period's latest blocks (an index scan from
                    // the top): the reservation was the latest a moment ago.
                    sqlx::query!(
                        r#"SELECT a.sequence_id AS "sequence_id!", a.period AS "period!",
                                  lower(b.seqs) AS "start!", upper(b.seqs) AS "end!",
                                  substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS "timeline!"
                           FROM UNNEST($1::bigint[], $2::text[]) AS a(sequence_id, period)
                           CROSS JOIN LATERAL (
                               SELECT seqs, instance_id FROM blocks
                               WHERE sequence_id = a.sequence_id AND period = a.period
                               ORDER BY lower(seqs) DESC LIMIT 10000) b
                           WHERE b.instance_id = $3"#,
                        &ids,
                        &periods,
                        &tag,
                    )
                    .fetch_all(&mut conn)
                    .await
                }
            },
        )
        .await
        .unwrap_or_default();
        found
            .into_iter()
            .filter(|row| self.on_fenced_timeline(&row.timeline))
            .map(|row| {
                (
                    (row.sequence_id, row.period),
                    SeqRange::new(row.start, row.end),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
