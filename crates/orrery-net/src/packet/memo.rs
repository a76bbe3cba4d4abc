//! Memoization of isolated episodes (issue 4, mechanism 3).
//!
//! Training traffic repeats itself: the all-to-all of every MoE layer, the activation send
//! of every micro-batch, every bucket of the same size. When the same group of flows
//! starts on an idle part of the network, the packet-level simulation plays out the same
//! way each time, so its outcome can be looked up instead of simulated.
//!
//! ## The unit: an isolated episode
//!
//! An *episode* is a group of flows released at the same instant onto links that nothing
//! else uses (no active, draining or memoized flow), connected through the links they share
//! (data and reverse paths), and followed until its last flow finishes. While the episode
//! runs no other flow may touch its links; if one does, the episode was not isolated after
//! all (an *intrusion*, below). Flows released in the same picosecond are gathered first: a
//! release onto idle links is deferred to a decision event at the same time, after every
//! other release of that instant, which groups the deferred flows into connected groups and
//! drops any group that a non-deferred flow touches.
//!
//! ## The key: a certificate of the group
//!
//! The issue asks for the flow-conflict graph (flows as vertices, an edge for each pair
//! sharing links, weighted by how many) in a canonical form, plus a hash of what the graph
//! does not capture. The key here is a *certificate*: the flows are ordered by a
//! Weisfeiler-Lehman colour refinement of the conflict graph (initial colours from each
//! flow's size and the speed, delay and kind of every hop of both its paths; two rounds of
//! refinement over weighted neighbours), ties broken by release order; then links and nodes
//! are renamed in order of first appearance along the ordered flows' paths, and the
//! certificate lists every flow's size and renamed paths, every renamed link's endpoints,
//! speed, delay and PFC headroom, every renamed switch's free-buffer bucket (sixteenths of
//! its shared pool in use by others), and a hash of the whole [`PacketConfig`]. The
//! certificate describes the group completely, so two groups with equal certificates are
//! isomorphic, and the isomorphism is "k-th flow to k-th flow": a hit is never wrong about
//! the structure. (Equal certificates are compared in full, not just by hash.) Two
//! isomorphic groups released in a different order can get different certificates: that
//! costs a miss, never a wrong answer. Canonical forms that are complete for every graph
//! need individualisation-refinement search; training traffic repeats in the same order,
//! so this is not worth it here.
//!
//! ## What is stored and how a hit is applied
//!
//! A simulated episode that ends without intrusion stores, per flow in certificate order,
//! its completion time relative to the episode's start, and an estimate of the events it
//! took. A hit never puts the flows' packets on the wire: each flow is scheduled to finish
//! at its stored offset, its bytes are added to the report (sent, delivered and every link
//! of its data path, and its ACK count) when it finishes, and its finish releases its
//! dependents as usual. ECN marks, CNPs and PFC frames of a memoized episode are not
//! counted (as with fast-forward jumps). The links stay reserved until the episode's last
//! flow finishes, so no other episode starts on them meanwhile.
//!
//! A hit is declined when a flow that depends only on the group would, by the stored
//! completion times, be released onto the group's links before the episode ends (an
//! intrusion the group itself causes, such as the next step of a ring).
//!
//! ## Intrusions
//!
//! - While an episode is being *recorded* (simulated), a release touching its links marks it
//!   intruded and it is not stored.
//! - While an episode is *memoized* (a hit), a release touching its links aborts the hit:
//!   each of its unfinished flows is re-materialised as a real queue pair at the progress
//!   the stored completion time implies, assuming it progressed linearly (an
//!   approximation: its queues start empty and its DCQCN state at line rate). The abort is
//!   counted in [`super::PacketStats::memo_aborts`] so a report says when this happened.
//!
//! ## The cache
//!
//! [`MemoCache`] lives across runs when the caller keeps one (the `orrery netsim --memo-cache`
//! file, or one [`super::PacketSimulator`] reused for every collective of a prediction). Its
//! file is versioned and checksummed (magic, version, length, CRC32) and written
//! atomically; a corrupt or foreign file is reported and ignored, never trusted.

