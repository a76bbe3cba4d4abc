//! `orrery bench --accel`: the accelerated packet model against the packet-by-packet
//! reference on training traffic, measured in one run so the ratios compare like with like.
//!
//! Each scenario runs with every acceleration on (the default) and, where the reference is
//! affordable (`--reference-max-gpus`), with all of it off. The table shows wall times and
//! their ratio, processed events, the events acceleration skipped (estimated from skipped
//! packets), the memo hit rate, the groups mirrored, the flows periodic extrapolation
//! finished without simulating them, and the errors the issue bounds: mean
//! and p99 of the per-flow completion-time errors, and the error of the whole run's and of
//! each collective's completion. Where the reference was not run, the speedup shown is the
//! event ratio `(processed + skipped) / processed`, marked "est".

use anyhow::{Context, Result};
use orrery_net::flows::{collective_flows, dependency_order, FlowAlgorithm, FlowSet};
use orrery_net::packet::{
    FastForwardHeld, FluidSimulator, PacketConfig, PacketRun, PacketSimulator, TraceRequest,
};
use orrery_net::sim::{RunErrors, SimReport};
use orrery_net::topology::{NetGraph, RailOptimizedSpec, Routing};
use orrery_net::CollectiveKind;
use orrery_predict::traffic::Release;
use orrery_units::{Bytes, Picos};
use serde::Serialize;
use std::time::Instant;

/// A GPT-style job (GPT-3 Medium shape, 350M parameters) whose data- and
/// pipeline-parallel traffic is the benchmark's training step; `nodes` and the data-parallel
/// degree come from the scenario.
const GPT_JOB: &str = r#"
name = "GPT 350M"
[model]
name = "GPT 350M"
layers = 24
hidden = 1024
heads = 16
ffn = 4096
vocab = 51200
seq_len = 2048
activation = "gelu"
tied_embeddings = true
[training]
global_batch = 256
micro_batch = 4
zero_stage = 1
[parallel]
tp = 2
pp = 4
sp = true
overlap_grad_reduce = true
[cluster]
gpu = "H100-SXM"
gpus_per_node = 8
nic_gbps = 400
"#;

struct Scenario {
    name: String,
    gpus: u32,
    graph: NetGraph,
    flows: FlowSet,
    /// How a job step's flows were released (`None`: not a job step).
    release: Option<Release>,
}

/// Adds an 8-channel ring all-reduce of `bytes` over `ranks` of `graph` to `flows`.
fn add_ring(
    flows: &mut FlowSet,
    graph: &NetGraph,
    name: &str,
    ranks: &[u32],
    bytes: u64,
) -> Result<()> {
    collective_flows(
        flows,
        name,
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 8 },
        ranks,
        Bytes(bytes),
        graph.endpoints_per_host(),
        Picos::from_nanos(2000),
    )?;
    Ok(())
}

fn ring_all_reduce(gpus: u32, bytes: u64) -> Result<Scenario> {
    let hosts = (gpus / 8).max(1) as usize;
    let graph = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(hosts))?;
    let mut flows = FlowSet::default();
    let ranks: Vec<u32> = (0..gpus).collect();
    add_ring(&mut flows, &graph, "all-reduce", &ranks, bytes)?;
    Ok(Scenario {
        name: format!("ring all-reduce {} MiB", bytes >> 20),
        gpus,
        graph,
        flows,
        release: None,
    })
}

/// Two 8-rank ring all-reduces of `bytes` (8 channels each), on rails 0 and 1 of 8 DGX
/// H100 hosts split into two pods of four: every ring crosses the spines twice, where ECMP
/// puts some channels on the same spine link. The smallest of these scenarios with
/// congestion (ECN marks, DCQCN) that acceleration meets; its reference is chaotic.
fn cross_pod_rings(bytes: u64) -> Result<Scenario> {
    let spec = RailOptimizedSpec {
        hosts_per_pod: 4,
        ..RailOptimizedSpec::dgx_h100(8)
    };
    let graph = NetGraph::rail_optimized(&spec)?;
    let mut flows = FlowSet::default();
    for rail in 0..2u32 {
        let ranks: Vec<u32> = (0..8).map(|h| h * 8 + rail).collect();
        add_ring(
            &mut flows,
            &graph,
            &format!("rail {rail} ring"),
            &ranks,
            bytes,
        )?;
    }
    Ok(Scenario {
        name: format!("2 rings across 2 pods {} MiB", bytes >> 20),
        gpus: 64,
        graph,
        flows,
        release: None,
    })
}

