//! The flow-level model against closed forms, max-min fairness properties and determinism.
#![allow(clippy::unwrap_used)]

use orrery_net::flow_model::{max_min_rates, FlowLevelSimulator, FlowModelConfig, Recompute};
use orrery_net::flows::{FlowSet, FlowSpec};
use orrery_net::sim::{FlowSimulator, SimError, SimReport};
use orrery_net::NetGraph;
use orrery_units::{Bandwidth, Bytes, FlowId, Picos};
use proptest::prelude::*;

fn gbps(x: f64) -> Bandwidth {
    Bandwidth::from_gbits_per_sec(x)
}

fn flow(src: u32, dst: u32, bytes: u64, deps: &[usize], delay: Picos) -> FlowSpec {
    FlowSpec {
        src,
        dst,
        bytes: Bytes(bytes),
        deps: deps.iter().map(|&d| FlowId::from_index(d)).collect(),
        delay,
        collective: 0,
    }
}

fn set(flows: Vec<FlowSpec>) -> FlowSet {
    FlowSet {
        flows,
        collectives: Vec::new(),
    }
}

fn simulate(graph: &NetGraph, flows: &FlowSet) -> SimReport {
    FlowLevelSimulator::default()
        .simulate(graph, flows)
        .unwrap()
}

fn assert_close_ps(got: Picos, want: Picos, tol: u64) {
    let diff = got.0.abs_diff(want.0);
    assert!(
        diff <= tol,
        "got {} ps, want {} ps (off by {diff})",
        got.0,
        want.0
    );
}

/// Seconds to picoseconds, computed independently of the model.
fn ps(secs: f64) -> Picos {
    Picos((secs * 1e12).round() as u64)
}

#[test]
fn one_flow_on_one_link_matches_the_closed_form() {
    let bw = gbps(100.0);
    let delay = Picos::from_nanos(500);
    let g = NetGraph::single_switch(2, bw, delay).unwrap();
    let bytes = 1_000_003u64;
    let release = Picos::from_nanos(1234);
    let r = simulate(&g, &set(vec![flow(0, 1, bytes, &[], release)]));
    let want = release + ps(bytes as f64 / bw.0) + delay + delay;
    assert_eq!(r.model, "flow");
    assert_eq!(r.flows[0].start, release);
    assert_close_ps(r.flows[0].finish, want, 1);
    assert_eq!(r.end, r.flows[0].finish);
    // Payload on the two links of the path, nothing elsewhere.
    let path = g.route(0, 1, 0).unwrap();
    for (l, &b) in r.link_bytes.iter().enumerate() {
        let on_path = path.iter().any(|p| p.index() == l);
        assert_eq!(b, if on_path { bytes } else { 0 }, "link {l}");
    }
    assert_eq!(r.bytes_sent, bytes);
    assert_eq!(r.bytes_delivered, bytes);
    assert_eq!(r.drops, 0);
    assert!(r.pfc_pauses.iter().all(|&p| p == 0));
    assert_eq!(r.pfc_pauses.len(), g.links().len());
    assert_eq!(r.events, 2);
}

#[test]
fn wire_overhead_stretches_the_transmission_only() {
    let bw = gbps(100.0);
    let delay = Picos::from_nanos(700);
    let g = NetGraph::single_switch(2, bw, delay).unwrap();
    let bytes = 4_000_000u64;
    let sim = FlowLevelSimulator::new(FlowModelConfig {
        wire_overhead: 1.25,
        ..FlowModelConfig::default()
    });
    let r = sim
        .simulate(&g, &set(vec![flow(0, 1, bytes, &[], Picos::ZERO)]))
        .unwrap();
    assert_close_ps(
        r.flows[0].finish,
        ps(1.25 * bytes as f64 / bw.0) + delay + delay,
        1,
    );
    assert_eq!(r.link_bytes.iter().max().copied(), Some(bytes));
}

#[test]
fn n_flows_into_one_receiver_share_its_link_equally() {
    let bw = gbps(400.0);
    let delay = Picos::from_nanos(300);
    for n in [2usize, 3, 7] {
        let g = NetGraph::single_switch(n + 1, bw, delay).unwrap();
        let bytes = 3_000_000u64;
        let flows = (0..n)
            .map(|i| flow(i as u32, n as u32, bytes, &[], Picos::ZERO))
            .collect();
        let r = simulate(&g, &set(flows));
        let want = ps(n as f64 * bytes as f64 / bw.0) + delay + delay;
        for o in &r.flows {
            assert_eq!(o.start, Picos::ZERO);
            assert_eq!(o.finish, r.flows[0].finish, "all finish together");
            assert_close_ps(o.finish, want, 1);
        }
        // The receiver's downlink carried everything.
        assert_eq!(r.link_bytes.iter().max().copied(), Some(n as u64 * bytes));
    }
}

