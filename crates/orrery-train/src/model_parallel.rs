//! Tensor, pipeline and expert parallelism for the GPT: one rank's shard of the model and its
//! step.
//!
//! **Sharding.** Every rank holds the parameters of its pipeline stage (a contiguous run of
//! layers, or with interleaving several such chunks; the first stage also holds the
//! embeddings, the last the final norm and the head; of a mixture of experts only its share
//! of the experts), with the matrices of each layer cut Megatron-style across the
//! tensor-parallel group:
//!
//! - column-parallel (output columns split): `attn.wq`, `attn.wk`, `attn.wv` by heads (query
//!   heads and key/value heads alike, so grouped-query attention keeps each query head with its
//!   key/value head), `mlp.w_in` and `mlp.w_gate` by hidden units;
//! - row-parallel (input rows split): `attn.wo` by heads, `mlp.w_out` by hidden units;
//! - experts' `w_in`/`w_gate` by columns and `w_out` by rows, like the MLP;
//! - replicated on every tensor-parallel rank: the embeddings, the norms, the router and the
//!   head.
//!
//! Parameter names are the single-rank model's, only the shapes shrink, so [`local_specs`],
//! [`shard`] and [`assemble`] convert between one full store and the shards.
//!
//! **Segments.** burn's autodiff cannot call the communicator during `backward`, so each
//! stage runs as segments — per layer one attention and one MLP segment, each reading a fresh
//! leaf input and ending in a partial sum over this rank's heads or hidden units. Between
//! segments the trainer applies Megatron's two operators by hand: `g` (all-reduce the partial
//! output over the tensor-parallel group in the forward pass, identity backward) and `f`
//! (identity forward, all-reduce the input gradient backward). A segment's backward with
//! upstream gradient `g` is `(y · g).sum().backward()`, reading the gradients of the leaf input
//! and of the parameters. The forward pass runs each segment on a leaf copy of its input with
//! its own parameter leaves and keeps the segment's graph (its activations) until the
//! backward pass; graphs of different segments and micro-batches share no nodes, so each is
//! freed by its own backward call.
//!
//! Because `f` sits at the segment input, before the norm, each tensor-parallel rank sees only
//! its heads' share of the norm's gradient; the layer norms' gradients are therefore summed
//! over the tensor-parallel group after the backward pass (the other replicated parameters get
//! identical gradients on every tensor-parallel rank already).
//!
//! **Sequence parallelism** (`parallel.sequence_parallel`, Megatron's). Without it, everything
//! between the blocks — the layer norms and the residual adds — runs on the whole sequence on
//! every tensor-parallel rank: the same work `tp` times over, and the same activations kept
//! `tp` times. These regions work on each token by itself, so each rank can do them on its
//! own `1 / tp` slice of the sequence instead (rank `r` of the group holds positions
//! `[r · s / tp, (r + 1) · s / tp)` of every sequence of the micro-batch). The blocks
//! themselves need every position (attention mixes them, and each rank holds only some heads
//! or hidden units), so the operators change at the blocks' edges:
//!
//! - `g` becomes a **reduce-scatter** along the sequence: the all-reduce without its
//!   all-gather, since each rank only needs the sum for its own slice. Backward it is an
//!   all-gather of the slices' gradients.
//! - `f` moves after the norm (so that the norm runs on the slice) and becomes an
//!   **all-gather** of the normalised slices. Backward it is a reduce-scatter: the
//!   all-reduce of the input gradient's shares, of which the norm's backward pass on the slice
//!   needs only the slice.
//!
//! Each block is then two segments: the norm on the slice, and the block's share on the
//! gathered sequence (a mixture of experts routes the gathered, already normalised tokens).
//! The norms' gradients are still summed over the tensor-parallel group after the backward
//! pass, for another reason: each rank now holds its slice's share. The embeddings and the
//! head are replicated, so they run on the whole sequence as before: the first stage embeds
//! it and keeps its slice (backward: an all-gather of the slices' gradients), the last stage
//! all-gathers the slices in front of the final norm and head (backward: the rank keeps its
//! slice of the input gradient, which every rank computed alike), and their gradients stay
//! identical across the group. Activations and gradients passed between pipeline stages are
//! the slices, `1 / tp` of the messages without it. The sums are the same sums taken in
//! another order (the norms' backward passes run on summed gradients instead of summing
//! their results), so a run with sequence parallelism matches one without within float
//! tolerance, not bit for bit.
//!
//! **Pipeline.** [`train_step`] runs the micro-batches with the 1F1B schedule
//! (`min(pp - stage - 1, m)` warm-up forwards, then alternating one forward and one backward,
//! then the remaining backwards), passing activations forward and gradients backward with
//! [`Communicator::send_f32`], [`Communicator::recv_f32`] and, where a stage sends one way and
//! receives the other, [`Communicator::send_recv_f32`]. Gradients accumulate over the
//! micro-batches (each loss scaled by `1 / m`). A tied embedding lives on the first and the
//! last stage; their two gradients are summed across the pair after the pipeline drains, so
//! both copies take the same update. Then gradients are averaged over the data-parallel group.
//!
//! With `virtual_stages` model chunks per rank the schedule is Megatron's interleaved 1F1B
//! (`Stage::interleaved`): chunk `c` of stage `s` is the model's chunk `c · pp + s`, the last
//! stage feeds the first stage's next chunk, and since two stages may then exchange both
//! activations and gradients, every message is tagged with its kind, chunk and micro-batch
//! ([`Communicator::send_f32_tagged`]) and received by its tag: the pairing names each
//! message rather than relying on the order of the pair's messages (which, in the schedules
//! checked, happens to be the order they are wanted in). Its sends are posted eagerly, so it
//! needs a communicator whose sends never wait ([`Communicator::sends_never_wait`]).
//!
//! **Experts.** With `model.moe`, each block's MLP segment becomes a mixture of experts: the
//! router runs where the token is; each token-expert pair's row goes to the member of the
//! expert-parallel group holding the expert (`Communicator::group_all_to_all_v_f32`, after an
//! exchange of row counts); the experts run there; the results come back the same way and are
//! summed weighted by the gates in expert order, the order of the single-rank reference, which
//! computes every expert on every token with zero gates for the others. The backward pass
//! sends the gradients along the same routes. Expert gradients are summed over the ranks
//! holding the same experts, the router's over the tensor-parallel group (like the norms').
//!
//! **Communication of one training step**, in issue order on each rank (what a recording or
//! emulating communicator sees): per micro-batch and layer, forward one tensor-parallel
//! all-reduce after attention and one after the MLP (with experts: a one-count-per-member
//! all-to-all, the rows' all-to-all there and the results' back, then the all-reduce), and
//! backward the mirror image (all-to-alls of the gradients, then the all-reduce of the input
//! gradient); between stages, activations and gradients as point-to-point messages of
//! `n · seq · d` floats. With sequence parallelism each of
//! those tensor-parallel all-reduces becomes two collectives over the same group and the
//! whole `n · seq · d` floats: forward, per block, an all-gather before it and a reduce-scatter
//! after it; backward, per block, an all-gather of the output gradient and a reduce-scatter of
//! the input gradient; plus an all-gather in front of the head (last stage, forward) and one
//! of the embeddings' gradient (first stage, backward); stage-to-stage messages carry
//! `n · seq / tp · d` floats. After the pipeline drains: one
//! tensor-parallel all-reduce of the layer norms' and routers' gradients, the tied embedding's
//! all-reduce between the first and last stage, the data-parallel all-reduce of the other
//! gradients and the expert-data-parallel one of the experts'; then a world all-reduce of one
//! float (the loss) and a world all-gather of 8 bytes (the gradient norm's partial sums).
//! Collectives over a group of one rank are skipped (the all-to-alls are not: they copy).
//!
//! What this module does not do: no overlap of communication with computation, no
//! load-balancing loss or expert capacity limit, no activation recomputation, and with
//! sequence parallelism no splitting of the embeddings' or the head's work (both are
//! replicated, not vocabulary-parallel, so they run on the whole sequence).

use std::collections::HashMap;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

use crate::comm::{CommError, Communicator, Group};
use crate::config::{ConfigErrors, ConfigProblem, ModelConfig, NormKind};
use crate::data::Batch;
use crate::model::{
    attention, cross_entropy, embed, mlp, moe_gates_and_mask, norm, param_specs, AttentionWeights,
    Aux, ParamSpec,
};
use crate::parallel::{Coords, Layout};
use crate::params::ParamStore;
use crate::trainer::TrainError;

/// How a parameter is split across the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKind {
    /// Every tensor-parallel rank holds all of it.
    Replicated,
    /// Output columns (the second dimension) are split in contiguous equal blocks.
    Columns,
    /// Input rows (the first dimension) are split in contiguous equal blocks.
    Rows,
}

/// How the parameter called `name` is split.
pub fn shard_kind(name: &str) -> ShardKind {
    const COLUMNS: [&str; 5] = [
        ".attn.wq",
        ".attn.wk",
        ".attn.wv",
        ".mlp.w_in",
        ".mlp.w_gate",
    ];
    const ROWS: [&str; 2] = [".attn.wo", ".mlp.w_out"];
    // Experts are MLPs, cut like the dense one.
    let expert = expert_of(name).is_some();
    if COLUMNS.iter().any(|s| name.ends_with(s))
        || (expert && (name.ends_with(".w_in") || name.ends_with(".w_gate")))
    {
        ShardKind::Columns
    } else if ROWS.iter().any(|s| name.ends_with(s)) || (expert && name.ends_with(".w_out")) {
        ShardKind::Rows
    } else {
        ShardKind::Replicated
    }
}

