//! The execution-graph IR: ops in an arena, dependencies by id, streams for concurrency.

use orrery_units::{Bytes, Flops, OpId};
use serde::{Deserialize, Serialize};

/// A stream of one rank. Ops on one stream run one at a time in issue order (like CUDA
/// streams); ops on different streams may overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Compute,
    TpComm,
    CpComm,
    EpComm,
    DpComm,
    PpComm,
}

impl Stream {
    pub const ALL: [Stream; 6] = [
        Stream::Compute,
        Stream::TpComm,
        Stream::CpComm,
        Stream::EpComm,
        Stream::DpComm,
        Stream::PpComm,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::TpComm => "tp-comm",
            Stream::CpComm => "cp-comm",
            Stream::EpComm => "ep-comm",
            Stream::DpComm => "dp-comm",
            Stream::PpComm => "pp-comm",
        }
    }
}

/// Which group of the layout a collective runs over, relative to the issuing rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupRole {
    Tp,
    Cp,
    Dp,
    /// Data-parallel and context-parallel ranks together (dense gradient reduction with CP).
    DpCp,
    Ep,
    /// Replicas of the same experts (expert gradient reduction).
    ExpertDp,
    /// The first and the last pipeline stage of one model replica, which both hold the tied
    /// word embeddings and all-reduce their gradients (a group of one on other stages).
    Embedding,
    /// Every rank: what a real training program reduces over the whole job (the loss, the
    /// gradient norm). The predictor's builder never issues it; collected graphs do.
    World,
}

impl GroupRole {
    pub const ALL: [GroupRole; 8] = [
        GroupRole::Tp,
        GroupRole::Cp,
        GroupRole::Dp,
        GroupRole::DpCp,
        GroupRole::Ep,
        GroupRole::ExpertDp,
        GroupRole::Embedding,
        GroupRole::World,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    /// The stream collectives over groups of this role run on.
    pub fn stream(self) -> Stream {
        match self {
            GroupRole::Tp => Stream::TpComm,
            GroupRole::Cp => Stream::CpComm,
            GroupRole::Ep => Stream::EpComm,
            GroupRole::Dp
            | GroupRole::DpCp
            | GroupRole::ExpertDp
            | GroupRole::Embedding
            | GroupRole::World => Stream::DpComm,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GroupRole::Tp => "tp",
            GroupRole::Cp => "cp",
            GroupRole::Dp => "dp",
            GroupRole::DpCp => "dp-cp",
            GroupRole::Ep => "ep",
            GroupRole::ExpertDp => "expert-dp",
            GroupRole::Embedding => "embedding",
            GroupRole::World => "world",
        }
    }
}

/// Collective operation kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
}

/// A pipeline neighbour, relative to the issuing rank's stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerStage {
    /// Stage `s - 1` (stage `p - 1` wraps to the previous model chunk on stage 0).
    Prev,
    /// Stage `s + 1` (wraps from the last stage to stage 0).
    Next,
}

/// What a compute op is, for the cost model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "shape", rename_all = "snake_case")]
pub enum ComputeKind {
    /// A matrix multiply of `[m, k] x [k, n]`, `batch` times.
    Gemm {
        m: u64,
        n: u64,
        k: u64,
        batch: u64,
        fp8: bool,
    },
    /// The attention core: `batch * heads` problems of `seq_q x seq_kv` with `head_dim`.
    Attention {
        batch: u64,
        heads: u64,
        seq_q: u64,
        seq_kv: u64,
        head_dim: u64,
        causal: bool,
        flash: bool,
        backward: bool,
    },
    /// A bandwidth-bound kernel (norms, activations, softmax, dropout, optimizer updates).
    MemoryBound,
}

/// What a memory allocation holds, for the ledger's breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryCategory {
    Weights,
    Gradients,
    OptimizerState,
    Activations,
    Temporary,
}

impl MemoryCategory {
    pub const ALL: [MemoryCategory; 5] = [
        MemoryCategory::Weights,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::Activations,
        MemoryCategory::Temporary,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MemoryCategory::Weights => "weights",
            MemoryCategory::Gradients => "gradients",
            MemoryCategory::OptimizerState => "optimizer",
            MemoryCategory::Activations => "activations",
            MemoryCategory::Temporary => "temporary",
        }
    }
}

/// The phase an op belongs to, for the time breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
    Recompute,
    Optimizer,
}

