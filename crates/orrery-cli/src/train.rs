//! `orrery train [CONFIG]`: the real training program (orrery-train) with the optimizer
//! runtime's options (orrery-optim) on the command line, a progress bar, and the run's
//! metrics, loss curve and checkpoints in an output folder.

use crate::{bad, progress_bar};
use anyhow::Result;
use orrery_optim::{RefreshMode, TierConfig};
use orrery_train::{
    make_optimizer_with, train_with, OptimizerRuntime, RunOptions, StepMetrics, TrainConfig,
    TrainError, TrainObserver,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// A training configuration TOML (docs/train.md). Without one, a small byte-level GPT
    /// trains on the built-in corpus.
    config: Option<PathBuf>,
    /// The optimizer (overrides `optimizer.name`).
    #[arg(long, value_parser = ["adamw", "soap", "shampoo", "sgd"])]
    optimizer: Option<String>,
    /// SOAP/Shampoo: refresh preconditioners on CPU worker threads while training goes on.
    #[arg(long = "async")]
    async_refresh: bool,
    /// With --async: how many refresh periods the basis in use may lag behind.
    #[arg(long, default_value_t = 5)]
    staleness: u64,
    /// With --async: refresh worker threads.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// SOAP: bytes of optimizer state allowed on the device (e.g. 64MiB); the rest goes to
    /// host memory, then to disk.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    device_budget: Option<u64>,
    /// SOAP: bytes of optimizer state allowed in host memory (default: unlimited when only
    /// --device-budget is given).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    host_budget: Option<u64>,
    /// Continue from the checkpoint in this folder (or this checkpoint file).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Where metrics (JSON lines), the loss curve (SVG) and checkpoints go.
    #[arg(long, value_name = "DIR", default_value = "out/train")]
    out: PathBuf,
    /// Total optimizer steps (overrides `steps`).
    #[arg(long)]
    steps: Option<u64>,
    /// Data-parallel ranks (threads in this process).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// A text file or folder of .txt files to train on (overrides `data.path`).
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// Print every step's metrics as a JSON line instead of a progress bar.
    #[arg(long)]
    json: bool,
}

/// Parses `4096`, `64KiB`, `64MiB`, `2GiB`, `64KB`, `64MB`, `2GB`.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a byte count (e.g. 4096, 64MiB, 2GB)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => return Err(format!("unknown unit `{other}` in `{s}`")),
    };
    Ok((n * mult) as u64)
}

struct Progress {
    bar: indicatif::ProgressBar,
    json: bool,
}

impl TrainObserver for Progress {
    fn on_step(&mut self, m: &StepMetrics) {
        if self.json {
            outln!("{}", m.to_json_line());
            return;
        }
        let val = m
            .val_loss
            .map(|v| format!(" val {v:.3}"))
            .unwrap_or_default();
        self.bar.set_position(m.step);
        self.bar.set_message(format!(
            "loss {:.3}{val}  {:.0} tok/s  optimizer wait {:.0} ms",
            m.loss,
            m.tokens_per_s,
            m.optimizer_wait_s * 1e3
        ));
    }
}

pub fn run_train(args: &TrainArgs) -> Result<()> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
            TrainConfig::from_toml_str(&text).map_err(|e| bad(e.to_string()))?
        }
        None => TrainConfig::default(),
    };
    if let Some(o) = &args.optimizer {
        config.optimizer.name = o.clone();
    }
    if let Some(s) = args.steps {
        config.steps = s;
        // A shorter run than the configured warm-up keeps the warm-up's share (a tenth).
        if config.warmup_steps > s {
            config.warmup_steps = s / 10;
        }
    }
    if let Some(d) = &args.data {
        config.data.path = Some(d.clone());
    }
    config.out_dir = Some(args.out.clone());
    config.validate().map_err(|e| bad(e.to_string()))?;
    let name = config.optimizer.name.clone();
    let second_order = name == "soap" || name == "shampoo";
    if (args.async_refresh || args.device_budget.is_some() || args.host_budget.is_some())
        && !second_order
    {
        return Err(bad(format!(
            "--async, --device-budget and --host-budget apply to soap and shampoo, not {name}"
        )));
    }
    if (args.device_budget.is_some() || args.host_budget.is_some()) && name != "soap" {
        return Err(bad("--device-budget and --host-budget apply to soap only"));
    }
    if args.ranks == 0 {
        return Err(bad("--ranks must be at least 1"));
    }
    let refresh = if args.async_refresh {
        RefreshMode::Async {
            workers: args.workers.max(1),
            staleness: args.staleness,
            apply_at_deadline: false,
        }
    } else {
        RefreshMode::Sync
    };
    let tiers = (args.device_budget.is_some() || args.host_budget.is_some()).then(|| {
        (
            args.device_budget.unwrap_or(u64::MAX),
            args.host_budget.unwrap_or(u64::MAX),
        )
    });
    let spill_root = args.out.join("spill");
    let rank_counter = Arc::new(AtomicUsize::new(0));
    let options = RunOptions {
        resume: args.resume.clone(),
        ranks: args.ranks,
        make_optimizer: Arc::new(move |c: &TrainConfig| {
            // Each rank spills into its own folder.
            let rank = rank_counter.fetch_add(1, Ordering::SeqCst);
            let runtime = OptimizerRuntime {
                refresh,
                tiers: tiers.map(|(device_budget, host_budget)| TierConfig {
                    device_budget,
                    host_budget,
                    spill_dir: spill_dir(&spill_root, rank),
                }),
            };
            make_optimizer_with(c, &runtime)
        }),
        ..RunOptions::default()
    };
    let bar = progress_bar(
        config.steps,
        "training {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}]",
    );
    if args.json {
        bar.finish_and_clear();
    }
    let mut observer = Progress {
        bar: bar.clone(),
        json: args.json,
    };
    let start = std::time::Instant::now();
    let result = train_with(&config, &options, &mut observer);
    bar.finish_and_clear();
    let summary = result.map_err(|e| match e {
        TrainError::Config(c) => bad(c.to_string()),
        other => anyhow::anyhow!("training failed: {other}"),
    })?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{} steps of {} ({} parameters): final loss {}, validation loss {}, {:.1} s, {:.0} tokens/s; metrics, loss curve and checkpoint in {}",
        summary.steps,
        name,
        summary.num_params,
        summary
            .final_loss
            .map_or("-".to_string(), |l| format!("{l:.4}")),
        summary
            .final_val_loss
            .map_or("-".to_string(), |l| format!("{l:.4}")),
        secs,
        summary.tokens_seen as f64 / secs.max(1e-9),
        args.out.display()
    );
    Ok(())
}

fn spill_dir(root: &Path, rank: usize) -> PathBuf {
    root.join(format!("rank{rank}"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse_with_units_and_reject_junk() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("12XB").is_err());
    }
}
