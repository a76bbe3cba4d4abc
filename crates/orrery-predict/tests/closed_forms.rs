//! Reference tests against closed forms: Korthikanti activation memory, pipeline in-flight
//! activations, ZeRO model states and ring all-reduce alpha-beta through the whole predictor.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::small_job;
use orrery_graph::{
    build, model_state_bytes, CollectiveOp, MemoryCategory, OpKind, ParamShards, Shape, Stream,
};
use orrery_predict::predict;
use orrery_spec::Recompute;

/// Korthikanti et al. 2022, Table 2, for a 16-bit GPT layer (MHA, f = 4h, unfused
/// attention): bytes per layer.
/// A Korthikanti configuration: tensor-parallel size, sequence parallelism, selective and
/// full recomputation.
#[derive(Clone, Copy)]
struct Config {
    t: f64,
    sp: bool,
    selective: bool,
    full: bool,
}

fn korthikanti(s: f64, b: f64, h: f64, a: f64, c: Config) -> f64 {
    let Config {
        t,
        sp,
        selective,
        full,
    } = c;
    if full {
        return s * b * h * 2.0;
    }
    let scores = if selective {
        0.0
    } else {
        5.0 * a * s / (h * t)
    };
    match (t > 1.0, sp) {
        (false, _) => s * b * h * (34.0 + 5.0 * a * s / h * if selective { 0.0 } else { 1.0 }),
        (true, false) => s * b * h * (10.0 + 24.0 / t + scores),
        (true, true) => s * b * h * (34.0 / t + scores),
    }
}

#[test]
fn activation_memory_matches_korthikanti_table_2() {
    for (tp, sp, recompute) in [
        (1, false, "none"),
        (8, false, "none"),
        (8, true, "none"),
        (8, false, "selective"),
        (8, true, "selective"),
        (8, false, "full"),
        (1, false, "selective"),
    ] {
        let job = small_job(&[
            "model.layers=4",
            "model.hidden=2048",
            "model.heads=16",
            "model.ffn=8192",
            "model.seq_len=1024",
            "training.micro_batch=2",
            "training.global_batch=16",
            "training.attention=\"unfused\"",
            &format!("training.recompute=\"{recompute}\""),
            &format!("parallel.tp={tp}"),
            &format!("parallel.sp={sp}"),
            "parallel.pp=1",
            "parallel.dp=1",
            &format!("cluster.gpus_per_node={tp}"),
            "cluster.nodes=1",
        ]);
        let shape = Shape::new(&job);
        let ours = shape.layer_activation_bytes(None).0 as f64;
        let sp_on = sp && tp > 1;
        let c = Config {
            t: tp as f64,
            sp: sp_on,
            selective: recompute == "selective",
            full: recompute == "full",
        };
        let theirs = korthikanti(1024.0, 2.0, 2048.0, 16.0, c);
        assert_eq!(ours, theirs, "tp {tp} sp {sp} recompute {recompute}");
    }
}

#[test]
fn flash_attention_drops_the_score_terms() {
    let job = small_job(&["parallel.sp=true", "training.attention=\"flash\""]);
    let s = Shape::new(&job);
    let (sq, b, h, t) = (128.0, 1.0, 256.0, 2.0);
    assert_eq!(
        s.layer_activation_bytes(None).0 as f64,
        sq * b * h * 34.0 / t
    );
}

/// The first stage's activations at its peak: p micro-batches of L/p layers under 1F1B,
/// times (1 + (p-1)/(p*v)) under the interleaved schedule with v chunks (Korthikanti et al.
/// 2022, section 4.2.3), plus the embedding's dropout mask for in-flight micro-batches of the
/// first chunk, which is bounded by the in-flight count.
#[test]
fn first_stage_holds_l_layers_of_activations() {
    for (pp, vpp) in [(2u64, 1u64), (4, 1), (2, 2), (4, 2), (4, 4)] {
        let job = small_job(&[
            "model.layers=16",
            &format!("parallel.pp={pp}"),
            &format!("parallel.vpp={vpp}"),
            "parallel.dp=1",
            "parallel.tp=1",
            "training.global_batch=16",
            &format!("cluster.gpus_per_node={pp}"),
            "cluster.nodes=1",
        ]);
        let layer = Shape::new(&job).layer_activation_bytes(None).0 as f64;
        let out = predict(&job).unwrap();
        let at_peak = &out.prediction.memory[0].ledger.at_peak;
        let acts = at_peak
            .iter()
            .find(|(c, _)| *c == MemoryCategory::Activations)
            .unwrap()
            .1
             .0 as f64;
        let (l, p, v) = (16.0, pp as f64, vpp as f64);
        let factor = if vpp > 1 {
            1.0 + (p - 1.0) / (p * v)
        } else {
            1.0
        };
        let layers_bytes = l * factor * layer;
        let in_flight = if vpp > 1 { (v + 1.0) * p - 1.0 } else { p };
        let embedding_mask = 128.0 * 256.0; // s*b*h/t per micro-batch
        assert!(
            acts >= layers_bytes,
            "pp {pp} vpp {vpp}: {acts} < {layers_bytes}"
        );
        assert!(
            acts <= layers_bytes + in_flight * embedding_mask,
            "pp {pp} vpp {vpp}: {acts} > {layers_bytes} + masks"
        );
    }
}