fn job_step(
    name: &str,
    text: &str,
    overrides: &[String],
    traffic: &[&str],
    release: Release,
) -> Result<Scenario> {
    let spec = orrery_spec::load_job_spec(text, overrides).map_err(|e| anyhow::anyhow!("{e}"))?;
    let job = orrery_spec::Job::from_spec(&spec).map_err(|e| anyhow::anyhow!("{e}"))?;
    let select = orrery_predict::traffic::TrafficSelection::from_names(traffic)
        .map_err(|u| anyhow::anyhow!("unknown traffic {u:?}"))?;
    let (graph, flows) = orrery_predict::traffic::job_traffic_with(&job, select, release)?;
    Ok(Scenario {
        name: name.to_string(),
        gpus: job.parallel().world_size() as u32,
        graph,
        flows,
        release: Some(release),
    })
}

fn gpt_step(gpus: u32, release: Release) -> Result<Scenario> {
    if !gpus.is_multiple_of(8) {
        return Err(crate::bad(format!(
            "--gpt-gpus: {gpus} is not a multiple of 8 (tp 2 x pp 4 per replica)"
        )));
    }
    let nodes = gpus / 8;
    let dp = gpus / 8; // tp 2 x pp 4 = 8 GPUs per replica
    let set = vec![
        format!("cluster.nodes={nodes}"),
        format!("parallel.dp={dp}"),
        format!("training.global_batch={}", 16 * dp),
    ];
    job_step(
        "GPT 350M step (DP+PP)",
        GPT_JOB,
        &set,
        &["dp", "pp"],
        release,
    )
}

fn gpt_13b_step(gpus: u32, release: Release) -> Result<Scenario> {
    if gpus == 0 || !gpus.is_multiple_of(32) || !256u32.is_multiple_of(gpus / 32) {
        return Err(crate::bad(format!(
            "--gpt13b-gpus: {gpus} is not 32 times a divisor of 256 (tp 8 x pp 4 per replica, \
             a global batch of 256 split over the replicas)"
        )));
    }
    // GPT-3 13B's shape on the 350M job's set-up (same vocabulary, sequences, ZeRO-1,
    // pipeline and cluster): tensor parallelism across the node, a fixed global batch of
    // 256 sequences (so more GPUs mean fewer micro-batches per replica, as when a job is
    // spread wider). Each rank holds 1/32 of the weights, so its gradient buckets are
    // hundreds of megabytes, reduced over few data-parallel ranks: ring steps of megabytes.
    let set = vec![
        "name=GPT 13B".to_string(),
        "model.name=GPT 13B".to_string(),
        "model.layers=40".to_string(),
        "model.hidden=5120".to_string(),
        "model.heads=40".to_string(),
        "model.ffn=20480".to_string(),
        "training.global_batch=256".to_string(),
        "training.micro_batch=1".to_string(),
        "parallel.tp=8".to_string(),
        format!("cluster.nodes={}", gpus / 8),
        format!("parallel.dp={}", gpus / 32), // tp 8 x pp 4 = 32 GPUs per replica
    ];
    job_step(
        "GPT 13B step (DP+PP)",
        GPT_JOB,
        &set,
        &["dp", "pp"],
        release,
    )
}

fn llama_pipeline_step(gpus: u32, release: Release) -> Result<Scenario> {
    if gpus == 0 || !gpus.is_multiple_of(128) {
        return Err(crate::bad(format!(
            "--llama-pp-gpus: {gpus} is not a multiple of 128 (tp 8 x pp 16 per replica)"
        )));
    }
    let text = orrery_spec::preset_job_text("llama3-405b-h100x8192")
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let dp = gpus / 128;
    job_step(
        "Llama 3 405B, 32 layers, PP 16 (DP+PP)",
        text,
        // 32 of the 126 layers (two per stage) and 16 micro-batches per replica keep the
        // reference affordable; each micro-batch's activations and gradients are the
        // model's (32 MiB per GPU and send), and the 1F1B warm-up sends them down the
        // pipeline in waves, each stage receiving from the one before while it sends to
        // the next, the pattern whose growing queues a jump must not freeze.
        &[
            "model.layers=32".to_string(),
            "parallel.pp=16".to_string(),
            format!("cluster.nodes={}", gpus / 8),
            format!("parallel.dp={dp}"),
            format!("training.global_batch={}", 16 * dp),
        ],
        &["dp", "pp"],
        release,
    )
}

fn moe_step(gpus: u32, pxn: bool, release: Release) -> Result<Scenario> {
    if !gpus.is_multiple_of(64) {
        return Err(crate::bad(format!(
            "--moe-gpus: {gpus} is not a multiple of 64 (tp 2 x pp 4 per replica, expert \
             groups of 8 replicas)"
        )));
    }
    let text =
        orrery_spec::preset_job_text("mixtral-8x7b-h100x64").map_err(|e| anyhow::anyhow!("{e}"))?;
    let dp = gpus / 8;
    job_step(
        if pxn {
            "Mixtral 8x7B, 8 layers (EP a2a + PP)"
        } else {
            "Mixtral 8x7B, 8 layers, no PXN"
        },
        text,
        // Eight of the 32 layers and 8 sequences per replica (64 at 64 GPUs) keep the
        // reference run affordable; the all-to-all pattern per layer and micro-batch is
        // the model's.
        &[
            "model.layers=8".to_string(),
            format!("cluster.nodes={}", gpus / 8),
            format!("parallel.dp={dp}"),
            format!("training.global_batch={}", 8 * dp),
            format!("cluster.pxn={pxn}"),
        ],
        &["ep", "pp"],
        release,
    )
}

