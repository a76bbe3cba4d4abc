//! The file `orrery collect` writes and `orrery emulate --graph` reads: every recorded rank
//! of a collection and the world they belong to.
//!
//! Layout: `orrery_units::frame` with the magic `ORRYCOLL` around a JSON body. A file that
//! is truncated, altered or of another version is reported and never used.

use orrery_graph::collect::RankRecord;
use orrery_units::frame::{frame, unframe, FrameError};
use serde::{Deserialize, Serialize};
use thiserror::Error;

const MAGIC: &[u8; 8] = b"ORRYCOLL";
const VERSION: u32 = 1;

/// A collection as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectionFile {
    /// The world: tensor, data, pipeline and expert parallel degrees.
    pub tp: u32,
    pub dp: u32,
    pub pp: u32,
    pub ep: u32,
    pub records: Vec<RankRecord>,
}

/// Why a collection file could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CollectionFileError {
    #[error("not an orrery collection (bad magic)")]
    BadMagic,
    #[error("collection header is truncated ({found} of 24 bytes)")]
    Header { found: u64 },
    #[error("collection format version {found}, this build reads version {VERSION}")]
    Version { found: u32 },
    #[error("collection is truncated or has trailing bytes (header says {expected} body bytes, found {found})")]
    Length { expected: u64, found: u64 },
    #[error("collection checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("collection body is malformed: {0}")]
    Malformed(String),
}

impl From<FrameError> for CollectionFileError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::BadMagic => CollectionFileError::BadMagic,
            FrameError::Truncated { found } => CollectionFileError::Header { found },
            FrameError::Version { found } => CollectionFileError::Version { found },
            FrameError::Length { expected, found } => {
                CollectionFileError::Length { expected, found }
            }
            FrameError::Checksum { stored, computed } => {
                CollectionFileError::Checksum { stored, computed }
            }
        }
    }
}

impl CollectionFile {
    /// The file image (deterministic: the body is the records' JSON in order).
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = serde_json::to_vec(self).unwrap_or_default();
        frame(MAGIC, VERSION, &body)
    }

    /// Parses a file image, checking magic, version, length and checksum.
    pub fn from_bytes(bytes: &[u8]) -> Result<CollectionFile, CollectionFileError> {
        let body = unframe(bytes, MAGIC, VERSION)?;
        serde_json::from_slice(body).map_err(|e| CollectionFileError::Malformed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orrery_graph::collect::RecordedOp;
    use orrery_graph::Phase;
    use orrery_units::Picos;

    fn sample() -> CollectionFile {
        CollectionFile {
            tp: 2,
            dp: 1,
            pp: 2,
            ep: 1,
            records: vec![RankRecord {
                rank: 0,
                ops: vec![RecordedOp::Compute {
                    name: "segment 0".into(),
                    phase: Phase::Forward,
                    duration: Picos(123),
                    memory: None,
                }],
            }],
        }
    }

    #[test]
    fn round_trips_and_detects_every_bit_flip_and_truncation() {
        let f = sample();
        let bytes = f.to_bytes();
        assert_eq!(CollectionFile::from_bytes(&bytes).unwrap(), f);
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(
                    CollectionFile::from_bytes(&b).is_err(),
                    "byte {i} bit {bit}"
                );
            }
        }
        for n in 0..bytes.len() {
            assert!(CollectionFile::from_bytes(&bytes[..n]).is_err());
        }
    }
}
