//! Blocked, grafted Shampoo against an independent `f64` implementation and a closed form.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::lockstep::lockstep;

use common::{noise, step_one, RefShampoo};
use orrery_optim::{Optimizer, Param, Shampoo, ShampooConfig};

fn compare(shape: &[usize], bdim: usize, freq: u64, shampoo_beta: f32, steps: u64, tol: f64) {
    let (rows, cols) = (shape[0], shape[1]);
    let cfg = ShampooConfig {
        beta1: 0.9,
        shampoo_beta,
        epsilon: 1e-6,
        weight_decay: 0.1,
        precondition_frequency: freq,
        start_preconditioning_step: 1,
        max_preconditioner_dim: bdim,
        ..ShampooConfig::default()
    };
    let mut opt = Shampoo::new(cfg);
    let mut reference = RefShampoo::new(
        rows,
        cols,
        bdim,
        0.9,
        f64::from(shampoo_beta),
        1e-6,
        0.1,
        freq,
    );
    let lr = 0.05f32;
    lockstep(&mut opt, &mut reference, shape, lr, 9, 200, steps, tol);
}

#[test]
fn shampoo_2x3_matches_reference() {
    // freq 2: roots at steps 1, 3, 5; steps 2, 4 reuse stale roots.
    compare(&[2, 3], 1024, 2, 1.0, 5, 2e-5);
}

#[test]
fn shampoo_3x2_ema_statistics_match_reference() {
    compare(&[3, 2], 1024, 1, 0.9, 4, 2e-5);
}

#[test]
fn shampoo_blocked_5x3_matches_reference() {
    // Blocks of at most 2: rows {0..2, 2..4, 4..5} x cols {0..2, 2..3} = six blocks.
    compare(&[5, 3], 2, 2, 1.0, 4, 2e-5);
}

#[test]
fn shampoo_diagonal_closed_form() {
    // A constant diagonal gradient diag(a, b): after t steps L = R = t diag(a², b²) and the
    // filtered gradient is G itself, so S = L^-1/4 G R^-1/4 = diag(sign a, sign b)/√t. The
    // Adam graft is diag(sign a, sign b) (g/|g|), norm √2, so the grafted step is exactly
    // diag(sign a, sign b) (ε = 0, no decay): x ← x − lr·diag(±1).
    let mut opt = Shampoo::new(ShampooConfig {
        epsilon: 0.0,
        weight_decay: 0.0,
        graft_eps: 1e-30,
        precondition_frequency: 1,
        ..ShampooConfig::default()
    });
    let g = [2.0f32, 0.0, 0.0, -0.5];
    let mut x = [0.0f32; 4];
    for t in 1..=3 {
        opt.step(
            0.1,
            &mut [Param {
                name: "d",
                shape: &[2, 2],
                value: &mut x,
                grad: &g,
            }],
        )
        .unwrap();
        let want = [-0.1 * t as f32, 0.0, 0.0, 0.1 * t as f32];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "step {t}: {x:?} vs {want:?}");
        }
    }
}

#[test]
fn shampoo_state_round_trips_bit_exactly() {
    let cfg = ShampooConfig {
        precondition_frequency: 2,
        max_preconditioner_dim: 2,
        ..ShampooConfig::default()
    };
    let mut a = Shampoo::new(cfg);
    let mut x = noise(5, 12);
    for s in 0..3 {
        let g = noise(300 + s, 12);
        step_one(&mut a, 0.01, &[3, 4], &mut x, &g);
    }
    let bytes = a.save_state();
    let mut b = Shampoo::new(cfg);
    b.load_state(&bytes).unwrap();
    let mut y = x.clone();
    for s in 3..6 {
        let g = noise(300 + s, 12);
        step_one(&mut a, 0.01, &[3, 4], &mut x, &g);
        step_one(&mut b, 0.01, &[3, 4], &mut y, &g);
    }
    assert_eq!(
        x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let mut bad = bytes.clone();
    let k = bad.len() / 2;
    bad[k] ^= 0x10;
    assert!(b.load_state(&bad).is_err());
}

mod random {
    use super::compare;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    proptest! {
        // Inverse roots are unique even for repeated eigenvalues, so any shape is fair game.
        #![proptest_config(ProptestConfig { cases: 24, rng_seed: RngSeed::Fixed(11), ..ProptestConfig::default() })]

        #[test]
        fn shampoo_matches_reference_on_random_small_shapes(
            rows in 1usize..6, cols in 1usize..6, bdim in 1usize..5, freq in 1u64..4, ema in proptest::bool::ANY,
        ) {
            // Looser than the fixed cases: the statistics are stored in f32 (as documented),
            // and in a rank-deficient statistic (a [4, 1] gradient, or fewer steps than rows)
            // the null-space eigenvalues are epsilon (1e-6) plus f32 rounding, raised to the
            // -1/4: agreement with the all-f64 reference is then ~1e-3 relative, not 1e-4
            // (found by CI's seed: [4, 1] at step 2 differed by 1.1e-4).
            compare(&[rows, cols], bdim, freq, if ema { 0.9 } else { 1.0 }, 5, 5e-4);
        }
    }
}
