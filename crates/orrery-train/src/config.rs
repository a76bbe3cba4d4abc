//! Training configuration: the serde shape of `train.toml`, its defaults, and validation that
//! reports every problem at once with the dotted path of the field it concerns.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use crate::parallel::ParallelConfig;

/// Normalisation layer of every block (and the final one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    /// Mean and variance normalisation with a learned gain and bias.
    LayerNorm,
    /// Root-mean-square normalisation with a learned gain, no bias.
    RmsNorm,
}

/// How token positions enter the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionKind {
    /// Rotary embeddings applied to queries and keys (no parameters).
    Rope,
    /// A learned `[context, d_model]` table added to the token embeddings.
    Learned,
}

/// The feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpKind {
    /// `W_out · gelu(W_in · x)`.
    Gelu,
    /// `W_out · (silu(W_gate · x) ⊙ W_in · x)`.
    SwiGlu,
}

/// Shape and variant of the decoder-only GPT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Embedding rows; must cover the tokenizer's vocabulary.
    pub vocab_size: usize,
    /// Longest sequence the model sees (training windows are this long).
    pub context: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Key/value heads; fewer than `n_heads` is grouped-query attention.
    pub n_kv_heads: usize,
    /// Hidden width of the feed-forward block.
    pub d_ff: usize,
    pub norm: NormKind,
    pub positions: PositionKind,
    pub mlp: MlpKind,
    /// Output head shares the token-embedding matrix.
    pub tie_embeddings: bool,
    pub rope_theta: f64,
    pub norm_eps: f64,
    /// Standard deviation of the normal weight initialisation (residual output projections are
    /// scaled down by `sqrt(2 * n_layers)`, as in GPT-2).
    pub init_std: f64,
    /// A mixture of experts in place of every block's MLP; `None` (the default, not written)
    /// keeps the dense MLP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

/// The mixture-of-experts feed-forward: `experts` MLPs of the model's `mlp` kind and `d_ff`
/// width; a linear router's softmax picks each token's `top_k` experts, whose outputs are
/// summed weighted by their router probabilities renormalised over the chosen ones. There is
/// no load-balancing loss and no capacity limit (no token is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
}

impl Default for MoeConfig {
    fn default() -> Self {
        Self {
            experts: 4,
            top_k: 2,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab_size: 256,
            context: 128,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 4,
            d_ff: 512,
            norm: NormKind::LayerNorm,
            positions: PositionKind::Rope,
            mlp: MlpKind::Gelu,
            tie_embeddings: true,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            init_std: 0.02,
            moe: None,
        }
    }
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }
}

/// The tokenizer turning text into token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per UTF-8 byte (vocabulary 256).
    Byte,
    /// A tiktoken BPE vocabulary bundled with tiktoken-rs (`r50k_base`, `p50k_base`,
    /// `cl100k_base`, `o200k_base`); needs the crate feature `bpe`.
    Bpe(String),
}

/// Where the text comes from and how it is split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// A text file, or a folder whose `.txt` files (recursively, in sorted path order) are
    /// concatenated. `None` uses the small corpus built into the crate.
    pub path: Option<PathBuf>,
    pub tokenizer: TokenizerKind,
    /// The last `val_fraction` of the tokens is the validation split.
    pub val_fraction: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: None,
            tokenizer: TokenizerKind::Byte,
            val_fraction: 0.1,
        }
    }
}

/// Optimizer names [`crate::make_optimizer`] builds.
pub const KNOWN_OPTIMIZERS: &[&str] = &["adamw", "soap", "shampoo", "sgd"];

