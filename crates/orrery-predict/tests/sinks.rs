//! Tests of the Perfetto trace and SVG sinks on small jobs.

// Helpers outside `#[test]` functions panic on purpose when a trace is malformed.
#![allow(clippy::unwrap_used)]

use orrery_graph::OpKind;
use orrery_predict::sinks::{
    breakdown_svg, memory_timeline_svg, write_perfetto_trace, write_perfetto_trace_with,
    TraceOptions,
};
use orrery_predict::{predict, predict_with, PredictOutput, ReplayMode};
use orrery_spec::{load_job_spec, Job};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// A small job: 4 layers on 2 nodes of 4 GPUs, tp 2, pp 2, dp 2.
const SMALL: &str = r#"
name = "sinks-small"
[model]
layers = 4
hidden = 256
heads = 8
ffn = 1024
vocab = 1000
seq_len = 128

[training]
global_batch = 8
micro_batch = 1

[parallel]
tp = 2
pp = 2
dp = 2

[cluster]
gpu = "H100-SXM"
gpus_per_node = 4
nodes = 2
"#;

/// A tiny job for the golden test: 2 layers, pp 2, one GPU per stage.
const TINY: &str = r#"
name = "sinks-tiny"
[model]
layers = 2
hidden = 64
heads = 4
ffn = 256
vocab = 128
seq_len = 32

[training]
global_batch = 2
micro_batch = 1

[parallel]
tp = 1
pp = 2
dp = 1

[cluster]
gpu = "H100-SXM"
gpus_per_node = 2
nodes = 1
"#;

fn job(text: &str) -> Job {
    let spec = load_job_spec(text, &[]).unwrap_or_else(|e| panic!("{e}"));
    Job::from_spec(&spec).unwrap_or_else(|e| panic!("{e}"))
}

fn output(text: &str) -> PredictOutput {
    predict(&job(text)).unwrap_or_else(|e| panic!("{e}"))
}

fn trace_bytes(out: &PredictOutput) -> Vec<u8> {
    let mut buf = Vec::new();
    write_perfetto_trace(out, &mut buf).unwrap();
    buf
}

fn events(trace: &Value) -> &Vec<Value> {
    trace["traceEvents"].as_array().unwrap()
}

/// A trace time (µs with six decimals) back to integer picoseconds.
fn ps(v: &Value) -> u64 {
    (v.as_f64().unwrap() * 1e6).round() as u64
}

/// On-stream ops with nonzero duration, summed over participants.
fn timed_stream_ops(out: &PredictOutput) -> usize {
    out.timeline
        .participants
        .iter()
        .map(|p| {
            let g = out.graphs.class(p.class);
            g.ops()
                .iter()
                .zip(&p.ops)
                .filter(|(op, t)| {
                    matches!(
                        op.kind,
                        OpKind::Compute { .. } | OpKind::Collective { .. } | OpKind::Send { .. }
                    ) && t.end > t.start
                })
                .count()
        })
        .sum()
}

