//! Text in, token windows out.
//!
//! A corpus is one token sequence (a file, or a folder's `.txt` files concatenated in sorted
//! path order) split by position: the last `val_fraction` of the tokens is validation, so the
//! split is deterministic and the two halves never share a window. Training batches are random
//! contiguous windows drawn from a seeded [`Rng`] whose state is checkpointed; validation uses a
//! fixed set of evenly spaced windows so that every evaluation measures the same thing.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::config::TokenizerKind;
use crate::rng::Rng;

/// The small public-domain corpus used when no data path is given (Shakespeare's sonnets).
pub const BUILTIN_CORPUS: &str = include_str!("../corpus/sonnets.txt");

/// tiktoken vocabularies that can be named in `data.tokenizer = { bpe = "..." }`, with the
/// number of token ids they produce (ordinary tokens; special tokens are never emitted).
pub const BPE_VOCABULARIES: &[(&str, usize)] = &[
    ("r50k_base", 50_257),
    ("p50k_base", 50_281),
    ("cl100k_base", 100_277),
    ("o200k_base", 200_019),
];

/// Vocabulary size of a named BPE vocabulary.
pub fn bpe_vocab_size(name: &str) -> Option<usize> {
    BPE_VOCABULARIES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, v)| v)
}

/// Errors of reading and tokenizing a corpus.
#[derive(Debug, Error)]
pub enum DataError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} is not valid UTF-8 text")]
    NotUtf8(PathBuf),
    #[error("{0} holds no .txt files")]
    EmptyFolder(PathBuf),
    #[error("the {split} split has {tokens} tokens, fewer than a window of context {context} + 1")]
    TooSmall {
        split: &'static str,
        tokens: usize,
        context: usize,
    },
    #[error("tokenizer `{0}`: {1}")]
    Tokenizer(String, String),
}

/// Text to token ids and back.
pub trait Tokenizer: Send + Sync + fmt::Debug {
    fn vocab_size(&self) -> usize;
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Best-effort decoding (invalid UTF-8 is replaced).
    fn decode(&self, ids: &[u32]) -> String;
}

/// One token per byte of the UTF-8 text.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl Tokenizer for ByteTokenizer {
    fn vocab_size(&self) -> usize {
        256
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .map(|&i| u8::try_from(i).unwrap_or(b'?'))
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(feature = "bpe")]
mod bpe {
    use super::{DataError, Tokenizer};

    /// A tiktoken BPE vocabulary bundled with tiktoken-rs.
    pub struct BpeTokenizer {
        name: String,
        bpe: tiktoken_rs::CoreBPE,
        vocab: usize,
    }

    impl std::fmt::Debug for BpeTokenizer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("BpeTokenizer")
                .field("name", &self.name)
                .field("vocab", &self.vocab)
                .finish()
        }
    }

    impl BpeTokenizer {
        pub fn new(name: &str) -> Result<Self, DataError> {
            let err = |e: String| DataError::Tokenizer(name.to_owned(), e);
            let bpe = match name {
                "r50k_base" => tiktoken_rs::r50k_base(),
                "p50k_base" => tiktoken_rs::p50k_base(),
                "cl100k_base" => tiktoken_rs::cl100k_base(),
                "o200k_base" => tiktoken_rs::o200k_base(),
                other => return Err(err(format!("unknown vocabulary `{other}`"))),
            };
            let vocab = super::bpe_vocab_size(name)
                .ok_or_else(|| err(format!("unknown vocabulary `{name}`")))?;
            Ok(Self {
                name: name.to_owned(),
                bpe: bpe.map_err(|e| err(e.to_string()))?,
                vocab,
            })
        }
    }

    impl Tokenizer for BpeTokenizer {
        fn vocab_size(&self) -> usize {
            self.vocab
        }

        fn encode(&self, text: &str) -> Vec<u32> {
            self.bpe.encode_ordinary(text)
        }

        fn decode(&self, ids: &[u32]) -> String {
            match self.bpe.decode_bytes(ids) {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(e) => format!("<undecodable: {e}>"),
            }
        }
    }
}

/// The tokenizer a configuration names.
pub fn make_tokenizer(kind: &TokenizerKind) -> Result<Box<dyn Tokenizer>, DataError> {
    match kind {
        TokenizerKind::Byte => Ok(Box::new(ByteTokenizer)),
        #[cfg(feature = "bpe")]
        TokenizerKind::Bpe(name) => Ok(Box::new(bpe::BpeTokenizer::new(name)?)),
        #[cfg(not(feature = "bpe"))]
        TokenizerKind::Bpe(name) => Err(DataError::Tokenizer(
            name.clone(),
            "BPE needs orrery-train built with the `bpe` feature".into(),
        )),
    }
}

fn read_file(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_owned(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|_| DataError::NotUtf8(path.to_owned()))
}

fn txt_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let io = |source| DataError::Io {
        path: dir.to_owned(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_dir() {
            txt_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "txt") {
            out.push(path);
        }
    }
    Ok(())
}

