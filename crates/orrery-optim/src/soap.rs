//! SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in
//! the eigenbasis of Shampoo's preconditioner.
//!
//! For a parameter viewed as an m×n matrix `G` (shape `[d0, d1, ...]` is viewed as
//! `d0 × (d1·d2·…)`; the reference implementation instead keeps one basis per tensor
//! dimension, which is the same thing for the 2-D weights of a transformer):
//!
//! ```text
//! first call:  L = (1-β) G Gᵀ,  R = (1-β) Gᵀ G,  Q_L, Q_R = eigenvectors (exact, descending);
//!              the parameter is NOT updated (the reference skips this step so that the
//!              current gradient is never used in its own projection)
//! every call after that, t = 1, 2, ...:
//!   G' = Q_Lᵀ G Q_R                               rotate into the eigenbasis
//!   m = β1 m + (1-β1) G' ;  v = β2 v + (1-β2) G'²   moments live in the rotated basis
//!   D = Q_L (m / (√v + ε)) Q_Rᵀ                   rotate the Adam direction back
//!   x ← x − lr·√(1-β2ᵗ)/(1-β1ᵗ)·D ;  x ← x − lr·wd·x   (reference order: decay after the step)
//!   L = βL + (1-β) G Gᵀ ;  R = βR + (1-β) Gᵀ G     statistics updated *after* the step
//!   if t % precondition_frequency == 0:  refresh each basis by one power iteration:
//!       λ̂ = diag(Qᵀ L Q); sort columns of Q by λ̂ descending (and permute v's axis to match);
//!       Q ← QR(L Q)  (Q factor);  m is carried to the new basis (m ← Q_newᵀ Q_old m …)
//! ```
//!
//! Choices, each following the reference implementation unless said otherwise:
//! - `β` for the statistics is `shampoo_beta`, defaulting to `β2` (reference: `shampoo_beta=-1`).
//! - Bias correction is folded into the step size and `ε` is added to `√v` unscaled, as in the
//!   reference (PyTorch's AdamW scales ε differently; the difference is only visible when `v`
//!   is tiny).
//! - A side whose size exceeds `max_precond_dim` is not rotated (identity); a parameter with no
//!   rotated side (1-D tensors, scalars, or both sides too large) is plain Adam with these
//!   betas and **is** updated from its first call: the first-step skip exists to keep the
//!   current gradient out of its own projection, and without a projection there is nothing to
//!   protect (the reference also skips step one for these; we don't).
//! - The reference carries `m` back to the original basis and forward again on *every* step;
//!   that round trip is the identity unless the basis changed, so we do it only when a new basis
//!   is installed (saves four matrix products per step and a little rounding).
//! - Eigendecompositions, power iterations and QR run in `f64` (see `linalg`); `L`, `R`, `Q`,
//!   `m`, `v` are stored in `f32`.
//! - The initial eigendecomposition is always computed inline, even in asynchronous mode: the
//!   first call updates nothing, so there is nothing to overlap it with.
//!
//! Step size compared with AdamW (a property of the algorithm, not of this implementation):
//! Adam normalises every coordinate it works in. AdamW works in the original coordinates, each
//! of which carries a share of a low-rank gradient, so each moves by about `lr`. SOAP works in
//! the eigenbasis, where such a gradient sits in a few coordinates and the rest carry mostly
//! noise, whose normalised first moment is small. So at the same learning rate SOAP's early
//! updates are much smaller than AdamW's, and the better the basis tracks the gradients the
//! smaller they are (freezing the first basis makes SOAP behave much like Adam). SOAP
//! usually wants a larger learning rate than AdamW in short runs. The published comparisons
//! tune each optimizer's rate separately.
//!
//! Asynchronous refresh ([`RefreshMode::Async`]): at a refresh step the statistics and current
//! basis are snapshotted and sent to a worker; at most one refresh per parameter is in flight
//! (a refresh due while the previous one is unfinished first waits for it). The new basis is
//! installed at the end of a step: as soon as it is finished (or only at the deadline when
//! `apply_at_deadline` is set, which makes runs reproducible), and at the latest
//! `staleness * precondition_frequency` steps after it was requested, waiting if needed. With
//! `staleness = 0` it is installed at exactly the point where the synchronous optimizer
//! installs it, from the same inputs through the same code, so results are bit-identical.
//!
//! Split refreshes ([`SplitRefresh`], through [`Optimizer::step_shared`]): data-parallel ranks
//! hold identical gradients and state, so refreshing every basis on every rank repeats the same
//! work `world` times. With a split, each refresh is computed only by its parameter's owner
//! ([`crate::assign_owners`]: the rotated parameters in the order given, weighted by the cube of
//! their rotated sides, largest first to the least-loaded rank). At the end of the step every
//! rank's decisions travel in one all-gather, and every rank applies all of them in rank order:
//! install this basis, or keep the one in use. Installing at the end of the step instead of at
//! the parameter's own update changes nothing, because a new basis is first used at the
//! parameter's next step; so with threshold 0 (always send) a split run is bit-identical to an
//! unsplit one. With a positive threshold the owner keeps the basis in use when
//! [`basis_change`] (eigenvalue-weighted misalignment of each new basis vector with the one it
//! descends from) is at most the threshold, unless it has already been kept over `max_kept`
//! consecutive refreshes; a kept refresh costs the others only its decision. The decision is
//! the owner's and every rank applies it, so no rank can diverge; the count of consecutive
//! keeps is part of the saved state (format `ORSOAP02`; `ORSOAP01` state is still read, with
//! no keeps). The initial eigendecomposition is not split (every rank computes it, from the
//! same gradient, on the first call), and a split needs [`RefreshMode::Sync`].