fn check_trace(out: &PredictOutput, trace: &Value) {
    let evs = events(trace);
    let step_ps = out.prediction.step_time.0;
    assert!(step_ps > 0);
    assert_eq!(trace["displayTimeUnit"], "ms");
    assert_eq!(ps(&trace["otherData"]["step_time_us"]), step_ps);

    // One named process per participant.
    let pids: BTreeSet<u64> = out
        .timeline
        .participants
        .iter()
        .map(|p| u64::from(p.rank.0))
        .collect();
    assert_eq!(pids.len(), out.timeline.participants.len());
    let mut process_names = BTreeMap::new();
    let mut thread_names = BTreeSet::new();
    for e in evs.iter().filter(|e| e["ph"] == "M") {
        let pid = e["pid"].as_u64().unwrap();
        let name = e["args"]["name"].as_str();
        match e["name"].as_str().unwrap() {
            "process_name" => {
                assert!(process_names
                    .insert(pid, name.unwrap().to_string())
                    .is_none());
            }
            "thread_name" => {
                let tid = e["tid"].as_u64().unwrap();
                assert!(thread_names.insert((pid, tid)));
                let expected = orrery_graph::Stream::ALL[tid as usize].name();
                assert_eq!(name.unwrap(), expected);
            }
            _ => {}
        }
    }
    assert_eq!(process_names.keys().copied().collect::<BTreeSet<_>>(), pids);
    for p in &out.timeline.participants {
        let stage = out.graphs.layout.coords(p.rank).pp;
        assert_eq!(
            process_names[&u64::from(p.rank.0)],
            format!("stage {stage} (rank {})", p.rank)
        );
    }

    // Complete events: positive, inside the step, on a named thread, one per timed op.
    let xs: Vec<&Value> = evs.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(xs.len(), timed_stream_ops(out));
    for e in &xs {
        let (ts, dur) = (ps(&e["ts"]), ps(&e["dur"]));
        assert!(dur > 0, "{e}");
        assert!(
            ts + dur <= step_ps,
            "{e} ends after the step ({step_ps} ps)"
        );
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        assert!(thread_names.contains(&key), "{e} is on an unnamed thread");
        assert!(!e["name"].as_str().unwrap().is_empty());
        assert!(
            ["forward", "backward", "recompute", "optimizer"].contains(&e["cat"].as_str().unwrap())
        );
        assert!(e["args"]["bytes"].is_u64() || e["args"]["flops"].is_number());
    }
    // Ops on one thread never overlap (streams run one op at a time).
    let mut by_thread: BTreeMap<(u64, u64), Vec<(u64, u64)>> = BTreeMap::new();
    for e in &xs {
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        by_thread
            .entry(key)
            .or_default()
            .push((ps(&e["ts"]), ps(&e["ts"]) + ps(&e["dur"])));
    }
    for spans in by_thread.values_mut() {
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
    }

    // A memory counter per participant, reaching the participant's peak.
    for m in &out.prediction.memory {
        let pid = u64::from(m.rank.0);
        let max = evs
            .iter()
            .filter(|e| e["ph"] == "C" && e["pid"].as_u64() == Some(pid))
            .map(|e| e["args"]["allocated_gib"].as_f64().unwrap())
            .fold(0.0, f64::max);
        assert!(
            (max - m.peak.as_gib()).abs() < 1e-6,
            "{max} vs {}",
            m.peak.as_gib()
        );
    }
}

#[test]
fn trace_is_valid_json_with_one_process_per_participant() {
    let out = output(SMALL);
    assert_eq!(out.timeline.participants.len(), 2);
    let trace: Value = serde_json::from_slice(&trace_bytes(&out)).unwrap();
    check_trace(&out, &trace);
    assert_eq!(trace["otherData"]["job"], "sinks-small");
    assert_eq!(trace["otherData"]["participants_written"], 2);
}

#[test]
fn trace_of_all_rank_replay_covers_every_rank() {
    let job = job(SMALL);
    let net = orrery_net::AnalyticalNetwork::new(
        orrery_predict::fabric_for(&job),
        orrery_net::AlgorithmChoice::Auto,
    );
    let out = predict_with(&job, &net, ReplayMode::AllRanks).unwrap();
    assert_eq!(out.timeline.participants.len(), 8);
    let trace: Value = serde_json::from_slice(&trace_bytes(&out)).unwrap();
    check_trace(&out, &trace);
    assert_eq!(trace["otherData"]["replay_mode"], "all_ranks");
}

#[test]
fn trace_limit_keeps_every_stage_first() {
    let job = job(SMALL);
    let net = orrery_net::AnalyticalNetwork::new(
        orrery_predict::fabric_for(&job),
        orrery_net::AlgorithmChoice::Auto,
    );
    let out = predict_with(&job, &net, ReplayMode::AllRanks).unwrap();
    let opts = TraceOptions {
        max_participants: Some(3),
        ..TraceOptions::default()
    };
    let mut buf = Vec::new();
    write_perfetto_trace_with(&out, &opts, &mut buf).unwrap();
    let trace: Value = serde_json::from_slice(&buf).unwrap();
    let names: Vec<&str> = events(&trace)
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 3);
    for stage in 0..2 {
        let prefix = format!("stage {stage} ");
        assert!(names.iter().any(|n| n.starts_with(&prefix)), "{names:?}");
    }
    assert_eq!(trace["otherData"]["participants"], 8);
    assert_eq!(trace["otherData"]["participants_written"], 3);
    // A limit at or above the count changes nothing.
    let mut all = Vec::new();
    let opts = TraceOptions {
        max_participants: Some(8),
        ..TraceOptions::default()
    };
    write_perfetto_trace_with(&out, &opts, &mut all).unwrap();
    assert_eq!(all, trace_bytes(&out));
}

