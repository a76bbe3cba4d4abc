#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Preconditioner refreshes split across data-parallel ranks: SOAP's bases
//! (`SoapConfig::split`) and Shampoo's blocks' inverse roots (`ShampooConfig::split`). With
//! threshold 0 a run is bit-identical to every rank refreshing everything itself, and with a
//! positive threshold some refreshes are kept, fewer are sent, the ranks still agree bit for
//! bit and the model still learns.

mod common;

use common::{bits, run_threads_with, tiny};
use orrery_optim::{Optimizer, Shampoo, ShampooConfig, Soap, SoapConfig, SplitRefresh};
use orrery_train::{TrainConfig, TrainSummary};

fn soap_config() -> TrainConfig {
    let mut config = tiny();
    // The optimizer is built by the tests; the name only labels the run.
    config.optimizer.name = "soap".into();
    config.steps = 12;
    config.eval_every = 0;
    config.lr = 3e-3;
    config
}

struct Rank {
    summary: TrainSummary,
    weights: Vec<f32>,
    /// Bases sent and kept, as the trainer counts them after the run.
    bases: (u64, u64),
}

/// Trains `config` on `world` threads with SOAP refreshing every 2 steps.
fn run(config: &TrainConfig, world: usize, split: Option<SplitRefresh>) -> Vec<Rank> {
    run_with(config, world, || {
        Box::new(Soap::new(SoapConfig {
            precondition_frequency: 2,
            split,
            ..SoapConfig::default()
        }))
    })
}

/// Trains `config` on `world` threads with Shampoo computing roots every 2 steps (1, 3, ...,
/// 11: 6 refreshes of every block) in blocks of at most 64 (the embedding's 256 rows are four
/// blocks; a whole 256×256 root per refresh would make the test slow, not stronger).
fn run_shampoo(config: &TrainConfig, world: usize, split: Option<SplitRefresh>) -> Vec<Rank> {
    run_with(config, world, || {
        Box::new(Shampoo::new(ShampooConfig {
            precondition_frequency: 2,
            max_preconditioner_dim: 64,
            split,
            ..ShampooConfig::default()
        }))
    })
}

fn run_with(
    config: &TrainConfig,
    world: usize,
    make: impl Fn() -> Box<dyn Optimizer> + Sync,
) -> Vec<Rank> {
    run_threads_with(config, world, make, |t, summary| Rank {
        summary,
        weights: t.params().flat().to_vec(),
        bases: {
            let o = t.optimizer_summary();
            (o.bases_sent, o.bases_kept)
        },
    })
}

/// Checks that the two ranks of a split run report the same run and hold the same weights,
/// and returns rank 0.
fn ranks_agree(split: &[Rank]) -> &Rank {
    let (a, b) = (&split[0], &split[1]);
    assert_eq!(a.summary, b.summary, "both ranks report the same run");
    assert_eq!(
        bits(&a.weights),
        bits(&b.weights),
        "ranks hold identical weights"
    );
    assert_eq!(a.bases, b.bases);
    a
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
        // The summary reports the exchange: every refresh that fell due was sent.
        let o = r.summary.optimizer;
        assert_eq!((o.bases_sent, o.bases_kept), r.bases);
        assert_eq!(o.refreshes, o.bases_sent);
        assert_eq!(o.refreshes, plain[0].summary.optimizer.refreshes);
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
    let a = ranks_agree(&split);
    let (sent, kept) = a.bases;
    assert!(kept > 0, "some bases were kept (sent {sent}, kept {kept})");
    assert!(sent > 0, "some bases were sent (sent {sent}, kept {kept})");
    let first = a.summary.history[0].loss;
    let last = a.summary.final_loss.unwrap();
    assert!(last < first, "the loss decreases: {first} -> {last}");
}

fn shampoo_config() -> TrainConfig {
    let mut config = soap_config();
    config.optimizer.name = "shampoo".into();
    config
}

#[test]
fn shampoo_split_at_threshold_zero_is_bit_identical_to_every_rank_computing_roots() {
    let config = shampoo_config();
    let plain = run_shampoo(&config, 2, None);
    let split = run_shampoo(
        &config,
        2,
        Some(SplitRefresh {
            threshold: 0.0,
            max_kept: 0,
        }),
    );
    let refreshes = plain[0].summary.optimizer.refreshes;
    // 16 blocks (the embedding's four, and six matrices in each of 2 layers), 6 refreshes each.
    assert_eq!(refreshes, 16 * 6);
    for r in &split {
        assert_eq!(losses(&r.summary), losses(&plain[0].summary), "same losses");
        assert_eq!(bits(&r.weights), bits(&plain[0].weights), "same weights");
        assert_eq!(r.bases, (refreshes, 0), "every block's roots sent");
        assert_eq!(r.summary.optimizer.refreshes, refreshes);
    }
    assert_eq!(plain[0].bases, (0, 0), "no split, no exchange");
}

#[test]
fn shampoo_split_with_a_positive_threshold_sends_fewer_roots_and_still_trains() {
    let config = shampoo_config();
    let split = run_shampoo(
        &config,
        2,
        Some(SplitRefresh {
            threshold: 0.2,
            max_kept: 2,
        }),
    );
    let a = ranks_agree(&split);
    let (sent, kept) = a.bases;
    let refreshes = a.summary.optimizer.refreshes;
    assert_eq!(sent + kept, refreshes);
    assert!(kept > 0, "some roots were kept (sent {sent}, kept {kept})");
    // The threshold decides, not only the staleness bound, which alone would send each
    // block's first roots and then one in three (2 of its 6 refreshes).
    assert!(sent * 3 > refreshes, "sent {sent} of {refreshes}");
    let first = a.summary.history[0].loss;
    let last = a.summary.final_loss.unwrap();
    assert!(last < first, "the loss decreases: {first} -> {last}");
}
