//! Split refreshes on ranks that are threads, for SOAP's bases (`SoapConfig::split`) and
//! Shampoo's blocks' inverse roots (`ShampooConfig::split`): with threshold 0 every rank ends
//! with exactly the weights and state bytes of an optimizer that refreshes everything itself;
//! with a positive threshold some refreshes are kept, and all ranks still hold the same state,
//! also across a save and load in the middle of the run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Barrier, Mutex};

use common::{noise, shaped_params};
use orrery_optim::{
    Optimizer, RankGroup, Shampoo, ShampooConfig, Soap, SoapConfig, SoloGroup, SplitRefresh,
    TierConfig,
};

/// Three rotated matrices of different sizes (one side of `wide` is above `max_precond_dim`),
/// a bias, and an empty tensor.
const SHAPES: [(&str, &[usize]); 6] = [
    ("a", &[3, 4]),
    ("b", &[5, 2]),
    ("c", &[6, 6]),
    ("wide", &[2, 9]),
    ("bias", &[4]),
    ("empty", &[0, 3]),
];

/// An all-gather among threads: every rank writes its slot, waits for all, copies all slots,
/// and waits again so that nobody overwrites a slot another rank is still reading.
struct ThreadGroup {
    rank: usize,
    world: usize,
    slots: Arc<Mutex<Vec<Vec<u8>>>>,
    barrier: Arc<Barrier>,
}

impl ThreadGroup {
    fn group(world: usize) -> Vec<ThreadGroup> {
        let slots = Arc::new(Mutex::new(vec![Vec::new(); world]));
        let barrier = Arc::new(Barrier::new(world));
        (0..world)
            .map(|rank| ThreadGroup {
                rank,
                world,
                slots: Arc::clone(&slots),
                barrier: Arc::clone(&barrier),
            })
            .collect()
    }
}

impl RankGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        self.slots.lock().unwrap()[self.rank] = mine.to_vec();
        self.barrier.wait();
        let all = self.slots.lock().unwrap().clone();
        self.barrier.wait();
        Ok(all)
    }
}

fn config(split: Option<SplitRefresh>) -> SoapConfig {
    SoapConfig {
        precondition_frequency: 2,
        max_precond_dim: 8,
        split,
        ..SoapConfig::default()
    }
}

/// Shampoo refreshing every 2 steps (1, 3, 5, ...) in blocks of at most 4: `a` is one block,
/// `b` two, `c` four and `wide` three, ten blocks in all.
fn shampoo_config(split: Option<SplitRefresh>) -> ShampooConfig {
    ShampooConfig {
        precondition_frequency: 2,
        max_preconditioner_dim: 4,
        split,
        ..ShampooConfig::default()
    }
}

const SHAMPOO_BLOCKS: u64 = 10;

/// The result of a run: final weights (bits), saved state, bases sent and kept, refreshes this
/// rank computed, refreshes that fell due.
type Outcome = (Vec<Vec<u32>>, Vec<u8>, u64, u64, u64, u64);

/// Counts summed over a run: sent, kept, computed, due.
type Counts = (u64, u64, u64, u64);

/// `steps` steps of `opt` on `group` from step `from`, with gradients that depend only on the
/// step (so every rank sees the same ones, as after a data-parallel all-reduce).
fn steps(
    opt: &mut dyn Optimizer,
    xs: &mut [Vec<f32>],
    group: &mut dyn RankGroup,
    from: u64,
    to: u64,
) -> Counts {
    let (mut sent, mut kept, mut computed, mut due) = (0, 0, 0, 0);
    for t in from..to {
        // A slowly turning gradient, so that bases settle and small changes occur.
        let gs: Vec<Vec<f32>> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, (_, s))| {
                let n = s.iter().product();
                let base = noise(1 + i as u64, n);
                let wiggle = noise(1000 + t * 10 + i as u64, n);
                base.iter().zip(wiggle).map(|(b, w)| b + 0.2 * w).collect()
            })
            .collect();
        let mut params = shaped_params(&SHAPES, xs, &gs);
        let r = opt.step_shared(0.01, &mut params, group).unwrap();
        sent += r.bases_sent;
        kept += r.bases_kept;
        computed += r.bases_computed;
        due += r.refreshes;
    }
    (sent, kept, computed, due)
}

fn init() -> Vec<Vec<f32>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, (_, s))| noise(50 + i as u64, s.iter().product()))
        .collect()
}

fn finish(xs: &[Vec<f32>], opt: &dyn Optimizer, (sent, kept, computed, due): Counts) -> Outcome {
    let bits = xs
        .iter()
        .map(|x| x.iter().map(|v| v.to_bits()).collect())
        .collect();
    (bits, opt.save_state(), sent, kept, computed, due)
}

