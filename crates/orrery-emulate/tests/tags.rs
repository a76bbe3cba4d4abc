//! Tagged messages in a collected graph: a receive meets the send of its tag, not the send
//! at its place in the pair's order.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_emulate::drive::world_layout;
use orrery_graph::collect::{stitch, RankRecord, RecordedOp};
use orrery_graph::Phase;
use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_predict::replay::{job_participants, replay_participants};
use orrery_predict::{CostModel, ReplayMode};
use orrery_units::{Bytes, Picos};

/// A recorded tagged message (the program's tag with the top bit, as the wrappers record it).
const TAGGED: u64 = 1 << 63;

fn compute(ms: u64) -> RecordedOp {
    RecordedOp::Compute {
        name: "work".into(),
        phase: Phase::Forward,
        duration: Picos::from_micros(1000 * ms),
        memory: None,
    }
}

fn message(send: bool, peer: u32, tag: u64) -> RecordedOp {
    let (bytes, tag, duration) = (Bytes(4096), TAGGED | tag, Picos::ZERO);
    if send {
        RecordedOp::Send {
            peer,
            bytes,
            tag,
            duration,
        }
    } else {
        RecordedOp::Recv {
            peer,
            bytes,
            tag,
            duration,
        }
    }
}

#[test]
fn a_receive_waits_for_the_send_of_its_tag() {
    // Two pipeline stages. Stage 0 sends A, works 10 ms, sends B; stage 1 wants B first,
    // works 1 ms, then takes A. Paired by tag, stage 1's first receive waits for B (10 ms);
    // paired by place it would take A at once and finish after about 1 ms.
    let (a, b) = (5, 9);
    let records = [
        RankRecord {
            rank: 0,
            ops: vec![
                compute(1),
                message(true, 1, a),
                compute(10),
                message(true, 1, b),
            ],
        },
        RankRecord {
            rank: 1,
            ops: vec![message(false, 0, b), compute(1), message(false, 0, a)],
        },
    ];
    let collected = stitch(world_layout(1, 1, 2, 1), &records).unwrap();
    let text = orrery_spec::preset_job_text("llama3-70b-h100x1024").unwrap();
    let job = orrery_spec::Job::from_spec(&orrery_spec::load_job_spec(text, &[]).unwrap()).unwrap();
    let cost = CostModel::for_gpu(&job.cluster().gpu);
    let net = AnalyticalNetwork::new(orrery_predict::fabric_for(&job), AlgorithmChoice::Auto);
    let mut parts = job_participants(&collected.graphs, ReplayMode::Classes);
    for p in &mut parts {
        p.measured = collected.measured.get(p.class.index()).cloned();
    }
    let timeline = replay_participants(parts, &cost, &net, ReplayMode::Classes).unwrap();
    let stage1 = timeline
        .participants
        .iter()
        .find(|p| p.rank.0 == 1)
        .unwrap();
    // B leaves stage 0 after 11 ms of its work; stage 1 then works 1 ms more.
    assert!(
        stage1.end() >= Picos::from_micros(12_000),
        "stage 1 ended at {} ps",
        stage1.end().0
    );
    assert!(stage1.end() < Picos::from_micros(13_000));
}
