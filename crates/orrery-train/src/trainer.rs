//! The training loop: one [`Trainer`] per rank.

use std::io::Write;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use orrery_optim::{OptimError, Optimizer, RankGroup, StepReport};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::checkpoint::{Checkpoint, CheckpointError, CheckpointMeta};
use crate::comm::{CommError, Communicator};
use crate::config::{ConfigErrors, TrainConfig};
use crate::data::{even_starts, random_starts, Batch, Corpus, DataError};
use crate::metrics::{loss_curve_svg, StepMetrics};
use crate::model::{param_specs, Aux, BuildError, Gpt};
use crate::model_parallel::{self as mp, MicroBatch, ModelParallel};
use crate::parallel::Layout;
use crate::params::{collect_grads, ParamStore};
use crate::rng::Rng;
use crate::schedule::lr_at;

/// RNG stream of weight initialisation.
const STREAM_WEIGHTS: u64 = 1;
/// RNG stream of training-batch sampling.
const STREAM_DATA: u64 = 2;

/// File names inside a run's output folder.
pub const METRICS_FILE: &str = "metrics.jsonl";
pub const LOSS_PLOT_FILE: &str = "loss.svg";
pub const CHECKPOINT_FILE: &str = "checkpoint.ckpt";

/// Errors of a training run.
#[derive(Debug, Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] ConfigErrors),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("collective failed on rank {rank}: {source}")]
    Comm {
        rank: usize,
        #[source]
        source: CommError,
    },
    #[error("optimizer: {0}")]
    Optim(#[from] OptimError),
    #[error("building the model: {0}")]
    Model(#[from] BuildError),
    #[error("tensor backend: {0}")]
    Backend(String),
    #[error("cannot resume: {0}")]
    Resume(String),
    /// The checkpoint `--resume` names could not be read or is damaged (bad input, unlike
    /// a checkpoint that cannot be written during training).
    #[error("cannot resume from {path}: {source}")]
    ResumeCheckpoint {
        path: PathBuf,
        #[source]
        source: CheckpointError,
    },
    #[error("writing {path}: {source}")]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the training loss became {loss} at step {step}")]
    NonFinite { step: u64, loss: f32 },
    #[error("data-parallel rank {0} panicked")]
    RankPanicked(usize),
    #[error("batch_size {batch} is not divisible by the {world} data-parallel ranks")]
    BatchNotDivisible { batch: usize, world: usize },
}

impl TrainError {
    /// Whether the run's input is at fault (its configuration, its data, a batch that does
    /// not split over the ranks, a checkpoint of another run to resume) rather than the run:
    /// what a command-line tool reports as bad input.
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            TrainError::Config(_)
                | TrainError::Data(_)
                | TrainError::BatchNotDivisible { .. }
                | TrainError::Resume(_)
                | TrainError::ResumeCheckpoint { .. }
        )
    }
}

/// A monotonic source of seconds. Libraries do not read the wall clock themselves: the caller
/// passes one in (the CLI a real one, tests a fixed one so output is reproducible).
pub trait Clock: Send + Sync {
    fn now_seconds(&self) -> f64;
}

/// A clock that always reads 0 (timing fields become 0; everything else is unchanged).
#[derive(Debug, Clone, Copy, Default)]
pub struct FixedClock;

impl Clock for FixedClock {
    fn now_seconds(&self) -> f64 {
        0.0
    }
}

/// `std::time::Instant` since construction, for callers that want real timings.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    start: std::time::Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// Receives progress from rank 0 of a run (for progress bars); every method has a no-op default.
pub trait TrainObserver {
    /// After every optimizer step (and its evaluation, if any).
    fn on_step(&mut self, _metrics: &StepMetrics) {}
    /// After a checkpoint was written.
    fn on_checkpoint(&mut self, _step: u64, _path: &Path) {}
}

/// An observer that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NullObserver;

impl TrainObserver for NullObserver {}

fn backend_err(e: impl std::fmt::Debug) -> TrainError {
    TrainError::Backend(format!("{e:?}"))
}

