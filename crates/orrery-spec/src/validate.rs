//! Raw spec to [`Job`]: fill presets, apply defaults, check everything, report all at once.
//!
//! The checker never stops at the first problem. Each check pushes a [`SpecError`] naming
//! the field's path, and cross-field checks run only on fields that were themselves valid,
//! so one typo does not cascade into a screen of follow-on errors.

use crate::presets;
use crate::raw::{
    AttentionKernel, JobSpec, ModelSpec, MoeSpec, OptimizerKind, PipelineSchedule, Precision,
    Recompute, TopologyKind,
};
use crate::{Cluster, Gpu, Job, Model, Moe, Parallel, Training};
use orrery_units::{Bandwidth, Bytes, FlopRate};
use std::fmt;

/// One problem in a job spec, with the dotted path of the field it concerns.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SpecError {
    pub path: String,
    pub message: String,
}

/// Every problem found in a job spec.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, thiserror::Error)]
pub struct SpecErrors(pub Vec<SpecError>);

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the job has {} problem(s):", self.0.len())?;
        for e in &self.0 {
            write!(f, "\n  {}: {}", e.path, e.message)?;
        }
        Ok(())
    }
}

/// Largest world size orrery accepts; beyond it ids and arenas would need to grow.
const MAX_WORLD: u64 = 1 << 22;
/// Most (micro-batch, layer) passes one pipeline stage may replay: keeps a stage's graph
/// under a few hundred million ops.
const MAX_LAYER_PASSES: u64 = 4_000_000;
/// Largest value accepted for shape fields, to keep all arithmetic far from overflow.
const MAX_DIM: u64 = 1 << 24;
/// Largest parameter count accepted (about 1000x today's largest models), so that parameter
/// and byte arithmetic on a validated model stays far from u64 overflow.
const MAX_PARAMS: f64 = 1e15;

struct Checker {
    errors: Vec<SpecError>,
}

impl Checker {
    fn push(&mut self, path: &str, message: impl Into<String>) {
        self.errors.push(SpecError {
            path: path.to_string(),
            message: message.into(),
        });
    }

    /// A required positive integer within bounds.
    fn positive(&mut self, path: &str, v: Option<u64>) -> Option<u64> {
        match v {
            None => {
                self.push(path, "is required (set it or use a preset)");
                None
            }
            Some(0) => {
                self.push(path, "must be at least 1");
                None
            }
            Some(x) if x > MAX_DIM => {
                self.push(path, format!("is {x}, larger than the supported {MAX_DIM}"));
                None
            }
            Some(x) => Some(x),
        }
    }

    /// An optional positive integer with a default.
    fn positive_or(&mut self, path: &str, v: Option<u64>, default: u64) -> Option<u64> {
        self.positive(path, Some(v.unwrap_or(default)))
    }

    fn divides(&mut self, path: &str, what: &str, d: Option<u64>, n: Option<u64>, n_name: &str) {
        if let (Some(d), Some(n)) = (d, n) {
            if d != 0 && n % d != 0 {
                self.push(path, format!("{what} = {d} must divide {n_name} = {n}"));
            }
        }
    }

    fn positive_f64(&mut self, path: &str, v: f64) -> Option<f64> {
        if v.is_finite() && v > 0.0 {
            Some(v)
        } else {
            self.push(path, format!("must be a positive number, got {v}"));
            None
        }
    }
}

