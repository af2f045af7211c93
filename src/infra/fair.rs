//! Slots shared by keys, handed out fairly: when a slot frees up and
//! requests wait, it goes to the waiting key that holds the fewest slots
//! (the longest-waiting request of that key), so no key holds more than
//! its share while others wait, however many requests it queues. A key may
//! also be capped outright (`per_key`): its further requests wait for its
//! own slots only.
//!
//! A slot is a [`Turn`]; dropping it frees the slot (or hands it straight
//! to the next waiter). A waiting request that goes away leaves the queue.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Debug)]
pub struct FairSlots {
    capacity: usize,
    per_key: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Slots held, per key (keys holding none are removed).
    held: HashMap<Arc<str>, usize>,
    in_use: usize,
    /// Waiting requests per key, oldest first, and each key's place in the
    /// order keys started waiting (ties between equal holders go to the
    /// key that waited first).
    waiting: HashMap<Arc<str>, VecDeque<(u64, oneshot::Sender<Turn>)>>,
    next_ticket: u64,
}

/// One slot, held until dropped.
#[derive(Debug)]
pub struct Turn {
    slots: Arc<FairSlots>,
    key: Arc<str>,
}

impl FairSlots {
    /// `capacity` slots in all, at most `per_key` held by one key.
    pub fn new(capacity: usize, per_key: usize) -> Arc<Self> {
        Arc::new(Self {
            capacity: capacity.max(1),
            per_key: per_key.max(1),
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a slot for `key`.
    pub async fn acquire(self: &Arc<Self>, key: &str) -> Turn {
        let key: Arc<str> = Arc::from(key);
        let receiver = {
            let mut state = self.state();
            let held = state.held.get(&key).copied().unwrap_or(0);
            let nobody_waits = state.waiting.values().all(VecDeque::is_empty);
            if state.in_use < self.capacity && held < self.per_key && nobody_waits {
                state.in_use += 1;
                *state.held.entry(key.clone()).or_insert(0) += 1;
                return Turn {
                    slots: self.clone(),
                    key,
                };
            }
            let (sender, receiver) = oneshot::channel();
            let ticket = state.next_ticket;
            state.next_ticket += 1;
            state
                .waiting
                .entry(key.clone())
                .or_default()
                .push_back((ticket, sender));
            receiver
        };
        // Slots may be free while others wait at their own cap.
        self.grant_waiting();
        // Taken by a slot freed meanwhile, or the queue was left behind (a
        // released turn is then handed on by its drop).
        match receiver.await {
            Ok(turn) => turn,
            Err(_) => {
                // Dropped without an answer: only when the slots are gone.
                // Take one outright rather than wait for ever.
                let mut state = self.state();
                state.in_use += 1;
                *state.held.entry(key.clone()).or_insert(0) += 1;
                Turn {
                    slots: self.clone(),
                    key,
                }
            }
        }
    }

    /// Slots in use now.
    pub fn in_use(&self) -> usize {
        self.state().in_use
    }

    /// Slots `key` holds now.
    pub fn held_by(&self, key: &str) -> usize {
        self.state().held.get(key).copied().unwrap_or(0)
    }

    fn release(self: &Arc<Self>, key: &Arc<str>) {
        {
            let mut state = self.state();
            state.in_use -= 1;
            if let Some(held) = state.held.get_mut(key) {
                *held -= 1;
                if *held == 0 {
                    state.held.remove(key);
                }
            }
        }
        self.grant_waiting();
    }

    /// Gives free slots to waiters: each to the waiting key holding the
    /// fewest (and under its cap), its oldest request first.
    fn grant_waiting(self: &Arc<Self>) {
        loop {
            let mut state = self.state();
            if state.in_use >= self.capacity {
                return;
            }
            let chosen = state
                .waiting
                .iter()
                .filter_map(|(key, queue)| {
                    let (ticket, _) = queue.front()?;
                    let held = state.held.get(key).copied().unwrap_or(0);
                    (held < self.per_key).then_some((held, *ticket, key.clone()))
                })
                .min();
            let Some((_, _, key)) = chosen else {
                return;
            };
            let Some(queue) = state.waiting.get_mut(&key) else {
                return;
            };
            let Some((_, sender)) = queue.pop_front() else {
                return;
            };
            if queue.is_empty() {
                state.waiting.remove(&key);
            }
            if sender.is_closed() {
                // Its request went away: try the next one.
                continue;
            }
            state.in_use += 1;
            *state.held.entry(key.clone()).or_insert(0) += 1;
            drop(state);
            let turn = Turn {
                slots: self.clone(),
                key,
            };
            // If the request went away just now, the turn comes back
            // through its drop.
            let _ = sender.send(turn);
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.slots.release(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_key_holding_fewest() {
        let slots = FairSlots::new(2, 2);
        let a1 = slots.acquire("a").await;
        let a2 = slots.acquire("a").await;
        // A queues many more; then b asks once.
        let mut a_waiting = Vec::new();
        for _ in 0..5 {
            let slots = slots.clone();
            a_waiting.push(tokio::spawn(async move { slots.acquire("a").await }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let b = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("b").await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(a1);
        let b = tokio::time::timeout(Duration::from_secs(1), b)
            .await
            .expect("b got the freed slot")
            .unwrap();
        assert_eq!(slots.held_by("b"), 1);
        assert_eq!(slots.held_by("a"), 1);
        drop((a2, b));
        for waiting in a_waiting {
            drop(waiting.await.unwrap());
        }
        assert_eq!(slots.in_use(), 0);
    }

    #[tokio::test]
    async fn a_key_at_its_cap_waits_while_others_are_served() {
        let slots = FairSlots::new(4, 1);
        let a = slots.acquire("a").await;
        let second_a = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("a").await })
        };
        let b = tokio::time::timeout(Duration::from_secs(1), slots.acquire("b"))
            .await
            .expect("b is not behind a's queue");
        assert!(!second_a.is_finished());
        drop(a);
        let second_a = tokio::time::timeout(Duration::from_secs(1), second_a)
            .await
            .expect("a's own slot came back")
            .unwrap();
        drop((b, second_a));
        assert_eq!(slots.in_use(), 0);
    }

    /// Waits (1 s at most) until a request of `key` is queued.
    async fn queued(slots: &FairSlots, key: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while slots
            .state()
            .waiting
            .get(key)
            .is_none_or(VecDeque::is_empty)
        {
            assert!(std::time::Instant::now() < deadline, "{key} never waited");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn neither_the_capacity_nor_a_keys_cap_is_passed_when_nobody_waits() {
        let slots = FairSlots::new(2, 2);
        let a1 = slots.acquire("a").await;
        let a2 = slots.acquire("a").await;
        assert_eq!((slots.in_use(), slots.held_by("a")), (2, 2));
        // Every slot held, nobody waiting: a third key waits all the same.
        let b = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("b").await })
        };
        queued(&slots, "b").await;
        assert_eq!((slots.in_use(), slots.held_by("b")), (2, 0));
        drop(a1);
        let b = tokio::time::timeout(Duration::from_secs(1), b)
            .await
            .expect("b got the freed slot")
            .unwrap();
        assert_eq!((slots.in_use(), slots.held_by("b")), (2, 1));
        drop((a2, b));

        // Free slots, nobody waiting: a key at its cap waits for its own.
        let capped = FairSlots::new(4, 1);
        let a = capped.acquire("a").await;
        let second_a = {
            let slots = capped.clone();
            tokio::spawn(async move { slots.acquire("a").await })
        };
        queued(&capped, "a").await;
        assert_eq!((capped.in_use(), capped.held_by("a")), (1, 1));
        drop(a);
        let second_a = tokio::time::timeout(Duration::from_secs(1), second_a)
            .await
            .expect("a's own slot came back")
            .unwrap();
        assert_eq!((capped.in_use(), capped.held_by("a")), (1, 1));
        drop(second_a);
    }

    #[tokio::test]
    async fn between_keys_holding_as_many_the_one_that_waited_first_is_served() {
        let slots = FairSlots::new(1, 1);
        let held = slots.acquire("x").await;
        // "z" starts waiting before "b" (which a name order would prefer).
        let z = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("z").await })
        };
        queued(&slots, "z").await;
        let b = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("b").await })
        };
        queued(&slots, "b").await;
        drop(held);
        let z = tokio::time::timeout(Duration::from_secs(1), z)
            .await
            .expect("z, first to wait, was served")
            .unwrap();
        assert_eq!((slots.held_by("z"), slots.held_by("b")), (1, 0));
        drop(z);
        drop(b.await.unwrap());
    }

    #[tokio::test]
    async fn a_request_that_goes_away_leaves_no_slot_behind() {
        let slots = FairSlots::new(1, 1);
        let held = slots.acquire("a").await;
        let gone = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("b").await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        let again = tokio::time::timeout(Duration::from_secs(1), slots.acquire("c"))
            .await
            .expect("the slot is free again");
        drop(again);
        assert_eq!(slots.in_use(), 0);
    }
}
