//! # orrery-spec: what the user asks for, checked once
//!
//! A training job is a model, a training recipe, a parallel layout and a cluster. People
//! write it as TOML (or start from a preset, or import a Hugging Face `config.json`) and
//! tweak it with `--set parallel.tp=4`. This crate turns that raw text into a [`Job`]: a
//! value that has been checked completely, so every later layer can read it without
//! re-checking and without panicking.
//!
//! Key types:
//! - [`JobSpec`] (in [`raw`]): the raw serde mirror of the TOML, every field optional.
//! - [`Job`]: the validated job; the only way to get one is [`Job::from_spec`], which either
//!   succeeds or returns [`SpecErrors`] listing *every* problem with its path
//!   (`parallel.tp`), never just the first.
//! - [`presets`]: built-in GPUs, model shapes and whole jobs.
//! - [`hf`]: import of Hugging Face `config.json` files into a [`raw::ModelSpec`].
//! - [`load_job_spec`] / [`apply_override`]: TOML text plus `key=value` overrides.
//!
//! What this crate deliberately does not do: read files or the environment (the CLI does
//! that and hands text in), or derive anything about performance. Parameter counts and
//! similar shape arithmetic that several layers need live on [`Model`].

pub mod hf;
pub mod presets;
pub mod raw;
mod validate;

pub use presets::GpuArch;
pub use raw::{
    Activation, AttentionKernel, JobSpec, OptimizerKind, PipelineSchedule, Precision, Recompute,
    RoutingKind, TopologyKind,
};
pub use validate::{SpecError, SpecErrors};

use orrery_units::{Bandwidth, Bytes, FlopRate};
use serde::Serialize;

/// A validated job. Construct it with [`Job::from_spec`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Job {
    name: String,
    model: Model,
    training: Training,
    parallel: Parallel,
    cluster: Cluster,
    warnings: Vec<String>,
}

impl Job {
    /// Validates a raw spec, filling presets, and reports every problem at once.
    pub fn from_spec(spec: &JobSpec) -> Result<Job, SpecErrors> {
        validate::validate(spec)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn training(&self) -> &Training {
        &self.training
    }
    pub fn parallel(&self) -> &Parallel {
        &self.parallel
    }
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
    /// Things that are legal but probably not what the user meant (a TP group spanning
    /// nodes, say). The CLI prints them; they never stop a prediction.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    /// Micro-batches each data-parallel replica runs per step.
    pub fn microbatches(&self) -> u64 {
        self.training.global_batch / (self.training.micro_batch * self.parallel.dp)
    }
    /// Tokens per optimizer step across the job.
    pub fn tokens_per_step(&self) -> u64 {
        self.training.global_batch * self.model.seq_len
    }
}

/// Mixture-of-experts shape (validated).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Moe {
    pub experts: u64,
    pub top_k: u64,
    pub expert_ffn: u64,
    pub shared_experts: u64,
    pub first_dense: u64,
    pub every: u64,
}

/// The model shape (validated: every divisibility the layout needs holds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Model {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub seq_len: u64,
    pub activation: Activation,
    pub tied_embeddings: bool,
    pub moe: Option<Moe>,
}

impl Model {
    /// Whether layer `layer` (0-based) has a mixture-of-experts MLP.
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        match &self.moe {
            Some(m) => {
                layer >= m.first_dense && (layer - m.first_dense).is_multiple_of(m.every.max(1))
            }
            None => false,
        }
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> u64 {
        (0..self.layers).filter(|&l| self.is_moe_layer(l)).count() as u64
    }

    /// Width of the query projection (`heads * head_dim`).
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of one of the key or value projections (`kv_heads * head_dim`).
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Parameters of one attention block (QKV, output projection, norm), unsharded.
    pub fn attention_params(&self) -> u64 {
        self.hidden * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * self.hidden + self.hidden
    }

    /// Matrices in one MLP of intermediate size `ffn`: gated activations have three.
    pub fn mlp_matrices(&self) -> u64 {
        match self.activation {
            Activation::Gelu => 2,
            Activation::Swiglu => 3,
        }
    }

    /// Parameters of one dense MLP (plus its norm), unsharded.
    pub fn dense_mlp_params(&self) -> u64 {
        self.mlp_matrices() * self.hidden * self.ffn + self.hidden
    }

    /// Parameters of one routed or shared expert.
    pub fn expert_params(&self) -> u64 {
        match &self.moe {
            Some(m) => self.mlp_matrices() * self.hidden * m.expert_ffn,
            None => 0,
        }
    }

    /// Embedding parameters (input, plus output unless tied).
    pub fn embedding_params(&self) -> u64 {
        let e = self.vocab * self.hidden;
        if self.tied_embeddings {
            e
        } else {
            2 * e
        }
    }

