//! [`CalendarQueue`]: a bucketed (calendar) queue, the comparison point for [`HeapQueue`].
//!
//! [`HeapQueue`]: crate::HeapQueue

use crate::arena::{Arena, QKey};
use crate::{EventKey, EventQueue};
use orrery_units::Picos;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Stale keys tolerated beyond the live count (and the bucket count) before a compaction.
const COMPACT_SLACK: usize = 64;
/// Upper bound on the bucket count, so a typo cannot allocate the machine away.
const MAX_BUCKETS: usize = 1 << 24;
/// Default layout: 4096 buckets of 1 ns, a 4.096 µs window, which suits packet-level
/// simulation where most events are nanoseconds to microseconds apart.
const DEFAULT_WIDTH: Picos = Picos(1_000);
const DEFAULT_BUCKETS: usize = 4096;

/// An event queue that files events into a ring of time buckets of fixed width.
///
/// The ring covers a window of `buckets × width` picoseconds starting at the current bucket.
/// An event inside the window goes into its bucket in O(1), unsorted; only the current bucket
/// is kept sorted, and a bucket is sorted once, when it becomes current. An event beyond the
/// window waits in an overflow heap and moves into the ring as the window slides over it; when
/// the ring is empty the window jumps straight to the earliest overflow event, so a far-future
/// event costs one heap operation, not a walk over empty buckets. A bitmap marks the buckets
/// that may hold keys, so sliding to the next one reads a word per 64 buckets: with few
/// events pending and tens of buckets between them (an accelerated packet run between its
/// jumps) the slide had tested every bucket on the way (`sparse_hold` in the queue bench:
/// 67-104 ns per hold before, 43-63 ns with the bitmap).
///
/// When the width matches the event density (a few events per bucket) a hold operation is
/// O(1) amortised, against the heap's O(log n). A poor width only costs speed: the order is
/// always exactly the [`HeapQueue`]'s, time first and then scheduling order, and the two are
/// checked against the same reference model in the tests. The layout is fixed; this queue does
/// not resize itself.
///
/// Cancellation, [`reschedule`], [`now`] and clamping of times before `now()` behave exactly
/// as in [`HeapQueue`].
///
/// [`HeapQueue`]: crate::HeapQueue
/// [`reschedule`]: CalendarQueue::reschedule
/// [`now`]: CalendarQueue::now
#[derive(Debug, Clone)]
pub struct CalendarQueue<E> {
    /// `buckets[cur]` is sorted descending by (time, seq), so the next event is its last
    /// element, and holds every ringed key with time `< cur_start + width` (including keys
    /// scheduled behind `cur_start` after the window moved on during a `peek_time`).
    /// `buckets[(cur + k) & mask]` for `0 < k < buckets.len()` holds, unsorted, the keys with
    /// time in `[cur_start + k·width, cur_start + (k+1)·width)`.
    buckets: Vec<Vec<QKey>>,
    /// One bit per bucket other than the current one that may hold keys (set when a key
    /// is filed there, cleared when the bucket becomes current or is found empty), so the
    /// slide to the next bucket holding keys reads a word per 64 buckets instead of every
    /// bucket's length: between an accelerated run's jumps few flows are active and
    /// events lie tens of 1 ns buckets apart.
    occupied: Vec<u64>,
    mask: usize,
    width: u64,
    cur: usize,
    cur_start: u64,
    /// Keys in the ring, stale ones included.
    in_ring: usize,
    /// Keys with time `>= cur_start + buckets·width`.
    overflow: BinaryHeap<Reverse<QKey>>,
    arena: Arena<E>,
    next_seq: u64,
    now: Picos,
    /// Sequence number of the last popped event (`None` before the first pop).
    now_seq: Option<u64>,
    /// Pending events that are dormant (in the arena, in no bucket).
    dormant: usize,
    clamped: u64,
}

impl<E> Default for CalendarQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> CalendarQueue<E> {
    /// An empty queue at time zero with the default layout (4096 buckets of 1 ns).
    pub fn new() -> Self {
        Self::with_layout(DEFAULT_WIDTH, DEFAULT_BUCKETS)
    }

