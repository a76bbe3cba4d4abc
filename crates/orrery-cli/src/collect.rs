//! `orrery collect` and `orrery emulate --train`: the real training program among virtual
//! peers.
//!
//! `orrery collect CONFIG --ranks W` runs one representative rank of each pipeline stage of
//! the W-rank world, `--slots` at a time, each as the only real rank of its world, and
//! writes what they recorded (compute segments with their measured durations and memory,
//! every collective and transfer) to a checksummed collection file. `orrery emulate --train
//! CONFIG --ranks W --real-ranks R` runs the chosen ranks live among virtual ones replayed
//! from a collection (`--graph`, or collected on the spot) and reports the emulated step.

use crate::emulate::{parse_ranks, perturbations, PerturbArgs};
use crate::InputProblems;
use crate::{atomic_write, bad, progress_bar};
use anyhow::{Context, Result};
use orrery_emulate::calibrate::MeasuredNetwork;
use orrery_emulate::drive::{collect, emulate, peak_and_compute, DriveError};
use orrery_emulate::file::CollectionFile;
use orrery_graph::collect::stitch;
use orrery_train::{Clock, MonotonicClock, TrainConfig};
use orrery_units::Picos;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct CollectArgs {
    /// A training configuration TOML (docs/train.md); its `[parallel]` section is the world.
    pub config: Option<PathBuf>,
    /// Ranks of the world (tp x pp x dp of the `[parallel]` section; any count for pure
    /// data parallelism).
    #[arg(long)]
    pub ranks: usize,
    /// Real ranks run at a time (`--comm threads`; default 1).
    #[arg(long)]
    pub slots: Option<usize>,
    /// `threads`: representatives of the world's ranks run as threads of this process,
    /// `--slots` at a time, among virtual peers. `mpi`: every rank is real, one process per
    /// rank of an MPI job (`mpirun -n RANKS orrery collect ... --comm mpi`; needs orrery
    /// built with `--features mpi`), and rank 0 writes every rank's record: the whole world
    /// collected from a real run, each rank's memory measured in a process of its own.
    #[arg(long, value_parser = ["threads", "mpi"], default_value = "threads")]
    pub comm: String,
    /// Untimed steps before the recorded one.
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// Where the collection goes.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Seconds a real rank may take over its warm-up and recorded steps before the
    /// collection gives up on it as hung (with `--comm mpi`, before the job is ended).
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Also export every rank's collected graph as Chakra ET, with the measured durations:
    /// `PREFIX.<rank>.et` plus `PREFIX.groups.json`.
    #[arg(long, value_name = "PREFIX")]
    pub chakra: Option<PathBuf>,
}

/// The training configuration a file holds, parsed but not validated (the caller validates
/// it once, after any overrides): every mistyped or unknown field is named at once.
pub fn read_train_config(path: &Path) -> Result<TrainConfig> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    TrainConfig::parse_toml_str(&text).map_err(|e| bad(e.to_string()))
}

/// The training configuration from a file, or the default one, validated.
pub fn train_config(path: Option<&Path>) -> Result<TrainConfig> {
    let config = path.map_or_else(|| Ok(TrainConfig::default()), read_train_config)?;
    config.validate().map_err(|e| bad(e.to_string()))?;
    crate::device::check_device(config.device, "device = \"cuda\"")?;
    Ok(config)
}

/// Maps errors of the input (configuration, its data, layout) to exit status 2.
fn input_error(e: DriveError) -> anyhow::Error {
    if e.is_input() {
        bad(e.to_string())
    } else {
        anyhow::Error::new(e)
    }
}

/// The longest `--timeout` taken: a year, far beyond any step, and far from overflowing the
/// clock's deadline arithmetic.
const MAX_TIMEOUT_SECS: u64 = 365 * 24 * 3600;

/// `--timeout` in seconds: zero would fail every run at once.
fn check_timeout(seconds: u64) -> Result<()> {
    if seconds == 0 || seconds > MAX_TIMEOUT_SECS {
        return Err(bad(format!(
            "--timeout must be between 1 and {MAX_TIMEOUT_SECS} seconds, not {seconds}"
        )));
    }
    Ok(())
}