    /// Total parameters.
    pub fn total_params(&self) -> u64 {
        let mut total = self.embedding_params() + self.hidden; // final norm
        for layer in 0..self.layers {
            total += self.attention_params();
            total += match &self.moe {
                Some(m) if self.is_moe_layer(layer) => {
                    (m.experts + m.shared_experts) * self.expert_params()
                        + self.hidden * m.experts
                        + self.hidden
                }
                _ => self.dense_mlp_params(),
            };
        }
        total
    }
}

/// The training recipe (validated).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Training {
    pub global_batch: u64,
    pub micro_batch: u64,
    pub precision: Precision,
    pub recompute: Recompute,
    /// Layers per model chunk that `Recompute::Full` applies to (`None`: all of them).
    pub recompute_layers: Option<u64>,
    pub optimizer: OptimizerKind,
    /// 0-3; 1 is Megatron's distributed optimizer.
    pub zero_stage: u8,
    pub attention: AttentionKernel,
}

/// The parallel layout (validated: `tp * pp * dp * cp` is the world size).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Parallel {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    pub cp: u64,
    pub ep: u64,
    pub vpp: u64,
    /// Sequence parallelism; always false when `tp == 1`, where it is a no-op.
    pub sp: bool,
    pub schedule: PipelineSchedule,
    pub overlap_grad_reduce: bool,
    pub overlap_param_gather: bool,
    pub tp_comm_overlap: bool,
    pub bucket_params: u64,
}

impl Parallel {
    pub fn world_size(&self) -> u64 {
        self.tp * self.pp * self.dp * self.cp
    }
}

/// The GPU (validated).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    pub name: String,
    pub arch: GpuArch,
    pub bf16_peak: FlopRate,
    pub fp8_peak: Option<FlopRate>,
    pub hbm: Bytes,
    pub hbm_bandwidth: Bandwidth,
    /// Per direction.
    pub nvlink_bandwidth: Bandwidth,
}

impl Gpu {
    /// A GPU with a preset's datasheet numbers.
    pub fn from_preset(p: &presets::GpuPreset) -> Gpu {
        Gpu {
            name: p.name.to_string(),
            arch: p.arch,
            bf16_peak: FlopRate::from_tflops(p.bf16_tflops),
            fp8_peak: p.fp8_tflops.map(FlopRate::from_tflops),
            hbm: Bytes::from_gib(p.hbm_gib),
            hbm_bandwidth: Bandwidth::from_gbytes_per_sec(p.hbm_gbps),
            nvlink_bandwidth: Bandwidth::from_gbytes_per_sec(p.nvlink_gbps),
        }
    }
}

/// The cluster (validated).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cluster {
    pub gpu: Gpu,
    pub gpus_per_node: u64,
    pub nodes: u64,
    /// Per GPU per direction.
    pub nic_bandwidth: Bandwidth,
    pub topology: TopologyKind,
    pub oversubscription: f64,
    pub nodes_per_leaf: u64,
    /// All-to-all relayed over NVLink to the GPU on the destination's rail (NCCL's PXN);
    /// `true` only on a rail-optimised topology.
    pub pxn: bool,
    /// How the fabric places flows on equal-cost paths.
    pub routing: RoutingKind,
    /// HBM the allocator cannot use.
    pub memory_reserve: Bytes,
}

impl Cluster {
    /// A rail-optimised cluster of `nodes` nodes of `gpus_per_node` preset GPUs with the
    /// preset's usual NIC and the default memory reserve.
    pub fn of_preset(gpu: &presets::GpuPreset, gpus_per_node: u64, nodes: u64) -> Cluster {
        Cluster {
            gpu: Gpu::from_preset(gpu),
            gpus_per_node: gpus_per_node.max(1),
            nodes: nodes.max(1),
            nic_bandwidth: Bandwidth::from_gbits_per_sec(gpu.default_nic_gbps),
            topology: TopologyKind::RailOptimized,
            oversubscription: 1.0,
            nodes_per_leaf: 16,
            pxn: true,
            routing: RoutingKind::Ecmp,
            memory_reserve: Bytes::from_gib(validate::DEFAULT_RESERVE_GIB),
        }
    }

    pub fn world_size(&self) -> u64 {
        self.gpus_per_node * self.nodes
    }
    /// HBM a rank can fill before it is out of memory.
    pub fn usable_memory(&self) -> Bytes {
        self.gpu.hbm.saturating_sub(self.memory_reserve)
    }
}