/// The expert of an expert parameter (`blocks.1.moe.experts.5.w_in` belongs to expert 5).
pub fn expert_of(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once(".moe.experts.")?;
    rest.split('.').next()?.parse().ok()
}

/// Whether rank `c` holds expert `e`: its position in the expert-parallel group owns a
/// contiguous block of `experts / ep` of them.
fn holds_expert(model: &ModelConfig, layout: &Layout, c: Coords, e: usize) -> bool {
    let experts = model.moe.map_or(1, |m| m.experts);
    e / (experts / layout.ep).max(1) == c.dp % layout.ep
}

/// The layer of a block parameter (`blocks.3.attn.wq` is in layer 3).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blocks.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Whether the pipeline stage `pp` holds the parameter called `name`.
fn stage_holds(name: &str, model: &ModelConfig, layout: &Layout, pp: usize) -> bool {
    let last = layout.pp - 1;
    match layer_of(name) {
        Some(l) => layout.stage_of_layer(l) == pp,
        None => match name {
            "tok_emb" => pp == 0 || (pp == last && model.tie_embeddings),
            "pos_emb" => pp == 0,
            _ => pp == last, // norm_f.*, head
        },
    }
}

/// The parameters rank `c` holds, with their local shapes, in the full model's order.
pub fn local_specs(model: &ModelConfig, layout: &Layout, c: Coords) -> Vec<ParamSpec> {
    param_specs(model)
        .into_iter()
        .filter(|s| stage_holds(&s.name, model, layout, c.pp))
        .filter(|s| expert_of(&s.name).is_none_or(|e| holds_expert(model, layout, c, e)))
        .map(|mut s| {
            match shard_kind(&s.name) {
                ShardKind::Columns => s.shape[1] /= layout.tp,
                ShardKind::Rows => s.shape[0] /= layout.tp,
                ShardKind::Replicated => {}
            }
            s
        })
        .collect()
}

/// Tensor-parallel part `part` of a `[rows, cols]` matrix `full` cut `kind`-wise into `parts`.
fn cut(
    full: &[f32],
    rows: usize,
    cols: usize,
    kind: ShardKind,
    parts: usize,
    part: usize,
) -> Vec<f32> {
    match kind {
        ShardKind::Replicated => full.to_vec(),
        ShardKind::Rows => {
            let n = rows / parts * cols;
            full[part * n..(part + 1) * n].to_vec()
        }
        ShardKind::Columns => {
            let w = cols / parts;
            full.chunks_exact(cols)
                .flat_map(|row| &row[part * w..(part + 1) * w])
                .copied()
                .collect()
        }
    }
}

/// Rank `c`'s shard of the full store `full`.
pub fn shard(full: &ParamStore, model: &ModelConfig, layout: &Layout, c: Coords) -> ParamStore {
    let specs = local_specs(model, layout, c);
    let mut out = ParamStore::zeros(&specs);
    for (i, s) in specs.iter().enumerate() {
        let Some(j) = full.index_of(&s.name) else {
            continue;
        };
        let shape = full.shape(j);
        let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let kind = shard_kind(&s.name);
        out.values_mut(i)
            .copy_from_slice(&cut(full.values(j), rows, cols, kind, layout.tp, c.tp));
    }
    out
}

/// The full store put together from every rank's local values (`locals[rank]`, in the order
/// of [`local_specs`]); only the first data-parallel replica's shards are read (for experts,
/// the first expert-parallel group's).
pub fn assemble(model: &ModelConfig, layout: &Layout, locals: &[Vec<f32>]) -> ParamStore {
    let mut full = ParamStore::zeros(&param_specs(model));
    for (rank, values) in locals.iter().enumerate().take(layout.world_size()) {
        let c = layout.coords(rank);
        if c.dp >= layout.ep {
            continue;
        }
        let specs = local_specs(model, layout, c);
        let mut local = ParamStore::zeros(&specs);
        if local.numel() != values.len() {
            continue;
        }
        local.flat_mut().copy_from_slice(values);
        for (i, s) in specs.iter().enumerate() {
            let Some(j) = full.index_of(&s.name) else {
                continue;
            };
            if c.dp != 0 && expert_of(&s.name).is_none() {
                continue;
            }
            let shape = full.shape(j).to_vec();
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            let src = local.values(i);
            let dst = full.values_mut(j);
            match shard_kind(&s.name) {
                // Replicas agree; the first stage's and the first tensor rank's copy is taken.
                ShardKind::Replicated => {
                    if c.tp == 0 && (s.name != "tok_emb" || c.pp == 0) {
                        dst.copy_from_slice(src);
                    }
                }
                ShardKind::Rows => {
                    let n = rows / layout.tp * cols;
                    dst[c.tp * n..(c.tp + 1) * n].copy_from_slice(src);
                }
                ShardKind::Columns => {
                    let w = cols / layout.tp;
                    for (row, piece) in dst.chunks_exact_mut(cols).zip(src.chunks_exact(w)) {
                        row[c.tp * w..(c.tp + 1) * w].copy_from_slice(piece);
                    }
                }
            }
        }
    }
    full
}

/// One rank's place in a model-parallel run and the groups it talks in.
#[derive(Debug, Clone)]
pub struct ModelParallel {
    pub layout: Layout,
    pub rank: usize,
    pub coords: Coords,
    pub tp_group: Group,
    pub dp_group: Group,
    pub embedding_group: Group,
    /// The ranks whose tokens share this rank's experts (all-to-all dispatch and combine).
    pub ep_group: Group,
    /// The ranks holding the same experts (their gradients are summed over it).
    pub expert_dp_group: Group,
    pub prev: Option<usize>,
    pub next: Option<usize>,
}

impl ModelParallel {
    pub fn new(layout: Layout, rank: usize) -> Self {
        Self {
            coords: layout.coords(rank),
            tp_group: layout.tp_group(rank),
            dp_group: layout.dp_group(rank),
            embedding_group: layout.embedding_group(rank),
            ep_group: layout.ep_group(rank),
            expert_dp_group: layout.expert_dp_group(rank),
            prev: layout.prev_stage(rank),
            next: layout.next_stage(rank),
            layout,
            rank,
        }
    }

    pub fn is_first_stage(&self) -> bool {
        self.coords.pp == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.coords.pp + 1 == self.layout.pp
    }

    /// Whether model chunk `chunk` of this rank is the model's first (it embeds the tokens).
    pub fn is_first_chunk(&self, chunk: usize) -> bool {
        self.is_first_stage() && chunk == 0
    }

    /// Whether model chunk `chunk` of this rank is the model's last (it computes the loss).
    pub fn is_last_chunk(&self, chunk: usize) -> bool {
        self.is_last_stage() && chunk + 1 == self.layout.virtual_stages
    }

    fn stage_rank(&self, pp: usize) -> usize {
        self.layout.rank_of(Coords { pp, ..self.coords })
    }

    /// The rank and chunk that feed this rank's chunk `chunk`: the previous stage's same
    /// chunk, or for the first stage the last stage's previous chunk.
    pub fn chunk_prev(&self, chunk: usize) -> Option<(usize, usize)> {
        if self.coords.pp > 0 {
            Some((self.stage_rank(self.coords.pp - 1), chunk))
        } else if chunk > 0 {
            Some((self.stage_rank(self.layout.pp - 1), chunk - 1))
        } else {
            None
        }
    }

    /// The rank and chunk this rank's chunk `chunk` feeds.
    pub fn chunk_next(&self, chunk: usize) -> Option<(usize, usize)> {
        if !self.is_last_stage() {
            Some((self.stage_rank(self.coords.pp + 1), chunk))
        } else if chunk + 1 < self.layout.virtual_stages {
            Some((self.stage_rank(0), chunk + 1))
        } else {
            None
        }
    }

    /// Whether this rank's copy of the parameter counts towards the global gradient norm:
    /// each element of the full model is counted exactly once, by the first data-parallel
    /// replica, the first tensor-parallel rank for replicated parameters, and the first stage
    /// for a tied embedding.
    fn owns_for_norm(&self, name: &str) -> bool {
        let c = self.coords;
        let replica = if expert_of(name).is_some() {
            c.dp < self.layout.ep
        } else {
            c.dp == 0
        };
        replica
            && (shard_kind(name) != ShardKind::Replicated || c.tp == 0)
            && (name != "tok_emb" || c.pp == 0)
    }
}

fn backend_err(e: impl std::fmt::Debug) -> TrainError {
    TrainError::Backend(format!("{e:?}"))
}

fn to_vec<BB: Backend, const D: usize>(t: Tensor<BB, D>) -> Result<Vec<f32>, TrainError> {
    t.try_into_data()
        .map_err(backend_err)?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(backend_err)
}

fn tensor3<BB: Backend>(v: Vec<f32>, shape: [usize; 3], device: &BB::Device) -> Tensor<BB, 3> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// Activations `[n, seq, d]` (row-major) regrouped by sequence slice, as `[parts, n, seq /
/// parts, d]`: slice `r` of every sequence, then slice `r + 1`, so that each slice is one
/// contiguous block, the layout of a reduce-scatter's pieces.
fn sequence_to_slices(v: &[f32], n: usize, parts: usize) -> Vec<f32> {
    // Row `i` of the `[n · parts]` blocks is sequence `i / parts`, slice `i % parts`.
    let block = v.len() / (n * parts).max(1);
    let mut out = Vec::with_capacity(v.len());
    for r in 0..parts {
        for b in 0..n {
            let at = (b * parts + r) * block;
            out.extend_from_slice(&v[at..at + block]);
        }
    }
    out
}