use super::config::PacketConfig;
use super::engine::{Engine, Ev};
use orrery_des::{EventKey, EventQueue};
use orrery_units::Picos;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

const NONE: u32 = u32::MAX;
/// Certificate format; bump when its layout or the meaning of a stored result changes.
const CERT_VERSION: u64 = 1;
const FILE_MAGIC: &[u8; 8] = b"ORRYMEMO";
const FILE_VERSION: u32 = 1;

/// One stored episode.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    cert: Vec<u64>,
    /// Completion time of each flow, in certificate order, relative to the episode start.
    finish: Vec<u64>,
    /// Estimated events the episode took when simulated.
    events: u64,
}

/// Stored episodes, keyed by a hash of their certificate (compared in full on lookup).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoCache {
    map: BTreeMap<u64, Vec<Entry>>,
    len: usize,
}

/// Why a cache file could not be read or written.
#[derive(Debug, Error)]
pub enum MemoFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not an orrery memo cache (bad magic)")]
    BadMagic,
    #[error("memo cache version {found}, this build reads version {FILE_VERSION}")]
    Version { found: u32 },
    #[error("memo cache is truncated or has trailing bytes (header says {expected} body bytes, found {found})")]
    Length { expected: u64, found: u64 },
    #[error("memo cache checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("memo cache body is malformed: {0}")]
    Malformed(&'static str),
}

impl MemoCache {
    pub fn new() -> MemoCache {
        MemoCache::default()
    }

    /// Stored episodes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn lookup(&self, cert: &[u64]) -> Option<&Entry> {
        self.map
            .get(&hash_words(cert))?
            .iter()
            .find(|e| e.cert == cert)
    }

    fn insert(&mut self, e: Entry) {
        let bucket = self.map.entry(hash_words(&e.cert)).or_default();
        if bucket.iter().all(|x| x.cert != e.cert) {
            bucket.push(e);
            self.len += 1;
        }
    }

    /// The file image: magic, version, body length, CRC32 of the body, body. Deterministic
    /// (entries in key order).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut body = Vec::new();
        put(&mut body, self.len as u64);
        for e in self.map.values().flatten() {
            put(&mut body, e.cert.len() as u64);
            e.cert.iter().for_each(|&w| put(&mut body, w));
            put(&mut body, e.finish.len() as u64);
            e.finish.iter().for_each(|&w| put(&mut body, w));
            put(&mut body, e.events);
        }
        let mut out = Vec::with_capacity(body.len() + 24);
        out.extend_from_slice(FILE_MAGIC);
        out.extend_from_slice(&FILE_VERSION.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Parses a file image, checking magic, version, length and checksum.
    pub fn from_bytes(bytes: &[u8]) -> Result<MemoCache, MemoFileError> {
        if bytes.len() < 8 || &bytes[..8] != FILE_MAGIC {
            return Err(MemoFileError::BadMagic);
        }
        let header = bytes.get(8..24).ok_or(MemoFileError::Length {
            expected: 0,
            found: 0,
        })?;
        let version = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        if version != FILE_VERSION {
            return Err(MemoFileError::Version { found: version });
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&header[4..12]);
        let expected = u64::from_le_bytes(len);
        let stored = u32::from_le_bytes([header[12], header[13], header[14], header[15]]);
        let body = &bytes[24..];
        if body.len() as u64 != expected {
            return Err(MemoFileError::Length {
                expected,
                found: body.len() as u64,
            });
        }
        let computed = crc32fast::hash(body);
        if computed != stored {
            return Err(MemoFileError::Checksum { stored, computed });
        }
        let mut r = Reader { b: body, at: 0 };
        let n = r.word()?;
        let mut cache = MemoCache::new();
        for _ in 0..n {
            let cert = r.words()?;
            let finish = r.words()?;
            let events = r.word()?;
            cache.insert(Entry {
                cert,
                finish,
                events,
            });
        }
        if r.at != body.len() {
            return Err(MemoFileError::Malformed("bytes after the last entry"));
        }
        if cache.len as u64 != n {
            return Err(MemoFileError::Malformed("duplicate entries"));
        }
        Ok(cache)
    }

    /// Reads a cache file.
    pub fn load(path: &Path) -> Result<MemoCache, MemoFileError> {
        let bytes = std::fs::read(path).map_err(|source| MemoFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        MemoCache::from_bytes(&bytes)
    }

    /// Writes the cache atomically: a temporary file beside `path`, synced, then renamed.
    pub fn save(&self, path: &Path) -> Result<(), MemoFileError> {
        use std::io::Write;
        let io = |source| MemoFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&self.to_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io)
    }
}

