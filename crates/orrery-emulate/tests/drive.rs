//! The real program among virtual peers: collection, emulation with one real rank, and the
//! all-real reference (threads), on worlds small enough to run every rank here.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_emulate::drive::{
    collect, communication, emulate, peak_and_compute, run_all_real, Collection, RankStep,
};
mod common;

use common::{clock, models};
use orrery_emulate::memory::CountingAlloc;
use orrery_graph::collect::RecordedOp;
use orrery_graph::CollectiveOp;
use orrery_predict::emulate::Perturbations;
use orrery_train::{ModelConfig, MoeConfig, ParallelConfig, TrainConfig};
use orrery_units::{Bytes, RankId};
use std::time::Duration;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Far longer than a healthy rank of these tiny worlds takes.
const TIMEOUT: Duration = Duration::from_secs(120);

fn tiny() -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            context: 16,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            d_ff: 64,
            ..ModelConfig::default()
        },
        steps: 4,
        batch_size: 8,
        lr: 1e-2,
        warmup_steps: 1,
        eval_every: 0,
        eval_batches: 1,
        ..TrainConfig::default()
    }
}

fn tp2_pp2() -> TrainConfig {
    TrainConfig {
        parallel: Some(ParallelConfig {
            tp: 2,
            pp: 2,
            dp: 1,
            micro_batches: 4,
            ..ParallelConfig::default()
        }),
        ..tiny()
    }
}

/// TP 2 x PP 2 with sequence parallelism: reduce-scatters and all-gathers in the
/// tensor-parallel group.
fn tp2_pp2_sp() -> TrainConfig {
    let mut c = tp2_pp2();
    if let Some(p) = c.parallel.as_mut() {
        p.sequence_parallel = true;
    }
    c
}

/// Interleaved 1F1B, two model chunks per stage, on TP 2 x PP 2: tagged messages, activations
/// and gradients both ways between the two stages.
fn interleaved() -> TrainConfig {
    let mut c = tp2_pp2();
    c.model.n_layers = 4;
    if let Some(p) = c.parallel.as_mut() {
        p.virtual_stages = 2;
    }
    c
}

/// A mixture of 4 experts (top 2) on TP 2 x DP 2 with the experts over both data-parallel
/// ranks: the expert all-to-alls of every block, both ways.
fn experts() -> TrainConfig {
    let mut c = tiny();
    c.model.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
    });
    c.parallel = Some(ParallelConfig {
        tp: 2,
        dp: 2,
        ep: 2,
        ..ParallelConfig::default()
    });
    c
}

/// A record's communication with the all-to-alls' sizes left out: among virtual peers they
/// follow the model that every member routes as the real rank does, not what the real
/// world's routers chose.
fn communication_but_exchange_sizes(record: &orrery_graph::collect::RankRecord) -> Vec<RecordedOp> {
    communication(record)
        .into_iter()
        .map(|mut o| {
            if let RecordedOp::Collective {
                op: CollectiveOp::AllToAll,
                bytes,
                ..
            } = &mut o
            {
                *bytes = Bytes(0);
            }
            o
        })
        .collect()
}

#[test]
fn collected_ranks_issue_the_all_real_collectives_in_order() {
    for (config, world) in [
        (tiny(), 2),
        (tp2_pp2(), 4),
        (tp2_pp2_sp(), 4),
        (interleaved(), 4),
    ] {
        let all_real = run_all_real(&config, world, 1, clock()).unwrap();
        let c = collect(&config, world, 2, 1, TIMEOUT, clock(), &mut |_, _| {}).unwrap();
        for rec in &c.records {
            let reference = &all_real[rec.rank as usize].record;
            assert_eq!(
                communication(rec),
                communication(reference),
                "rank {} of {world}",
                rec.rank
            );
        }
        // Every stage's graph was built.
        assert_eq!(
            c.collected.graphs.classes.len(),
            config.parallel.map_or(1, |p| p.pp)
        );
    }
}

