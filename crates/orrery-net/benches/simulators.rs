//! Simulator speed: packet-level events per second on an incast and a ring all-reduce, the
//! flow-level model on the same ring, and the accelerated packet model (every mechanism on,
//! the default) on the 128-GPU ring of `orrery bench --accel`, whose run is mostly set-up:
//! routes, tie keys and the symmetry search over its 260,096 flows, and on a long 4-to-1
//! incast at 400 Gb/s with and without cut jumps; and the fluid model on the same ring and
//! incast. Run with `cargo bench -p orrery-net`.

use orrery_net::flow_model::FlowLevelSimulator;
use orrery_net::flows::{collective_flows, FlowAlgorithm, FlowSet};
use orrery_net::packet::{FluidSimulator, PacketConfig, PacketSimulator};
use orrery_net::sim::FlowSimulator;
use orrery_net::topology::{NetGraph, RailOptimizedSpec};
use orrery_net::CollectiveKind;
use orrery_units::{Bandwidth, Bytes, Picos};

fn main() {
    divan::main();
}

/// `senders` flows of `bytes` each into host 0 of one switch at `gbps`, 1 us cables.
fn incast(senders: u32, gbps: f64, bytes: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(
        senders as usize + 1,
        Bandwidth::from_gbits_per_sec(gbps),
        Picos::from_nanos(1000),
    )
    .expect("topology");
    let mut set = FlowSet::default();
    for i in 1..=senders {
        set.push_p2p("incast", i, 0, Bytes(bytes), Picos::ZERO);
    }
    (g, set)
}

/// An 8-channel ring all-reduce of `mib` MiB over the GPUs of `hosts` DGX-H100-like hosts.
fn ring_over(hosts: usize, mib: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(hosts)).expect("topology");
    let mut set = FlowSet::default();
    let ranks: Vec<u32> = (0..8 * hosts as u32).collect();
    collective_flows(
        &mut set,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 8 },
        &ranks,
        Bytes(mib << 20),
        8,
        Picos::from_nanos(2000),
    )
    .expect("flows");
    (g, set)
}

fn ring() -> (NetGraph, FlowSet) {
    ring_over(2, 16)
}

#[divan::bench(sample_count = 10)]
fn packet_incast_16_to_1(b: divan::Bencher) {
    let (g, set) = incast(16, 100.0, 1 << 20);
    b.bench(|| {
        PacketSimulator::default()
            .simulate(&g, &set)
            .map(|r| r.events)
    });
}

#[divan::bench(sample_count = 10)]
fn packet_ring_16_gpus_16mib(b: divan::Bencher) {
    let (g, set) = ring();
    b.bench(|| {
        PacketSimulator::default()
            .simulate(&g, &set)
            .map(|r| r.events)
    });
}

#[divan::bench(sample_count = 20)]
fn accelerated_ring_128_gpus_64mib(b: divan::Bencher) {
    let (g, set) = ring_over(16, 64);
    b.bench(|| {
        PacketSimulator::new(PacketConfig::default())
            .simulate(&g, &set)
            .map(|r| r.events)
    });
}

/// Four 30 MiB flows into one 400 Gb/s port, accelerated with and without cut jumps
/// (`accel.cut_jumps`): most of the incast runs with the port held at PFC's threshold
/// while DCQCN cuts the four rates in step.
#[divan::bench(sample_count = 10, args = [false, true])]
fn accelerated_incast_4_to_1_400g(b: divan::Bencher, cut_jumps: bool) {
    let (g, set) = incast(4, 400.0, 30 << 20);
    let mut config = PacketConfig::default();
    config.accel.cut_jumps = cut_jumps;
    b.bench(|| {
        PacketSimulator::new(config.clone())
            .simulate(&g, &set)
            .map(|r| r.events)
    });
}

#[divan::bench(sample_count = 10)]
fn flow_ring_16_gpus_16mib(b: divan::Bencher) {
    let (g, set) = ring();
    b.bench(|| {
        FlowLevelSimulator::default()
            .simulate(&g, &set)
            .map(|r| r.events)
    });
}

/// The fluid model on the 4-to-1 incast above: the queue, PFC and DCQCN's cuts followed
/// in 500 ns steps instead of packets; with and without freezing its calm flows
/// (`calm_skip`, which changes no result).
#[divan::bench(sample_count = 10, args = [true, false])]
fn fluid_incast_4_to_1_400g(b: divan::Bencher, calm_skip: bool) {
    fluid_bench(b, incast(4, 400.0, 30 << 20), calm_skip, None);
}

/// The same incast with its 1 us cables transmitting once a microsecond at 500 ns steps,
/// with and without skipping the steps between their transmissions (`gap_skip`, which
/// changes no result).
#[divan::bench(sample_count = 10, args = [true, false])]
fn fluid_incast_4_to_1_400g_cables_every_1us(b: divan::Bencher, gap_skip: bool) {
    let (g, set) = incast(4, 400.0, 30 << 20);
    let sim = FluidSimulator {
        longest_link_step: Some(Picos::from_micros(1)),
        gap_skip,
        ..Default::default()
    };
    b.bench(|| sim.simulate(&g, &set).map(|r| r.events));
}

/// The ring with every link transmitting every 200 ns step (NVLink's delay sets it).
#[divan::bench(sample_count = 10, args = [true, false])]
fn fluid_ring_16_gpus_16mib(b: divan::Bencher, calm_skip: bool) {
    fluid_bench(b, ring(), calm_skip, Some(Picos::ZERO));
}

/// The same ring with its 1 us cables stepped once a microsecond while its NVLink hops
/// keep the 200 ns step (`longest_link_step`, what the default chooses here).
#[divan::bench(sample_count = 10)]
fn fluid_ring_16_gpus_16mib_cables_every_1us(b: divan::Bencher) {
    fluid_bench(b, ring(), true, None);
}

fn fluid_bench(
    b: divan::Bencher,
    (g, set): (NetGraph, FlowSet),
    calm_skip: bool,
    longest_link_step: Option<Picos>,
) {
    let sim = FluidSimulator {
        calm_skip,
        longest_link_step,
        ..Default::default()
    };
    b.bench(|| sim.simulate(&g, &set).map(|r| r.events));
}
