//! The compute cost model: how long one compute op takes on one GPU.
//!
//! Every op is costed by a roofline: the larger of its FLOPs over the achievable FLOP rate
//! and its bytes over the achievable HBM bandwidth, plus a fixed per-kernel overhead. The
//! achievable rates are datasheet peaks times efficiencies that depend on the kind of op and
//! its shape. Every constant is stated here with where it comes from; none is fitted to the
//! validation rows.

use orrery_graph::ComputeKind;
use orrery_spec::{Gpu, GpuArch};
use orrery_units::{Bytes, Flops, Picos};
use serde::Serialize;

/// The constants of the compute cost model for one GPU.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    pub gpu_name: String,
    /// Dense BF16/FP16 peak, FLOP/s.
    pub bf16_peak: f64,
    /// Dense FP8 peak, FLOP/s (BF16 peak where the GPU has no FP8).
    pub fp8_peak: f64,
    /// HBM bandwidth, B/s.
    pub hbm_bandwidth: f64,
    /// Best GEMM efficiency on large, well-shaped problems. cuBLAS reaches about 271 of
    /// 312 TFLOP/s on A100 (0.87) and about 795 of 989 on H100 SXM (0.80); Blackwell is
    /// assumed to match Hopper until measured.
    pub gemm_max_efficiency: f64,
    /// Best FP8 GEMM efficiency relative to the FP8 peak. Transformer Engine FP8 GEMMs reach
    /// roughly 1.3-1.5x BF16 throughput end to end, not 2x, i.e. ~0.6 of FP8 peak.
    pub fp8_max_efficiency: f64,
    /// Dimension at which a GEMM reaches half of its best efficiency along that dimension:
    /// `eff(d) = d / (d + half)`. Models tile quantisation and too few thread blocks on
    /// small dimensions: 128 for Ampere, whose cuBLAS kernels use 128-wide tiles on 108
    /// SMs; 256 for Hopper and Blackwell, whose warp-group kernels use 128x256 tiles on
    /// 132+ SMs and so need twice the work per dimension to fill the machine.
    pub gemm_half_dim: f64,
    /// Flash-attention efficiency relative to the BF16 peak, forward and backward.
    /// FlashAttention-2 reports up to ~0.72 (fwd) and ~0.6 (bwd) on A100; on H100,
    /// cuDNN/Transformer-Engine fused attention reaches ~0.55 (fwd) and ~0.45 (bwd).
    pub flash_fwd_efficiency: f64,
    pub flash_bwd_efficiency: f64,
    /// Sequence length at which flash attention reaches half its best efficiency
    /// (short sequences leave the tensor cores idle between tiles).
    pub flash_half_seq: f64,
    /// Fraction of HBM bandwidth bandwidth-bound kernels reach (elementwise, norms,
    /// softmax, optimizer). Typical fused PyTorch/Apex kernels reach 80% of datasheet.
    pub memory_efficiency: f64,
    /// Fixed cost of one kernel (launch and tail), added to every compute op.
    pub kernel_overhead: Picos,
    /// Slowdown of a compute kernel that starts while a communication kernel runs on the
    /// same GPU: NCCL and Transformer Engine's userbuffers occupy 8-32 of the GPU's SMs and
    /// part of its HBM bandwidth while they run, so overlapped compute does not run at full
    /// speed. 0.10 corresponds to losing ~13 of H100's 132 SMs.
    pub overlap_slowdown: f64,
}

impl CostModel {
    /// The cost model for a GPU, with constants by architecture.
    pub fn for_gpu(gpu: &Gpu) -> CostModel {
        let (gemm, fp8, ffwd, fbwd, half) = match gpu.arch {
            GpuArch::Ampere => (0.87, 0.87, 0.65, 0.55, 128.0),
            GpuArch::Hopper | GpuArch::Blackwell => (0.80, 0.60, 0.55, 0.45, 256.0),
        };
        CostModel {
            gpu_name: gpu.name.clone(),
            bf16_peak: gpu.bf16_peak.0,
            fp8_peak: gpu.fp8_peak.map_or(gpu.bf16_peak.0, |f| f.0),
            hbm_bandwidth: gpu.hbm_bandwidth.0,
            gemm_max_efficiency: gemm,
            fp8_max_efficiency: fp8,
            gemm_half_dim: half,
            flash_fwd_efficiency: ffwd,
            flash_bwd_efficiency: fbwd,
            flash_half_seq: 256.0,
            memory_efficiency: 0.80,
            kernel_overhead: Picos::from_nanos(3_000),
            overlap_slowdown: 0.10,
        }
    }

    fn dim_efficiency(&self, d: u64) -> f64 {
        let d = d as f64;
        d / (d + self.gemm_half_dim)
    }

    /// Efficiency of a GEMM of this shape relative to the peak it runs at.
    pub fn gemm_efficiency(&self, m: u64, n: u64, k: u64, fp8: bool) -> f64 {
        let best = if fp8 {
            self.fp8_max_efficiency
        } else {
            self.gemm_max_efficiency
        };
        best * self.dim_efficiency(m) * self.dim_efficiency(n) * self.dim_efficiency(k)
    }