fn timed(config: PacketConfig, s: &Scenario) -> Result<(PacketRun, f64)> {
    timed_on(config, s, &s.flows)
}

/// Runs under this many seconds are repeated (see [`timed_median`]).
const SHORT_RUN_SECS: f64 = 1.0;
/// The most runs [`timed_median`] makes.
const SHORT_RUN_REPEATS: usize = 5;

/// [`timed`], repeated while the runs are short: a run under [`SHORT_RUN_SECS`] is run
/// again, each time with a fresh simulator (an empty memo cache), up to
/// [`SHORT_RUN_REPEATS`] runs or until they add up to that time, and the median wall
/// time is returned with the number of runs. A run of a few tens of milliseconds (the
/// accelerated 128-GPU ring) varied by a third from one run to the next, which a single
/// run would carry into the speedup. Every repeat must give the first run's report: a
/// run that differs is a determinism bug, reported as an error.
fn timed_median(config: PacketConfig, s: &Scenario) -> Result<(PacketRun, f64, usize)> {
    repeated_while_short(
        s,
        "accelerated",
        || timed(config.clone(), s),
        |a, b| a.report == b.report,
    )
}

/// Runs `run` (a result and its wall seconds) again while the runs are short, as
/// [`timed_median`] says, each repeat required to give what the first gave (`same`);
/// returns the first result, the median time and the number of runs. `what` names the
/// run in the error a repeat that differs is reported as.
fn repeated_while_short<R>(
    s: &Scenario,
    what: &str,
    run: impl Fn() -> Result<(R, f64)>,
    same: impl Fn(&R, &R) -> bool,
) -> Result<(R, f64, usize)> {
    let (first_run, first) = run()?;
    let mut times = vec![first];
    while times.len() < SHORT_RUN_REPEATS && times.iter().sum::<f64>() < SHORT_RUN_SECS {
        let (again, t) = run()?;
        anyhow::ensure!(
            same(&again, &first_run),
            "{}: a repeat of the {what} run gave another report (the same input must give the same output)",
            s.name
        );
        times.push(t);
    }
    times.sort_by(f64::total_cmp);
    let runs = times.len();
    Ok((first_run, times[runs / 2], runs))
}

/// [`timed`] on other flows over `s`'s fabric.
fn timed_on(config: PacketConfig, s: &Scenario, flows: &FlowSet) -> Result<(PacketRun, f64)> {
    let t = Instant::now();
    let run = PacketSimulator::new(config)
        .run(&s.graph, flows, &TraceRequest::default())
        .with_context(|| format!("simulating {}", s.name))?;
    Ok((run, t.elapsed().as_secs_f64()))
}

/// What `orrery bench --accel` runs: `ring_mib` sizes the ring all-reduce (0: none); 350M
/// GPT steps run at each of `gpt_gpus` and 13B ones at each of `gpt_13b_gpus` (0s
/// skipped), MoE ones at each of `moe_gpus` (with NCCL's PXN if `pxn`); the reference runs
/// only up to `reference_max_gpus`; `json` prints the rows as JSON instead of a table.
pub struct AccelBench {
    pub ring_mib: u64,
    pub cross_pod_mib: u64,
    pub gpt_gpus: Vec<u32>,
    pub gpt_13b_gpus: Vec<u32>,
    /// GPU counts of the Llama 3 405B pipeline steps (multiples of 128; 0s skipped).
    pub llama_pp_gpus: Vec<u32>,
    pub moe_gpus: Vec<u32>,
    pub pxn: bool,
    /// How every scenario's fabric places flows on equal-cost paths.
    pub routing: Routing,
    pub reference_max_gpus: u32,
    /// When the job steps' flows are released.
    pub release: Release,
    /// Also run each reference with the next seed and report how far it is from the first.
    pub seed_spread: bool,
    /// Also run each reference on its flows numbered in another dependency order and report
    /// how far it is from the first.
    pub label_spread: bool,
    /// Also run each scenario in the fluid model ([`FluidSimulator`]).
    pub fluid: bool,
    /// The fluid model's [`FluidSimulator::longest_link_step`].
    pub fluid_link_step: Option<Picos>,
    pub json: bool,
}

