//! [`HeapQueue`]: a binary heap of small keys over a payload arena, with lazy deletion.

use crate::arena::{Arena, QKey};
use crate::{EventKey, EventQueue};
use orrery_units::Picos;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Below this many stale keys the heap is never compacted: rebuilding a tiny heap costs more
/// than skipping its few stale keys.
const COMPACT_SLACK: usize = 64;

/// The reference event queue: a binary min-heap of `(time, seq, slot)` keys, payloads in an
/// arena.
///
/// * `schedule` and `pop` are O(log n); `cancel` is O(1): it frees the payload's slot and the
///   heap key, now stale, is skipped when it reaches the top (lazy deletion).
/// * When stale keys outnumber pending events (plus a small slack) the heap is rebuilt without
///   them, so a timer rescheduled a million times before it fires does not leave a million
///   keys behind; the rebuild is O(n) and amortises to O(1) per cancel.
/// * Equal-time events pop in the order they were scheduled (a [`reschedule`] counts as a new
///   scheduling).
///
/// Scheduling before [`now`] (the time of the last popped event) is a logic error in the
/// caller: it would make time run backwards. The queue does not panic; it clamps such an event
/// to `now()`, so it pops next among the events at `now()` in scheduling order, and counts it
/// in [`clamped_schedules`] so a simulator can assert that it stayed at zero.
///
/// [`reschedule`]: HeapQueue::reschedule
/// [`now`]: HeapQueue::now
/// [`clamped_schedules`]: HeapQueue::clamped_schedules
#[derive(Debug, Clone)]
pub struct HeapQueue<E> {
    heap: BinaryHeap<Reverse<QKey>>,
    arena: Arena<E>,
    next_seq: u64,
    now: Picos,
    clamped: u64,
}

impl<E> Default for HeapQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> HeapQueue<E> {
    /// An empty queue at time zero.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty queue at time zero with room for `n` pending events before reallocating.
    pub fn with_capacity(n: usize) -> Self {
        HeapQueue {
            heap: BinaryHeap::with_capacity(n),
            arena: Arena::with_capacity(n),
            next_seq: 0,
            now: Picos::ZERO,
            clamped: 0,
        }
    }

    /// Reserves room for `additional` more pending events.
    pub fn reserve(&mut self, additional: usize) {
        self.heap.reserve(additional);
        self.arena.reserve(additional);
    }

    /// The time of the last popped event (zero before the first pop). Simulated time never
    /// goes backwards: every later pop returns a time `>= now()`.
    pub fn now(&self) -> Picos {
        self.now
    }

    /// How many times `schedule` or `reschedule` was asked for a time before `now()` and
    /// clamped it. Zero in a correct simulator.
    pub fn clamped_schedules(&self) -> u64 {
        self.clamped
    }

    /// Whether `key` names a pending event.
    pub fn contains(&self, key: EventKey) -> bool {
        self.arena.contains(key)
    }

    /// Moves a pending event to time `at` (clamped to `now()`), keeping its payload where it
    /// is. It counts as newly scheduled: among events at `at` it pops after those already
    /// scheduled. `key` goes stale; the returned key names the event from now on. Returns
    /// `None`, changing nothing, if `key` is stale.
    ///
    /// This is the timer primitive: a retransmission or pacing timer pushed back on every
    /// acknowledgement costs one O(log n) heap push and no payload move.
    pub fn reschedule(&mut self, key: EventKey, at: Picos) -> Option<EventKey> {
        let seq = self.next_seq;
        let new_key = self.arena.renew(key, seq)?;
        self.next_seq += 1;
        let time = self.clamp(at);
        self.heap.push(Reverse(QKey {
            time,
            seq,
            slot: key.slot,
        }));
        self.maybe_compact();
        Some(new_key)
    }

    fn clamp(&mut self, at: Picos) -> Picos {
        if at < self.now {
            self.clamped += 1;
            self.now
        } else {
            at
        }
    }

    /// Drops stale keys from the top so that the top, if any, is live.
    fn settle(&mut self) {
        while let Some(Reverse(top)) = self.heap.peek() {
            if self.arena.is_current(top) {
                return;
            }
            self.heap.pop();
        }
    }

    fn maybe_compact(&mut self) {
        let live = self.arena.live();
        let stale = self.heap.len() - live;
        if stale > live + COMPACT_SLACK {
            let arena = &self.arena;
            self.heap.retain(|Reverse(k)| arena.is_current(k));
        }
    }

    /// Number of keys in the heap, stale ones included (for tests of compaction).
    #[cfg(test)]
    pub(crate) fn raw_len(&self) -> usize {
        self.heap.len()
    }
}

impl<E> EventQueue<E> for HeapQueue<E> {
    fn schedule(&mut self, at: Picos, event: E) -> EventKey {
        let time = self.clamp(at);
        let seq = self.next_seq;
        self.next_seq += 1;
        let key = self.arena.insert(seq, event);
        self.heap.push(Reverse(QKey {
            time,
            seq,
            slot: key.slot,
        }));
        key
    }

    fn cancel(&mut self, key: EventKey) -> bool {
        if self.arena.remove(key).is_none() {
            return false;
        }
        self.maybe_compact();
        true
    }

    fn pop(&mut self) -> Option<(Picos, E)> {
        while let Some(Reverse(k)) = self.heap.pop() {
            if self.arena.is_current(&k) {
                self.now = k.time;
                return Some((k.time, self.arena.take_current(&k)));
            }
        }
        None
    }

    fn peek_time(&mut self) -> Option<Picos> {
        self.settle();
        self.heap.peek().map(|Reverse(k)| k.time)
    }

    fn len(&self) -> usize {
        self.arena.live()
    }
}
