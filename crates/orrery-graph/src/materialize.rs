//! Any single rank's concrete graph: the class graph with groups and peers resolved.

use crate::build::JobGraphs;
use crate::ir::{ExecGraph, OpKind};
use orrery_units::{GroupId, RankId};

/// A concrete reference an op of a materialised rank graph makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concrete {
    None,
    Group(GroupId),
    Peer(RankId),
}

/// One rank's graph: its class graph plus, per op, the concrete group or peer it names.
#[derive(Debug, Clone)]
pub struct RankGraph<'a> {
    pub rank: RankId,
    pub graph: &'a ExecGraph,
    pub resolved: Vec<Concrete>,
}

/// Resolves rank `rank`'s graph. Cost: one pass over its class graph.
pub fn materialize(graphs: &JobGraphs, rank: RankId) -> RankGraph<'_> {
    let layout = &graphs.layout;
    let graph = graphs.class(layout.class_of(rank));
    let resolved = graph
        .ops()
        .iter()
        .map(|op| match op.kind {
            OpKind::Collective { group, .. } => Concrete::Group(layout.group_id(rank, group)),
            OpKind::Send { peer, .. } | OpKind::Recv { peer, .. } => {
                Concrete::Peer(layout.peer(rank, peer))
            }
            _ => Concrete::None,
        })
        .collect();
    RankGraph {
        rank,
        graph,
        resolved,
    }
}