/// One scenario's measurements (a row of the table; `--json` prints these).
#[derive(Debug, Serialize)]
struct AccelRow {
    scenario: String,
    /// How a job step's flows were released (absent for the ring scenarios).
    #[serde(skip_serializing_if = "Option::is_none")]
    release: Option<Release>,
    gpus: u32,
    flows: usize,
    /// Wall seconds of the reference run, when it ran.
    reference_secs: Option<f64>,
    /// Median wall seconds of `accelerated_runs` accelerated runs (more than one when
    /// they are short, see [`timed_median`]).
    accelerated_secs: f64,
    accelerated_runs: usize,
    /// `reference_secs / accelerated_secs`, when the reference ran.
    wall_speedup: Option<f64>,
    /// Events the reference processed; without a reference run, the accelerated run's
    /// processed plus skipped events (an estimate, `reference_events_estimated`).
    reference_events: u64,
    reference_events_estimated: bool,
    events: u64,
    /// `reference_events / events`.
    event_ratio: f64,
    skipped_events: u64,
    /// Fast-forward jumps taken, and of those the jumps of quiet partitions (after
    /// `accel.quiet_window` samples instead of the whole window) and the cut jumps
    /// (through DCQCN's cuts at a steady cadence of CNPs, `accel.cut_jumps`).
    fast_forwards: u64,
    quiet_jumps: u64,
    cut_jumps: u64,
    /// What held the accelerated run's partitions back, in flow-samples
    /// ([`FastForwardHeld`]; the quotient's flows' when symmetry was found).
    ff_held: FastForwardHeld,
    memo_lookups: u64,
    memo_hits: u64,
    /// `memo_hits / memo_lookups` (0 without lookups).
    memo_hit_rate: f64,
    mirrored_groups: u64,
    virtual_flows: u64,
    /// Flows finished at a kept collective's times (`accel.collective_memo`).
    repeated_flows: u64,
    /// Copies of each simulated flow when the accelerated run was a symmetry quotient (0:
    /// no symmetry found).
    symmetry_copies: u64,
    /// Packets dropped by the accelerated run and, when it ran, by the reference (with
    /// PFC, neither should drop any).
    drops: u64,
    reference_drops: Option<u64>,
    /// Errors against the reference, as fractions (0.01 is 1%), when it ran.
    errors: Option<AccelErrors>,
    /// With `--seed-spread`: the reference run with the next seed against the reference,
    /// the same measures. Where this is as large as `errors`, single flows are chaotic
    /// (random ECN marks decide them) and per-flow errors measure that, not acceleration.
    reference_seed_spread: Option<AccelErrors>,
    /// With `--label-spread`: the reference run on the same flows numbered in another order
    /// that keeps every dependency before its dependents, against the reference. Queue
    /// pairs joining a port together are ordered by their collective's shape, not their
    /// numbers, but other events of one picosecond still go in the order they were filed;
    /// where this is as large as `errors`, per-flow errors measure those ties.
    reference_label_spread: Option<AccelErrors>,
    /// With `--fluid`: the fluid model's wall seconds (median, as `accelerated_secs`) and
    /// its errors against the reference, when that ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    fluid_secs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fluid_errors: Option<AccelErrors>,
    /// With `--fluid`: the copies each flow the fluid model stepped stood for (the
    /// product of the symmetry reduction's rotations; 1 where it found none).
    #[serde(skip_serializing_if = "Option::is_none")]
    fluid_symmetry_copies: Option<u64>,
    /// With `--fluid`: the fluid model stepping every flow (`calm_skip` off), timed the
    /// same way; the bench fails if its flows differ from the default run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    fluid_every_step_secs: Option<f64>,
    /// With `--fluid`: the fluid model taking the steps between strided links'
    /// transmissions too (`gap_skip` off), timed the same way; the bench fails if its
    /// flows differ from the default run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    fluid_every_gap_secs: Option<f64>,
}

#[derive(Debug, Serialize)]
struct AccelErrors {
    mean_fct: f64,
    p99_fct: f64,
    end: f64,
    collective: f64,
    collective_time: f64,
}

impl From<RunErrors> for AccelErrors {
    fn from(e: RunErrors) -> AccelErrors {
        AccelErrors {
            mean_fct: e.mean_fct,
            p99_fct: e.p99_fct,
            end: e.end,
            collective: e.collective,
            collective_time: e.collective_time,
        }
    }
}

