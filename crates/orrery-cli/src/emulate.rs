//! `orrery emulate`: one training step with chosen ranks tracked one by one among virtual
//! ones, under perturbations, next to the prediction for the same job.
//!
//! The chosen ranks are the live participants of [`orrery_predict::emulate::Emulation`].
//! With a job, their compute ops take the cost model's durations, so this answers the
//! perturbation question: how much a straggler or a slow link costs the step, exactly, at
//! the price of one timeline per class of ranks that behave alike rather than the whole
//! world. With `--train` (the `collect` module) the real training program runs them.

use crate::{atomic_write, bad, load_job, progress_spinner, InputProblems, JobArgs};
use anyhow::{Context, Result};
use orrery_predict::emulate::{
    report, DegradedLink, EmulateError, Emulation, EmulationReport, Perturbations, Pruning,
    SlowRanks,
};
use orrery_predict::{predict_with, ReplayMode};
use orrery_spec::Job;
use orrery_units::{Picos, RankId};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct EmulateArgs {
    #[command(flatten)]
    job: JobArgs,
    /// The ranks to track one by one (the real ranks once the training program is
    /// connected), e.g. `0,17` or `0-3`.
    #[arg(long, value_name = "RANKS", required = true)]
    real_ranks: String,
    /// Replay every rank on its own instead of one participant per class of ranks with
    /// identical timelines (the same answer, slowly on large jobs).
    #[arg(long)]
    no_prune: bool,
    #[command(flatten)]
    perturb: PerturbArgs,
    #[command(flatten)]
    train: crate::collect::TrainEmulateArgs,
    /// Network model (see `orrery predict --network`).
    #[arg(long, default_value = "analytical", value_parser = ["analytical", "flow", "packet", "fluid"])]
    network: String,
    #[command(flatten)]
    packet: crate::packet_flags::PacketFlags,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Write a Perfetto/Chrome trace: one track per tracked rank and per shared stage.
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
}

/// The perturbations of an emulation, as options.
#[derive(clap::Args, Debug, Default)]
pub struct PerturbArgs {
    /// Slow ranks' compute: `RANKS:FACTOR[@FROM_MS[..UNTIL_MS]]`, e.g. `5:1.5` or
    /// `4-7:2@10..20` (times in milliseconds of the step). Repeatable.
    #[arg(long, value_name = "SPEC")]
    slow: Vec<String>,
    /// A slower network link: `RANK:FACTOR`; its collectives and sends take FACTOR times as
    /// long. Repeatable.
    #[arg(long, value_name = "SPEC")]
    degrade_link: Vec<String>,
}

/// The perturbations the options describe.
pub fn perturbations(args: &PerturbArgs) -> Result<Perturbations> {
    Ok(Perturbations {
        slow: args
            .slow
            .iter()
            .map(|s| parse_slow(s))
            .collect::<Result<_>>()?,
        links: args
            .degrade_link
            .iter()
            .map(|s| parse_link(s))
            .collect::<Result<_>>()?,
    })
}

/// Most ranks one option may name (a range beyond a world's size is refused later anyway).
const MAX_RANKS: u32 = 1 << 20;

/// `0,17`, `0-3`, `1,4-6`: ranks in the order given, duplicates dropped.
pub fn parse_ranks(flag: &str, text: &str) -> Result<Vec<RankId>> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let number = |s: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| bad(format!("{flag}: `{s}` is not a rank number")))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let r = number(part)?;
                (r, r)
            }
        };
        if hi < lo {
            return Err(bad(format!("{flag}: range `{part}` runs backwards")));
        }
        if hi - lo >= MAX_RANKS || out.len() as u32 + (hi - lo) >= MAX_RANKS {
            return Err(bad(format!("{flag}: more than {MAX_RANKS} ranks named")));
        }
        for r in lo..=hi {
            if seen.insert(r) {
                out.push(RankId(r));
            }
        }
    }
    if out.is_empty() {
        return Err(bad(format!("{flag}: no rank given")));
    }
    Ok(out)
}

fn parse_factor(flag: &str, text: &str) -> Result<f64> {
    text.trim()
        .parse::<f64>()
        .map_err(|_| bad(format!("{flag}: `{text}` is not a number")))
}

fn parse_ms(flag: &str, text: &str) -> Result<Picos> {
    let v = text
        .trim()
        .parse::<f64>()
        .map_err(|_| bad(format!("{flag}: `{text}` is not a time in milliseconds")))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(bad(format!(
            "{flag}: `{text}` must be a time of zero or more"
        )));
    }
    Ok(Picos((v * 1e9).round() as u64))
}

