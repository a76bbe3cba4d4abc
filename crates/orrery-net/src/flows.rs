//! Traffic as flows: collectives become dependency graphs of point-to-point flows.
//!
//! (Module essay and the collective algorithms are written with the implementation.)

use crate::CollectiveKind;
use orrery_units::{Bytes, FlowId, Picos};
use serde::{Deserialize, Serialize};

/// One message: `bytes` from endpoint `src` to endpoint `dst`, released `delay` after the
/// last of its dependencies completes (or at `delay` if it has none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowSpec {
    pub src: u32,
    pub dst: u32,
    pub bytes: Bytes,
    /// Flows that must complete before this one is released (earlier ids only).
    pub deps: Vec<FlowId>,
    /// Release delay after the dependencies (per-step send latency, or an arrival time).
    pub delay: Picos,
    /// The collective (index into [`FlowSet::collectives`]) this flow belongs to.
    pub collective: u32,
}

/// How a collective is turned into flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FlowAlgorithm {
    /// Ring with `channels` parallel rings, each carrying `1/channels` of the data.
    Ring { channels: u32 },
    /// Two complementary binary trees, each carrying half the data (all-reduce).
    DoubleBinaryTree,
    /// Recursive halving then doubling (all-reduce, reduce-scatter, all-gather).
    HalvingDoubling,
    /// Every rank sends to every other rank directly (all-to-all).
    Direct,
    /// Inside each host, then across hosts among one rank per host, then inside again.
    Hierarchical,
}

/// A named collective within a flow set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveInfo {
    pub name: String,
    pub kind: Option<CollectiveKind>,
    pub ranks: Vec<u32>,
    pub bytes: Bytes,
}

/// A set of flows with dependencies: the input of every flow and packet simulation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowSet {
    pub flows: Vec<FlowSpec>,
    pub collectives: Vec<CollectiveInfo>,
}

/// Why flows could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FlowError {
    #[error("flow {flow} depends on flow {dep}, which is not an earlier flow")]
    BadDependency { flow: usize, dep: u32 },
    #[error("flow {flow} goes from endpoint {src} to itself")]
    SelfLoop { flow: usize, src: u32 },
    #[error("a collective needs at least one rank")]
    NoRanks,
    #[error("{algorithm:?} cannot run {kind:?}")]
    Unsupported {
        algorithm: FlowAlgorithm,
        kind: CollectiveKind,
    },
}

impl FlowSet {
    /// Checks that dependencies point to earlier flows and no flow is a self-loop.
    pub fn check(&self) -> Result<(), FlowError> {
        for (i, f) in self.flows.iter().enumerate() {
            if f.src == f.dst {
                return Err(FlowError::SelfLoop {
                    flow: i,
                    src: f.src,
                });
            }
            if let Some(d) = f.deps.iter().find(|d| d.index() >= i) {
                return Err(FlowError::BadDependency { flow: i, dep: d.0 });
            }
        }
        Ok(())
    }

    /// Adds a single point-to-point flow as its own collective; returns its id.
    pub fn push_p2p(
        &mut self,
        name: &str,
        src: u32,
        dst: u32,
        bytes: Bytes,
        delay: Picos,
    ) -> FlowId {
        let collective = self.collectives.len() as u32;
        self.collectives.push(CollectiveInfo {
            name: name.to_string(),
            kind: None,
            ranks: vec![src, dst],
            bytes,
        });
        let id = FlowId::from_index(self.flows.len());
        self.flows.push(FlowSpec {
            src,
            dst,
            bytes,
            deps: Vec::new(),
            delay,
            collective,
        });
        id
    }
}
