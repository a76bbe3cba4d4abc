//! orrery's real training program, as a library.
//!
//! This is the layer that actually trains a language model — the program that hybrid emulation
//! will later run as its real ranks, and the harness the optimizer runtime is benchmarked in.
//! It is deliberately small and exact rather than fast:
//!
//! - **Model** ([`model`]): a decoder-only GPT on burn (CPU `ndarray` backend with autodiff by
//!   default; CUDA behind the `cuda` feature). Pre-norm blocks; LayerNorm or RMSNorm; RoPE or
//!   learned positions; grouped-query attention (`n_kv_heads`); GeLU or SwiGLU, dense or a
//!   top-k mixture of experts; tied or untied output head — all chosen in [`ModelConfig`].
//! - **Parameters** ([`params::ParamStore`]): the canonical weights are named `f32` buffers,
//!   not burn tensors. Each step builds the burn module from the store, runs forward and
//!   backward with burn's autodiff, copies each parameter's gradient out by module path, and
//!   hands values and gradients to an [`orrery_optim::Optimizer`]. burn's own optimizers are
//!   never used: the optimizer math (AdamW, SOAP, Shampoo) lives in `orrery-optim`, backend-free.
//! - **Data** ([`data`]): a byte-level tokenizer by default (BPE from tiktoken-rs behind the
//!   `bpe` feature); a text file or folder of `.txt` files split by position into training and
//!   validation tokens; random contiguous windows from a seeded, checkpointed RNG. A few KB of
//!   Shakespeare's sonnets are built in; `scripts/fetch-shakespeare.sh` fetches 42 plays.
//! - **Loop** ([`Trainer`]): warm-up + cosine schedule, global-norm gradient clipping, periodic
//!   evaluation on fixed validation windows, metrics as JSON lines ([`StepMetrics`]) and a
//!   loss-curve SVG.
//! - **Checkpoints** ([`checkpoint`]): one file with magic, version, length and CRC32, written
//!   atomically; it holds weights (exact bit patterns), optimizer state bytes, sampler RNG
//!   state, step, configuration, metrics and the optimizer's figures, so that a run of N steps
//!   equals k steps + resume + N − k steps bit for bit.
//! - **Data parallelism** ([`comm`]): a blocking, rank-ordered [`Communicator`] trait with a
//!   single-rank backend, an in-process threads backend ([`train_with`]'s `ranks`), and, behind
//!   the `mpi` feature, an MPI backend with one rank per process on one or several hosts
//!   (`comm_mpi::MpiComm`, run by [`train_with_comm`] under `mpirun`). Every rank draws the same
//!   global batch and trains on its slice; gradients are averaged with an all-reduce that sums
//!   in rank order, so results depend neither on timing nor on the backend.
//! - **Tensor, pipeline and expert parallelism** ([`parallel`], [`model_parallel`]): an
//!   optional `[parallel]` section ([`ParallelConfig`]) makes the run a `tp × pp × dp` grid
//!   ([`Layout`]). Each rank holds its pipeline stage's layers with Megatron's column- and
//!   row-parallel cuts of the attention and MLP matrices (embeddings, norms and head
//!   replicated), runs its micro-batches with the 1F1B schedule (or interleaved 1F1B over
//!   several model chunks per stage), passing activations and gradients to its pipeline
//!   neighbours with point-to-point messages, and sums partial results over its
//!   tensor-parallel group with group all-reduces of the [`Communicator`]. A
//!   mixture-of-experts model ([`MoeConfig`]) may split its experts over an expert-parallel
//!   group (`ep`), tokens dispatched to them and results combined with the group all-to-all.
//!   Every layout trains the single-rank model's weights within float tolerance (every rank
//!   cuts its shard from the same seeded full model), and its checkpoints hold the whole
//!   model's weights and every rank's optimizer state, for a bit-exact resume.
//!
//! Determinism: the crate's own [`rng::Rng`] initialises weights and samples batches, burn's
//! backend RNG is seeded too (nothing here draws from it: there is no dropout), and timing is
//! read from a caller-supplied [`Clock`]. The same configuration and seed give bit-identical
//! losses and weights.
//!
//! Split preconditioner refreshes: every optimizer step hands the optimizer the communicator
//! (as an `orrery_optim::RankGroup`), so that SOAP or Shampoo built with a split
//! ([`OptimizerRuntime::split`]) can have each SOAP basis, or each Shampoo block's inverse
//! roots, refreshed by one owner rank and sent to the others in one all-gather per step;
//! threshold 0 is bit-identical to no split (`tests/split_refresh.rs` over threads,
//! `tests/mpi.rs` over MPI), and [`Trainer::optimizer_summary`] counts the exchange
//! (`bases_sent`, `bases_kept`).
//!
//! What the optimizer did is part of the run's [`TrainSummary`] ([`OptimizerSummary`]): the
//! largest state it held in each tier, the refreshes that fell due, the time steps waited for
//! asynchronous refreshes, and the refreshes a split sent and kept, over the whole run (the
//! checkpoint carries them across a resume).
//!
//! What this crate does not do: it does not print (progress goes to a [`TrainObserver`]); it
//! does not shard optimizer state across ranks (a split shares refresh work, and every rank
//! still holds all the state; with model parallelism each rank holds its shard's); it has no
//! sequence parallelism, mixed precision, dropout, KV cache or sampling/generation; and it
//! does not make the CPU fast — it is a faithful, reproducible reference trainer.