#[test]
fn emulation_with_one_real_rank_matches_the_all_real_run() {
    for config in [tp2_pp2(), tp2_pp2_sp(), interleaved()] {
        one_real_rank_matches_the_all_real_run(&config);
    }
}

fn one_real_rank_matches_the_all_real_run(config: &TrainConfig) {
    let (cost, net) = models();
    let collection = collect(config, 4, 2, 1, TIMEOUT, clock(), &mut |_, _| {}).unwrap();
    let all_real = run_all_real(config, 4, 1, clock()).unwrap();
    for live in [RankId(0), RankId(3)] {
        let run = emulate(
            config,
            &collection.collected,
            &cost,
            &net,
            &[live],
            &Perturbations::default(),
            1,
            Duration::from_secs(60),
            clock(),
        )
        .unwrap();
        let rec = &run.records[0].record;
        let reference = &all_real[live.index()].record;
        // The same collectives and transfers, in the same order.
        assert_eq!(
            communication(rec),
            communication(reference),
            "rank {}",
            live.0
        );
        // Every segment the real rank reported reached the engine.
        assert_eq!(run.step.segments[0].0, live);
        let (peak, _) = peak_and_compute(rec);
        let (reference_peak, _) = peak_and_compute(reference);
        eprintln!(
            "rank {}: peak {} B emulated, {} B all real; step {} ps",
            live.0,
            peak,
            reference_peak,
            run.step.timeline.step_time().0
        );
        assert!(peak > 0);
        assert!(run.step.timeline.step_time().0 > 0);
    }
}

/// Emulates `config` on 4 ranks with every rank real and checks it is the real program: each
/// rank's loss bit for bit and its collectives in order, as in the all-real run. Returns the
/// collection and the all-real run for further checks.
fn every_rank_real_is_the_real_program(config: &TrainConfig) -> (Collection, Vec<RankStep>) {
    let (cost, net) = models();
    let collection = collect(config, 4, 2, 1, TIMEOUT, clock(), &mut |_, _| {}).unwrap();
    let all_real = run_all_real(config, 4, 1, clock()).unwrap();
    let every = [RankId(0), RankId(1), RankId(2), RankId(3)];
    let run = emulate(
        config,
        &collection.collected,
        &cost,
        &net,
        &every,
        &Perturbations::default(),
        1,
        TIMEOUT,
        clock(),
    )
    .unwrap();
    assert_eq!(run.records.len(), 4);
    for step in &run.records {
        let reference = &all_real[step.record.rank as usize];
        assert_eq!(
            step.loss.to_bits(),
            reference.loss.to_bits(),
            "rank {}",
            step.record.rank
        );
        assert_eq!(
            communication(&step.record),
            communication(&reference.record)
        );
    }
    (collection, all_real)
}

#[test]
fn real_ranks_of_one_emulation_exchange_real_data() {
    let config = tp2_pp2();
    let (cost, net) = models();
    // Every rank real: the emulated program is the real program, bit for bit.
    let (collection, all_real) = every_rank_real_is_the_real_program(&config);
    // Two real ranks (a tensor-parallel pair) among virtual ones: they agree with each
    // other, as replicas of one computation must.
    let pair = emulate(
        &config,
        &collection.collected,
        &cost,
        &net,
        &[RankId(2), RankId(3)],
        &Perturbations::default(),
        1,
        Duration::from_secs(60),
        clock(),
    )
    .unwrap();
    assert_eq!(pair.records.len(), 2);
    assert_eq!(
        pair.records[0].loss.to_bits(),
        pair.records[1].loss.to_bits()
    );
    for step in &pair.records {
        let reference = &all_real[step.record.rank as usize].record;
        assert_eq!(communication(&step.record), communication(reference));
    }
}

