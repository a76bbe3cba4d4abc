//! The file `orrery collect` writes and `orrery emulate --graph` reads: every recorded rank
//! of a collection and the world they belong to.
//!
//! Layout: the magic `ORRYCOLL`, a format version (u32, little-endian), the body's length
//! (u64) and its CRC32 (u32), then the body, JSON. A file that is truncated, altered or of
//! another version is reported and never used.

use orrery_graph::collect::RankRecord;
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

impl CollectionFile {
    /// The file image (deterministic: the body is the records' JSON in order).
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = serde_json::to_vec(self).unwrap_or_default();
        let mut out = Vec::with_capacity(body.len() + 24);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Parses a file image, checking magic, version, length and checksum.
    pub fn from_bytes(bytes: &[u8]) -> Result<CollectionFile, CollectionFileError> {
        if bytes.len() < 8 || &bytes[..8] != MAGIC {
            return Err(CollectionFileError::BadMagic);
        }
        let header = bytes.get(8..24).ok_or(CollectionFileError::Header {
            found: bytes.len() as u64,
        })?;
        let version = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        if version != VERSION {
            return Err(CollectionFileError::Version { found: version });
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&header[4..12]);
        let expected = u64::from_le_bytes(len);
        let stored = u32::from_le_bytes([header[12], header[13], header[14], header[15]]);
        let body = &bytes[24..];
        if body.len() as u64 != expected {
            return Err(CollectionFileError::Length {
                expected,
                found: body.len() as u64,
            });
        }
        let computed = crc32fast::hash(body);
        if computed != stored {
            return Err(CollectionFileError::Checksum { stored, computed });
        }
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
