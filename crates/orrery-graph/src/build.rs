//! Megatron-style training step builder: a [`Job`] becomes one [`ExecGraph`] per class.
//!
//! Each pipeline stage is one symmetry class. Its graph holds, in issue order:
//! static allocations (weights, gradients, optimizer state), the pipeline schedule's
//! forward and backward passes with their tensor-, context- and expert-parallel
//! collectives, point-to-point activations and gradients, activation allocations and frees,
//! the bucketed data-parallel gradient reduction, the optimizer step and the parameter
//! all-gather of the distributed optimizer.
//!
//! Sizes follow Megatron-LM. Activation bytes per layer generalise Korthikanti et al. 2022
//! (Table 2) to grouped-query attention and gated MLPs; with MHA, a 4h GeLU MLP, unfused
//! attention and no recomputation they reduce to `s*b*h*(34 + 5*a*s/h)` exactly (tested).

use crate::ir::{
    CollectiveOp, ComputeKind, ExecGraph, GroupRole, MemoryCategory, Op, OpKind, PeerStage, Phase,
    Stream,
};
use crate::layout::Layout;
use crate::schedule::{stage_order, Pass, Step};
use orrery_spec::{Activation, AttentionKernel, Job, OptimizerKind, Precision, Recompute};
use orrery_units::{Bytes, ClassId, Flops, OpId};

/// The graphs of a whole job: the layout and one graph per symmetry class.
#[derive(Debug, Clone)]
pub struct JobGraphs {
    pub layout: Layout,
    /// Indexed by [`ClassId`].
    pub classes: Vec<ExecGraph>,
}

impl JobGraphs {
    pub fn class(&self, c: ClassId) -> &ExecGraph {
        &self.classes[c.index()]
    }
    pub fn total_ops(&self) -> usize {
        self.classes.iter().map(ExecGraph::len).sum()
    }
}

/// Builds the graphs of one training step of `job`.
pub fn build(job: &Job) -> JobGraphs {
    let layout = Layout::new(job);
    let shape = Shape::new(job);
    let classes = (0..layout.pp)
        .map(|s| StageBuilder::new(job, &shape, u64::from(s)).build())
        .collect();
    JobGraphs { layout, classes }
}

/// Per-rank tensor sizes derived once from the job.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Tokens per micro-batch on one rank (sequence split by CP).
    pub tokens: u64,
    pub mb: u64,
    pub seq_q: u64,
    pub seq: u64,
    pub h: u64,
    pub q: u64,
    pub kv: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub heads: u64,
    pub head_dim: u64,
    pub tp: u64,
    pub cp: u64,
    pub ep: u64,
    pub dp: u64,
    pub pp: u64,
    pub vpp: u64,
    pub sp: bool,
    pub gated: bool,
    pub flash: bool,
    pub fp8: bool,
    pub recompute: Recompute,
    /// Layers at the start of each chunk that full recomputation applies to.
    pub recompute_layers: u64,
    pub layers_per_chunk: u64,
    pub microbatches: u64,
    /// Bytes per gradient element as reduced and stored (fp32 main grads under bf16,
    /// Megatron's default; 16-bit under fp16, the ZeRO paper's accounting).
    pub grad_bytes: u64,
    pub zero_stage: u8,
    pub optimizer: OptimizerKind,
    pub overlap_grad_reduce: bool,
    pub overlap_param_gather: bool,
    pub tp_comm_overlap: bool,
    pub bucket_params: u64,
}

/// Parameters one rank holds and the data-parallel degrees they are sharded over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamShards {
    pub dense: u64,
    pub expert: u64,
    /// Ranks that hold replicas of the dense parameters (DP x CP).
    pub dp_dense: u64,
    /// Ranks that hold replicas of the same experts.
    pub dp_expert: u64,
}

/// Model-state bytes on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelState {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
}

impl ModelState {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer
    }
}

/// Mixed-precision Adam model states under ZeRO (Rajbhandari et al. 2020): 16-bit weights
/// (2 B), gradients of `grad_bytes`, and fp32 master weights plus two moments (12 B).
/// Stage 1 shards the optimizer state over the data-parallel ranks, stage 2 also the
/// gradients, stage 3 also the weights. With `grad_bytes = 2` this is the paper's
/// `(2 + 2 + K) * psi` accounting with K = 12.
pub fn model_state_bytes(p: ParamShards, zero_stage: u8, grad_bytes: u64) -> ModelState {
    let shard = |n: u64, d: u64, on: bool| if on { n.div_ceil(d.max(1)) } else { n };
    let both = |on: bool| shard(p.dense, p.dp_dense, on) + shard(p.expert, p.dp_expert, on);
    ModelState {
        weights: ACT * both(zero_stage >= 3),
        gradients: grad_bytes * both(zero_stage >= 2),
        optimizer: 12 * both(zero_stage >= 1),
    }
}

/// Bytes per element of 16-bit activations.
const ACT: u64 = 2;

impl Shape {
    pub fn new(job: &Job) -> Shape {
        let m = job.model();
        let t = job.training();
        let p = job.parallel();
        Shape {
            tokens: t.micro_batch * m.seq_len / p.cp,
            mb: t.micro_batch,
            seq_q: m.seq_len / p.cp,
            seq: m.seq_len,
            h: m.hidden,
            q: m.q_dim(),
            kv: m.kv_dim(),
            ffn: m.ffn,
            vocab: m.vocab,
            heads: m.heads,
            head_dim: m.head_dim,
            tp: p.tp,
            cp: p.cp,
            ep: p.ep,
            dp: p.dp,
            pp: p.pp,
            vpp: p.vpp,
            sp: p.sp,
            gated: m.activation == Activation::Swiglu,
            flash: t.attention == AttentionKernel::Flash,
            fp8: t.precision == Precision::Fp8,
            recompute: t.recompute,
            recompute_layers: t.recompute_layers.unwrap_or(m.layers / (p.pp * p.vpp)),
            layers_per_chunk: m.layers / (p.pp * p.vpp),
            microbatches: job.microbatches(),
            grad_bytes: if t.precision == Precision::Fp16 { 2 } else { 4 },
            zero_stage: t.zero_stage,
            optimizer: t.optimizer,
            overlap_grad_reduce: p.overlap_grad_reduce,
            overlap_param_gather: p.overlap_param_gather,
            tp_comm_overlap: p.tp_comm_overlap,
            bucket_params: p.bucket_params,
        }
    }

    /// Activation elements of a `[tokens, h]` tensor where sequence parallelism shards it.
    fn seq_sharded(&self, elems: u64) -> u64 {
        if self.sp {
            elems / self.tp
        } else {
            elems
        }
    }

    /// How layer `layer` (global index) is recomputed: full recomputation covers only the
    /// first `recompute_layers` layers of each model chunk; the others keep everything.
    pub fn layer_recompute(&self, layer: u64) -> Recompute {
        match self.recompute {
            Recompute::Full if layer % self.layers_per_chunk.max(1) >= self.recompute_layers => {
                Recompute::None
            }
            r => r,
        }
    }

