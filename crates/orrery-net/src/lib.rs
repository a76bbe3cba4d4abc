//! # orrery-net: how long moving bytes between GPUs takes
//!
//! This crate knows nodes, links, groups of endpoints, bytes and time; it knows nothing
//! about LLMs. The predictor asks it one question, through [`NetworkModel`]: "a collective
//! of this kind and size runs over a group placed like this on the fabric: how long does it
//! take?" (and the same for a point-to-point transfer).
//!
//! Key types:
//! - [`Fabric`]: the cluster's links: the NVLink-class domain inside a node, one NIC per GPU
//!   across nodes, and the switch topology (rail-optimised or an oversubscribed fat-tree).
//! - [`GroupPlacement`]: where a communication group's members sit (how many ranks, on how
//!   many nodes, how many on the busiest node), which is all an analytical model needs.
//! - [`CollectiveRequest`] and [`CollectiveCost`]: the question and the answer.
//! - [`NetworkModel`]: the trait every network model implements. [`AnalyticalNetwork`] is the
//!   alpha-beta model of NCCL-like ring, tree and hierarchical algorithms; [`SimNetwork`]
//!   answers the same question with a simulator.
//!
//! The simulators' side:
//! - [`topology`]: [`NetGraph`], an arena of endpoints, switches and directed links, with
//!   rail-optimised and fat-tree builders and deterministic routing: ECMP by a hash of the
//!   connection, or paths pinned by the destination's port on its leaf ([`Routing`]).
//! - [`flows`]: [`flows::FlowSet`], messages with dependencies, and `collective_flows`, which
//!   expands NCCL-like collective algorithms into them.
//! - [`sim`]: the [`sim::FlowSimulator`] trait and its [`sim::SimReport`];
//!   [`flow_model`] (max-min fair sharing) and [`packet`] (RDMA, ECN, PFC, DCQCN) implement it.
//! - [`scenario`]: the `orrery netsim` file format.
//! - [`flow_trace`]: a run's flows and collectives as a Perfetto timeline (`orrery netsim
//!   --trace`).
//!
//! Byte convention: [`CollectiveRequest::bytes`] is the size `S` of the *full* buffer per
//! rank, as nccl-tests reports it: the all-reduce buffer, the all-gather output, the
//! reduce-scatter input, the all-to-all send buffer. Bus bandwidth then has its usual
//! meaning (all-reduce moves `2(n-1)/n * S` per rank, all-gather and reduce-scatter
//! `(n-1)/n * S`).
//!
//! What this crate deliberately does not do: contention between different collectives that
//! run at the same time is seen only when they are simulated together (`orrery netsim`,
//! including a job's whole step); behind [`NetworkModel`] every collective is costed alone,
//! by the analytical model and by [`SimNetwork`] alike. On a rail-optimised fabric the
//! concurrent groups of a Megatron layout use disjoint NICs, so this is mostly harmless.

use orrery_units::{Bandwidth, Bytes, Picos};
use serde::{Deserialize, Serialize};

mod analytical;
pub mod flow_model;
pub mod flow_trace;
pub mod flows;
pub mod packet;
pub mod scenario;
pub mod sim;
pub mod sim_network;
pub mod topology;
pub mod word_hash;

pub use analytical::AnalyticalNetwork;
pub use sim_network::{SimNetwork, SimTotals};
pub use topology::{
    FatTreeSpec, Link, NetGraph, NodeKind, RailOptimizedSpec, Routing, TopologyError,
};

/// The collective operations the predictor issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
    Reduce,
}

impl CollectiveKind {
    /// Bytes each rank sends, as a fraction of the full buffer `S`, for a group of `n`
    /// (the nccl-tests bus-bandwidth factor).
    pub fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n.max(1));
        match self {
            CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
            CollectiveKind::AllGather
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllToAll => (n - 1.0) / n,
            CollectiveKind::Broadcast | CollectiveKind::Reduce => 1.0,
        }
    }
}

/// A NCCL-like algorithm choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Ring over all members (NCCL's default for large messages).
    Ring,
    /// Double binary tree across nodes, chain inside the node (all-reduce only).
    Tree,
    /// Reduce-scatter inside the node, the collective across nodes, all-gather inside.
    Hierarchical,
    /// Direct pairwise exchange (all-to-all, point-to-point).
    Direct,
    /// Not modelled: measured in a real run (a calibrated model's answer). No model applies
    /// it by choice.
    Measured,
}

/// Which algorithm a model should use for a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmChoice {
    /// The fastest applicable algorithm, as NCCL's tuner would pick.
    #[default]
    Auto,
    Fixed(Algorithm),
}

/// Where a group's members sit on the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupPlacement {
    /// Number of members (ranks) in the group.
    pub size: u32,
    /// Number of distinct nodes the members occupy.
    pub nodes: u32,
    /// Members on the most populated node (the bottleneck node).
    pub max_per_node: u32,
}

impl GroupPlacement {
    /// A group whose members all share one node.
    pub fn single_node(size: u32) -> GroupPlacement {
        GroupPlacement {
            size,
            nodes: 1,
            max_per_node: size,
        }
    }
}

/// The switch topology across nodes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Topology {
    /// One NIC per GPU to a leaf switch per rail, full-bisection spine.
    RailOptimized,
    /// A fat-tree whose upper tiers carry `1 / oversubscription` of the leaf bandwidth;
    /// traffic between nodes under different leaves sees the reduced bandwidth.
    FatTree {
        oversubscription: f64,
        nodes_per_leaf: u32,
    },
}

/// One class of link: bandwidth per GPU per direction and a per-message latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkClass {
    /// Datasheet unidirectional bandwidth available to one GPU.
    pub bandwidth: Bandwidth,
    /// Fraction of `bandwidth` a well-tuned collective achieves on large messages.
    pub efficiency: f64,
    /// Latency of one algorithm step over this link (software + wire).
    pub latency: Picos,
}

impl LinkClass {
    /// The bandwidth collectives achieve in practice.
    pub fn achievable(&self) -> Bandwidth {
        self.bandwidth.scale(self.efficiency)
    }
}

/// The cluster's communication fabric.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fabric {
    pub gpus_per_node: u32,
    pub nodes: u32,
    /// NVLink-class links inside a node.
    pub intra_node: LinkClass,
    /// NIC links across nodes (per GPU).
    pub inter_node: LinkClass,
    pub topology: Topology,
}

/// A collective to be costed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CollectiveRequest {
    pub kind: CollectiveKind,
    /// Full buffer size per rank (see the crate docs for the convention).
    pub bytes: Bytes,
    pub placement: GroupPlacement,
}

/// What a collective costs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CollectiveCost {
    pub time: Picos,
    pub algorithm: Algorithm,
}

/// A network model: the one question the predictor asks of a network.
///
/// Implementations must be deterministic: the same request gives the same answer.
pub trait NetworkModel {
    /// A short name for reports ("analytical", "flow", "packet").
    fn name(&self) -> &'static str;
    /// Time from the moment every member has entered the collective until it completes.
    fn collective(&self, request: &CollectiveRequest) -> CollectiveCost;
    /// Time to move `bytes` from one GPU to another, on the same node or across nodes.
    fn point_to_point(&self, bytes: Bytes, same_node: bool) -> Picos;
}
