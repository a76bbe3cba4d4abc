//! # orrery-predict: from a job to step time, MFU, breakdown and per-rank memory
//!
//! This is the layer users meet first. It builds the job's execution graphs
//! ([`orrery_graph::build()`]), replays them in simulated time with a compute [`CostModel`]
//! and a [`orrery_net::NetworkModel`], and reads the replay back as a [`Prediction`]: step
//! time, tokens per second, MFU, where the time goes ([`Breakdown`]), and each pipeline
//! stage's memory peak with an out-of-memory verdict ([`MemoryLedger`]).
//!
//! Key types and functions:
//! - [`predict`]: the whole pipeline with the analytical network; [`predict_with`] for any
//!   network model and replay mode.
//! - [`replay::replay`]: the discrete-event replay engine (class mode and all-rank mode).
//! - [`emulate::Emulation`]: the same engine with live participants (real ranks of hybrid
//!   emulation), one participant per class of ranks with identical timelines (exact), with
//!   perturbations (slow ranks, degraded links).
//! - [`CostModel`]: per-op roofline with shape-dependent GEMM efficiency and a flash
//!   attention model; every constant documented where it is defined.
//! - [`memory::ledger`], [`breakdown::breakdown`]: readers of a replayed timeline.
//! - [`sinks`]: the Perfetto trace and SVG charts.
//! - [`validation`]: the published measurements and the predictions against them.
//! - [`traces`]: replay of imported Chakra traces on the same engine and models.
//! - [`traffic`]: a training step's communication as network flows for `orrery netsim`.
//!
//! What this crate deliberately does not do: print, read files or the clock. The CLI owns
//! all I/O; this crate returns values and writes into `std::io::Write` handed to it.

pub mod breakdown;
pub mod cost;
pub mod emulate;
pub mod flops;
pub mod memory;
pub mod replay;
pub mod sinks;
pub mod traces;
pub mod traffic;
pub mod validation;

pub use breakdown::Breakdown;
pub use cost::CostModel;
pub use memory::MemoryLedger;
pub use replay::{ReplayMode, Timeline};

use orrery_graph::{build, JobGraphs};
use orrery_net::sim::FlowSimulator;
use orrery_net::{
    AlgorithmChoice, AnalyticalNetwork, Fabric, LinkClass, NetworkModel, SimNetwork, Topology,
};
use orrery_spec::{Job, TopologyKind};
use orrery_units::{Bytes, ClassId, Picos, RankId};
use serde::Serialize;

/// Fraction of NVLink bandwidth NCCL collectives reach: measured 8-GPU all-reduce bus
/// bandwidth is ~235 of 300 GB/s on A100 and ~368 of 450 GB/s on H200 (0.78-0.82).
pub const NVLINK_EFFICIENCY: f64 = 0.80;
/// Fraction of NIC bandwidth inter-node collectives reach (74-80% measured with NCCL).
pub const NIC_EFFICIENCY: f64 = 0.77;
/// Per-step latency of an NVLink hop inside NCCL (launch, synchronisation, wire).
pub const NVLINK_LATENCY_NS: u64 = 1_500;
/// Per-step latency across the InfiniBand/RoCE fabric.
pub const NIC_LATENCY_NS: u64 = 5_000;

/// The fabric a job's cluster describes.
pub fn fabric_for(job: &Job) -> Fabric {
    fabric_of(job.cluster())
}

/// A simulated network for a job: its cluster's fabric, with all-to-alls relayed as the
/// cluster's `pxn` says and flows routed as its `routing` says. Build every job's
/// [`SimNetwork`] here, so none misses a setting.
pub fn sim_network_for<S: FlowSimulator>(job: &Job, simulator: S) -> SimNetwork<S> {
    SimNetwork::new(simulator, fabric_for(job))
        .with_pxn(job.cluster().pxn)
        .with_routing(routing_of(job.cluster()))
}