    /// Bytes one layer stashes for backward under the job's recomputation setting.
    pub fn layer_activation_bytes(&self, moe: Option<&orrery_spec::Moe>) -> Bytes {
        self.activation_bytes(moe, self.recompute)
    }

    /// Bytes one layer stashes for backward (Korthikanti et al. 2022, generalised).
    pub fn activation_bytes(&self, moe: Option<&orrery_spec::Moe>, recompute: Recompute) -> Bytes {
        let th = self.tokens * self.h;
        match recompute {
            // Only the layer input is kept (sequence-sharded under SP).
            Recompute::Full => return Bytes(ACT * self.seq_sharded(th)),
            Recompute::None | Recompute::Selective => {}
        }
        // Unsharded under plain TP: QKV input 2, attention dropout mask 1, MLP input 2, MLP
        // dropout mask 1, two LayerNorm inputs 4 (all per token per hidden unit).
        let unsharded = 10 * th;
        // Sharded by TP: Q, K, V and the projection input; the MLP's intermediate tensors.
        let attn = ACT * self.tokens * (2 * self.q + 2 * self.kv);
        let mlp = match moe {
            None => self.mlp_activation(self.tokens, self.ffn),
            Some(m) => {
                // Routed tokens: dispatched input plus the experts' intermediates, and the
                // shared experts as a dense MLP.
                let routed = self.tokens * m.top_k;
                ACT * routed * self.h * self.tp
                    + self.mlp_activation(routed, m.expert_ffn)
                    + self.mlp_activation(self.tokens, m.shared_experts * m.expert_ffn)
            }
        };
        let scores = if self.flash || recompute == Recompute::Selective {
            0
        } else {
            5 * self.mb * self.heads * self.seq_q * self.seq
        };
        Bytes(self.seq_sharded(unsharded) + (attn + mlp + scores) / self.tp)
    }

    /// Intermediate activations of an MLP of width `ffn` over `tokens` (unsharded bytes):
    /// the fc1 output (twice as wide when gated) and the activation output.
    fn mlp_activation(&self, tokens: u64, ffn: u64) -> u64 {
        let fc1_out = if self.gated { 2 * ffn } else { ffn };
        ACT * tokens * (fc1_out + ffn)
    }

    /// Parameters of one dense or MoE layer held by one rank (TP- and EP-sharded), split
    /// into (dense, expert) parts since they are reduced over different groups.
    pub fn layer_params(&self, moe: Option<&orrery_spec::Moe>) -> (u64, u64) {
        let norms = 2 * self.h;
        let attn = (self.h * (self.q + 2 * self.kv) + self.q * self.h) / self.tp;
        let mats = if self.gated { 3 } else { 2 };
        match moe {
            None => (norms + attn + mats * self.h * self.ffn / self.tp, 0),
            Some(m) => {
                let expert = mats * self.h * m.expert_ffn / self.tp;
                let shared = m.shared_experts * expert;
                let router = self.h * m.experts;
                (
                    norms + attn + shared + router,
                    (m.experts / self.ep) * expert,
                )
            }
        }
    }
}

/// Builds one stage's graph.
struct StageBuilder<'a> {
    job: &'a Job,
    s: &'a Shape,
    stage: u64,
    g: ExecGraph,
    /// Per chunk: the layer indices (global) it holds.
    chunk_layers: Vec<Vec<u64>>,
    /// Per chunk: activation allocation of each in-flight micro-batch.
    act_alloc: Vec<Vec<Option<OpId>>>,
    /// Per chunk: the micro-batch whose backward is the chunk's last (gradients final).
    last_bwd_mb: Vec<u32>,
    /// Parameter all-gather ops each chunk's first forward waits for (by layer).
    param_gather_dep: Vec<Vec<Option<OpId>>>,
    /// Gradient reductions issued so far, which the optimizer step waits for.
    grad_reductions: Vec<OpId>,
    /// Pending gradient elements not yet in a bucket: (dense, expert).
    pending: (u64, u64),
    microbatch: Option<u32>,
    /// The most recently issued compute op (program order for streamless events).
    last_compute: Option<OpId>,
    /// Per micro-batch, the output layer's state between its forward and backward.
    loss: Vec<Option<LossHead>>,
}

/// The output layer of one micro-batch between forward and backward.
#[derive(Debug, Clone, Copy)]
struct LossHead {
    /// The fp32 logits buffer, freed by the backward.
    logits: OpId,
    /// What the loss's backward waits for (the vocab-parallel reductions).
    loss: OpId,
}

