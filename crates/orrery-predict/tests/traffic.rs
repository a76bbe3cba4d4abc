//! A job's training-step communication as flows: every collective instance and pipeline send
//! appears once, released when the replay issued it, and the flows simulate to completion.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::small_job;
use orrery_graph::OpKind;
use orrery_net::flow_model::FlowLevelSimulator;
use orrery_net::sim::FlowSimulator;
use orrery_predict::traffic::{job_traffic, TrafficSelection};

#[test]
fn every_send_and_collective_instance_becomes_flows() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let (graph, flows) = job_traffic(&job, TrafficSelection::ALL).unwrap();
    assert_eq!(graph.num_endpoints() as u64, job.parallel().world_size());
    assert!(flows.check().is_ok());
    // Pipeline sends: one flow per send op of every rank.
    let graphs = orrery_graph::build(&job);
    let layout = &graphs.layout;
    let sends: usize = (0..layout.world_size())
        .map(|r| {
            let g = graphs.class(layout.class_of(orrery_units::RankId(r)));
            g.ops()
                .iter()
                .filter(|o| matches!(o.kind, OpKind::Send { .. }))
                .count()
        })
        .sum();
    let p2p = flows
        .collectives
        .iter()
        .filter(|c| c.kind.is_none())
        .count();
    assert_eq!(p2p, sends);
    // Collective instances: each group's collectives once, not once per member.
    // Collective instances: each group's collectives once, not once per member, so the
    // instances are the members' collective ops divided by the group sizes.
    let member_ops: f64 = (0..layout.world_size())
        .map(|r| {
            let g = graphs.class(layout.class_of(orrery_units::RankId(r)));
            g.ops()
                .iter()
                .filter_map(|o| match o.kind {
                    OpKind::Collective { group, .. } => Some(f64::from(layout.group_size(group))),
                    _ => None,
                })
                .map(|size| 1.0 / size)
                .sum::<f64>()
        })
        .sum();
    let collectives = flows
        .collectives
        .iter()
        .filter(|c| c.kind.is_some())
        .count();
    assert_eq!(collectives, member_ops.round() as usize);
    // The traffic simulates to completion.
    let report = FlowLevelSimulator::default()
        .simulate(&graph, &flows)
        .unwrap();
    assert_eq!(report.bytes_delivered, report.bytes_sent);
    assert!(report.end.0 > 0);
}

#[test]
fn selection_filters_the_traffic() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let pp_only = TrafficSelection::from_names(&["pp"]).unwrap();
    let (_, flows) = job_traffic(&job, pp_only).unwrap();
    assert!(!flows.flows.is_empty());
    assert!(flows.collectives.iter().all(|c| c.kind.is_none()));
    assert_eq!(
        TrafficSelection::from_names(&["dp", "xx"]).unwrap_err(),
        vec!["xx".to_string()]
    );
}
