//! # orrery: the command-line tool
//!
//! The only crate that prints, reads files or looks at the clock. It turns arguments into a
//! [`orrery_spec::Job`], calls the libraries and renders what they return: terminal tables,
//! JSON, Perfetto traces, SVG charts and Chakra traces. Bad input (an unreadable file, a
//! spec error, an unknown preset) exits with status 2 after listing every problem; other
//! failures exit with status 1.

/// Prints to stdout through [`emit`], so a closed pipe ends the program quietly.
macro_rules! out {
    ($($arg:tt)*) => { $crate::emit(&format!($($arg)*)) };
}

/// [`out!`] with a newline.
macro_rules! outln {
    () => { $crate::emit("\n") };
    ($($arg:tt)*) => { $crate::emit(&format!("{}\n", format_args!($($arg)*))) };
}

mod bench_accel;
mod bench_emulate;
mod bench_train;
mod collect;
mod device;
mod emulate;
mod netsim;
mod packet_flags;
mod report;
mod train;

use anyhow::{Context, Result};

/// Counts the bytes each thread holds, so that real ranks of hybrid emulation report their
/// measured peak memory.
#[global_allocator]
static ALLOC: orrery_emulate::memory::CountingAlloc = orrery_emulate::memory::CountingAlloc;
use clap::{Parser, Subcommand};
use orrery_predict::{predict_with, ReplayMode};
use orrery_spec::{hf, load_job_spec, preset_job_text, presets, Job, JobSpec};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "orrery",
    version,
    about = "Predict, emulate and optimize LLM training at scale"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Predict one training step: time, MFU, where the time goes, per-stage memory.
    Predict(PredictArgs),
    /// Predict every published measurement of the validation set and print the errors.
    Validate {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Simulate a network scenario (topology + flows or collectives) at packet or flow level.
    Netsim(netsim::NetsimArgs),
    /// Train a GPT with AdamW, SOAP or Shampoo (the real training program; CPU by default).
    Train(train::TrainArgs),
    /// Emulate one training step with chosen ranks tracked one by one among virtual ones,
    /// under perturbations (slow ranks, degraded links), next to the prediction.
    Emulate(emulate::EmulateArgs),
    /// Run the real training program (`orrery train`'s configuration) as one rank of each
    /// pipeline stage among virtual peers, and record one step as the world's execution
    /// graph, for `orrery emulate --train --graph`.
    Collect(collect::CollectArgs),
    /// Replay Chakra execution traces (`PREFIX.<rank>.et` for every rank, plus a comm-group
    /// JSON) on orrery's cost and network models.
    Replay(ReplayArgs),
    /// List the built-in jobs, models and GPUs.
    Presets,
    /// Time the predictor on built-in scenarios and print medians and ratios (--accel: the
    /// packet model against its reference; --train: the optimizers on real training runs).
    Bench {
        /// Repetitions per scenario (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
        runs: u32,
        /// Instead: the accelerated packet model against the packet-by-packet reference on
        /// training traffic (ring all-reduce, GPT steps, an MoE step): the reference once,
        /// the accelerated model once or, when a run takes under a second, the median of up
        /// to five.
        #[arg(long, conflicts_with_all = ["emulate", "emulate_fidelity"])]
        accel: bool,
        /// With --accel: MiB of the 128-GPU ring all-reduce (0: leave it out).
        #[arg(long, default_value_t = 64)]
        ring_mib: u64,
        /// With --accel: MiB of each of two ring all-reduces across two pods of four hosts
        /// (64 GPUs; the spines congest). 0, the default, leaves them out.
        #[arg(long, default_value_t = 0)]
        cross_pod_mib: u64,
        /// With --accel: also run each reference with the next seed and print how far it
        /// lands from the first (how chaotic single flows are).
        #[arg(long)]
        seed_spread: bool,
        /// With --accel: also run each reference on its flows numbered in another order
        /// (dependencies still first) and print how far it lands from the first (how much
        /// the order of same-time events decides single flows).
        #[arg(long)]
        label_spread: bool,
        /// With --accel: also run each scenario in the fluid model and print its wall time
        /// and its errors against the reference, its time stepping every flow (the calm
        /// skip off) and its time taking the steps between strided links' transmissions
        /// (the gap skip off; the bench fails if a run's flows differ from the first's).
        #[arg(long)]
        fluid: bool,
        /// With --accel --fluid: let the fluid model step links whose delay spans several
        /// of its steps at most this many nanoseconds apart, 0 for every link every step
        /// (`orrery netsim --fluid-link-step-ns`; by default as there).
        #[arg(long, value_name = "NS", requires = "fluid")]
        fluid_link_step_ns: Option<f64>,
        /// With --accel: GPU counts of the GPT step scenarios (0: none).
        #[arg(long, value_delimiter = ',', default_values_t = [64, 128, 256, 1024])]
        gpt_gpus: Vec<u32>,
        /// With --accel: GPU counts of the GPT 13B step scenarios (32 times a divisor of 256,
        /// e.g. 64,128,256,1024; 0: none, the default, so that the table's other commands
        /// keep their meaning). At 1,024 GPUs the accelerated run alone took 8 minutes
        /// (2026-12-01).
        #[arg(long = "gpt13b-gpus", value_delimiter = ',', default_values_t = [0])]
        gpt_13b_gpus: Vec<u32>,
        /// With --accel: GPU counts of the Llama 3 405B pipeline step scenarios (32 layers,
        /// tp 8 x pp 16 per replica, 16 micro-batches each; multiples of 128; 0: none, the
        /// default). At 128 GPUs the reference takes about a minute.
        #[arg(long = "llama-pp-gpus", value_delimiter = ',', default_values_t = [0])]
        llama_pp_gpus: Vec<u32>,
        /// With --accel: leave out the MoE steps.
        #[arg(long)]
        no_moe: bool,
        /// With --accel: GPU counts of the MoE (Mixtral 8x7B, 8 layers) step scenarios,
        /// multiples of 64 (tp 2 x pp 4 per replica, expert groups of 8 replicas; 0: none).
        #[arg(long, value_delimiter = ',', default_values_t = [64])]
        moe_gpus: Vec<u32>,
        /// With --accel: the MoE steps' all-to-alls cross rails through the spines instead
        /// of being relayed onto the destination's rail over NVLink (`cluster.pxn = false`,
        /// NCCL_PXN_DISABLE=1).
        #[arg(long)]
        no_pxn: bool,
        /// With --accel: how every scenario's fabric places flows on equal-cost paths:
        /// `ecmp` (a hash per connection, where flows across pods collide on uplinks) or
        /// `pinned` (by the destination's port on its leaf, `cluster.routing = "pinned"`).
        #[arg(long, default_value = "ecmp", value_parser = ["ecmp", "pinned"])]
        routing: String,
        /// With --accel: when the job steps' flows are released: `rendezvous` (after what
        /// each rank's op waits for, as simulated, a collective starting on all its members
        /// when the last is ready), `dependencies` (each member on its own) or `replay` (at
        /// the analytical replay's times); docs/netsim.md.
        #[arg(
            long,
            default_value = "rendezvous",
            value_parser = clap::builder::PossibleValuesParser::new(
                orrery_predict::traffic::Release::ALL.map(|r| r.name())
            )
        )]
        release: String,
        /// With --accel: run the (slow) reference only for scenarios up to this many GPUs;
        /// larger ones show the speedup estimated from events.
        #[arg(long, default_value_t = 128)]
        reference_max_gpus: u32,
        /// Instead: what hybrid emulation's engine costs per step as the world grows (one
        /// real rank, pruned), against the real rank's compute.
        #[arg(long)]
        emulate: bool,
        /// Instead: emulation of the real training program with one real rank against the
        /// same step with every rank real, on 2 and 4 ranks.
        #[arg(long)]
        emulate_fidelity: bool,
        /// With --emulate-fidelity: every measurement in a process of its own, the all-real
        /// step as an MPI job of this binary (needs `--features mpi` and `mpirun`).
        #[arg(long, requires = "emulate_fidelity")]
        mpi: bool,
        /// With --emulate-fidelity: where every rank computes, `cpu` or `cuda` (burn's CUDA
        /// backend, every rank on the one GPU; needs orrery built with `--features cuda`).
        #[arg(long, requires = "emulate_fidelity", value_parser = ["cpu", "cuda"], default_value = "cpu")]
        device: String,
        /// With --emulate: world sizes (multiples of 32).
        #[arg(long, value_delimiter = ',', default_values_t = [1024, 2048, 4096, 8192])]
        emulate_gpus: Vec<u32>,
        /// `--train` and its options: the optimizers compared on real training runs.
        #[command(flatten)]
        train: bench_train::BenchTrainArgs,
    },
}

