//! Tensor, pipeline and hybrid parallelism over threads give the single-rank model's losses and
//! weights, within float tolerance: the same global batch, the same initial weights (every rank
//! cuts its shard from the seed's full model), and only the association of sums differs (the
//! tensor-parallel partial sums, the micro-batch accumulation, the gradient norm).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use orrery_train::{
    load_corpus, make_optimizer, train_with, Checkpoint, CommError, Communicator, CpuBackend,
    FixedClock, MlpKind, MoeConfig, NormKind, NullObserver, ParallelConfig, PositionKind,
    RunOptions, SingleRank, ThreadComm, TrainConfig, TrainError, Trainer, CHECKPOINT_FILE,
};

/// Relative tolerance of the per-step training and validation losses.
const LOSS_RTOL: f32 = 1e-5;
/// Absolute tolerance of the weights after 3 AdamW steps at learning rate 1e-2: 0.5% of one
/// step. AdamW divides each gradient by its own running magnitude, so a gradient element that
/// is tiny in both runs can move by a visible fraction of the step on float noise alone; the
/// largest difference measured is 1.7e-5 (interleaved, two stages, two micro-batches).
const ADAMW_WEIGHT_ATOL: f32 = 5e-5;
/// The same with plain gradient descent, where a weight's difference is the learning rate
/// times its gradient's.
const SGD_WEIGHT_ATOL: f32 = 1e-7;

fn config() -> TrainConfig {
    let mut c = common::mp_config(1, 1, 1, 1);
    c.parallel = None;
    c
}

fn par(tp: usize, pp: usize, dp: usize, micro_batches: usize) -> Option<ParallelConfig> {
    common::mp_config(tp, pp, dp, micro_batches).parallel
}

/// [`par`] with `virtual_stages` model chunks per pipeline rank (interleaved 1F1B).
fn interleaved(
    tp: usize,
    pp: usize,
    dp: usize,
    micro_batches: usize,
    virtual_stages: usize,
) -> Option<ParallelConfig> {
    par(tp, pp, dp, micro_batches).map(|p| ParallelConfig {
        virtual_stages,
        ..p
    })
}

/// [`par`] with Megatron's sequence parallelism over the tensor-parallel group.
fn sequence_parallel(
    tp: usize,
    pp: usize,
    dp: usize,
    micro_batches: usize,
) -> Option<ParallelConfig> {
    par(tp, pp, dp, micro_batches).map(|p| ParallelConfig {
        sequence_parallel: true,
        ..p
    })
}

struct Run {
    losses: Vec<f32>,
    val: Vec<Option<f32>>,
    norms: Vec<f32>,
    weights: Vec<f32>,
}