fn put(out: &mut Vec<u8>, w: u64) {
    out.extend_from_slice(&w.to_le_bytes());
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn word(&mut self) -> Result<u64, MemoFileError> {
        let s = self
            .b
            .get(self.at..self.at + 8)
            .ok_or(MemoFileError::Malformed("entry runs past the end"))?;
        self.at += 8;
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        Ok(u64::from_le_bytes(w))
    }

    fn words(&mut self) -> Result<Vec<u64>, MemoFileError> {
        let n = self.word()?;
        if n > ((self.b.len() - self.at) / 8) as u64 {
            return Err(MemoFileError::Malformed("length runs past the end"));
        }
        (0..n).map(|_| self.word()).collect()
    }
}

/// FNV-1a over 64-bit words, then a final avalanche: a stable hash (it is written to files,
/// so it must not change between builds as `std`'s hasher may).
fn hash_words(words: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    mix(h)
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A stable hash of everything in the configuration (the `Debug` form lists every field,
/// floats included, and is stable for a given build of the config types; the certificate
/// version is bumped when they change).
pub(super) fn config_hash(cfg: &PacketConfig) -> u64 {
    let text = format!("{cfg:?}");
    let words: Vec<u64> = text.bytes().map(u64::from).collect();
    hash_words(&words)
}

/// The cache an engine uses: the caller's, or one of its own for the run.
#[derive(Debug)]
pub(super) enum CacheRef<'a> {
    Own(MemoCache),
    Shared(&'a mut MemoCache),
}

impl CacheRef<'_> {
    fn get(&self) -> &MemoCache {
        match self {
            CacheRef::Own(c) => c,
            CacheRef::Shared(c) => c,
        }
    }

    fn get_mut(&mut self) -> &mut MemoCache {
        match self {
            CacheRef::Own(c) => c,
            CacheRef::Shared(c) => c,
        }
    }
}

/// One episode of a run: recorded (simulated) or memoized (a hit).
#[derive(Debug)]
struct Episode {
    hit: bool,
    /// Global start time.
    start: Picos,
    /// Flows in certificate order.
    flows: Vec<u32>,
    cert: Vec<u64>,
    /// Flows not finished yet.
    left: u32,
    intruded: bool,
    /// Estimated events per packet of a hit (to credit skipped events as flows finish).
    events_per_packet: f64,
}

/// Per-run memoization state (`accel.memoize` only).
#[derive(Debug)]
pub(super) struct Memo<'a> {
    cache: CacheRef<'a>,
    cfg_hash: u64,
    /// Flows (active, draining, deferred or memoized) using each link, both directions.
    users: Vec<u32>,
    /// Deferred flows using each link (a subset of `users`).
    deferred_users: Vec<u32>,
    /// The flow is not counted in `users` (not released yet, or finished and drained).
    idle: Vec<bool>,
    /// Flows released onto idle links at this instant, awaiting the decision event.
    deferred: Vec<u32>,
    decide_pending: bool,
    /// The live episode using each link, or `NONE`.
    link_episode: Vec<u32>,
    flow_episode: Vec<u32>,
    episodes: Vec<Episode>,
    /// Each memoized flow's pending finish event (local time, key).
    pub finish_at: Vec<Option<(Picos, EventKey)>>,
    /// Memoized flows not finished yet (to skip scans when zero).
    pub owned: usize,
    /// Scratch: per-link marks, reset after each use.
    link_mark: Vec<u32>,
}