use std::collections::{BTreeMap, BTreeSet};

use crate::linalg::{self, LinalgError};
use crate::runtime::{Inflight, WorkerPool};
use crate::split::{self, side_cost, Decision, Key, Payload, SplitRefresh};
use crate::state::{Reader, Writer};
use crate::tiers::{Access, TierConfig, TierUsage, TieredStore};
use crate::{check_param, OptimError, Optimizer, Param, RankGroup, StepReport};

/// The published default learning rate (the caller passes the learning rate to each step).
pub const SOAP_DEFAULT_LR: f32 = 3e-3;

/// When basis refreshes are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefreshMode {
    /// Inline, at the step that triggers them (the published algorithm).
    Sync,
    /// On `workers` CPU threads; a basis may be used until it is `staleness` refresh periods
    /// old (the published runtime default is 5). `apply_at_deadline`: install a finished basis
    /// only at its deadline instead of as soon as it is ready, which makes results independent
    /// of timing.
    Async {
        workers: usize,
        staleness: u64,
        apply_at_deadline: bool,
    },
}

/// Hyper-parameters of [`Soap`]. Learning rate: passed per step (published default
/// [`SOAP_DEFAULT_LR`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SoapConfig {
    /// Adam's moment decay rates in the rotated basis (default 0.95, 0.95).
    pub betas: (f32, f32),
    /// Decay of the `L`/`R` statistics; `None` uses `betas.1` (the reference's default).
    pub shampoo_beta: Option<f32>,
    /// Added to `√v` (default 1e-8).
    pub eps: f32,
    /// Decoupled weight decay (default 0.01).
    pub weight_decay: f32,
    /// Steps between basis refreshes (default 10; 0 is treated as 1).
    pub precondition_frequency: u64,
    /// Sides larger than this are not rotated (default 10_000, the reference's).
    pub max_precond_dim: usize,
    /// Synchronous (default) or asynchronous refreshes.
    pub refresh: RefreshMode,
    /// Tier budgets for the state; `None` (default) keeps everything on the device.
    pub tiers: Option<TierConfig>,
    /// Split basis refreshes across the data-parallel ranks of
    /// [`Optimizer::step_shared`]; `None` (default): every rank refreshes every basis. Needs
    /// [`RefreshMode::Sync`]. Plain [`Optimizer::step`] ignores it (a group of one).
    pub split: Option<SplitRefresh>,
}

impl SoapConfig {
    /// The decay the `L`/`R` statistics use: `shampoo_beta`, or `betas.1` without one.
    pub fn statistics_beta(&self) -> f32 {
        self.shampoo_beta.unwrap_or(self.betas.1)
    }
}

impl Default for SoapConfig {
    fn default() -> Self {
        Self {
            betas: (0.95, 0.95),
            shampoo_beta: None,
            eps: 1e-8,
            weight_decay: 0.01,
            precondition_frequency: 10,
            max_precond_dim: 10_000,
            refresh: RefreshMode::Sync,
            tiers: None,
            split: None,
        }
    }
}

/// One side's statistic and the basis in use.
type SideSnapshot = (Vec<f32>, Vec<f32>);

/// Snapshot a refresh works from: per side, the statistic and the basis in use.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RefreshJob {
    left: Option<SideSnapshot>,
    right: Option<SideSnapshot>,
    rows: usize,
    cols: usize,
}

/// One side of a refresh: the order of the old basis' columns and the new basis.
type NewSide = (Vec<usize>, Vec<f32>);

/// Per side: the permutation applied to the old basis' columns and the new basis.
#[derive(Debug, Clone)]
pub(crate) struct RefreshResult {
    left: Option<NewSide>,
    right: Option<NewSide>,
    /// Per side, the estimated eigenvalue of each new column (the weights of
    /// [`basis_change`]). Only the rank that computed the refresh has them; they are not
    /// sent, and installing a basis does not read them.
    eig: (Vec<f64>, Vec<f64>),
}

type RefreshOutcome = Result<RefreshResult, LinalgError>;

type Pending = Inflight<RefreshJob, RefreshOutcome>;

/// One SOAP basis refresh of one side: one power iteration from the basis `q` (n×n,
/// row-major, columns are basis vectors) on the statistic `stat`, then QR. Returns the order in
/// which the old columns were sorted (by estimated eigenvalue, descending) and the new basis.
pub fn refresh_basis(
    stat: &[f32],
    q: &[f32],
    n: usize,
) -> Result<(Vec<usize>, Vec<f32>), LinalgError> {
    refresh_side(stat, q, n).map(|(side, _)| side)
}

/// One power iteration + QR for one side (see the module docs).
/// Also returns the estimated eigenvalues in the new column order.
fn refresh_side(stat: &[f32], q: &[f32], n: usize) -> Result<(NewSide, Vec<f64>), LinalgError> {
    let q64: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
    let sq = linalg::matmul_f32_f64(stat, &q64, n); // L Q
                                                    // λ̂_c = q_cᵀ L q_c, the Rayleigh quotient of each current basis vector.
    let est: Vec<f64> = (0..n)
        .map(|c| (0..n).map(|i| q64[i * n + c] * sq[i * n + c]).sum())
        .collect();
    let mut perm: Vec<usize> = (0..n).collect();
    // Descending, ties broken by index so the order is deterministic.
    perm.sort_by(|&a, &b| est[b].total_cmp(&est[a]).then(a.cmp(&b)));
    // L · Q[:, perm] is (L Q)[:, perm]: permute the columns of the product we already have.
    let mut power = vec![0.0f64; n * n];
    for i in 0..n {
        for (c, &src) in perm.iter().enumerate() {
            power[i * n + c] = sq[i * n + src];
        }
    }
    let qn = linalg::qr_q(&power, n)?;
    let sorted = perm.iter().map(|&c| est[c]).collect();
    Ok(((perm, linalg::to_f32(&qn)), sorted))
}

