//! Import of Hugging Face `config.json` files.
//!
//! A `config.json` describes a model in the vocabulary of its `transformers` class. This
//! module maps the families orrery can represent onto a [`ModelSpec`]:
//!
//! | `model_type` | keys read |
//! |---|---|
//! | `llama`, `mistral`, `qwen2` | `num_hidden_layers`, `hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`, `vocab_size`, `max_position_embeddings`, `tie_word_embeddings`, `hidden_act` |
//! | `mixtral` | the above plus `num_local_experts`, `num_experts_per_tok` (every layer is MoE, experts of `intermediate_size`) |
//! | `qwen2_moe` | the llama keys plus `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers` |
//! | `gpt2` | `n_layer`, `n_embd`, `n_head`, `n_inner` (null: `4 * n_embd`), `vocab_size`, `n_positions`, `activation_function`, `tie_word_embeddings` |
//!
//! When `model_type` is absent, the first entry of `architectures` (`LlamaForCausalLM`, ...)
//! names the family. Optional keys take the defaults of the `transformers` config class
//! (`num_key_value_heads` = `num_attention_heads`, untied embeddings for the llama family,
//! tied for GPT-2). Every missing required key is reported at once, in one
//! [`HfImportError::Missing`].
//!
//! What is not modelled: biases (Qwen2's QKV bias, GPT-2's linear biases), learned position
//! embeddings, sliding windows and RoPE scaling. They change parameter counts by well under
//! 1% for the supported families.

use crate::raw::{Activation, ModelSpec, MoeSpec};
use serde_json::{Map, Value};

/// Why a `config.json` could not be imported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HfImportError {
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    #[error("config.json must be a JSON object, found {0}")]
    NotAnObject(String),
    #[error("config.json lacks required key(s): {}", .0.join(", "))]
    Missing(Vec<String>),
    #[error("config.json key `{key}` must be {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("unsupported model_type `{0}`; supported: {known}", known = SUPPORTED.join(", "))]
    UnsupportedModelType(String),
    #[error("unsupported architecture `{0}`; supported: {known}", known = SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture(String),
    #[error("config.json key `{key}` = {value} is not supported: {reason}")]
    Unsupported {
        key: String,
        value: String,
        reason: String,
    },
}

/// The `model_type` values this importer understands.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gpt2"];

/// The `architectures` entries this importer understands, used when `model_type` is absent.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "GPT2LMHeadModel",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// Llama, Mistral and Qwen2: pre-norm, GQA, gated MLP.
    Llama,
    Mixtral,
    Qwen2Moe,
    Gpt2,
}

fn family_of_model_type(t: &str) -> Option<Family> {
    match t {
        "llama" | "mistral" | "qwen2" => Some(Family::Llama),
        "mixtral" => Some(Family::Mixtral),
        "qwen2_moe" => Some(Family::Qwen2Moe),
        "gpt2" => Some(Family::Gpt2),
        _ => None,
    }
}

fn model_type_of_architecture(a: &str) -> Option<&'static str> {
    match a {
        "LlamaForCausalLM" => Some("llama"),
        "MistralForCausalLM" => Some("mistral"),
        "MixtralForCausalLM" => Some("mixtral"),
        "Qwen2ForCausalLM" => Some("qwen2"),
        "Qwen2MoeForCausalLM" => Some("qwen2_moe"),
        "GPT2LMHeadModel" | "GPT2Model" => Some("gpt2"),
        _ => None,
    }
}

/// A short description of a JSON value for error messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => {
            let short: String = s.chars().take(40).collect();
            if short.len() < s.len() {
                format!("the string \"{short}...\"")
            } else {
                format!("the string \"{s}\"")
            }
        }
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// Reads keys from the config, collecting every missing required key and the first
/// wrongly typed one, so that one error can report all of them.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
    missing: Vec<String>,
    wrong: Option<HfImportError>,
}

