//! Event-queue speed under the classic hold model: with n events pending, pop the earliest
//! and schedule one at `now + increment`, increment uniform in [0, 2 µs). The queue size stays
//! n, so one iteration is one pop and one schedule at a steady state, the inner loop of a
//! discrete-event simulator.
//!
//! Run with `cargo bench -p orrery-des`.

use divan::counter::ItemsCount;
use divan::Bencher;
use orrery_des::{CalendarQueue, EventQueue, HeapQueue, Rng};
use orrery_units::Picos;

fn main() {
    divan::main();
}

/// Mean scheduling increment: 1 µs.
const MEAN_INCREMENT: u64 = 1_000_000;

/// A queue built for the hold model with `n` pending events.
trait HoldQueue: EventQueue<u64> {
    fn for_hold(n: usize) -> Self;
}

impl HoldQueue for HeapQueue<u64> {
    fn for_hold(n: usize) -> Self {
        HeapQueue::with_capacity(n)
    }
}

impl HoldQueue for CalendarQueue<u64> {
    /// One bucket per pending event over a window of twice the scheduling horizon: the
    /// pending events spread over about 2 × MEAN_INCREMENT, so about two per occupied
    /// bucket, the layout a calendar queue's resize heuristic would pick.
    fn for_hold(n: usize) -> Self {
        let buckets = n.next_power_of_two();
        let width = (4 * MEAN_INCREMENT / buckets as u64).max(1);
        CalendarQueue::with_layout(Picos(width), buckets)
    }
}

fn increment(rng: &mut Rng) -> Picos {
    Picos(rng.gen_range(0, 2 * MEAN_INCREMENT))
}

/// One hold operation: pop the earliest event and schedule it again `increment` later.
#[inline]
fn hold_once<Q: EventQueue<u64>>(q: &mut Q, rng: &mut Rng, increment: impl Fn(&mut Rng) -> Picos) {
    let (t, e) = q.pop().expect("the hold model never empties the queue");
    q.schedule(t + increment(rng), e);
}

/// Fills `q` with `n` events `increment` apart on average, warms it up into the
/// steady-state distribution of pending times, and times one hold operation.
fn bench_hold<Q: EventQueue<u64>>(
    bencher: Bencher,
    mut q: Q,
    n: usize,
    seed: u64,
    increment: impl Fn(&mut Rng) -> Picos + Copy,
) {
    let mut rng = Rng::seed_from_u64(seed);
    for i in 0..n as u64 {
        q.schedule(increment(&mut rng), i);
    }
    for _ in 0..n {
        hold_once(&mut q, &mut rng, increment);
    }
    bencher
        .counter(ItemsCount::new(1usize))
        .bench_local(move || hold_once(&mut q, &mut rng, increment));
}

#[divan::bench(
    types = [HeapQueue<u64>, CalendarQueue<u64>],
    args = [1_000, 100_000, 1_000_000],
)]
fn hold<Q: HoldQueue>(bencher: Bencher, n: usize) {
    bench_hold(bencher, Q::for_hold(n), n, 0x0de5, increment);
}

/// The hold model as an accelerated packet run sees it: few events pending (the packets of
/// a handful of flows between fast-forward jumps), tens of nanoseconds apart, in the
/// default layout of 1 ns buckets, so most buckets between two events are empty.
#[divan::bench(args = [4, 16, 64])]
fn sparse_hold(bencher: Bencher, n: usize) {
    let mean = 40_000 * n as u64;
    let step = move |rng: &mut Rng| Picos(rng.gen_range(0, 2 * mean));
    bench_hold(bencher, CalendarQueue::new(), n, 0x5a45, step);
}