/// The body of an op.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OpKind {
    Compute {
        kind: ComputeKind,
        flops: Flops,
        bytes: Bytes,
    },
    Collective {
        op: CollectiveOp,
        group: GroupRole,
        bytes: Bytes,
    },
    /// Eager send to a pipeline neighbour; `tag` matches the neighbour's [`OpKind::Recv`].
    Send {
        peer: PeerStage,
        bytes: Bytes,
        tag: u64,
    },
    /// Completes when the matching send's data has arrived.
    Recv {
        peer: PeerStage,
        bytes: Bytes,
        tag: u64,
    },
    Alloc {
        bytes: Bytes,
        category: MemoryCategory,
    },
    /// Frees the allocation made by op `alloc`.
    Free { alloc: OpId },
}

impl OpKind {
    /// Whether the op occupies its stream while it runs. Receives, allocations and frees do
    /// not: they are events that happen when their inputs are ready.
    pub fn occupies_stream(&self) -> bool {
        matches!(
            self,
            OpKind::Compute { .. } | OpKind::Collective { .. } | OpKind::Send { .. }
        )
    }
}

/// One op of a rank's graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub kind: OpKind,
    pub stream: Stream,
    pub phase: Phase,
    /// Ops that must finish before this one starts (besides stream order).
    pub deps: Vec<OpId>,
    /// A short label for traces (`L12.fc1`), shared through the graph's name table.
    pub name: u32,
    /// Micro-batch this op belongs to, if any.
    pub microbatch: Option<u32>,
}

/// One rank's (or one symmetry class's) execution graph: ops in issue order.
///
/// Ops are stored in the order the rank issues them; every dependency points to an earlier
/// op, so issue order is a topological order and the graph is acyclic by construction.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecGraph {
    ops: Vec<Op>,
    names: Vec<String>,
    #[serde(skip)]
    name_index: std::collections::BTreeMap<String, u32>,
}

/// Why an [`ExecGraph`] is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    #[error("op {op} depends on op {dep}, which is not issued before it")]
    ForwardDependency { op: u32, dep: u32 },
    #[error("op {op} frees op {alloc}, which is not an earlier allocation")]
    BadFree { op: u32, alloc: u32 },
    #[error("op {op} has name index {name} but the graph has {names} names")]
    BadName { op: u32, name: u32, names: usize },
}

impl ExecGraph {
    pub fn new() -> ExecGraph {
        ExecGraph::default()
    }

    /// Interns a label and returns its index.
    pub fn intern(&mut self, name: &str) -> u32 {
        // The lookup table is not serialised; rebuild it after deserialisation.
        if self.name_index.len() != self.names.len() {
            self.reindex_names();
        }
        if let Some(&i) = self.name_index.get(name) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(name.to_string());
        self.name_index.insert(name.to_string(), i);
        i
    }

    /// Appends an op. Dependencies on ops not yet issued are a bug in the builder and are
    /// caught by [`ExecGraph::check`].
    pub fn push(&mut self, op: Op) -> OpId {
        let id = OpId::from_index(self.ops.len());
        self.ops.push(op);
        id
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    pub fn op(&self, id: OpId) -> &Op {
        &self.ops[id.index()]
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn name_of(&self, op: &Op) -> &str {
        self.names.get(op.name as usize).map_or("?", String::as_str)
    }

    /// Checks the structural invariants: dependencies and frees point backwards (so the graph
    /// is acyclic), and name indices are in range.
    pub fn check(&self) -> Result<(), GraphError> {
        for (i, op) in self.ops.iter().enumerate() {
            let i32_ = i as u32;
            for d in &op.deps {
                if d.index() >= i {
                    return Err(GraphError::ForwardDependency { op: i32_, dep: d.0 });
                }
            }
            if let OpKind::Free { alloc } = op.kind {
                let ok = alloc.index() < i
                    && matches!(self.ops[alloc.index()].kind, OpKind::Alloc { .. });
                if !ok {
                    return Err(GraphError::BadFree {
                        op: i32_,
                        alloc: alloc.0,
                    });
                }
            }
            if op.name as usize >= self.names.len() {
                return Err(GraphError::BadName {
                    op: i32_,
                    name: op.name,
                    names: self.names.len(),
                });
            }
        }
        Ok(())
    }

    /// Rebuilds the name lookup from the name table.
    fn reindex_names(&mut self) {
        self.name_index = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i as u32))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_survives_a_serde_round_trip() {
        let mut g = ExecGraph::new();
        let a = g.intern("L0.qkv");
        let b = g.intern("L0.proj");
        let json = serde_json::to_string(&g).unwrap();
        let mut back: ExecGraph = serde_json::from_str(&json).unwrap();
        // Known names keep their index; a new one gets the next.
        assert_eq!(back.intern("L0.proj"), b);
        assert_eq!(back.intern("L0.qkv"), a);
        assert_eq!(back.intern("L1.qkv"), 2);
        assert_eq!(back.names().len(), 3);
    }
}
