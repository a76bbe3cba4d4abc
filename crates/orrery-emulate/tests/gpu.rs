//! Real ranks on a CUDA GPU (feature `cuda`). These need a GPU, so they are ignored by
//! default; on a machine with one:
//!
//! ```text
//! cargo test --release -p orrery-emulate --features cuda --test gpu -- --ignored --nocapture
//! ```
//!
//! They check what no CPU run can: that a rank on the GPU trains, that every compute segment
//! carries a memory sample read from the device pool, and that an emulation of the same
//! rank reads the same peak as its collection.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{clock, models};
use orrery_emulate::drive::{collect, emulate, peak_and_compute};
use orrery_graph::collect::RecordedOp;
use orrery_predict::emulate::Perturbations;
use orrery_train::{DeviceKind, ModelConfig, TrainConfig};
use orrery_units::RankId;
use std::time::Duration;

/// Far longer than a healthy rank of this world takes, kernel compilation included.
const TIMEOUT: Duration = Duration::from_secs(600);

/// Two data-parallel ranks of a small model, on the GPU.
fn on_gpu() -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            context: 64,
            d_model: 128,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            d_ff: 512,
            ..ModelConfig::default()
        },
        steps: 4,
        batch_size: 16,
        lr: 1e-3,
        warmup_steps: 1,
        eval_every: 0,
        eval_batches: 1,
        device: DeviceKind::Cuda,
        ..TrainConfig::default()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_on_the_gpu_reports_its_pool_and_an_emulation_reads_the_same_peak() {
    let config = on_gpu();
    let collection = collect(&config, 2, 1, 1, TIMEOUT, clock(), &mut |_, _| {}).unwrap();
    let record = &collection.records[0];
    let mut segments = 0;
    let mut most_live = 0;
    for op in &record.ops {
        if let RecordedOp::Compute { memory, .. } = op {
            let m = memory.expect("every segment on the GPU has a memory sample");
            assert!(m.live.0 <= m.peak.0, "{m:?}");
            most_live = most_live.max(m.live.0);
            segments += 1;
        }
    }
    assert!(segments > 1);
    let (peak, compute) = peak_and_compute(record);
    // How far the pool's reservation (the peak recorded) is above the most any segment's
    // end held: not checked, printed for docs/emulate.md.
    eprintln!(
        "collected rank 0: {segments} segments, {compute:?} of compute, pool peak (reserved) \
         {peak} B, most in use at a segment's end {most_live} B"
    );
    // The model's weights alone are on the device.
    assert!(peak > 100_000, "{peak}");

    let (cost, net) = models();
    let run = emulate(
        &config,
        &collection.collected,
        &cost,
        &net,
        &[RankId(0)],
        &Perturbations::default(),
        1,
        TIMEOUT,
        clock(),
    )
    .unwrap();
    let (emulated_peak, _) = peak_and_compute(&run.records[0].record);
    eprintln!("emulated rank 0: pool peak {emulated_peak} B");
    // The issue's bound for peak memory: 0.1%. (The pool reserves whole pages, so the same
    // allocations should read the same reservation exactly.)
    assert!(
        emulated_peak.abs_diff(peak) * 1000 <= peak,
        "{emulated_peak} against {peak}"
    );
}