fn single(config: &TrainConfig) -> Run {
    let mut c = config.clone();
    c.parallel = None;
    let mut t = Trainer::<CpuBackend>::new(
        c.clone(),
        load_corpus(&c).unwrap(),
        make_optimizer(&c).unwrap(),
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap();
    for _ in 0..c.steps {
        t.step(&FixedClock).unwrap();
    }
    Run {
        losses: t.history().iter().map(|m| m.loss).collect(),
        val: t.history().iter().map(|m| m.val_loss).collect(),
        norms: t.history().iter().map(|m| m.grad_norm).collect(),
        weights: t.params().flat().to_vec(),
    }
}

/// Every rank's run; `weights` are the gathered full model.
fn parallel(config: &TrainConfig) -> Vec<Run> {
    common::run_model_parallel_threads(config)
        .into_iter()
        .map(|(history, weights)| Run {
            losses: history.iter().map(|m| m.loss).collect(),
            val: history.iter().map(|m| m.val_loss).collect(),
            norms: history.iter().map(|m| m.grad_norm).collect(),
            weights,
        })
        .collect()
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// Checks every rank of `config`'s parallel run against the single-rank run and prints the
/// largest differences.
fn check(name: &str, config: &TrainConfig) {
    let atol = if config.optimizer.name == "sgd" {
        SGD_WEIGHT_ATOL
    } else {
        ADAMW_WEIGHT_ATOL
    };
    let reference = single(config);
    let runs = parallel(config);
    let (mut loss_diff, mut norm_diff, mut weight_diff) = (0.0f32, 0.0f32, 0.0f32);
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(run.losses.len(), reference.losses.len());
        for (step, (a, b)) in run.losses.iter().zip(&reference.losses).enumerate() {
            assert!(
                rel(*a, *b) <= LOSS_RTOL,
                "{name} rank {rank} step {step}: loss {a} vs {b}"
            );
            loss_diff = loss_diff.max(rel(*a, *b));
        }
        for (a, b) in run.val.iter().zip(&reference.val) {
            match (a, b) {
                (Some(a), Some(b)) => {
                    assert!(
                        rel(*a, *b) <= LOSS_RTOL,
                        "{name} rank {rank}: val {a} vs {b}"
                    );
                    loss_diff = loss_diff.max(rel(*a, *b));
                }
                (None, None) => {}
                other => panic!("{name} rank {rank}: evaluation differs {other:?}"),
            }
        }
        for (a, b) in run.norms.iter().zip(&reference.norms) {
            norm_diff = norm_diff.max(rel(*a, *b));
        }
        assert_eq!(run.weights.len(), reference.weights.len());
        for (i, (a, b)) in run.weights.iter().zip(&reference.weights).enumerate() {
            assert!(
                (a - b).abs() <= atol,
                "{name} rank {rank} weight {i}: {a} vs {b}"
            );
            weight_diff = weight_diff.max((a - b).abs());
        }
        // Replicas agree with each other exactly: the same bits on every rank.
        assert_eq!(run.losses, runs[0].losses, "{name} rank {rank}");
        assert_eq!(run.weights, runs[0].weights, "{name} rank {rank}");
    }
    eprintln!(
        "{name}: max loss rel diff {loss_diff:e}, grad-norm rel diff {norm_diff:e}, \
         weight abs diff {weight_diff:e}"
    );
}

#[test]
fn tensor_parallel_matches_single_rank() {
    let mut c = config();
    c.parallel = par(2, 1, 1, 1);
    check("tp2", &c);
}

#[test]
fn pipeline_parallel_1f1b_matches_single_rank() {
    let mut c = config();
    // Four micro-batches over two stages: warm-up, steady 1F1B and cool-down all run.
    c.parallel = par(1, 2, 1, 4);
    check("pp2 m4", &c);
}

#[test]
fn tensor_and_pipeline_parallel_match_single_rank() {
    let mut c = config();
    c.parallel = par(2, 2, 1, 2);
    check("tp2 pp2 m2", &c);
}

#[test]
fn tensor_pipeline_and_data_parallel_match_single_rank() {
    let mut c = config();
    c.parallel = par(2, 2, 2, 2);
    check("tp2 pp2 dp2 m2", &c);
}

/// The other model variants: SwiGLU (a second column-parallel matrix), RMSNorm, learned
/// positions (on the first stage only) and an untied head (on the last stage only), with
/// four stages of one layer each.
#[test]
fn variants_match_single_rank() {
    let mut c = config();
    c.model.mlp = MlpKind::SwiGlu;
    c.model.norm = NormKind::RmsNorm;
    c.model.positions = PositionKind::Learned;
    c.model.tie_embeddings = false;
    c.parallel = par(2, 4, 1, 4);
    check("swiglu rmsnorm learned untied tp2 pp4 m4", &c);
}

/// Interleaved 1F1B with two chunks per stage (4 chunks of one layer): with as many
/// micro-batches as stages every forward runs before the first backward; with twice as many
/// the schedule alternates.
#[test]
fn interleaved_1f1b_matches_single_rank() {
    let mut c = config();
    c.parallel = interleaved(1, 2, 1, 2, 2);
    check("pp2 v2 m2", &c);
    c.parallel = interleaved(1, 2, 1, 4, 2);
    check("pp2 v2 m4", &c);
}

/// Interleaving with tensor and data parallelism, and a tied embedding whose two copies are
/// on the first and the last stage.
#[test]
fn interleaved_hybrid_matches_single_rank() {
    let mut c = config();
    c.parallel = interleaved(2, 2, 2, 4, 2);
    check("tp2 pp2 dp2 v2 m4", &c);
}

/// A mixture of 4 experts (top 2) in every block, the experts split over 2 expert-parallel
/// ranks: tokens go to the rank holding their experts and back through the group all-to-all.
#[test]
fn expert_parallel_matches_single_rank() {
    let mut c = config();
    c.model.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
    });
    c.parallel = par(1, 1, 2, 1).map(|p| ParallelConfig { ep: 2, ..p });
    check("moe e4 k2 dp2 ep2", &c);
}

