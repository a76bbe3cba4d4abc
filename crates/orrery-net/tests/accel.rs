#![allow(clippy::unwrap_used)]
//! Equivalence harness of the accelerated packet model: every scenario runs with
//! steady-state fast-forwarding off (the packet-by-packet reference) and on, and the
//! accelerated run must stay within the issue's bounds: mean per-flow FCT error < 1%, p99
//! of the per-flow FCT errors < 5%, completion (end of the run and each collective's
//! finish) error < 1%. Scenarios that must jump check that they did and processed fewer
//! events; scenarios that must not (short flows, incast bursts) check that nothing was
//! skipped and the report is identical to the reference.

mod common;

use common::{
    add_ring, add_ring_of, flow, flow_set, four_gpu_hosts, gbps, ring_all_reduce, run,
    step_with_a_tree_norm, us,
};
use orrery_net::flows::{
    collective_flows, dependency_order, CollectiveInfo, FlowAlgorithm, FlowSet,
};
use orrery_net::packet::{
    EcnPoint, FastForwardHeld, HeldBy, PacketConfig, PacketRun, PacketSimulator, SymmetryShift,
    TraceRequest,
};
use orrery_net::sim::RunErrors;
use orrery_net::topology::{FatTreeSpec, NetGraph, RailOptimizedSpec, Routing};
use orrery_net::CollectiveKind;
use orrery_units::{Bytes, FlowId, Picos};

fn accel_on() -> PacketConfig {
    with_ff(PacketConfig::reference())
}

fn with_ff(mut c: PacketConfig) -> PacketConfig {
    c.accel.fast_forward = true;
    c
}

/// The model without DCQCN: PFC alone keeps an incast lossless at fair shares.
fn pfc_only() -> PacketConfig {
    PacketConfig {
        dcqcn: false,
        ..PacketConfig::reference()
    }
}

type Errors = RunErrors;

fn errors(off: &PacketRun, on: &PacketRun, fs: &FlowSet) -> Errors {
    RunErrors::between(&off.report, &on.report, fs)
}

/// Runs `fs` with fast-forwarding off and on, checks the bounds and the invariants every
/// accelerated run keeps, and returns both runs.
fn equivalent(g: &NetGraph, fs: &FlowSet, name: &str) -> (PacketRun, PacketRun, Errors) {
    equivalent_with(PacketConfig::reference(), g, fs, name)
}

fn equivalent_with(
    base: PacketConfig,
    g: &NetGraph,
    fs: &FlowSet,
    name: &str,
) -> (PacketRun, PacketRun, Errors) {
    let off = run(base.clone(), g, fs);
    let on = run(with_ff(base.clone()), g, fs);
    let e = check_bounds(&base, &off, &on, fs, name);
    (off, on, e)
}

/// Checks an accelerated run `on` against the reference `off`: the issue's error bounds and
/// the invariants every accelerated run keeps (every byte accounted for, nothing lost).
fn check_bounds(
    base: &PacketConfig,
    off: &PacketRun,
    on: &PacketRun,
    fs: &FlowSet,
    name: &str,
) -> Errors {
    let e = errors(off, on, fs);
    assert!(e.mean_fct < 0.01, "{name}: {e:?}");
    assert!(e.p99_fct < 0.05, "{name}: {e:?}");
    assert!(e.end < 0.01, "{name}: {e:?}");
    assert!(e.collective < 0.01, "{name}: {e:?}");
    assert!(e.collective_time < 0.01, "{name}: {e:?}");
    let total: u64 = fs.flows.iter().map(|f| f.bytes.0).sum();
    assert_eq!(on.report.bytes_delivered, total, "{name}");
    assert_eq!(on.report.bytes_sent, off.report.bytes_sent, "{name}");
    assert_eq!(on.report.drops, 0, "{name}");
    assert_eq!(on.stats.clamped_schedules, 0, "{name}");
    assert_eq!(on.stats.retransmitted_bytes, 0, "{name}");
    let link_total = |r: &PacketRun| r.report.link_bytes.iter().sum::<u64>();
    assert_eq!(link_total(on), link_total(off), "{name}");
    for (o, f) in on.report.flows.iter().zip(&fs.flows) {
        assert!(o.finish >= o.start, "{name}");
        assert!(f.bytes.0 == 0 || o.finish > o.start, "{name}");
    }
    assert_eq!(
        on.stats.skipped_bytes,
        on.stats.skipped_packets * u64::from(base.mtu_payload)
    );
    e
}

/// Long flows on disjoint paths of one switch.
fn disjoint() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(6, gbps(100.0), us(1)).unwrap();
    let fs = flow_set(vec![
        flow(0, 1, 20_000_000),
        flow(2, 3, 30_000_000),
        flow(4, 5, 12_000_000),
    ]);
    (g, fs)
}

/// A 4-to-1 incast of long flows (`bytes` each) with staggered sizes.
fn long_incast(bytes: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(5, gbps(100.0), us(1)).unwrap();
    let fs = flow_set(
        (0..4)
            .map(|i| flow(i, 4, bytes + u64::from(i) * bytes / 4))
            .collect(),
    );
    (g, fs)
}

/// Many short flows between random-looking pairs, staggered.
fn short_flows() -> (NetGraph, FlowSet) {
    let g = NetGraph::dumbbell(4, 4, gbps(100.0), gbps(100.0), us(1)).unwrap();
    let mut flows = Vec::new();
    for i in 0..40u32 {
        let mut f = flow(i % 4, 4 + (i * 3) % 4, 20_000 + 7_000 * u64::from(i % 5));
        f.delay = Picos::from_nanos(2_500 * u64::from(i));
        flows.push(f);
    }
    (g, flow_set(flows))
}

/// A 16-to-1 burst of 64 KB messages.
fn incast_burst() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(17, gbps(100.0), us(1)).unwrap();
    let fs = flow_set((0..16).map(|i| flow(i, 16, 64_000)).collect());
    (g, fs)
}

/// A long flow reaches steady state, then a second flow joins its bottleneck at 1 ms.
fn mid_arrival() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(3, gbps(100.0), us(1)).unwrap();
    let mut late = flow(1, 2, 8_000_000);
    late.delay = us(1000);
    let fs = flow_set(vec![flow(0, 2, 30_000_000), late]);
    (g, fs)
}

#[test]
fn long_flows_on_disjoint_paths_fast_forward_within_bounds() {
    let (g, fs) = disjoint();
    let (off, on, _) = equivalent(&g, &fs, "disjoint");
    assert!(on.stats.fast_forwards > 0);
    assert!(on.stats.jumped_time > Picos::ZERO);
    assert!(on.stats.skipped_packets > 0);
    assert!(on.report.events * 3 < off.report.events, "{on:?}");
    assert_eq!(off.stats.fast_forwards, 0);
    assert_eq!(off.stats.jumped_time, Picos::ZERO);
}

/// With PFC alone the incast settles at once into fair shares of the receiver's link (the
/// switch pauses every sender in turn) and fast-forwards between completions.
#[test]
fn a_long_incast_reaches_steady_state_and_fast_forwards_within_bounds() {
    let (g, fs) = long_incast(8_000_000);
    let (off, on, _) = equivalent_with(pfc_only(), &g, &fs, "long incast, PFC only");
    assert!(on.stats.jumped_time > Picos::ZERO);
    assert!(on.stats.skipped_events > 0);
    assert!(on.report.events < off.report.events);
}

/// Under DCQCN's default parameters an incast does not settle: the sending rates follow a
/// sawtooth of a few milliseconds (CNPs walk them down while the queue is above Kmin, the
/// 900 us increase timer brings them back), so the conservative steadiness test must not
/// jump through it, and the run stays within bounds.
#[test]
fn a_dcqcn_incast_stays_within_bounds() {
    let (g, fs) = long_incast(8_000_000);
    equivalent(&g, &fs, "long incast, DCQCN");
}

#[test]
fn a_ring_all_reduce_on_a_rail_optimised_fabric_stays_within_bounds() {
    let (g, fs) = ring_all_reduce(16 << 20);
    equivalent(&g, &fs, "ring all-reduce");
}

#[test]
fn short_flows_are_never_skipped() {
    let (g, fs) = short_flows();
    let (off, on, _) = equivalent(&g, &fs, "short flows");
    assert_eq!(on.stats.fast_forwards, 0);
    assert_eq!(on.stats.jumped_time, Picos::ZERO);
    // Sampling without jumping changes nothing at all.
    assert_eq!(on.report, off.report);
}

#[test]
fn an_incast_burst_is_never_skipped() {
    let (g, fs) = incast_burst();
    let (off, on, _) = equivalent(&g, &fs, "incast burst");
    assert_eq!(on.stats.fast_forwards, 0);
    assert_eq!(on.report, off.report);
}

#[test]
fn a_jump_stops_at_a_flow_arriving_mid_steady_state() {
    let (g, fs) = mid_arrival();
    let (off, on, _) = equivalent(&g, &fs, "mid-steady-state arrival");
    // The first flow was steady before the second arrived, and the jump did not pass the
    // arrival: the late flow is released exactly at 1 ms, as in the reference.
    assert!(on.stats.fast_forwards > 0);
    assert_eq!(on.report.flows[1].start, us(1000));
    assert_eq!(off.report.flows[1].start, us(1000));
}

#[test]
fn a_jump_at_line_rate_lands_within_one_frame_of_the_reference() {
    // One flow alone, and two flows crossing (each one's ACKs between the other's data):
    // both deliver a packet every fixed period once started, so the jump's rate (the slope
    // between two deliveries in the second half of the window) is that period's, and the
    // flows finish within one frame's serialisation of the reference. Counting packets per
    // sample over the whole window, partitioned jumps (`orrery netsim`'s default) made them
    // 384 ns and 307 ns late (4.4 and 3.5 frames of 86.6 ns at 100 Gb/s), and this test
    // failed on its first, whole-network case.
    let g = NetGraph::single_switch(2, gbps(100.0), us(1)).unwrap();
    let cfg = PacketConfig::reference();
    let frame = cfg.mtu_payload + cfg.header_bytes + cfg.framing_bytes;
    let frame_time = Picos::from_secs_f64(f64::from(frame) * 8.0 / 100e9);
    for fs in [
        flow_set(vec![flow(0, 1, 20_000_000)]),
        flow_set(vec![flow(0, 1, 20_000_000), flow(1, 0, 20_000_000)]),
    ] {
        let off = run(cfg.clone(), &g, &fs);
        for on in [
            run(accel_on(), &g, &fs),
            run(with_parts(cfg.clone()), &g, &fs),
        ] {
            assert!(on.stats.fast_forwards > 0 && on.stats.skipped_packets > 10_000);
            for (a, b) in off.report.flows.iter().zip(&on.report.flows) {
                let late = a.finish.0.abs_diff(b.finish.0);
                assert!(late < frame_time.0, "{late} ps against {frame_time:?}");
            }
        }
    }
}

#[test]
fn fast_forwarding_is_deterministic_and_tracing_sees_global_time() {
    let (g, fs) = mid_arrival();
    let a = run(accel_on(), &g, &fs);
    let b = run(accel_on(), &g, &fs);
    assert_eq!(a, b);
    assert!(a.stats.fast_forwards > 0);
    let trace = TraceRequest {
        interval: us(50),
        ports: Vec::new(),
        flows: true,
    };
    let traced = PacketSimulator::new(accel_on())
        .run(&g, &fs, &trace)
        .unwrap();
    assert_eq!(traced.report, a.report);
    assert!(traced
        .samples
        .windows(2)
        .all(|w| w[0].time < w[1].time && w[0].delivered[0] <= w[1].delivered[0]));
    let last = traced.samples.last().unwrap();
    assert!(last.time <= a.report.end + us(50));
    // The trace has a gap where the run jumped.
    assert!(traced
        .samples
        .windows(2)
        .any(|w| w[1].time - w[0].time > us(50)));
}

/// Events processed with and without fast-forwarding for each scenario (report only).
/// Run with `cargo test --release -p orrery-net --test accel -- --ignored --nocapture`.
#[test]
#[ignore]
fn report_events_with_and_without_fast_forwarding() {
    let scenarios: Vec<(&str, (NetGraph, FlowSet))> = vec![
        ("disjoint long flows", disjoint()),
        ("4-to-1 long incast, PFC only", long_incast(8_000_000)),
        ("4-to-1 long incast, DCQCN", long_incast(8_000_000)),
        ("ring all-reduce 16 MiB", ring_all_reduce(16 << 20)),
        ("ring all-reduce 256 MiB", ring_all_reduce(256 << 20)),
        ("short flows", short_flows()),
        ("16-to-1 incast burst", incast_burst()),
        ("mid-steady-state arrival", mid_arrival()),
    ];
    for (name, (g, fs)) in scenarios {
        let base = if name.contains("PFC only") {
            pfc_only()
        } else {
            PacketConfig::reference()
        };
        let t0 = std::time::Instant::now();
        let off = run(base.clone(), &g, &fs);
        let t_off = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let on = run(with_ff(base), &g, &fs);
        let t_on = t1.elapsed().as_secs_f64();
        let e = errors(&off, &on, &fs);
        println!(
            "{name}: events off {} on {} ({:.1}x), wall {:.3}s / {:.3}s, jumps {}, jumped {:.3} of {:.3} ms, \
             skipped events ~{}, errors mean {:.4}% p99 {:.4}% end {:.4}% coll {:.4}%",
            off.report.events,
            on.report.events,
            off.report.events as f64 / on.report.events.max(1) as f64,
            t_off,
            t_on,
            on.stats.fast_forwards,
            on.stats.jumped_time.as_millis_f64(),
            on.report.end.as_millis_f64(),
            on.stats.skipped_events,
            100.0 * e.mean_fct,
            100.0 * e.p99_fct,
            100.0 * e.end,
            100.0 * e.collective,
        );
    }
}

// ---- Partitioning ----------------------------------------------------------------------

fn with_parts(mut c: PacketConfig) -> PacketConfig {
    c.accel.fast_forward = true;
    c.accel.partitioning = true;
    c
}

/// Runs `fs` off, whole-network and partitioned; checks the partitioned run against the
/// reference like [`equivalent_with`] does the whole-network one and returns (off, whole,
/// partitioned, partitioned errors). The whole-network run is not checked here.
fn three_ways(
    base: PacketConfig,
    g: &NetGraph,
    fs: &FlowSet,
    name: &str,
) -> (PacketRun, PacketRun, PacketRun, Errors) {
    let off = run(base.clone(), g, fs);
    let whole = run(with_ff(base.clone()), g, fs);
    let parts = run(with_parts(base.clone()), g, fs);
    let e = check_bounds(&base, &off, &parts, fs, &format!("{name} (partitioned)"));
    (off, whole, parts, e)
}

/// Two disjoint groups on one switch: two long flows (hosts 0-3) and a steady stream of
/// short flows among hosts 4-7 that keeps the whole network from ever being steady.
fn long_and_short() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(8, gbps(100.0), us(1)).unwrap();
    let mut flows = vec![flow(0, 1, 20_000_000), flow(2, 3, 16_000_000)];
    for i in 0..120u32 {
        let mut f = flow(4 + i % 4, 4 + (i + 1 + i / 4 % 3) % 4, 30_000);
        f.delay = Picos::from_nanos(15_000 * u64::from(i));
        flows.push(f);
    }
    (g, flow_set(flows))
}

/// A long steady pair and, elsewhere on the same switch, a 4-to-1 DCQCN incast that never
/// settles.
fn long_and_dcqcn_incast() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(7, gbps(100.0), us(1)).unwrap();
    let mut flows = vec![flow(0, 1, 24_000_000)];
    flows.extend((2..6).map(|i| flow(i, 6, 6_000_000)));
    (g, flow_set(flows))
}

/// Two steady pairs (0 to 1, 2 to 3) in separate partitions; at 1 ms a flow from 1 to 4
/// joins the first pair's partition (its data shares a link with the pair's ACKs, its
/// ACKs one with the pair's data), and at 1.5 ms a flow from 3 to 0 merges the two
/// partitions, which have jumped independently, the same way.
fn joins_and_merge() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(5, gbps(100.0), us(1)).unwrap();
    let mut join = flow(1, 4, 6_000_000);
    join.delay = us(1000);
    let mut merge = flow(3, 0, 6_000_000);
    merge.delay = us(1500);
    let fs = flow_set(vec![
        flow(0, 1, 40_000_000),
        flow(2, 3, 30_000_000),
        join,
        merge,
    ]);
    (g, fs)
}

/// Under PFC alone: with DCQCN the reference sees a couple of random ECN marks when the
/// flows join (a queue of a few packets passes Kmin for an instant), and each costs its
/// flow a rate cut that takes milliseconds to recover; a jump (whole-network or
/// partitioned alike) skips such rare marks, so that variant is 17% off.
#[test]
fn partitioned_jumps_stop_at_releases_that_join_or_merge_their_partitions() {
    let (g, fs) = joins_and_merge();
    let (off, whole, parts, _) = three_ways(pfc_only(), &g, &fs, "joins+merge");
    assert!(parts.stats.fast_forwards > whole.stats.fast_forwards);
    assert!(parts.report.events < whole.report.events);
    assert!(parts.report.events < off.report.events);
    assert_eq!(parts.report.flows[2].start, us(1000));
    assert_eq!(parts.report.flows[3].start, us(1500));
    let again = run(with_parts(pfc_only()), &g, &fs);
    assert_eq!(again, parts);
    // Each partition stopped its jump at the release that touches it: when the joining
    // (1 ms) and merging (1.5 ms) flows start, the pairs they meet have delivered what they
    // had in the reference, neither more (jumped past) nor less.
    let trace = TraceRequest {
        interval: us(50),
        ports: Vec::new(),
        flows: true,
    };
    let t_off = PacketSimulator::new(pfc_only())
        .run(&g, &fs, &trace)
        .unwrap();
    let t_on = PacketSimulator::new(with_parts(pfc_only()))
        .run(&g, &fs, &trace)
        .unwrap();
    assert_eq!(t_on.report, parts.report);
    for (at, pair) in [(us(1000), 0usize), (us(1500), 0), (us(1500), 1)] {
        let at_time = |r: &PacketRun| {
            r.samples
                .iter()
                .find(|s| s.time == at)
                .map(|s| s.delivered[pair])
                .unwrap()
        };
        let (a, b) = (at_time(&t_off) as f64, at_time(&t_on) as f64);
        assert!(
            (a - b).abs() < 0.01 * a,
            "pair {pair} at {at:?}: {a} vs {b}"
        );
    }
}

