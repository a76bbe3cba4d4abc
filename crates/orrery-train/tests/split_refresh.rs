#![allow(clippy::unwrap_used, clippy::expect_used)]

//! SOAP's basis refreshes split across data-parallel ranks (`SoapConfig::split`): with
//! threshold 0 a run is bit-identical to every rank refreshing everything itself, and with a
//! positive threshold some bases are kept, the ranks still agree bit for bit and the model
//! still learns.

mod common;

use common::{bits, run_threads_with, tiny};
use orrery_optim::{Soap, SoapConfig, SplitRefresh};
use orrery_train::{TrainConfig, TrainSummary};

fn soap_config() -> TrainConfig {
    let mut config = tiny();
    config.optimizer.name = "soap".into();
    config.steps = 12;
    config.eval_every = 0;
    config.lr = 3e-3;
    config
}

struct Rank {
    summary: TrainSummary,
    weights: Vec<f32>,
    /// Bases sent and kept.
    bases: (u64, u64),
}

/// Trains `config` on `world` threads with SOAP refreshing every 2 steps.
fn run(config: &TrainConfig, world: usize, split: Option<SplitRefresh>) -> Vec<Rank> {
    run_threads_with(
        config,
        world,
        || {
            Box::new(Soap::new(SoapConfig {
                precondition_frequency: 2,
                split,
                ..SoapConfig::default()
            }))
        },
        |t, summary| Rank {
            summary,
            weights: t.params().flat().to_vec(),
            bases: t.bases_sent_and_kept(),
        },
    )
}

fn losses(s: &TrainSummary) -> Vec<u32> {
    s.history.iter().map(|m| m.loss.to_bits()).collect()
}

#[test]
fn split_at_threshold_zero_is_bit_identical_to_every_rank_refreshing() {
    let config = soap_config();
    let plain = run(&config, 2, None);
    let split = run(
        &config,
        2,
        Some(SplitRefresh {
            threshold: 0.0,
            max_kept: 0,
        }),
    );
    for r in &split {
        assert_eq!(losses(&r.summary), losses(&plain[0].summary), "same losses");
        assert_eq!(bits(&r.weights), bits(&plain[0].weights), "same weights");
        assert!(r.bases.0 > 0, "bases were sent");
        assert_eq!(r.bases.1, 0, "threshold 0 keeps nothing");
        assert_eq!(r.bases, split[0].bases, "every rank counts the same");
    }
    assert_eq!(plain[0].bases, (0, 0), "no split, no exchange");
}

#[test]
fn a_positive_threshold_keeps_some_bases_and_still_trains() {
    let config = soap_config();
    let split = run(
        &config,
        2,
        Some(SplitRefresh {
            threshold: 0.05,
            max_kept: 2,
        }),
    );
    let (a, b) = (&split[0], &split[1]);
    assert_eq!(a.summary, b.summary, "both ranks report the same run");
    assert_eq!(
        bits(&a.weights),
        bits(&b.weights),
        "ranks hold identical weights"
    );
    assert_eq!(a.bases, b.bases);
    let (sent, kept) = a.bases;
    assert!(kept > 0, "some bases were kept (sent {sent}, kept {kept})");
    assert!(sent > 0, "some bases were sent (sent {sent}, kept {kept})");
    let first = a.summary.history[0].loss;
    let last = a.summary.final_loss.unwrap();
    assert!(last < first, "the loss decreases: {first} -> {last}");
}