fn scalar<B: burn::tensor::backend::Backend>(t: Tensor<B, 1>) -> Result<f32, TrainError> {
    let v = t
        .try_into_data()
        .map_err(backend_err)?
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(backend_err)?;
    v.first()
        .copied()
        .ok_or_else(|| TrainError::Backend("empty loss tensor".into()))
}

/// The training state of one rank: configuration, data, parameters, optimizer, sampler RNG.
pub struct Trainer<B: AutodiffBackend> {
    config: TrainConfig,
    device: B::Device,
    corpus: Corpus,
    store: ParamStore,
    grads: ParamStore,
    optimizer: Box<dyn Optimizer>,
    comm: Box<dyn Communicator>,
    data_rng: Rng,
    step: u64,
    tokens_seen: u64,
    history: Vec<StepMetrics>,
    /// What the optimizer did in this run (carried across a resume by the checkpoint).
    optim: OptimizerSummary,
    aux: Aux<B>,
    aux_eval: Aux<B::InnerBackend>,
    /// This rank's place in a tensor/pipeline-parallel run; `None` for pure data parallelism,
    /// where every rank holds the whole model.
    mp: Option<ModelParallel>,
}

impl<B: AutodiffBackend> std::fmt::Debug for Trainer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("step", &self.step)
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("params", &self.store.numel())
            .finish_non_exhaustive()
    }
}

impl<B: AutodiffBackend> Trainer<B> {
    /// A fresh run: weights initialised from `config.seed` (identically on every rank, then
    /// broadcast from rank 0 so that backends whose ranks could differ still agree).
    pub fn new(
        config: TrainConfig,
        corpus: Corpus,
        optimizer: Box<dyn Optimizer>,
        mut comm: Box<dyn Communicator>,
        device: B::Device,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        let world = comm.world_size();
        let rank = comm.rank();
        // A `[parallel]` section must describe this run's ranks even when it splits nothing.
        let layout = match &config.parallel {
            Some(par) => Some(Layout::new(par, &config.model, config.batch_size, world)?),
            None => None,
        };
        let split = config.parallel.is_some_and(|p| p.splits_model());
        if config.parallel.is_some_and(|p| p.virtual_stages > 1) && !comm.sends_never_wait() {
            return Err(TrainError::Config(ConfigErrors {
                problems: vec![crate::config::ConfigProblem {
                    path: "parallel.virtual_stages".into(),
                    message: "interleaved 1F1B needs a communicator whose sends never wait for \
                              the receiver (threads); this one's may (MPI)"
                        .into(),
                }],
            }));
        }
        if !split && !config.batch_size.is_multiple_of(world) {
            return Err(TrainError::BatchNotDivisible {
                batch: config.batch_size,
                world,
            });
        }
        B::seed(&device, config.seed);
        let specs = param_specs(&config.model);
        let mut store = ParamStore::init(&specs, &mut Rng::new(config.seed, STREAM_WEIGHTS));
        let mp = match layout {
            Some(layout) if split => Some(ModelParallel::new(layout, rank)),
            _ => None,
        };
        if let Some(m) = &mp {
            // Every rank initialises the full model from the seed and keeps its shard, so the
            // shards are the single-rank model's weights exactly; ranks hold different
            // parameters, so there is no broadcast from rank 0.
            store = mp::shard(&store, &config.model, &m.layout, m.coords);
        } else {
            comm.broadcast_f32(0, store.flat_mut())
                .map_err(|source| TrainError::Comm { rank, source })?;
        }
        let grads = match &mp {
            Some(m) => ParamStore::zeros(&mp::local_specs(&config.model, &m.layout, m.coords)),
            None => ParamStore::zeros(&specs),
        };
        let aux = Aux::new(&config.model, config.model.context, &device);
        let aux_eval = Aux::new(&config.model, config.model.context, &device);
        Ok(Self {
            data_rng: Rng::new(config.seed, STREAM_DATA),
            config,
            device,
            corpus,
            store,
            grads,
            optimizer,
            comm,
            step: 0,
            tokens_seen: 0,
            history: Vec::new(),
            optim: OptimizerSummary::default(),
            aux,
            aux_eval,
            mp,
        })
    }

