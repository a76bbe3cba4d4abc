//! Checkpoints: one self-checking file per save, written atomically.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! 0   8  magic "ORRYCKPT"
//! 8   4  format version (1)
//! 12  8  payload length in bytes
//! 20  4  CRC32 of the payload
//! 24  .. payload:
//!        u64 n + n bytes   metadata as JSON (step, config, RNG state, parameter names/shapes,
//!                          metrics and optimizer figures so far)
//!        u64 n + n f32     parameter values in store order
//!        u64 n + n bytes   optimizer state (opaque, from `Optimizer::save_state`)
//! ```
//!
//! The length and checksum are verified before anything is parsed, so a truncated or
//! bit-flipped file is reported as such rather than as a confusing parse error. Values are
//! stored as their exact bit patterns, which is what makes resume bit-exact.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::TrainConfig;
use crate::metrics::StepMetrics;
use crate::OptimizerSummary;

const MAGIC: &[u8; 8] = b"ORRYCKPT";
const VERSION: u32 = 1;
const HEADER: usize = 24;

/// Everything except the bulk arrays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Optimizer updates completed.
    pub step: u64,
    pub config: TrainConfig,
    /// State of the training-batch sampler's RNG after `step` batches.
    pub data_rng: [u64; 4],
    pub world_size: usize,
    pub tokens_seen: u64,
    pub param_names: Vec<String>,
    pub param_shapes: Vec<Vec<usize>>,
    /// Metrics of the steps done so far, so a resumed run's log and plot cover the whole run.
    pub history: Vec<StepMetrics>,
    /// What the optimizer did so far, so a resumed run's summary covers the whole run too.
    /// Checkpoints written before it existed lack it and are read with zeros.
    #[serde(default)]
    pub optimizer: OptimizerSummary,
}

/// A checkpoint in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub meta: CheckpointMeta,
    pub values: Vec<f32>,
    pub optimizer: Vec<u8>,
}

/// Errors of reading or writing a checkpoint.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not an orrery checkpoint (bad magic bytes)")]
    BadMagic,
    #[error("checkpoint format version {0} is not supported (this build reads version {VERSION})")]
    UnsupportedVersion(u32),
    #[error("checkpoint is truncated: header says {expected} payload bytes, file has {found}")]
    Truncated { expected: u64, found: u64 },
    #[error("checkpoint is corrupt: CRC32 {computed:08x} does not match the stored {stored:08x}")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("checkpoint payload is malformed: {0}")]
    Malformed(String),
}

