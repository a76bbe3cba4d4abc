//! The raw, unvalidated job description exactly as a person writes it in TOML.
//!
//! Every field is optional here: presets fill gaps, and [`crate::Job::from_spec`] reports
//! every missing or inconsistent field at once. Nothing outside this crate should make
//! decisions on a [`JobSpec`]; validate it into a [`crate::Job`] first.

use serde::{Deserialize, Serialize};

/// A whole job: model, training recipe, parallel layout and cluster.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// A free-form name shown in reports.
    pub name: Option<String>,
    #[serde(default)]
    pub model: ModelSpec,
    #[serde(default)]
    pub training: TrainingSpec,
    #[serde(default)]
    pub parallel: ParallelSpec,
    #[serde(default)]
    pub cluster: ClusterSpec,
}

/// The transformer's shape. `preset` fills every field the file leaves out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub preset: Option<String>,
    pub name: Option<String>,
    pub layers: Option<u64>,
    pub hidden: Option<u64>,
    pub heads: Option<u64>,
    /// Key/value heads (GQA); equal to `heads` for multi-head attention.
    pub kv_heads: Option<u64>,
    /// Per-head dimension; defaults to `hidden / heads`.
    pub head_dim: Option<u64>,
    /// Dense MLP intermediate size.
    pub ffn: Option<u64>,
    pub vocab: Option<u64>,
    pub seq_len: Option<u64>,
    pub activation: Option<Activation>,
    pub tied_embeddings: Option<bool>,
    pub moe: Option<MoeSpec>,
}

/// Mixture-of-experts settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    pub experts: Option<u64>,
    pub top_k: Option<u64>,
    /// Intermediate size of one routed expert.
    pub expert_ffn: Option<u64>,
    /// Always-active shared experts (each of `expert_ffn` size).
    pub shared_experts: Option<u64>,
    /// The first `first_dense` layers use the dense MLP.
    pub first_dense: Option<u64>,
    /// Of the remaining layers, every `every`-th is MoE (1 = all of them).
    pub every: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    Gelu,
    Swiglu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Bf16,
    Fp16,
    /// FP8 GEMMs (Transformer-Engine style), 16-bit everything else.
    Fp8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    /// Recompute the attention core only (Korthikanti et al. 2022).
    Selective,
    /// Keep only each layer's input; recompute the whole layer in backward.
    Full,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adamw,
    Soap,
    Shampoo,
}

/// How attention's core is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// Flash attention: no materialised score matrix, causal work skipped.
    Flash,
    /// Materialised scores with a fused softmax (Megatron-LM before flash attention).
    Unfused,
}

/// The training recipe.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    /// Sequences per optimizer step across the whole job.
    pub global_batch: Option<u64>,
    /// Sequences per micro-batch per data-parallel replica.
    pub micro_batch: Option<u64>,
    pub precision: Option<Precision>,
    pub recompute: Option<Recompute>,
    /// With `recompute = "full"`: recompute only the first N layers of each model chunk and
    /// keep the rest (Megatron's `--recompute-method block --recompute-num-layers N`).
    /// Default: every layer.
    pub recompute_layers: Option<u64>,
    pub optimizer: Option<OptimizerKind>,
    /// ZeRO stage 0-3. Stage 1 is Megatron's distributed optimizer.
    pub zero_stage: Option<u64>,
    /// Megatron's `--use-distributed-optimizer`; the same as `zero_stage = 1`.
    pub distributed_optimizer: Option<bool>,
    pub attention: Option<AttentionKernel>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PipelineSchedule {
    #[serde(rename = "1f1b")]
    OneFOneB,
    #[serde(rename = "interleaved")]
    Interleaved,
}

/// The parallel layout.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    pub tp: Option<u64>,
    pub pp: Option<u64>,
    /// Data-parallel degree; derived from the world size when left out.
    pub dp: Option<u64>,
    pub cp: Option<u64>,
    pub ep: Option<u64>,
    /// Virtual pipeline stages (model chunks) per rank.
    pub vpp: Option<u64>,
    pub sp: Option<bool>,
    pub schedule: Option<PipelineSchedule>,
    /// Overlap the data-parallel gradient reduction with backward.
    pub overlap_grad_reduce: Option<bool>,
    /// Overlap the distributed optimizer's parameter all-gather with forward.
    pub overlap_param_gather: Option<bool>,
    /// Overlap tensor-parallel communication with the GEMMs next to it (Transformer
    /// Engine's userbuffers `tp_comm_overlap`).
    pub tp_comm_overlap: Option<bool>,
    /// Gradient bucket size in millions of parameters (Megatron's default: 40).
    pub bucket_mparams: Option<u64>,
}

/// Switch topology across nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologyKind {
    RailOptimized,
    FatTree,
}

/// How flows are placed on equal-cost paths across the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingKind {
    /// Hash-based equal-cost multi-path (RoCE's default).
    #[default]
    Ecmp,
    /// Paths pinned by the destination's port on its leaf (destination-mod-k).
    Pinned,
}

/// The cluster. `gpu` names a preset; the other GPU fields override it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub gpu: Option<String>,
    pub gpus_per_node: Option<u64>,
    pub nodes: Option<u64>,
    /// NIC bandwidth per GPU in Gb/s (HDR 200, NDR 400).
    pub nic_gbps: Option<f64>,
    pub topology: Option<TopologyKind>,
    /// Fat-tree oversubscription ratio (1 = full bisection).
    pub oversubscription: Option<f64>,
    /// Nodes under one leaf switch of a fat-tree.
    pub nodes_per_leaf: Option<u64>,
    /// Rail-optimised clusters: relay all-to-all blocks over NVLink to the GPU on the
    /// destination's rail (NCCL's PXN; `false` is `NCCL_PXN_DISABLE=1`).
    pub pxn: Option<bool>,
    /// How the fabric places flows on equal-cost paths (`ecmp` or `pinned`).
    pub routing: Option<RoutingKind>,
    /// HBM kept back from the allocator (CUDA context, NCCL buffers, fragmentation), GiB.
    pub memory_reserve_gib: Option<f64>,
    /// Overrides of the GPU preset's datasheet numbers.
    pub peak_tflops: Option<f64>,
    pub hbm_gib: Option<f64>,
    pub hbm_gbps: Option<f64>,
    pub nvlink_gbps: Option<f64>,
}
