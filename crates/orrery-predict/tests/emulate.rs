//! Hybrid emulation's engine: live ranks fed the models' own durations reproduce the
//! replay, pruning changes nothing for the materialized ranks, perturbations slow exactly
//! what they name, and bad input is reported all at once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::small_job;
use orrery_graph::{build, OpKind};
use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_predict::emulate::{
    DegradedLink, EmulateError, Emulation, EmulationStep, Perturbations, Pruning, SlowRanks,
};
use orrery_predict::replay::{replay, ReplayMode, Timeline};
use orrery_predict::{fabric_for, CostModel};
use orrery_units::{Picos, RankId};
use proptest::prelude::*;

fn layouts() -> impl Strategy<Value = Vec<String>> {
    (
        prop_oneof![Just(1u64), Just(2)],
        prop_oneof![Just(1u64), Just(2), Just(4)],
        prop_oneof![Just(1u64), Just(2)],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0u64..4,
    )
        .prop_map(|(tp, pp, dp, interleave, overlap, tied, zero)| {
            let vpp = if interleave && pp > 1 { 2 } else { 1 };
            let world = tp * pp * dp;
            vec![
                format!("parallel.tp={tp}"),
                format!("parallel.pp={pp}"),
                format!("parallel.dp={dp}"),
                format!("parallel.vpp={vpp}"),
                format!("parallel.overlap_grad_reduce={overlap}"),
                format!("parallel.tp_comm_overlap={overlap}"),
                "parallel.bucket_mparams=1".to_string(),
                format!("training.zero_stage={zero}"),
                format!("training.global_batch={}", 4 * dp * pp),
                format!("cluster.gpus_per_node={}", world.min(4)),
                format!("cluster.nodes={}", world.div_ceil(4)),
                "model.layers=8".to_string(),
                format!("model.tied_embeddings={tied}"),
            ]
        })
}

/// Two data-parallel ranks on one node.
const DP2: [&str; 5] = [
    "parallel.dp=2",
    "parallel.tp=1",
    "parallel.pp=1",
    "cluster.gpus_per_node=2",
    "cluster.nodes=1",
];

fn owned(overrides: &[&str]) -> Vec<String> {
    overrides.iter().map(|s| s.to_string()).collect()
}

fn timing_of(t: &Timeline, rank: RankId) -> Vec<(Picos, Picos)> {
    t.participants
        .iter()
        .find(|p| p.rank == rank)
        .map(|p| p.ops.iter().map(|o| (o.start, o.end)).collect())
        .unwrap()
}

/// Emulates with the live ranks fed the models' own durations.
fn emulate_modelled(
    overrides: &[String],
    live: &[RankId],
    pruning: Pruning,
    perturb: &Perturbations,
) -> (Timeline, usize) {
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let job = small_job(&refs);
    let graphs = build(&job);
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    let emu = Emulation::new(&graphs, &cost, &net, live, pruning, perturb).unwrap();
    let n = emu.participants().len();
    (emu.run_with(|_, _, modelled| modelled).unwrap(), n)
}

fn all_rank_replay(overrides: &[String]) -> Timeline {
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let job = small_job(&refs);
    let graphs = build(&job);
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    replay(&graphs, &cost, &net, ReplayMode::AllRanks).unwrap()
}

