//! Optimizers for orrery's training program — AdamW, SOAP and Shampoo — and the runtime that
//! makes the second-order ones affordable.
//!
//! # The boundary
//!
//! Parameters and gradients cross into this crate as plain `f32` buffers with a name and a
//! row-major shape ([`Param`]), so the optimizer math never depends on a tensor backend: the
//! trainer copies (or borrows) each tensor's data, calls [`Optimizer::step`] with this step's
//! learning rate (the caller owns the schedule), and copies the values back. State is keyed by
//! parameter name and created on a parameter's first step. [`Optimizer::save_state`] and
//! [`Optimizer::load_state`] move the whole state as one versioned, checksummed byte blob; bad
//! bytes are refused with [`OptimError::BadState`] and a message saying what was wrong.
//!
//! # The optimizers
//!
//! - [`AdamW`]: Adam with decoupled weight decay ([`AdamWConfig`]).
//! - [`Soap`]: Adam run in the eigenbasis of Shampoo's Kronecker factors, as published by Vyas
//!   et al. (2024), with periodic power-iteration + QR refreshes of the basis ([`SoapConfig`]).
//! - [`Shampoo`]: blocked Shampoo with inverse fourth roots and Adam grafting
//!   ([`ShampooConfig`]).
//!
//! Tensors with two or more dimensions are treated as matrices (first dimension × the rest);
//! 1-D tensors get Adam inside SOAP and Shampoo. The dense linear algebra ([`linalg`]) is faer,
//! single-threaded per matrix, with eigendecompositions and QR in `f64` and state in `f32`.
//!
//! # The runtime
//!
//! - *Asynchronous preconditioning* ([`RefreshMode::Async`]): SOAP's basis refreshes (and
//!   Shampoo's inverse roots) run on a pool of CPU threads from a snapshot, and a step uses the
//!   newest finished basis, waiting only when the basis in use would exceed the staleness bound
//!   (in refresh periods; at most one refresh per parameter is in flight); staleness 0 is
//!   bit-identical to the synchronous optimizer. [`StepReport::wait_seconds`] says how long a
//!   step waited. Saved state includes refreshes in flight (as their inputs).
//! - *Split refreshes* ([`SplitRefresh`]): on data-parallel ranks, which hold identical state,
//!   each refresh — a SOAP parameter's basis, a Shampoo block's inverse roots — is computed by
//!   one owner rank ([`assign_owners`]), and the result reaches the others through
//!   [`Optimizer::step_shared`]'s [`RankGroup`] (one all-gather per step), only when it changed
//!   by more than a threshold ([`basis_change`], [`root_change`]) or has been kept too often.
//!   Threshold 0 is bit-identical to every rank refreshing everything; [`StepReport`] counts
//!   the refreshes that fell due and those sent and kept.
//! - *Tiered state* ([`tiers`]): each of SOAP's state tensors is placed on the device, in host
//!   memory or on disk by its access pattern under per-tier byte budgets; spilled tensors are
//!   checksummed files written atomically, and a corrupt one is an error
//!   ([`OptimError::Spill`]), never silently used. The next parameter's spilled state is
//!   prefetched on an I/O thread while the current one is computed. Spilled and resident state
//!   give bit-identical results. [`Optimizer::state_usage`] reports the bytes in each tier.
//!
//! # Guarantees
//!
//! Same inputs, same outputs, bit for bit: every reduction has a fixed order, decompositions run
//! single-threaded (parallelism comes from working on different matrices at once), and the
//! only timing-dependent behaviour — installing an asynchronous refresh as soon as it is ready —
//! can be switched to installing it at its deadline (`apply_at_deadline`). The wall clock is
//! read only to fill `wait_seconds`, never to decide anything.
//!
//! # What this crate does not do
//!
//! It does not compute gradients, clip them or schedule the learning rate (the trainer does);
//! it does not connect to other ranks (it decides what a split refresh sends, and the caller's
//! [`RankGroup`] carries it); it does not split asynchronous refreshes (a split needs
//! [`RefreshMode::Sync`]) nor SOAP's initial eigendecomposition (every rank computes it on a
//! parameter's first call), and it does not shard optimizer state (every rank of a split
//! still holds all of it); it does not use a GPU — on the CPU the "device" tier is RAM
//! accounted separately; it does not migrate tensors between tiers after placement; and only
//! SOAP's state is tiered (Shampoo and AdamW keep theirs resident).

use thiserror::Error;

mod adamw;
pub mod linalg;
mod runtime;
mod shampoo;
mod soap;
mod split;
mod state;
pub mod tiers;

