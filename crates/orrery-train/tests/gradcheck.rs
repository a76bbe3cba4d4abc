#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Finite-difference check of the model's gradients, in its own test binary: burn resolves a
//! tensor's float dtype through per-device defaults shared by every backend on that device, so
//! f32 tests running earlier in the same process would make these "f64" tensors f32.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use orrery_train::model::{param_specs, Aux, Gpt};
use orrery_train::params::{collect_grads, ParamStore};
use orrery_train::rng::Rng;
use orrery_train::{MlpKind, ModelConfig, NormKind, PositionKind};

type F64 = NdArray<f64>;

fn small() -> ModelConfig {
    ModelConfig {
        context: 8,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        d_ff: 24,
        // Larger than GPT-2's 0.02 so that the check sees real signal.
        init_std: 0.2,
        ..ModelConfig::default()
    }
}

fn tokens<B: Backend>(ids: &[i64], b: usize, t: usize, dev: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(ids.to_vec(), [b, t]), dev)
}

fn ids(n: usize, seed: u64) -> Vec<i64> {
    let mut r = Rng::new(seed, 9);
    (0..n).map(|_| r.below(256) as i64).collect()
}

/// Backward through burn's autodiff agrees with central differences of the loss, computed in
/// f64, for the largest-gradient element of every parameter.
#[test]
fn gradients_match_finite_differences() {
    type B = Autodiff<F64>;
    let cfgs = [
        ModelConfig {
            norm: NormKind::RmsNorm,
            mlp: MlpKind::SwiGlu,
            ..small()
        },
        ModelConfig {
            positions: PositionKind::Learned,
            tie_embeddings: false,
            n_kv_heads: 1,
            n_layers: 1,
            ..small()
        },
    ];
    let mut bad = Vec::new();
    for cfg in cfgs {
        let specs = param_specs(&cfg);
        let store = ParamStore::init(&specs, &mut Rng::new(5, 0));
        let dev = Default::default();
        let (x, y) = (ids(16, 7), ids(16, 8));
        let aux = Aux::new(&cfg, 8, &dev);
        let m = Gpt::<B>::build(&cfg, &store, &dev, true).unwrap();
        let grads = m
            .loss(
                &cfg,
                tokens::<B>(&x, 2, 8, &dev),
                tokens::<B>(&y, 2, 8, &dev),
                &aux,
            )
            .backward();
        let mut g = ParamStore::zeros(&specs);
        collect_grads::<B, _>(&m, &grads, &mut g).unwrap();

        let aux64 = Aux::<F64>::new(&cfg, 8, &dev);
        let loss_of = |s: &ParamStore| -> f64 {
            let m = Gpt::<F64>::build(&cfg, s, &dev, false).unwrap();
            m.loss(
                &cfg,
                tokens::<F64>(&x, 2, 8, &dev),
                tokens::<F64>(&y, 2, 8, &dev),
                &aux64,
            )
            .into_data()
            .convert::<f64>()
            .into_vec::<f64>()
            .unwrap()[0]
        };
        for i in 0..store.len() {
            let (j, &gj) = g
                .values(i)
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            let v = store.values(i)[j];
            // Large enough that the backend's rounding (about 1e-9 on the loss) is negligible,
            // small enough that the O(h^2) truncation error is too.
            let h = 1e-3f64;
            let mut plus = store.clone();
            let vp = (f64::from(v) + h) as f32;
            plus.values_mut(i)[j] = vp;
            let mut minus = store.clone();
            let vm = (f64::from(v) - h) as f32;
            minus.values_mut(i)[j] = vm;
            let fd = (loss_of(&plus) - loss_of(&minus)) / (f64::from(vp) - f64::from(vm));
            let err = (fd - f64::from(gj)).abs();
            if err > 1e-4 + 1e-3 * fd.abs() {
                bad.push(format!(
                    "{} [{j}]: autodiff {gj}, finite difference {fd}",
                    store.name(i)
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
