//! `orrery bench --emulate`: what hybrid emulation's engine costs as the world grows.
//!
//! The scenario is the default job (Llama-3 70B, TP 8 x interleaved PP 4) with its
//! data-parallel degree scaled so that the world has 1,024 to 8,192 GPUs, one real rank
//! (rank 0) and pruning on. Per world size the table shows the participants replayed, the
//! engine's events, its wall time per step (the median of `runs`; it includes building the
//! graphs and setting the emulation up, which a run does once), the real rank's compute
//! in the emulated step and the ratio of the two: the overhead emulation adds to every step
//! of the real rank. The real rank's compute is the cost model's (a job, not the training
//! program: `--emulate-fidelity` measures that), so the ratio is against the GPU time the
//! rank would spend. The
//! process's peak resident memory after each world size is read from `/proc/self/status`;
//! world sizes run in increasing order, so its growth is what the larger world added. An
//! unpruned emulation of the smallest world, once, shows what pruning saves.

use crate::median_secs;
use anyhow::{Context, Result};
use orrery_predict::emulate::{Emulation, Perturbations, Pruning};
use orrery_spec::{load_job_spec, preset_job_text, presets, Job};
use orrery_train::{Clock, DeviceKind, MonotonicClock, TrainConfig};
use orrery_units::{Picos, RankId};
use std::sync::Arc;

/// Peak resident set of this process in KiB (`VmHWM`), if the system tells.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The default job on `gpus` GPUs: 32 micro-batches per data-parallel replica, as at 1,024.
fn job_on(gpus: u32) -> Result<Job> {
    let nodes = gpus / 8;
    let dp = gpus / 32;
    let overrides = vec![
        format!("cluster.nodes={nodes}"),
        format!("training.global_batch={}", 32 * dp),
    ];
    let spec = load_job_spec(preset_job_text(presets::DEFAULT_JOB)?, &overrides)?;
    Job::from_spec(&spec).map_err(|e| anyhow::anyhow!("{e}"))
}

struct Measured {
    participants: usize,
    events: u64,
    real_compute: Picos,
}

/// One emulated step with rank 0 live, fed the cost model's durations.
fn emulate_once(job: &Job, pruning: Pruning) -> Result<Measured> {
    let graphs = orrery_graph::build(job);
    let cost = orrery_predict::CostModel::for_gpu(&job.cluster().gpu);
    let net = orrery_net::AnalyticalNetwork::new(
        orrery_predict::fabric_for(job),
        orrery_net::AlgorithmChoice::Auto,
    );
    let live = [RankId(0)];
    let emu = Emulation::new(
        &graphs,
        &cost,
        &net,
        &live,
        pruning,
        &Perturbations::default(),
    )?;
    let participants = emu.participants().len();
    let (timeline, supplied) = emu.run_modelled()?;
    Ok(Measured {
        participants,
        events: timeline.events,
        real_compute: Picos(supplied.values().map(|d| d.0).sum()),
    })
}

pub fn run_emulate_bench(runs: u32, gpus: &[u32]) -> Result<()> {
    // Every world size is checked before anything runs, and every wrong one named.
    let mut problems = crate::InputProblems::default();
    for &g in gpus {
        if g < 32 || g % 32 != 0 {
            problems.push(&format!(
                "--emulate-gpus: {g} is not a multiple of 32 (TP 8 x PP 4)"
            ));
        }
    }
    problems.finish(Some(()))?;
    outln!(
        "orrery bench --emulate: {} with one real rank (rank 0), pruned; median of {runs} runs",
        presets::DEFAULT_JOB
    );
    outln!(
        "the real rank's compute is the cost model's (a job; --emulate-fidelity runs the training program)\n"
    );
    outln!(
        "{:>6}  {:>12}  {:>9}  {:>14}  {:>16}  {:>9}  {:>14}",
        "GPUs",
        "participants",
        "events",
        "engine / step",
        "real compute",
        "overhead",
        "peak RSS"
    );
    for &g in gpus {
        let job = job_on(g)?;
        let mut m = None;
        let secs = median_secs(runs, || {
            m = Some(emulate_once(&job, Pruning::Classes)?);
            Ok(())
        })?;
        let m = m.context("no run")?;
        let real = m.real_compute.as_secs_f64();
        outln!(
            "{:>6}  {:>12}  {:>9}  {:>11.1} ms  {:>13.1} ms  {:>8.3}%  {:>10} MiB",
            g,
            m.participants,
            m.events,
            secs * 1e3,
            real * 1e3,
            100.0 * secs / real.max(f64::MIN_POSITIVE),
            peak_rss_kib().map_or("?".to_string(), |k| (k / 1024).to_string())
        );
    }
    if let Some(&smallest) = gpus.iter().min() {
        let job = job_on(smallest)?;
        let mut m = None;
        let secs = median_secs(1, || {
            m = Some(emulate_once(&job, Pruning::None)?);
            Ok(())
        })?;
        let m = m.context("no run")?;
        outln!(
            "\nunpruned, {smallest} GPUs (once): {} participants, {} events, {:.1} ms, peak RSS {} MiB",
            m.participants,
            m.events,
            secs * 1e3,
            peak_rss_kib().map_or("?".to_string(), |k| (k / 1024).to_string())
        );
    }
    Ok(())
}