/// The inverse of [`sequence_to_slices`]: the slices `[parts, n, seq / parts, d]` (an
/// all-gather's pieces in group order) put back into whole sequences `[n, seq, d]`.
fn slices_to_sequence(v: &[f32], n: usize, parts: usize) -> Vec<f32> {
    let block = v.len() / (n * parts).max(1);
    let mut out = Vec::with_capacity(v.len());
    for b in 0..n {
        for r in 0..parts {
            let at = (r * n + b) * block;
            out.extend_from_slice(&v[at..at + block]);
        }
    }
    out
}

/// Slice `part` of `parts` of every sequence of the activations `[n, seq, d]`.
fn sequence_slice(v: &[f32], n: usize, parts: usize, part: usize) -> Vec<f32> {
    let block = v.len() / (n * parts).max(1);
    (0..n)
        .flat_map(|b| {
            let at = (b * parts + part) * block;
            v[at..at + block].iter().copied()
        })
        .collect()
}

/// Parameters of one segment built from the store: leaves recording gradients in a backward
/// pass, plain tensors in a forward pass.
struct Leaves<B: AutodiffBackend> {
    grad: bool,
    ones: Vec<(usize, Tensor<B, 1>)>,
    twos: Vec<(usize, Tensor<B, 2>)>,
}

impl<B: AutodiffBackend> Leaves<B> {
    fn new(grad: bool) -> Self {
        Self {
            grad,
            ones: Vec::new(),
            twos: Vec::new(),
        }
    }

    fn load<const D: usize>(
        &self,
        store: &ParamStore,
        name: &str,
        device: &B::Device,
    ) -> Result<(usize, Tensor<B, D>), TrainError> {
        let i = store
            .index_of(name)
            .ok_or_else(|| TrainError::Model(crate::model::BuildError::Missing(name.to_owned())))?;
        let t = Tensor::<B, D>::from_data(
            TensorData::new(store.values(i).to_vec(), store.shape(i).to_vec()),
            device,
        );
        Ok((i, if self.grad { t.require_grad() } else { t }))
    }

    fn p1(
        &mut self,
        store: &ParamStore,
        name: &str,
        dev: &B::Device,
    ) -> Result<Tensor<B, 1>, TrainError> {
        let (i, t) = self.load::<1>(store, name, dev)?;
        if self.grad {
            self.ones.push((i, t.clone()));
        }
        Ok(t)
    }

    fn p2(
        &mut self,
        store: &ParamStore,
        name: &str,
        dev: &B::Device,
    ) -> Result<Tensor<B, 2>, TrainError> {
        let (i, t) = self.load::<2>(store, name, dev)?;
        if self.grad {
            self.twos.push((i, t.clone()));
        }
        Ok(t)
    }

    /// Adds each leaf's gradient to its entry of `into`.
    fn accumulate(&self, grads: &B::Gradients, into: &mut ParamStore) -> Result<(), TrainError> {
        let mut add = |i: usize, g: Vec<f32>| {
            for (acc, x) in into.values_mut(i).iter_mut().zip(g) {
                *acc += x;
            }
        };
        for (i, t) in &self.ones {
            if let Some(g) = t.grad(grads) {
                add(*i, to_vec(g)?);
            }
        }
        for (i, t) in &self.twos {
            if let Some(g) = t.grad(grads) {
                add(*i, to_vec(g)?);
            }
        }
        Ok(())
    }
}

/// A segment's forward pass, kept for its backward pass: the leaf input, the output whose
/// autodiff graph leads back to it and to the parameter leaves.
struct Kept<B: AutodiffBackend, const D: usize> {
    x: Tensor<B, 3>,
    y: Tensor<B, D>,
    leaves: Leaves<B>,
}

/// One of a layer's two tensor-parallel blocks, attention or the feed-forward part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Attention,
    FeedForward,
}

/// A block's body (the part between Megatron's `f` and `g`), kept for the backward pass.
enum BodyKept<B: AutodiffBackend> {
    /// A segment: attention or a dense MLP.
    Dense(Kept<B, 3>),
    /// A mixture of experts.
    Experts(MoeSaved<B>),
}

/// A layer's block, kept for the backward pass.
struct BlockKept<B: AutodiffBackend> {
    /// With sequence parallelism, the layer norm on this rank's slice of the sequence, a
    /// segment of its own (the all-gather sits between it and the body). Without, the norm is
    /// the first step of the body's segment.
    norm: Option<Kept<B, 3>>,
    body: BodyKept<B>,
}

/// What the forward pass keeps of one micro-batch for its backward pass.
struct Saved<B: AutodiffBackend> {
    /// The shape `[n, seq, d]` of the activations passed between stages (with sequence
    /// parallelism `seq` is this rank's slice of the sequence).
    shape: [usize; 3],
    /// The first chunk's embedding output (the whole sequence) and its leaves.
    embed: Option<(Tensor<B, 3>, Leaves<B>)>,
    /// Per local layer: its attention block and its feed-forward block.
    layers: Vec<(BlockKept<B>, BlockKept<B>)>,
    /// The last chunk's head: input leaf, loss and leaves.
    head: Option<Kept<B, 1>>,
}

/// A router's result: the normalised input `h` (`[n, d]`), the gates (`[n, experts]`) and
/// the chosen experts' 0/1 mask (row-major).
struct Routed<B: Backend> {
    h: Tensor<B, 2>,
    gates: Tensor<B, 2>,
    mask: Vec<f32>,
}

/// What the forward pass keeps of one micro-batch's mixture-of-experts layer: the routing, the
/// rows exchanged and the router's and experts' graphs, so that the backward pass can send
/// gradients along the same routes.
struct MoeSaved<B: AutodiffBackend> {
    /// The token-expert pairs this rank dispatched, in send order (by destination member,
    /// then token, then expert).
    pairs: Vec<(usize, usize)>,
    /// Rows sent to each member and received from each member.
    sent_rows: Vec<usize>,
    recv_rows: Vec<usize>,
    /// The experts' outputs for `pairs` (width `d`), as returned.
    y: Vec<f32>,
    /// Gates `[tokens, experts]`.
    gates: Vec<f32>,
    /// The router: input leaf, normalised input, gates and leaves.
    router: RouterKept<B>,
    /// Per local expert that got rows: which received rows, and its kept segment.
    experts: Vec<(Vec<usize>, Kept<B, 3>)>,
}

/// The router segment, kept for the backward pass.
struct RouterKept<B: AutodiffBackend> {
    x: Tensor<B, 3>,
    h: Tensor<B, 2>,
    gates: Tensor<B, 2>,
    leaves: Leaves<B>,
}

/// The result of a stage's forward pass over one micro-batch.
struct Forwarded<B: AutodiffBackend> {
    /// The activations to send to the next stage (all stages but the last).
    out: Option<Vec<f32>>,
    /// The micro-batch's mean loss (the last stage).
    loss: Option<f32>,
    /// `None` for a forward-only (evaluation) pass.
    saved: Option<Saved<B>>,
}

/// A micro-batch's tokens, `[n, seq]` each.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub n: usize,
    pub seq: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
}

impl From<Batch> for MicroBatch {
    fn from(b: Batch) -> Self {
        Self {
            n: b.batch,
            seq: b.seq,
            inputs: b.inputs,
            targets: b.targets,
        }
    }
}

/// One rank's stage of the model, for one step.
struct Stage<'a, B: AutodiffBackend> {
    mp: &'a ModelParallel,
    model: &'a ModelConfig,
    store: &'a ParamStore,
    grads: &'a mut ParamStore,
    comm: &'a mut dyn Communicator,
    device: &'a B::Device,
    aux: &'a Aux<B>,
}

/// The tag of an interleaved-1F1B message: what it carries (its kind), for which model chunk
/// of the receiver and which micro-batch. Unique among a pair's messages of one step, and
/// the same on both sides, so the receiver can ask for the one it needs next.
fn message_tag(kind: u8, chunk: usize, mb: usize) -> u64 {
    // 24 bits each; the layout's validation keeps chunks and micro-batches below 2^24.
    (u64::from(kind) << 48) | ((chunk as u64 & 0xff_ffff) << 24) | (mb as u64 & 0xff_ffff)
}

/// Message kinds of interleaved 1F1B (part of a message's tag).
const TAG_FORWARD: u8 = 0;
const TAG_BACKWARD: u8 = 1;