pub mod checkpoint;
pub mod comm;
#[cfg(feature = "mpi")]
pub mod comm_mpi;
pub mod config;
pub mod data;
pub mod metrics;
pub mod model;
pub mod model_parallel;
pub mod parallel;
pub mod params;
pub mod rng;
pub mod schedule;
mod trainer;

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};

use orrery_optim::{OptimError, Optimizer, Param, StepReport};

pub use checkpoint::{Checkpoint, CheckpointError};
pub use comm::{CommError, Communicator, Group, GroupError, SingleRank, ThreadComm};
#[cfg(feature = "mpi")]
pub use comm_mpi::{MpiAbort, MpiComm, MpiInitError};
pub use config::{
    ConfigErrors, ConfigLoadError, ConfigProblem, DataConfig, DeviceKind, MlpKind, ModelConfig,
    MoeConfig, NormKind, OptimizerConfig, PositionKind, TokenizerKind, TrainConfig,
};
pub use data::{Corpus, DataError, Tokenizer};
pub use metrics::{loss_curve_svg, StepMetrics};
pub use parallel::{Coords, Layout, ParallelConfig};
pub use trainer::{
    Clock, FixedClock, MonotonicClock, NullObserver, OptimizerSummary, TrainError, TrainObserver,
    TrainSummary, Trainer, CHECKPOINT_FILE, LOSS_PLOT_FILE, METRICS_FILE,
};

/// The default backend: burn's ndarray CPU backend with autodiff.
pub type CpuBackend = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

/// burn's CUDA backend with autodiff (feature `cuda`).
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Autodiff<burn::backend::Cuda>;

/// Starts burn's CUDA backend on the default device and waits for it: a one-element tensor
/// made there and read back, which is what a rank's first step does first. Where the CUDA
/// driver cannot be loaded or no device answers, burn's backend panics (on a thread of its
/// own, then here); a caller that owns the process can catch that before its ranks start
/// (`orrery` does, and reports the `device` it could not use).
#[cfg(feature = "cuda")]
pub fn start_cuda() {
    let probe = burn::tensor::Tensor::<burn::backend::Cuda, 1>::zeros([1], &Default::default());
    let _ = probe.into_data();
}

/// Plain gradient descent, `x -= lr * g`. Stateless; for debugging and for tests that need an
/// optimizer whose arithmetic is obvious.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sgd;