#[test]
fn a_short_flow_leaving_speeds_up_the_long_one() {
    // Two flows across a dumbbell's bottleneck: both at C/2 until the short one is done,
    // then the long one alone at C.
    let (edge, neck) = (gbps(400.0), gbps(100.0));
    let delay = Picos::from_nanos(1000);
    let g = NetGraph::dumbbell(2, 2, edge, neck, delay).unwrap();
    let (a, b) = (5_000_000u64, 2_000_000u64);
    let r = simulate(
        &g,
        &set(vec![
            flow(0, 2, a, &[], Picos::ZERO),
            flow(1, 3, b, &[], Picos::ZERO),
        ]),
    );
    let prop = delay + delay + delay;
    assert_close_ps(r.flows[1].finish, ps(2.0 * b as f64 / neck.0) + prop, 1);
    assert_close_ps(r.flows[0].finish, ps((a + b) as f64 / neck.0) + prop, 2);
    assert_eq!(r.events, 4);
}

#[test]
fn max_min_on_the_classic_examples() {
    // A over links 0 and 1, B over 0, C over 1; capacities 1 and 2.
    let r = max_min_rates(&[1.0, 2.0], &[vec![0, 1], vec![0], vec![1]]);
    let want = [0.5, 0.5, 1.5];
    for (g, w) in r.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{r:?}");
    }
    // Parking lot over three links of capacities 1, 2, 3: the long flow is held by link 0.
    let r = max_min_rates(
        &[1.0, 2.0, 3.0],
        &[vec![0, 1, 2], vec![0], vec![1], vec![2]],
    );
    let want = [0.5, 0.5, 1.5, 2.5];
    for (g, w) in r.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{r:?}");
    }
    // Three flows on one link of 3, one of them also on a link of 0.5.
    let r = max_min_rates(&[3.0, 0.5], &[vec![0, 1], vec![0], vec![0]]);
    let want = [0.5, 1.25, 1.25];
    for (g, w) in r.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{r:?}");
    }
}

#[test]
fn a_dependency_delays_the_release() {
    let bw = gbps(200.0);
    let delay = Picos::from_nanos(250);
    let g = NetGraph::single_switch(3, bw, delay).unwrap();
    let gap = Picos::from_nanos(2000);
    let bytes = 800_000u64;
    let r = simulate(
        &g,
        &set(vec![
            flow(0, 1, bytes, &[], Picos::ZERO),
            flow(1, 2, bytes, &[0], gap),
        ]),
    );
    let one = ps(bytes as f64 / bw.0) + delay + delay;
    assert_close_ps(r.flows[0].finish, one, 1);
    assert_eq!(r.flows[1].start, r.flows[0].finish + gap);
    assert_close_ps(r.flows[1].finish, r.flows[1].start + one, 1);
    assert_eq!(r.end, r.flows[1].finish);
}

#[test]
fn the_latest_dependency_decides_the_release() {
    let bw = gbps(100.0);
    let g = NetGraph::single_switch(4, bw, Picos::from_nanos(100)).unwrap();
    let r = simulate(
        &g,
        &set(vec![
            flow(0, 1, 1_000, &[], Picos::ZERO),
            flow(2, 3, 9_000_000, &[], Picos::ZERO),
            flow(1, 0, 1_000, &[0, 1], Picos::from_nanos(10)),
        ]),
    );
    assert!(r.flows[1].finish > r.flows[0].finish);
    assert_eq!(r.flows[2].start, r.flows[1].finish + Picos::from_nanos(10));
}

#[test]
fn a_zero_byte_flow_takes_the_propagation_delay() {
    let delay = Picos::from_nanos(400);
    let g = NetGraph::single_switch(2, gbps(100.0), delay).unwrap();
    let r = simulate(
        &g,
        &set(vec![
            flow(0, 1, 0, &[], Picos::from_nanos(5)),
            flow(1, 0, 0, &[0], Picos::ZERO),
        ]),
    );
    assert_eq!(r.flows[0].finish, Picos::from_nanos(5) + delay + delay);
    assert_eq!(r.flows[1].start, r.flows[0].finish);
    assert_eq!(r.flows[1].finish, r.flows[0].finish + delay + delay);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let g = NetGraph::single_switch(2, gbps(100.0), Picos::ZERO).unwrap();
    let sim = FlowLevelSimulator::default();
    let self_loop = set(vec![flow(1, 1, 10, &[], Picos::ZERO)]);
    assert!(matches!(
        sim.simulate(&g, &self_loop),
        Err(SimError::Flows(_))
    ));
    let forward_dep = set(vec![
        flow(0, 1, 10, &[1], Picos::ZERO),
        flow(1, 0, 10, &[], Picos::ZERO),
    ]);
    assert!(matches!(
        sim.simulate(&g, &forward_dep),
        Err(SimError::Flows(_))
    ));
    let no_endpoint = set(vec![flow(0, 9, 10, &[], Picos::ZERO)]);
    assert!(matches!(
        sim.simulate(&g, &no_endpoint),
        Err(SimError::Topology(_))
    ));
    let empty = sim.simulate(&g, &FlowSet::default()).unwrap();
    assert_eq!(empty.end, Picos::ZERO);
    assert_eq!(empty.events, 0);
}