pub(crate) fn compute_refresh(job: &RefreshJob) -> RefreshOutcome {
    let side = |snap: &Option<SideSnapshot>, n: usize| match snap {
        Some((s, q)) => refresh_side(s, q, n).map(|(side, eig)| (Some(side), eig)),
        None => Ok((None, Vec::new())),
    };
    let (left, left_eig) = side(&job.left, job.rows)?;
    let (right, right_eig) = side(&job.right, job.cols)?;
    Ok(RefreshResult {
        left,
        right,
        eig: (left_eig, right_eig),
    })
}

/// How far a refresh moved a basis: `1 − Σ_c w_c |⟨q_old[:, perm[c]], q_new[:, c]⟩| / Σ_c w_c`,
/// in `[0, 1]`, for `n×n` row-major bases whose columns are basis vectors, the column order
/// `perm` that [`refresh_basis`] returned, and a weight `w_c ≥ 0` per new column (negative
/// weights count as 0; empty `weights`, or weights summing to 0, weigh every column equally).
/// SOAP weighs each column by its estimated eigenvalue.
///
/// Why this measure: SOAP's moments are per coordinate of the basis, so what matters is
/// whether each basis vector moved, not whether the spanned space did (a full basis always
/// spans everything, so a subspace distance would be zero). Each new column is compared with
/// the old column it descends from; the absolute value ignores the sign flips QR may
/// introduce; and the value is unchanged when both bases are rotated by the same orthogonal
/// matrix. Weighting by eigenvalue makes the directions that carry the gradients' energy
/// decide: in a side larger than the gradients' rank most eigenvalues are (nearly) zero, their
/// eigenvectors turn arbitrarily from one refresh to the next, and the moments in those
/// coordinates are (nearly) zero, so keeping them loses nothing. A pure reordering of the
/// columns measures 0: keeping the old basis then loses nothing but the new order.
pub fn basis_change(old: &[f32], perm: &[usize], new: &[f32], n: usize, weights: &[f64]) -> f64 {
    let w = |c: usize| weights.get(c).map_or(1.0, |&x| x.max(0.0));
    let total: f64 = (0..n.min(perm.len())).map(w).sum();
    let uniform = weights.is_empty() || total <= 0.0 || !total.is_finite();
    let (mut aligned, mut sum_w) = (0.0f64, 0.0f64);
    for (c, &src) in perm.iter().enumerate().take(n) {
        let dot: f64 = (0..n)
            .map(|i| f64::from(old[i * n + src]) * f64::from(new[i * n + c]))
            .sum();
        let wc = if uniform { 1.0 } else { w(c) };
        aligned += wc * dot.abs();
        sum_w += wc;
    }
    if sum_w <= 0.0 {
        return 0.0;
    }
    (1.0 - aligned / sum_w).clamp(0.0, 1.0)
}

/// The rows and columns a parameter of this shape is viewed as, and which sides are rotated.
fn sides(shape: &[usize], max_dim: usize) -> (usize, usize, bool, bool) {
    let n: usize = shape.iter().product();
    if shape.len() >= 2 {
        let (rows, cols) = (shape[0], shape[1..].iter().product());
        (rows, cols, rows <= max_dim, cols <= max_dim)
    } else {
        (1, n, false, false)
    }
}

/// The split refresh of the step in progress: the parameters this rank refreshes and what it
/// decided for each refresh that fell due.
#[derive(Debug, Default)]
struct SplitStep {
    owned: BTreeSet<Key>,
    decisions: Vec<(Key, Decision<RefreshResult>)>,
}

/// A refreshed basis on the wire: per side, the column order and the basis. The eigenvalue
/// estimates stay with the owner (only its decision reads them).
impl Payload for RefreshResult {
    fn write(&self, w: &mut Writer) {
        for side in [&self.left, &self.right] {
            match side {
                None => w.u8(0),
                Some((perm, q)) => {
                    w.u8(1);
                    w.usizes(perm);
                    w.f32s(q);
                }
            }
        }
    }

    fn read(r: &mut Reader<'_>) -> Result<Self, OptimError> {
        let mut side = || -> Result<Option<NewSide>, OptimError> {
            Ok(match r.u8()? {
                0 => None,
                _ => Some((r.usizes()?, r.f32s()?)),
            })
        };
        let left = side()?;
        let right = side()?;
        Ok(RefreshResult {
            left,
            right,
            eig: (Vec::new(), Vec::new()),
        })
    }
}

/// Checks that a received side (permutation and basis) fits a side of size `n`.
fn check_side(side: &Option<NewSide>, on: bool, n: usize) -> bool {
    match side {
        None => !on,
        Some((perm, q)) => {
            let mut seen = vec![false; n];
            on && perm.len() == n
                && q.len() == n * n
                && perm
                    .iter()
                    .all(|&i| i < n && !std::mem::replace(&mut seen[i], true))
        }
    }
}

