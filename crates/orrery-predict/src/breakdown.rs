//! Where the time goes: the step of one participant split into compute, exposed
//! communication by kind, pipeline bubble and optimizer.
//!
//! The split is a sweep over the participant's timeline. At each instant the compute
//! stream is either busy (that time is compute, or optimizer for optimizer ops) or idle. Idle
//! time during which a communication op runs is *exposed* communication, charged to the
//! first busy stream in the order TP, CP, EP, PP, DP (the order in which they block the
//! critical path most directly); idle time with nothing running is pipeline bubble (waiting
//! for a neighbour stage). The parts add up to the step time exactly.

use crate::replay::ParticipantTimeline;
use orrery_graph::{ExecGraph, OpKind, Phase, Stream};
use orrery_units::Picos;
use serde::Serialize;

/// The step time of one participant, split by cause. Parts add up to `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Breakdown {
    pub total: Picos,
    pub compute_forward: Picos,
    pub compute_backward: Picos,
    pub compute_recompute: Picos,
    pub optimizer: Picos,
    pub exposed_tp: Picos,
    pub exposed_cp: Picos,
    pub exposed_ep: Picos,
    pub exposed_pp: Picos,
    pub exposed_dp: Picos,
    pub bubble: Picos,
}

impl Breakdown {
    pub fn compute(&self) -> Picos {
        self.compute_forward + self.compute_backward + self.compute_recompute
    }

    /// Sum of all parts (equals `total` by construction).
    pub fn sum(&self) -> Picos {
        self.compute()
            + self.optimizer
            + self.exposed_tp
            + self.exposed_cp
            + self.exposed_ep
            + self.exposed_pp
            + self.exposed_dp
            + self.bubble
    }
}

const COMM_ORDER: [Stream; 5] = [
    Stream::TpComm,
    Stream::CpComm,
    Stream::EpComm,
    Stream::PpComm,
    Stream::DpComm,
];

/// Splits one participant's step (from 0 to `step_end`) by cause.
pub fn breakdown(graph: &ExecGraph, timing: &ParticipantTimeline, step_end: Picos) -> Breakdown {
    // Boundaries: +1/-1 per stream busy interval, compute intervals tagged with phase.
    #[derive(Clone, Copy)]
    enum What {
        Compute(Phase),
        Comm(usize),
    }
    let mut edges: Vec<(Picos, i8, What)> = Vec::new();
    for (i, op) in graph.ops().iter().enumerate() {
        let t = timing.ops[i];
        if t.end <= t.start {
            continue;
        }
        let what = match (op.kind, op.stream) {
            (OpKind::Compute { .. }, _) => What::Compute(op.phase),
            (OpKind::Collective { .. } | OpKind::Send { .. }, s) => {
                match COMM_ORDER.iter().position(|&c| c == s) {
                    Some(k) => What::Comm(k),
                    None => continue,
                }
            }
            _ => continue,
        };
        edges.push((t.start, 1, what));
        edges.push((t.end, -1, what));
    }
    // Ends before starts at the same instant, so touching intervals do not overlap.
    edges.sort_by_key(|e| (e.0, e.1));
    let mut b = Breakdown {
        total: step_end,
        ..Breakdown::default()
    };
    let mut comm_active = [0i32; 5];
    let mut compute_phase: Option<Phase> = None;
    let mut compute_depth = 0i32;
    let mut last = Picos::ZERO;
    for (t, delta, what) in edges {
        if t > last {
            let d = t - last;
            b.charge(d, compute_depth > 0, compute_phase, &comm_active);
            last = t;
        }
        match what {
            What::Compute(ph) => {
                compute_depth += i32::from(delta);
                compute_phase = if compute_depth > 0 { Some(ph) } else { None };
            }
            What::Comm(k) => comm_active[k] += i32::from(delta),
        }
    }
    if step_end > last {
        b.charge(step_end - last, false, None, &[0; 5]);
    }
    b
}

impl Breakdown {
    fn charge(&mut self, d: Picos, computing: bool, phase: Option<Phase>, comm: &[i32; 5]) {
        if computing {
            match phase {
                Some(Phase::Forward) => self.compute_forward += d,
                Some(Phase::Backward) => self.compute_backward += d,
                Some(Phase::Recompute) => self.compute_recompute += d,
                Some(Phase::Optimizer) | None => self.optimizer += d,
            }
            return;
        }
        match comm.iter().position(|&c| c > 0) {
            Some(0) => self.exposed_tp += d,
            Some(1) => self.exposed_cp += d,
            Some(2) => self.exposed_ep += d,
            Some(3) => self.exposed_pp += d,
            Some(_) => self.exposed_dp += d,
            None => self.bubble += d,
        }
    }
}
