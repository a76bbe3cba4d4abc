//! The runtime's equivalence promises: asynchronous refresh at staleness 0 equals synchronous
//! SOAP bit for bit; state spilled to disk equals resident state bit for bit; a corrupted spill
//! file is reported, never used.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;

use common::{noise, shaped_params, step_one};
use orrery_optim::{Optimizer, Param, RefreshMode, Soap, SoapConfig, Tier, TierConfig};
use proptest::prelude::*;

/// Shapes of a small model: two matrices (one with a side above `max_precond_dim`) and a bias.
const SHAPES: [(&str, &[usize]); 4] = [
    ("a", &[3, 4]),
    ("b", &[5, 2]),
    ("wide", &[2, 9]),
    ("bias", &[4]),
];

fn run(cfg: SoapConfig, steps: u64, seed: u64) -> (Vec<Vec<u32>>, f64, Soap) {
    let mut opt = Soap::new(cfg);
    let mut xs: Vec<Vec<f32>> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, (_, s))| noise(seed + i as u64, s.iter().product()))
        .collect();
    let mut wait = 0.0;
    for t in 0..steps {
        let gs: Vec<Vec<f32>> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, (_, s))| noise(seed * 1000 + t * 10 + i as u64, s.iter().product()))
            .collect();
        let mut params = shaped_params(&SHAPES, &mut xs, &gs);
        wait += opt.step(0.01, &mut params).unwrap().wait_seconds;
    }
    (
        xs.iter()
            .map(|x| x.iter().map(|v| v.to_bits()).collect())
            .collect(),
        wait,
        opt,
    )
}

fn base() -> SoapConfig {
    SoapConfig {
        precondition_frequency: 2,
        max_precond_dim: 8,
        ..SoapConfig::default()
    }
}

fn spill_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("orrery-optim-rt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn async_staleness_zero_equals_sync(seed in 0u64..10_000, workers in 1usize..4, freq in 1u64..4) {
        let sync = SoapConfig { precondition_frequency: freq, ..base() };
        let asy = SoapConfig {
            refresh: RefreshMode::Async { workers, staleness: 0, apply_at_deadline: false },
            ..sync.clone()
        };
        let (a, _, _) = run(sync, 7, seed);
        let (b, _, _) = run(asy, 7, seed);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn rotation_by_orthogonal_bases_preserves_the_norm(seed in 0u64..10_000) {
        // Orthogonal bases from SOAP's own initial eigendecomposition of random statistics.
        let (rows, cols) = (3usize, 4usize);
        let g = noise(seed, rows * cols);
        let mut l = vec![0.0f32; rows * rows];
        let mut r = vec![0.0f32; cols * cols];
        orrery_optim::linalg::accumulate_left(&mut l, &g, rows, cols, 0.0);
        orrery_optim::linalg::accumulate_right(&mut r, &g, rows, cols, 0.0);
        let ql = orrery_optim::linalg::to_f32(&orrery_optim::linalg::eigh_desc(&l, rows).unwrap().1);
        let qr = orrery_optim::linalg::to_f32(&orrery_optim::linalg::eigh_desc(&r, cols).unwrap().1);
        let x = noise(seed + 1, rows * cols);
        let y = orrery_optim::rotate(&x, Some(&ql), Some(&qr), rows, cols);
        let back = orrery_optim::rotate_back(&y, Some(&ql), Some(&qr), rows, cols);
        let n = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
        prop_assert!((n(&x) - n(&y)).abs() < 1e-5 * n(&x).max(1.0));
        for (a, b) in x.iter().zip(&back) {
            prop_assert!((a - b).abs() < 1e-5);
        }
    }
}

#[test]
fn async_with_staleness_trains_and_deadline_mode_is_reproducible() {
    let cfg = SoapConfig {
        refresh: RefreshMode::Async {
            workers: 2,
            staleness: 2,
            apply_at_deadline: true,
        },
        ..base()
    };
    let (a, wait, opt) = run(cfg.clone(), 9, 3);
    let (b, _, _) = run(cfg, 9, 3);
    assert_eq!(a, b, "deadline mode must not depend on timing");
    assert!(wait >= 0.0 && wait.is_finite());
    assert_eq!(opt.workers(), 2);
    // A stale basis changes the numbers relative to synchronous SOAP.
    let (s, _, _) = run(base(), 9, 3);
    assert_ne!(a, s);
}