/// `Q_Lᵀ G Q_R` (identity on a side without a basis).
pub fn rotate(
    g: &[f32],
    ql: Option<&[f32]>,
    qr: Option<&[f32]>,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let mut x = g.to_vec();
    if let Some(q) = ql {
        let mut o = vec![0.0; rows * cols];
        linalg::matmul_tn(q, &x, &mut o, rows, rows, cols);
        x = o;
    }
    if let Some(q) = qr {
        let mut o = vec![0.0; rows * cols];
        linalg::matmul(&x, q, &mut o, rows, cols, cols);
        x = o;
    }
    x
}

/// `Q_L D Q_Rᵀ`, the inverse of [`rotate`] for orthogonal bases.
pub fn rotate_back(
    d: &[f32],
    ql: Option<&[f32]>,
    qr: Option<&[f32]>,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let mut x = d.to_vec();
    if let Some(q) = ql {
        let mut o = vec![0.0; rows * cols];
        linalg::matmul(q, &x, &mut o, rows, rows, cols);
        x = o;
    }
    if let Some(q) = qr {
        let mut o = vec![0.0; rows * cols];
        linalg::matmul_nt(&x, q, &mut o, rows, cols, cols);
        x = o;
    }
    x
}

/// The owner's choice for a finished refresh ([`split::should_send`]): the change is the
/// larger of the two sides' [`basis_change`].
fn decide(
    res: RefreshResult,
    t: &Tensors,
    kept: u64,
    split: SplitRefresh,
    rows: usize,
    cols: usize,
) -> Decision<RefreshResult> {
    let change =
        |side: &Option<NewSide>, old: &Option<Vec<f32>>, eig: &[f64], n: usize| match (side, old) {
            (Some((perm, q)), Some(old)) => basis_change(old, perm, q, n, eig),
            _ => 0.0,
        };
    let send = split::should_send(split, kept, || {
        change(&res.left, &t.ql, &res.eig.0, rows).max(change(&res.right, &t.qr, &res.eig.1, cols))
    });
    if send {
        Decision::Send(res)
    } else {
        Decision::Keep
    }
}

/// The state tensors of one parameter while it is being updated.
#[derive(Debug)]
struct Tensors {
    m: Vec<f32>,
    v: Vec<f32>,
    l: Option<Vec<f32>>,
    ql: Option<Vec<f32>>,
    r: Option<Vec<f32>>,
    qr: Option<Vec<f32>>,
    /// Whether a new basis was installed since the tensors were taken (spilled bases are only
    /// rewritten then).
    basis_changed: bool,
}

impl Tensors {
    /// Installs a refreshed basis: carry `m` to the new basis, permute `v` to the new column
    /// order (the reference permutes, it does not rotate, the second moment).
    fn install(&mut self, res: RefreshResult, rows: usize, cols: usize) {
        self.basis_changed = true;
        let m_orig = rotate_back(&self.m, self.ql.as_deref(), self.qr.as_deref(), rows, cols);
        if let Some((perm, q)) = res.left {
            let old = self.v.clone();
            for (i, &src) in perm.iter().enumerate() {
                self.v[i * cols..(i + 1) * cols]
                    .copy_from_slice(&old[src * cols..(src + 1) * cols]);
            }
            self.ql = Some(q);
        }
        if let Some((perm, q)) = res.right {
            let old = self.v.clone();
            for r in 0..rows {
                for (j, &src) in perm.iter().enumerate() {
                    self.v[r * cols + j] = old[r * cols + src];
                }
            }
            self.qr = Some(q);
        }
        self.m = rotate(&m_orig, self.ql.as_deref(), self.qr.as_deref(), rows, cols);
    }
}

#[derive(Debug)]
struct SoapParam {
    shape: Vec<usize>,
    rows: usize,
    cols: usize,
    left: bool,
    right: bool,
    /// Adam steps taken (the reference's `state["step"]`).
    step: u64,
    pending: Option<Pending>,
    /// Split refreshes: consecutive refreshes over which the basis in use was kept.
    kept: u64,
}

fn key(name: &str, part: &str) -> String {
    // NUL never appears in a sensible parameter name, so keys of different parameters cannot
    // collide.
    format!("{name}\u{0}{part}")
}

/// SOAP over named parameters. State is created on a parameter's first step.
#[derive(Debug)]
pub struct Soap {
    config: SoapConfig,
    params: BTreeMap<String, SoapParam>,
    store: TieredStore,
    pool: Option<WorkerPool>,
    /// Set only inside a split [`Optimizer::step_shared`].
    split_step: Option<SplitStep>,
    /// Refreshes that fell due in the step in progress ([`StepReport::refreshes`]).
    refreshes_due: u64,
}

/// State written before split refreshes existed (no `kept` counters); still read.
const SOAP_TAG_V1: &[u8; 8] = b"ORSOAP01";
const SOAP_TAG: &[u8; 8] = b"ORSOAP02";
const SOAP_ERR_TAG: &[u8; 8] = b"ORSOAPER";

impl Soap {
    pub fn new(config: SoapConfig) -> Self {
        let pool = match config.refresh {
            RefreshMode::Sync => None,
            RefreshMode::Async { workers, .. } => Some(WorkerPool::new(workers)),
        };
        let store = TieredStore::new(config.tiers.clone());
        Self {
            config,
            params: BTreeMap::new(),
            store,
            pool,
            split_step: None,
            refreshes_due: 0,
        }
    }

    pub fn config(&self) -> &SoapConfig {
        &self.config
    }

