//! The coordinator against the engine fed directly, and its errors for hung, crashed and
//! miscounting real ranks.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_emulate::{Coordinator, CoordinatorError, RankReporter};
use orrery_graph::collect::{stitch, Collected, RankRecord, RecordedOp};
use orrery_graph::{CollectiveOp, GroupRole, Layout, Phase};
use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_predict::emulate::{Emulation, Perturbations, Pruning};
use orrery_predict::CostModel;
use orrery_units::{Bytes, Picos, RankId};
use std::time::Duration;

/// Compute times of a rank's three segments, in microseconds: they differ per rank, so
/// that who waits for whom matters.
fn segments(rank: u32) -> [u64; 3] {
    [100 + 10 * u64::from(rank), 250, 40 + 5 * u64::from(rank)]
}

/// TP 2 x DP 2, one stage: forward, TP all-reduce, backward, DP all-reduce, optimizer.
fn collected() -> Collected {
    let layout = Layout::from_dims(2, 1, 2, 1, 1, 4);
    let records: Vec<RankRecord> = (0..4)
        .map(|rank| {
            let r = RankId(rank);
            let group =
                |role| -> Vec<u32> { layout.group_members(r, role).iter().map(|m| m.0).collect() };
            let [f, b, o] = segments(rank);
            let compute = |name: &str, phase, us| RecordedOp::Compute {
                name: name.into(),
                phase,
                duration: Picos::from_micros(us),
                memory: None,
            };
            let all_reduce = |role, bytes| RecordedOp::Collective {
                op: CollectiveOp::AllReduce,
                group: group(role),
                role: None,
                bytes: Bytes(bytes),
                duration: Picos::ZERO,
            };
            RankRecord {
                rank,
                ops: vec![
                    compute("forward", Phase::Forward, f),
                    all_reduce(GroupRole::Tp, 1 << 20),
                    compute("backward", Phase::Backward, b),
                    all_reduce(GroupRole::Dp, 1 << 24),
                    compute("optimizer", Phase::Optimizer, o),
                ],
            }
        })
        .collect();
    stitch(layout, &records).unwrap()
}

/// The cost model and network of the default job's cluster (H100, 400 Gb/s NICs).
fn models() -> (CostModel, AnalyticalNetwork) {
    let text = orrery_spec::preset_job_text("llama3-70b-h100x1024").unwrap();
    let job = orrery_spec::Job::from_spec(&orrery_spec::load_job_spec(text, &[]).unwrap()).unwrap();
    (
        CostModel::for_gpu(&job.cluster().gpu),
        AnalyticalNetwork::new(orrery_predict::fabric_for(&job), AlgorithmChoice::Auto),
    )
}

/// Runs the coordinated step with real ranks `live`, each rank's thread doing `program`.
fn coordinated(
    live: &[RankId],
    timeout: Duration,
    program: impl Fn(RankReporter) + Send + Sync + Copy + 'static,
) -> Result<orrery_emulate::coordinator::CoordinatedStep, CoordinatorError> {
    let c = collected();
    let (cost, net) = models();
    let emu = Emulation::collected(
        &c,
        &cost,
        &net,
        live,
        Pruning::Classes,
        &Perturbations::default(),
    )
    .unwrap();
    let (coordinator, reporters) = Coordinator::new(emu, timeout);
    let threads: Vec<_> = reporters
        .into_iter()
        .map(|r| std::thread::spawn(move || program(r)))
        .collect();
    let out = coordinator.run();
    for t in threads {
        let _ = t.join();
    }
    out
}

/// A real rank that does its recorded segments.
fn faithful(r: RankReporter) {
    for us in segments(r.rank().0) {
        if r.segment(Picos::from_micros(us)).is_err() {
            return;
        }
    }
    let _ = r.done();
}

#[test]
fn reports_drive_the_engine_as_supplying_the_durations_does() {
    let live = [RankId(0), RankId(3)];
    let step = coordinated(&live, Duration::from_secs(30), faithful).unwrap();
    let c = collected();
    let (cost, net) = models();
    // The same step with each real rank's own segments supplied directly.
    let mut next = std::collections::HashMap::<u32, usize>::new();
    let direct = Emulation::collected(
        &c,
        &cost,
        &net,
        &live,
        Pruning::Classes,
        &Perturbations::default(),
    )
    .unwrap()
    .run_with(|rank, _, _| {
        let k = next.entry(rank.0).or_default();
        *k += 1;
        Picos::from_micros(segments(rank.0)[*k - 1])
    })
    .unwrap();
    assert_eq!(step.timeline.step_time(), direct.step_time());
    for (a, b) in step.timeline.participants.iter().zip(&direct.participants) {
        assert_eq!(a.ops, b.ops);
    }
    // Each real rank reported its three segments, which matched what was recorded.
    assert_eq!(step.segments.len(), 2);
    for (rank, segs) in &step.segments {
        let want: Vec<Picos> = segments(rank.0)
            .iter()
            .map(|&u| Picos::from_micros(u))
            .collect();
        let got: Vec<Picos> = segs.iter().map(|s| s.0).collect();
        assert_eq!(got, want);
        // The class graph was recorded from rank 0, so its own segments match it.
        if rank.0 == 0 {
            assert!(segs.iter().all(|(took, recorded)| took == recorded));
        }
    }
}