fn clock() -> Arc<dyn Clock> {
    Arc::new(MonotonicClock::new())
}

fn run_collection(
    config: &TrainConfig,
    ranks: usize,
    slots: usize,
    warmup: u64,
    timeout: u64,
) -> Result<CollectionFile> {
    let layout = orrery_emulate::drive::layout_of(config, ranks).map_err(input_error)?;
    let bar = progress_bar(
        u64::from(layout.num_classes()),
        "collecting {bar:40} {pos}/{len} ranks",
    );
    let timeout = Duration::from_secs(timeout);
    let c = collect(
        config,
        ranks,
        slots,
        warmup,
        timeout,
        clock(),
        &mut |done, _| bar.set_position(done as u64),
    )
    .map_err(input_error)?;
    bar.finish_and_clear();
    collection_file(config, ranks, c.records)
}

/// The collection file of `records` from a world of `ranks` ranks of `config`.
fn collection_file(
    config: &TrainConfig,
    ranks: usize,
    records: Vec<orrery_graph::collect::RankRecord>,
) -> Result<CollectionFile> {
    let layout = orrery_emulate::drive::layout_of(config, ranks).map_err(input_error)?;
    let c0 = layout.coords(orrery_units::RankId(layout.world_size() - 1));
    Ok(CollectionFile {
        tp: c0.tp + 1,
        dp: c0.dp + 1,
        pp: c0.pp + 1,
        ep: config.parallel.map_or(1, |p| p.ep as u32),
        records,
    })
}

/// What one rank of a real run measured (`--comm mpi`): the reference an emulation of the
/// same world is compared with.
#[derive(serde::Serialize)]
struct MeasuredRank {
    rank: u32,
    step_ps: u64,
    compute_ps: u64,
    peak_memory_bytes: u64,
}

