//! The communication of one training step as network flows, for `orrery netsim`.
//!
//! The predictor replays the step with the analytical network, which says when every rank
//! issues every collective and transfer. Each collective instance (one per concrete group and
//! position in that group's order) becomes the flows of its NCCL-like algorithm among the
//! group's ranks, released at the time the replay started it; each pipeline send becomes one
//! flow released when it was sent. The result runs on a topology built from the job's
//! cluster, so the packet- or flow-level simulator sees the step's traffic with its real
//! timing and overlaps.
//!
//! What this deliberately does not do: feed the simulated network times back into the
//! compute schedule (flows are released at the analytical replay's times, not when the
//! simulated network would have let the ranks reach them). It is the traffic of a step, not
//! a co-simulation.

use crate::replay::ReplayMode;
use crate::{fabric_for, predict_with, PredictError};
use orrery_graph::materialize::{materialize, Concrete};
use orrery_graph::{CollectiveOp, GroupRole, OpKind};
use orrery_net::flows::{collective_flows, FlowAlgorithm, FlowError, FlowSet};
use orrery_net::topology::{FatTreeSpec, NetGraph, RailOptimizedSpec, TopologyError};
use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_spec::{Job, TopologyKind};
use orrery_units::{Picos, RankId};
use serde::Serialize;
use std::collections::HashSet;

/// Which kinds of communication to include.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TrafficSelection {
    pub tp: bool,
    pub cp: bool,
    pub ep: bool,
    pub dp: bool,
    pub pp: bool,
}

impl TrafficSelection {
    pub const ALL: TrafficSelection = TrafficSelection {
        tp: true,
        cp: true,
        ep: true,
        dp: true,
        pp: true,
    };

    /// Parses names like `["dp", "pp"]`; returns the unknown names as the error.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<TrafficSelection, Vec<String>> {
        let mut s = TrafficSelection {
            tp: false,
            cp: false,
            ep: false,
            dp: false,
            pp: false,
        };
        let mut unknown = Vec::new();
        for n in names {
            match n.as_ref() {
                "tp" => s.tp = true,
                "cp" => s.cp = true,
                "ep" => s.ep = true,
                "dp" => s.dp = true,
                "pp" => s.pp = true,
                other => unknown.push(other.to_string()),
            }
        }
        if unknown.is_empty() {
            Ok(s)
        } else {
            Err(unknown)
        }
    }

    fn role(&self, role: GroupRole) -> bool {
        match role {
            GroupRole::Tp => self.tp,
            GroupRole::Cp => self.cp,
            GroupRole::Ep => self.ep,
            GroupRole::Dp
            | GroupRole::DpCp
            | GroupRole::ExpertDp
            | GroupRole::Embedding
            | GroupRole::World => self.dp,
        }
    }
}

/// Why a job's traffic could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TrafficError {
    #[error(transparent)]
    Predict(#[from] PredictError),
    #[error("building the cluster topology: {0}")]
    Topology(#[from] TopologyError),
    #[error("expanding a collective into flows: {0}")]
    Flows(#[from] FlowError),
}

/// The topology a job's cluster describes, at datasheet link rates.
pub fn cluster_topology(job: &Job) -> Result<NetGraph, TopologyError> {
    let c = job.cluster();
    let hosts = c.nodes as usize;
    let gpus = c.gpus_per_node as usize;
    match c.topology {
        TopologyKind::RailOptimized => NetGraph::rail_optimized(&RailOptimizedSpec {
            gpus_per_host: gpus,
            nvlink: c.gpu.nvlink_bandwidth,
            nic: c.nic_bandwidth,
            ..RailOptimizedSpec::dgx_h100(hosts)
        }),
        TopologyKind::FatTree => NetGraph::fat_tree(&FatTreeSpec {
            gpus_per_host: gpus,
            nvlink: c.gpu.nvlink_bandwidth,
            nic: c.nic_bandwidth,
            hosts_per_leaf: c.nodes_per_leaf as usize,
            oversubscription: c.oversubscription,
            ..FatTreeSpec::two_tier(hosts)
        }),
    }
}

/// The flows of one training step of `job`, with the topology they run on.
pub fn job_traffic(
    job: &Job,
    select: TrafficSelection,
) -> Result<(NetGraph, FlowSet), TrafficError> {
    let net = AnalyticalNetwork::new(fabric_for(job), AlgorithmChoice::Auto);
    let out = predict_with(job, &net, ReplayMode::Classes)?;
    let graph = cluster_topology(job)?;
    let layout = &out.graphs.layout;
    let per_host = job.cluster().gpus_per_node as usize;
    let step = Picos::from_nanos(crate::NIC_LATENCY_NS);
    let mut set = FlowSet::default();
    let mut done: HashSet<(u32, u32)> = HashSet::new();
    for r in 0..layout.world_size() {
        let rank = RankId(r);
        let rg = materialize(&out.graphs, rank);
        // In class mode every rank of a class has its class's timeline.
        let timing = &out.timeline.participants[layout.class_of(rank).index()];
        let mut seq_on_group = std::collections::HashMap::new();
        for (i, (op, resolved)) in rg.graph.ops().iter().zip(&rg.resolved).enumerate() {
            let start = timing.ops[i].start;
            match (op.kind, *resolved) {
                (
                    OpKind::Collective {
                        op: cop,
                        group,
                        bytes,
                    },
                    Concrete::Group(g),
                ) => {
                    let seq = seq_on_group.entry(g).or_insert(0u32);
                    let key = (g.0, *seq);
                    *seq += 1;
                    if !select.role(group) || !done.insert(key) {
                        continue;
                    }
                    let members: Vec<u32> = layout
                        .group_members(rank, group)
                        .iter()
                        .map(|m| m.0)
                        .collect();
                    let placement = layout.placement(rank, group);
                    let (kind, algorithm) = match cop {
                        CollectiveOp::AllToAll => {
                            (orrery_net::CollectiveKind::AllToAll, FlowAlgorithm::Direct)
                        }
                        other => (
                            crate::replay::net_kind(other),
                            FlowAlgorithm::Ring {
                                channels: placement.max_per_node.max(1),
                            },
                        ),
                    };
                    let name = format!("{} {} g{}", group.name(), rg.graph.name_of(op), g.0);
                    let range = collective_flows(
                        &mut set, &name, kind, algorithm, &members, bytes, per_host, step,
                    )?;
                    for f in &mut set.flows[range] {
                        if f.deps.is_empty() {
                            f.delay += start;
                        }
                    }
                }
                (OpKind::Send { bytes, .. }, Concrete::Peer(peer)) if select.pp => {
                    set.push_p2p(rg.graph.name_of(op), r, peer.0, bytes, start);
                }
                _ => {}
            }
        }
    }
    set.check()?;
    Ok((graph, set))
}
