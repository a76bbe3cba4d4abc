//! # orrery-des: the discrete-event core
//!
//! (The module essay is to be written with the implementation.)

use orrery_units::Picos;

/// A handle to a scheduled event, used to cancel it. Stale handles (of events that already
/// fired or were cancelled) are detected and ignored.
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