pub fn run_collect(args: &CollectArgs) -> Result<()> {
    let mut problems = InputProblems::default();
    problems.output("--out", Some(&args.out));
    problems.output("--chakra", args.chakra.as_deref());
    let config = problems.check(train_config(args.config.as_deref()));
    problems.check(check_timeout(args.timeout));
    let mpi = args.comm == "mpi";
    let slots = match (args.slots, mpi) {
        (Some(0), _) => {
            problems.push("--slots must be at least 1");
            1
        }
        // Every rank of an MPI job runs at once; a flag that would be ignored is refused.
        (Some(_), true) => {
            problems.push("--slots applies to --comm threads, not mpi");
            1
        }
        (slots, _) => slots.unwrap_or(1),
    };
    let config = problems.finish(config)?;
    let (file, measured) = if mpi {
        let timeout = Duration::from_secs(args.timeout);
        match mpi_collect::collect_this_rank(&config, args.ranks, args.warmup, timeout)? {
            Some((file, walls)) => {
                // Threads stitch as they collect; here the records meet for the first time.
                // A collection that does not stitch is not written.
                stitched(&file)?;
                let measured: Vec<MeasuredRank> = file
                    .records
                    .iter()
                    .zip(walls)
                    .map(|(record, wall)| {
                        let (peak, compute) = peak_and_compute(record);
                        MeasuredRank {
                            rank: record.rank,
                            step_ps: wall.0,
                            compute_ps: compute.0,
                            peak_memory_bytes: peak,
                        }
                    })
                    .collect();
                (file, Some(measured))
            }
            // Rank 0 writes the file; the others are done once they have sent their record.
            None => return Ok(()),
        }
    } else {
        let file = run_collection(&config, args.ranks, slots, args.warmup, args.timeout)?;
        (file, None)
    };
    atomic_write(&args.out, &file.to_bytes())?;
    if let Some(prefix) = &args.chakra {
        export_collected(&file, prefix)?;
    }
    let ops: usize = file.records.iter().map(|r| r.ops.len()).sum();
    if args.json {
        let v = serde_json::json!({
            "world_size": args.ranks,
            "ranks_collected": file.records.len(),
            "recorded_ops": ops,
            "out": args.out,
            "real_run": measured,
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    outln!(
        "collected {} ranks of {} ({} recorded ops) into {}",
        file.records.len(),
        args.ranks,
        ops,
        args.out.display()
    );
    if let Some(measured) = measured {
        outln!("\nwhat the real run measured (every rank real, a process each):");
        outln!(
            "{:>6}  {:>12}  {:>12}  {:>14}",
            "rank",
            "step",
            "compute",
            "peak memory"
        );
        for m in &measured {
            outln!(
                "{:>6}  {:>9.3} ms  {:>9.3} ms  {:>12} B",
                m.rank,
                m.step_ps as f64 / 1e9,
                m.compute_ps as f64 / 1e9,
                m.peak_memory_bytes
            );
        }
    }
    Ok(())
}

/// The world's graphs of a collection.
fn stitched(file: &CollectionFile) -> Result<orrery_graph::collect::Collected> {
    file_world(file)?;
    let layout = orrery_emulate::drive::world_layout(file.tp, file.dp, file.pp, file.ep);
    stitch(layout, &file.records).map_err(|e| bad(e.to_string()))
}

/// The world a collection file describes, checked (a file is untrusted input).
fn file_world(file: &CollectionFile) -> Result<usize> {
    let world = file
        .tp
        .checked_mul(file.dp)
        .and_then(|x| x.checked_mul(file.pp))
        .filter(|&w| w > 0 && w <= 1 << 20)
        .ok_or_else(|| {
            bad(format!(
                "the collection's world (tp {} x dp {} x pp {}) is empty or too large",
                file.tp, file.dp, file.pp
            ))
        })?;
    if file.ep == 0 || !file.dp.is_multiple_of(file.ep) {
        return Err(bad(format!(
            "the collection's ep {} does not divide its dp {}",
            file.ep, file.dp
        )));
    }
    Ok(world as usize)
}

/// Every rank's collected graph as Chakra ET with its measured durations.
fn export_collected(file: &CollectionFile, prefix: &Path) -> Result<()> {
    use orrery_graph::chakra::{comm_groups_json, export_rank_with_times, OpTime};
    let c = stitched(file)?;
    let layout = &c.graphs.layout;
    let with_suffix = |s: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(s);
        PathBuf::from(p)
    };
    for r in 0..layout.world_size() {
        let rank = orrery_units::RankId(r);
        let times: Vec<OpTime> = c.measured[layout.class_of(rank).index()]
            .iter()
            .map(|d| OpTime {
                start: Picos::ZERO,
                duration: d.unwrap_or(Picos::ZERO),
            })
            .collect();
        let mut buf = Vec::new();
        export_rank_with_times(&c.graphs, rank, &times, &mut buf)?;
        atomic_write(&with_suffix(&format!(".{r}.et")), &buf)?;
    }
    atomic_write(
        &with_suffix(".groups.json"),
        comm_groups_json(&c.graphs).as_bytes(),
    )?;
    eprintln!(
        "wrote {} Chakra ET files with prefix {}",
        layout.world_size(),
        prefix.display()
    );
    Ok(())
}

/// `orrery collect --comm mpi`: this process is one rank of an MPI job whose every rank is
/// real.
#[cfg(feature = "mpi")]
mod mpi_collect {
    use super::{clock, collection_file, input_error};
    use crate::bad;
    use crate::train::mpi_rank::or_abort;
    use anyhow::Result;
    use orrery_emulate::drive::record_real_rank;
    use orrery_emulate::file::CollectionFile;
    use orrery_graph::collect::RankRecord;
    use orrery_train::{Communicator, MpiComm, TrainConfig};
    use orrery_units::Picos;
    use std::time::Duration;

    /// Records this rank's step and gathers every rank's record on rank 0, which gets the
    /// collection file and each rank's step time; the other ranks get `None`. A rank that
    /// fails or panics ends the whole job (its peers would otherwise wait for it forever),
    /// with status 2 for bad input; one that has not gathered within `timeout` ends it too.
    pub fn collect_this_rank(
        config: &TrainConfig,
        ranks: usize,
        warmup: u64,
        timeout: Duration,
    ) -> Result<Option<(CollectionFile, Vec<Picos>)>> {
        let comm = MpiComm::init().map_err(|e| bad(format!("--comm mpi: {e}")))?;
        // Every rank sees the same arguments, so every rank refuses alike and ends normally.
        if comm.world_size() != ranks {
            return Err(bad(format!(
                "--ranks {ranks}, but the MPI job has {} processes (mpirun -n {ranks})",
                comm.world_size()
            )));
        }
        // Checked before the rank starts (`record_real_rank` checks again) so that a layout
        // that does not fit ends every rank normally with status 2, not the job by MPI_Abort.
        orrery_emulate::drive::layout_of(config, ranks).map_err(input_error)?;
        let abort = comm.abort_handle();
        let mut gatherer = comm.second_handle();
        let rank = comm.rank();
        // The watchdog: a rank still working at the deadline (hung, or waiting for one that
        // is) leaves without finalising MPI, and the launcher ends the job. It exits rather
        // than calling MPI from this thread, which MPI_THREAD_SERIALIZED does not allow.
        let (done, finished) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(timeout)
            {
                eprintln!(
                    "error: MPI rank {rank} did not finish its steps within {} s (hung?)",
                    timeout.as_secs()
                );
                std::process::exit(1);
            }
        });
        let all = or_abort(&abort, "collection failed", || {
            let step = record_real_rank(config, ranks, comm, warmup, clock())
                .map_err(|e| (if e.is_input() { 2 } else { 1 }, e.to_string()))?;
            let mine = serde_json::to_vec(&(step.record, step.wall))
                .map_err(|e| (1, format!("rank {rank}: {e}")))?;
            gatherer
                .all_gather_bytes(&mine)
                .map_err(|e| (1, format!("rank {rank}: gathering the records: {e}")))
        });
        drop(done);
        if rank != 0 {
            return Ok(None);
        }
        let steps = all
            .iter()
            .map(|b| serde_json::from_slice::<(RankRecord, Picos)>(b))
            .collect::<Result<Vec<_>, _>>()?;
        let (records, walls) = steps.into_iter().unzip();
        Ok(Some((collection_file(config, ranks, records)?, walls)))
    }
}