fn put_section(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CheckpointError> {
        if self.buf.len() < n {
            return Err(CheckpointError::Malformed(format!(
                "{what} needs {n} bytes, {} left",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn u64(&mut self, what: &str) -> Result<u64, CheckpointError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn len(&mut self, what: &str, elem: usize) -> Result<usize, CheckpointError> {
        let n = self.u64(what)?;
        usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(elem))
            .ok_or_else(|| CheckpointError::Malformed(format!("{what} length {n} is too large")))
    }
}

impl Checkpoint {
    /// The file's bytes: header plus payload.
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        let meta = serde_json::to_vec(&self.meta)
            .map_err(|e| CheckpointError::Malformed(format!("metadata: {e}")))?;
        let mut payload = Vec::with_capacity(meta.len() + 4 * self.values.len() + 64);
        put_section(&mut payload, &meta);
        payload.extend_from_slice(&(self.values.len() as u64).to_le_bytes());
        for v in &self.values {
            payload.extend_from_slice(&v.to_le_bytes());
        }
        put_section(&mut payload, &self.optimizer);
        let mut out = Vec::with_capacity(HEADER + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        out.extend_from_slice(&payload);
        Ok(out)
    }

    /// Checks magic, version, length and CRC32, then parses.
    pub fn decode(bytes: &[u8]) -> Result<Self, CheckpointError> {
        if bytes.len() < HEADER {
            if bytes.len() >= 8 && &bytes[..8] != MAGIC {
                return Err(CheckpointError::BadMagic);
            }
            return Err(CheckpointError::Truncated {
                expected: HEADER as u64,
                found: bytes.len() as u64,
            });
        }
        if &bytes[..8] != MAGIC {
            return Err(CheckpointError::BadMagic);
        }
        let mut r = Reader { buf: &bytes[8..] };
        let version_bytes = r.take(4, "version")?;
        let version = u32::from_le_bytes([
            version_bytes[0],
            version_bytes[1],
            version_bytes[2],
            version_bytes[3],
        ]);
        if version != VERSION {
            return Err(CheckpointError::UnsupportedVersion(version));
        }
        let len = r.u64("payload length")?;
        let crc_bytes = r.take(4, "checksum")?;
        let stored = u32::from_le_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
        let payload = &bytes[HEADER..];
        if payload.len() as u64 != len {
            return Err(CheckpointError::Truncated {
                expected: len,
                found: payload.len() as u64,
            });
        }
        let computed = crc32fast::hash(payload);
        if computed != stored {
            return Err(CheckpointError::ChecksumMismatch { stored, computed });
        }
        let mut r = Reader { buf: payload };
        let n = r.len("metadata", 1)?;
        let meta: CheckpointMeta = serde_json::from_slice(r.take(n, "metadata")?)
            .map_err(|e| CheckpointError::Malformed(format!("metadata: {e}")))?;
        let n = r.len("values", 4)?;
        let values = r
            .take(n, "values")?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let n = r.len("optimizer state", 1)?;
        let optimizer = r.take(n, "optimizer state")?.to_vec();
        if !r.buf.is_empty() {
            return Err(CheckpointError::Malformed(format!(
                "{} trailing bytes",
                r.buf.len()
            )));
        }
        Ok(Self {
            meta,
            values,
            optimizer,
        })
    }

    /// Writes atomically: a temporary file in the same folder, fsync, rename over `path`,
    /// then fsync of the folder so the rename itself is durable.
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let bytes = self.encode()?;
        write_atomic(path, &bytes)
    }

    pub fn load(path: &Path) -> Result<Self, CheckpointError> {
        let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::decode(&bytes)
    }
}

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync of the folder).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".to_owned());
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Directory fsync is not supported everywhere; the data itself is already durable.
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            meta: CheckpointMeta {
                step: 3,
                config: TrainConfig::default(),
                data_rng: [1, 2, 3, 4],
                world_size: 1,
                tokens_seen: 99,
                param_names: vec!["a".into()],
                param_shapes: vec![vec![3]],
                history: Vec::new(),
                optimizer: OptimizerSummary {
                    refreshes: 5,
                    peak_device_bytes: 1 << 40,
                    ..OptimizerSummary::default()
                },
            },
            values: vec![1.0, -0.0, f32::MIN_POSITIVE],
            optimizer: vec![9, 8, 7],
        }
    }

    #[test]
    fn round_trip_is_exact() {
        let c = sample();
        let d = Checkpoint::decode(&c.encode().unwrap()).unwrap();
        assert_eq!(d, c);
        assert_eq!(d.values[1].to_bits(), (-0.0f32).to_bits());
    }

    /// Metadata written before the optimizer figures existed still reads, with zeros.
    #[test]
    fn metadata_without_optimizer_figures_reads_as_zeros() {
        let mut json = serde_json::to_value(&sample().meta).unwrap();
        let removed = json.as_object_mut().unwrap().remove("optimizer");
        assert!(removed.is_some(), "the figures are written");
        let meta: CheckpointMeta = serde_json::from_value(json).unwrap();
        assert_eq!(meta.optimizer, OptimizerSummary::default());
        assert_eq!(meta.history, sample().meta.history);
    }

    #[test]
    fn corruption_is_detected() {
        let bytes = sample().encode().unwrap();
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x01;
        assert!(matches!(
            Checkpoint::decode(&flipped),
            Err(CheckpointError::ChecksumMismatch { .. })
        ));
        assert!(matches!(
            Checkpoint::decode(&bytes[..bytes.len() - 5]),
            Err(CheckpointError::Truncated { .. })
        ));
        assert!(matches!(
            Checkpoint::decode(&bytes[..10]),
            Err(CheckpointError::Truncated { .. })
        ));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(matches!(
            Checkpoint::decode(&magic),
            Err(CheckpointError::BadMagic)
        ));
        let mut version = bytes;
        version[8] = 7;
        assert!(matches!(
            Checkpoint::decode(&version),
            Err(CheckpointError::UnsupportedVersion(7))
        ));
    }
}