    /// Worker threads actually running (0 in synchronous mode).
    pub fn workers(&self) -> usize {
        self.pool.as_ref().map_or(0, WorkerPool::workers)
    }

    /// The tier store, for inspection (which tier a tensor is in, its spill file).
    pub fn store(&self) -> &TieredStore {
        &self.store
    }

    /// Key under which a parameter's state tensor `part` (`m`, `v`, `L`, `QL`, `R`, `QR`) is
    /// stored.
    pub fn state_key(name: &str, part: &str) -> String {
        key(name, part)
    }

    /// Starts reading a parameter's spilled state tensors in the background.
    fn prefetch(&mut self, name: &str) {
        let Some(st) = self.params.get(name) else {
            return;
        };
        let mut parts = vec!["m", "v"];
        if st.left {
            parts.extend(["L", "QL"]);
        }
        if st.right {
            parts.extend(["R", "QR"]);
        }
        for part in parts {
            self.store.prefetch(&key(name, part));
        }
    }

    fn freq(&self) -> u64 {
        self.config.precondition_frequency.max(1)
    }

    /// First sight of a parameter: register its state (and, for matrices, build the
    /// statistics and the exact initial bases). Returns whether the parameter must be skipped
    /// this step.
    fn init_param(&mut self, p: &Param<'_>) -> Result<bool, OptimError> {
        let n = p.value.len();
        let (rows, cols) = if p.shape.len() >= 2 {
            (p.shape[0], p.shape[1..].iter().product())
        } else {
            (1, n)
        };
        let matrix = p.shape.len() >= 2;
        let left = matrix && rows <= self.config.max_precond_dim;
        let right = matrix && cols <= self.config.max_precond_dim;
        let sb = self.config.statistics_beta();
        let name = p.name;
        self.store
            .insert(&key(name, "m"), vec![0.0; n], Access::Hot)?;
        self.store
            .insert(&key(name, "v"), vec![0.0; n], Access::Hot)?;
        if left {
            let mut l = vec![0.0; rows * rows];
            linalg::accumulate_left(&mut l, p.grad, rows, cols, sb);
            let (_, q) = linalg::eigh_desc(&l, rows)?;
            self.store.insert(&key(name, "L"), l, Access::Hot)?;
            self.store
                .insert(&key(name, "QL"), linalg::to_f32(&q), Access::Warm)?;
        }
        if right {
            let mut r = vec![0.0; cols * cols];
            linalg::accumulate_right(&mut r, p.grad, rows, cols, sb);
            let (_, q) = linalg::eigh_desc(&r, cols)?;
            self.store.insert(&key(name, "R"), r, Access::Hot)?;
            self.store
                .insert(&key(name, "QR"), linalg::to_f32(&q), Access::Warm)?;
        }
        self.params.insert(
            name.to_owned(),
            SoapParam {
                shape: p.shape.to_vec(),
                rows,
                cols,
                left,
                right,
                step: 0,
                pending: None,
                kept: 0,
            },
        );
        Ok(left || right)
    }

    /// Takes all state tensors of a parameter, or none: if one cannot be read, those already
    /// taken are put back, so a failed step leaves the state as it was.
    fn take(&mut self, name: &str, left: bool, right: bool) -> Result<Tensors, OptimError> {
        let mut parts: Vec<&str> = vec!["m", "v"];
        if left {
            parts.extend(["L", "QL"]);
        }
        if right {
            parts.extend(["R", "QR"]);
        }
        let mut got: Vec<Vec<f32>> = Vec::with_capacity(parts.len());
        for part in &parts {
            match self.store.take(&key(name, part)) {
                Ok(x) => got.push(x),
                Err(e) => {
                    for (part, x) in parts.iter().zip(got) {
                        self.store.put(&key(name, part), x)?;
                    }
                    return Err(e.into());
                }
            }
        }
        let mut it = got.into_iter();
        let mut next = || it.next().unwrap_or_default();
        let (m, v) = (next(), next());
        let (l, ql) = if left {
            (Some(next()), Some(next()))
        } else {
            (None, None)
        };
        let (r, qr) = if right {
            (Some(next()), Some(next()))
        } else {
            (None, None)
        };
        Ok(Tensors {
            m,
            v,
            l,
            ql,
            r,
            qr,
            basis_changed: false,
        })
    }

    fn put(&mut self, name: &str, t: Tensors) -> Result<(), OptimError> {
        let s = &mut self.store;
        s.put(&key(name, "m"), t.m)?;
        s.put(&key(name, "v"), t.v)?;
        for (part, x) in [("L", t.l), ("R", t.r)] {
            if let Some(x) = x {
                s.put(&key(name, part), x)?;
            }
        }
        for (part, x) in [("QL", t.ql), ("QR", t.qr)] {
            match x {
                Some(x) if t.basis_changed => s.put(&key(name, part), x)?,
                Some(x) => s.put_unchanged(&key(name, part), x)?,
                None => {}
            }
        }
        Ok(())
    }

