//! Shampoo (Gupta et al. 2018) in the blocked, grafted form of Anil et al. 2020 and Meta's
//! Distributed Shampoo (Shi et al. 2023).
//!
//! A parameter viewed as an m×n matrix (`[d0, d1, ...]` as `d0 × d1·d2·…`) is cut into blocks
//! of at most `max_preconditioner_dim` rows and columns; every block `b` has its own statistics
//! and inverse roots. At step `t = 1, 2, ...` with gradient `G`:
//!
//! ```text
//! M = β1 M + (1-β1) G,  M̂ = M / (1-β1ᵗ)               filtered gradient (β1 = 0: M̂ = G)
//! V = β2g V + (1-β2g) G², A = M̂ / (√(V/(1-β2gᵗ)) + εg)  Adam, the grafting direction
//! per block b:
//!   L_b = β L_b + (1-β) G_b G_bᵀ,  R_b = β R_b + (1-β) G_bᵀ G_b   (β = 1: running sums)
//!   every `precondition_frequency` steps from `start_preconditioning_step` on:
//!       PL_b = (L_b + ε I)^(-1/4),  PR_b = (R_b + ε I)^(-1/4)      by eigendecomposition
//!   S_b = PL_b M̂_b PR_b;   D_b = S_b · ‖A_b‖_F / ‖S_b‖_F           Adam grafting per block
//! before the first roots exist (t < start_preconditioning_step): D = A
//! x ← x (1 - lr·wd) − lr·D                                           decoupled weight decay
//! ```
//!
//! Choices: ε is **absolute** and added to the eigenvalues after clamping negative ones to zero
//! (`(max(λ,0) + ε)^(-1/4)`), as in Meta's implementation (default 1e-12). Eigendecompositions
//! run in `f64` (`linalg`); statistics and roots are stored in `f32`. 1-D tensors (and blocks of
//! size zero) get the grafting direction, i.e. Adam. If a block's Shampoo direction is zero
//! (a zero gradient), the Adam direction is used.
//!
//! Root computations can run on worker threads ([`RefreshMode::Async`]) under the same
//! staleness rule as SOAP's basis refreshes: all blocks of a parameter are one job, snapshotted
//! after the statistics update; synchronously the new roots are used in the step that computed
//! them, so staleness 0 is bit-identical. Before a parameter's first roots are installed it gets
//! the grafting direction. Shampoo's state stays resident (tiering is wired to SOAP only).
//!
//! Split root computations ([`ShampooConfig::split`], through [`Optimizer::step_shared`]):
//! data-parallel ranks hold identical statistics, so with a split each *block*'s inverse roots
//! are computed only by the block's owner ([`crate::assign_owners`] over all blocks of the
//! matrices given, weighted by `rows³ + cols³`), and the owners' results reach every rank in
//! one all-gather per step. Because synchronous Shampoo uses new roots in the step that
//! computed them, a split step runs in two halves: every parameter's moments and statistics
//! first (with the owned roots computed and decided), then the exchange, then every
//! parameter's update with the roots installed. Parameters do not interact, so this order gives
//! the same bits as stepping one parameter after another: threshold 0 is bit-identical to no
//! split. With a positive threshold the owner keeps the roots in use when [`root_change`] of
//! both sides is at most the threshold, unless they have been kept over `max_kept`
//! consecutive refreshes (a block's first roots are always sent). Every rank applies the
//! owner's decision, so no rank diverges; the count of consecutive keeps is saved with each
//! block (format `ORSHAMP2`; `ORSHAMP1` state is still read, with no keeps). A split needs
//! [`RefreshMode::Sync`].

use std::collections::BTreeMap;

use crate::linalg::{self, LinalgError};
use crate::runtime::{Inflight, WorkerPool};
use crate::soap::RefreshMode;
use crate::split::{self, side_cost, Decision, Payload, SplitRefresh};
use crate::state::{Reader, Writer};
use crate::{check_param, OptimError, Optimizer, Param, RankGroup, StepReport, TierUsage};

