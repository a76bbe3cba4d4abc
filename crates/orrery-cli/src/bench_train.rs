//! `orrery bench --train`: AdamW, SOAP (synchronous and asynchronous) and Shampoo trained on
//! the same model, data and seeds in one run, so that convergence, step-time and memory
//! ratios compare like with like (issue 5).
//!
//! Every optimizer trains every seed with the same configuration and a validation loss every
//! `--eval-every` steps. The reference is AdamW: per seed, its final validation loss is the
//! target, and each optimizer's "steps to target" is the first evaluated step whose validation
//! loss is at most that target. Step times come from the trainer's own per-step timing
//! (forward, backward, gradient averaging and the optimizer step; evaluation excluded), and the
//! optimizer is wrapped so that its step time and its state bytes per tier can be read too.
//! When SOAP is benchmarked, one more SOAP run trains with a device budget of half its
//! measured state and a host budget of a quarter, so that the rest spills to disk, and checks
//! that it trains to the same validation loss as the resident run.
//!
//! Each optimizer may train at its own peak learning rate (`--lr soap=1e-2`): the best rate
//! differs between optimizers (SOAP's is larger than AdamW's in short runs), so one shared rate
//! would compare a tuned AdamW with untuned rivals. The report gives every optimizer's rate.
//!
//! Nothing here asserts timing: the figures are printed (as a table, or JSON with `--json`),
//! and the targets are for the reader to compare.

use crate::{bad, progress_bar};
use anyhow::Result;
use orrery_optim::{OptimError, Optimizer, Param, RefreshMode, StepReport, TierConfig, TierUsage};
use orrery_train::{
    make_optimizer_with, soap_config, train_with, OptimizerConfig, OptimizerRuntime, RunOptions,
    StepMetrics, TrainConfig, TrainError, TrainObserver, TrainSummary,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The corpus the benchmark prefers, relative to the working directory (the repository root
/// when run from a checkout).
const SHAKESPEARE: &str = "crates/orrery-train/data/shakespeare";

/// Steps of a run when neither `--steps` nor a configuration file says otherwise.
const DEFAULT_STEPS: u64 = 200;

/// Layers of the default benchmark model (`orrery train`'s default has 4).
const DEFAULT_LAYERS: usize = 6;

/// A step slower than this multiple of its run's median step time counts as a spike.
const SPIKE_FACTOR: f64 = 2.0;

/// The optimizers the benchmark knows, as named on the command line.
const OPTIMIZERS: [&str; 4] = ["adamw", "soap", "soap-async", "shampoo"];

#[derive(clap::Args, Debug)]
pub struct BenchTrainArgs {
    /// Instead: train AdamW, SOAP (sync and async) and Shampoo on the same model and seeds and
    /// print steps to AdamW's final validation loss, step times and optimizer memory.
    #[arg(long = "train", id = "train", conflicts_with = "accel")]
    pub enabled: bool,
    /// With --train: a text file or folder of .txt files (default: the Shakespeare plays in
    /// crates/orrery-train/data/shakespeare if present, else the built-in sonnets).
    #[arg(long, value_name = "PATH", requires = "train")]
    data: Option<PathBuf>,
    /// With --train: optimizer steps of every run (default 200, or the configuration's).
    #[arg(long, requires = "train")]
    steps: Option<u64>,
    /// With --train: seeds; every optimizer trains each (medians over seeds are reported).
    #[arg(long, value_delimiter = ',', default_values_t = [0, 1, 2], requires = "train")]
    seeds: Vec<u64>,
    /// With --train: optimizers to compare; AdamW, the reference, must be one of them.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = OPTIMIZERS,
        default_values = OPTIMIZERS,
        requires = "train"
    )]
    optimizers: Vec<String>,
    /// With --train: a training configuration TOML (docs/train.md) instead of the default
    /// ~1.2M-parameter byte-level GPT; `optimizer.name` and `seed` are set per run.
    #[arg(long, value_name = "FILE.toml", requires = "train")]
    config: Option<PathBuf>,
    /// With --train: evaluate every this many steps (the resolution of "steps to target").
    #[arg(long, default_value_t = 10, requires = "train")]
    eval_every: u64,
    /// With --train or --accel: print the report as JSON instead of a table (with --train,
    /// per-seed values included).
    #[arg(long)]
    pub json: bool,
    /// With --train: one optimizer's peak learning rate, NAME=LR (repeatable, e.g.
    /// `--lr soap=1e-2 --lr shampoo=3e-3`); the others keep the configuration's (3e-3 by
    /// default). soap-async takes soap's unless it is given its own.
    #[arg(long = "lr", value_name = "NAME=LR", value_parser = parse_lr, requires = "train")]
    lrs: Vec<LrOverride>,
    /// With --train: one of SOAP's hyper-parameters for the soap, soap-async and tiered runs,
    /// KEY=VALUE (repeatable): `frequency` (steps between basis refreshes, default 10),
    /// `beta1`, `beta2` (Adam's in the eigenbasis; default the configuration's, 0.9 and 0.95),
    /// `shampoo_beta` (decay of the L and R statistics; default beta2), `weight_decay`
    /// (default the configuration's, 0.1). The other optimizers keep the configuration's.
    #[arg(long = "soap", value_name = "KEY=VALUE", value_parser = parse_soap, requires = "train")]
    soap: Vec<SoapOverride>,
    /// With --train: skip the extra tiered-state SOAP run (it measures memory, not
    /// convergence or step time).
    #[arg(long, requires = "train")]
    no_tiering: bool,
}