#[test]
fn partitioning_jumps_long_flows_past_a_stream_of_short_ones() {
    let (g, fs) = long_and_short();
    let (off, whole, parts, _) = three_ways(PacketConfig::reference(), &g, &fs, "long+short");
    assert!(parts.stats.fast_forwards > 0);
    assert!(parts.report.events < whole.report.events, "{parts:?}");
    assert!(parts.report.events < off.report.events);
    // The short flows are untouched by the jumps of the long ones' partition: their FCTs
    // are within a hair of the reference.
    let e = errors(&off, &parts, &fs);
    assert!(e.mean_fct < 0.01);
}

#[test]
fn partitioning_jumps_a_steady_pair_beside_an_unsettled_dcqcn_incast() {
    let (g, fs) = long_and_dcqcn_incast();
    let (off, whole, parts, _) = three_ways(PacketConfig::reference(), &g, &fs, "pair+incast");
    assert!(parts.stats.fast_forwards > 0);
    assert!(parts.report.events < whole.report.events, "{parts:?}");
    assert!(parts.report.events < off.report.events);
}

#[test]
fn held_back_flow_samples_name_the_test_that_kept_each_partition_from_jumping() {
    let (g, fs) = long_and_dcqcn_incast();
    let off = run(PacketConfig::reference(), &g, &fs);
    let whole = run(with_ff(PacketConfig::reference()), &g, &fs);
    let parts = run(with_parts(PacketConfig::reference()), &g, &fs);
    // Counted only where partitions are tested.
    assert_eq!(off.stats.ff_held, FastForwardHeld::default());
    assert_eq!(whole.stats.ff_held, FastForwardHeld::default());
    let held = parts.stats.ff_held;
    // Every jump is counted, once per flow of the partition that took it: the lone pair's
    // one flow, or the incast's four.
    let jumps = parts.stats.fast_forwards;
    let jumped = held.get(HeldBy::Jumped);
    assert!(jumps > 0 && jumped >= jumps && jumped <= 4 * jumps);
    // The incast under DCQCN is what kept samples from jumping: its rates moved, its
    // deliveries spread, or its queue was deep enough to be marked (1,772 flow-samples
    // against 5 jumped when this was written).
    let rate_moving = held.get(HeldBy::DcqcnRateMoving);
    let dcqcn = rate_moving + held.get(HeldBy::FlowUnsteady) + held.get(HeldBy::Busy);
    assert!(rate_moving > 0 && dcqcn > 10 * jumped, "{held:?}");
}

/// Two 50 MB flows from two hosts into one at 400 Gb/s: after DCQCN's first cuts and
/// their recovery, the receiver's port queue stands at PFC's threshold for about a
/// millisecond while every packet is marked and each CNP cuts both rates by ~1%, from
/// ~257 Gb/s towards the 200 Gb/s each delivers.
fn two_into_one(first_mib: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(3, gbps(400.0), us(1)).unwrap();
    (
        g,
        flow_set(vec![flow(1, 0, first_mib << 20), flow(2, 0, 50 << 20)]),
    )
}

/// Runs `fs` on `g` as the reference, partitioned with cut jumps and partitioned without
/// them.
fn with_and_without_cut_jumps(g: &NetGraph, fs: &FlowSet) -> (PacketRun, PacketRun, PacketRun) {
    let base = PacketConfig::reference();
    let off = run(base.clone(), g, fs);
    let cut = run(with_parts(base.clone()), g, fs);
    let mut without = with_parts(base);
    without.accel.cut_jumps = false;
    (off, cut, run(without, g, fs))
}

#[test]
fn a_cut_jump_carries_dcqcn_through_a_queue_held_at_pfc_within_bounds() {
    let (g, fs) = two_into_one(50);
    let base = PacketConfig::reference();
    let (off, cut, held) = with_and_without_cut_jumps(&g, &fs);
    let e = check_bounds(&base, &off, &cut, &fs, "two into one (cut jumps)");
    check_bounds(&base, &off, &held, &fs, "two into one (no cut jumps)");
    assert!(cut.stats.cut_jumps > 0, "{:?}", cut.stats);
    assert_eq!(held.stats.cut_jumps, 0);
    // Without them DCQCN's cuts hold that stretch back, and every packet of it is
    // simulated: 554,106 events against 355,021 with them when this was written.
    assert!(
        cut.report.events * 4 < held.report.events * 3,
        "{} against {}",
        cut.report.events,
        held.report.events
    );
    assert!(held.stats.ff_held.get(HeldBy::DcqcnRateMoving) > 0);
    assert!(e.end < 0.001, "{e:?}");
    // The cuts the jump stands in for matter once a flow runs on alone at the rate DCQCN
    // left it: with a 40 MiB first flow, the second ends 0.017% off the reference (0.035%
    // without cut jumps); frozen through the jump as an ordinary jump would leave it, its
    // rate was left higher and it ended 0.96% early.
    let (g, fs) = two_into_one(40);
    let (off, cut, _) = with_and_without_cut_jumps(&g, &fs);
    check_bounds(&base, &off, &cut, &fs, "40 and 50 MiB into one (cut jumps)");
    assert!(cut.stats.cut_jumps > 0, "{:?}", cut.stats);
    for (on, reference) in cut.report.flows.iter().zip(&off.report.flows) {
        let (a, b) = (on.fct().0 as f64, reference.fct().0 as f64);
        assert!((a - b).abs() < 0.001 * b, "{a} against {b}");
    }
}

/// A 4-to-1 incast of 30 MiB flows at 400 Gb/s spends most of its time with the
/// receiver's port held at PFC's threshold and the four rates cut in step: with cut jumps
/// it takes less than half the events it takes without (330,065 against 799,111, the
/// reference 872,478, when this was written), within the bounds.
#[test]
fn cut_jumps_carry_a_long_incast_held_at_pfc_within_bounds() {
    let g = NetGraph::single_switch(5, gbps(400.0), us(1)).unwrap();
    let fs = flow_set((1..5).map(|i| flow(i, 0, 30 << 20)).collect());
    let base = PacketConfig::reference();
    let (off, cut, held) = with_and_without_cut_jumps(&g, &fs);
    check_bounds(&base, &off, &cut, &fs, "4-to-1 at 400G (cut jumps)");
    assert!(cut.stats.cut_jumps > 0, "{:?}", cut.stats);
    assert!(
        2 * cut.report.events < held.report.events,
        "{} against {}",
        cut.report.events,
        held.report.events
    );
}

// ---- Queues that are still moving -----------------------------------------------------

/// Host 1 receives a flow from host 0 and sends one to host 2, `bytes` each, on one switch
/// at `link_gbps`: the switch port into host 1 carries the first flow's data at host 0's
/// line rate and, beside it, the ACKs of the second, so its queue grows by the ACKs' rate
/// (8% of the link with per-packet ACKs) until ECN marks it and DCQCN cuts the first
/// flow: a pipeline stage receiving one micro-batch's activations while it sends the
/// previous one's.
fn chain_of_two(link_gbps: f64, bytes: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(3, gbps(link_gbps), us(1)).unwrap();
    (g, flow_set(vec![flow(0, 1, bytes), flow(1, 2, bytes)]))
}

fn without_queue_test(mut c: PacketConfig) -> PacketConfig {
    c.accel.queue_theta = f64::INFINITY;
    c
}

/// The reference with a step ECN threshold at 400 Gb/s: every packet leaving a queue over
/// 800 KB marked, so a queue's first mark falls where it crosses the threshold and no
/// draw decides it (with RED, a queue a few packets off picks another packet to mark).
fn step_ecn() -> PacketConfig {
    step_ecn_at(800_000)
}

/// [`step_ecn`] with the step at `bytes`.
fn step_ecn_at(bytes: u64) -> PacketConfig {
    PacketConfig {
        ecn: vec![EcnPoint {
            gbps: 400.0,
            kmin: bytes,
            kmax: bytes,
            pmax: 1.0,
        }],
        ..PacketConfig::reference()
    }
}

/// The queue into host 1 grows for about 230 us before its first mark, longer than the
/// window, while both flows deliver at flat rates. Jumped then, frozen short of the mark,
/// the first flow kept its line rate to the end and finished a third early. Growing, the
/// queue is not steady: the jump carries it to just short of the mark (step thresholds,
/// so that the mark is not a draw), and the mark and the cut are simulated.
#[test]
fn a_queue_still_growing_is_not_jumped_over_its_first_mark() {
    let (g, fs) = chain_of_two(400.0, 32_000_000);
    let base = step_ecn();
    let (off, whole, parts, _) = three_ways(base.clone(), &g, &fs, "chain of two");
    check_bounds(&base, &off, &whole, &fs, "chain of two (whole network)");
    assert!(off.stats.cnps > 0, "{:?}", off.stats);
    assert!(parts.stats.fast_forwards > 0, "{:?}", parts.stats);
    assert!(parts.report.events < off.report.events);
    // With the queue test off, the jump freezes the queue before its first mark.
    let blind = run(without_queue_test(with_parts(base.clone())), &g, &fs);
    let e = errors(&off, &blind, &fs);
    assert!(e.end > 0.2, "{e:?}");
}

/// Flows from host `k` to host `k + 1` for `k` in `0..n`, `bytes` each, on one 400 Gb/s
/// switch: every host but the ends receives while it sends, as a 1F1B pipeline's stages
/// do in its warm-up.
fn chain_of(n: u32, bytes: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(n as usize + 1, gbps(400.0), us(1)).unwrap();
    (g, flow_set((0..n).map(|k| flow(k, k + 1, bytes)).collect()))
}

/// The queues of a chain grow under their ECN thresholds, each link into a middle host
/// carrying a flow at line rate and the ACKs of that host's own flow. A quiet partition's
/// jump carries them (appends packets at their tails, moving each sender on by them),
/// stopping short of the threshold, where it used to wait for the first mark packet by
/// packet. With a step threshold (every packet over 800 KB marked, so the first mark
/// falls where the queue crosses it, no draw deciding), each flow lands on the reference
/// within 0.1% (its first mark, the cut and the recovery simulated), with no
/// retransmission (the appended packets are numbered where the flows expect them:
/// `check_bounds`), in under half the reference's events; without carrying, the chain of
/// eight took 1,982,451 events against 2,027,504 (default thresholds). With the default
/// RED thresholds the first mark is a draw among the packets over `kmin`, and a queue a
/// few packets off moves it: the chain of two then ends within 0.2% of the range of the
/// reference's ends over seeds 0 to 4 (measured: 1,123.2 to 1,136.7 us; the accelerated
/// run 1,125.6 us at 2.5 us samples, inside the range, and 1,137.8 us at 5 us and 1,138.0
/// at 10 us, 0.10% after its latest).
#[test]
fn a_queue_growing_towards_its_first_mark_is_carried_through_a_jump() {
    let step = step_ecn();
    for n in [2, 8] {
        let (g, fs) = chain_of(n, 32_000_000);
        let name = format!("chain of {n}");
        let (off, _, parts, e) = three_ways(step.clone(), &g, &fs, &name);
        assert!(off.stats.cnps > 0, "{name}: {:?}", off.stats);
        assert!(parts.stats.carried_packets > 0, "{name}: {:?}", parts.stats);
        assert!(e.mean_fct < 0.001 && e.end < 0.001, "{name}: {e:?}");
        assert!(
            2 * parts.report.events < off.report.events,
            "{name}: {} events against {}",
            parts.report.events,
            off.report.events
        );
        assert_eq!(parts.stats.go_backs, 0, "{name}");
    }
    let (g, fs) = chain_of(2, 32_000_000);
    let base = PacketConfig::reference();
    let on = run(with_parts(base.clone()), &g, &fs);
    assert!(on.stats.carried_packets > 0, "{:?}", on.stats);
    let ends: Vec<f64> = (0..5)
        .map(|seed| {
            run(
                PacketConfig {
                    seed,
                    ..base.clone()
                },
                &g,
                &fs,
            )
            .report
            .end
            .0 as f64
        })
        .collect();
    let (lo, hi) = ends
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &e| (lo.min(e), hi.max(e)));
    let end = on.report.end.0 as f64;
    assert!(
        end >= lo * 0.998 && end <= hi * 1.002,
        "{end} against the reference's {ends:?}"
    );
}

/// Host 1 receives a long flow at line rate while it sends two (to hosts 2 and 3), so the
/// link into it carries that flow and both flows' ACKs, and its queue grows by the ACKs'
/// share, whatever split of host 1's NIC DCQCN makes. Host 4's short flow into host 3
/// gets the flow from host 1 cut; after it ends that flow climbs back one rate increase
/// at a time, and each jump of the partition stops at the next increase. The growing
/// queue is carried through each jump, and what the jump carried into it goes into its
/// earlier samples too (a queue's samples, like its flows', are kept in the partition's
/// own time), so after the thaw its course is measured on rather than from fresh samples
/// alone, and the partition jumps again sooner. Step thresholds (3 MB at 400 Gb/s, 750 KB
/// on these 100 Gb/s links), so that a mark is not a draw. Measured (2.5 us samples): 994
/// us of the 6.47 ms run simulated packet by packet (145,925 events against the
/// reference's 878,226), within 0.06% in the mean; with the course measured afresh after
/// each thaw, 1,182 us (174,193 events).
#[test]
fn a_carried_queue_keeps_its_course_through_the_jump() {
    let g = NetGraph::single_switch(5, gbps(100.0), us(1)).unwrap();
    let fs = flow_set(vec![
        flow(0, 1, 60_000_000),
        flow(1, 2, 40_000_000),
        flow(1, 3, 30_000_000),
        flow(4, 3, 2_000_000),
    ]);
    let base = step_ecn_at(3_000_000);
    let off = run(base.clone(), &g, &fs);
    let on = run(with_parts(base.clone()), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "carried course");
    assert!(e.end < 0.001, "{e:?}");
    assert!(on.stats.carried_packets > 0, "{:?}", on.stats);
    assert!(on.stats.recovering_jumps > 1, "{:?}", on.stats);
    let simulated = on.report.end.0 - on.stats.jumped_time.0;
    assert!(
        simulated < Picos::from_micros(1_090).0,
        "{simulated} ps simulated packet by packet"
    );
}

/// After its first cut a queue drains: its flows deliver at the link's speed from what
/// stands in it while their senders add less. A quiet partition's jump takes the drain
/// out of the queue (each flow losing its share of it, its sender moved back by that
/// after its move on by what it delivered), stopping a guard above empty, where it used
/// to simulate the drain packet by packet. With a step threshold at 3 MB (a drain of
/// about 120 us; from 800 KB it lasts about 35 us, too short at 5 us samples to measure
/// and jump), the chain of two (96 MB flows, long enough for the queue to reach 3 MB;
/// one flow in the draining queue) and a two-to-one incast (two flows sharing it, their
/// shares weighted by what each delivers beyond its DCQCN rate) land within 0.1% of the
/// reference with every link's bytes equal to its (measured at 2.5 us samples and a 10 us
/// quiet tail: 0.008% and 0.015% mean), the chain in under half its events (506,525
/// against 1,234,441; 2,571 packets taken out of the draining queue; the incast 86,146
/// against 373,519).
#[test]
fn a_queue_draining_after_a_cut_is_carried_through_a_jump() {
    let step = step_ecn_at(3_000_000);
    let two_into_one = {
        let g = NetGraph::single_switch(3, gbps(400.0), us(1)).unwrap();
        let fs = flow_set(vec![flow(0, 2, 32_000_000), flow(1, 2, 24_000_000)]);
        (g, fs)
    };
    for (name, (g, fs)) in [
        ("chain of two", chain_of(2, 96_000_000)),
        ("two into one", two_into_one),
    ] {
        let off = run(step.clone(), &g, &fs);
        let on = run(with_parts(step.clone()), &g, &fs);
        let e = check_bounds(&step, &off, &on, &fs, name);
        assert!(on.stats.drained_packets > 0, "{name}: {:?}", on.stats);
        assert!(e.mean_fct < 0.001 && e.end < 0.001, "{name}: {e:?}");
        assert_eq!(on.report.link_bytes, off.report.link_bytes, "{name}");
        assert_eq!(on.stats.go_backs, 0, "{name}");
        if name == "chain of two" {
            assert!(
                2 * on.report.events < off.report.events,
                "{name}: {} events against {}",
                on.report.events,
                off.report.events
            );
        }
    }
}