/// Hyper-parameters of [`Shampoo`]; the learning rate is passed per step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShampooConfig {
    /// EMA of the gradient that Shampoo preconditions (default 0.9; 0 disables it).
    pub beta1: f32,
    /// Decay of the statistics; 1.0 (default) accumulates plain sums as in the original paper.
    pub shampoo_beta: f32,
    /// Absolute epsilon added to the statistics' eigenvalues (default 1e-12).
    pub epsilon: f64,
    /// Decoupled weight decay (default 0.01).
    pub weight_decay: f32,
    /// Steps between inverse-root recomputations (default 10).
    pub precondition_frequency: u64,
    /// First step that uses Shampoo's direction (default 1); earlier steps use the grafting
    /// direction alone.
    pub start_preconditioning_step: u64,
    /// Largest block side (default 1024).
    pub max_preconditioner_dim: usize,
    /// Second-moment decay of the Adam graft (default 0.999).
    pub graft_beta2: f32,
    /// Epsilon of the Adam graft (default 1e-8).
    pub graft_eps: f32,
    /// Synchronous (default) or asynchronous root computation, with the same staleness rule
    /// as SOAP's basis refreshes (in units of `precondition_frequency`). With staleness 0 the
    /// results are bit-identical to synchronous Shampoo.
    pub refresh: RefreshMode,
    /// Split the blocks' root computations across the data-parallel ranks of
    /// [`Optimizer::step_shared`] (see the module docs); `None` (default): every rank computes
    /// every root. Needs [`RefreshMode::Sync`]. Plain [`Optimizer::step`] ignores it.
    pub split: Option<SplitRefresh>,
}

impl Default for ShampooConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            shampoo_beta: 1.0,
            epsilon: 1e-12,
            weight_decay: 0.01,
            precondition_frequency: 10,
            start_preconditioning_step: 1,
            max_preconditioner_dim: 1024,
            graft_beta2: 0.999,
            graft_eps: 1e-8,
            refresh: RefreshMode::Sync,
            split: None,
        }
    }
}

/// The statistics and roots of one block.
#[derive(Debug, Clone, PartialEq)]
struct Block {
    r0: usize,
    rn: usize,
    c0: usize,
    cn: usize,
    l: Vec<f32>,
    r: Vec<f32>,
    /// Inverse fourth roots; empty until first computed.
    pl: Vec<f32>,
    pr: Vec<f32>,
    /// Split refreshes: consecutive refreshes over which the roots in use were kept.
    kept: u64,
}

/// Snapshot for an inverse-root computation: every block's (rows, cols, L, R) and ε.
#[derive(Debug)]
struct RootJob {
    blocks: Vec<(usize, usize, Vec<f32>, Vec<f32>)>,
    eps: f64,
}

type Roots = Vec<(Vec<f32>, Vec<f32>)>;
type RootOutcome = Result<Roots, LinalgError>;

/// A block's inverse roots, computed from the block itself (the split path; the same
/// arithmetic as [`compute_roots`] on a snapshot of it).
fn block_roots(b: &Block, eps: f64) -> Result<(Vec<f32>, Vec<f32>), LinalgError> {
    Ok((
        linalg::inverse_root(&b.l, b.rn, 4.0, eps)?,
        linalg::inverse_root(&b.r, b.cn, 4.0, eps)?,
    ))
}

/// How far a refresh moved an inverse root: the Frobenius distance between the old and the
/// new root, each scaled to unit Frobenius norm, in `[0, √2]` for the positive semi-definite
/// roots Shampoo computes (at most 2 for any matrices). Infinite when there is nothing to
/// compare: no old root (the first computation), different sizes, or a root that is zero or
/// not finite.
///
/// Why this measure: Shampoo's direction for a block is grafted, rescaled to the Adam
/// direction's norm, so multiplying either root by a positive number changes nothing in the
/// update, and running sums of statistics (`shampoo_beta = 1`) make the roots shrink steadily
/// without turning. Scaling both roots to unit norm ignores exactly that, and what remains is
/// how much the preconditioner's shape changed.
pub fn root_change(old: &[f32], new: &[f32]) -> f64 {
    if old.is_empty() || old.len() != new.len() {
        return f64::INFINITY;
    }
    let (na, nb) = (norm(old), norm(new));
    if !(na > 0.0 && nb > 0.0 && na.is_finite() && nb.is_finite()) {
        return f64::INFINITY;
    }
    old.iter()
        .zip(new)
        .map(|(&a, &b)| {
            let d = f64::from(a) / na - f64::from(b) / nb;
            d * d
        })
        .sum::<f64>()
        .sqrt()
}

