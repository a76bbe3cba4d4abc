//! Learning-rate schedule: linear warm-up, then cosine decay to a floor.

/// Learning rate of the update with 0-based index `step` in a run of `total` steps: rises
/// linearly to `peak` over `warmup` steps (the first update already uses `peak / warmup`, never
/// 0), then follows half a cosine down to `peak * min_ratio` at the last step.
pub fn lr_at(step: u64, total: u64, warmup: u64, peak: f64, min_ratio: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup).saturating_sub(1).max(1);
    let progress = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
    let floor = peak * min_ratio;
    floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let lr = |s| lr_at(s, 110, 10, 1.0, 0.1);
        assert!((lr(0) - 0.1).abs() < 1e-12);
        assert!((lr(9) - 1.0).abs() < 1e-12);
        assert!((lr(10) - 1.0).abs() < 1e-12);
        assert!((lr(109) - 0.1).abs() < 1e-12);
        assert!((lr(60) - 0.55).abs() < 0.01);
        for s in 10..109 {
            assert!(lr(s + 1) <= lr(s));
        }
    }

    #[test]
    fn no_warmup_and_single_step() {
        assert!((lr_at(0, 1, 0, 2.0, 0.0) - 2.0).abs() < 1e-12);
        assert!((lr_at(0, 5, 0, 2.0, 0.5) - 2.0).abs() < 1e-12);
    }
}
