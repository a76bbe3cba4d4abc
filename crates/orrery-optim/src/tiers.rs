//! Tiered placement of optimizer state: device, host or disk, under per-tier byte budgets.
//!
//! Every state tensor is registered once with an [`Access`] pattern and placed greedily, in
//! registration order (which is deterministic: parameters are visited in the caller's order):
//!
//! - [`Access::Hot`] (read and written every step: Adam moments, the `L`/`R` accumulators)
//!   goes to the device if it fits, else the host, else disk;
//! - [`Access::Warm`] (read every step, written rarely: eigenbases) prefers the host, then the
//!   device, then disk — bases are the natural thing to keep off the device because a refresh
//!   replaces them wholesale.
//!
//! On the CPU "device" and "host" are both RAM; they are accounted separately so the budgets
//! and the device-resident byte count mean what they will mean on a GPU. The disk tier is one
//! file per tensor, read and written with plain file I/O (the workspace forbids `unsafe`, so no
//! memory maps): a 16-byte header (magic, element count), the little-endian `f32` bits, then a
//! CRC32 of everything before it. Writes go to a temporary file that is fsynced and renamed over
//! the old one, so a crash leaves either the old or the new tensor, never a torn one. A file
//! whose length or checksum does not match is reported as [`TierError::Corrupt`] and never used.
//!
//! Stores in one process may share a spill folder (file names carry a store number); two
//! processes must not.
//!
//! Prefetch: [`TieredStore::prefetch`] starts reading a spilled tensor on a dedicated I/O
//! thread; the optimizer calls it for the next parameter while it computes the current one, so
//! disk reads overlap compute. Every write of a key drops its prefetch, so a prefetched read
//! is never older than the file. A spilled tensor that was taken but not modified (a basis
//! between refreshes) is not rewritten ([`TieredStore::put_unchanged`]).
//!
//! What it does not do (yet): move tensors between tiers after placement, or reorder
//! placement globally by size (placement is greedy in registration order).

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::runtime::{Inflight, WorkerPool};

use thiserror::Error;

/// Where a state tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

/// How a tensor is used, which decides the tier it prefers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read and written every step.
    Hot,
    /// Read every step, written rarely.
    Warm,
}

/// Budgets of the tiered state. `None` as the whole config means "everything on the device".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes of optimizer state allowed on the device.
    pub device_budget: u64,
    /// Bytes of optimizer state allowed in host memory.
    pub host_budget: u64,
    /// Folder for spilled tensors (created if missing). Each optimizer should get its own.
    pub spill_dir: PathBuf,
}

/// Bytes currently placed in each tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub device_bytes: u64,
    pub host_bytes: u64,
    pub disk_bytes: u64,
}

/// Errors of reading or writing spilled state.
#[derive(Debug, Error)]
pub enum TierError {
    #[error("spill file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("spill file {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("state tensor `{0}` is not registered (or is taken)")]
    Missing(String),
}

#[derive(Debug)]
struct Entry {
    tier: Tier,
    /// Element count, fixed at registration.
    len: usize,
    /// Resident data (device or host tier); `None` on disk or while taken.
    data: Option<Vec<f32>>,
    /// File of a disk-tier tensor.
    file: Option<PathBuf>,
}

/// Named `f32` state tensors placed in tiers.
#[derive(Debug)]
pub struct TieredStore {
    config: Option<TierConfig>,
    entries: BTreeMap<String, Entry>,
    usage: TierUsage,
    next_file: u64,
    /// Distinguishes the files of stores in one process that share a spill folder.
    store_id: u64,
    /// One I/O thread for prefetching spilled tensors, started on the first prefetch.
    io: Option<WorkerPool>,
    /// Reads in flight or finished, consumed by the next `take` of the key.
    prefetched: BTreeMap<String, Inflight<(PathBuf, usize), SpillRead>>,
}

type SpillRead = Result<Vec<f32>, TierError>;