impl<B: AutodiffBackend> Stage<'_, B> {
    fn comm_err(&self, source: CommError) -> TrainError {
        TrainError::Comm {
            rank: self.mp.rank,
            source,
        }
    }

    fn layers(&self, chunk: usize) -> std::ops::Range<usize> {
        self.mp.layout.chunk_layers(self.mp.coords.pp, chunk)
    }

    fn int2(&self, v: &[i64], n: usize, seq: usize) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(v.to_vec(), [n, seq]), self.device)
    }

    fn norm_params(
        &self,
        prefix: &str,
        leaves: &mut Leaves<B>,
    ) -> Result<(Tensor<B, 1>, Option<Tensor<B, 1>>), TrainError> {
        let gain = leaves.p1(self.store, &format!("{prefix}.gain"), self.device)?;
        let bias = match self.model.norm {
            NormKind::LayerNorm => {
                Some(leaves.p1(self.store, &format!("{prefix}.bias"), self.device)?)
            }
            NormKind::RmsNorm => None,
        };
        Ok((gain, bias))
    }

    /// The layer norm in front of layer `l`'s `block`.
    fn block_norm(
        &self,
        block: Block,
        l: usize,
        x: Tensor<B, 3>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let which = match block {
            Block::Attention => "norm1",
            Block::FeedForward => "norm2",
        };
        let (gain, bias) = self.norm_params(&format!("blocks.{l}.{which}"), leaves)?;
        Ok(norm(x, gain, bias, self.model.norm_eps))
    }

    /// This rank's partial sum of layer `l`'s dense `block` (attention or the MLP) on its
    /// normalised input `h`.
    fn block_core(
        &self,
        block: Block,
        l: usize,
        h: Tensor<B, 3>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        match block {
            Block::Attention => self.attn_core(l, h, leaves),
            Block::FeedForward => self.mlp_core(l, h, leaves),
        }
    }

    /// This rank's partial sum of layer `l`'s attention on its normalised input `h`.
    fn attn_core(
        &self,
        l: usize,
        h: Tensor<B, 3>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let b = format!("blocks.{l}");
        let (s, d) = (self.store, self.device);
        let w = AttentionWeights {
            wq: leaves.p2(s, &format!("{b}.attn.wq"), d)?,
            wk: leaves.p2(s, &format!("{b}.attn.wk"), d)?,
            wv: leaves.p2(s, &format!("{b}.attn.wv"), d)?,
            wo: leaves.p2(s, &format!("{b}.attn.wo"), d)?,
        };
        let tp = self.mp.layout.tp;
        Ok(attention(
            h,
            w,
            self.model.n_heads / tp,
            self.model.n_kv_heads / tp,
            self.model.head_dim(),
            self.aux,
        ))
    }

    /// This rank's partial sum of layer `l`'s MLP on its normalised input `h`.
    fn mlp_core(
        &self,
        l: usize,
        h: Tensor<B, 3>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let b = format!("blocks.{l}");
        let (s, d) = (self.store, self.device);
        let w_gate = match self.model.mlp {
            crate::config::MlpKind::SwiGlu => Some(leaves.p2(s, &format!("{b}.mlp.w_gate"), d)?),
            crate::config::MlpKind::Gelu => None,
        };
        Ok(mlp(
            h,
            leaves.p2(s, &format!("{b}.mlp.w_in"), d)?,
            w_gate,
            leaves.p2(s, &format!("{b}.mlp.w_out"), d)?,
        ))
    }

    fn embed_segment(
        &self,
        tokens: Tensor<B, 2, Int>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let tok = leaves.p2(self.store, "tok_emb", self.device)?;
        let pos = match self.model.positions {
            crate::config::PositionKind::Learned => {
                Some(leaves.p2(self.store, "pos_emb", self.device)?)
            }
            crate::config::PositionKind::Rope => None,
        };
        Ok(embed(tok, pos, tokens))
    }

    fn head_segment(
        &self,
        x: Tensor<B, 3>,
        targets: Tensor<B, 2, Int>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 1>, TrainError> {
        let [b, t, d] = x.dims();
        let (gain, bias) = self.norm_params("norm_f", leaves)?;
        let h = norm(x, gain, bias, self.model.norm_eps).reshape([b * t, d]);
        let logits = if self.model.tie_embeddings {
            h.matmul(leaves.p2(self.store, "tok_emb", self.device)?.transpose())
        } else {
            h.matmul(leaves.p2(self.store, "head", self.device)?)
        };
        Ok(cross_entropy(logits, targets))
    }

    /// Megatron's `g` forward (and `f` backward): the sum of `t` over the tensor-parallel
    /// group.
    fn tp_sum(&mut self, t: Tensor<B, 3>) -> Result<Tensor<B, 3>, TrainError> {
        if self.mp.layout.tp == 1 {
            return Ok(t);
        }
        let dims = t.dims();
        let mut v = to_vec(t)?;
        let group = &self.mp.tp_group;
        self.comm
            .group_all_reduce_sum_f32(group, &mut v)
            .map_err(|e| TrainError::Comm {
                rank: self.mp.rank,
                source: e,
            })?;
        Ok(tensor3(v, dims, self.device))
    }

    /// Whether the regions between the tensor-parallel blocks run on a slice of the sequence
    /// (sequence parallelism; never with a single tensor-parallel rank).
    fn sequence_parallel(&self) -> bool {
        self.mp.layout.sequence_parallel && self.mp.layout.tp > 1
    }

    /// The sequence length of the activations between blocks and stages: this rank's slice
    /// with sequence parallelism, else the whole sequence.
    fn local_seq(&self, mb: &MicroBatch) -> usize {
        if self.sequence_parallel() {
            mb.seq / self.mp.layout.tp
        } else {
            mb.seq
        }
    }

    /// Sequence parallelism's all-gather: every tensor-parallel rank's slice `[n, s, d]` of
    /// the sequence, put together in group order into the whole `[n, tp · s, d]`.
    fn seq_gather(&mut self, t: Tensor<B, 3>) -> Result<Tensor<B, 3>, TrainError> {
        let [n, s, d] = t.dims();
        let tp = self.mp.layout.tp;
        let mine = to_vec(t)?;
        let mut parts = vec![0.0f32; mine.len() * tp];
        let group = &self.mp.tp_group;
        self.comm
            .group_all_gather_f32(group, &mine, &mut parts)
            .map_err(|source| TrainError::Comm {
                rank: self.mp.rank,
                source,
            })?;
        Ok(tensor3(
            slices_to_sequence(&parts, n, tp),
            [n, s * tp, d],
            self.device,
        ))
    }

    /// Sequence parallelism's reduce-scatter: the sum of `t` (`[n, s, d]`, this rank's
    /// partial sum over the whole sequence) over the tensor-parallel group, of which this rank
    /// keeps its slice `[n, s / tp, d]`.
    fn seq_reduce_scatter(&mut self, t: Tensor<B, 3>) -> Result<Tensor<B, 3>, TrainError> {
        let [n, s, d] = t.dims();
        let tp = self.mp.layout.tp;
        let whole = sequence_to_slices(&to_vec(t)?, n, tp);
        let mut mine = vec![0.0f32; whole.len() / tp];
        let group = &self.mp.tp_group;
        self.comm
            .group_reduce_scatter_sum_f32(group, &whole, &mut mine)
            .map_err(|source| TrainError::Comm {
                rank: self.mp.rank,
                source,
            })?;
        Ok(tensor3(mine, [n, s / tp, d], self.device))
    }

    /// Runs the segment `body` on `x`. Training: on a fresh leaf copy of `x` with parameter
    /// leaves, keeping the graph for the backward pass; the output is returned detached, so
    /// that the next segment starts its own graph.
    fn run_segment(
        &self,
        x: &Tensor<B, 3>,
        train: bool,
        body: impl FnOnce(&Self, Tensor<B, 3>, &mut Leaves<B>) -> Result<Tensor<B, 3>, TrainError>,
    ) -> Result<(Tensor<B, 3>, Option<Kept<B, 3>>), TrainError> {
        let mut leaves = Leaves::new(train);
        let xin = if train {
            x.clone().detach().require_grad()
        } else {
            x.clone()
        };
        let y = body(self, xin.clone(), &mut leaves)?;
        let out = y.clone().detach();
        Ok((out, train.then_some(Kept { x: xin, y, leaves })))
    }

    /// Layer `l`'s `block` on the residual stream `x`: returns `x` plus the block's output,
    /// and with `train` what its backward pass needs.
    ///
    /// Without sequence parallelism `x` is the whole sequence, the same on every
    /// tensor-parallel rank. The norm and this rank's share of the block run as one segment
    /// (`f`, identity forward, sits at the segment's input), and `g` is the all-reduce of the
    /// partial sums.
    ///
    /// With sequence parallelism `x` is this rank's slice of the sequence. The norm is a
    /// segment of its own on the slice; `f` all-gathers the normalised slices into the whole
    /// sequence, which the block's share needs (attention mixes positions, and every rank
    /// holds only some heads or hidden units for all of them); and `g` reduce-scatters the
    /// partial sums, which is the all-reduce without its all-gather: each rank receives only
    /// the slice that its residual add, the next norm and the next block's all-gather need.
    fn block_forward(
        &mut self,
        block: Block,
        l: usize,
        x: Tensor<B, 3>,
        train: bool,
    ) -> Result<(Tensor<B, 3>, Option<BlockKept<B>>), TrainError> {
        let sp = self.sequence_parallel();
        let (input, norm) = if sp {
            let (h, kept) =
                self.run_segment(&x, train, |s, x, leaves| s.block_norm(block, l, x, leaves))?;
            (self.seq_gather(h)?, kept)
        } else {
            (x.clone(), None)
        };
        let (partial, body) = if block == Block::FeedForward && self.model.moe.is_some() {
            // With sequence parallelism the input is already normalised.
            let (p, saved) = self.moe_forward(l, &input, sp, train)?;
            (p, saved.map(BodyKept::Experts))
        } else {
            let (p, kept) = self.run_segment(&input, train, |s, x, leaves| {
                let h = if sp {
                    x
                } else {
                    s.block_norm(block, l, x, leaves)?
                };
                s.block_core(block, l, h, leaves)
            })?;
            (p, kept.map(BodyKept::Dense))
        };
        let y = if sp {
            self.seq_reduce_scatter(partial)?
        } else {
            self.tp_sum(partial)?
        };
        Ok((x + y, body.map(|body| BlockKept { norm, body })))
    }

    /// The stage's forward pass over one micro-batch through model chunk `chunk`: from the
    /// tokens (first chunk) or the received activations `input`, to the activations to send
    /// on or, on the last chunk, the loss. With `train` the segments' graphs are kept.
    fn forward(
        &mut self,
        mb: &MicroBatch,
        chunk: usize,
        input: Option<Vec<f32>>,
        train: bool,
    ) -> Result<Forwarded<B>, TrainError> {
        let seq = self.local_seq(mb);
        let mut embed = None;
        let mut x = match input {
            Some(v) => tensor3(v, [mb.n, seq, self.model.d_model], self.device),
            None => {
                let tokens = self.int2(&mb.inputs, mb.n, mb.seq);
                let mut leaves = Leaves::new(train);
                let y = self.embed_segment(tokens, &mut leaves)?;
                let out = y.clone().detach();
                if train {
                    embed = Some((y, leaves));
                }
                // Sequence parallelism: the embeddings are replicated, so every rank embeds
                // the whole sequence and keeps its slice (the backward pass all-gathers the
                // slices' gradients, giving every rank the same embedding gradient).
                if seq < mb.seq {
                    out.narrow(1, self.mp.coords.tp * seq, seq)
                } else {
                    out
                }
            }
        };
        let mut layers = Vec::new();
        for l in self.layers(chunk) {
            let (x1, attn) = self.block_forward(Block::Attention, l, x, train)?;
            let (x2, ffn) = self.block_forward(Block::FeedForward, l, x1, train)?;
            x = x2;
            if let (Some(a), Some(f)) = (attn, ffn) {
                layers.push((a, f));
            }
        }
        let mut head = None;
        let mut loss = None;
        let mut out = None;
        if self.mp.is_last_chunk(chunk) {
            // Sequence parallelism: the head is replicated too, so it runs on the whole
            // sequence, gathered; every rank then computes the same loss and the same input
            // gradient, of which the backward pass keeps this rank's slice.
            if seq < mb.seq {
                x = self.seq_gather(x)?;
            }
            let targets = self.int2(&mb.targets, mb.n, mb.seq);
            let mut leaves = Leaves::new(train);
            let xin = if train { x.detach().require_grad() } else { x };
            let l = self.head_segment(xin.clone(), targets, &mut leaves)?;
            loss = Some(
                to_vec(l.clone().detach())?
                    .first()
                    .copied()
                    .unwrap_or(f32::NAN),
            );
            if train {
                head = Some(Kept {
                    x: xin,
                    y: l,
                    leaves,
                });
            }
        } else {
            out = Some(to_vec(x)?);
        }
        let saved = train.then_some(Saved {
            shape: [mb.n, seq, self.model.d_model],
            embed,
            layers,
            head,
        });
        Ok(Forwarded { out, loss, saved })
    }

    /// Backward through a kept segment with upstream gradient `g` of its output: adds its
    /// parameters' gradients to the rank's and returns its input's gradient (this rank's
    /// share; the caller applies Megatron's `f`).
    fn segment_backward(
        &mut self,
        k: Kept<B, 3>,
        g: Tensor<B, 3>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let dims = k.x.dims();
        let grads = (k.y * g).sum().backward();
        k.leaves.accumulate(&grads, self.grads)?;
        let dx = match k.x.grad(&grads) {
            Some(d) => to_vec(d)?,
            None => vec![0.0; dims.iter().product()],
        };
        Ok(tensor3(dx, dims, self.device))
    }

    /// The backward pass of [`Self::block_forward`] with upstream gradient `g` of the new
    /// residual stream: the old one's, `g` itself (the residual path) plus the block's.
    ///
    /// The operators' backward passes mirror their forward passes: without sequence
    /// parallelism `g`'s is the identity and `f`'s the all-reduce of the input gradient's
    /// shares; with it `g`'s is an all-gather of the slices' gradients (the body's partial
    /// sums went to every slice) and `f`'s a reduce-scatter of the shares, which sums them and
    /// hands each rank its slice for the norm's backward pass.
    fn block_backward(
        &mut self,
        k: BlockKept<B>,
        g: Tensor<B, 3>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let gy = if k.norm.is_some() {
            self.seq_gather(g.clone())?
        } else {
            g.clone()
        };
        let dh = match k.body {
            BodyKept::Dense(kept) => self.segment_backward(kept, gy)?,
            BodyKept::Experts(saved) => self.moe_backward(gy, saved)?,
        };
        let dx = match k.norm {
            Some(norm) => {
                let dh = self.seq_reduce_scatter(dh)?;
                self.segment_backward(norm, dh)?
            }
            None => self.tp_sum(dh)?,
        };
        Ok(g + dx)
    }

    /// The stage's backward pass over one micro-batch: from the loss (last chunk, scaled by
    /// `scale`) or the received gradient `g` of its output, to the gradient of its input to
    /// send back (`None` on the first chunk).
    fn backward(
        &mut self,
        saved: Saved<B>,
        g: Option<Vec<f32>>,
        scale: f32,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        let mut g = match (saved.head, g) {
            (Some(k), _) => {
                let shape = k.x.dims();
                let grads = k.y.mul_scalar(scale).backward();
                k.leaves.accumulate(&grads, self.grads)?;
                let dx = match k.x.grad(&grads) {
                    Some(d) => to_vec(d)?,
                    None => vec![0.0; shape.iter().product()],
                };
                // Sequence parallelism: the head ran on the gathered sequence; this rank's
                // slice of its input gradient is the gradient of this rank's slice.
                let parts = shape[1] / saved.shape[1];
                let dx = if parts > 1 {
                    sequence_slice(&dx, shape[0], parts, self.mp.coords.tp)
                } else {
                    dx
                };
                tensor3(dx, saved.shape, self.device)
            }
            (None, Some(v)) => tensor3(v, saved.shape, self.device),
            (None, None) => {
                return Err(TrainError::Backend(
                    "a pipeline stage before the last got no output gradient".into(),
                ))
            }
        };
        for (attn, ffn) in saved.layers.into_iter().rev() {
            g = self.block_backward(ffn, g)?;
            g = self.block_backward(attn, g)?;
        }
        match saved.embed {
            Some((y, leaves)) => {
                // Sequence parallelism: the forward pass kept this rank's slice of the
                // embeddings, so the whole sequence's gradient is the slices' put together.
                if g.dims()[1] < y.dims()[1] {
                    g = self.seq_gather(g)?;
                }
                let grads = (y * g).sum().backward();
                leaves.accumulate(&grads, self.grads)?;
                Ok(None)
            }
            None => Ok(Some(to_vec(g)?)),
        }
    }

    /// Elements of a micro-batch's activations (or their gradient) between stages.
    fn act_len(&self, mb: &MicroBatch) -> usize {
        mb.n * self.local_seq(mb) * self.model.d_model
    }

    /// A micro-batch's activations or their gradient from `peer` (`None`: there is no such
    /// stage, and nothing to receive).
    fn recv_from(
        &mut self,
        peer: Option<usize>,
        mb: &MicroBatch,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        let Some(peer) = peer else {
            return Ok(None);
        };
        let mut buf = vec![0.0; self.act_len(mb)];
        self.comm
            .recv_f32(peer, &mut buf)
            .map_err(|e| self.comm_err(e))?;
        Ok(Some(buf))
    }

    /// Sends `data` to `peer` when both exist.
    fn send_to(&mut self, peer: Option<usize>, data: Option<Vec<f32>>) -> Result<(), TrainError> {
        if let (Some(peer), Some(data)) = (peer, data) {
            self.comm
                .send_f32(peer, &data)
                .map_err(|e| self.comm_err(e))?;
        }
        Ok(())
    }

    /// Activations from the previous stage (`None` on the first stage, which embeds tokens).
    fn recv_forward(&mut self, mb: &MicroBatch) -> Result<Option<Vec<f32>>, TrainError> {
        self.recv_from(self.mp.prev, mb)
    }

    fn send_forward(&mut self, out: Option<Vec<f32>>) -> Result<(), TrainError> {
        self.send_to(self.mp.next, out)
    }

    fn recv_backward(&mut self, mb: &MicroBatch) -> Result<Option<Vec<f32>>, TrainError> {
        self.recv_from(self.mp.next, mb)
    }

    fn send_backward(&mut self, dx: Option<Vec<f32>>) -> Result<(), TrainError> {
        self.send_to(self.mp.prev, dx)
    }

    /// Sends `data` to `peer` and receives a micro-batch's activations or gradient (`mb`)
    /// from it, as one exchange (`None` when there is no such stage or nothing to send).
    fn exchange(
        &mut self,
        peer: Option<usize>,
        data: Option<Vec<f32>>,
        mb: &MicroBatch,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        match (peer, data) {
            (Some(peer), Some(data)) => {
                let mut buf = vec![0.0; self.act_len(mb)];
                self.comm
                    .send_recv_f32(peer, &data, peer, &mut buf)
                    .map_err(|e| self.comm_err(e))?;
                Ok(Some(buf))
            }
            _ => Ok(None),
        }
    }

    /// Sends this micro-batch's activations on and receives the gradient of another's
    /// (`mb_back`) from the next stage, as one exchange.
    fn send_forward_recv_backward(
        &mut self,
        out: Option<Vec<f32>>,
        mb_back: &MicroBatch,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        self.exchange(self.mp.next, out, mb_back)
    }

    /// Sends a gradient back and receives the next micro-batch's (`mb_fwd`) activations from
    /// the previous stage, as one exchange.
    fn send_backward_recv_forward(
        &mut self,
        dx: Option<Vec<f32>>,
        mb_fwd: &MicroBatch,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        self.exchange(self.mp.prev, dx, mb_fwd)
    }

    /// The 1F1B schedule over `micro`: returns the sum of the micro-batch losses (last stage;
    /// 0 elsewhere).
    fn one_f_one_b(&mut self, micro: &[MicroBatch]) -> Result<f32, TrainError> {
        let m = micro.len();
        let scale = 1.0 / m as f32;
        let stages = self.mp.layout.pp;
        let warmup = (stages - self.mp.coords.pp - 1).min(m);
        let steady = m - warmup;
        let mut saved = std::collections::VecDeque::new();
        let mut loss_sum = 0.0f32;
        let mut add_loss = |l: Option<f32>| {
            if let Some(l) = l {
                loss_sum += l;
            }
        };
        for mb in &micro[..warmup] {
            let input = self.recv_forward(mb)?;
            let Forwarded {
                out,
                loss,
                saved: s,
            } = self.forward(mb, 0, input, true)?;
            add_loss(loss);
            saved.push_back(s);
            self.send_forward(out)?;
        }
        let mut input = if steady > 0 {
            self.recv_forward(&micro[warmup])?
        } else {
            None
        };
        for i in 0..steady {
            let (fwd, back) = (warmup + i, i);
            let Forwarded {
                out,
                loss,
                saved: s,
            } = self.forward(&micro[fwd], 0, input.take(), true)?;
            add_loss(loss);
            saved.push_back(s);
            let g = self.send_forward_recv_backward(out, &micro[back])?;
            let s = saved
                .pop_front()
                .flatten()
                .ok_or_else(|| TrainError::Backend("1F1B lost a micro-batch".into()))?;
            let dx = self.backward(s, g, scale)?;
            if i + 1 == steady {
                self.send_backward(dx)?;
            } else {
                input = self.send_backward_recv_forward(dx, &micro[fwd + 1])?;
            }
        }
        for mb in &micro[steady..] {
            let g = self.recv_backward(mb)?;
            let s = saved
                .pop_front()
                .flatten()
                .ok_or_else(|| TrainError::Backend("1F1B lost a micro-batch".into()))?;
            let dx = self.backward(s, g, scale)?;
            self.send_backward(dx)?;
        }
        Ok(loss_sum)
    }
}

