//! Built-in GPUs, models and whole jobs.
//!
//! GPU numbers are datasheet values (dense, no sparsity). HBM capacity is what the driver
//! reports to the allocator (`nvidia-smi`), which is the number an OOM verdict must use.
//! Model shapes are the published architectures; "-shaped" presets say where they deviate.

use crate::raw::{Activation, JobSpec, ModelSpec, MoeSpec};

/// GPU generations, which decide the cost model's efficiency constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuArch {
    Ampere,
    Hopper,
    Blackwell,
}

/// A GPU preset: datasheet numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuPreset {
    pub name: &'static str,
    pub arch: GpuArch,
    /// Dense BF16/FP16 tensor-core peak, TFLOP/s.
    pub bf16_tflops: f64,
    /// Dense FP8 tensor-core peak, TFLOP/s; `None` where the hardware has no FP8.
    pub fp8_tflops: Option<f64>,
    /// Capacity visible to the allocator, GiB.
    pub hbm_gib: f64,
    /// HBM bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// NVLink bandwidth per GPU per direction, GB/s (half the bidirectional datasheet figure).
    pub nvlink_gbps: f64,
    /// NIC bandwidth per GPU in typical clusters of this GPU, Gb/s.
    pub default_nic_gbps: f64,
}

/// Every built-in GPU. Sources: NVIDIA A100, H100, H200, B200 datasheets; H800 is the
/// export variant of H100 SXM with NVLink cut to 400 GB/s bidirectional.
pub const GPUS: &[GpuPreset] = &[
    GpuPreset {
        name: "A100-40GB",
        arch: GpuArch::Ampere,
        bf16_tflops: 312.0,
        fp8_tflops: None,
        hbm_gib: 40.0,
        hbm_gbps: 1555.0,
        nvlink_gbps: 300.0,
        default_nic_gbps: 200.0,
    },
    GpuPreset {
        name: "A100-80GB",
        arch: GpuArch::Ampere,
        bf16_tflops: 312.0,
        fp8_tflops: None,
        hbm_gib: 80.0,
        hbm_gbps: 2039.0,
        nvlink_gbps: 300.0,
        default_nic_gbps: 200.0,
    },
    GpuPreset {
        name: "H100-SXM",
        arch: GpuArch::Hopper,
        bf16_tflops: 989.4,
        fp8_tflops: Some(1978.9),
        hbm_gib: 79.6,
        hbm_gbps: 3350.0,
        nvlink_gbps: 450.0,
        default_nic_gbps: 400.0,
    },
    GpuPreset {
        name: "H800",
        arch: GpuArch::Hopper,
        bf16_tflops: 989.4,
        fp8_tflops: Some(1978.9),
        hbm_gib: 79.6,
        hbm_gbps: 3350.0,
        nvlink_gbps: 200.0,
        default_nic_gbps: 400.0,
    },
    GpuPreset {
        name: "H200",
        arch: GpuArch::Hopper,
        bf16_tflops: 989.4,
        fp8_tflops: Some(1978.9),
        hbm_gib: 140.4,
        hbm_gbps: 4800.0,
        nvlink_gbps: 450.0,
        default_nic_gbps: 400.0,
    },
    GpuPreset {
        name: "B200",
        arch: GpuArch::Blackwell,
        bf16_tflops: 2250.0,
        fp8_tflops: Some(4500.0),
        hbm_gib: 179.0,
        hbm_gbps: 8000.0,
        nvlink_gbps: 900.0,
        default_nic_gbps: 400.0,
    },
];

/// Looks a GPU up by name, ignoring case and the characters `-`, `_` and space.
pub fn gpu(name: &str) -> Option<&'static GpuPreset> {
    let key = normalise(name);
    GPUS.iter()
        .find(|g| normalise(g.name) == key || alias(&key) == Some(g.name))
}

fn alias(key: &str) -> Option<&'static str> {
    match key {
        "a100" | "a10080" | "a100sxm" => Some("A100-80GB"),
        "a10040" => Some("A100-40GB"),
        "h100" | "h100sxm5" => Some("H100-SXM"),
        _ => None,
    }
}

fn normalise(s: &str) -> String {
    s.chars()
        .filter(|c| !matches!(c, '-' | '_' | ' '))
        .flat_map(char::to_lowercase)
        .collect()
}

/// Names of the built-in models.
pub const MODEL_NAMES: &[&str] = &[
    "gpt3-175b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "mixtral-8x7b",
    "deepseek-v3",
];

