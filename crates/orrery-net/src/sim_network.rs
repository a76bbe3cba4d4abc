//! Simulated networks behind the predictor's [`NetworkModel`] trait.
//!
//! [`SimNetwork`] answers "how long does this collective take on this placement?" by
//! building a rail-optimised topology with just the hosts the group occupies, expanding the
//! collective into flows (NCCL-like ring with one channel per GPU of the busiest host, direct
//! all-to-all relayed to the destination's rail as NCCL's PXN does, unless
//! [`SimNetwork::with_pxn`] turns that off) and running a [`FlowSimulator`] (flow-level or
//! packet-level) on it. Answers are cached by (kind, bytes, placement): a training step
//! repeats a handful of shapes.
//!
//! Links are built at their *achievable* bandwidth (datasheet times the fabric's efficiency),
//! the same numbers the analytical model uses, so that the simulated models see the protocol
//! overheads NCCL pays (which neither simulates) and differ from the analytical model only by
//! what they add: queueing, congestion control and the actual flow dependencies.
//!
//! What this does not do: contention between different collectives that run at the same time
//! (each is simulated alone), and placements other than "the group's members fill its hosts
//! from local GPU 0 up".

use crate::flows::{collective_flows, FlowAlgorithm, FlowSet};
use crate::sim::{AccelCounts, FlowSimulator};
use crate::topology::{NetGraph, RailOptimizedSpec, Routing};
use crate::{
    Algorithm, CollectiveCost, CollectiveKind, CollectiveRequest, Fabric, GroupPlacement,
    NetworkModel,
};
use orrery_units::{Bytes, Picos};
use std::cell::RefCell;
use std::collections::HashMap;

/// A network model that simulates each collective on a topology.
#[derive(Debug)]
pub struct SimNetwork<S: FlowSimulator> {
    simulator: S,
    fabric: Fabric,
    /// Looked up only, never iterated, so hash order cannot reach an output.
    cache: RefCell<HashMap<(CollectiveKind, Bytes, GroupPlacement), Picos>>,
    p2p_cache: RefCell<HashMap<(Bytes, bool), Picos>>,
    failures: RefCell<Vec<String>>,
    totals: RefCell<SimTotals>,
    /// All-to-alls relayed to the destination's rail ([`FlowAlgorithm::DirectPxn`]).
    pxn: bool,
    /// How the simulated topology places flows on equal-cost paths.
    routing: Routing,
}

/// What a [`SimNetwork`] simulated over its life: one simulation per distinct collective
/// or transfer shape, their processed events and what acceleration skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct SimTotals {
    pub simulations: u64,
    pub events: u64,
    pub accel: AccelCounts,
}

impl<S: FlowSimulator> SimNetwork<S> {
    pub fn new(simulator: S, fabric: Fabric) -> SimNetwork<S> {
        SimNetwork {
            simulator,
            fabric,
            cache: RefCell::new(HashMap::new()),
            p2p_cache: RefCell::new(HashMap::new()),
            failures: RefCell::new(Vec::new()),
            totals: RefCell::new(SimTotals::default()),
            pxn: true,
            routing: Routing::Ecmp,
        }
    }

    /// How the simulated fabric places flows on equal-cost paths (ECMP by default).
    pub fn with_routing(mut self, routing: Routing) -> SimNetwork<S> {
        self.routing = routing;
        self
    }

    /// Whether all-to-alls are relayed over NVLink to the destination's rail, as NCCL's
    /// PXN does (the default) or cross rails through the spines (`false`).
    pub fn with_pxn(mut self, pxn: bool) -> SimNetwork<S> {
        self.pxn = pxn;
        self
    }

    /// Distinct collective shapes simulated so far.
    pub fn simulated_shapes(&self) -> usize {
        self.cache.borrow().len() + self.p2p_cache.borrow().len()
    }

    /// Simulations that failed (their answer fell back to zero time); empty when all ran.
    /// Simulations run so far, their events and what acceleration skipped.
    pub fn totals(&self) -> SimTotals {
        *self.totals.borrow()
    }

    pub fn failures(&self) -> Vec<String> {
        self.failures.borrow().clone()
    }

    /// A rail-optimised topology of `hosts` hosts of the fabric's GPUs at achievable rates.
    fn topology(&self, hosts: usize) -> Result<NetGraph, crate::topology::TopologyError> {
        let f = &self.fabric;
        let gpus = f.gpus_per_node.max(1) as usize;
        // Wire delays are the physical defaults of `RailOptimizedSpec::dgx_h100`; the
        // fabric's per-step latencies (software and synchronisation, the alpha of the
        // analytical model) are paid as each flow's release delay instead.
        NetGraph::rail_optimized(&RailOptimizedSpec {
            hosts: hosts.max(1),
            gpus_per_host: gpus,
            nvlink: f.intra_node.achievable(),
            nic: f.inter_node.achievable(),
            ..RailOptimizedSpec::dgx_h100(hosts.max(1))
        })
        .map(|g| g.with_routing(self.routing))
    }