    /// An empty queue at time zero with `buckets` buckets (rounded up to a power of two,
    /// at least 1, at most 2^24) each `bucket_width` wide (at least 1 ps). Aim for a few
    /// pending events per bucket: `bucket_width ≈ 2-4 × (typical horizon / pending events)`
    /// and `buckets × bucket_width` about the typical scheduling horizon.
    pub fn with_layout(bucket_width: Picos, buckets: usize) -> Self {
        let n = buckets.clamp(1, MAX_BUCKETS).next_power_of_two();
        CalendarQueue {
            buckets: (0..n).map(|_| Vec::new()).collect(),
            occupied: vec![0; n.div_ceil(64)],
            mask: n - 1,
            width: bucket_width.0.max(1),
            cur: 0,
            cur_start: 0,
            in_ring: 0,
            overflow: BinaryHeap::new(),
            arena: Arena::with_capacity(0),
            next_seq: 0,
            now: Picos::ZERO,
            now_seq: None,
            dormant: 0,
            clamped: 0,
        }
    }

    /// The width of one bucket.
    pub fn bucket_width(&self) -> Picos {
        Picos(self.width)
    }

    /// The number of buckets in the ring.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// The time of the last popped event (zero before the first pop).
    pub fn now(&self) -> Picos {
        self.now
    }

    /// How many schedules asked for a time before `now()` and were clamped to it.
    pub fn clamped_schedules(&self) -> u64 {
        self.clamped
    }

    /// Whether `key` names a pending event.
    pub fn contains(&self, key: EventKey) -> bool {
        self.arena.contains(key)
    }

    /// Moves a pending event to `at` (clamped to `now()`); see [`HeapQueue::reschedule`].
    ///
    /// [`HeapQueue::reschedule`]: crate::HeapQueue::reschedule
    /// A dormant event becomes an ordinary one at `at`.
    pub fn reschedule(&mut self, key: EventKey, at: Picos) -> Option<EventKey> {
        let seq = self.next_seq;
        if self.arena.is_dormant(key) {
            self.dormant -= 1;
        }
        let new_key = self.arena.renew(key, seq)?;
        self.next_seq += 1;
        let time = self.clamp(at);
        self.file(QKey {
            time,
            seq,
            slot: key.slot,
        });
        self.maybe_compact();
        Some(new_key)
    }

    /// Schedules a *dormant* event: it takes its place in the order now, at `at` with the next sequence number, exactly as [`EventQueue::schedule`]
    /// would give it (`at` must not be before `now()`: it is not clamped, since the
    /// caller keeps `at` to wake it with), but it is filed nowhere and never pops until [`wake`] files it
    /// under that same place. It counts as pending for [`contains`], not for
    /// [`EventQueue::len`]. Waking it costs what scheduling it would have; never waking
    /// it (cancelling it once its time has passed) costs neither a filing nor a pop.
    ///
    /// This is for an event that will most likely turn out to do nothing when it pops (a port freeing
    /// with nothing queued) but must keep its tie-breaking place in case something comes
    /// to depend on it before its time.
    ///
    /// [`wake`]: CalendarQueue::wake
    /// [`contains`]: CalendarQueue::contains
    pub fn schedule_dormant(&mut self, at: Picos, event: E) -> EventKey {
        debug_assert!(
            at >= self.now,
            "a dormant event before now() cannot keep its place"
        );
        let seq = self.next_seq;
        self.next_seq += 1;
        let key = self.arena.insert(seq, event);
        self.arena.set_dormant(key, true);
        self.dormant += 1;
        key
    }

    /// Files the dormant event `key` at `at`, which must be the time it was scheduled
    /// for, so it pops where it would have had it been scheduled
    /// normally. Returns false (and does nothing) if `key` names no dormant event. Waking
    /// an event whose place has already passed ([`has_passed`]) is a caller's bug: it
    /// pops at once, out of order.
    ///
    /// [`has_passed`]: CalendarQueue::has_passed
    pub fn wake(&mut self, key: EventKey, at: Picos) -> bool {
        if !self.arena.is_dormant(key) {
            return false;
        }
        debug_assert!(
            !self.has_passed(key, at),
            "waking an event whose place has passed"
        );
        let Some(seq) = self.arena.seq_of(key) else {
            return false;
        };
        self.arena.set_dormant(key, false);
        self.dormant -= 1;
        self.file(QKey {
            time: at,
            seq,
            slot: key.slot,
        });
        true
    }