pub use adamw::{AdamW, AdamWConfig};
pub use shampoo::{block_ranges, root_change, Shampoo, ShampooConfig};
pub use soap::{
    basis_change, refresh_basis, rotate, rotate_back, RefreshMode, Soap, SoapConfig,
    SOAP_DEFAULT_LR,
};
pub use split::{assign_owners, SplitRefresh};
pub use tiers::{Tier, TierConfig, TierUsage};

/// One parameter tensor handed to an optimizer step: its stable name (used to key state and
/// checkpoints), its shape (row-major), its values (updated in place) and its gradient.
#[derive(Debug)]
pub struct Param<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub value: &'a mut [f32],
    pub grad: &'a [f32],
}

/// What a step did, for progress bars and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepReport {
    /// Wall time the step spent waiting for preconditioner work, in seconds.
    pub wait_seconds: f64,
    /// Periodic preconditioner refreshes that fell due this step, whoever computes them: one
    /// per rotated parameter for SOAP (its basis; the initial eigendecomposition on a
    /// parameter's first call is not counted), one per block for Shampoo (its inverse roots).
    /// Every rank of a split counts all of them, so there they are `bases_sent + bases_kept`.
    pub refreshes: u64,
    /// Split refreshes ([`SplitRefresh`]): refreshed preconditioners (SOAP bases, Shampoo
    /// blocks' inverse roots) that their owners sent and every rank installed this step.
    pub bases_sent: u64,
    /// Split refreshes: refreshes whose owner kept the preconditioner in use (changed too
    /// little) and sent only that decision.
    pub bases_kept: u64,
    /// Split refreshes: refreshes this rank computed as their owner (the other ranks' share
    /// of the work it did not do is `bases_sent + bases_kept - bases_computed`).
    pub bases_computed: u64,
}

/// Errors of an optimizer step or of restoring optimizer state.
#[derive(Debug, Error)]
pub enum OptimError {
    #[error("parameter `{name}`: {problem}")]
    BadParam { name: String, problem: String },
    #[error("optimizer state: {0}")]
    BadState(String),
    /// A preconditioner decomposition failed (non-finite statistics).
    #[error(transparent)]
    Linalg(#[from] linalg::LinalgError),
    /// Spilled state could not be read or written, or was corrupt.
    #[error(transparent)]
    Spill(#[from] tiers::TierError),
    /// Exchanging refreshed bases with the other ranks failed, or what arrived was not a
    /// valid exchange message.
    #[error("basis exchange: {0}")]
    Exchange(String),
}

/// The data-parallel group as an optimizer sees it: its rank, the number of ranks, and one
/// collective. Every rank of the group calls [`Optimizer::step_shared`] with identical
/// parameters and gradients, so every rank reaches the same collectives in the same order. The
/// trainer implements it over its communicator; this crate never opens a connection itself.
pub trait RankGroup {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every rank's bytes, indexed by rank, on every rank.
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, String>;
}

/// A group of one rank (the identity collective), for single-rank callers and tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoloGroup;

impl RankGroup for SoloGroup {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        Ok(vec![mine.to_vec()])
    }
}

/// An optimizer over named `f32` parameters. `lr` is this step's learning rate (the caller owns
/// the schedule). State is saved and restored as opaque bytes; the caller writes them
/// atomically and checksums them.
pub trait Optimizer: Send {
    fn step(&mut self, lr: f32, params: &mut [Param<'_>]) -> Result<StepReport, OptimError>;
    fn save_state(&self) -> Vec<u8>;
    fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError>;

    /// Bytes of optimizer state in each tier (device, host, disk). Every optimizer in this
    /// crate overrides it; the default (all zero) exists only so that adding this method did
    /// not break other implementations.
    fn state_usage(&self) -> TierUsage {
        TierUsage::default()
    }

    /// [`Optimizer::step`] on one rank of a data-parallel group whose ranks all hold the same
    /// parameters, gradients and state. An optimizer may split work across the group here (SOAP
    /// with [`SoapConfig::split`], Shampoo with [`ShampooConfig::split`]); the default, and
    /// either without a split, is `step`, which uses no collective.
    fn step_shared(
        &mut self,
        lr: f32,
        params: &mut [Param<'_>],
        group: &mut dyn RankGroup,
    ) -> Result<StepReport, OptimError> {
        let _ = group;
        self.step(lr, params)
    }
}

/// Checks that a parameter's buffers agree with its shape.
pub(crate) fn check_param(p: &Param<'_>) -> Result<(), OptimError> {
    let n: usize = p.shape.iter().product();
    if p.value.len() != n || p.grad.len() != n {
        return Err(OptimError::BadParam {
            name: p.name.to_owned(),
            problem: format!(
                "shape {:?} has {n} elements but value has {} and grad {}",
                p.shape,
                p.value.len(),
                p.grad.len()
            ),
        });
    }
    Ok(())
}