/// Runs every scenario and prints the table (row by row, as they finish) or the JSON
/// report (at the end).
pub fn run_accel_bench(b: &AccelBench) -> Result<()> {
    // Every scenario is built before any runs, so that every wrong count is named at once.
    let mut problems = crate::InputProblems::default();
    let mut scenarios = Vec::new();
    let mut add = |scenario: Result<Scenario>| scenarios.extend(problems.check(scenario));
    if b.ring_mib > 0 {
        add(ring_all_reduce(128, b.ring_mib << 20));
    }
    if b.cross_pod_mib > 0 {
        add(cross_pod_rings(b.cross_pod_mib << 20));
    }
    for &g in b.gpt_gpus.iter().filter(|&&g| g > 0) {
        add(gpt_step(g, b.release));
    }
    for &g in b.gpt_13b_gpus.iter().filter(|&&g| g > 0) {
        add(gpt_13b_step(g, b.release));
    }
    for &g in b.llama_pp_gpus.iter().filter(|&&g| g > 0) {
        add(llama_pipeline_step(g, b.release));
    }
    for &g in b.moe_gpus.iter().filter(|&&g| g > 0) {
        add(moe_step(g, b.pxn, b.release));
    }
    problems.finish(Some(()))?;
    if b.routing == Routing::Pinned {
        // Flows name endpoints, not paths, so the same traffic runs on the pinned fabric.
        for s in &mut scenarios {
            s.graph = s.graph.clone().with_routing(Routing::Pinned);
            s.name.push_str(", pinned");
        }
    }
    if !b.json {
        outln!(
            "orrery bench --accel: accelerated packet model (fast-forward, partitioning, memo, mirrors, periodic extrapolation, collective memo, symmetry) vs the packet-by-packet reference"
        );
        outln!(
            "job steps' flows released {} (--release {})\n",
            match b.release {
                Release::Replay => "at the replay's times",
                Release::Dependencies => "after what each rank's op waits for, as simulated",
                Release::Rendezvous =>
                    "after what each rank's op waits for, as simulated, a collective on all its members at once",
            },
            b.release.name()
        );
        outln!(
            "accel s: the median of up to {SHORT_RUN_REPEATS} runs when a run takes under {SHORT_RUN_SECS} s (a fresh simulator each); the reference runs once\n"
        );
        outln!(
            "ev ratio: the reference's events over the accelerated run's (~: estimated from the events the accelerated run skipped, where the reference did not run); skipped: the events the accelerated run's mechanisms report skipping\n"
        );
        outln!("{}", table_header());
    }
    let mut rows = Vec::new();
    for s in &scenarios {
        let spreads = Spreads {
            seed: b.seed_spread,
            label: b.label_spread,
            fluid: b.fluid,
            fluid_link_step: b.fluid_link_step,
        };
        let row = measure(s, s.gpus <= b.reference_max_gpus, spreads)?;
        if !b.json {
            outln!("{}", table_line(&row));
            if row.drops > 0 || row.reference_drops.is_some_and(|d| d > 0) {
                let reference = row
                    .reference_drops
                    .map_or("not run".to_string(), |d| d.to_string());
                outln!(
                    "{:<46} packets dropped: {} accelerated, reference {reference}",
                    "",
                    row.drops
                );
            }
            if let Some(secs) = row.fluid_secs {
                let against = match (&row.fluid_errors, row.reference_secs) {
                    (Some(e), Some(t_ref)) => format!(
                        "{:.1}x faster than the reference; mean / p99 FCT {:.3}% / {:.3}%, end {:.3}%, collectives {:.3}% (completion times {:.3}%)",
                        t_ref / secs,
                        100.0 * e.mean_fct,
                        100.0 * e.p99_fct,
                        100.0 * e.end,
                        100.0 * e.collective,
                        100.0 * e.collective_time
                    ),
                    _ => "no reference run".to_string(),
                };
                let copies = match row.fluid_symmetry_copies {
                    Some(c) if c > 1 => format!(", one copy stepped for {c}"),
                    _ => String::new(),
                };
                outln!(
                    "{:<46} the fluid model: {secs:.3} s ({:.2}x the accelerated run's time{copies}), {against}",
                    "",
                    secs / row.accelerated_secs
                );
                if let Some(stepped) = row.fluid_every_step_secs {
                    outln!(
                        "{:<46} the fluid model stepping every flow: {stepped:.3} s (the calm skip {:.2}x faster, the same flows)",
                        "",
                        stepped / secs
                    );
                }
                if let Some(gaps) = row.fluid_every_gap_secs {
                    outln!(
                        "{:<46} the fluid model taking the steps between transmissions: {gaps:.3} s (the gap skip {:.2}x faster, the same flows)",
                        "",
                        gaps / secs
                    );
                }
            }
            for (e, what) in [
                (&row.reference_seed_spread, "with the next seed"),
                (&row.reference_label_spread, "on its flows renumbered"),
            ] {
                if let Some(e) = e {
                    outln!(
                        "{:<46} the reference {what} against it: mean / p99 FCT {:.3}% / {:.3}%, end {:.3}%, collectives {:.3}% (completion times {:.3}%)",
                        "",
                        100.0 * e.mean_fct,
                        100.0 * e.p99_fct,
                        100.0 * e.end,
                        100.0 * e.collective,
                        100.0 * e.collective_time
                    );
                }
            }
        }
        rows.push(row);
    }
    if b.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    }
    Ok(())
}

/// Which second reference runs measure how far the reference moves by itself, and whether
/// the fluid model runs too.
#[derive(Debug, Clone, Copy)]
struct Spreads {
    /// With the next seed (other ECN marking draws).
    seed: bool,
    /// On the flows renumbered (other tie-breaking between same-time events).
    label: bool,
    /// The fluid model's run, and its links' longest step.
    fluid: bool,
    fluid_link_step: Option<Picos>,
}

