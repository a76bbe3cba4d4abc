//! The decoder-only GPT as a burn [`Module`].
//!
//! The module is a *view* of the parameter values held in [`ParamStore`]: it is built from the
//! store (with [`Gpt::build`]) before a forward pass and never updated in place, because the
//! optimizer works on plain `f32` buffers. Field names are chosen so that burn's module path of
//! every parameter (`blocks.0.attn.wq`) is exactly its name in the store; that is how gradients
//! found by walking the module are matched to the store's entries.

use burn::module::{Module, Param, ParamId};
use burn::tensor::activation::{gelu, log_softmax, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::config::{MlpKind, ModelConfig, NormKind, PositionKind};
use crate::params::ParamStore;

/// Normalisation: LayerNorm when `bias` is present, RMSNorm when it is not.
#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    pub gain: Param<Tensor<B, 1>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

/// Causal self-attention with grouped-query key/value heads. Projections are `[in, out]`.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub wq: Param<Tensor<B, 2>>,
    pub wk: Param<Tensor<B, 2>>,
    pub wv: Param<Tensor<B, 2>>,
    pub wo: Param<Tensor<B, 2>>,
}

/// Feed-forward block: GeLU when `w_gate` is absent, SwiGLU when it is present.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub w_in: Param<Tensor<B, 2>>,
    pub w_gate: Option<Param<Tensor<B, 2>>>,
    pub w_out: Param<Tensor<B, 2>>,
}

/// A pre-norm transformer block: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub norm1: Norm<B>,
    pub attn: Attention<B>,
    pub norm2: Norm<B>,
    /// The dense feed-forward (absent with a mixture of experts).
    pub mlp: Option<Mlp<B>>,
    /// The mixture of experts (with `ModelConfig::moe`).
    pub moe: Option<Moe<B>>,
}

/// A mixture of experts: a linear router `[d, experts]` and the experts' MLPs.
#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    pub router: Param<Tensor<B, 2>>,
    pub experts: Vec<Mlp<B>>,
}

/// The whole model. `pos_emb` exists only with learned positions, `head` only when the output
/// head is not tied to `tok_emb`.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    pub tok_emb: Param<Tensor<B, 2>>,
    pub pos_emb: Option<Param<Tensor<B, 2>>>,
    pub blocks: Vec<Block<B>>,
    pub norm_f: Norm<B>,
    pub head: Option<Param<Tensor<B, 2>>>,
}

/// How one parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with this standard deviation.
    Normal(f64),
    /// Every element equal to this value (norm gains 1, biases 0).
    Const(f32),
}

/// Name, shape and initialisation of one parameter, in the canonical order of the store.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// The parameters of a model with this configuration, in a fixed order.
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    let d = cfg.d_model;
    let hd = cfg.head_dim();
    let std = cfg.init_std;
    // GPT-2's scaling of the projections that write into the residual stream keeps its
    // variance from growing with depth.
    let out_std = std / (2.0 * cfg.n_layers as f64).sqrt();
    let mut v = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, init: Init| {
        v.push(ParamSpec { name, shape, init });
    };
    push("tok_emb".into(), vec![cfg.vocab_size, d], Init::Normal(std));
    if cfg.positions == PositionKind::Learned {
        push("pos_emb".into(), vec![cfg.context, d], Init::Normal(std));
    }
    let norm = |prefix: &str, push: &mut dyn FnMut(String, Vec<usize>, Init)| {
        push(format!("{prefix}.gain"), vec![d], Init::Const(1.0));
        if cfg.norm == NormKind::LayerNorm {
            push(format!("{prefix}.bias"), vec![d], Init::Const(0.0));
        }
    };
    for l in 0..cfg.n_layers {
        let b = format!("blocks.{l}");
        norm(&format!("{b}.norm1"), &mut push);
        push(
            format!("{b}.attn.wq"),
            vec![d, cfg.n_heads * hd],
            Init::Normal(std),
        );
        push(
            format!("{b}.attn.wk"),
            vec![d, cfg.n_kv_heads * hd],
            Init::Normal(std),
        );
        push(
            format!("{b}.attn.wv"),
            vec![d, cfg.n_kv_heads * hd],
            Init::Normal(std),
        );
        push(
            format!("{b}.attn.wo"),
            vec![cfg.n_heads * hd, d],
            Init::Normal(out_std),
        );
        norm(&format!("{b}.norm2"), &mut push);
        let ffn = |prefix: String, push: &mut dyn FnMut(String, Vec<usize>, Init)| {
            push(
                format!("{prefix}.w_in"),
                vec![d, cfg.d_ff],
                Init::Normal(std),
            );
            if cfg.mlp == MlpKind::SwiGlu {
                push(
                    format!("{prefix}.w_gate"),
                    vec![d, cfg.d_ff],
                    Init::Normal(std),
                );
            }
            push(
                format!("{prefix}.w_out"),
                vec![cfg.d_ff, d],
                Init::Normal(out_std),
            );
        };
        match &cfg.moe {
            None => ffn(format!("{b}.mlp"), &mut push),
            Some(moe) => {
                push(
                    format!("{b}.moe.router"),
                    vec![d, moe.experts],
                    Init::Normal(std),
                );
                for e in 0..moe.experts {
                    ffn(format!("{b}.moe.experts.{e}"), &mut push);
                }
            }
        }
    }
    norm("norm_f", &mut push);
    if !cfg.tie_embeddings {
        push("head".into(), vec![d, cfg.vocab_size], Init::Normal(std));
    }
    v
}

