//! Helpers shared by the packet-model test files (each includes this with `mod common;`
//! and uses what it needs).
#![allow(dead_code, clippy::unwrap_used)]

use orrery_net::flows::{collective_flows, FlowAlgorithm, FlowSet, FlowSpec};
use orrery_net::packet::{PacketConfig, PacketRun, PacketSimulator, TraceRequest};
use orrery_net::topology::{NetGraph, RailOptimizedSpec};
use orrery_net::CollectiveKind;
use orrery_units::{Bandwidth, Bytes, FlowId, Picos};

pub fn gbps(x: f64) -> Bandwidth {
    Bandwidth::from_gbits_per_sec(x)
}

pub fn us(x: u64) -> Picos {
    Picos::from_micros(x)
}

/// A flow of `bytes` from endpoint `src` to `dst`, released at time zero.
pub fn flow(src: u32, dst: u32, bytes: u64) -> FlowSpec {
    FlowSpec {
        src,
        dst,
        bytes: Bytes(bytes),
        deps: Default::default(),
        delay: Picos::ZERO,
        collective: 0,
    }
}

pub fn flow_set(flows: Vec<FlowSpec>) -> FlowSet {
    FlowSet {
        flows,
        collectives: Vec::new(),
    }
}

/// A packet-level run with `cfg` and no trace.
pub fn run(cfg: PacketConfig, g: &NetGraph, fs: &FlowSet) -> PacketRun {
    PacketSimulator::new(cfg)
        .run(g, fs, &TraceRequest::default())
        .unwrap()
}

/// The random traffic of the dumbbell property tests: a 3 + 3 dumbbell of 100 Gb/s edges
/// around a 25 Gb/s bottleneck, and a flow for each `(src, dst, bytes, start_us)` whose
/// ends differ, with the total of their bytes.
pub fn dumbbell_traffic(specs: &[(u32, u32, u64, u64)]) -> (NetGraph, FlowSet, u64) {
    let g = NetGraph::dumbbell(3, 3, gbps(100.0), gbps(25.0), us(1)).unwrap();
    let flows: Vec<FlowSpec> = specs
        .iter()
        .filter(|(s, d, _, _)| s != d)
        .map(|&(s, d, b, t)| {
            let mut f = flow(s, d, b);
            f.delay = us(t);
            f
        })
        .collect();
    let total = flows.iter().map(|f| f.bytes.0).sum();
    (g, flow_set(flows), total)
}

/// A rail-optimised fabric of `hosts` hosts of four GPUs.
pub fn four_gpu_hosts(hosts: usize) -> NetGraph {
    let spec = RailOptimizedSpec {
        gpus_per_host: 4,
        ..RailOptimizedSpec::dgx_h100(hosts)
    };
    NetGraph::rail_optimized(&spec).unwrap()
}

/// Adds a one-channel ring all-reduce of `bytes` over `ranks` (four GPUs per host).
pub fn add_ring(fs: &mut FlowSet, name: &str, ranks: &[u32], bytes: u64) {
    add_ring_of(fs, name, ranks, bytes, 1);
}

/// Adds a ring all-reduce of `bytes` with `channels` channels over `ranks` (four GPUs per
/// host).
pub fn add_ring_of(fs: &mut FlowSet, name: &str, ranks: &[u32], bytes: u64, channels: u32) {
    collective_flows(
        fs,
        name,
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels },
        ranks,
        Bytes(bytes),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
}

/// An 8-rank ring all-reduce on two rail-optimised hosts of four GPUs.
pub fn ring_all_reduce(bytes: u64) -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    add_ring(&mut fs, "ring", &(0..8).collect::<Vec<u32>>(), bytes);
    (four_gpu_hosts(2), fs)
}

/// Adds `kind` over `ranks` by `algorithm` to `fs`, every first step of a rank waiting for
/// all the flows into that rank of the collective `after` (when given). Returns its flows.
#[allow(clippy::too_many_arguments)]
pub fn add_after(
    fs: &mut FlowSet,
    name: &str,
    kind: CollectiveKind,
    algorithm: FlowAlgorithm,
    ranks: &[u32],
    bytes: u64,
    after: Option<std::ops::Range<usize>>,
) -> std::ops::Range<usize> {
    let added = collective_flows(
        fs,
        name,
        kind,
        algorithm,
        ranks,
        Bytes(bytes),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
    if let Some(before) = after {
        for f in added.clone() {
            if fs.flows[f].deps.is_empty() {
                let src = fs.flows[f].src;
                fs.flows[f].deps = before
                    .clone()
                    .filter(|&g| fs.flows[g].dst == src)
                    .map(|g| FlowId(g as u32))
                    .collect();
            }
        }
    }
    added
}

/// A gradient reduce-scatter over every GPU of four hosts of four, the 4-byte all-reduce
/// of its norm over a tree across hosts (which has a root, so no host shift maps it onto
/// itself), and the parameter all-gather after it.
pub fn step_with_a_tree_norm() -> (NetGraph, FlowSet) {
    let ranks: Vec<u32> = (0..16).collect();
    let mut fs = FlowSet::default();
    let ring = FlowAlgorithm::Ring { channels: 4 };
    let reduce = add_after(
        &mut fs,
        "grad-reduce",
        CollectiveKind::ReduceScatter,
        ring,
        &ranks,
        64_000_000,
        None,
    );
    let norm = add_after(
        &mut fs,
        "grad-norm",
        CollectiveKind::AllReduce,
        FlowAlgorithm::HostTree,
        &ranks,
        4,
        Some(reduce),
    );
    add_after(
        &mut fs,
        "param-all-gather",
        CollectiveKind::AllGather,
        ring,
        &ranks,
        64_000_000,
        Some(norm),
    );
    (four_gpu_hosts(4), fs)
}