impl Optimizer for Sgd {
    fn step(&mut self, lr: f32, params: &mut [Param<'_>]) -> Result<StepReport, OptimError> {
        for p in params.iter_mut() {
            if p.value.len() != p.grad.len() {
                return Err(OptimError::BadParam {
                    name: p.name.to_owned(),
                    problem: "value and gradient lengths differ".into(),
                });
            }
            for (x, g) in p.value.iter_mut().zip(p.grad) {
                *x -= lr * g;
            }
        }
        Ok(StepReport::default())
    }

    fn save_state(&self) -> Vec<u8> {
        Vec::new()
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        if bytes.is_empty() {
            Ok(())
        } else {
            Err(OptimError::BadState("sgd has no state".into()))
        }
    }
}

/// How the second-order optimizers run, beyond their hyper-parameters: synchronous or
/// asynchronous preconditioner refreshes, (SOAP) tier budgets for the state, and (SOAP and
/// Shampoo) refreshes split across the data-parallel ranks: each rank refreshes the
/// preconditioners it owns (SOAP: a parameter's basis; Shampoo: a block's inverse roots) and
/// sends the results (only those that changed by more than `split.threshold`, or that the
/// `max_kept` bound forces) to the others. With threshold 0 a split run is bit-identical to
/// one without.
#[derive(Debug, Clone)]
pub struct OptimizerRuntime {
    pub refresh: orrery_optim::RefreshMode,
    pub tiers: Option<orrery_optim::TierConfig>,
    pub split: Option<orrery_optim::SplitRefresh>,
}

impl Default for OptimizerRuntime {
    fn default() -> Self {
        Self {
            refresh: orrery_optim::RefreshMode::Sync,
            tiers: None,
            split: None,
        }
    }
}

/// The optimizer `config.optimizer` names, with `orrery-optim`'s defaults for everything the
/// configuration does not set (SOAP/Shampoo preconditioning, synchronous refreshes).
pub fn make_optimizer(config: &TrainConfig) -> Result<Box<dyn Optimizer>, TrainError> {
    make_optimizer_with(config, &OptimizerRuntime::default())
}

/// [`make_optimizer`] with the runtime's options. Asynchronous refreshes and splits apply to
/// SOAP and Shampoo, tiers to SOAP only, and a split needs synchronous refreshes; anything else
/// is a configuration error naming `optimizer.name`.
pub fn make_optimizer_with(
    config: &TrainConfig,
    runtime: &OptimizerRuntime,
) -> Result<Box<dyn Optimizer>, TrainError> {
    let o = &config.optimizer;
    let split = runtime.split;
    let refuse = |message: String| {
        Err(TrainError::Config(ConfigErrors {
            problems: vec![ConfigProblem {
                path: "optimizer.name".into(),
                message,
            }],
        }))
    };
    let second_order = o.name == "soap" || o.name == "shampoo";
    if !second_order && !matches!(runtime.refresh, orrery_optim::RefreshMode::Sync) {
        return refuse(format!(
            "asynchronous refresh needs soap or shampoo, not {}",
            o.name
        ));
    }
    if o.name != "soap" && runtime.tiers.is_some() {
        return refuse(format!("tiered optimizer state needs soap, not {}", o.name));
    }
    if split.is_some() && !second_order {
        return refuse(format!(
            "split refreshes need soap or shampoo, not {}",
            o.name
        ));
    }
    if split.is_some() && !matches!(runtime.refresh, orrery_optim::RefreshMode::Sync) {
        return refuse("split refreshes need synchronous refreshes".into());
    }
    match o.name.as_str() {
        "adamw" => Ok(Box::new(orrery_optim::AdamW::new(
            orrery_optim::AdamWConfig {
                betas: (o.beta1, o.beta2),
                eps: o.eps,
                weight_decay: o.weight_decay,
            },
        ))),
        "soap" => Ok(Box::new(orrery_optim::Soap::new(
            orrery_optim::SoapConfig {
                refresh: runtime.refresh,
                tiers: runtime.tiers.clone(),
                split,
                ..soap_config(o)
            },
        ))),
        "shampoo" => Ok(Box::new(orrery_optim::Shampoo::new(
            orrery_optim::ShampooConfig {
                refresh: runtime.refresh,
                split,
                ..shampoo_config(o)
            },
        ))),
        "sgd" => Ok(Box::new(Sgd)),
        other => refuse(format!("unknown optimizer `{other}`")),
    }
}

/// SOAP's hyper-parameters from the configuration's optimizer section, the published
/// defaults where it leaves them out; the runtime fields (refreshes, tiers, split) at their
/// defaults. What `make_optimizer_with` trains SOAP with, and what reports show.
pub fn soap_config(o: &OptimizerConfig) -> orrery_optim::SoapConfig {
    let published = orrery_optim::SoapConfig::default();
    orrery_optim::SoapConfig {
        betas: (o.beta1, o.beta2),
        eps: o.eps,
        weight_decay: o.weight_decay,
        precondition_frequency: o
            .precondition_frequency
            .unwrap_or(published.precondition_frequency),
        shampoo_beta: o.shampoo_beta,
        ..published
    }
}

/// Shampoo's hyper-parameters from the configuration's optimizer section, as
/// [`soap_config`] does for SOAP.
pub fn shampoo_config(o: &OptimizerConfig) -> orrery_optim::ShampooConfig {
    let published = orrery_optim::ShampooConfig::default();
    orrery_optim::ShampooConfig {
        beta1: o.beta1,
        weight_decay: o.weight_decay,
        precondition_frequency: o
            .precondition_frequency
            .unwrap_or(published.precondition_frequency),
        shampoo_beta: o.shampoo_beta.unwrap_or(published.shampoo_beta),
        ..published
    }
}

/// Builds one rank's optimizer (called once per rank).
pub type OptimizerFactory =
    Arc<dyn Fn(&TrainConfig) -> Result<Box<dyn Optimizer>, TrainError> + Send + Sync>;

/// How to run a configuration (beyond the configuration itself).
#[derive(Clone)]
pub struct RunOptions {
    /// Continue from this checkpoint file, or from `checkpoint.ckpt` in this folder.
    pub resume: Option<PathBuf>,
    /// In-process data-parallel ranks (threads) of [`train_with`]; 1 trains on the calling
    /// thread. [`train_with_comm`] ignores it: its communicator defines the ranks.
    pub ranks: usize,
    pub clock: Arc<dyn Clock>,
    pub make_optimizer: OptimizerFactory,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("resume", &self.resume)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            resume: None,
            ranks: 1,
            clock: Arc::new(MonotonicClock::new()),
            make_optimizer: Arc::new(make_optimizer),
        }
    }
}