/// Errors of building a module from a parameter store.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("parameter `{0}` is missing from the store")]
    Missing(String),
    #[error("parameter `{name}` has shape {found:?}, the model needs {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
}

/// Precomputed causal mask and rotary tables for one sequence length.
#[derive(Debug, Clone)]
pub struct Aux<B: Backend> {
    /// `[1, 1, t, t]`: 0 on and below the diagonal, a large negative number above.
    mask: Tensor<B, 4>,
    /// `[1, 1, t, head_dim / 2]` cosines and sines of the rotary angles.
    rope: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
}

impl<B: Backend> Aux<B> {
    pub fn new(cfg: &ModelConfig, t: usize, device: &B::Device) -> Self {
        // A finite large negative (not -inf) keeps softmax's backward free of NaNs.
        let mut mask = vec![0.0f32; t * t];
        for i in 0..t {
            for j in (i + 1)..t {
                mask[i * t + j] = -1e9;
            }
        }
        let mask = Tensor::from_data(TensorData::new(mask, [1, 1, t, t]), device);
        let rope = (cfg.positions == PositionKind::Rope).then(|| {
            let half = cfg.head_dim() / 2;
            let mut cos = Vec::with_capacity(t * half);
            let mut sin = Vec::with_capacity(t * half);
            for p in 0..t {
                for i in 0..half {
                    let freq = cfg.rope_theta.powf(-2.0 * i as f64 / cfg.head_dim() as f64);
                    let angle = p as f64 * freq;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
            (
                Tensor::from_data(TensorData::new(cos, [1, 1, t, half]), device),
                Tensor::from_data(TensorData::new(sin, [1, 1, t, half]), device),
            )
        });
        Self { mask, rope }
    }
}

fn param<B: Backend, const D: usize>(
    store: &ParamStore,
    name: &str,
    device: &B::Device,
    grad: bool,
) -> Result<Param<Tensor<B, D>>, BuildError> {
    let idx = store
        .index_of(name)
        .ok_or_else(|| BuildError::Missing(name.to_owned()))?;
    let shape = store.shape(idx);
    if shape.len() != D {
        return Err(BuildError::Shape {
            name: name.to_owned(),
            expected: vec![0; D],
            found: shape.to_vec(),
        });
    }
    let data = TensorData::new(store.values(idx).to_vec(), shape.to_vec());
    let tensor = Tensor::<B, D>::from_data(data, device);
    let tensor = if grad { tensor.require_grad() } else { tensor };
    Ok(Param::initialized(ParamId::new(), tensor))
}

/// `x [b, t, in] · w [in, out]`.
pub(crate) fn matmul3<B: Backend>(x: Tensor<B, 3>, w: Tensor<B, 2>) -> Tensor<B, 3> {
    let [b, t, d] = x.dims();
    let out = w.dims()[1];
    x.reshape([b * t, d]).matmul(w).reshape([b, t, out])
}

impl<B: Backend> Norm<B> {
    fn forward(&self, x: Tensor<B, 3>, eps: f64) -> Tensor<B, 3> {
        norm(x, self.gain.val(), self.bias.as_ref().map(|b| b.val()), eps)
    }
}

/// LayerNorm over the last dimension when `bias` is present, RMSNorm when it is not. The
/// module's forward and the model-parallel segments (`crate::model_parallel`) share it, so
/// both compute the same arithmetic.
pub(crate) fn norm<B: Backend>(
    x: Tensor<B, 3>,
    gain: Tensor<B, 1>,
    bias: Option<Tensor<B, 1>>,
    eps: f64,
) -> Tensor<B, 3> {
    let gain = gain.unsqueeze::<3>();
    match bias {
        Some(bias) => {
            let mean = x.clone().mean_dim(2);
            let centred = x - mean;
            let var = centred.clone().powi_scalar(2).mean_dim(2);
            centred / (var + eps).sqrt() * gain + bias.unsqueeze::<3>()
        }
        None => {
            let ms = x.clone().powi_scalar(2).mean_dim(2);
            x / (ms + eps).sqrt() * gain
        }
    }
}

/// Rotates pairs `(x_i, x_{i + half})` of the head dimension by the position's angles.
fn apply_rope<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let hd = x.dims()[3];
    let half = hd / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x1 * sin.clone() + x2 * cos.clone();
    Tensor::cat(vec![r1, r2], 3)
}

impl<B: Backend> Attention<B> {
    fn forward(&self, x: Tensor<B, 3>, cfg: &ModelConfig, aux: &Aux<B>) -> Tensor<B, 3> {
        let w = AttentionWeights {
            wq: self.wq.val(),
            wk: self.wk.val(),
            wv: self.wv.val(),
            wo: self.wo.val(),
        };
        attention(x, w, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim(), aux)
    }
}

/// The four projections of one attention layer, or of one tensor-parallel shard of it.
pub(crate) struct AttentionWeights<B: Backend> {
    pub wq: Tensor<B, 2>,
    pub wk: Tensor<B, 2>,
    pub wv: Tensor<B, 2>,
    pub wo: Tensor<B, 2>,
}

/// Causal attention with `h` query heads and `kvh` key/value heads of `hd` dimensions. A
/// tensor-parallel shard passes its own head counts (the heads it holds) with the model's
/// head dimension; its output is then a partial sum over its heads of the output projection.
pub(crate) fn attention<B: Backend>(
    x: Tensor<B, 3>,
    w: AttentionWeights<B>,
    h: usize,
    kvh: usize,
    hd: usize,
    aux: &Aux<B>,
) -> Tensor<B, 3> {
    let [b, t, _] = x.dims();
    let heads = |y: Tensor<B, 3>, n: usize| y.reshape([b, t, n, hd]).swap_dims(1, 2);
    let mut q = heads(matmul3(x.clone(), w.wq), h);
    let mut k = heads(matmul3(x.clone(), w.wk), kvh);
    let mut v = heads(matmul3(x, w.wv), kvh);
    if let Some((cos, sin)) = &aux.rope {
        q = apply_rope(q, cos, sin);
        k = apply_rope(k, cos, sin);
    }
    if kvh < h {
        // Each key/value head serves `h / kvh` consecutive query heads.
        let g = h / kvh;
        let expand = |y: Tensor<B, 4>| {
            y.reshape([b, kvh, 1, t, hd])
                .repeat_dim(2, g)
                .reshape([b, h, t, hd])
        };
        k = expand(k);
        v = expand(v);
    }
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = q.matmul(k.swap_dims(2, 3)) * scale + aux.mask.clone();
    let att = softmax(scores, 3);
    let y = att.matmul(v).swap_dims(1, 2).reshape([b, t, h * hd]);
    matmul3(y, w.wo)
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        mlp(
            x,
            self.w_in.val(),
            self.w_gate.as_ref().map(|g| g.val()),
            self.w_out.val(),
        )
    }
}

