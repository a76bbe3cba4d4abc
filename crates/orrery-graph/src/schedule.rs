//! Pipeline schedules: the order in which one stage runs forward and backward passes.
//!
//! These follow Megatron-LM's `forward_backward_pipelining_without_interleaving` (1F1B) and
//! `forward_backward_pipelining_with_interleaving` exactly: the number of warm-up forwards,
//! the steady one-forward-one-backward phase and the cool-down backwards, and for the
//! interleaved schedule the mapping from a virtual micro-batch index to (model chunk,
//! micro-batch) in groups of `pp` micro-batches.

use serde::Serialize;

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Pass {
    Forward,
    Backward,
}

/// One pass of one micro-batch through one model chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Step {
    pub pass: Pass,
    pub microbatch: u32,
    pub chunk: u32,
}

/// Steps of stage `stage` of `pp` for `m` micro-batches and `v` chunks per stage.
///
/// `v == 1` gives 1F1B; `v > 1` the interleaved schedule, which needs `m % pp == 0`.
pub fn stage_order(stage: u32, pp: u32, m: u32, v: u32) -> Vec<Step> {
    let pp = pp.max(1);
    let v = v.max(1);
    let total = m * v;
    let warmup = if v == 1 {
        (pp - stage - 1).min(m)
    } else if m == pp {
        total
    } else {
        ((pp - stage - 1) * 2 + (v - 1) * pp).min(total)
    };
    let chunk_of = |k: u32, forward: bool| -> u32 {
        let c = (k % (pp * v)) / pp;
        if forward {
            c
        } else {
            v - c - 1
        }
    };
    let mb_of = |k: u32| -> u32 {
        if v == 1 {
            k
        } else {
            (k / (pp * v)) * pp + k % pp
        }
    };
    let fwd = |k: u32| Step {
        pass: Pass::Forward,
        microbatch: mb_of(k),
        chunk: chunk_of(k, true),
    };
    let bwd = |k: u32| Step {
        pass: Pass::Backward,
        microbatch: mb_of(k),
        chunk: chunk_of(k, false),
    };
    let mut steps = Vec::with_capacity(2 * total as usize);
    for k in 0..warmup {
        steps.push(fwd(k));
    }
    let steady = total - warmup;
    for k in 0..steady {
        steps.push(fwd(warmup + k));
        steps.push(bwd(k));
    }
    for k in steady..total {
        steps.push(bwd(k));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use expect_test::expect;

    fn show(steps: &[Step]) -> String {
        steps
            .iter()
            .map(|s| {
                let p = if s.pass == Pass::Forward { 'F' } else { 'B' };
                format!("{p}{}.{}", s.microbatch, s.chunk)
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn one_f_one_b_orders() {
        let all: Vec<String> = (0..4).map(|s| show(&stage_order(s, 4, 6, 1))).collect();
        expect![[r#"
            F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0
            F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 B4.0 B5.0
            F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 F4.0 B3.0 F5.0 B4.0 B5.0
            F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0"#]]
        .assert_eq(&all.join("\n"));
    }

    #[test]
    fn interleaved_orders() {
        let all: Vec<String> = (0..2).map(|s| show(&stage_order(s, 2, 4, 2))).collect();
        expect![[r#"
            F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0
            F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"#]]
        .assert_eq(&all.join("\n"));
    }

    #[test]
    fn every_pass_appears_once() {
        for (pp, m, v) in [(4, 8, 1), (4, 8, 2), (4, 4, 3), (8, 16, 4), (2, 1, 1)] {
            for s in 0..pp {
                let steps = stage_order(s, pp, m, v);
                assert_eq!(steps.len() as u32, 2 * m * v);
                for pass in [Pass::Forward, Pass::Backward] {
                    let mut seen: Vec<(u32, u32)> = steps
                        .iter()
                        .filter(|x| x.pass == pass)
                        .map(|x| (x.microbatch, x.chunk))
                        .collect();
                    seen.sort_unstable();
                    seen.dedup();
                    assert_eq!(seen.len() as u32, m * v);
                }
                // A backward never precedes its own forward.
                for (i, st) in steps.iter().enumerate() {
                    if st.pass == Pass::Backward {
                        assert!(steps[..i].iter().any(|f| f.pass == Pass::Forward
                            && f.microbatch == st.microbatch
                            && f.chunk == st.chunk));
                    }
                }
            }
        }
    }
}
