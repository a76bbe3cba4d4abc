//! What every flow-level and packet-level simulation returns, and the trait they share.

use crate::flows::FlowSet;
use crate::topology::NetGraph;
use orrery_units::Picos;
use serde::Serialize;

/// When one flow ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct FlowOutcome {
    /// When the flow was released (dependencies done plus its delay).
    pub start: Picos,
    /// When its last byte arrived at the destination.
    pub finish: Picos,
}

impl FlowOutcome {
    /// Flow completion time.
    pub fn fct(&self) -> Picos {
        self.finish - self.start
    }
}

/// The result of simulating a flow set on a topology.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct SimReport {
    /// Which model produced it ("flow", "packet").
    pub model: String,
    /// Per flow, in flow-set order.
    pub flows: Vec<FlowOutcome>,
    /// When the last flow finished.
    pub end: Picos,
    /// Payload bytes carried by each directed link, in link order.
    pub link_bytes: Vec<u64>,
    /// PFC pause frames sent towards each directed link's sender, in link order (packet
    /// model; zeros elsewhere).
    pub pfc_pauses: Vec<u64>,
    /// Packets dropped (packet model without PFC; zero elsewhere).
    pub drops: u64,
    /// Payload bytes handed to the network by senders and delivered to receivers.
    pub bytes_sent: u64,
    pub bytes_delivered: u64,
    /// Events the simulation processed.
    pub events: u64,
    /// What acceleration saved (packet model; zeros elsewhere).
    pub accel: AccelCounts,
}

/// What an accelerated simulation skipped, in numbers a report can show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct AccelCounts {
    /// Events not processed thanks to fast-forwarding and memoization (estimated: skipped
    /// packets times the events per packet of the simulated part).
    pub skipped_events: u64,
    /// Isolated episodes looked up in the memo cache, and found there.
    pub memo_lookups: u64,
    pub memo_hits: u64,
}

impl AccelCounts {
    /// Adds another run's counts.
    pub fn add(&mut self, other: &AccelCounts) {
        self.skipped_events += other.skipped_events;
        self.memo_lookups += other.memo_lookups;
        self.memo_hits += other.memo_hits;
    }

    /// Memo hits per lookup (zero without lookups).
    pub fn memo_hit_rate(&self) -> f64 {
        if self.memo_lookups == 0 {
            0.0
        } else {
            self.memo_hits as f64 / self.memo_lookups as f64
        }
    }
}

/// Why a simulation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Flows(#[from] crate::flows::FlowError),
    #[error(transparent)]
    Topology(#[from] crate::topology::TopologyError),
    #[error("the simulation stopped with {unfinished} flows unfinished (deadlock or event limit)")]
    Unfinished { unfinished: usize },
}

/// How far a running simulation has got, reported every few thousand events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimProgress {
    /// Simulated time reached.
    pub now: Picos,
    pub flows_done: usize,
    pub flows_total: usize,
    pub events: u64,
}

/// Events between two progress reports: rare enough that the callback costs nothing.
pub const PROGRESS_EVERY: u64 = 1 << 16;

/// A simulator of flows on a topology. Implementations are deterministic: the same graph,
/// flows and configuration (seed included) give the same report.
pub trait FlowSimulator {
    fn name(&self) -> &'static str;
    fn simulate(&self, graph: &NetGraph, flows: &FlowSet) -> Result<SimReport, SimError>;

    /// Like [`FlowSimulator::simulate`], calling `progress` every [`PROGRESS_EVERY`] events.
    /// The report is identical to `simulate`'s.
    fn simulate_with_progress(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        progress: &mut dyn FnMut(SimProgress),
    ) -> Result<SimReport, SimError> {
        let _ = progress;
        self.simulate(graph, flows)
    }
}