/// Without the `mpi` feature no process can join an MPI job: `--comm mpi` is refused.
#[cfg(not(feature = "mpi"))]
mod mpi_collect {
    use crate::bad;
    use anyhow::Result;
    use orrery_emulate::file::CollectionFile;
    use orrery_train::TrainConfig;
    use orrery_units::Picos;

    pub fn collect_this_rank(
        _config: &TrainConfig,
        _ranks: usize,
        _warmup: u64,
        _timeout: std::time::Duration,
    ) -> Result<Option<(CollectionFile, Vec<Picos>)>> {
        Err(bad(crate::train::NO_MPI))
    }
}

/// The cost model and network of the cluster the real program's `ranks` are modelled on:
/// `gpu`'s preset, [`orrery_emulate::drive::GPUS_PER_NODE`] to a node, its usual NIC.
pub fn program_models(
    gpu: &str,
    ranks: usize,
) -> Result<(orrery_predict::CostModel, orrery_net::AnalyticalNetwork)> {
    let preset =
        orrery_spec::presets::gpu(gpu).ok_or_else(|| bad(format!("--gpu: unknown GPU `{gpu}`")))?;
    let per_node = u64::from(orrery_emulate::drive::GPUS_PER_NODE).min(ranks as u64);
    let cluster =
        orrery_spec::Cluster::of_preset(preset, per_node, (ranks as u64).div_ceil(per_node));
    let net = orrery_net::AnalyticalNetwork::new(
        orrery_predict::fabric_of(&cluster),
        orrery_net::AlgorithmChoice::Auto,
    );
    Ok((orrery_predict::CostModel::for_gpu(&cluster.gpu), net))
}