impl<'a> Memo<'a> {
    pub fn new(
        cfg: &PacketConfig,
        flows: usize,
        links: usize,
        cache: Option<&'a mut MemoCache>,
    ) -> Memo<'a> {
        Memo {
            cache: match cache {
                Some(c) => CacheRef::Shared(c),
                None => CacheRef::Own(MemoCache::new()),
            },
            cfg_hash: config_hash(cfg),
            users: vec![0; links],
            deferred_users: vec![0; links],
            idle: vec![true; flows],
            deferred: Vec::new(),
            decide_pending: false,
            link_episode: vec![NONE; links],
            flow_episode: vec![NONE; flows],
            episodes: Vec::new(),
            finish_at: vec![None; flows],
            owned: 0,
            link_mark: vec![NONE; links],
        }
    }
}

impl Engine<'_> {
    /// The links of flow `f` (data path, then reverse path).
    fn links_of(&self, f: u32) -> Vec<u32> {
        let fl = &self.flows[f as usize];
        let (a, b) = (fl.fwd, fl.rev);
        (a.0..a.0 + a.1)
            .chain(b.0..b.0 + b.1)
            .map(|h| self.paths[h as usize])
            .collect()
    }

    /// A flow with packets is released. Returns true if it was deferred to the decision
    /// event (its links are idle); otherwise the caller starts it now. Either way the
    /// release is checked against live episodes on its links.
    pub(super) fn memo_on_release(&mut self, f: u32) -> bool {
        let links = self.links_of(f);
        let Some(m) = self.memo.as_mut() else {
            return false;
        };
        let mut abort = Vec::new();
        for &l in &links {
            let id = m.link_episode[l as usize];
            if id == NONE {
                continue;
            }
            let ep = &mut m.episodes[id as usize];
            if ep.hit {
                if !abort.contains(&id) {
                    abort.push(id);
                }
            } else {
                ep.intruded = true;
            }
        }
        let busy = links
            .iter()
            .any(|&l| m.users[l as usize] > m.deferred_users[l as usize]);
        for &l in &links {
            m.users[l as usize] += 1;
        }
        m.idle[f as usize] = false;
        let deferred = !busy;
        if deferred {
            for &l in &links {
                m.deferred_users[l as usize] += 1;
            }
            m.deferred.push(f);
            if !m.decide_pending {
                m.decide_pending = true;
                self.q.schedule(self.now, Ev::MemoDecide);
            }
        }
        for id in abort {
            self.memo_abort(id);
        }
        deferred
    }

    /// Flow `f` finished or lost a packet: when it is finished and drained it stops using
    /// its links.
    pub(super) fn memo_maybe_idle(&mut self, f: u32) {
        let done = self.flows[f as usize].finish.is_some() && self.live[f as usize] == 0;
        if !done || self.memo.as_ref().is_none_or(|m| m.idle[f as usize]) {
            return;
        }
        let links = self.links_of(f);
        if let Some(m) = self.memo.as_mut() {
            m.idle[f as usize] = true;
            for l in links {
                m.users[l as usize] -= 1;
            }
        }
    }

    /// The decision event: groups the flows deferred at this instant and, per group, starts
    /// it as a recorded episode, applies a stored one, or (if another flow touches it)
    /// starts it plainly.
    pub(super) fn memo_decide(&mut self) {
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        m.decide_pending = false;
        let deferred = std::mem::take(&mut m.deferred);
        // Group by shared links: each link remembers the first group that used it.
        let mut group_of: Vec<usize> = (0..deferred.len()).collect();
        let mut link_lists = Vec::with_capacity(deferred.len());
        for &f in &deferred {
            link_lists.push(self.links_of(f));
        }
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        for (i, links) in link_lists.iter().enumerate() {
            for &l in links {
                let owner = m.link_mark[l as usize];
                if owner == NONE {
                    m.link_mark[l as usize] = i as u32;
                } else {
                    let (a, b) = (root(&mut group_of, owner as usize), root(&mut group_of, i));
                    if a != b {
                        let (lo, hi) = (a.min(b), a.max(b));
                        group_of[hi] = lo;
                    }
                }
            }
        }
        let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for i in 0..deferred.len() {
            let r = root(&mut group_of, i);
            groups.entry(r).or_default().push(i);
        }
        // A group is clean if every user of its links is one of the deferred flows.
        let mut clean = Vec::with_capacity(groups.len());
        for members in groups.values() {
            let ok = members.iter().all(|&i| {
                link_lists[i]
                    .iter()
                    .all(|&l| m.users[l as usize] == m.deferred_users[l as usize])
            });
            clean.push(ok);
        }
        for links in &link_lists {
            for &l in links {
                m.link_mark[l as usize] = NONE;
                m.deferred_users[l as usize] -= 1;
            }
        }
        for (members, ok) in groups.values().zip(clean) {
            let flows: Vec<u32> = members.iter().map(|&i| deferred[i]).collect();
            if !ok {
                for &f in &flows {
                    self.start_qp(f);
                }
                continue;
            }
            self.memo_start_group(&flows);
        }
    }

    /// Starts an isolated group: from the cache if it is there and would not be intruded by
    /// its own dependents, else simulated and recorded.
    fn memo_start_group(&mut self, flows: &[u32]) {
        let (order, cert) = self.certificate(flows);
        self.stats.memo_lookups += 1;
        let hit = self.memo.as_ref().and_then(|m| {
            m.cache
                .get()
                .lookup(&cert)
                .filter(|e| e.finish.len() == order.len())
                .cloned()
        });
        if let Some(entry) = hit {
            if self.dependents_stay_clear(&order, &entry.finish) {
                self.memo_apply(order, cert, &entry);
                return;
            }
        }
        self.memo_begin_episode(order, cert, false, 0.0);
        for &f in flows {
            self.start_qp(f);
        }
    }

    /// Registers an episode over `order`'s links and returns its id.
    fn memo_begin_episode(
        &mut self,
        order: Vec<u32>,
        cert: Vec<u64>,
        hit: bool,
        events_per_packet: f64,
    ) -> u32 {
        let mut links = Vec::new();
        for &f in &order {
            links.extend(self.links_of(f));
        }
        let start = Picos(self.now.0 + self.offset.0);
        let Some(m) = self.memo.as_mut() else {
            return NONE;
        };
        let id = m.episodes.len() as u32;
        for &l in &links {
            m.link_episode[l as usize] = id;
        }
        for &f in &order {
            m.flow_episode[f as usize] = id;
        }
        m.episodes.push(Episode {
            hit,
            start,
            left: order.len() as u32,
            flows: order,
            cert,
            intruded: false,
            events_per_packet,
        });
        id
    }

    /// Whether every flow that waits only on the group and shares its links would be
    /// released after the group's last completion (by the stored completion times).
    fn dependents_stay_clear(&mut self, order: &[u32], finish: &[u64]) -> bool {
        let mut links = Vec::new();
        for &f in order {
            links.extend(self.links_of(f));
        }
        let Some(m) = self.memo.as_mut() else {
            return false;
        };
        for &l in &links {
            m.link_mark[l as usize] = 0;
        }
        let end = finish.iter().copied().max().unwrap_or(0);
        // Per dependent: in-group dependencies, and the latest of their completions.
        let mut touched: BTreeMap<u32, (u32, u64)> = BTreeMap::new();
        for (k, &f) in order.iter().enumerate() {
            let (a, b) = (
                self.dependents_at[f as usize] as usize,
                self.dependents_at[f as usize + 1] as usize,
            );
            for &d in &self.dependents[a..b] {
                let t = touched.entry(d).or_insert((0, 0));
                t.0 += 1;
                t.1 = t.1.max(finish[k]);
            }
        }
        let mut clear = true;
        for (&d, &(count, latest)) in &touched {
            let fl = &self.flows[d as usize];
            let only_group = count == fl.waiting;
            let release = latest.saturating_add(fl.delay.0);
            if only_group && release < end {
                let fwd = fl.fwd.0..fl.fwd.0 + fl.fwd.1;
                let rev = fl.rev.0..fl.rev.0 + fl.rev.1;
                if fwd
                    .chain(rev)
                    .any(|h| m.link_mark[self.paths[h as usize] as usize] != NONE)
                {
                    clear = false;
                }
            }
        }
        for &l in &links {
            m.link_mark[l as usize] = NONE;
        }
        clear
    }

    /// Applies a stored episode: every flow of `order` finishes at its stored offset
    /// without sending a packet.
    fn memo_apply(&mut self, order: Vec<u32>, cert: Vec<u64>, entry: &Entry) {
        let packets: u64 = order.iter().map(|&f| self.flows[f as usize].npkts).sum();
        let per_packet = entry.events as f64 / packets.max(1) as f64;
        let now = self.now;
        let id = self.memo_begin_episode(order.clone(), cert, true, per_packet);
        if id == NONE {
            return;
        }
        self.stats.memo_hits += 1;
        for (k, &f) in order.iter().enumerate() {
            let at = Picos(now.0.saturating_add(entry.finish[k]));
            let key = self.q.schedule(at, Ev::MemoFinish(f));
            if let Some(m) = self.memo.as_mut() {
                m.finish_at[f as usize] = Some((at, key));
                m.owned += 1;
            }
        }
    }

    /// A memoized flow reaches its stored completion: account its bytes and finish it.
    pub(super) fn memo_finish(&mut self, f: u32) {
        let per_packet = match self.memo.as_mut() {
            Some(m) => {
                m.finish_at[f as usize] = None;
                m.owned -= 1;
                let id = m.flow_episode[f as usize];
                m.episodes
                    .get(id as usize)
                    .map_or(0.0, |e| e.events_per_packet)
            }
            None => return,
        };
        let (npkts, from) = {
            let fl = &self.flows[f as usize];
            (fl.npkts, fl.snd_nxt)
        };
        self.memo_credit(f, npkts - from);
        self.stats.memo_skipped_events += ((npkts - from) as f64 * per_packet).round() as u64;
        let fl = &mut self.flows[f as usize];
        fl.sender_done = true;
        self.finish_flow(f);
    }

    /// Moves flow `f` to packet `to` (from its current position) without simulating:
    /// sequence numbers, byte counters of the flow, the run and its data path, its ACKs.
    fn memo_credit(&mut self, f: u32, packets: u64) {
        let mtu = u64::from(self.cfg.mtu_payload);
        let ack_every = u64::from(self.cfg.ack_every).max(1);
        let fl = &mut self.flows[f as usize];
        if packets == 0 {
            return;
        }
        let to = fl.snd_nxt + packets;
        let bytes = if to == fl.npkts {
            (packets - 1) * mtu + u64::from(fl.last_payload)
        } else {
            packets * mtu
        };
        // ACKs every `ack_every` packets and always for the last one.
        let acks = to / ack_every - fl.snd_nxt / ack_every
            + u64::from(to == fl.npkts && to % ack_every != 0);
        fl.snd_nxt = to;
        fl.snd_una = to;
        fl.high = to;
        fl.rcv_nxt = to;
        fl.delivered += bytes;
        self.bytes_sent += bytes;
        self.bytes_delivered += bytes;
        self.stats.acks += acks;
        self.stats.memo_skipped_packets += packets;
        let (start, len) = fl.fwd;
        for h in start..start + len {
            self.link_bytes[self.paths[h as usize] as usize] += bytes;
        }
    }

    /// A release touched the links of memoized episode `id`: its unfinished flows become
    /// real queue pairs at the progress their stored completion implies (linear in time).
    fn memo_abort(&mut self, id: u32) {
        let now = self.now;
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        let Some(ep) = m.episodes.get_mut(id as usize) else {
            return;
        };
        ep.hit = false;
        ep.intruded = true;
        let start_local = Picos(ep.start.0.saturating_sub(self.offset.0));
        let per_packet = ep.events_per_packet;
        let flows = ep.flows.clone();
        self.stats.memo_aborts += 1;
        for f in flows {
            let Some(m) = self.memo.as_mut() else {
                return;
            };
            let Some((at, key)) = m.finish_at[f as usize].take() else {
                continue;
            };
            m.owned -= 1;
            self.q.cancel(key);
            let span = at.0.saturating_sub(start_local.0).max(1);
            let frac = now.0.saturating_sub(start_local.0) as f64 / span as f64;
            let npkts = self.flows[f as usize].npkts;
            let k = ((frac * npkts as f64).floor() as u64).min(npkts - 1);
            self.memo_credit(f, k);
            self.stats.memo_skipped_events += (k as f64 * per_packet).round() as u64;
            self.start_qp(f);
        }
    }

    /// Bookkeeping when flow `f` finishes: its episode may be complete (and stored).
    pub(super) fn memo_on_finish(&mut self, f: u32) {
        let per_packet = if self.data_packets > 0 {
            self.events as f64 / self.data_packets as f64
        } else {
            0.0
        };
        let mut store = None;
        if let Some(m) = self.memo.as_mut() {
            let id = m.flow_episode[f as usize];
            if let Some(ep) = m.episodes.get_mut(id as usize) {
                ep.left -= 1;
                if ep.left == 0 {
                    if !ep.hit && !ep.intruded {
                        store = Some(id);
                    } else {
                        ep.cert = Vec::new();
                    }
                }
            }
        }
        if let Some(id) = store {
            let mut links = Vec::new();
            let flows = self
                .memo
                .as_ref()
                .map(|m| m.episodes[id as usize].flows.clone())
                .unwrap_or_default();
            for &g in &flows {
                links.extend(self.links_of(g));
            }
            let packets: u64 = flows.iter().map(|&g| self.flows[g as usize].npkts).sum();
            let finish: Vec<u64> = flows
                .iter()
                .map(|&g| self.flows[g as usize].finish.unwrap_or(Picos::ZERO).0)
                .collect();
            if let Some(m) = self.memo.as_mut() {
                let ep = &mut m.episodes[id as usize];
                let start = ep.start.0;
                let cert = std::mem::take(&mut ep.cert);
                let finish = finish.iter().map(|t| t.saturating_sub(start)).collect();
                m.cache.get_mut().insert(Entry {
                    cert,
                    finish,
                    events: (packets as f64 * per_packet).round() as u64,
                });
                self.stats.memo_recorded += 1;
            }
        }
        // A completed episode no longer owns its links.
        if let Some(m) = self.memo.as_mut() {
            let id = m.flow_episode[f as usize];
            let done = m.episodes.get(id as usize).is_some_and(|e| e.left == 0);
            if done {
                let flows = m.episodes[id as usize].flows.clone();
                let mut links = Vec::new();
                for &g in &flows {
                    links.extend(self.links_of(g));
                }
                if let Some(m) = self.memo.as_mut() {
                    for l in links {
                        if m.link_episode[l as usize] == id {
                            m.link_episode[l as usize] = NONE;
                        }
                    }
                }
            }
        }
    }

    /// The certificate of a group of flows (see the module essay) and the flows in
    /// certificate order.
    fn certificate(&self, flows: &[u32]) -> (Vec<u32>, Vec<u64>) {
        let hop = |l: u32| {
            let p = &self.ports[l as usize];
            hash_words(&[
                p.bw.to_bits(),
                p.delay.0,
                u64::from(p.from_switch),
                u64::from(p.to_switch),
                p.headroom,
            ])
        };
        let n = flows.len();
        let links: Vec<Vec<u32>> = flows.iter().map(|&f| self.links_of(f)).collect();
        let mut colour: Vec<u64> = flows
            .iter()
            .zip(&links)
            .map(|(&f, ls)| {
                let fl = &self.flows[f as usize];
                let mut w = vec![fl.npkts, u64::from(fl.last_payload), u64::from(fl.fwd.1)];
                w.extend(ls.iter().map(|&l| hop(l)));
                hash_words(&w)
            })
            .collect();
        // Conflict graph: pairs sharing links, weighted by how many.
        let mut by_link: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, ls) in links.iter().enumerate() {
            for &l in ls {
                by_link.entry(l).or_default().push(i);
            }
        }
        let mut weight: BTreeMap<(usize, usize), u64> = BTreeMap::new();
        for users in by_link.values() {
            for (x, &a) in users.iter().enumerate() {
                for &b in &users[x + 1..] {
                    if a != b {
                        *weight.entry((a.min(b), a.max(b))).or_default() += 1;
                    }
                }
            }
        }
        let mut nbrs: Vec<Vec<(u64, usize)>> = vec![Vec::new(); n];
        for (&(a, b), &w) in &weight {
            nbrs[a].push((w, b));
            nbrs[b].push((w, a));
        }
        for _ in 0..2 {
            let next: Vec<u64> = (0..n)
                .map(|i| {
                    let mut ms: Vec<(u64, u64)> =
                        nbrs[i].iter().map(|&(w, j)| (w, colour[j])).collect();
                    ms.sort_unstable();
                    let mut w = vec![colour[i]];
                    w.extend(ms.iter().flat_map(|&(a, b)| [a, b]));
                    hash_words(&w)
                })
                .collect();
            colour = next;
        }
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by_key(|&i| (colour[i], i));
        let order: Vec<u32> = idx.iter().map(|&i| flows[i]).collect();
        // Rename links and nodes by first appearance.
        let mut link_name: BTreeMap<u32, u64> = BTreeMap::new();
        let mut node_name: BTreeMap<u32, u64> = BTreeMap::new();
        let mut cert = vec![CERT_VERSION, self.memo.as_ref().map_or(0, |m| m.cfg_hash)];
        cert.push(n as u64);
        let mut link_order = Vec::new();
        for &i in &idx {
            let fl = &self.flows[flows[i] as usize];
            cert.extend([fl.npkts, u64::from(fl.last_payload), u64::from(fl.fwd.1)]);
            cert.push(links[i].len() as u64);
            for &l in &links[i] {
                let next = link_name.len() as u64;
                let name = *link_name.entry(l).or_insert_with(|| {
                    link_order.push(l);
                    next
                });
                cert.push(name);
            }
        }
        cert.push(link_order.len() as u64);
        let mut node_order = Vec::new();
        for &l in &link_order {
            let p = &self.ports[l as usize];
            let mut name = |node: u32| {
                let next = node_name.len() as u64;
                *node_name.entry(node).or_insert_with(|| {
                    node_order.push(node);
                    next
                })
            };
            let (a, b) = (name(p.from), name(p.to));
            cert.extend([
                a,
                b,
                p.bw.to_bits(),
                p.delay.0,
                u64::from(p.from_switch),
                u64::from(p.to_switch),
                p.headroom,
            ]);
        }
        cert.push(node_order.len() as u64);
        for &node in &node_order {
            let b = &self.bufs[node as usize];
            let bucket = (b.shared_used.min(b.shared_cap) * 16)
                .checked_div(b.shared_cap)
                .unwrap_or(0);
            cert.push(bucket);
        }
        (order, cert)
    }
}