    /// One parameter's step; returns the seconds spent waiting for a refresh.
    fn step_param(&mut self, lr: f32, p: &mut Param<'_>) -> Result<f64, OptimError> {
        match self.params.get(p.name) {
            None => {
                if self.init_param(p)? {
                    return Ok(0.0);
                }
            }
            Some(st) if st.shape != p.shape => {
                return Err(OptimError::BadParam {
                    name: p.name.to_owned(),
                    problem: format!(
                        "shape {:?} differs from the state's {:?}",
                        p.shape, st.shape
                    ),
                })
            }
            Some(_) => {}
        }
        let freq = self.freq();
        let sb = self.config.statistics_beta();
        let cfg = self.config.clone();
        let Some(st) = self.params.get(p.name) else {
            return Err(OptimError::BadState(format!(
                "parameter `{}` vanished",
                p.name
            )));
        };
        let (left, right) = (st.left, st.right);
        let mut t = self.take(p.name, left, right)?;
        // Whatever happens in the update, the tensors go back to the store.
        let result = self.update(lr, p, &mut t, &cfg, freq, sb);
        let put = self.put(p.name, t);
        let wait = result?;
        put?;
        Ok(wait)
    }

    /// The update proper, on tensors taken out of the store.
    fn update(
        &mut self,
        lr: f32,
        p: &mut Param<'_>,
        t: &mut Tensors,
        cfg: &SoapConfig,
        freq: u64,
        sb: f32,
    ) -> Result<f64, OptimError> {
        let Some(st) = self.params.get_mut(p.name) else {
            return Err(OptimError::BadState(format!(
                "parameter `{}` vanished",
                p.name
            )));
        };
        let (rows, cols, left, right) = (st.rows, st.cols, st.left, st.right);
        st.step += 1;
        let step = st.step;

        // Adam in the rotated basis.
        let g = rotate(p.grad, t.ql.as_deref(), t.qr.as_deref(), rows, cols);
        let (b1, b2) = cfg.betas;
        let e = i32::try_from(step).unwrap_or(i32::MAX);
        let bc1 = 1.0 - f64::from(b1).powi(e);
        let bc2 = 1.0 - f64::from(b2).powi(e);
        let step_size = lr * (bc2.sqrt() / bc1) as f32;
        let mut d = vec![0.0f32; g.len()];
        for (((m, v), &gi), di) in t.m.iter_mut().zip(t.v.iter_mut()).zip(&g).zip(d.iter_mut()) {
            *m = b1 * *m + (1.0 - b1) * gi;
            *v = b2 * *v + (1.0 - b2) * gi * gi;
            *di = *m / (v.sqrt() + cfg.eps);
        }
        let d = rotate_back(&d, t.ql.as_deref(), t.qr.as_deref(), rows, cols);
        let decay = -lr * cfg.weight_decay;
        for (x, di) in p.value.iter_mut().zip(&d) {
            *x += -step_size * di;
            *x += decay * *x;
        }

        // Preconditioner maintenance, after the step (reference order).
        let mut wait = 0.0;
        if let Some(l) = &mut t.l {
            linalg::accumulate_left(l, p.grad, rows, cols, sb);
        }
        if let Some(r) = &mut t.r {
            linalg::accumulate_right(r, p.grad, rows, cols, sb);
        }
        let Some(st) = self.params.get_mut(p.name) else {
            return Err(OptimError::BadState(format!(
                "parameter `{}` vanished",
                p.name
            )));
        };
        if (left || right) && step % freq == 0 {
            self.refreshes_due += 1;
            if let Some(prev) = st.pending.take() {
                let (res, w) = prev.wait();
                wait += w;
                t.install(res?, rows, cols);
            }
            let job = RefreshJob {
                left: t.l.clone().zip(t.ql.clone()),
                right: t.r.clone().zip(t.qr.clone()),
                rows,
                cols,
            };
            if let (Some(split), Some(rule)) = (&mut self.split_step, cfg.split) {
                // Split: only the owner refreshes, and nobody installs until every owner's
                // decision has arrived (`step_shared`). Installing later in the step changes
                // nothing, because a parameter's new basis is first used at its next step.
                let key = (p.name.to_owned(), 0);
                if split.owned.contains(&key) {
                    let d = match compute_refresh(&job) {
                        Ok(res) => decide(res, t, st.kept, rule, rows, cols),
                        Err(e) => Decision::Failed(e.to_string()),
                    };
                    split.decisions.push((key, d));
                }
            } else {
                match &self.pool {
                    None => t.install(compute_refresh(&job)?, rows, cols),
                    Some(pool) => {
                        st.pending = Some(Pending::submit(pool, step, job, compute_refresh));
                    }
                }
            }
        }
        if let (
            Some(pend),
            RefreshMode::Async {
                staleness,
                apply_at_deadline,
                ..
            },
        ) = (&mut st.pending, cfg.refresh)
        {
            let deadline = pend
                .requested_at
                .saturating_add(staleness.saturating_mul(freq));
            let ready = if step >= deadline {
                st.pending.take().map(|p| {
                    let (r, w) = p.wait();
                    wait += w;
                    r
                })
            } else if !apply_at_deadline {
                let r = pend.poll();
                if r.is_some() {
                    st.pending = None;
                }
                r
            } else {
                None
            };
            if let Some(res) = ready {
                t.install(res?, rows, cols);
            }
        }
        Ok(wait)
    }