/// `collected` replayed with no real rank, every rank at its recorded durations, on `net`:
/// what a prediction from the collection says its step takes.
pub fn replayed_alone<N: orrery_net::NetworkModel>(
    collected: &orrery_graph::collect::Collected,
    cost: &orrery_predict::CostModel,
    net: &N,
) -> Result<Picos> {
    let mut parts = orrery_predict::replay::job_participants(
        &collected.graphs,
        orrery_predict::ReplayMode::Classes,
    );
    for p in &mut parts {
        p.measured = collected.measured.get(p.class.index()).cloned();
    }
    Ok(orrery_predict::replay::replay_participants(
        parts,
        cost,
        net,
        orrery_predict::ReplayMode::Classes,
    )
    .context("replaying the collection")?
    .step_time())
}

/// `orrery emulate --train`'s own options.
#[derive(clap::Args, Debug, Default)]
pub struct TrainEmulateArgs {
    /// Emulate the real training program with this configuration TOML (instead of a job):
    /// the real ranks run it live.
    #[arg(long, value_name = "CONFIG", conflicts_with_all = ["job", "preset", "hf_config"])]
    pub train: Option<PathBuf>,
    /// With --train: ranks of the world.
    #[arg(long, requires = "train")]
    pub ranks: Option<usize>,
    /// With --train: the collection to replay virtual ranks from (`orrery collect`);
    /// without it, one is collected first.
    #[arg(long, value_name = "FILE", requires = "train")]
    pub graph: Option<PathBuf>,
    /// With --train: untimed steps before the emulated one.
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// With --train: seconds a real rank may go without reporting before the emulation
    /// fails (a hung rank); without --graph, also what each rank collected first may take.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// With --train: the GPU preset whose cluster the virtual ranks' network is modelled
    /// on (8 per node, its usual NIC).
    #[arg(long, default_value = "H100-SXM")]
    pub gpu: String,
    /// With --train and --graph: collectives and point-to-point transfers take the time the
    /// collection measured (a real run's: `orrery collect --comm mpi`): a collective's size
    /// and group size the median over its instances of its fastest member's time, a
    /// transfer's size the median over transfers of the shorter of its send and receive;
    /// anything not measured is the --gpu cluster's.
    #[arg(long, requires = "graph")]
    pub calibrate: bool,
}

