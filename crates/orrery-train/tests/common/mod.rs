#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use orrery_train::{
    load_corpus, make_optimizer, CpuBackend, FixedClock, ModelConfig, NullObserver, SingleRank,
    StepMetrics, ThreadComm, TrainConfig, TrainSummary, Trainer,
};

/// A model small enough that 30 unoptimised steps take a couple of seconds.
pub fn tiny() -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            context: 16,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            d_ff: 64,
            ..ModelConfig::default()
        },
        steps: 30,
        batch_size: 8,
        lr: 1e-2,
        warmup_steps: 3,
        eval_every: 10,
        eval_batches: 1,
        ..TrainConfig::default()
    }
}

pub fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("orrery-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The run of `two_ranks_equal_one_rank_with_twice_the_batch` and its MPI twin: 8 steps with
/// evaluation every 4, a global batch of 8 (4 per rank on 2 ranks).
pub fn dp_config() -> TrainConfig {
    let mut config = tiny();
    config.steps = 8;
    config.eval_every = 4;
    config.batch_size = 8;
    config
}

/// Runs `config` on one rank; returns the summary and the final weights.
pub fn run_single(config: &TrainConfig) -> (TrainSummary, Vec<f32>) {
    run_single_with(config, make_optimizer(config).unwrap())
}

/// Runs `config` on one rank with `optimizer`; returns the summary and the final weights.
pub fn run_single_with(
    config: &TrainConfig,
    optimizer: Box<dyn orrery_optim::Optimizer>,
) -> (TrainSummary, Vec<f32>) {
    let mut t = Trainer::<CpuBackend>::new(
        config.clone(),
        load_corpus(config).unwrap(),
        optimizer,
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap();
    let s = t.run(&FixedClock, &mut NullObserver).unwrap();
    (s, t.params().flat().to_vec())
}

/// Runs `config` on `world` in-process ranks; returns every rank's summary and final weights.
pub fn run_threads(config: &TrainConfig, world: usize) -> Vec<(TrainSummary, Vec<f32>)> {
    run_threads_with(
        config,
        world,
        || make_optimizer(config).unwrap(),
        |t, s| (s, t.params().flat().to_vec()),
    )
}

/// Runs `config` on `world` in-process ranks, each with the optimizer `make` builds; returns
/// what `finish` takes from each rank's trainer and summary after the run.
pub fn run_threads_with<T: Send>(
    config: &TrainConfig,
    world: usize,
    make: impl Fn() -> Box<dyn orrery_optim::Optimizer> + Sync,
    finish: impl Fn(&Trainer<CpuBackend>, TrainSummary) -> T + Sync,
) -> Vec<T> {
    let corpus = load_corpus(config).unwrap();
    let (make, finish) = (&make, &finish);
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(world)
            .into_iter()
            .map(|comm| {
                let corpus = corpus.clone();
                s.spawn(move || {
                    let mut t = Trainer::<CpuBackend>::new(
                        config.clone(),
                        corpus,
                        make(),
                        Box::new(comm),
                        Default::default(),
                    )
                    .unwrap();
                    let summary = t.run(&FixedClock, &mut NullObserver).unwrap();
                    finish(&t, summary)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A data-parallel run (`history`, final `weights`) trains like the single-rank run with the
/// same global batch. Float sums are associated differently (each rank's mean over its share,
/// then the mean over ranks), so equality is within a tolerance, the same for every backend.
pub fn assert_matches_single(
    single: &(TrainSummary, Vec<f32>),
    history: &[StepMetrics],
    weights: &[f32],
) {
    let (single, w1) = single;
    assert_eq!(single.history.len(), history.len(), "same number of steps");
    for (a, b) in single.history.iter().zip(history) {
        assert!(
            (a.loss - b.loss).abs() < 1e-4,
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
        assert!((a.grad_norm - b.grad_norm).abs() < 1e-3 * a.grad_norm.max(1.0));
        match (a.val_loss, b.val_loss) {
            (Some(x), Some(y)) => assert!((x - y).abs() < 1e-4, "val {x} vs {y}"),
            (None, None) => {}
            other => panic!("evaluation schedule differs: {other:?}"),
        }
    }
    assert_eq!(w1.len(), weights.len(), "same number of weights");
    let max_diff = w1
        .iter()
        .zip(weights)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max_diff < 1e-4, "largest weight difference {max_diff}");
}

/// The model-parallel tests' run (`tests/model_parallel.rs`, and over MPI `tests/mpi.rs`): the
/// tiny model with 4 layers, 3 steps, evaluation after the last, laid out `tp × pp × dp` with
/// `micro_batches` per step and replica.
pub fn mp_config(tp: usize, pp: usize, dp: usize, micro_batches: usize) -> TrainConfig {
    let mut c = tiny();
    c.model.n_layers = 4;
    c.steps = 3;
    c.warmup_steps = 1;
    c.batch_size = 8;
    c.eval_every = 3;
    c.parallel = Some(orrery_train::ParallelConfig {
        tp,
        pp,
        dp,
        micro_batches,
        virtual_stages: 1,
        ep: 1,
        sequence_parallel: false,
    });
    c
}

/// Trains `config` (with a `[parallel]` section) step by step on one trainer built with
/// `comm`; returns its history and the gathered full model's weights.
pub fn run_model_parallel_rank(
    config: &TrainConfig,
    corpus: orrery_train::Corpus,
    comm: Box<dyn orrery_train::Communicator>,
) -> (Vec<StepMetrics>, Vec<f32>) {
    let mut t = Trainer::<CpuBackend>::new(
        config.clone(),
        corpus,
        make_optimizer(config).unwrap(),
        comm,
        Default::default(),
    )
    .unwrap();
    for _ in 0..config.steps {
        t.step(&FixedClock).unwrap();
    }
    let weights = t.gather_params().unwrap().flat().to_vec();
    (t.history().to_vec(), weights)
}

/// [`run_model_parallel_rank`] on every rank of `config`'s layout, over threads.
pub fn run_model_parallel_threads(config: &TrainConfig) -> Vec<(Vec<StepMetrics>, Vec<f32>)> {
    let world = config.parallel.unwrap().world_size();
    let corpus = load_corpus(config).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(world)
            .into_iter()
            .map(|comm| {
                let corpus = corpus.clone();
                s.spawn(move || run_model_parallel_rank(config, corpus, Box::new(comm)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

pub mod mpi_session;