impl<B: AutodiffBackend> Stage<'_, B> {
    fn send_tagged(
        &mut self,
        to: usize,
        kind: u8,
        chunk: usize,
        mb: usize,
        data: &[f32],
    ) -> Result<(), TrainError> {
        self.comm
            .send_f32_tagged(to, message_tag(kind, chunk, mb), data)
            .map_err(|e| self.comm_err(e))
    }

    /// The message of `kind` for `chunk` and micro-batch `mb` from `from`, of `len` elements,
    /// whenever it was sent among the pair's other messages.
    fn recv_tagged(
        &mut self,
        from: usize,
        kind: u8,
        chunk: usize,
        mb: usize,
        len: usize,
    ) -> Result<Vec<f32>, TrainError> {
        let mut buf = vec![0.0f32; len];
        self.comm
            .recv_f32_tagged(from, message_tag(kind, chunk, mb), &mut buf)
            .map_err(|e| self.comm_err(e))?;
        Ok(buf)
    }

    /// Interleaved 1F1B (Megatron's schedule for `v` model chunks per rank): the `m · v`
    /// forward passes run in groups of `pp` micro-batches per chunk, chunk by chunk; the
    /// backward passes in the same order with the chunks reversed. A stage warms up with
    /// `2 (pp - stage - 1) + (v - 1) pp` forwards (all of them when `m = pp`), then
    /// alternates one forward and one backward, then drains. Every message is tagged and
    /// received just before it is needed; the sends must not wait for their receiver (the
    /// trainer checks [`Communicator::sends_never_wait`]).
    fn interleaved(&mut self, micro: &[MicroBatch]) -> Result<f32, TrainError> {
        let m = micro.len();
        let (pp, v) = (self.mp.layout.pp, self.mp.layout.virtual_stages);
        let s = self.mp.coords.pp;
        let total = m * v;
        let warmup = if m == pp {
            total
        } else {
            ((pp - s - 1) * 2 + (v - 1) * pp).min(total)
        };
        let mut saved = HashMap::new();
        let mut loss_sum = 0.0f32;
        for k in 0..warmup {
            loss_sum += self.interleaved_forward(micro, k, &mut saved)?;
        }
        for i in 0..total - warmup {
            loss_sum += self.interleaved_forward(micro, warmup + i, &mut saved)?;
            self.interleaved_backward(micro, i, &mut saved)?;
        }
        for k in total - warmup..total {
            self.interleaved_backward(micro, k, &mut saved)?;
        }
        Ok(loss_sum)
    }

    /// The micro-batch of the `k`-th forward (or backward) pass of interleaved 1F1B.
    fn interleaved_mb(&self, k: usize) -> usize {
        let (pp, v) = (self.mp.layout.pp, self.mp.layout.virtual_stages);
        (k / (pp * v)) * pp + k % pp
    }

    /// The `k`-th forward pass of interleaved 1F1B; its loss (0 off the last chunk).
    fn interleaved_forward(
        &mut self,
        micro: &[MicroBatch],
        k: usize,
        saved: &mut HashMap<(usize, usize), Saved<B>>,
    ) -> Result<f32, TrainError> {
        let (pp, v) = (self.mp.layout.pp, self.mp.layout.virtual_stages);
        let (chunk, mb) = ((k / pp) % v, self.interleaved_mb(k));
        let len = self.act_len(&micro[mb]);
        let input = match self.mp.chunk_prev(chunk) {
            Some((from, _)) => Some(self.recv_tagged(from, TAG_FORWARD, chunk, mb, len)?),
            None => None,
        };
        let f = self.forward(&micro[mb], chunk, input, true)?;
        if let Some(kept) = f.saved {
            saved.insert((chunk, mb), kept);
        }
        if let (Some((to, their_chunk)), Some(out)) = (self.mp.chunk_next(chunk), f.out) {
            self.send_tagged(to, TAG_FORWARD, their_chunk, mb, &out)?;
        }
        Ok(f.loss.unwrap_or(0.0))
    }

    /// The `k`-th backward pass of interleaved 1F1B.
    fn interleaved_backward(
        &mut self,
        micro: &[MicroBatch],
        k: usize,
        saved: &mut HashMap<(usize, usize), Saved<B>>,
    ) -> Result<(), TrainError> {
        let (pp, v) = (self.mp.layout.pp, self.mp.layout.virtual_stages);
        let (chunk, mb) = (v - 1 - (k / pp) % v, self.interleaved_mb(k));
        let len = self.act_len(&micro[mb]);
        let g = match self.mp.chunk_next(chunk) {
            Some((from, _)) => Some(self.recv_tagged(from, TAG_BACKWARD, chunk, mb, len)?),
            None => None,
        };
        let s = saved.remove(&(chunk, mb)).ok_or_else(|| {
            TrainError::Backend(format!(
                "interleaved 1F1B: backward of chunk {chunk}, micro-batch {mb} before its forward"
            ))
        })?;
        let dx = self.backward(s, g, 1.0 / micro.len() as f32)?;
        if let (Some((to, their_chunk)), Some(dx)) = (self.mp.chunk_prev(chunk), dx) {
            self.send_tagged(to, TAG_BACKWARD, their_chunk, mb, &dx)?;
        }
        Ok(())
    }
}

