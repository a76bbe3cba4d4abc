//! The parallel layout of a run: how its ranks split the model and the batch.
//!
//! A run of `tp × pp × dp` ranks is a grid. Along **tensor parallelism** (`tp`) the ranks of
//! one group hold slices of every matrix of their layers (attention by heads, the MLP by hidden
//! units) and combine partial results with all-reduces. Along **pipeline parallelism** (`pp`)
//! the layers are cut into contiguous stages; a micro-batch's activations flow forward from
//! stage to stage and its gradients flow back. Along **data parallelism** (`dp`) whole copies
//! of the (sharded, staged) model train on different slices of the global batch and average
//! their gradients. With `virtual_stages` above 1 each pipeline rank holds several
//! non-adjacent model chunks (interleaved 1F1B). With a mixture-of-experts model, **expert
//! parallelism** (`ep`) splits the experts over groups of `ep` consecutive data-parallel
//! replicas, which exchange tokens with all-to-alls.
//!
//! Key types: [`ParallelConfig`], the optional `[parallel]` section of `train.toml` (absent:
//! pure data parallelism over however many ranks the run has, exactly as before the section
//! existed), and [`Layout`], the validated grid for a given world size, which maps a rank to
//! its [`Coords`] and back and names the [`Group`]s each rank communicates in.
//!
//! Ranks are numbered with tensor parallelism fastest, then data parallelism, then pipeline
//! stages: `rank = tp + TP · (dp + DP · pp)`. Tensor-parallel groups, which talk the most, are
//! consecutive ranks (one host, in a real job); pipeline neighbours are `TP · DP` apart.
//!
//! With `sequence_parallel` the tensor-parallel group also splits the sequence between its
//! blocks (Megatron's sequence parallelism); that is an option of the tensor-parallel axis,
//! not an axis of its own, so it adds no ranks and no groups.
//!
//! What this module does not do: it computes nothing and sends nothing (the trainer and
//! [`crate::model_parallel`] do); it has no context-parallel axis.

use serde::{Deserialize, Serialize};

use crate::comm::Group;
use crate::config::{ConfigErrors, ConfigProblem, ModelConfig};

/// The `[parallel]` section of a training configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Tensor-parallel ranks: divides `n_heads`, `n_kv_heads` and `d_ff`.
    pub tp: usize,
    /// Pipeline stages: divides `n_layers`.
    pub pp: usize,
    /// Data-parallel replicas: `tp · pp · dp` is the run's number of ranks.
    pub dp: usize,
    /// Micro-batches per step and replica, run through the pipeline with the 1F1B schedule;
    /// `batch_size` must be divisible by `dp · micro_batches`.
    pub micro_batches: usize,
    /// Model chunks per pipeline rank. Above 1 the schedule is interleaved 1F1B: the layers
    /// are cut into `pp · virtual_stages` chunks dealt round-robin to the stages (stage `s`
    /// holds chunks `s`, `s + pp`, ...), which shrinks the pipeline bubble by this factor.
    /// Needs `pp > 1` and `micro_batches` divisible by `pp`; `n_layers` must be divisible by
    /// `pp · virtual_stages`.
    pub virtual_stages: usize,
    /// Expert-parallel ranks (a mixture-of-experts model, `model.moe`): each data-parallel
    /// replica's tokens are dispatched to the experts of `ep` consecutive replicas, each of
    /// which holds `experts / ep` of them. Divides `dp` and `model.moe.experts`.
    pub ep: usize,
    /// Megatron's sequence parallelism over the tensor-parallel group: the layer norms and
    /// residual adds between the tensor-parallel blocks run on `1 / tp` of the sequence on
    /// each rank, and each block's all-reduce becomes an all-gather before it and a
    /// reduce-scatter after it. Needs `tp > 1` and `model.context` divisible by `tp`. Not
    /// written when off, so configurations and checkpoints from before it read back
    /// unchanged.
    #[serde(skip_serializing_if = "is_false")]
    pub sequence_parallel: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            tp: 1,
            pp: 1,
            dp: 1,
            micro_batches: 1,
            virtual_stages: 1,
            ep: 1,
            sequence_parallel: false,
        }
    }
}