/// The network's routing for a cluster's `routing`.
pub fn routing_of(c: &orrery_spec::Cluster) -> orrery_net::Routing {
    match c.routing {
        orrery_spec::RoutingKind::Ecmp => orrery_net::Routing::Ecmp,
        orrery_spec::RoutingKind::Pinned => orrery_net::Routing::Pinned,
    }
}

/// The fabric a cluster describes.
pub fn fabric_of(c: &orrery_spec::Cluster) -> Fabric {
    let to32 = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
    Fabric {
        gpus_per_node: to32(c.gpus_per_node),
        nodes: to32(c.nodes),
        intra_node: LinkClass {
            bandwidth: c.gpu.nvlink_bandwidth,
            efficiency: NVLINK_EFFICIENCY,
            latency: Picos::from_nanos(NVLINK_LATENCY_NS),
        },
        inter_node: LinkClass {
            bandwidth: c.nic_bandwidth,
            efficiency: NIC_EFFICIENCY,
            latency: Picos::from_nanos(NIC_LATENCY_NS),
        },
        topology: match c.topology {
            TopologyKind::RailOptimized => Topology::RailOptimized,
            TopologyKind::FatTree => Topology::FatTree {
                oversubscription: c.oversubscription,
                nodes_per_leaf: to32(c.nodes_per_leaf),
            },
        },
    }
}

/// Memory of one pipeline stage (all its ranks are alike).
#[derive(Debug, Clone, Serialize)]
pub struct StageMemory {
    pub stage: u32,
    /// The rank whose graph was replayed for this stage.
    pub rank: RankId,
    pub peak: Bytes,
    pub usable: Bytes,
    pub fits: bool,
    pub ledger: MemoryLedger,
}

/// One symmetry class: the ranks it stands for and the rank replayed for it.
#[derive(Debug, Clone, Serialize)]
pub struct ClassInfo {
    pub class: u32,
    /// Pipeline stage of every rank of the class.
    pub stage: u32,
    pub ranks: u32,
    pub representative: RankId,
}

/// A complete prediction for one training step.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub job: String,
    pub network_model: String,
    pub world_size: u64,
    pub gpu: String,
    pub step_time: Picos,
    pub tokens_per_step: u64,
    pub tokens_per_second: f64,
    pub model_flops: f64,
    pub tflops_per_gpu: f64,
    pub mfu: f64,
    /// The stage that finishes last, whose timeline the breakdown describes.
    pub critical_stage: u32,
    pub breakdown: Breakdown,
    pub memory: Vec<StageMemory>,
    pub fits: bool,
    /// The symmetry classes: every rank belongs to exactly one ([`orrery_graph::Layout::class_of`]).
    pub classes: Vec<ClassInfo>,
    pub graph_ops: usize,
    pub replay_events: u64,
    /// With a simulated network: how many simulations it ran, their events, and what
    /// acceleration (fast-forwarding, memoization) skipped. Set by the caller that owns
    /// the simulator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_simulation: Option<orrery_net::SimTotals>,
    pub warnings: Vec<String>,
}

