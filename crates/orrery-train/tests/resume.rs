#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{bits, temp_dir, tiny};
use orrery_train::{
    load_corpus, make_optimizer, train_with, Checkpoint, CheckpointError, CpuBackend, FixedClock,
    NullObserver, RunOptions, SingleRank, TrainConfig, TrainError, Trainer,
};

fn fresh(config: &TrainConfig) -> Trainer<CpuBackend> {
    Trainer::new(
        config.clone(),
        load_corpus(config).unwrap(),
        make_optimizer(config).unwrap(),
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap()
}

fn resumed(config: &TrainConfig, ckpt: Checkpoint) -> Trainer<CpuBackend> {
    Trainer::resume(
        config.clone(),
        ckpt,
        load_corpus(config).unwrap(),
        make_optimizer(config).unwrap(),
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap()
}

/// N steps in one go equal k steps + checkpoint file + resume + N - k steps, bit for bit:
/// every loss, every validation loss, every learning rate and every final weight.
#[test]
fn resume_is_bit_exact() {
    let mut config = tiny();
    config.steps = 12;
    config.eval_every = 4;
    for variant in 0..2 {
        if variant == 1 {
            // The other architecture variants, so that every parameter kind round-trips.
            config.model.norm = orrery_train::NormKind::RmsNorm;
            config.model.positions = orrery_train::PositionKind::Learned;
            config.model.mlp = orrery_train::MlpKind::SwiGlu;
            config.model.tie_embeddings = false;
        }
        let mut full = fresh(&config);
        let full_summary = full.run(&FixedClock, &mut NullObserver).unwrap();

        let dir = temp_dir(&format!("resume-{variant}"));
        let path = dir.join("ckpt");
        let mut first = fresh(&config);
        for _ in 0..5 {
            first.step(&FixedClock).unwrap();
        }
        first.checkpoint().save(&path).unwrap();
        drop(first);
        let mut second = resumed(&config, Checkpoint::load(&path).unwrap());
        assert_eq!(second.steps_done(), 5);
        let second_summary = second.run(&FixedClock, &mut NullObserver).unwrap();

        assert_eq!(full_summary.history.len(), 12);
        for (a, b) in full_summary.history.iter().zip(&second_summary.history) {
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {}", a.step);
            assert_eq!(a.val_loss.map(f32::to_bits), b.val_loss.map(f32::to_bits));
            assert_eq!(a.lr.to_bits(), b.lr.to_bits());
            assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits());
        }
        assert_eq!(full_summary, second_summary);
        assert_eq!(bits(full.params().flat()), bits(second.params().flat()));
        // The optimizer state continues identically too.
        assert_eq!(full.checkpoint().optimizer, second.checkpoint().optimizer);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn corrupt_checkpoint_is_reported() {
    let dir = temp_dir("corrupt");
    let mut config = tiny();
    config.steps = 2;
    config.warmup_steps = 1;
    config.eval_every = 0;
    config.out_dir = Some(dir.clone());
    let options = RunOptions {
        clock: Arc::new(FixedClock),
        ..RunOptions::default()
    };
    train_with(&config, &options, &mut NullObserver).unwrap();
    let path = dir.join("checkpoint.ckpt");
    let good = std::fs::read(&path).unwrap();
    Checkpoint::decode(&good).unwrap();

    config.steps = 3;
    let resume = RunOptions {
        resume: Some(dir.clone()),
        ..options
    };

    // One flipped bit in the middle of the weights.
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x10;
    std::fs::write(&path, &flipped).unwrap();
    let err = train_with(&config, &resume, &mut NullObserver).unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::ResumeCheckpoint {
                source: CheckpointError::ChecksumMismatch { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("corrupt"), "{err}");
    // A damaged checkpoint to resume from is the input's fault (the CLI's status 2).
    assert!(err.is_input(), "{err}");

    // Truncated (a write cut short).
    std::fs::write(&path, &good[..good.len() - 100]).unwrap();
    let err = train_with(&config, &resume, &mut NullObserver).unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::ResumeCheckpoint {
                source: CheckpointError::Truncated { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("truncated"), "{err}");

    // Not a checkpoint at all.
    std::fs::write(&path, b"hello, world, this is not a checkpoint").unwrap();
    let err = train_with(&config, &resume, &mut NullObserver).unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::ResumeCheckpoint {
                source: CheckpointError::BadMagic,
                ..
            }
        ),
        "{err:?}"
    );

    // The intact file still resumes.
    std::fs::write(&path, &good).unwrap();
    let s = train_with(&config, &resume, &mut NullObserver).unwrap();
    assert_eq!(s.steps, 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_refuses_a_different_model() {
    let mut config = tiny();
    config.steps = 1;
    config.warmup_steps = 0;
    let mut t = fresh(&config);
    t.step(&FixedClock).unwrap();
    let ckpt = t.checkpoint();
    config.model.d_ff = 32;
    let err = Trainer::<CpuBackend>::resume(
        config.clone(),
        ckpt,
        load_corpus(&config).unwrap(),
        make_optimizer(&config).unwrap(),
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap_err();
    assert!(matches!(err, TrainError::Resume(_)), "{err:?}");
}

/// The same through SOAP's and Shampoo's saved state (bases, statistics, moments).
#[test]
fn resume_is_bit_exact_with_second_order_optimizers() {
    for name in ["soap", "shampoo"] {
        let mut config = tiny();
        config.optimizer.name = name.into();
        // Past the default precondition_frequency of 10, so a basis refresh happens after
        // the resume.
        config.steps = 12;
        config.warmup_steps = 2;
        config.eval_every = 0;
        let mut full = fresh(&config);
        let a = full.run(&FixedClock, &mut NullObserver).unwrap();
        let mut first = fresh(&config);
        for _ in 0..5 {
            first.step(&FixedClock).unwrap();
        }
        let bytes = first.checkpoint().encode().unwrap();
        let mut second = resumed(&config, Checkpoint::decode(&bytes).unwrap());
        let b = second.run(&FixedClock, &mut NullObserver).unwrap();
        // The summaries include the optimizer's figures, which the checkpoint carries: SOAP
        // refreshes after the resume only, Shampoo on both sides of it.
        assert!(a.optimizer.refreshes > 0, "{name}");
        assert_eq!(a, b, "{name}");
        assert_eq!(
            bits(full.params().flat()),
            bits(second.params().flat()),
            "{name}"
        );
    }
}