/// Fills `model` from its preset: explicit fields win.
fn merge_model(spec: &ModelSpec, c: &mut Checker) -> ModelSpec {
    let Some(name) = &spec.preset else {
        return spec.clone();
    };
    let Some(base) = presets::model(name) else {
        c.push(
            "model.preset",
            format!(
                "unknown model `{name}`; known: {}",
                presets::MODEL_NAMES.join(", ")
            ),
        );
        return spec.clone();
    };
    let moe = match (&spec.moe, &base.moe) {
        (Some(m), Some(b)) => Some(MoeSpec {
            experts: m.experts.or(b.experts),
            top_k: m.top_k.or(b.top_k),
            expert_ffn: m.expert_ffn.or(b.expert_ffn),
            shared_experts: m.shared_experts.or(b.shared_experts),
            first_dense: m.first_dense.or(b.first_dense),
            every: m.every.or(b.every),
        }),
        (m, b) => m.clone().or_else(|| b.clone()),
    };
    ModelSpec {
        preset: spec.preset.clone(),
        name: spec.name.clone().or(base.name),
        layers: spec.layers.or(base.layers),
        hidden: spec.hidden.or(base.hidden),
        heads: spec.heads.or(base.heads),
        kv_heads: spec.kv_heads.or(base.kv_heads),
        head_dim: spec.head_dim.or(base.head_dim),
        ffn: spec.ffn.or(base.ffn),
        vocab: spec.vocab.or(base.vocab),
        seq_len: spec.seq_len.or(base.seq_len),
        activation: spec.activation.or(base.activation),
        tied_embeddings: spec.tied_embeddings.or(base.tied_embeddings),
        moe,
    }
}