    /// Continues from a checkpoint. `config` may change the run length, evaluation and output
    /// settings; the model must be the checkpoint's. The optimizer is restored from the
    /// checkpoint's state bytes.
    pub fn resume(
        config: TrainConfig,
        checkpoint: Checkpoint,
        corpus: Corpus,
        optimizer: Box<dyn Optimizer>,
        comm: Box<dyn Communicator>,
        device: B::Device,
    ) -> Result<Self, TrainError> {
        let saved = &checkpoint.meta.config;
        let splits = |c: &TrainConfig| c.parallel.is_some_and(|p| p.splits_model());
        // A model-parallel checkpoint holds the whole model's weights but one optimizer state
        // per rank, which fits only the layout that wrote it.
        if (splits(&config) || splits(saved)) && saved.parallel != config.parallel {
            return Err(TrainError::Resume(
                "the configuration's [parallel] layout differs from the checkpoint's; a \
                 tensor-, pipeline- or expert-parallel run resumes with the same layout"
                    .into(),
            ));
        }
        if saved.model != config.model {
            return Err(TrainError::Resume(
                "the configuration's [model] differs from the checkpoint's".into(),
            ));
        }
        if saved.batch_size != config.batch_size
            || saved.seed != config.seed
            || saved.data != config.data
        {
            return Err(TrainError::Resume(
                "batch_size, seed and [data] must match the checkpoint's for an exact resume"
                    .into(),
            ));
        }
        if checkpoint.meta.step > config.steps {
            return Err(TrainError::Resume(format!(
                "the checkpoint is at step {}, past the configured {} steps",
                checkpoint.meta.step, config.steps
            )));
        }
        let mut t = Self::new(config, corpus, optimizer, comm, device)?;
        if t.mp.is_some() {
            t.restore_model_parallel(&checkpoint)?;
        } else {
            t.restore_whole(&checkpoint)?;
        }
        t.data_rng = Rng::from_state(checkpoint.meta.data_rng);
        t.step = checkpoint.meta.step;
        t.tokens_seen = checkpoint.meta.tokens_seen;
        t.history = checkpoint.meta.history;
        t.optim = checkpoint.meta.optimizer;
        Ok(t)
    }

    /// Whether the checkpoint's parameter names and shapes are `store`'s.
    fn layout_matches(checkpoint: &Checkpoint, store: &ParamStore) -> bool {
        checkpoint.meta.param_names == store.names()
            && checkpoint.meta.param_shapes.len() == store.len()
            && checkpoint
                .meta
                .param_shapes
                .iter()
                .enumerate()
                .all(|(i, s)| s == store.shape(i))
            && checkpoint.values.len() == store.numel()
    }

    /// Weights and optimizer state of a checkpoint of the whole model on every rank.
    fn restore_whole(&mut self, checkpoint: &Checkpoint) -> Result<(), TrainError> {
        if !Self::layout_matches(checkpoint, &self.store) {
            return Err(TrainError::Resume(
                "the checkpoint's parameters do not match the model".into(),
            ));
        }
        self.store.flat_mut().copy_from_slice(&checkpoint.values);
        self.optimizer.load_state(&checkpoint.optimizer)?;
        Ok(())
    }

    /// A model-parallel checkpoint: this rank's shard of its full weights, and its own
    /// optimizer state out of the one per rank.
    fn restore_model_parallel(&mut self, checkpoint: &Checkpoint) -> Result<(), TrainError> {
        let Some(m) = self.mp.as_ref() else {
            return self.restore_whole(checkpoint);
        };
        let mut full = ParamStore::zeros(&param_specs(&self.config.model));
        if !Self::layout_matches(checkpoint, &full) {
            return Err(TrainError::Resume(
                "the checkpoint's parameters do not match the model".into(),
            ));
        }
        full.flat_mut().copy_from_slice(&checkpoint.values);
        self.store = mp::shard(&full, &self.config.model, &m.layout, m.coords);
        let states = decode_states(&checkpoint.optimizer).ok_or_else(|| {
            TrainError::Resume("the checkpoint's per-rank optimizer states are malformed".into())
        })?;
        let world = m.layout.world_size();
        if states.len() != world {
            return Err(TrainError::Resume(format!(
                "the checkpoint holds optimizer states of {} ranks, the run has {world}",
                states.len()
            )));
        }
        self.optimizer.load_state(&states[m.rank])?;
        Ok(())
    }

