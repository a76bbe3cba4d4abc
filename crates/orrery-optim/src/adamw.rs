//! AdamW (Loshchilov & Hutter): Adam with weight decay decoupled from the gradient.

use std::collections::BTreeMap;

use crate::state::{Reader, Writer};
use crate::{check_param, OptimError, Optimizer, Param, StepReport, TierUsage};

/// Hyper-parameters of [`AdamW`]. The learning rate is not here: the caller passes it to every
/// step, because the caller owns the schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Decay rates of the first and second moment (default 0.9, 0.999).
    pub betas: (f32, f32),
    /// Added to the root of the second moment (default 1e-8).
    pub eps: f32,
    /// Decoupled weight decay: each step multiplies the value by `1 - lr * weight_decay`
    /// (default 0.01).
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Moments of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AdamMoments {
    pub(crate) step: u64,
    pub(crate) m: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

impl AdamMoments {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            step: 0,
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// Updates the moments with `grad` and writes the bias-corrected Adam direction
    /// `m_hat / (sqrt(v_hat) + eps)` into `out` (same length as `grad`).
    pub(crate) fn direction(&mut self, betas: (f32, f32), eps: f32, grad: &[f32], out: &mut [f32]) {
        self.step += 1;
        let (b1, b2) = betas;
        // Bias corrections in f64 so that late steps (b^t tiny) do not lose precision; the
        // per-element arithmetic stays f32 like every other framework's AdamW.
        let t = i32::try_from(self.step).unwrap_or(i32::MAX);
        let bc1 = (1.0 - f64::from(b1).powi(t)) as f32;
        let bc2_sqrt = (1.0 - f64::from(b2).powi(t)).sqrt() as f32;
        for (((m, v), &g), o) in self.m.iter_mut().zip(self.v.iter_mut()).zip(grad).zip(out) {
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            // PyTorch's form: (m / bc1) / (sqrt(v) / sqrt(bc2) + eps).
            *o = (*m / bc1) / (v.sqrt() / bc2_sqrt + eps);
        }
    }

    pub(crate) fn write(&self, w: &mut Writer) {
        w.u64(self.step);
        w.f32s(&self.m);
        w.f32s(&self.v);
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self, OptimError> {
        let step = r.u64()?;
        let m = r.f32s()?;
        let v = r.f32s()?;
        if m.len() != v.len() {
            return Err(OptimError::BadState(format!(
                "adam moments have different lengths ({} and {})",
                m.len(),
                v.len()
            )));
        }
        Ok(Self { step, m, v })
    }
}

/// AdamW over named parameters; state is created on a parameter's first step.
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    state: BTreeMap<String, AdamMoments>,
}

const ADAMW_TAG: &[u8; 8] = b"ORADAMW1";

impl AdamW {
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            state: BTreeMap::new(),
        }
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Bytes of optimizer state currently held (moments only).
    pub fn state_bytes(&self) -> u64 {
        self.state
            .values()
            .map(|s| 4 * (s.m.len() + s.v.len()) as u64)
            .sum()
    }
}

impl Default for AdamW {
    fn default() -> Self {
        Self::new(AdamWConfig::default())
    }
}

