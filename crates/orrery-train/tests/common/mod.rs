#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use orrery_train::{ModelConfig, TrainConfig};

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