fn read_job(job: &(PathBuf, usize)) -> SpillRead {
    read_spill(&job.0, job.1)
}

/// Source of `store_id`s. File names never influence results, so a process-wide counter is
/// fine; two *processes* must not share a spill folder.
static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

const MAGIC: &[u8; 8] = b"ORSPILL1";

impl TieredStore {
    /// A store; `None` keeps everything on the device with no budget.
    pub fn new(config: Option<TierConfig>) -> Self {
        Self {
            config,
            entries: BTreeMap::new(),
            usage: TierUsage::default(),
            next_file: 0,
            store_id: NEXT_STORE.fetch_add(1, Ordering::Relaxed),
            io: None,
            prefetched: BTreeMap::new(),
        }
    }

    pub fn usage(&self) -> TierUsage {
        self.usage
    }

    pub fn tier_of(&self, key: &str) -> Option<Tier> {
        self.entries.get(key).map(|e| e.tier)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    fn choose(&self, bytes: u64, access: Access) -> Tier {
        let Some(cfg) = &self.config else {
            return Tier::Device;
        };
        let dev = self.usage.device_bytes + bytes <= cfg.device_budget;
        let host = self.usage.host_bytes + bytes <= cfg.host_budget;
        match access {
            Access::Hot if dev => Tier::Device,
            Access::Hot if host => Tier::Host,
            Access::Warm if host => Tier::Host,
            Access::Warm if dev => Tier::Device,
            _ => Tier::Disk,
        }
    }

    /// Registers `key` with its initial data and places it. Re-registering replaces the old
    /// tensor (and frees its budget).
    pub fn insert(&mut self, key: &str, data: Vec<f32>, access: Access) -> Result<(), TierError> {
        self.remove(key)?;
        let bytes = 4 * data.len() as u64;
        let tier = self.choose(bytes, access);
        let len = data.len();
        let mut entry = Entry {
            tier,
            len,
            data: None,
            file: None,
        };
        match tier {
            Tier::Device => self.usage.device_bytes += bytes,
            Tier::Host => self.usage.host_bytes += bytes,
            Tier::Disk => self.usage.disk_bytes += bytes,
        }
        if tier == Tier::Disk {
            let dir = self
                .config
                .as_ref()
                .map(|c| c.spill_dir.clone())
                .unwrap_or_default();
            fs::create_dir_all(&dir).map_err(|source| TierError::Io {
                path: dir.clone(),
                source,
            })?;
            let path = dir.join(format!("state-{}-{:06}.bin", self.store_id, self.next_file));
            self.next_file += 1;
            write_spill(&path, &data)?;
            entry.file = Some(path);
        } else {
            entry.data = Some(data);
        }
        self.entries.insert(key.to_owned(), entry);
        Ok(())
    }

    /// Starts reading a spilled tensor on the I/O thread so that the next [`TieredStore::take`]
    /// of `key` finds it in memory. Does nothing for resident tensors. The read goes through the
    /// same length and checksum checks; a corrupt file is reported by that `take`.
    pub fn prefetch(&mut self, key: &str) {
        let Some(e) = self.entries.get(key) else {
            return;
        };
        let Some(path) = &e.file else { return };
        if self.prefetched.contains_key(key) {
            return;
        }
        let pool = self.io.get_or_insert_with(|| WorkerPool::new(1));
        let job = (path.clone(), e.len);
        self.prefetched
            .insert(key.to_owned(), Inflight::submit(pool, 0, job, read_job));
    }

    /// Forgets `key` (deleting its spill file).
    pub fn remove(&mut self, key: &str) -> Result<(), TierError> {
        self.prefetched.remove(key);
        if let Some(e) = self.entries.remove(key) {
            let bytes = 4 * e.len as u64;
            match e.tier {
                Tier::Device => self.usage.device_bytes -= bytes,
                Tier::Host => self.usage.host_bytes -= bytes,
                Tier::Disk => self.usage.disk_bytes -= bytes,
            }
            if let Some(path) = e.file {
                fs::remove_file(&path).map_err(|source| TierError::Io { path, source })?;
            }
        }
        Ok(())
    }

    /// Moves a tensor out for an update (reading and verifying it if it is on disk). Give it
    /// back with [`TieredStore::put`].
    pub fn take(&mut self, key: &str) -> Result<Vec<f32>, TierError> {
        let e = self
            .entries
            .get_mut(key)
            .ok_or_else(|| TierError::Missing(key.to_owned()))?;
        match &e.file {
            // A prefetched read was started after the file's last write (every write drops
            // the key's prefetch), so its bytes are current.
            Some(path) => match self.prefetched.remove(key) {
                Some(read) => read.wait().0,
                None => read_spill(path, e.len),
            },
            // Resident: move it out; a second `take` before `put` is an error, not an empty
            // tensor.
            None => e
                .data
                .take()
                .ok_or_else(|| TierError::Missing(key.to_owned())),
        }
    }

    /// A copy of a tensor, leaving it in place.
    pub fn read(&self, key: &str) -> Result<Vec<f32>, TierError> {
        let e = self
            .entries
            .get(key)
            .ok_or_else(|| TierError::Missing(key.to_owned()))?;
        match (&e.data, &e.file) {
            (Some(d), _) => Ok(d.clone()),
            (None, Some(path)) => read_spill(path, e.len),
            (None, None) => Err(TierError::Missing(key.to_owned())),
        }
    }

    /// Stores a tensor back in its tier (writing it atomically if it is on disk).
    pub fn put(&mut self, key: &str, data: Vec<f32>) -> Result<(), TierError> {
        let e = self
            .entries
            .get_mut(key)
            .ok_or_else(|| TierError::Missing(key.to_owned()))?;
        if data.len() != e.len {
            return Err(TierError::Corrupt {
                path: PathBuf::from(key),
                reason: format!("tensor changed length from {} to {}", e.len, data.len()),
            });
        }
        match &e.file {
            Some(path) => {
                self.prefetched.remove(key);
                write_spill(path, &data)
            }
            None => {
                e.data = Some(data);
                Ok(())
            }
        }
    }

    /// Gives back a tensor that was taken but not modified: resident tensors move back in, a
    /// spilled one is not rewritten (its file already holds exactly these values).
    pub fn put_unchanged(&mut self, key: &str, data: Vec<f32>) -> Result<(), TierError> {
        match self.entries.get(key) {
            Some(e) if e.file.is_some() && data.len() == e.len => Ok(()),
            _ => self.put(key, data),
        }
    }

    /// The spill file of `key`, if it lives on disk (for tests and diagnostics).
    pub fn spill_path(&self, key: &str) -> Option<&Path> {
        self.entries.get(key).and_then(|e| e.file.as_deref())
    }
}

impl Drop for TieredStore {
    fn drop(&mut self) {
        // Spill files are scratch space, not checkpoints: remove them. Failures are ignored
        // because there is nobody to report them to and a leftover file is harmless.
        for e in self.entries.values() {
            if let Some(p) = &e.file {
                let _ = fs::remove_file(p);
            }
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TierError + '_ {
    move |source| TierError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Atomic write: temp file in the same folder, fsync, rename over the target.
pub(crate) fn write_spill(path: &Path, data: &[f32]) -> Result<(), TierError> {
    let mut buf = Vec::with_capacity(20 + 4 * data.len());
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(data.len() as u64).to_le_bytes());
    for x in data {
        buf.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    let crc = crc32fast::hash(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&buf).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

/// Reads and verifies a spill file holding `len` elements.
pub(crate) fn read_spill(path: &Path, len: usize) -> Result<Vec<f32>, TierError> {
    let bytes = fs::read(path).map_err(io(path))?;
    let corrupt = |reason: String| TierError::Corrupt {
        path: path.to_owned(),
        reason,
    };
    let want = 20 + 4 * len;
    if bytes.len() != want {
        return Err(corrupt(format!("{} bytes, expected {want}", bytes.len())));
    }
    if &bytes[..8] != MAGIC {
        return Err(corrupt("bad magic".into()));
    }
    let (body, trailer) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    let actual = crc32fast::hash(body);
    if stored != actual {
        return Err(corrupt(format!(
            "checksum {actual:08x} does not match stored {stored:08x}"
        )));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&body[8..16]);
    if u64::from_le_bytes(n) != len as u64 {
        return Err(corrupt(format!(
            "header says {} elements, expected {len}",
            u64::from_le_bytes(n)
        )));
    }
    Ok(body[16..]
        .chunks_exact(4)
        .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("orrery-optim-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn placement_follows_access_and_budgets() {
        let dir = tmpdir("place");
        let cfg = TierConfig {
            device_budget: 16,
            host_budget: 16,
            spill_dir: dir.clone(),
        };
        let mut s = TieredStore::new(Some(cfg));
        s.insert("a", vec![1.0; 4], Access::Hot).unwrap(); // 16 B -> device
        s.insert("b", vec![2.0; 4], Access::Warm).unwrap(); // host
        s.insert("c", vec![3.0; 4], Access::Hot).unwrap(); // both full -> disk
        assert_eq!(s.tier_of("a"), Some(Tier::Device));
        assert_eq!(s.tier_of("b"), Some(Tier::Host));
        assert_eq!(s.tier_of("c"), Some(Tier::Disk));
        assert_eq!(
            s.usage(),
            TierUsage {
                device_bytes: 16,
                host_bytes: 16,
                disk_bytes: 16
            }
        );
        let c = s.take("c").unwrap();
        assert_eq!(c, vec![3.0; 4]);
        s.put("c", vec![4.0; 4]).unwrap();
        assert_eq!(s.read("c").unwrap(), vec![4.0; 4]);
        drop(s);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn prefetch_returns_current_data_and_checks_it() {
        let dir = tmpdir("prefetch");
        let cfg = TierConfig {
            device_budget: 0,
            host_budget: 0,
            spill_dir: dir.clone(),
        };
        let mut s = TieredStore::new(Some(cfg));
        s.insert("a", vec![1.0, 2.0], Access::Hot).unwrap();
        s.prefetch("a");
        assert_eq!(s.take("a").unwrap(), vec![1.0, 2.0]);
        s.prefetch("a");
        s.put("a", vec![3.0, 4.0]).unwrap(); // drops the now stale prefetch
        assert_eq!(s.take("a").unwrap(), vec![3.0, 4.0]);
        s.put_unchanged("a", vec![3.0, 4.0]).unwrap();
        let path = s.spill_path("a").unwrap().to_owned();
        let mut bytes = fs::read(&path).unwrap();
        bytes[16] ^= 0x80;
        fs::write(&path, &bytes).unwrap();
        s.prefetch("a");
        assert!(matches!(s.take("a"), Err(TierError::Corrupt { .. })));
        drop(s);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn corrupted_spill_file_is_reported() {
        let dir = tmpdir("corrupt");
        let cfg = TierConfig {
            device_budget: 0,
            host_budget: 0,
            spill_dir: dir.clone(),
        };
        let mut s = TieredStore::new(Some(cfg));
        s.insert("x", vec![1.5, -2.5, 3.25], Access::Hot).unwrap();
        let path = s.spill_path("x").unwrap().to_owned();
        let mut bytes = fs::read(&path).unwrap();
        bytes[18] ^= 0x40; // flip a bit of the data
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(s.take("x"), Err(TierError::Corrupt { .. })));
        fs::write(&path, &bytes[..bytes.len() - 3]).unwrap(); // truncated
        let e = s.read("x").unwrap_err();
        assert!(e.to_string().contains("expected"), "{e}");
        drop(s);
        let _ = fs::remove_dir_all(&dir);
    }
}