/// One `--soap KEY=VALUE`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum SoapOverride {
    Frequency(u64),
    Beta1(f32),
    Beta2(f32),
    ShampooBeta(f32),
    WeightDecay(f32),
}

/// The keys `--soap` takes.
const SOAP_KEYS: [&str; 5] = [
    "frequency",
    "beta1",
    "beta2",
    "shampoo_beta",
    "weight_decay",
];

impl SoapOverride {
    fn key(self) -> &'static str {
        match self {
            Self::Frequency(_) => SOAP_KEYS[0],
            Self::Beta1(_) => SOAP_KEYS[1],
            Self::Beta2(_) => SOAP_KEYS[2],
            Self::ShampooBeta(_) => SOAP_KEYS[3],
            Self::WeightDecay(_) => SOAP_KEYS[4],
        }
    }
}

/// Splits a `KEY=VALUE` option value; `example` and `keys` go into the error.
fn key_value<'s>(s: &'s str, example: &str, keys: &str) -> Result<(&'s str, &'s str), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("expected {example} ({keys})"))?;
    Ok((key.trim(), value.trim()))
}

/// Parses `--soap KEY=VALUE`; like `--lr`, clap names the flag in the error and exits with
/// status 2. Only the value's type is checked here: its range is the configuration's to
/// check ([`TrainConfig::validate`], through [`run_train_bench`]'s probe), so the two cannot
/// disagree.
fn parse_soap(s: &str) -> Result<SoapOverride, String> {
    let keys = format!("keys: {}", SOAP_KEYS.join(", "));
    let (key, value) = key_value(s, "KEY=VALUE, e.g. frequency=2", &keys)?;
    let float = || -> Result<f32, String> {
        value
            .parse::<f32>()
            .ok()
            .filter(|x| x.is_finite())
            .ok_or_else(|| format!("{key}: `{value}` is not a finite number"))
    };
    match key {
        "frequency" => value
            .parse::<u64>()
            .map(SoapOverride::Frequency)
            .map_err(|_| format!("frequency must be a whole number of steps, got {value}")),
        "beta1" => float().map(SoapOverride::Beta1),
        "beta2" => float().map(SoapOverride::Beta2),
        "shampoo_beta" => float().map(SoapOverride::ShampooBeta),
        "weight_decay" => float().map(SoapOverride::WeightDecay),
        other => Err(format!("unknown key `{other}` ({keys})")),
    }
}

/// SOAP's hyper-parameters as its runs use them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
struct SoapSettings {
    precondition_frequency: u64,
    beta1: f32,
    beta2: f32,
    shampoo_beta: f32,
    weight_decay: f32,
}

/// The optimizer section of the SOAP runs' configuration: the shared one with `--soap`'s
/// overrides; an error when a key is given twice or no SOAP variant trains.
fn soap_optimizer(
    base: &OptimizerConfig,
    overrides: &[SoapOverride],
    variants: &[Variant],
) -> Result<OptimizerConfig> {
    let mut o = base.clone();
    o.name = "soap".to_string();
    if overrides.is_empty() {
        return Ok(o);
    }
    if !variants
        .iter()
        .any(|v| matches!(v, Variant::Soap | Variant::SoapAsync))
    {
        return Err(bad(
            "--soap: neither soap nor soap-async is among --optimizers",
        ));
    }
    let mut seen: Vec<&str> = Vec::new();
    for &x in overrides {
        if seen.contains(&x.key()) {
            return Err(bad(format!("--soap sets `{}` twice", x.key())));
        }
        seen.push(x.key());
        match x {
            SoapOverride::Frequency(n) => o.precondition_frequency = Some(n),
            SoapOverride::Beta1(b) => o.beta1 = b,
            SoapOverride::Beta2(b) => o.beta2 = b,
            SoapOverride::ShampooBeta(b) => o.shampoo_beta = Some(b),
            SoapOverride::WeightDecay(w) => o.weight_decay = w,
        }
    }
    Ok(o)
}

/// What SOAP trains with, read off the optimizer it is built as (defaults included).
fn soap_settings(o: &OptimizerConfig) -> SoapSettings {
    let c = soap_config(o);
    SoapSettings {
        precondition_frequency: c.precondition_frequency,
        beta1: c.betas.0,
        beta2: c.betas.1,
        shampoo_beta: c.statistics_beta(),
        weight_decay: c.weight_decay,
    }
}

/// One `--lr NAME=LR`.
#[derive(Debug, Clone, Copy)]
struct LrOverride {
    variant: Variant,
    lr: f64,
}

/// Parses `--lr NAME=LR`; clap prefixes the error with the flag and the value and exits with
/// status 2, as for the other malformed options.
fn parse_lr(s: &str) -> Result<LrOverride, String> {
    let names = format!("names: {}", OPTIMIZERS.join(", "));
    let (name, value) = key_value(s, "NAME=LR, e.g. soap=1e-2", &names)?;
    let variant =
        Variant::parse(name).ok_or_else(|| format!("unknown optimizer `{name}` ({names})"))?;
    let lr: f64 = value
        .parse()
        .map_err(|_| format!("`{value}` is not a number"))?;
    if !(lr.is_finite() && lr > 0.0) {
        return Err(format!(
            "the learning rate must be positive and finite, got {value}"
        ));
    }
    Ok(LrOverride { variant, lr })
}