/// The optimizer built by [`crate::train`] (callers with their own optimizer use
/// [`crate::Trainer::new`] directly).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// `adamw`, `soap` or `shampoo` (from `orrery-optim`), or `sgd` (plain gradient descent,
    /// for debugging).
    pub name: String,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// SOAP and Shampoo: steps between preconditioner refreshes (SOAP's basis, Shampoo's
    /// inverse roots); `None`: the optimizer's published default (10 for both).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub precondition_frequency: Option<u64>,
    /// SOAP and Shampoo: decay of the `L`/`R` statistics; `None`: the optimizer's published
    /// default (SOAP: `beta2`; Shampoo: 1, plain sums).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shampoo_beta: Option<f32>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            name: "adamw".to_owned(),
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            precondition_frequency: None,
            shampoo_beta: None,
        }
    }
}

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// burn's ndarray backend on the CPU.
    Cpu,
    /// burn's CUDA backend; needs the crate feature `cuda`.
    Cuda,
}

/// Everything a training run needs. `Default` is the small run `orrery train` does with no
/// configuration: a ~0.8M-parameter byte-level GPT on the built-in corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub optimizer: OptimizerConfig,
    pub device: DeviceKind,
    /// Seeds weight initialisation, batch sampling and burn's backend RNG.
    pub seed: u64,
    /// Optimizer steps of the whole run (a resumed run continues up to this count).
    pub steps: u64,
    /// Sequences per step, summed over all data-parallel ranks.
    pub batch_size: usize,
    /// Peak learning rate, reached at the end of warm-up.
    pub lr: f64,
    pub warmup_steps: u64,
    /// The cosine decays to `lr * min_lr_ratio` at the last step.
    pub min_lr_ratio: f64,
    /// Clip gradients to this global L2 norm; 0 disables clipping.
    pub grad_clip: f64,
    /// Evaluate on the validation split every this many steps (and after the last); 0 never.
    pub eval_every: u64,
    /// Validation batches (of `batch_size` sequences) per evaluation.
    pub eval_batches: usize,
    /// Write a checkpoint every this many steps (and after the last); 0 only after the last.
    /// Checkpoints are written only when `out_dir` is set.
    pub checkpoint_every: u64,
    /// Where metrics, the loss curve and checkpoints go; `None` writes nothing.
    pub out_dir: Option<PathBuf>,
    /// Tensor, pipeline and data parallelism ([`ParallelConfig`]). Absent: pure data
    /// parallelism over the run's ranks. Not written when absent, so configurations and
    /// checkpoints from before the section existed read back unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel: Option<ParallelConfig>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: ModelConfig::default(),
            data: DataConfig::default(),
            optimizer: OptimizerConfig::default(),
            device: DeviceKind::Cpu,
            seed: 0,
            // The built-in corpus is 9 KB: longer runs only memorise it (validation loss
            // bottoms out around step 100 and then rises).
            steps: 100,
            batch_size: 16,
            lr: 3e-3,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            grad_clip: 1.0,
            eval_every: 20,
            eval_batches: 4,
            checkpoint_every: 0,
            out_dir: None,
            parallel: None,
        }
    }
}

/// One problem with a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// Dotted path of the field, e.g. `model.n_kv_heads`.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found in a configuration.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid training configuration:\n{}", .problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigErrors {
    pub problems: Vec<ConfigProblem>,
}

impl ConfigErrors {
    /// Whether some problem concerns `path`.
    pub fn mentions(&self, path: &str) -> bool {
        self.problems.iter().any(|p| p.path == path)
    }
}

