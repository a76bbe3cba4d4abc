//! `orrery train [CONFIG]`: the real training program (orrery-train) with the optimizer
//! runtime's options (orrery-optim) on the command line, a progress bar, and the run's
//! metrics, loss curve and checkpoints in an output folder. Data parallelism runs over threads
//! of this process (`--ranks N`) or, with the `mpi` feature, over the processes of an MPI job
//! (`mpirun -n N orrery train --comm mpi`).

use crate::{bad, progress_bar};
use anyhow::Result;
use orrery_optim::{RefreshMode, SplitRefresh, TierConfig};
use orrery_train::{
    make_optimizer_with, train_with, OptimizerRuntime, OptimizerSummary, RunOptions, StepMetrics,
    TrainConfig, TrainObserver, TrainSummary,
};
use orrery_units::Bytes;
use serde::Serialize;
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
    /// SOAP/Shampoo with several ranks: each preconditioner refresh (a SOAP basis, a Shampoo
    /// block's inverse roots) runs on one owner rank, which sends the result to the others
    /// (synchronous refresh only).
    #[arg(long)]
    split_refresh: bool,
    /// With --split-refresh: the owner keeps the preconditioner in use when it moved by at
    /// most this (SOAP: eigenvalue-weighted misalignment of the basis, 0 to 1; Shampoo:
    /// distance of the roots scaled to unit norm, 0 to 1.41); 0 sends every refresh,
    /// bit-identical to every rank refreshing everything.
    #[arg(long, default_value_t = 0.0)]
    basis_threshold: f32,
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
    /// How data-parallel ranks communicate: `threads` of this process (`--ranks`), or `mpi`,
    /// one rank per process of an `mpirun` job (needs orrery built with `--features mpi`).
    #[arg(long, value_parser = ["threads", "mpi"], default_value = "threads")]
    comm: String,
    /// A text file or folder of .txt files to train on (overrides `data.path`).
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// Print every step's metrics as a JSON line instead of a progress bar, and the final
    /// report as one JSON object (on stderr, as the text report is, so that stdout holds only
    /// the steps).
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

/// `config` with the flags that override its fields (`--optimizer`, `--steps`, `--data`,
/// `--out`).
fn with_overrides(mut config: TrainConfig, args: &TrainArgs) -> TrainConfig {
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
    config
}