/// Trains `config` on one rank with the optimizer it names and a real clock.
pub fn train(
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
) -> Result<TrainSummary, TrainError> {
    train_with(config, &RunOptions::default(), observer)
}

/// Reads and tokenizes the configured corpus and splits it.
pub fn load_corpus(config: &TrainConfig) -> Result<Corpus, TrainError> {
    let tokenizer = data::make_tokenizer(&config.data.tokenizer)?;
    if tokenizer.vocab_size() > config.model.vocab_size {
        return Err(TrainError::Config(ConfigErrors {
            problems: vec![ConfigProblem {
                path: "model.vocab_size".into(),
                message: format!(
                    "{} is smaller than the tokenizer's vocabulary of {}",
                    config.model.vocab_size,
                    tokenizer.vocab_size()
                ),
            }],
        }));
    }
    let text = data::read_text(config.data.path.as_deref())?;
    Ok(Corpus::split(
        tokenizer.encode(&text),
        config.data.val_fraction,
        config.model.context,
    )?)
}

/// The checkpoint file `resume` refers to (a folder means its `checkpoint.ckpt`).
pub fn checkpoint_path(resume: &Path) -> PathBuf {
    if resume.is_dir() {
        resume.join(CHECKPOINT_FILE)
    } else {
        resume.to_owned()
    }
}

/// Trains with explicit options: resume, in-process data parallelism, clock, optimizer.
pub fn train_with(
    config: &TrainConfig,
    options: &RunOptions,
    observer: &mut dyn TrainObserver,
) -> Result<TrainSummary, TrainError> {
    config.validate()?;
    match config.device {
        DeviceKind::Cpu => run_ranks::<CpuBackend>(config, options, &Default::default(), observer),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            run_ranks::<CudaBackend>(config, options, &Default::default(), observer)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(cuda_unavailable()),
    }
}

