//! SOAP against an independent `f64` implementation of the published algorithm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::lockstep::lockstep;

use common::{noise, RefSoap};
use orrery_optim::{Optimizer, Param, Soap, SoapConfig};

/// Runs `steps` calls of SOAP and of the reference on the same gradients (which depend only on
/// the step, not on the iterate) and compares the parameters after every call.
fn compare(shape: &[usize], max_dim: usize, freq: u64, steps: u64, tol: f64) {
    let (rows, cols) = (shape[0], shape[1]);
    let (betas, eps, wd, lr) = ((0.9f32, 0.8f32), 1e-3f32, 0.1f32, 0.1f32);
    let mut opt = Soap::new(SoapConfig {
        betas,
        eps,
        weight_decay: wd,
        precondition_frequency: freq,
        max_precond_dim: max_dim,
        ..SoapConfig::default()
    });
    let mut reference = RefSoap::new(
        rows,
        cols,
        max_dim,
        (f64::from(betas.0), f64::from(betas.1)),
        f64::from(eps),
        f64::from(wd),
        freq,
    );
    lockstep(&mut opt, &mut reference, shape, lr, 1, 100, steps, tol);
}

#[test]
fn soap_first_call_only_builds_the_preconditioner() {
    let mut opt = Soap::default();
    let mut x = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let before = x.clone();
    let g = noise(7, 6);
    opt.step(
        0.1,
        &mut [Param {
            name: "w",
            shape: &[2, 3],
            value: &mut x,
            grad: &g,
        }],
    )
    .unwrap();
    assert_eq!(x, before);
}

#[test]
fn soap_2x3_matches_reference_through_two_refreshes() {
    // freq 2: calls 1 (init), 2 (t=1), 3 (t=2, refresh after), 4 (uses the refreshed basis),
    // 5 (t=4, second refresh), 6.
    compare(&[2, 3], 10_000, 2, 6, 2e-5);
}

#[test]
fn soap_3x2_matches_reference_refreshing_every_step() {
    compare(&[3, 2], 10_000, 1, 5, 2e-5);
}

#[test]
fn soap_4x3_matches_reference() {
    compare(&[4, 3], 10_000, 3, 8, 5e-5);
}

#[test]
fn soap_side_above_max_precond_dim_stays_unrotated() {
    // 2x3 with max 2: rows rotated, columns identity.
    compare(&[2, 3], 2, 2, 6, 2e-5);
}

#[test]
fn soap_one_dimensional_is_adam_from_the_first_call() {
    let (b1, b2, eps, wd, lr) = (0.95f64, 0.95f64, 1e-8f64, 0.01f64, 0.01f64);
    let mut opt = Soap::default();
    let mut x = vec![0.5f32, -1.0];
    let mut xr = [0.5f64, -1.0];
    let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
    for t in 1..=3 {
        let g = noise(t, 2);
        opt.step(
            lr as f32,
            &mut [Param {
                name: "b",
                shape: &[2],
                value: &mut x,
                grad: &g,
            }],
        )
        .unwrap();
        let ss = lr * (1.0 - b2.powi(t as i32)).sqrt() / (1.0 - b1.powi(t as i32));
        for i in 0..2 {
            let gi = f64::from(g[i]);
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            xr[i] -= ss * m[i] / (v[i].sqrt() + eps);
            xr[i] -= lr * wd * xr[i];
            assert!(
                (f64::from(x[i]) - xr[i]).abs() < 1e-6,
                "step {t}: {} vs {}",
                x[i],
                xr[i]
            );
        }
    }
}

#[test]
fn soap_state_round_trips_bit_exactly() {
    let cfg = SoapConfig {
        precondition_frequency: 2,
        ..SoapConfig::default()
    };
    let mut a = Soap::new(cfg.clone());
    let mut x = noise(3, 6);
    let b = noise(4, 3);
    let mut xb = b.clone();
    let run = |o: &mut Soap, x: &mut Vec<f32>, xb: &mut Vec<f32>, s: u64| {
        let g = noise(50 + s, 6);
        let gb = noise(80 + s, 3);
        o.step(
            0.01,
            &mut [
                Param {
                    name: "w",
                    shape: &[2, 3],
                    value: x,
                    grad: &g,
                },
                Param {
                    name: "b",
                    shape: &[3],
                    value: xb,
                    grad: &gb,
                },
            ],
        )
        .unwrap();
    };
    for s in 0..3 {
        run(&mut a, &mut x, &mut xb, s);
    }
    let bytes = a.save_state();
    let mut c = Soap::new(cfg);
    c.load_state(&bytes).unwrap();
    assert_eq!(c.save_state(), bytes);
    let (mut y, mut yb) = (x.clone(), xb.clone());
    for s in 3..7 {
        run(&mut a, &mut x, &mut xb, s);
        run(&mut c, &mut y, &mut yb, s);
    }
    assert_eq!(
        x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(xb, yb);
    // Damaged bytes are refused with a reason, and the old state is kept.
    let mut bad = bytes.clone();
    bad[20] ^= 1;
    let e = c.load_state(&bad).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    assert!(c.load_state(&bytes[..10]).is_err());
    assert!(c
        .load_state(&orrery_optim::AdamW::default().save_state())
        .is_err());
}

mod random {
    use super::compare;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    proptest! {
        // A fixed seed: the cases are random but the same on every run, so a near-degenerate
        // eigenvalue gap cannot make the suite flaky.
        #![proptest_config(ProptestConfig { cases: 24, rng_seed: RngSeed::Fixed(7), ..ProptestConfig::default() })]

        #[test]
        fn soap_matches_reference_on_random_small_shapes(rows in 1usize..5, cols in 1usize..5, freq in 1u64..4, max_dim in 1usize..6) {
            // The first statistics have rank min(rows, cols); a rotated side with a null space of
            // two or more dimensions has no unique eigenbasis (any basis of the null space is
            // valid), so implementations legitimately differ there. Keep to unique bases.
            let k = rows.min(cols);
            prop_assume!(rows > max_dim || rows - k <= 1);
            prop_assume!(cols > max_dim || cols - k <= 1);
            compare(&[rows, cols], max_dim, freq, 6, 1e-4);
        }
    }
}