/// With one ACK per eight packets the queue into host 1 grows by under 1% of the link, too
/// slowly to fail the drift test, but it still reaches a low ECN threshold (100 KB) about
/// 850 us in, before the flows end: a queue on its way to marking is not steady, and one
/// over the threshold is not either while no flow through it has been cut yet (its first
/// mark halves the rate). Either rule alone let a jump through, and the first flow
/// finished 23% early. With 2.5 us samples the quiet window ends before that queue has
/// held more than a frame, which used to leave it out of the test altogether: the first
/// flow finished 24% early until a queue within a frame was left out only where it
/// cannot grow (here two cables feed it, and its load is about 101% of the link).
#[test]
fn a_queue_drifting_slowly_towards_marking_is_not_jumped_over_its_first_mark() {
    let (g, fs) = chain_of_two(100.0, 20_000_000);
    let mut base = PacketConfig::reference();
    base.ack_every = 8;
    base.ecn = vec![EcnPoint {
        gbps: 100.0,
        kmin: 100_000,
        kmax: 400_000,
        pmax: 0.2,
    }];
    let (off, _, parts, _) = three_ways(base.clone(), &g, &fs, "chain of two, slow drift");
    assert!(off.stats.cnps > 0, "{:?}", off.stats);
    assert!(parts.stats.fast_forwards > 0, "{:?}", parts.stats);
    let blind = run(without_queue_test(with_parts(base)), &g, &fs);
    let e = errors(&off, &blind, &fs);
    assert!(e.end > 0.2, "{e:?}");
}

/// A flow alone through a switch: the queue at the switch's egress holds at most a frame,
/// and, fed by one cable as fast as its own, it cannot grow, so the partition jumps after
/// its quiet window instead of waiting until that queue's course is measured (the slow
/// drift above is the queue that may grow). Tested on how much of the flow's 4.33 ms the
/// jumps left to simulate: 30.1 us with the exemption (its start and its tail), 52.6 us
/// without it (at a 20 us quiet tail, 40.1 and 62.6 us).
#[test]
fn a_shallow_queue_fed_by_one_cable_does_not_hold_a_quiet_jump_back() {
    let g = NetGraph::single_switch(2, gbps(100.0), us(1)).unwrap();
    let fs = flow_set(vec![flow(0, 1, 50_000_000)]);
    let base = PacketConfig::reference();
    let (off, _, parts, _) = three_ways(base, &g, &fs, "one flow through a switch");
    let fct = off.report.flows[0].finish.0 - off.report.flows[0].start.0;
    let simulated = fct - parts.stats.jumped_time.0;
    assert!(parts.stats.quiet_jumps > 0, "{:?}", parts.stats);
    assert!(simulated < us(40).0, "simulated {simulated} ps of {fct}");
}

/// Without DCQCN, on a 4 MiB switch: hosts 0 and 4 each send to host 1 and to a host of
/// their own (20 MB each, their NICs shared round-robin), and host 1 sends 40 MB to host
/// 2. The link into host 1 carries two half-rate flows and the ACKs of host 1's own, so
/// its queue grows by those ACKs' 8% until PFC pauses hosts 0 and 4, which slows the
/// flows they send elsewhere too. Jumped while still growing, frozen under
/// the pause threshold, those two flows ran unpaused and finished 5.6% early.
#[test]
fn a_queue_growing_towards_pfc_pauses_is_not_jumped() {
    let g = NetGraph::single_switch(6, gbps(100.0), us(1)).unwrap();
    let fs = flow_set(vec![
        flow(0, 1, 20_000_000),
        flow(0, 3, 20_000_000),
        flow(4, 1, 20_000_000),
        flow(4, 5, 20_000_000),
        flow(1, 2, 40_000_000),
    ]);
    let base = PacketConfig {
        buffer_bytes: 4 * 1024 * 1024,
        ..pfc_only()
    };
    let (off, _, _, _) = three_ways(base.clone(), &g, &fs, "growing towards PFC");
    let pauses = |r: &PacketRun| r.report.pfc_pauses.iter().sum::<u64>();
    assert!(pauses(&off) > 0);
    let blind = run(without_queue_test(with_parts(base)), &g, &fs);
    let e = errors(&off, &blind, &fs);
    assert!(e.mean_fct > 0.015, "{e:?}");
}

// ---- Quiet partitions ------------------------------------------------------------------

fn without_quiet(mut c: PacketConfig) -> PacketConfig {
    c.accel.quiet_window = 0;
    c
}

/// Each GPU of one host of four sends to the GPU of the same rail on the other host and
/// back, 6 MB each way at staggered sizes: one flow per direction of every rail link, each
/// one's ACKs among the other's data.
fn rail_pairs() -> (NetGraph, FlowSet) {
    let mut flows = Vec::new();
    for gpu in 0..4u32 {
        let bytes = 6_000_000 + 500_000 * u64::from(gpu);
        flows.push(flow(gpu, 4 + gpu, bytes));
        flows.push(flow(4 + gpu, gpu, bytes));
    }
    (four_gpu_hosts(2), flow_set(flows))
}

/// Long flows alone on their paths are quiet (nothing queues in a switch, DCQCN stays at
/// line rate): partitioned, they jump after `quiet_window` samples and stop
/// `quiet_tail_margin` before they end, within the bounds, and with fewer events than
/// when only the whole window lets them jump.
#[test]
fn quiet_partitions_jump_after_a_short_window_within_bounds() {
    for (name, (g, fs)) in [("disjoint", disjoint()), ("rail pairs", rail_pairs())] {
        let off = run(PacketConfig::reference(), &g, &fs);
        let quiet = run(with_parts(PacketConfig::reference()), &g, &fs);
        let long = run(
            without_quiet(with_parts(PacketConfig::reference())),
            &g,
            &fs,
        );
        check_bounds(&PacketConfig::reference(), &off, &quiet, &fs, name);
        check_bounds(&PacketConfig::reference(), &off, &long, &fs, name);
        assert!(quiet.stats.quiet_jumps > 0, "{name}: {:?}", quiet.stats);
        assert!(quiet.stats.quiet_jumps <= quiet.stats.fast_forwards);
        assert_eq!(long.stats.quiet_jumps, 0, "{name}");
        assert!(
            quiet.report.events < long.report.events,
            "{name}: {} against {}",
            quiet.report.events,
            long.report.events
        );
    }
}

/// Four equal flows into one host share its link from start to end. Under PFC alone a
/// switch queue and pauses are always there: the partition is never quiet, and it is still
/// steady and jumps after the whole window. Under DCQCN the queue is marked and the flows
/// cut; once cut below the link's speed the queue drains, and the partition is quiet only
/// while the rates are held, so a quiet jump goes no farther than the flows' next
/// increase (one did at 2.5 us samples, 627.5 us, and at 2 us, 636 us; at 10 us the
/// queue never stayed under its threshold for the three samples).
#[test]
fn an_incast_is_quiet_only_while_dcqcn_holds_its_rates() {
    let g = NetGraph::single_switch(5, gbps(100.0), us(1)).unwrap();
    let fs = flow_set((0..4).map(|i| flow(i, 4, 8_000_000)).collect());
    for (name, base) in [
        ("incast, PFC only", pfc_only()),
        ("incast, DCQCN", PacketConfig::reference()),
    ] {
        let off = run(base.clone(), &g, &fs);
        let on = run(with_parts(base.clone()), &g, &fs);
        check_bounds(&base, &off, &on, &fs, name);
        if base.dcqcn {
            assert!(
                on.stats.quiet_jumps <= on.stats.recovering_jumps,
                "{name}: {:?}",
                on.stats
            );
        } else {
            assert_eq!(on.stats.quiet_jumps, 0, "{name}: {:?}", on.stats);
            assert!(on.stats.fast_forwards > 0, "{name}: {:?}", on.stats);
        }
    }
}

/// A flow alone and quiet, then a second one released onto its bottleneck at 1 ms: the
/// quiet jump stops at the release (the late flow starts exactly then), and the run,
/// where the two then share the link into host 2, stays within bounds.
#[test]
fn a_quiet_jump_stops_at_a_flow_arriving_on_its_links() {
    let (g, fs) = mid_arrival();
    let off = run(PacketConfig::reference(), &g, &fs);
    let on = run(with_parts(PacketConfig::reference()), &g, &fs);
    check_bounds(
        &PacketConfig::reference(),
        &off,
        &on,
        &fs,
        "mid arrival, quiet",
    );
    assert!(on.stats.quiet_jumps > 0, "{:?}", on.stats);
    assert_eq!(on.report.flows[1].start, us(1000));
}

/// A short flow and a long one into one host: both are cut by DCQCN while they share the
/// link, and after the short one finishes the long one climbs back to line rate one
/// rate-increase period (900 us) at a time, its rate flat in between.
fn recovery_after_a_short_rival() -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(3, gbps(100.0), us(1)).unwrap();
    (
        g,
        flow_set(vec![flow(0, 2, 4_000_000), flow(1, 2, 60_000_000)]),
    )
}

#[test]
fn a_recovering_flow_jumps_between_its_rate_increases_which_keep_their_time() {
    let (g, fs) = recovery_after_a_short_rival();
    // The long window's recovering jumps; the quiet ones are checked at the end.
    let base = without_quiet(PacketConfig::reference());
    let (off, whole, parts, e) = three_ways(base.clone(), &g, &fs, "recovery");
    // Recovering, the long flow is never steady for the whole-network jump (its clocks stay
    // in local time there) and was not for the partitioned one before it kept its clock.
    // The whole network may jump while the two share the link at rates DCQCN holds (at
    // 2.5 us samples it jumped once, 23.8 us, before the short flow's tail), never after: a
    // jump of the recovering flow with its clocks in local time would delay its increases
    // by the jump, and its end with them.
    let whole_errors = check_bounds(&base, &off, &whole, &fs, "recovery (whole network)");
    assert!(whole_errors.end < 0.002, "{whole_errors:?}");
    // Partitioned, it jumps up to each increase: most of its run is skipped...
    let fct = off.report.flows[1].finish.0 - off.report.flows[1].start.0;
    assert!(parts.stats.jumped_time.0 > fct / 2, "{:?}", parts.stats);
    assert!(parts.stats.recovering_jumps > 0);
    assert!(parts.stats.recovering_jumps <= parts.stats.fast_forwards);
    assert!(parts.report.events < off.report.events / 2);
    // ...and its increases come when they did in the reference, not a jump later each
    // (with its clocks frozen through the jumps, the flow finished 71% late).
    assert!(e.end < 0.002, "{e:?}");
    // At every trace sample it has delivered at least what it had in the reference (a jump
    // moves its bytes when it starts, so within a jump it is ahead), and at the samples
    // between jumps it agrees to within 0.1%.
    let trace = TraceRequest {
        interval: us(250),
        ports: Vec::new(),
        flows: true,
    };
    let t_off = PacketSimulator::new(PacketConfig::reference())
        .run(&g, &fs, &trace)
        .unwrap();
    let t_on = PacketSimulator::new(with_parts(base))
        .run(&g, &fs, &trace)
        .unwrap();
    assert_eq!(t_on.report, parts.report);
    let mut agree = 0;
    for (a, b) in t_off.samples.iter().zip(&t_on.samples) {
        assert_eq!(a.time, b.time);
        if a.time >= off.report.flows[1].finish {
            break;
        }
        let (x, y) = (a.delivered[1] as f64, b.delivered[1] as f64);
        assert!(y >= 0.999 * x, "at {:?}: {y} behind {x}", a.time);
        agree += usize::from((x - y).abs() < 0.001 * x);
    }
    assert!(agree >= 6, "{agree} samples agree");
    // Once the rival has left, nothing queues: the partition is quiet, recovering flow and
    // all, and after a short window it jumps to each increase as well, with fewer events
    // (stopping there as the long window's jumps do: with quiet jumps that ran past the
    // increase, the flow would finish late by the jumps' overshoot).
    let quiet = run(with_parts(PacketConfig::reference()), &g, &fs);
    let eq = check_bounds(
        &PacketConfig::reference(),
        &off,
        &quiet,
        &fs,
        "recovery, quiet",
    );
    assert!(eq.end < 0.002, "{eq:?}");
    assert!(quiet.stats.quiet_jumps > 0, "{:?}", quiet.stats);
    assert!(quiet.stats.recovering_jumps > 0, "{:?}", quiet.stats);
    assert!(quiet.report.events < parts.report.events);
}

/// Two-GPU all-reduces of `bytes` between the same GPU of host `h` (pod 0) and host `h + 2`
/// (pod 1), on every GPU of two hosts of four: eight pairs over two spines, one cable from
/// each leaf to each, so ECMP puts some pairs' flows on shared cables and leaves others
/// alone (the embedding all-reduce of a pipeline whose first and last stages are in
/// different pods).
fn cross_pod_pairs(bytes: u64) -> (NetGraph, FlowSet) {
    let spec = RailOptimizedSpec {
        gpus_per_host: 4,
        hosts_per_pod: 2,
        spines: 2,
        ..RailOptimizedSpec::dgx_h100(4)
    };
    let g = NetGraph::rail_optimized(&spec).unwrap();
    let mut fs = FlowSet::default();
    for a in 0..8u32 {
        add_ring(&mut fs, &format!("pair {a}"), &[a, a + 8], bytes);
    }
    (g, fs)
}

#[test]
fn cross_pod_pairs_that_ecmp_partly_collides_stay_within_bounds() {
    let (g, fs) = cross_pod_pairs(48_000_000);
    let (off, _, parts, _) = three_ways(PacketConfig::reference(), &g, &fs, "cross-pod pairs");
    assert!(off.stats.ecn_marks > 0 && off.stats.cnps > 0);
    assert!(parts.stats.fast_forwards > 0);
    assert!(parts.report.events < off.report.events);
    // ECMP did collide: some cable carries more than one GPU's sends (48 MB), so flows of
    // two pairs.
    let busiest = off.report.link_bytes.iter().max().copied().unwrap_or(0);
    assert!(busiest > 48_000_000, "{busiest}");
    // Not every flow jumped: 20 of the 32 flows cost under half their reference events.
    let jumped = (off.flow_events.iter().zip(&parts.flow_events))
        .filter(|(a, b)| 2 * **b < **a)
        .count();
    assert!(jumped > 0 && jumped < fs.flows.len(), "{jumped}");
}

/// An 8-rank one-channel ring all-reduce of 16 MB on one switch at 100 Gb/s, rank 0's port
/// shared with a `bytes` flow to a ninth endpoint: the ring's steps fall out of step with
/// each other, so a rank may have two sends in flight and its neighbours' partitions jump
/// while it runs.
fn staggered_ring(bytes: u64) -> (NetGraph, FlowSet) {
    let g = NetGraph::single_switch(9, gbps(100.0), us(1)).unwrap();
    let mut fs = flow_set(vec![flow(0, 8, bytes)]);
    fs.collectives.push(neighbour());
    collective_flows(
        &mut fs,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 1 },
        &(0..8).collect::<Vec<u32>>(),
        Bytes(16_000_000),
        1,
        Picos::from_nanos(2000),
    )
    .unwrap();
    (g, fs)
}

/// The collective of the flows beside a ring.
fn neighbour() -> CollectiveInfo {
    CollectiveInfo {
        name: "neighbour".to_string(),
        kind: None,
        ranks: vec![0, 8],
        bytes: Bytes(0),
    }
}

#[test]
fn a_jump_stops_where_another_partitions_completion_would_release_a_flow_onto_it() {
    // A step released by a completion in another partition used to land on a partition
    // frozen by a quiet jump and wait for its thaw: with a 23 MB neighbour, one step took
    // 348 us instead of 189 and the run ended 3.4% late.
    for bytes in [5_000_000, 23_000_000] {
        let (g, fs) = staggered_ring(bytes);
        let base = PacketConfig::reference();
        let off = run(base.clone(), &g, &fs);
        let on = run(PacketConfig::default(), &g, &fs);
        check_bounds(
            &base,
            &off,
            &on,
            &fs,
            &format!("staggered ring, {bytes} B beside"),
        );
        assert!(on.stats.quiet_jumps > 0, "{bytes}: {:?}", on.stats);
        assert!(on.report.events < off.report.events);
    }
}

#[test]
fn cross_pod_pairs_on_pinned_paths_stay_quiet_and_jump_within_bounds() {
    // The same pairs with paths pinned by destination: every flow has its own cables
    // across the spines, nothing is marked, and every mechanism (the default) skips most
    // of the reference's events.
    let (g, fs) = cross_pod_pairs(48_000_000);
    let g = g.with_routing(Routing::Pinned);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(PacketConfig::default(), &g, &fs);
    check_bounds(&base, &off, &on, &fs, "cross-pod pairs, pinned");
    assert_eq!(off.stats.ecn_marks, 0);
    let busiest = off.report.link_bytes.iter().max().copied().unwrap_or(0);
    assert_eq!(busiest, 48_000_000);
    assert!(on.stats.quiet_jumps > 0);
    assert!(
        on.report.events * 20 < off.report.events,
        "{} vs {}",
        on.report.events,
        off.report.events
    );
}

#[test]
fn partitioning_keeps_the_single_partition_scenarios_within_bounds() {
    let scenarios: Vec<(&str, PacketConfig, (NetGraph, FlowSet))> = vec![
        ("disjoint", PacketConfig::reference(), disjoint()),
        ("long incast PFC", pfc_only(), long_incast(8_000_000)),
        (
            "long incast DCQCN",
            PacketConfig::reference(),
            long_incast(8_000_000),
        ),
        ("ring", PacketConfig::reference(), ring_all_reduce(16 << 20)),
        ("mid arrival", PacketConfig::reference(), mid_arrival()),
    ];
    for (name, base, (g, fs)) in scenarios {
        let (_, _, parts, _) = three_ways(base, &g, &fs, name);
        if name == "mid arrival" {
            assert!(parts.stats.fast_forwards > 0);
            assert_eq!(parts.report.flows[1].start, us(1000));
        }
        if name == "disjoint" {
            assert!(parts.stats.fast_forwards > 0);
        }
    }
}

