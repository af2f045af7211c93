//! Leases: numbers an instance holds in memory to serve `POST /ids` and
//! documents without a Redis call or a commit of their own.
//!
//! An instance takes numbers from a pool in runs sized to about 50 ms of
//! the sequence's traffic on it ([`rate`]), recorded in the issuance ledger
//! as leased to it before any of them is handed out. Requests then take
//! numbers from memory, each lease only until its deadline (the caller's,
//! a little before the lease's expiry in the ledger): a number past it is
//! never handed out, and a sweep gives back what nears it. The next lease
//! is asked for while a quarter of the
//! current one is left, so a request waits only when a lease runs dry
//! faster than a commit. At low rates a lease would be the request itself,
//! so the request is served on its own (strict order, one commit each).
//! A lease ordered while such requests are still getting their numbers is
//! taken after them ([`OnItsOwn`]): on one instance, a request sent after
//! another's answer never gets a lower number.
//!
//! This module is the store only: which numbers each holder has, when a
//! new lease is due, and which numbers go back (idle, too old, or at a
//! stop). It does no I/O: taking a lease and recording handouts are the
//! lease path's (`issuance::lease_path`), giving numbers back the lease
//! returns' (`issuance::lease_returns`); both consult it.
//! Every time decision reads the one injected clock.

pub mod rate;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, mpsc};

use super::Placement;
use crate::domain::clock::Clock;
use crate::infra::stats::Stats;

pub use rate::{MIN_LEASE, Rate, lease_size};

#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// Off: every request is recorded on its own (`IDPOOL_LEASES=off`).
    pub enabled: bool,
    /// How much of a sequence's traffic one lease carries.
    pub traffic: Duration,
    /// A lease no request has taken a number from for this long is given
    /// back.
    pub max_idle: Duration,
    /// A lease not used up this long after it was taken is given back even
    /// while requests still use it, so a live instance never holds numbers
    /// long enough for reconciliation to judge them (its settle time is
    /// never below the request timeout, at least a second).
    pub max_age: Duration,
    /// How often idle leases are looked for and returns written.
    pub report_every: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            traffic: Duration::from_millis(50),
            max_idle: Duration::from_millis(500),
            max_age: Duration::from_secs(1),
            report_every: Duration::from_millis(20),
        }
    }
}

/// The leased numbers of one pool (sequence version and period) on this
/// instance, and the placement it was made for (handed back with every
/// lease order and return).
pub struct Holder {
    pub pool: Arc<Placement>,
    state: Mutex<State>,
    /// Woken when a lease arrives or fails.
    changed: Notify,
    /// Woken when the last request served on its own has its numbers.
    own_done: Notify,
}

/// A leased number and the instant after which it may not be handed out.
#[derive(Clone, Copy)]
struct Leased {
    seq: i64,
    until: Instant,
}

/// Numbers within this much of their deadline are given back by the sweep
/// rather than handed out: their lease nears its expiry in the ledger.
const GIVE_BACK_BEFORE_DEADLINE: Duration = Duration::from_secs(2);

#[derive(Default)]
struct State {
    /// Leased, not handed out yet; ascending.
    numbers: VecDeque<Leased>,
    /// The earliest deadline among `numbers`, if any.
    earliest: Option<Instant>,
    fetching: bool,
    /// Failed lease attempts so far: a waiter that sees this grow stops
    /// waiting and is served on its own.
    failures: u64,
    last_size: usize,
    leased_at: Option<DateTime<Utc>>,
    /// When a sweep last found fewer numbers left than the sweep before
    /// (a request took some), and how many it found: measured by the
    /// sweep, so requests read the clock only for the rate.
    used_at: Option<DateTime<Utc>>,
    left_at_sweep: usize,
    rate: Rate,
    /// The instance is stopping: nothing more is leased or handed out.
    closed: bool,
    /// Requests told to go on their own whose pop has not answered yet
    /// ([`OnItsOwn`]): the next lease is taken only after them.
    on_their_own: usize,
}