/// A busy, irregular scenario: a dumbbell with crossing, incast and chained flows.
fn busy_scenario() -> (NetGraph, FlowSet) {
    let g = NetGraph::dumbbell(6, 5, gbps(400.0), gbps(200.0), Picos::from_nanos(600)).unwrap();
    let mut flows = Vec::new();
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..300usize {
        let src = (next() % 11) as u32;
        let mut dst = (next() % 11) as u32;
        if dst == src {
            dst = (src + 1) % 11;
        }
        let bytes = 1_000 + next() % 3_000_000;
        let deps: Vec<usize> = if i > 0 && next() % 3 == 0 {
            vec![(next() % i as u64) as usize]
        } else {
            Vec::new()
        };
        let delay = Picos::from_nanos(next() % 5_000);
        flows.push(flow(src, dst, bytes, &deps, delay));
    }
    (g, set(flows))
}

#[test]
fn the_same_input_gives_the_same_report() {
    let (g, flows) = busy_scenario();
    let a = simulate(&g, &flows);
    let b = simulate(&g, &flows);
    assert_eq!(a, b);
    assert_eq!(a.events, 2 * flows.flows.len() as u64);
    let total: u64 = flows.flows.iter().map(|f| f.bytes.0).sum();
    assert_eq!(a.bytes_sent, total);
    assert_eq!(a.bytes_delivered, total);
    for (o, f) in a.flows.iter().zip(&flows.flows) {
        assert!(o.finish > o.start);
        for d in &f.deps {
            assert!(o.start >= a.flows[d.index()].finish + f.delay);
        }
    }
}

#[test]
fn affected_recomputation_equals_full_recomputation() {
    let (g, flows) = busy_scenario();
    let fast = FlowLevelSimulator::new(FlowModelConfig {
        recompute: Recompute::Affected,
        ..FlowModelConfig::default()
    });
    let slow = FlowLevelSimulator::new(FlowModelConfig {
        recompute: Recompute::Full,
        ..FlowModelConfig::default()
    });
    assert_eq!(
        fast.simulate(&g, &flows).unwrap(),
        slow.simulate(&g, &flows).unwrap()
    );
}

/// A ring all-reduce built by hand: `channels` rings, each carrying `1/channels` of `total`
/// bytes; at step `k` (of `2(n-1)`) rank `i` sends its chunk of `total / (n * channels)`
/// bytes to rank `i+1`, after rank `i-1`'s step `k-1` on the same channel arrived.
fn ring_allreduce(n: usize, channels: usize, total: u64, step_delay: Picos) -> FlowSet {
    let chunk = total / (n * channels) as u64;
    let per_step = n * channels;
    let mut flows = Vec::new();
    for k in 0..2 * (n - 1) {
        for c in 0..channels {
            for i in 0..n {
                let deps = if k == 0 {
                    Vec::new()
                } else {
                    let prev = (i + n - 1) % n;
                    vec![(k - 1) * per_step + c * n + prev]
                };
                flows.push(flow(
                    i as u32,
                    ((i + 1) % n) as u32,
                    chunk,
                    &deps,
                    step_delay,
                ));
            }
        }
    }
    set(flows)
}

#[test]
fn ring_allreduce_on_a_single_switch_matches_the_alpha_beta_time() {
    let bw = gbps(400.0);
    let delay = Picos::from_nanos(500);
    let step_delay = Picos::from_nanos(2000);
    let n = 4usize;
    let total = 64u64 << 20;
    let g = NetGraph::single_switch(n, bw, delay).unwrap();
    for channels in [1usize, 2] {
        let flows = ring_allreduce(n, channels, total, step_delay);
        let r = simulate(&g, &flows);
        // Each step moves S/n per rank over a dedicated uplink and downlink.
        let step =
            step_delay.as_secs_f64() + (total as f64 / n as f64) / bw.0 + 2.0 * delay.as_secs_f64();
        let want = ps(2.0 * (n as f64 - 1.0) * step);
        assert_close_ps(r.end, want, 2 * (n as u64 - 1));
        assert_eq!(r.events, 2 * flows.flows.len() as u64);
        // Every uplink and downlink carried 2(n-1)/n * S.
        for &b in &r.link_bytes {
            assert_eq!(b, 2 * (n as u64 - 1) * total / n as u64);
        }
    }
}

