//! Times SOAP's linear algebra and steps on one n×n parameter (default 512):
//! `cargo run --release -p orrery-optim --example soap_timing -- [n]`.
//! Prints medians of several repetitions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use orrery_optim::{linalg, refresh_basis, AdamW, Optimizer, Param, RefreshMode, Soap, SoapConfig};

fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(512);
    let reps = 5;
    let g = data(1, n * n);
    let mut l = vec![0.0f32; n * n];
    linalg::accumulate_left(&mut l, &g, n, n, 0.0);
    let time = |f: &mut dyn FnMut()| {
        median(
            (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        )
    };
    let mut q = Vec::new();
    let eigh = time(&mut || q = linalg::to_f32(&linalg::eigh_desc(&l, n).unwrap().1));
    let refresh = time(&mut || {
        refresh_basis(&l, &q, n).unwrap();
    });
    println!(
        "n={n}: exact eigh (f64) {:.1} ms; power-iteration+QR refresh {:.1} ms",
        eigh * 1e3,
        refresh * 1e3
    );

    // Per-step cost over 20 steps (frequency 10: two refreshes), sync vs async vs AdamW.
    let steps = 20;
    let run = |opt: &mut dyn Optimizer| -> (Vec<f64>, f64) {
        let mut x = data(2, n * n);
        let mut times = Vec::new();
        let mut wait = 0.0;
        for s in 0..steps {
            let g = data(100 + s, n * n);
            let t = Instant::now();
            let r = opt
                .step(
                    1e-3,
                    &mut [Param {
                        name: "w",
                        shape: &[n, n],
                        value: &mut x,
                        grad: &g,
                    }],
                )
                .unwrap();
            times.push(t.elapsed().as_secs_f64());
            wait += r.wait_seconds;
        }
        (times, wait)
    };
    let (sync, _) = run(&mut Soap::new(SoapConfig::default()));
    let cfg = SoapConfig {
        refresh: RefreshMode::Async {
            workers: 1,
            staleness: 1,
            apply_at_deadline: false,
        },
        ..SoapConfig::default()
    };
    let (asy, wait) = run(&mut Soap::new(cfg));
    let (adam, _) = run(&mut AdamW::default());
    let max = |v: &[f64]| v[1..].iter().copied().fold(0.0, f64::max);
    println!(
        "step ms (median / max after the first): adamw {:.2} / {:.2}; soap sync {:.2} / {:.2}; soap async(S=1) {:.2} / {:.2} (total wait {:.1} ms)",
        median(adam.clone()) * 1e3,
        max(&adam) * 1e3,
        median(sync.clone()) * 1e3,
        max(&sync) * 1e3,
        median(asy.clone()) * 1e3,
        max(&asy) * 1e3,
        wait * 1e3
    );
}
