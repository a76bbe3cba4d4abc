//! Chakra traces exported by orrery, imported back and replayed, give exactly the all-rank
//! replay of the job they came from; measured durations in a trace replace the cost model.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::small_job;
use orrery_graph::chakra::{
    comm_groups_json, export_rank, export_rank_with_times, import_rank, OpTime,
};
use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_predict::traces::{replay_traces, TraceReplayError};
use orrery_predict::{fabric_for, predict_with, ReplayMode};
use orrery_units::{Picos, RankId};
use std::collections::BTreeMap;

fn groups_of(json: &str) -> BTreeMap<String, Vec<u32>> {
    serde_json::from_str(json).unwrap()
}

#[test]
fn exported_traces_replay_exactly_like_the_job() {
    for overrides in [
        vec!["parallel.dp=2", "training.global_batch=8"],
        vec![
            "parallel.vpp=2",
            "parallel.dp=2",
            "training.global_batch=8",
            "training.zero_stage=1",
        ],
        vec![
            "parallel.tp=1",
            "parallel.dp=4",
            "model.moe.experts=4",
            "model.moe.top_k=2",
            "model.moe.expert_ffn=512",
            "parallel.ep=2",
            "training.global_batch=16",
        ],
    ] {
        let job = small_job(&overrides);
        let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
        let reference = predict_with(&job, &net, ReplayMode::AllRanks).unwrap();
        let graphs = &reference.graphs;
        let world = graphs.layout.world_size();
        let traces: Vec<_> = (0..world)
            .map(|r| {
                let mut buf = Vec::new();
                export_rank(graphs, RankId(r), &mut buf).unwrap();
                import_rank(&buf).unwrap()
            })
            .collect();
        let groups = groups_of(&comm_groups_json(graphs));
        let (report, timeline) = replay_traces(&traces, &groups, job.cluster(), false).unwrap();
        assert_eq!(
            report.step_time, reference.prediction.step_time,
            "{overrides:?}"
        );
        for (a, b) in timeline
            .participants
            .iter()
            .zip(&reference.timeline.participants)
        {
            assert_eq!(a.rank, b.rank);
            assert_eq!(a.ops, b.ops, "rank {} differs ({overrides:?})", a.rank);
        }
        assert_eq!(report.measured_ops, 0);
    }
}

#[test]
fn measured_durations_replace_the_cost_model() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    let reference = predict_with(&job, &net, ReplayMode::AllRanks).unwrap();
    let graphs = &reference.graphs;
    let world = graphs.layout.world_size();
    // Every op measured at exactly 1 us: the replay must use those, not the cost model.
    let traces: Vec<_> = (0..world)
        .map(|r| {
            let n = graphs.class(graphs.layout.class_of(RankId(r))).len();
            let times = vec![
                OpTime {
                    start: Picos::ZERO,
                    duration: Picos::from_micros(1)
                };
                n
            ];
            let mut buf = Vec::new();
            export_rank_with_times(graphs, RankId(r), &times, &mut buf).unwrap();
            import_rank(&buf).unwrap()
        })
        .collect();
    let groups = groups_of(&comm_groups_json(graphs));
    let (report, timeline) = replay_traces(&traces, &groups, job.cluster(), true).unwrap();
    assert!(report.measured_ops > 0);
    let p = &timeline.participants[0];
    for (op, t) in traces[0].graph.ops().iter().zip(&p.ops) {
        if matches!(op.kind, orrery_graph::OpKind::Compute { .. }) {
            assert_eq!(t.end - t.start, Picos::from_micros(1));
        }
    }
}

#[test]
fn a_missing_rank_is_an_error_not_a_hang() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let graphs = orrery_graph::build(&job);
    let traces: Vec<_> = (0..3)
        .map(|r| {
            let mut buf = Vec::new();
            export_rank(&graphs, RankId(r), &mut buf).unwrap();
            import_rank(&buf).unwrap()
        })
        .collect();
    let groups = groups_of(&comm_groups_json(&graphs));
    let err = replay_traces(&traces, &groups, job.cluster(), false).unwrap_err();
    assert!(
        matches!(
            err,
            TraceReplayError::MissingMember { .. } | TraceReplayError::MissingPeer { .. }
        ),
        "{err}"
    );
    assert!(matches!(
        replay_traces(&[], &groups, job.cluster(), false),
        Err(TraceReplayError::Empty)
    ));
}