/// Every benchmarked optimizer's peak learning rate: its `--lr`, for soap-async soap's when it
/// has none of its own (the same optimizer, refreshed in the background, so its convergence
/// and step time compare with synchronous SOAP's at the same rate), else the configuration's.
fn learning_rates(overrides: &[LrOverride], variants: &[Variant], base: f64) -> Result<Vec<f64>> {
    let mut given: Vec<LrOverride> = Vec::new();
    for o in overrides {
        if given.iter().any(|g| g.variant == o.variant) {
            return Err(bad(format!("--lr names `{}` twice", o.variant.label())));
        }
        // A rate for an optimizer that does not train would be silently ignored; soap's also
        // serves soap-async.
        let used = variants.contains(&o.variant)
            || (o.variant == Variant::Soap && variants.contains(&Variant::SoapAsync));
        if !used {
            return Err(bad(format!(
                "--lr {}={}: `{}` is not among --optimizers",
                o.variant.label(),
                o.lr,
                o.variant.label()
            )));
        }
        given.push(*o);
    }
    let of = |v: Variant| given.iter().find(|g| g.variant == v).map(|g| g.lr);
    Ok(variants
        .iter()
        .map(|&v| {
            of(v)
                .or_else(|| {
                    (v == Variant::SoapAsync)
                        .then(|| of(Variant::Soap))
                        .flatten()
                })
                .unwrap_or(base)
        })
        .collect())
}

/// One optimizer of the benchmark: the name `make_optimizer_with` knows and how it refreshes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    AdamW,
    Soap,
    SoapAsync,
    Shampoo,
}

impl Variant {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "adamw" => Some(Self::AdamW),
            "soap" => Some(Self::Soap),
            "soap-async" => Some(Self::SoapAsync),
            "shampoo" => Some(Self::Shampoo),
            _ => None,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::AdamW => "adamw",
            Self::Soap => "soap",
            Self::SoapAsync => "soap-async",
            Self::Shampoo => "shampoo",
        }
    }

    fn optimizer_name(self) -> &'static str {
        match self {
            Self::AdamW => "adamw",
            Self::Soap | Self::SoapAsync => "soap",
            Self::Shampoo => "shampoo",
        }
    }

    /// `orrery train --async`'s defaults (one worker, staleness 5), so the benchmark measures
    /// what users get.
    fn refresh(self) -> RefreshMode {
        match self {
            Self::SoapAsync => RefreshMode::Async {
                workers: 1,
                staleness: 5,
                apply_at_deadline: false,
            },
            _ => RefreshMode::Sync,
        }
    }
}

/// What the wrapper around an optimizer saw: the wall time of each `step` call and the
/// largest state it held in each tier.
#[derive(Debug, Default, Clone)]
struct Probe {
    step_seconds: Vec<f64>,
    peak: TierUsage,
}

/// Delegates to the real optimizer and records its step time and state usage. The trainer
/// owns the optimizer it is given and exposes neither, so this is the only way to read them
/// from outside through the public API.
struct Instrumented {
    inner: Box<dyn Optimizer>,
    probe: Arc<Mutex<Probe>>,
}

impl Optimizer for Instrumented {
    fn step(&mut self, lr: f32, params: &mut [Param<'_>]) -> Result<StepReport, OptimError> {
        let t = Instant::now();
        let report = self.inner.step(lr, params);
        let secs = t.elapsed().as_secs_f64();
        let usage = self.inner.state_usage();
        // A poisoned lock only loses measurements; training itself must go on.
        if let Ok(mut p) = self.probe.lock() {
            p.step_seconds.push(secs);
            p.peak.device_bytes = p.peak.device_bytes.max(usage.device_bytes);
            p.peak.host_bytes = p.peak.host_bytes.max(usage.host_bytes);
            p.peak.disk_bytes = p.peak.disk_bytes.max(usage.disk_bytes);
        }
        report
    }

    fn save_state(&self) -> Vec<u8> {
        self.inner.save_state()
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.inner.load_state(bytes)
    }

    fn state_usage(&self) -> TierUsage {
        self.inner.state_usage()
    }
}

/// Advances the shared progress bar and shows the run in progress.
struct BarObserver<'a> {
    bar: &'a indicatif::ProgressBar,
    label: String,
    last_val: Option<f32>,
}

impl TrainObserver for BarObserver<'_> {
    fn on_step(&mut self, m: &StepMetrics) {
        if m.val_loss.is_some() {
            self.last_val = m.val_loss;
        }
        let val = self
            .last_val
            .map(|v| format!(" val {v:.3}"))
            .unwrap_or_default();
        self.bar.inc(1);
        self.bar.set_message(format!(
            "{} step {} loss {:.3}{val}",
            self.label, m.step, m.loss
        ));
    }
}

/// Byte counts of optimizer state per tier.
#[derive(Debug, Clone, Copy, Serialize)]
struct StateBytes {
    device: u64,
    host: u64,
    disk: u64,
}

impl From<TierUsage> for StateBytes {
    fn from(u: TierUsage) -> Self {
        Self {
            device: u.device_bytes,
            host: u.host_bytes,
            disk: u.disk_bytes,
        }
    }
}

/// One optimizer on one seed.
#[derive(Debug, Clone, Serialize)]
struct SeedResult {
    seed: u64,
    final_val_loss: Option<f32>,
    /// AdamW's final validation loss on this seed.
    target_val_loss: Option<f32>,
    /// First evaluated step whose validation loss is at most the target; `None`: not reached.
    steps_to_target: Option<u64>,
    /// `steps_to_target` over AdamW's on this seed (below 1: fewer steps than AdamW).
    steps_ratio: Option<f64>,
    /// Training time (the trainer's step times, evaluation excluded) up to that step.
    seconds_to_target: Option<f64>,
    /// Step-time statistics over steps 2.. (step 1 creates the optimizer state).
    step_ms_median: f64,
    step_ms_p99: f64,
    step_ms_max: f64,
    /// Steps slower than `SPIKE_FACTOR` times the median.
    spikes: usize,
    /// Median step time over AdamW's on this seed.
    step_time_ratio: Option<f64>,
    /// Median wall time of the optimizer's `step` alone (steps 2..).
    optimizer_ms_median: f64,
    /// Total time steps waited for asynchronous refreshes, as the optimizer reports it.
    optimizer_wait_s: f64,
    /// Sum of all step times.
    train_seconds: f64,
    /// Largest state per tier during the run.
    state_bytes: StateBytes,
    /// (step, validation loss) at every evaluation.
    val_curve: Vec<(u64, f32)>,
}