/// A built-in model shape as a fully populated [`ModelSpec`].
pub fn model(name: &str) -> Option<ModelSpec> {
    let key = normalise(name);
    let dense = |name: &str, layers, hidden, heads, kv, ffn, vocab, seq, act, tied| ModelSpec {
        preset: None,
        name: Some(name.to_string()),
        layers: Some(layers),
        hidden: Some(hidden),
        heads: Some(heads),
        kv_heads: Some(kv),
        head_dim: None,
        ffn: Some(ffn),
        vocab: Some(vocab),
        seq_len: Some(seq),
        activation: Some(act),
        tied_embeddings: Some(tied),
        moe: None,
    };
    use Activation::{Gelu, Swiglu};
    let spec = match key.as_str() {
        // Brown et al. 2020, Table 2.1.
        "gpt3175b" => dense(
            "GPT-3 175B",
            96,
            12288,
            96,
            96,
            49152,
            51200,
            2048,
            Gelu,
            true,
        ),
        // Llama 3 herd paper (Dubey et al. 2024), Table 3.
        "llama38b" => dense(
            "Llama-3 8B",
            32,
            4096,
            32,
            8,
            14336,
            128256,
            8192,
            Swiglu,
            false,
        ),
        "llama370b" => dense(
            "Llama-3 70B",
            80,
            8192,
            64,
            8,
            28672,
            128256,
            8192,
            Swiglu,
            false,
        ),
        "llama3405b" => dense(
            "Llama-3 405B",
            126,
            16384,
            128,
            8,
            53248,
            128256,
            8192,
            Swiglu,
            false,
        ),
        // Mistral AI, Mixtral of Experts (Jiang et al. 2024): 8 experts, top-2, every layer.
        "mixtral8x7b" => {
            let mut m = dense(
                "Mixtral 8x7B",
                32,
                4096,
                32,
                8,
                14336,
                32000,
                4096,
                Swiglu,
                false,
            );
            m.moe = Some(MoeSpec {
                experts: Some(8),
                top_k: Some(2),
                expert_ffn: Some(14336),
                shared_experts: Some(0),
                first_dense: Some(0),
                every: Some(1),
            });
            m
        }
        // DeepSeek-V3 technical report: 61 layers, first 3 dense, 256 routed experts of
        // 2048, top-8, one shared expert. Multi-head latent attention is approximated as
        // multi-head attention with 128 heads of dimension 128 (the value head size); the
        // low-rank KV compression is not modelled, so attention memory is overstated.
        "deepseekv3" => {
            let mut m = dense(
                "DeepSeek-V3-shaped",
                61,
                7168,
                128,
                128,
                18432,
                129280,
                4096,
                Swiglu,
                false,
            );
            m.head_dim = Some(128);
            m.moe = Some(MoeSpec {
                experts: Some(256),
                top_k: Some(8),
                expert_ffn: Some(2048),
                shared_experts: Some(1),
                first_dense: Some(3),
                every: Some(1),
            });
            m
        }
        _ => return None,
    };
    Some(spec)
}

/// Names of the built-in jobs, default first.
pub const JOB_NAMES: &[&str] = &[
    "llama3-70b-h100x1024",
    "llama3-405b-h100x8192",
    "gpt3-175b-a100x1024",
    "mixtral-8x7b-h100x64",
    "deepseek-v3-h800x2048",
];

/// The job `orrery predict` runs when given nothing.
pub const DEFAULT_JOB: &str = "llama3-70b-h100x1024";

/// The TOML text of a built-in job.
pub fn job_toml(name: &str) -> Option<&'static str> {
    let key = normalise(name);
    let text = match key.as_str() {
        "llama370bh100x1024" => include_str!("../presets/llama3-70b-h100x1024.toml"),
        "llama3405bh100x8192" => include_str!("../presets/llama3-405b-h100x8192.toml"),
        "gpt3175ba100x1024" => include_str!("../presets/gpt3-175b-a100x1024.toml"),
        "mixtral8x7bh100x64" => include_str!("../presets/mixtral-8x7b-h100x64.toml"),
        "deepseekv3h800x2048" => include_str!("../presets/deepseek-v3-h800x2048.toml"),
        _ => return None,
    };
    Some(text)
}

/// A built-in job as a raw spec.
pub fn job(name: &str) -> Option<JobSpec> {
    // The embedded files are checked by a unit test, so a parse failure here is a bug
    // caught in CI; still, report it as "no such preset" rather than panic.
    job_toml(name).and_then(|t| toml::from_str(t).ok())
}
