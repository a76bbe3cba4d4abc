#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bits, temp_dir, tiny};
use orrery_train::{
    load_corpus, make_optimizer, train_with, CpuBackend, FixedClock, NullObserver, RunOptions,
    SingleRank, TrainError, Trainer,
};
use std::sync::Arc;

fn trainer(config: &orrery_train::TrainConfig) -> Trainer<CpuBackend> {
    Trainer::new(
        config.clone(),
        load_corpus(config).unwrap(),
        make_optimizer(config).unwrap(),
        Box::new(SingleRank),
        Default::default(),
    )
    .unwrap()
}

#[test]
fn tiny_model_loss_decreases_on_builtin_corpus() {
    let config = tiny();
    let mut t = trainer(&config);
    let s = t.run(&FixedClock, &mut NullObserver).unwrap();
    let first = s.history[0].loss;
    let last = s.final_loss.unwrap();
    // Uniform over 256 bytes is ln 256 = 5.55 nats.
    assert!((first - 256f32.ln()).abs() < 0.3, "first loss {first}");
    assert!(last < first - 1.5, "loss {first} -> {last}");
    let val = s.final_val_loss.unwrap();
    assert!(val < first - 1.0, "val loss {val}");
    assert_eq!(s.history.len(), 30);
    assert_eq!(s.tokens_seen, 30 * 8 * 16);
    assert!(s.history.iter().filter(|m| m.val_loss.is_some()).count() == 3);
}

#[test]
fn same_seed_same_run_bit_for_bit() {
    let mut config = tiny();
    config.steps = 5;
    let a = trainer(&config)
        .run(&FixedClock, &mut NullObserver)
        .unwrap();
    let mut tb = trainer(&config);
    let b = tb.run(&FixedClock, &mut NullObserver).unwrap();
    assert_eq!(a, b);
    let mut tc = trainer(&config);
    tc.run(&FixedClock, &mut NullObserver).unwrap();
    assert_eq!(bits(tb.params().flat()), bits(tc.params().flat()));
    config.seed = 1;
    let c = trainer(&config)
        .run(&FixedClock, &mut NullObserver)
        .unwrap();
    assert_ne!(a.history[0].loss, c.history[0].loss);
}