/// Why a job text could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("job file is not valid TOML: {0}")]
    Toml(String),
    #[error("override `{text}`: {reason}")]
    Override { text: String, reason: String },
    #[error("unknown job preset `{name}`; known presets: {known}")]
    UnknownPreset { name: String, known: String },
    /// Fields with unknown names or values of the wrong type, every one of them.
    #[error("{0}")]
    Fields(SpecErrors),
}

/// Parses job TOML and applies `key=value` overrides (`parallel.tp=4`) in order.
///
/// Overrides are applied to the TOML tree before it is typed, so an override can set any
/// field a file can, and a typo in an override's key is reported like a typo in the file.
pub fn load_job_spec(text: &str, overrides: &[String]) -> Result<JobSpec, LoadError> {
    let mut tree: toml::Table = toml::from_str(text).map_err(|e| LoadError::Toml(e.to_string()))?;
    for o in overrides {
        apply_override(&mut tree, o)?;
    }
    JobSpec::deserialize_table(tree)
}

impl JobSpec {
    fn deserialize_table(tree: toml::Table) -> Result<JobSpec, LoadError> {
        match toml::Value::Table(tree.clone()).try_into() {
            Ok(spec) => Ok(spec),
            Err(first) => {
                let problems = field_problems::<JobSpec>(&tree, "");
                if problems.is_empty() {
                    // Not attributable to one field (should not happen): report it whole.
                    Err(LoadError::Toml(first.to_string()))
                } else {
                    Err(LoadError::Fields(SpecErrors(problems)))
                }
            }
        }
    }
}

/// Finds every field of a table that does not deserialize into `T`, one field at a time.
///
/// Every field of every spec section is optional, so a table holding a single field
/// deserializes exactly when that field's name is known and its value has the right type.
/// Checking the fields one by one therefore names every bad field at once, where serde alone
/// stops at the first. Sub-tables of the known sections are checked the same way.
fn field_problems<T: serde::de::DeserializeOwned>(
    table: &toml::Table,
    prefix: &str,
) -> Vec<SpecError> {
    let mut out = Vec::new();
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        let mut single = toml::Table::new();
        single.insert(key.clone(), value.clone());
        if let Err(e) = toml::Value::Table(single).try_into::<T>() {
            let nested = match (path.as_str(), value) {
                ("model", toml::Value::Table(t)) => field_problems::<raw::ModelSpec>(t, &path),
                ("training", toml::Value::Table(t)) => {
                    field_problems::<raw::TrainingSpec>(t, &path)
                }
                ("parallel", toml::Value::Table(t)) => {
                    field_problems::<raw::ParallelSpec>(t, &path)
                }
                ("cluster", toml::Value::Table(t)) => field_problems::<raw::ClusterSpec>(t, &path),
                ("model.moe", toml::Value::Table(t)) => field_problems::<raw::MoeSpec>(t, &path),
                _ => Vec::new(),
            };
            if nested.is_empty() {
                out.push(SpecError {
                    path,
                    message: first_line(&e.to_string()),
                });
            } else {
                out.extend(nested);
            }
        }
    }
    out
}

/// The meaningful line of a serde/toml error message (they may carry a source excerpt).
fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or(message)
        .to_string()
}

/// The TOML text of a built-in job, or the list of known names.
pub fn preset_job_text(name: &str) -> Result<&'static str, LoadError> {
    presets::job_toml(name).ok_or_else(|| LoadError::UnknownPreset {
        name: name.to_string(),
        known: presets::JOB_NAMES.join(", "),
    })
}

/// Sets `key.path=value` in a TOML tree. The value is read as a TOML value when it parses
/// as one (`4`, `true`, `2.5`, `"x"`), and as a bare string otherwise (`gpu=H100-SXM`).
pub fn apply_override(tree: &mut toml::Table, text: &str) -> Result<(), LoadError> {
    let fail = |reason: &str| LoadError::Override {
        text: text.to_string(),
        reason: reason.to_string(),
    };
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| fail("expected key=value"))?;
    let key = key.trim();
    let value = value.trim();
    if key.is_empty() {
        return Err(fail("the key is empty"));
    }
    let parsed: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {value}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(value.to_string())),
        Err(_) => toml::Value::String(value.to_string()),
    };
    let parts: Vec<&str> = key.split('.').collect();
    let (last, parents) = parts.split_last().ok_or_else(|| fail("the key is empty"))?;
    let mut table = tree;
    for p in parents {
        if p.is_empty() {
            return Err(fail("the key has an empty segment"));
        }
        let entry = table
            .entry((*p).to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(fail(&format!("`{p}` is not a table"))),
        };
    }
    if last.is_empty() {
        return Err(fail("the key has an empty segment"));
    }
    table.insert((*last).to_string(), parsed);
    Ok(())
}

#[cfg(test)]
mod tests;