impl ParallelConfig {
    /// Whether the model itself is split (tensor or pipeline parallelism) or the step is cut
    /// into micro-batches, so that the model-parallel step runs rather than the plain
    /// data-parallel one.
    pub fn splits_model(&self) -> bool {
        self.tp > 1
            || self.pp > 1
            || self.micro_batches > 1
            || self.virtual_stages > 1
            || self.ep > 1
    }

    /// Ranks of the run this section describes.
    pub fn world_size(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// The problems of this section for `model` and `batch_size`, each with the dotted path
    /// of the field it concerns (appended to `out`).
    pub fn problems(&self, model: &ModelConfig, batch_size: usize, out: &mut Vec<ConfigProblem>) {
        let mut bad = |path: &str, message: String| {
            out.push(ConfigProblem {
                path: path.to_owned(),
                message,
            });
        };
        for (name, v) in [
            ("tp", self.tp),
            ("pp", self.pp),
            ("dp", self.dp),
            ("micro_batches", self.micro_batches),
            ("virtual_stages", self.virtual_stages),
            ("ep", self.ep),
        ] {
            if v == 0 {
                bad(&format!("parallel.{name}"), "must be at least 1".into());
            }
        }
        if self.tp > 0 {
            for (field, v) in [
                ("n_heads", model.n_heads),
                ("n_kv_heads", model.n_kv_heads),
                ("d_ff", model.d_ff),
            ] {
                if !v.is_multiple_of(self.tp) {
                    bad(
                        "parallel.tp",
                        format!("{} does not divide model.{field} {v}", self.tp),
                    );
                }
            }
        }
        if self.pp > 0 && !model.n_layers.is_multiple_of(self.pp) {
            bad(
                "parallel.pp",
                format!(
                    "{} does not divide model.n_layers {}",
                    self.pp, model.n_layers
                ),
            );
        } else if self.pp > 0 && self.virtual_stages > 1 {
            let chunks = self.pp * self.virtual_stages;
            if !model.n_layers.is_multiple_of(chunks) {
                bad(
                    "parallel.virtual_stages",
                    format!(
                        "pp {} × virtual_stages {} = {chunks} chunks do not divide \
                         model.n_layers {}",
                        self.pp, self.virtual_stages, model.n_layers
                    ),
                );
            }
            if self.pp == 1 {
                bad(
                    "parallel.virtual_stages",
                    "interleaving needs more than one pipeline stage (pp > 1)".into(),
                );
            } else if !self.micro_batches.is_multiple_of(self.pp) {
                bad(
                    "parallel.micro_batches",
                    format!(
                        "{} is not divisible by pp {}, as interleaved 1F1B needs",
                        self.micro_batches, self.pp
                    ),
                );
            }
            // Interleaved 1F1B names its messages by chunk and micro-batch in 24 bits each
            // (`model_parallel::message_tag`).
            for (field, n) in [
                ("parallel.micro_batches", self.micro_batches),
                ("parallel.virtual_stages", self.virtual_stages),
            ] {
                if n >= 1 << 24 {
                    bad(
                        field,
                        format!("{n} is too many for interleaved 1F1B (at most 16,777,215)"),
                    );
                }
            }
        }
        if self.ep > 1 {
            if !self.dp.is_multiple_of(self.ep) {
                bad(
                    "parallel.ep",
                    format!("{} does not divide dp {}", self.ep, self.dp),
                );
            }
            match &model.moe {
                None => bad(
                    "parallel.ep",
                    "expert parallelism needs a mixture-of-experts model (model.moe)".into(),
                ),
                Some(moe) if !moe.experts.is_multiple_of(self.ep) => bad(
                    "parallel.ep",
                    format!(
                        "{} does not divide model.moe.experts {}",
                        self.ep, moe.experts
                    ),
                ),
                Some(_) => {}
            }
        }
        if self.sequence_parallel {
            // The sequence is cut into `tp` equal slices, one per tensor-parallel rank; with
            // one rank there is nothing to cut, and a silent no-op would hide a typo in `tp`.
            if self.tp == 1 {
                bad(
                    "parallel.sequence_parallel",
                    "sequence parallelism splits the sequence over the tensor-parallel group \
                     and needs tp > 1"
                        .into(),
                );
            } else if self.tp > 1 && !model.context.is_multiple_of(self.tp) {
                bad(
                    "parallel.sequence_parallel",
                    format!(
                        "model.context {} is not divisible by tp {}, as sequence parallelism \
                         needs",
                        model.context, self.tp
                    ),
                );
            }
        }
        let replicas = self.dp * self.micro_batches;
        if replicas > 0 && !batch_size.is_multiple_of(replicas) {
            bad(
                "parallel.micro_batches",
                format!(
                    "batch_size {batch_size} is not divisible by dp {} × micro_batches {}",
                    self.dp, self.micro_batches
                ),
            );
        }
    }
}

/// A rank's place in the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// A validated `tp × pp × dp` grid for one model and world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub micro_batches: usize,
    /// Model chunks per pipeline rank (1: plain 1F1B; more: interleaved 1F1B).
    pub virtual_stages: usize,
    /// Expert-parallel ranks (1 without experts).
    pub ep: usize,
    /// Whether the regions between tensor-parallel blocks run on `1 / tp` of the sequence
    /// (Megatron's sequence parallelism).
    pub sequence_parallel: bool,
    /// Consecutive layers per model chunk (`n_layers / (pp · virtual_stages)`).
    pub layers_per_chunk: usize,
}