fn root(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> MemoCache {
        let mut c = MemoCache::new();
        c.insert(Entry {
            cert: vec![1, 2, 3],
            finish: vec![10, 20],
            events: 7,
        });
        c.insert(Entry {
            cert: vec![4, 5],
            finish: vec![30],
            events: 9,
        });
        c
    }

    #[test]
    fn the_file_image_round_trips() {
        let c = sample();
        let back = MemoCache::from_bytes(&c.to_bytes()).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.len(), 2);
        assert!(back.lookup(&[1, 2, 3]).is_some());
        assert!(back.lookup(&[1, 2]).is_none());
    }

    #[test]
    fn every_single_bit_flip_and_truncation_is_detected() {
        let bytes = sample().to_bytes();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(MemoCache::from_bytes(&b).is_err(), "flip at {i}:{bit}");
            }
        }
        for n in 0..bytes.len() {
            assert!(MemoCache::from_bytes(&bytes[..n]).is_err(), "cut at {n}");
        }
    }

    #[test]
    fn save_is_atomic_and_load_reports_corruption() {
        let dir = std::env::temp_dir().join(format!("orrery-memo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cache.bin");
        sample().save(&path).unwrap();
        assert!(!dir.join("cache.bin.tmp").exists());
        assert_eq!(MemoCache::load(&path).unwrap(), sample());
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let err = MemoCache::load(&path).unwrap_err();
        assert!(matches!(err, MemoFileError::Checksum { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
