//! Both queues against a reference model: for random interleavings of schedule, cancel,
//! reschedule, pop and peek, every queue must return exactly what a sorted list of
//! (time, seq, payload) returns.
#![allow(clippy::unwrap_used)]

use orrery_des::{CalendarQueue, EventKey, EventQueue, HeapQueue};
use orrery_units::Picos;
use proptest::prelude::*;
use std::collections::HashSet;

/// The slow, obviously right queue: a list scanned for its minimum.
#[derive(Debug, Default)]
struct Model {
    /// (time, seq, payload) of pending events.
    pending: Vec<(u64, u64, u32)>,
    now: u64,
    next_seq: u64,
}

impl Model {
    fn schedule(&mut self, at: u64, payload: u32) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push((at.max(self.now), seq, payload));
        seq
    }
    fn remove(&mut self, seq: u64) -> Option<u32> {
        let i = self.pending.iter().position(|e| e.1 == seq)?;
        Some(self.pending.swap_remove(i).2)
    }
    fn min_index(&self) -> Option<usize> {
        (0..self.pending.len()).min_by_key(|&i| (self.pending[i].0, self.pending[i].1))
    }
    fn pop(&mut self) -> Option<(u64, u32)> {
        let e = self.pending.swap_remove(self.min_index()?);
        self.now = e.0;
        Some((e.0, e.2))
    }
    fn peek_time(&self) -> Option<u64> {
        self.min_index().map(|i| self.pending[i].0)
    }
}

/// The queue operations under test, including the inherent ones both queues share.
trait Queue: EventQueue<u32> {
    fn now_(&self) -> Picos;
    fn reschedule_(&mut self, key: EventKey, at: Picos) -> Option<EventKey>;
}
impl Queue for HeapQueue<u32> {
    fn now_(&self) -> Picos {
        self.now()
    }
    fn reschedule_(&mut self, key: EventKey, at: Picos) -> Option<EventKey> {
        self.reschedule(key, at)
    }
}
impl Queue for CalendarQueue<u32> {
    fn now_(&self) -> Picos {
        self.now()
    }
    fn reschedule_(&mut self, key: EventKey, at: Picos) -> Option<EventKey> {
        self.reschedule(key, at)
    }
}

fn queues() -> Vec<(&'static str, Box<dyn Queue>)> {
    vec![
        ("heap", Box::new(HeapQueue::new())),
        ("heap-cap", Box::new(HeapQueue::with_capacity(16))),
        ("calendar-default", Box::new(CalendarQueue::new())),
        (
            "calendar-1x1",
            Box::new(CalendarQueue::with_layout(Picos(1), 1)),
        ),
        (
            "calendar-4x7",
            Box::new(CalendarQueue::with_layout(Picos(7), 4)),
        ),
        (
            "calendar-64x100",
            Box::new(CalendarQueue::with_layout(Picos(100), 64)),
        ),
        // Several words of the occupancy bitmap, and a window the `After` times wrap.
        (
            "calendar-256x3",
            Box::new(CalendarQueue::with_layout(Picos(3), 256)),
        ),
    ]
}

#[derive(Debug, Clone)]
enum When {
    /// `now + d`.
    After(u64),
    /// An absolute time, possibly before `now` (clamped) or near the end of time.
    At(u64),
}