/// Experts with tensor, pipeline, data and expert parallelism at once (8 ranks), the experts
/// themselves cut across the tensor-parallel group.
#[test]
fn expert_parallel_hybrid_matches_single_rank() {
    let mut c = config();
    c.model.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
    });
    c.model.mlp = MlpKind::SwiGlu;
    c.parallel = par(2, 2, 2, 2).map(|p| ParallelConfig { ep: 2, ..p });
    check("moe swiglu tp2 pp2 dp2 ep2 m2", &c);
}

/// Sequence parallelism: the norms and residual adds run on half the sequence on each
/// tensor-parallel rank, between an all-gather and a reduce-scatter.
#[test]
fn sequence_parallel_matches_single_rank() {
    let mut c = config();
    c.parallel = sequence_parallel(2, 1, 1, 1);
    check("tp2 sp", &c);
}

/// Sequence parallelism with pipeline stages, which pass each other the slices.
#[test]
fn sequence_parallel_with_pipeline_matches_single_rank() {
    let mut c = config();
    c.parallel = sequence_parallel(2, 2, 1, 2);
    check("tp2 pp2 m2 sp", &c);
}

/// Sequence parallelism with pipeline and data parallelism.
#[test]
fn sequence_parallel_hybrid_matches_single_rank() {
    let mut c = config();
    c.parallel = sequence_parallel(2, 2, 2, 2);
    check("tp2 pp2 dp2 m2 sp", &c);
}

/// Sequence parallelism with the other model variants (learned positions, embedded on the
/// whole sequence and sliced; an untied head on the gathered sequence), with interleaved
/// 1F1B, and with experts, which route the gathered tokens.
#[test]
fn sequence_parallel_variants_match_single_rank() {
    let mut c = config();
    c.model.mlp = MlpKind::SwiGlu;
    c.model.norm = NormKind::RmsNorm;
    c.model.positions = PositionKind::Learned;
    c.model.tie_embeddings = false;
    c.parallel = sequence_parallel(2, 2, 1, 2);
    check("swiglu rmsnorm learned untied tp2 pp2 m2 sp", &c);

    let mut c = config();
    c.parallel = sequence_parallel(2, 2, 1, 2).map(|p| ParallelConfig {
        virtual_stages: 2,
        ..p
    });
    check("tp2 pp2 v2 m2 sp", &c);

    // The experts' configuration of `expert_parallel_hybrid_matches_single_rank`.
    let mut c = config();
    c.model.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
    });
    c.model.mlp = MlpKind::SwiGlu;
    c.parallel = sequence_parallel(2, 2, 2, 2).map(|p| ParallelConfig { ep: 2, ..p });
    check("moe swiglu tp2 pp2 dp2 ep2 m2 sp", &c);
}

/// Sequence parallelism changes where sums are taken, not what is computed: the same losses
/// and weights as plain tensor parallelism within float tolerance.
#[test]
fn sequence_parallel_matches_plain_tensor_parallel() {
    let mut c = config();
    c.parallel = par(2, 2, 1, 2);
    let plain = parallel(&c);
    c.parallel = sequence_parallel(2, 2, 1, 2);
    let sp = parallel(&c);
    let (mut loss_diff, mut weight_diff) = (0.0f32, 0.0f32);
    for (rank, (a, b)) in sp.iter().zip(&plain).enumerate() {
        for (step, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
            assert!(
                rel(*x, *y) <= LOSS_RTOL,
                "rank {rank} step {step}: {x} vs {y}"
            );
            loss_diff = loss_diff.max(rel(*x, *y));
        }
        for (x, y) in a.val.iter().zip(&b.val) {
            match (x, y) {
                (Some(x), Some(y)) => {
                    assert!(rel(*x, *y) <= LOSS_RTOL, "rank {rank}: val {x} vs {y}");
                    loss_diff = loss_diff.max(rel(*x, *y));
                }
                (None, None) => {}
                other => panic!("rank {rank}: evaluation differs {other:?}"),
            }
        }
        assert_eq!(a.weights.len(), b.weights.len());
        for (i, (x, y)) in a.weights.iter().zip(&b.weights).enumerate() {
            assert!(
                (x - y).abs() <= ADAMW_WEIGHT_ATOL,
                "rank {rank} weight {i}: {x} vs {y}"
            );
            weight_diff = weight_diff.max((x - y).abs());
        }
    }
    // Not bit for bit: the sequence-parallel path did run.
    assert_ne!(
        common::bits(&sp[0].weights),
        common::bits(&plain[0].weights)
    );
    eprintln!(
        "tp2 pp2 m2 sp vs plain tp: max loss rel diff {loss_diff:e}, weight abs diff \
         {weight_diff:e}"
    );
}