/// GeLU or (with `w_gate`) SwiGLU feed-forward; on a tensor-parallel shard of the hidden
/// units the output is a partial sum.
pub(crate) fn mlp<B: Backend>(
    x: Tensor<B, 3>,
    w_in: Tensor<B, 2>,
    w_gate: Option<Tensor<B, 2>>,
    w_out: Tensor<B, 2>,
) -> Tensor<B, 3> {
    let hidden = match w_gate {
        None => gelu(matmul3(x, w_in)),
        Some(gate) => silu(matmul3(x.clone(), gate)) * matmul3(x, w_in),
    };
    matmul3(hidden, w_out)
}

impl<B: Backend> Moe<B> {
    /// Every expert on every token, weighted by the gates (zero for the experts a token did
    /// not choose): the reference arithmetic, which the expert-parallel path
    /// (`crate::model_parallel`) reproduces computing only the chosen experts.
    fn forward(&self, h: Tensor<B, 3>, top_k: usize) -> Tensor<B, 3> {
        let [b, t, d] = h.dims();
        let n_exp = self.experts.len();
        let gates = moe_gates(h.clone().reshape([b * t, d]), self.router.val(), top_k)
            .reshape([b, t, n_exp]);
        let mut out: Option<Tensor<B, 3>> = None;
        for (e, expert) in self.experts.iter().enumerate() {
            let y = gates.clone().narrow(2, e, 1) * expert.forward(h.clone());
            out = Some(match out {
                Some(acc) => acc + y,
                None => y,
            });
        }
        out.unwrap_or_else(|| h.zeros_like())
    }
}