/// Partial full recomputation (Megatron's block method): the first k layers of each stage
/// keep only their input, the others everything; under 1F1B the first stage holds p
/// micro-batches of that mix.
#[test]
fn partial_recomputation_keeps_the_rest_of_the_layers() {
    let (pp, per_stage) = (4u64, 4u64);
    for k in 0..=per_stage {
        let job = small_job(&[
            "model.layers=16",
            "parallel.pp=4",
            "parallel.dp=1",
            "parallel.tp=1",
            "training.global_batch=16",
            "training.recompute=\"full\"",
            &format!("training.recompute_layers={k}"),
            "cluster.gpus_per_node=4",
            "cluster.nodes=1",
        ]);
        let shape = Shape::new(&job);
        let full = shape.activation_bytes(None, Recompute::Full).0 as f64;
        let none = shape.activation_bytes(None, Recompute::None).0 as f64;
        let out = predict(&job).unwrap();
        let at_peak = &out.prediction.memory[0].ledger.at_peak;
        let acts = at_peak
            .iter()
            .find(|(c, _)| *c == MemoryCategory::Activations)
            .unwrap()
            .1
             .0 as f64;
        let embedding_mask = 128.0 * 256.0;
        let expected =
            pp as f64 * (k as f64 * full + (per_stage - k) as f64 * none + embedding_mask);
        assert_eq!(acts, expected, "k = {k}");
    }
}

#[test]
fn zero_model_states_match_the_paper() {
    let psi = 7_500_000_000u64;
    let p = |d| ParamShards {
        dense: psi,
        expert: 0,
        dp_dense: d,
        dp_expert: d,
    };
    // (2 + 2 + 12) psi at stage 0; 4 psi + 12 psi / Nd at stage 1; 2 psi + 14 psi / Nd at 2; 16 psi / Nd at 3.
    assert_eq!(model_state_bytes(p(64), 0, 2).total(), 16 * psi);
    assert_eq!(
        model_state_bytes(p(64), 1, 2).total(),
        4 * psi + (12 * psi).div_ceil(64) / 12 * 12
    );
    assert_eq!(
        model_state_bytes(p(64), 2, 2).total(),
        2 * psi + 14 * psi.div_ceil(64)
    );
    assert_eq!(
        model_state_bytes(p(64), 3, 2).total(),
        16 * psi.div_ceil(64)
    );
}

/// A pure data-parallel job without overlap: every gradient bucket's all-reduce is exposed,
/// so the exposed DP time equals the sum of the ring alpha-beta times of its buckets.
#[test]
fn exposed_dp_time_is_the_ring_alpha_beta_sum() {
    let job = small_job(&[
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.dp=8",
        "parallel.overlap_grad_reduce=false",
        "parallel.overlap_param_gather=false",
        "training.zero_stage=0",
        "training.global_batch=16",
        "cluster.gpus_per_node=8",
        "cluster.nodes=1",
    ]);
    let out = predict(&job).unwrap();
    let fabric = orrery_predict::fabric_for(&job);
    let n = 8.0;
    let alpha = fabric.intra_node.latency.as_secs_f64();
    let bw = fabric.intra_node.bandwidth.0 * fabric.intra_node.efficiency;
    let mut expected = 0.0;
    for op in build(&job).classes[0].ops() {
        if let OpKind::Collective {
            op: CollectiveOp::AllReduce,
            bytes,
            ..
        } = op.kind
        {
            assert_eq!(op.stream, Stream::DpComm);
            expected += 2.0 * (n - 1.0) * alpha + 2.0 * (n - 1.0) / n * bytes.0 as f64 / bw;
        }
    }
    let got = out.prediction.breakdown.exposed_dp.as_secs_f64();
    assert!(
        (got - expected).abs() / expected < 1e-6,
        "{got} vs {expected}"
    );
}