impl<'a> Reader<'a> {
    fn new(obj: &'a Map<String, Value>) -> Self {
        Reader {
            obj,
            missing: Vec::new(),
            wrong: None,
        }
    }

    fn wrong_type(&mut self, key: &str, expected: &'static str, v: &Value) {
        if self.wrong.is_none() {
            self.wrong = Some(HfImportError::WrongType {
                key: key.to_string(),
                expected,
                found: describe(v),
            });
        }
    }

    /// The value of `key`; `null` counts as absent, as it does for `transformers`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// An optional non-negative integer.
    fn opt_u64(&mut self, key: &str) -> Option<u64> {
        let v = self.get(key)?;
        match v.as_u64() {
            Some(x) => Some(x),
            None => {
                self.wrong_type(key, "a non-negative integer", v);
                None
            }
        }
    }

    /// A required non-negative integer; a missing one is recorded.
    fn req_u64(&mut self, key: &str) -> Option<u64> {
        if self.get(key).is_none() {
            self.missing.push(key.to_string());
            return None;
        }
        self.opt_u64(key)
    }

    fn opt_bool(&mut self, key: &str) -> Option<bool> {
        let v = self.get(key)?;
        match v.as_bool() {
            Some(x) => Some(x),
            None => {
                self.wrong_type(key, "a boolean", v);
                None
            }
        }
    }