/// Each row's `top_k` largest entries of `probs` (`[n, experts]`, row-major), as a 0/1 mask;
/// ties go to the lower expert index, so the choice is deterministic.
pub(crate) fn top_k_mask(probs: &[f32], experts: usize, top_k: usize) -> Vec<f32> {
    let mut mask = vec![0.0f32; probs.len()];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (row, m) in probs
        .chunks_exact(experts)
        .zip(mask.chunks_exact_mut(experts))
    {
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&i, &j| row[j].total_cmp(&row[i]).then(i.cmp(&j)));
        for &e in order.iter().take(top_k) {
            m[e] = 1.0;
        }
    }
    mask
}

/// The gates of `h` (`[n, d]`): the router's softmax, kept for each token's `top_k` experts
/// and renormalised over them (`[n, experts]`, zero elsewhere). The choice of experts is read
/// from the probabilities' values and enters as a constant mask, so gradients flow through
/// the kept probabilities only. A backend that cannot read the values back yields an all-zero
/// mask, whose gates are NaN, which the trainer reports as a non-finite loss.
pub(crate) fn moe_gates<B: Backend>(
    h: Tensor<B, 2>,
    router: Tensor<B, 2>,
    top_k: usize,
) -> Tensor<B, 2> {
    moe_gates_and_mask(h, router, top_k).0
}

/// [`moe_gates`] and the 0/1 mask of the chosen experts (row-major `[n, experts]`).
pub(crate) fn moe_gates_and_mask<B: Backend>(
    h: Tensor<B, 2>,
    router: Tensor<B, 2>,
    top_k: usize,
) -> (Tensor<B, 2>, Vec<f32>) {
    let probs = softmax(h.matmul(router), 1);
    let [n, experts] = probs.dims();
    let values = probs
        .clone()
        .try_into_data()
        .ok()
        .and_then(|d| d.convert::<f32>().into_vec::<f32>().ok())
        .unwrap_or_else(|| vec![f32::NAN; n * experts]);
    let chosen = top_k_mask(&values, experts, top_k);
    let mask = Tensor::<B, 2>::from_data(
        TensorData::new(chosen.clone(), [n, experts]),
        &probs.device(),
    );
    let kept = probs * mask;
    (kept.clone() / kept.sum_dim(1), chosen)
}

/// Token (and learned position) embeddings of `tokens [b, t]`: `[b, t, d]`.
pub(crate) fn embed<B: Backend>(
    tok_emb: Tensor<B, 2>,
    pos_emb: Option<Tensor<B, 2>>,
    tokens: Tensor<B, 2, Int>,
) -> Tensor<B, 3> {
    let [b, t] = tokens.dims();
    let d = tok_emb.dims()[1];
    let mut x = tok_emb
        .select(0, tokens.reshape([b * t]))
        .reshape([b, t, d]);
    if let Some(pos) = pos_emb {
        x = x + pos.narrow(0, 0, t).unsqueeze::<3>();
    }
    x
}

/// Mean next-token cross-entropy of `logits [b * t, vocab]` against `targets [b, t]`.
pub(crate) fn cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [b, t] = targets.dims();
    let logp = log_softmax(logits, 1);
    logp.gather(1, targets.reshape([b * t, 1])).mean().neg()
}

