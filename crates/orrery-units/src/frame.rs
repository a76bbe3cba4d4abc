//! The frame around every file orrery writes for itself and reads back (the memo cache,
//! a collection): an 8-byte magic, a format version (`u32`), the body's length (`u64`) and
//! its CRC32 (`u32`), all little-endian, then the body. Reading checks all four, so a file
//! that is foreign, of another version, truncated, extended or altered is refused before
//! its body is parsed.

/// Bytes before the body.
pub const HEADER_LEN: usize = 24;

/// Why a framed file was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// Not the expected magic.
    BadMagic,
    /// Shorter than the header (`found` bytes in all).
    Truncated { found: u64 },
    /// Another format version.
    Version { found: u32 },
    /// The body is not as long as the header says.
    Length { expected: u64, found: u64 },
    /// The body's checksum is not the stored one.
    Checksum { stored: u32, computed: u32 },
}

/// `body` framed with `magic` and `version`.
pub fn frame(magic: &[u8; 8], version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + HEADER_LEN);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// The body of a file framed with `magic` and `version`, every check passed.
pub fn unframe<'a>(bytes: &'a [u8], magic: &[u8; 8], version: u32) -> Result<&'a [u8], FrameError> {
    if bytes.len() < magic.len() || &bytes[..magic.len()] != magic {
        return Err(FrameError::BadMagic);
    }
    let header = bytes.get(8..HEADER_LEN).ok_or(FrameError::Truncated {
        found: bytes.len() as u64,
    })?;
    let word = |at: usize, n: usize| {
        header[at..at + n]
            .iter()
            .rev()
            .fold(0u64, |a, &b| (a << 8) | u64::from(b))
    };
    let found = word(0, 4) as u32;
    if found != version {
        return Err(FrameError::Version { found });
    }
    let expected = word(4, 8);
    let stored = word(12, 4) as u32;
    let body = &bytes[HEADER_LEN..];
    if body.len() as u64 != expected {
        return Err(FrameError::Length {
            expected,
            found: body.len() as u64,
        });
    }
    let computed = crc32fast::hash(body);
    if computed != stored {
        return Err(FrameError::Checksum { stored, computed });
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_every_damage() {
        let bytes = frame(b"ORRYTEST", 3, b"some body");
        assert_eq!(unframe(&bytes, b"ORRYTEST", 3), Ok(&b"some body"[..]));
        assert_eq!(
            unframe(&bytes, b"ORRYTEST", 4),
            Err(FrameError::Version { found: 3 })
        );
        assert_eq!(unframe(&bytes, b"ORRYELSE", 3), Err(FrameError::BadMagic));
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(unframe(&b, b"ORRYTEST", 3).is_err(), "byte {i} bit {bit}");
            }
        }
        for n in 0..bytes.len() {
            assert!(unframe(&bytes[..n], b"ORRYTEST", 3).is_err(), "{n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(
            unframe(&longer, b"ORRYTEST", 3),
            Err(FrameError::Length { .. })
        ));
    }
}