    /// The run's checkpoint on rank 0 (`None` on the others), collectively: with model
    /// parallelism every rank must call it, the shards are put together into the whole
    /// model's weights and every rank's optimizer state is kept, by rank.
    pub fn gather_checkpoint(&mut self) -> Result<Option<Checkpoint>, TrainError> {
        if self.mp.is_none() {
            return Ok((self.comm.rank() == 0).then(|| self.checkpoint()));
        }
        let full = self.gather_params()?;
        let rank = self.comm.rank();
        let states = self
            .comm
            .all_gather_bytes(&self.optimizer.save_state())
            .map_err(|source| TrainError::Comm { rank, source })?;
        if rank != 0 {
            return Ok(None);
        }
        let mut c = self.checkpoint();
        c.meta.param_names = full.names().to_vec();
        c.meta.param_shapes = (0..full.len()).map(|i| full.shape(i).to_vec()).collect();
        c.values = full.flat().to_vec();
        c.optimizer = encode_states(&states);
        Ok(Some(c))
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Updates completed so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// This rank's parameters: the whole model with pure data parallelism, this rank's shard
    /// with tensor, pipeline or expert parallelism (see [`Self::gather_params`]).
    pub fn params(&self) -> &ParamStore {
        &self.store
    }

    pub fn history(&self) -> &[StepMetrics] {
        &self.history
    }

    pub fn tokens_seen(&self) -> u64 {
        self.tokens_seen
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// What the optimizer did in this run (a resumed run's steps before the resume included).
    pub fn optimizer_summary(&self) -> OptimizerSummary {
        self.optim
    }

    fn comm_err(&self, source: CommError) -> TrainError {
        TrainError::Comm {
            rank: self.comm.rank(),
            source,
        }
    }

    fn int_tensor<BB: burn::tensor::backend::Backend>(
        data: Vec<i64>,
        shape: [usize; 2],
        device: &BB::Device,
    ) -> Tensor<BB, 2, Int> {
        Tensor::from_data(TensorData::new(data, shape), device)
    }

    /// One optimizer update: sample the global batch, run this rank's share forward and
    /// backward, average gradients over ranks, clip, step, and evaluate when it is due.
    pub fn step(&mut self, clock: &dyn Clock) -> Result<StepMetrics, TrainError> {
        let t0 = clock.now_seconds();
        let cfg = &self.config;
        let ctx = cfg.model.context;
        let world = self.comm.world_size();
        let rank = self.comm.rank();
        let local = cfg.batch_size / world;
        let lr = lr_at(
            self.step,
            cfg.steps,
            cfg.warmup_steps,
            cfg.lr,
            cfg.min_lr_ratio,
        );

        // Every rank draws the whole global batch from the same RNG and keeps its slice, so
        // the data do not depend on the number of ranks.
        let starts = random_starts(
            &mut self.data_rng,
            self.corpus.train.len(),
            ctx,
            cfg.batch_size,
        );
        if self.mp.is_some() {
            return self.finish_step(clock, t0, lr, &starts);
        }
        let batch = Batch::from_starts(
            &self.corpus.train,
            &starts[rank * local..(rank + 1) * local],
            ctx,
        );
        let model = Gpt::<B>::build(&cfg.model, &self.store, &self.device, true)?;
        let inputs = Self::int_tensor::<B>(batch.inputs, [local, ctx], &self.device);
        let targets = Self::int_tensor::<B>(batch.targets, [local, ctx], &self.device);
        let loss = model.loss(&cfg.model, inputs, targets, &self.aux);
        let mut loss_value = scalar(loss.clone().inner())?;
        let grads = loss.backward();
        collect_grads::<B, _>(&model, &grads, &mut self.grads).map_err(TrainError::Backend)?;
        drop(model);

        if world > 1 {
            // Each rank's loss is a mean over its equal share, so the mean over ranks is the
            // mean over the global batch.
            let inv = 1.0 / world as f32;
            let mut l = [loss_value];
            self.comm
                .all_reduce_sum_f32(&mut l)
                .map_err(|e| self.comm_err(e))?;
            loss_value = l[0] * inv;
            let mut g = std::mem::replace(&mut self.grads, ParamStore::zeros(&[]));
            let r = self.comm.all_reduce_sum_f32(g.flat_mut());
            for x in g.flat_mut() {
                *x *= inv;
            }
            self.grads = g;
            r.map_err(|e| self.comm_err(e))?;
        }
        if !loss_value.is_finite() {
            return Err(TrainError::NonFinite {
                step: self.step + 1,
                loss: loss_value,
            });
        }

        // Global norm in f64, summed in store order: deterministic and rank-independent.
        let norm = self
            .grads
            .flat()
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt();
        self.apply_update(clock, t0, lr, loss_value, norm)
    }

    /// The model-parallel step after the batch is drawn: this rank's replica's micro-batches
    /// through [`mp::train_step`], then the update.
    fn finish_step(
        &mut self,
        clock: &dyn Clock,
        t0: f64,
        lr: f64,
        starts: &[usize],
    ) -> Result<StepMetrics, TrainError> {
        let Some(mpar) = self.mp.as_ref() else {
            return Err(TrainError::Backend("not a model-parallel run".into()));
        };
        let ctx = self.config.model.context;
        let (dp, m) = (mpar.layout.dp, mpar.layout.micro_batches);
        let local = self.config.batch_size / dp;
        let mine = &starts[mpar.coords.dp * local..(mpar.coords.dp + 1) * local];
        let micro: Vec<MicroBatch> = mine
            .chunks(local / m)
            .map(|c| Batch::from_starts(&self.corpus.train, c, ctx).into())
            .collect();
        let out = mp::train_step::<B>(
            mpar,
            &self.config.model,
            &self.store,
            &mut self.grads,
            self.comm.as_mut(),
            &self.device,
            &self.aux,
            &micro,
        )?;
        if !out.loss.is_finite() {
            return Err(TrainError::NonFinite {
                step: self.step + 1,
                loss: out.loss,
            });
        }
        self.apply_update(clock, t0, lr, out.loss, out.grad_norm)
    }

    /// Clips the gradients to the global norm `norm`, steps the optimizer, and evaluates when
    /// it is due.
    fn apply_update(
        &mut self,
        clock: &dyn Clock,
        t0: f64,
        lr: f64,
        loss_value: f32,
        norm: f64,
    ) -> Result<StepMetrics, TrainError> {
        let ctx = self.config.model.context;
        let clip = self.config.grad_clip;
        if clip > 0.0 && norm > clip {
            let scale = (clip / (norm + 1e-6)) as f32;
            for g in self.grads.flat_mut() {
                *g *= scale;
            }
        }
        let grads = &self.grads;
        let optimizer = &mut self.optimizer;
        // The optimizer gets the communicator too, so that it can share preconditioner
        // refreshes across the ranks; optimizers that do not split anything ignore it.
        let report = if self.mp.is_some() {
            // Ranks of a model-parallel run hold different parameters, so a split refresh
            // over all of them would mix shards; each rank refreshes its own.
            self.store.with_optim_params(grads, |params| {
                optimizer.step_shared(lr as f32, params, &mut SoloGroup)
            })?
        } else {
            let mut group = CommGroup(self.comm.as_mut());
            self.store.with_optim_params(grads, |params| {
                optimizer.step_shared(lr as f32, params, &mut group)
            })?
        };
        self.optim.record(&report, self.optimizer.state_usage());
        let t1 = clock.now_seconds();

        self.step += 1;
        let tokens = (self.config.batch_size * ctx) as u64;
        self.tokens_seen += tokens;
        let eval_every = self.config.eval_every;
        let val_loss = if eval_every > 0
            && (self.step.is_multiple_of(eval_every) || self.step == self.config.steps)
        {
            Some(self.evaluate()?)
        } else {
            None
        };
        let step_seconds = t1 - t0;
        let metrics = StepMetrics {
            step: self.step,
            loss: loss_value,
            val_loss,
            lr,
            grad_norm: norm as f32,
            tokens_per_s: if step_seconds > 0.0 {
                tokens as f64 / step_seconds
            } else {
                0.0
            },
            step_seconds,
            optimizer_wait_s: report.wait_seconds,
        };
        self.history.push(metrics.clone());
        Ok(metrics)
    }

    /// Mean loss over the fixed validation windows (`eval_batches * batch_size` of them,
    /// evenly spaced), split across ranks.
    pub fn evaluate(&mut self) -> Result<f32, TrainError> {
        if self.mp.is_some() {
            return self.evaluate_model_parallel();
        }
        let cfg = &self.config;
        let ctx = cfg.model.context;
        let world = self.comm.world_size();
        let rank = self.comm.rank();
        let n = cfg.eval_batches.max(1) * cfg.batch_size;
        let starts = even_starts(self.corpus.val.len(), ctx, n);
        let mine = &starts[rank * n / world..(rank + 1) * n / world];
        let chunk = (cfg.batch_size / world).max(1);
        let model = Gpt::<B::InnerBackend>::build(&cfg.model, &self.store, &self.device, false)?;
        let mut sums = [0.0f32, 0.0f32];
        for part in mine.chunks(chunk) {
            let b = Batch::from_starts(&self.corpus.val, part, ctx);
            let inputs =
                Self::int_tensor::<B::InnerBackend>(b.inputs, [part.len(), ctx], &self.device);
            let targets =
                Self::int_tensor::<B::InnerBackend>(b.targets, [part.len(), ctx], &self.device);
            let l = scalar(model.loss(&cfg.model, inputs, targets, &self.aux_eval))?;
            sums[0] += l * part.len() as f32;
            sums[1] += part.len() as f32;
        }
        self.comm
            .all_reduce_sum_f32(&mut sums)
            .map_err(|e| self.comm_err(e))?;
        Ok(sums[0] / sums[1].max(1.0))
    }

    /// [`Self::evaluate`] through the pipeline: each data-parallel replica takes its share of
    /// the windows, batch by batch, and the last stage's first tensor-parallel rank counts the
    /// losses.
    fn evaluate_model_parallel(&mut self) -> Result<f32, TrainError> {
        let Some(mpar) = self.mp.as_ref() else {
            return Err(TrainError::Backend("not a model-parallel run".into()));
        };
        let cfg = &self.config;
        let ctx = cfg.model.context;
        let dp = mpar.layout.dp;
        let n = cfg.eval_batches.max(1) * cfg.batch_size;
        let starts = even_starts(self.corpus.val.len(), ctx, n);
        let d = mpar.coords.dp;
        let mine = &starts[d * n / dp..(d + 1) * n / dp];
        let chunk = (cfg.batch_size / dp).max(1);
        let counts = mpar.is_last_stage() && mpar.coords.tp == 0;
        let mut sums = [0.0f32, 0.0f32];
        for part in mine.chunks(chunk) {
            let b: MicroBatch = Batch::from_starts(&self.corpus.val, part, ctx).into();
            let loss = mp::eval_forward::<B>(
                mpar,
                &cfg.model,
                &self.store,
                self.comm.as_mut(),
                &self.device,
                &self.aux,
                &b,
            )?;
            if let (true, Some(l)) = (counts, loss) {
                sums[0] += l * part.len() as f32;
                sums[1] += part.len() as f32;
            }
        }
        let rank = mpar.rank;
        self.comm
            .all_reduce_sum_f32(&mut sums)
            .map_err(|source| TrainError::Comm { rank, source })?;
        Ok(sums[0] / sums[1].max(1.0))
    }

    /// The full model's parameters on every rank: with tensor or pipeline parallelism the
    /// shards of all ranks put together (a collective: every rank must call it), otherwise a
    /// copy of this rank's store.
    pub fn gather_params(&mut self) -> Result<ParamStore, TrainError> {
        let Some(mpar) = self.mp.as_ref() else {
            return Ok(self.store.clone());
        };
        let bytes: Vec<u8> = self
            .store
            .flat()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let rank = mpar.rank;
        let all = self
            .comm
            .all_gather_bytes(&bytes)
            .map_err(|source| TrainError::Comm { rank, source })?;
        let locals: Vec<Vec<f32>> = all
            .iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect();
        Ok(mp::assemble(&self.config.model, &mpar.layout, &locals))
    }

    /// This rank's place in a tensor- or pipeline-parallel run (`None` for pure data
    /// parallelism).
    pub fn model_parallel(&self) -> Option<&ModelParallel> {
        self.mp.as_ref()
    }

    /// The full training state. With tensor, pipeline or expert parallelism it holds only this
    /// rank's shard and optimizer state: use [`Self::gather_checkpoint`] (what [`Self::run`]
    /// writes) for a checkpoint that resumes.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            meta: CheckpointMeta {
                step: self.step,
                config: self.config.clone(),
                data_rng: self.data_rng.state(),
                world_size: self.comm.world_size(),
                tokens_seen: self.tokens_seen,
                param_names: self.store.names().to_vec(),
                param_shapes: (0..self.store.len())
                    .map(|i| self.store.shape(i).to_vec())
                    .collect(),
                history: self.history.clone(),
                optimizer: self.optim,
            },
            values: self.store.flat().to_vec(),
            optimizer: self.optimizer.save_state(),
        }
    }

    /// Runs until `config.steps`, reporting to `observer` and, on rank 0 with `out_dir` set,
    /// writing metrics, checkpoints and the loss curve.
    pub fn run(
        &mut self,
        clock: &dyn Clock,
        observer: &mut dyn TrainObserver,
    ) -> Result<TrainSummary, TrainError> {
        let out_dir = if self.rank() == 0 {
            self.config.out_dir.clone()
        } else {
            None
        };
        let mut metrics_file = match &out_dir {
            Some(dir) => Some(self.open_metrics(dir)?),
            None => None,
        };
        while self.step < self.config.steps {
            let m = self.step(clock)?;
            observer.on_step(&m);
            if let (Some(dir), Some(f)) = (&out_dir, metrics_file.as_mut()) {
                let path = dir.join(METRICS_FILE);
                writeln!(f, "{}", m.to_json_line())
                    .and_then(|()| f.flush())
                    .map_err(|source| TrainError::Output { path, source })?;
            }
            let every = self.config.checkpoint_every;
            let due =
                (every > 0 && self.step.is_multiple_of(every)) || self.step == self.config.steps;
            // Every rank decides alike: a model-parallel checkpoint is a collective.
            if let (true, Some(dir)) = (due, self.config.out_dir.clone()) {
                if self.mp.is_some() || out_dir.is_some() {
                    if let Some(c) = self.gather_checkpoint()? {
                        let path = dir.join(CHECKPOINT_FILE);
                        c.save(&path)?;
                        observer.on_checkpoint(self.step, &path);
                    }
                }
            }
        }
        if let Some(dir) = &out_dir {
            let path = dir.join(LOSS_PLOT_FILE);
            crate::checkpoint::write_atomic(&path, loss_curve_svg(&self.history).as_bytes())?;
        }
        Ok(self.summary())
    }

    /// Rewrites the metrics file with the history so far (non-empty after a resume) and
    /// returns it open for appending.
    fn open_metrics(&self, dir: &Path) -> Result<std::fs::File, TrainError> {
        let path = dir.join(METRICS_FILE);
        let io = |source| TrainError::Output {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut f = std::fs::File::create(&path).map_err(io)?;
        for m in &self.history {
            writeln!(f, "{}", m.to_json_line()).map_err(io)?;
        }
        Ok(f)
    }

    pub fn summary(&self) -> TrainSummary {
        TrainSummary {
            steps: self.step,
            final_loss: self.history.last().map(|m| m.loss),
            final_val_loss: self.history.iter().rev().find_map(|m| m.val_loss),
            tokens_seen: self.tokens_seen,
            num_params: match &self.mp {
                // The whole model's, not this rank's shard.
                Some(_) => param_specs(&self.config.model)
                    .iter()
                    .map(|s| s.shape.iter().product::<usize>())
                    .sum(),
                None => self.store.numel(),
            },
            history: self.history.clone(),
            optimizer: self.optim,
        }
    }
}