/// Where a job comes from: a file, a preset or the default, with overrides.
#[derive(clap::Args, Debug)]
struct JobArgs {
    /// A job TOML file. Without one, a built-in job runs (see --preset).
    job: Option<PathBuf>,
    /// A built-in job (see `orrery presets`); the default is Llama-3 70B on 1,024 H100.
    #[arg(long, conflicts_with = "job")]
    preset: Option<String>,
    /// A Hugging Face config.json whose model replaces the job's model section.
    #[arg(long, value_name = "FILE")]
    hf_config: Option<PathBuf>,
    /// Override a field, e.g. `--set parallel.tp=4` (repeatable, applied in order).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[derive(clap::Args, Debug)]
struct PredictArgs {
    #[command(flatten)]
    job: JobArgs,
    /// Print the prediction as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Write a Perfetto/Chrome trace of the step (one track per rank and stream).
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
    /// Put at most this many replayed ranks in the trace (every stage is kept first); useful
    /// with --all-ranks on large jobs.
    #[arg(long, value_name = "N")]
    trace_limit: Option<usize>,
    /// Write SVG charts (memory timeline, time breakdown) into this folder.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Export every rank's graph as Chakra ET: `PREFIX.<rank>.et` plus `PREFIX.groups.json`.
    #[arg(long, value_name = "PREFIX")]
    chakra: Option<PathBuf>,
    /// Replay every rank instead of one per symmetry class (slow; the exact reference).
    #[arg(long)]
    all_ranks: bool,
    /// Network model: analytical (alpha-beta), flow (max-min fair sharing), packet (RDMA
    /// with DCQCN and PFC; slow for large messages) or fluid (the packet model's fabric
    /// with bytes as a fluid in fixed steps; approximate). Flow, packet and fluid simulate
    /// each distinct collective once, alone, on a rail-optimised topology of the group's
    /// hosts.
    #[arg(long, default_value = "analytical", value_parser = ["analytical", "flow", "packet", "fluid"])]
    network: String,
    #[command(flatten)]
    packet: packet_flags::PacketFlags,
}

#[derive(clap::Args, Debug)]
struct ReplayArgs {
    /// Trace prefix: reads PREFIX.0.et, PREFIX.1.et, ... until a rank is missing.
    prefix: PathBuf,
    /// Comm-group JSON (group name -> ranks); default PREFIX.groups.json.
    #[arg(long, value_name = "FILE")]
    groups: Option<PathBuf>,
    /// GPU preset the ranks run on.
    #[arg(long, default_value = "H100-SXM")]
    gpu: String,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u64,
    /// NIC bandwidth per GPU in Gb/s (default: the GPU preset's usual NIC).
    #[arg(long)]
    nic_gbps: Option<f64>,
    /// Use durations recorded in the traces instead of the cost model where present.
    #[arg(long)]
    measured: bool,
    #[arg(long)]
    json: bool,
}

/// An error caused by the user's input: reported with exit status 2.
#[derive(Debug)]
struct BadInput(String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

/// The problems of a command's input, gathered so that all are reported at once (each
/// check's message on a line of its own, exit status 2).
#[derive(Default)]
pub(crate) struct InputProblems(Vec<String>);

impl InputProblems {
    /// The value of a check that passed; a failed one's message is kept.
    pub(crate) fn check<T>(&mut self, result: Result<T>) -> Option<T> {
        result.map_err(|e| self.0.push(e.to_string())).ok()
    }

    pub(crate) fn push(&mut self, message: &str) {
        self.0.push(message.to_string());
    }

    /// Checks, before any work, that the folder output `path` (given by `flag`) is to be
    /// written in exists: a run of minutes that failed at its end for a mistyped folder
    /// would be lost.
    pub(crate) fn output(&mut self, flag: &str, path: Option<&Path>) {
        let Some(path) = path else { return };
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !dir.is_dir() {
            self.0.push(format!(
                "{flag}: cannot write {}: the folder {} does not exist",
                path.display(),
                dir.display()
            ));
        }
    }

    /// `value` (what the checks built) if no check failed, else every problem kept as one
    /// error. A check that built nothing kept its problem, so `value` is there when none is.
    pub(crate) fn finish<T>(self, value: Option<T>) -> Result<T> {
        match (self.0.is_empty(), value) {
            (true, Some(v)) => Ok(v),
            // Not expected (every check that builds nothing keeps its problem); said
            // rather than reported as an empty error.
            (true, None) => Err(anyhow::anyhow!(
                "a check of the input built nothing and kept no problem (a bug)"
            )),
            (false, _) => Err(bad(self.0.join("\n"))),
        }
    }
}

fn bad(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(BadInput(msg.into()))
}

/// Writes to stdout. When the reader has gone away (`orrery presets | head`) the program
/// ends quietly with success, as command-line tools do, instead of panicking.
fn emit(text: &str) {
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {e}");
        std::process::exit(1);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<BadInput>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Predict(args) => run_predict(&args),
        Command::Validate { json } => run_validate(json),
        Command::Replay(args) => run_replay(&args),
        Command::Emulate(args) => emulate::run_emulate(&args),
        Command::Collect(args) => collect::run_collect(&args),
        Command::Netsim(args) => netsim::run_netsim(&args),
        Command::Train(args) => train::run_train(&args),
        Command::Presets => {
            print_presets();
            Ok(())
        }
        Command::Bench { train, .. } if train.enabled => bench_train::run_train_bench(&train),
        // Checked here rather than by clap: `--json` needs either of two flags, which one
        // `requires` cannot say.
        Command::Bench {
            accel: false,
            ref train,
            ..
        } if train.json => Err(bad("--json: only with --train or --accel")),
        Command::Bench {
            emulate: true,
            emulate_gpus,
            runs,
            ..
        } => bench_emulate::run_emulate_bench(runs, &emulate_gpus),
        Command::Bench {
            emulate_fidelity: true,
            mpi,
            runs,
            ref device,
            ..
        } => {
            let device = if device == "cuda" {
                orrery_train::DeviceKind::Cuda
            } else {
                orrery_train::DeviceKind::Cpu
            };
            if mpi {
                bench_emulate::run_fidelity_bench_mpi(runs, device)
            } else {
                bench_emulate::run_fidelity_bench(runs, device)
            }
        }
        Command::Bench {
            accel: true,
            ring_mib,
            cross_pod_mib,
            seed_spread,
            label_spread,
            fluid,
            fluid_link_step_ns,
            gpt_gpus,
            gpt_13b_gpus,
            llama_pp_gpus,
            reference_max_gpus,
            no_moe,
            moe_gpus,
            no_pxn,
            routing,
            release,
            train,
            ..
        } => bench_accel::run_accel_bench(&bench_accel::AccelBench {
            ring_mib,
            cross_pod_mib,
            seed_spread,
            label_spread,
            fluid,
            fluid_link_step: fluid_link_step_ns
                .map(|ns| netsim::link_step("--fluid-link-step-ns", ns))
                .transpose()
                .map_err(bad)?,
            gpt_gpus,
            gpt_13b_gpus,
            llama_pp_gpus,
            moe_gpus: if no_moe { Vec::new() } else { moe_gpus },
            pxn: !no_pxn,
            routing: if routing == "pinned" {
                orrery_net::Routing::Pinned
            } else {
                orrery_net::Routing::Ecmp
            },
            reference_max_gpus,
            release: orrery_predict::traffic::Release::from_name(&release).unwrap_or_default(),
            json: train.json,
        }),
        Command::Bench { runs, .. } => run_bench(runs),
    }
}

/// Reads the job from a file, a preset or the default, applies overrides and validates:
/// the job, or `None` with every problem found kept in `problems`, which the caller
/// reports with its own flags' at once ([`InputProblems::finish`]).
fn load_job(args: &JobArgs, problems: &mut InputProblems) -> Option<Job> {
    let text = problems.check(match (&args.job, &args.preset) {
        (Some(path), _) => std::fs::read_to_string(path)
            .map_err(|e| bad(format!("cannot read job file {}: {e}", path.display()))),
        (None, name) => preset_job_text(name.as_deref().unwrap_or(presets::DEFAULT_JOB))
            .map(str::to_string)
            .map_err(|e| bad(e.to_string())),
    });
    let hf_model = args.hf_config.as_ref().and_then(|path| {
        problems.check(
            std::fs::read_to_string(path)
                .map_err(|e| bad(format!("cannot read {}: {e}", path.display())))
                .and_then(|json| {
                    hf::model_from_hf_config(&json)
                        .map_err(|e| bad(format!("{}: {e}", path.display())))
                }),
        )
    });
    let spec: Option<JobSpec> = text.and_then(|text| {
        problems.check(load_job_spec(&text, &args.set).map_err(|e| bad(e.to_string())))
    });
    spec.and_then(|mut spec| {
        if let Some(model) = hf_model {
            // Keep model fields the job or --set gave explicitly (sequence length, say).
            spec.model = merge_hf(model, &spec);
        }
        problems.check(Job::from_spec(&spec).map_err(|e| bad(e.to_string())))
    })
}

/// The HF model, with the job's explicit sequence length winning (configs state the
/// maximum context, jobs the training sequence).
fn merge_hf(mut model: orrery_spec::raw::ModelSpec, spec: &JobSpec) -> orrery_spec::raw::ModelSpec {
    if spec.model.seq_len.is_some() {
        model.seq_len = spec.model.seq_len;
    }
    model
}

fn run_predict(args: &PredictArgs) -> Result<()> {
    let mut problems = InputProblems::default();
    problems.output("--trace", args.trace.as_deref());
    problems.output("--chakra", args.chakra.as_deref());
    args.packet.check_outputs(&mut problems);
    if let Some(e) = args.packet.refuse_unless_packet(&args.network) {
        problems.push(&e.to_string());
    }
    let job = load_job(&args.job, &mut problems);
    let job = problems.finish(job)?;
    let mode = if args.all_ranks {
        ReplayMode::AllRanks
    } else {
        ReplayMode::Classes
    };
    let fabric = orrery_predict::fabric_for(&job);
    let spinner = progress_spinner("building and replaying the step");
    let out = match args.network.as_str() {
        "flow" => {
            let sim = orrery_net::flow_model::FlowLevelSimulator::default();
            simulated(&job, orrery_predict::sim_network_for(&job, sim), mode)?
        }
        "fluid" => {
            let sim = orrery_net::packet::FluidSimulator::default();
            simulated(&job, orrery_predict::sim_network_for(&job, sim), mode)?
        }
        "packet" => {
            // A clone shares the simulator's memo cache, so it holds what every
            // simulation of the step learned once the step has been predicted.
            let sim = args.packet.simulator();
            let out = simulated(
                &job,
                orrery_predict::sim_network_for(&job, sim.clone()),
                mode,
            )?;
            args.packet.save_cache(&sim)?;
            out
        }
        _ => {
            let net = orrery_net::AnalyticalNetwork::new(fabric, orrery_net::AlgorithmChoice::Auto);
            predict_with(&job, &net, mode).context("prediction failed")?
        }
    };
    spinner.finish_and_clear();
    let p = &out.prediction;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(p)?);
    } else {
        out!("{}", report::prediction(p));
    }
    if let Some(path) = &args.trace {
        let mut buf = Vec::new();
        let opts = orrery_predict::sinks::TraceOptions {
            max_participants: args.trace_limit,
            ..Default::default()
        };
        orrery_predict::sinks::write_perfetto_trace_with(&out, &opts, &mut buf)?;
        atomic_write(path, &buf)?;
        eprintln!("wrote trace {}", path.display());
    }
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let memory = orrery_predict::sinks::memory_timeline_svg(&out);
        atomic_write(&dir.join("memory.svg"), memory.as_bytes())?;
        let breakdown = orrery_predict::sinks::breakdown_svg(p);
        atomic_write(&dir.join("breakdown.svg"), breakdown.as_bytes())?;
        eprintln!(
            "wrote {}/memory.svg and {}/breakdown.svg",
            dir.display(),
            dir.display()
        );
    }
    if let Some(prefix) = &args.chakra {
        export_chakra(&out.graphs, prefix)?;
    }
    Ok(())
}