/// The training program both fidelity benches run: 4 layers, d_model 128, context 64, a batch
/// of 16, on `device`; laid out as [`fidelity_worlds`] lists.
fn fidelity_base(device: DeviceKind) -> TrainConfig {
    use orrery_train::ModelConfig;
    TrainConfig {
        model: ModelConfig {
            context: 64,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            d_ff: 512,
            ..ModelConfig::default()
        },
        steps: 8,
        batch_size: 16,
        warmup_steps: 1,
        eval_every: 0,
        device,
        ..TrainConfig::default()
    }
}

/// The fidelity benches' worlds: name, configuration, ranks.
///
/// Four-rank worlds need a core per rank when every rank computes at once (TP 2 x PP 2 with
/// four micro-batches keeps both stages busy). With one micro-batch the pipeline runs one
/// stage at a time, so at most two ranks compute at once (but for the weight update at the
/// step's end, where all four do), and a two-core machine hosts most of the all-real step
/// without its ranks queueing for a core: those worlds are the four-rank comparison such a
/// machine can make.
fn fidelity_worlds(device: DeviceKind) -> [(&'static str, TrainConfig, usize); 4] {
    use orrery_train::ParallelConfig;
    let base = fidelity_base(device);
    let layout = |tp: usize, dp: usize, micro_batches: usize| TrainConfig {
        parallel: Some(ParallelConfig {
            tp,
            pp: 2,
            dp,
            micro_batches,
            ..ParallelConfig::default()
        }),
        ..base.clone()
    };
    [
        ("DP 2", base.clone(), 2),
        ("TP 2 x PP 2", layout(2, 1, 4), 4),
        ("TP 2 x PP 2, 1 micro-batch", layout(2, 1, 1), 4),
        ("DP 2 x PP 2, 1 micro-batch", layout(1, 2, 1), 4),
    ]
}

/// `device`'s name in the benches' headers.
fn device_name(device: DeviceKind) -> &'static str {
    match device {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
    }
}

/// The networks a fidelity bench emulates on, in [`WorldRuns::emulated`]'s order: whether
/// the virtual ranks' communication takes the times the real run measured
/// (`orrery emulate --train --calibrate`) instead of the H100 cluster model's.
const CALIBRATED: [bool; 2] = [false, true];

/// What a fidelity bench measured on one world. Each run is an all-real step and, next to it
/// in time, emulations of rank 0 with the virtual ranks replayed from that run's own
/// collection, one per network of [`CALIBRATED`].
#[derive(Debug, Default)]
struct WorldRuns {
    real_steps: Vec<u64>,
    /// Rank 0's peak in the all-real step.
    real_peaks: Vec<u64>,
    /// Per network of [`CALIBRATED`]: the emulated steps and rank 0's emulated peaks.
    emulated: [(Vec<u64>, Vec<u64>); 2],
    /// The run's own collection replayed with no real rank, on the measured network.
    replayed: Vec<u64>,
}