/// Experts among virtual peers: collected and emulated ranks issue the all-real run's
/// collectives in order (the expert all-to-alls' sizes follow the virtual peers' routing
/// model), and with every rank real the emulated program is the real program, exchanges and
/// all.
#[test]
fn experts_among_virtual_peers_issue_the_all_real_collectives() {
    let config = experts();
    let (cost, net) = models();
    let (collection, all_real) = every_rank_real_is_the_real_program(&config);
    for rec in &collection.records {
        let reference = &all_real[rec.rank as usize].record;
        assert_eq!(
            communication_but_exchange_sizes(rec),
            communication_but_exchange_sizes(reference),
            "rank {}",
            rec.rank
        );
    }
    let run = emulate(
        &config,
        &collection.collected,
        &cost,
        &net,
        &[RankId(1)],
        &Perturbations::default(),
        1,
        Duration::from_secs(60),
        clock(),
    )
    .unwrap();
    let rec = &run.records[0].record;
    assert_eq!(
        communication_but_exchange_sizes(rec),
        communication_but_exchange_sizes(&all_real[1].record)
    );
    assert!(run.step.timeline.step_time().0 > 0);
    assert!(run.records[0].loss.is_finite());
}

#[test]
fn interleaved_1f1b_with_every_rank_real_is_the_real_program() {
    every_rank_real_is_the_real_program(&interleaved());
}

#[test]
fn a_real_run_calibrates_every_collective_and_transfer_its_graphs_ask_for() {
    use orrery_emulate::calibrate::MeasuredNetwork;
    use orrery_graph::OpKind;
    use orrery_net::{Algorithm, CollectiveRequest, GroupPlacement, NetworkModel};
    // Every rank real (threads), its operations timed: the collectives its stitched graphs
    // replay are all answered from the measurements, asked as the replay asks (kind, bytes,
    // group size).
    let config = tp2_pp2();
    let all_real = run_all_real(&config, 4, 1, clock()).unwrap();
    let records: Vec<_> = all_real.iter().map(|s| s.record.clone()).collect();
    let layout = orrery_emulate::drive::layout_of(&config, 4).unwrap();
    let collected = orrery_graph::collect::stitch(layout.clone(), &records).unwrap();
    let (_, fallback) = models();
    // The cluster model's answers, to tell a measured transfer from an unmeasured one.
    let (_, unmeasured) = models();
    let net = MeasuredNetwork::from_records(&records, 4, fallback);
    assert!(net.calibrated() > 0);
    assert!(net.calibrated_transfers() > 0);
    let (mut asked, mut sends) = (0, 0);
    for (class, graph) in collected.graphs.classes.iter().enumerate() {
        let rank = layout.representative(orrery_units::ClassId(class as u32));
        for op in graph.ops() {
            if let OpKind::Collective { op, group, bytes } = op.kind {
                let size = layout.group_members(rank, group).len() as u32;
                let cost = net.collective(&CollectiveRequest {
                    kind: orrery_predict::replay::net_kind(op),
                    bytes,
                    placement: GroupPlacement::single_node(size),
                });
                assert_eq!(cost.algorithm, Algorithm::Measured, "{op:?} of {bytes:?}");
                asked += 1;
            }
            // The pipeline's transfers too: measured, so not what the cluster model says.
            if let OpKind::Send { bytes, .. } = op.kind {
                let modelled = unmeasured.point_to_point(bytes, true);
                assert_ne!(net.point_to_point(bytes, true), modelled, "{bytes:?}");
                sends += 1;
            }
        }
    }
    assert!(asked > 10, "{asked}");
    assert!(sends > 0);
}

/// A GPU configuration in a build without the `cuda` feature is refused by name, before any
/// rank runs on the CPU and measures host memory for a GPU job.
#[cfg(not(feature = "cuda"))]
#[test]
fn real_ranks_on_cuda_without_the_feature_are_refused_naming_the_device() {
    let mut config = tiny();
    config.device = orrery_train::DeviceKind::Cuda;
    let err = collect(&config, 2, 1, 0, TIMEOUT, clock(), &mut |_, _| {}).unwrap_err();
    assert!(err.is_input(), "{err}");
    let orrery_emulate::drive::DriveError::Train {
        source: orrery_train::TrainError::Config(problems),
        ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert!(problems.mentions("device"), "{err}");
    assert!(err.to_string().contains("orrery-emulate"), "{err}");
}