/// The text of a file, of every `.txt` file under a folder (sorted by path, separated by a
/// blank line), or of the built-in corpus when `path` is `None`.
pub fn read_text(path: Option<&Path>) -> Result<String, DataError> {
    let Some(path) = path else {
        return Ok(BUILTIN_CORPUS.to_owned());
    };
    if path.is_dir() {
        let mut files = Vec::new();
        txt_files(path, &mut files)?;
        if files.is_empty() {
            return Err(DataError::EmptyFolder(path.to_owned()));
        }
        files.sort();
        let mut text = String::new();
        for f in &files {
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(&read_file(f)?);
        }
        Ok(text)
    } else {
        read_file(path)
    }
}

/// A tokenized corpus split into training and validation tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corpus {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl Corpus {
    /// Splits `tokens`: the last `ceil(len * val_fraction)` are validation. Both parts must hold
    /// at least one window of `context + 1` tokens (inputs plus shifted targets).
    pub fn split(tokens: Vec<u32>, val_fraction: f64, context: usize) -> Result<Self, DataError> {
        let n = tokens.len();
        let n_val = ((n as f64) * val_fraction).ceil() as usize;
        let n_val = n_val.min(n);
        let mut train = tokens;
        let val = train.split_off(n - n_val);
        for (split, t) in [("training", &train), ("validation", &val)] {
            if t.len() < context + 1 {
                return Err(DataError::TooSmall {
                    split,
                    tokens: t.len(),
                    context,
                });
            }
        }
        Ok(Self { train, val })
    }
}

/// A batch of windows: `inputs[i]` is `tokens[s..s + t]`, `targets[i]` is `tokens[s + 1..s + t + 1]`,
/// both row-major `[batch, t]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
}

impl Batch {
    pub fn from_starts(tokens: &[u32], starts: &[usize], seq: usize) -> Self {
        let mut inputs = Vec::with_capacity(starts.len() * seq);
        let mut targets = Vec::with_capacity(starts.len() * seq);
        for &s in starts {
            inputs.extend(tokens[s..s + seq].iter().map(|&x| i64::from(x)));
            targets.extend(tokens[s + 1..s + seq + 1].iter().map(|&x| i64::from(x)));
        }
        Self {
            batch: starts.len(),
            seq,
            inputs,
            targets,
        }
    }
}

/// Start positions of `n` random windows of `seq + 1` tokens in a sequence of `len` tokens.
pub fn random_starts(rng: &mut Rng, len: usize, seq: usize, n: usize) -> Vec<usize> {
    let span = (len - seq) as u64; // starts 0..=len-seq-1
    (0..n).map(|_| rng.below(span) as usize).collect()
}

/// `n` evenly spaced window starts covering the sequence (the same on every call).
pub fn even_starts(len: usize, seq: usize, n: usize) -> Vec<usize> {
    let last = len - seq - 1;
    if n <= 1 {
        return vec![0; n];
    }
    (0..n).map(|i| i * last / (n - 1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_round_trips() {
        let t = ByteTokenizer;
        let ids = t.encode("Shall I compare thee — ");
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids), "Shall I compare thee — ");
    }

    #[cfg(feature = "bpe")]
    #[test]
    fn bpe_tokenizer_round_trips() {
        let t = make_tokenizer(&TokenizerKind::Bpe("r50k_base".into())).unwrap();
        let ids = t.encode("Shall I compare thee to a summer's day?");
        assert!(ids.len() < 15, "{ids:?}");
        assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        assert_eq!(t.decode(&ids), "Shall I compare thee to a summer's day?");
    }

    #[test]
    fn split_is_by_position_and_checks_size() {
        let tokens: Vec<u32> = (0..100).collect();
        let c = Corpus::split(tokens, 0.1, 8).unwrap();
        assert_eq!(c.train.len(), 90);
        assert_eq!(c.val, (90..100).collect::<Vec<_>>());
        assert!(matches!(
            Corpus::split((0..100).collect(), 0.1, 10),
            Err(DataError::TooSmall {
                split: "validation",
                ..
            })
        ));
    }

    #[test]
    fn windows_stay_inside_and_targets_shift() {
        let tokens: Vec<u32> = (0..50).collect();
        let mut rng = Rng::new(1, 2);
        let starts = random_starts(&mut rng, tokens.len(), 8, 100);
        assert!(starts.iter().all(|&s| s + 8 < 50));
        let b = Batch::from_starts(&tokens, &starts[..2], 8);
        assert_eq!(b.inputs.len(), 16);
        assert_eq!(b.targets[0], b.inputs[0] + 1);
        let e = even_starts(50, 8, 5);
        assert_eq!(e.first(), Some(&0));
        assert_eq!(e.last(), Some(&41));
    }

    #[test]
    fn folder_of_txt_files_is_read_in_order() {
        let dir = std::env::temp_dir().join(format!("orrery-train-data-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.txt"), "second").unwrap();
        std::fs::write(dir.join("a.txt"), "first").unwrap();
        std::fs::write(dir.join("sub/c.txt"), "third").unwrap();
        std::fs::write(dir.join("skip.md"), "no").unwrap();
        let text = read_text(Some(&dir)).unwrap();
        assert_eq!(text, "first\n\nsecond\n\nthird");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(read_text(None).unwrap().contains("summer's day"));
    }
}