/// Medians over seeds of one optimizer's figures.
#[derive(Debug, Clone, Serialize)]
struct Medians {
    final_val_loss: Option<f64>,
    steps_to_target: Option<f64>,
    steps_ratio: Option<f64>,
    seconds_to_target: Option<f64>,
    /// Seeds on which the target was reached.
    reached: usize,
    step_ms_median: Option<f64>,
    step_ms_p99: Option<f64>,
    step_ms_max: Option<f64>,
    spikes: Option<f64>,
    step_time_ratio: Option<f64>,
    optimizer_ms_median: Option<f64>,
    optimizer_wait_s: Option<f64>,
    state_device_bytes: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
struct OptimizerReport {
    name: String,
    /// Peak learning rate of this optimizer's runs.
    lr: f64,
    medians: Medians,
    seeds: Vec<SeedResult>,
}

/// SOAP trained with a device budget smaller than its state.
#[derive(Debug, Clone, Serialize)]
struct TieringReport {
    seed: u64,
    /// Peak learning rate: the one of the SOAP run it is compared with.
    lr: f64,
    device_budget: u64,
    host_budget: u64,
    /// Device-resident bytes of the same SOAP state without budgets.
    untiered_device_bytes: u64,
    state_bytes: StateBytes,
    steps: u64,
    final_val_loss: Option<f32>,
    /// Whether the final validation loss is bit-identical to the resident synchronous SOAP run
    /// of the same seed (`None` when plain `soap` was not benchmarked).
    matches_resident: Option<bool>,
    step_ms_median: f64,
    step_ms_max: f64,
}

#[derive(Debug, Clone, Serialize)]
struct CorpusInfo {
    /// The path trained on, or `built-in` for the sonnets compiled into orrery-train.
    source: String,
    train_tokens: usize,
    val_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    corpus: CorpusInfo,
    params: usize,
    steps: u64,
    eval_every: u64,
    seeds: Vec<u64>,
    /// The configuration every run shares (`optimizer.name`, `seed` and, with `--lr`, `lr`
    /// vary per run; each optimizer's rate is in its report).
    config: TrainConfig,
    spike_factor: f64,
    /// SOAP's hyper-parameters in its runs (`--soap`), when SOAP is benchmarked.
    soap: Option<SoapSettings>,
    optimizers: Vec<OptimizerReport>,
    /// `None` without SOAP or with `--no-tiering`.
    tiering: Option<TieringReport>,
}

/// What one training run returned.
struct Run {
    summary: TrainSummary,
    probe: Probe,
}

/// The shared configuration: the file's or the benchmark's default, with the command line's
/// steps, data and evaluation cadence.
fn base_config(args: &BenchTrainArgs) -> Result<TrainConfig> {
    let mut config = match &args.config {
        Some(path) => crate::collect::read_train_config(path)?,
        None => {
            let mut c = TrainConfig::default();
            // The issue asks for a 1-3M-parameter model; two more layers of the default width
            // give ~1.2M with the same matrix shapes as `orrery train`'s default, so SOAP's
            // and Shampoo's per-matrix costs are the ones users see there.
            c.model.n_layers = DEFAULT_LAYERS;
            c.steps = DEFAULT_STEPS;
            c
        }
    };
    if let Some(s) = args.steps {
        if s == 0 {
            return Err(bad("--steps must be at least 1"));
        }
        config.steps = s;
    }
    // A run shorter than the configured warm-up keeps the warm-up's share (a tenth), as
    // `orrery train --steps` does.
    if config.warmup_steps > config.steps {
        config.warmup_steps = config.steps / 10;
    }
    if args.eval_every == 0 {
        return Err(bad(
            "--eval-every must be at least 1: steps to target are read off the validation curve",
        ));
    }
    config.eval_every = args.eval_every;
    if let Some(d) = &args.data {
        config.data.path = Some(d.clone());
    } else if config.data.path.is_none() {
        config.data.path = default_corpus();
    }
    // The benchmark writes no metrics, curves or checkpoints: only its report.
    config.out_dir = None;
    config.validate().map_err(|e| bad(e.to_string()))?;
    Ok(config)
}

/// The Shakespeare plays if they are there: relative to the working directory first, then
/// next to this crate's sources, so a binary run from elsewhere in a checkout finds them too.
fn default_corpus() -> Option<PathBuf> {
    let candidates = [
        PathBuf::from(SHAKESPEARE),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../orrery-train/data/shakespeare"),
    ];
    candidates.into_iter().find(|p| p.is_dir())
}

fn variants(args: &BenchTrainArgs) -> Result<Vec<Variant>> {
    let mut out: Vec<Variant> = Vec::new();
    for name in &args.optimizers {
        let v = Variant::parse(name).ok_or_else(|| bad(format!("unknown optimizer `{name}`")))?;
        if out.contains(&v) {
            return Err(bad(format!("--optimizers names `{name}` twice")));
        }
        out.push(v);
    }
    if !out.contains(&Variant::AdamW) {
        return Err(bad(
            "--optimizers must include adamw: its final validation loss is the target",
        ));
    }
    // AdamW first, so that each seed's target is known before the others are scored and the
    // table starts with the reference.
    out.sort_by_key(|v| *v != Variant::AdamW);
    Ok(out)
}

fn train_error(e: TrainError) -> anyhow::Error {
    if e.is_input() {
        bad(e.to_string())
    } else {
        anyhow::anyhow!("training failed: {e}")
    }
}

fn train_once(
    config: &TrainConfig,
    runtime: OptimizerRuntime,
    bar: &indicatif::ProgressBar,
    label: String,
) -> Result<Run> {
    let probe = Arc::new(Mutex::new(Probe::default()));
    let shared = Arc::clone(&probe);
    let options = RunOptions {
        make_optimizer: Arc::new(move |c: &TrainConfig| {
            let inner = make_optimizer_with(c, &runtime)?;
            Ok(Box::new(Instrumented {
                inner,
                probe: Arc::clone(&shared),
            }) as Box<dyn Optimizer>)
        }),
        ..RunOptions::default()
    };
    let mut observer = BarObserver {
        bar,
        label,
        last_val: None,
    };
    let summary = train_with(config, &options, &mut observer).map_err(train_error)?;
    let probe = probe.lock().map(|p| p.clone()).unwrap_or_default();
    Ok(Run { summary, probe })
}

/// The value at quantile `q` (0..=1) of sorted `xs`, by nearest rank.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut xs: Vec<f64>) -> Vec<f64> {
    xs.sort_by(f64::total_cmp);
    xs
}