    /// Like [`Optimizer::save_state`], but reports a failure to read spilled state instead of
    /// encoding it into the bytes.
    pub fn try_save_state(&self) -> Result<Vec<u8>, OptimError> {
        let mut w = Writer::new(SOAP_TAG);
        w.u64(self.params.len() as u64);
        for (name, st) in &self.params {
            w.str(name);
            w.usizes(&st.shape);
            w.u8(u8::from(st.left) | (u8::from(st.right) << 1));
            w.u64(st.step);
            w.u64(st.kept);
            w.f32s(&self.store.read(&key(name, "m"))?);
            w.f32s(&self.store.read(&key(name, "v"))?);
            if st.left {
                w.f32s(&self.store.read(&key(name, "L"))?);
                w.f32s(&self.store.read(&key(name, "QL"))?);
            }
            if st.right {
                w.f32s(&self.store.read(&key(name, "R"))?);
                w.f32s(&self.store.read(&key(name, "QR"))?);
            }
            // A refresh in flight is saved as its inputs; loading recomputes it (a pure
            // function), so nothing is lost.
            match &st.pending {
                None => w.u8(0),
                Some(p) => {
                    w.u8(1);
                    w.u64(p.requested_at);
                    for (s, q) in p.job.left.iter().chain(p.job.right.iter()) {
                        w.f32s(s);
                        w.f32s(q);
                    }
                }
            }
        }
        Ok(w.finish())
    }
}

impl Default for Soap {
    fn default() -> Self {
        Self::new(SoapConfig::default())
    }
}

