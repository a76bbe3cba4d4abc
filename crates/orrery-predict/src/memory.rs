//! The memory ledger: each participant's allocations over time, its peak and the verdict.

use crate::replay::ParticipantTimeline;
use orrery_graph::{ExecGraph, MemoryCategory, OpKind};
use orrery_units::{Bytes, Picos};
use serde::Serialize;

/// One change of a rank's allocated memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryEvent {
    pub time: Picos,
    /// Allocated bytes right after this event.
    pub allocated: Bytes,
}

/// A participant's memory over the step.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryLedger {
    pub events: Vec<MemoryEvent>,
    pub peak: Bytes,
    pub peak_time: Picos,
    /// Bytes by category at the peak, in [`MemoryCategory::ALL`] order.
    pub at_peak: Vec<(MemoryCategory, Bytes)>,
}

/// Why a ledger is inconsistent (a bug in a graph builder or importer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("op {op} frees {bytes} B of {category:?} but only {held} B are allocated")]
    Negative {
        op: u32,
        category: MemoryCategory,
        bytes: u64,
        held: u64,
    },
}

/// Builds the ledger from a graph and its replayed timing. Events at the same time apply in
/// issue order, so an allocation and a free at one instant never double-count.
pub fn ledger(
    graph: &ExecGraph,
    timing: &ParticipantTimeline,
) -> Result<MemoryLedger, LedgerError> {
    let mut changes: Vec<(Picos, u32, MemoryCategory, i128)> = Vec::new();
    for (i, op) in graph.ops().iter().enumerate() {
        let t = timing.ops[i].end;
        match op.kind {
            OpKind::Alloc { bytes, category } => {
                changes.push((t, i as u32, category, i128::from(bytes.0)))
            }
            OpKind::Free { alloc } => {
                if let OpKind::Alloc { bytes, category } = graph.op(alloc).kind {
                    changes.push((t, i as u32, category, -i128::from(bytes.0)));
                }
            }
            _ => {}
        }
    }
    changes.sort_by_key(|c| (c.0, c.1));
    let mut by_cat = [0i128; 5];
    let mut total: i128 = 0;
    let mut peak = 0i128;
    let mut peak_time = Picos::ZERO;
    let mut at_peak = by_cat;
    let mut events = Vec::with_capacity(changes.len());
    for (t, op, cat, delta) in changes {
        let ci = MemoryCategory::ALL
            .iter()
            .position(|&c| c == cat)
            .unwrap_or(0);
        if by_cat[ci] + delta < 0 {
            return Err(LedgerError::Negative {
                op,
                category: cat,
                bytes: (-delta) as u64,
                held: by_cat[ci] as u64,
            });
        }
        by_cat[ci] += delta;
        total += delta;
        if total > peak {
            peak = total;
            peak_time = t;
            at_peak = by_cat;
        }
        events.push(MemoryEvent {
            time: t,
            allocated: Bytes(total as u64),
        });
    }
    Ok(MemoryLedger {
        events,
        peak: Bytes(peak as u64),
        peak_time,
        at_peak: MemoryCategory::ALL
            .iter()
            .zip(at_peak)
            .map(|(&c, b)| (c, Bytes(b as u64)))
            .collect(),
    })
}