/// Step times without step 1, which creates the optimizer state (SOAP's and Shampoo's first
/// eigendecompositions, burn's first allocations) and would otherwise be every run's maximum.
fn steady(xs: &[f64]) -> Vec<f64> {
    if xs.len() > 1 {
        xs[1..].to_vec()
    } else {
        xs.to_vec()
    }
}

/// The median of values where `None` means "never" (larger than any value): `None` when the
/// middle of the sorted list is "never", and `None` for an empty list.
fn median_opt(values: &[Option<f64>]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().map(|x| x.unwrap_or(f64::INFINITY)).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let m = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    m.is_finite().then_some(m)
}

/// The first evaluated step whose validation loss is at most `target`.
fn steps_to(curve: &[(u64, f32)], target: f32) -> Option<u64> {
    curve.iter().find(|(_, v)| *v <= target).map(|(s, _)| *s)
}

fn val_curve(history: &[StepMetrics]) -> Vec<(u64, f32)> {
    history
        .iter()
        .filter_map(|m| m.val_loss.map(|v| (m.step, v)))
        .collect()
}

/// Scores one run against AdamW's run of the same seed (`reference`: its final validation loss,
/// steps to it and median step time; `None` while scoring AdamW itself).
fn score(seed: u64, run: &Run, reference: Option<(Option<f32>, Option<u64>, f64)>) -> SeedResult {
    let history = &run.summary.history;
    let curve = val_curve(history);
    let final_val_loss = run.summary.final_val_loss;
    let target = match reference {
        Some((t, _, _)) => t,
        None => final_val_loss,
    };
    let steps_to_target = target.and_then(|t| steps_to(&curve, t));
    let seconds_to_target = steps_to_target.map(|s| {
        history
            .iter()
            .take_while(|m| m.step <= s)
            .map(|m| m.step_seconds)
            .sum()
    });
    let step_times = sorted(steady(
        &history.iter().map(|m| m.step_seconds).collect::<Vec<_>>(),
    ));
    let step_median = quantile(&step_times, 0.5);
    let spikes = step_times
        .iter()
        .filter(|&&t| t > SPIKE_FACTOR * step_median)
        .count();
    let (adamw_steps, adamw_median) = match reference {
        Some((_, s, m)) => (s, m),
        None => (steps_to_target, step_median),
    };
    let steps_ratio = match (steps_to_target, adamw_steps) {
        (Some(a), Some(b)) if b > 0 => Some(a as f64 / b as f64),
        _ => None,
    };
    let optimizer_times = sorted(steady(&run.probe.step_seconds));
    SeedResult {
        seed,
        final_val_loss,
        target_val_loss: target,
        steps_to_target,
        steps_ratio,
        seconds_to_target,
        step_ms_median: 1e3 * step_median,
        step_ms_p99: 1e3 * quantile(&step_times, 0.99),
        step_ms_max: 1e3 * step_times.last().copied().unwrap_or(0.0),
        spikes,
        step_time_ratio: (adamw_median > 0.0).then(|| step_median / adamw_median),
        optimizer_ms_median: 1e3 * quantile(&optimizer_times, 0.5),
        optimizer_wait_s: history.iter().map(|m| m.optimizer_wait_s).sum(),
        train_seconds: history.iter().map(|m| m.step_seconds).sum(),
        state_bytes: run.probe.peak.into(),
        val_curve: curve,
    }
}