/// `flows` numbered in another order that keeps each flow after its dependencies (among
/// the flows ready, the highest-numbered first), and each new number's old one.
fn renumbered(flows: &FlowSet) -> (FlowSet, Vec<usize>) {
    let n = flows.flows.len();
    let deps = |i: usize| flows.flows[i].deps.iter().map(|d| d.index()).collect();
    // A flow set's dependencies point to earlier flows, so there is no cycle.
    let old_of = dependency_order(n, deps, true).unwrap_or_else(|| (0..n).collect());
    (flows.reordered(&old_of), old_of)
}

/// Runs scenario `s` accelerated and, if `with_reference`, packet by packet (and packet by
/// packet again for each spread asked for).
fn measure(s: &Scenario, with_reference: bool, spreads: Spreads) -> Result<AccelRow> {
    let (fast, t_fast, fast_runs) = timed_median(PacketConfig::default(), s)?;
    let reference = if with_reference {
        Some(timed(PacketConfig::reference(), s)?)
    } else {
        None
    };
    let spread = match &reference {
        Some((reference, _)) if spreads.seed => {
            let mut config = PacketConfig::reference();
            config.seed = config.seed.wrapping_add(1);
            let (other, _) = timed(config, s)?;
            Some(RunErrors::between(&reference.report, &other.report, &s.flows).into())
        }
        _ => None,
    };
    let label_spread = match &reference {
        Some((reference, _)) if spreads.label => {
            let (renamed, old_of) = renumbered(&s.flows);
            let (other, _) = timed_on(PacketConfig::reference(), s, &renamed)?;
            let mut report = other.report;
            let mut flows = report.flows.clone();
            for (k, &i) in old_of.iter().enumerate() {
                flows[i] = report.flows[k];
            }
            report.flows = flows;
            Some(RunErrors::between(&reference.report, &report, &s.flows).into())
        }
        _ => None,
    };
    let fluid = if spreads.fluid {
        let sim = FluidSimulator {
            longest_link_step: spreads.fluid_link_step,
            ..Default::default()
        };
        let (report, secs, copies) = timed_fluid(s, &sim)?;
        let slow_runs = [
            (
                FluidSimulator {
                    calm_skip: false,
                    ..sim.clone()
                },
                "--fluid-every-step",
                "calm skip",
            ),
            (
                FluidSimulator {
                    gap_skip: false,
                    ..sim.clone()
                },
                "--fluid-no-gap-skip",
                "gap skip",
            ),
        ];
        let mut slow_secs = [0.0; 2];
        for ((slow, flag, skip), slow_secs) in slow_runs.iter().zip(&mut slow_secs) {
            let (slow_report, t, _) = timed_fluid(s, slow)?;
            if slow_report.flows != report.flows {
                anyhow::bail!(
                    "{}: the fluid model's {skip} changed the flows' times (it must not: \
                     compare `orrery netsim --model fluid` with and without {flag})",
                    s.name
                );
            }
            *slow_secs = t;
        }
        let errors = reference
            .as_ref()
            .map(|(r, _)| RunErrors::between(&r.report, &report, &s.flows).into());
        Some((secs, errors, slow_secs, copies))
    } else {
        None
    };
    let st = &fast.stats;
    let skipped = st.total_skipped_events();
    let events = fast.report.events;
    let reference_events = reference
        .as_ref()
        .map_or(events + skipped, |(r, _)| r.report.events);
    Ok(AccelRow {
        scenario: s.name.clone(),
        release: s.release,
        gpus: s.gpus,
        flows: s.flows.flows.len(),
        reference_secs: reference.as_ref().map(|(_, t)| *t),
        accelerated_secs: t_fast,
        accelerated_runs: fast_runs,
        wall_speedup: reference.as_ref().map(|(_, t)| t / t_fast),
        reference_events,
        reference_events_estimated: reference.is_none(),
        events,
        event_ratio: reference_events as f64 / events.max(1) as f64,
        skipped_events: skipped,
        fast_forwards: st.fast_forwards,
        quiet_jumps: st.quiet_jumps,
        cut_jumps: st.cut_jumps,
        ff_held: st.ff_held,
        memo_lookups: st.memo_lookups,
        memo_hits: st.memo_hits,
        memo_hit_rate: st.memo_hit_rate(),
        mirrored_groups: st.memo_mirrored,
        virtual_flows: st.periodic_flows,
        repeated_flows: st.collective_memo_flows,
        symmetry_copies: st.symmetry_order,
        drops: fast.report.drops,
        reference_drops: reference.as_ref().map(|(r, _)| r.report.drops),
        errors: reference
            .as_ref()
            .map(|(r, _)| RunErrors::between(&r.report, &fast.report, &s.flows).into()),
        reference_seed_spread: spread,
        reference_label_spread: label_spread,
        fluid_secs: fluid.as_ref().map(|f| f.0),
        fluid_every_step_secs: fluid.as_ref().map(|f| f.2[0]),
        fluid_every_gap_secs: fluid.as_ref().map(|f| f.2[1]),
        fluid_symmetry_copies: fluid.as_ref().map(|f| f.3),
        fluid_errors: fluid.and_then(|f| f.1),
    })
}

