//! The payload arena both queues share.
//!
//! Payloads live here, not in the priority structure, so that the structure moves only small
//! `(time, seq, slot)` keys however large `E` is. A slot is freed on pop or cancel and its
//! generation bumped, which is what makes an [`EventKey`] stale. The slot also remembers the
//! sequence number of its current occupant, which is how a queue recognises its own stale
//! internal keys (lazy deletion): a key is live iff `slots[key.slot].seq == key.seq`.
//! Sequence numbers are never reused, so unlike generations this check cannot wrap.

use crate::EventKey;
use orrery_units::Picos;

/// Marks the end of the free list and the `seq` of a free slot. Sequence numbers count up
/// from zero and cannot reach this in any run (2^64 schedules).
const NONE_U32: u32 = u32::MAX;
const FREE_SEQ: u64 = u64::MAX;
/// `next_free` of an occupied slot whose event is *dormant*: its place in the order is
/// fixed (time and sequence number) but no priority structure holds its key yet. An
/// occupied slot is on no free list, so its `next_free` is otherwise always `NONE_U32`.
const DORMANT: u32 = u32::MAX - 1;

/// The key the priority structures order: time first, then scheduling order. `slot` only
/// locates the payload; `seq` is unique, so it never takes part in a comparison that decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct QKey {
    pub(crate) time: Picos,
    pub(crate) seq: u64,
    pub(crate) slot: u32,
}

impl QKey {
    /// The key's place in the order as one number: time in the high half, `seq` in the low.
    pub(crate) fn order(&self) -> u128 {
        (u128::from(self.time.0) << 64) | u128::from(self.seq)
    }
}

#[derive(Debug, Clone)]
struct Slot<E> {
    /// Sequence number of the occupant, or `FREE_SEQ`.
    seq: u64,
    /// Bumped each time the occupant leaves (pop, cancel, reschedule).
    generation: u32,
    /// Next free slot while this one is free.
    next_free: u32,
    payload: Option<E>,
}

#[derive(Debug, Clone)]
pub(crate) struct Arena<E> {
    slots: Vec<Slot<E>>,
    free_head: u32,
    live: usize,
}

impl<E> Arena<E> {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Arena {
            slots: Vec::with_capacity(n),
            free_head: NONE_U32,
            live: 0,
        }
    }

    /// Number of occupied slots, i.e. pending events.
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    pub(crate) fn reserve(&mut self, additional: usize) {
        self.slots.reserve(additional);
    }

    /// Stores `payload` for the event with sequence number `seq`.
    pub(crate) fn insert(&mut self, seq: u64, payload: E) -> EventKey {
        self.live += 1;
        if self.free_head != NONE_U32 {
            let slot = self.free_head;
            let s = &mut self.slots[slot as usize];
            self.free_head = s.next_free;
            s.seq = seq;
            s.next_free = NONE_U32;
            s.payload = Some(payload);
            return EventKey {
                slot,
                generation: s.generation,
            };
        }
        // Slot indices are u32 so that keys stay small; 4 billion simultaneously pending
        // events is far beyond any simulation this core serves.
        let slot = u32::try_from(self.slots.len())
            .ok()
            .filter(|&s| s != NONE_U32)
            .expect("orrery-des: more than u32::MAX - 1 pending events");
        self.slots.push(Slot {
            seq,
            generation: 0,
            next_free: NONE_U32,
            payload: Some(payload),
        });
        EventKey {
            slot,
            generation: 0,
        }
    }

    /// Whether an internal key still names the slot's occupant.
    #[inline]
    pub(crate) fn is_current(&self, k: &QKey) -> bool {
        self.slots[k.slot as usize].seq == k.seq
    }

    /// Whether a user-facing key names a pending event.
    #[inline]
    pub(crate) fn contains(&self, key: EventKey) -> bool {
        self.slots
            .get(key.slot as usize)
            .is_some_and(|s| s.generation == key.generation && s.seq != FREE_SEQ)
    }

    /// Removes the occupant of `slot` (which must be occupied) and frees the slot.
    fn free(&mut self, slot: u32) -> Option<E> {
        let s = &mut self.slots[slot as usize];
        let payload = s.payload.take();
        s.seq = FREE_SEQ;
        s.generation = s.generation.wrapping_add(1);
        s.next_free = self.free_head;
        self.free_head = slot;
        self.live -= 1;
        payload
    }

    /// The sequence number of the pending event `key` names.
    pub(crate) fn seq_of(&self, key: EventKey) -> Option<u64> {
        self.contains(key)
            .then(|| self.slots[key.slot as usize].seq)
    }

    /// Whether `key` names a pending event that is dormant.
    pub(crate) fn is_dormant(&self, key: EventKey) -> bool {
        self.contains(key) && self.slots[key.slot as usize].next_free == DORMANT
    }

    /// Marks the pending event `key` dormant or not.
    pub(crate) fn set_dormant(&mut self, key: EventKey, dormant: bool) {
        debug_assert!(self.contains(key));
        self.slots[key.slot as usize].next_free = if dormant { DORMANT } else { NONE_U32 };
    }

    /// Takes the payload named by a live internal key.
    pub(crate) fn take_current(&mut self, k: &QKey) -> E {
        debug_assert!(self.is_current(k));
        self.free(k.slot)
            .expect("an occupied arena slot holds a payload")
    }

    /// Takes the payload named by a user key, if it is pending.
    pub(crate) fn remove(&mut self, key: EventKey) -> Option<E> {
        if self.contains(key) {
            self.free(key.slot)
        } else {
            None
        }
    }

    /// Gives a pending event a new sequence number in place: the old user key and the old
    /// internal key both go stale, the payload does not move. Returns the new user key.
    pub(crate) fn renew(&mut self, key: EventKey, seq: u64) -> Option<EventKey> {
        if !self.contains(key) {
            return None;
        }
        let s = &mut self.slots[key.slot as usize];
        s.seq = seq;
        s.generation = s.generation.wrapping_add(1);
        s.next_free = NONE_U32;
        Some(EventKey {
            slot: key.slot,
            generation: s.generation,
        })
    }
}