fn medians(seeds: &[SeedResult]) -> Medians {
    let of = |f: &dyn Fn(&SeedResult) -> Option<f64>| {
        median_opt(&seeds.iter().map(f).collect::<Vec<_>>())
    };
    Medians {
        final_val_loss: of(&|s| s.final_val_loss.map(f64::from)),
        steps_to_target: of(&|s| s.steps_to_target.map(|x| x as f64)),
        steps_ratio: of(&|s| s.steps_ratio),
        seconds_to_target: of(&|s| s.seconds_to_target),
        reached: seeds.iter().filter(|s| s.steps_to_target.is_some()).count(),
        step_ms_median: of(&|s| Some(s.step_ms_median)),
        step_ms_p99: of(&|s| Some(s.step_ms_p99)),
        step_ms_max: of(&|s| Some(s.step_ms_max)),
        spikes: of(&|s| Some(s.spikes as f64)),
        step_time_ratio: of(&|s| s.step_time_ratio),
        optimizer_ms_median: of(&|s| Some(s.optimizer_ms_median)),
        optimizer_wait_s: of(&|s| Some(s.optimizer_wait_s)),
        state_device_bytes: of(&|s| Some(s.state_bytes.device as f64)),
    }
}

fn spill_root() -> PathBuf {
    std::env::temp_dir().join(format!("orrery-bench-train-spill-{}", std::process::id()))
}

pub fn run_train_bench(args: &BenchTrainArgs) -> Result<()> {
    let config = base_config(args)?;
    let variants = variants(args)?;
    let lrs = learning_rates(&args.lrs, &variants, config.lr)?;
    let soap_opt = soap_optimizer(&config.optimizer, &args.soap, &variants)?;
    // `--soap`'s values are checked against the configuration's ranges before any training
    // (the base configuration is valid, so a problem here is one of theirs).
    let mut probe = config.clone();
    probe.optimizer = soap_opt.clone();
    probe.validate().map_err(|e| bad(format!("--soap: {e}")))?;
    let seeds = args.seeds.clone();
    if seeds.is_empty() {
        return Err(bad("--seeds needs at least one seed"));
    }
    let mut distinct = seeds.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != seeds.len() {
        return Err(bad("--seeds names a seed twice"));
    }

    // Reading the corpus once up front reports a bad --data path before any training, and
    // gives the token counts the report shows.
    let corpus = orrery_train::load_corpus(&config).map_err(train_error)?;
    let corpus_info = CorpusInfo {
        source: config
            .data
            .path
            .as_ref()
            .map_or("built-in".to_string(), |p| p.display().to_string()),
        train_tokens: corpus.train.len(),
        val_tokens: corpus.val.len(),
    };
    drop(corpus);

    let soap_selected = variants
        .iter()
        .any(|v| matches!(v, Variant::Soap | Variant::SoapAsync));
    let tiering_run = soap_selected && !args.no_tiering;
    let runs = (seeds.len() * variants.len() + usize::from(tiering_run)) as u64;
    let bar = progress_bar(
        runs * config.steps,
        "bench --train {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}]",
    );

    // Seeds outside, optimizers inside: the runs a seed's ratios compare are close in time, so
    // slow drifts in machine load bias them less.
    let mut results: Vec<Vec<SeedResult>> = vec![Vec::new(); variants.len()];
    let mut params = 0;
    let mut first_soap_run: Option<(Variant, f64, StateBytes, Option<f32>)> = None;
    for &seed in &seeds {
        let mut reference = None;
        for (i, &v) in variants.iter().enumerate() {
            let mut c = config.clone();
            c.seed = seed;
            if matches!(v, Variant::Soap | Variant::SoapAsync) {
                c.optimizer = soap_opt.clone();
            } else {
                c.optimizer.name = v.optimizer_name().to_string();
            }
            c.lr = lrs[i];
            let runtime = OptimizerRuntime {
                refresh: v.refresh(),
                ..OptimizerRuntime::default()
            };
            let run = train_once(&c, runtime, &bar, format!("{} seed {seed}", v.label()));
            let run = match run {
                Ok(r) => r,
                Err(e) => {
                    bar.finish_and_clear();
                    return Err(e);
                }
            };
            params = run.summary.num_params;
            let r = score(seed, &run, reference);
            if v == Variant::AdamW {
                reference = Some((r.final_val_loss, r.steps_to_target, r.step_ms_median / 1e3));
            }
            // Prefer plain SOAP's state as the tiering baseline: its run is also the one the
            // tiered run must reproduce bit for bit.
            let replace = match first_soap_run {
                None => matches!(v, Variant::Soap | Variant::SoapAsync),
                Some((prev, ..)) => prev != Variant::Soap && v == Variant::Soap,
            };
            if replace && seed == seeds[0] {
                first_soap_run = Some((v, lrs[i], r.state_bytes, r.final_val_loss));
            }
            results[i].push(r);
        }
    }

    let tiering = match first_soap_run.filter(|_| tiering_run) {
        Some((v, lr, untiered, resident_loss)) => {
            let t = tiered_run(&config, &soap_opt, seeds[0], lr, untiered, &bar);
            let t = match t {
                Ok(t) => t,
                Err(e) => {
                    bar.finish_and_clear();
                    return Err(e);
                }
            };
            Some(TieringReport {
                matches_resident: (v == Variant::Soap)
                    .then(|| t.final_val_loss.map(f32::to_bits) == resident_loss.map(f32::to_bits)),
                ..t
            })
        }
        None => None,
    };
    bar.finish_and_clear();

    let report = Report {
        corpus: corpus_info,
        params,
        steps: config.steps,
        eval_every: config.eval_every,
        seeds,
        config,
        spike_factor: SPIKE_FACTOR,
        soap: soap_selected.then(|| soap_settings(&soap_opt)),
        optimizers: variants
            .iter()
            .zip(lrs)
            .zip(results)
            .map(|((v, lr), seeds)| OptimizerReport {
                name: v.label().to_string(),
                lr,
                medians: medians(&seeds),
                seeds,
            })
            .collect(),
        tiering,
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{}", render(&report));
    }
    Ok(())
}

