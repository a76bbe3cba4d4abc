//! Flow- and packet-level models agree on uncongested scenarios, within a stated tolerance.
//!
//! The packet model pays what the flow model does not: per-packet headers and framing
//! (82 of 1082 bytes per 1000-byte payload, 7.6%), ACKs sharing links that carry data both
//! ways, store-and-forward of each packet at each hop. So on bulk transfers the packet model
//! is slower by those overheads; the stated tolerance is 12%, and the packet model must
//! never be faster than the flow model by more than 1% (it cannot beat line rate).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_net::flow_model::FlowLevelSimulator;
use orrery_net::flows::{collective_flows, FlowAlgorithm, FlowSet};
use orrery_net::packet::PacketSimulator;
use orrery_net::sim::FlowSimulator;
use orrery_net::topology::{NetGraph, RailOptimizedSpec};
use orrery_net::CollectiveKind;
use orrery_units::{Bandwidth, Bytes, Picos};

fn compare(graph: &NetGraph, flows: &FlowSet, what: &str) {
    let f = FlowLevelSimulator::default()
        .simulate(graph, flows)
        .unwrap();
    let p = PacketSimulator::default().simulate(graph, flows).unwrap();
    let ratio = p.end.as_secs_f64() / f.end.as_secs_f64();
    assert!(
        ratio > 0.99 && ratio < 1.12,
        "{what}: packet {} vs flow {} (ratio {ratio:.3})",
        p.end,
        f.end
    );
    assert_eq!(p.bytes_delivered, f.bytes_delivered, "{what}");
    assert_eq!(p.drops, 0, "{what}");
}

#[test]
fn disjoint_flows_agree() {
    let g = NetGraph::single_switch(
        8,
        Bandwidth::from_gbits_per_sec(100.0),
        Picos::from_nanos(1000),
    )
    .unwrap();
    let mut set = FlowSet::default();
    for i in 0..4u32 {
        set.push_p2p("pair", 2 * i, 2 * i + 1, Bytes(2 << 20), Picos::ZERO);
    }
    compare(&g, &set, "4 disjoint pairs");
}

#[test]
fn a_ring_all_reduce_across_hosts_agrees() {
    let spec = RailOptimizedSpec {
        gpus_per_host: 4,
        ..RailOptimizedSpec::dgx_h100(2)
    };
    let g = NetGraph::rail_optimized(&spec).unwrap();
    let mut set = FlowSet::default();
    let ranks: Vec<u32> = (0..8).collect();
    collective_flows(
        &mut set,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 4 },
        &ranks,
        Bytes(8 << 20),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
    compare(&g, &set, "8-rank ring all-reduce on 2 hosts");
}

/// Progress reporting observes the run without changing it.
#[test]
fn progress_reports_do_not_change_the_report() {
    use orrery_net::sim::SimProgress;
    let g = NetGraph::single_switch(
        4,
        Bandwidth::from_gbits_per_sec(100.0),
        Picos::from_nanos(1000),
    )
    .unwrap();
    let mut set = FlowSet::default();
    for i in 1..4u32 {
        set.push_p2p("incast", i, 0, Bytes(1 << 20), Picos::ZERO);
    }
    // Two simulators of each kind: a packet simulator keeps its memo cache across runs,
    // so the second run on the same one would be answered from the cache.
    let sims: [[&dyn FlowSimulator; 2]; 2] = [
        [
            &FlowLevelSimulator::default(),
            &FlowLevelSimulator::default(),
        ],
        [&PacketSimulator::default(), &PacketSimulator::default()],
    ];
    for [sim, twin] in sims {
        let mut calls = Vec::new();
        let with = sim
            .simulate_with_progress(&g, &set, &mut |p: SimProgress| calls.push(p))
            .unwrap();
        let without = twin.simulate(&g, &set).unwrap();
        assert_eq!(with, without, "{}", sim.name());
        assert!(!calls.is_empty(), "{}", sim.name());
        assert!(calls
            .windows(2)
            .all(|w| w[0].now <= w[1].now && w[0].events <= w[1].events));
        assert!(calls
            .iter()
            .all(|p| p.flows_total == 3 && p.flows_done <= 3));
    }
}
