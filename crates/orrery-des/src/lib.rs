//! # orrery-des: the discrete-event core
//!
//! Everything in orrery that advances simulated time — the packet-level network simulator,
//! the replay engine — is a loop of "take the earliest pending event, handle it, schedule the
//! events it causes". This crate is that loop's two domain-free parts: an event queue and a
//! random number generator. It knows times, sequence numbers and opaque payloads; what an
//! event *means* (a packet leaving a port, a kernel finishing) belongs to the caller's `E`.
//!
//! ## Key types
//!
//! - [`EventQueue`]: the queue contract. Events are ordered by (time, sequence number of
//!   scheduling): equal-time events pop in the order they were scheduled, so a run does not
//!   depend on how a heap breaks ties. [`EventQueue::cancel`] is O(1) and a stale
//!   [`EventKey`] (of an event already popped or cancelled, even after its slot was reused)
//!   is rejected, not misapplied to whatever now lives in the slot.
//! - [`HeapQueue`]: the reference implementation, a binary heap of small `(time, seq, slot)`
//!   keys over an arena of payloads, with lazy deletion. Use this unless a benchmark says
//!   otherwise. Its [`HeapQueue::reschedule`] moves a pending event without moving its payload:
//!   the primitive behind timers that are pushed back over and over.
//! - [`CalendarQueue`]: a bucketed calendar queue with the same contract and the same order,
//!   O(1) per hold operation when its bucket width fits the event density. It exists to be
//!   measured against the heap (`cargo bench -p orrery-des`) and is tested against the same
//!   reference model.
//! - [`Rng`]: xoshiro256** seeded through SplitMix64, with [`Rng::fork`] to give every
//!   component its own independent stream.
//!
//! ## Why it is built this way
//!
//! - **Determinism.** The same input and seed must give byte-identical output. Events are
//!   ordered by integer time and then by a sequence number the queue assigns, never by a float
//!   or by memory layout, and the RNG's sequence is fixed by code in this crate, not by the
//!   version of a dependency.
//! - **Integer time.** Times are [`Picos`]; floats never order events.
//! - **Cheap cancellation.** Network timers (retransmission, pacing, PFC pause expiry) are
//!   scheduled and cancelled far more often than they fire. Cancelling frees the payload slot
//!   at once; the key left in the priority structure is skipped when it surfaces, and the
//!   structure is compacted when such stale keys outnumber live events, so memory stays
//!   proportional to the pending events.
//! - **Time never runs backwards.** Each queue remembers `now()`, the time of the last popped
//!   event. Scheduling before it is a bug in the caller; the queue clamps the event to `now()`
//!   and counts it (`clamped_schedules()`) instead of panicking in the middle of a long run.
//!
//! ## What it deliberately does not do
//!
//! - No domain knowledge: no packets, links, GPUs or LLMs. Those live in `orrery-net` and
//!   `orrery-predict`, which depend on this crate, never the other way.
//! - No wall clock, no environment, no threads: simulated time is whatever the caller
//!   schedules, and seeds are passed in.
//! - No printing or logging: the CLI is the only crate that prints.
//! - No event loop or handler registry: callers own their loop, which keeps the payload type
//!   and the dispatch (usually one `match`) theirs and monomorphic.

mod arena;
mod calendar;
mod heap;
mod rng;

pub use calendar::CalendarQueue;
pub use heap::HeapQueue;
pub use rng::{keyed_unit, Rng};

use orrery_units::Picos;

/// A handle to a scheduled event, used to cancel it. Stale handles (of events that already
/// fired or were cancelled) are detected and ignored.
///
/// `slot` locates the payload in the queue's arena; `generation` counts how many events have
/// left that slot, so a handle to an earlier occupant does not match the current one. (The
/// generation is 32 bits: a handle kept while its slot is reused 2^32 times would match
/// again, which no simulation comes near.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventKey {
    pub slot: u32,
    pub generation: u32,
}

/// A priority queue of events ordered by (time, sequence number of scheduling).
pub trait EventQueue<E> {
    /// Schedules `event` at `at`. Events at equal times pop in scheduling order.
    fn schedule(&mut self, at: Picos, event: E) -> EventKey;
    /// Cancels a pending event in O(1); returns whether it was pending.
    fn cancel(&mut self, key: EventKey) -> bool;
    /// Removes and returns the earliest pending event.
    fn pop(&mut self) -> Option<(Picos, E)>;
    /// Time of the earliest pending event.
    fn peek_time(&mut self) -> Option<Picos>;
    /// Number of pending (not cancelled) events.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