/// Mixture-of-experts layers (`model.moe`): the router on the token's rank, the experts on the
/// ranks of the expert-parallel group that hold them, tokens sent there and results sent back
/// with the group all-to-all (Megatron's dispatch and combine).
impl<B: AutodiffBackend> Stage<'_, B> {
    fn moe_top_k(&self) -> usize {
        self.model.moe.map_or(1, |m| m.top_k)
    }

    fn moe_experts(&self) -> usize {
        self.model.moe.map_or(1, |m| m.experts)
    }

    /// The group member (position in the expert-parallel group) holding expert `e`.
    fn expert_owner(&self, e: usize) -> usize {
        e / (self.moe_experts() / self.mp.layout.ep).max(1)
    }

    /// Layer `l`'s router: the normalised input `h` (`[n, d]`; `x` normalised here unless
    /// `normed`) and the gates (`[n, experts]`), with the chosen experts' mask.
    fn router_segment(
        &self,
        l: usize,
        x: Tensor<B, 3>,
        normed: bool,
        leaves: &mut Leaves<B>,
    ) -> Result<Routed<B>, TrainError> {
        let [b, t, d] = x.dims();
        let h = if normed {
            x
        } else {
            self.block_norm(Block::FeedForward, l, x, leaves)?
        };
        let h = h.reshape([b * t, d]);
        let router = leaves.p2(self.store, &format!("blocks.{l}.moe.router"), self.device)?;
        let (gates, mask) = moe_gates_and_mask(h.clone(), router, self.moe_top_k());
        Ok(Routed { h, gates, mask })
    }

    /// Expert `e` of layer `l` on `rows` (`[1, r, d]`): this rank's tensor-parallel share.
    fn expert_segment(
        &self,
        l: usize,
        e: usize,
        rows: Tensor<B, 3>,
        leaves: &mut Leaves<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let p = format!("blocks.{l}.moe.experts.{e}");
        let (s, d) = (self.store, self.device);
        let w_gate = match self.model.mlp {
            crate::config::MlpKind::SwiGlu => Some(leaves.p2(s, &format!("{p}.w_gate"), d)?),
            crate::config::MlpKind::Gelu => None,
        };
        Ok(mlp(
            rows,
            leaves.p2(s, &format!("{p}.w_in"), d)?,
            w_gate,
            leaves.p2(s, &format!("{p}.w_out"), d)?,
        ))
    }

    /// The group all-to-all over the expert-parallel group with `rows[j]` rows of `width`
    /// to and from member `j`.
    fn ep_exchange(
        &mut self,
        send: &[f32],
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<Vec<f32>, TrainError> {
        let sc: Vec<usize> = send_rows.iter().map(|r| r * width).collect();
        let rc: Vec<usize> = recv_rows.iter().map(|r| r * width).collect();
        let mut recv = vec![0.0f32; rc.iter().sum()];
        let group = &self.mp.ep_group;
        self.comm
            .group_all_to_all_v_f32(group, send, &sc, &mut recv, &rc)
            .map_err(|source| TrainError::Comm {
                rank: self.mp.rank,
                source,
            })?;
        Ok(recv)
    }

    /// Runs every local expert on the rows it was sent (`recv`, width `d + 1`): outputs in the
    /// same order (width `d`), and with `train` each expert's kept segment with the indices of
    /// its rows.
    #[allow(clippy::type_complexity)]
    fn run_experts(
        &mut self,
        l: usize,
        recv: &[f32],
        train: bool,
    ) -> Result<(Vec<f32>, Vec<(Vec<usize>, Kept<B, 3>)>), TrainError> {
        let d = self.model.d_model;
        let n_rows = recv.len() / (d + 1);
        let mut out = vec![0.0f32; n_rows * d];
        let mut kept = Vec::new();
        let mut by_expert: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (i, row) in recv.chunks_exact(d + 1).enumerate() {
            by_expert.entry(row[0] as usize).or_default().push(i);
        }
        for (e, idx) in by_expert {
            let rows: Vec<f32> = idx
                .iter()
                .flat_map(|&i| recv[i * (d + 1) + 1..(i + 1) * (d + 1)].iter().copied())
                .collect();
            let x = tensor3::<B>(rows, [1, idx.len(), d], self.device);
            let x = if train { x.require_grad() } else { x };
            let mut leaves = Leaves::new(train);
            let y = self.expert_segment(l, e, x.clone(), &mut leaves)?;
            let result = to_vec(y.clone().detach())?;
            for (k, &i) in idx.iter().enumerate() {
                out[i * d..(i + 1) * d].copy_from_slice(&result[k * d..(k + 1) * d]);
            }
            if train {
                kept.push((idx, Kept { x, y, leaves }));
            }
        }
        Ok((out, kept))
    }

    /// Layer `l`'s mixture of experts on `x` (normalised first unless `normed`, as with
    /// sequence parallelism, where the norm ran on the slice before the all-gather): route,
    /// dispatch each token to its chosen experts' ranks, run the local experts, return the
    /// results, and sum them weighted by the gates in expert order (the reference's order).
    /// The output is this rank's tensor-parallel partial sum, like the dense MLP's.
    fn moe_forward(
        &mut self,
        l: usize,
        x: &Tensor<B, 3>,
        normed: bool,
        train: bool,
    ) -> Result<(Tensor<B, 3>, Option<MoeSaved<B>>), TrainError> {
        let [b, t, d] = x.dims();
        let n = b * t;
        let experts = self.moe_experts();
        let members = self.mp.layout.ep;
        let xin = if train {
            x.clone().detach().require_grad()
        } else {
            x.clone()
        };
        let mut leaves = Leaves::new(train);
        let Routed { h, gates, mask } = self.router_segment(l, xin.clone(), normed, &mut leaves)?;
        let hv = to_vec(h.clone().detach())?;
        let gv = to_vec(gates.clone().detach())?;
        let mut pairs = Vec::new();
        let mut sent_rows = vec![0usize; members];
        let mut send = Vec::new();
        for (q, rows) in sent_rows.iter_mut().enumerate() {
            for tok in 0..n {
                for e in 0..experts {
                    if mask[tok * experts + e] != 0.0 && self.expert_owner(e) == q {
                        pairs.push((tok, e));
                        *rows += 1;
                        send.push(e as f32);
                        send.extend_from_slice(&hv[tok * d..(tok + 1) * d]);
                    }
                }
            }
        }
        // Row counts first (one each, exact in f32), so that every member knows what it gets.
        let counts: Vec<f32> = sent_rows.iter().map(|&r| r as f32).collect();
        let ones = vec![1; members];
        let got = self.ep_exchange(&counts, &ones, &ones, 1)?;
        let recv_rows: Vec<usize> = got.iter().map(|&c| c as usize).collect();
        let recv = self.ep_exchange(&send, &sent_rows, &recv_rows, d + 1)?;
        let (outputs, kept) = self.run_experts(l, &recv, train)?;
        let y = self.ep_exchange(&outputs, &recv_rows, &sent_rows, d)?;
        let out = combine(&pairs, &y, &gv, experts, n, d);
        let saved = train.then_some(MoeSaved {
            pairs,
            sent_rows,
            recv_rows,
            y,
            gates: gv,
            router: RouterKept {
                x: xin,
                h,
                gates,
                leaves,
            },
            experts: kept,
        });
        Ok((tensor3(out, [b, t, d], self.device), saved))
    }

    /// The backward pass of [`Self::moe_forward`] with upstream gradient `g`; like
    /// [`Self::segment_backward`] it returns this rank's share of the input's gradient.
    fn moe_backward(
        &mut self,
        g: Tensor<B, 3>,
        s: MoeSaved<B>,
    ) -> Result<Tensor<B, 3>, TrainError> {
        let [b, t, d] = s.router.x.dims();
        let n = b * t;
        let experts = self.moe_experts();
        let gv = to_vec(g)?;
        // The weighted sum: d y = gate · g, d gate = y · g (chosen experts only; the others'
        // gates are a constant zero).
        let mut dy = Vec::with_capacity(s.y.len());
        let mut dgates = vec![0.0f32; n * experts];
        for (k, &(tok, e)) in s.pairs.iter().enumerate() {
            let gate = s.gates[tok * experts + e];
            let grow = &gv[tok * d..(tok + 1) * d];
            let yrow = &s.y[k * d..(k + 1) * d];
            dy.extend(grow.iter().map(|&x| gate * x));
            dgates[tok * experts + e] = yrow.iter().zip(grow).map(|(a, b)| a * b).sum();
        }
        let dy_recv = self.ep_exchange(&dy, &s.sent_rows, &s.recv_rows, d)?;
        let total_rows: usize = s.recv_rows.iter().sum();
        let mut drows = vec![0.0f32; total_rows * d];
        for (idx, k) in s.experts {
            let gy: Vec<f32> = idx
                .iter()
                .flat_map(|&i| dy_recv[i * d..(i + 1) * d].iter().copied())
                .collect();
            let gy = tensor3::<B>(gy, [1, idx.len(), d], self.device);
            let grads = (k.y * gy).sum().backward();
            k.leaves.accumulate(&grads, self.grads)?;
            let dx = match k.x.grad(&grads) {
                Some(v) => to_vec(v)?,
                None => vec![0.0; idx.len() * d],
            };
            for (j, &i) in idx.iter().enumerate() {
                drows[i * d..(i + 1) * d].copy_from_slice(&dx[j * d..(j + 1) * d]);
            }
        }
        let dh_pairs = self.ep_exchange(&drows, &s.recv_rows, &s.sent_rows, d)?;
        let mut dh = vec![0.0f32; n * d];
        for (k, &(tok, _)) in s.pairs.iter().enumerate() {
            for (acc, v) in dh[tok * d..(tok + 1) * d]
                .iter_mut()
                .zip(&dh_pairs[k * d..(k + 1) * d])
            {
                *acc += v;
            }
        }
        let r = s.router;
        let dev = self.device;
        let dh = Tensor::<B, 2>::from_data(TensorData::new(dh, [n, d]), dev);
        let dgates = Tensor::<B, 2>::from_data(TensorData::new(dgates, [n, experts]), dev);
        let grads = ((r.h * dh).sum() + (r.gates * dgates).sum()).backward();
        r.leaves.accumulate(&grads, self.grads)?;
        let dx = match r.x.grad(&grads) {
            Some(v) => to_vec(v)?,
            None => vec![0.0; n * d],
        };
        Ok(tensor3(dx, [b, t, d], self.device))
    }
}