impl<'a> StageBuilder<'a> {
    fn new(job: &'a Job, s: &'a Shape, stage: u64) -> StageBuilder<'a> {
        let v = s.vpp;
        let chunk_layers = (0..v)
            .map(|c| {
                let vstage = c * s.pp + stage;
                (vstage * s.layers_per_chunk..(vstage + 1) * s.layers_per_chunk).collect()
            })
            .collect();
        let order = stage_order(stage as u32, s.pp as u32, s.microbatches as u32, v as u32);
        let mut last_bwd_mb = vec![0u32; v as usize];
        for st in &order {
            if st.pass == Pass::Backward {
                last_bwd_mb[st.chunk as usize] = st.microbatch;
            }
        }
        StageBuilder {
            job,
            s,
            stage,
            g: ExecGraph::new(),
            chunk_layers,
            act_alloc: vec![vec![None; s.microbatches as usize]; v as usize],
            last_bwd_mb,
            param_gather_dep: vec![vec![None; s.layers_per_chunk as usize]; v as usize],
            grad_reductions: Vec::new(),
            pending: (0, 0),
            microbatch: None,
            last_compute: None,
            loss: vec![None; s.microbatches as usize],
        }
    }

    fn moe_of(&self, layer: u64) -> Option<&'a orrery_spec::Moe> {
        let m = self.job.model();
        if m.is_moe_layer(layer) {
            m.moe.as_ref()
        } else {
            None
        }
    }

    fn vstage(&self, chunk: u32) -> u64 {
        u64::from(chunk) * self.s.pp + self.stage
    }
    fn is_first_vstage(&self, chunk: u32) -> bool {
        self.vstage(chunk) == 0
    }
    fn is_last_vstage(&self, chunk: u32) -> bool {
        self.vstage(chunk) == self.s.pp * self.s.vpp - 1
    }

    // ---- op helpers ----

    fn push(
        &mut self,
        kind: OpKind,
        stream: Stream,
        phase: Phase,
        name: &str,
        deps: &[OpId],
    ) -> OpId {
        let name = self.g.intern(name);
        let mut deps: Vec<OpId> = deps.to_vec();
        // Events off the streams (receives, allocations, frees) happen in program order:
        // not before the compute op issued just before them.
        let streamless = matches!(
            kind,
            OpKind::Recv { .. } | OpKind::Alloc { .. } | OpKind::Free { .. }
        );
        if streamless {
            deps.extend(self.last_compute);
        }
        deps.sort_unstable();
        deps.dedup();
        let id = self.g.push(Op {
            kind,
            stream,
            phase,
            deps,
            name,
            microbatch: self.microbatch,
        });
        if matches!(kind, OpKind::Compute { .. }) {
            self.last_compute = Some(id);
        }
        id
    }

    fn gemm(
        &mut self,
        name: &str,
        phase: Phase,
        (m, n, k): (u64, u64, u64),
        batch: u64,
        deps: &[OpId],
    ) -> OpId {
        let flops = Flops(2.0 * m as f64 * n as f64 * k as f64 * batch as f64);
        // Operands and result in 16-bit, each touched once.
        let bytes = Bytes(ACT * batch * (m * k + k * n + m * n));
        let kind = ComputeKind::Gemm {
            m,
            n,
            k,
            batch,
            fp8: self.s.fp8,
        };
        self.push(
            OpKind::Compute { kind, flops, bytes },
            Stream::Compute,
            phase,
            name,
            deps,
        )
    }

    fn mem(&mut self, name: &str, phase: Phase, bytes: u64, deps: &[OpId]) -> OpId {
        let kind = OpKind::Compute {
            kind: ComputeKind::MemoryBound,
            flops: Flops(0.0),
            bytes: Bytes(bytes),
        };
        self.push(kind, Stream::Compute, phase, name, deps)
    }

    fn coll(
        &mut self,
        name: &str,
        phase: Phase,
        op: CollectiveOp,
        group: GroupRole,
        bytes: u64,
        deps: &[OpId],
    ) -> Option<OpId> {
        let size = match group {
            GroupRole::Tp => self.s.tp,
            GroupRole::Cp => self.s.cp,
            GroupRole::Dp => self.s.dp,
            GroupRole::DpCp => self.s.dp * self.s.cp,
            GroupRole::Ep => self.s.ep,
            GroupRole::ExpertDp => self.s.dp * self.s.cp / self.s.ep,
            GroupRole::Embedding => self.s.pp.min(2),
            GroupRole::World => self.s.tp * self.s.cp * self.s.dp * self.s.pp,
        };
        if size <= 1 || bytes == 0 {
            return None;
        }
        let stream = group.stream();
        Some(self.push(
            OpKind::Collective {
                op,
                group,
                bytes: Bytes(bytes),
            },
            stream,
            phase,
            name,
            deps,
        ))
    }

    fn alloc(
        &mut self,
        name: &str,
        phase: Phase,
        bytes: u64,
        category: MemoryCategory,
        deps: &[OpId],
    ) -> OpId {
        self.push(
            OpKind::Alloc {
                bytes: Bytes(bytes),
                category,
            },
            Stream::Compute,
            phase,
            name,
            deps,
        )
    }

    fn free(&mut self, name: &str, phase: Phase, alloc: OpId, deps: &[OpId]) -> OpId {
        self.push(OpKind::Free { alloc }, Stream::Compute, phase, name, deps)
    }

    // ---- the step ----

    fn build(mut self) -> ExecGraph {
        self.static_memory();
        let v = self.s.vpp as u32;
        if self.s.zero_stage >= 1 && self.s.overlap_param_gather {
            self.param_gather(true);
        }
        let order = stage_order(
            self.stage as u32,
            self.s.pp as u32,
            self.s.microbatches as u32,
            v,
        );
        for st in order {
            self.microbatch = Some(st.microbatch);
            match st.pass {
                Pass::Forward => self.forward(st),
                Pass::Backward => self.backward(st),
            }
        }
        self.microbatch = None;
        self.flush_grad_bucket(&[], true);
        self.optimizer_step();
        self.g
    }

    fn rank_params(&self) -> (u64, u64) {
        let mut dense = 0;
        let mut expert = 0;
        for c in 0..self.s.vpp as u32 {
            for &l in &self.chunk_layers[c as usize] {
                let (d, e) = self.s.layer_params(self.moe_of(l));
                dense += d;
                expert += e;
            }
            if self.is_first_vstage(c) {
                dense += self.s.vocab * self.s.h / self.s.tp;
            }
            if self.is_last_vstage(c) {
                dense += self.s.h; // final norm
                let tied_shared = self.job.model().tied_embeddings && self.s.pp == 1;
                if !tied_shared {
                    dense += self.s.vocab * self.s.h / self.s.tp;
                }
            }
        }
        (dense, expert)
    }

    fn static_memory(&mut self) {
        let (dense, expert) = self.rank_params();
        let dp_dense = self.s.dp * self.s.cp;
        let mut state = model_state_bytes(
            ParamShards {
                dense,
                expert,
                dp_dense,
                dp_expert: dp_dense / self.s.ep,
            },
            self.s.zero_stage,
            self.s.grad_bytes,
        );
        if self.s.optimizer != OptimizerKind::Adamw {
            state.optimizer += self.preconditioner_bytes();
        }
        let p = Phase::Optimizer;
        self.alloc("weights", p, state.weights, MemoryCategory::Weights, &[]);
        self.alloc(
            "gradients",
            p,
            state.gradients,
            MemoryCategory::Gradients,
            &[],
        );
        self.alloc(
            "optimizer-state",
            p,
            state.optimizer,
            MemoryCategory::OptimizerState,
            &[],
        );
    }

    /// The weight matrices of one layer as (rows, cols) on this rank, for second-order
    /// optimizers whose state grows with each matrix's dimensions.
    fn layer_matrices(&self, moe: Option<&orrery_spec::Moe>) -> Vec<(u64, u64, u64)> {
        let s = self.s;
        let mats = if s.gated { 2 } else { 1 };
        let mut out = vec![(s.h, (s.q + 2 * s.kv) / s.tp, 1), (s.q / s.tp, s.h, 1)];
        match moe {
            None => {
                out.push((s.h, mats * s.ffn / s.tp, 1));
                out.push((s.ffn / s.tp, s.h, 1));
            }
            Some(m) => {
                let n = m.experts / s.ep + m.shared_experts;
                out.push((s.h, mats * m.expert_ffn / s.tp, n));
                out.push((m.expert_ffn / s.tp, s.h, n));
            }
        }
        out
    }

    /// SOAP/Shampoo state beyond Adam's: per matrix two fp32 factor statistics and two
    /// eigenbases (each side capped at 8192 by blocking), sharded like optimizer state.
    fn preconditioner_bytes(&self) -> u64 {
        let mut total = 0u64;
        for c in 0..self.s.vpp as usize {
            for &l in &self.chunk_layers[c] {
                for (r, c_, n) in self.layer_matrices(self.moe_of(l)) {
                    let (r, c_) = (r.min(8192), c_.min(8192));
                    total += n * 4 * 2 * (r * r + c_ * c_);
                }
            }
        }
        if self.s.zero_stage >= 1 {
            total.div_ceil(self.s.dp * self.s.cp)
        } else {
            total
        }
    }

    /// Bucketed all-gather of updated parameters (distributed optimizer). With `at_start`
    /// the gathers are issued at the start of the step and the first forward of each layer
    /// waits for its bucket, modelling Megatron's overlap of the gather with forward in the
    /// steady state; otherwise they follow the optimizer step on the critical path.
    fn param_gather(&mut self, at_start: bool) {
        let phase = Phase::Optimizer;
        let deps: Vec<OpId> = if at_start {
            Vec::new()
        } else {
            self.g
                .len()
                .checked_sub(1)
                .map(OpId::from_index)
                .into_iter()
                .collect()
        };
        for c in 0..self.s.vpp as usize {
            let mut pending = 0u64;
            let mut waiting: Vec<usize> = Vec::new();
            let layers = self.chunk_layers[c].clone();
            for (i, &l) in layers.iter().enumerate() {
                let (d, e) = self.s.layer_params(self.moe_of(l));
                pending += d + e;
                waiting.push(i);
                let last = i + 1 == layers.len();
                if pending >= self.s.bucket_params || last {
                    let bytes = ACT * pending;
                    let id = self.coll(
                        "param-all-gather",
                        phase,
                        CollectiveOp::AllGather,
                        GroupRole::DpCp,
                        bytes,
                        &deps,
                    );
                    for &w in &waiting {
                        self.param_gather_dep[c][w] = id;
                    }
                    pending = 0;
                    waiting.clear();
                }
            }
        }
    }

    fn forward(&mut self, st: Step) {
        let s = self.s;
        let c = st.chunk;
        let ph = Phase::Forward;
        let p2p_bytes = ACT * s.seq_sharded(s.tokens * s.h);
        let vs = self.vstage(c);
        let mut x: Vec<OpId> = Vec::new();
        if !self.is_first_vstage(c) {
            let tag = tag(Pass::Forward, st.microbatch, vs - 1);
            let r = self.push(
                OpKind::Recv {
                    peer: PeerStage::Prev,
                    bytes: Bytes(p2p_bytes),
                    tag,
                },
                Stream::PpComm,
                ph,
                "recv-act",
                &[],
            );
            x.push(r);
        }
        // The activation stash of this (micro-batch, chunk).
        let mut stash: u64 = self.chunk_layers[c as usize]
            .iter()
            .map(|&l| {
                self.s
                    .activation_bytes(self.moe_of(l), self.s.layer_recompute(l))
                    .0
            })
            .sum();
        if self.is_first_vstage(c) {
            // Embedding dropout mask (Korthikanti: s*b*h*p/t over p in-flight micro-batches).
            stash += s.tokens * s.h / s.tp;
        }
        let a = self.alloc("activations", ph, stash, MemoryCategory::Activations, &x);
        self.act_alloc[c as usize][st.microbatch as usize] = Some(a);
        if self.is_first_vstage(c) {
            let e = self.mem("embedding", ph, 2 * ACT * s.tokens * s.h, &x);
            let red = if s.sp {
                CollectiveOp::ReduceScatter
            } else {
                CollectiveOp::AllReduce
            };
            x = vec![e];
            if let Some(r) = self.coll(
                "embedding-reduce",
                ph,
                red,
                GroupRole::Tp,
                ACT * s.tokens * s.h,
                &[e],
            ) {
                x = vec![r];
            }
        }
        let layers = self.chunk_layers[c as usize].clone();
        for (i, &l) in layers.iter().enumerate() {
            if st.microbatch == 0 {
                if let Some(gather) = self.param_gather_dep[c as usize][i] {
                    x.push(gather);
                }
                if s.zero_stage >= 3 {
                    x.extend(self.zero3_gather(l, ph, &x.clone()));
                }
            } else if s.zero_stage >= 3 {
                x.extend(self.zero3_gather(l, ph, &x.clone()));
            }
            x = self.layer_forward(l, ph, &x);
        }
        if self.is_last_vstage(c) {
            let head = self.lm_head_forward(&x);
            self.loss[st.microbatch as usize] = Some(head);
        } else {
            let tag = tag(Pass::Forward, st.microbatch, vs);
            let act = OpKind::Send {
                peer: PeerStage::Next,
                bytes: Bytes(p2p_bytes),
                tag,
            };
            self.push(act, Stream::PpComm, ph, "send-act", &x);
        }
    }

    fn zero3_gather(&mut self, layer: u64, phase: Phase, deps: &[OpId]) -> Option<OpId> {
        let (d, e) = self.s.layer_params(self.moe_of(layer));
        self.coll(
            "zero3-param-gather",
            phase,
            CollectiveOp::AllGather,
            GroupRole::DpCp,
            ACT * (d + e),
            deps,
        )
    }

    /// One transformer layer's forward; returns the ops the next layer waits for.
    fn layer_forward(&mut self, layer: u64, ph: Phase, x: &[OpId]) -> Vec<OpId> {
        let s = self.s;
        let e_norm = s.seq_sharded(s.tokens * s.h);
        let ln1 = self.mem(&format!("L{layer}.ln1"), ph, 2 * ACT * e_norm, x);
        let qkv = self.column_linear(&format!("L{layer}.qkv"), ph, s.q + 2 * s.kv, s.h, ln1);
        let attn = self.attention(layer, ph, false, &qkv);
        let proj = self.row_linear(&format!("L{layer}.proj"), ph, s.h, s.q, &attn);
        let res1 = self.mem(&format!("L{layer}.residual1"), ph, 7 * e_norm, &proj);
        let ln2 = self.mem(&format!("L{layer}.ln2"), ph, 2 * ACT * e_norm, &[res1]);
        let mlp_out = match self.moe_of(layer) {
            None => self.dense_mlp_forward(layer, ph, ln2),
            Some(m) => self.moe_forward(layer, ph, ln2, m),
        };
        let res2 = self.mem(&format!("L{layer}.residual2"), ph, 7 * e_norm, &mlp_out);
        vec![res2]
    }

    /// A column-parallel linear `[tokens, k] x [k, n/tp]`, with the sequence-parallel
    /// all-gather of its input in front. Returns what its consumers wait for.
    fn column_linear(&mut self, name: &str, ph: Phase, n: u64, k: u64, input: OpId) -> Vec<OpId> {
        let s = self.s;
        let g = self.tp_gather(&format!("{name}-ag"), ph, input);
        let gemm = self.gemm(name, ph, (s.tokens, n / s.tp, k), 1, &g.deps);
        g.join(gemm)
    }

    /// A row-parallel linear `[tokens, k/tp] x [k/tp, n]` followed by the TP reduction of
    /// its output (reduce-scatter under SP, all-reduce otherwise).
    fn row_linear(&mut self, name: &str, ph: Phase, n: u64, k: u64, deps: &[OpId]) -> Vec<OpId> {
        let s = self.s;
        let gemm = self.gemm(name, ph, (s.tokens, n, k / s.tp), 1, deps);
        self.tp_reduce(&format!("{name}-rs"), ph, gemm)
    }

    /// Backward of a row-parallel linear: gather the output gradient (SP), then the data
    /// and weight gradients.
    fn row_linear_backward(&mut self, name: &str, n: u64, k: u64, grad: OpId) -> Vec<OpId> {
        let s = self.s;
        let ph = Phase::Backward;
        let g = self.tp_gather(&format!("{name}-grad-ag"), ph, grad);
        let dgrad = self.gemm(
            &format!("{name}-dgrad"),
            ph,
            (s.tokens, k / s.tp, n),
            1,
            &g.deps,
        );
        let wgrad = self.gemm(
            &format!("{name}-wgrad"),
            ph,
            (k / s.tp, n, s.tokens),
            1,
            &g.join(dgrad),
        );
        vec![dgrad, wgrad]
    }

    /// Backward of a column-parallel linear: the data gradient, whose TP reduction Megatron
    /// overlaps with the weight gradient, and the input gather (SP) the weight gradient needs.
    fn column_linear_backward(&mut self, name: &str, n: u64, k: u64, deps: &[OpId]) -> Vec<OpId> {
        let s = self.s;
        let ph = Phase::Backward;
        let dgrad = self.gemm(
            &format!("{name}-dgrad"),
            ph,
            (s.tokens, k, n / s.tp),
            1,
            deps,
        );
        let reduce = self.tp_reduce_after(&format!("{name}-rs"), ph, dgrad);
        let input = self.tp_gather(&format!("{name}-in-ag"), ph, dgrad);
        let wgrad = self.gemm(
            &format!("{name}-wgrad"),
            ph,
            (k, n / s.tp, s.tokens),
            1,
            &input.deps,
        );
        let mut out = input.join(wgrad);
        out.extend(reduce);
        out
    }

    fn dense_mlp_forward(&mut self, layer: u64, ph: Phase, ln2: OpId) -> Vec<OpId> {
        let s = self.s;
        let width = if s.gated { 2 * s.ffn } else { s.ffn };
        let fc1 = self.column_linear(&format!("L{layer}.fc1"), ph, width, s.h, ln2);
        let act_bytes = ACT * s.tokens * (width + s.ffn) / s.tp;
        let act = self.mem(&format!("L{layer}.act"), ph, act_bytes, &fc1);
        self.row_linear(&format!("L{layer}.fc2"), ph, s.h, s.ffn, &[act])
    }

    fn moe_forward(&mut self, layer: u64, ph: Phase, ln2: OpId, m: &orrery_spec::Moe) -> Vec<OpId> {
        let s = self.s;
        let t = s.tokens;
        let fc1_in = self.tp_gather(&format!("L{layer}.moe-ag"), ph, ln2);
        let router = self.gemm(
            &format!("L{layer}.router"),
            ph,
            (t, m.experts, s.h),
            1,
            &fc1_in.deps,
        );
        let after = fc1_in.join(router);
        let routed = t * m.top_k;
        let a2a_bytes = ACT * routed * s.h;
        let topk = self.mem(
            &format!("L{layer}.topk"),
            ph,
            4 * t * m.experts + 2 * a2a_bytes,
            &after,
        );
        let dispatch = self.coll(
            &format!("L{layer}.dispatch"),
            ph,
            CollectiveOp::AllToAll,
            GroupRole::Ep,
            a2a_bytes,
            &[topk],
        );
        let local_experts = (m.experts / s.ep).max(1);
        let per_expert = routed.div_ceil(local_experts);
        let width = if s.gated {
            2 * m.expert_ffn
        } else {
            m.expert_ffn
        };
        let deps: Vec<OpId> = dispatch.into_iter().chain([topk]).collect();
        let fc1 = self.gemm(
            &format!("L{layer}.expert-fc1"),
            ph,
            (per_expert, width / s.tp, s.h),
            local_experts,
            &deps,
        );
        let act = self.mem(
            &format!("L{layer}.expert-act"),
            ph,
            ACT * routed * (width + m.expert_ffn) / s.tp,
            &[fc1],
        );
        let fc2 = self.gemm(
            &format!("L{layer}.expert-fc2"),
            ph,
            (per_expert, s.h, m.expert_ffn / s.tp),
            local_experts,
            &[act],
        );
        let mut out = vec![fc2];
        if m.shared_experts > 0 {
            let f = m.shared_experts * m.expert_ffn;
            let w = if s.gated { 2 * f } else { f };
            let sfc1 = self.gemm(
                &format!("L{layer}.shared-fc1"),
                ph,
                (t, w / s.tp, s.h),
                1,
                &after,
            );
            let sact = self.mem(
                &format!("L{layer}.shared-act"),
                ph,
                ACT * t * (w + f) / s.tp,
                &[sfc1],
            );
            out.push(self.gemm(
                &format!("L{layer}.shared-fc2"),
                ph,
                (t, s.h, f / s.tp),
                1,
                &[sact],
            ));
        }
        let combine = self.coll(
            &format!("L{layer}.combine"),
            ph,
            CollectiveOp::AllToAll,
            GroupRole::Ep,
            a2a_bytes,
            &out,
        );
        let deps: Vec<OpId> = combine.into_iter().chain(out).collect();
        let merged = self.mem(&format!("L{layer}.moe-combine"), ph, 2 * a2a_bytes, &deps);
        self.tp_reduce(&format!("L{layer}.moe-rs"), ph, merged)
    }

    /// The attention core, with context parallelism's K/V exchange overlapped with it.
    ///
    /// Ring attention passes each rank's K/V chunk around the CP ring in `cp - 1` steps, each
    /// overlapped with the attention over the chunk already present. Every rank sends and
    /// receives exactly what an all-gather of K/V moves, so the exchange is modelled as one
    /// all-gather on the CP stream running concurrently with the attention kernel (and, in
    /// backward, a reduce-scatter of dK/dV); the per-step synchronisation of the real ring
    /// is not modelled.
    fn attention(&mut self, layer: u64, ph: Phase, backward: bool, deps: &[OpId]) -> Vec<OpId> {
        let s = self.s;
        let heads = s.heads / s.tp;
        let causal_factor = if s.flash { 0.5 } else { 1.0 };
        let fwd_flops = 4.0 * (s.mb * heads * s.seq_q * s.seq * s.head_dim) as f64 * causal_factor;
        let flops = if backward { 2.5 * fwd_flops } else { fwd_flops };
        let io = ACT * s.tokens * (2 * s.q + 2 * s.kv) / s.tp;
        let scores = s.mb * heads * s.seq_q * s.seq;
        // Unfused attention materialises scores: scale-mask-softmax and dropout passes
        // (read 2 + write 2 bytes each, plus a 1-byte dropout mask).
        let bytes = if s.flash {
            io
        } else {
            io + 9 * scores * if backward { 2 } else { 1 }
        };
        let kind = ComputeKind::Attention {
            batch: s.mb,
            heads,
            seq_q: s.seq_q,
            seq_kv: s.seq,
            head_dim: s.head_dim,
            causal: true,
            flash: s.flash,
            backward,
        };
        let name = if backward {
            format!("L{layer}.attn-bwd")
        } else {
            format!("L{layer}.attn")
        };
        let a = self.push(
            OpKind::Compute {
                kind,
                flops: Flops(flops),
                bytes: Bytes(bytes),
            },
            Stream::Compute,
            ph,
            &name,
            deps,
        );
        let kv_bytes = ACT * s.mb * s.seq * 2 * s.kv / s.tp;
        let mut out = vec![a];
        if let Some(x) = self.coll(
            &format!("L{layer}.cp-kv"),
            ph,
            CollectiveOp::AllGather,
            GroupRole::Cp,
            kv_bytes,
            deps,
        ) {
            out.push(x);
        }
        if backward {
            if let Some(x) = self.coll(
                &format!("L{layer}.cp-dkv"),
                ph,
                CollectiveOp::ReduceScatter,
                GroupRole::Cp,
                kv_bytes,
                deps,
            ) {
                out.push(x);
            }
        }
        out
    }

    /// The TP all-gather before a column-parallel GEMM (sequence parallelism only).
    fn tp_gather(&mut self, name: &str, ph: Phase, input: OpId) -> Gather {
        let s = self.s;
        if !s.sp {
            return Gather {
                deps: vec![input],
                overlapped: None,
            };
        }
        let bytes = ACT * s.tokens * s.h;
        match self.coll(
            name,
            ph,
            CollectiveOp::AllGather,
            GroupRole::Tp,
            bytes,
            &[input],
        ) {
            // With TP-comm overlap the gather is chunked and pipelined with the GEMM: both
            // start together and whatever follows waits for both.
            Some(ag) if s.tp_comm_overlap => Gather {
                deps: vec![input],
                overlapped: Some(ag),
            },
            Some(ag) => Gather {
                deps: vec![ag],
                overlapped: None,
            },
            None => Gather {
                deps: vec![input],
                overlapped: None,
            },
        }
    }

    /// The TP reduction after a row-parallel GEMM: reduce-scatter (SP) or all-reduce.
    fn tp_reduce(&mut self, name: &str, ph: Phase, gemm: OpId) -> Vec<OpId> {
        let s = self.s;
        let op = if s.sp {
            CollectiveOp::ReduceScatter
        } else {
            CollectiveOp::AllReduce
        };
        let bytes = ACT * s.tokens * s.h;
        // With TP-comm overlap the reduce-scatter is pipelined with the GEMM that feeds it.
        let deps = if s.tp_comm_overlap {
            self.g.op(gemm).deps.clone()
        } else {
            vec![gemm]
        };
        match self.coll(name, ph, op, GroupRole::Tp, bytes, &deps) {
            Some(r) if s.tp_comm_overlap => vec![gemm, r],
            Some(r) => vec![r],
            None => vec![gemm],
        }
    }

    /// The output layer and loss; returns the logits allocation and what the loss's
    /// backward waits for.
    fn lm_head_forward(&mut self, x: &[OpId]) -> LossHead {
        let s = self.s;
        let ph = Phase::Forward;
        let t = s.tokens;
        let ln = self.mem("final-ln", ph, 2 * ACT * s.seq_sharded(t * s.h), x);
        let ag = self.tp_gather("lm-head-ag", ph, ln);
        // Logits in fp32 live from the head's forward to its backward (Korthikanti:
        // 4*s*b*h/t*(1 + V/h) on the last stage).
        let logits = 4 * t * s.h / s.tp + 4 * t * s.vocab / s.tp;
        let tmp = self.alloc("logits", ph, logits, MemoryCategory::Temporary, &ag.deps);
        let head = self.gemm("lm-head", ph, (t, s.vocab / s.tp, s.h), 1, &ag.join(tmp));
        // Vocab-parallel cross-entropy: fp32 passes over the logits, three small all-reduces.
        let ce = self.mem("cross-entropy", ph, 12 * t * s.vocab / s.tp, &[head]);
        let reduce = self.coll(
            "cross-entropy-ar",
            ph,
            CollectiveOp::AllReduce,
            GroupRole::Tp,
            12 * t,
            &[ce],
        );
        LossHead {
            logits: tmp,
            loss: reduce.unwrap_or(ce),
        }
    }

    fn lm_head_backward(&mut self, head: Option<LossHead>) -> Vec<OpId> {
        let s = self.s;
        let ph = Phase::Backward;
        let t = s.tokens;
        let loss: Vec<OpId> = head.map(|h| h.loss).into_iter().collect();
        let ce = self.mem("cross-entropy-bwd", ph, 8 * t * s.vocab / s.tp, &loss);
        let dgrad = self.gemm("lm-head-dgrad", ph, (t, s.h, s.vocab / s.tp), 1, &[ce]);
        let wgrad = self.gemm("lm-head-wgrad", ph, (s.vocab / s.tp, s.h, t), 1, &[ce]);
        if let Some(h) = head {
            self.free("logits-free", ph, h.logits, &[dgrad, wgrad]);
        }
        let mut out = self.tp_reduce("lm-head-rs", ph, dgrad);
        out.push(wgrad);
        let ln = self.mem("final-ln-bwd", ph, 3 * ACT * s.seq_sharded(t * s.h), &out);
        vec![ln]
    }

    fn backward(&mut self, st: Step) {
        let s = self.s;
        let c = st.chunk;
        let ph = Phase::Backward;
        let vs = self.vstage(c);
        let p2p_bytes = ACT * s.seq_sharded(s.tokens * s.h);
        let mut x: Vec<OpId> = Vec::new();
        if self.is_last_vstage(c) {
            let head = self.loss[st.microbatch as usize].take();
            x = self.lm_head_backward(head);
            if self.is_final_bwd(st) {
                self.add_grads(self.s.vocab * self.s.h / self.s.tp + self.s.h, 0, &x);
            }
        } else {
            let tag = tag(Pass::Backward, st.microbatch, vs);
            let r = self.push(
                OpKind::Recv {
                    peer: PeerStage::Next,
                    bytes: Bytes(p2p_bytes),
                    tag,
                },
                Stream::PpComm,
                ph,
                "recv-grad",
                &[],
            );
            x.push(r);
        }
        let layers = self.chunk_layers[c as usize].clone();
        for &l in layers.iter().rev() {
            if s.zero_stage >= 3 {
                x.extend(self.zero3_gather(l, ph, &x.clone()));
            }
            x = self.layer_backward(l, &x);
            if self.is_final_bwd(st) {
                let (d, e) = self.s.layer_params(self.moe_of(l));
                self.add_grads(d, e, &x);
            }
        }
        if self.is_first_vstage(c) {
            let e = self.mem("embedding-bwd", ph, 2 * ACT * s.tokens * s.h, &x);
            x = vec![e];
            if self.is_final_bwd(st) {
                self.add_grads(self.s.vocab * self.s.h / self.s.tp, 0, &x);
            }
        }
        // The stash is released once the backward's last kernel has read it; sending the
        // input gradient upstream does not need it.
        if let Some(a) = self.act_alloc[c as usize][st.microbatch as usize].take() {
            self.free("activations-free", ph, a, &x);
        }
        if self.is_final_bwd(st) {
            // A chunk's gradients are final: flush its last partial bucket.
            self.flush_grad_bucket(&x, false);
        }
        if !self.is_first_vstage(c) {
            let tag = tag(Pass::Backward, st.microbatch, vs - 1);
            let grad = OpKind::Send {
                peer: PeerStage::Prev,
                bytes: Bytes(p2p_bytes),
                tag,
            };
            self.push(grad, Stream::PpComm, ph, "send-grad", &x);
        }
    }

    fn is_final_bwd(&self, st: Step) -> bool {
        self.last_bwd_mb[st.chunk as usize] == st.microbatch
    }

    /// Records gradients that became final and issues a bucket reduction when full.
    fn add_grads(&mut self, dense: u64, expert: u64, deps: &[OpId]) {
        self.pending.0 += dense;
        self.pending.1 += expert;
        if self.pending.0 + self.pending.1 >= self.s.bucket_params {
            self.flush_grad_bucket(deps, false);
        }
    }

    /// Issues the reduction of the pending bucket. Without overlap every reduction waits
    /// until the end of the pipeline flush (`end_of_step`).
    fn flush_grad_bucket(&mut self, deps: &[OpId], end_of_step: bool) {
        if !self.s.overlap_grad_reduce && !end_of_step {
            return;
        }
        let (dense, expert) = std::mem::take(&mut self.pending);
        let deps: Vec<OpId> = if end_of_step {
            self.g
                .len()
                .checked_sub(1)
                .map(OpId::from_index)
                .into_iter()
                .collect()
        } else {
            deps.to_vec()
        };
        let op = if self.s.zero_stage >= 1 {
            CollectiveOp::ReduceScatter
        } else {
            CollectiveOp::AllReduce
        };
        let gb = self.s.grad_bytes;
        let ph = Phase::Backward;
        if let Some(r) = self.coll("grad-reduce", ph, op, GroupRole::DpCp, gb * dense, &deps) {
            self.grad_reductions.push(r);
        }
        if let Some(r) = self.coll(
            "expert-grad-reduce",
            ph,
            op,
            GroupRole::ExpertDp,
            gb * expert,
            &deps,
        ) {
            self.grad_reductions.push(r);
        }
    }

    fn layer_backward(&mut self, layer: u64, x: &[OpId]) -> Vec<OpId> {
        let s = self.s;
        let t = s.tokens;
        let ph = Phase::Backward;
        let mut x = x.to_vec();
        let mut tmp = None;
        let recompute = s.layer_recompute(layer);
        if recompute == Recompute::Full {
            // Rebuild the layer's stash from its input, then run backward as usual.
            let bytes = s.activation_bytes(self.moe_of(layer), Recompute::None).0;
            let a = self.alloc(
                "recompute-buffer",
                Phase::Recompute,
                bytes,
                MemoryCategory::Temporary,
                &x,
            );
            x = self.layer_forward(layer, Phase::Recompute, &[a]);
            tmp = Some(a);
        }
        let e_norm = s.seq_sharded(t * s.h);
        let res2 = self.mem(&format!("L{layer}.residual2-bwd"), ph, 4 * e_norm, &x);
        let mlp = match self.moe_of(layer) {
            None => self.dense_mlp_backward(layer, res2),
            Some(m) => self.moe_backward(layer, res2, m),
        };
        let ln2 = self.mem(&format!("L{layer}.ln2-bwd"), ph, 3 * ACT * e_norm, &mlp);
        let mut deps = self.row_linear_backward(&format!("L{layer}.proj"), s.h, s.q, ln2);
        if recompute == Recompute::Selective && !s.flash {
            deps = self.attention(layer, Phase::Recompute, false, &deps);
        }
        let attn = self.attention(layer, ph, true, &deps);
        let after =
            self.column_linear_backward(&format!("L{layer}.qkv"), s.q + 2 * s.kv, s.h, &attn);
        let ln1 = self.mem(&format!("L{layer}.ln1-bwd"), ph, 3 * ACT * e_norm, &after);
        if let Some(a) = tmp {
            self.free("recompute-buffer-free", ph, a, &[ln1]);
        }
        vec![ln1]
    }

    /// The reduction of a column-parallel layer's input gradient. Megatron overlaps it with
    /// the weight-gradient GEMM that follows, so it depends only on the dgrad.
    fn tp_reduce_after(&mut self, name: &str, ph: Phase, dgrad: OpId) -> Option<OpId> {
        let s = self.s;
        let op = if s.sp {
            CollectiveOp::ReduceScatter
        } else {
            CollectiveOp::AllReduce
        };
        self.coll(name, ph, op, GroupRole::Tp, ACT * s.tokens * s.h, &[dgrad])
    }

    fn dense_mlp_backward(&mut self, layer: u64, input: OpId) -> Vec<OpId> {
        let s = self.s;
        let width = if s.gated { 2 * s.ffn } else { s.ffn };
        let fc2 = self.row_linear_backward(&format!("L{layer}.fc2"), s.h, s.ffn, input);
        let act_bytes = ACT * s.tokens * (2 * width + s.ffn) / s.tp;
        let act = self.mem(
            &format!("L{layer}.act-bwd"),
            Phase::Backward,
            act_bytes,
            &fc2,
        );
        self.column_linear_backward(&format!("L{layer}.fc1"), width, s.h, &[act])
    }

    fn moe_backward(&mut self, layer: u64, input: OpId, m: &orrery_spec::Moe) -> Vec<OpId> {
        let s = self.s;
        let t = s.tokens;
        let ph = Phase::Backward;
        let routed = t * m.top_k;
        let a2a = ACT * routed * s.h;
        let g = self.tp_gather(&format!("L{layer}.moe-grad-ag"), ph, input);
        let back = self.coll(
            &format!("L{layer}.combine-bwd"),
            ph,
            CollectiveOp::AllToAll,
            GroupRole::Ep,
            a2a,
            &g.deps,
        );
        let local = (m.experts / s.ep).max(1);
        let per_expert = routed.div_ceil(local);
        let width = if s.gated {
            2 * m.expert_ffn
        } else {
            m.expert_ffn
        };
        let deps: Vec<OpId> = back.into_iter().chain(g.deps.iter().copied()).collect();
        let d2 = self.gemm(
            &format!("L{layer}.expert-fc2-dgrad"),
            ph,
            (per_expert, m.expert_ffn / s.tp, s.h),
            local,
            &deps,
        );
        let w2 = self.gemm(
            &format!("L{layer}.expert-fc2-wgrad"),
            ph,
            (m.expert_ffn / s.tp, s.h, per_expert),
            local,
            &[d2],
        );
        let act = self.mem(
            &format!("L{layer}.expert-act-bwd"),
            ph,
            ACT * routed * (2 * width + m.expert_ffn) / s.tp,
            &[w2],
        );
        let d1 = self.gemm(
            &format!("L{layer}.expert-fc1-dgrad"),
            ph,
            (per_expert, s.h, width / s.tp),
            local,
            &[act],
        );
        let w1 = self.gemm(
            &format!("L{layer}.expert-fc1-wgrad"),
            ph,
            (s.h, width / s.tp, per_expert),
            local,
            &[d1],
        );
        let disp = self.coll(
            &format!("L{layer}.dispatch-bwd"),
            ph,
            CollectiveOp::AllToAll,
            GroupRole::Ep,
            a2a,
            &[d1],
        );
        let mut out: Vec<OpId> = disp.into_iter().chain([w1]).collect();
        if m.shared_experts > 0 {
            let f = m.shared_experts * m.expert_ffn;
            let w = if s.gated { 2 * f } else { f };
            let sd2 = self.gemm(
                &format!("L{layer}.shared-fc2-dgrad"),
                ph,
                (t, f / s.tp, s.h),
                1,
                &g.deps,
            );
            let sw2 = self.gemm(
                &format!("L{layer}.shared-fc2-wgrad"),
                ph,
                (f / s.tp, s.h, t),
                1,
                &[sd2],
            );
            let sd1 = self.gemm(
                &format!("L{layer}.shared-fc1-dgrad"),
                ph,
                (t, s.h, w / s.tp),
                1,
                &[sw2],
            );
            let sw1 = self.gemm(
                &format!("L{layer}.shared-fc1-wgrad"),
                ph,
                (s.h, w / s.tp, t),
                1,
                &[sd1],
            );
            out.push(sw1);
        }
        let router = self.gemm(
            &format!("L{layer}.router-bwd"),
            ph,
            (t, s.h, m.experts),
            2,
            &out,
        );
        let red = self.tp_reduce_after(&format!("L{layer}.moe-rs"), ph, router);
        let mut res = vec![router];
        res.extend(red);
        res
    }

    fn optimizer_step(&mut self) {
        let s = self.s;
        let ph = Phase::Optimizer;
        let (dense, expert) = self.rank_params();
        let dpc = s.dp * s.cp;
        let shard = if s.zero_stage >= 1 {
            dense.div_ceil(dpc) + expert.div_ceil(dpc / s.ep)
        } else {
            dense + expert
        };
        let mut deps = self.grad_reductions.clone();
        deps.extend(self.g.len().checked_sub(1).map(OpId::from_index));
        // Tied word embeddings live on the first stage (input) and the last (output layer)
        // when the pipeline has more than one stage; Megatron all-reduces their gradients
        // between the two after the pipeline flush, before the optimizer.
        let holds_embedding = self.stage == 0 || self.stage + 1 == s.pp;
        if self.job.model().tied_embeddings && s.pp > 1 && holds_embedding {
            let bytes = s.grad_bytes * s.vocab * s.h / s.tp;
            let embedding = self.coll(
                "embedding-grad-allreduce",
                ph,
                CollectiveOp::AllReduce,
                GroupRole::Embedding,
                bytes,
                &deps,
            );
            deps.extend(embedding);
        }
        // Gradient-norm all-reduce for clipping: one fp32 scalar over the data-parallel group.
        let norm = self.coll(
            "grad-norm",
            ph,
            CollectiveOp::AllReduce,
            GroupRole::DpCp,
            4,
            &deps,
        );
        deps.extend(norm);
        // Adam reads fp32 master weight, gradient, two moments (16 B) and writes master,
        // moments and the 16-bit weight (14 B): 30 bytes and ~12 FLOPs per parameter.
        let bytes = 30 * shard;
        let kind = OpKind::Compute {
            kind: ComputeKind::MemoryBound,
            flops: Flops(12.0 * shard as f64),
            bytes: Bytes(bytes),
        };
        let step = self.push(kind, Stream::Compute, ph, "optimizer-step", &deps);
        if s.optimizer != OptimizerKind::Adamw {
            self.second_order_step(step);
        }
        if s.zero_stage >= 1 && !s.overlap_param_gather {
            self.param_gather(false);
        }
    }

    /// SOAP / Shampoo extra work per matrix (approximation): the factor statistics
    /// `G G^T` and `G^T G` and the two rotations each way, `6*r*c*(r + c)` FLOPs, plus an
    /// eigendecomposition of each factor (~10 n^3 FLOPs) amortised over a refresh every
    /// 10 steps. Sharded across data-parallel ranks with the distributed optimizer.
    fn second_order_step(&mut self, after: OpId) {
        let mut flops = 0.0;
        for c in 0..self.s.vpp as usize {
            for &l in &self.chunk_layers[c] {
                for (r, c_, n) in self.layer_matrices(self.moe_of(l)) {
                    let (r, c_) = (r.min(8192) as f64, c_.min(8192) as f64);
                    flops += n as f64 * (6.0 * r * c_ * (r + c_) + (r.powi(3) + c_.powi(3)));
                }
            }
        }
        if self.s.zero_stage >= 1 {
            flops /= (self.s.dp * self.s.cp) as f64;
        }
        let n = (flops / 6.0).cbrt().max(1.0) as u64;
        let kind = ComputeKind::Gemm {
            m: n,
            n,
            k: n,
            batch: 1,
            fp8: false,
        };
        let bytes = Bytes(6 * n * n);
        let op = OpKind::Compute {
            kind,
            flops: Flops(flops),
            bytes,
        };
        self.push(
            op,
            Stream::Compute,
            Phase::Optimizer,
            "preconditioner",
            &[after],
        );
    }
}

/// The TP gather before a GEMM, possibly overlapped with it.
struct Gather {
    /// What the GEMM must wait for.
    deps: Vec<OpId>,
    /// A gather running concurrently with the GEMM, which the GEMM's consumers wait for.
    overlapped: Option<OpId>,
}

impl Gather {
    /// The ops a consumer of the GEMM waits for.
    fn join(&self, gemm: OpId) -> Vec<OpId> {
        let mut v = vec![gemm];
        v.extend(self.overlapped);
        v
    }
}

/// A tag matching a send to its receive: direction, micro-batch, and the virtual-stage
/// boundary (`vs` to `vs + 1`).
pub fn tag(pass: Pass, microbatch: u32, boundary: u64) -> u64 {
    let dir = match pass {
        Pass::Forward => 0,
        Pass::Backward => 1,
    };
    (boundary << 33) | (u64::from(microbatch) << 1) | dir
}
