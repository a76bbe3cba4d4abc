//! The one piece of the test support that touches the crate: a driver that steps an
//! optimizer and a reference side by side on the same gradients.

use orrery_optim::{Optimizer, Param};

/// A reference optimizer step in `f64`.
pub trait RefStep {
    fn ref_step(&mut self, lr: f64, x: &mut [f64], g: &[f64]);
}

impl RefStep for super::RefSoap {
    fn ref_step(&mut self, lr: f64, x: &mut [f64], g: &[f64]) {
        self.step(lr, x, g);
    }
}

impl RefStep for super::RefShampoo {
    fn ref_step(&mut self, lr: f64, x: &mut [f64], g: &[f64]) {
        self.step(lr, x, g);
    }
}

/// Runs `steps` calls of `opt` and of `reference` on the same gradients (seeded
/// `grad_seed + call`, independent of the iterate) from the same start (seeded `x_seed`),
/// and checks every element after every call is within `tol` of the reference.
#[allow(clippy::too_many_arguments)]
pub fn lockstep(
    opt: &mut dyn Optimizer,
    reference: &mut dyn RefStep,
    shape: &[usize],
    lr: f32,
    x_seed: u64,
    grad_seed: u64,
    steps: u64,
    tol: f64,
) {
    let n: usize = shape.iter().product();
    let mut x: Vec<f32> = super::noise(x_seed, n);
    let mut xr: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for s in 0..steps {
        let g = super::noise(grad_seed + s, n);
        let gr: Vec<f64> = g.iter().map(|&v| f64::from(v)).collect();
        opt.step(
            lr,
            &mut [Param {
                name: "w",
                shape,
                value: &mut x,
                grad: &g,
            }],
        )
        .unwrap();
        reference.ref_step(f64::from(lr), &mut xr, &gr);
        for (i, (a, b)) in x.iter().zip(&xr).enumerate() {
            assert!(
                (f64::from(*a) - b).abs() <= tol,
                "shape {shape:?} call {s} element {i}: optimizer {a} vs reference {b}"
            );
        }
    }
}