struct Loaded {
    name: String,
    param: SoapParam,
    tensors: Vec<(&'static str, Vec<f32>, Access)>,
}

fn read_param(r: &mut Reader<'_>, has_kept: bool) -> Result<Loaded, OptimError> {
    let bad = |m: String| OptimError::BadState(m);
    let name = r.str()?;
    let shape = r.usizes()?;
    let flags = r.u8()?;
    let (left, right) = (flags & 1 != 0, flags & 2 != 0);
    if flags > 3 || ((left || right) && shape.len() < 2) {
        return Err(bad(format!(
            "parameter `{name}`: invalid side flags {flags} for shape {shape:?}"
        )));
    }
    let n: usize = shape.iter().product();
    let (rows, cols) = if shape.len() >= 2 {
        (shape[0], shape[1..].iter().product())
    } else {
        (1, n)
    };
    let step = r.u64()?;
    let kept = if has_kept { r.u64()? } else { 0 };
    let mut tensors = Vec::new();
    let mut expect = |r: &mut Reader<'_>, part: &'static str, len: usize, acc: Access| {
        let x = r.f32s()?;
        if x.len() != len {
            return Err(bad(format!(
                "parameter `{name}`: `{part}` has {} values, expected {len}",
                x.len()
            )));
        }
        tensors.push((part, x, acc));
        Ok(())
    };
    expect(r, "m", n, Access::Hot)?;
    expect(r, "v", n, Access::Hot)?;
    if left {
        expect(r, "L", rows * rows, Access::Hot)?;
        expect(r, "QL", rows * rows, Access::Warm)?;
    }
    if right {
        expect(r, "R", cols * cols, Access::Hot)?;
        expect(r, "QR", cols * cols, Access::Warm)?;
    }
    let pending = match r.u8()? {
        0 => None,
        1 => {
            let requested_at = r.u64()?;
            let mut side = |on: bool, d: usize| -> Result<Option<SideSnapshot>, OptimError> {
                if !on {
                    return Ok(None);
                }
                let (s, q) = (r.f32s()?, r.f32s()?);
                if s.len() != d * d || q.len() != d * d {
                    return Err(bad(format!(
                        "parameter `{name}`: pending refresh has wrong sizes"
                    )));
                }
                Ok(Some((s, q)))
            };
            let job = RefreshJob {
                left: side(left, rows)?,
                right: side(right, cols)?,
                rows,
                cols,
            };
            Some(Pending::computed(requested_at, job, compute_refresh))
        }
        x => {
            return Err(bad(format!(
                "parameter `{name}`: invalid pending marker {x}"
            )))
        }
    };
    let param = SoapParam {
        shape,
        rows,
        cols,
        left,
        right,
        step,
        pending,
        kept,
    };
    Ok(Loaded {
        name,
        param,
        tensors,
    })
}

impl Optimizer for Soap {
    fn step(&mut self, lr: f32, params: &mut [Param<'_>]) -> Result<StepReport, OptimError> {
        for p in params.iter() {
            check_param(p)?;
        }
        let mut report = StepReport::default();
        self.refreshes_due = 0;
        for i in 0..params.len() {
            // Start reading the next parameter's spilled state while this one is computed.
            if let Some(next) = params.get(i + 1).map(|p| p.name) {
                self.prefetch(next);
            }
            let p = &mut params[i];
            // An empty tensor has nothing to optimize (and would make 0×0 decompositions).
            if p.value.is_empty() {
                continue;
            }
            report.wait_seconds += self.step_param(lr, p)?;
        }
        report.refreshes = self.refreshes_due;
        Ok(report)
    }

    fn step_shared(
        &mut self,
        lr: f32,
        params: &mut [Param<'_>],
        group: &mut dyn RankGroup,
    ) -> Result<StepReport, OptimError> {
        if self.config.split.is_none() {
            return self.step(lr, params);
        }
        if self.config.refresh != RefreshMode::Sync {
            return Err(OptimError::Exchange(
                "split refreshes need synchronous refreshes (RefreshMode::Sync)".into(),
            ));
        }
        // Owners are assigned over the rotated parameters in the order given, weighted by the
        // cubic cost of their decompositions; every rank passes the same parameters, so every
        // rank computes the same owners.
        let max_dim = self.config.max_precond_dim;
        let items = params
            .iter()
            .filter_map(|p| {
                let (rows, cols, left, right) = sides(p.shape, max_dim);
                ((left || right) && !p.value.is_empty()).then(|| {
                    let cost = side_cost(rows, left).saturating_add(side_cost(cols, right));
                    ((p.name.to_owned(), 0), cost)
                })
            })
            .collect();
        self.split_step = Some(SplitStep {
            owned: split::owned(items, group),
            decisions: Vec::new(),
        });
        let stepped = self.step(lr, params);
        let mine = self.split_step.take().unwrap_or_default();
        let mut report = stepped?;
        report.bases_computed = mine.decisions.len() as u64;
        let all = split::exchange(group, &mine.decisions)?;
        // Every rank applies every owner's decisions in rank order, so all ranks make the
        // same changes to their (identical) state.
        split::apply_all(all, &mut report, |(name, index), decision| {
            let Some(st) = self.params.get_mut(name).filter(|_| *index == 0) else {
                return Err(OptimError::Exchange(format!(
                    "a decision for unknown basis {index} of parameter `{name}`"
                )));
            };
            let Some(res) = decision else {
                st.kept += 1;
                return Ok(());
            };
            st.kept = 0;
            let (rows, cols, left, right) = (st.rows, st.cols, st.left, st.right);
            if !check_side(&res.left, left, rows) || !check_side(&res.right, right, cols) {
                return Err(OptimError::Exchange(format!(
                    "parameter `{name}`: a received basis has the wrong size"
                )));
            }
            let mut t = self.take(name, left, right)?;
            t.install(res, rows, cols);
            self.put(name, t)
        })?;
        Ok(report)
    }

    /// Refresh snapshots in flight are not counted.
    fn state_usage(&self) -> TierUsage {
        self.store.usage()
    }

    fn save_state(&self) -> Vec<u8> {
        match self.try_save_state() {
            Ok(b) => b,
            // The trait cannot return an error here: encode it so that `load_state` refuses
            // the bytes with the reason instead of restoring partial state.
            Err(e) => {
                let mut w = Writer::new(SOAP_ERR_TAG);
                w.str(&e.to_string());
                w.finish()
            }
        }
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        if bytes.get(..8) == Some(SOAP_ERR_TAG.as_slice()) {
            let mut r = Reader::new(bytes, SOAP_ERR_TAG)?;
            let msg = r.str()?;
            return Err(OptimError::BadState(format!(
                "the state could not be saved: {msg}"
            )));
        }
        let v1 = bytes.get(..8) == Some(SOAP_TAG_V1.as_slice());
        let mut r = Reader::new(bytes, if v1 { SOAP_TAG_V1 } else { SOAP_TAG })?;
        let n = r.len()?;
        let mut loaded = Vec::new();
        for _ in 0..n {
            loaded.push(read_param(&mut r, !v1)?);
        }
        r.end()?;
        // Everything parsed: only now replace the current state.
        self.params.clear();
        self.store = TieredStore::new(None); // drops (and deletes) the old spill files first
        self.store = TieredStore::new(self.config.tiers.clone());
        for l in loaded {
            for (part, x, acc) in l.tensors {
                self.store.insert(&key(&l.name, part), x, acc)?;
            }
            self.params.insert(l.name, l.param);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A rotation by `angle` in the plane of columns 0 and 1 of the 3×3 identity.
    fn turned(angle: f64) -> Vec<f32> {
        let (c, s) = (angle.cos() as f32, angle.sin() as f32);
        vec![c, -s, 0.0, s, c, 0.0, 0.0, 0.0, 1.0]
    }

    #[test]
    fn the_change_measure_ignores_signs_order_and_common_rotations() {
        let id = turned(0.0);
        let perm = [0, 1, 2];
        assert_eq!(basis_change(&id, &perm, &id, 3, &[]), 0.0);
        let flipped = [-1.0f32, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0];
        assert_eq!(basis_change(&id, &perm, &flipped, 3, &[]), 0.0, "signs");
        // Columns reordered, with the permutation that says so.
        let swapped = [0.0f32, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        assert_eq!(
            basis_change(&id, &[1, 0, 2], &swapped, 3, &[]),
            0.0,
            "order"
        );
        // Two of three vectors turn by 60°: each keeps |cos| = 1/2 of its alignment.
        let a = std::f64::consts::FRAC_PI_3;
        let d = basis_change(&id, &perm, &turned(a), 3, &[]);
        assert!((d - (1.0 - (0.5 + 0.5 + 1.0) / 3.0)).abs() < 1e-6, "{d}");
        // The same change seen after rotating both bases is the same change.
        let u = turned(0.7);
        let mul = |x: &[f32], y: &[f32]| {
            let mut o = vec![0.0f32; 9];
            crate::linalg::matmul(x, y, &mut o, 3, 3, 3);
            o
        };
        let d2 = basis_change(&mul(&u, &id), &perm, &mul(&u, &turned(a)), 3, &[]);
        assert!((d - d2).abs() < 1e-6, "{d} vs {d2}");
        // Weighted by eigenvalue: a turn confined to directions of no energy is no change.
        assert_eq!(
            basis_change(&id, &perm, &turned(a), 3, &[0.0, 0.0, 2.0]),
            0.0
        );
        let w = basis_change(&id, &perm, &turned(a), 3, &[1.0, 1.0, 0.0]);
        assert!((w - 0.5).abs() < 1e-6, "{w}");
        // A turn by 90° replaces the vectors entirely.
        let q = basis_change(
            &id,
            &perm,
            &turned(std::f64::consts::FRAC_PI_2),
            3,
            &[1.0, 1.0, 0.0],
        );
        assert!((q - 1.0).abs() < 1e-6, "{q}");
    }
}