/// A block's new roots as they travel from their owner to the other ranks.
#[derive(Debug)]
struct BlockRoots {
    pl: Vec<f32>,
    pr: Vec<f32>,
}

impl Payload for BlockRoots {
    fn write(&self, w: &mut Writer) {
        w.f32s(&self.pl);
        w.f32s(&self.pr);
    }

    fn read(r: &mut Reader<'_>) -> Result<Self, OptimError> {
        Ok(BlockRoots {
            pl: r.f32s()?,
            pr: r.f32s()?,
        })
    }
}

fn compute_roots(job: &RootJob) -> RootOutcome {
    job.blocks
        .iter()
        .map(|(rn, cn, l, r)| {
            Ok((
                linalg::inverse_root(l, *rn, 4.0, job.eps)?,
                linalg::inverse_root(r, *cn, 4.0, job.eps)?,
            ))
        })
        .collect()
}

#[derive(Debug)]
struct ShampooParam {
    shape: Vec<usize>,
    cols: usize,
    step: u64,
    m: Vec<f32>,
    v: Vec<f32>,
    blocks: Vec<Block>,
    pending: Option<Inflight<RootJob, RootOutcome>>,
}

impl ShampooParam {
    fn install(&mut self, roots: Roots) {
        for (b, (pl, pr)) in self.blocks.iter_mut().zip(roots) {
            b.pl = pl;
            b.pr = pr;
        }
    }
}

/// Splits `0..n` into consecutive ranges of at most `max` (every range non-empty).
pub fn block_ranges(n: usize, max: usize) -> Vec<(usize, usize)> {
    let max = max.max(1);
    (0..n.div_ceil(max))
        .map(|i| (i * max, max.min(n - i * max)))
        .collect()
}

/// Copies block (r0..r0+rn, c0..c0+cn) out of a rows×cols row-major matrix.
fn gather(x: &[f32], cols: usize, b: &Block) -> Vec<f32> {
    let mut o = Vec::with_capacity(b.rn * b.cn);
    for i in b.r0..b.r0 + b.rn {
        o.extend_from_slice(&x[i * cols + b.c0..i * cols + b.c0 + b.cn]);
    }
    o
}

fn scatter(x: &mut [f32], cols: usize, b: &Block, src: &[f32]) {
    for (k, i) in (b.r0..b.r0 + b.rn).enumerate() {
        x[i * cols + b.c0..i * cols + b.c0 + b.cn].copy_from_slice(&src[k * b.cn..(k + 1) * b.cn]);
    }
}

fn norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

/// Blocked Shampoo with Adam grafting over named parameters.
#[derive(Debug)]
pub struct Shampoo {
    config: ShampooConfig,
    params: BTreeMap<String, ShampooParam>,
    pool: Option<WorkerPool>,
}

/// State written before split refreshes existed (no `kept` counters); still read.
const SHAMPOO_TAG_V1: &[u8; 8] = b"ORSHAMP1";
const SHAMPOO_TAG: &[u8; 8] = b"ORSHAMP2";

/// What the first half of a parameter's step ([`begin`]) leaves for the second ([`finish`]).
#[derive(Debug)]
struct Half {
    /// The bias-corrected filtered gradient, which Shampoo preconditions.
    mhat: Vec<f32>,
    /// The Adam (grafting) direction, overwritten block by block with the grafted Shampoo
    /// direction.
    dir: Vec<f32>,
    /// Whether the roots fall due at this step.
    refresh: bool,
}