    fn run(
        &self,
        hosts: usize,
        build: impl FnOnce(&mut FlowSet, usize) -> Result<(), String>,
    ) -> Result<Picos, String> {
        let graph = self.topology(hosts).map_err(|e| e.to_string())?;
        let mut set = FlowSet::default();
        build(&mut set, graph.endpoints_per_host())?;
        let report = self
            .simulator
            .simulate(&graph, &set)
            .map_err(|e| e.to_string())?;
        let mut t = self.totals.borrow_mut();
        t.simulations += 1;
        t.events += report.events;
        t.accel.add(&report.accel);
        Ok(report.end)
    }

    fn note_failure(&self, what: String) -> Picos {
        self.failures.borrow_mut().push(what);
        Picos::ZERO
    }
}

/// The endpoints of a group placed as `placement` says: hosts filled from local GPU 0 up.
pub fn placed_ranks(placement: GroupPlacement, gpus_per_host: usize) -> Vec<u32> {
    let per = placement.max_per_node.max(1) as usize;
    let mut ranks = Vec::with_capacity(placement.size as usize);
    'outer: for h in 0..placement.nodes.max(1) as usize {
        for j in 0..per.min(gpus_per_host.max(1)) {
            if ranks.len() == placement.size as usize {
                break 'outer;
            }
            ranks.push((h * gpus_per_host + j) as u32);
        }
    }
    ranks
}

impl<S: FlowSimulator> NetworkModel for SimNetwork<S> {
    fn name(&self) -> &'static str {
        self.simulator.name()
    }

    fn collective(&self, request: &CollectiveRequest) -> CollectiveCost {
        let placement = request.placement;
        let algorithm = match request.kind {
            CollectiveKind::AllToAll => Algorithm::Direct,
            _ => Algorithm::Ring,
        };
        if placement.size <= 1 || request.bytes.0 == 0 {
            return CollectiveCost {
                time: Picos::ZERO,
                algorithm,
            };
        }
        let key = (request.kind, request.bytes, placement);
        if let Some(&t) = self.cache.borrow().get(&key) {
            return CollectiveCost { time: t, algorithm };
        }
        let gpus = self.fabric.gpus_per_node.max(1) as usize;
        let ranks = placed_ranks(placement, gpus);
        let flow_alg = match request.kind {
            CollectiveKind::AllToAll => FlowAlgorithm::all_to_all(self.pxn),
            _ => FlowAlgorithm::Ring {
                channels: placement.max_per_node.max(1),
            },
        };
        let step = if placement.nodes > 1 {
            self.fabric.inter_node.latency
        } else {
            self.fabric.intra_node.latency
        };
        let result = self.run(placement.nodes.max(1) as usize, |set, per_host| {
            collective_flows(
                set,
                "collective",
                request.kind,
                flow_alg,
                &ranks,
                request.bytes,
                per_host,
                step,
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
        });
        let time = result.unwrap_or_else(|e| {
            self.note_failure(format!(
                "{:?} of {} B on {placement:?}: {e}",
                request.kind, request.bytes.0
            ))
        });
        self.cache.borrow_mut().insert(key, time);
        CollectiveCost { time, algorithm }
    }

    fn point_to_point(&self, bytes: Bytes, same_node: bool) -> Picos {
        if bytes.0 == 0 {
            return Picos::ZERO;
        }
        if let Some(&t) = self.p2p_cache.borrow().get(&(bytes, same_node)) {
            return t;
        }
        let gpus = self.fabric.gpus_per_node.max(1) as usize;
        let (hosts, dst) = if same_node && gpus > 1 {
            (1, 1)
        } else {
            (2, gpus as u32)
        };
        let result = self.run(hosts, |set, _| {
            set.push_p2p("p2p", 0, dst, bytes, Picos::ZERO);
            Ok(())
        });
        let time =
            result.unwrap_or_else(|e| self.note_failure(format!("p2p of {} B: {e}", bytes.0)));
        self.p2p_cache.borrow_mut().insert((bytes, same_node), time);
        time
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_fills_hosts_from_gpu_zero() {
        let p = GroupPlacement {
            size: 6,
            nodes: 2,
            max_per_node: 3,
        };
        assert_eq!(placed_ranks(p, 8), vec![0, 1, 2, 8, 9, 10]);
        let p = GroupPlacement {
            size: 4,
            nodes: 4,
            max_per_node: 1,
        };
        assert_eq!(placed_ranks(p, 8), vec![0, 8, 16, 24]);
    }
}
