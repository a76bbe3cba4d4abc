//! # orrery-graph: what every rank does during one training step
//!
//! The execution graph is the contract between "what the job is" and "how long it takes".
//! It is a per-rank DAG of compute ops (with FLOPs, bytes moved and a shape the cost model
//! can read), collectives (kind, group role, bytes), point-to-point transfers to pipeline
//! neighbours, and memory allocations and frees, each op on a stream so the replay knows
//! what may overlap.
//!
//! Key types:
//! - [`ExecGraph`] and [`Op`]: one graph's ops in an arena, in issue order; dependencies
//!   always point backwards, so the graph is acyclic by construction ([`ExecGraph::check`]).
//! - [`Layout`]: the rank grid in Megatron order, every communication group, pipeline
//!   neighbours, and the symmetry classes (one per pipeline stage).
//! - [`build()`]: the Megatron-LM training step (TP/SP, 1F1B and interleaved 1F1B, DP with
//!   bucketed and overlapped gradient reduction, distributed optimizer, CP, EP, recompute).
//! - [`materialize`]: any single rank's concrete graph (groups and peers resolved).
//! - [`chakra`]: Chakra execution-trace export and import.
//! - [`collect`]: graphs stitched from what a real training program recorded, with measured
//!   durations (hybrid emulation's graph collection).
//!
//! What this crate deliberately does not do: decide durations. Ops carry sizes, never times;
//! the predictor's cost and network models turn sizes into picoseconds.

pub mod build;
pub mod chakra;
pub mod collect;
pub mod ir;
pub mod layout;
pub mod materialize;
pub mod schedule;

pub use build::{build, model_state_bytes, JobGraphs, ModelState, ParamShards, Shape};
pub use ir::{
    CollectiveOp, ComputeKind, ExecGraph, GraphError, GroupRole, MemoryCategory, Op, OpKind,
    PeerStage, Phase, Stream,
};
pub use layout::{Coords, Layout, Placement};