/// Reading a configuration from TOML.
#[derive(Debug, Error)]
pub enum ConfigLoadError {
    #[error("training configuration is not valid TOML for this schema: {0}")]
    Parse(#[from] toml::de::Error),
    #[error(transparent)]
    Invalid(#[from] ConfigErrors),
}

/// Why a `cuda` job cannot run in a build without the `cuda` feature, and how to build one.
pub const CUDA_UNAVAILABLE: &str =
    "cuda needs orrery built with the `cuda` feature: cargo build --release -p orrery-cli --features cuda";

/// Every field of `tree` that does not deserialize into a [`TrainConfig`], found one at a
/// time: every field of every section has a default, so a configuration holding only that
/// field (inside its sections) deserializes exactly when its name is known and its value has
/// the right type. Where a section fails but none of its fields alone does, the section is
/// named. serde alone stops at the first.
fn field_problems(tree: &toml::Table) -> Vec<ConfigProblem> {
    fn probe(path: &[String], value: &toml::Value) -> Result<(), String> {
        let mut v = value.clone();
        for key in path.iter().rev() {
            let mut t = toml::Table::new();
            t.insert(key.clone(), v);
            v = toml::Value::Table(t);
        }
        v.try_into::<TrainConfig>().map(|_| ()).map_err(|e| {
            let text = e.to_string();
            text.lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or(&text)
                .to_string()
        })
    }
    fn walk(path: &mut Vec<String>, value: &toml::Value, out: &mut Vec<ConfigProblem>) {
        let Err(message) = probe(path, value) else {
            return;
        };
        let before = out.len();
        if let toml::Value::Table(t) = value {
            for (k, v) in t {
                path.push(k.clone());
                walk(path, v, out);
                path.pop();
            }
        }
        if out.len() == before {
            out.push(ConfigProblem {
                path: path.join("."),
                message,
            });
        }
    }
    let mut out = Vec::new();
    let mut path = Vec::new();
    for (k, v) in tree {
        path.push(k.clone());
        walk(&mut path, v, &mut out);
        path.pop();
    }
    out
}

impl TrainConfig {
    /// Parses TOML (every field optional, unknown fields rejected) and validates it.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigLoadError> {
        let config = Self::parse_toml_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses TOML without validating it (a caller that overrides fields validates after):
    /// every mistyped or unknown field is reported at once, with its path; a file that is
    /// not TOML at all, with the parser's message.
    pub fn parse_toml_str(text: &str) -> Result<Self, ConfigLoadError> {
        let err = match toml::from_str::<Self>(text) {
            Ok(config) => return Ok(config),
            Err(e) => e,
        };
        let problems = text
            .parse::<toml::Table>()
            .map(|tree| field_problems(&tree))
            .unwrap_or_default();
        if problems.is_empty() {
            Err(ConfigLoadError::Parse(err))
        } else {
            Err(ConfigLoadError::Invalid(ConfigErrors { problems }))
        }
    }

    /// Checks every constraint and reports all violations together.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut p = Vec::new();
        let mut bad = |path: &str, message: String| {
            p.push(ConfigProblem {
                path: path.to_owned(),
                message,
            });
        };
        let m = &self.model;
        if m.vocab_size == 0 {
            bad("model.vocab_size", "must be at least 1".into());
        }
        if self.data.tokenizer == TokenizerKind::Byte && m.vocab_size < 256 {
            bad(
                "model.vocab_size",
                format!("{} is smaller than the byte tokenizer's 256", m.vocab_size),
            );
        }
        if m.context < 2 {
            bad("model.context", format!("{} is below 2", m.context));
        }
        if m.d_model == 0 {
            bad("model.d_model", "must be at least 1".into());
        }
        if m.n_layers == 0 {
            bad("model.n_layers", "must be at least 1".into());
        }
        if m.n_heads == 0 {
            bad("model.n_heads", "must be at least 1".into());
        } else if !m.d_model.is_multiple_of(m.n_heads) {
            bad(
                "model.n_heads",
                format!("{} does not divide d_model {}", m.n_heads, m.d_model),
            );
        } else if m.positions == PositionKind::Rope && !m.head_dim().is_multiple_of(2) {
            bad(
                "model.positions",
                format!("rope needs an even head dimension, got {}", m.head_dim()),
            );
        }
        if m.n_kv_heads == 0 {
            bad("model.n_kv_heads", "must be at least 1".into());
        } else if m.n_heads != 0 && !m.n_heads.is_multiple_of(m.n_kv_heads) {
            bad(
                "model.n_kv_heads",
                format!("{} does not divide n_heads {}", m.n_kv_heads, m.n_heads),
            );
        }
        if m.d_ff == 0 {
            bad("model.d_ff", "must be at least 1".into());
        }
        if let Some(moe) = &m.moe {
            if moe.experts == 0 {
                bad("model.moe.experts", "must be at least 1".into());
            }
            if moe.top_k == 0 || moe.top_k > moe.experts {
                bad(
                    "model.moe.top_k",
                    format!("{} is not in 1..={}", moe.top_k, moe.experts),
                );
            }
        }
        if !(m.rope_theta.is_finite() && m.rope_theta > 1.0) {
            bad(
                "model.rope_theta",
                format!("{} is not above 1", m.rope_theta),
            );
        }
        if !(m.norm_eps.is_finite() && m.norm_eps > 0.0) {
            bad("model.norm_eps", format!("{} is not positive", m.norm_eps));
        }
        if !(m.init_std.is_finite() && m.init_std > 0.0) {
            bad("model.init_std", format!("{} is not positive", m.init_std));
        }
        let d = &self.data;
        if !(d.val_fraction > 0.0 && d.val_fraction < 1.0) {
            bad(
                "data.val_fraction",
                format!("{} is not strictly between 0 and 1", d.val_fraction),
            );
        }
        if let TokenizerKind::Bpe(name) = &d.tokenizer {
            match crate::data::bpe_vocab_size(name) {
                None => {
                    let known: Vec<&str> =
                        crate::data::BPE_VOCABULARIES.iter().map(|v| v.0).collect();
                    bad(
                        "data.tokenizer",
                        format!(
                            "unknown BPE vocabulary `{name}` (known: {})",
                            known.join(", ")
                        ),
                    );
                }
                Some(v) if m.vocab_size < v => bad(
                    "model.vocab_size",
                    format!("{} is smaller than {name}'s {v} tokens", m.vocab_size),
                ),
                Some(_) => {}
            }
            if !cfg!(feature = "bpe") {
                bad(
                    "data.tokenizer",
                    "BPE needs orrery-train built with the `bpe` feature".into(),
                );
            }
        }
        let o = &self.optimizer;
        if !KNOWN_OPTIMIZERS.contains(&o.name.as_str()) {
            bad(
                "optimizer.name",
                format!(
                    "unknown optimizer `{}` (known: {})",
                    o.name,
                    KNOWN_OPTIMIZERS.join(", ")
                ),
            );
        }
        if !(0.0..1.0).contains(&o.beta1) {
            bad("optimizer.beta1", format!("{} is not in [0, 1)", o.beta1));
        }
        if !(0.0..1.0).contains(&o.beta2) {
            bad("optimizer.beta2", format!("{} is not in [0, 1)", o.beta2));
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            bad("optimizer.eps", format!("{} is not positive", o.eps));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            bad(
                "optimizer.weight_decay",
                format!("{} is negative", o.weight_decay),
            );
        }
        if o.precondition_frequency == Some(0) {
            bad(
                "optimizer.precondition_frequency",
                "must be at least 1".into(),
            );
        }
        if let Some(b) = o.shampoo_beta {
            // Shampoo's published default is 1 (plain sums), so 1 is allowed; SOAP takes an
            // EMA and 1 would never let a new gradient in.
            let max_ok = if o.name == "soap" { b < 1.0 } else { b <= 1.0 };
            if !(b >= 0.0 && max_ok) {
                bad(
                    "optimizer.shampoo_beta",
                    format!(
                        "{b} is not in [0, 1{}",
                        if o.name == "soap" { ")" } else { "]" }
                    ),
                );
            }
        }
        if self.device == DeviceKind::Cuda && !cfg!(feature = "cuda") {
            bad("device", CUDA_UNAVAILABLE.into());
        }
        if self.steps == 0 {
            bad("steps", "must be at least 1".into());
        }
        if self.batch_size == 0 {
            bad("batch_size", "must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bad("lr", format!("{} is not positive", self.lr));
        }
        if self.warmup_steps > self.steps {
            bad(
                "warmup_steps",
                format!("{} exceeds steps {}", self.warmup_steps, self.steps),
            );
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            bad(
                "min_lr_ratio",
                format!("{} is not in [0, 1]", self.min_lr_ratio),
            );
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            bad("grad_clip", format!("{} is negative", self.grad_clip));
        }
        if self.eval_every > 0 && self.eval_batches == 0 {
            bad(
                "eval_batches",
                "must be at least 1 when eval_every is set".into(),
            );
        }
        if let Some(par) = &self.parallel {
            par.problems(m, self.batch_size, &mut p);
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors { problems: p })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mistyped_or_unknown_field_is_reported_at_once() {
        let text = r#"
            steps = "many"
            colour = "blue"
            [model]
            n_layers = "two"
            bogus = 1
            [model.moe]
            experts = "eight"
            [parallel]
            tp = -1
        "#;
        let Err(ConfigLoadError::Invalid(e)) = TrainConfig::parse_toml_str(text) else {
            panic!("expected every field's problem");
        };
        let mut paths: Vec<&str> = e.problems.iter().map(|p| p.path.as_str()).collect();
        paths.sort_unstable();
        assert_eq!(
            paths,
            [
                "colour",
                "model.bogus",
                "model.moe.experts",
                "model.n_layers",
                "parallel.tp",
                "steps"
            ],
            "{e}"
        );
        // Not TOML at all: the parser's own message.
        assert!(matches!(
            TrainConfig::parse_toml_str("steps ="),
            Err(ConfigLoadError::Parse(_))
        ));
        // A well-typed file parses without being validated; from_toml_str validates.
        let zero = TrainConfig::parse_toml_str("steps = 0").unwrap();
        assert_eq!(zero.steps, 0);
        assert!(TrainConfig::from_toml_str("steps = 0").is_err());
    }

    #[test]
    fn every_cut_of_a_configuration_parses_or_names_its_problems() {
        // Each prefix of a configuration (a file cut short, half a table, half a string)
        // parses, or fails with the parser's message or with problems that have paths;
        // the field-by-field search never panics.
        let text = "steps = 5\nlr = 0.01\n[model]\nn_layers = 2\nmlp = \"swiglu\"\n\
                    [model.moe]\nexperts = 4\n[parallel]\ntp = 1\npp = 1\n";
        for end in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            match TrainConfig::parse_toml_str(&text[..end]) {
                Ok(_) | Err(ConfigLoadError::Parse(_)) => {}
                Err(ConfigLoadError::Invalid(e)) => {
                    assert!(e.problems.iter().all(|p| !p.path.is_empty()), "{e}");
                }
            }
        }
    }

    #[test]
    fn default_is_valid() {
        TrainConfig::default().validate().unwrap();
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let mut c = TrainConfig::default();
        c.model.n_kv_heads = 3;
        c.model.d_model = 130;
        c.batch_size = 0;
        c.data.val_fraction = 1.5;
        let err = c.validate().unwrap_err();
        assert!(err.mentions("model.n_kv_heads"), "{err}");
        assert!(err.mentions("model.n_heads"), "{err}");
        assert!(err.mentions("batch_size"), "{err}");
        assert!(err.mentions("data.val_fraction"), "{err}");
        assert!(err
            .to_string()
            .contains("model.n_kv_heads: 3 does not divide"));
    }

    #[test]
    fn toml_round_trip_and_unknown_field() {
        let c = TrainConfig::from_toml_str(
            "steps = 100\n[model]\nnorm = \"rmsnorm\"\nmlp = \"swiglu\"\npositions = \"learned\"\n",
        )
        .unwrap();
        assert_eq!(c.steps, 100);
        assert_eq!(c.model.norm, NormKind::RmsNorm);
        assert_eq!(c.model.mlp, MlpKind::SwiGlu);
        // An unknown field is named with its path.
        assert!(matches!(
            TrainConfig::from_toml_str("[model]\nwidth = 3\n"),
            Err(ConfigLoadError::Invalid(e)) if e.mentions("model.width")
        ));
        assert!(matches!(
            TrainConfig::from_toml_str("[model]\nn_layers = 0\n"),
            Err(ConfigLoadError::Invalid(e)) if e.mentions("model.n_layers")
        ));
    }

    #[test]
    fn parallel_section_is_optional_and_checked() {
        let text = toml::to_string(&TrainConfig::default()).unwrap();
        assert!(!text.contains("parallel"), "{text}");
        let c = TrainConfig::from_toml_str(
            "batch_size = 8\n[model]\nn_layers = 4\n[parallel]\ntp = 2\npp = 2\nmicro_batches = 4\n",
        )
        .unwrap();
        let par = c.parallel.unwrap();
        assert_eq!((par.tp, par.pp, par.dp, par.micro_batches), (2, 2, 1, 4));
        let r = TrainConfig::from_toml_str("[parallel]\ntp = 3\n");
        assert!(
            matches!(&r, Err(ConfigLoadError::Invalid(e)) if e.mentions("parallel.tp")),
            "{r:?}"
        );
        // Sequence parallelism is off unless asked for, and not written when off.
        assert!(!par.sequence_parallel);
        let text = toml::to_string(&c).unwrap();
        assert!(!text.contains("sequence_parallel"), "{text}");
        let c = TrainConfig::from_toml_str(
            "[model]\ncontext = 16\n[parallel]\ntp = 2\nsequence_parallel = true\n",
        )
        .unwrap();
        assert!(c.parallel.is_some_and(|p| p.sequence_parallel));
        for (toml, needle) in [
            ("[parallel]\nsequence_parallel = true\n", "needs tp > 1"),
            (
                "[model]\ncontext = 15\n[parallel]\ntp = 2\nsequence_parallel = true\n",
                "model.context 15 is not divisible by tp 2",
            ),
        ] {
            let r = TrainConfig::from_toml_str(toml);
            assert!(
                matches!(&r, Err(ConfigLoadError::Invalid(e))
                    if e.mentions("parallel.sequence_parallel")
                        && e.to_string().contains(needle)),
                "{toml}: {r:?}"
            );
        }
    }

    #[test]
    fn preconditioner_fields_are_optional_and_checked() {
        let c = TrainConfig::from_toml_str(
            "[optimizer]\nname = \"soap\"\nprecondition_frequency = 2\nshampoo_beta = 0.9\n",
        )
        .unwrap();
        assert_eq!(c.optimizer.precondition_frequency, Some(2));
        assert_eq!(c.optimizer.shampoo_beta, Some(0.9));
        assert_eq!(
            TrainConfig::default().optimizer.precondition_frequency,
            None
        );
        // Unset fields are not written, so a configuration without them reads back the same.
        let text = toml::to_string(&TrainConfig::default()).unwrap();
        assert!(!text.contains("precondition_frequency"), "{text}");
        for (toml, path) in [
            (
                "precondition_frequency = 0",
                "optimizer.precondition_frequency",
            ),
            (
                "name = \"soap\"\nshampoo_beta = 1.0",
                "optimizer.shampoo_beta",
            ),
            ("shampoo_beta = -0.5", "optimizer.shampoo_beta"),
        ] {
            let r = TrainConfig::from_toml_str(&format!("[optimizer]\n{toml}\n"));
            assert!(
                matches!(&r, Err(ConfigLoadError::Invalid(e)) if e.mentions(path)),
                "{toml}: {r:?}"
            );
        }
        // Shampoo's published statistics are plain sums: beta 1 is allowed there.
        TrainConfig::from_toml_str("[optimizer]\nname = \"shampoo\"\nshampoo_beta = 1.0\n")
            .unwrap();
    }
}