#[test]
fn a_slower_real_rank_slows_the_step() {
    fn slow(r: RankReporter) {
        for us in segments(r.rank().0) {
            let _ = r.segment(Picos::from_micros(3 * us));
        }
        let _ = r.done();
    }
    let base = coordinated(&[RankId(1)], Duration::from_secs(30), faithful).unwrap();
    let slowed = coordinated(&[RankId(1)], Duration::from_secs(30), slow).unwrap();
    assert!(slowed.timeline.step_time() > base.timeline.step_time());
}

#[test]
fn a_hung_real_rank_is_an_error_within_the_timeout() {
    fn hangs(r: RankReporter) {
        let _ = r.segment(Picos::from_micros(100));
        // Holds its reporter without reporting, longer than the timeout.
        std::thread::sleep(Duration::from_millis(1500));
        drop(r);
    }
    let t = std::time::Instant::now();
    let e = coordinated(&[RankId(2)], Duration::from_millis(200), hangs).unwrap_err();
    assert!(
        matches!(
            e,
            CoordinatorError::Hung {
                rank: 2,
                segment: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("real rank 2 reported nothing"),
        "{e}"
    );
    // Generous bound: the point is that it does not wait for the rank.
    assert!(t.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_crashed_real_rank_is_an_error_at_once() {
    fn crashes(r: RankReporter) {
        let _ = r.segment(Picos::from_micros(100));
        drop(r);
    }
    let e = coordinated(&[RankId(0)], Duration::from_secs(30), crashes).unwrap_err();
    assert!(
        matches!(
            e,
            CoordinatorError::Gone {
                rank: 0,
                segment: 1
            }
        ),
        "{e}"
    );
}

#[test]
fn failed_and_miscounting_ranks_are_named() {
    fn fails(r: RankReporter) {
        let _ = r.failed("out of memory in the backward pass");
    }
    let e = coordinated(&[RankId(1)], Duration::from_secs(30), fails).unwrap_err();
    assert!(
        e.to_string().contains("real rank 1 failed: out of memory"),
        "{e}"
    );
    fn too_few(r: RankReporter) {
        let _ = r.segment(Picos::from_micros(100));
        let _ = r.done();
    }
    let e = coordinated(&[RankId(1)], Duration::from_secs(30), too_few).unwrap_err();
    assert!(
        matches!(
            e,
            CoordinatorError::TooFew {
                rank: 1,
                reported: 1,
                ..
            }
        ),
        "{e}"
    );
    fn too_many(r: RankReporter) {
        for _ in 0..4 {
            let _ = r.segment(Picos::from_micros(100));
        }
        let _ = r.done();
    }
    let e = coordinated(&[RankId(1)], Duration::from_secs(30), too_many).unwrap_err();
    assert!(
        matches!(
            e,
            CoordinatorError::TooMany {
                rank: 1,
                reported: 4,
                expected: 3
            }
        ),
        "{e}"
    );
}

/// DP `world` with expert parallelism over pairs of ranks: compute, the expert all-to-all,
/// compute.
fn moe_collected(world: u32) -> Collected {
    moe_layers_collected(Layout::from_dims(1, 1, world, 1, 2, world))
}

/// Every rank of `layout`: compute, the expert all-to-all in its expert-parallel group,
/// compute (pipeline stages, if any, do not exchange: each runs its own layers' experts).
fn moe_layers_collected(layout: Layout) -> Collected {
    let world = layout.world_size();
    let records: Vec<RankRecord> = (0..world)
        .map(|rank| RankRecord {
            rank,
            ops: vec![
                RecordedOp::Compute {
                    name: "router".into(),
                    phase: Phase::Forward,
                    duration: Picos::from_micros(100),
                    memory: None,
                },
                RecordedOp::Collective {
                    op: CollectiveOp::AllToAll,
                    group: layout
                        .group_members(RankId(rank), GroupRole::Ep)
                        .iter()
                        .map(|r| r.0)
                        .collect(),
                    role: Some(GroupRole::Ep),
                    bytes: Bytes(1 << 20),
                    duration: Picos::ZERO,
                },
                RecordedOp::Compute {
                    name: "experts".into(),
                    phase: Phase::Forward,
                    duration: Picos::from_micros(100),
                    memory: None,
                },
            ],
        })
        .collect();
    stitch(layout, &records).unwrap()
}

/// Emulates `c` with real rank 0, which reports its all-to-all's size (`None`: none) and
/// computes 100 us per segment: each participant's (rank, end).
fn moe_step(c: &Collected, bytes: Option<u64>, pruning: Pruning) -> Vec<(u32, Picos)> {
    let (cost, net) = models();
    let emu = Emulation::collected(
        c,
        &cost,
        &net,
        &[RankId(0)],
        pruning,
        &Perturbations::default(),
    )
    .unwrap();
    let (coordinator, reporters) = Coordinator::new(emu, Duration::from_secs(30));
    let r = reporters.into_iter().next().unwrap();
    let t = std::thread::spawn(move || {
        let first = Picos::from_micros(100);
        match bytes {
            Some(b) => r.segment_before(first, b).unwrap(),
            None => r.segment(first).unwrap(),
        }
        r.segment(Picos::from_micros(100)).unwrap();
        r.done().unwrap();
    });
    let step = coordinator.run().unwrap();
    t.join().unwrap();
    step.timeline
        .participants
        .iter()
        .map(|p| (p.rank.0, p.end()))
        .collect()
}

fn step_time(ends: &[(u32, Picos)]) -> Picos {
    ends.iter().map(|e| e.1).max().unwrap()
}

#[test]
fn a_real_routers_all_to_all_size_reaches_the_engine() {
    let c = moe_collected(2);
    let step_with = |bytes| step_time(&moe_step(&c, bytes, Pruning::Classes));
    let as_collected = step_with(None);
    // The router sent what the collection saw: nothing changes.
    assert_eq!(step_with(Some(1 << 20)), as_collected);
    // A skewed router (64 times the rows) makes the exchange, and the step, longer.
    assert!(step_with(Some(64 << 20)) > as_collected);
    // Fewer rows than the collection saw: the virtual peer routes alike, so the exchange is
    // shorter too.
    assert!(step_with(Some(1 << 10)) < as_collected);
}

/// Another pipeline stage's experts are other layers' with other routers: its exchanges keep
/// the collected size whatever the real rank's router chose.
#[test]
fn other_stages_keep_the_collected_all_to_all_size() {
    let layout = Layout::from_dims(1, 1, 2, 2, 2, 4);
    let other_stage: Vec<u32> = (0..4)
        .filter(|&r| layout.class_of(RankId(r)) != layout.class_of(RankId(0)))
        .collect();
    assert_eq!(other_stage.len(), 2);
    let c = moe_layers_collected(layout);
    let stage_end = |ends: &[(u32, Picos)], ranks: &[u32]| {
        ends.iter()
            .filter(|e| ranks.contains(&e.0))
            .map(|e| e.1)
            .max()
    };
    for pruning in [Pruning::Classes, Pruning::None] {
        let as_collected = moe_step(&c, None, pruning);
        let skewed = moe_step(&c, Some(64 << 20), pruning);
        let own_stage: Vec<u32> = (0..4).filter(|r| !other_stage.contains(r)).collect();
        assert!(stage_end(&skewed, &own_stage) > stage_end(&as_collected, &own_stage));
        assert!(stage_end(&as_collected, &other_stage).is_some());
        assert_eq!(
            stage_end(&skewed, &other_stage),
            stage_end(&as_collected, &other_stage)
        );
    }
}

/// Virtual ranks of the real rank's stage follow its router in every expert-parallel group,
/// not only its own; pruned and unpruned emulation agree.
#[test]
fn virtual_ranks_of_other_expert_groups_follow_the_live_router() {
    let c = moe_collected(4);
    let other_group_end =
        |ends: &[(u32, Picos)]| ends.iter().filter(|e| e.0 >= 2).map(|e| e.1).max().unwrap();
    let as_collected = moe_step(&c, None, Pruning::Classes);
    for bytes in [64u64 << 20, 1 << 10] {
        let pruned = moe_step(&c, Some(bytes), Pruning::Classes);
        let unpruned = moe_step(&c, Some(bytes), Pruning::None);
        assert_eq!(step_time(&pruned), step_time(&unpruned), "{bytes} B");
        assert_eq!(other_group_end(&pruned), other_group_end(&unpruned));
        if bytes > 1 << 20 {
            assert!(other_group_end(&pruned) > other_group_end(&as_collected));
        } else {
            assert!(other_group_end(&pruned) < other_group_end(&as_collected));
        }
    }
}