fn new_param(c: &ShampooConfig, p: &Param<'_>) -> ShampooParam {
    let n = p.value.len();
    let matrix = p.shape.len() >= 2;
    let (rows, cols) = if matrix {
        (p.shape[0], p.shape[1..].iter().product())
    } else {
        (1, n)
    };
    let mut blocks = Vec::new();
    if matrix {
        for (r0, rn, c0, cn) in block_grid(rows, cols, c.max_preconditioner_dim) {
            blocks.push(Block {
                r0,
                rn,
                c0,
                cn,
                l: vec![0.0; rn * rn],
                r: vec![0.0; cn * cn],
                pl: Vec::new(),
                pr: Vec::new(),
                kept: 0,
            });
        }
    }
    ShampooParam {
        shape: p.shape.to_vec(),
        cols,
        step: 0,
        m: vec![0.0; n],
        v: vec![0.0; n],
        blocks,
        pending: None,
    }
}

/// The blocks of a rows×cols matrix as (r0, rn, c0, cn), row blocks outer: the order of a
/// parameter's `blocks`, and the block index a split refresh is named by.
fn block_grid(rows: usize, cols: usize, max: usize) -> Vec<(usize, usize, usize, usize)> {
    let col_blocks = block_ranges(cols, max);
    block_ranges(rows, max)
        .into_iter()
        .flat_map(|(r0, rn)| col_blocks.iter().map(move |&(c0, cn)| (r0, rn, c0, cn)))
        .collect()
}

/// The state of parameter `p`, created on its first step; a parameter whose shape differs
/// from its state's is refused (before anything changes).
fn state_for<'a>(
    params: &'a mut BTreeMap<String, ShampooParam>,
    c: &ShampooConfig,
    p: &Param<'_>,
) -> Result<&'a mut ShampooParam, OptimError> {
    let st = params
        .entry(p.name.to_owned())
        .or_insert_with(|| new_param(c, p));
    if st.shape != p.shape {
        return Err(OptimError::BadParam {
            name: p.name.to_owned(),
            problem: format!(
                "shape {:?} differs from the state's {:?}",
                p.shape, st.shape
            ),
        });
    }
    Ok(st)
}

/// The first half of a step: moments, the grafting direction and the statistics (which
/// include this step's gradient, as the roots computed from them are used in this step).
fn begin(c: &ShampooConfig, st: &mut ShampooParam, p: &Param<'_>) -> Half {
    st.step += 1;
    let t = i32::try_from(st.step).unwrap_or(i32::MAX);
    let bc1 = if c.beta1 > 0.0 {
        (1.0 - f64::from(c.beta1).powi(t)) as f32
    } else {
        1.0
    };
    let bc2_sqrt = (1.0 - f64::from(c.graft_beta2).powi(t)).sqrt() as f32;
    let n = p.grad.len();
    let mut mhat = vec![0.0f32; n];
    let mut dir = vec![0.0f32; n]; // starts as the Adam graft
    for i in 0..n {
        let g = p.grad[i];
        st.m[i] = c.beta1 * st.m[i] + (1.0 - c.beta1) * g;
        st.v[i] = c.graft_beta2 * st.v[i] + (1.0 - c.graft_beta2) * g * g;
        mhat[i] = st.m[i] / bc1;
        dir[i] = mhat[i] / (st.v[i].sqrt() / bc2_sqrt + c.graft_eps);
    }
    let start = c.start_preconditioning_step.max(1);
    let freq = c.precondition_frequency.max(1);
    let refresh = st.step >= start && (st.step - start).is_multiple_of(freq);
    let cols = st.cols;
    for b in &mut st.blocks {
        let g = gather(p.grad, cols, b);
        linalg::accumulate_left(&mut b.l, &g, b.rn, b.cn, c.shampoo_beta);
        linalg::accumulate_right(&mut b.r, &g, b.rn, b.cn, c.shampoo_beta);
    }
    Half {
        mhat,
        dir,
        refresh: refresh && !st.blocks.is_empty(),
    }
}

/// Installs the roots of a computation still in flight (its result is needed before new
/// roots are computed; at most one computation per parameter is in flight). Returns the
/// seconds spent waiting for it.
fn settle_pending(st: &mut ShampooParam) -> Result<f64, OptimError> {
    match st.pending.take() {
        Some(prev) => {
            let (res, w) = prev.wait();
            st.install(res?);
            Ok(w)
        }
        None => Ok(0.0),
    }
}