impl Layout {
    /// Checks `config` against the model, the batch size and the run's `world` size; every
    /// problem is reported with its field (`parallel.tp`, `parallel.dp`, ...).
    pub fn new(
        config: &ParallelConfig,
        model: &ModelConfig,
        batch_size: usize,
        world: usize,
    ) -> Result<Self, ConfigErrors> {
        let mut problems = Vec::new();
        config.problems(model, batch_size, &mut problems);
        if problems.is_empty() && config.world_size() != world {
            problems.push(ConfigProblem {
                path: "parallel.dp".into(),
                message: format!(
                    "tp {} × pp {} × dp {} is {} ranks, the run has {world}",
                    config.tp,
                    config.pp,
                    config.dp,
                    config.world_size()
                ),
            });
        }
        if !problems.is_empty() {
            return Err(ConfigErrors { problems });
        }
        Ok(Self {
            tp: config.tp,
            pp: config.pp,
            dp: config.dp,
            micro_batches: config.micro_batches,
            virtual_stages: config.virtual_stages,
            ep: config.ep,
            sequence_parallel: config.sequence_parallel,
            layers_per_chunk: model.n_layers / (config.pp * config.virtual_stages),
        })
    }

    pub fn world_size(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    pub fn rank_of(&self, c: Coords) -> usize {
        c.tp + self.tp * (c.dp + self.dp * c.pp)
    }

    /// The global indices of the layers of model chunk `chunk` (in `0..virtual_stages`) of
    /// pipeline stage `pp`: global chunk `chunk · pp_size + pp`.
    pub fn chunk_layers(&self, pp: usize, chunk: usize) -> std::ops::Range<usize> {
        let g = chunk * self.pp + pp;
        g * self.layers_per_chunk..(g + 1) * self.layers_per_chunk
    }

    /// The stage that holds layer `layer`.
    pub fn stage_of_layer(&self, layer: usize) -> usize {
        (layer / self.layers_per_chunk) % self.pp
    }

    fn group(&self, ranks: Vec<usize>) -> Group {
        // Ranks built from valid coordinates are distinct and inside the world.
        Group::new(ranks, self.world_size()).unwrap_or_else(|_| Group::world(1))
    }

    /// The tensor-parallel group of `rank`, in `tp` order.
    pub fn tp_group(&self, rank: usize) -> Group {
        let c = self.coords(rank);
        self.group(
            (0..self.tp)
                .map(|tp| self.rank_of(Coords { tp, ..c }))
                .collect(),
        )
    }

    /// The data-parallel group of `rank`, in `dp` order.
    pub fn dp_group(&self, rank: usize) -> Group {
        let c = self.coords(rank);
        self.group(
            (0..self.dp)
                .map(|dp| self.rank_of(Coords { dp, ..c }))
                .collect(),
        )
    }

    /// The expert-parallel group of `rank`: the `ep` consecutive data-parallel replicas
    /// (same stage and tensor rank) whose tokens share one set of experts, in `dp` order. A
    /// member's position is `dp % ep`, and it holds experts `[pos · E / ep, (pos + 1) · E / ep)`.
    pub fn ep_group(&self, rank: usize) -> Group {
        let c = self.coords(rank);
        let first = c.dp - c.dp % self.ep;
        self.group(
            (first..first + self.ep)
                .map(|dp| self.rank_of(Coords { dp, ..c }))
                .collect(),
        )
    }

    /// The ranks holding the same experts as `rank` (same stage, tensor rank and expert
    /// position, one per expert-parallel group), in `dp` order: an expert's gradient is summed
    /// over them.
    pub fn expert_dp_group(&self, rank: usize) -> Group {
        let c = self.coords(rank);
        self.group(
            (c.dp % self.ep..self.dp)
                .step_by(self.ep)
                .map(|dp| self.rank_of(Coords { dp, ..c }))
                .collect(),
        )
    }

    /// The first and last pipeline stage's ranks with `rank`'s `dp` and `tp`: the two copies
    /// of a tied embedding (one group member when `pp` is 1).
    pub fn embedding_group(&self, rank: usize) -> Group {
        let c = self.coords(rank);
        let first = self.rank_of(Coords { pp: 0, ..c });
        let last = self.rank_of(Coords {
            pp: self.pp - 1,
            ..c
        });
        if first == last {
            self.group(vec![first])
        } else {
            self.group(vec![first, last])
        }
    }

    /// The rank of the previous pipeline stage with the same `dp` and `tp`.
    pub fn prev_stage(&self, rank: usize) -> Option<usize> {
        let c = self.coords(rank);
        (c.pp > 0).then(|| self.rank_of(Coords { pp: c.pp - 1, ..c }))
    }

    /// The rank of the next pipeline stage with the same `dp` and `tp`.
    pub fn next_stage(&self, rank: usize) -> Option<usize> {
        let c = self.coords(rank);
        (c.pp + 1 < self.pp).then(|| self.rank_of(Coords { pp: c.pp + 1, ..c }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelConfig {
        ModelConfig {
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            d_ff: 64,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn ranks_and_coordinates_round_trip() {
        let cfg = ParallelConfig {
            tp: 2,
            pp: 2,
            dp: 3,
            micro_batches: 2,
            virtual_stages: 1,
            ep: 1,
            sequence_parallel: false,
        };
        let l = Layout::new(&cfg, &model(), 12, 12).unwrap();
        for rank in 0..12 {
            assert_eq!(l.rank_of(l.coords(rank)), rank);
        }
        assert_eq!(
            l.coords(7),
            Coords {
                tp: 1,
                dp: 0,
                pp: 1
            }
        );
        assert_eq!(l.tp_group(7).ranks(), &[6, 7]);
        assert_eq!(l.dp_group(7).ranks(), &[7, 9, 11]);
        assert_eq!(l.embedding_group(7).ranks(), &[1, 7]);
        assert_eq!((l.prev_stage(7), l.next_stage(7)), (Some(1), None));
        assert_eq!(l.chunk_layers(1, 0), 2..4);
        assert_eq!(l.stage_of_layer(1), 0);
        let cfg = ParallelConfig {
            tp: 1,
            pp: 2,
            dp: 1,
            micro_batches: 2,
            virtual_stages: 2,
            ep: 1,
            sequence_parallel: false,
        };
        let l = Layout::new(&cfg, &model(), 8, 2).unwrap();
        assert_eq!(l.chunk_layers(0, 1), 2..3);
        assert_eq!(l.chunk_layers(1, 0), 1..2);
        assert_eq!(
            (0..4).map(|x| l.stage_of_layer(x)).collect::<Vec<_>>(),
            vec![0, 1, 0, 1]
        );
    }

    #[test]
    fn problems_name_their_field() {
        let cfg = ParallelConfig {
            tp: 3,
            pp: 3,
            dp: 1,
            micro_batches: 5,
            virtual_stages: 1,
            ep: 1,
            sequence_parallel: false,
        };
        let err = Layout::new(&cfg, &model(), 8, 9).unwrap_err();
        for path in ["parallel.tp", "parallel.pp", "parallel.micro_batches"] {
            assert!(err.mentions(path), "{path}: {err}");
        }
        assert!(err.to_string().contains("model.n_heads 4"), "{err}");
        let ok = ParallelConfig {
            tp: 2,
            pp: 2,
            dp: 1,
            micro_batches: 1,
            virtual_stages: 1,
            ep: 1,
            sequence_parallel: false,
        };
        let err = Layout::new(&ok, &model(), 8, 8).unwrap_err();
        assert!(err.mentions("parallel.dp"), "{err}");
        assert!(err.to_string().contains("the run has 8"), "{err}");
        let interleaved = ParallelConfig {
            tp: 1,
            pp: 2,
            dp: 1,
            micro_batches: 3,
            virtual_stages: 4,
            ep: 1,
            sequence_parallel: false,
        };
        let err = Layout::new(&interleaved, &model(), 6, 2).unwrap_err();
        assert!(err.mentions("parallel.virtual_stages"), "{err}");
        assert!(err.mentions("parallel.micro_batches"), "{err}");
        // Interleaved messages name their micro-batch in 24 bits.
        let many = ParallelConfig {
            micro_batches: 1 << 24,
            virtual_stages: 2,
            ..interleaved
        };
        let err = Layout::new(&many, &model(), 1 << 24, 2).unwrap_err();
        assert!(
            err.to_string().contains("too many for interleaved"),
            "{err}"
        );
    }

    #[test]
    fn sequence_parallelism_needs_tensor_parallelism_and_a_divisible_context() {
        let sp = |tp: usize| ParallelConfig {
            tp,
            sequence_parallel: true,
            ..ParallelConfig::default()
        };
        // Nothing to split the sequence over.
        let err = Layout::new(&sp(1), &model(), 8, 1).unwrap_err();
        assert!(err.mentions("parallel.sequence_parallel"), "{err}");
        assert!(err.to_string().contains("needs tp > 1"), "{err}");
        // A context that does not cut into tp equal slices, reported with the other problems.
        let odd = ModelConfig {
            context: 9,
            d_ff: 63,
            ..model()
        };
        let err = Layout::new(&sp(2), &odd, 8, 2).unwrap_err();
        assert!(err.mentions("parallel.sequence_parallel"), "{err}");
        assert!(err.mentions("parallel.tp"), "{err}");
        assert!(
            err.to_string()
                .contains("model.context 9 is not divisible by tp 2"),
            "{err}"
        );
        // Off, the same shapes are only the tensor-parallel problem.
        let plain = ParallelConfig {
            sequence_parallel: false,
            ..sp(2)
        };
        let err = Layout::new(&plain, &odd, 8, 2).unwrap_err();
        assert!(!err.mentions("parallel.sequence_parallel"), "{err}");
        let ok = Layout::new(&sp(2), &model(), 8, 2).unwrap();
        assert!(ok.sequence_parallel);
        assert!(sp(2).splits_model());
    }
}