impl WorldRuns {
    /// Prints the world's rows, one per network, and returns the paired errors of the runs'
    /// collections replayed alone.
    fn print(self, name: &str, world: usize) -> Vec<f64> {
        let replayed = paired_errors(&self.real_steps, &self.replayed);
        let [(h100_steps, h100_peaks), (measured_steps, measured_peaks)] = self.emulated;
        fidelity_row(
            &format!("{name}, H100 net"),
            world,
            self.real_steps.clone(),
            h100_steps,
            self.real_peaks.clone(),
            h100_peaks,
        );
        fidelity_row(
            &format!("{name}, measured net"),
            world,
            self.real_steps,
            measured_steps,
            self.real_peaks,
            measured_peaks,
        );
        replayed
    }
}

/// The footer of both fidelity benches: how far each real run's own records, replayed with
/// no real rank, are from its step. That is the part of an error that no real rank caused
/// (on two cores, ranks of the real run waiting for a core, which a replay never does;
/// docs/emulate.md).
fn print_replays(replays: &[(String, Vec<f64>)]) {
    outln!("\neach real run's own collection replayed alone (every rank at its recorded durations, measured net), against its step: paired error, median [min, max]");
    for (name, errors) in replays {
        outln!("{name:<44} {}", fmt_paired(errors));
    }
}

/// A fresh wall clock for a run.
fn wall_clock() -> Arc<dyn Clock> {
    Arc::new(MonotonicClock::new())
}

/// `orrery bench --emulate-fidelity`: emulation with one real rank against the same step
/// with every rank real, as threads of this process, on worlds small enough to run here,
/// each rank computing on `device`.
///
/// Each run's all-real step is recorded as `orrery collect --comm mpi` records a real run,
/// and its own collection is what the emulations next to it replay, as the `--mpi` bench
/// does: so the two benches differ only in where the ranks live. On a machine with a core
/// per rank (or a GPU) this is the step-time comparison that two cores cannot make.
pub fn run_fidelity_bench(runs: u32, device: DeviceKind) -> Result<()> {
    use orrery_emulate::calibrate::MeasuredNetwork;
    use orrery_emulate::drive::{layout_of, peak_and_compute, run_all_real};
    use orrery_graph::collect::{stitch, RankRecord};
    check_device(device)?;
    let base = fidelity_base(device);
    let on = device_name(device);
    outln!("orrery bench --emulate-fidelity: one real rank (rank 0) against every rank real (threads of one process, computing on {on}); median of {runs} runs");
    outln!("virtual ranks replay each real run's own collection; their collectives and transfers are modelled on an H100 cluster (H100 net) or take the times the real run measured (measured net, --calibrate); the real run's are in-process");
    outln!("threads of one process free some of each other's blocks (burn keeps one autodiff registry per process), which moves their peaks by some KB: --mpi runs each measurement in a process of its own\n");
    fidelity_header();
    let mut replays: Vec<(String, Vec<f64>)> = Vec::new();
    for (name, config, world) in fidelity_worlds(device) {
        let layout = layout_of(&config, world)?;
        let (cost, cluster) = crate::collect::program_models("H100-SXM", world)?;
        let mut runs_of_world = WorldRuns::default();
        for _ in 0..runs {
            let all = run_all_real(&config, world, 1, wall_clock())?;
            runs_of_world
                .real_steps
                .push(all.iter().map(|s| s.wall.0).max().unwrap_or(0));
            runs_of_world
                .real_peaks
                .push(all.first().map_or(0, |s| peak_and_compute(&s.record).0));
            let records: Vec<RankRecord> = all.into_iter().map(|s| s.record).collect();
            let own = stitch(layout.clone(), &records)
                .map_err(|e| anyhow::anyhow!("the all-real run's records: {e}"))?;
            for (calibrated, (steps, peaks)) in
                CALIBRATED.into_iter().zip(&mut runs_of_world.emulated)
            {
                // Without calibration the table is empty and every answer is the cluster's.
                let measured: &[RankRecord] = if calibrated { &records } else { &[] };
                let net = MeasuredNetwork::from_records(measured, world as u32, cluster);
                let e = emulate_rank_0(&config, &own, &cost, &net)?;
                steps.push(e.step.timeline.step_time().0);
                peaks.push(
                    e.records
                        .first()
                        .map_or(0, |s| peak_and_compute(&s.record).0),
                );
                if calibrated {
                    let alone = crate::collect::replayed_alone(&own, &cost, &net)?;
                    runs_of_world.replayed.push(alone.0);
                }
            }
        }
        let replayed = runs_of_world.print(name, world);
        replays.push((format!("{name} ({world})"), replayed));
    }
    print_replays(&replays);
    outln!("\none real rank of the real program (TP 2 x PP 2 x DP W/4, computing on {on}) in large worlds; median of {runs} steps");
    outln!(
        "{:>6}  {:>12}  {:>14}  {:>18}  {:>9}",
        "ranks",
        "participants",
        "engine / step",
        "real rank compute",
        "overhead"
    );
    for world in [1024usize, 8192] {
        let config = TrainConfig {
            batch_size: 2 * world,
            parallel: Some(orrery_train::ParallelConfig {
                tp: 2,
                pp: 2,
                dp: world / 4,
                micro_batches: 4,
                ..orrery_train::ParallelConfig::default()
            }),
            ..base.clone()
        };
        let (collection, cost, net) = collected_world(&config, world)?;
        let mut engine = Vec::new();
        let mut compute = Vec::new();
        let mut participants = 0;
        for _ in 0..runs {
            let e = emulate_rank_0(&config, &collection.collected, &cost, &net)?;
            participants = e.step.participants.len();
            engine.push(e.step.engine.as_nanos() as u64);
            compute.push(
                e.records
                    .first()
                    .map_or(0, |s| peak_and_compute(&s.record).1 .0),
            );
        }
        engine.sort_unstable();
        compute.sort_unstable();
        let (en, co) = (engine[engine.len() / 2], compute[compute.len() / 2]);
        outln!(
            "{:>6}  {:>12}  {:>11.3} ms  {:>15.2} ms  {:>8.2}%",
            world,
            participants,
            en as f64 / 1e6,
            co as f64 / 1e9,
            100.0 * (en as f64 * 1e3) / (co as f64).max(1.0)
        );
    }
    Ok(())
}