#[test]
fn trace_is_byte_identical_across_runs() {
    let a = trace_bytes(&output(SMALL));
    let b = trace_bytes(&output(SMALL));
    assert!(!a.is_empty());
    assert!(a == b, "two runs gave different traces");
}

/// A hand-built two-stage step whose timings do not depend on the cost model, so the
/// golden below changes only when the trace format does.
fn synthetic() -> PredictOutput {
    use orrery_graph::{
        CollectiveOp, ComputeKind, ExecGraph, GroupRole, JobGraphs, Layout, MemoryCategory, Op,
        PeerStage, Phase, Stream,
    };
    use orrery_predict::replay::{OpTiming, ParticipantTimeline, Timeline};
    use orrery_units::{Bytes, ClassId, Flops, OpId, Picos, RankId};

    fn op(g: &mut ExecGraph, name: &str, kind: OpKind, stream: Stream, mb: Option<u32>) -> Op {
        Op {
            kind,
            stream,
            phase: Phase::Forward,
            deps: Default::default(),
            name: g.intern(name),
            microbatch: mb,
        }
    }
    let gemm = OpKind::Compute {
        kind: ComputeKind::Gemm {
            m: 64,
            n: 64,
            k: 64,
            batch: 1,
            fp8: false,
        },
        flops: Flops(524_288.0),
        bytes: Bytes(24_576),
    };
    let mut stages = Vec::new();
    for stage in 0..2u32 {
        let mut g = ExecGraph::new();
        let mut ops = vec![
            op(
                &mut g,
                "weights",
                OpKind::Alloc {
                    bytes: Bytes(3 << 29),
                    category: MemoryCategory::Weights,
                },
                Stream::Compute,
                None,
            ),
            op(
                &mut g,
                "act",
                OpKind::Alloc {
                    bytes: Bytes(1 << 28),
                    category: MemoryCategory::Activations,
                },
                Stream::Compute,
                Some(0),
            ),
        ];
        let mut times = vec![(0, 0), (0, 0)];
        if stage == 1 {
            let recv = OpKind::Recv {
                peer: PeerStage::Prev,
                bytes: Bytes(4096),
                tag: 7,
            };
            ops.push(op(&mut g, "recv-act", recv, Stream::PpComm, Some(0)));
            times.push((0, 1_500_000));
        }
        let t0 = if stage == 1 { 1_500_000 } else { 0 };
        ops.push(op(&mut g, "L0.\"fc1\"", gemm, Stream::Compute, Some(0)));
        times.push((t0, t0 + 2_250_000));
        let ar = OpKind::Collective {
            op: CollectiveOp::AllReduce,
            group: GroupRole::Tp,
            bytes: Bytes(8192),
        };
        ops.push(op(&mut g, "L0.ar", ar, Stream::TpComm, Some(0)));
        times.push((t0 + 2_250_000, t0 + 3_000_001));
        // A zero-length op on a stream is not drawn.
        ops.push(op(&mut g, "noop", gemm, Stream::Compute, Some(0)));
        times.push((t0 + 3_000_001, t0 + 3_000_001));
        if stage == 0 {
            let send = OpKind::Send {
                peer: PeerStage::Next,
                bytes: Bytes(4096),
                tag: 7,
            };
            ops.push(op(&mut g, "send-act", send, Stream::PpComm, Some(0)));
            times.push((0, 1_500_000));
        }
        ops.push(op(
            &mut g,
            "free-act",
            OpKind::Free { alloc: OpId(1) },
            Stream::Compute,
            Some(0),
        ));
        times.push((t0 + 3_000_001, t0 + 3_000_001));
        for o in ops {
            g.push(o);
        }
        g.check().unwrap();
        let timing = ParticipantTimeline {
            rank: RankId(stage),
            class: ClassId(stage),
            ops: times
                .into_iter()
                .map(|(s, e)| OpTiming {
                    start: Picos(s),
                    end: Picos(e),
                })
                .collect(),
        };
        stages.push((g, timing));
    }
    let mut out = output(TINY);
    out.graphs = JobGraphs {
        layout: Layout::from_dims(1, 1, 1, 2, 1, 2),
        classes: stages.iter().map(|(g, _)| g.clone()).collect(),
    };
    out.timeline = Timeline {
        mode: ReplayMode::Classes,
        participants: stages.into_iter().map(|(_, t)| t).collect(),
        events: 0,
    };
    let p = &mut out.prediction;
    p.memory.clear();
    p.step_time = out.timeline.step_time();
    p.mfu = 0.25;
    p.world_size = 2;
    p.gpu = "H100-SXM".to_string();
    p.network_model = "analytical".to_string();
    out
}