/// Synchronous SOAP with half its measured state allowed on the device and a quarter in host
/// memory, so that all three tiers hold some of it.
fn tiered_run(
    config: &TrainConfig,
    soap: &OptimizerConfig,
    seed: u64,
    lr: f64,
    untiered: StateBytes,
    bar: &indicatif::ProgressBar,
) -> Result<TieringReport> {
    let total = untiered.device + untiered.host + untiered.disk;
    let device_budget = total / 2;
    let host_budget = total / 4;
    let root = spill_root();
    let mut c = config.clone();
    c.seed = seed;
    c.lr = lr;
    c.optimizer = soap.clone();
    let runtime = OptimizerRuntime {
        refresh: RefreshMode::Sync,
        tiers: Some(TierConfig {
            device_budget,
            host_budget,
            spill_dir: root.clone(),
        }),
        ..OptimizerRuntime::default()
    };
    let run = train_once(&c, runtime, bar, format!("soap tiered seed {seed}"));
    // The optimizer deletes its spill files when dropped; the folder is the benchmark's own.
    let _ = std::fs::remove_dir_all(&root);
    let run = run?;
    let times = sorted(steady(
        &run.summary
            .history
            .iter()
            .map(|m| m.step_seconds)
            .collect::<Vec<_>>(),
    ));
    Ok(TieringReport {
        seed,
        lr,
        device_budget,
        host_budget,
        untiered_device_bytes: untiered.device,
        state_bytes: run.probe.peak.into(),
        steps: run.summary.steps,
        final_val_loss: run.summary.final_val_loss,
        matches_resident: None,
        step_ms_median: 1e3 * quantile(&times, 0.5),
        step_ms_max: 1e3 * times.last().copied().unwrap_or(0.0),
    })
}

fn fmt_bytes(b: f64) -> String {
    const KIB: f64 = 1024.0;
    if b >= KIB * KIB {
        format!("{:.2} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{b:.0} B")
    }
}

/// A learning rate in its shortest exact form, in exponent notation below 0.01 (`3e-3`, not
/// `0.003`) so that the column stays narrow and reads like the `--lr` that set it.
fn fmt_lr(lr: f64) -> String {
    if lr != 0.0 && lr.abs() < 1e-2 {
        format!("{lr:e}")
    } else {
        format!("{lr}")
    }
}

fn opt_fmt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map_or("-".to_string(), f)
}

