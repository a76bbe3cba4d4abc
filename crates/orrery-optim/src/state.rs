//! The versioned byte format of saved optimizer state.
//!
//! Layout: an 8-byte tag naming the optimizer, a little-endian `u32` format version, the
//! payload (little-endian integers, `f32` as their bit patterns, strings and arrays prefixed by
//! a `u64` length), and a CRC32 of everything before it. The caller checksums its checkpoint
//! files too, but the trailer here means a truncated or altered blob is refused by
//! `load_state` itself, with a message that says what was wrong, instead of being half-read.

use crate::OptimError;

/// Version of the layout inside the tagged envelope. Bump on any change.
pub(crate) const FORMAT_VERSION: u32 = 1;

#[derive(Debug)]
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn new(tag: &[u8; 8]) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(tag);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        Self { buf }
    }
    pub(crate) fn u8(&mut self, x: u8) {
        self.buf.push(x);
    }
    pub(crate) fn u64(&mut self, x: u64) {
        self.buf.extend_from_slice(&x.to_le_bytes());
    }
    pub(crate) fn f32(&mut self, x: f32) {
        self.buf.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    pub(crate) fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.buf.extend_from_slice(s.as_bytes());
    }
    pub(crate) fn f32s(&mut self, xs: &[f32]) {
        self.u64(xs.len() as u64);
        self.buf.reserve(4 * xs.len());
        for &x in xs {
            self.f32(x);
        }
    }
    pub(crate) fn usizes(&mut self, xs: &[usize]) {
        self.u64(xs.len() as u64);
        for &x in xs {
            self.u64(x as u64);
        }
    }
    pub(crate) fn finish(mut self) -> Vec<u8> {
        let crc = crc32fast::hash(&self.buf);
        self.buf.extend_from_slice(&crc.to_le_bytes());
        self.buf
    }
}

#[derive(Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn bad(msg: impl Into<String>) -> OptimError {
    OptimError::BadState(msg.into())
}

impl<'a> Reader<'a> {
    /// Checks tag, version and checksum; the reader then walks the payload.
    pub(crate) fn new(bytes: &'a [u8], tag: &[u8; 8]) -> Result<Self, OptimError> {
        if bytes.len() < 16 {
            return Err(bad(format!(
                "{} bytes is too short to be optimizer state",
                bytes.len()
            )));
        }
        if &bytes[..8] != tag {
            return Err(bad(format!(
                "expected state tagged {:?}, found {:?} (state of another optimizer?)",
                String::from_utf8_lossy(tag),
                String::from_utf8_lossy(&bytes[..8])
            )));
        }
        let (body, trailer) = bytes.split_at(bytes.len() - 4);
        let mut crc = [0u8; 4];
        crc.copy_from_slice(trailer);
        let stored = u32::from_le_bytes(crc);
        let actual = crc32fast::hash(body);
        if stored != actual {
            return Err(bad(format!(
                "checksum mismatch (stored {stored:08x}, computed {actual:08x}): truncated or corrupted"
            )));
        }
        let mut v = [0u8; 4];
        v.copy_from_slice(&body[8..12]);
        let version = u32::from_le_bytes(v);
        if version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {version} is not supported (this build reads {FORMAT_VERSION})"
            )));
        }
        Ok(Self { buf: body, pos: 12 })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], OptimError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                bad(format!(
                    "payload ends early: wanted {n} bytes at offset {}",
                    self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, OptimError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u64(&mut self) -> Result<u64, OptimError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    /// A count; refused when it could not possibly fit in the rest of the payload, so a
    /// corrupted length never triggers a huge allocation.
    pub(crate) fn len(&mut self) -> Result<usize, OptimError> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(bad(format!("length {n} exceeds the {left} bytes left")));
        }
        usize::try_from(n).map_err(|_| bad("length overflows usize"))
    }
    pub(crate) fn str(&mut self) -> Result<String, OptimError> {
        let n = self.len()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad("a parameter name is not UTF-8"))
    }
    pub(crate) fn f32s(&mut self) -> Result<Vec<f32>, OptimError> {
        let n = self.len()?;
        let b = self.take(
            n.checked_mul(4)
                .ok_or_else(|| bad("array length overflows"))?,
        )?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect())
    }
    pub(crate) fn usizes(&mut self) -> Result<Vec<usize>, OptimError> {
        let n = self.len()?;
        (0..n)
            .map(|_| {
                let x = self.u64()?;
                usize::try_from(x).map_err(|_| bad("index overflows usize"))
            })
            .collect()
    }
    pub(crate) fn end(&self) -> Result<(), OptimError> {
        if self.pos != self.buf.len() {
            return Err(bad(format!(
                "{} trailing bytes after the state",
                self.buf.len() - self.pos
            )));
        }
        Ok(())
    }
}
