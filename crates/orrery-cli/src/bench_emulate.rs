//! `orrery bench --emulate`: what hybrid emulation's engine costs as the world grows.
//!
//! The scenario is the default job (Llama-3 70B, TP 8 x interleaved PP 4) with its
//! data-parallel degree scaled so that the world has 1,024 to 8,192 GPUs, one real rank
//! (rank 0) and pruning on. Per world size the table shows the participants replayed, the
//! engine's events, its wall time per step (the median of `runs`; it includes building the
//! graphs and setting the emulation up, which a run does once), the real rank's compute
//! in the emulated step and the ratio of the two: the overhead emulation adds to every step
//! of the real rank. The real rank's compute is the cost model's (the training program is
//! not connected yet), so the ratio is against the GPU time the rank would spend. The
//! process's peak resident memory after each world size is read from `/proc/self/status`;
//! world sizes run in increasing order, so its growth is what the larger world added. An
//! unpruned emulation of the smallest world, once, shows what pruning saves.

use crate::median_secs;
use anyhow::{Context, Result};
use orrery_predict::emulate::{Emulation, EmulationStep, Perturbations, Pruning};
use orrery_spec::{load_job_spec, preset_job_text, presets, Job};
use orrery_units::{Picos, RankId};

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
    let mut emu = Emulation::new(
        &graphs,
        &cost,
        &net,
        &live,
        pruning,
        &Perturbations::default(),
    )?;
    let participants = emu.participants().len();
    let mut real_compute = 0u64;
    let timeline = loop {
        match emu.advance()? {
            EmulationStep::Done(t) => break t,
            EmulationStep::Compute {
                participant,
                op,
                modelled,
                ..
            } => {
                real_compute += modelled.0;
                emu.supply(participant, op, modelled)?;
            }
        }
    };
    Ok(Measured {
        participants,
        events: timeline.events,
        real_compute: Picos(real_compute),
    })
}

pub fn run_emulate_bench(runs: u32, gpus: &[u32]) -> Result<()> {
    outln!(
        "orrery bench --emulate: {} with one real rank (rank 0), pruned; median of {runs} runs",
        presets::DEFAULT_JOB
    );
    outln!(
        "the real rank's compute is the cost model's (the training program is not connected yet)\n"
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
        if g < 32 || g % 32 != 0 {
            return Err(crate::bad(format!(
                "--emulate-gpus: {g} is not a multiple of 32 (TP 8 x PP 4)"
            )));
        }
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