/// Predicts with a simulated network, reporting simulations that failed as warnings.
fn simulated<S: orrery_net::sim::FlowSimulator>(
    job: &Job,
    net: orrery_net::SimNetwork<S>,
    mode: ReplayMode,
) -> Result<orrery_predict::PredictOutput> {
    let mut out = predict_with(job, &net, mode).context("prediction failed")?;
    out.prediction.network_simulation = Some(net.totals());
    for f in net.failures() {
        out.prediction.warnings.push(format!(
            "network simulation failed, counted as zero time: {f}"
        ));
    }
    Ok(out)
}

fn export_chakra(graphs: &orrery_graph::JobGraphs, prefix: &Path) -> Result<()> {
    let world = graphs.layout.world_size();
    let bar = progress_bar(
        u64::from(world),
        "exporting Chakra ET {bar:40} {pos}/{len} ranks",
    );
    for r in 0..world {
        let mut buf = Vec::new();
        orrery_graph::chakra::export_rank(graphs, orrery_units::RankId(r), &mut buf)?;
        atomic_write(&with_suffix(prefix, &format!(".{r}.et")), &buf)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let groups = orrery_graph::chakra::comm_groups_json(graphs);
    atomic_write(&with_suffix(prefix, ".groups.json"), groups.as_bytes())?;
    eprintln!(
        "wrote {world} Chakra ET files with prefix {}",
        prefix.display()
    );
    Ok(())
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

fn run_replay(args: &ReplayArgs) -> Result<()> {
    // The traces', the groups file's and the flags' problems at once.
    let mut problems = InputProblems::default();
    let mut traces = Vec::new();
    loop {
        let path = with_suffix(&args.prefix, &format!(".{}.et", traces.len()));
        let Ok(bytes) = std::fs::read(&path) else {
            break;
        };
        // A corrupt rank is reported and the next ones read on, so every corrupt file is
        // named at once; its place is kept so the ranks keep their numbers.
        match orrery_graph::chakra::import_rank(&bytes) {
            Ok(rank) => traces.push(Some(rank)),
            Err(e) => {
                problems.push(&format!("{}: {e}", path.display()));
                traces.push(None);
            }
        }
    }
    if traces.is_empty() {
        problems.push(&format!(
            "no trace found at {}",
            with_suffix(&args.prefix, ".0.et").display()
        ));
    }
    let groups_path = args
        .groups
        .clone()
        .unwrap_or_else(|| with_suffix(&args.prefix, ".groups.json"));
    let groups: Option<std::collections::BTreeMap<String, Vec<u32>>> =
        match std::fs::read_to_string(&groups_path) {
            Ok(text) => problems.check(serde_json::from_str(&text).map_err(|e| {
                bad(format!(
                    "{}: not a comm-group JSON object of rank lists: {e}",
                    groups_path.display()
                ))
            })),
            Err(_) if args.groups.is_none() => Some(Default::default()),
            Err(e) => {
                problems.push(&format!("cannot read {}: {e}", groups_path.display()));
                None
            }
        };
    let preset = presets::gpu(&args.gpu);
    if preset.is_none() {
        problems.push(&format!("--gpu: unknown GPU `{}`", args.gpu));
    }
    if args.gpus_per_node == 0 {
        problems.push("--gpus-per-node must be at least 1");
    }
    if let Some(nic) = args.nic_gbps {
        if !(nic.is_finite() && nic > 0.0) {
            problems.push(&format!("--nic-gbps must be a positive number, got {nic}"));
        }
    }
    // Every rank, or none if one is corrupt.
    let traces: Option<Vec<_>> = traces.into_iter().collect();
    let (traces, (groups, preset)) = problems.finish(traces.zip(groups.zip(preset)))?;
    let ranks = traces.len() as u64;
    let mut cluster = orrery_spec::Cluster::of_preset(
        preset,
        args.gpus_per_node,
        ranks.div_ceil(args.gpus_per_node),
    );
    if let Some(nic) = args.nic_gbps {
        cluster.nic_bandwidth = orrery_units::Bandwidth::from_gbits_per_sec(nic);
    }
    let (report, _) =
        orrery_predict::traces::replay_traces(&traces, &groups, &cluster, args.measured)
            .map_err(|e| bad(e.to_string()))?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{}", report::trace_replay(&report));
    }
    Ok(())
}

fn run_validate(json: bool) -> Result<()> {
    let bar = progress_bar(0, "predicting published runs {bar:40} {pos}/{len}");
    let report = orrery_predict::validation::validate(|i, n| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
    })?;
    bar.finish_and_clear();
    if json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        out!("{}", report::validation(&report));
    }
    Ok(())
}