    fn opt_str(&mut self, key: &str) -> Option<&'a str> {
        let v = self.get(key)?;
        match v.as_str() {
            Some(x) => Some(x),
            None => {
                self.wrong_type(key, "a string", v);
                None
            }
        }
    }

    fn opt_array(&mut self, key: &str) -> Option<&'a Vec<Value>> {
        let v = self.get(key)?;
        match v.as_array() {
            Some(x) => Some(x),
            None => {
                self.wrong_type(key, "an array", v);
                None
            }
        }
    }

    /// The first error found: missing keys (all of them) before wrong types.
    fn finish(self) -> Result<(), HfImportError> {
        if !self.missing.is_empty() {
            return Err(HfImportError::Missing(self.missing));
        }
        match self.wrong {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The family of the config, from `model_type` or else `architectures[0]`.
fn family(r: &mut Reader<'_>) -> Result<(Family, String), HfImportError> {
    if let Some(t) = r.opt_str("model_type") {
        return family_of_model_type(t)
            .map(|f| (f, t.to_string()))
            .ok_or_else(|| HfImportError::UnsupportedModelType(t.to_string()));
    }
    if let Some(e) = r.wrong.take() {
        return Err(e);
    }
    let arch = match r.get("architectures") {
        Some(Value::Array(a)) => a.first().and_then(Value::as_str),
        _ => None,
    };
    match arch {
        Some(a) => model_type_of_architecture(a)
            .and_then(|t| family_of_model_type(t).map(|f| (f, t.to_string())))
            .ok_or_else(|| HfImportError::UnsupportedArchitecture(a.to_string())),
        None => Err(HfImportError::Missing(vec!["model_type".to_string()])),
    }
}

/// The activation of a gated (llama-family) MLP.
fn gated_activation(r: &mut Reader<'_>) -> Result<Activation, HfImportError> {
    match r.opt_str("hidden_act") {
        None | Some("silu" | "swish") => Ok(Activation::Swiglu),
        Some(other) => Err(HfImportError::Unsupported {
            key: "hidden_act".to_string(),
            value: format!("\"{other}\""),
            reason: "orrery models the gated MLP of this family with SiLU (SwiGLU) only"
                .to_string(),
        }),
    }
}

/// Reads a Hugging Face `config.json` into a model spec.
///
/// The result has `preset: None`; every shape field the config defines is set, and
/// validation ([`crate::Job::from_spec`]) checks the shape against the parallel layout.
pub fn model_from_hf_config(text: &str) -> Result<ModelSpec, HfImportError> {
    let v: Value = serde_json::from_str(text).map_err(|e| HfImportError::Json(e.to_string()))?;
    let obj = match &v {
        Value::Object(o) => o,
        other => return Err(HfImportError::NotAnObject(describe(other))),
    };
    let mut r = Reader::new(obj);
    let (family, model_type) = family(&mut r)?;
    let name = match r.opt_str("_name_or_path") {
        Some(n) if !n.trim().is_empty() => n.to_string(),
        _ => model_type,
    };
    let spec = match family {
        Family::Gpt2 => gpt2(&mut r, name)?,
        Family::Llama | Family::Mixtral | Family::Qwen2Moe => llama_like(&mut r, family, name)?,
    };
    r.finish()?;
    Ok(spec)
}

fn gpt2(r: &mut Reader<'_>, name: String) -> Result<ModelSpec, HfImportError> {
    let layers = r.req_u64("n_layer");
    let hidden = r.req_u64("n_embd");
    let heads = r.req_u64("n_head");
    let vocab = r.req_u64("vocab_size");
    let seq_len = r.req_u64("n_positions");
    let ffn = r
        .opt_u64("n_inner")
        .or_else(|| hidden.map(|h| h.saturating_mul(4)));
    let tied = r.opt_bool("tie_word_embeddings").unwrap_or(true);
    let activation = match r.opt_str("activation_function") {
        None | Some("gelu" | "gelu_new" | "gelu_fast" | "gelu_pytorch_tanh" | "quick_gelu") => {
            Activation::Gelu
        }
        Some(other) => {
            return Err(HfImportError::Unsupported {
                key: "activation_function".to_string(),
                value: format!("\"{other}\""),
                reason: "orrery models GPT-2's MLP with GELU only".to_string(),
            })
        }
    };
    Ok(ModelSpec {
        preset: None,
        name: Some(name),
        layers,
        hidden,
        heads,
        kv_heads: heads,
        head_dim: None,
        ffn,
        vocab,
        seq_len,
        activation: Some(activation),
        tied_embeddings: Some(tied),
        moe: None,
    })
}

fn llama_like(
    r: &mut Reader<'_>,
    family: Family,
    name: String,
) -> Result<ModelSpec, HfImportError> {
    let layers = r.req_u64("num_hidden_layers");
    let hidden = r.req_u64("hidden_size");
    let heads = r.req_u64("num_attention_heads");
    let kv_heads = r.opt_u64("num_key_value_heads").or(heads);
    let head_dim = r.opt_u64("head_dim");
    let ffn = r.req_u64("intermediate_size");
    let vocab = r.req_u64("vocab_size");
    let seq_len = r.req_u64("max_position_embeddings");
    let tied = r.opt_bool("tie_word_embeddings").unwrap_or(false);
    let activation = gated_activation(r)?;
    let moe = match family {
        Family::Mixtral => {
            let experts = r.req_u64("num_local_experts");
            let top_k = r.req_u64("num_experts_per_tok");
            Some(MoeSpec {
                experts,
                top_k,
                expert_ffn: ffn,
                shared_experts: Some(0),
                first_dense: Some(0),
                every: Some(1),
            })
        }
        Family::Qwen2Moe => Some(qwen2_moe(r)?),
        Family::Llama | Family::Gpt2 => None,
    };
    Ok(ModelSpec {
        preset: None,
        name: Some(name),
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        seq_len,
        activation: Some(activation),
        tied_embeddings: Some(tied),
        moe,
    })
}

/// Qwen2-MoE: `num_experts` routed experts of `moe_intermediate_size`, one shared expert of
/// `shared_expert_intermediate_size` (represented as that many routed-size experts), and
/// layer `i` is MoE when `(i + 1) % decoder_sparse_step == 0`.
fn qwen2_moe(r: &mut Reader<'_>) -> Result<MoeSpec, HfImportError> {
    let experts = r.req_u64("num_experts");
    let top_k = r.req_u64("num_experts_per_tok");
    let expert_ffn = r.req_u64("moe_intermediate_size");
    let shared_ffn = r.opt_u64("shared_expert_intermediate_size").unwrap_or(0);
    let step = r.opt_u64("decoder_sparse_step").unwrap_or(1);
    if let Some(list) = r.opt_array("mlp_only_layers") {
        if !list.is_empty() {
            return Err(HfImportError::Unsupported {
                key: "mlp_only_layers".to_string(),
                value: Value::Array(list.clone()).to_string(),
                reason: "orrery places MoE layers by a first-dense count and a stride only"
                    .to_string(),
            });
        }
    }
    if step == 0 {
        return Err(HfImportError::Unsupported {
            key: "decoder_sparse_step".to_string(),
            value: "0".to_string(),
            reason: "must be at least 1".to_string(),
        });
    }
    let shared_experts = match expert_ffn {
        _ if shared_ffn == 0 => Some(0),
        Some(e) if e > 0 && shared_ffn.is_multiple_of(e) => Some(shared_ffn / e),
        Some(_) => {
            return Err(HfImportError::Unsupported {
                key: "shared_expert_intermediate_size".to_string(),
                value: shared_ffn.to_string(),
                reason: "orrery represents the shared expert as a whole number of \
                         moe_intermediate_size experts"
                    .to_string(),
            })
        }
        None => None,
    };
    Ok(MoeSpec {
        experts,
        top_k,
        expert_ffn,
        shared_experts,
        first_dense: Some(step - 1),
        every: Some(step),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::{ClusterSpec, JobSpec, ParallelSpec, TrainingSpec};
    use crate::Job;

    /// meta-llama/Meta-Llama-3-8B `config.json` as published (plus `_name_or_path`).
    const LLAMA3_8B: &str = r#"{
      "_name_or_path": "meta-llama/Meta-Llama-3-8B",
      "architectures": ["LlamaForCausalLM"],
      "attention_bias": false,
      "attention_dropout": 0.0,
      "bos_token_id": 128000,
      "eos_token_id": 128001,
      "hidden_act": "silu",
      "hidden_size": 4096,
      "initializer_range": 0.02,
      "intermediate_size": 14336,
      "max_position_embeddings": 8192,
      "model_type": "llama",
      "num_attention_heads": 32,
      "num_hidden_layers": 32,
      "num_key_value_heads": 8,
      "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": null,
      "rope_theta": 500000.0,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.40.0.dev0",
      "use_cache": true,
      "vocab_size": 128256
    }"#;

    /// mistralai/Mixtral-8x7B-v0.1 `config.json` as published.
    const MIXTRAL_8X7B: &str = r#"{
      "architectures": ["MixtralForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 1,
      "eos_token_id": 2,
      "hidden_act": "silu",
      "hidden_size": 4096,
      "initializer_range": 0.02,
      "intermediate_size": 14336,
      "max_position_embeddings": 32768,
      "model_type": "mixtral",
      "num_attention_heads": 32,
      "num_experts_per_tok": 2,
      "num_hidden_layers": 32,
      "num_key_value_heads": 8,
      "num_local_experts": 8,
      "output_router_logits": false,
      "rms_norm_eps": 1e-05,
      "rope_theta": 1000000.0,
      "router_aux_loss_coef": 0.02,
      "sliding_window": null,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.36.0.dev0",
      "use_cache": true,
      "vocab_size": 32000
    }"#;

    /// Qwen/Qwen2-7B `config.json` as published.
    const QWEN2_7B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151643,
      "hidden_act": "silu",
      "hidden_size": 3584,
      "initializer_range": 0.02,
      "intermediate_size": 18944,
      "max_position_embeddings": 131072,
      "max_window_layers": 28,
      "model_type": "qwen2",
      "num_attention_heads": 28,
      "num_hidden_layers": 28,
      "num_key_value_heads": 4,
      "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0,
      "sliding_window": 131072,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.37.2",
      "use_cache": true,
      "use_sliding_window": false,
      "vocab_size": 152064
    }"#;

    /// Qwen/Qwen1.5-MoE-A2.7B `config.json` as published.
    const QWEN15_MOE_A27B: &str = r#"{
      "architectures": ["Qwen2MoeForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151643,
      "hidden_act": "silu",
      "hidden_size": 2048,
      "initializer_range": 0.02,
      "intermediate_size": 5632,
      "max_position_embeddings": 8192,
      "max_window_layers": 21,
      "model_type": "qwen2_moe",
      "num_attention_heads": 16,
      "num_hidden_layers": 24,
      "num_key_value_heads": 16,
      "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0,
      "sliding_window": 32768,
      "tie_word_embeddings": false,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.39.0.dev0",
      "use_cache": true,
      "use_sliding_window": false,
      "vocab_size": 151936,
      "decoder_sparse_step": 1,
      "moe_intermediate_size": 1408,
      "shared_expert_intermediate_size": 5632,
      "num_experts_per_tok": 4,
      "num_experts": 60,
      "norm_topk_prob": false,
      "output_router_logits": false,
      "router_aux_loss_coef": 0.001
    }"#;

    /// openai-community/gpt2 (GPT-2 small) `config.json` as published: no `n_inner`.
    const GPT2_SMALL: &str = r#"{
      "activation_function": "gelu_new",
      "architectures": ["GPT2LMHeadModel"],
      "attn_pdrop": 0.1,
      "bos_token_id": 50256,
      "embd_pdrop": 0.1,
      "eos_token_id": 50256,
      "initializer_range": 0.02,
      "layer_norm_epsilon": 1e-05,
      "model_type": "gpt2",
      "n_ctx": 1024,
      "n_embd": 768,
      "n_head": 12,
      "n_layer": 12,
      "n_positions": 1024,
      "resid_pdrop": 0.1,
      "summary_activation": null,
      "summary_first_dropout": 0.1,
      "summary_proj_to_labels": true,
      "summary_type": "cls_index",
      "summary_use_proj": true,
      "task_specific_params": {
        "text-generation": { "do_sample": true, "max_length": 50 }
      },
      "vocab_size": 50257
    }"#;

    /// An imported model on a small cluster: `tp` x `pp` inside `nodes` nodes of 8.
    fn job_for(model: ModelSpec, tp: u64, pp: u64, ep: Option<u64>, nodes: u64) -> Job {
        let spec = JobSpec {
            name: None,
            model,
            training: TrainingSpec {
                global_batch: Some(256),
                micro_batch: Some(1),
                ..TrainingSpec::default()
            },
            parallel: ParallelSpec {
                tp: Some(tp),
                pp: Some(pp),
                ep,
                ..ParallelSpec::default()
            },
            cluster: ClusterSpec {
                gpu: Some("H100-SXM".to_string()),
                gpus_per_node: Some(8),
                nodes: Some(nodes),
                ..ClusterSpec::default()
            },
        };
        Job::from_spec(&spec).unwrap_or_else(|e| panic!("{e}"))
    }

    fn assert_params_near(job: &Job, published: f64, tolerance: f64) {
        let p = job.model().total_params() as f64;
        let err = (p - published).abs() / published;
        assert!(
            err <= tolerance,
            "{}: {p:.4e} params vs published {published:.4e} ({:.2}% off)",
            job.model().name,
            err * 100.0
        );
    }

    #[test]
    fn llama3_8b_imports_and_validates() {
        let m = model_from_hf_config(LLAMA3_8B).unwrap();
        assert_eq!(
            m,
            ModelSpec {
                preset: None,
                name: Some("meta-llama/Meta-Llama-3-8B".to_string()),
                layers: Some(32),
                hidden: Some(4096),
                heads: Some(32),
                kv_heads: Some(8),
                head_dim: None,
                ffn: Some(14336),
                vocab: Some(128256),
                seq_len: Some(8192),
                activation: Some(Activation::Swiglu),
                tied_embeddings: Some(false),
                moe: None,
            }
        );
        let job = job_for(m, 8, 2, None, 4);
        assert_eq!(job.model().head_dim, 128);
        assert_eq!(job.parallel().dp, 2);
        assert_params_near(&job, 8.03e9, 0.01);
    }

    #[test]
    fn mixtral_8x7b_imports_and_validates() {
        let m = model_from_hf_config(MIXTRAL_8X7B).unwrap();
        assert_eq!(m.name.as_deref(), Some("mixtral"));
        assert_eq!(
            (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab),
            (
                Some(32),
                Some(4096),
                Some(32),
                Some(8),
                Some(14336),
                Some(32000)
            )
        );
        assert_eq!(m.seq_len, Some(32768));
        assert_eq!(
            m.moe,
            Some(MoeSpec {
                experts: Some(8),
                top_k: Some(2),
                expert_ffn: Some(14336),
                shared_experts: Some(0),
                first_dense: Some(0),
                every: Some(1),
            })
        );
        let job = job_for(m, 2, 4, Some(8), 8);
        assert_eq!(job.model().moe_layers(), 32);
        assert_eq!(job.parallel().ep, 8);
        assert_params_near(&job, 46.7e9, 0.01);
    }

    #[test]
    fn qwen2_7b_imports_and_validates() {
        let m = model_from_hf_config(QWEN2_7B).unwrap();
        assert_eq!(m.name.as_deref(), Some("qwen2"));
        assert_eq!(
            (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab),
            (
                Some(28),
                Some(3584),
                Some(28),
                Some(4),
                Some(18944),
                Some(152064)
            )
        );
        assert_eq!(m.seq_len, Some(131072));
        assert_eq!(m.activation, Some(Activation::Swiglu));
        assert_eq!(m.tied_embeddings, Some(false));
        assert!(m.moe.is_none());
        // kv_heads = 4 bounds TP at 4.
        let job = job_for(m, 4, 1, None, 2);
        assert_eq!(job.model().head_dim, 128);
        // Published: 7.62B, of which ~2M are QKV biases orrery does not model.
        assert_params_near(&job, 7.62e9, 0.01);
    }

    #[test]
    fn qwen2_moe_imports_and_validates() {
        let m = model_from_hf_config(QWEN15_MOE_A27B).unwrap();
        assert_eq!(
            m.moe,
            Some(MoeSpec {
                experts: Some(60),
                top_k: Some(4),
                expert_ffn: Some(1408),
                shared_experts: Some(4),
                first_dense: Some(0),
                every: Some(1),
            })
        );
        let job = job_for(m, 2, 2, Some(4), 2);
        assert_eq!(job.model().moe_layers(), 24);
        // Published: 14.3B total; the shared-expert gate and biases are not modelled.
        assert_params_near(&job, 14.3e9, 0.02);
    }

    #[test]
    fn qwen2_moe_sparse_step_places_moe_layers() {
        let text =
            QWEN15_MOE_A27B.replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 2"#);
        let m = model_from_hf_config(&text).unwrap();
        let moe = m.moe.clone().unwrap();
        assert_eq!((moe.first_dense, moe.every), (Some(1), Some(2)));
        let job = job_for(m, 2, 2, Some(4), 2);
        // transformers: layer i is MoE when (i + 1) % step == 0.
        let moe_layers: Vec<u64> = (0..24).filter(|&l| job.model().is_moe_layer(l)).collect();
        let expected: Vec<u64> = (0..24).filter(|l| (l + 1) % 2 == 0).collect();
        assert_eq!(moe_layers, expected);
    }

    #[test]
    fn gpt2_small_imports_and_validates() {
        let m = model_from_hf_config(GPT2_SMALL).unwrap();
        assert_eq!(
            m,
            ModelSpec {
                preset: None,
                name: Some("gpt2".to_string()),
                layers: Some(12),
                hidden: Some(768),
                heads: Some(12),
                kv_heads: Some(12),
                head_dim: None,
                ffn: Some(3072),
                vocab: Some(50257),
                seq_len: Some(1024),
                activation: Some(Activation::Gelu),
                tied_embeddings: Some(true),
                moe: None,
            }
        );
        let job = job_for(m, 4, 1, None, 1);
        assert_eq!(job.model().head_dim, 64);
        // Published 124M includes 0.8M learned position embeddings and the linear biases,
        // which orrery does not model.
        assert_params_near(&job, 124.4e6, 0.03);
    }

    #[test]
    fn gpt2_explicit_n_inner_wins_and_null_means_default() {
        let m = model_from_hf_config(r#"{"model_type":"gpt2","n_layer":2,"n_embd":64,"n_head":4,"n_inner":100,"vocab_size":10,"n_positions":32}"#).unwrap();
        assert_eq!(m.ffn, Some(100));
        let m = model_from_hf_config(r#"{"model_type":"gpt2","n_layer":2,"n_embd":64,"n_head":4,"n_inner":null,"vocab_size":10,"n_positions":32}"#).unwrap();
        assert_eq!(m.ffn, Some(256));
    }

    #[test]
    fn head_dim_and_default_kv_heads() {
        // Mistral-Nemo-shaped: head_dim differs from hidden / heads; no kv key means MHA.
        let m = model_from_hf_config(
            r#"{"model_type":"mistral","num_hidden_layers":40,"hidden_size":5120,
                "num_attention_heads":32,"head_dim":128,"intermediate_size":14336,
                "vocab_size":131072,"max_position_embeddings":1024000}"#,
        )
        .unwrap();
        assert_eq!(m.head_dim, Some(128));
        assert_eq!(m.kv_heads, Some(32));
        assert_eq!(m.tied_embeddings, Some(false));
        assert_eq!(m.activation, Some(Activation::Swiglu));
    }

    #[test]
    fn architecture_names_the_family_when_model_type_is_absent() {
        let text = LLAMA3_8B.replace(r#""model_type": "llama","#, "");
        let m = model_from_hf_config(&text).unwrap();
        assert_eq!(m.layers, Some(32));
        let text = GPT2_SMALL.replace(r#""model_type": "gpt2","#, "");
        let m = model_from_hf_config(&text).unwrap();
        assert_eq!(m.name.as_deref(), Some("gpt2"));
        assert_eq!(m.activation, Some(Activation::Gelu));
    }

    #[test]
    fn every_missing_key_is_reported_at_once() {
        let err = model_from_hf_config(
            r#"{"model_type":"llama","hidden_size":4096,"num_attention_heads":32}"#,
        )
        .unwrap_err();
        assert_eq!(
            err,
            HfImportError::Missing(vec![
                "num_hidden_layers".to_string(),
                "intermediate_size".to_string(),
                "vocab_size".to_string(),
                "max_position_embeddings".to_string(),
            ])
        );
        assert_eq!(
            err.to_string(),
            "config.json lacks required key(s): num_hidden_layers, intermediate_size, \
             vocab_size, max_position_embeddings"
        );
        let err =
            model_from_hf_config(&MIXTRAL_8X7B.replace("num_local_experts", "x")).unwrap_err();
        assert_eq!(
            err,
            HfImportError::Missing(vec!["num_local_experts".to_string()])
        );
        let err = model_from_hf_config(r#"{"model_type":"gpt2"}"#).unwrap_err();
        assert_eq!(
            err,
            HfImportError::Missing(
                ["n_layer", "n_embd", "n_head", "vocab_size", "n_positions"]
                    .map(String::from)
                    .to_vec()
            )
        );
        let err = model_from_hf_config("{}").unwrap_err();
        assert_eq!(err, HfImportError::Missing(vec!["model_type".to_string()]));
    }

    #[test]
    fn wrong_types_name_the_key() {
        let err = model_from_hf_config(&LLAMA3_8B.replace("4096", "\"4096\"")).unwrap_err();
        assert_eq!(
            err,
            HfImportError::WrongType {
                key: "hidden_size".to_string(),
                expected: "a non-negative integer",
                found: "the string \"4096\"".to_string(),
            }
        );
        let err = model_from_hf_config(&LLAMA3_8B.replace(
            r#""num_attention_heads": 32"#,
            r#""num_attention_heads": -32"#,
        ))
        .unwrap_err();
        assert!(err.to_string().contains("num_attention_heads"), "{err}");
        let err = model_from_hf_config(&LLAMA3_8B.replace(
            r#""tie_word_embeddings": false"#,
            r#""tie_word_embeddings": "no""#,
        ))
        .unwrap_err();
        assert!(
            matches!(err, HfImportError::WrongType { ref key, .. } if key == "tie_word_embeddings")
        );
        let err = model_from_hf_config(r#"{"model_type": 7}"#).unwrap_err();
        assert!(matches!(err, HfImportError::WrongType { ref key, .. } if key == "model_type"));
    }

    #[test]
    fn unsupported_inputs_are_errors() {
        assert!(matches!(
            model_from_hf_config(r#"{"model_type":"bert"}"#),
            Err(HfImportError::UnsupportedModelType(t)) if t == "bert"
        ));
        assert!(matches!(
            model_from_hf_config(r#"{"architectures":["BertModel"]}"#),
            Err(HfImportError::UnsupportedArchitecture(a)) if a == "BertModel"
        ));
        assert!(matches!(
            model_from_hf_config(&LLAMA3_8B.replace("silu", "gelu")),
            Err(HfImportError::Unsupported { key, .. }) if key == "hidden_act"
        ));
        assert!(matches!(
            model_from_hf_config(&GPT2_SMALL.replace("gelu_new", "relu")),
            Err(HfImportError::Unsupported { key, .. }) if key == "activation_function"
        ));
        assert!(matches!(
            model_from_hf_config(&QWEN15_MOE_A27B.replace(
                r#""decoder_sparse_step": 1"#,
                r#""decoder_sparse_step": 1, "mlp_only_layers": [0, 5]"#
            )),
            Err(HfImportError::Unsupported { key, .. }) if key == "mlp_only_layers"
        ));
        assert!(matches!(
            model_from_hf_config(&QWEN15_MOE_A27B.replace(
                r#""shared_expert_intermediate_size": 5632"#,
                r#""shared_expert_intermediate_size": 5000"#
            )),
            Err(HfImportError::Unsupported { key, .. }) if key == "shared_expert_intermediate_size"
        ));
        assert!(matches!(
            model_from_hf_config("[1, 2]"),
            Err(HfImportError::NotAnObject(_))
        ));
        assert!(matches!(
            model_from_hf_config("{not json"),
            Err(HfImportError::Json(_))
        ));
    }

    #[test]
    fn zero_shapes_import_and_fail_validation_with_paths() {
        let m = model_from_hf_config(
            &LLAMA3_8B.replace(r#""num_hidden_layers": 32"#, r#""num_hidden_layers": 0"#),
        )
        .unwrap();
        let spec = JobSpec {
            model: m,
            training: TrainingSpec {
                global_batch: Some(8),
                ..TrainingSpec::default()
            },
            cluster: ClusterSpec {
                nodes: Some(1),
                ..ClusterSpec::default()
            },
            ..JobSpec::default()
        };
        let err = Job::from_spec(&spec).unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        assert_eq!(err.0[0].path, "model.layers");
    }
}