/// Refuses ranks on a GPU this build cannot drive or this machine cannot start, naming the
/// flag, before any rank starts.
fn check_device(device: DeviceKind) -> Result<()> {
    if device == DeviceKind::Cuda && !cfg!(feature = "cuda") {
        return Err(crate::bad(
            "--device cuda: this orrery was built without the GPU backend; build it with \
             cargo build --release -p orrery-cli --features cuda",
        ));
    }
    crate::device::check_device(device, "--device cuda")
}

/// A child of the `--mpi` bench that has not finished by then has hung (a healthy one takes
/// seconds).
const CHILD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(900);

/// Runs `cmd` to completion, its output kept in `dir`: its stdout, or an error with its
/// stderr, also when it outlives [`CHILD_DEADLINE`] (it is killed).
fn child_stdout(
    mut cmd: std::process::Command,
    what: &str,
    dir: &std::path::Path,
) -> Result<String> {
    let (out, err) = (dir.join("child.out"), dir.join("child.err"));
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::fs::File::create(&err)?)
        .spawn()
        .with_context(|| format!("cannot start {what}"))?;
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > CHILD_DEADLINE {
            // SIGTERM first, so that mpirun can take its ranks down with it; then SIGKILL.
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let grace = std::time::Instant::now();
            while grace.elapsed() < std::time::Duration::from_secs(10) {
                if child.try_wait()?.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "{what} did not finish within {} s",
                CHILD_DEADLINE.as_secs()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    if !status.success() {
        anyhow::bail!(
            "{what} failed ({status}):\n{}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
    }
    Ok(std::fs::read_to_string(&out)?)
}

/// The field `key` of a child's JSON, which must be there.
fn json_u64(v: &serde_json::Value, key: &str, what: &str) -> Result<u64> {
    v[key]
        .as_u64()
        .with_context(|| format!("{what}: no {key} in its JSON"))
}

/// `orrery bench --emulate-fidelity --mpi`: the same comparison with every measurement in a
/// process of its own. The all-real step is an MPI job of this binary (`orrery collect
/// --comm mpi`, a process per rank, launched with `mpirun` or `$ORRERY_MPIRUN`); the
/// emulation (`orrery emulate --train`, rank 0 real) replays the virtual ranks from that
/// run's own collection, in a fresh process. A real rank that shares its process with other
/// ranks' threads has some of its blocks freed by them, later than it would free them
/// itself (burn's autodiff keeps one graph registry per process), so its peak moves by a
/// few kilobytes; alone in its process it measures exactly what it holds.
pub fn run_fidelity_bench_mpi(runs: u32, device: DeviceKind) -> Result<()> {
    if !cfg!(feature = "mpi") {
        return Err(crate::bad(
            "--emulate-fidelity --mpi launches orrery as an MPI job: build it with \
             --features mpi (see docs/train.md)",
        ));
    }
    check_device(device)?;
    let exe = std::env::current_exe().context("cannot find this program")?;
    let launcher = std::env::var("ORRERY_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let dir = std::env::temp_dir().join(format!("orrery-fidelity-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = fidelity_mpi_rows(runs, device, &exe, &launcher, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The rows of [`run_fidelity_bench_mpi`], its files in `dir`.
fn fidelity_mpi_rows(
    runs: u32,
    device: DeviceKind,
    exe: &std::path::Path,
    launcher: &str,
    dir: &std::path::Path,
) -> Result<()> {
    // A single machine: more ranks than cores, loopback TCP (works in containers). Settings
    // the caller made win.
    let defaults = [
        ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
        ("OMPI_MCA_btl", "self,tcp"),
        ("OMPI_MCA_btl_tcp_if_include", "lo"),
        ("OMPI_MCA_oob_tcp_if_include", "lo"),
    ];
    let on = device_name(device);
    outln!("orrery bench --emulate-fidelity --mpi: one real rank (rank 0) against every rank real (a process per rank, {launcher}, computing on {on}); median of {runs} runs");
    outln!("virtual ranks replay the real run's own collection; their collectives and transfers are modelled on an H100 cluster (H100 net) or take the times the real run measured (measured net, --calibrate); the real run's are MPI on this machine\n");
    fidelity_header();
    let mut replays: Vec<(String, Vec<f64>)> = Vec::new();
    for (index, (name, config, world)) in fidelity_worlds(device).into_iter().enumerate() {
        let path = dir.join(format!("world{index}.toml"));
        std::fs::write(&path, toml::to_string(&config)?)?;
        let mut runs_of_world = WorldRuns::default();
        for run in 0..runs {
            let reference = dir.join(format!("world{index}-{run}.collection"));
            let mut mpi = std::process::Command::new(launcher);
            mpi.args(["-n", &world.to_string()])
                .arg(exe)
                .arg("collect")
                .arg(&path)
                .args(["--ranks", &world.to_string(), "--comm", "mpi", "--json"])
                .arg("--out")
                .arg(&reference);
            for (k, v) in defaults {
                if std::env::var_os(k).is_none() {
                    mpi.env(k, v);
                }
            }
            let what = "the all-real MPI job";
            let real: serde_json::Value = serde_json::from_str(&child_stdout(mpi, what, dir)?)?;
            let ranks = real["real_run"]
                .as_array()
                .with_context(|| format!("{what}: no real_run in its JSON"))?;
            let mut slowest = 0;
            for r in ranks {
                slowest = slowest.max(json_u64(r, "step_ps", what)?);
            }
            runs_of_world.real_steps.push(slowest);
            let rank0 = ranks
                .iter()
                .find(|r| r["rank"] == 0)
                .with_context(|| format!("{what}: no rank 0"))?;
            runs_of_world
                .real_peaks
                .push(json_u64(rank0, "peak_memory_bytes", what)?);
            for (calibrated, (steps, peaks)) in
                CALIBRATED.into_iter().zip(&mut runs_of_world.emulated)
            {
                let mut emulate = std::process::Command::new(exe);
                emulate
                    .args(["emulate", "--train"])
                    .arg(&path)
                    .args(["--ranks", &world.to_string(), "--real-ranks", "0", "--json"])
                    .arg("--graph")
                    .arg(&reference);
                if calibrated {
                    emulate.arg("--calibrate");
                }
                let what = "the emulation";
                let emu: serde_json::Value =
                    serde_json::from_str(&child_stdout(emulate, what, dir)?)?;
                steps.push(json_u64(&emu, "step_time_ps", what)?);
                peaks.push(json_u64(&emu["real_ranks"][0], "peak_memory_bytes", what)?);
                if calibrated {
                    runs_of_world
                        .replayed
                        .push(json_u64(&emu, "collected_step_time_ps", what)?);
                }
            }
        }
        let replayed = runs_of_world.print(name, world);
        replays.push((format!("{name} ({world})"), replayed));
    }
    print_replays(&replays);
    Ok(())
}

/// How far `other` is from `real`, in percent of `real`.
fn percent_error(real: u64, other: u64) -> f64 {
    100.0 * (other as f64 - real as f64) / (real as f64).max(1.0)
}

/// Each run's error of `other` against `real` (the run next to it in time), in percent,
/// sorted.
fn paired_errors(real: &[u64], other: &[u64]) -> Vec<f64> {
    let mut paired: Vec<f64> = real
        .iter()
        .zip(other)
        .map(|(&r, &o)| percent_error(r, o))
        .collect();
    paired.sort_by(f64::total_cmp);
    paired
}

/// Sorted paired errors as "median [min, max]".
fn fmt_paired(paired: &[f64]) -> String {
    let at = |i: usize| paired.get(i).copied().unwrap_or(0.0);
    format!(
        "{:+.2}% [{:+.1}, {:+.1}]",
        at(paired.len() / 2),
        at(0),
        at(paired.len().saturating_sub(1))
    )
}

/// `config`'s world of `world` ranks collected (one slot, one warm-up step) and the models
/// of the H100 cluster it is emulated on.
fn collected_world(
    config: &TrainConfig,
    world: usize,
) -> Result<(
    orrery_emulate::drive::Collection,
    orrery_predict::CostModel,
    orrery_net::AnalyticalNetwork,
)> {
    let timeout = std::time::Duration::from_secs(600);
    let collection =
        orrery_emulate::drive::collect(config, world, 1, 1, timeout, wall_clock(), &mut |_, _| {})?;
    let (cost, net) = crate::collect::program_models("H100-SXM", world)?;
    Ok((collection, cost, net))
}

/// One step of `config` with rank 0 real among virtual ranks replayed from `collection`,
/// after one warm-up step, unperturbed.
fn emulate_rank_0<N: orrery_net::NetworkModel + Sync>(
    config: &TrainConfig,
    collected: &orrery_graph::collect::Collected,
    cost: &orrery_predict::CostModel,
    net: &N,
) -> Result<orrery_emulate::drive::Emulated> {
    Ok(orrery_emulate::drive::emulate(
        config,
        collected,
        cost,
        net,
        &[RankId(0)],
        &Perturbations::default(),
        1,
        std::time::Duration::from_secs(600),
        wall_clock(),
    )?)
}

/// The columns of a fidelity table ([`fidelity_row`]).
fn fidelity_header() {
    outln!(
        "{:<45} {:>6}  {:>14}  {:>14}  {:>8}  {:>26}  {:>12}  {:>12}  {:>8}",
        "world",
        "cores",
        "all-real step",
        "emulated step",
        "error",
        "paired error [min, max]",
        "all-real peak",
        "emulated peak",
        "error"
    );
}

/// One world's row of a fidelity table: the medians of the runs and their errors.
fn fidelity_row(
    name: &str,
    world: usize,
    mut real_steps: Vec<u64>,
    mut emu_steps: Vec<u64>,
    mut real_peaks: Vec<u64>,
    mut emu_peaks: Vec<u64>,
) {
    // Each run's emulation against the real run next to it in time: on a shared machine the
    // load drifts, and pairs see the same drift.
    let paired = paired_errors(&real_steps, &emu_steps);
    let median = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    let (rs, es) = (median(&mut real_steps), median(&mut emu_steps));
    let (rp, ep) = (median(&mut real_peaks), median(&mut emu_peaks));
    outln!(
        "{:<45} {:>6}  {:>11.2} ms  {:>11.2} ms  {:>+7.2}%  {:>26}  {:>10} B  {:>10} B  {:>+7.3}%",
        format!("{name} ({world})"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        rs as f64 / 1e9,
        es as f64 / 1e9,
        percent_error(rs, es),
        fmt_paired(&paired),
        rp,
        ep,
        percent_error(rp, ep)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_errors_compare_each_run_with_its_own_reference() {
        // Run 1: 1% short of its real step; run 2: 5% long; run 3: exact. Sorted.
        let paired = paired_errors(&[100, 200, 50], &[99, 210, 50]);
        assert_eq!(paired, vec![-1.0, 0.0, 5.0]);
        assert_eq!(fmt_paired(&paired), "+0.00% [-1.0, +5.0]");
        assert_eq!(fmt_paired(&[]), "+0.00% [+0.0, +0.0]");
    }
}