#[test]
fn partitioning_never_skips_short_flows_or_bursts() {
    for (g, fs) in [short_flows(), incast_burst()] {
        let off = run(PacketConfig::reference(), &g, &fs);
        let parts = run(with_parts(PacketConfig::reference()), &g, &fs);
        assert_eq!(parts.stats.fast_forwards, 0);
        assert_eq!(parts.report, off.report);
    }
}

#[test]
fn partitioned_fast_forwarding_is_deterministic() {
    for (g, fs) in [long_and_short(), long_and_dcqcn_incast()] {
        let a = run(with_parts(PacketConfig::reference()), &g, &fs);
        let b = run(with_parts(PacketConfig::reference()), &g, &fs);
        assert_eq!(a, b);
        assert!(a.stats.fast_forwards > 0);
    }
}

/// Events off / whole-network / partitioned and the partitioned errors for the
/// partitioning scenarios (report only; run like the report above).
#[test]
#[ignore]
fn report_events_with_partitioning() {
    let scenarios: Vec<(&str, (NetGraph, FlowSet))> = vec![
        ("long flows + short-flow stream", long_and_short()),
        ("steady pair + DCQCN incast", long_and_dcqcn_incast()),
        ("joins and merge, PFC only", joins_and_merge()),
        ("disjoint long flows", disjoint()),
        ("mid-steady-state arrival", mid_arrival()),
        ("ring all-reduce 16 MiB", ring_all_reduce(16 << 20)),
    ];
    for (name, (g, fs)) in scenarios {
        let base = if name.contains("PFC only") {
            pfc_only()
        } else {
            PacketConfig::reference()
        };
        let (off, whole, parts, e) = three_ways(base, &g, &fs, name);
        let ew = errors(&off, &whole, &fs);
        println!(
            "{name}: events off {} whole {} partitioned {}; jumps whole {} partitioned {}; \
             partitioned errors mean {:.4}% p99 {:.4}% end {:.4}% coll {:.4}%; \
             whole errors mean {:.4}% p99 {:.4}% end {:.4}%",
            off.report.events,
            whole.report.events,
            parts.report.events,
            whole.stats.fast_forwards,
            parts.stats.fast_forwards,
            100.0 * e.mean_fct,
            100.0 * e.p99_fct,
            100.0 * e.end,
            100.0 * e.collective,
            100.0 * ew.mean_fct,
            100.0 * ew.p99_fct,
            100.0 * ew.end,
        );
    }
}

// ---- Memoization -----------------------------------------------------------------------

fn with_memo(mut c: PacketConfig) -> PacketConfig {
    c.accel.memoize = true;
    c
}

/// `reps` rounds of an all-to-all (`bytes` per rank) among 8 GPUs on two rail-optimised
/// hosts, each round released `gap` after every flow of the previous one finished: the
/// dispatch of one MoE layer after another, with compute in between.
fn repeated_all_to_all(reps: usize, bytes: u64, gap: Picos) -> (NetGraph, FlowSet) {
    let ranks: Vec<u32> = (0..8).collect();
    repeated_all_to_all_of(FlowAlgorithm::Direct, 2, &ranks, reps, bytes, gap)
}

/// [`repeated_all_to_all`] with another algorithm, over `ranks` of `hosts` hosts of four
/// GPUs.
fn repeated_all_to_all_of(
    algorithm: FlowAlgorithm,
    hosts: usize,
    ranks: &[u32],
    reps: usize,
    bytes: u64,
    gap: Picos,
) -> (NetGraph, FlowSet) {
    let g = four_gpu_hosts(hosts);
    let mut fs = FlowSet::default();
    let mut prev: Option<std::ops::Range<usize>> = None;
    for r in 0..reps {
        let range = collective_flows(
            &mut fs,
            &format!("a2a{r}"),
            CollectiveKind::AllToAll,
            algorithm,
            ranks,
            Bytes(bytes),
            4,
            Picos::from_nanos(2000),
        )
        .unwrap();
        if let Some(p) = &prev {
            for i in range.clone() {
                fs.flows[i].deps = p.clone().map(|d| FlowId(d as u32)).collect();
                fs.flows[i].delay = Picos(fs.flows[i].delay.0 + gap.0);
            }
        }
        prev = Some(range);
    }
    (g, fs)
}

#[test]
fn memoized_all_to_all_rounds_stay_within_bounds_and_skip_the_repeats() {
    let (g, fs) = repeated_all_to_all(8, 4_000_000, us(30));
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_memo(base.clone()), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "all-to-all rounds");
    // Each round is three isolated groups: the NVLink traffic inside each host and the
    // traffic between the hosts (over the NICs). The first round records all three (the
    // two hosts' groups are isomorphic, so one entry serves both); every later one hits.
    assert_eq!(
        (e.mean_fct, e.end),
        (0.0, 0.0),
        "deterministic episodes repeat exactly"
    );
    assert_eq!(on.stats.memo_lookups, 24);
    assert_eq!(on.stats.memo_recorded, 3);
    assert_eq!(on.stats.memo_hits, 21);
    assert_eq!(on.stats.memo_aborts, 0);
    assert!(on.report.events * 7 < off.report.events);
    assert!(on.stats.memo_skipped_events > 0);
    // Events by flow: in the reference every flow has its own, and the rest are port
    // events; with the memo, only the recorded first round's flows have any.
    assert!(off.flow_events.iter().all(|&n| n > 0));
    assert!(off.flow_events.iter().sum::<u64>() < off.report.events);
    let per_round = fs.flows.len() / 8;
    let (first, later) = on.flow_events.split_at(per_round);
    assert!(first.iter().all(|&n| n > 0), "{first:?}");
    assert!(later.iter().all(|&n| n == 0), "{later:?}");
}

#[test]
fn pxn_all_to_all_rounds_stay_within_bounds_with_every_mechanism() {
    // An expert group as Megatron places it with two tensor ranks: the even GPUs of four
    // hosts, so most blocks between hosts change rails and are relayed over NVLink.
    let ranks: Vec<u32> = (0..4).flat_map(|h| [4 * h, 4 * h + 2]).collect();
    let (g, fs) = repeated_all_to_all_of(FlowAlgorithm::DirectPxn, 4, &ranks, 6, 4_000_000, us(30));
    let per_round = fs.flows.len() / 6;
    assert_eq!(
        per_round,
        8 * 7 + 4 * 3 * 2,
        "one NVLink flow per relayed block"
    );
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(PacketConfig::default(), &g, &fs);
    check_bounds(&base, &off, &on, &fs, "PXN all-to-all rounds");
    assert!(
        on.report.events * 4 < off.report.events,
        "{} vs {}",
        on.report.events,
        off.report.events
    );
}

#[test]
fn memoized_ring_steps_stay_within_bounds() {
    // Every step of a ring starts after the previous step's flow into its sender finished,
    // so each flow starts on links that are idle by then: an isolated one-flow episode,
    // the same at every step but those whose route differs.
    let (g, fs) = ring_all_reduce(8_000_000);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_memo(base.clone()), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "ring with memo");
    assert_eq!(
        (e.mean_fct, e.end),
        (0.0, 0.0),
        "deterministic episodes repeat exactly"
    );
    assert!(on.stats.memo_hits > 0);
    assert!(on.report.events * 2 < off.report.events);
    assert_eq!(on.stats.memo_aborts, 0);
}

#[test]
fn a_cache_carries_across_runs_and_through_its_file() {
    let (g, fs) = repeated_all_to_all(3, 2_000_000, us(30));
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let sim = PacketSimulator::new(with_memo(base.clone()));
    let first = sim.run(&g, &fs, &TraceRequest::default()).unwrap();
    assert_eq!(first.stats.memo_recorded, 3);
    // The second run finds every round in the cache: not one packet is simulated, the
    // only events are the flows' releases.
    let second = sim.run(&g, &fs, &TraceRequest::default()).unwrap();
    assert_eq!(second.stats.memo_hits, 9);
    assert_eq!(second.report.events, fs.flows.len() as u64);
    assert!(
        second.flow_events.iter().all(|&n| n == 0),
        "no flow simulated"
    );
    check_bounds(&base, &off, &second, &fs, "second run");
    // Through a file, into a fresh simulator.
    let path = std::env::temp_dir().join(format!("orrery-accel-memo-{}.bin", std::process::id()));
    sim.cache().save(&path).unwrap();
    let loaded = orrery_net::packet::MemoCache::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let third = PacketSimulator::with_cache(with_memo(base.clone()), loaded)
        .run(&g, &fs, &TraceRequest::default())
        .unwrap();
    assert_eq!(third.report, second.report);
    // A different configuration never uses those entries.
    let mut other = with_memo(base.clone());
    other.ecn[0].kmin = 200_000;
    let fourth = PacketSimulator::with_cache(other, sim.cache())
        .run(&g, &fs, &TraceRequest::default())
        .unwrap();
    assert_eq!(fourth.stats.memo_recorded, 3);
    assert_eq!(fourth.stats.memo_hits, 6);
}

#[test]
fn a_flow_intruding_on_a_memoized_episode_aborts_it_and_stays_within_bounds() {
    // Round 6 of 8 is a hit; 20 us after its first (NVLink) flow finishes, while the
    // round's inter-host group is still running, an unrelated flow starts on GPU 0's NIC,
    // which that group uses. The hit must be rolled back: its episode is replayed up to
    // the intrusion and its flows simulated on from the replayed state.
    let (g, fs) = intruded_all_to_all();
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_memo(base.clone()), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "intruded all-to-all");
    assert!(on.stats.memo_aborts >= 1, "{:?}", on.stats);
    assert!(on.stats.memo_replayed_events > 0, "{:?}", on.stats);
    // Resuming from linear progress with empty queues (before replays) gave 0.22% mean and
    // 3.7% p99 here; the replay leaves only ECN's random draws and buffer background.
    assert!(e.mean_fct < 1e-3 && e.p99_fct < 1e-2, "{e:?}");
    // Without the intruder no round aborts (the harness above).
}

/// The repeated all-to-all whose sixth round a later flow intrudes on (see
/// [`a_flow_intruding_on_a_memoized_episode_aborts_it_and_stays_within_bounds`]).
fn intruded_all_to_all() -> (NetGraph, FlowSet) {
    let (g, mut fs) = repeated_all_to_all(8, 4_000_000, us(30));
    let round = 56; // flows per round
    let mut intruder = flow(0, 7, 1_000_000);
    intruder.deps = vec![FlowId((5 * round) as u32)].into();
    intruder.delay = us(20);
    fs.flows.push(intruder);
    (g, fs)
}

/// `reps` ring all-reduces of `bytes` on the 8-GPU fabric of [`ring_all_reduce`], each
/// released `gap` after the previous one finished (a bucket after bucket).
fn repeated_rings(reps: usize, bytes: u64, gap: Picos) -> (NetGraph, FlowSet) {
    let (g, first) = ring_all_reduce(bytes);
    let mut fs = FlowSet::default();
    let per = first.flows.len();
    for r in 0..reps {
        let base = fs.flows.len();
        for f in &first.flows {
            let mut f = f.clone();
            f.deps = f.deps.iter().map(|d| FlowId(d.0 + base as u32)).collect();
            if r > 0 && f.deps.is_empty() {
                // The first step waits for every flow of the previous ring.
                f.deps = (base - per..base).map(|d| FlowId(d as u32)).collect();
                f.delay = Picos(f.delay.0 + gap.0);
            }
            fs.flows.push(f);
        }
    }
    (g, fs)
}

#[test]
fn a_whole_ring_is_one_episode_and_its_repeats_hit() {
    // The ring's later steps are released by its own flows onto its own links: they join
    // the episode that the first step started, so the whole collective is recorded once
    // and every repeat is looked up as a whole.
    let (g, fs) = repeated_rings(5, 8_000_000, us(20));
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_memo(base.clone()), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "repeated rings");
    assert_eq!(on.stats.memo_aborts, 0, "{:?}", on.stats);
    assert!(on.stats.memo_hits >= 4, "{:?}", on.stats);
    assert!(on.report.events * 4 < off.report.events, "{:?}", on.stats);
    assert!(e.mean_fct < 1e-9, "{e:?}");
}

// ---- Mirrors -------------------------------------------------------------------------

fn with_mirror(mut c: PacketConfig) -> PacketConfig {
    c.accel.memoize = true;
    c.accel.mirror = true;
    c
}

/// One ring all-reduce of `bytes` per rail on four rail-optimised hosts of four GPUs: ring
/// `r` runs over GPU `r` of every host, on rail `r`'s NICs and leaf, so the four rings are
/// isomorphic, start together and share no link (the data-parallel groups of four pipeline
/// stages or tensor ranks).
fn rings_on_every_rail(bytes: u64) -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    for rail in 0..4u32 {
        let ranks: Vec<u32> = (0..4).map(|h| h * 4 + rail).collect();
        add_ring(&mut fs, &format!("ring{rail}"), &ranks, bytes);
    }
    (four_gpu_hosts(4), fs)
}

/// Adds a flow from `src` to `dst` that starts about 40 us into the rings' first step,
/// released by a short NVLink flow elsewhere (so it is neither a join nor a release known
/// when the rings started: an intrusion).
fn intruder_during_the_first_step(fs: &mut FlowSet, src: u32, dst: u32) {
    let trigger = fs.flows.len();
    let mut short = flow(1, 3, 100_000);
    short.delay = us(5);
    fs.flows.push(short);
    let mut intruder = flow(src, dst, 2_000_000);
    intruder.deps = vec![FlowId(trigger as u32)].into();
    intruder.delay = us(35);
    fs.flows.push(intruder);
}

#[test]
fn isomorphic_groups_started_together_are_simulated_once() {
    let (g, fs) = rings_on_every_rail(16_000_000);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let slow = run(with_memo(base.clone()), &g, &fs);
    let fast = run(with_mirror(base.clone()), &g, &fs);
    // Without mirrors every ring's first step is recorded; with them ring 0's is, and
    // the other three follow it. Later steps of the mirrors start on links without
    // draining packets, so they are looked up and mirrored too.
    assert_eq!(slow.stats.memo_mirrored, 0);
    assert_eq!(slow.stats.memo_recorded, 4, "{:?}", slow.stats);
    assert!(fast.stats.memo_mirrored >= 3, "{:?}", fast.stats);
    assert_eq!(fast.stats.memo_mirror_breaks, 0, "{:?}", fast.stats);
    assert!(
        fast.report.events * 3 < slow.report.events * 2,
        "{:?}",
        fast.stats
    );
    // Disjoint rings do not interact, so the mirrors' completions are the leader's, which
    // are the reference's: the fast path changes nothing.
    let e = check_bounds(&base, &off, &fast, &fs, "mirrored rings");
    assert!(e.mean_fct < 1e-9 && e.end < 1e-9, "{e:?}");
    let e = check_bounds(&base, &slow, &fast, &fs, "mirrors against no mirrors");
    assert!(e.mean_fct < 1e-9, "{e:?}");
}

#[test]
fn a_flow_intruding_on_a_mirror_breaks_only_that_mirror_within_bounds() {
    // An unrelated flow starts on GPU 2's NIC (rail 2) while ring 2 mirrors ring 0: ring 2
    // must be simulated from then on; rings 1 and 3 go on mirroring.
    let (g, mut fs) = rings_on_every_rail(16_000_000);
    intruder_during_the_first_step(&mut fs, 2, 10);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_mirror(base.clone()), &g, &fs);
    assert!(on.stats.memo_mirrored >= 3, "{:?}", on.stats);
    assert_eq!(on.stats.memo_mirror_breaks, 1, "{:?}", on.stats);
    check_bounds(&base, &off, &on, &fs, "intruded mirror");
}

#[test]
fn a_flow_intruding_on_the_leader_breaks_every_mirror_within_bounds() {
    let (g, mut fs) = rings_on_every_rail(16_000_000);
    let per_ring = fs.flows.len() / 4;
    intruder_during_the_first_step(&mut fs, 0, 8);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_mirror(base.clone()), &g, &fs);
    assert!(on.stats.memo_mirrored >= 3, "{:?}", on.stats);
    assert_eq!(on.stats.memo_mirror_breaks, 3, "{:?}", on.stats);
    check_bounds(&base, &off, &on, &fs, "intruded leader");
    // The intruder slows ring 0 only (its first flow finishes later than ring 1's).
    // Rings 1 to 3 mirrored ring 0 until then and took over its state when it was
    // intruded: they finish exactly as in the reference, as does everything else.
    assert!(off.report.flows[0].finish > off.report.flows[per_ring].finish);
    assert_eq!(
        on.report.flows[per_ring..4 * per_ring],
        off.report.flows[per_ring..4 * per_ring]
    );
    assert_eq!(on.report.flows, off.report.flows);
}

#[test]
fn a_join_the_mirrors_lack_breaks_them_within_bounds() {
    // A flow released at a fixed time (no dependencies) onto ring 0's NIC during the first
    // step joins ring 0's recording as a timed join; the other rings have no such flow, so
    // they stop mirroring at that instant.
    let (g, mut fs) = rings_on_every_rail(16_000_000);
    let mut late = flow(0, 8, 2_000_000);
    late.delay = us(60);
    fs.flows.push(late);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_mirror(base.clone()), &g, &fs);
    assert!(on.stats.memo_mirrored >= 3, "{:?}", on.stats);
    assert_eq!(on.stats.memo_mirror_breaks, 3, "{:?}", on.stats);
    check_bounds(&base, &off, &on, &fs, "a join only the leader has");
}

// ---- Periodic extrapolation ------------------------------------------------------------

fn with_periodic(mut c: PacketConfig) -> PacketConfig {
    c.accel.memoize = true;
    c.accel.periodic = true;
    c
}