#[test]
#[ignore = "timing: run with --release --ignored --nocapture"]
fn timing_ring_allreduce_1gib_8_endpoints_8_channels() {
    let bw = gbps(400.0);
    let g = NetGraph::single_switch(8, bw, Picos::from_nanos(500)).unwrap();
    let flows = ring_allreduce(8, 8, 1 << 30, Picos::from_nanos(2000));
    let sim = FlowLevelSimulator::default();
    let t = std::time::Instant::now();
    let r = sim.simulate(&g, &flows).unwrap();
    let wall = t.elapsed();
    println!(
        "flow model: 1 GiB ring all-reduce, 8 endpoints, 8 channels: {} flows, {} events, \
         simulated {}, wall {:?} ({:.0} events/s)",
        flows.flows.len(),
        r.events,
        r.end,
        wall,
        r.events as f64 / wall.as_secs_f64()
    );
    let (g, flows) = busy_scenario();
    timing_recompute("busy dumbbell", &g, &flows);
    // Many independent pairs: small components, where affected recomputation pays off.
    let g = NetGraph::single_switch(128, bw, Picos::from_nanos(500)).unwrap();
    let mut pairs = Vec::new();
    for k in 0..20usize {
        for p in 0..64usize {
            let deps = if k == 0 {
                vec![]
            } else {
                vec![(k - 1) * 64 + p]
            };
            let bytes = 100_000 + ((p * 7919 + k * 104_729) % 1_000_000) as u64;
            let delay = Picos::from_nanos(((p * 31 + k * 17) % 97) as u64);
            pairs.push(flow(2 * p as u32, 2 * p as u32 + 1, bytes, &deps, delay));
        }
    }
    timing_recompute("64 independent pairs", &g, &set(pairs));
}

fn timing_recompute(what: &str, g: &NetGraph, flows: &FlowSet) {
    for (name, recompute) in [("affected", Recompute::Affected), ("full", Recompute::Full)] {
        let sim = FlowLevelSimulator::new(FlowModelConfig {
            recompute,
            ..FlowModelConfig::default()
        });
        let reps = 20u32;
        let t = std::time::Instant::now();
        let mut events = 0;
        for _ in 0..reps {
            events = sim.simulate(g, flows).unwrap().events;
        }
        println!(
            "flow model: {what}, {} flows, recompute {name}: {events} events, \
             wall {:?} per run",
            flows.flows.len(),
            t.elapsed() / reps
        );
    }
}

fn check_max_min(caps: &[f64], paths: &[Vec<usize>], rates: &[f64]) -> Result<(), TestCaseError> {
    let tol = 1e-9;
    let mut load = vec![0.0f64; caps.len()];
    let mut top = vec![0.0f64; caps.len()];
    for (p, &r) in paths.iter().zip(rates) {
        prop_assert!(r.is_finite() && r >= 0.0);
        for &l in p {
            load[l] += r;
            top[l] = top[l].max(r);
        }
    }
    for (l, &c) in caps.iter().enumerate() {
        prop_assert!(
            load[l] <= c * (1.0 + tol),
            "link {l} carries {} > {c}",
            load[l]
        );
    }
    for (f, (p, &r)) in paths.iter().zip(rates).enumerate() {
        let bottlenecked = p
            .iter()
            .any(|&l| load[l] >= caps[l] * (1.0 - tol) && r >= top[l] * (1.0 - tol));
        prop_assert!(bottlenecked, "flow {f} at {r} has no bottleneck");
    }
    Ok(())
}

proptest! {
    #[test]
    fn max_min_rates_are_feasible_and_every_flow_is_bottlenecked(
        caps in prop::collection::vec(0.1f64..100.0, 1..8),
        raw in prop::collection::vec(prop::collection::vec(0usize..64, 1..5), 1..16),
    ) {
        let paths: Vec<Vec<usize>> = raw
            .into_iter()
            .map(|p| {
                let mut p: Vec<usize> = p.into_iter().map(|l| l % caps.len()).collect();
                p.sort_unstable();
                p.dedup();
                p
            })
            .collect();
        let rates = max_min_rates(&caps, &paths);
        prop_assert_eq!(rates.len(), paths.len());
        check_max_min(&caps, &paths, &rates)?;
    }
}
