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

/// One collective's span in a run: its first flow's release to its last flow's finish,
/// with how many flows and bytes it had. A collective with no flows has none
/// (`flows == 0`, `start` at `Picos(u64::MAX)`, `finish` at zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollectiveSpan {
    pub start: Picos,
    pub finish: Picos,
    pub flows: usize,
    pub bytes: u64,
}

/// Each collective of `flows`' span in the run that gave `outcomes`, by collective index, in
/// one pass over the flows.
pub fn collective_spans(flows: &FlowSet, outcomes: &[FlowOutcome]) -> Vec<CollectiveSpan> {
    let mut spans = vec![
        CollectiveSpan {
            start: Picos(u64::MAX),
            finish: Picos::ZERO,
            flows: 0,
            bytes: 0,
        };
        flows.collectives.len()
    ];
    for (f, o) in flows.flows.iter().zip(outcomes) {
        if let Some(c) = spans.get_mut(f.collective as usize) {
            c.start = c.start.min(o.start);
            c.finish = c.finish.max(o.finish);
            c.flows += 1;
            c.bytes += f.bytes.0;
        }
    }
    spans
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

/// When the last of `flows` finished (zero for none): a report's `end`.
pub fn last_finish(flows: &[FlowOutcome]) -> Picos {
    flows.iter().map(|o| o.finish).max().unwrap_or(Picos::ZERO)
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

/// How far one report is from a reference report of the same flows: the error measures the
/// accelerated packet model is held to (mean and p99 of the per-flow completion-time errors,
/// the run's end, the worst collective's finish and completion time). All relative, as
/// fractions.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct RunErrors {
    pub mean_fct: f64,
    pub p99_fct: f64,
    pub end: f64,
    /// Worst relative error of a collective's finish (zero without collectives).
    pub collective: f64,
    /// Worst relative error of a collective's completion time: from its first flow's
    /// release to its last flow's finish, in each run (zero without collectives). A
    /// finish is measured from time zero, so a late collective's error is diluted by all
    /// that came before; a completion time is not, and a collective released late because
    /// an earlier one finished late is not charged for that.
    pub collective_time: f64,
}

impl RunErrors {
    /// Errors of `report` against `reference`, both runs of `flows`.
    pub fn between(reference: &SimReport, report: &SimReport, flows: &FlowSet) -> RunErrors {
        let rel = |a: Picos, b: Picos| {
            (a.as_secs_f64() - b.as_secs_f64()).abs() / b.as_secs_f64().max(1e-15)
        };
        let mut per: Vec<f64> = reference
            .flows
            .iter()
            .zip(&report.flows)
            .map(|(r, o)| rel(o.fct(), r.fct()))
            .collect();
        let mean_fct = per.iter().sum::<f64>() / per.len().max(1) as f64;
        per.sort_by(f64::total_cmp);
        let p99_fct = per
            .get(((per.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0);
        let (of_ref, of_run) = (
            collective_spans(flows, &reference.flows),
            collective_spans(flows, &report.flows),
        );
        let collective = of_ref
            .iter()
            .zip(&of_run)
            .map(|(r, o)| rel(o.finish, r.finish))
            .fold(0.0, f64::max);
        let span = |c: &CollectiveSpan| Picos(c.finish.0.saturating_sub(c.start.0));
        let collective_time = of_ref
            .iter()
            .zip(&of_run)
            .filter(|(r, _)| r.flows > 0)
            .map(|(r, o)| rel(span(o), span(r)))
            .fold(0.0, f64::max);
        RunErrors {
            mean_fct,
            p99_fct,
            end: rel(report.end, reference.end),
            collective,
            collective_time,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::FlowSpec;

    fn report(finishes: &[u64]) -> SimReport {
        SimReport {
            flows: finishes
                .iter()
                .map(|&f| FlowOutcome {
                    start: Picos::ZERO,
                    finish: Picos(f),
                })
                .collect(),
            end: Picos(finishes.iter().copied().max().unwrap_or(0)),
            ..SimReport::default()
        }
    }

    /// One-byte flows from 0 to 1, each in the collective given (numbered from 0 up to
    /// the largest).
    fn flows_in(collectives: &[u32]) -> FlowSet {
        let spec = |c: u32| FlowSpec {
            src: 0,
            dst: 1,
            bytes: orrery_units::Bytes(1),
            deps: Default::default(),
            delay: Picos::ZERO,
            collective: c,
        };
        let info = crate::flows::CollectiveInfo {
            name: "a".into(),
            kind: None,
            ranks: Vec::new(),
            bytes: orrery_units::Bytes(0),
        };
        let n = collectives.iter().max().map_or(0, |&c| c as usize + 1);
        FlowSet {
            flows: collectives.iter().map(|&c| spec(c)).collect(),
            collectives: vec![info; n],
        }
    }

    #[test]
    fn run_errors_are_relative_to_the_reference() {
        let flows = flows_in(&[0, 0, 1, 1]);
        let reference = report(&[100, 200, 400, 1000]);
        assert_eq!(
            RunErrors::between(&reference, &reference, &flows),
            RunErrors::default()
        );
        // The second flow 10% late, the fourth 5% early.
        let e = RunErrors::between(&reference, &report(&[100, 220, 400, 950]), &flows);
        assert!((e.mean_fct - 0.15 / 4.0).abs() < 1e-12, "{e:?}");
        assert!((e.p99_fct - 0.1).abs() < 1e-12, "{e:?}");
        assert!((e.end - 0.05).abs() < 1e-12, "{e:?}");
        assert!((e.collective - 0.1).abs() < 1e-12, "{e:?}");
        // Released at zero, a collective's completion time is its finish.
        assert!((e.collective_time - 0.1).abs() < 1e-12, "{e:?}");
    }

    #[test]
    fn a_collective_released_late_is_charged_for_its_own_time_only() {
        let flows = flows_in(&[0, 1]);
        let run = |spans: [(u64, u64); 2]| SimReport {
            flows: spans
                .iter()
                .map(|&(s, f)| FlowOutcome {
                    start: Picos(s),
                    finish: Picos(f),
                })
                .collect(),
            end: Picos(spans[1].1),
            ..SimReport::default()
        };
        // The first collective finishes 10 late (1% of its 1,000); the second, released
        // when it finished, takes its 100 again and so finishes 10 late too (0.9% of its
        // finish, a tenth of its time), but its completion time is exact: the worst
        // completion-time error is the first's 1%.
        let reference = run([(0, 1000), (1000, 1100)]);
        let e = RunErrors::between(&reference, &run([(0, 1010), (1010, 1110)]), &flows);
        assert!((e.collective - 0.01).abs() < 1e-12, "{e:?}");
        assert!((e.collective_time - 0.01).abs() < 1e-12, "{e:?}");
        // Taking 120 instead, the second is 20% off in completion time.
        let e = RunErrors::between(&reference, &run([(0, 1010), (1010, 1130)]), &flows);
        assert!((e.collective - 30.0 / 1100.0).abs() < 1e-12, "{e:?}");
        assert!((e.collective_time - 0.2).abs() < 1e-12, "{e:?}");
    }
}