/// A one-channel ring all-reduce of `bytes` over 16 GPUs on four rail-optimised hosts of
/// four: 30 steps, every rank's chain to its successor settles into the same completion
/// time after a few steps.
fn long_ring(bytes: u64) -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    add_ring(&mut fs, "ring16", &(0..16).collect::<Vec<u32>>(), bytes);
    (four_gpu_hosts(4), fs)
}

/// The run went periodic once and stayed so: no abort, and most of its flows virtual.
fn assert_periodic_throughout(on: &PacketRun, fs: &FlowSet) {
    assert_eq!(on.stats.periodic_starts, 1, "{:?}", on.stats);
    assert_eq!(on.stats.periodic_aborts, 0, "{:?}", on.stats);
    assert!(
        on.stats.periodic_flows * 2 > fs.flows.len() as u64,
        "{:?}",
        on.stats
    );
}

#[test]
fn a_periodic_ring_is_extrapolated_within_bounds() {
    let (g, fs) = long_ring(4_000_000);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let memo = run(with_memo(base.clone()), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(memo.stats.periodic_flows, 0);
    // Most of the 480 flows are extrapolated, and the run processes a fraction of the
    // events of the reference and of memoization alone.
    assert_periodic_throughout(&on, &fs);
    assert!(on.report.events * 3 < off.report.events, "{:?}", on.stats);
    assert!(on.report.events * 2 < memo.report.events, "{:?}", on.stats);
    assert!(on.stats.periodic_skipped_events > 0);
    check_bounds(&base, &off, &on, &fs, "periodic ring");
    // Same input, same output.
    let again = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(again.report, on.report);
}

/// A one-channel ring all-reduce of 32 MB over the first GPU of each of eight hosts of
/// four, in two pods of four hosts with four spines (each leaf's uplinks as fast as its
/// hosts' NICs), and ECN marking from 100 KB at 400 Gb/s (an eighth of the default
/// thresholds). The ring's two hops between pods take longer than the others, so its
/// steps fall out of line and a step's flows are still starting when the ring goes
/// periodic.
fn rail_ring_across_pods() -> (NetGraph, FlowSet, PacketConfig) {
    let mut fs = FlowSet::default();
    let ranks: Vec<u32> = (0..8).map(|h| h * 4).collect();
    add_ring(&mut fs, "rail ring", &ranks, 32_000_000);
    let spec = RailOptimizedSpec {
        gpus_per_host: 4,
        hosts_per_pod: 4,
        spines: 4,
        ..RailOptimizedSpec::dgx_h100(8)
    };
    let mut base = PacketConfig::reference();
    for point in &mut base.ecn {
        point.kmin /= 8;
        point.kmax /= 8;
    }
    (NetGraph::rail_optimized(&spec).unwrap(), fs, base)
}

#[test]
fn a_flow_in_progress_when_its_ring_goes_periodic_keeps_its_lanes_pace() {
    // When the ring goes periodic, the flows still running lose the ACKs of their
    // neighbours' flows, which are now virtual. A flow's sender then had its port to
    // itself and sent faster than its lane had, into a receiver whose port still carried
    // a running flow's ACKs: the queue there passed the marking threshold, DCQCN cut the
    // flow, it finished late, its lane stopped being steady and its next flow, simulated
    // among virtual ones, ended the extrapolation (2.4% late at the end, 42% at p99,
    // 31 ECN marks where the reference has none). Held to its lane's pace it ends in time.
    let (g, fs, base) = rail_ring_across_pods();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(off.stats.ecn_marks, 0, "{:?}", off.stats);
    assert_eq!(on.stats.ecn_marks, 0, "{:?}", on.stats);
    assert_periodic_throughout(&on, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "rail ring across pods");
    assert!(e.end < 0.001 && e.p99_fct < 0.01, "{e:?}");
}

/// The ring of [`long_ring`] (on a fabric with a fifth host, idle) and a 20 MB flow from
/// rank 3 to its successor on the path of the ring's chain between them, released in the
/// middle of that chain's first flow to end after 80% of the ring's reference length: by
/// a transfer inside the fifth host that finishes then (`announced` false: its release is
/// scheduled only then), or with that delay and no dependency (true: scheduled from the
/// start).
fn ring_and_late_flow(announced: bool) -> (NetGraph, FlowSet) {
    ring_and_flow_at(announced, (4, 5), 20_000_000)
}

/// Adds a collective of its own (a lone transfer's) to `fs` and returns its number.
fn own_collective(fs: &mut FlowSet, name: &str, ranks: Vec<u32>) -> u32 {
    fs.collectives.push(CollectiveInfo {
        name: name.to_string(),
        kind: None,
        ranks,
        bytes: Bytes(0),
    });
    fs.collectives.len() as u32 - 1
}

/// Adds a 1 MB transfer from GPU 16 to GPU 17 (inside the fifth host of
/// [`four_gpu_hosts`], on no link of the rings there, so its completion is the same in
/// every run) that finishes at `at`, and returns it: a dependency that releases an
/// intruder nobody announced before then.
fn push_probe_finishing_at(fs: &mut FlowSet, g: &NetGraph, at: Picos) -> FlowId {
    let mut probe = flow(16, 17, 1_000_000);
    let alone = run(PacketConfig::reference(), g, &flow_set(vec![probe.clone()]));
    probe.delay = Picos(at.0 - alone.report.flows[0].fct().0);
    probe.collective = own_collective(fs, "probe", vec![16, 17]);
    fs.flows.push(probe);
    FlowId(fs.flows.len() as u32 - 1)
}

/// [`ring_and_late_flow`] with the intruder of `bytes` released in the middle of the
/// chain's first flow to end after `at.0 / at.1` of the ring's reference length.
fn ring_and_flow_at(announced: bool, at: (u64, u64), bytes: u64) -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    add_ring(&mut fs, "ring16", &(0..16).collect::<Vec<u32>>(), 4_000_000);
    let g = four_gpu_hosts(5);
    let plain = run(PacketConfig::reference(), &g, &fs);
    let times = &plain.report.flows;
    let chain = (0..fs.flows.len())
        .filter(|&f| fs.flows[f].src == 3)
        .filter(|&f| times[f].finish.0 >= plain.report.end.0 / at.1 * at.0)
        .min_by_key(|&f| times[f].start)
        .unwrap();
    let middle = (times[chain].start.0 + times[chain].finish.0) / 2;
    let next = fs.flows[chain].dst;
    let mut late = flow(3, next, bytes);
    late.collective = own_collective(&mut fs, "late", vec![3, next]);
    if announced {
        late.delay = Picos(middle);
    } else {
        late.deps = vec![push_probe_finishing_at(&mut fs, &g, Picos(middle))].into();
    }
    fs.flows.push(late);
    (g, fs)
}

/// The late flow's FCT error against the reference.
fn late_flow_error(off: &PacketRun, on: &PacketRun) -> f64 {
    let last = off.report.flows.len() - 1;
    let fct = |r: &PacketRun| r.report.flows[last].fct().0;
    fct(on).abs_diff(fct(off)) as f64 / fct(off) as f64
}

#[test]
fn a_flow_intruding_on_a_periodic_ring_ends_the_extrapolation_within_bounds() {
    // Released while the ring is periodic, the late flow shares the chain's path for
    // several steps: the ring's next flows are simulated against it until its chains
    // settle again.
    let (g, fs) = ring_and_late_flow(false);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    assert!(on.stats.periodic_starts >= 1, "{:?}", on.stats);
    assert_eq!(on.stats.periodic_aborts, 1, "{:?}", on.stats);
    check_bounds(&base, &off, &on, &fs, "intruded periodic ring");
    // The intruder itself is simulated against the ring's packets, and the virtual flow
    // in progress on its path is simulated from its release on.
    assert!(on.stats.periodic_met >= 1, "{:?}", on.stats);
    let err = late_flow_error(&off, &on);
    assert!(err < 0.005, "intruder FCT error {err}");
}

#[test]
fn a_small_intruder_meets_the_virtual_flows_in_progress_on_its_links() {
    // 1 MB released a quarter into the ring and 2 MB two fifths in: the virtual flow in
    // progress on the intruder's path is simulated from the intrusion on, so the two share
    // the link as in the reference. Kept virtual (the rule before), it let the intruder
    // run alone past it: 4.7% and 2.5% early, the 1 MB transfer's completion 1.6% off and
    // the ring's end 0.56%.
    let cases = [((1, 4), 1_000_000), ((2, 5), 2_000_000)];
    let ring_and = |at, bytes| ring_and_flow_at(false, at, bytes);
    for on in intruders_within(&cases, ring_and, 0.005) {
        assert!(on.stats.periodic_met >= 1, "{:?}", on.stats);
    }
}

/// For each case (where, bytes) of an intruder built by `scenario`: one intrusion within
/// the bounds ([`intruded_once`]) and the intruder, the scenario's last flow, within
/// `bound` of the reference. Returns the accelerated runs.
fn intruders_within(
    cases: &[((u64, u64), u64)],
    scenario: impl Fn((u64, u64), u64) -> (NetGraph, FlowSet),
    bound: f64,
) -> Vec<PacketRun> {
    let mut runs = Vec::new();
    for &(at, bytes) in cases {
        let (g, fs) = scenario(at, bytes);
        let name = format!("{bytes} B intruding at {at:?}");
        let (off, on) = intruded_once(&g, &fs, &name);
        let err = late_flow_error(&off, &on);
        assert!(err < bound, "{name}: intruder FCT error {err}");
        runs.push(on);
    }
    runs
}

/// Runs `fs` packet by packet and with periodic extrapolation, and checks that the
/// extrapolation started and was ended by one intrusion, within the issue's bounds and
/// the end within 0.1%.
fn intruded_once(g: &NetGraph, fs: &FlowSet, name: &str) -> (PacketRun, PacketRun) {
    let base = PacketConfig::reference();
    let off = run(base.clone(), g, fs);
    let on = run(with_periodic(base.clone()), g, fs);
    assert!(on.stats.periodic_starts >= 1, "{name}: {:?}", on.stats);
    assert_eq!(on.stats.periodic_aborts, 1, "{name}: {:?}", on.stats);
    let e = check_bounds(&base, &off, &on, fs, name);
    assert!(e.end < 0.001, "{name}: {e:?}");
    (off, on)
}

#[test]
fn a_second_ring_released_onto_a_periodic_ring_meets_its_flows_in_progress() {
    // The next bucket of a data-parallel group: a second ring all-reduce on the same ranks,
    // released halfway through the first (by a transfer elsewhere, so unannounced) while
    // the first is periodic. Its first step lands on every link of the first ring; the
    // virtual flows in progress there are simulated from that instant. Kept virtual (the
    // rule before), they let the second ring's first step run alone: 39% p99 per-flow
    // error, 1.2% mean, the end 1.0% early.
    let (g, fs) = ring_then((1, 4_000_000), (1, 2), 4_000_000, true);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(on.stats.periodic_aborts, 1, "{:?}", on.stats);
    // The first ring's flows in progress, each on the path of the second ring's first
    // step (at most one per rank).
    assert!((1..=16).contains(&on.stats.periodic_met), "{:?}", on.stats);
    let e = check_bounds(&base, &off, &on, &fs, "second ring");
    assert!(e.p99_fct < 0.001 && e.end < 0.001, "{e:?}");
}

#[test]
fn a_release_scheduled_onto_a_rings_links_meets_it_once_periodic() {
    // The late flow's release is known from the start. The ring goes periodic all the
    // same (it used to wait, when the virtual flows in progress did not meet an intruder),
    // and the flow, when it comes, meets the virtual flow in progress on its path and ends
    // the extrapolation as an unannounced one does.
    let (g, fs) = ring_and_late_flow(true);
    let (off, on) = intruded_once(&g, &fs, "announced intruder");
    assert!(on.stats.periodic_met >= 1, "{:?}", on.stats);
    assert!(on.stats.periodic_flows > 0, "{:?}", on.stats);
    let e = errors(&off, &on, &fs);
    assert!(e.collective < 0.001, "{e:?}");
    let err = late_flow_error(&off, &on);
    assert!(err < 0.005, "intruder FCT error {err}");
}

/// The ring of [`long_ring`] alone, and with, announced from the start, a 20 MB flow
/// from rank 3 to its successor (on the path of one of the ring's chains) released half
/// the ring's reference length after the ring's reference end: the next collective of a
/// data-parallel group, released at a time the predictor fixed.
fn ring_and_next_transfer() -> (NetGraph, FlowSet, FlowSet) {
    let (g, alone) = long_ring(4_000_000);
    let end = run(PacketConfig::reference(), &g, &alone).report.end;
    let mut fs = alone.clone();
    fs.collectives.push(CollectiveInfo {
        name: "next".to_string(),
        kind: None,
        ranks: vec![3, 4],
        bytes: Bytes(0),
    });
    let mut next = flow(3, 4, 20_000_000);
    next.collective = fs.collectives.len() as u32 - 1;
    next.delay = Picos(end.0 + end.0 / 2);
    fs.flows.push(next);
    (g, alone, fs)
}

#[test]
fn a_release_scheduled_after_a_rings_end_does_not_hold_it_back() {
    // Due half the ring's length after its end, the next transfer finds the ring's links
    // free whether the ring is simulated or extrapolated: the ring goes periodic as it
    // does alone and is never intruded on. (When a scheduled release held a collective
    // back, one due after it ended still did until the check looked at when it was due:
    // on the GPT 350M step at 1,024 GPUs, 31 identical reduce-scatter steps were simulated
    // one by one because of the next bucket, due 0.67 ms after their end.)
    let (g, alone, fs) = ring_and_next_transfer();
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    let ring_only = run(with_periodic(base.clone()), &g, &alone);
    assert_eq!(on.stats.periodic_starts, 1, "{:?}", on.stats);
    assert_eq!(on.stats.periodic_aborts, 0, "{:?}", on.stats);
    assert_eq!(
        on.stats.periodic_flows, ring_only.stats.periodic_flows,
        "as many virtual flows as without the next transfer"
    );
    check_bounds(&base, &off, &on, &fs, "ring, then a scheduled transfer");
    assert!(late_flow_error(&off, &on) < 0.001);
}

/// A hierarchical all-gather of `bytes` over 12 rail-optimised hosts of four GPUs: each
/// rail's ring across the hosts (11 steps, 48 lanes), then a ring inside each host
/// (3 steps, 48 more lanes, on NVLink).
fn hierarchical_all_gather(bytes: u64) -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    collective_flows(
        &mut fs,
        "all-gather",
        CollectiveKind::AllGather,
        FlowAlgorithm::Hierarchical,
        &(0..48).collect::<Vec<u32>>(),
        Bytes(bytes),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
    (four_gpu_hosts(12), fs)
}

#[test]
fn a_collective_goes_periodic_on_its_started_lanes_before_its_later_phase_starts() {
    // The lanes of the host phase have no flow released while the rails' rings run, so
    // they have nothing to learn yet; they do not hold the rings back (before, a
    // collective waited for every lane with flows left, and this one never went
    // periodic).
    let (g, fs) = hierarchical_all_gather(24_000_000);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(on.stats.periodic_starts, 1, "{:?}", on.stats);
    assert_eq!(on.stats.periodic_aborts, 0, "{:?}", on.stats);
    let across = fs.flows.iter().filter(|f| f.src / 4 != f.dst / 4).count() as u64;
    assert_eq!(across, 48 * 11);
    // Five steps learned, the rest of the eleven extrapolated, on every rail.
    assert!(on.stats.periodic_flows * 3 > across, "{:?}", on.stats);
    check_bounds(&base, &off, &on, &fs, "hierarchical all-gather");
}

/// Sixteen one-GPU hosts with NICs of `nic_gbps`, in two pods of eight under four spines,
/// paths pinned.
fn two_pods(nic_gbps: f64) -> NetGraph {
    let spec = RailOptimizedSpec {
        gpus_per_host: 1,
        nic: gbps(nic_gbps),
        hosts_per_pod: 8,
        spines: 4,
        ..RailOptimizedSpec::dgx_h100(16)
    };
    NetGraph::rail_optimized(&spec)
        .unwrap()
        .with_routing(Routing::Pinned)
}

/// A one-channel 16 MB ring all-reduce over 16 hosts of one GPU at 100 Gb/s in two pods
/// of eight, paths pinned: the two hops between the pods take longer than the others, and
/// the delay each adds travels round the ring one rank per step, moving every lane's
/// period by a few percent once as it passes (30 steps per lane).
fn two_pod_ring() -> (NetGraph, FlowSet) {
    two_pod_ring_of(16_000_000)
}

/// [`two_pod_ring`] with a buffer of `bytes` (flows of a sixteenth of it).
fn two_pod_ring_of(bytes: u64) -> (NetGraph, FlowSet) {
    let g = two_pods(100.0);
    let mut fs = FlowSet::default();
    collective_flows(
        &mut fs,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 1 },
        &(0..16).collect::<Vec<u32>>(),
        Bytes(bytes),
        1,
        Picos::from_nanos(2000),
    )
    .unwrap();
    (g, fs)
}

#[test]
fn a_ring_across_two_pods_goes_periodic_while_the_pods_delay_travels_round_it() {
    let (g, fs) = two_pod_ring();
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    check_bounds(&base, &off, &on, &fs, "ring across two pods");
    assert_eq!(on.stats.periodic_starts, 1, "{:?}", on.stats);
    // Every lane of a one-channel ring has its data path to itself, so by default no
    // lane's period is bounded. Bounded as lanes that share their paths are, under the
    // completion times' own 1% every lane waits for the delay to pass (19 of its 30 flows
    // virtual, 304 in all); under the default 5% the ring goes periodic after its first
    // window.
    let bounded = |gap_theta: f64| {
        let mut c = with_periodic(base.clone());
        c.accel.period_gap_theta = gap_theta;
        c.accel.period_own_paths = false;
        c
    };
    let loose = run(bounded(0.05), &g, &fs);
    check_bounds(&base, &off, &loose, &fs, "ring across two pods, 5% period");
    let held = run(bounded(0.01), &g, &fs);
    check_bounds(&base, &off, &held, &fs, "ring across two pods, 1% period");
    extrapolates_more("own paths", &on, &held);
    extrapolates_more("5% period", &loose, &held);
    assert!(on.stats.periodic_flows >= loose.stats.periodic_flows);
}