#[test]
fn outputs_are_written_and_a_folder_resumes() {
    let dir = temp_dir("outputs");
    let mut config = tiny();
    config.steps = 6;
    config.eval_every = 3;
    config.out_dir = Some(dir.clone());
    let options = RunOptions {
        clock: Arc::new(FixedClock),
        ..RunOptions::default()
    };
    let s = train_with(&config, &options, &mut NullObserver).unwrap();
    assert_eq!(s.steps, 6);
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 6);
    assert!(metrics.lines().all(|l| l.starts_with("{\"step\":")));
    let svg = std::fs::read_to_string(dir.join("loss.svg")).unwrap();
    assert!(svg.contains("<svg"));
    assert!(dir.join("checkpoint.ckpt").exists());

    // Extend the same run to 9 steps from its folder.
    config.steps = 9;
    let resumed = RunOptions {
        resume: Some(dir.clone()),
        ..options
    };
    let s2 = train_with(&config, &resumed, &mut NullObserver).unwrap();
    assert_eq!(s2.steps, 9);
    assert_eq!(s2.history[..6], s.history[..]);
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 9);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn invalid_config_names_the_field() {
    let mut config = tiny();
    config.model.n_kv_heads = 3;
    config.lr = -1.0;
    match train_with(&config, &RunOptions::default(), &mut NullObserver) {
        Err(TrainError::Config(e)) => {
            assert!(e.mentions("model.n_kv_heads"), "{e}");
            assert!(e.mentions("lr"), "{e}");
            assert!(e.to_string().contains("model.n_kv_heads"));
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[cfg(feature = "bpe")]
#[test]
fn trains_with_a_bpe_tokenizer() {
    let mut config = tiny();
    config.data.tokenizer = orrery_train::TokenizerKind::Bpe("r50k_base".into());
    config.model.vocab_size = 50_257;
    config.steps = 4;
    config.warmup_steps = 1;
    config.eval_every = 2;
    let s = trainer(&config)
        .run(&FixedClock, &mut NullObserver)
        .unwrap();
    let first = s.history[0].loss;
    assert!((first - 50_257f32.ln()).abs() < 0.5, "first loss {first}");
    assert!(s.final_loss.unwrap() < first);

    config.model.vocab_size = 256;
    let err = config.validate().unwrap_err();
    assert!(err.mentions("model.vocab_size"), "{err}");
}

/// Every optimizer the configuration can name trains the tiny model (SOAP and Shampoo come
/// from orrery-optim; this checks the plumbing, not their convergence).
#[test]
fn every_named_optimizer_trains() {
    for name in ["adamw", "soap", "shampoo", "sgd"] {
        let mut config = tiny();
        config.optimizer.name = name.into();
        config.steps = 6;
        config.warmup_steps = 1;
        config.eval_every = 0;
        if name == "sgd" {
            config.lr = 0.5;
        }
        let s = trainer(&config)
            .run(&FixedClock, &mut NullObserver)
            .unwrap();
        let first = s.history[0].loss;
        let last = s.final_loss.unwrap();
        assert!(last < first, "{name}: {first} -> {last}");
    }
}

#[test]
fn optimizer_runtime_options_are_refused_where_they_do_not_apply() {
    use orrery_train::{make_optimizer_with, OptimizerRuntime, TrainConfig};
    let mut config = TrainConfig::default();
    let asynchronous = OptimizerRuntime {
        refresh: orrery_optim::RefreshMode::Async {
            workers: 1,
            staleness: 1,
            apply_at_deadline: true,
        },
        ..OptimizerRuntime::default()
    };
    let tiered = OptimizerRuntime {
        tiers: Some(orrery_optim::TierConfig {
            device_budget: 0,
            host_budget: 0,
            spill_dir: std::env::temp_dir().join("orrery-train-unused-spill"),
        }),
        ..OptimizerRuntime::default()
    };
    let split = OptimizerRuntime {
        split: Some(orrery_optim::SplitRefresh::default()),
        ..OptimizerRuntime::default()
    };
    // A split needs synchronous refreshes.
    let split_async = OptimizerRuntime {
        split: split.split,
        ..asynchronous.clone()
    };
    config.optimizer.name = "adamw".into();
    assert!(make_optimizer_with(&config, &asynchronous).is_err());
    assert!(make_optimizer_with(&config, &tiered).is_err());
    assert!(make_optimizer_with(&config, &split).is_err());
    config.optimizer.name = "shampoo".into();
    assert!(make_optimizer_with(&config, &asynchronous).is_ok());
    assert!(make_optimizer_with(&config, &tiered).is_err());
    assert!(make_optimizer_with(&config, &split).is_ok());
    assert!(make_optimizer_with(&config, &split_async).is_err());
    config.optimizer.name = "sgd".into();
    assert!(make_optimizer_with(&config, &split).is_err());
    config.optimizer.name = "soap".into();
    assert!(make_optimizer_with(&config, &asynchronous).is_ok());
    assert!(make_optimizer_with(&config, &tiered).is_ok());
    assert!(make_optimizer_with(&config, &split).is_ok());
    assert!(make_optimizer_with(&config, &split_async).is_err());
}

/// The summary's optimizer figures, from what the optimizer reports: AdamW holds two moments
/// per weight on the device and refreshes nothing; SOAP refreshes every matrix's basis once in
/// 11 steps (the first step only builds the bases) and Shampoo every block's roots twice (steps
/// 1 and 11; each matrix of the tiny model is one block); SOAP's spilled state is reported on
/// disk. Synchronous refreshes never wait.
#[test]
fn the_summary_reports_what_the_optimizer_did() {
    use orrery_train::{make_optimizer_with, OptimizerRuntime, OptimizerSummary, TrainSummary};
    let mut config = tiny();
    config.steps = 11;
    config.warmup_steps = 1;
    config.eval_every = 0;
    let run = |config: &orrery_train::TrainConfig, runtime: &OptimizerRuntime| -> TrainSummary {
        Trainer::<CpuBackend>::new(
            config.clone(),
            load_corpus(config).unwrap(),
            make_optimizer_with(config, runtime).unwrap(),
            Box::new(SingleRank),
            Default::default(),
        )
        .unwrap()
        .run(&FixedClock, &mut NullObserver)
        .unwrap()
    };
    let t = trainer(&config);
    let store = t.params();
    let matrices = (0..store.len())
        .filter(|&i| store.shape(i).len() >= 2)
        .count() as u64;
    assert!(matrices > 0);

    config.optimizer.name = "adamw".into();
    let adamw = run(&config, &OptimizerRuntime::default());
    assert_eq!(
        adamw.optimizer,
        OptimizerSummary {
            peak_device_bytes: 2 * 4 * adamw.num_params as u64,
            ..OptimizerSummary::default()
        }
    );

    config.optimizer.name = "soap".into();
    let soap = run(&config, &OptimizerRuntime::default()).optimizer;
    assert_eq!(soap.refreshes, matrices);
    assert!(
        soap.peak_device_bytes > adamw.optimizer.peak_device_bytes,
        "SOAP holds bases and statistics too: {soap:?}"
    );
    assert_eq!((soap.peak_host_bytes, soap.peak_disk_bytes), (0, 0));
    assert_eq!(soap.refresh_wait_seconds, 0.0);
    assert_eq!((soap.bases_sent, soap.bases_kept), (0, 0), "no split");

    let spill = temp_dir("summary-spill");
    let spilled = run(
        &config,
        &OptimizerRuntime {
            tiers: Some(orrery_optim::TierConfig {
                device_budget: 0,
                host_budget: 0,
                spill_dir: spill.clone(),
            }),
            ..OptimizerRuntime::default()
        },
    )
    .optimizer;
    assert_eq!(spilled.peak_device_bytes, 0);
    assert_eq!(spilled.peak_disk_bytes, soap.peak_device_bytes);
    assert_eq!(spilled.refreshes, soap.refreshes);
    let _ = std::fs::remove_dir_all(&spill);

    config.optimizer.name = "shampoo".into();
    let shampoo = run(&config, &OptimizerRuntime::default()).optimizer;
    assert_eq!(shampoo.refreshes, 2 * matrices);
    assert!(shampoo.peak_device_bytes > 0);
}
