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
use orrery_net::flows::{collective_flows, FlowAlgorithm, FlowSet};
use orrery_net::packet::{PacketConfig, PacketRun, PacketSimulator, TraceRequest};
use orrery_net::sim::RunErrors;
use orrery_net::topology::{NetGraph, RailOptimizedSpec};
use orrery_net::CollectiveKind;
use orrery_units::{Bytes, Picos};
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
}

fn ring_all_reduce(gpus: u32, bytes: u64) -> Result<Scenario> {
    let hosts = (gpus / 8).max(1) as usize;
    let graph = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(hosts))?;
    let mut flows = FlowSet::default();
    let ranks: Vec<u32> = (0..gpus).collect();
    collective_flows(
        &mut flows,
        "all-reduce",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 8 },
        &ranks,
        Bytes(bytes),
        graph.endpoints_per_host(),
        Picos::from_nanos(2000),
    )?;
    Ok(Scenario {
        name: format!("ring all-reduce {} MiB", bytes >> 20),
        gpus,
        graph,
        flows,
    })
}

fn job_step(name: &str, text: &str, overrides: &[String], traffic: &[&str]) -> Result<Scenario> {
    let spec = orrery_spec::load_job_spec(text, overrides).map_err(|e| anyhow::anyhow!("{e}"))?;
    let job = orrery_spec::Job::from_spec(&spec).map_err(|e| anyhow::anyhow!("{e}"))?;
    let select = orrery_predict::traffic::TrafficSelection::from_names(traffic)
        .map_err(|u| anyhow::anyhow!("unknown traffic {u:?}"))?;
    let (graph, flows) = orrery_predict::traffic::job_traffic(&job, select)?;
    Ok(Scenario {
        name: name.to_string(),
        gpus: job.parallel().world_size() as u32,
        graph,
        flows,
    })
}

fn gpt_step(gpus: u32) -> Result<Scenario> {
    let nodes = gpus / 8;
    let dp = gpus / 8; // tp 2 x pp 4 = 8 GPUs per replica
    let set = vec![
        format!("cluster.nodes={nodes}"),
        format!("parallel.dp={dp}"),
        format!("training.global_batch={}", 16 * dp),
    ];
    job_step("GPT 350M step (DP+PP)", GPT_JOB, &set, &["dp", "pp"])
}

fn gpt_13b_step(gpus: u32) -> Result<Scenario> {
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
    job_step("GPT 13B step (DP+PP)", GPT_JOB, &set, &["dp", "pp"])
}

fn moe_step() -> Result<Scenario> {
    let text =
        orrery_spec::preset_job_text("mixtral-8x7b-h100x64").map_err(|e| anyhow::anyhow!("{e}"))?;
    job_step(
        "Mixtral 8x7B, 8 layers (EP a2a + PP)",
        text,
        // Eight of the 32 layers and 64 sequences keep the reference run affordable; the
        // all-to-all pattern per layer and micro-batch is the model's.
        &[
            "model.layers=8".to_string(),
            "training.global_batch=64".to_string(),
        ],
        &["ep", "pp"],
    )
}

fn timed(config: PacketConfig, s: &Scenario) -> Result<(PacketRun, f64)> {
    let t = Instant::now();
    let run = PacketSimulator::new(config)
        .run(&s.graph, &s.flows, &TraceRequest::default())
        .with_context(|| format!("simulating {}", s.name))?;
    Ok((run, t.elapsed().as_secs_f64()))
}

/// Runs the table. `ring_mib` sizes the ring all-reduce (0: none); 350M GPT steps run at
/// each of `gpt_gpus` and 13B ones at each of `gpt_13b_gpus` (0s skipped); the MoE step
/// runs if `with_moe`; the reference runs only up to `reference_max_gpus`.
pub fn run_accel_bench(
    ring_mib: u64,
    gpt_gpus: &[u32],
    gpt_13b_gpus: &[u32],
    with_moe: bool,
    reference_max_gpus: u32,
) -> Result<()> {
    let mut scenarios = Vec::new();
    if ring_mib > 0 {
        scenarios.push(ring_all_reduce(128, ring_mib << 20)?);
    }
    for &g in gpt_gpus.iter().filter(|&&g| g > 0) {
        scenarios.push(gpt_step(g)?);
    }
    for &g in gpt_13b_gpus.iter().filter(|&&g| g > 0) {
        scenarios.push(gpt_13b_step(g)?);
    }
    if with_moe {
        scenarios.push(moe_step()?);
    }
    outln!(
        "orrery bench --accel: accelerated packet model (fast-forward, partitioning, memo, mirrors, periodic extrapolation) vs the packet-by-packet reference\n"
    );
    outln!(
        "{:<40} {:>5} {:>6} {:>9} {:>9} {:>9} {:>12} {:>12} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "scenario",
        "GPUs",
        "flows",
        "ref s",
        "accel s",
        "speedup",
        "ref events",
        "events",
        "memo%",
        "mirror",
        "virtual",
        "meanFCT%",
        "p99FCT%",
        "end%",
        "coll%"
    );
    for s in &scenarios {
        let (fast, t_fast) = timed(PacketConfig::default(), s)?;
        let skipped = fast.stats.total_skipped_events();
        let memo = 100.0 * fast.stats.memo_hit_rate();
        let mirrored = fast.stats.memo_mirrored;
        let virtual_flows = fast.stats.periodic_flows;
        let line = if s.gpus <= reference_max_gpus {
            let (reference, t_ref) = timed(PacketConfig::reference(), s)?;
            let e = RunErrors::between(&reference.report, &fast.report, &s.flows);
            format!(
                "{:>9.2} {:>9.2} {:>8.1}x {:>12} {:>12} {:>6.1} {:>6} {:>8} {:>8.3} {:>8.3} {:>8.3} {:>8.3}",
                t_ref,
                t_fast,
                t_ref / t_fast,
                reference.report.events,
                fast.report.events,
                memo,
                mirrored,
                virtual_flows,
                100.0 * e.mean_fct,
                100.0 * e.p99_fct,
                100.0 * e.end,
                100.0 * e.collective
            )
        } else {
            let est = (fast.report.events + skipped) as f64 / fast.report.events.max(1) as f64;
            format!(
                "{:>9} {:>9.2} {:>5.1}x est {:>12} {:>12} {:>6.1} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "-",
                t_fast,
                est,
                format!("~{}", fast.report.events + skipped),
                fast.report.events,
                memo,
                mirrored,
                virtual_flows,
                "-",
                "-",
                "-",
                "-"
            )
        };
        outln!(
            "{:<40} {:>5} {:>6} {line}",
            s.name,
            s.gpus,
            s.flows.flows.len()
        );
    }
    Ok(())
}