/// `more` made at least four steps of each of the 16-rank ring's lanes virtual beyond
/// what `fewer` did, and took under two thirds of its events.
fn extrapolates_more(name: &str, more: &PacketRun, fewer: &PacketRun) {
    assert!(
        more.stats.periodic_flows >= fewer.stats.periodic_flows + 4 * 16,
        "{name}: {} vs {}",
        more.stats.periodic_flows,
        fewer.stats.periodic_flows
    );
    assert!(
        more.report.events * 3 < fewer.report.events * 2,
        "{name}: {} vs {}",
        more.report.events,
        fewer.report.events
    );
}

#[test]
fn lanes_on_their_own_paths_go_periodic_before_the_pods_delay_has_gone_round() {
    // With 250 KB steps the delay the pod crossings add is a larger part of the period
    // than 5%, so lanes held to that bound wait for it to go round (304 virtual flows);
    // a one-channel ring's lanes have their data paths to themselves and are not held
    // (388, about half the events). Both within the bounds; measured 0.29% mean and
    // 0.74% p99 per-flow error unbounded, 0.010% and 0.054% under 5%.
    let (g, fs) = two_pod_ring_of(4_000_000);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    check_bounds(&base, &off, &on, &fs, "250 KB ring, own paths");
    let mut bounded = with_periodic(base.clone());
    bounded.accel.period_own_paths = false;
    let loose = run(bounded, &g, &fs);
    check_bounds(&base, &off, &loose, &fs, "250 KB ring, 5% period");
    extrapolates_more("250 KB ring", &on, &loose);
}

#[test]
fn traffic_without_chains_is_never_extrapolated() {
    for (name, (g, fs)) in [
        ("short flows", short_flows()),
        ("incast burst", incast_burst()),
        (
            "all-to-all rounds",
            repeated_all_to_all(4, 1_000_000, us(30)),
        ),
    ] {
        let on = run(PacketConfig::default(), &g, &fs);
        assert_eq!(on.stats.periodic_starts, 0, "{name}: {:?}", on.stats);
        assert_eq!(on.stats.periodic_flows, 0, "{name}");
    }
}

#[test]
fn a_short_two_channel_ring_goes_periodic_within_bounds() {
    // Two channels of an 8-rank ring share every link and drift against each other, so
    // the lanes settle late and the flows still simulated at the switch lose half their
    // contention. Without holding those flows to their lane's periodic completion time
    // this scenario had a 5.3% p99 flow error; with it, it stays well inside the bounds.
    let mut fs = FlowSet::default();
    collective_flows(
        &mut fs,
        "ring8x2",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 2 },
        &(0..8).collect::<Vec<u32>>(),
        Bytes(32_000_000),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
    let g = four_gpu_hosts(2);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(on.stats.periodic_starts, 1, "{:?}", on.stats);
    assert!(on.stats.periodic_flows > 50, "{:?}", on.stats);
    let e = check_bounds(&base, &off, &on, &fs, "two-channel ring");
    assert!(e.p99_fct < 0.01, "{e:?}");
}

/// Two ring all-reduces of 32 MB on the same 16 GPUs (four hosts), in different rank
/// orders, so their episodes keep intruding on each other's memo hits.
fn two_rings_on_the_same_gpus() -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    let a: Vec<u32> = (0..16).collect();
    let b: Vec<u32> = (0..16).map(|i| (i * 5) % 16).collect();
    for (name, ranks) in [("a", &a), ("b", &b)] {
        collective_flows(
            &mut fs,
            name,
            CollectiveKind::AllReduce,
            FlowAlgorithm::Ring { channels: 2 },
            ranks,
            Bytes(32_000_000),
            4,
            Picos::from_nanos(2000),
        )
        .unwrap();
    }
    (four_gpu_hosts(4), fs)
}

/// Two ring all-reduces over the same 16 GPUs in different rank orders, two channels each,
/// released together. Each ring's steps keep intruding on the other's memoized episodes,
/// so this is a stress test of rolling back aborted hits. Before hits were rolled back by
/// replaying their episode, an aborted hit resumed its flows from linear progress with
/// empty queues and this run ended 1.9% off in mean flow completion time and 31% at p99.
#[test]
fn two_rings_on_the_same_gpus_stay_within_bounds() {
    let (g, fs) = two_rings_on_the_same_gpus();
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(PacketConfig::default(), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "two rings on the same GPUs");
    assert!(on.stats.memo_aborts >= 10, "{:?}", on.stats);
    assert!(on.stats.memo_replayed_events > 0, "{:?}", on.stats);
    // Replays draw from their own seeded streams: a second run is identical.
    assert!(
        run(PacketConfig::default(), &g, &fs) == on,
        "rollbacks are deterministic"
    );
    // The replays make the rollbacks exact up to ECN's random draws and the switch
    // buffers' background, which this run does not exercise.
    assert!(e.mean_fct < 1e-4 && e.p99_fct < 1e-3, "{e:?}");
}

/// An episode of two flows released together, `p` (short, GPU 0 to GPU 4) and `q` (long,
/// GPU 1 to GPU 4 across the rails, so it shares `p`'s last link), and after `p` three equal
/// transfers from GPU 0 to GPU 8, each a collective of its own that waits for the previous
/// one: the next collectives of a rank, released on links of the episode they wait for
/// (GPU 0's, which `p` used) while that episode still runs elsewhere (`q`).
fn chained_after_a_live_episode() -> (NetGraph, FlowSet) {
    let g = four_gpu_hosts(3);
    let info = |name: &str, ranks: Vec<u32>| CollectiveInfo {
        name: name.to_string(),
        kind: None,
        ranks,
        bytes: Bytes(0),
    };
    let mut fs = FlowSet {
        flows: vec![flow(0, 4, 200_000), flow(1, 4, 20_000_000)],
        collectives: vec![info("p and q", vec![0, 1, 4])],
    };
    let mut prev = 0u32;
    for k in 0..3u32 {
        fs.collectives.push(info(&format!("k{k}"), vec![0, 8]));
        let mut f = flow(0, 8, 1_000_000);
        f.deps = vec![FlowId(prev)].into();
        f.delay = us(10);
        f.collective = k + 1;
        prev = fs.flows.len() as u32;
        fs.flows.push(f);
    }
    (g, fs)
}

#[test]
fn a_collective_after_another_starts_its_own_episode_and_repeats_hit() {
    // The transfers wait for a flow of another collective's episode that is still running
    // (its long flow). Joining it would make one episode of everything, never stored
    // while it runs; each starts its own on idle links instead, so the first is recorded
    // and the other two are answered from the cache, exactly.
    let (g, fs) = chained_after_a_live_episode();
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_memo(base.clone()), &g, &fs);
    let e = check_bounds(&base, &off, &on, &fs, "chained after a live episode");
    assert_eq!((e.mean_fct, e.end), (0.0, 0.0), "{e:?}");
    // The transfers ran while `q` did.
    assert!(off.report.flows[4].finish < off.report.flows[1].finish);
    assert_eq!(on.stats.memo_hits, 2, "{:?}", on.stats);
    assert!(on.flow_events[3] == 0 && on.flow_events[4] == 0);
}

// ---- Symmetry reduction ----------------------------------------------------------------

fn with_symmetry(mut c: PacketConfig) -> PacketConfig {
    c.accel.symmetry = true;
    c
}

/// Checks a run `on` reduced by symmetry against its reference `off`: within the bounds,
/// `copies` copies of each simulated flow, at least `ratio` times fewer events, and the end
/// and every collective's completion exact.
fn assert_reduced(
    off: &PacketRun,
    on: &PacketRun,
    fs: &FlowSet,
    copies: u64,
    ratio: u64,
    name: &str,
) {
    let e = check_bounds(&PacketConfig::reference(), off, on, fs, name);
    assert_eq!(on.stats.symmetry_order, copies, "{name}");
    // The rotations found, level by level, give those copies.
    let product: u64 = on.symmetry.iter().map(|s| u64::from(s.copies())).product();
    assert_eq!(product, copies, "{name}: {:?}", on.symmetry);
    assert_eq!(
        copies * on.stats.symmetry_flows,
        fs.flows.len() as u64,
        "{name}"
    );
    assert!(
        ratio * on.report.events <= off.report.events,
        "{name}: {}",
        on.report.events
    );
    assert_eq!(e.end, 0.0, "{name}");
    assert_eq!(e.collective, 0.0, "{name}");
}

/// A ring all-reduce of `bytes` over every GPU of `hosts` rail-optimised hosts of four, on
/// `channels` channels (each host enters and leaves its part of a channel's ring through
/// other GPUs, so a host shift maps channels onto channels).
fn ring_over_hosts(hosts: usize, channels: u32, bytes: u64) -> (NetGraph, FlowSet) {
    let mut fs = FlowSet::default();
    collective_flows(
        &mut fs,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels },
        &(0..4 * hosts as u32).collect::<Vec<u32>>(),
        Bytes(bytes),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
    (four_gpu_hosts(hosts), fs)
}

#[test]
fn a_ring_over_alike_hosts_is_simulated_once_per_host_within_bounds() {
    // The ring, and on every host a transfer from GPU 0 to GPU 2 beside it: the hosts are
    // alike, the GPUs of a host are not.
    let (g, mut fs) = ring_over_hosts(4, 4, 4_000_000);
    for h in 0..4 {
        fs.flows.push(flow(4 * h, 4 * h + 2, 1_000_000));
    }
    let trace = TraceRequest {
        interval: us(2),
        ports: Vec::new(),
        flows: true,
    };
    let sim = |c| PacketSimulator::new(c).run(&g, &fs, &trace).unwrap();
    let off = sim(PacketConfig::reference());
    let on = sim(with_symmetry(PacketConfig::reference()));
    // Four hosts alike: one host's worth of flows simulated, a quarter of the events.
    assert_reduced(&off, &on, &fs, 4, 4, "symmetric ring");
    // The flows simulated, those sent from the first host, are the reference's to the
    // picosecond, and so are their delivered bytes at every trace sample. The rest are
    // copies of them, and they are the reference's too: queue pairs that join a port
    // together are served in an order the host shift keeps (tie keys), so the reference
    // is as symmetric as its traffic.
    let first_host: Vec<usize> = (0..fs.flows.len())
        .filter(|&f| fs.flows[f].src < 4)
        .collect();
    assert_eq!(first_host.len() as u64, on.stats.symmetry_flows);
    assert_eq!(on.report.flows, off.report.flows);
    assert_eq!(on.samples.len(), off.samples.len());
    for (a, b) in on.samples.iter().zip(&off.samples) {
        assert_eq!(a.delivered.len(), fs.flows.len());
        for &f in &first_host {
            assert_eq!(a.delivered[f], b.delivered[f], "flow {f} at {:?}", a.time);
        }
    }
    assert_eq!(on.report.bytes_delivered, off.report.bytes_delivered);
    assert_eq!(on.stats.acks, off.stats.acks);
}

#[test]
fn a_ring_over_alike_hosts_and_gpus_is_simulated_once_per_gpu_within_bounds() {
    // Shifting the hosts, then the GPUs of every host (with the channels), maps the ring
    // onto itself: one GPU's flows are simulated, on one GPU's links.
    let (g, fs) = ring_over_hosts(4, 4, 4_000_000);
    let off = run(PacketConfig::reference(), &g, &fs);
    let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
    assert_reduced(&off, &on, &fs, 16, 10, "ring, hosts and GPUs");
    // Every flow is the reference's to the picosecond (no ECN marks to draw here).
    assert_eq!(on.report.flows, off.report.flows);
    // Progress is reported against every flow, the quotient's scaled to the whole set (a
    // longer ring, so that the quotient's run reports some).
    let (long_g, long_fs) = ring_over_hosts(4, 4, 16_000_000);
    let mut reports = Vec::new();
    let long = PacketSimulator::new(with_symmetry(PacketConfig::reference()))
        .run_with_progress(&long_g, &long_fs, &TraceRequest::default(), &mut |p| {
            reports.push(p)
        })
        .unwrap();
    let total = long_fs.flows.len();
    assert!(reports
        .iter()
        .all(|p| p.flows_total == total && p.flows_done <= total));
    let most = reports.iter().map(|p| p.flows_done).max().unwrap_or(0);
    assert!(
        most as u64 > long.stats.symmetry_flows,
        "{most} of {total}: {reports:?}"
    );
    // The same with every other mechanism on.
    let all = run(PacketConfig::default(), &g, &fs);
    check_bounds(
        &PacketConfig::reference(),
        &off,
        &all,
        &fs,
        "ring, every mechanism",
    );
    assert_eq!(all.stats.symmetry_order, 16);
}

#[test]
fn a_ring_over_every_other_gpu_is_folded_by_a_strided_shift() {
    // Ranks on GPUs 0 and 2 of four hosts of four, as a data-parallel group takes every
    // other GPU when tensor ranks are interleaved: after the host shift, moving each GPU
    // two places on within its host (0 to 2 to 0, 1 to 3 to 1) maps the ring onto itself.
    let ranks: Vec<u32> = (0..4).flat_map(|h| [4 * h, 4 * h + 2]).collect();
    let mut fs = FlowSet::default();
    collective_flows(
        &mut fs,
        "ring",
        CollectiveKind::AllReduce,
        FlowAlgorithm::Ring { channels: 2 },
        &ranks,
        Bytes(4_000_000),
        4,
        Picos::from_nanos(2000),
    )
    .unwrap();
    let g = four_gpu_hosts(4);
    let off = run(PacketConfig::reference(), &g, &fs);
    let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
    assert_reduced(&off, &on, &fs, 8, 6, "ring over every other GPU");
}

#[test]
fn the_reference_does_not_depend_on_how_its_flows_are_numbered() {
    // Four ring channels over four hosts: every GPU's first sends of the channels join its
    // ports at one picosecond, and which goes first decides single flows.
    let (g, fs) = ring_over_hosts(4, 4, 1_000_000);
    let deps = |i: usize| fs.flows[i].deps.iter().map(|d| d.index()).collect();
    // The highest-numbered ready flow first: every channel's flows change places.
    let old_of = dependency_order(fs.flows.len(), deps, true).unwrap();
    assert_ne!(old_of, (0..fs.flows.len()).collect::<Vec<_>>());
    assert_renumbering_changes_nothing(&PacketConfig::reference(), &g, &fs, &old_of);
}

/// Runs `fs` and `fs` renumbered by `old_of` (new flow `k` is old flow `old_of[k]`) under
/// `cfg`, checks that every flow starts and finishes at the same picosecond and the runs
/// process the same events, and returns the run on the original numbering.
fn assert_renumbering_changes_nothing(
    cfg: &PacketConfig,
    g: &NetGraph,
    fs: &FlowSet,
    old_of: &[usize],
) -> PacketRun {
    let a = run(cfg.clone(), g, fs);
    let b = run(cfg.clone(), g, &fs.reordered(old_of));
    for (k, &i) in old_of.iter().enumerate() {
        assert_eq!(
            a.report.flows[i], b.report.flows[k],
            "flow {i} (renumbered {k})"
        );
    }
    assert_eq!(a.report.events, b.report.events);
    a
}

#[test]
fn an_incast_does_not_depend_on_how_its_flows_are_numbered() {
    // GPU 0 of hosts 1 to 5 sends to GPU 0 of host 0 at once: their frames reach the rail
    // leaf's port to host 0 in the same picoseconds, and the order those arrivals are
    // handled in decides who queues first. Without DCQCN, so that no ECN marking draw,
    // keyed by flow number, tells the two numberings apart; PFC holds the senders back.
    let g = four_gpu_hosts(6);
    let fs = flow_set((1..6u32).map(|h| flow(4 * h, 0, 2_000_000)).collect());
    let reversed: Vec<usize> = (0..fs.flows.len()).rev().collect();
    let mut cfg = PacketConfig::reference();
    cfg.dcqcn = false;
    let a = assert_renumbering_changes_nothing(&cfg, &g, &fs, &reversed);
    assert!(
        a.stats.peak_switch_bytes > 100_000,
        "the queue builds: {:?}",
        a.stats
    );
    let finish: Vec<_> = a.report.flows.iter().map(|f| f.finish).collect();
    assert!(
        finish.iter().any(|&t| t != finish[0]),
        "some flow wins a tie"
    );
}

/// The ring of [`ring_over_hosts`] with one more flow inside the first host.
#[test]
fn one_flow_out_of_step_leaves_the_run_unreduced_and_unchanged() {
    let (g, mut fs) = ring_over_hosts(4, 4, 1_000_000);
    fs.flows.push(flow(0, 2, 100_000));
    let off = run(PacketConfig::reference(), &g, &fs);
    let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
    assert_eq!(on.stats.symmetry_order, 0);
    assert_eq!(on, off);
}

/// GPU 0 of every host sends 1 MB to GPU 0 of the next host, on four hosts of four GPUs,
/// each host a pod of its own (its own rail leaves), and `spines` spines between the pods.
fn next_pod_flows(spines: usize) -> (NetGraph, FlowSet) {
    let spec = RailOptimizedSpec {
        gpus_per_host: 4,
        hosts_per_pod: 1,
        spines,
        ..RailOptimizedSpec::dgx_h100(4)
    };
    let g = NetGraph::rail_optimized(&spec).unwrap();
    let fs = flow_set(
        (0..4u32)
            .map(|h| flow(4 * h, 4 * ((h + 1) % 4), 1_000_000))
            .collect(),
    );
    (g, fs)
}