/// The fluid model `sim` on `s`, timed as [`timed_median`] times the accelerated run, with
/// the copies each stepped flow stood for.
fn timed_fluid(s: &Scenario, sim: &FluidSimulator) -> Result<(SimReport, f64, u64)> {
    // Each run finds the same rotations; the last one's are kept.
    let copies = std::cell::Cell::new(1);
    let run = || -> Result<(SimReport, f64)> {
        let start = Instant::now();
        let (report, run) = sim
            .run_with_progress(&s.graph, &s.flows, &mut |_| {})
            .with_context(|| format!("{}: the fluid model failed", s.name))?;
        copies.set(run.symmetry.iter().map(|r| u64::from(r.copies())).product());
        Ok((report, start.elapsed().as_secs_f64()))
    };
    let (report, secs, _) = repeated_while_short(s, "fluid", run, |a, b| a == b)?;
    Ok((report, secs, copies.get()))
}

/// The table's header line, its columns as wide as [`table_line`]'s.
fn table_header() -> String {
    format!(
        "{:<46} {:>5} {:>6} {:>9} {:>9} {:>9} {:>10} {:>13} {:>12} {:>13} {:>6} {:>6} {:>8} {:>8} {:>4} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "scenario",
        "GPUs",
        "flows",
        "ref s",
        "accel s",
        "speedup",
        "ev ratio",
        "ref events",
        "events",
        "skipped",
        "memo%",
        "mirror",
        "virtual",
        "repeated",
        "sym",
        "meanFCT%",
        "p99FCT%",
        "end%",
        "coll%",
        "cct%"
    )
}