pub fn run_train(args: &TrainArgs) -> Result<()> {
    // The configuration's problems and the flags' are reported at once.
    let mut problems = crate::InputProblems::default();
    // Parsed only: the flags override it before it is validated as a whole.
    let config = args.config.as_deref().map_or_else(
        || Ok(TrainConfig::default()),
        crate::collect::read_train_config,
    );
    let config = problems
        .check(config)
        .map(|config| with_overrides(config, args));
    // Which optimizer the flags apply to is known from a configuration that loaded, valid or
    // not.
    if let Some(config) = &config {
        problems.check(config.validate().map_err(|e| bad(e.to_string())));
        let name = &config.optimizer.name;
        let second_order = name == "soap" || name == "shampoo";
        if (args.async_refresh || args.device_budget.is_some() || args.host_budget.is_some())
            && !second_order
        {
            problems.push(&format!(
                "--async, --device-budget and --host-budget apply to soap and shampoo, not {name}"
            ));
        } else if (args.device_budget.is_some() || args.host_budget.is_some()) && name != "soap" {
            problems.push("--device-budget and --host-budget apply to soap only");
        }
    }
    if args.ranks == 0 {
        problems.push("--ranks must be at least 1");
    }
    if args.async_refresh && args.workers == 0 {
        problems.push("--workers must be at least 1");
    }
    if !(args.basis_threshold.is_finite() && args.basis_threshold >= 0.0) {
        problems.push(&format!(
            "--basis-threshold must be a number from 0 up, not {}",
            args.basis_threshold
        ));
    }
    let config = problems.finish(config)?;
    let name = config.optimizer.name.clone();
    let mpi = if args.comm == "mpi" {
        if args.ranks != 1 {
            return Err(bad(
                "--ranks counts threads of --comm threads; under --comm mpi every process is \
                 one rank (mpirun -n N)",
            ));
        }
        let mpi = mpi_rank::MpiRank::join()?;
        // Checked here rather than left to the trainer so that every rank refuses alike and
        // ends normally, with status 2, instead of aborting the job.
        if !config.batch_size.is_multiple_of(mpi.world_size()) {
            return Err(bad(format!(
                "batch_size {} is not divisible by the {} MPI ranks",
                config.batch_size,
                mpi.world_size()
            )));
        }
        Some(mpi)
    } else {
        None
    };
    crate::device::check_device(config.device, "device = \"cuda\"")?;
    let rank = mpi.as_ref().map_or(0, mpi_rank::MpiRank::rank);
    let refresh = if args.async_refresh {
        RefreshMode::Async {
            workers: args.workers,
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
    let split = args.split_refresh.then(|| SplitRefresh {
        threshold: args.basis_threshold,
        ..SplitRefresh::default()
    });
    let spill_root = args.out.join("spill");
    // Threads number their optimizers from 0; an MPI process builds one optimizer, for its own
    // rank, so several processes on one host never share a spill folder.
    let rank_counter = Arc::new(AtomicUsize::new(rank));
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
                split,
            };
            make_optimizer_with(c, &runtime)
        }),
        ..RunOptions::default()
    };
    // Only rank 0 reports progress (the other MPI ranks' observers are never called), so the
    // other processes keep the terminal free of idle bars and summaries.
    let bar = if rank == 0 {
        progress_bar(
            config.steps,
            "training {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}]",
        )
    } else {
        indicatif::ProgressBar::hidden()
    };
    if args.json {
        bar.finish_and_clear();
    }
    let mut observer = Progress {
        bar: bar.clone(),
        json: args.json,
    };
    let start = std::time::Instant::now();
    let result = match mpi {
        None => train_with(&config, &options, &mut observer),
        Some(mpi) => mpi.train(&config, &options, &mut observer),
    };
    bar.finish_and_clear();
    let summary = result.map_err(|e| {
        if e.is_input() {
            bad(e.to_string())
        } else {
            anyhow::anyhow!("training failed: {e}")
        }
    })?;
    if rank != 0 {
        return Ok(());
    }
    let secs = start.elapsed().as_secs_f64();
    let report = FinalReport::new(&summary, &name, secs, &args.out);
    if args.json {
        eprintln!("{}", serde_json::to_string(&report)?);
    } else {
        eprintln!("{}", report.text());
    }
    Ok(())
}

/// What `orrery train` reports when a run ends (rank 0's view; the optimizer's counts are the
/// same on every rank).
#[derive(Debug, Serialize)]
struct FinalReport<'a> {
    steps: u64,
    optimizer: &'a str,
    parameters: usize,
    final_loss: Option<f32>,
    final_val_loss: Option<f32>,
    seconds: f64,
    tokens_per_s: f64,
    out: String,
    /// Peak state bytes per tier, refreshes, refresh wait, bases sent and kept.
    optimizer_state: OptimizerSummary,
}

impl<'a> FinalReport<'a> {
    fn new(summary: &TrainSummary, optimizer: &'a str, seconds: f64, out: &Path) -> Self {
        Self {
            steps: summary.steps,
            optimizer,
            parameters: summary.num_params,
            final_loss: summary.final_loss,
            final_val_loss: summary.final_val_loss,
            seconds,
            tokens_per_s: summary.tokens_seen as f64 / seconds.max(1e-9),
            out: out.display().to_string(),
            optimizer_state: summary.optimizer,
        }
    }