/// With plain gradient descent the weights agree far more tightly (see [`SGD_WEIGHT_ATOL`]).
#[test]
fn hybrid_parallel_sgd_weights_match_tightly() {
    let mut c = config();
    c.optimizer.name = "sgd".into();
    c.parallel = par(2, 2, 2, 2);
    check("sgd tp2 pp2 dp2 m2", &c);
}

#[test]
fn a_bad_layout_names_the_field() {
    let mut c = config();
    c.parallel = par(3, 1, 1, 1);
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.tp"), "{err}");

    c.parallel = par(2, 3, 1, 1);
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.pp"), "{err}");

    c.parallel = par(1, 1, 1, 3);
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.micro_batches"), "{err}");

    // A valid section that does not describe the run's 2 ranks.
    c.parallel = par(2, 2, 1, 1);
    let corpus = load_corpus(&c).unwrap();
    let mut comms = ThreadComm::group(2);
    let comm = comms.remove(0);
    let r = Trainer::<CpuBackend>::new(
        c.clone(),
        corpus,
        make_optimizer(&c).unwrap(),
        Box::new(comm),
        Default::default(),
    );
    match r {
        Err(TrainError::Config(e)) => assert!(e.mentions("parallel.dp"), "{e}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }

    c.parallel = interleaved(1, 2, 1, 2, 3);
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.virtual_stages"), "{err}");

    // Sequence parallelism needs a tensor-parallel group and a context it cuts evenly.
    c.parallel = sequence_parallel(1, 2, 1, 2);
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.sequence_parallel"), "{err}");
    c.parallel = sequence_parallel(2, 1, 1, 1);
    c.model.context = 15;
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.sequence_parallel"), "{err}");
    c.model.context = 16;

    // Expert parallelism needs experts, and must divide both dp and their number.
    c.parallel = par(1, 1, 2, 1).map(|p| ParallelConfig { ep: 2, ..p });
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.ep"), "{err}");
    c.model.moe = Some(MoeConfig {
        experts: 3,
        top_k: 4,
    });
    c.parallel = par(1, 1, 3, 1).map(|p| ParallelConfig { ep: 2, ..p });
    let err = c.validate().unwrap_err();
    assert!(err.mentions("parallel.ep"), "{err}");
    assert!(err.mentions("model.moe.top_k"), "{err}");
    assert!(err.to_string().contains("2 does not divide dp 3"), "{err}");
    assert!(
        err.to_string()
            .contains("2 does not divide model.moe.experts 3"),
        "{err}"
    );
    c.model.moe = None;

    // Interleaving needs sends that never wait; a communicator whose sends may wait (as
    // MPI's do) is refused before anything is sent.
    c.parallel = interleaved(1, 2, 1, 2, 2);
    let r = Trainer::<CpuBackend>::new(
        c.clone(),
        load_corpus(&c).unwrap(),
        make_optimizer(&c).unwrap(),
        Box::new(WaitingSends),
        Default::default(),
    );
    match r {
        Err(TrainError::Config(e)) => assert!(e.mentions("parallel.virtual_stages"), "{e}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// Rank 0 of 2 whose sends may wait for the receiver; nothing may be called on it.
struct WaitingSends;

impl Communicator for WaitingSends {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_reduce_sum_f32(&mut self, _: &mut [f32]) -> Result<(), CommError> {
        unreachable!()
    }
    fn broadcast_f32(&mut self, _: usize, _: &mut [f32]) -> Result<(), CommError> {
        unreachable!()
    }
    fn broadcast_bytes(&mut self, _: usize, _: &mut Vec<u8>) -> Result<(), CommError> {
        unreachable!()
    }
    fn all_gather_bytes(&mut self, _: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        unreachable!()
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        unreachable!()
    }
    fn send_f32(&mut self, _: usize, _: &[f32]) -> Result<(), CommError> {
        unreachable!()
    }
    fn recv_f32(&mut self, _: usize, _: &mut [f32]) -> Result<(), CommError> {
        unreachable!()
    }
}

/// A `[parallel]` section that only sets `dp` is the plain data-parallel run, bit for bit.
#[test]
fn data_parallel_section_is_plain_data_parallelism() {
    let mut c = config();
    c.parallel = None;
    let plain = common::run_threads(&c, 2);
    c.parallel = par(1, 1, 2, 1);
    let section = common::run_threads(&c, 2);
    assert_eq!(plain[0].0.history, section[0].0.history);
    assert_eq!(common::bits(&plain[0].1), common::bits(&section[0].1));
}

/// A model-parallel run's checkpoint holds the whole model's weights and every rank's
/// optimizer state: 2 steps, a checkpoint, a resume through `train_with` and 2 more steps are
/// the uninterrupted 4-step run bit for bit (losses, final weights, optimizer states). A
/// resume with another layout is refused.
#[test]
fn model_parallel_resume_is_bit_exact() {
    let mut c = common::mp_config(2, 2, 1, 2);
    c.steps = 4;
    c.eval_every = 2;
    let options = RunOptions {
        ranks: 4,
        clock: Arc::new(FixedClock),
        ..RunOptions::default()
    };
    let full_dir = common::temp_dir("mp-resume-full");
    c.out_dir = Some(full_dir.clone());
    let full = train_with(&c, &options, &mut NullObserver).unwrap();

    // The first 2 steps, by hand on 4 threads, and rank 0's gathered checkpoint.
    let part_dir = common::temp_dir("mp-resume-part");
    c.out_dir = Some(part_dir.clone());
    let corpus = load_corpus(&c).unwrap();
    let checkpoints: Vec<Option<Checkpoint>> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(4)
            .into_iter()
            .map(|comm| {
                let (c, corpus) = (&c, corpus.clone());
                s.spawn(move || {
                    let mut t = Trainer::<CpuBackend>::new(
                        c.clone(),
                        corpus,
                        make_optimizer(c).unwrap(),
                        Box::new(comm),
                        Default::default(),
                    )
                    .unwrap();
                    for _ in 0..2 {
                        t.step(&FixedClock).unwrap();
                    }
                    t.gather_checkpoint().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(checkpoints[1..].iter().all(Option::is_none), "rank 0 only");
    let path = part_dir.join("step2.ckpt");
    checkpoints[0].as_ref().unwrap().save(&path).unwrap();

    let resumed = train_with(
        &c,
        &RunOptions {
            resume: Some(path.clone()),
            ..options.clone()
        },
        &mut NullObserver,
    )
    .unwrap();
    assert_eq!(full.history, resumed.history);
    let a = Checkpoint::load(&full_dir.join(CHECKPOINT_FILE)).unwrap();
    let b = Checkpoint::load(&part_dir.join(CHECKPOINT_FILE)).unwrap();
    assert_eq!(a.meta.step, 4);
    assert_eq!(common::bits(&a.values), common::bits(&b.values));
    assert_eq!(a.optimizer, b.optimizer);
    // The checkpoint's weights are the whole model's: the single-rank layout.
    let single_names: Vec<String> = orrery_train::model::param_specs(&c.model)
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(a.meta.param_names, single_names);

    let mut other = c.clone();
    other.parallel = par(2, 1, 2, 2);
    let r = train_with(
        &other,
        &RunOptions {
            resume: Some(path),
            ..options
        },
        &mut NullObserver,
    );
    assert!(matches!(r, Err(TrainError::Resume(_))), "{r:?}");
}