impl Holder {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// Takes out every number whose deadline is at or before `by`.
    fn take_expiring(&mut self, by: Instant) -> Vec<i64> {
        if self.earliest.is_none_or(|earliest| earliest > by) {
            return Vec::new();
        }
        let mut expiring = Vec::new();
        self.numbers.retain(|leased| {
            let keep = leased.until > by;
            if !keep {
                expiring.push(leased.seq);
            }
            keep
        });
        self.earliest = self.numbers.iter().map(|l| l.until).min();
        expiring
    }

    fn drain_all(&mut self) -> Vec<i64> {
        self.earliest = None;
        self.numbers.drain(..).map(|l| l.seq).collect()
    }
}

/// A holder's key: sequence id, definition version, period key.
pub type HolderKey = (i64, i32, String);

/// Where a request stands after taking what a lease had.
pub enum LeaseProgress {
    Complete,
    /// A lease is on its way.
    Waiting,
    /// No lease is coming: the rest is served for this request alone,
    /// which holds the ticket until it has its numbers.
    Alone(OnItsOwn),
}

/// A request served on its own, from the moment it was told no lease is
/// coming until it drops this (once its pop has answered: its numbers are
/// known). A lease ordered meanwhile is taken only after every such pop:
/// taken before, it could hold lower numbers than one of them, and a
/// request sent after that one's answer would get a lower number from the
/// lease. (Not until the request is recorded: a request stuck on a locked
/// number must not hold up the lease everyone else waits for.)
pub struct OnItsOwn {
    holder: Arc<Holder>,
}

impl Drop for OnItsOwn {
    fn drop(&mut self) {
        let mut state = self.holder.state();
        state.on_their_own = state.on_their_own.saturating_sub(1);
        if state.on_their_own == 0 {
            drop(state);
            self.holder.own_done.notify_waiters();
        }
    }
}

/// A lease to take now, of `size` numbers; whoever gets one must answer
/// it with [`Leases::arrived`].
pub struct Order {
    pub holder: Arc<Holder>,
    pub size: usize,
}

/// Numbers a holder gives back: not handed out, to go back to their pool.
pub struct Returned {
    pub pool: Arc<Placement>,
    pub seqs: Vec<i64>,
}

pub struct Leases {
    clock: Arc<dyn Clock>,
    settings: LeaseSettings,
    holders: Mutex<HashMap<HolderKey, Arc<Holder>>>,
    returns: mpsc::UnboundedSender<Returned>,
    /// Held by the one reporter while it runs (a restarted one takes it
    /// over).
    pending_returns: tokio::sync::Mutex<mpsc::UnboundedReceiver<Returned>>,
    /// Leases being taken, and a wake-up when one arrives.
    fetches: AtomicUsize,
    fetched: Notify,
    /// Returns not written yet, and a wake-up when some are.
    unwritten: AtomicUsize,
    written: Notify,
    stats: Arc<Stats>,
}

impl Leases {
    pub fn new(clock: Arc<dyn Clock>, settings: LeaseSettings, stats: Arc<Stats>) -> Self {
        let (returns, pending_returns) = mpsc::unbounded_channel();
        Self {
            clock,
            settings,
            holders: Mutex::new(HashMap::new()),
            returns,
            pending_returns: tokio::sync::Mutex::new(pending_returns),
            fetches: AtomicUsize::new(0),
            fetched: Notify::new(),
            unwritten: AtomicUsize::new(0),
            written: Notify::new(),
            stats,
        }
    }

    pub fn enabled(&self) -> bool {
        self.settings.enabled
    }

    pub fn settings(&self) -> &LeaseSettings {
        &self.settings
    }

    /// Whether `placement`'s period has ended on the injected clock: no
    /// request takes its numbers any more, and reconciliation gives its
    /// pool up for good.
    pub fn period_ended(&self, placement: &Placement) -> bool {
        placement
            .period
            .ends_at()
            .is_some_and(|end| self.clock.now() >= end)
    }