/// The timeline of `rank` in an emulation: its own participant's, or that of the
/// participant standing for it (the lowest rank of its timeline class, which the pruned
/// emulation replays).
fn timing_in(
    t: &Timeline,
    rank: RankId,
    stands_for: &dyn Fn(RankId) -> RankId,
) -> Vec<(Picos, Picos)> {
    timing_of(t, stands_for(rank))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Live ranks given the cost model's durations run exactly as in the all-rank replay,
    /// pruned or not, and so does every other rank when nothing is pruned.
    #[test]
    fn modelled_durations_reproduce_the_replay(overrides in layouts(), pick in 0u32..64) {
        let reference = all_rank_replay(&overrides);
        let world = reference.participants.len() as u32;
        let live = [RankId(pick % world), RankId(world - 1)];
        let (unpruned, _) = emulate_modelled(&overrides, &live, Pruning::None, &Perturbations::default());
        prop_assert_eq!(unpruned.step_time(), reference.step_time());
        for r in 0..world {
            prop_assert_eq!(timing_of(&unpruned, RankId(r)), timing_of(&reference, RankId(r)));
        }
        let (pruned, _) = emulate_modelled(&overrides, &live, Pruning::Classes, &Perturbations::default());
        for r in live {
            prop_assert_eq!(timing_of(&pruned, r), timing_of(&reference, r), "rank {}", r.0);
        }
        prop_assert_eq!(pruned.step_time(), reference.step_time());
    }

    /// Pruning is exact under perturbations too: every rank's timeline in the pruned
    /// emulation (through the participant standing for it) equals the unpruned one.
    #[test]
    fn pruned_equals_unpruned_under_perturbations(
        overrides in layouts(),
        live_pick in 0u32..64,
        slow_pick in 0u32..64,
        link_pick in 0u32..64,
        factor in 1.1f64..3.0,
        window in any::<bool>(),
    ) {
        let reference = all_rank_replay(&overrides);
        let world = reference.participants.len() as u32;
        let mid = Picos(reference.step_time().0 / 3);
        let perturb = Perturbations {
            slow: vec![SlowRanks {
                ranks: vec![RankId(slow_pick % world)],
                factor,
                from: if window { mid } else { Picos::ZERO },
                until: None,
            }],
            links: vec![DegradedLink { rank: RankId(link_pick % world), factor: 2.0 }],
        };
        let live = [RankId(live_pick % world)];
        let (unpruned, _) = emulate_modelled(&overrides, &live, Pruning::None, &perturb);
        let (pruned, stands_for) = emulate_with_map(&overrides, &live, &perturb);
        prop_assert_eq!(pruned.step_time(), unpruned.step_time());
        for r in 0..world {
            prop_assert_eq!(
                timing_in(&pruned, RankId(r), &|x| stands_for[x.index()]),
                timing_of(&unpruned, RankId(r)),
                "rank {}", r
            );
        }
    }
}

/// A pruned emulation fed the models' durations, and for each rank the rank whose
/// participant stands for it.
fn emulate_with_map(
    overrides: &[String],
    live: &[RankId],
    perturb: &Perturbations,
) -> (Timeline, Vec<RankId>) {
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let job = small_job(&refs);
    let graphs = build(&job);
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    let emu = Emulation::new(&graphs, &cost, &net, live, Pruning::Classes, perturb).unwrap();
    let map = (0..graphs.layout.world_size())
        .map(|r| emu.stands_for(RankId(r)))
        .collect();
    (emu.run_with(|_, _, modelled| modelled).unwrap(), map)
}

#[test]
fn pruned_emulation_grows_with_timeline_classes_not_with_the_world() {
    let job = |dp: u64| -> Vec<String> {
        vec![
            "parallel.tp=2".to_string(),
            "parallel.pp=2".to_string(),
            format!("parallel.dp={dp}"),
            format!("training.global_batch={}", 4 * dp),
            "cluster.gpus_per_node=8".to_string(),
            format!("cluster.nodes={}", dp / 2),
        ]
    };
    let live = [RankId(0), RankId(17)];
    let perturb = Perturbations {
        slow: vec![SlowRanks {
            ranks: vec![RankId(6)],
            factor: 1.5,
            from: Picos::ZERO,
            until: None,
        }],
        links: vec![],
    };
    let (_, at_32) = emulate_modelled(&job(32), &live, Pruning::Classes, &perturb);
    let (pruned, at_64) = emulate_modelled(&job(64), &live, Pruning::Classes, &perturb);
    // The same participants for 128 and 256 GPUs: the live and perturbed ranks and the
    // classes of ranks that relate to them alike.
    assert_eq!(at_32, at_64);
    assert!(at_64 < 20, "{at_64} participants");
    let (unpruned, all) = emulate_modelled(&job(64), &live, Pruning::None, &perturb);
    assert_eq!(all, 256);
    assert_eq!(pruned.step_time(), unpruned.step_time());
    for r in live {
        assert_eq!(timing_of(&pruned, r), timing_of(&unpruned, r));
    }
}

fn compute_durations(t: &Timeline, rank: RankId, overrides: &[String]) -> Vec<Picos> {
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let job = small_job(&refs);
    let graphs = build(&job);
    let class = graphs.layout.class_of(rank);
    let ops = graphs.class(class).ops();
    timing_of(t, rank)
        .into_iter()
        .zip(ops)
        .filter(|(_, o)| matches!(o.kind, OpKind::Compute { .. }))
        .map(|((s, e), _)| Picos(e.0 - s.0))
        .collect()
}