fn preset_job(name: &str) -> Result<Job> {
    let spec = load_job_spec(preset_job_text(name)?, &[])?;
    Job::from_spec(&spec).map_err(|e| anyhow::anyhow!("{e}"))
}

/// Median wall time of `runs` calls of `f`, in seconds.
fn median_secs(runs: u32, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut times = Vec::new();
    for _ in 0..runs {
        let t = std::time::Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Benchmark scenarios measured in one run, so ratios compare like with like.
fn run_bench(runs: u32) -> Result<()> {
    outln!("orrery bench: median of {runs} runs per scenario\n");
    for name in ["llama3-405b-h100x8192", "llama3-70b-h100x1024"] {
        let job = preset_job(name)?;
        let build = median_secs(runs, || {
            orrery_graph::build(&job);
            Ok(())
        })?;
        let mut ops = 0;
        let total = median_secs(runs, || {
            let out = orrery_predict::predict(&job)?;
            ops = out.prediction.graph_ops;
            Ok(())
        })?;
        outln!(
            "predict {name:<24} {:>4} GPUs: {:8.1} ms (graph build {:6.1} ms, {ops} ops, {:.2} M ops/s)",
            job.parallel().world_size(),
            total * 1e3,
            build * 1e3,
            ops as f64 / total / 1e6
        );
    }
    // Class replay against the all-rank reference on a job small enough for both.
    let job = preset_job("mixtral-8x7b-h100x64")?;
    let net = orrery_net::AnalyticalNetwork::new(
        orrery_predict::fabric_for(&job),
        orrery_net::AlgorithmChoice::Auto,
    );
    let mut steps = (orrery_units::Picos::ZERO, orrery_units::Picos::ZERO);
    let classes = median_secs(runs, || {
        steps.0 = predict_with(&job, &net, ReplayMode::Classes)?
            .prediction
            .step_time;
        Ok(())
    })?;
    let all = median_secs(runs, || {
        steps.1 = predict_with(&job, &net, ReplayMode::AllRanks)?
            .prediction
            .step_time;
        Ok(())
    })?;
    network_bench(runs)?;
    outln!(
        "\nclass replay vs all-rank replay (mixtral-8x7b-h100x64, 64 GPUs): {:.1} ms vs {:.1} ms, {:.1}x faster, step times {} ({} vs {})",
        classes * 1e3,
        all * 1e3,
        all / classes,
        if steps.0 == steps.1 { "identical" } else { "DIFFER" },
        steps.0,
        steps.1
    );
    Ok(())
}

/// Packet- versus flow-level (and fluid) simulation of one ring all-reduce, in one run.
fn network_bench(runs: u32) -> Result<()> {
    use orrery_net::sim::FlowSimulator;
    let graph = orrery_net::NetGraph::rail_optimized(&orrery_net::RailOptimizedSpec::dgx_h100(2))?;
    let mut set = orrery_net::flows::FlowSet::default();
    let ranks: Vec<u32> = (0..16).collect();
    orrery_net::flows::collective_flows(
        &mut set,
        "ring",
        orrery_net::CollectiveKind::AllReduce,
        orrery_net::flows::FlowAlgorithm::Ring { channels: 8 },
        &ranks,
        orrery_units::Bytes(64 << 20),
        8,
        orrery_units::Picos::from_nanos(2000),
    )?;
    let mut reports = (None, None);
    let packet = median_secs(runs, || {
        reports.0 = Some(
            orrery_net::packet::PacketSimulator::new(orrery_net::packet::PacketConfig::reference())
                .simulate(&graph, &set)?,
        );
        Ok(())
    })?;
    let flow = median_secs(runs, || {
        reports.1 =
            Some(orrery_net::flow_model::FlowLevelSimulator::default().simulate(&graph, &set)?);
        Ok(())
    })?;
    let mut fluid_report = None;
    let fluid = median_secs(runs, || {
        fluid_report = Some(orrery_net::packet::FluidSimulator::default().simulate(&graph, &set)?);
        Ok(())
    })?;
    // Fast-forwarding on long flows that settle: events and wall time with and without.
    let g = orrery_net::NetGraph::single_switch(
        8,
        orrery_units::Bandwidth::from_gbits_per_sec(100.0),
        orrery_units::Picos::from_nanos(1000),
    )?;
    let mut long = orrery_net::flows::FlowSet::default();
    for i in 0..4u32 {
        long.push_p2p(
            "long",
            2 * i,
            2 * i + 1,
            orrery_units::Bytes(64 << 20),
            orrery_units::Picos::ZERO,
        );
    }
    let mut ff = (None, None);
    let plain = median_secs(runs, || {
        ff.0 = Some(
            orrery_net::packet::PacketSimulator::new(orrery_net::packet::PacketConfig::reference())
                .simulate(&g, &long)?,
        );
        Ok(())
    })?;
    let mut config = orrery_net::packet::PacketConfig::reference();
    config.accel.fast_forward = true;
    let fast = median_secs(runs, || {
        ff.1 = Some(orrery_net::packet::PacketSimulator::new(config.clone()).simulate(&g, &long)?);
        Ok(())
    })?;
    if let (Some(a), Some(b)) = ff {
        outln!(
            "\n4 disjoint 64 MiB flows at 100G, packet level: fast-forward {:.1} ms wall ({} events) vs full {:.1} ms ({} events): {:.1}x fewer events, {:.1}x faster, end time {} vs {}",
            fast * 1e3,
            b.events,
            plain * 1e3,
            a.events,
            a.events as f64 / b.events.max(1) as f64,
            plain / fast,
            b.end,
            a.end
        );
    }
    if let (Some(p), Some(f)) = reports {
        outln!(
            "\n64 MiB ring all-reduce, 16 GPUs on 2 hosts: packet {:.1} ms wall ({} events, {:.1} M events/s, simulated {}) vs flow {:.2} ms wall ({} events, simulated {}): flow is {:.0}x faster, packet/flow simulated time {:.3}",
            packet * 1e3,
            p.events,
            p.events as f64 / packet / 1e6,
            p.end,
            flow * 1e3,
            f.events,
            f.end,
            packet / flow,
            p.end.as_secs_f64() / f.end.as_secs_f64()
        );
        if let Some(q) = fluid_report {
            outln!(
                "the fluid model on the same ring: {:.2} ms wall ({} steps, simulated {}): {:.0}x faster than packet, packet/fluid simulated time {:.4}",
                fluid * 1e3,
                q.events,
                q.end,
                packet / fluid,
                p.end.as_secs_f64() / q.end.as_secs_f64()
            );
        }
    }
    Ok(())
}

fn print_presets() {
    outln!("Jobs (orrery predict --preset NAME):");
    for name in presets::JOB_NAMES {
        let tag = if *name == presets::DEFAULT_JOB {
            " (default)"
        } else {
            ""
        };
        outln!("  {name}{tag}");
    }
    outln!("\nModels ([model] preset = \"NAME\"):");
    for name in presets::MODEL_NAMES {
        outln!("  {name}");
    }
    outln!("\nGPUs ([cluster] gpu = \"NAME\"):");
    for g in presets::GPUS {
        outln!(
            "  {:<10} {:>7.1} TFLOP/s bf16, {:>6.1} GiB HBM at {:>5.0} GB/s, NVLink {:>4.0} GB/s per direction",
            g.name, g.bf16_tflops, g.hbm_gib, g.hbm_gbps, g.nvlink_gbps
        );
    }
}

/// A progress bar of `len` steps drawn with `template` (indicatif's syntax).
fn progress_bar(len: u64, template: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

fn progress_spinner(msg: &'static str) -> indicatif::ProgressBar {
    let s = indicatif::ProgressBar::new_spinner();
    s.set_message(msg);
    s.enable_steady_tick(std::time::Duration::from_millis(120));
    s
}

/// Writes a file atomically: a temporary file in the same folder, fsync, then rename, so a
/// crash never leaves a half-written trace or chart behind. A path naming something that is
/// not a regular file (a device such as `/dev/null`, a FIFO) is written in place instead:
/// renaming over it would put a file where the device was, and every later reader of
/// `/dev/null` would read what was written there.
fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    atomic_write_with(path, |w| w.write_all(bytes))
}

/// [`atomic_write`] of what `fill` writes, streamed through a buffer rather than built in
/// memory first (a flow report of millions of flows is gigabytes of text).
fn atomic_write_with(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        let write = || -> std::io::Result<()> {
            let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
            fill(&mut w)?;
            w.flush()
        };
        return write().map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()));
    }
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        fill(&mut w)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::anyhow!("writing {}: {e}", path.display())
    })
}