#[test]
fn traffic_whose_routes_do_not_shift_with_the_hosts_is_not_reduced() {
    // One spine: every route is the shift of the others.
    let (g, fs) = next_pod_flows(1);
    let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
    assert_eq!(on.stats.symmetry_order, 4);
    // Four spines: each flow's ECMP hash picks its spine, and the hashes do not shift with
    // the hosts, though the fabric and the flows do.
    let (g, fs) = next_pod_flows(4);
    let off = run(PacketConfig::reference(), &g, &fs);
    let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
    assert_eq!(on.stats.symmetry_order, 0);
    assert_eq!(on, off);
}

#[test]
fn pinned_paths_fold_by_a_host_shift_that_moves_every_path_to_the_next_spine() {
    // Two pods of four hosts of two GPUs, two spines with two cables from each leaf: a
    // pinned path up from a leaf takes the cable numbered by its destination's place on
    // its leaf (spine `place / 2`, cable `place % 2`). Every GPU pairs with the same GPU
    // of the same host of the other pod. Swapping the pods keeps every path's spine and
    // cable, as does the shift of the GPUs; swapping neighbouring hosts moves every path
    // to the other cable to its spine, and moving every host two places on in its pod
    // moves it to the other spine. The fabric's shape alone says neither (both spines
    // see every leaf alike, both cables join the same two switches): the symmetry search
    // reads them from the routes.
    let spec = RailOptimizedSpec {
        gpus_per_host: 2,
        hosts_per_pod: 4,
        spines: 2,
        ..RailOptimizedSpec::dgx_h100(8)
    };
    let g = NetGraph::rail_optimized(&spec)
        .unwrap()
        .with_routing(Routing::Pinned);
    let mut fs = FlowSet::default();
    for a in 0..8u32 {
        add_ring(&mut fs, &format!("pair {a}"), &[a, a + 8], 2_000_000);
    }
    let off = run(PacketConfig::reference(), &g, &fs);
    let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
    // Neighbouring hosts, pods, hosts two places on, GPUs: two copies each.
    assert_reduced(&off, &on, &fs, 16, 12, "cross-pod pairs, pinned");
    let shift = |across_hosts, block, stride| SymmetryShift {
        across_hosts,
        block,
        stride,
    };
    assert_eq!(
        on.symmetry,
        [
            shift(true, 2, 1),
            shift(true, 8, 4),
            shift(true, 4, 2),
            shift(false, 2, 1)
        ]
    );
    assert_eq!(
        on.symmetry[2].to_string(),
        "hosts 2 places on in blocks of 4 (x2)"
    );
    assert_eq!(off.stats.ecn_marks, 0);
}

#[test]
fn pinned_paths_on_fat_trees_fold_as_far_as_their_cables_allow() {
    // Eight hosts of two GPUs, two per leaf, every GPU paired with its counterpart four
    // hosts on, over a 2-tier tree (two spines) and a 3-tier one (pods of two leaves, two
    // aggregation switches each, four cores in two planes). On two tiers the hosts
    // shift and the GPUs swap; on three, the hosts of a leaf share its uplinks to each
    // aggregation switch (a path's digit there is its GPU), so only the pods swap and the
    // GPUs do. The GPU swap there moves each core to the other plane, which the quotient's
    // routes, folded onto one pod, show for the pod they pass only: the other pod's
    // aggregation switches follow from the cores (`complete_hints`).
    for (tiers, copies) in [(2u8, 8u64), (3, 4)] {
        let spec = FatTreeSpec {
            gpus_per_host: 2,
            hosts_per_leaf: 2,
            spines: 2,
            leaves_per_pod: 2,
            cores: 4,
            tiers,
            ..FatTreeSpec::two_tier(8)
        };
        let g = NetGraph::fat_tree(&spec)
            .unwrap()
            .with_routing(Routing::Pinned);
        let mut fs = FlowSet::default();
        for a in 0..8u32 {
            add_ring(&mut fs, &format!("pair {a}"), &[a, a + 8], 2_000_000);
        }
        let off = run(PacketConfig::reference(), &g, &fs);
        let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
        let name = format!("pairs across a {tiers}-tier fat-tree, pinned");
        assert_reduced(&off, &on, &fs, copies, copies - 1, &name);
        assert_eq!(off.stats.ecn_marks, 0, "{name}");
    }
}

#[test]
fn a_leaf_that_every_host_shares_counts_every_copy_in_its_buffer() {
    // Four hosts of two GPUs on one leaf; both GPUs of every host send to GPU 0 of the
    // next host: a 2:1 incast at four of the leaf's ports. Without DCQCN the queues grow
    // until PFC pauses them, at a threshold set by the whole leaf's shared pool, which
    // holds all four hosts' queues.
    let spec = FatTreeSpec {
        gpus_per_host: 2,
        spines: 1,
        ..FatTreeSpec::two_tier(4)
    };
    let g = NetGraph::fat_tree(&spec).unwrap();
    let fs = flow_set(
        (0..4u32)
            .flat_map(|h| {
                let to = 2 * ((h + 1) % 4);
                [flow(2 * h, to, 20_000_000), flow(2 * h + 1, to, 20_000_000)]
            })
            .collect(),
    );
    let base = pfc_only();
    let off = run(base.clone(), &g, &fs);
    let on = run(with_symmetry(base.clone()), &g, &fs);
    check_bounds(&base, &off, &on, &fs, "incast on a shared leaf");
    assert_eq!(on.stats.symmetry_order, 4);
    let pauses = |r: &PacketRun| r.report.pfc_pauses.iter().sum::<u64>();
    assert!(pauses(&off) > 0, "the incast must reach PFC");
    // The full leaf's occupancy and pauses, to within the order of same-time events.
    let close = |a: u64, b: u64| (a as f64 - b as f64).abs() <= 0.01 * b as f64;
    let (peak_on, peak_off) = (on.stats.peak_switch_bytes, off.stats.peak_switch_bytes);
    assert!(close(peak_on, peak_off), "{peak_on} against {peak_off}");
    assert!(
        close(pauses(&on), pauses(&off)),
        "{} against {}",
        pauses(&on),
        pauses(&off)
    );
}

#[test]
fn one_packet_flows_that_break_the_shift_are_exempt_and_the_step_stays_within_bounds() {
    let (g, fs) = step_with_a_tree_norm();
    let off = run(PacketConfig::reference(), &g, &fs);
    let mut loose = with_symmetry(PacketConfig::reference());
    loose.accel.symmetry_exempt = true;
    let on = run(loose, &g, &fs);
    let e = check_bounds(&PacketConfig::reference(), &off, &on, &fs, "tree norm");
    // The host shift holds with the norm's flows exempt. The GPU shift holds on the
    // quotient too, but the norm comes down each host's chain one GPU after another, so
    // the all-gather's copies start out of step with each other: that quotient's run is
    // set aside (its events still counted) and the host shift alone is kept.
    assert_eq!(on.stats.symmetry_order, 4, "{:?}", on.stats);
    assert_eq!(on.stats.symmetry_exempt_flows, 60);
    assert!(on.stats.symmetry_late_flows > 0);
    assert!(on.stats.symmetry_retried_events > 0);
    assert!(3 * on.report.events <= off.report.events, "{e:?}");
    // Every flow of the expanded run is released when its dependencies finish, as in any
    // run: the flows after the norm follow their own ranks' norm results, not copies.
    for (o, f) in on.report.flows.iter().zip(&fs.flows) {
        if let Some(ready) = f
            .deps
            .iter()
            .map(|d| on.report.flows[d.index()].finish)
            .max()
        {
            assert_eq!(o.start, ready + f.delay, "{f:?}");
        }
    }
    assert_eq!(on.report.bytes_delivered, off.report.bytes_delivered);
    assert_eq!(on.report.link_bytes, off.report.link_bytes);
    // Strict symmetry finds nothing, and changes nothing.
    let mut strict = with_symmetry(PacketConfig::reference());
    strict.accel.symmetry_exempt = false;
    let strict = run(strict, &g, &fs);
    assert_eq!(strict.stats.symmetry_order, 0);
    assert_eq!(strict, off);
}

/// Dormant port frees (`lazy_port_frees`, at switches and hosts) are exact: on every
/// scenario, reference and accelerated, the run gives the same flows, bytes, pauses and
/// drops as with every free scheduled, and handles fewer events.
#[test]
fn lazy_port_frees_change_nothing_but_the_events() {
    let fast_forward = [
        PacketConfig::reference(),
        accel_on(),
        with_parts(accel_on()),
    ];
    // Memo hits rolled back by replays (which run to the intrusion and are captured) and
    // every mechanism at once.
    let rollbacks = [
        with_memo(PacketConfig::reference()),
        PacketConfig::default(),
    ];
    // Drops, so queue pairs get packets back by NACKs and timeouts while their host
    // port's free may be dormant.
    let lossy = |c: PacketConfig| PacketConfig {
        pfc: false,
        buffer_bytes: 30_000,
        ..c
    };
    let losses = [lossy(PacketConfig::reference()), lossy(accel_on())];
    let scenarios = [
        ("lossy incast", incast_burst(), &losses[..]),
        ("ring", ring_all_reduce(8 << 20), &fast_forward[..]),
        (
            "long and dcqcn incast",
            long_and_dcqcn_incast(),
            &fast_forward,
        ),
        ("incast burst", incast_burst(), &fast_forward),
        ("mid arrival", mid_arrival(), &fast_forward),
        ("joins and merge", joins_and_merge(), &fast_forward),
        ("intruded all-to-all", intruded_all_to_all(), &rollbacks),
        ("two rings", two_rings_on_the_same_gpus(), &rollbacks[1..]),
    ];
    for (name, (g, fs), bases) in &scenarios {
        for base in bases.iter().cloned() {
            assert!(base.lazy_port_frees, "on by default, in the reference too");
            let eager = run(
                PacketConfig {
                    lazy_port_frees: false,
                    ..base.clone()
                },
                g,
                fs,
            );
            let lazy = run(base, g, fs);
            if *name == "lossy incast" {
                assert!(lazy.stats.go_backs > 0 && lazy.stats.timeouts > 0, "{name}");
            }
            let (a, b) = (&eager.report, &lazy.report);
            assert_eq!(a.flows, b.flows, "{name}");
            assert_eq!(a.link_bytes, b.link_bytes, "{name}");
            assert_eq!(a.pfc_pauses, b.pfc_pauses, "{name}");
            assert_eq!(a.drops, b.drops, "{name}");
            assert_eq!(a.bytes_delivered, b.bytes_delivered, "{name}");
            // A free filed late (clamped to now) would be one the lazy run got wrong.
            let clamped = |r: &PacketRun| r.stats.clamped_schedules;
            assert_eq!(clamped(&eager), clamped(&lazy), "{name}");
            assert!(b.events < a.events, "{name}: {} !< {}", b.events, a.events);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 16, ..Default::default() })]

    /// Every GPU sends to (or all-reduces with) its counterpart some pods on, over random
    /// small rail-optimised fabrics with pinned paths: whatever rotations the symmetry
    /// search finds (spines and cables placed by the routes), the reduced run stays within the
    /// reference's bounds, accounts for every byte, and its rotations' copies multiply to
    /// its order.
    #[test]
    fn pinned_pod_to_pod_traffic_reduces_within_bounds(
        hosts_per_pod in proptest::sample::select(vec![2usize, 4]),
        pods in 2usize..4,
        gpus_per_host in 1usize..3,
        spines in proptest::sample::select(vec![1usize, 2, 4]),
        pod_offset in 1usize..3,
        bytes in 100_000u64..600_000,
        pairs in proptest::bool::ANY,
    ) {
        let hosts = hosts_per_pod * pods;
        let spec = RailOptimizedSpec {
            gpus_per_host,
            hosts_per_pod,
            spines,
            ..RailOptimizedSpec::dgx_h100(hosts)
        };
        let Ok(g) = NetGraph::rail_optimized(&spec) else {
            return Err(proptest::test_runner::TestCaseError::reject("no such fabric"));
        };
        let g = g.with_routing(Routing::Pinned);
        let endpoints = (hosts * gpus_per_host) as u32;
        let shift = (pod_offset % pods * hosts_per_pod * gpus_per_host) as u32;
        proptest::prop_assume!(shift > 0);
        let mut fs = FlowSet::default();
        for a in 0..endpoints {
            let b = (a + shift) % endpoints;
            if pairs {
                add_ring(&mut fs, &format!("pair {a}"), &[a.min(b), a.max(b)], bytes);
            } else {
                fs.flows.push(flow(a, b, bytes));
            }
        }
        let off = run(PacketConfig::reference(), &g, &fs);
        let on = run(with_symmetry(PacketConfig::reference()), &g, &fs);
        check_bounds(&PacketConfig::reference(), &off, &on, &fs, "pinned pod shift");
        let product: u64 = on.symmetry.iter().map(|s| u64::from(s.copies())).product();
        if on.symmetry.is_empty() {
            proptest::prop_assert_eq!(on.stats.symmetry_order, 0);
        } else {
            proptest::prop_assert_eq!(product, on.stats.symmetry_order);
        }
    }
}

/// A ring all-reduce of `ring_bytes` over 16 GPUs with `channels` channels (on five
/// hosts of four, the fifth idle) and, released by a 1 MB transfer inside the fifth host
/// that finishes `frac` of the ring's reference length in (so unannounced), either a
/// transfer of `bytes` from rank 3 to rank 4 (on the path of a chain of the ring) or, with
/// `second`, a second ring all-reduce of `bytes` on the same ranks and channels.
fn ring_then(
    (channels, ring_bytes): (u32, u64),
    frac: (u64, u64),
    bytes: u64,
    second: bool,
) -> (NetGraph, FlowSet) {
    let ranks: Vec<u32> = (0..16).collect();
    let mut fs = FlowSet::default();
    add_ring_of(&mut fs, "ring", &ranks, ring_bytes, channels);
    let g = four_gpu_hosts(5);
    let plain = run(PacketConfig::reference(), &g, &fs);
    let released = Picos(plain.report.end.0 / frac.1 * frac.0);
    let probe = push_probe_finishing_at(&mut fs, &g, released);
    let first = fs.flows.len();
    if second {
        add_ring_of(&mut fs, "second", &ranks, bytes, channels);
    } else {
        let mut late = flow(3, 4, bytes);
        late.collective = own_collective(&mut fs, "late", vec![3, 4]);
        fs.flows.push(late);
    }
    for f in fs.flows[first..].iter_mut().filter(|f| f.deps.is_empty()) {
        f.deps = vec![probe].into();
    }
    (g, fs)
}

#[test]
fn a_transfer_released_between_a_periodic_rings_steps_is_met_by_its_next_ones() {
    // Released halfway (1 MB) and a third of the way (2 MB) through a two-channel ring,
    // each transfer lands where no virtual flow of the ring is in progress, between two
    // steps of the chain it shares links with. Before the chain's next virtual flow was
    // checked for other traffic on its links, the two never met: the transfers ran alone,
    // 39% and 36% early, and the ring ended 4.0% and 7.7% early.
    let cases = [((1, 2), 1_000_000), ((1, 3), 2_000_000)];
    let ring_and = |at, bytes| ring_then((2, 8_000_000), at, bytes, false);
    intruders_within(&cases, ring_and, 0.01);
}

#[test]
fn a_second_two_channel_ring_on_a_periodic_one_ends_in_time_but_is_not_exact_flow_by_flow() {
    // The second ring of [`a_second_ring_released_onto_a_periodic_ring_meets_its_flows_in_progress`]
    // with two channels (4 MB released halfway, 8 MB two fifths in). Both rings end within
    // 0.2% of the reference, but the flows simulated around the intrusion, among them
    // those restarted where an intruder met them, are up to 10.6% off at p99 (the
    // issue's bound is 5%): a known gap, held here so that it does not grow. Before
    // intruders met the flows in progress, 32.8% and 42.0% at p99, the ends 0.77% and
    // 1.13% early. The worst flows are the rings' NVLink hops (about 1 us each), whose
    // order on the NVLink ports flips with a few tens of nanoseconds of phase: releasing
    // the second ring 50 ns later moves the reference itself by 6.5% and 6.8% at p99,
    // 200 ns later by 27% and 21% (and its end by 0.06% and 1.7%).
    let base = PacketConfig::reference();
    for (frac, bytes) in [((1, 2), 4_000_000), ((2, 5), 8_000_000)] {
        let (g, fs) = ring_then((2, 8_000_000), frac, bytes, true);
        let off = run(base.clone(), &g, &fs);
        let on = run(with_periodic(base.clone()), &g, &fs);
        let name = format!("second ring of {bytes} B at {frac:?}");
        assert!(on.stats.periodic_met >= 1, "{name}: {:?}", on.stats);
        let e = errors(&off, &on, &fs);
        assert!(e.mean_fct < 0.011 && e.p99_fct < 0.12, "{name}: {e:?}");
        assert!(e.end < 0.002 && e.collective < 0.002, "{name}: {e:?}");
    }
}

// ---- Collective memo ------------------------------------------------------------------

fn with_collective_memo(mut c: PacketConfig) -> PacketConfig {
    c = with_periodic(c);
    c.accel.collective_memo = true;
    c
}