/// Each token's output: its chosen experts' results `y` (one row per pair of `pairs`) weighted
/// by the gates, summed in expert order.
fn combine(
    pairs: &[(usize, usize)],
    y: &[f32],
    gates: &[f32],
    experts: usize,
    n: usize,
    d: usize,
) -> Vec<f32> {
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by_key(|&k| pairs[k]);
    let mut out = vec![0.0f32; n * d];
    let mut started = vec![false; n];
    for k in order {
        let (tok, e) = pairs[k];
        let gate = gates[tok * experts + e];
        let dst = &mut out[tok * d..(tok + 1) * d];
        let src = &y[k * d..(k + 1) * d];
        if std::mem::replace(&mut started[tok], true) {
            for (acc, v) in dst.iter_mut().zip(src) {
                *acc += gate * v;
            }
        } else {
            for (acc, v) in dst.iter_mut().zip(src) {
                *acc = gate * v;
            }
        }
    }
    out
}

/// With sequence parallelism, refuses micro-batches whose sequences do not cut into as many
/// equal slices as there are tensor-parallel ranks, before anything is sent (the
/// configuration's check of `model.context` keeps the trainer's batches from ever failing it).
fn check_sequence_split(mp: &ModelParallel, micro: &[MicroBatch]) -> Result<(), TrainError> {
    let tp = mp.layout.tp;
    match micro.iter().find(|mb| !mb.seq.is_multiple_of(tp)) {
        Some(mb) if mp.layout.sequence_parallel => Err(TrainError::Config(ConfigErrors {
            problems: vec![ConfigProblem {
                path: "parallel.sequence_parallel".into(),
                message: format!(
                    "sequences of {} tokens do not cut into tp {tp} equal slices",
                    mb.seq
                ),
            }],
        })),
        _ => Ok(()),
    }
}

/// Sums `buf` over `group` unless it has one member.
fn group_sum(
    comm: &mut dyn Communicator,
    group: &Group,
    rank: usize,
    buf: &mut [f32],
) -> Result<(), TrainError> {
    if group.len() > 1 {
        comm.group_all_reduce_sum_f32(group, buf)
            .map_err(|source| TrainError::Comm { rank, source })?;
    }
    Ok(())
}

/// The result of one model-parallel step on one rank.
#[derive(Debug, Clone, Copy)]
pub struct StepOutcome {
    /// Mean loss over the global batch (the same on every rank).
    pub loss: f32,
    /// Global L2 norm of the full model's gradient (the same on every rank).
    pub grad_norm: f64,
}