/// The roots of an unsplit step: computed now or on the pool when due, and an asynchronous
/// result installed when ready or at its deadline. Returns the seconds spent waiting.
fn unsplit_roots(
    c: &ShampooConfig,
    pool: Option<&WorkerPool>,
    st: &mut ShampooParam,
    due: bool,
) -> Result<f64, OptimError> {
    // Roots: computed from the statistics *including* this step's gradient and, when
    // synchronous, used in this very step. Same staleness machinery as SOAP.
    let freq = c.precondition_frequency.max(1);
    let mut wait = 0.0;
    if due {
        wait += settle_pending(st)?;
        let job = RootJob {
            blocks: st
                .blocks
                .iter()
                .map(|b| (b.rn, b.cn, b.l.clone(), b.r.clone()))
                .collect(),
            eps: c.epsilon,
        };
        match pool {
            None => st.install(compute_roots(&job)?),
            Some(pool) => {
                st.pending = Some(Inflight::submit(pool, st.step, job, compute_roots));
            }
        }
    }
    if let RefreshMode::Async {
        staleness,
        apply_at_deadline,
        ..
    } = c.refresh
    {
        let ready = match &mut st.pending {
            Some(pend)
                if st.step
                    >= pend
                        .requested_at
                        .saturating_add(staleness.saturating_mul(freq)) =>
            {
                st.pending.take().map(|p| {
                    let (r, w) = p.wait();
                    wait += w;
                    r
                })
            }
            Some(pend) if !apply_at_deadline => {
                let r = pend.poll();
                if r.is_some() {
                    st.pending = None;
                }
                r
            }
            _ => None,
        };
        if let Some(res) = ready {
            st.install(res?);
        }
    }
    Ok(wait)
}

/// The second half of a step: each block's Shampoo direction, grafted onto the Adam
/// direction's norm, then the update with decoupled weight decay.
fn finish(c: &ShampooConfig, st: &ShampooParam, lr: f32, p: &mut Param<'_>, half: Half) {
    let Half { mhat, mut dir, .. } = half;
    let start = c.start_preconditioning_step.max(1);
    let cols = st.cols;
    for b in &st.blocks {
        if st.step < start || b.pl.is_empty() {
            continue;
        }
        let mb = gather(&mhat, cols, b);
        let mut tmp = vec![0.0f32; b.rn * b.cn];
        linalg::matmul(&b.pl, &mb, &mut tmp, b.rn, b.rn, b.cn);
        let mut s = vec![0.0f32; b.rn * b.cn];
        linalg::matmul(&tmp, &b.pr, &mut s, b.rn, b.cn, b.cn);
        let graft = gather(&dir, cols, b);
        let (ns, na) = (norm(&s), norm(&graft));
        if ns > 0.0 && ns.is_finite() {
            let scale = (na / ns) as f32;
            s.iter_mut().for_each(|x| *x *= scale);
            scatter(&mut dir, cols, b, &s);
        }
    }
    let decay = 1.0 - lr * c.weight_decay;
    for (x, d) in p.value.iter_mut().zip(&dir) {
        *x = *x * decay - lr * d;
    }
}

impl Shampoo {
    pub fn new(config: ShampooConfig) -> Self {
        let pool = match config.refresh {
            RefreshMode::Sync => None,
            RefreshMode::Async { workers, .. } => Some(WorkerPool::new(workers)),
        };
        Self {
            config,
            params: BTreeMap::new(),
            pool,
        }
    }