    /// Whether the pending event `key`, at time `at`, comes before the last popped event
    /// in the (time, sequence) order: had it been filed, it would have popped already.
    /// False for a key that names no pending event.
    pub fn has_passed(&self, key: EventKey, at: Picos) -> bool {
        let (Some(seq), Some(now_seq)) = (self.arena.seq_of(key), self.now_seq) else {
            return false;
        };
        (at, seq) < (self.now, now_seq)
    }

    fn clamp(&mut self, at: Picos) -> Picos {
        if at < self.now {
            self.clamped += 1;
            self.now
        } else {
            at
        }
    }

    /// One past the last time the ring covers. u128 because the window may extend past
    /// `u64::MAX` near the end of time.
    fn window_end(&self) -> u128 {
        u128::from(self.cur_start) + self.buckets.len() as u128 * u128::from(self.width)
    }

    /// Puts a key where it belongs: current bucket (sorted), a later bucket, or overflow.
    fn file(&mut self, k: QKey) {
        let t = k.time.0;
        if u128::from(t) >= self.window_end() {
            self.overflow.push(Reverse(k));
            return;
        }
        self.in_ring += 1;
        let offset = t.saturating_sub(self.cur_start) / self.width;
        if offset == 0 {
            let bucket = &mut self.buckets[self.cur];
            // Descending order: the new key goes after every key that pops later. It is the
            // newest, so among equal times it pops last.
            let pos = bucket.partition_point(|e| *e > k);
            bucket.insert(pos, k);
        } else {
            // offset < bucket count by the window test, so it fits in usize.
            let idx = (self.cur + offset as usize) & self.mask;
            self.buckets[idx].push(k);
            self.mark(idx);
        }
    }

    /// Marks bucket `idx` as one that may hold keys.
    fn mark(&mut self, idx: usize) {
        self.occupied[idx / 64] |= 1 << (idx % 64);
    }

    /// Clears bucket `idx`'s mark: it has become current, or it is empty.
    fn unmark(&mut self, idx: usize) {
        self.occupied[idx / 64] &= !(1 << (idx % 64));
    }

    /// The distance from the current bucket to the next one marked occupied, going round
    /// the ring (a marked bucket may have been emptied by a compaction since). `None` if
    /// none is marked.
    fn next_marked(&self) -> Option<usize> {
        let n = self.buckets.len();
        let words = self.occupied.len();
        let first = (self.cur + 1) & self.mask;
        let (w0, b0) = (first / 64, first % 64);
        // The first word from `first` on, then the others round the ring, then the first
        // word's bits before `first`.
        let head = self.occupied[w0] & (u64::MAX << b0);
        if head != 0 {
            let idx = w0 * 64 + head.trailing_zeros() as usize;
            return Some((idx + n - self.cur) & self.mask);
        }
        for k in 1..=words {
            let w = (w0 + k) % words;
            let bits = if k == words {
                self.occupied[w] & !(u64::MAX << b0)
            } else {
                self.occupied[w]
            };
            if bits != 0 {
                let idx = w * 64 + bits.trailing_zeros() as usize;
                return Some((idx + n - self.cur) & self.mask);
            }
        }
        None
    }

