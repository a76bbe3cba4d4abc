#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, tiny};
use orrery_train::{
    load_corpus, make_optimizer, CpuBackend, FixedClock, NullObserver, SingleRank, ThreadComm,
    TrainConfig, TrainSummary, Trainer,
};

/// Runs `config` on `world` in-process ranks; returns every rank's summary and final weights.
fn run_dp(config: &TrainConfig, world: usize) -> Vec<(TrainSummary, Vec<f32>)> {
    let corpus = load_corpus(config).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(world)
            .into_iter()
            .map(|comm| {
                let corpus = corpus.clone();
                s.spawn(move || {
                    let mut t = Trainer::<CpuBackend>::new(
                        config.clone(),
                        corpus,
                        make_optimizer(config).unwrap(),
                        Box::new(comm),
                        Default::default(),
                    )
                    .unwrap();
                    let s = t.run(&FixedClock, &mut NullObserver).unwrap();
                    (s, t.params().flat().to_vec())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn run_single(config: &TrainConfig) -> (TrainSummary, Vec<f32>) {
    let mut t = Trainer::<CpuBackend>::new(
        config.clone(),
        load_corpus(config).unwrap(),
        make_optimizer(config).unwrap(),
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap();
    let s = t.run(&FixedClock, &mut NullObserver).unwrap();
    (s, t.params().flat().to_vec())
}

/// 2 ranks with 4 sequences each train like 1 rank with 8: the same global batch, gradients
/// averaged by the all-reduce. Float sums are associated differently, so equality is within a
/// tolerance; the ranks themselves agree bit for bit.
#[test]
fn two_ranks_equal_one_rank_with_twice_the_batch() {
    let mut config = tiny();
    config.steps = 8;
    config.eval_every = 4;
    config.batch_size = 8;
    let (single, w1) = run_single(&config);
    let ranks = run_dp(&config, 2);
    assert_eq!(ranks.len(), 2);
    assert_eq!(ranks[0].0, ranks[1].0, "both ranks report the same run");
    assert_eq!(
        bits(&ranks[0].1),
        bits(&ranks[1].1),
        "ranks hold identical weights"
    );
    let (dp, w2) = &ranks[0];
    for (a, b) in single.history.iter().zip(&dp.history) {
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
    let max_diff = w1
        .iter()
        .zip(w2)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max_diff < 1e-4, "largest weight difference {max_diff}");
}

#[test]
fn data_parallel_is_deterministic() {
    let mut config = tiny();
    config.steps = 3;
    config.eval_every = 0;
    let a = run_dp(&config, 2);
    let b = run_dp(&config, 2);
    assert_eq!(a[0].0, b[0].0);
    assert_eq!(bits(&a[0].1), bits(&b[0].1));
}

#[test]
fn train_with_threads_matches_manual_ranks() {
    let mut config = tiny();
    config.steps = 3;
    config.eval_every = 0;
    let options = orrery_train::RunOptions {
        ranks: 2,
        clock: std::sync::Arc::new(FixedClock),
        ..Default::default()
    };
    struct Count(u64);
    impl orrery_train::TrainObserver for Count {
        fn on_step(&mut self, m: &orrery_train::StepMetrics) {
            self.0 = m.step;
        }
    }
    let mut count = Count(0);
    let s = orrery_train::train_with(&config, &options, &mut count).unwrap();
    assert_eq!(count.0, 3, "rank 0's steps reach the caller's observer");
    assert_eq!(s, run_dp(&config, 2)[0].0);
    config.batch_size = 7;
    assert!(matches!(
        orrery_train::train_with(&config, &options, &mut NullObserver),
        Err(orrery_train::TrainError::BatchNotDivisible { batch: 7, world: 2 })
    ));
}