/// Every rank's optimizer state in one byte string: the count, then each state's length and
/// bytes (little-endian `u64`s).
fn encode_states(states: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(states.len() as u64).to_le_bytes());
    for s in states {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s);
    }
    out
}

/// The states [`encode_states`] wrote, or `None` when the bytes are not such a string.
fn decode_states(bytes: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut at = 0usize;
    let take_u64 = |at: &mut usize| -> Option<usize> {
        let b: [u8; 8] = bytes.get(*at..*at + 8)?.try_into().ok()?;
        *at += 8;
        usize::try_from(u64::from_le_bytes(b)).ok()
    };
    let n = take_u64(&mut at)?;
    let mut out = Vec::new();
    for _ in 0..n {
        let len = take_u64(&mut at)?;
        out.push(bytes.get(at..at.checked_add(len)?)?.to_vec());
        at += len;
    }
    (at == bytes.len()).then_some(out)
}

/// The trainer's communicator as the optimizer's [`RankGroup`].
struct CommGroup<'a>(&'a mut dyn Communicator);

impl RankGroup for CommGroup<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let rank = self.0.rank();
        self.0
            .all_gather_bytes(mine)
            .map_err(|e| format!("rank {rank}: {e}"))
    }
}

/// A group of one, for optimizers of model-parallel ranks.
struct SoloGroup;

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

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    pub steps: u64,
    pub final_loss: Option<f32>,
    pub final_val_loss: Option<f32>,
    pub tokens_seen: u64,
    /// Parameters of the whole model (with model parallelism too, not one rank's shard).
    pub num_params: usize,
    pub history: Vec<StepMetrics>,
    /// What the optimizer did over the whole run (carried across a resume by the checkpoint).
    pub optimizer: OptimizerSummary,
}