/// Trains `config` as one rank of a run whose ranks are separate processes, possibly on
/// several hosts, joined by `comm` (an `MpiComm` under `mpirun`, feature `mpi`). Every rank
/// calls this with the same configuration and options and trains on the calling thread.
/// `options.ranks` is not used: the communicator's world is the run's. As with the threads
/// of [`train_with`], only rank 0 reports to `observer` and writes the output folder, and a
/// resumed run reads its checkpoint on rank 0 only.
pub fn train_with_comm(
    config: &TrainConfig,
    options: &RunOptions,
    comm: Box<dyn Communicator>,
    observer: &mut dyn TrainObserver,
) -> Result<TrainSummary, TrainError> {
    config.validate()?;
    let corpus = load_corpus(config)?;
    let mut null = NullObserver;
    let observer: &mut dyn TrainObserver = if comm.rank() == 0 {
        observer
    } else {
        &mut null
    };
    match config.device {
        DeviceKind::Cpu => {
            run_rank::<CpuBackend>(config, options, corpus, comm, Default::default(), observer)
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            run_rank::<CudaBackend>(config, options, corpus, comm, Default::default(), observer)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(cuda_unavailable()),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_unavailable() -> TrainError {
    TrainError::Config(ConfigErrors {
        problems: vec![ConfigProblem {
            path: "device".into(),
            message: config::CUDA_UNAVAILABLE.into(),
        }],
    })
}

/// The checkpoint to resume from, read by rank 0 and broadcast: rank 0 is the rank that writes
/// checkpoints, so ranks on other hosts need no shared file system. Rank 0 broadcasts nothing
/// (an empty message; a checkpoint never is one) when it cannot read the file, so every rank
/// fails instead of waiting.
fn load_resume_checkpoint(
    comm: &mut dyn Communicator,
    resume: &Path,
) -> Result<Checkpoint, TrainError> {
    let path = checkpoint_path(resume);
    let unreadable = |source| TrainError::ResumeCheckpoint {
        path: path.clone(),
        source,
    };
    if comm.world_size() == 1 {
        return Checkpoint::load(&path).map_err(unreadable);
    }
    let rank = comm.rank();
    let (mut bytes, failure) = if rank == 0 {
        match std::fs::read(&path) {
            Ok(b) => (b, None),
            Err(source) => (
                Vec::new(),
                Some(CheckpointError::Io {
                    path: path.clone(),
                    source,
                }),
            ),
        }
    } else {
        (Vec::new(), None)
    };
    comm.broadcast_bytes(0, &mut bytes)
        .map_err(|source| TrainError::Comm { rank, source })?;
    if let Some(e) = failure {
        return Err(unreadable(e));
    }
    if bytes.is_empty() {
        return Err(TrainError::Resume(format!(
            "rank 0 could not read a checkpoint from {}",
            path.display()
        )));
    }
    Checkpoint::decode(&bytes).map_err(unreadable)
}

fn run_rank<B: burn::tensor::backend::AutodiffBackend>(
    config: &TrainConfig,
    options: &RunOptions,
    corpus: Corpus,
    mut comm: Box<dyn Communicator>,
    device: B::Device,
    observer: &mut dyn TrainObserver,
) -> Result<TrainSummary, TrainError> {
    let optimizer = (options.make_optimizer)(config)?;
    let mut trainer = match &options.resume {
        Some(p) => {
            let ckpt = load_resume_checkpoint(comm.as_mut(), p)?;
            Trainer::<B>::resume(config.clone(), ckpt, corpus, optimizer, comm, device)?
        }
        None => Trainer::<B>::new(config.clone(), corpus, optimizer, comm, device)?,
    };
    trainer.run(options.clock.as_ref(), observer)
}

enum Event {
    Step(StepMetrics),
    Checkpoint(u64, PathBuf),
}

/// Forwards rank 0's progress from its thread to the caller's observer.
struct ChannelObserver(mpsc::Sender<Event>);

impl TrainObserver for ChannelObserver {
    fn on_step(&mut self, m: &StepMetrics) {
        let _ = self.0.send(Event::Step(m.clone()));
    }
    fn on_checkpoint(&mut self, step: u64, path: &Path) {
        let _ = self.0.send(Event::Checkpoint(step, path.to_owned()));
    }
}

fn run_ranks<B: burn::tensor::backend::AutodiffBackend>(
    config: &TrainConfig,
    options: &RunOptions,
    device: &B::Device,
    observer: &mut dyn TrainObserver,
) -> Result<TrainSummary, TrainError>
where
    B::Device: Sync,
{
    let corpus = load_corpus(config)?;
    let ranks = options.ranks.max(1);
    if ranks == 1 {
        return run_rank::<B>(
            config,
            options,
            corpus,
            Box::new(SingleRank),
            device.clone(),
            observer,
        );
    }
    // With tensor or pipeline parallelism the batch is split over the data-parallel replicas
    // only; the trainer checks that against the `[parallel]` layout.
    let split = config.parallel.is_some_and(|p| p.splits_model());
    if !split && !config.batch_size.is_multiple_of(ranks) {
        return Err(TrainError::BatchNotDivisible {
            batch: config.batch_size,
            world: ranks,
        });
    }
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(ranks)
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let corpus = corpus.clone();
                let tx = tx.clone();
                s.spawn(move || {
                    let mut chan = ChannelObserver(tx);
                    let mut null = NullObserver;
                    let obs: &mut dyn TrainObserver = if rank == 0 { &mut chan } else { &mut null };
                    run_rank::<B>(config, options, corpus, Box::new(comm), device.clone(), obs)
                })
            })
            .collect();
        drop(tx);
        for ev in rx {
            match ev {
                Event::Step(m) => observer.on_step(&m),
                Event::Checkpoint(step, path) => observer.on_checkpoint(step, &path),
            }
        }
        let mut results = Vec::with_capacity(ranks);
        for (rank, h) in handles.into_iter().enumerate() {
            results.push(h.join().unwrap_or(Err(TrainError::RankPanicked(rank))));
        }
        // Report the first rank's own failure: the ranks it leaves behind fail with the less
        // informative `PeerGone`.
        let peer_gone = |e: &TrainError| {
            matches!(
                e,
                TrainError::Comm {
                    source: CommError::PeerGone,
                    ..
                }
            )
        };
        let mut errors: Vec<TrainError> = Vec::new();
        let mut summary = None;
        for r in results {
            match r {
                Ok(s) => {
                    summary.get_or_insert(s);
                }
                Err(e) => errors.push(e),
            }
        }
        if let Some(i) = errors.iter().position(|e| !peer_gone(e)) {
            return Err(errors.swap_remove(i));
        }
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        summary.ok_or(TrainError::RankPanicked(0))
    })
}