#[test]
fn trace_golden() {
    let out = synthetic();
    let text = String::from_utf8(trace_bytes(&out)).unwrap();
    check_trace(&out, &serde_json::from_str(&text).unwrap());
    expect_test::expect![[r#"
        {"traceEvents":[
        {"ph":"M","pid":0,"tid":0,"name":"process_name","args":{"name":"stage 0 (rank 0)"}},
        {"ph":"M","pid":0,"tid":0,"name":"process_sort_index","args":{"sort_index":0}},
        {"ph":"M","pid":0,"tid":0,"name":"thread_name","args":{"name":"compute"}},
        {"ph":"M","pid":0,"tid":0,"name":"thread_sort_index","args":{"sort_index":0}},
        {"ph":"M","pid":0,"tid":1,"name":"thread_name","args":{"name":"tp-comm"}},
        {"ph":"M","pid":0,"tid":1,"name":"thread_sort_index","args":{"sort_index":1}},
        {"ph":"M","pid":0,"tid":5,"name":"thread_name","args":{"name":"pp-comm"}},
        {"ph":"M","pid":0,"tid":5,"name":"thread_sort_index","args":{"sort_index":5}},
        {"ph":"X","pid":0,"tid":0,"ts":0.000000,"dur":2.250000,"name":"L0.\"fc1\"","cat":"forward","args":{"kind":"gemm","flops":524288,"bytes":24576,"microbatch":0}},
        {"ph":"X","pid":0,"tid":1,"ts":2.250000,"dur":0.750001,"name":"L0.ar","cat":"forward","args":{"kind":"all_reduce","group":"tp","bytes":8192,"microbatch":0}},
        {"ph":"X","pid":0,"tid":5,"ts":0.000000,"dur":1.500000,"name":"send-act","cat":"forward","args":{"kind":"send","peer":"next","bytes":4096,"tag":7,"microbatch":0}},
        {"ph":"C","pid":0,"tid":0,"ts":0.000000,"name":"memory","args":{"allocated_gib":1.750000}},
        {"ph":"C","pid":0,"tid":0,"ts":3.000001,"name":"memory","args":{"allocated_gib":1.500000}},
        {"ph":"M","pid":1,"tid":0,"name":"process_name","args":{"name":"stage 1 (rank 1)"}},
        {"ph":"M","pid":1,"tid":0,"name":"process_sort_index","args":{"sort_index":1}},
        {"ph":"M","pid":1,"tid":0,"name":"thread_name","args":{"name":"compute"}},
        {"ph":"M","pid":1,"tid":0,"name":"thread_sort_index","args":{"sort_index":0}},
        {"ph":"M","pid":1,"tid":1,"name":"thread_name","args":{"name":"tp-comm"}},
        {"ph":"M","pid":1,"tid":1,"name":"thread_sort_index","args":{"sort_index":1}},
        {"ph":"M","pid":1,"tid":5,"name":"thread_name","args":{"name":"pp-comm"}},
        {"ph":"M","pid":1,"tid":5,"name":"thread_sort_index","args":{"sort_index":5}},
        {"ph":"i","s":"t","pid":1,"tid":5,"ts":1.500000,"name":"recv-act","cat":"forward","args":{"kind":"recv","peer":"prev","bytes":4096,"tag":7,"microbatch":0}},
        {"ph":"X","pid":1,"tid":0,"ts":1.500000,"dur":2.250000,"name":"L0.\"fc1\"","cat":"forward","args":{"kind":"gemm","flops":524288,"bytes":24576,"microbatch":0}},
        {"ph":"X","pid":1,"tid":1,"ts":3.750000,"dur":0.750001,"name":"L0.ar","cat":"forward","args":{"kind":"all_reduce","group":"tp","bytes":8192,"microbatch":0}},
        {"ph":"C","pid":1,"tid":0,"ts":0.000000,"name":"memory","args":{"allocated_gib":1.750000}},
        {"ph":"C","pid":1,"tid":0,"ts":4.500001,"name":"memory","args":{"allocated_gib":1.500000}}
        ],
        "displayTimeUnit":"ms",
        "otherData":{"generator":"orrery","job":"sinks-tiny","gpu":"H100-SXM","network_model":"analytical","replay_mode":"classes","world_size":2,"step_time_us":4.500001,"mfu":0.25,"participants":2,"participants_written":2}}
    "#]].assert_eq(&text);
}

/// The `points` lists of the SVG's polylines, as point counts.
fn polyline_sizes(svg: &str) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .map(|el| {
            let pts = el.split("points=\"").nth(1).unwrap();
            let pts = &pts[..pts.find('"').unwrap()];
            pts.split_whitespace().count()
        })
        .collect()
}

fn check_svg_shape(svg: &str) {
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
}

#[test]
fn memory_svg_has_a_line_per_stage_and_the_hbm_limit() {
    let out = output(SMALL);
    let svg = memory_timeline_svg(&out);
    check_svg_shape(&svg);
    let stages = out.prediction.memory.len();
    assert_eq!(stages, 2);
    // Stage lines are step functions (many points); legend keys and dashes have two.
    let lines = polyline_sizes(&svg).into_iter().filter(|&n| n > 2).count();
    assert_eq!(lines, stages);
    for m in &out.prediction.memory {
        assert!(svg.contains(&format!("stage {} (rank {})", m.stage, m.rank)));
    }
    assert!(svg.contains("usable HBM"));
    assert!(svg.contains("time (ms)"));
    assert!(svg.contains("allocated (GiB)"));
    assert!(svg.contains("Allocated memory per pipeline stage: sinks-small"));
    // The dashed limit is many short segments in its own colour.
    assert!(svg.matches("stroke=\"#C00000\"").count() > 10);
    assert_eq!(svg, memory_timeline_svg(&output(SMALL)));
}

#[test]
fn breakdown_svg_labels_every_part() {
    let out = output(SMALL);
    let p = &out.prediction;
    let svg = breakdown_svg(p);
    check_svg_shape(&svg);
    for label in [
        "step",
        "forward",
        "backward",
        "recompute",
        "optimizer",
        "exposed TP",
        "exposed CP",
        "exposed EP",
        "exposed PP",
        "exposed DP",
        "bubble",
        "time (ms)",
    ] {
        assert!(
            svg.contains(&format!("{label}\n</text>")),
            "no label {label}"
        );
    }
    let fwd = format!("{:.3} ms", p.breakdown.compute_forward.0 as f64 / 1e9);
    assert!(svg.contains(&fwd), "no value {fwd}");
    assert!(p.breakdown.compute_forward.0 > 0);
    assert!(svg.contains("<rect"));
    assert_eq!(svg, breakdown_svg(&output(SMALL).prediction));
}

#[test]
fn charts_of_an_empty_prediction_are_still_svg() {
    let mut out = output(TINY);
    out.prediction.memory.clear();
    out.prediction.breakdown = orrery_predict::Breakdown::default();
    out.prediction.step_time = orrery_units::Picos::ZERO;
    check_svg_shape(&memory_timeline_svg(&out));
    check_svg_shape(&breakdown_svg(&out.prediction));
}
