//! Properties of the replay: class replay equals all-rank replay, every group issues the
//! same collectives in the same order, graphs are acyclic, the ledger balances, and the
//! output is deterministic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::small_job;
use orrery_graph::materialize::{materialize, Concrete};
use orrery_graph::{build, OpKind};
use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_predict::{fabric_for, predict, predict_with, ReplayMode};
use orrery_units::RankId;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn layouts() -> impl Strategy<Value = Vec<String>> {
    (
        prop_oneof![Just(1u64), Just(2)],
        prop_oneof![Just(1u64), Just(2), Just(4)],
        prop_oneof![Just(1u64), Just(2)],
        prop_oneof![Just(1u64), Just(2)],
        any::<bool>(),
        prop_oneof![Just("none"), Just("selective"), Just("full")],
        0u64..4,
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just("flash"), Just("unfused")],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(tp, pp, dp, cp, interleave, recompute, zero, overlap, sp, attention, moe, tied)| {
                let cp = if attention == "unfused" { 1 } else { cp };
                let vpp = if interleave && pp > 1 { 2 } else { 1 };
                let world = tp * pp * dp * cp;
                let mut o = vec![
                    format!("parallel.tp={tp}"),
                    format!("parallel.pp={pp}"),
                    format!("parallel.dp={dp}"),
                    format!("parallel.cp={cp}"),
                    format!("parallel.vpp={vpp}"),
                    format!("parallel.sp={sp}"),
                    format!("parallel.overlap_grad_reduce={overlap}"),
                    format!("parallel.overlap_param_gather={overlap}"),
                    format!("parallel.tp_comm_overlap={overlap}"),
                    format!("parallel.bucket_mparams=1"),
                    format!("training.recompute=\"{recompute}\""),
                    format!("training.zero_stage={zero}"),
                    format!("training.attention=\"{attention}\""),
                    format!("training.global_batch={}", 4 * dp * pp),
                    format!("cluster.gpus_per_node={}", world.min(4)),
                    format!("cluster.nodes={}", world.div_ceil(4)),
                    "model.layers=8".to_string(),
                    format!("model.tied_embeddings={tied}"),
                ];
                if moe && dp * cp >= 2 {
                    o.push("model.moe.experts=4".into());
                    o.push("model.moe.top_k=2".into());
                    o.push("model.moe.expert_ffn=512".into());
                    o.push(format!("parallel.ep={}", (dp * cp).min(2)));
                }
                o
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn class_replay_equals_all_rank_replay(overrides in layouts()) {
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let job = small_job(&refs);
        let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
        let classes = predict_with(&job, &net, ReplayMode::Classes).unwrap();
        let all = predict_with(&job, &net, ReplayMode::AllRanks).unwrap();
        prop_assert!(classes.graphs.layout.is_regular());
        prop_assert_eq!(classes.prediction.step_time, all.prediction.step_time);
        // Every rank's timeline equals its class's.
        for p in &all.timeline.participants {
            let c = &classes.timeline.participants[p.class.index()];
            prop_assert_eq!(&p.ops, &c.ops, "rank {} differs from its class", p.rank);
        }
        for (a, b) in classes.prediction.memory.iter().zip(&all.prediction.memory) {
            prop_assert_eq!(a.peak, b.peak);
        }
        // The class map covers every rank exactly once.
        let covered: u32 = classes.prediction.classes.iter().map(|c| c.ranks).sum();
        prop_assert_eq!(u64::from(covered), job.parallel().world_size());
    }

    #[test]
    fn graphs_are_acyclic_and_ledgers_balance(overrides in layouts()) {
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let job = small_job(&refs);
        let out = predict(&job).unwrap();
        for g in &out.graphs.classes {
            prop_assert!(g.check().is_ok());
        }
        for m in &out.prediction.memory {
            // The ledger never went negative (predict would have failed) and everything
            // but the model state is freed by the end of the step.
            let last = m.ledger.events.last().unwrap().allocated;
            let statics: u64 = out.graphs.classes[m.stage as usize]
                .ops()
                .iter()
                .filter_map(|o| match o.kind {
                    OpKind::Alloc { bytes, category } if category != orrery_graph::MemoryCategory::Activations
                        && category != orrery_graph::MemoryCategory::Temporary => Some(bytes.0),
                    _ => None,
                })
                .sum();
            prop_assert_eq!(last.0, statics);
            prop_assert!(m.peak >= last);
        }
        let b = out.prediction.breakdown;
        prop_assert_eq!(b.sum(), b.total);
    }

    #[test]
    fn every_group_issues_the_same_collectives_in_order(overrides in layouts()) {
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let job = small_job(&refs);
        let graphs = build(&job);
        let mut seqs: BTreeMap<u32, BTreeMap<u32, Vec<String>>> = BTreeMap::new();
        for r in 0..graphs.layout.world_size() {
            let rg = materialize(&graphs, RankId(r));
            for (op, res) in rg.graph.ops().iter().zip(&rg.resolved) {
                if let (OpKind::Collective { op: c, bytes, .. }, Concrete::Group(g)) = (op.kind, res) {
                    seqs.entry(g.0).or_default().entry(r).or_default().push(format!("{c:?}:{}", bytes.0));
                }
            }
        }
        for (g, per_rank) in seqs {
            let members = per_rank.len();
            let mut it = per_rank.values();
            let first = it.next().unwrap();
            for other in it {
                prop_assert_eq!(first, other, "group {} ({} members) disagrees", g, members);
            }
        }
    }
}

#[test]
fn prediction_is_deterministic() {
    let job = small_job(&[
        "parallel.vpp=2",
        "training.global_batch=8",
        "parallel.dp=2",
        "cluster.nodes=2",
    ]);
    let a = serde_json::to_string(&predict(&job).unwrap().prediction).unwrap();
    let b = serde_json::to_string(&predict(&job).unwrap().prediction).unwrap();
    assert_eq!(a, b);
}

#[test]
fn mfu_arithmetic() {
    let job = small_job(&[]);
    let p = predict(&job).unwrap().prediction;
    let peak = job.cluster().gpu.bf16_peak.0;
    let expect = p.model_flops / (p.step_time.as_secs_f64() * p.world_size as f64 * peak);
    assert!((p.mfu - expect).abs() < 1e-12);
    assert!(
        (p.tokens_per_second - p.tokens_per_step as f64 / p.step_time.as_secs_f64()).abs() < 1e-6
    );
}

/// Tied embeddings with a pipeline: the first and last stage all-reduce the embedding
/// gradients between them (and only they), and the class replay waits for both.
#[test]
fn tied_embeddings_all_reduce_between_first_and_last_stage() {
    let job = small_job(&[
        "model.tied_embeddings=true",
        "parallel.pp=4",
        "parallel.tp=1",
        "parallel.dp=2",
    ]);
    let graphs = build(&job);
    let count = |stage: usize| {
        graphs.classes[stage]
            .ops()
            .iter()
            .filter(|o| graphs.classes[stage].name_of(o) == "embedding-grad-allreduce")
            .map(|o| match o.kind {
                OpKind::Collective { bytes, .. } => bytes.0,
                _ => 0,
            })
            .collect::<Vec<u64>>()
    };
    // fp32 gradients of the vocab x hidden table (1000 x 256), unsharded with tp = 1.
    assert_eq!(count(0), vec![4 * 1000 * 256]);
    assert_eq!(count(3), vec![4 * 1000 * 256]);
    assert!(count(1).is_empty() && count(2).is_empty());
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    let classes = predict_with(&job, &net, ReplayMode::Classes).unwrap();
    let all = predict_with(&job, &net, ReplayMode::AllRanks).unwrap();
    assert_eq!(classes.prediction.step_time, all.prediction.step_time);
    // Untied, or without a pipeline, there is nothing to synchronise.
    let untied = build(&small_job(&[
        "parallel.pp=4",
        "parallel.tp=1",
        "parallel.dp=2",
    ]));
    assert!(untied.classes.iter().all(|g| g
        .ops()
        .iter()
        .all(|o| g.name_of(o) != "embedding-grad-allreduce")));
}