    /// Makes the current bucket non-empty if any key remains anywhere: slides the window to
    /// the next bucket holding keys, or jumps it to the earliest overflow key when the ring
    /// is empty. Returns false when the queue holds no keys at all.
    fn advance(&mut self) -> bool {
        debug_assert!(self.buckets[self.cur].is_empty());
        if self.in_ring == 0 {
            // Jump. The earliest overflow key bounds every remaining time from below, stale or
            // not, so it is a valid start for the window.
            let Some(Reverse(top)) = self.overflow.peek() else {
                return false;
            };
            self.cur_start = top.time.0;
            // Every bucket is empty: marks left by compactions go.
            self.occupied.fill(0);
        } else {
            // Slide to the next bucket holding keys (there is one: the ring holds keys and
            // the current bucket none), without filtering or sorting the empty ones on the
            // way: after the packet model's fast-forward jumps the ring is sparse, and
            // that cost more than the events. The old current
            // bucket and the empty ones after it become the last buckets of the window;
            // overflow keys that now fall in the window move in below, behind the new
            // current bucket, since every overflow key is later than the whole old window.
            // Every filing into a bucket other than the current one marks it, so the next
            // marked bucket that is not empty is the one (should none be marked, the walk
            // over the buckets finds it).
            let d = loop {
                let Some(d) = self.next_marked() else {
                    debug_assert!(false, "keys in the ring but no bucket marked");
                    let mut d = 1;
                    while self.buckets[(self.cur + d) & self.mask].is_empty() {
                        d += 1;
                    }
                    break d;
                };
                let idx = (self.cur + d) & self.mask;
                if !self.buckets[idx].is_empty() {
                    break d;
                }
                self.unmark(idx);
            };
            self.cur = (self.cur + d) & self.mask;
            self.cur_start += d as u64 * self.width;
            self.unmark(self.cur);
        }
        let end = self.window_end();
        while let Some(Reverse(k)) = self.overflow.peek() {
            if u128::from(k.time.0) >= end {
                break;
            }
            let k = *k;
            self.overflow.pop();
            if self.arena.is_current(&k) {
                let offset = (k.time.0 - self.cur_start) / self.width;
                let idx = (self.cur + offset as usize) & self.mask;
                self.buckets[idx].push(k);
                if idx != self.cur {
                    self.mark(idx);
                }
                self.in_ring += 1;
            }
        }
        let arena = &self.arena;
        let bucket = &mut self.buckets[self.cur];
        // A bucket of one key is sorted already, and if that key is stale `pop` and
        // `peek_time` drop it as they do any stale key; sparse runs (an accelerated step)
        // come here mostly for one key, where filtering and sorting cost more than the pop.
        if bucket.len() > 1 {
            let before = bucket.len();
            bucket.retain(|k| arena.is_current(k));
            self.in_ring -= before - bucket.len();
            // Sorted on (time, seq) packed into one u128, which orders exactly as `QKey`
            // does (`seq` is unique, so `slot` never decides) and compares without
            // branching on equal times, which synchronised traffic makes common.
            bucket.sort_unstable_by_key(|k| Reverse(k.order()));
        }
        true
    }

    fn maybe_compact(&mut self) {
        let live = self.arena.live() - self.dormant;
        let stale = self.in_ring + self.overflow.len() - live;
        if stale > live + self.buckets.len() + COMPACT_SLACK {
            let arena = &self.arena;
            let mut in_ring = 0;
            for b in &mut self.buckets {
                // retain keeps order, so the current bucket stays sorted.
                b.retain(|k| arena.is_current(k));
                in_ring += b.len();
            }
            self.in_ring = in_ring;
            self.overflow.retain(|Reverse(k)| arena.is_current(k));
        }
    }

    /// Keys held, stale ones included (for tests of compaction).
    #[cfg(test)]
    pub(crate) fn raw_len(&self) -> usize {
        self.in_ring + self.overflow.len()
    }
}

impl<E> EventQueue<E> for CalendarQueue<E> {
    fn schedule(&mut self, at: Picos, event: E) -> EventKey {
        let time = self.clamp(at);
        let seq = self.next_seq;
        self.next_seq += 1;
        let key = self.arena.insert(seq, event);
        self.file(QKey {
            time,
            seq,
            slot: key.slot,
        });
        key
    }

    fn cancel(&mut self, key: EventKey) -> bool {
        let dormant = self.arena.is_dormant(key);
        if self.arena.remove(key).is_none() {
            return false;
        }
        if dormant {
            // It was in no bucket, so it leaves no stale key to compact.
            self.dormant -= 1;
            return true;
        }
        self.maybe_compact();
        true
    }

    fn pop(&mut self) -> Option<(Picos, E)> {
        loop {
            if let Some(k) = self.buckets[self.cur].pop() {
                self.in_ring -= 1;
                if self.arena.is_current(&k) {
                    self.now = k.time;
                    self.now_seq = Some(k.seq);
                    return Some((k.time, self.arena.take_current(&k)));
                }
                continue;
            }
            if !self.advance() {
                return None;
            }
        }
    }

    fn peek_time(&mut self) -> Option<Picos> {
        loop {
            if let Some(k) = self.buckets[self.cur].last() {
                if self.arena.is_current(k) {
                    return Some(k.time);
                }
                self.buckets[self.cur].pop();
                self.in_ring -= 1;
                continue;
            }
            if !self.advance() {
                return None;
            }
        }
    }

    fn len(&self) -> usize {
        self.arena.live() - self.dormant
    }
}