#[test]
fn spilled_state_equals_resident_state_bit_for_bit() {
    let (resident, _, r) = run(base(), 6, 11);
    let dir = spill_dir("all-disk");
    let tiers = TierConfig {
        device_budget: 0,
        host_budget: 0,
        spill_dir: dir.clone(),
    };
    let (spilled, _, s) = run(
        SoapConfig {
            tiers: Some(tiers),
            ..base()
        },
        6,
        11,
    );
    assert_eq!(resident, spilled);
    assert_eq!(s.state_usage().device_bytes, 0);
    assert_eq!(s.state_usage().disk_bytes, r.state_usage().device_bytes);
    assert_eq!(r.save_state(), s.save_state());
    drop(s);
    // Mixed placement: a small device budget, some host, the rest on disk.
    let tiers = TierConfig {
        device_budget: 200,
        host_budget: 300,
        spill_dir: dir.clone(),
    };
    let (mixed, _, m) = run(
        SoapConfig {
            tiers: Some(tiers),
            ..base()
        },
        6,
        11,
    );
    assert_eq!(resident, mixed);
    let u = m.state_usage();
    assert!(
        u.device_bytes <= 200 && u.host_bytes <= 300 && u.disk_bytes > 0,
        "{u:?}"
    );
    drop(m);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn corrupted_spill_file_is_reported_by_the_step() {
    let dir = spill_dir("corrupt");
    let tiers = TierConfig {
        device_budget: 0,
        host_budget: 0,
        spill_dir: dir.clone(),
    };
    let mut opt = Soap::new(SoapConfig {
        tiers: Some(tiers),
        ..base()
    });
    let mut x = noise(1, 12);
    let g = noise(2, 12);
    step_one(&mut opt, 0.01, &[3, 4], &mut x, &g);
    let key = Soap::state_key("w", "v");
    assert_eq!(opt.store().tier_of(&key), Some(Tier::Disk));
    let path = opt.store().spill_path(&key).unwrap().to_owned();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[17] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let before = x.clone();
    let err = opt
        .step(
            0.01,
            &mut [Param {
                name: "w",
                shape: &[3, 4],
                value: &mut x,
                grad: &g,
            }],
        )
        .unwrap_err();
    assert!(err.to_string().contains("corrupt"), "{err}");
    assert_eq!(x, before, "a corrupt state must not move the parameters");
    // save_state cannot return an error; the failure is carried into the bytes and refused.
    let saved = opt.save_state();
    let e = Soap::default().load_state(&saved).unwrap_err().to_string();
    assert!(e.contains("could not be saved"), "{e}");
    drop(opt);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn degenerate_shapes_do_not_panic() {
    use orrery_optim::{AdamW, Shampoo};
    let shapes: [&[usize]; 6] = [&[], &[0], &[0, 3], &[3, 0], &[1, 1], &[1, 5]];
    let opts: [Box<dyn Optimizer>; 3] = [
        Box::new(Soap::default()),
        Box::new(Shampoo::default()),
        Box::new(AdamW::default()),
    ];
    for mut opt in opts {
        for _ in 0..3 {
            for (i, shape) in shapes.iter().enumerate() {
                let n: usize = shape.iter().product();
                let mut x = noise(i as u64, n);
                let g = noise(10 + i as u64, n);
                let name = format!("p{i}");
                opt.step(
                    0.01,
                    &mut [Param {
                        name: &name,
                        shape,
                        value: &mut x,
                        grad: &g,
                    }],
                )
                .unwrap();
                assert!(x.iter().all(|v| v.is_finite()));
            }
        }
        // A mismatched buffer is an error, not a panic.
        let mut x = vec![0.0f32; 5];
        let e = opt.step(
            0.01,
            &mut [Param {
                name: "bad",
                shape: &[2, 3],
                value: &mut x,
                grad: &[0.0; 5],
            }],
        );
        assert!(e.is_err());
        // A known parameter changing size is an error too.
        let mut y = vec![0.0f32; 4];
        let g = [0.1f32; 4];
        let e = opt.step(
            0.01,
            &mut [Param {
                name: "p5",
                shape: &[2, 2],
                value: &mut y,
                grad: &g,
            }],
        );
        assert!(e.is_err());
        // Non-finite gradients are reported (SOAP/Shampoo) or propagate (AdamW), never panic.
        let mut z = vec![0.0f32; 4];
        let _ = opt.step(
            0.01,
            &mut [Param {
                name: "nan",
                shape: &[2, 2],
                value: &mut z,
                grad: &[f32::NAN; 4],
            }],
        );
    }
}

#[test]
fn async_resume_with_a_refresh_in_flight_is_bit_exact() {
    // Deadline mode is timing-independent, so a run saved while a refresh is pending and
    // resumed must equal the uninterrupted run bit for bit.
    let cfg = SoapConfig {
        refresh: RefreshMode::Async {
            workers: 1,
            staleness: 2,
            apply_at_deadline: true,
        },
        ..base()
    };
    let shape: &[usize] = &[3, 4];
    let grads: Vec<Vec<f32>> = (0..10).map(|t| noise(700 + t, 12)).collect();
    let mut full = Soap::new(cfg.clone());
    let mut x = noise(5, 12);
    let mut saved = None;
    let mut x_at_save = Vec::new();
    for (t, g) in grads.iter().enumerate() {
        full.step(
            0.01,
            &mut [Param {
                name: "w",
                shape,
                value: &mut x,
                grad: g,
            }],
        )
        .unwrap();
        if t == 4 {
            // Step 4 (Adam step 4) requested a refresh due at step 8: it is in flight.
            saved = Some(full.save_state());
            x_at_save = x.clone();
        }
    }
    let mut resumed = Soap::new(cfg);
    resumed.load_state(&saved.unwrap()).unwrap();
    let mut y = x_at_save;
    for g in &grads[5..] {
        resumed
            .step(
                0.01,
                &mut [Param {
                    name: "w",
                    shape,
                    value: &mut y,
                    grad: g,
                }],
            )
            .unwrap();
    }
    assert_eq!(
        x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

fn run_shampoo(cfg: orrery_optim::ShampooConfig, steps: u64, seed: u64) -> Vec<Vec<u32>> {
    let mut opt = orrery_optim::Shampoo::new(cfg);
    let mut xs: Vec<Vec<f32>> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, (_, s))| noise(seed + i as u64, s.iter().product()))
        .collect();
    for t in 0..steps {
        let gs: Vec<Vec<f32>> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, (_, s))| noise(seed * 1000 + t * 10 + i as u64, s.iter().product()))
            .collect();
        let mut params = shaped_params(&SHAPES, &mut xs, &gs);
        opt.step(0.01, &mut params).unwrap();
    }
    xs.iter()
        .map(|x| x.iter().map(|v| v.to_bits()).collect())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    #[test]
    fn shampoo_async_staleness_zero_equals_sync(seed in 0u64..10_000, workers in 1usize..3, freq in 1u64..4) {
        let sync = orrery_optim::ShampooConfig {
            precondition_frequency: freq,
            max_preconditioner_dim: 3,
            ..orrery_optim::ShampooConfig::default()
        };
        let asy = orrery_optim::ShampooConfig {
            refresh: RefreshMode::Async { workers, staleness: 0, apply_at_deadline: false },
            ..sync
        };
        prop_assert_eq!(run_shampoo(sync, 7, seed), run_shampoo(asy, 7, seed));
    }
}