pub fn run_train_emulation(
    args: &TrainEmulateArgs,
    real_ranks: &str,
    perturb_args: &PerturbArgs,
    json: bool,
    trace: Option<&Path>,
) -> Result<()> {
    let mut problems = InputProblems::default();
    problems.output("--trace", trace);
    let config = problems.check(train_config(args.train.as_deref()));
    let ranks = problems.check(args.ranks.ok_or_else(|| bad("--train needs --ranks")));
    problems.check(check_timeout(args.timeout));
    let live = problems.check(parse_ranks("--real-ranks", real_ranks));
    let perturb = problems.check(perturbations(perturb_args));
    let (config, ranks, live, perturb) = problems.finish(
        config
            .zip(ranks)
            .zip(live.zip(perturb))
            .map(|((c, r), (l, p))| (c, r, l, p)),
    )?;
    let file = match &args.graph {
        Some(path) => {
            let bytes = std::fs::read(path)
                .map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
            CollectionFile::from_bytes(&bytes)
                .map_err(|e| bad(format!("{}: {e}", path.display())))?
        }
        None => run_collection(&config, ranks, 1, args.warmup, args.timeout)?,
    };
    let world = file_world(&file)?;
    if world != ranks {
        return Err(bad(format!(
            "--ranks {ranks}: the collection is of a world of {world}"
        )));
    }
    // The configuration must describe the collection's world, or the real ranks would
    // issue other operations than the virtual ones replay.
    let expected = orrery_emulate::drive::layout_of(&config, ranks).map_err(input_error)?;
    let c = expected.coords(orrery_units::RankId(expected.world_size() - 1));
    let config_ep = config.parallel.map_or(1, |p| p.ep as u32);
    if (c.tp + 1, c.dp + 1, c.pp + 1, config_ep) != (file.tp, file.dp, file.pp, file.ep) {
        return Err(bad(format!(
            "--graph: the collection is of tp {} x dp {} x pp {} (ep {}), the configuration of tp {} x dp {} x pp {} (ep {})",
            file.tp,
            file.dp,
            file.pp,
            file.ep,
            c.tp + 1,
            c.dp + 1,
            c.pp + 1,
            config_ep
        )));
    }
    let collected = stitched(&file)?;
    let (cost, analytical) = program_models(&args.gpu, ranks)?;
    // Without --calibrate the table is empty and every answer is the cluster model's.
    let measured: &[orrery_graph::collect::RankRecord] =
        if args.calibrate { &file.records } else { &[] };
    let net = MeasuredNetwork::from_records(measured, world as u32, analytical);
    if args.calibrate && net.calibrated() + net.calibrated_transfers() == 0 {
        return Err(bad(
            "--calibrate: the collection measured no collective and no transfer (ranks \
             collected among virtual peers spend no time in them; collect a real run with \
             --comm mpi)",
        ));
    }
    let network = if args.calibrate {
        format!(
            "collectives ({} sizes) and point-to-point transfers ({} sizes) as measured in \
             the collection, the rest on the {} cluster model",
            net.calibrated(),
            net.calibrated_transfers(),
            args.gpu
        )
    } else {
        format!("communication on the {} cluster model", args.gpu)
    };
    let run = emulate(
        &config,
        &collected,
        &cost,
        &net,
        &live,
        &perturb,
        args.warmup,
        Duration::from_secs(args.timeout),
        clock(),
    )
    .map_err(input_error)?;
    let mut rows = Vec::new();
    for rec in run.records.iter().map(|s| &s.record) {
        let (peak, compute) = peak_and_compute(rec);
        let recorded = run
            .step
            .segments
            .iter()
            .find(|(r, _)| r.0 == rec.rank)
            .map_or(Picos::ZERO, |(_, s)| {
                Picos(s.iter().fold(0u64, |a, x| a.saturating_add(x.1 .0)))
            });
        let end = run
            .step
            .timeline
            .participants
            .iter()
            .find(|p| p.rank.0 == rec.rank)
            .map_or(Picos::ZERO, |p| p.end());
        rows.push((rec.rank, end, compute, recorded, peak));
    }
    let step = run.step.timeline.step_time();
    // Side by side: the collected step replayed on its own (every rank at its recorded
    // durations), what a prediction from the collection says.
    let replayed = replayed_alone(&collected, &cost, &net)?;
    if let Some(path) = trace {
        let labels: Vec<String> = run
            .step
            .participants
            .iter()
            .map(|i| {
                let stage = collected.graphs.layout.coords(i.rank).pp;
                if i.live {
                    format!("real rank {} (stage {stage})", i.rank.0)
                } else {
                    format!(
                        "{} virtual ranks like rank {} (stage {stage})",
                        i.stands_for, i.rank.0
                    )
                }
            })
            .collect();
        let meta = orrery_predict::sinks::TraceMeta {
            job: format!(
                "orrery train {}",
                args.train
                    .as_deref()
                    .map_or("(default)".into(), |p| p.display().to_string())
            ),
            gpu: match config.device {
                orrery_train::DeviceKind::Cpu => "CPU (measured), virtual ranks collected",
                orrery_train::DeviceKind::Cuda => "CUDA GPU (measured), virtual ranks collected",
            }
            .into(),
            network_model: format!(
                "{} ({})",
                if args.calibrate {
                    "measured"
                } else {
                    "analytical"
                },
                args.gpu
            ),
            world_size: ranks as u64,
            step_time: step,
            mfu: 0.0,
        };
        let opts = orrery_predict::sinks::TraceOptions {
            max_participants: None,
            labels: Some(&labels),
        };
        let mut buf = Vec::new();
        orrery_predict::sinks::write_timeline_trace(
            &collected.graphs,
            &run.step.timeline,
            &meta,
            &opts,
            &mut buf,
        )?;
        atomic_write(path, &buf)?;
        eprintln!("wrote trace {}", path.display());
    }
    // Virtual ranks, one row per class: its end and its peak memory from the collected
    // graph.
    let mut virtual_rows = Vec::new();
    for (info, t) in run
        .step
        .participants
        .iter()
        .zip(&run.step.timeline.participants)
    {
        if info.live {
            continue;
        }
        let graph = collected.graphs.class(info.class);
        let peak = orrery_predict::memory::ledger(graph, t)
            .map(|l| l.peak.0)
            .context("memory ledger of a collected graph")?;
        virtual_rows.push((info.rank.0, info.stands_for, t.end(), peak));
    }
    if json {
        let ranks_json: Vec<serde_json::Value> = rows
            .iter()
            .map(|&(rank, end, compute, recorded, peak)| {
                serde_json::json!({
                    "rank": rank,
                    "end_ps": end.0,
                    "compute_ps": compute.0,
                    "collected_compute_ps": recorded.0,
                    "peak_memory_bytes": peak,
                })
            })
            .collect();
        let virtual_json: Vec<serde_json::Value> = virtual_rows
            .iter()
            .map(|&(rank, n, end, peak)| {
                serde_json::json!({
                    "rank": rank,
                    "stands_for": n,
                    "end_ps": end.0,
                    "peak_memory_bytes": peak,
                })
            })
            .collect();
        let v = serde_json::json!({
            "world_size": ranks,
            "network": network,
            "engine_wall_ms": run.step.engine.as_secs_f64() * 1e3,
            "collected_step_time_ps": replayed.0,
            "participants": run.step.timeline.participants.len(),
            "step_time_ps": step.0,
            "real_ranks": ranks_json,
            "virtual_ranks": virtual_json,
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "orrery emulate --train: {ranks} ranks, real ranks {real_ranks}, {} participants",
        run.step.timeline.participants.len()
    );
    let _ = writeln!(s, "  virtual ranks replay the collected step; {network}");
    let _ = writeln!(
        s,
        "\nemulated step time: {:.3} ms (the collected step replayed alone: {:.3} ms, {:+.2}%)",
        step.as_millis_f64(),
        replayed.as_millis_f64(),
        100.0 * (step.0 as f64 - replayed.0 as f64) / (replayed.0 as f64).max(1.0)
    );
    let real_compute = rows.iter().map(|r| r.2 .0).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "emulation engine: {:.3} ms of wall time for the step ({:.2}% of the real ranks' compute)\n",
        run.step.engine.as_secs_f64() * 1e3,
        100.0 * run.step.engine.as_secs_f64() / (real_compute as f64 / 1e12).max(f64::MIN_POSITIVE)
    );
    let _ = writeln!(
        s,
        "  {:>5}  {:>12}  {:>14}  {:>18}  {:>12}",
        "rank", "step end", "compute (now)", "compute (collected)", "peak memory"
    );
    for (rank, end, compute, recorded, peak) in rows {
        let _ = writeln!(
            s,
            "  {:>5}  {:>9.3} ms  {:>11.3} ms  {:>15.3} ms  {:>8.2} MiB",
            rank,
            end.as_millis_f64(),
            compute.as_millis_f64(),
            recorded.as_millis_f64(),
            peak as f64 / (1u64 << 20) as f64
        );
    }
    for (rank, n, end, peak) in virtual_rows {
        let _ = writeln!(
            s,
            "  {:>5}  {:>9.3} ms  {:>14}  {:>18}  {:>8.2} MiB   (virtual, stands for {})",
            format!("{rank}*"),
            end.as_millis_f64(),
            "-",
            "-",
            peak as f64 / (1u64 << 20) as f64,
            n
        );
    }
    out!("{s}");
    Ok(())
}