pub(crate) fn validate(spec: &JobSpec) -> Result<Job, crate::SpecErrors> {
    let mut c = Checker { errors: Vec::new() };
    let m = merge_model(&spec.model, &mut c);

    // ---- model ----
    let layers = c.positive("model.layers", m.layers);
    let hidden = c.positive("model.hidden", m.hidden);
    let heads = c.positive("model.heads", m.heads);
    // Left out, kv_heads is heads (MHA): a missing or bad `heads` is then reported once.
    let kv_heads = match m.kv_heads {
        Some(k) => c.positive("model.kv_heads", Some(k)),
        None => heads,
    };
    let vocab = c.positive("model.vocab", m.vocab);
    let seq_len = c.positive("model.seq_len", m.seq_len);
    let ffn = c.positive("model.ffn", m.ffn);
    let head_dim = match m.head_dim {
        Some(d) => c.positive("model.head_dim", Some(d)),
        None => match (hidden, heads) {
            (Some(h), Some(a)) if h % a == 0 => Some(h / a),
            (Some(h), Some(a)) => {
                c.push(
                    "model.heads",
                    format!("heads = {a} must divide hidden = {h} (or set model.head_dim)"),
                );
                None
            }
            _ => None,
        },
    };
    if let (Some(a), Some(k)) = (heads, kv_heads) {
        if a % k != 0 {
            c.push(
                "model.kv_heads",
                format!("kv_heads = {k} must divide heads = {a}"),
            );
        }
    }
    let moe = m.moe.as_ref().and_then(|x| {
        let experts = c.positive("model.moe.experts", x.experts);
        let top_k = c.positive("model.moe.top_k", x.top_k);
        let expert_ffn = match x.expert_ffn {
            Some(f) => c.positive("model.moe.expert_ffn", Some(f)),
            None => ffn,
        };
        let shared_experts = match x.shared_experts {
            Some(s) if s > MAX_DIM => {
                c.push(
                    "model.moe.shared_experts",
                    format!("is {s}, larger than the supported {MAX_DIM}"),
                );
                None
            }
            s => Some(s.unwrap_or(0)),
        };
        let every = c.positive_or("model.moe.every", x.every, 1);
        let first_dense = x.first_dense.unwrap_or(0);
        if let (Some(e), Some(k)) = (experts, top_k) {
            if k > e {
                c.push(
                    "model.moe.top_k",
                    format!("top_k = {k} exceeds experts = {e}"),
                );
            }
        }
        if let Some(l) = layers {
            if first_dense >= l {
                c.push(
                    "model.moe.first_dense",
                    format!("{first_dense} leaves no MoE layer of {l}"),
                );
            }
        }
        Some(Moe {
            experts: experts?,
            top_k: top_k?,
            expert_ffn: expert_ffn?,
            shared_experts: shared_experts?,
            first_dense,
            every: every?,
        })
    });
    // Each shape field is at most MAX_DIM, but their products need not fit in a u64: bound
    // the parameter count so that no arithmetic on a validated model can overflow.
    if let (Some(l), Some(h), Some(a), Some(k), Some(d), Some(f), Some(v)) =
        (layers, hidden, heads, kv_heads, head_dim, ffn, vocab)
    {
        let (l, h, a, k, d, f, v) = (
            l as f64, h as f64, a as f64, k as f64, d as f64, f as f64, v as f64,
        );
        let attention = h * (a * d + 2.0 * k * d) + a * d * h + h;
        let dense = 3.0 * h * f + h;
        let sparse = moe.as_ref().map_or(0.0, |x| {
            (x.experts + x.shared_experts) as f64 * 3.0 * h * x.expert_ffn as f64
                + h * x.experts as f64
                + h
        });
        let bound = l * (attention + dense.max(sparse)) + 2.0 * v * h + h;
        if bound > MAX_PARAMS {
            c.push(
                "model",
                format!(
                    "has about {bound:.3e} parameters, more than the supported {MAX_PARAMS:.0e}"
                ),
            );
        }
    }

    // ---- training ----
    let t = &spec.training;
    let global_batch = c.positive("training.global_batch", t.global_batch);
    let micro_batch = c.positive_or("training.micro_batch", t.micro_batch, 1);
    let precision = t.precision.unwrap_or(Precision::Bf16);
    let recompute = t.recompute.unwrap_or(Recompute::None);
    let optimizer = t.optimizer.unwrap_or(OptimizerKind::Adamw);
    let attention = t.attention.unwrap_or(AttentionKernel::Flash);
    let zero_stage = match (t.zero_stage, t.distributed_optimizer) {
        (Some(z), _) if z > 3 => {
            c.push(
                "training.zero_stage",
                format!("must be 0, 1, 2 or 3, got {z}"),
            );
            None
        }
        (Some(0), Some(true)) => {
            c.push(
                "training.distributed_optimizer",
                "contradicts training.zero_stage = 0",
            );
            None
        }
        (Some(z), _) => Some(z as u8),
        (None, Some(true)) => Some(1),
        (None, _) => Some(0),
    };
    if optimizer != OptimizerKind::Adamw && zero_stage.is_some_and(|z| z > 1) {
        c.push(
            "training.optimizer",
            "SOAP and Shampoo are modelled with ZeRO stage 0 or 1 only",
        );
    }

    // ---- cluster ----
    let cl = &spec.cluster;
    let gpu_name = cl.gpu.clone().unwrap_or_else(|| "H100-SXM".to_string());
    let gpu_preset = presets::gpu(&gpu_name);
    if gpu_preset.is_none() {
        c.push(
            "cluster.gpu",
            format!(
                "unknown GPU `{gpu_name}`; known: {}",
                presets::GPUS
                    .iter()
                    .map(|g| g.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
    let gpus_per_node = c.positive_or("cluster.gpus_per_node", cl.gpus_per_node, 8);
    let nodes = c.positive("cluster.nodes", cl.nodes);
    let gpu = gpu_preset.and_then(|g| {
        let peak = c.positive_f64(
            "cluster.peak_tflops",
            cl.peak_tflops.unwrap_or(g.bf16_tflops),
        );
        let hbm = c.positive_f64("cluster.hbm_gib", cl.hbm_gib.unwrap_or(g.hbm_gib));
        let hbm_bw = c.positive_f64("cluster.hbm_gbps", cl.hbm_gbps.unwrap_or(g.hbm_gbps));
        let nvl = c.positive_f64(
            "cluster.nvlink_gbps",
            cl.nvlink_gbps.unwrap_or(g.nvlink_gbps),
        );
        // An overridden BF16 peak scales the FP8 peak with it, keeping their ratio.
        let fp8 = g
            .fp8_tflops
            .map(|f| FlopRate::from_tflops(f * peak.unwrap_or(g.bf16_tflops) / g.bf16_tflops));
        Some(Gpu {
            name: g.name.to_string(),
            arch: g.arch,
            bf16_peak: FlopRate::from_tflops(peak?),
            fp8_peak: fp8,
            hbm: Bytes::from_gib(hbm?),
            hbm_bandwidth: Bandwidth::from_gbytes_per_sec(hbm_bw?),
            nvlink_bandwidth: Bandwidth::from_gbytes_per_sec(nvl?),
        })
    });
    let nic = c.positive_f64(
        "cluster.nic_gbps",
        cl.nic_gbps
            .unwrap_or_else(|| gpu_preset.map_or(400.0, |g| g.default_nic_gbps)),
    );
    let topology = cl.topology.unwrap_or(TopologyKind::RailOptimized);
    let oversubscription = match cl.oversubscription {
        Some(o) if !(o.is_finite() && o >= 1.0) => {
            c.push(
                "cluster.oversubscription",
                format!("must be at least 1, got {o}"),
            );
            None
        }
        Some(o) => Some(o),
        None => Some(1.0),
    };
    if cl.oversubscription.is_some() && topology != TopologyKind::FatTree {
        c.push(
            "cluster.oversubscription",
            "applies only to topology = \"fat_tree\"",
        );
    }
    let nodes_per_leaf = c.positive_or("cluster.nodes_per_leaf", cl.nodes_per_leaf, 16);
    if cl.pxn.is_some() && topology != TopologyKind::RailOptimized {
        c.push(
            "cluster.pxn",
            "applies only to topology = \"rail_optimized\" (a fat-tree's GPUs share their leaf)",
        );
    }
    let pxn = topology == TopologyKind::RailOptimized && cl.pxn.unwrap_or(true);
    let reserve_gib = cl.memory_reserve_gib.unwrap_or(DEFAULT_RESERVE_GIB);
    let memory_reserve = if reserve_gib.is_finite() && reserve_gib >= 0.0 {
        if let Some(g) = &gpu {
            if Bytes::from_gib(reserve_gib) >= g.hbm {
                c.push(
                    "cluster.memory_reserve_gib",
                    format!("{reserve_gib} GiB leaves no usable HBM"),
                );
            }
        }
        Some(Bytes::from_gib(reserve_gib))
    } else {
        c.push(
            "cluster.memory_reserve_gib",
            format!("must be a non-negative number, got {reserve_gib}"),
        );
        None
    };
    if precision == Precision::Fp8 && gpu.as_ref().is_some_and(|g| g.fp8_peak.is_none()) {
        c.push(
            "training.precision",
            format!("fp8 needs FP8 tensor cores; {gpu_name} has none"),
        );
    }

    // ---- parallel ----
    let p = &spec.parallel;
    let tp = c.positive_or("parallel.tp", p.tp, 1);
    let pp = c.positive_or("parallel.pp", p.pp, 1);
    let cp = c.positive_or("parallel.cp", p.cp, 1);
    let ep = c.positive_or("parallel.ep", p.ep, 1);
    let vpp = c.positive_or("parallel.vpp", p.vpp, 1);
    let world = match (gpus_per_node, nodes) {
        (Some(g), Some(n)) if g.saturating_mul(n) > MAX_WORLD => {
            c.push(
                "cluster.nodes",
                format!("world size {} exceeds the supported {MAX_WORLD}", g * n),
            );
            None
        }
        (Some(g), Some(n)) => Some(g * n),
        _ => None,
    };
    let model_parallel = match (tp, pp, cp) {
        (Some(t), Some(p), Some(c)) => Some(t.saturating_mul(p).saturating_mul(c)),
        _ => None,
    };
    let dp = match (p.dp, world, model_parallel) {
        // Bounded like every other degree, so products with it cannot overflow.
        (Some(d), _, _) if d == 0 || d > MAX_DIM => c.positive("parallel.dp", Some(d)),
        (Some(d), Some(w), Some(mp)) => {
            if d.saturating_mul(mp) != w {
                c.push(
                    "parallel.dp",
                    format!(
                        "tp*pp*dp*cp = {} but the cluster has {w} GPUs",
                        d.saturating_mul(mp)
                    ),
                );
            }
            Some(d)
        }
        (Some(d), _, _) => Some(d),
        (None, Some(w), Some(mp)) => {
            if w % mp != 0 {
                c.push(
                    "parallel",
                    format!("tp*pp*cp = {mp} does not divide the cluster's {w} GPUs, so dp cannot be derived"),
                );
                None
            } else {
                Some(w / mp)
            }
        }
        (None, _, _) => None,
    };
    let schedule = p.schedule.unwrap_or(if vpp.is_some_and(|v| v > 1) {
        PipelineSchedule::Interleaved
    } else {
        PipelineSchedule::OneFOneB
    });
    let sp_requested = p.sp.unwrap_or(tp.is_some_and(|t| t > 1));

    // ---- cross-field checks ----
    c.divides("parallel.tp", "tp", tp, heads, "model.heads");
    c.divides("parallel.tp", "tp", tp, kv_heads, "model.kv_heads");
    c.divides("parallel.tp", "tp", tp, ffn, "model.ffn");
    if let Some(m) = &moe {
        c.divides(
            "parallel.ep",
            "ep",
            Some(ep.unwrap_or(1)),
            Some(m.experts),
            "model.moe.experts",
        );
        c.divides(
            "parallel.tp",
            "tp",
            tp,
            Some(m.expert_ffn),
            "model.moe.expert_ffn",
        );
    } else if ep.is_some_and(|e| e > 1) {
        c.push(
            "parallel.ep",
            "expert parallelism needs a model with [model.moe]",
        );
    }
    if let (Some(e), Some(d), Some(cp)) = (ep, dp, cp) {
        if (d * cp) % e != 0 {
            c.push(
                "parallel.ep",
                format!("ep = {e} must divide dp*cp = {}", d * cp),
            );
        }
    }
    if let (Some(l), Some(p), Some(v)) = (layers, pp, vpp) {
        if l % (p * v) != 0 {
            c.push(
                "model.layers",
                format!("layers = {l} must be divisible by pp*vpp = {}", p * v),
            );
        }
    }
    if let Some(n) = t.recompute_layers {
        if recompute != Recompute::Full {
            c.push(
                "training.recompute_layers",
                "applies only to recompute = \"full\"",
            );
        }
        if let (Some(l), Some(p), Some(v)) = (layers, pp, vpp) {
            if n > l / (p * v).max(1) {
                c.push(
                    "training.recompute_layers",
                    format!(
                        "{n} exceeds the {} layers of a model chunk",
                        l / (p * v).max(1)
                    ),
                );
            }
        }
    }
    if let (Some(v), Some(p)) = (vpp, pp) {
        match schedule {
            PipelineSchedule::OneFOneB if v > 1 => c.push(
                "parallel.schedule",
                format!("vpp = {v} needs schedule = \"interleaved\""),
            ),
            PipelineSchedule::Interleaved if p == 1 => {
                c.push("parallel.schedule", "the interleaved schedule needs pp > 1")
            }
            _ => {}
        }
    }
    let microbatches = match (global_batch, micro_batch, dp) {
        (Some(g), Some(m), Some(d)) => {
            if g % (m * d) != 0 {
                c.push(
                    "training.global_batch",
                    format!(
                        "global_batch = {g} must be divisible by micro_batch*dp = {}",
                        m * d
                    ),
                );
                None
            } else {
                Some(g / (m * d))
            }
        }
        _ => None,
    };
    if let (Some(n), Some(l), Some(p)) = (microbatches, layers, pp) {
        // Each stage's graph has a few dozen ops per layer per micro-batch pass; beyond this
        // bound the replay would need tens of gigabytes.
        let passes = n.saturating_mul(l) / p.max(1);
        if passes > MAX_LAYER_PASSES {
            c.push(
                "training.global_batch",
                format!(
                    "{n} micro-batches per replica over {} layers per stage is {passes} layer passes per stage; orrery replays at most {MAX_LAYER_PASSES} (raise micro_batch or dp)",
                    l / p.max(1)
                ),
            );
        }
    }
    if schedule == PipelineSchedule::Interleaved {
        if let (Some(n), Some(p)) = (microbatches, pp) {
            if n % p != 0 {
                c.push(
                    "training.global_batch",
                    format!("the interleaved schedule needs micro-batches per replica ({n}) divisible by pp = {p}"),
                );
            }
        }
    }
    if let (Some(s), Some(cp)) = (seq_len, cp) {
        if cp > 1 && s % (2 * cp) != 0 {
            c.push(
                "model.seq_len",
                format!(
                    "seq_len = {s} must be divisible by 2*cp = {} (load-balanced CP)",
                    2 * cp
                ),
            );
        }
    }
    let sp = sp_requested && tp.is_some_and(|t| t > 1);
    if let (true, Some(s), Some(t), Some(cp)) = (sp, seq_len, tp, cp) {
        if (s / cp.max(1)) % t != 0 {
            c.push(
                "parallel.sp",
                format!("sequence parallelism needs seq_len/cp divisible by tp = {t}"),
            );
        }
    }
    if attention == AttentionKernel::Unfused && cp.is_some_and(|x| x > 1) {
        c.push(
            "training.attention",
            "context parallelism needs flash attention",
        );
    }

    let mut warnings = Vec::new();
    if let (Some(t), Some(g)) = (tp, gpus_per_node) {
        if t > g {
            warnings.push(format!(
                "tp = {t} spans nodes of {g} GPUs: TP traffic crosses the NIC"
            ));
        }
    }
    if let (Some(n), Some(p)) = (microbatches, pp) {
        if p > 1 && n < p {
            warnings.push(format!(
                "{n} micro-batches for {p} pipeline stages: the bubble dominates"
            ));
        }
    }

    if !c.errors.is_empty() {
        return Err(crate::SpecErrors(c.errors));
    }
    // Every value below was checked above; a None here would mean a check forgot to push an
    // error, which we report instead of panicking.
    let built = (|| {
        let model = Model {
            name: m
                .name
                .clone()
                .or(m.preset.clone())
                .unwrap_or_else(|| "custom".to_string()),
            layers: layers?,
            hidden: hidden?,
            heads: heads?,
            kv_heads: kv_heads?,
            head_dim: head_dim?,
            ffn: ffn?,
            vocab: vocab?,
            seq_len: seq_len?,
            activation: m.activation.unwrap_or(crate::Activation::Swiglu),
            tied_embeddings: m.tied_embeddings.unwrap_or(false),
            moe: moe.clone(),
        };
        let training = Training {
            global_batch: global_batch?,
            micro_batch: micro_batch?,
            precision,
            recompute,
            recompute_layers: t.recompute_layers,
            optimizer,
            zero_stage: zero_stage?,
            attention,
        };
        let parallel = Parallel {
            tp: tp?,
            pp: pp?,
            dp: dp?,
            cp: cp?,
            ep: ep?,
            vpp: vpp?,
            sp,
            schedule,
            overlap_grad_reduce: p.overlap_grad_reduce.unwrap_or(true),
            overlap_param_gather: p.overlap_param_gather.unwrap_or(false),
            tp_comm_overlap: p.tp_comm_overlap.unwrap_or(false) && sp,
            bucket_params: p
                .bucket_mparams
                .unwrap_or(40)
                .saturating_mul(1_000_000)
                .max(1),
        };
        let cluster = Cluster {
            gpu: gpu.clone()?,
            gpus_per_node: gpus_per_node?,
            nodes: nodes?,
            nic_bandwidth: Bandwidth::from_gbits_per_sec(nic?),
            topology,
            oversubscription: oversubscription?,
            nodes_per_leaf: nodes_per_leaf?,
            pxn,
            routing: cl.routing.unwrap_or_default(),
            memory_reserve: memory_reserve?,
        };
        let name = spec.name.clone().unwrap_or_else(|| {
            format!(
                "{} on {} x {}",
                model.name,
                cluster.world_size(),
                cluster.gpu.name
            )
        });
        Some(Job {
            name,
            model,
            training,
            parallel,
            cluster,
            warnings: warnings.clone(),
        })
    })();
    built.ok_or_else(|| {
        crate::SpecErrors(vec![SpecError {
            path: "job".to_string(),
            message: "internal: a field failed validation without an error".to_string(),
        }])
    })
}

/// Default HBM reserve: CUDA context (~0.5 GiB), NCCL and cuBLAS workspaces and allocator
/// fragmentation. PyTorch users typically lose 2-4 GiB of an 80 GiB card to these.
pub const DEFAULT_RESERVE_GIB: f64 = 3.0;