impl When {
    fn resolve(&self, now: u64) -> u64 {
        match *self {
            When::After(d) => now.saturating_add(d),
            When::At(t) => t,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Schedule(When),
    /// Cancel the handle at this index (modulo the handles issued so far).
    Cancel(usize),
    Reschedule(usize, When),
    Pop,
    Peek,
}

fn when() -> impl Strategy<Value = When> {
    prop_oneof![
        4 => (0u64..20).prop_map(When::After),   // many ties
        4 => (0u64..3_000).prop_map(When::After),
        1 => (0u64..1_000_000_000_000).prop_map(When::After), // far future
        1 => (0u64..200).prop_map(When::At),     // often before now: clamped
        1 => (0u64..3).prop_map(|d| When::At(u64::MAX - d)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => when().prop_map(Op::Schedule),
        2 => any::<usize>().prop_map(Op::Cancel),
        2 => (any::<usize>(), when()).prop_map(|(i, w)| Op::Reschedule(i, w)),
        4 => Just(Op::Pop),
        1 => Just(Op::Peek),
    ]
}

/// Runs `ops` on the model and on `q`, asserting agreement after every step.
fn check(name: &str, q: &mut dyn Queue, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut m = Model::default();
    // handles[i] = (model seq, queue key): the i-th key handed out, live or stale.
    let mut handles: Vec<(u64, EventKey)> = Vec::new();
    let mut cancelled: HashSet<u32> = HashSet::new();
    let mut next_payload = 0u32;
    let mut last_pop = 0u64;
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Schedule(w) => {
                let at = w.resolve(m.now);
                let seq = m.schedule(at, next_payload);
                let key = q.schedule(Picos(at), next_payload);
                handles.push((seq, key));
                next_payload += 1;
            }
            Op::Cancel(i) if !handles.is_empty() => {
                let (seq, key) = handles[i % handles.len()];
                let want = m.remove(seq);
                prop_assert_eq!(q.cancel(key), want.is_some(), "{} step {}", name, step);
                if let Some(p) = want {
                    cancelled.insert(p);
                }
            }
            Op::Reschedule(i, w) if !handles.is_empty() => {
                let (seq, key) = handles[i % handles.len()];
                let at = w.resolve(m.now);
                let got = q.reschedule_(key, Picos(at));
                match m.remove(seq) {
                    Some(payload) => {
                        let new_seq = m.schedule(at, payload);
                        prop_assert!(got.is_some(), "{} step {}", name, step);
                        handles.push((new_seq, got.unwrap()));
                    }
                    None => prop_assert!(got.is_none(), "{} step {}", name, step),
                }
            }
            Op::Cancel(_) | Op::Reschedule(..) => {}
            Op::Pop => {
                let want = m.pop();
                let got = q.pop().map(|(t, e)| (t.0, e));
                prop_assert_eq!(got, want, "{} step {}", name, step);
                if let Some((t, e)) = got {
                    prop_assert!(t >= last_pop, "{} step {}: time went backwards", name, step);
                    prop_assert!(
                        !cancelled.contains(&e),
                        "{} step {}: popped cancelled",
                        name,
                        step
                    );
                    prop_assert_eq!(q.now_(), Picos(t));
                    last_pop = t;
                }
            }
            Op::Peek => {
                prop_assert_eq!(
                    q.peek_time().map(|t| t.0),
                    m.peek_time(),
                    "{} step {}",
                    name,
                    step
                );
            }
        }
        prop_assert_eq!(q.len(), m.pending.len(), "{} step {}", name, step);
        prop_assert_eq!(q.is_empty(), m.pending.is_empty());
    }
    // Drain: the rest must come out in the model's order too.
    loop {
        let want = m.pop();
        let got = q.pop().map(|(t, e)| (t.0, e));
        prop_assert_eq!(got, want, "{} drain", name);
        if want.is_none() {
            break;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn every_queue_matches_the_model(ops in prop::collection::vec(op(), 0..400)) {
        for (name, mut q) in queues() {
            check(name, q.as_mut(), &ops)?;
        }
    }

    /// Long runs in the steady state (the hold model with cancellations), where calendar
    /// windows slide many times and compaction kicks in.
    #[test]
    fn hold_model_with_cancellations_agrees(
        seed in any::<u64>(),
        pending in 1usize..300,
        steps in 0usize..3_000,
    ) {
        let mut rng = orrery_des::Rng::seed_from_u64(seed);
        let mut ops: Vec<Op> = (0..pending).map(|_| Op::Schedule(When::After(rng.gen_range(0, 5_000)))).collect();
        for _ in 0..steps {
            ops.push(match rng.gen_range(0, 10) {
                0..=4 => Op::Pop,
                5 | 6 => Op::Schedule(When::After(rng.gen_range(0, 5_000))),
                7 => Op::Cancel(rng.next_u64() as usize),
                _ => Op::Reschedule(rng.next_u64() as usize, When::After(rng.gen_range(0, 5_000))),
            });
        }
        for (name, mut q) in queues() {
            check(name, q.as_mut(), &ops)?;
        }
    }
}

#[test]
fn both_queues_pop_identical_sequences_under_the_hold_model() {
    // A deterministic long run: one heap and one calendar, 10,000 pending, 200,000 holds.
    let mut rng = orrery_des::Rng::seed_from_u64(2024);
    let mut heap = HeapQueue::new();
    let mut cal = CalendarQueue::with_layout(Picos(20), 1024);
    for i in 0..10_000u32 {
        let t = Picos(rng.gen_range(0, 10_000));
        heap.schedule(t, i);
        cal.schedule(t, i);
    }
    for i in 10_000..210_000u32 {
        let a = heap.pop().unwrap();
        let b = cal.pop().unwrap();
        assert_eq!(a, b);
        let t = a.0 + Picos(rng.gen_range(0, 10_000));
        heap.schedule(t, i);
        cal.schedule(t, i);
    }
    assert_eq!(heap.len(), cal.len());
}
