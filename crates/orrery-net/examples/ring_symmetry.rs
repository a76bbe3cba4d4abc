//! How the symmetry reduction compares with the packet-by-packet reference on a ring
//! all-reduce over DGX-H100-like hosts (8 channels), the figures quoted in the `symmetry`
//! module: the errors of the reduced run with every other mechanism off and with all of
//! them on, how many of the flows it simulated (those sent from GPU 0) are the
//! reference's to the picosecond, and how far the reference itself moves when its flows
//! are numbered in another order that keeps dependencies first.
//!
//! `cargo run --release -p orrery-net --example ring_symmetry -- [HOSTS] [MIB]` (defaults
//! 16 hosts, 64 MiB: about 40 s, most of it the two reference runs).
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use orrery_net::flows::{collective_flows, dependency_order, FlowAlgorithm, FlowSet};
use orrery_net::packet::{PacketConfig, PacketRun, PacketSimulator, TraceRequest};
use orrery_net::sim::RunErrors;
use orrery_net::topology::{NetGraph, RailOptimizedSpec};
use orrery_net::CollectiveKind;
use orrery_units::{Bytes, Picos};
use std::time::Instant;

const CHANNELS: u32 = 8;

fn main() {
    let arg = |i: usize, default: u64| {
        std::env::args()
            .nth(i)
            .map_or(default, |s| s.parse().unwrap())
    };
    let hosts = arg(1, 16) as usize;
    let bytes = arg(2, 64) << 20;
    let graph = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(hosts)).unwrap();
    let mut flows = FlowSet::default();
    collective_flows(
        &mut flows,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: CHANNELS },
        &(0..8 * hosts as u32).collect::<Vec<u32>>(),
        Bytes(bytes),
        8,
        Picos::from_nanos(2000),
    )
    .unwrap();
    let run = |config: PacketConfig, flows: &FlowSet| -> (PacketRun, f64) {
        let t = Instant::now();
        let r = PacketSimulator::new(config)
            .run(&graph, flows, &TraceRequest::default())
            .unwrap();
        (r, t.elapsed().as_secs_f64())
    };
    let (reference, secs) = run(PacketConfig::reference(), &flows);
    println!(
        "reference: {} flows, {} events, {secs:.1} s",
        flows.flows.len(),
        reference.report.events
    );

    // Numbered in another order that keeps dependencies first (the highest-numbered ready
    // flow first, as `orrery bench --accel --label-spread` does).
    let n = flows.flows.len();
    let deps = |i: usize| flows.flows[i].deps.iter().map(|d| d.index()).collect();
    let old_of = dependency_order(n, deps, true).unwrap();
    let renumbered = flows.reordered(&old_of);
    let (other, _) = run(PacketConfig::reference(), &renumbered);
    let mut back = reference.report.clone();
    for (k, &i) in old_of.iter().enumerate() {
        back.flows[i] = other.report.flows[k];
    }
    println!(
        "reference with its flows renumbered: {:?}",
        RunErrors::between(&reference.report, &back, &flows)
    );

    let mut symmetry_alone = PacketConfig::reference();
    symmetry_alone.accel.symmetry = true;
    let mut without = PacketConfig::default();
    without.accel.symmetry = false;
    // With both shifts (hosts, then GPUs) the flows simulated are those sent from GPU 0.
    let simulated: Vec<usize> = (0..n).filter(|&f| flows.flows[f].src == 0).collect();
    for (name, config) in [
        ("symmetry alone", symmetry_alone),
        ("every mechanism", PacketConfig::default()),
        ("every mechanism but symmetry", without),
    ] {
        let (r, secs) = run(config, &flows);
        let exact = simulated
            .iter()
            .filter(|&&f| reference.report.flows[f] == r.report.flows[f])
            .count();
        println!(
            "{name}: {} events, {secs:.2} s, {} copies, GPU 0's flows exact {exact} of {}, {:?}",
            r.report.events,
            r.stats.symmetry_order,
            simulated.len(),
            RunErrors::between(&reference.report, &r.report, &flows)
        );
    }
}