/// Decoupled weight decay followed by the step along `dir`: `x = x*(1 - lr*wd) - lr*dir`.
pub(crate) fn apply_update(value: &mut [f32], dir: &[f32], lr: f32, weight_decay: f32) {
    let decay = 1.0 - lr * weight_decay;
    for (x, &d) in value.iter_mut().zip(dir) {
        *x = *x * decay - lr * d;
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, lr: f32, params: &mut [Param<'_>]) -> Result<StepReport, OptimError> {
        for p in params.iter() {
            check_param(p)?;
        }
        let mut dir = Vec::new();
        for p in params.iter_mut() {
            let n = p.value.len();
            let st = self
                .state
                .entry(p.name.to_owned())
                .or_insert_with(|| AdamMoments::new(n));
            if st.m.len() != n {
                return Err(OptimError::BadParam {
                    name: p.name.to_owned(),
                    problem: format!("has {n} elements but its state has {}", st.m.len()),
                });
            }
            dir.clear();
            dir.resize(n, 0.0);
            st.direction(self.config.betas, self.config.eps, p.grad, &mut dir);
            apply_update(p.value, &dir, lr, self.config.weight_decay);
        }
        Ok(StepReport::default())
    }

    /// AdamW keeps everything resident on the device.
    fn state_usage(&self) -> TierUsage {
        TierUsage {
            device_bytes: self.state_bytes(),
            ..TierUsage::default()
        }
    }

    fn save_state(&self) -> Vec<u8> {
        let mut w = Writer::new(ADAMW_TAG);
        w.u64(self.state.len() as u64);
        for (name, st) in &self.state {
            w.str(name);
            st.write(&mut w);
        }
        w.finish()
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        let mut r = Reader::new(bytes, ADAMW_TAG)?;
        let n = r.len()?;
        let mut state = BTreeMap::new();
        for _ in 0..n {
            let name = r.str()?;
            let st = AdamMoments::read(&mut r)?;
            state.insert(name, st);
        }
        r.end()?;
        self.state = state;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn run(opt: &mut AdamW, lr: f32, value: &mut [f32], grad: &[f32]) {
        let shape = [value.len()];
        let mut ps = [Param {
            name: "w",
            shape: &shape,
            value,
            grad,
        }];
        opt.step(lr, &mut ps).unwrap();
    }

    #[test]
    fn adamw_first_step_is_sign_step_plus_decay() {
        // Step 1: m_hat = g, v_hat = g^2, so the direction is g/(|g|+eps) ~ sign(g).
        let mut opt = AdamW::new(AdamWConfig {
            weight_decay: 0.1,
            ..Default::default()
        });
        let mut x = [1.0f32, -2.0, 0.5];
        run(&mut opt, 0.1, &mut x, &[0.5, -0.25, 0.0]);
        // x*(1 - 0.01) - 0.1*sign(g)
        let expect = [1.0 * 0.99 - 0.1, -2.0 * 0.99 + 0.1, 0.5 * 0.99];
        for (a, e) in x.iter().zip(expect) {
            assert!((a - e).abs() < 1e-6, "{a} vs {e}");
        }
    }

    #[test]
    fn adamw_second_step_matches_hand_computation() {
        let mut opt = AdamW::new(AdamWConfig {
            weight_decay: 0.0,
            ..Default::default()
        });
        let mut x = [0.0f32];
        run(&mut opt, 0.01, &mut x, &[1.0]);
        run(&mut opt, 0.01, &mut x, &[3.0]);
        // m = 0.9*0.1 + 0.1*3 = 0.39 ; bc1 = 0.19 ; m_hat = 2.0526316
        // v = 0.999*0.001 + 0.001*9 = 0.009999 ; bc2 = 0.001999 ; v_hat = 5.0020010
        let m_hat = 0.39f64 / 0.19;
        let v_hat = 0.009999f64 / 0.001999;
        let expect = -0.01 - 0.01 * m_hat / (v_hat.sqrt() + 1e-8);
        assert!(
            (f64::from(x[0]) - expect).abs() < 1e-6,
            "{} vs {expect}",
            x[0]
        );
    }

    #[test]
    fn adamw_state_round_trips() {
        let mut a = AdamW::default();
        let mut x = [1.0f32, 2.0];
        run(&mut a, 0.1, &mut x, &[0.3, -0.7]);
        let bytes = a.save_state();
        let mut b = AdamW::default();
        b.load_state(&bytes).unwrap();
        let mut y = x;
        run(&mut a, 0.1, &mut x, &[0.1, 0.2]);
        run(&mut b, 0.1, &mut y, &[0.1, 0.2]);
        assert_eq!(x.map(f32::to_bits), y.map(f32::to_bits));
        assert!(matches!(
            b.load_state(&bytes[..bytes.len() - 1]),
            Err(OptimError::BadState(_))
        ));
    }
}
