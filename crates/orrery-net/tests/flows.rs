#![allow(clippy::unwrap_used)]
//! Collectives into flows: byte totals against each algorithm's theory, dependency
//! structure (acyclic, step counts), golden step structures, and rejected inputs.

use expect_test::{expect, Expect};
use orrery_net::flows::{collective_flows, double_binary_tree, FlowAlgorithm, FlowError, FlowSet};
use orrery_net::CollectiveKind;
use orrery_units::{Bytes, Picos};
use proptest::prelude::*;
use std::fmt::Write as _;
use std::ops::Range;

use CollectiveKind as K;
use FlowAlgorithm as A;

const LAT: Picos = Picos(5_000_000);

fn build(kind: K, alg: A, ranks: &[u32], bytes: u64, eph: usize) -> (FlowSet, Range<usize>) {
    let mut set = FlowSet::default();
    // Something before, so that ranges and dependencies are checked as offsets.
    set.push_p2p("warmup", 0, 1, Bytes(10), Picos::ZERO);
    let r = collective_flows(&mut set, "c", kind, alg, ranks, Bytes(bytes), eph, LAT).unwrap();
    (set, r)
}

fn seq(n: u32) -> Vec<u32> {
    (0..n).collect()
}

/// Bytes sent by each rank position.
fn sent_per_rank(set: &FlowSet, range: Range<usize>, ranks: &[u32]) -> Vec<u64> {
    let mut out = vec![0; ranks.len()];
    for f in &set.flows[range] {
        let i = ranks.iter().position(|&r| r == f.src).unwrap();
        out[i] += f.bytes.0;
    }
    out
}

/// Longest chain of flows (in flows) through the dependencies: the step count.
fn critical_path(set: &FlowSet, range: Range<usize>) -> usize {
    let mut depth = vec![0usize; set.flows.len()];
    let mut best = 0;
    for i in range {
        depth[i] = 1 + set.flows[i]
            .deps
            .iter()
            .map(|d| depth[d.index()])
            .max()
            .unwrap_or(0);
        best = best.max(depth[i]);
    }
    best
}

/// Structural invariants every collective's flows satisfy.
fn assert_well_formed(set: &FlowSet, range: &Range<usize>, ranks: &[u32], kind: K) {
    set.check().unwrap();
    assert_eq!(range.end, set.flows.len());
    let c = set.collectives.len() - 1;
    assert_eq!(set.collectives[c].ranks, ranks);
    assert_eq!(set.collectives[c].kind, Some(kind));
    for f in &set.flows[range.clone()] {
        assert_eq!(f.collective as usize, c);
        assert_eq!(f.delay, LAT);
        assert!(ranks.contains(&f.src) && ranks.contains(&f.dst));
        assert!(f.deps.iter().all(|d| d.index() >= range.start));
        assert!(
            f.deps.windows(2).all(|w| w[0] < w[1]),
            "deps sorted, no repeats"
        );
    }
}

fn render(set: &FlowSet, range: Range<usize>) -> String {
    let mut s = String::new();
    for i in range.clone() {
        let f = &set.flows[i];
        let deps: Vec<String> = f
            .deps
            .iter()
            .map(|d| (d.index() - range.start).to_string())
            .collect();
        writeln!(
            s,
            "{:<4}{}->{} {}B after [{}]",
            format!("f{}", i - range.start),
            f.src,
            f.dst,
            f.bytes.0,
            deps.join(",")
        )
        .unwrap();
    }
    s
}

fn check_golden(kind: K, alg: A, n: u32, bytes: u64, expect: Expect) {
    let ranks = seq(n);
    let (set, r) = build(kind, alg, &ranks, bytes, 1);
    assert_well_formed(&set, &r, &ranks, kind);
    expect.assert_eq(&render(&set, r));
}