    /// Two lines: the run, then the optimizer (with the split's exchange when there was one).
    fn text(&self) -> String {
        let loss = |l: Option<f32>| l.map_or("-".to_string(), |l| format!("{l:.4}"));
        let o = &self.optimizer_state;
        let split = if o.bases_sent + o.bases_kept > 0 {
            format!(
                "; split refresh: {} sent, {} kept",
                o.bases_sent, o.bases_kept
            )
        } else {
            String::new()
        };
        format!(
            "{} steps of {} ({} parameters): final loss {}, validation loss {}, {:.1} s, {:.0} tokens/s; metrics, loss curve and checkpoint in {}\n\
             optimizer state at most {} on the device, {} in host memory, {} on disk; {} preconditioner refreshes, {:.1} ms waiting for them{split}",
            self.steps,
            self.optimizer,
            self.parameters,
            loss(self.final_loss),
            loss(self.final_val_loss),
            self.seconds,
            self.tokens_per_s,
            self.out,
            Bytes(o.peak_device_bytes),
            Bytes(o.peak_host_bytes),
            Bytes(o.peak_disk_bytes),
            o.refreshes,
            o.refresh_wait_seconds * 1e3,
        )
    }
}

fn spill_dir(root: &Path, rank: usize) -> PathBuf {
    root.join(format!("rank{rank}"))
}

/// This process's rank of an MPI job (`--comm mpi`).
#[cfg(feature = "mpi")]
pub(crate) mod mpi_rank {
    use crate::bad;
    use anyhow::Result;
    use orrery_train::{
        train_with_comm, Communicator, MpiAbort, MpiComm, RunOptions, TrainConfig, TrainError,
        TrainObserver, TrainSummary,
    };

    /// Runs `f`, this rank's share of an MPI job, and returns what it returns; a failure or
    /// a panic ends the whole job instead. A rank that simply returned an error, or unwound,
    /// would drop its communicator and wait in `MPI_Finalize` for peers that wait for it in
    /// their next collective: the job would hang. The error, `(exit status, message)`, is
    /// printed here, as `what` failed, and the launcher exits with that status (Open MPI's
    /// does), as the CLI does without MPI.
    pub fn or_abort<T>(
        abort: &MpiAbort,
        what: &str,
        f: impl FnOnce() -> Result<T, (i32, String)>,
    ) -> T {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(v)) => v,
            Ok(Err((code, message))) => {
                eprintln!("error: {what}: {message}");
                abort.abort(code)
            }
            // The panic's own message was printed by the panic hook.
            Err(_) => {
                eprintln!("error: {what}: panicked");
                abort.abort(1)
            }
        }
    }

    pub struct MpiRank {
        comm: MpiComm,
        abort: MpiAbort,
    }

    impl MpiRank {
        /// Initialises MPI; started without a launcher, that is a usage error.
        pub fn join() -> Result<MpiRank> {
            let comm = MpiComm::init().map_err(|e| bad(format!("--comm mpi: {e}")))?;
            let abort = comm.abort_handle();
            Ok(MpiRank { comm, abort })
        }

        pub fn rank(&self) -> usize {
            self.comm.rank()
        }

        pub fn world_size(&self) -> usize {
            self.comm.world_size()
        }

        /// Trains this rank. A failure ends the whole job: a rank that simply returned would
        /// leave its peers waiting in the next collective (and itself in `MPI_Finalize`), so
        /// the error is printed here and the job aborted, with status 2 for a configuration
        /// problem and 1 otherwise, as the CLI exits without MPI.
        pub fn train(
            self,
            config: &TrainConfig,
            options: &RunOptions,
            observer: &mut dyn TrainObserver,
        ) -> Result<TrainSummary, TrainError> {
            let rank = self.comm.rank();
            let what = format!("training failed on MPI rank {rank}");
            Ok(or_abort(&self.abort, &what, || {
                train_with_comm(config, options, Box::new(self.comm), observer)
                    .map_err(|e| (if e.is_input() { 2 } else { 1 }, e.to_string()))
            }))
        }
    }
}

/// Why `--comm mpi` is refused by a build without the `mpi` feature.
#[cfg(not(feature = "mpi"))]
pub const NO_MPI: &str = "--comm mpi needs orrery built with MPI support: cargo build --release \
                          -p orrery-cli --features mpi (with OpenMPI's development files and \
                          libclang installed; see docs/train.md)";