#[test]
fn shampoo_async_deadline_mode_is_reproducible_and_stale() {
    let sync = orrery_optim::ShampooConfig {
        precondition_frequency: 2,
        ..orrery_optim::ShampooConfig::default()
    };
    let asy = orrery_optim::ShampooConfig {
        refresh: RefreshMode::Async {
            workers: 2,
            staleness: 1,
            apply_at_deadline: true,
        },
        ..sync
    };
    let a = run_shampoo(asy, 8, 4);
    assert_eq!(a, run_shampoo(asy, 8, 4));
    assert_ne!(a, run_shampoo(sync, 8, 4));
}

#[test]
fn shampoo_async_resume_with_roots_in_flight_is_bit_exact() {
    let cfg = orrery_optim::ShampooConfig {
        precondition_frequency: 2,
        max_preconditioner_dim: 2,
        refresh: RefreshMode::Async {
            workers: 1,
            staleness: 2,
            apply_at_deadline: true,
        },
        ..orrery_optim::ShampooConfig::default()
    };
    let shape: &[usize] = &[3, 4];
    let grads: Vec<Vec<f32>> = (0..10).map(|t| noise(900 + t, 12)).collect();
    let mut full = orrery_optim::Shampoo::new(cfg);
    let mut x = noise(6, 12);
    let (mut saved, mut x_at_save) = (None, Vec::new());
    for (t, g) in grads.iter().enumerate() {
        full.step(
            0.01,
            &mut [Param {
                name: "w",
                shape,
                value: &mut x,
                grad: g,
            }],
        )
        .unwrap();
        if t == 3 {
            saved = Some(full.save_state());
            x_at_save = x.clone();
        }
    }
    let mut resumed = orrery_optim::Shampoo::new(cfg);
    resumed.load_state(&saved.unwrap()).unwrap();
    let mut y = x_at_save;
    for g in &grads[4..] {
        resumed
            .step(
                0.01,
                &mut [Param {
                    name: "w",
                    shape,
                    value: &mut y,
                    grad: g,
                }],
            )
            .unwrap();
    }
    assert_eq!(
        x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

/// The wait of each call of an optimizer on one `n`×`n` matrix with fresh gradients.
fn waits(opt: &mut dyn Optimizer, n: usize, calls: u64) -> Vec<f64> {
    let mut x = noise(1, n * n);
    (0..calls)
        .map(|c| {
            let g = noise(500 + c, n * n);
            opt.step(
                0.01,
                &mut [Param {
                    name: "w",
                    shape: &[n, n],
                    value: &mut x,
                    grad: &g,
                }],
            )
            .unwrap()
            .wait_seconds
        })
        .collect()
}

#[test]
fn a_step_that_blocks_on_a_refresh_reports_its_wait() {
    // Staleness 0 makes every refresh due at the very step that requests it, so that step
    // must block until a worker has done one power iteration and a QR of a 96×96 statistic:
    // its wait has to be counted. Steps without a refresh in flight block on nothing and
    // report exactly zero; so does the synchronous optimizer, which never waits for a worker
    // (its refresh time is part of the step, not a wait). Only "> 0" is asserted about the
    // clock.
    let (n, freq) = (96, 3);
    let sync = SoapConfig {
        precondition_frequency: freq,
        ..SoapConfig::default()
    };
    let asy = SoapConfig {
        refresh: RefreshMode::Async {
            workers: 1,
            staleness: 0,
            apply_at_deadline: false,
        },
        ..sync.clone()
    };
    let w = waits(&mut Soap::new(asy), n, 10);
    // Call 0 builds the preconditioner; call c is SOAP step c, which refreshes when
    // c % freq == 0.
    for (c, &wait) in w.iter().enumerate() {
        if c > 0 && (c as u64).is_multiple_of(freq) {
            assert!(
                wait > 0.0,
                "call {c} blocked on its refresh but reported {wait}"
            );
        } else {
            assert_eq!(wait, 0.0, "call {c} had nothing to wait for");
        }
    }
    assert!(waits(&mut Soap::new(sync), n, 10).iter().all(|&w| w == 0.0));

    // Shampoo's inverse roots go through the same machinery.
    let shampoo = orrery_optim::ShampooConfig {
        precondition_frequency: freq,
        refresh: RefreshMode::Async {
            workers: 1,
            staleness: 0,
            apply_at_deadline: false,
        },
        ..orrery_optim::ShampooConfig::default()
    };
    let w = waits(&mut orrery_optim::Shampoo::new(shampoo), n, 10);
    assert!(w.iter().any(|&x| x > 0.0), "{w:?}");
}