#[test]
fn ring_all_reduce_n4_steps() {
    // 6 steps of 4 flows; step t of rank i waits for its own step t-1 and for rank i-1's.
    // Reduce-scatter: rank i sends chunk i-1-t; all-gather: chunk i-t. 4003 bytes make
    // chunk 3 the short one (1000 bytes against 1001), so the schedule shows in the sizes.
    check_golden(
        K::AllReduce,
        A::Ring { channels: 1 },
        4,
        4003,
        expect![[r#"
            f0  0->1 1000B after []
            f1  1->2 1001B after []
            f2  2->3 1001B after []
            f3  3->0 1001B after []
            f4  0->1 1001B after [0,3]
            f5  1->2 1000B after [0,1]
            f6  2->3 1001B after [1,2]
            f7  3->0 1001B after [2,3]
            f8  0->1 1001B after [4,7]
            f9  1->2 1001B after [4,5]
            f10 2->3 1000B after [5,6]
            f11 3->0 1001B after [6,7]
            f12 0->1 1001B after [8,11]
            f13 1->2 1001B after [8,9]
            f14 2->3 1001B after [9,10]
            f15 3->0 1000B after [10,11]
            f16 0->1 1000B after [12,15]
            f17 1->2 1001B after [12,13]
            f18 2->3 1001B after [13,14]
            f19 3->0 1001B after [14,15]
            f20 0->1 1001B after [16,19]
            f21 1->2 1000B after [16,17]
            f22 2->3 1001B after [17,18]
            f23 3->0 1001B after [18,19]
        "#]],
    );
}

#[test]
fn ring_all_gather_two_channels_n4() {
    check_golden(
        K::AllGather,
        A::Ring { channels: 2 },
        4,
        800,
        expect![[r#"
            f0  0->1 100B after []
            f1  1->2 100B after []
            f2  2->3 100B after []
            f3  3->0 100B after []
            f4  0->1 100B after [0,3]
            f5  1->2 100B after [0,1]
            f6  2->3 100B after [1,2]
            f7  3->0 100B after [2,3]
            f8  0->1 100B after [4,7]
            f9  1->2 100B after [4,5]
            f10 2->3 100B after [5,6]
            f11 3->0 100B after [6,7]
            f12 0->1 100B after []
            f13 1->2 100B after []
            f14 2->3 100B after []
            f15 3->0 100B after []
            f16 0->1 100B after [12,15]
            f17 1->2 100B after [12,13]
            f18 2->3 100B after [13,14]
            f19 3->0 100B after [14,15]
            f20 0->1 100B after [16,19]
            f21 1->2 100B after [16,17]
            f22 2->3 100B after [17,18]
            f23 3->0 100B after [18,19]
        "#]],
    );
}

#[test]
fn chained_broadcast_pipelines_chunks() {
    // 1 MiB in two 512 KiB chunks along 0 -> 1 -> 2.
    check_golden(
        K::Broadcast,
        A::Ring { channels: 1 },
        3,
        1 << 20,
        expect![[r#"
            f0  0->1 524288B after []
            f1  1->2 524288B after [0]
            f2  0->1 524288B after [0]
            f3  1->2 524288B after [1,2]
        "#]],
    );
}

#[test]
fn double_binary_tree_all_reduce_n4() {
    check_golden(
        K::AllReduce,
        A::DoubleBinaryTree,
        4,
        1000,
        expect![[r#"
            f0  3->2 500B after []
            f1  1->2 500B after []
            f2  2->0 500B after [0,1]
            f3  0->2 500B after [2]
            f4  2->1 500B after [3]
            f5  2->3 500B after [3]
            f6  2->1 500B after []
            f7  0->1 500B after []
            f8  1->3 500B after [6,7]
            f9  3->1 500B after [8]
            f10 1->0 500B after [9]
            f11 1->2 500B after [9]
        "#]],
    );
}

#[test]
fn halving_doubling_all_reduce_n4() {
    check_golden(
        K::AllReduce,
        A::HalvingDoubling,
        4,
        4000,
        expect![[r#"
            f0  0->2 2000B after []
            f1  1->3 2000B after []
            f2  2->0 2000B after []
            f3  3->1 2000B after []
            f4  0->1 1000B after [0,2]
            f5  1->0 1000B after [1,3]
            f6  2->3 1000B after [0,2]
            f7  3->2 1000B after [1,3]
            f8  0->1 1000B after [4,5]
            f9  1->0 1000B after [4,5]
            f10 2->3 1000B after [6,7]
            f11 3->2 1000B after [6,7]
            f12 0->2 2000B after [8,9]
            f13 1->3 2000B after [8,9]
            f14 2->0 2000B after [10,11]
            f15 3->1 2000B after [10,11]
        "#]],
    );
}

#[test]
fn ring_all_reduce_moves_2_n_minus_1_over_n_per_rank() {
    for n in 2..=9u32 {
        for channels in [1, 2, 4] {
            let s = u64::from(n) * u64::from(channels) * 1000;
            let ranks = seq(n);
            let (set, r) = build(K::AllReduce, A::Ring { channels }, &ranks, s, 1);
            assert_well_formed(&set, &r, &ranks, K::AllReduce);
            let n64 = u64::from(n);
            for sent in sent_per_rank(&set, r.clone(), &ranks) {
                assert_eq!(sent, 2 * (n64 - 1) * s / n64);
            }
            assert_eq!(r.len() as u64, u64::from(channels) * 2 * (n64 - 1) * n64);
            assert_eq!(critical_path(&set, r), 2 * (n as usize - 1));
        }
    }
}

#[test]
fn all_to_all_has_n_times_n_minus_1_independent_flows() {
    for n in 1..=12u32 {
        let ranks: Vec<u32> = (0..n).map(|i| 3 * i + 1).collect();
        let (set, r) = build(K::AllToAll, A::Direct, &ranks, 120 * u64::from(n), 1);
        assert_well_formed(&set, &r, &ranks, K::AllToAll);
        assert_eq!(r.len(), (n * n.saturating_sub(1)) as usize);
        assert!(set.flows[r.clone()].iter().all(|f| f.deps.is_empty()));
        let mut pairs: Vec<(u32, u32)> = set.flows[r.clone()]
            .iter()
            .map(|f| (f.src, f.dst))
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        assert_eq!(pairs.len(), r.len(), "each ordered pair once");
        for sent in sent_per_rank(&set, r, &ranks) {
            assert_eq!(sent, 120 * u64::from(n.saturating_sub(1)));
        }
    }
}

#[test]
fn double_binary_trees_span_and_balance() {
    for n in 1..=200usize {
        for tree in double_binary_tree(n) {
            assert_eq!(tree.parent.len(), n);
            assert_eq!(tree.parent[tree.root], None);
            let order = tree.top_down();
            assert_eq!(order.len(), n, "spanning, n = {n}");
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
            for v in 0..n {
                assert!(tree.children[v].len() <= 2);
                for &c in &tree.children[v] {
                    assert_eq!(tree.parent[c], Some(v));
                }
            }
            // Depth is logarithmic.
            let mut depth = vec![0usize; n];
            for &v in &order {
                if let Some(p) = tree.parent[v] {
                    depth[v] = depth[p] + 1;
                }
            }
            let max = depth.iter().max().copied().unwrap_or(0);
            assert!(
                max <= 2 + (n as f64).log2().ceil() as usize,
                "n = {n}, depth {max}"
            );
        }
        // Even n: no rank has children in both trees (inner in one, leaf in the other).
        if n % 2 == 0 {
            let [a, b] = double_binary_tree(n);
            for v in 0..n {
                assert!(
                    a.children[v].is_empty() || b.children[v].is_empty(),
                    "n = {n}, v = {v}"
                );
            }
        }
    }
}

#[test]
fn halving_doubling_non_power_of_two() {
    // n = 6: p = 4, r = 2; 1 -> 0 and 3 -> 2 fold in, then back out.
    let ranks = seq(6);
    let s = 4000u64;
    let (set, r) = build(K::AllReduce, A::HalvingDoubling, &ranks, s, 1);
    assert_well_formed(&set, &r, &ranks, K::AllReduce);
    let sent = sent_per_rank(&set, r.clone(), &ranks);
    assert_eq!(sent.iter().sum::<u64>(), 2 * 2 * s + 2 * 3 * s);
    assert_eq!(sent[1], s, "a folded rank sends its buffer once");
    assert_eq!(sent[3], s);
    assert_eq!(
        sent[0],
        s + 2 * 3 * s / 4,
        "its partner also returns the result"
    );
    assert_eq!(sent[4], 2 * 3 * s / 4);
    assert_eq!(critical_path(&set, r), 1 + 2 * 2 + 1);
    for kind in [K::AllGather, K::ReduceScatter] {
        let mut set = FlowSet::default();
        assert_eq!(
            collective_flows(
                &mut set,
                "x",
                kind,
                A::HalvingDoubling,
                &ranks,
                Bytes(s),
                1,
                LAT
            ),
            Err(FlowError::Unsupported {
                algorithm: A::HalvingDoubling,
                kind
            })
        );
        assert!(set.flows.is_empty() && set.collectives.is_empty());
    }
}

#[test]
fn hierarchical_keeps_inter_host_traffic_on_matching_local_indices() {
    // 3 hosts x 4 ranks (8 endpoints per host, ranks on local GPUs 0..4), listed in an
    // interleaved order.
    let eph = 8usize;
    let mut ranks = Vec::new();
    for l in 0..4u32 {
        for h in 0..3u32 {
            ranks.push(h * 8 + l);
        }
    }
    let s = 12 * 1000u64;
    for kind in [K::AllReduce, K::AllGather, K::ReduceScatter] {
        let (set, r) = build(kind, A::Hierarchical, &ranks, s, eph);
        assert_well_formed(&set, &r, &ranks, kind);
        for f in &set.flows[r.clone()] {
            if f.src / 8 != f.dst / 8 {
                assert_eq!(f.src % 8, f.dst % 8, "{kind:?}: {} -> {}", f.src, f.dst);
            }
        }
        let (h, l) = (3u64, 4u64);
        let expected = match kind {
            K::AllReduce => 2 * (l - 1) * s / l + 2 * (h - 1) * (s / l) / h,
            _ => (h * l - 1) * s / (h * l),
        };
        for sent in sent_per_rank(&set, r.clone(), &ranks) {
            assert_eq!(sent, expected, "{kind:?}");
        }
        let steps = match kind {
            K::AllReduce => 2 * (l - 1) + 2 * (h - 1),
            _ => (l - 1) + (h - 1),
        };
        assert_eq!(critical_path(&set, r) as u64, steps, "{kind:?}");
    }
}

#[test]
fn rejected_inputs_leave_the_set_untouched() {
    let mut set = FlowSet::default();
    let mut call = |kind, alg, ranks: &[u32], eph| {
        collective_flows(&mut set, "x", kind, alg, ranks, Bytes(1 << 20), eph, LAT)
    };
    let unsupported = |algorithm, kind| Err(FlowError::Unsupported { algorithm, kind });
    assert_eq!(
        call(K::AllReduce, A::Ring { channels: 1 }, &[], 1),
        Err(FlowError::NoRanks)
    );
    assert_eq!(
        call(K::AllReduce, A::Ring { channels: 1 }, &[1, 2, 1], 1),
        Err(FlowError::DuplicateRank { rank: 1 })
    );
    assert_eq!(
        call(K::AllGather, A::Ring { channels: 0 }, &[0, 1], 1),
        Err(FlowError::NoChannels)
    );
    let r = [0, 1, 2, 3];
    for (alg, kind) in [
        (A::Ring { channels: 2 }, K::AllToAll),
        (A::DoubleBinaryTree, K::AllGather),
        (A::DoubleBinaryTree, K::Broadcast),
        (A::HalvingDoubling, K::AllToAll),
        (A::HalvingDoubling, K::Reduce),
        (A::Direct, K::AllReduce),
        (A::Hierarchical, K::AllToAll),
        (A::Hierarchical, K::Broadcast),
    ] {
        assert_eq!(
            call(kind, alg, &r, 1),
            unsupported(alg, kind),
            "{alg:?} {kind:?}"
        );
    }
    // Hosts with different numbers of ranks.
    assert_eq!(
        call(K::AllReduce, A::Hierarchical, &[0, 1, 2, 4], 4),
        unsupported(A::Hierarchical, K::AllReduce)
    );
    // Absurd sizes are errors, not allocations.
    let many: Vec<u32> = (0..5000).collect();
    assert!(matches!(
        call(K::AllReduce, A::Ring { channels: 64 }, &many, 1),
        Err(FlowError::TooManyFlows { .. })
    ));
    assert!(set.flows.is_empty() && set.collectives.is_empty());
}

#[test]
fn a_single_rank_adds_no_flows_but_records_the_collective() {
    let mut set = FlowSet::default();
    let r = collective_flows(
        &mut set,
        "solo",
        K::AllReduce,
        A::Ring { channels: 4 },
        &[7],
        Bytes(100),
        8,
        LAT,
    )
    .unwrap();
    assert!(r.is_empty());
    assert_eq!(set.collectives.len(), 1);
    assert_eq!(set.collectives[0].name, "solo");
}

#[test]
fn small_buffers_use_fewer_channels() {
    // 6 bytes over 4 ranks: one channel, chunks of 2,2,1,1 bytes.
    let ranks = seq(4);
    let (set, r) = build(K::AllReduce, A::Ring { channels: 8 }, &ranks, 6, 1);
    assert_eq!(r.len(), 2 * 3 * 4);
    let total: u64 = set.flows[r].iter().map(|f| f.bytes.0).sum();
    assert_eq!(total, 2 * 3 * 6);
}

/// Every supported (algorithm, kind) pair on `n` ranks with its theory.
fn theory(kind: K, alg: A, n: u64, s: u64, ranks_sent: &[u64]) {
    let total: u64 = ranks_sent.iter().sum();
    let divisible = |d: u64| s.is_multiple_of(d);
    match (alg, kind) {
        (A::Ring { channels }, K::AllReduce) => {
            let c = u64::from(channels).min((s / n).max(1));
            assert_eq!(total, 2 * (n - 1) * s);
            for &x in ranks_sent {
                let ideal = 2.0 * (n - 1) as f64 * s as f64 / n as f64;
                assert!((x as f64 - ideal).abs() < 2.0 * c as f64 + 1e-9);
                if divisible(n * c) {
                    assert_eq!(x, 2 * (n - 1) * s / n);
                }
            }
        }
        (A::Ring { channels }, K::AllGather | K::ReduceScatter) => {
            let c = u64::from(channels).min((s / n).max(1));
            assert_eq!(total, (n - 1) * s);
            for &x in ranks_sent {
                let ideal = (n - 1) as f64 * s as f64 / n as f64;
                assert!((x as f64 - ideal).abs() < c as f64 + 1e-9);
                if divisible(n * c) {
                    assert_eq!(x, (n - 1) * s / n);
                }
            }
        }
        (A::Ring { .. }, K::Broadcast) => {
            let want: Vec<u64> = (0..n).map(|i| if i + 1 < n { s } else { 0 }).collect();
            assert_eq!(ranks_sent, want);
        }
        (A::Ring { .. }, K::Reduce) => {
            let want: Vec<u64> = (0..n).map(|i| if i > 0 { s } else { 0 }).collect();
            assert_eq!(ranks_sent, want);
        }
        (A::DoubleBinaryTree, K::AllReduce) => {
            assert_eq!(total, 2 * (n - 1) * s);
            let halves = [s.div_ceil(2), s / 2];
            let trees = double_binary_tree(n as usize);
            for (v, &x) in ranks_sent.iter().enumerate() {
                let want: u64 = trees
                    .iter()
                    .zip(halves)
                    .map(|(t, h)| {
                        h * (u64::from(t.parent[v].is_some()) + t.children[v].len() as u64)
                    })
                    .sum();
                assert_eq!(x, want);
                assert!(x <= 2 * s + 2);
            }
        }
        (A::HalvingDoubling, K::AllReduce) => {
            let p = 1u64 << (63 - n.leading_zeros());
            let r = n - p;
            assert_eq!(total, 2 * r * s + 2 * (p - 1) * s);
            if r == 0 && divisible(n) {
                assert!(ranks_sent.iter().all(|&x| x == 2 * (n - 1) * s / n));
            }
        }
        (A::HalvingDoubling, K::AllGather | K::ReduceScatter) | (A::Direct, K::AllToAll) => {
            assert_eq!(total, (n - 1) * s);
            if divisible(n) {
                assert!(ranks_sent.iter().all(|&x| x == (n - 1) * s / n));
            }
        }
        other => panic!("no theory for {other:?}"),
    }
}

fn algorithms() -> impl Strategy<Value = (A, K)> {
    prop_oneof![
        (
            1u32..5,
            prop_oneof![
                Just(K::AllReduce),
                Just(K::AllGather),
                Just(K::ReduceScatter),
                Just(K::Broadcast),
                Just(K::Reduce)
            ]
        )
            .prop_map(|(channels, k)| (A::Ring { channels }, k)),
        Just((A::DoubleBinaryTree, K::AllReduce)),
        Just((A::HalvingDoubling, K::AllReduce)),
        Just((A::HalvingDoubling, K::AllGather)),
        Just((A::HalvingDoubling, K::ReduceScatter)),
        Just((A::Direct, K::AllToAll)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// ECMP connections (`connection_numbers`) are dependency chains: the flows of one
    /// collective between two endpoints on one connection each depend on the one before,
    /// a pair's connections are numbered from 0 without gaps, and a ring keeps a pair's
    /// steps on no more connections than it has channels (one per channel that uses the
    /// pair), both halves of an all-reduce included.
    #[test]
    fn connections_are_dependency_chains(
        (alg, kind) in algorithms(),
        n in 1u64..13,
        s in prop_oneof![1u64..100, 1000u64..5_000_000],
    ) {
        let n = if matches!(alg, A::HalvingDoubling) && kind != K::AllReduce {
            1u64 << (63 - n.leading_zeros())
        } else {
            n
        };
        let ranks: Vec<u32> = (0..n as u32).collect();
        let (set, r) = build(kind, alg, &ranks, s, 4);
        let connection = orrery_net::flow_model::connection_numbers(&set);
        let mut on: std::collections::BTreeMap<(u32, u32, u32), Vec<Vec<usize>>> =
            Default::default();
        for i in r {
            let f = &set.flows[i];
            let per_pair = on.entry((f.collective, f.src, f.dst)).or_default();
            if per_pair.len() <= connection[i] {
                per_pair.resize(connection[i] + 1, Vec::new());
            }
            per_pair[connection[i]].push(i);
        }
        for (pair, connections) in &on {
            for chain in connections {
                prop_assert!(!chain.is_empty(), "a gap in the numbers of {:?}", pair);
                for w in chain.windows(2) {
                    prop_assert!(
                        set.flows[w[1]].deps.iter().any(|d| d.index() == w[0]),
                        "flow {} does not depend on flow {} before it on {:?}", w[1], w[0], pair
                    );
                }
            }
            if let A::Ring { channels } = alg {
                prop_assert!(connections.len() <= channels as usize, "{:?}", pair);
            }
        }
    }

    /// Bytes sent per rank match each algorithm's theory, for any group size and buffer
    /// (exactly when the buffer divides evenly, within rounding otherwise), and the
    /// dependencies only point backwards.
    #[test]
    fn byte_totals_match_theory(
        (alg, kind) in algorithms(),
        n in 1u64..13,
        s in prop_oneof![0u64..100, 1000u64..5_000_000, Just(3 << 20)],
        even in any::<bool>(),
    ) {
        let s = if even { s - s % (n * 8 * 2) } else { s };
        let n = if matches!(alg, A::HalvingDoubling) && kind != K::AllReduce {
            1u64 << (63 - n.leading_zeros())
        } else {
            n
        };
        let ranks: Vec<u32> = (0..n as u32).map(|i| 2 * i).collect();
        let (set, r) = build(kind, alg, &ranks, s, 1);
        assert_well_formed(&set, &r, &ranks, kind);
        let sent = sent_per_rank(&set, r.clone(), &ranks);
        if n == 1 {
            prop_assert!(r.is_empty());
        } else {
            theory(kind, alg, n, s, &sent);
        }
    }

    /// Hierarchical: per-rank bytes are the intra-host phases plus the inter-host phase.
    #[test]
    fn hierarchical_byte_totals(
        h in 1u64..5,
        l in 1u64..5,
        kind in prop_oneof![Just(K::AllReduce), Just(K::AllGather), Just(K::ReduceScatter)],
        s in 0u64..1_000_000,
    ) {
        let eph = 8usize;
        let ranks: Vec<u32> = (0..h)
            .flat_map(|host| (0..l).map(move |j| (host * 8 + j) as u32))
            .collect();
        let (set, r) = build(kind, A::Hierarchical, &ranks, s, eph);
        assert_well_formed(&set, &r, &ranks, kind);
        let sent = sent_per_rank(&set, r, &ranks);
        let total: u64 = sent.iter().sum();
        match kind {
            K::AllReduce => prop_assert_eq!(total, 2 * h * (l - 1) * s + 2 * (h - 1) * s),
            _ => prop_assert_eq!(total, (h * l - 1) * s),
        }
        let s_even = s - s % (h * l);
        if s == s_even {
            let want = match kind {
                K::AllReduce => 2 * (l - 1) * s / l + 2 * (h - 1) * (s / l) / h,
                _ => (h * l - 1) * s / (h * l),
            };
            prop_assert!(sent.iter().all(|&x| x == want));
        }
    }
}

#[test]
fn host_tree_all_reduce_on_two_hosts_of_two() {
    // Hosts {0, 1} and {2, 3}: each chain reduces towards its head (1 -> 0, 3 -> 2), the
    // heads meet across hosts, and the sum goes back down each chain; one tree per half.
    let ranks = seq(4);
    let (set, range) = build(K::AllReduce, A::HostTree, &ranks, 1000, 2);
    assert_well_formed(&set, &range, &ranks, K::AllReduce);
    expect![[r#"
        f0  3->2 500B after []
        f1  2->0 500B after [0]
        f2  1->0 500B after []
        f3  0->2 500B after [1,2]
        f4  0->1 500B after [1,2]
        f5  2->3 500B after [3]
        f6  1->0 500B after []
        f7  0->2 500B after [6]
        f8  3->2 500B after []
        f9  2->0 500B after [7,8]
        f10 2->3 500B after [7,8]
        f11 0->1 500B after [9]
    "#]]
    .assert_eq(&render(&set, range));
}

#[test]
fn host_trees_cross_hosts_only_between_heads_and_send_as_much_as_the_rank_tree() {
    // Four hosts of four: inside a host only chain neighbours talk, across hosts only
    // heads (each host's first rank), and the flow count is the rank tree's, 2(n-1) per
    // tree and chunk.
    for bytes in [4u64, 64 << 20] {
        let ranks = seq(16);
        let (set, range) = build(K::AllReduce, A::HostTree, &ranks, bytes, 4);
        assert_well_formed(&set, &range, &ranks, K::AllReduce);
        for f in &set.flows[range.clone()] {
            let (hs, hd) = (f.src / 4, f.dst / 4);
            if hs == hd {
                assert_eq!(f.src.abs_diff(f.dst), 1, "{f:?}");
            } else {
                assert!(f.src % 4 == 0 && f.dst % 4 == 0, "{f:?}");
            }
        }
        let (tree_set, tree_range) = build(K::AllReduce, A::DoubleBinaryTree, &ranks, bytes, 4);
        assert_eq!(range.len(), tree_range.len());
        let total =
            |s: &FlowSet, r: Range<usize>| s.flows[r].iter().map(|f| f.bytes.0).sum::<u64>();
        assert_eq!(total(&set, range), total(&tree_set, tree_range));
    }
}

#[test]
fn dependency_order_puts_dependencies_first_and_breaks_ties_by_id() {
    // 0 <- 2, 1 <- 2, 3 alone; 2 waits for 0 and 1.
    let deps = |i: usize| match i {
        2 => vec![0, 1],
        _ => Vec::new(),
    };
    use orrery_net::flows::dependency_order;
    assert_eq!(dependency_order(4, deps, false), Some(vec![0, 1, 2, 3]));
    assert_eq!(dependency_order(4, deps, true), Some(vec![3, 1, 0, 2]));
    // A cycle has no such order.
    let cycle = |i: usize| vec![(i + 1) % 3];
    assert_eq!(dependency_order(3, cycle, false), None);
}

#[test]
fn pxn_all_to_all_on_two_hosts_of_two_relays_cross_rail_blocks() {
    // Hosts {0, 1} and {2, 3}, two GPUs (rails) each. 0 -> 3 crosses host and rail, so it
    // goes 0 -> 1 over NVLink and 1 -> 3 on rail 1; 0 -> 2 is on rail 0 already.
    let ranks = seq(4);
    let (set, r) = build(K::AllToAll, A::DirectPxn, &ranks, 400, 2);
    assert_well_formed(&set, &r, &ranks, K::AllToAll);
    expect![[r#"
        f0  0->1 100B after []
        f1  0->2 100B after []
        f2  0->1 100B after []
        f3  1->3 100B after []
        f4  1->0 100B after []
        f5  1->0 100B after []
        f6  0->2 100B after []
        f7  1->3 100B after []
        f8  2->0 100B after []
        f9  2->3 100B after []
        f10 3->1 100B after []
        f11 2->3 100B after []
        f12 3->2 100B after []
        f13 2->0 100B after []
        f14 3->1 100B after []
        f15 3->2 100B after []
    "#]]
    .assert_eq(&render(&set, r));
}

/// Bytes each endpoint receives from each host, over flows that end there.
fn received_from_hosts(set: &FlowSet, range: Range<usize>, eph: u32) -> Vec<(u32, u32, u64)> {
    let mut got = std::collections::BTreeMap::new();
    for f in &set.flows[range] {
        if f.src / eph != f.dst / eph {
            *got.entry((f.dst, f.src / eph)).or_insert(0) += f.bytes.0;
        }
    }
    got.into_iter().map(|((d, h), b)| (d, h, b)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// PXN moves exactly the blocks `Direct` moves between hosts, each on its destination's
    /// rail wherever the group has a relay there (and directly only where it has none),
    /// with one extra NVLink flow per relayed block; on one host, or with one GPU per host,
    /// it is `Direct`.
    #[test]
    fn pxn_all_to_all_carries_direct_blocks_on_their_rails(
        picks in proptest::collection::btree_set(0u32..24, 1..12),
        eph in prop_oneof![Just(1u32), Just(2), Just(4), Just(8)],
        s in 0u64..100_000,
    ) {
        let ranks: Vec<u32> = picks.into_iter().collect();
        let (direct, rd) = build(K::AllToAll, A::Direct, &ranks, s, eph as usize);
        let (pxn, rp) = build(K::AllToAll, A::DirectPxn, &ranks, s, eph as usize);
        assert_well_formed(&pxn, &rp, &ranks, K::AllToAll);
        prop_assert!(pxn.flows[rp.clone()].iter().all(|f| f.deps.is_empty()));
        let relay_exists = |src: u32, dst: u32| {
            ranks.iter().any(|&p| p / eph == src / eph && p % eph == dst % eph)
        };
        let mut relayed = 0;
        for f in &direct.flows[rd.clone()] {
            if f.src / eph != f.dst / eph && f.src % eph != f.dst % eph && relay_exists(f.src, f.dst) {
                relayed += 1;
            }
        }
        prop_assert_eq!(rp.len(), rd.len() + relayed);
        for f in &pxn.flows[rp.clone()] {
            if f.src / eph != f.dst / eph && f.src % eph != f.dst % eph {
                prop_assert!(!relay_exists(f.src, f.dst), "{} -> {} crosses rails", f.src, f.dst);
            }
        }
        prop_assert_eq!(
            received_from_hosts(&pxn, rp.clone(), eph),
            received_from_hosts(&direct, rd.clone(), eph)
        );
        if eph == 1 || ranks.iter().all(|&r| r / eph == ranks[0] / eph) {
            prop_assert_eq!(&pxn.flows[rp], &direct.flows[rd]);
        }
    }
}

#[test]
fn pxn_keeps_an_expert_all_to_all_off_the_spines() {
    use orrery_net::topology::{NetGraph, NodeKind, RailOptimizedSpec};
    // An expert-parallel group as Megatron places it with TP 2: the even GPUs of two
    // hosts. Direct, 24 of its 32 blocks between hosts cross rails through a spine.
    let graph = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(2)).unwrap();
    let ranks: Vec<u32> = [0, 2, 4, 6, 8, 10, 12, 14].into();
    let spine_flows = |alg| {
        let (set, r) = build(K::AllToAll, alg, &ranks, 8 << 20, 8);
        set.flows[r]
            .iter()
            .filter(|f| {
                let route = graph.route(f.src as usize, f.dst as usize, 0).unwrap();
                route.iter().any(|&l| {
                    let link = graph.link(l);
                    graph.kind(link.from) == NodeKind::Spine
                        || graph.kind(link.to) == NodeKind::Spine
                })
            })
            .count()
    };
    assert_eq!(spine_flows(A::Direct), 24);
    assert_eq!(spine_flows(A::DirectPxn), 0);
}