/// Runs `n` steps on `world` threads, each with its own optimizer made by `make`; with
/// `reload_at`, every rank saves its state there and continues in a fresh optimizer.
fn run_ranks<O: Optimizer>(
    world: usize,
    n: u64,
    reload_at: Option<u64>,
    make: impl Fn(usize) -> O + Sync,
) -> Vec<Outcome> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadGroup::group(world)
            .into_iter()
            .map(|mut g| {
                let make = &make;
                s.spawn(move || {
                    let rank = g.rank;
                    let mut opt = make(rank);
                    let mut xs = init();
                    let cut = reload_at.unwrap_or(n);
                    let (s1, k1, c1, d1) = steps(&mut opt, &mut xs, &mut g, 0, cut);
                    if reload_at.is_some() {
                        let bytes = opt.save_state();
                        opt = make(rank);
                        opt.load_state(&bytes).unwrap();
                    }
                    let (s2, k2, c2, d2) = steps(&mut opt, &mut xs, &mut g, cut, n);
                    finish(&xs, &opt, (s1 + s2, k1 + k2, c1 + c2, d1 + d2))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `n` steps of `opt` alone.
fn alone(mut opt: impl Optimizer, n: u64) -> Outcome {
    let mut xs = init();
    let counts = steps(&mut opt, &mut xs, &mut SoloGroup, 0, n);
    finish(&xs, &opt, counts)
}

fn unsplit(n: u64) -> Outcome {
    alone(Soap::new(config(None)), n)
}

#[test]
fn threshold_zero_equals_every_rank_refreshing_everything() {
    let reference = unsplit(13);
    assert_eq!((reference.2, reference.3), (0, 0), "no split, no exchange");
    assert_eq!(reference.5, 24, "refreshes fell due without a split too");
    let always = SplitRefresh {
        threshold: 0.0,
        max_kept: 3,
    };
    for world in [1, 2, 3, 5] {
        let ranks = run_ranks(world, 13, None, |_| Soap::new(config(Some(always))));
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(r.0, reference.0, "world {world} rank {rank}: weights");
            assert_eq!(r.1, reference.1, "world {world} rank {rank}: state bytes");
            // 4 rotated matrices (`wide` on its short side), refreshed at their steps 2, 4,
            // ..., 12 (the first call only initialises).
            assert_eq!((r.2, r.3), (24, 0), "world {world} rank {rank}: counts");
            assert_eq!(
                r.5, 24,
                "world {world} rank {rank}: every rank counts every refresh"
            );
        }
        // The work is split: every refresh computed exactly once, by one rank. Owners are
        // per parameter, so with 4 rotated parameters at most 4 ranks have work.
        let computed: Vec<u64> = ranks.iter().map(|r| r.4).collect();
        assert_eq!(
            computed.iter().sum::<u64>(),
            24,
            "world {world}: {computed:?}"
        );
        if world > 1 {
            assert!(
                computed.iter().all(|&c| c < 24),
                "world {world}: {computed:?}"
            );
        }
    }
}

#[test]
fn split_with_spilled_state_equals_resident_state() {
    let reference = unsplit(9);
    let root = std::env::temp_dir().join(format!("orrery-optim-split-{}", std::process::id()));
    let ranks = run_ranks(2, 9, None, |rank| {
        Soap::new(SoapConfig {
            tiers: Some(TierConfig {
                device_budget: 0,
                host_budget: 0,
                spill_dir: root.join(format!("rank{rank}")),
            }),
            ..config(Some(SplitRefresh::default()))
        })
    });
    for r in &ranks {
        assert_eq!(r.0, reference.0);
        assert_eq!(r.1, reference.1);
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_positive_threshold_keeps_bases_and_ranks_stay_identical() {
    let lazy = SplitRefresh {
        threshold: 0.02,
        max_kept: 2,
    };
    let ranks = run_ranks(2, 25, None, |_| Soap::new(config(Some(lazy))));
    let (sent, kept) = (ranks[0].2, ranks[0].3);
    assert!(kept > 0, "some bases kept: sent {sent}, kept {kept}");
    assert!(sent > 0, "some bases sent: sent {sent}, kept {kept}");
    // 4 matrices refreshed at steps 2, 4, ..., 24 of their own count, 12 refreshes each.
    assert_eq!(sent + kept, 48);
    // The staleness bound: at most `max_kept` keeps in a row, so at least one send in three.
    assert!(sent * 3 >= sent + kept);
    for r in &ranks[1..] {
        assert_eq!(r.0, ranks[0].0, "identical weights");
        assert_eq!(r.1, ranks[0].1, "identical state");
        assert_eq!((r.2, r.3), (sent, kept));
    }
    // Keeping bases changed the run, as it should.
    assert_ne!(ranks[0].0, unsplit(25).0);

    // Saving and loading mid-run (which carries how long each basis has been kept) continues
    // exactly.
    let resumed = run_ranks(2, 25, Some(11), |_| Soap::new(config(Some(lazy))));
    for r in &resumed {
        assert_eq!(r.0, ranks[0].0);
        assert_eq!(r.1, ranks[0].1);
    }
}

/// A threshold no change can exceed leaves only the staleness bound: each basis is kept over
/// exactly `max_kept` refreshes and then sent.
#[test]
fn the_staleness_bound_forces_a_send_after_max_kept_keeps() {
    for (max_kept, expected) in [(0, (48, 0)), (2, (16, 32)), (5, (8, 40))] {
        let never = SplitRefresh {
            threshold: 1.0,
            max_kept,
        };
        let ranks = run_ranks(2, 25, None, |_| Soap::new(config(Some(never))));
        for r in &ranks {
            assert_eq!((r.2, r.3), expected, "max_kept {max_kept}");
            assert_eq!(r.1, ranks[0].1);
        }
    }
}

/// Shampoo's roots split over blocks: at threshold 0 every rank ends with the bits of Shampoo
/// computing every root itself, each block's roots are computed by exactly one rank, and every
/// rank counts every refresh. 13 steps refresh the 10 blocks at steps 1, 3, ..., 13.
#[test]
fn shampoo_threshold_zero_equals_every_rank_computing_every_root() {
    let reference = alone(Shampoo::new(shampoo_config(None)), 13);
    let due = 7 * SHAMPOO_BLOCKS;
    assert_eq!(reference.5, due, "refreshes without a split");
    assert_eq!((reference.2, reference.3, reference.4), (0, 0, 0));
    let always = SplitRefresh {
        threshold: 0.0,
        max_kept: 3,
    };
    for world in [1, 2, 3] {
        let ranks = run_ranks(world, 13, None, |_| {
            Shampoo::new(shampoo_config(Some(always)))
        });
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(r.0, reference.0, "world {world} rank {rank}: weights");
            assert_eq!(r.1, reference.1, "world {world} rank {rank}: state bytes");
            assert_eq!((r.2, r.3, r.5), (due, 0, due), "world {world} rank {rank}");
        }
        let computed: Vec<u64> = ranks.iter().map(|r| r.4).collect();
        assert_eq!(
            computed.iter().sum::<u64>(),
            due,
            "world {world}: {computed:?}"
        );
        if world > 1 {
            assert!(
                computed.iter().all(|&c| c > 0 && c < due),
                "world {world}: every rank does a share: {computed:?}"
            );
        }
    }
}

/// With a positive threshold the owners keep some roots, so fewer are sent; the ranks still
/// agree bit for bit, also across a save and load mid-run (which carries the keep counts).
#[test]
fn shampoo_positive_threshold_sends_fewer_roots() {
    let lazy = SplitRefresh {
        threshold: 0.03,
        max_kept: 2,
    };
    let make = |_| Shampoo::new(shampoo_config(Some(lazy)));
    let ranks = run_ranks(2, 25, None, make);
    let (sent, kept) = (ranks[0].2, ranks[0].3);
    let due = 13 * SHAMPOO_BLOCKS;
    assert_eq!(sent + kept, due, "every refresh decided once");
    assert!(kept > 0, "some roots kept: sent {sent}, kept {kept}");
    assert!(
        sent < due,
        "fewer roots sent than refreshes: {sent} of {due}"
    );
    // The threshold decides, not only the staleness bound: that alone would send each
    // block's first roots and then one in three (5 of 13 refreshes; see the next test).
    assert!(sent > 5 * SHAMPOO_BLOCKS, "sent {sent}");
    for r in &ranks[1..] {
        assert_eq!(r.0, ranks[0].0, "identical weights");
        assert_eq!(r.1, ranks[0].1, "identical state");
        assert_eq!((r.2, r.3), (sent, kept));
    }
    assert_ne!(
        ranks[0].0,
        alone(Shampoo::new(shampoo_config(None)), 25).0,
        "keeping roots changed the run"
    );
    let resumed = run_ranks(2, 25, Some(12), make);
    for r in &resumed {
        assert_eq!(r.0, ranks[0].0);
        assert_eq!(r.1, ranks[0].1);
    }
}

/// A threshold no change reaches (roots scaled to unit norm are at most 2 apart): each block's
/// first roots are sent (there is nothing to keep), then `max_kept` keeps and a send, again and
/// again. 13 refreshes per block: with `max_kept` 2, 1 + 4 sends and 8 keeps.
#[test]
fn shampoo_roots_are_sent_first_and_then_by_the_staleness_bound() {
    for (max_kept, per_block) in [(0, (13, 0)), (2, (5, 8)), (5, (3, 10))] {
        let never = SplitRefresh {
            threshold: 3.0,
            max_kept,
        };
        let ranks = run_ranks(2, 25, None, |_| Shampoo::new(shampoo_config(Some(never))));
        for r in &ranks {
            assert_eq!(
                (r.2, r.3),
                (per_block.0 * SHAMPOO_BLOCKS, per_block.1 * SHAMPOO_BLOCKS),
                "max_kept {max_kept}"
            );
            assert_eq!(r.1, ranks[0].1);
        }
    }
}
