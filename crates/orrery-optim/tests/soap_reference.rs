//! SOAP against an independent `f64` implementation of the published algorithm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::lockstep::lockstep;

use common::{noise, step_one, RefSoap};
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
    step_one(&mut opt, 0.1, &[2, 3], &mut x, &g);
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
fn soap_matches_reference_over_thirty_calls_with_many_refreshes() {
    // Larger than the cases above and long enough for ten basis refreshes, so that an error
    // in carrying the moments across a refresh would accumulate. Square shapes keep the
    // eigenbases unique (see `random` below for why that matters).
    compare(&[8, 8], 10_000, 3, 30, 1e-5);
    // A tall matrix whose long side is left unrotated: only the right basis exists.
    compare(&[12, 7], 10, 4, 30, 1e-5);
}

/// Adam written out in `f32` with SOAP's conventions (bias correction folded into the step
/// size, `ε` added to `√v`, decay after the step), in the same operation order as the crate.
struct AdamF32 {
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl AdamF32 {
    fn new(n: usize) -> Self {
        Self {
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        }
    }

    fn step(&mut self, cfg: &SoapConfig, lr: f32, x: &mut [f32], g: &[f32]) {
        self.t += 1;
        let (b1, b2) = cfg.betas;
        let bc1 = 1.0 - f64::from(b1).powi(self.t);
        let bc2 = 1.0 - f64::from(b2).powi(self.t);
        let step_size = lr * (bc2.sqrt() / bc1) as f32;
        for (((xi, &gi), m), v) in x.iter_mut().zip(g).zip(&mut self.m).zip(&mut self.v) {
            *m = b1 * *m + (1.0 - b1) * gi;
            *v = b2 * *v + (1.0 - b2) * gi * gi;
            let d = *m / (v.sqrt() + cfg.eps);
            *xi += -step_size * d;
            *xi += -lr * cfg.weight_decay * *xi;
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn soap_with_no_rotated_side_is_adam_bit_for_bit() {
    // `max_precond_dim = 0`: neither side is rotated, so a matrix is plain Adam from its
    // first call, with the same betas, ε and bias correction.
    let cfg = SoapConfig {
        betas: (0.9, 0.95),
        weight_decay: 0.1,
        max_precond_dim: 0,
        ..SoapConfig::default()
    };
    let mut opt = Soap::new(cfg.clone());
    let mut adam = AdamF32::new(12);
    let mut x = noise(1, 12);
    let mut y = x.clone();
    for t in 0..20 {
        let g = noise(100 + t, 12);
        step_one(&mut opt, 3e-3, &[3, 4], &mut x, &g);
        adam.step(&cfg, 3e-3, &mut y, &g);
        assert_eq!(bits(&x), bits(&y), "call {t}");
    }
}

#[test]
fn soap_in_an_identity_eigenbasis_is_adam_bit_for_bit() {
    // A first gradient whose statistics are diagonal with distinct entries makes both initial
    // eigenbases the identity up to column signs, and a refresh period longer than the run
    // keeps them. Adam in that basis is Adam: sign flips cancel exactly between the rotation
    // and its inverse, and the moments are those of the unrotated gradients. So after the
    // skipped first call SOAP must take exactly Adam's steps; any scaling, transposition or
    // bias-correction error in the rotated path would show here.
    let n = 5;
    let cfg = SoapConfig {
        betas: (0.9, 0.95),
        weight_decay: 0.1,
        precondition_frequency: u64::MAX,
        ..SoapConfig::default()
    };
    let mut g0 = vec![0.0f32; n * n];
    for i in 0..n {
        g0[i * n + i] = (n - i) as f32;
    }
    let mut opt = Soap::new(cfg.clone());
    let mut x = noise(2, n * n);
    let mut y = x.clone();
    let before = x.clone();
    step_one(&mut opt, 3e-3, &[n, n], &mut x, &g0);
    assert_eq!(x, before, "the first call only builds the preconditioner");
    for part in ["QL", "QR"] {
        let q = opt.store().read(&Soap::state_key("w", part)).unwrap();
        for i in 0..n {
            for j in 0..n {
                let want = if i == j { 1.0 } else { 0.0 };
                assert_eq!(
                    q[i * n + j].abs(),
                    want,
                    "{part}[{i},{j}] = {}",
                    q[i * n + j]
                );
            }
        }
    }
    let mut adam = AdamF32::new(n * n);
    for t in 0..30 {
        let g = noise(200 + t, n * n);
        step_one(&mut opt, 3e-3, &[n, n], &mut x, &g);
        adam.step(&cfg, 3e-3, &mut y, &g);
        assert_eq!(bits(&x), bits(&y), "call {}", t + 2);
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