    fn memory_time(&self, bytes: Bytes) -> f64 {
        bytes.as_f64() / (self.hbm_bandwidth * self.memory_efficiency)
    }

    /// Duration of a compute op that shares the GPU with running communication kernels.
    pub fn duration_overlapped(&self, kind: &ComputeKind, flops: Flops, bytes: Bytes) -> Picos {
        let d = self.duration(kind, flops, bytes);
        Picos::from_secs_f64(d.as_secs_f64() * (1.0 + self.overlap_slowdown))
    }

    /// Duration of a compute op.
    pub fn duration(&self, kind: &ComputeKind, flops: Flops, bytes: Bytes) -> Picos {
        let secs = match *kind {
            ComputeKind::Gemm { m, n, k, fp8, .. } => {
                let peak = if fp8 { self.fp8_peak } else { self.bf16_peak };
                let rate = peak * self.gemm_efficiency(m, n, k, fp8);
                (flops.0 / rate).max(self.memory_time(bytes))
            }
            ComputeKind::Attention {
                seq_q,
                seq_kv,
                head_dim,
                flash,
                backward,
                ..
            } => {
                if flash {
                    let best = if backward {
                        self.flash_bwd_efficiency
                    } else {
                        self.flash_fwd_efficiency
                    };
                    let s = seq_kv as f64;
                    let eff = best * s / (s + self.flash_half_seq);
                    (flops.0 / (self.bf16_peak * eff)).max(self.memory_time(bytes))
                } else {
                    // Unfused: batched GEMMs for QK^T and PV, then separate bandwidth-bound
                    // softmax and dropout kernels over the materialised scores.
                    let eff = self.gemm_efficiency(seq_q, seq_kv, head_dim, false);
                    flops.0 / (self.bf16_peak * eff) + self.memory_time(bytes)
                }
            }
            ComputeKind::MemoryBound => self.memory_time(bytes),
        };
        Picos::from_secs_f64(secs) + self.kernel_overhead
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orrery_units::{Bandwidth, FlopRate};

    fn h100() -> Gpu {
        Gpu {
            name: "H100-SXM".into(),
            arch: GpuArch::Hopper,
            bf16_peak: FlopRate::from_tflops(989.4),
            fp8_peak: Some(FlopRate::from_tflops(1978.9)),
            hbm: Bytes::from_gib(80.0),
            hbm_bandwidth: Bandwidth::from_gbytes_per_sec(3350.0),
            nvlink_bandwidth: Bandwidth::from_gbytes_per_sec(450.0),
        }
    }

    #[test]
    fn large_gemm_approaches_the_best_efficiency() {
        let c = CostModel::for_gpu(&h100());
        let e = c.gemm_efficiency(32768, 32768, 32768, false);
        assert!(e > 0.77 && e <= 0.80, "{e}");
        // Small GEMMs are much less efficient.
        assert!(c.gemm_efficiency(256, 256, 256, false) < 0.4);
    }

    #[test]
    fn gemm_roofline_closed_form() {
        let c = CostModel::for_gpu(&h100());
        let (m, n, k) = (8192u64, 8192u64, 8192u64);
        let flops = Flops(2.0 * (m * n * k) as f64);
        let kind = ComputeKind::Gemm {
            m,
            n,
            k,
            batch: 1,
            fp8: false,
        };
        let d = c.duration(&kind, flops, Bytes(2 * (m * k + k * n + m * n)));
        let expect = flops.0 / (989.4e12 * c.gemm_efficiency(m, n, k, false));
        let expect = Picos::from_secs_f64(expect) + c.kernel_overhead;
        assert_eq!(d, expect);
    }

    #[test]
    fn memory_bound_ops_run_at_memory_speed() {
        let c = CostModel::for_gpu(&h100());
        let d = c.duration(&ComputeKind::MemoryBound, Flops(0.0), Bytes(2_680_000_000));
        // 2.68 GB at 0.8 * 3.35 TB/s = 1 ms, plus the kernel overhead.
        assert_eq!(d, Picos::from_secs_f64(1e-3) + c.kernel_overhead);
    }

    #[test]
    fn fp8_is_faster_but_not_twice() {
        let c = CostModel::for_gpu(&h100());
        let (m, n, k) = (8192u64, 8192u64, 8192u64);
        let flops = Flops(2.0 * (m * n * k) as f64);
        let b = c.duration(
            &ComputeKind::Gemm {
                m,
                n,
                k,
                batch: 1,
                fp8: false,
            },
            flops,
            Bytes(0),
        );
        let f = c.duration(
            &ComputeKind::Gemm {
                m,
                n,
                k,
                batch: 1,
                fp8: true,
            },
            flops,
            Bytes(0),
        );
        let speedup = b.as_secs_f64() / f.as_secs_f64();
        assert!(speedup > 1.3 && speedup < 1.6, "{speedup}");
    }
}
