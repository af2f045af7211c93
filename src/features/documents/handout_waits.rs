//! Attaches waiting for a handout record, answered together: an ID
//! another instance answered from a lease is attachable once its handout
//! is written (a few milliseconds later) or its lease has expired and is
//! ended here (its instance died before writing it). One statement every
//! few milliseconds looks at every number any attach of this instance
//! waits on, however many attaches wait, and no attach holds a connection
//! or a database turn while it waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::infra::db::Db;
use crate::infra::log_limit::Repeated;
use crate::records::ledger::{self, LEASE_TTL, LeaseWait};

/// How often the waiting numbers are looked at: about a handout
/// reporter's period, so an attach of an ID just answered elsewhere waits
/// about two of them.
const LOOK_EVERY: Duration = Duration::from_millis(5);

/// How long past a lease's expiry an attach still waits for it (the
/// lease's statement may have run a moment after it was counted from).
const SLACK: Duration = Duration::from_millis(500);

/// A number one attach waits on: (sequence id, number).
type Number = (i64, i64);

struct Waiter {
    until: Instant,
    done: oneshot::Sender<()>,
}

pub struct HandoutWaits {
    db: Db,
    waiting: Mutex<HashMap<Number, Vec<Waiter>>>,
    wake: Notify,
}

impl HandoutWaits {
    /// The waits, and their one looker on `tasks` (it ends with them).
    pub fn spawn(db: Db, tasks: &TaskTracker) -> Arc<Self> {
        let waits = Arc::new(Self {
            db,
            waiting: Mutex::new(HashMap::new()),
            wake: Notify::new(),
        });
        tasks.spawn(look(Arc::downgrade(&waits)));
        waits
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<Number, Vec<Waiter>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Until none of `numbers` waits for a handout any more (or a lease
    /// recorded now would have expired): whether it may be attached is
    /// decided after, in the attach's transaction.
    pub async fn settled(&self, numbers: &[Number]) {
        if numbers.is_empty() {
            return;
        }
        let until = Instant::now() + LEASE_TTL + SLACK;
        let answers: Vec<oneshot::Receiver<()>> = {
            let mut waiting = self.waiting();
            numbers
                .iter()
                .map(|number| {
                    let (done, answer) = oneshot::channel();
                    waiting
                        .entry(*number)
                        .or_default()
                        .push(Waiter { until, done });
                    answer
                })
                .collect()
        };
        self.wake.notify_one();
        for answer in answers {
            // The looker gone (a stop): nothing more to wait for.
            let _ = answer.await;
        }
    }

    /// One look at every waiting number: those settled or past their
    /// waiters' deadline are answered; expired leases are ended first.
    async fn look_once(&self) -> Result<(), sqlx::Error> {
        let numbers: Vec<Number> = self.waiting().keys().copied().collect();
        if numbers.is_empty() {
            return Ok(());
        }
        let mut conn = self.db.acquire().await?;
        let waits = ledger::lease_waits(&mut conn, &numbers).await?;
        let expired: Vec<Number> = numbers
            .iter()
            .zip(&waits)
            .filter(|(_, w)| **w == LeaseWait::Expired)
            .map(|(n, _)| *n)
            .collect();
        if !expired.is_empty() {
            ledger::end_expired_leases(&mut conn, &expired).await?;
        }
        drop(conn);
        let now = Instant::now();
        let mut waiting = self.waiting();
        for (number, wait) in numbers.iter().zip(waits) {
            let Some(waiters) = waiting.get_mut(number) else {
                continue;
            };
            let settled = wait != LeaseWait::Pending;
            for waiter in std::mem::take(waiters) {
                if settled || now >= waiter.until {
                    let _ = waiter.done.send(());
                } else {
                    waiters.push(waiter);
                }
            }
            if waiters.is_empty() {
                waiting.remove(number);
            }
        }
        Ok(())
    }

    /// Answers the waiters whose deadline passed (the database not
    /// answering meanwhile).
    fn give_up_late(&self) {
        let now = Instant::now();
        let mut waiting = self.waiting();
        waiting.retain(|_, waiters| {
            for waiter in std::mem::take(waiters) {
                match now >= waiter.until {
                    true => {
                        let _ = waiter.done.send(());
                    }
                    false => waiters.push(waiter),
                }
            }
            !waiters.is_empty()
        });
    }
}

/// The looker: every `LOOK_EVERY` while numbers wait, asleep otherwise.
async fn look(waits: Weak<HandoutWaits>) {
    loop {
        let Some(this) = waits.upgrade() else { return };
        let idle = this.waiting().is_empty();
        if idle {
            let woken = this.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if this.waiting().is_empty() {
                // Woken by a new wait, or now and then to notice the end.
                let _ = tokio::time::timeout(Duration::from_secs(1), woken).await;
                continue;
            }
        }
        let next = Instant::now() + LOOK_EVERY;
        if let Err(e) = this.look_once().await {
            LOOKS_FAILING.warn(&e);
            this.give_up_late();
        } else {
            LOOKS_FAILING.ended();
        }
        drop(this);
        tokio::time::sleep_until(next).await;
    }
}

static LOOKS_FAILING: Repeated =
    Repeated::new("attaches waiting for handout records could not look; trying again");
