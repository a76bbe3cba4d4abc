//! Trains from a TOML configuration (or the built-in default) and prints one JSON line per step.
//!
//! ```text
//! cargo run --release -p orrery-train --example train -- [CONFIG.toml] [--ranks N] [--resume DIR] [--steps N]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use orrery_train::{
    train_with, MonotonicClock, RunOptions, StepMetrics, TrainConfig, TrainObserver,
};

struct Print;

impl TrainObserver for Print {
    fn on_step(&mut self, m: &StepMetrics) {
        println!("{}", m.to_json_line());
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut config = TrainConfig::default();
    let mut options = RunOptions {
        clock: Arc::new(MonotonicClock::new()),
        ..RunOptions::default()
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ranks" => options.ranks = args.next().unwrap().parse().unwrap(),
            "--resume" => options.resume = Some(args.next().unwrap().into()),
            "--steps" => config.steps = args.next().unwrap().parse().unwrap(),
            "--out" => config.out_dir = Some(args.next().unwrap().into()),
            path => {
                let text = std::fs::read_to_string(path).unwrap();
                config = TrainConfig::from_toml_str(&text).unwrap_or_else(|e| {
                    eprintln!("{e}");
                    std::process::exit(2)
                });
            }
        }
    }
    let start = std::time::Instant::now();
    match train_with(&config, &options, &mut Print) {
        Ok(s) => {
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "{} steps, {} params, final loss {:?}, final val loss {:?}, {:.1} s, {:.0} tokens/s overall",
                s.steps,
                s.num_params,
                s.final_loss,
                s.final_val_loss,
                secs,
                s.tokens_seen as f64 / secs
            );
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