/// Why a prediction failed.
#[derive(Debug, thiserror::Error)]
pub enum PredictError {
    #[error(transparent)]
    Replay(#[from] replay::ReplayError),
    #[error("memory ledger of stage {stage}: {source}")]
    Ledger {
        stage: u32,
        source: memory::LedgerError,
    },
}

/// Everything a prediction produced, for the sinks.
#[derive(Debug)]
pub struct PredictOutput {
    pub prediction: Prediction,
    pub graphs: JobGraphs,
    pub timeline: Timeline,
}

/// A replayed timeline read back as a prediction: step time, MFU, the critical
/// participant's breakdown and each stage's memory (hybrid emulation's timelines, whose
/// participants are live ranks and shared classes, go through here).
pub fn output_for(
    job: &Job,
    net: &str,
    graphs: JobGraphs,
    timeline: Timeline,
) -> Result<PredictOutput, PredictError> {
    let prediction = summarize(job, net, &graphs, &timeline)?;
    Ok(PredictOutput {
        prediction,
        graphs,
        timeline,
    })
}

/// Predicts one training step with the analytical network, replaying one rank per class.
pub fn predict(job: &Job) -> Result<PredictOutput, PredictError> {
    let net = AnalyticalNetwork::new(fabric_for(job), AlgorithmChoice::Auto);
    predict_with(job, &net, ReplayMode::Classes)
}

/// Predicts one training step with any network model and replay mode.
pub fn predict_with<N: NetworkModel>(
    job: &Job,
    net: &N,
    mode: ReplayMode,
) -> Result<PredictOutput, PredictError> {
    let graphs = build(job);
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let timeline = replay::replay(&graphs, &cost, net, mode)?;
    let prediction = summarize(job, net.name(), &graphs, &timeline)?;
    Ok(PredictOutput {
        prediction,
        graphs,
        timeline,
    })
}

fn class_summary(layout: &orrery_graph::Layout) -> Vec<ClassInfo> {
    let mut counts = vec![0u32; layout.num_classes() as usize];
    for r in 0..layout.world_size() {
        counts[layout.class_of(RankId(r)).index()] += 1;
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(c, ranks)| {
            let class = ClassId(c as u32);
            let representative = layout.representative(class);
            ClassInfo {
                class: class.0,
                stage: layout.coords(representative).pp,
                ranks,
                representative,
            }
        })
        .collect()
}

fn summarize(
    job: &Job,
    net: &str,
    graphs: &JobGraphs,
    timeline: &Timeline,
) -> Result<Prediction, PredictError> {
    let step = timeline.step_time();
    let world = job.parallel().world_size();
    let secs = step.as_secs_f64().max(f64::MIN_POSITIVE);
    let model_flops = flops::model_flops(job);
    let peak = job.cluster().gpu.bf16_peak.0;
    let critical = timeline
        .participants
        .iter()
        .enumerate()
        .max_by_key(|(i, p)| (p.end(), std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    let crit = &timeline.participants[critical];
    let breakdown = breakdown::breakdown(graphs.class(crit.class), crit, step);
    // One memory report per stage: the first participant of each class.
    let usable = job.cluster().usable_memory();
    let mut memory = Vec::new();
    for stage in 0..graphs.layout.num_classes() {
        let class = ClassId(stage);
        if let Some(p) = timeline.participants.iter().find(|p| p.class == class) {
            let ledger = memory::ledger(graphs.class(class), p)
                .map_err(|source| PredictError::Ledger { stage, source })?;
            memory.push(StageMemory {
                stage,
                rank: p.rank,
                peak: ledger.peak,
                usable,
                fits: ledger.peak <= usable,
                ledger,
            });
        }
    }
    let mut warnings = job.warnings().to_vec();
    if !graphs.layout.is_regular() {
        warnings.push("groups of one role sit unevenly on nodes; class replay uses the first group's placement for all (replay --all-ranks for the exact answer)".to_string());
    }
    Ok(Prediction {
        job: job.name().to_string(),
        network_model: net.to_string(),
        world_size: world,
        gpu: job.cluster().gpu.name.clone(),
        step_time: step,
        tokens_per_step: job.tokens_per_step(),
        tokens_per_second: job.tokens_per_step() as f64 / secs,
        model_flops,
        tflops_per_gpu: model_flops / secs / world as f64 / 1e12,
        mfu: model_flops / (secs * world as f64 * peak),
        critical_stage: crit.class.0,
        breakdown,
        fits: memory.iter().all(|m| m.fits),
        memory,
        classes: class_summary(&graphs.layout),
        graph_ops: graphs.total_ops(),
        replay_events: timeline.events,
        network_simulation: None,
        warnings,
    })
}
