#![allow(clippy::unwrap_used, clippy::expect_used)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use orrery_train::model::{param_specs, Aux, Gpt};
use orrery_train::params::{collect_grads, ParamStore};
use orrery_train::rng::Rng;
use orrery_train::{MlpKind, ModelConfig, NormKind, PositionKind};

type F32 = NdArray<f32>;

fn small() -> ModelConfig {
    ModelConfig {
        context: 8,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        d_ff: 24,
        // Larger than GPT-2's 0.02 so that the finite-difference check sees real signal.
        init_std: 0.2,
        ..ModelConfig::default()
    }
}

fn variants() -> Vec<ModelConfig> {
    let mut out = Vec::new();
    for norm in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for positions in [PositionKind::Rope, PositionKind::Learned] {
            for mlp in [MlpKind::Gelu, MlpKind::SwiGlu] {
                for (tie, kv) in [(true, 4), (false, 2), (true, 1)] {
                    out.push(ModelConfig {
                        norm,
                        positions,
                        mlp,
                        tie_embeddings: tie,
                        n_kv_heads: kv,
                        ..small()
                    });
                }
            }
        }
    }
    out
}

fn tokens<B: Backend>(ids: &[i64], b: usize, t: usize, dev: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(ids.to_vec(), [b, t]), dev)
}

fn ids(n: usize, seed: u64) -> Vec<i64> {
    let mut r = Rng::new(seed, 9);
    (0..n).map(|_| r.below(256) as i64).collect()
}

fn logits<B: Backend>(
    cfg: &ModelConfig,
    store: &ParamStore,
    input: &[i64],
    b: usize,
    t: usize,
) -> Vec<f32> {
    let dev = Default::default();
    let m = Gpt::<B>::build(cfg, store, &dev, false).unwrap();
    let aux = Aux::new(cfg, t, &dev);
    m.forward(cfg, tokens::<B>(input, b, t, &dev), &aux)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

#[test]
fn forward_shapes_for_every_variant() {
    for cfg in variants() {
        let store = ParamStore::init(&param_specs(&cfg), &mut Rng::new(0, 0));
        let dev = Default::default();
        let m = Gpt::<F32>::build(&cfg, &store, &dev, false).unwrap();
        // Shorter than the context, as at generation time.
        let aux = Aux::new(&cfg, 5, &dev);
        let out = m.forward(&cfg, tokens::<F32>(&ids(10, 1), 2, 5, &dev), &aux);
        assert_eq!(out.dims(), [10, 256], "{cfg:?}");
        let loss = m.loss(
            &cfg,
            tokens::<F32>(&ids(10, 1), 2, 5, &dev),
            tokens::<F32>(&ids(10, 2), 2, 5, &dev),
            &aux,
        );
        let l = loss.into_data().into_vec::<f32>().unwrap()[0];
        assert!(l.is_finite() && l > 0.0, "{cfg:?}: {l}");
    }
}

#[test]
fn parameter_count_matches_the_formula() {
    let cfg = ModelConfig::default(); // 4 layers, d 128, ff 512, tied, rope, layernorm, gelu
    let store = ParamStore::init(&param_specs(&cfg), &mut Rng::new(0, 0));
    let d = 128;
    let per_block = 4 * d * d + 2 * d * 512 + 4 * d;
    assert_eq!(store.numel(), 256 * d + 4 * per_block + 2 * d);
}

#[test]
fn every_parameter_gets_a_gradient() {
    type B = Autodiff<F32>;
    for cfg in variants() {
        let specs = param_specs(&cfg);
        let store = ParamStore::init(&specs, &mut Rng::new(0, 0));
        let dev = Default::default();
        let m = Gpt::<B>::build(&cfg, &store, &dev, true).unwrap();
        let aux = Aux::new(&cfg, 8, &dev);
        let loss = m.loss(
            &cfg,
            tokens::<B>(&ids(16, 3), 2, 8, &dev),
            tokens::<B>(&ids(16, 4), 2, 8, &dev),
            &aux,
        );
        let grads = loss.backward();
        let mut g = ParamStore::zeros(&specs);
        collect_grads::<B, _>(&m, &grads, &mut g).unwrap();
        for i in 0..g.len() {
            let norm: f32 = g.values(i).iter().map(|x| x * x).sum();
            assert!(norm > 0.0, "{}: no gradient ({cfg:?})", g.name(i));
        }
    }
}

#[test]
fn attention_is_causal() {
    for cfg in variants().into_iter().step_by(5) {
        let store = ParamStore::init(&param_specs(&cfg), &mut Rng::new(2, 0));
        let mut a = ids(8, 11);
        let before = logits::<F32>(&cfg, &store, &a, 1, 8);
        a[7] = (a[7] + 1) % 256;
        a[6] = (a[6] + 3) % 256;
        let after = logits::<F32>(&cfg, &store, &a, 1, 8);
        // Positions 0..6 see only tokens 0..6.
        assert_eq!(before[..6 * 256], after[..6 * 256], "{cfg:?}");
        assert_ne!(before[6 * 256..], after[6 * 256..]);
    }
}

/// Grouped-query attention is multi-head attention whose key/value heads are shared by
/// consecutive query heads.
#[test]
fn gqa_equals_mha_with_duplicated_kv_heads() {
    let gqa = ModelConfig {
        n_kv_heads: 2,
        ..small()
    };
    let mha = ModelConfig {
        n_kv_heads: 4,
        ..small()
    };
    let g_store = ParamStore::init(&param_specs(&gqa), &mut Rng::new(3, 0));
    let mut m_store = ParamStore::zeros(&param_specs(&mha));
    let hd = small().head_dim();
    let group = 2;
    for i in 0..m_store.len() {
        let name = m_store.name(i).to_owned();
        let src = g_store.index_of(&name).unwrap();
        if name.ends_with("attn.wk") || name.ends_with("attn.wv") {
            let d = m_store.shape(i)[0];
            let (cols_m, cols_g) = (m_store.shape(i)[1], g_store.shape(src)[1]);
            let from = g_store.values(src).to_vec();
            let to = m_store.values_mut(i);
            for r in 0..d {
                for head in 0..4 {
                    for k in 0..hd {
                        to[r * cols_m + head * hd + k] = from[r * cols_g + (head / group) * hd + k];
                    }
                }
            }
        } else {
            m_store.values_mut(i).copy_from_slice(g_store.values(src));
        }
    }
    let x = ids(16, 5);
    let a = logits::<F32>(&gqa, &g_store, &x, 2, 8);
    let b = logits::<F32>(&mha, &m_store, &x, 2, 8);
    let max = a
        .iter()
        .zip(&b)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-5, "max difference {max}");
}
