#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{assert_matches_single, bits, dp_config, run_single, run_threads, temp_dir, tiny};
use orrery_train::{
    load_corpus, make_optimizer, train_with, Checkpoint, CheckpointError, CpuBackend, FixedClock,
    NullObserver, RunOptions, ThreadComm, TrainError, Trainer,
};

/// 2 ranks with 4 sequences each train like 1 rank with 8: the same global batch, gradients
/// averaged by the all-reduce. Float sums are associated differently, so equality is within a
/// tolerance; the ranks themselves agree bit for bit. (tests/mpi.rs checks the same of MPI.)
#[test]
fn two_ranks_equal_one_rank_with_twice_the_batch() {
    let config = dp_config();
    let single = run_single(&config);
    let ranks = run_threads(&config, 2);
    assert_eq!(ranks.len(), 2);
    assert_eq!(ranks[0].0, ranks[1].0, "both ranks report the same run");
    assert_eq!(
        bits(&ranks[0].1),
        bits(&ranks[1].1),
        "ranks hold identical weights"
    );
    assert_matches_single(&single, &ranks[0].0.history, &ranks[0].1);
}

#[test]
fn data_parallel_is_deterministic() {
    let mut config = tiny();
    config.steps = 3;
    config.eval_every = 0;
    let a = run_threads(&config, 2);
    let b = run_threads(&config, 2);
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
    assert_eq!(s, run_threads(&config, 2)[0].0);
    config.batch_size = 7;
    assert!(matches!(
        orrery_train::train_with(&config, &options, &mut NullObserver),
        Err(orrery_train::TrainError::BatchNotDivisible { batch: 7, world: 2 })
    ));
}

/// With several ranks, rank 0 reads the checkpoint and broadcasts it (ranks on other hosts need
/// no shared file system): the run continues exactly as from ranks that each read the file, and
/// a checkpoint rank 0 cannot read fails every rank instead of leaving them waiting.
#[test]
fn a_multi_rank_resume_reads_the_checkpoint_on_rank_0() {
    let dir = temp_dir("dp-resume");
    let mut config = tiny();
    config.steps = 3;
    config.eval_every = 0;
    config.out_dir = Some(dir.clone());
    let options = RunOptions {
        ranks: 2,
        clock: std::sync::Arc::new(FixedClock),
        ..Default::default()
    };
    train_with(&config, &options, &mut NullObserver).unwrap();
    config.steps = 5;
    config.out_dir = None;
    let resume = RunOptions {
        resume: Some(dir.clone()),
        ..options.clone()
    };
    let resumed = train_with(&config, &resume, &mut NullObserver).unwrap();
    assert_eq!(resumed.history.len(), 5);

    let ckpt = Checkpoint::load(&dir.join(orrery_train::CHECKPOINT_FILE)).unwrap();
    let corpus = load_corpus(&config).unwrap();
    let reference = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::group(2)
            .into_iter()
            .map(|comm| {
                let (config, ckpt, corpus) = (&config, ckpt.clone(), corpus.clone());
                s.spawn(move || {
                    let mut t = Trainer::<CpuBackend>::resume(
                        config.clone(),
                        ckpt,
                        corpus,
                        make_optimizer(config).unwrap(),
                        Box::new(comm),
                        Default::default(),
                    )
                    .unwrap();
                    t.run(&FixedClock, &mut NullObserver).unwrap()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(resumed, reference[0]);

    let missing = RunOptions {
        resume: Some(dir.join("missing.ckpt")),
        ..options
    };
    let err = train_with(&config, &missing, &mut NullObserver).unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::ResumeCheckpoint {
                source: CheckpointError::Io { .. },
                ..
            }
        ),
        "{err}"
    );
}