/// Without the `mpi` feature no process can join an MPI job: `--comm mpi` is refused.
#[cfg(not(feature = "mpi"))]
mod mpi_rank {
    use super::NO_MPI;
    use crate::bad;
    use anyhow::Result;
    use orrery_train::{RunOptions, TrainConfig, TrainError, TrainObserver, TrainSummary};

    /// Has no values, so the code that would use one type-checks but never runs.
    pub enum MpiRank {}

    impl MpiRank {
        pub fn join() -> Result<MpiRank> {
            Err(bad(NO_MPI))
        }

        pub fn rank(&self) -> usize {
            match *self {}
        }

        pub fn world_size(&self) -> usize {
            match *self {}
        }

        pub fn train(
            self,
            _config: &TrainConfig,
            _options: &RunOptions,
            _observer: &mut dyn TrainObserver,
        ) -> Result<TrainSummary, TrainError> {
            match self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, run_train, FinalReport, TrainArgs};
    use clap::Parser;
    use orrery_train::{OptimizerSummary, TrainSummary};

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    /// `--comm mpi` is a usage error (status 2) with advice when MPI support is not built in,
    /// and under any build when combined with thread ranks; neither starts training.
    #[test]
    fn comm_mpi_is_refused_when_it_cannot_run() {
        let is_bad = |args: &[&str], needle: &str| {
            let cli = Cli::try_parse_from(args).unwrap();
            let err = run_train(&cli.train).unwrap_err();
            assert!(err.downcast_ref::<crate::BadInput>().is_some(), "{err}");
            assert!(err.to_string().contains(needle), "{err}");
        };
        is_bad(&["t", "--comm", "mpi", "--ranks", "2"], "mpirun -n N");
        #[cfg(not(feature = "mpi"))]
        is_bad(&["t", "--comm", "mpi"], "--features mpi");
        // Test binaries do not run under a launcher.
        #[cfg(feature = "mpi")]
        is_bad(&["t", "--comm", "mpi"], "mpirun -n N");
        assert!(Cli::try_parse_from(["t", "--comm", "nccl"]).is_err());
    }

    #[test]
    fn byte_counts_parse_with_units_and_reject_junk() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("12XB").is_err());
    }

    /// The final report carries the optimizer's figures, as text and as JSON, and names the
    /// split's exchange only when there was one.
    #[test]
    fn the_final_report_shows_the_optimizer() {
        let mut summary = TrainSummary {
            steps: 12,
            final_loss: Some(2.5),
            final_val_loss: None,
            tokens_seen: 1200,
            num_params: 1000,
            history: Vec::new(),
            optimizer: OptimizerSummary {
                peak_device_bytes: 3 << 20,
                peak_host_bytes: 2048,
                peak_disk_bytes: 0,
                refreshes: 40,
                refresh_wait_seconds: 0.25,
                bases_sent: 0,
                bases_kept: 0,
            },
        };
        let out = std::path::Path::new("out/x");
        let text = FinalReport::new(&summary, "soap", 2.0, out).text();
        assert!(
            text.contains("12 steps of soap (1000 parameters)"),
            "{text}"
        );
        assert!(text.contains("600 tokens/s"), "{text}");
        assert!(
            text.contains("3.00 MiB on the device, 2.00 KiB in host memory, 0 B on disk"),
            "{text}"
        );
        assert!(
            text.contains("40 preconditioner refreshes, 250.0 ms waiting"),
            "{text}"
        );
        assert!(!text.contains("split"), "{text}");
        summary.optimizer.bases_sent = 30;
        summary.optimizer.bases_kept = 10;
        let report = FinalReport::new(&summary, "soap", 2.0, out);
        assert!(
            report.text().contains("split refresh: 30 sent, 10 kept"),
            "{}",
            report.text()
        );
        let json: serde_json::Value = serde_json::to_value(&report).unwrap();
        assert_eq!(json["optimizer_state"]["refreshes"], 40);
        assert_eq!(json["optimizer_state"]["bases_kept"], 10);
        assert_eq!(json["optimizer_state"]["peak_host_bytes"], 2048);
        assert_eq!(json["final_val_loss"], serde_json::Value::Null);
    }
}