fn render(r: &Report) -> String {
    use std::fmt::Write;
    let m = &r.config.model;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "orrery bench --train: {} parameters (byte-level GPT, {} layers, d_model {}, d_ff {}, context {}), batch {}, {} steps, validation every {} steps",
        r.params, m.n_layers, m.d_model, m.d_ff, m.context, r.config.batch_size, r.steps, r.eval_every
    );
    let corpus = if r.corpus.source == "built-in" {
        "built-in sonnets".to_string()
    } else {
        r.corpus.source.clone()
    };
    let _ = writeln!(
        s,
        "corpus: {corpus} ({} training / {} validation tokens)",
        r.corpus.train_tokens, r.corpus.val_tokens
    );
    let seeds: Vec<String> = r.seeds.iter().map(u64::to_string).collect();
    let _ = writeln!(
        s,
        "seeds {}: medians over seeds (per-seed values with --json); target = AdamW's final validation loss of the same seed; step times exclude step 1; spike = step > {}x the median\n",
        seeds.join(","),
        r.spike_factor
    );
    let _ = writeln!(
        s,
        "{:<11} {:>8} {:>9} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8} {:>6} {:>10} {:>8} {:>7} {:>12}",
        "optimizer",
        "lr",
        "val loss",
        "steps to",
        "x AdamW",
        "to tgt s",
        "step ms",
        "p99 ms",
        "max ms",
        "spikes",
        "ms x AdamW",
        "optim ms",
        "wait s",
        "device state"
    );
    let n = r.seeds.len();
    for o in &r.optimizers {
        let md = &o.medians;
        let steps = if md.reached == n {
            opt_fmt(md.steps_to_target, |x| format!("{x:.0}"))
        } else if md.steps_to_target.is_some() {
            format!(
                "{:.0} ({}/{n})",
                md.steps_to_target.unwrap_or(0.0),
                md.reached
            )
        } else {
            "not reached".to_string()
        };
        let _ = writeln!(
            s,
            "{:<11} {:>8} {:>9} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8} {:>6} {:>10} {:>8} {:>7} {:>12}",
            o.name,
            fmt_lr(o.lr),
            opt_fmt(md.final_val_loss, |x| format!("{x:.4}")),
            steps,
            opt_fmt(md.steps_ratio, |x| format!("{x:.2}x")),
            opt_fmt(md.seconds_to_target, |x| format!("{x:.1}")),
            opt_fmt(md.step_ms_median, |x| format!("{x:.1}")),
            opt_fmt(md.step_ms_p99, |x| format!("{x:.1}")),
            opt_fmt(md.step_ms_max, |x| format!("{x:.1}")),
            opt_fmt(md.spikes, |x| format!("{x:.0}")),
            opt_fmt(md.step_time_ratio, |x| format!("{x:.2}x")),
            opt_fmt(md.optimizer_ms_median, |x| format!("{x:.1}")),
            opt_fmt(md.optimizer_wait_s, |x| format!("{x:.2}")),
            opt_fmt(md.state_device_bytes, fmt_bytes),
        );
    }
    if let Some(h) = &r.soap {
        let _ = writeln!(
            s,
            "\nsoap, soap-async: precondition frequency {}, betas ({}, {}), shampoo beta {}, weight decay {}",
            h.precondition_frequency, h.beta1, h.beta2, h.shampoo_beta, h.weight_decay
        );
    }
    let _ = writeln!(
        s,
        "\nlr: peak learning rate (warm-up, then cosine); steps to: first evaluated step at or below the target (seeds that reached it, if not all); x AdamW: its ratio to AdamW's; to tgt s: training seconds to that step (evaluation excluded); ms x AdamW: median step time over AdamW's; optim ms: the optimizer's step alone; wait s: time steps waited for asynchronous refreshes; device state: peak optimizer state on the device"
    );
    match &r.tiering {
        Some(t) => {
            let same = match t.matches_resident {
                Some(true) => "bit-identical to the resident run",
                Some(false) => "DIFFERS from the resident run",
                None => "no resident sync SOAP run to compare",
            };
            let _ = writeln!(
                s,
                "\ntiered SOAP (seed {}, lr {}): state {} resident on the device untiered; with a device budget of {} and a host budget of {} it holds device {} / host {} / disk {} and trained {} steps to validation loss {} ({same}); step {:.1} ms median, {:.1} ms max",
                t.seed,
                fmt_lr(t.lr),
                fmt_bytes(t.untiered_device_bytes as f64),
                fmt_bytes(t.device_budget as f64),
                fmt_bytes(t.host_budget as f64),
                fmt_bytes(t.state_bytes.device as f64),
                fmt_bytes(t.state_bytes.host as f64),
                fmt_bytes(t.state_bytes.disk as f64),
                t.steps,
                t.final_val_loss.map_or("-".to_string(), |l| format!("{l:.4}")),
                t.step_ms_median,
                t.step_ms_max
            );
        }
        None if r.soap.is_some() => {
            let _ = writeln!(s, "\n(tiered SOAP run skipped: --no-tiering)");
        }
        None => {
            let _ = writeln!(s, "\n(no SOAP run: tiered state not measured)");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{
        fmt_lr, learning_rates, median_opt, parse_lr, quantile, steady, steps_to, LrOverride,
        Variant,
    };

    #[test]
    fn lr_flags_parse_name_and_positive_rate() {
        let o = parse_lr("soap=1e-2").unwrap();
        assert_eq!((o.variant, o.lr), (Variant::Soap, 1e-2));
        let o = parse_lr("soap-async=0.02").unwrap();
        assert_eq!((o.variant, o.lr), (Variant::SoapAsync, 0.02));
        for (bad, needle) in [
            ("soap", "NAME=LR"),
            ("lion=1e-3", "lion"),
            ("adamw=fast", "fast"),
            ("adamw=0", "positive"),
            ("adamw=-1e-3", "positive"),
            ("adamw=inf", "finite"),
            ("adamw=NaN", "finite"),
        ] {
            let e = parse_lr(bad).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn soap_async_inherits_soaps_rate_unless_given_its_own() {
        let all = [
            Variant::AdamW,
            Variant::Soap,
            Variant::SoapAsync,
            Variant::Shampoo,
        ];
        let soap = LrOverride {
            variant: Variant::Soap,
            lr: 1e-2,
        };
        assert_eq!(
            learning_rates(&[soap], &all, 3e-3).unwrap(),
            [3e-3, 1e-2, 1e-2, 3e-3]
        );
        let own = LrOverride {
            variant: Variant::SoapAsync,
            lr: 2e-2,
        };
        assert_eq!(
            learning_rates(&[soap, own], &all, 3e-3).unwrap(),
            [3e-3, 1e-2, 2e-2, 3e-3]
        );
        // soap's rate serves soap-async when plain soap is not benchmarked.
        assert_eq!(
            learning_rates(&[soap], &[Variant::AdamW, Variant::SoapAsync], 3e-3).unwrap(),
            [3e-3, 1e-2]
        );
        let twice = learning_rates(&[soap, soap], &all, 3e-3).unwrap_err();
        assert!(twice.to_string().contains("twice"), "{twice}");
        let unused = learning_rates(&[soap], &[Variant::AdamW], 3e-3).unwrap_err();
        assert!(unused.to_string().contains("--optimizers"), "{unused}");
    }

    #[test]
    fn learning_rates_print_like_the_flag() {
        assert_eq!(fmt_lr(3e-3), "3e-3");
        assert_eq!(fmt_lr(1e-2), "0.01");
        assert_eq!(fmt_lr(0.02), "0.02");
        assert_eq!(fmt_lr(2.5e-4), "2.5e-4");
    }

    #[test]
    fn medians_treat_never_as_largest() {
        assert_eq!(median_opt(&[Some(3.0), Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median_opt(&[Some(3.0), None, Some(1.0)]), Some(3.0));
        assert_eq!(median_opt(&[None, None, Some(1.0)]), None);
        assert_eq!(median_opt(&[Some(1.0), Some(2.0)]), Some(1.5));
        assert_eq!(median_opt(&[Some(1.0), None]), None);
        assert_eq!(median_opt(&[]), None);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&xs, 0.5), 50.0);
        assert_eq!(quantile(&xs, 0.99), 99.0);
        assert_eq!(quantile(&xs, 1.0), 100.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(steady(&[9.0, 1.0, 2.0]), vec![1.0, 2.0]);
    }

    #[test]
    fn steps_to_target_is_the_first_evaluation_at_or_below_it() {
        let curve = [(10, 3.0), (20, 2.5), (30, 2.6), (40, 2.4)];
        assert_eq!(steps_to(&curve, 2.5), Some(20));
        assert_eq!(steps_to(&curve, 2.4), Some(40));
        assert_eq!(steps_to(&curve, 2.0), None);
    }
}