/// One-channel ring all-reduces of `bytes` over the 16 hosts of [`two_pod_ring`], one per
/// entry of `starts`, each its own collective, whose first steps wait for zero-byte marker
/// flows released at `starts[r][k]` for rank `k` of ring `r` (a zero-byte flow uses no
/// link): a bucket after bucket, released by compute that ends at given times.
fn rings_released_at(starts: &[Vec<Picos>], bytes: u64) -> (NetGraph, FlowSet) {
    let (g, _) = two_pod_ring();
    let mut fs = FlowSet::default();
    let ranks: Vec<u32> = (0..16).collect();
    for (r, at) in starts.iter().enumerate() {
        let marker = own_collective(&mut fs, &format!("compute {r}"), vec![0, 1]);
        let first_marker = fs.flows.len();
        for &t in at {
            let mut m = flow(0, 1, 0);
            m.delay = t;
            m.collective = marker;
            fs.flows.push(m);
        }
        let range = collective_flows(
            &mut fs,
            &format!("ring {r}"),
            CollectiveKind::AllReduce,
            FlowAlgorithm::Ring { channels: 1 },
            &ranks,
            Bytes(bytes),
            1,
            Picos::from_nanos(2000),
        )
        .unwrap();
        let roots: Vec<usize> = range.filter(|&f| fs.flows[f].deps.is_empty()).collect();
        assert_eq!(roots.len(), at.len());
        for (k, f) in roots.into_iter().enumerate() {
            fs.flows[f].deps = vec![FlowId((first_marker + k) as u32)].into();
        }
    }
    (g, fs)
}

/// Adds a transfer of `bytes` from host 3 to host 4 (a hop of the rings of
/// [`rings_released_at`]), a collective of its own, released at `at`.
fn push_hop_transfer(fs: &mut FlowSet, bytes: u64, at: Picos) {
    let mut transfer = flow(3, 4, bytes);
    transfer.delay = at;
    transfer.collective = own_collective(fs, "transfer", vec![3, 4]);
    fs.flows.push(transfer);
}

/// Runs `fs` packet by packet and with the collective memo (and the memoization and
/// periodic extrapolation it builds on), returning the base configuration and both runs.
fn reference_and_collective_memo(
    g: &NetGraph,
    fs: &FlowSet,
) -> (PacketConfig, PacketRun, PacketRun) {
    let base = PacketConfig::reference();
    let off = run(base.clone(), g, fs);
    let on = run(with_collective_memo(base.clone()), g, fs);
    (base, off, on)
}

/// The run kept `expected.0` collectives and repeated `expected.1`.
fn assert_kept_and_repeated(run: &PacketRun, expected: (u64, u64), name: &str) {
    let st = &run.stats;
    let got = (st.collective_memo_records, st.collective_memo_repeats);
    assert_eq!(got, expected, "{name}: {st:?}");
}

/// Every ring of [`rings_released_at`] starting on idle links at `t0 + r * period`.
fn rings_every(reps: usize, period: Picos, bytes: u64) -> (NetGraph, FlowSet) {
    let starts: Vec<Vec<Picos>> = (0..reps)
        .map(|r| vec![Picos(r as u64 * period.0); 16])
        .collect();
    rings_released_at(&starts, bytes)
}

/// The flows of collective `name`, in flow order.
fn flows_of(fs: &FlowSet, name: &str) -> Vec<usize> {
    let c = fs.collectives.iter().position(|c| c.name == name).unwrap();
    (0..fs.flows.len())
        .filter(|&f| fs.flows[f].collective as usize == c)
        .collect()
}

#[test]
fn a_collective_repeating_an_earlier_ones_shape_finishes_at_its_times() {
    // Three rings, each released `ONE_RING` after the last started, on idle links again:
    // the first is simulated (and goes periodic) and kept, the next two finish every flow
    // at the first's times without a packet. Measured: 12,150,276 events for the
    // reference, 2,303,346 with periodic extrapolation (whose later rings relearn their
    // lanes), 768,774 with the collective memo; 0.075% mean and 0.195% p99 per-flow error
    // with either.
    let (g, fs) = rings_every(3, us(ONE_RING), RING_BYTES);
    let base = PacketConfig::reference();
    let off = run(base.clone(), &g, &fs);
    let periodic = run(with_periodic(base.clone()), &g, &fs);
    let on = run(with_collective_memo(base.clone()), &g, &fs);
    let per = flows_of(&fs, "ring 0").len() as u64;
    assert_eq!(on.stats.collective_memo_repeats, 2, "{:?}", on.stats);
    assert_eq!(on.stats.collective_memo_aborts, 0, "{:?}", on.stats);
    assert_eq!(on.stats.collective_memo_flows, 2 * per, "{:?}", on.stats);
    // Repeated flows are counted apart from the first ring's virtual ones.
    assert!(on.stats.periodic_flows < per, "{:?}", on.stats);
    assert!(on.stats.collective_memo_skipped_events > 0);
    // Only the first ring is kept: each ring ends well before the next starts, so nothing
    // spoils it, and the zero-byte markers finish at their release, before any check.
    assert_eq!(on.stats.collective_memo_records, 1, "{:?}", on.stats);
    // Kept times, to the picosecond: every repeated flow takes what its counterpart did.
    let fct = |r: &PacketRun, f: usize| r.report.flows[f].fct();
    let first = flows_of(&fs, "ring 0");
    for name in ["ring 1", "ring 2"] {
        for (&a, &b) in first.iter().zip(&flows_of(&fs, name)) {
            assert_eq!(fct(&on, a), fct(&on, b), "{name}");
        }
        assert!(flows_of(&fs, name).iter().all(|&f| on.flow_events[f] == 0));
    }
    // The first ring is the periodic run's, and the whole run within the bounds of the
    // reference, where the rings themselves repeat to within 0.01%.
    for &f in &first {
        assert_eq!(fct(&on, f), fct(&periodic, f));
    }
    check_bounds(&base, &off, &on, &fs, "repeated rings");
    let e = errors(&periodic, &on, &fs);
    assert!(e.mean_fct < 1e-4 && e.end < 1e-6, "{e:?}");
    assert!(
        on.report.events * 2 < periodic.report.events,
        "{:?}",
        on.stats
    );
    // Same input, same output.
    let again = run(with_collective_memo(base.clone()), &g, &fs);
    assert_eq!(again.report, on.report);
}

#[test]
fn a_collective_released_out_of_its_recorded_step_is_not_repeated() {
    // The second ring has the first's shape, but one rank's first step is released 3 us
    // after the others': when its compute (a marker flow) ends then, its release is not
    // due yet when the ring starts; when the step is released at a time of its own, its
    // release is due 3 us off its recorded offset. Either way a repeat would end partway,
    // so none starts, and the ring is simulated within the bounds.
    let late = |t: u64, k: usize| Picos(us(t).0 + if k == 5 { us(3).0 } else { 0 });
    let starts = vec![
        vec![Picos::ZERO; 16],
        (0..16).map(|k| late(ONE_RING, k)).collect(),
    ];
    let (g, by_markers) = rings_released_at(&starts, RING_BYTES);
    // The same rings with each first step released at its marker's time directly.
    let mut at_own_times = by_markers.clone();
    for f in 0..at_own_times.flows.len() {
        if let [marker] = at_own_times.flows[f].deps[..] {
            if at_own_times.flows[marker.0 as usize].bytes.0 == 0 {
                at_own_times.flows[f].delay = at_own_times.flows[marker.0 as usize].delay;
                at_own_times.flows[f].deps = Default::default();
            }
        }
    }
    let base = PacketConfig::reference();
    for (name, fs) in [("marker", by_markers), ("own time", at_own_times)] {
        let off = run(base.clone(), &g, &fs);
        let on = run(with_collective_memo(base.clone()), &g, &fs);
        // Both rings are kept: one shape, two patterns of first-step offsets.
        assert_kept_and_repeated(&on, (2, 0), name);
        assert_eq!(on.stats.collective_memo_flows, 0, "{name}: {:?}", on.stats);
        check_bounds(&base, &off, &on, &fs, name);
    }
}

#[test]
fn a_collective_starting_on_busy_links_is_simulated_and_the_next_idle_one_repeats() {
    // A 2 MB transfer from GPU 3 to GPU 4 (the ring's hop between the first two hosts) is
    // released 10 us before the second ring and is still running when it starts: the
    // second ring is simulated, not repeated (nor recorded); the third, on idle links
    // again, repeats the first.
    let (g, mut fs) = rings_every(3, us(ONE_RING), RING_BYTES);
    push_hop_transfer(&mut fs, 2_000_000, us(ONE_RING - 10));
    let (base, off, on) = reference_and_collective_memo(&g, &fs);
    assert_eq!(on.stats.collective_memo_repeats, 1, "{:?}", on.stats);
    assert_eq!(on.stats.collective_memo_aborts, 0, "{:?}", on.stats);
    let fct = |f: usize| on.report.flows[f].fct();
    let [first, second, third] = ["ring 0", "ring 1", "ring 2"].map(|r| flows_of(&fs, r));
    assert!(second.iter().any(|&f| on.flow_events[f] > 0));
    assert!(first.iter().zip(&second).any(|(&a, &b)| fct(a) != fct(b)));
    assert!(first.iter().zip(&third).all(|(&a, &b)| fct(a) == fct(b)));
    check_bounds(&base, &off, &on, &fs, "a ring started on busy links");
}

#[test]
fn a_transfer_released_onto_a_repeating_collective_ends_the_repeat_within_bounds() {
    // A 1 MB transfer on a ring hop, released halfway through the second ring (at a time
    // of its own, scheduled from the start): the repeat begins all the same, ends when
    // the transfer comes, the flows in progress on its links meet it, and the ring's
    // later steps are simulated.
    let (g, mut fs) = rings_every(2, us(ONE_RING), RING_BYTES);
    let plain = run(PacketConfig::reference(), &g, &fs);
    let second = flows_of(&fs, "ring 1");
    let start = second
        .iter()
        .map(|&f| plain.report.flows[f].start)
        .min()
        .unwrap();
    let end = second
        .iter()
        .map(|&f| plain.report.flows[f].finish)
        .max()
        .unwrap();
    push_hop_transfer(&mut fs, 1_000_000, Picos((start.0 + end.0) / 2));
    let (base, off, on) = reference_and_collective_memo(&g, &fs);
    assert_eq!(on.stats.collective_memo_repeats, 1, "{:?}", on.stats);
    assert_eq!(on.stats.collective_memo_aborts, 1, "{:?}", on.stats);
    assert!(on.stats.collective_memo_met >= 1, "{:?}", on.stats);
    check_bounds(&base, &off, &on, &fs, "a transfer onto a repeating ring");
    let err = late_flow_error(&off, &on);
    assert!(err < 0.005, "transfer FCT error {err}");
}

#[test]
fn collectives_without_chains_are_left_to_memoization() {
    // Rounds of a 4-to-1 incast of 2 MB flows on one switch, each round its own
    // collective released 30 us after the last one's flows finished (DCQCN cuts them in
    // every round). Rounds 1 to 3 have one shape, but no flow of a round waits for another
    // of it: memoization's hits take them (and roll an intrusion back exactly, where a
    // repeat could only end), and the collective memo changes nothing.
    let g = NetGraph::single_switch(5, gbps(100.0), us(1)).unwrap();
    let mut fs = FlowSet::default();
    for r in 0..4u32 {
        let c = own_collective(&mut fs, &format!("incast {r}"), vec![0, 1, 2, 3, 4]);
        let previous = fs.flows.len() as u32;
        for i in 0..4 {
            let mut f = flow(i, 4, 2_000_000);
            f.collective = c;
            if r > 0 {
                f.deps = (previous - 4..previous).map(FlowId).collect();
                f.delay = us(30);
            }
            fs.flows.push(f);
        }
    }
    let base = PacketConfig::reference();
    let on = run(with_collective_memo(base.clone()), &g, &fs);
    let without = run(with_periodic(base.clone()), &g, &fs);
    assert!(
        on.stats.ecn_marks > 0 && on.stats.memo_hits == 3,
        "{:?}",
        on.stats
    );
    assert_eq!(on.stats.collective_memo_records, 0, "{:?}", on.stats);
    assert_eq!(on.stats.collective_memo_repeats, 0, "{:?}", on.stats);
    assert_eq!(on.report, without.report);
}

/// Microseconds between the starts of the rings of the collective-memo tests: each
/// 16 MB ring of [`rings_released_at`] has ended well before the next starts.
const ONE_RING: u64 = 5000;
const RING_BYTES: u64 = 16_000_000;

#[test]
fn a_collective_that_never_went_periodic_is_left_to_memoization() {
    // Five 4-rank ring all-reduces over four hosts, one after another: chains of six
    // flows, too short to go periodic (`period_window` flows must be left after five
    // learned), so no outcome is kept and the run is the one without the collective
    // memo, its steps memoized episodes.
    let mut fs = FlowSet::default();
    for r in 0..5 {
        let previous = fs.flows.len() as u32;
        let range = collective_flows(
            &mut fs,
            &format!("ring {r}"),
            CollectiveKind::AllReduce,
            FlowAlgorithm::Ring { channels: 1 },
            &[0, 4, 8, 12],
            Bytes(8_000_000),
            4,
            Picos::from_nanos(2000),
        )
        .unwrap();
        let roots: Vec<usize> = range.filter(|&f| fs.flows[f].deps.is_empty()).collect();
        for f in roots.into_iter().filter(|_| r > 0) {
            fs.flows[f].deps = (previous - 4..previous).map(FlowId).collect();
            fs.flows[f].delay = us(20);
        }
    }
    let g = four_gpu_hosts(4);
    let base = PacketConfig::reference();
    let on = run(with_collective_memo(base.clone()), &g, &fs);
    let without = run(with_periodic(base.clone()), &g, &fs);
    assert_eq!(on.stats.periodic_starts, 0, "{:?}", on.stats);
    assert!(on.stats.memo_hits > 0, "{:?}", on.stats);
    assert_eq!(on.stats.collective_memo_records, 0, "{:?}", on.stats);
    assert_eq!(on.report, without.report);
}

#[test]
fn a_collective_that_other_traffic_touched_is_not_kept() {
    // A 2 MB transfer on a ring hop, released a tenth of a ring into the first ring: the
    // first ring's record is spoiled, so the second is simulated and kept, and the third
    // repeats the second, not the first.
    let (g, mut fs) = rings_every(3, us(ONE_RING), RING_BYTES);
    push_hop_transfer(&mut fs, 2_000_000, us(ONE_RING / 10));
    let (base, off, on) = reference_and_collective_memo(&g, &fs);
    assert_kept_and_repeated(&on, (1, 1), "a ring touched by a transfer");
    let fct = |f: usize| on.report.flows[f].fct();
    let [first, second, third] = ["ring 0", "ring 1", "ring 2"].map(|r| flows_of(&fs, r));
    assert!(first.iter().zip(&second).any(|(&a, &b)| fct(a) != fct(b)));
    assert!(second.iter().zip(&third).all(|(&a, &b)| fct(a) == fct(b)));
    assert!(third.iter().all(|&f| on.flow_events[f] == 0));
    check_bounds(&base, &off, &on, &fs, "a ring touched by a transfer");
}

#[test]
fn kept_collectives_carry_across_runs_and_through_the_cache_file() {
    // Two rings in a row: the first run keeps the first and repeats it in the second; a
    // second run with the same cache repeats both, and so does a fresh simulator given the
    // cache through its file, with the same report. On a fabric whose links differ (faster
    // NICs), the kept ring does not apply.
    let (g, fs) = rings_every(2, us(ONE_RING), RING_BYTES);
    let config = with_collective_memo(PacketConfig::reference());
    let sim = PacketSimulator::new(config.clone());
    let first = sim.run(&g, &fs, &TraceRequest::default()).unwrap();
    assert_kept_and_repeated(&first, (1, 1), "first run");
    assert_eq!(sim.cache().kept_collectives(), 1);
    let second = sim.run(&g, &fs, &TraceRequest::default()).unwrap();
    assert_kept_and_repeated(&second, (0, 2), "second run");
    let per = flows_of(&fs, "ring 0");
    let fct = |r: &PacketRun, f: usize| r.report.flows[f].fct();
    assert!(per.iter().all(|&f| fct(&second, f) == fct(&first, f)));
    assert!(per.iter().all(|&f| second.flow_events[f] == 0));
    let path = std::env::temp_dir().join(format!("orrery-kept-{}.bin", std::process::id()));
    sim.cache().save(&path).unwrap();
    let loaded = orrery_net::packet::MemoCache::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded, sim.cache());
    let third = PacketSimulator::with_cache(config.clone(), loaded)
        .run(&g, &fs, &TraceRequest::default())
        .unwrap();
    assert_eq!(third.report, second.report);
    let faster = two_pods(200.0);
    let fourth = PacketSimulator::with_cache(config, sim.cache())
        .run(&faster, &fs, &TraceRequest::default())
        .unwrap();
    assert_kept_and_repeated(&fourth, (1, 1), "faster NICs");
}

#[test]
fn a_collective_without_chains_holds_no_links_for_the_others() {
    // Two 1 MB transfers on a ring hop, one collective without chains: the first between
    // the rings, the second after both. That collective is live through the second ring,
    // on its links, but takes no part in the collective memo, so the second ring still
    // starts on idle links and repeats the first.
    let (g, mut fs) = rings_every(2, us(ONE_RING), RING_BYTES);
    push_hop_transfer(&mut fs, 1_000_000, us(ONE_RING * 4 / 5));
    let pair = fs.collectives.len() as u32 - 1;
    let mut later = flow(3, 4, 1_000_000);
    later.delay = us(3 * ONE_RING);
    later.collective = pair;
    fs.flows.push(later);
    let (base, off, on) = reference_and_collective_memo(&g, &fs);
    assert_kept_and_repeated(&on, (1, 1), "rings beside a collective without chains");
    check_bounds(
        &base,
        &off,
        &on,
        &fs,
        "rings beside a collective without chains",
    );
}
