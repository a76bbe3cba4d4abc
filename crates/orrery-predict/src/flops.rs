//! Model FLOPs: the work a training step does by the model's definition, independent of
//! how it is executed (recomputation and causal-mask savings do not count). MFU divides this
//! by what the hardware could do in the step time.

use orrery_spec::Job;

/// Model FLOPs of one training step: forward plus backward (3x forward) of every matmul with
/// its active parameters, the full (non-causal) attention score and value products, and the
/// output layer. For a dense GPT with MHA and f = 4h this equals Korthikanti et al. 2022
/// eq. 7, `72*B*s*L*h^2*(1 + s/(6h) + V/(12hL))`.
pub fn model_flops(job: &Job) -> f64 {
    let m = job.model();
    let tokens = job.tokens_per_step() as f64;
    let h = m.hidden as f64;
    let mut matmul_params = 0.0;
    for layer in 0..m.layers {
        matmul_params += (m.hidden * (m.q_dim() + 2 * m.kv_dim()) + m.q_dim() * m.hidden) as f64;
        matmul_params += match &m.moe {
            Some(moe) if m.is_moe_layer(layer) => {
                ((moe.top_k + moe.shared_experts) * m.expert_params() + m.hidden * moe.experts)
                    as f64
            }
            _ => (m.mlp_matrices() * m.hidden * m.ffn) as f64,
        };
    }
    let head = m.vocab as f64 * h;
    let attention = 4.0 * m.layers as f64 * m.seq_len as f64 * m.q_dim() as f64;
    3.0 * tokens * (2.0 * (matmul_params + head) + attention)
}

#[cfg(test)]
mod tests {
    use super::*;
    use orrery_spec::{load_job_spec, Job};

    #[test]
    fn equals_korthikanti_eq7_for_dense_gpt() {
        let text = r#"
            [model]
            layers = 48
            hidden = 6144
            heads = 64
            ffn = 24576
            vocab = 51200
            seq_len = 2048
            activation = "gelu"
            [training]
            global_batch = 4
            micro_batch = 4
            [parallel]
            tp = 8
            [cluster]
            gpu = "A100-80GB"
            nodes = 1
        "#;
        let job = Job::from_spec(&load_job_spec(text, &[]).unwrap()).unwrap();
        let (b, s, l, h, v) = (4.0f64, 2048.0f64, 48.0f64, 6144.0f64, 51200.0f64);
        let eq7 = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l));
        let ours = model_flops(&job);
        assert!((ours - eq7).abs() / eq7 < 1e-12, "{ours} vs {eq7}");
    }
}