    pub fn config(&self) -> &ShampooConfig {
        &self.config
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> u64 {
        self.params
            .values()
            .map(|p| {
                let blocks: usize = p
                    .blocks
                    .iter()
                    .map(|b| b.l.len() + b.r.len() + b.pl.len() + b.pr.len())
                    .sum();
                4 * (p.m.len() + p.v.len() + blocks) as u64
            })
            .sum()
    }

    /// The blocks every rank may have to refresh this step, named by parameter and block
    /// index, with their costs: every block of the non-empty matrices given, in order.
    fn split_items(&self, params: &[Param<'_>]) -> Vec<(split::Key, u64)> {
        let max = self.config.max_preconditioner_dim;
        let mut items = Vec::new();
        for p in params {
            if p.value.is_empty() || p.shape.len() < 2 {
                continue;
            }
            let (rows, cols) = (p.shape[0], p.shape[1..].iter().product());
            for (i, (_, rn, _, cn)) in block_grid(rows, cols, max).into_iter().enumerate() {
                let cost = side_cost(rn, true).saturating_add(side_cost(cn, true));
                items.push(((p.name.to_owned(), i), cost));
            }
        }
        items
    }

    /// Installs one decision of a split refresh in the block it names.
    fn apply_decision(
        &mut self,
        (name, index): &split::Key,
        roots: Option<BlockRoots>,
    ) -> Result<(), OptimError> {
        let Some(b) = self
            .params
            .get_mut(name)
            .and_then(|st| st.blocks.get_mut(*index))
        else {
            return Err(OptimError::Exchange(format!(
                "a decision for unknown block {index} of parameter `{name}`"
            )));
        };
        let Some(BlockRoots { pl, pr }) = roots else {
            b.kept += 1;
            return Ok(());
        };
        if pl.len() != b.rn * b.rn || pr.len() != b.cn * b.cn {
            return Err(OptimError::Exchange(format!(
                "parameter `{name}`: received roots of block {index} have the wrong size"
            )));
        }
        b.pl = pl;
        b.pr = pr;
        b.kept = 0;
        Ok(())
    }
}

impl Default for Shampoo {
    fn default() -> Self {
        Self::new(ShampooConfig::default())
    }
}

impl Optimizer for Shampoo {
    fn step(&mut self, lr: f32, params: &mut [Param<'_>]) -> Result<StepReport, OptimError> {
        for p in params.iter() {
            check_param(p)?;
        }
        let c = self.config;
        let mut report = StepReport::default();
        for p in params.iter_mut() {
            // An empty tensor has nothing to optimize (and would make 0×0 decompositions).
            if p.value.is_empty() {
                continue;
            }
            let st = state_for(&mut self.params, &c, p)?;
            let half = begin(&c, st, p);
            if half.refresh {
                report.refreshes += st.blocks.len() as u64;
            }
            report.wait_seconds += unsplit_roots(&c, self.pool.as_ref(), st, half.refresh)?;
            finish(&c, st, lr, p, half);
        }
        Ok(report)
    }

    fn step_shared(
        &mut self,
        lr: f32,
        params: &mut [Param<'_>],
        group: &mut dyn RankGroup,
    ) -> Result<StepReport, OptimError> {
        let Some(rule) = self.config.split else {
            return self.step(lr, params);
        };
        if self.config.refresh != RefreshMode::Sync {
            return Err(OptimError::Exchange(
                "split refreshes need synchronous refreshes (RefreshMode::Sync)".into(),
            ));
        }
        for p in params.iter() {
            check_param(p)?;
            // Refused before anything changes; every rank passes the same parameters, so
            // every rank refuses alike and none is left waiting in the exchange.
            match self.params.get(p.name) {
                Some(st) if !p.value.is_empty() && st.shape != p.shape => {
                    return Err(OptimError::BadParam {
                        name: p.name.to_owned(),
                        problem: format!(
                            "shape {:?} differs from the state's {:?}",
                            p.shape, st.shape
                        ),
                    })
                }
                _ => {}
            }
        }
        let owned = split::owned(self.split_items(params), group);
        let c = self.config;
        let mut report = StepReport::default();
        // First half of every parameter, with the owned blocks' roots computed and decided.
        let mut halves = Vec::with_capacity(params.len());
        let mut mine = Vec::new();
        for p in params.iter() {
            if p.value.is_empty() {
                halves.push(None);
                continue;
            }
            let st = state_for(&mut self.params, &c, p)?;
            let half = begin(&c, st, p);
            if half.refresh {
                // A computation in flight exists only in state saved by an asynchronous
                // run; the unsplit optimizer installs it at this point too.
                report.wait_seconds += settle_pending(st)?;
                report.refreshes += st.blocks.len() as u64;
                for (i, b) in st.blocks.iter().enumerate() {
                    let key = (p.name.to_owned(), i);
                    if !owned.contains(&key) {
                        continue;
                    }
                    let d = match block_roots(b, c.epsilon) {
                        Ok((pl, pr)) => {
                            let send = split::should_send(rule, b.kept, || {
                                root_change(&b.pl, &pl).max(root_change(&b.pr, &pr))
                            });
                            if send {
                                Decision::Send(BlockRoots { pl, pr })
                            } else {
                                Decision::Keep
                            }
                        }
                        Err(e) => Decision::Failed(e.to_string()),
                    };
                    mine.push((key, d));
                }
            }
            halves.push(Some(half));
        }
        report.bases_computed = mine.len() as u64;
        // Every rank applies every owner's decisions in rank order, so all ranks make the
        // same changes to their (identical) state before any root is used.
        let all = split::exchange(group, &mine)?;
        split::apply_all(all, &mut report, |key, roots| {
            self.apply_decision(key, roots)
        })?;
        // Second half: the updates, with this step's roots in place.
        for (p, half) in params.iter_mut().zip(halves) {
            let Some(half) = half else {
                continue;
            };
            let Some(st) = self.params.get(p.name) else {
                return Err(OptimError::BadState(format!(
                    "parameter `{}` vanished",
                    p.name
                )));
            };
            finish(&c, st, lr, p, half);
        }
        Ok(report)
    }

    /// Shampoo keeps everything resident on the device.
    fn state_usage(&self) -> TierUsage {
        TierUsage {
            device_bytes: self.state_bytes(),
            ..TierUsage::default()
        }
    }

    fn save_state(&self) -> Vec<u8> {
        let mut w = Writer::new(SHAMPOO_TAG);
        w.u64(self.params.len() as u64);
        for (name, st) in &self.params {
            w.str(name);
            w.usizes(&st.shape);
            w.u64(st.step);
            w.f32s(&st.m);
            w.f32s(&st.v);
            w.u64(st.blocks.len() as u64);
            for b in &st.blocks {
                w.usizes(&[b.r0, b.rn, b.c0, b.cn]);
                w.f32s(&b.l);
                w.f32s(&b.r);
                w.f32s(&b.pl);
                w.f32s(&b.pr);
                w.u64(b.kept);
            }
            // A root computation in flight is saved as its inputs and recomputed on load.
            match &st.pending {
                None => w.u8(0),
                Some(p) => {
                    w.u8(1);
                    w.u64(p.requested_at);
                    for (_, _, l, r) in &p.job.blocks {
                        w.f32s(l);
                        w.f32s(r);
                    }
                }
            }
        }
        w.finish()
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        let v1 = bytes.get(..8) == Some(SHAMPOO_TAG_V1.as_slice());
        let mut r = Reader::new(bytes, if v1 { SHAMPOO_TAG_V1 } else { SHAMPOO_TAG })?;
        let n = r.len()?;
        let mut params = BTreeMap::new();
        for _ in 0..n {
            let name = r.str()?;
            let shape = r.usizes()?;
            let step = r.u64()?;
            let m = r.f32s()?;
            let v = r.f32s()?;
            let len: usize = shape.iter().product();
            let bad = |what: String| OptimError::BadState(format!("parameter `{name}`: {what}"));
            if m.len() != len || v.len() != len {
                return Err(bad(format!("moments do not match shape {shape:?}")));
            }
            let (rows, cols) = if shape.len() >= 2 {
                (shape[0], shape[1..].iter().product())
            } else {
                (1, len)
            };
            let nb = r.len()?;
            let mut blocks = Vec::new();
            for _ in 0..nb {
                let dims = r.usizes()?;
                let [r0, rn, c0, cn] = dims[..] else {
                    return Err(bad("block header is not 4 numbers".into()));
                };
                let (l, rr, pl, pr) = (r.f32s()?, r.f32s()?, r.f32s()?, r.f32s()?);
                let kept = if v1 { 0 } else { r.u64()? };
                let ok = r0 + rn <= rows
                    && c0 + cn <= cols
                    && l.len() == rn * rn
                    && rr.len() == cn * cn
                    && (pl.is_empty() || pl.len() == rn * rn)
                    && (pr.is_empty() || pr.len() == cn * cn);
                if !ok {
                    return Err(bad(format!("block at ({r0}, {c0}) has inconsistent sizes")));
                }
                blocks.push(Block {
                    r0,
                    rn,
                    c0,
                    cn,
                    l,
                    r: rr,
                    pl,
                    pr,
                    kept,
                });
            }
            let pending = match r.u8()? {
                0 => None,
                1 => {
                    let requested_at = r.u64()?;
                    let mut snap = Vec::with_capacity(blocks.len());
                    for b in &blocks {
                        let (l, rr) = (r.f32s()?, r.f32s()?);
                        if l.len() != b.rn * b.rn || rr.len() != b.cn * b.cn {
                            return Err(bad("pending root computation has wrong sizes".into()));
                        }
                        snap.push((b.rn, b.cn, l, rr));
                    }
                    let job = RootJob {
                        blocks: snap,
                        eps: self.config.epsilon,
                    };
                    Some(Inflight::computed(requested_at, job, compute_roots))
                }
                x => return Err(bad(format!("invalid pending marker {x}"))),
            };
            params.insert(
                name,
                ShampooParam {
                    shape,
                    cols,
                    step,
                    m,
                    v,
                    blocks,
                    pending,
                },
            );
        }
        r.end()?;
        self.params = params;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_root_change_ignores_scale_and_sees_turns() {
        let a = [2.0f32, 0.5, 0.5, 1.0];
        let scaled: Vec<f32> = a.iter().map(|x| 3.0 * x).collect();
        assert!(root_change(&a, &scaled) < 1e-7, "a multiple is no change");
        assert_eq!(root_change(&[], &a), f64::INFINITY, "first roots");
        assert_eq!(root_change(&a, &a[..3]), f64::INFINITY);
        assert_eq!(root_change(&[0.0; 4], &a), f64::INFINITY);
        // diag(1, 0) to diag(0, 1): orthogonal unit matrices are √2 apart.
        let d = root_change(&[1.0, 0.0, 0.0, 0.0], &[0.0, 0.0, 0.0, 1.0]);
        assert!((d - std::f64::consts::SQRT_2).abs() < 1e-12, "{d}");
        let small = root_change(&a, &[2.0, 0.5, 0.5, 1.1]);
        assert!(small > 0.0 && small < 0.1, "{small}");
    }

    /// State saved before split refreshes (`ORSHAMP1`, no keep counts) still loads, as the
    /// same state with nothing kept.
    #[test]
    fn state_of_the_first_format_is_still_read() {
        let mut a = Shampoo::new(ShampooConfig {
            max_preconditioner_dim: 2,
            start_preconditioning_step: 1,
            ..ShampooConfig::default()
        });
        let (mut x, g) = (vec![0.5f32; 6], vec![0.1f32, -0.2, 0.3, 0.05, 0.4, -0.1]);
        for _ in 0..2 {
            let mut p = [Param {
                name: "w",
                shape: &[2, 3],
                value: &mut x,
                grad: &g,
            }];
            a.step(0.01, &mut p).unwrap();
        }
        let mut w = Writer::new(SHAMPOO_TAG_V1);
        w.u64(1);
        let st = &a.params["w"];
        w.str("w");
        w.usizes(&st.shape);
        w.u64(st.step);
        w.f32s(&st.m);
        w.f32s(&st.v);
        w.u64(st.blocks.len() as u64);
        for b in &st.blocks {
            assert!(!b.pl.is_empty(), "roots computed");
            w.usizes(&[b.r0, b.rn, b.c0, b.cn]);
            for x in [&b.l, &b.r, &b.pl, &b.pr] {
                w.f32s(x);
            }
        }
        w.u8(0);
        let mut b = Shampoo::default();
        b.load_state(&w.finish()).unwrap();
        assert_eq!(b.save_state(), a.save_state());
    }

    #[test]
    fn blocks_cover_the_dimension() {
        assert_eq!(block_ranges(5, 2), vec![(0, 2), (2, 2), (4, 1)]);
        assert_eq!(block_ranges(4, 4), vec![(0, 4)]);
        assert!(block_ranges(0, 3).is_empty());
    }
}