    /// Holders kept now.
    pub fn holders(&self) -> usize {
        self.holders.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The holder of `key`, made with `pool` on first use.
    pub fn holder(&self, key: HolderKey, pool: impl FnOnce() -> Arc<Placement>) -> Arc<Holder> {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        holders
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Holder {
                    pool: pool(),
                    state: Mutex::new(State::default()),
                    changed: Notify::new(),
                    own_done: Notify::new(),
                })
            })
            .clone()
    }

    /// Moves leased numbers into `got` until it holds `count`, and orders
    /// the next lease when a quarter of the last one is left (or none is,
    /// and the rate asks for one). `first_visit` counts the request in the
    /// rate. The order, if any, must be taken and answered.
    pub fn take(
        &self,
        holder: &Arc<Holder>,
        count: usize,
        pool_size: usize,
        got: &mut Vec<i64>,
        first_visit: bool,
    ) -> (LeaseProgress, Option<Order>) {
        let now = self.clock.now();
        let mut state = holder.state();
        if first_visit {
            state.rate.add(count, now);
        }
        if state.closed {
            return (Self::on_its_own(holder, state), None);
        }
        // Nothing past its deadline goes out: the sweep normally gave it
        // back long before (a stalled sweep, a slow machine).
        let expired = state.take_expiring(Instant::now());
        if !expired.is_empty() {
            self.give_back(holder, expired);
        }
        let take = (count - got.len()).min(state.numbers.len());
        got.extend(state.numbers.drain(..take).map(|l| l.seq));
        let missing = count - got.len();
        let low = state.numbers.len() * 4 <= state.last_size;
        if !state.fetching && (missing > 0 || low) {
            let rate = state.rate.per_second(now);
            if let Some(size) = lease_size(rate, self.settings.traffic, missing, pool_size) {
                state.fetching = true;
                state.last_size = size;
                drop(state);
                self.fetches.fetch_add(1, Ordering::AcqRel);
                let order = Order {
                    holder: holder.clone(),
                    size,
                };
                let progress = if missing == 0 {
                    LeaseProgress::Complete
                } else {
                    LeaseProgress::Waiting
                };
                return (progress, Some(order));
            }
        }
        let progress = if missing == 0 {
            LeaseProgress::Complete
        } else if state.fetching {
            LeaseProgress::Waiting
        } else {
            return (Self::on_its_own(holder, state), None);
        };
        (progress, None)
    }

    /// Counted under the same lock that decided it, so no lease ordered
    /// after the decision can miss it.
    fn on_its_own(holder: &Arc<Holder>, mut state: MutexGuard<'_, State>) -> LeaseProgress {
        state.on_their_own += 1;
        LeaseProgress::Alone(OnItsOwn {
            holder: holder.clone(),
        })
    }

    /// Until every request told to go on its own has popped its numbers: a
    /// lease is taken only then (see [`OnItsOwn`]).
    pub async fn after_those_on_their_own(&self, holder: &Holder) {
        loop {
            let done = holder.own_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if holder.state().on_their_own == 0 {
                return;
            }
            done.await;
        }
    }

    /// Waits for leases until `count` numbers are in `got`, handing every
    /// lease order met on the way to `order`. An error when no lease is
    /// coming: the rate asks for none (the request's [`OnItsOwn`]), or
    /// taking one failed (None: the caller finds out why on its own).
    pub async fn fill(
        &self,
        holder: &Arc<Holder>,
        count: usize,
        pool_size: usize,
        got: &mut Vec<i64>,
        mut order: impl FnMut(Order),
    ) -> Result<(), Option<OnItsOwn>> {
        loop {
            let changed = holder.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read, so a lease arriving in
            // between still wakes this request.
            changed.as_mut().enable();
            let failures = holder.state().failures;
            let (progress, next) = self.take(holder, count, pool_size, got, false);
            if let Some(next) = next {
                order(next);
            }
            match progress {
                LeaseProgress::Complete => return Ok(()),
                LeaseProgress::Alone(on_its_own) => return Err(Some(on_its_own)),
                LeaseProgress::Waiting => {}
            }
            changed.await;
            if holder.state().failures != failures {
                return Err(None);
            }
        }
    }

    /// The answer to an [`Order`]: the numbers leased (recorded in the
    /// ledger as this instance's), or None when none were, and the instant
    /// after which none of them may be handed out.
    pub fn arrived(&self, holder: &Holder, leased: Option<Vec<i64>>, until: Instant) {
        let mut state = holder.state();
        state.fetching = false;
        match leased {
            Some(seqs) => {
                self.stats.leases_taken.inc();
                self.stats.lease_numbers.inc_by(seqs.len() as u64);
                if state.closed {
                    drop(state);
                    self.give_back(holder, seqs);
                } else {
                    state
                        .numbers
                        .extend(seqs.into_iter().map(|seq| Leased { seq, until }));
                    state
                        .numbers
                        .make_contiguous()
                        .sort_unstable_by_key(|l| l.seq);
                    state.earliest = Some(state.earliest.map_or(until, |e| e.min(until)));
                    state.leased_at = Some(self.clock.now());
                    drop(state);
                }
            }
            None => {
                state.failures += 1;
                drop(state);
            }
        }
        holder.changed.notify_waiters();
        self.fetches.fetch_sub(1, Ordering::AcqRel);
        self.fetched.notify_waiters();
    }

    /// Counts numbers handed out of a lease.
    pub fn served(&self, how_many: usize) {
        self.stats.lease_numbers_served.inc_by(how_many as u64);
    }

    /// Numbers taken from a lease but not handed out after all (a
    /// document not written) go back to their pool: their deadline is no
    /// longer known here, so they never go back into the lease.
    pub fn put_back(&self, holder: &Holder, seqs: Vec<i64>) {
        self.give_back(holder, seqs);
    }

    fn give_back(&self, holder: &Holder, seqs: Vec<i64>) {
        if seqs.is_empty() {
            return;
        }
        self.stats.lease_numbers_returned.inc_by(seqs.len() as u64);
        self.unwritten.fetch_add(1, Ordering::AcqRel);
        let _ = self.returns.send(Returned {
            pool: holder.pool.clone(),
            seqs,
        });
    }

    /// Gives back what leases idle longer than `max_idle`, or taken longer
    /// than `max_age` ago, still hold (all of it when `everything`, at a
    /// clean stop, after which nothing more is leased), and forgets
    /// holders no request uses any more.
    pub fn sweep(&self, everything: bool) {
        let now = self.clock.now();
        let since =
            |at: Option<DateTime<Utc>>| at.map(|at| (now - at).to_std().unwrap_or_default());
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let mut unused = Vec::new();
        let near_deadline = Instant::now() + GIVE_BACK_BEFORE_DEADLINE;
        for (key, holder) in holders.iter() {
            let mut state = holder.state();
            if everything {
                state.closed = true;
            }
            let expiring = state.take_expiring(near_deadline);
            if !expiring.is_empty() {
                self.give_back(holder, expiring);
            }
            let left = state.numbers.len();
            if left < state.left_at_sweep {
                state.used_at = Some(now);
            }
            state.left_at_sweep = left;
            let idle = since(state.used_at.max(state.leased_at))
                .is_none_or(|idle| idle >= self.settings.max_idle);
            let old = since(state.leased_at).is_none_or(|age| age >= self.settings.max_age);
            if (everything || ((idle || old) && !state.fetching)) && !state.numbers.is_empty() {
                let seqs: Vec<i64> = state.drain_all();
                state.left_at_sweep = 0;
                drop(state);
                self.give_back(holder, seqs);
                continue;
            }
            // A holder keeps the sequence's rate: forgotten only once no
            // request uses it and the rate has faded.
            if idle
                && !state.fetching
                && state.numbers.is_empty()
                && state.rate.per_second(now) < 1.0
                && Arc::strong_count(holder) == 1
            {
                unused.push(key.clone());
            }
        }
        for key in unused {
            holders.remove(&key);
        }
    }

    /// Until every lease ordered so far has arrived (or failed).
    pub async fn fetches_done(&self) {
        loop {
            let fetched = self.fetched.notified();
            tokio::pin!(fetched);
            fetched.as_mut().enable();
            if self.fetches.load(Ordering::Acquire) == 0 {
                return;
            }
            fetched.await;
        }
    }

    /// The returns waiting to be written; the reporter holds the guard.
    pub async fn pending_returns(
        &self,
    ) -> tokio::sync::MutexGuard<'_, mpsc::UnboundedReceiver<Returned>> {
        self.pending_returns.lock().await
    }

    /// The reporter wrote `how_many` returns.
    pub fn returns_written(&self, how_many: usize) {
        self.unwritten.fetch_sub(how_many, Ordering::AcqRel);
        self.written.notify_waiters();
    }

    /// Until every return given back so far is written.
    pub async fn all_returns_written(&self) {
        loop {
            let written = self.written.notified();
            tokio::pin!(written);
            written.as_mut().enable();
            if self.unwritten.load(Ordering::Acquire) == 0 {
                return;
            }
            written.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::clock::ManualClock;

    fn leases(clock: Arc<ManualClock>) -> Leases {
        Leases::new(clock, LeaseSettings::default(), Arc::new(Stats::default()))
    }

    /// Where numbers of a default sequence issued `at` come from.
    fn placement(at: DateTime<Utc>) -> Arc<Placement> {
        use crate::domain::sequence::{Definition, ProjectCode, Sequence, TypeCode};
        use crate::records::pool::{PoolKeys, PoolRef};
        let (project, doc_type) = (
            ProjectCode::parse("P").unwrap(),
            TypeCode::parse("T").unwrap(),
        );
        let definition = Definition::defaults(&project, &doc_type).unwrap();
        let period = definition.period_at(at);
        let shape = definition.shape("P", "T", &period, at).unwrap();
        let sequence = Arc::new(Sequence {
            id: 1,
            project,
            doc_type,
            definition,
            version: 1,
            identity_version: 1,
            floor: None,
            created_at: at,
            updated_at: at,
        });
        let keys = Arc::new(PoolKeys::new("test", "P", "T", period.key()));
        let pool = PoolRef {
            sequence: sequence.clone(),
            period: period.clone(),
            keys,
        };
        Arc::new(Placement {
            sequence,
            period,
            pool,
            shape,
            at,
        })
    }

    /// A request told to go on its own, then a burst that orders a lease:
    /// the lease waits until that request has its numbers, so it cannot
    /// hold numbers below the ones the request is answered with.
    #[tokio::test]
    async fn a_lease_ordered_while_a_request_is_on_its_own_is_taken_after_it() {
        let clock = Arc::new(ManualClock::new(Utc::now()));
        let leases = leases(clock.clone());
        let holder = leases.holder((1, 1, String::new()), || placement(clock.now()));
        let mut got = Vec::new();
        let (progress, order) = leases.take(&holder, 1, 1000, &mut got, true);
        assert!(order.is_none(), "one request orders no lease");
        let LeaseProgress::Alone(on_its_own) = progress else {
            panic!("a quiet sequence's request goes on its own");
        };
        // A burst: 1,000 requests within a millisecond ask for a lease.
        let mut ordered = None;
        for _ in 0..1000 {
            clock.advance(chrono::Duration::microseconds(1));
            let (_, order) = leases.take(&holder, 1, 1000, &mut Vec::new(), true);
            ordered = ordered.or(order);
        }
        let order = ordered.expect("the burst orders a lease");
        let waiting = leases.after_those_on_their_own(&order.holder);
        tokio::pin!(waiting);
        assert!(
            futures::poll!(waiting.as_mut()).is_pending(),
            "the lease was let go before the request on its own had its numbers"
        );
        drop(on_its_own);
        assert!(futures::poll!(waiting.as_mut()).is_ready());
        let until = Instant::now() + Duration::from_secs(5);
        leases.arrived(
            &order.holder,
            Some((1..=order.size as i64).collect()),
            until,
        );
    }
}