/// The row as a line of the table: the wall speedup where the reference ran (else "-"),
/// and the events ratio, marked "~" where it is estimated.
fn table_line(r: &AccelRow) -> String {
    let memo = 100.0 * r.memo_hit_rate;
    let sym = match r.symmetry_copies {
        0 | 1 => "-".to_string(),
        k => format!("{k}x"),
    };
    // The events ratio does not move with the machine's load, where the wall speedup
    // does; without a reference run it is estimated from the events the run skipped.
    let measured = match (&r.errors, r.reference_secs, r.wall_speedup) {
        (Some(e), Some(t_ref), Some(speedup)) => format!(
            "{:>9.2} {:>9.3} {:>8.1}x {:>9.1}x {:>13} {:>12} {:>13} {:>6.1} {:>6} {:>8} {:>8} {:>4} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3}",
            t_ref,
            r.accelerated_secs,
            speedup,
            r.event_ratio,
            r.reference_events,
            r.events,
            r.skipped_events,
            memo,
            r.mirrored_groups,
            r.virtual_flows,
            r.repeated_flows,
            sym,
            100.0 * e.mean_fct,
            100.0 * e.p99_fct,
            100.0 * e.end,
            100.0 * e.collective,
            100.0 * e.collective_time
        ),
        _ => format!(
            "{:>9} {:>9.3} {:>9} {:>10} {:>13} {:>12} {:>13} {:>6.1} {:>6} {:>8} {:>8} {:>4} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "-",
            r.accelerated_secs,
            "-",
            format!("~{:.1}x", r.event_ratio),
            format!("~{}", r.reference_events),
            r.events,
            r.skipped_events,
            memo,
            r.mirrored_groups,
            r.virtual_flows,
            r.repeated_flows,
            sym,
            "-",
            "-",
            "-",
            "-",
            "-"
        ),
    };
    format!("{:<46} {:>5} {:>6} {measured}", r.scenario, r.gpus, r.flows)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A row as a 1,024-GPU step would fill it, with or without its reference run.
    fn row(with_reference: bool) -> AccelRow {
        let errors = || AccelErrors {
            mean_fct: 0.0033,
            p99_fct: 0.0488,
            end: 0.0033,
            collective: 0.0558,
            collective_time: 5.5232,
        };
        AccelRow {
            scenario: "GPT 350M step (DP+PP)".to_string(),
            release: Some(Release::Rendezvous),
            gpus: 1024,
            flows: 210_912,
            reference_secs: with_reference.then_some(301.07),
            accelerated_secs: 146.77,
            accelerated_runs: 1,
            wall_speedup: with_reference.then_some(2.06),
            reference_events: 3_568_854_918,
            reference_events_estimated: !with_reference,
            events: 1_008_587_356,
            event_ratio: 3.538,
            skipped_events: 3_158_009_128,
            fast_forwards: 4_901,
            quiet_jumps: 4_798,
            cut_jumps: 103,
            ff_held: FastForwardHeld::default(),
            memo_lookups: 9_751,
            memo_hits: 7_321,
            memo_hit_rate: 0.7508,
            mirrored_groups: 853,
            virtual_flows: 162_560,
            repeated_flows: 0,
            symmetry_copies: 0,
            drops: 0,
            reference_drops: with_reference.then_some(0),
            errors: with_reference.then(errors),
            reference_seed_spread: None,
            reference_label_spread: None,
            fluid_secs: None,
            fluid_errors: None,
            fluid_symmetry_copies: None,
            fluid_every_step_secs: None,
            fluid_every_gap_secs: None,
        }
    }

    /// Every column of a line sits under its header, with or without a reference run
    /// (the header and the two kinds of line are formatted apart), and the line carries
    /// the events ratio and the skipped events, the issue's measures beside the speedup.
    #[test]
    fn table_lines_fit_their_header() {
        let header = table_header();
        // Where each header column ends: a right-aligned value ends there too.
        let ends = |line: &str| -> Vec<usize> {
            let b = line.as_bytes();
            (1..=b.len())
                .filter(|&i| b[i - 1] != b' ' && (i == b.len() || b[i] == b' '))
                .collect()
        };
        let header_ends = ends(&header);
        for with_reference in [true, false] {
            let line = table_line(&row(with_reference));
            assert_eq!(line.len(), header.len(), "{header}\n{line}");
            let line_ends = ends(&line);
            // Past the scenario's name (its words end wherever they end), each of the 19
            // values ends where a header column does (a header's name may be two words).
            let tail: Vec<usize> = line_ends.into_iter().filter(|&i| i > 46).collect();
            assert_eq!(tail.len(), 19, "{header}\n{line}");
            assert!(
                tail.iter().all(|i| header_ends.contains(i)),
                "{header}\n{line}"
            );
            let ratio = if with_reference { " 3.5x " } else { " ~3.5x " };
            assert!(line.contains(ratio), "{line}");
            assert!(line.contains(" 3158009128 "), "{line}");
        }
        assert!(table_line(&row(true)).contains(" 2.1x "));
    }

    #[test]
    fn renumbering_keeps_dependencies_first_and_maps_back() {
        // A ring all-reduce over four ranks: chains of dependencies and ties among the
        // flows ready at once.
        let mut flows = FlowSet::default();
        collective_flows(
            &mut flows,
            "ring",
            CollectiveKind::AllReduce,
            FlowAlgorithm::Ring { channels: 2 },
            &[0, 1, 2, 3],
            Bytes(1 << 16),
            4,
            Picos::ZERO,
        )
        .unwrap();
        let (renamed, old_of) = renumbered(&flows);
        renamed.check().unwrap();
        let mut seen = old_of.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..flows.flows.len()).collect::<Vec<_>>());
        assert_ne!(old_of, seen, "another order than the first");
        let mut new_of = vec![0; old_of.len()];
        for (k, &i) in old_of.iter().enumerate() {
            new_of[i] = k;
        }
        for (k, &i) in old_of.iter().enumerate() {
            let (a, b) = (&renamed.flows[k], &flows.flows[i]);
            assert_eq!(
                (a.src, a.dst, a.bytes, a.delay),
                (b.src, b.dst, b.bytes, b.delay)
            );
            let mut deps: Vec<usize> = a.deps.iter().map(|d| old_of[d.index()]).collect();
            let mut want: Vec<usize> = b.deps.iter().map(|d| d.index()).collect();
            deps.sort_unstable();
            want.sort_unstable();
            assert_eq!(deps, want, "flow {i}");
            assert!(b.deps.iter().all(|d| new_of[d.index()] < k));
        }
    }

    /// `--fluid` times the fluid model with and without its calm skip and its gap skip,
    /// and the row is made only where the runs' flows agree (the bench fails otherwise);
    /// it says how many copies the fluid model's symmetry reduction stepped as one.
    #[test]
    fn the_fluid_rows_time_the_calm_skip_and_the_gap_skip_against_every_step() {
        // 64 GPUs: of 16, 32 and 64, the smallest ring the symmetry search finds a rotation of.
        let s = ring_all_reduce(64, 16 << 20).unwrap();
        let spreads = Spreads {
            seed: false,
            label: false,
            fluid: true,
            fluid_link_step: None,
        };
        let row = measure(&s, false, spreads).unwrap();
        assert!(row.fluid_secs.is_some_and(|t| t > 0.0));
        assert!(row.fluid_every_step_secs.is_some_and(|t| t > 0.0));
        assert!(row.fluid_every_gap_secs.is_some_and(|t| t > 0.0));
        assert!(row.fluid_errors.is_none(), "no reference ran");
        // The fluid model finds the packet model's rotations (the hosts' and their GPUs').
        assert!(row.symmetry_copies > 1, "{}", row.symmetry_copies);
        assert_eq!(row.fluid_symmetry_copies, Some(row.symmetry_copies));
    }
}