/// `RANKS:FACTOR[@FROM[..UNTIL]]`.
fn parse_slow(text: &str) -> Result<SlowRanks> {
    let (ranks, rest) = text.split_once(':').ok_or_else(|| {
        bad(format!(
            "--slow: `{text}` is not RANKS:FACTOR[@FROM..UNTIL]"
        ))
    })?;
    let (factor, window) = match rest.split_once('@') {
        Some((f, w)) => (f, Some(w)),
        None => (rest, None),
    };
    let (from, until) = match window {
        None => (Picos::ZERO, None),
        Some(w) => match w.split_once("..") {
            Some((a, b)) => (
                parse_ms("--slow", a)?,
                if b.trim().is_empty() {
                    None
                } else {
                    Some(parse_ms("--slow", b)?)
                },
            ),
            None => (parse_ms("--slow", w)?, None),
        },
    };
    Ok(SlowRanks {
        ranks: parse_ranks("--slow", ranks)?,
        factor: parse_factor("--slow", factor)?,
        from,
        until,
    })
}

/// `RANK:FACTOR`.
fn parse_link(text: &str) -> Result<DegradedLink> {
    let (rank, factor) = text
        .split_once(':')
        .ok_or_else(|| bad(format!("--degrade-link: `{text}` is not RANK:FACTOR")))?;
    let rank = rank
        .trim()
        .parse::<u32>()
        .map_err(|_| bad(format!("--degrade-link: `{rank}` is not a rank number")))?;
    Ok(DegradedLink {
        rank: RankId(rank),
        factor: parse_factor("--degrade-link", factor)?,
    })
}

pub fn run_emulate(args: &EmulateArgs) -> Result<()> {
    if args.train.train.is_some() {
        if let Some(e) = args.packet.refuse_without_packet(
            &[],
            "with --train the virtual ranks replay on the analytical or measured network \
             (--calibrate)",
            "emulate a job (without --train) with --network packet",
        ) {
            return Err(e);
        }
        return crate::collect::run_train_emulation(
            &args.train,
            &args.real_ranks,
            &args.perturb,
            args.json,
            args.trace.as_deref(),
        );
    }
    let mut problems = InputProblems::default();
    problems.output("--trace", args.trace.as_deref());
    args.packet.check_outputs(&mut problems);
    if let Some(e) = args.packet.refuse_unless_packet(&args.network) {
        problems.push(&e.to_string());
    }
    let live = problems.check(parse_ranks("--real-ranks", &args.real_ranks));
    let perturb = problems.check(perturbations(&args.perturb));
    let job = load_job(&args.job, &mut problems);
    let (job, live, perturb) = problems.finish(
        job.zip(live)
            .zip(perturb)
            .map(|((job, live), perturb)| (job, live, perturb)),
    )?;
    let pruning = if args.no_prune {
        Pruning::None
    } else {
        Pruning::Classes
    };
    let fabric = orrery_predict::fabric_for(&job);
    let spinner = progress_spinner("emulating the step");
    let done = match args.network.as_str() {
        "flow" => {
            let sim = orrery_net::flow_model::FlowLevelSimulator::default();
            let net = orrery_predict::sim_network_for(&job, sim);
            emulate_with(&job, &net, &live, pruning, &perturb)?
        }
        "fluid" => {
            let sim = orrery_net::packet::FluidSimulator::default();
            let net = orrery_predict::sim_network_for(&job, sim);
            emulate_with(&job, &net, &live, pruning, &perturb)?
        }
        "packet" => {
            // A clone shares the simulator's memo cache (see `run_predict`).
            let sim = args.packet.simulator();
            let net = orrery_predict::sim_network_for(&job, sim.clone());
            let done = emulate_with(&job, &net, &live, pruning, &perturb)?;
            args.packet.save_cache(&sim)?;
            done
        }
        _ => {
            let net = orrery_net::AnalyticalNetwork::new(fabric, orrery_net::AlgorithmChoice::Auto);
            emulate_with(&job, &net, &live, pruning, &perturb)?
        }
    };
    spinner.finish_and_clear();
    let (rep, out, labels) = done;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rep)?);
    } else {
        out!("{}", render(&job, &rep, &live, &perturb));
    }
    if let Some(path) = &args.trace {
        let mut buf = Vec::new();
        let opts = orrery_predict::sinks::TraceOptions {
            max_participants: None,
            labels: Some(&labels),
        };
        orrery_predict::sinks::write_perfetto_trace_with(&out, &opts, &mut buf)?;
        atomic_write(path, &buf)?;
        eprintln!("wrote trace {}", path.display());
    }
    Ok(())
}

type Emulated = (EmulationReport, orrery_predict::PredictOutput, Vec<String>);