impl<B: Backend> Gpt<B> {
    /// Builds the module from the store's current values. With `grad`, every parameter is a
    /// leaf that records gradients (on an autodiff backend).
    pub fn build(
        cfg: &ModelConfig,
        store: &ParamStore,
        device: &B::Device,
        grad: bool,
    ) -> Result<Self, BuildError> {
        let p2 = |name: &str| param::<B, 2>(store, name, device, grad);
        let p1 = |name: &str| param::<B, 1>(store, name, device, grad);
        let norm = |prefix: &str| -> Result<Norm<B>, BuildError> {
            Ok(Norm {
                gain: p1(&format!("{prefix}.gain"))?,
                bias: match cfg.norm {
                    NormKind::LayerNorm => Some(p1(&format!("{prefix}.bias"))?),
                    NormKind::RmsNorm => None,
                },
            })
        };
        let ffn = |prefix: &str| -> Result<Mlp<B>, BuildError> {
            Ok(Mlp {
                w_in: p2(&format!("{prefix}.w_in"))?,
                w_gate: match cfg.mlp {
                    MlpKind::SwiGlu => Some(p2(&format!("{prefix}.w_gate"))?),
                    MlpKind::Gelu => None,
                },
                w_out: p2(&format!("{prefix}.w_out"))?,
            })
        };
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let b = format!("blocks.{l}");
            blocks.push(Block {
                norm1: norm(&format!("{b}.norm1"))?,
                attn: Attention {
                    wq: p2(&format!("{b}.attn.wq"))?,
                    wk: p2(&format!("{b}.attn.wk"))?,
                    wv: p2(&format!("{b}.attn.wv"))?,
                    wo: p2(&format!("{b}.attn.wo"))?,
                },
                norm2: norm(&format!("{b}.norm2"))?,
                mlp: match cfg.moe {
                    None => Some(ffn(&format!("{b}.mlp"))?),
                    Some(_) => None,
                },
                moe: match &cfg.moe {
                    None => None,
                    Some(moe) => Some(Moe {
                        router: p2(&format!("{b}.moe.router"))?,
                        experts: (0..moe.experts)
                            .map(|e| ffn(&format!("{b}.moe.experts.{e}")))
                            .collect::<Result<_, _>>()?,
                    }),
                },
            });
        }
        Ok(Self {
            tok_emb: p2("tok_emb")?,
            pos_emb: match cfg.positions {
                PositionKind::Learned => Some(p2("pos_emb")?),
                PositionKind::Rope => None,
            },
            blocks,
            norm_f: norm("norm_f")?,
            head: if cfg.tie_embeddings {
                None
            } else {
                Some(p2("head")?)
            },
        })
    }

    /// Logits `[b * t, vocab]` for tokens `[b, t]` (`t <= context`).
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        tokens: Tensor<B, 2, Int>,
        aux: &Aux<B>,
    ) -> Tensor<B, 2> {
        let [b, t] = tokens.dims();
        let d = cfg.d_model;
        let mut x = embed(
            self.tok_emb.val(),
            self.pos_emb.as_ref().map(|p| p.val()),
            tokens,
        );
        for block in &self.blocks {
            x = x.clone()
                + block
                    .attn
                    .forward(block.norm1.forward(x.clone(), cfg.norm_eps), cfg, aux);
            let h = block.norm2.forward(x.clone(), cfg.norm_eps);
            let y = match (&block.mlp, &block.moe) {
                (Some(m), _) => m.forward(h),
                (None, Some(moe)) => moe.forward(h, cfg.moe.map_or(1, |m| m.top_k)),
                // `build` always sets one of the two.
                (None, None) => h.zeros_like(),
            };
            x = x + y;
        }
        let x = self.norm_f.forward(x, cfg.norm_eps).reshape([b * t, d]);
        match &self.head {
            Some(head) => x.matmul(head.val()),
            None => x.matmul(self.tok_emb.val().transpose()),
        }
    }

    /// Mean next-token cross-entropy of `inputs -> targets` (both `[b, t]`), as a 1-element
    /// tensor so that it can be back-propagated.
    pub fn loss(
        &self,
        cfg: &ModelConfig,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        aux: &Aux<B>,
    ) -> Tensor<B, 1> {
        let logits = self.forward(cfg, inputs, aux);
        cross_entropy(logits, targets)
    }
}