/// The optimizer's side of a run, from what [`Optimizer::step_shared`] reports and
/// [`Optimizer::state_usage`] measures after every step, saved in checkpoints so that a
/// resumed run reports the whole run (k steps + resume + N − k steps report what N steps do,
/// up to the wall-clock wait). Counts are the same on every rank of a data-parallel run; so
/// are the state bytes, except that tiered state spills by each rank's own budgets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSummary {
    /// The most optimizer state seen after a step on the device, in host memory and on disk,
    /// in bytes, each tier's largest on its own (they need not occur at the same step).
    pub peak_device_bytes: u64,
    pub peak_host_bytes: u64,
    pub peak_disk_bytes: u64,
    /// Periodic preconditioner refreshes that fell due ([`StepReport::refreshes`]): SOAP's
    /// bases, one per rotated matrix; Shampoo's inverse roots, one per block. 0 for AdamW and
    /// SGD.
    pub refreshes: u64,
    /// Seconds steps waited for asynchronous refreshes (the optimizer's own wall-clock reading,
    /// so it is not reproducible even with a fixed [`Clock`]).
    pub refresh_wait_seconds: f64,
    /// Split refreshes: refreshed preconditioners their owners sent to every rank.
    pub bases_sent: u64,
    /// Split refreshes: refreshes whose owner kept the preconditioner in use.
    pub bases_kept: u64,
}

impl OptimizerSummary {
    /// Adds one step's report and the state measured after it.
    fn record(&mut self, report: &StepReport, usage: orrery_optim::TierUsage) {
        self.peak_device_bytes = self.peak_device_bytes.max(usage.device_bytes);
        self.peak_host_bytes = self.peak_host_bytes.max(usage.host_bytes);
        self.peak_disk_bytes = self.peak_disk_bytes.max(usage.disk_bytes);
        self.refreshes += report.refreshes;
        self.refresh_wait_seconds += report.wait_seconds;
        self.bases_sent += report.bases_sent;
        self.bases_kept += report.bases_kept;
    }
}