/// One step's forward and backward on this rank: runs `micro` (this data-parallel replica's
/// micro-batches) through the pipeline with 1F1B, leaves in `grads` this rank's shard of the
/// gradient averaged over the data-parallel group, and returns the global loss and gradient
/// norm. Every rank of the run must call it with the same number of equally sized
/// micro-batches.
#[allow(clippy::too_many_arguments)]
pub fn train_step<B: AutodiffBackend>(
    mp: &ModelParallel,
    model: &ModelConfig,
    store: &ParamStore,
    grads: &mut ParamStore,
    comm: &mut dyn Communicator,
    device: &B::Device,
    aux: &Aux<B>,
    micro: &[MicroBatch],
) -> Result<StepOutcome, TrainError> {
    grads.flat_mut().fill(0.0);
    let rank = mp.rank;
    check_sequence_split(mp, micro)?;
    let loss_sum = {
        let mut stage = Stage::<B> {
            mp,
            model,
            store,
            grads: &mut *grads,
            comm: &mut *comm,
            device,
            aux,
        };
        if mp.layout.virtual_stages > 1 {
            stage.interleaved(micro)?
        } else {
            stage.one_f_one_b(micro)?
        }
    };
    // Each tensor-parallel rank holds a share of the layer norms' gradients: without sequence
    // parallelism the norms sit after `f`, so it holds its heads' (or hidden units') share;
    // with it they run on the rank's slice of the sequence, so it holds its slice's share. The
    // routers' gradients come from this rank's share of the experts' outputs either way.
    if mp.layout.tp > 1 {
        let idx: Vec<usize> = (0..grads.len())
            .filter(|&i| {
                let n = grads.name(i);
                n.contains(".norm1.") || n.contains(".norm2.") || n.ends_with(".moe.router")
            })
            .collect();
        let mut buf: Vec<f32> = idx.iter().flat_map(|&i| grads.values(i).to_vec()).collect();
        group_sum(comm, &mp.tp_group, rank, &mut buf)?;
        let mut at = 0;
        for &i in &idx {
            let dst = grads.values_mut(i);
            let n = dst.len();
            dst.copy_from_slice(&buf[at..at + n]);
            at += n;
        }
    }
    // A tied embedding: the first stage holds the lookup's gradient, the last the head's.
    if model.tie_embeddings && mp.layout.pp > 1 && (mp.is_first_stage() || mp.is_last_stage()) {
        if let Some(i) = grads.index_of("tok_emb") {
            group_sum(comm, &mp.embedding_group, rank, grads.values_mut(i))?;
        }
    }
    let dp = mp.layout.dp;
    if dp > 1 {
        // Experts are summed over the ranks that hold them, everything else over the whole
        // data-parallel group; both then averaged over all replicas' tokens.
        let (experts, rest): (Vec<usize>, Vec<usize>) =
            (0..grads.len()).partition(|&i| expert_of(grads.name(i)).is_some());
        for (idx, group) in [(rest, &mp.dp_group), (experts, &mp.expert_dp_group)] {
            if idx.is_empty() {
                continue;
            }
            let mut buf: Vec<f32> = idx.iter().flat_map(|&i| grads.values(i).to_vec()).collect();
            group_sum(comm, group, rank, &mut buf)?;
            let mut at = 0;
            for &i in &idx {
                let dst = grads.values_mut(i);
                let n = dst.len();
                dst.copy_from_slice(&buf[at..at + n]);
                at += n;
            }
        }
        let inv = 1.0 / dp as f32;
        for x in grads.flat_mut() {
            *x *= inv;
        }
    }
    // The loss lives on the last stage; its first tensor-parallel rank of every replica
    // contributes, everyone else adds zeros (exactly).
    let mut l = [if mp.is_last_stage() && mp.coords.tp == 0 {
        loss_sum / micro.len().max(1) as f32
    } else {
        0.0
    }];
    comm.all_reduce_sum_f32(&mut l)
        .map_err(|source| TrainError::Comm { rank, source })?;
    let loss = l[0] * (1.0 / dp as f32);
    // Each element of the full gradient is counted by one rank; the partial sums are summed
    // in f64 in rank order, the same on every rank.
    let mut partial = 0.0f64;
    for i in 0..grads.len() {
        if mp.owns_for_norm(grads.name(i)) {
            partial += grads
                .values(i)
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>();
        }
    }
    let all = comm
        .all_gather_bytes(&partial.to_le_bytes())
        .map_err(|source| TrainError::Comm { rank, source })?;
    let mut sum = 0.0f64;
    for b in all {
        let bytes: [u8; 8] = b.as_slice().try_into().map_err(|_| TrainError::Comm {
            rank,
            source: CommError::LengthMismatch {
                rank,
                expected: 8,
                found: b.len(),
            },
        })?;
        sum += f64::from_le_bytes(bytes);
    }
    Ok(StepOutcome {
        loss,
        grad_norm: sum.sqrt(),
    })
}

/// Forward-only pass of one batch through the pipeline (evaluation): the batch's mean loss on
/// the last stage, `None` elsewhere.
pub fn eval_forward<B: AutodiffBackend>(
    mp: &ModelParallel,
    model: &ModelConfig,
    store: &ParamStore,
    comm: &mut dyn Communicator,
    device: &B::Device,
    aux: &Aux<B>,
    batch: &MicroBatch,
) -> Result<Option<f32>, TrainError> {
    check_sequence_split(mp, std::slice::from_ref(batch))?;
    let mut unused = ParamStore::zeros(&[]);
    let mut stage = Stage::<B> {
        mp,
        model,
        store,
        grads: &mut unused,
        comm,
        device,
        aux,
    };
    // One pass through the chunks in model order: a chain, so plain messages in order do.
    let mut loss = None;
    for chunk in 0..mp.layout.virtual_stages {
        let input = match mp.chunk_prev(chunk) {
            Some((from, _)) => {
                let mut buf = vec![0.0; stage.act_len(batch)];
                stage
                    .comm
                    .recv_f32(from, &mut buf)
                    .map_err(|e| stage.comm_err(e))?;
                Some(buf)
            }
            None => None,
        };
        let f = stage.forward(batch, chunk, input, false)?;
        loss = loss.or(f.loss);
        if let (Some((to, _)), Some(out)) = (mp.chunk_next(chunk), f.out) {
            stage
                .comm
                .send_f32(to, &out)
                .map_err(|e| stage.comm_err(e))?;
        }
    }
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::ParallelConfig;
    use crate::rng::Rng;

    fn model() -> ModelConfig {
        ModelConfig {
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            d_model: 16,
            d_ff: 32,
            vocab_size: 256,
            context: 8,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn shards_assemble_to_the_full_store() {
        let m = model();
        let par = ParallelConfig {
            tp: 2,
            pp: 2,
            dp: 2,
            micro_batches: 1,
            virtual_stages: 1,
            ep: 1,
            sequence_parallel: false,
        };
        let layout = Layout::new(&par, &m, 8, 8).unwrap();
        let full = ParamStore::init(&param_specs(&m), &mut Rng::new(3, 1));
        let locals: Vec<Vec<f32>> = (0..8)
            .map(|r| shard(&full, &m, &layout, layout.coords(r)).flat().to_vec())
            .collect();
        let back = assemble(&m, &layout, &locals);
        assert_eq!(back, full);
        let c = layout.coords(3); // tp 1, dp 1, pp 0
        let specs = local_specs(&m, &layout, c);
        let wq = specs.iter().find(|s| s.name == "blocks.1.attn.wq").unwrap();
        assert_eq!(wq.shape, vec![16, 8]);
        let wo = specs.iter().find(|s| s.name == "blocks.0.attn.wo").unwrap();
        assert_eq!(wo.shape, vec![8, 16]);
        assert!(specs.iter().all(|s| s.name != "blocks.2.attn.wq"));
        assert!(specs.iter().any(|s| s.name == "tok_emb"));
        let last = local_specs(&m, &layout, layout.coords(4));
        assert!(last.iter().any(|s| s.name == "tok_emb"), "tied head");
        assert!(last.iter().any(|s| s.name == "norm_f.gain"));
    }

    #[test]
    fn expert_shards_assemble_to_the_full_store() {
        let m = ModelConfig {
            moe: Some(crate::config::MoeConfig {
                experts: 4,
                top_k: 2,
            }),
            ..model()
        };
        let par = ParallelConfig {
            tp: 2,
            pp: 1,
            dp: 4,
            micro_batches: 1,
            virtual_stages: 1,
            ep: 2,
            sequence_parallel: false,
        };
        let layout = Layout::new(&par, &m, 8, 8).unwrap();
        let full = ParamStore::init(&param_specs(&m), &mut Rng::new(3, 1));
        let locals: Vec<Vec<f32>> = (0..8)
            .map(|r| shard(&full, &m, &layout, layout.coords(r)).flat().to_vec())
            .collect();
        assert_eq!(assemble(&m, &layout, &locals), full);
        // Rank 3 is tp 1 of replica 1: expert position 1, experts 2 and 3, cut by columns.
        let specs = local_specs(&m, &layout, layout.coords(3));
        let experts: Vec<usize> = specs
            .iter()
            .filter(|s| s.name.starts_with("blocks.0.") && s.name.ends_with(".w_in"))
            .filter_map(|s| expert_of(&s.name))
            .collect();
        assert_eq!(experts, vec![2, 3]);
        let w = specs
            .iter()
            .find(|s| s.name == "blocks.0.moe.experts.2.w_out")
            .unwrap();
        assert_eq!(w.shape, vec![16, 16]);
        assert_eq!(layout.ep_group(3).ranks(), &[1, 3]);
        assert_eq!(layout.expert_dp_group(3).ranks(), &[3, 7]);
    }
}