#[test]
fn a_slowed_rank_and_only_it_computes_slower() {
    let overrides: Vec<String> = owned(&["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]);
    let live = [RankId(0)];
    let slow = RankId(5);
    let perturb = Perturbations {
        slow: vec![SlowRanks {
            ranks: vec![slow],
            factor: 2.0,
            from: Picos::ZERO,
            until: None,
        }],
        links: vec![],
    };
    let (base, _) = emulate_modelled(&overrides, &live, Pruning::None, &Perturbations::default());
    let (slowed, _) = emulate_modelled(&overrides, &live, Pruning::None, &perturb);
    for r in 0..8 {
        let a = compute_durations(&base, RankId(r), &overrides);
        let b = compute_durations(&slowed, RankId(r), &overrides);
        if RankId(r) == slow {
            // Every compute op twice as long (to the picosecond, up to the choice between
            // the overlapped and the plain duration, which depends on timing).
            let longer = a.iter().zip(&b).filter(|(x, y)| y.0 > x.0).count();
            assert_eq!(longer, a.len(), "rank {r}");
            let total_a: u64 = a.iter().map(|d| d.0).sum();
            let total_b: u64 = b.iter().map(|d| d.0).sum();
            assert!(
                total_b as f64 >= 1.9 * total_a as f64,
                "{total_a} -> {total_b}"
            );
        } else {
            let sum = |v: &[Picos]| v.iter().map(|d| d.0).sum::<u64>() as f64;
            // Others only wait: their compute is at most marginally different (overlap
            // with communication can change when their comm streams are busy).
            assert!((sum(&b) - sum(&a)).abs() <= 0.02 * sum(&a), "rank {r}");
        }
    }
    assert!(slowed.step_time() > base.step_time());
}

#[test]
fn a_slowdown_window_only_touches_ops_starting_inside_it() {
    let overrides: Vec<String> = owned(&DP2);
    let live = [RankId(0)];
    let (base, _) = emulate_modelled(&overrides, &live, Pruning::None, &Perturbations::default());
    let mid = Picos(base.step_time().0 / 2);
    let perturb = Perturbations {
        slow: vec![SlowRanks {
            ranks: vec![RankId(0)],
            factor: 3.0,
            from: mid,
            until: None,
        }],
        links: vec![],
    };
    let (slowed, _) = emulate_modelled(&overrides, &live, Pruning::None, &perturb);
    let before = timing_of(&base, RankId(0));
    let after = timing_of(&slowed, RankId(0));
    let mut unchanged = 0;
    for (i, t) in before
        .iter()
        .enumerate()
        .filter(|(_, (s, e))| *e < mid && *s < mid)
    {
        assert!(after.contains(t), "{t:?} changed");
        // And at the same op, not just somewhere.
        assert_eq!(after[i], *t, "op {i}");
        unchanged += 1;
    }
    assert!(unchanged > 0);
    assert!(slowed.step_time() > base.step_time());
}

#[test]
fn a_degraded_link_slows_its_groups_collectives_by_its_factor() {
    let overrides: Vec<String> = owned(&DP2);
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let job = small_job(&refs);
    let graphs = build(&job);
    let ops = graphs.class(graphs.layout.class_of(RankId(0))).ops();
    let perturb = Perturbations {
        slow: vec![],
        links: vec![DegradedLink {
            rank: RankId(1),
            factor: 2.0,
        }],
    };
    let live = [RankId(0)];
    let (base, _) = emulate_modelled(&overrides, &live, Pruning::None, &Perturbations::default());
    let (slowed, _) = emulate_modelled(&overrides, &live, Pruning::None, &perturb);
    // A collective's time is from the later member's arrival to its end.
    let spans = |t: &Timeline| -> Vec<u64> {
        let a = timing_of(t, RankId(0));
        let b = timing_of(t, RankId(1));
        ops.iter()
            .enumerate()
            .filter(|(_, o)| matches!(o.kind, OpKind::Collective { .. }))
            .map(|(i, _)| a[i].1 .0 - a[i].0 .0.max(b[i].0 .0))
            .collect()
    };
    let (x, y) = (spans(&base), spans(&slowed));
    assert!(!x.is_empty());
    for (a, b) in x.iter().zip(&y) {
        assert!(b.abs_diff(2 * a) <= 1, "{a} -> {b}");
    }
}

#[test]
fn bad_input_is_reported_all_at_once() {
    let job = small_job(&[]);
    let graphs = build(&job);
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    let perturb = Perturbations {
        slow: vec![SlowRanks {
            ranks: vec![RankId(99)],
            factor: 0.0,
            from: Picos(10),
            until: Some(Picos(5)),
        }],
        links: vec![DegradedLink {
            rank: RankId(1),
            factor: f64::NAN,
        }],
    };
    let err = Emulation::new(
        &graphs,
        &cost,
        &net,
        &[RankId(8)],
        Pruning::Classes,
        &perturb,
    )
    .unwrap_err();
    let text = err.to_string();
    for needle in [
        "real ranks: rank 8 is outside a world of 8",
        "slow.ranks: rank 99",
        "slow.factor",
        "slow.until",
        "links.factor",
    ] {
        assert!(text.contains(needle), "{needle} missing from {text}");
    }
    let EmulateError::Many(all) = err else {
        panic!("expected every problem, got {text}");
    };
    assert_eq!(all.len(), 5);
}

#[test]
fn supplying_an_op_that_does_not_wait_is_an_error_and_waiting_ops_repeat() {
    let job = small_job(&[]);
    let graphs = build(&job);
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let net = AnalyticalNetwork::new(fabric_for(&job), AlgorithmChoice::Auto);
    let mut emu = Emulation::new(
        &graphs,
        &cost,
        &net,
        &[RankId(0)],
        Pruning::Classes,
        &Perturbations::default(),
    )
    .unwrap();
    let EmulationStep::Compute {
        participant, op, ..
    } = emu.advance().unwrap()
    else {
        panic!("the live rank computes first");
    };
    // Not supplied: the same op is asked for again.
    let EmulationStep::Compute { op: again, .. } = emu.advance().unwrap() else {
        panic!("still waiting");
    };
    assert_eq!(op, again);
    assert!(matches!(
        emu.supply(participant, op + 1000, Picos(1)),
        Err(EmulateError::NotWaiting { .. })
    ));
    emu.supply(participant, op, Picos(1)).unwrap();
    assert!(matches!(
        emu.supply(participant, op, Picos(1)),
        Err(EmulateError::NotWaiting { .. })
    ));
}

mod collected {
    use orrery_graph::collect::{stitch, RankRecord, RecordedOp};
    use orrery_graph::{CollectiveOp, GroupRole, Layout, MemoryCategory, PeerStage, Phase};
    use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
    use orrery_predict::emulate::{Emulation, Perturbations, Pruning};
    use orrery_predict::CostModel;
    use orrery_units::{Bytes, Picos, RankId};

    /// What a rank of a TP 2 x PP 2 x DP 2 program records: forward, TP all-reduce,
    /// activations to the next stage, backward, gradients back, DP all-reduce. Compute
    /// times differ per stage so that waiting shows.
    fn record(layout: &Layout, rank: u32) -> RankRecord {
        let r = RankId(rank);
        let stage = layout.coords(r).pp;
        let members =
            |role| -> Vec<u32> { layout.group_members(r, role).iter().map(|m| m.0).collect() };
        let compute = |name: &str, phase, us| RecordedOp::Compute {
            name: name.into(),
            phase,
            duration: Picos::from_micros(us),
            memory: None,
        };
        let coll = |role, bytes| RecordedOp::Collective {
            op: CollectiveOp::AllReduce,
            group: members(role),
            role: Some(role),
            bytes: Bytes(bytes),
            duration: Picos::ZERO,
        };
        let next = layout.peer(r, PeerStage::Next).0;
        let prev = layout.peer(r, PeerStage::Prev).0;
        let xfer = |send: bool, peer, tag| {
            if send {
                RecordedOp::Send {
                    peer,
                    bytes: Bytes(1 << 20),
                    tag,
                    duration: Picos::ZERO,
                }
            } else {
                RecordedOp::Recv {
                    peer,
                    bytes: Bytes(1 << 20),
                    tag,
                    duration: Picos::ZERO,
                }
            }
        };
        let f = 300 + 200 * u64::from(stage);
        let mut ops = vec![RecordedOp::Alloc {
            id: 1,
            bytes: Bytes(1 << 30),
            category: MemoryCategory::Activations,
        }];
        if stage == 0 {
            ops.extend([
                compute("forward", Phase::Forward, f),
                coll(GroupRole::Tp, 1 << 22),
                xfer(true, next, 1),
                xfer(false, next, 2),
                compute("backward", Phase::Backward, 2 * f),
            ]);
        } else {
            ops.extend([
                xfer(false, prev, 1),
                compute("forward", Phase::Forward, f),
                coll(GroupRole::Tp, 1 << 22),
                compute("backward", Phase::Backward, 2 * f),
                xfer(true, prev, 2),
            ]);
        }
        ops.push(RecordedOp::Free { id: 1 });
        ops.push(coll(GroupRole::Dp, 1 << 24));
        RankRecord { rank, ops }
    }

    #[test]
    fn collected_graphs_emulate_alike_pruned_or_not() {
        let layout = Layout::from_dims(2, 1, 2, 2, 1, 4);
        // Only one rank per stage need be recorded; recording more checks their symmetry.
        let records: Vec<RankRecord> = (0..8).map(|r| record(&layout, r)).collect();
        let collected = stitch(layout, &records).unwrap();
        let job = super::small_job(&[]);
        let cost = CostModel::for_gpu(&job.cluster().gpu);
        let net = AnalyticalNetwork::new(orrery_predict::fabric_for(&job), AlgorithmChoice::Auto);
        let run = |pruning| {
            let emu = Emulation::collected(
                &collected,
                &cost,
                &net,
                &[RankId(5)],
                pruning,
                &Perturbations::default(),
            )
            .unwrap();
            let n = emu.participants().len();
            // The live rank's compute takes its recorded durations, as the real program
            // would measure them again.
            (emu.run_with(|_, _, recorded| recorded).unwrap(), n)
        };
        let (pruned, n_pruned) = run(Pruning::Classes);
        let (all, n_all) = run(Pruning::None);
        // Eight ranks, one of them live: every rank relates to it differently.
        assert_eq!((n_pruned, n_all), (8, 8));
        let of = |t: &orrery_predict::replay::Timeline, r: u32| {
            t.participants
                .iter()
                .find(|p| p.rank == RankId(r))
                .map(|p| p.ops.clone())
                .unwrap()
        };
        assert_eq!(of(&pruned, 5), of(&all, 5));
        // Stage 1 computes longer, so stage 0 waits for its gradients: the step is at
        // least both stages' compute in sequence.
        let compute_us: u64 = 300 + 600 + 500 + 1000;
        assert!(all.step_time() >= Picos::from_micros(compute_us));
        assert_eq!(pruned.step_time(), all.step_time());
    }
}

/// Stages that do not fill whole nodes: ranks of one stage then differ in whether their
/// pipeline neighbour shares their node, and pruning must keep them apart.
#[test]
fn pruning_is_exact_when_stages_straddle_nodes() {
    for (tp, dp, pp, per_node) in [
        (2u64, 3u64, 4u64, 8u64),
        (1, 3, 2, 2),
        (2, 3, 2, 4),
        (2, 2, 3, 4),
    ] {
        let world = tp * dp * pp;
        let overrides: Vec<String> = vec![
            format!("parallel.tp={tp}"),
            format!("parallel.dp={dp}"),
            format!("parallel.pp={pp}"),
            format!("training.global_batch={}", 4 * dp * pp),
            format!("cluster.gpus_per_node={per_node}"),
            format!("cluster.nodes={}", world / per_node),
            "model.layers=12".to_string(),
        ];
        let live = [RankId(world as u32 - 1)];
        let slow = Perturbations {
            slow: vec![SlowRanks {
                ranks: vec![RankId(1)],
                factor: 1.5,
                from: Picos::ZERO,
                until: None,
            }],
            links: vec![],
        };
        for perturb in [Perturbations::default(), slow] {
            let (unpruned, _) = emulate_modelled(&overrides, &live, Pruning::None, &perturb);
            let (pruned, stands_for) = emulate_with_map(&overrides, &live, &perturb);
            for r in 0..world as u32 {
                assert_eq!(
                    timing_in(&pruned, RankId(r), &|x| stands_for[x.index()]),
                    timing_of(&unpruned, RankId(r)),
                    "tp {tp} dp {dp} pp {pp}, {per_node} per node: rank {r}"
                );
            }
        }
    }
}

#[test]
fn two_degraded_links_in_one_group_take_the_slower_in_either_order() {
    let overrides: Vec<String> = owned(&["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]);
    let links = |a: f64, b: f64| Perturbations {
        slow: vec![],
        links: vec![
            DegradedLink {
                rank: RankId(0),
                factor: a,
            },
            DegradedLink {
                rank: RankId(1),
                factor: b,
            },
        ],
    };
    let (x, _) = emulate_modelled(&overrides, &[RankId(3)], Pruning::Classes, &links(3.0, 1.5));
    let (y, _) = emulate_modelled(&overrides, &[RankId(3)], Pruning::Classes, &links(1.5, 3.0));
    assert_eq!(x.step_time(), y.step_time());
}