fn emulate_with<N: orrery_net::NetworkModel>(
    job: &Job,
    net: &N,
    live: &[RankId],
    pruning: Pruning,
    perturb: &Perturbations,
) -> Result<Emulated> {
    let predicted = predict_with(job, net, ReplayMode::Classes).context("prediction failed")?;
    let predicted_step = predicted.prediction.step_time;
    // The prediction's graphs are the job's: the emulation replays them too.
    let graphs = predicted.graphs;
    let cost = orrery_predict::CostModel::for_gpu(&job.cluster().gpu);
    let emu = Emulation::new(&graphs, &cost, net, live, pruning, perturb).map_err(|e| {
        match e {
            // The input was wrong: exit 2 with every problem named.
            EmulateError::Replay(_) => anyhow::Error::new(e),
            _ => bad(e.to_string()),
        }
    })?;
    let info = emu.participants().to_vec();
    let pruned = emu.pruned();
    // With a job, the live ranks' compute takes the cost model's durations (`--train` runs
    // the training program instead); the modelled durations are kept for the report.
    let (timeline, modelled) = emu.run_modelled()?;
    let rep = report(&graphs, &info, pruned, &timeline, &modelled, predicted_step)
        .context("memory ledger")?;
    let labels = info
        .iter()
        .map(|i| {
            let stage = graphs.layout.coords(i.rank).pp;
            match (i.live, i.stands_for) {
                (true, _) => format!("real rank {} (stage {stage})", i.rank.0),
                (false, 1) => format!("virtual rank {} (stage {stage})", i.rank.0),
                (false, n) => format!("{n} virtual ranks like rank {} (stage {stage})", i.rank.0),
            }
        })
        .collect();
    let out = orrery_predict::output_for(job, net.name(), graphs, timeline)
        .context("reading the emulated step")?;
    Ok((rep, out, labels))
}

fn ms(p: Picos) -> String {
    format!("{:.3} ms", p.as_millis_f64())
}

fn render(job: &Job, r: &EmulationReport, live: &[RankId], perturb: &Perturbations) -> String {
    let mut s = String::new();
    let names: Vec<String> = live.iter().map(|r| r.0.to_string()).collect();
    let _ = writeln!(
        s,
        "orrery emulate: {}, {} GPUs, real ranks {}",
        job.name(),
        r.world_size,
        names.join(", ")
    );
    let _ = writeln!(
        s,
        "  the real ranks' compute is the cost model's (with --train the training program runs them)"
    );
    let _ = writeln!(
        s,
        "  {} participants for {} ranks ({})",
        r.participants,
        r.world_size,
        if r.pruned {
            "one per class of ranks with identical timelines; real and perturbed ranks on their own"
        } else {
            "every rank on its own"
        }
    );
    for p in &perturb.slow {
        let ranks: Vec<String> = p.ranks.iter().map(|r| r.0.to_string()).collect();
        let window = match p.until {
            Some(u) => format!("from {} to {}", ms(p.from), ms(u)),
            None => format!("from {}", ms(p.from)),
        };
        let _ = writeln!(
            s,
            "  perturbation: ranks {} compute {}x slower {window}",
            ranks.join(","),
            p.factor
        );
    }
    for l in &perturb.links {
        let _ = writeln!(
            s,
            "  perturbation: rank {}'s link {}x slower",
            l.rank.0, l.factor
        );
    }
    let diff = if r.predicted_step_time.0 > 0 {
        100.0 * (r.step_time.0 as f64 - r.predicted_step_time.0 as f64)
            / r.predicted_step_time.0 as f64
    } else {
        0.0
    };
    let _ = writeln!(
        s,
        "\nstep time: emulated {}, predicted {} ({diff:+.2}%)\n",
        ms(r.step_time),
        ms(r.predicted_step_time)
    );
    let _ = writeln!(
        s,
        "  {:>6}  {:>5}  {:>7}  {:>13}  {:>13}  {:>11}",
        "rank", "stage", "kind", "step end", "compute", "peak memory"
    );
    for k in &r.ranks {
        let _ = writeln!(
            s,
            "  {:>6}  {:>5}  {:>7}  {:>13}  {:>13}  {:>7.2} GiB",
            k.rank,
            k.stage,
            if k.real { "real" } else { "virtual" },
            ms(k.end),
            ms(k.compute),
            k.peak_memory.0 as f64 / (1u64 << 30) as f64
        );
    }
    for c in &r.shared {
        let _ = writeln!(
            s,
            "  {:>6}  {:>5}  {:>7}  {:>13}  {:>13}  {:>7.2} GiB   (and {} more like it)",
            format!("{}*", c.representative),
            c.stage,
            "virtual",
            ms(c.end),
            "-",
            c.peak_memory.0 as f64 / (1u64 << 30) as f64,
            c.ranks - 1
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_and_perturbations_parse() {
        assert_eq!(
            parse_ranks("--x", "1, 4-6,4").unwrap(),
            vec![RankId(1), RankId(4), RankId(5), RankId(6)]
        );
        let s = parse_slow("4-5:2@10..20").unwrap();
        assert_eq!(s.ranks, vec![RankId(4), RankId(5)]);
        assert_eq!(s.factor, 2.0);
        assert_eq!(s.from, Picos(10_000_000_000));
        assert_eq!(s.until, Some(Picos(20_000_000_000)));
        assert_eq!(parse_slow("3:1.5").unwrap().until, None);
        assert_eq!(parse_slow("3:1.5@7..").unwrap().from, Picos(7_000_000_000));
        let l = parse_link("7:3").unwrap();
        assert_eq!((l.rank, l.factor), (RankId(7), 3.0));
        for bad_input in ["5", "a:2", "3:x", "3:2@-1", "3:2@1..x"] {
            assert!(parse_slow(bad_input).is_err(), "{bad_input}");
        }
        assert!(parse_ranks("--x", "5-3").is_err());
        assert!(parse_link("7").is_err());
    }
}
