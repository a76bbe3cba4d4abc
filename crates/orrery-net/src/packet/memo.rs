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
//! ## Joins
//!
//! An episode grows while it runs. A flow released onto links that are idle or the
//! episode's own *joins* it instead of intruding when
//! - every dependency is in the episode or finished before it started (a *dependent
//!   join*: the next step of a ring, released by the episode's own completions), or
//! - it has no dependency in the episode but its release was fixed before the episode
//!   started and it lands on the episode's links (a *timed join*: traffic the predictor
//!   released at a known time).
//!
//! A flow that waits for flows of the episode but belongs to another collective (the next
//! collective of a rank, released when its own part of the previous one ended) never
//! joins: on idle links it starts an episode of its own, and on the episode's links it
//! intrudes. Joining would chain a group's collectives into one episode for as long as any
//! of them runs, never the same twice and so never answered from the cache: on the GPT 13B
//! step at 64 GPUs with the traffic released after its dependencies, the gradient buckets
//! joined a pipeline send's episode one after another, and starting their own episodes
//! took the run from 7.15M to 2.98M events.
//!
//! A recorded episode stores its joins in order (kind, in-episode dependencies or release
//! offset, size, path as link names continuing the certificate's naming, and the
//! attributes of newly named links). A hit must map every stored join onto this run's
//! flows before it is taken: a dependent join onto the unreleased dependent of the mapped
//! flows with the same dependencies, delay, size and path; a timed join onto a flow whose
//! release is pending at the same offset on the mapped links. Joins of a hit finish at
//! their stored offsets when released. A hit is also declined when any other release
//! already scheduled lands on the episode's links before its end.
//!
//! When the flows released at one instant are grouped, a release scheduled within
//! `BRIDGE_HORIZON` (50 us) on their links connects the groups it touches, so groups that
//! such a flow will bridge are decided as one episode instead of spoiling each other.
//!
//! ## The key: a certificate of the group
//!
//! The issue asks for the flow-conflict graph (flows as vertices, an edge for each pair
//! sharing links, weighted by how many) in a canonical form, plus a hash of what the graph
//! does not capture. The key here is a *certificate*: the flows are ordered by a
//! Weisfeiler-Lehman colour refinement of the conflict graph (initial colours from each
//! flow's size, the speed, delay and kind of every hop of both its paths, and its place
//! among the group's flows on its NIC port in the order that port serves queue pairs
//! joining together, see `Engine::start_qp`; two rounds of refinement over weighted
//! neighbours), ties broken by release order; then links and nodes
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
//! - While an episode is *memoized* (a hit), a release touching its links aborts the hit,
//!   and the hit is *rolled back*: a fresh engine over the same ports replays the episode
//!   alone, its flows released at the times they were released here, from its start up to
//!   the intrusion, and each unfinished flow takes its replayed state (sender, receiver,
//!   DCQCN state and timers, packets in flight and queued, round-robin position; see the
//!   `image` module). The episode was isolated until the intrusion, so the replay is what
//!   the simulation would have done. Three things stay approximate: ECN's random draws
//!   (the replay has its own stream), the buffer bytes other traffic held in the switches
//!   the episode crossed (the replay takes those of the instant of the intrusion as a
//!   constant background), and the order among events of the intrusion's own instant (the
//!   replay stops just before it). A flow released at that very instant starts afresh;
//!   one the replay finished keeps its stored completion. Aborts are counted in
//!   [`super::PacketStats::memo_aborts`] and the replays' events in
//!   [`super::PacketStats::memo_replayed_events`] (and in the run's events, so speed-ups
//!   stay honest). Before replays, aborted flows resumed from linear progress with empty
//!   queues, which put two rings sharing their GPUs 31% off at p99 (`tests/accel.rs`).
//!
//! ## Mirrors (`accel.mirror`)
//!
//! Training traffic is also symmetric in space: the data-parallel rings of every pipeline
//! stage and tensor rank, the same activation send on every rail, start at the same instant
//! as isomorphic groups on disjoint links. The cache cannot help the first time (the
//! entry is only stored when the recording ends), so without more every copy would be
//! simulated. When a group released at this instant has the certificate of a group already
//! being recorded from this same instant, it becomes a *mirror* of that *leader*: none of
//! its packets is simulated, and each of its flows finishes exactly when the leader's flow
//! of the same certificate position finishes. Joins are mirrored too: the leader's join
//! is released first (equal events at equal times are processed in scheduling order, and
//! the leader's completions come first), and the mirror's matching flow is taken only if
//! its recorded words (in-episode dependencies, delay, size, path under the episode's
//! naming, new links' attributes) and its release time equal the leader's.
//!
//! A mirror is *broken* (simulated after all) when its groups stop being alike: a release
//! touches its links or its leader's, or one of them has a join the other has not by the
//! end of the instant (counted in `memo_mirror_breaks`). Until then the mirror was isolated
//! and isomorphic to its leader, so its true state is the leader's carried through the
//! isomorphism, and that is what it gets: this is the rollback of a mirror, exact rather
//! than estimated. Each unfinished flow takes its leader flow's sender, receiver and DCQCN
//! state; every pending event of the leader's flows and links (arrivals, port releases,
//! PFC frames, wake-ups, timers) is copied onto the mirror's, in scheduling order; packets
//! queued at the leader's ports are copied into the mirror's queues in order (data packets
//! re-enter their switch, which redoes buffer and PFC accounting); and each host port
//! serves its queue pairs in the leader port's round-robin order. The engine keeps its
//! ledger of pending events whenever mirrors are on, to find what to copy. Tests check
//! that mirrors broken by an intrusion on their leader finish exactly as in the reference.
//! Two things stay approximate: ECN marking draws come from one random stream, so where
//! marking is probabilistic a run that simulates fewer packets draws other numbers (as
//! with hits and jumps), and a switch buffer pool shared by a leader and its mirror held
//! only the leader's packets. When the mirror breaks, its copies enter that pool on top
//! of the leader's; each is admitted at the first switch it enters even past the ingress
//! headroom (which pauses the upstream) rather than dropped.
//!
//! ## The cache
//!
//! [`MemoCache`] lives across runs when the caller keeps one (the `orrery netsim --memo-cache`
//! file, or one [`super::PacketSimulator`] reused for every collective of a prediction). It
//! also holds the collectives the collective memo kept (see "Repeated collectives" in the
//! `periodic` module), keyed by shape with the configuration's hash folded in. Its file
//! is versioned and checksummed (magic, version, length, CRC32) and written atomically; a
//! corrupt or foreign file is reported and ignored, never trusted.

use super::config::PacketConfig;
use super::engine::{Engine, Ev};
use crate::flows::FlowSet;
use orrery_des::{EventKey, EventQueue};
use orrery_units::frame::{frame, unframe, FrameError};
use orrery_units::Picos;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

const NONE: u32 = u32::MAX;
/// Certificate format; bump when its layout or the meaning of a stored result changes.
const CERT_VERSION: u64 = 3;
const FILE_MAGIC: &[u8; 8] = b"ORRYMEMO";
/// Kinds of join in an entry's shape.
const JOIN_DEPENDENT: u64 = 0;
const JOIN_TIMED: u64 = 1;
/// How far ahead a scheduled release counts as bridging the groups released now (see
/// [`Engine::memo_decide`]): a few RTTs plus a DCQCN reaction, short next to the flows
/// worth memoizing.
const BRIDGE_HORIZON: Picos = Picos(50_000_000);
/// 3: kept collectives after the episodes.
const FILE_VERSION: u32 = 3;
/// Most shapes (sets of joins) kept per starting group. Every lookup verifies each shape
/// of its group, and a group whose joins differ from one run of it to the next gains a
/// shape per recording: on a 1,024-GPU GPT step one two-flow group had gathered 700 of
/// them, and verifying (and copying) them took 80% of the run. With 64, the GPT steps on
/// 128 GPUs take the same events as without a bound, and on 256 GPUs 2.3% more (88.6M
/// against 86.5M); with 8, 5% and 3% more. A group that keeps changing shape is
/// unlikely to repeat an old one, so the least recently used (stored or hit) make way.
const MAX_SHAPES: usize = 64;

/// One stored episode.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    cert: Vec<u64>,
    /// Completion time of each flow, in certificate order, relative to the episode start.
    finish: Vec<u64>,
    /// Estimated events the episode took when simulated.
    events: u64,
    /// The flows that joined after the start (see "Joins" in the module essay):
    /// `[n, (n_deps, deps.., delay, packets, last payload, n_links, link names..)*, m,
    /// (from node, to node, bandwidth bits, delay, from switch, to switch, headroom)*]`,
    /// the second list describing the links first named by a join.
    shape: Vec<u64>,
}

/// A collective kept by the collective memo (see "Repeated collectives" in the `periodic`
/// module): per flow, in flow order, its release after the collective's first release and
/// its completion time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KeptCollective {
    pub offsets: Vec<u64>,
    pub fcts: Vec<u64>,
}

/// Outcomes kept per collective shape, each for another pattern of release offsets from
/// outside the collective (a first bucket released at a time of its own, the later ones
/// after compute).
pub(super) const MAX_KEPT_PER_SHAPE: usize = 4;

/// Stored episodes, keyed by a hash of their certificate (compared in full on lookup), and
/// kept collectives, keyed by their shape with the configuration (see
/// `Memo::collective_key` in the `memo` module).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoCache {
    map: BTreeMap<u64, Vec<Arc<Entry>>>,
    len: usize,
    collectives: BTreeMap<u128, Vec<KeptCollective>>,
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
    #[error("memo cache header is truncated ({found} of 24 bytes)")]
    Header { found: u64 },
    #[error("memo cache version {found}, this build reads version {FILE_VERSION}")]
    Version { found: u32 },
    #[error("memo cache is truncated or has trailing bytes (header says {expected} body bytes, found {found})")]
    Length { expected: u64, found: u64 },
    #[error("memo cache checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("memo cache body is malformed: {0}")]
    Malformed(&'static str),
}

impl From<FrameError> for MemoFileError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::BadMagic => MemoFileError::BadMagic,
            FrameError::Truncated { found } => MemoFileError::Header { found },
            FrameError::Version { found } => MemoFileError::Version { found },
            FrameError::Length { expected, found } => MemoFileError::Length { expected, found },
            FrameError::Checksum { stored, computed } => {
                MemoFileError::Checksum { stored, computed }
            }
        }
    }
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
        self.len == 0 && self.collectives.is_empty()
    }

    /// Kept collectives (outcomes, over every shape).
    pub fn kept_collectives(&self) -> usize {
        self.collectives.values().map(Vec::len).sum()
    }

    /// The outcomes kept for collectives of `key`.
    pub(super) fn kept(&self, key: u128) -> &[KeptCollective] {
        self.collectives.get(&key).map_or(&[], |v| &v[..])
    }

    /// Keeps `outcome` for `key` unless [`MAX_KEPT_PER_SHAPE`] are kept or one of them is
    /// the `same` as it; returns whether it was kept.
    pub(super) fn keep(
        &mut self,
        key: u128,
        outcome: KeptCollective,
        same: impl Fn(&KeptCollective, &KeptCollective) -> bool,
    ) -> bool {
        let kept = self.collectives.entry(key).or_default();
        if kept.len() >= MAX_KEPT_PER_SHAPE || kept.iter().any(|k| same(k, &outcome)) {
            return false;
        }
        kept.push(outcome);
        true
    }

    /// Stored episodes that started with the group `cert` describes (they may differ in
    /// the flows that joined later).
    fn lookup<'s>(&'s self, cert: &'s [u64]) -> impl Iterator<Item = &'s Arc<Entry>> + 's {
        self.map
            .get(&hash_words(cert))
            .into_iter()
            .flatten()
            .filter(move |e| e.cert == cert)
    }

    /// Stores `e` unless an entry of the same group and shape is stored. A group keeps at
    /// most [`MAX_SHAPES`] shapes, the least recently stored or used making way (see
    /// [`MemoCache::touch`]).
    fn insert(&mut self, e: Entry) {
        let bucket = self.map.entry(hash_words(&e.cert)).or_default();
        if bucket
            .iter()
            .any(|x| x.cert == e.cert && x.shape == e.shape)
        {
            return;
        }
        if bucket.iter().filter(|x| x.cert == e.cert).count() >= MAX_SHAPES {
            if let Some(oldest) = bucket.iter().position(|x| x.cert == e.cert) {
                bucket.remove(oldest);
                self.len -= 1;
            }
        }
        bucket.push(Arc::new(e));
        self.len += 1;
    }

    /// Entry `e` was just used: it becomes its group's newest, the last to make way.
    fn touch(&mut self, e: &Arc<Entry>) {
        if let Some(bucket) = self.map.get_mut(&hash_words(&e.cert)) {
            if let Some(at) = bucket.iter().position(|x| Arc::ptr_eq(x, e)) {
                let used = bucket.remove(at);
                bucket.push(used);
            }
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
            put(&mut body, e.shape.len() as u64);
            e.shape.iter().for_each(|&w| put(&mut body, w));
        }
        put(&mut body, self.kept_collectives() as u64);
        for (&key, kept) in &self.collectives {
            for k in kept {
                put(&mut body, (key >> 64) as u64);
                put(&mut body, key as u64);
                put(&mut body, k.offsets.len() as u64);
                k.offsets.iter().for_each(|&w| put(&mut body, w));
                put(&mut body, k.fcts.len() as u64);
                k.fcts.iter().for_each(|&w| put(&mut body, w));
            }
        }
        frame(FILE_MAGIC, FILE_VERSION, &body)
    }

    /// Parses a file image, checking magic, version, length and checksum.
    pub fn from_bytes(bytes: &[u8]) -> Result<MemoCache, MemoFileError> {
        let body = unframe(bytes, FILE_MAGIC, FILE_VERSION)?;
        let mut r = Reader { b: body, at: 0 };
        let n = r.word()?;
        let mut cache = MemoCache::new();
        for _ in 0..n {
            let cert = r.words()?;
            let finish = r.words()?;
            let events = r.word()?;
            let shape = r.words()?;
            cache.insert(Entry {
                cert,
                finish,
                events,
                shape,
            });
        }
        if cache.len as u64 != n {
            return Err(MemoFileError::Malformed("duplicate entries"));
        }
        let kept = r.word()?;
        for _ in 0..kept {
            let key = (u128::from(r.word()?) << 64) | u128::from(r.word()?);
            let offsets = r.words()?;
            let fcts = r.words()?;
            if offsets.len() != fcts.len() {
                return Err(MemoFileError::Malformed(
                    "a kept collective's offsets and times differ in length",
                ));
            }
            let outcome = KeptCollective { offsets, fcts };
            if !cache.keep(key, outcome, |k, new| k == new) {
                return Err(MemoFileError::Malformed(
                    "a kept collective repeated, or too many for its shape",
                ));
            }
        }
        if r.at != body.len() {
            return Err(MemoFileError::Malformed("bytes after the last entry"));
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
    /// A path naming something that is not a regular file (`/dev/null`, a FIFO) is written
    /// in place: renaming over it would put a file where the device was.
    pub fn save(&self, path: &Path) -> Result<(), MemoFileError> {
        use std::io::Write;
        let io = |source| MemoFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
            let mut f = std::fs::File::create(path).map_err(io)?;
            return f.write_all(&self.to_bytes()).map_err(io);
        }
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
pub(super) fn hash_words(words: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    mix(h)
}

pub(super) fn mix(mut x: u64) -> u64 {
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
    /// Flows of the initial group (the rest of `flows` joined later).
    initial: usize,
    /// A hit: the stored completion offsets, by index in `flows`.
    finish: Vec<u64>,
    /// Recording: names of the links and nodes seen so far, the joins and the new links'
    /// attributes, encoded as in [`Entry::shape`].
    link_names: HashMap<u32, u64>,
    node_names: HashMap<u32, u64>,
    joins: Vec<u64>,
    new_links: Vec<u64>,
    /// Where each join's words start in `joins` and its link records in `new_links`, so
    /// a mirror can compare its own joins.
    join_at: Vec<(usize, usize)>,
    /// A live mirror: the recording episode it mirrors (`NONE` otherwise).
    leader: u32,
    /// Whether the episode started as a mirror (its skipped events are estimated at the
    /// run's events per packet, as it never had a recording of its own).
    mirror: bool,
    /// A recording episode's live mirrors.
    followers: Vec<u32>,
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
    /// Each flow's dependencies (CSR), and its index in its episode's flows.
    deps_at: Vec<u32>,
    deps: Vec<u32>,
    /// Each flow's collective (index into the flow set's collectives).
    collective: Vec<u32>,
    index: Vec<u32>,
    /// The flows whose release is scheduled, per link they will use (short lists: a flow
    /// is in them from the scheduling of its release to the release).
    pending_on: Vec<Vec<u32>>,
    /// `accel.mirror`.
    mirror_on: bool,
    /// Joins of leaders (episode, index in its flows) whose mirrors must have matched
    /// them by the decision event of this instant.
    mirror_checks: Vec<(u32, usize)>,
}

impl<'a> Memo<'a> {
    /// The cache this run reads and writes.
    pub(super) fn cache(&self) -> &MemoCache {
        self.cache.get()
    }

    pub(super) fn cache_mut(&mut self) -> &mut MemoCache {
        self.cache.get_mut()
    }

    /// The cache key of a collective of shape `shape` (see "Repeated collectives" in the
    /// `periodic` module) in this run: the shape with the configuration's hash (and the
    /// symmetry quotient's buffer copies) folded in, as an episode's certificate has it.
    pub(super) fn collective_key(&self, shape: u128) -> u128 {
        let hi = mix((shape >> 64) as u64 ^ self.cfg_hash);
        let lo = mix(shape as u64 ^ self.cfg_hash.rotate_left(32));
        (u128::from(hi) << 64) | u128::from(lo)
    }

    /// Sets apart this run's episodes from those of runs whose switches stand for other
    /// numbers of copies (a symmetry quotient's fixed switches count each byte `copies`
    /// times, so the same flows fill their pools differently): `copies` enters the
    /// configuration hash every certificate starts with. All ones changes nothing.
    pub fn set_buffer_copies(&mut self, copies: &[u64]) {
        if copies.iter().any(|&c| c != 1) {
            let mut words = vec![self.cfg_hash];
            words.extend_from_slice(copies);
            self.cfg_hash = hash_words(&words);
        }
    }

    pub fn new(
        cfg: &PacketConfig,
        set: &FlowSet,
        links: usize,
        cache: Option<&'a mut MemoCache>,
    ) -> Memo<'a> {
        let flows = set.flows.len();
        let mut deps_at = Vec::with_capacity(flows + 1);
        let mut deps = Vec::new();
        deps_at.push(0);
        for f in &set.flows {
            deps.extend(f.deps.iter().map(|d| d.0));
            deps_at.push(deps.len() as u32);
        }
        Memo {
            deps_at,
            deps,
            collective: set.flows.iter().map(|f| f.collective).collect(),
            index: vec![NONE; flows],
            pending_on: vec![Vec::new(); links],
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
            mirror_on: cfg.accel.mirror,
            mirror_checks: Vec::new(),
        }
    }
}

impl Memo<'_> {
    /// Flow `f`'s release was scheduled (`on`) or has happened (`!on`).
    pub fn note_pending(&mut self, f: u32, links: impl Iterator<Item = u32>, on: bool) {
        for l in links {
            let list = &mut self.pending_on[l as usize];
            if on {
                list.push(f);
            } else if let Some(i) = list.iter().position(|&x| x == f) {
                list.swap_remove(i);
            }
        }
    }

    /// Flow `f`, released now and not simulated, uses `links` until it finishes.
    pub(super) fn take_links(&mut self, f: u32, links: &[u32]) {
        for &l in links {
            self.users[l as usize] += 1;
        }
        self.idle[f as usize] = false;
    }

    /// Whether flow `f` uses no link (not released yet, or finished and drained).
    pub(super) fn is_idle(&self, f: u32) -> bool {
        self.idle[f as usize]
    }

    /// Flows using link `l` (active, draining, deferred or memoized).
    pub(super) fn users_of(&self, l: u32) -> u32 {
        self.users[l as usize]
    }

    fn deps_of(&self, f: u32) -> &[u32] {
        &self.deps[self.deps_at[f as usize] as usize..self.deps_at[f as usize + 1] as usize]
    }
}

impl Engine<'_> {
    /// The links of flow `f` (data path, then reverse path), collected.
    fn links_of(&self, f: u32) -> Vec<u32> {
        self.flow_links(f).collect()
    }

    /// A flow with packets is released. Returns true if it was deferred to the decision
    /// event (its links are idle) or is an expected join of a memoized episode; otherwise
    /// the caller starts it now. A join of a recording episode is recorded; any other
    /// release is checked against live episodes on its links.
    pub(super) fn memo_on_release(&mut self, f: u32) -> bool {
        if self.periodic_on_release(f) {
            return true; // virtual: its collective is periodic
        }
        let links = self.links_of(f);
        if let Some(target) = self.memo_join_target(f, &links) {
            if let Some(m) = self.memo.as_mut() {
                for &l in &links {
                    m.users[l as usize] += 1;
                }
                m.idle[f as usize] = false;
            }
            return match target {
                JoinTarget::Memoized(id) => {
                    self.memo_own_join(id, f);
                    true
                }
                JoinTarget::Recording(id) => {
                    self.memo_record_join(id, f, &links);
                    false
                }
                JoinTarget::Mirror(id) => self.memo_mirror_join(id, f, &links),
            };
        }
        let Some(m) = self.memo.as_mut() else {
            return false;
        };
        let mut abort = Vec::new();
        let mut led = Vec::new();
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
                if !ep.intruded && !ep.followers.is_empty() {
                    led.push(id);
                }
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
        for id in led {
            self.memo_break_followers(id);
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
        self.periodic_on_idle(f);
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
        let checks = std::mem::take(&mut m.mirror_checks);
        self.memo_check_mirrors(checks);
        // Group by shared links: each link remembers the first group that used it.
        let mut link_lists = Vec::with_capacity(deferred.len());
        for &f in &deferred {
            link_lists.push(self.links_of(f));
        }
        // Flows due soon on these links connect the groups they will bridge (one level),
        // so groups that a soon-arriving flow joins are decided, recorded and looked up
        // as one episode instead of spoiling each other.
        let mut connectors: Vec<Vec<u32>> = Vec::new();
        if let Some(m) = self.memo.as_ref() {
            let until = self.now.0.saturating_add(BRIDGE_HORIZON.0);
            let mut seen = HashSet::new();
            for links in &link_lists {
                for &l in links {
                    for &c in &m.pending_on[l as usize] {
                        let due = self.pending_rel[c as usize].is_some_and(|(t, _)| t.0 <= until);
                        if due && seen.insert(c) {
                            connectors.push(self.links_of(c));
                        }
                    }
                }
            }
        }
        let real = link_lists.len();
        link_lists.extend(connectors);
        let mut group_of: Vec<usize> = (0..link_lists.len()).collect();
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
        for i in 0..real {
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
        for (i, links) in link_lists.iter().enumerate() {
            for &l in links {
                m.link_mark[l as usize] = NONE;
                if i < real {
                    m.deferred_users[l as usize] -= 1;
                }
            }
        }
        let mut leaders = Vec::new();
        for (members, ok) in groups.values().zip(clean) {
            let flows: Vec<u32> = members.iter().map(|&i| deferred[i]).collect();
            if !ok {
                for &f in &flows {
                    self.start_qp(f);
                }
                continue;
            }
            self.memo_start_group(&flows, &mut leaders);
        }
    }

    /// Starts an isolated group: from the cache if it is there and would not be intruded by
    /// its own dependents; else as a mirror of an isomorphic group recorded from this same
    /// instant (`leaders`: certificate and episode of each); else simulated and recorded.
    fn memo_start_group(&mut self, flows: &[u32], leaders: &mut Vec<(Vec<u64>, u32)>) {
        let (order, cert, link_order, node_order) = self.certificate(flows);
        self.stats.memo_lookups += 1;
        let entries: Vec<Arc<Entry>> = self
            .memo
            .as_ref()
            .map(|m| m.cache.get().lookup(&cert).cloned().collect())
            .unwrap_or_default();
        for entry in entries {
            let Some(joins) = self.memo_verify(&order, &link_order, &node_order, &entry) else {
                continue;
            };
            let mut all = order.clone();
            all.extend(joins);
            if all.len() != entry.finish.len() {
                continue;
            }
            let end = entry.finish.iter().copied().max().unwrap_or(0);
            if self.dependents_stay_clear(&all, &entry.finish) && self.pending_clear(&all, end) {
                if let Some(m) = self.memo.as_mut() {
                    m.cache.get_mut().touch(&entry);
                }
                self.memo_apply(all, order.len(), cert, &entry);
                return;
            }
            self.stats.memo_declined += 1;
        }
        let leader = self
            .memo
            .as_ref()
            .filter(|m| m.mirror_on)
            .and_then(|_| leaders.iter().find(|(c, _)| *c == cert))
            .map(|&(_, id)| id);
        let id = self.memo_begin_episode(order, cert.clone(), leader.is_some(), 0.0, 0);
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        if let Some(ep) = m.episodes.get_mut(id as usize) {
            ep.link_names = (0u64..).zip(&link_order).map(|(k, &l)| (l, k)).collect();
            ep.node_names = (0u64..).zip(&node_order).map(|(k, &n)| (n, k)).collect();
            if let Some(leader) = leader {
                ep.leader = leader;
                ep.mirror = true;
            }
        }
        if let Some(leader) = leader {
            if let Some(l) = m.episodes.get_mut(leader as usize) {
                l.followers.push(id);
            }
            self.stats.memo_mirrored += 1;
            return;
        }
        leaders.push((cert, id));
        for &f in flows {
            self.start_qp(f);
        }
    }

    /// Registers an episode over `flows` (the first `initial` released now, the rest
    /// expected to join; zero means all) and returns its id.
    fn memo_begin_episode(
        &mut self,
        flows: Vec<u32>,
        cert: Vec<u64>,
        hit: bool,
        events_per_packet: f64,
        initial: usize,
    ) -> u32 {
        let mut links = Vec::new();
        for &f in &flows {
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
        for (k, &f) in flows.iter().enumerate() {
            m.flow_episode[f as usize] = id;
            m.index[f as usize] = k as u32;
        }
        m.episodes.push(Episode {
            hit,
            start,
            left: flows.len() as u32,
            initial: if initial == 0 { flows.len() } else { initial },
            flows,
            cert,
            intruded: false,
            events_per_packet,
            finish: Vec::new(),
            link_names: HashMap::new(),
            node_names: HashMap::new(),
            joins: Vec::new(),
            new_links: Vec::new(),
            join_at: Vec::new(),
            leader: NONE,
            mirror: false,
            followers: Vec::new(),
        });
        id
    }

    /// Maps a stored episode's joins onto this run's flows, in recorded order: a
    /// dependent join to the not yet released dependent of the mapped flows with the same
    /// in-episode dependencies (all others finished) and delay; a timed join to a flow on
    /// an already named link whose release is pending at the same offset from now. Both
    /// must match in size and path (named links the same links, new names new links with
    /// the stored attributes). Returns the joining flows, or `None` if the entry does not
    /// fit this run.
    fn memo_verify(
        &self,
        order: &[u32],
        link_order: &[u32],
        node_order: &[u32],
        entry: &Entry,
    ) -> Option<Vec<u32>> {
        let m = self.memo.as_ref()?;
        let sh = &entry.shape;
        let mut at = 0usize;
        let mut next = || {
            let w = sh.get(at).copied();
            at += 1;
            w
        };
        let n_joins = next()? as usize;
        let mut joins = Vec::with_capacity(n_joins);
        for _ in 0..n_joins {
            let kind = next()?;
            let (deps, when) = match kind {
                JOIN_TIMED => (Vec::new(), next()?),
                JOIN_DEPENDENT => {
                    let nd = next()? as usize;
                    let deps: Vec<u64> = (0..nd).map(|_| next()).collect::<Option<_>>()?;
                    (deps, next()?)
                }
                _ => return None,
            };
            let (npkts, last) = (next()?, next()?);
            let nl = next()? as usize;
            let names: Vec<u64> = (0..nl).map(|_| next()).collect::<Option<_>>()?;
            joins.push((kind, deps, when, npkts, last, names));
        }
        let n_new = next()? as usize;
        let attrs: Vec<u64> = (0..7 * n_new).map(|_| next()).collect::<Option<_>>()?;
        let mut map = Naming {
            links: link_order.to_vec(),
            link_set: link_order.iter().copied().collect(),
            nodes: node_order.to_vec(),
            node_set: node_order.iter().copied().collect(),
            base: link_order.len(),
        };
        let mut all: Vec<u32> = order.to_vec();
        let mut pos: HashMap<u32, u32> = (0u32..).zip(order).map(|(k, &f)| (f, k)).collect();
        for (kind, deps, when, npkts, last, names) in &joins {
            let fits_size = |c: u32| {
                let fl = &self.flows[c as usize];
                !pos.contains_key(&c)
                    && !fl.released
                    && fl.npkts == *npkts
                    && u64::from(fl.last_payload) == *last
            };
            let mut chosen = None;
            if *kind == JOIN_TIMED {
                let first = names.iter().find(|&&n| (n as usize) < map.links.len())?;
                let due = self.now.0.saturating_add(*when);
                for &c in &m.pending_on[map.links[*first as usize] as usize] {
                    let pending = self.pending_rel[c as usize].is_some_and(|(t, _)| t.0 == due);
                    if pending && fits_size(c) {
                        if let Some(add) = self.map_path(c, names, &attrs, &map) {
                            map.commit(add);
                            chosen = Some(c);
                            break;
                        }
                    }
                }
            } else {
                let mut want: Vec<u32> = Vec::with_capacity(deps.len());
                for &d in deps {
                    want.push(*all.get(d as usize)?);
                }
                want.sort_unstable();
                let first = *want.first()?;
                let (a, b) = (
                    self.dependents_at[first as usize] as usize,
                    self.dependents_at[first as usize + 1] as usize,
                );
                for &c in &self.dependents[a..b] {
                    if !fits_size(c) || self.flows[c as usize].delay.0 != *when {
                        continue;
                    }
                    let cdeps = m.deps_of(c);
                    let mut inside: Vec<u32> = cdeps
                        .iter()
                        .copied()
                        .filter(|d| pos.contains_key(d))
                        .collect();
                    inside.sort_unstable();
                    let others_done = cdeps
                        .iter()
                        .all(|d| pos.contains_key(d) || self.flows[*d as usize].finish.is_some());
                    if inside != want || !others_done {
                        continue;
                    }
                    if let Some(add) = self.map_path(c, names, &attrs, &map) {
                        map.commit(add);
                        chosen = Some(c);
                        break;
                    }
                }
            }
            let c = chosen?;
            pos.insert(c, all.len() as u32);
            all.push(c);
        }
        Some(all.split_off(order.len()))
    }

    /// Checks flow `c`'s path against recorded link `names` under the naming so far;
    /// returns the links and nodes it names for the first time.
    fn map_path(
        &self,
        c: u32,
        names: &[u64],
        attrs: &[u64],
        map: &Naming,
    ) -> Option<(Vec<u32>, Vec<u32>)> {
        let links = self.links_of(c);
        if links.len() != names.len() {
            return None;
        }
        let (mut add_l, mut add_n): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        for (&l, &name) in links.iter().zip(names) {
            let name = name as usize;
            let known = map.links.len() + add_l.len();
            if name < known {
                let mapped = match map.links.get(name) {
                    Some(&x) => x,
                    None => add_l[name - map.links.len()],
                };
                if mapped != l {
                    return None;
                }
                continue;
            }
            if name != known || map.link_set.contains(&l) || add_l.contains(&l) {
                return None;
            }
            let want = attrs.get(7 * (name - map.base)..7 * (name - map.base) + 7)?;
            let p = &self.ports[l as usize];
            if want[2..] != link_attrs(p) {
                return None;
            }
            for (node, nname) in [(p.from, want[0]), (p.to, want[1])] {
                let nname = nname as usize;
                let known = map.nodes.len() + add_n.len();
                if nname < known {
                    let mapped = match map.nodes.get(nname) {
                        Some(&x) => x,
                        None => add_n[nname - map.nodes.len()],
                    };
                    if mapped != node {
                        return None;
                    }
                } else if nname == known && !map.node_set.contains(&node) && !add_n.contains(&node)
                {
                    add_n.push(node);
                } else {
                    return None;
                }
            }
            add_l.push(l);
        }
        Some((add_l, add_n))
    }

    /// Whether no release already scheduled, other than the episode's own, lands on the
    /// episode's links before its end (`end` after now).
    fn pending_clear(&self, all: &[u32], end: u64) -> bool {
        let Some(m) = self.memo.as_ref() else {
            return false;
        };
        let members: HashSet<u32> = all.iter().copied().collect();
        let mut seen = HashSet::new();
        let until = self.now.0.saturating_add(end);
        for &f in all {
            for l in self.links_of(f) {
                if !seen.insert(l) {
                    continue;
                }
                // The release time first: most flows waiting on a link are not scheduled
                // yet or come later, and it is far cheaper than the membership test.
                for &c in &m.pending_on[l as usize] {
                    if self.pending_rel[c as usize].is_some_and(|(t, _)| t.0 < until)
                        && !members.contains(&c)
                    {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Whether every flow outside the episode that waits only on its flows and shares its
    /// links would be released after the episode's last completion (by the stored
    /// completion times).
    fn dependents_stay_clear(&mut self, all: &[u32], finish: &[u64]) -> bool {
        let mut links = Vec::new();
        for &f in all {
            links.extend(self.links_of(f));
        }
        let members: HashSet<u32> = all.iter().copied().collect();
        let Some(m) = self.memo.as_mut() else {
            return false;
        };
        for &l in &links {
            m.link_mark[l as usize] = 0;
        }
        let end = finish.iter().copied().max().unwrap_or(0);
        // Per dependent: in-episode dependencies, and the latest of their completions.
        let mut touched: BTreeMap<u32, (u32, u64)> = BTreeMap::new();
        for (k, &f) in all.iter().enumerate() {
            let (a, b) = (
                self.dependents_at[f as usize] as usize,
                self.dependents_at[f as usize + 1] as usize,
            );
            for &d in &self.dependents[a..b] {
                if members.contains(&d) {
                    continue;
                }
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

    /// Applies a stored episode: the first `initial` flows of `all` (released now) finish
    /// at their stored offsets without sending a packet; the rest finish at theirs once
    /// released (see [`Engine::memo_on_release`]).
    fn memo_apply(&mut self, all: Vec<u32>, initial: usize, cert: Vec<u64>, entry: &Entry) {
        let packets: u64 = all.iter().map(|&f| self.flows[f as usize].npkts).sum();
        let per_packet = entry.events as f64 / packets.max(1) as f64;
        let now = self.now;
        let id = self.memo_begin_episode(all.clone(), cert, true, per_packet, initial);
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        if let Some(ep) = m.episodes.get_mut(id as usize) {
            ep.finish = entry.finish.clone();
        }
        self.stats.memo_hits += 1;
        for (k, &f) in all.iter().enumerate().take(initial) {
            let at = Picos(now.0.saturating_add(entry.finish[k]));
            let key = self.q.schedule(at, Ev::MemoFinish(f));
            if let Some(m) = self.memo.as_mut() {
                m.finish_at[f as usize] = Some((at, key));
                m.owned += 1;
            }
        }
    }

    /// The live episode flow `f` joins, if any, and whether it is memoized: `f` is an
    /// expected join of a memoized episode, or every dependency of `f` is in a recording
    /// (unspoiled) episode or finished before it started and every link of `f` is idle or
    /// the episode's.
    fn memo_join_target(&self, f: u32, links: &[u32]) -> Option<JoinTarget> {
        let m = self.memo.as_ref()?;
        // An expected join of a memoized episode was marked when the hit was verified.
        let own = m.flow_episode[f as usize];
        if let Some(ep) = m.episodes.get(own as usize) {
            if ep.hit && !ep.mirror && ep.left > 0 {
                return Some(JoinTarget::Memoized(own));
            }
        }
        let deps = m.deps_of(f);
        let joinable = |e: u32| {
            e != NONE
                && m.episodes.get(e as usize).is_some_and(|ep| {
                    ep.left > 0 && ((!ep.hit && !ep.intruded) || ep.leader != NONE)
                })
        };
        // A flow of another collective that waits for a live episode's flows (the next
        // collective of a rank, released after the one it waits for) does not grow the
        // episode: on idle links it starts its own, which can be looked up, where joining
        // would make every episode the whole chain of a group's collectives, never the
        // same twice (see "Joins" in the module essay).
        let coll = m.collective[f as usize];
        if deps
            .iter()
            .any(|&d| m.collective[d as usize] != coll && joinable(m.flow_episode[d as usize]))
        {
            return None;
        }
        // The episode of a dependency (a dependent join: the next step of a ring), else of
        // a link (a timed join: a release fixed before the episode started that lands on
        // its links).
        let id = deps
            .iter()
            .map(|&d| m.flow_episode[d as usize])
            .find(|&e| joinable(e))
            .or_else(|| {
                links
                    .iter()
                    .map(|&l| m.link_episode[l as usize])
                    .find(|&e| joinable(e))
            })?;
        let ep = &m.episodes[id as usize];
        for &d in deps {
            if m.flow_episode[d as usize] != id {
                match self.flows[d as usize].finish {
                    Some(t) if t <= ep.start => {}
                    _ => return None,
                }
            }
        }
        let free = links
            .iter()
            .all(|&l| m.users[l as usize] == 0 || m.link_episode[l as usize] == id);
        free.then_some(if ep.leader != NONE {
            JoinTarget::Mirror(id)
        } else {
            JoinTarget::Recording(id)
        })
    }

    /// Flow `f` joins recording episode `id`: it is simulated as usual, and the episode
    /// records its in-episode dependencies, size, delay and path (naming new links). Its
    /// mirrors must match it by this instant's decision event.
    fn memo_record_join(&mut self, id: u32, f: u32, links: &[u32]) {
        let Some(words) = self.join_words(id, f, links) else {
            return;
        };
        self.memo_add_join(id, f, links, words);
        let now = self.now;
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        let Some(ep) = m.episodes.get(id as usize) else {
            return;
        };
        if !ep.followers.is_empty() {
            m.mirror_checks.push((id, ep.flows.len() - 1));
            if !m.decide_pending {
                m.decide_pending = true;
                self.q.schedule(now, Ev::MemoDecide);
            }
        }
    }

    /// What episode `id` records of flow `f` joining it now (see [`Entry::shape`]) under
    /// the episode's naming: the join's words, the records of the links it names first,
    /// and those links and nodes in naming order. Read-only; [`Engine::memo_add_join`]
    /// commits it.
    fn join_words(&self, id: u32, f: u32, links: &[u32]) -> Option<JoinWords> {
        let m = self.memo.as_ref()?;
        let ep = m.episodes.get(id as usize)?;
        let fl = &self.flows[f as usize];
        let now = self.now.0 + self.offset.0;
        let mut inside: Vec<u64> = m
            .deps_of(f)
            .iter()
            .filter(|&&d| m.flow_episode[d as usize] == id)
            .map(|&d| u64::from(m.index[d as usize]))
            .collect();
        inside.sort_unstable();
        let mut jw = JoinWords::default();
        if inside.is_empty() {
            // Timed: released at a fixed offset from the episode's start.
            jw.words
                .extend([JOIN_TIMED, now.saturating_sub(ep.start.0)]);
        } else {
            jw.words.extend([JOIN_DEPENDENT, inside.len() as u64]);
            jw.words.extend(&inside);
            jw.words.push(fl.delay.0);
        }
        jw.words
            .extend([fl.npkts, u64::from(fl.last_payload), links.len() as u64]);
        for &l in links {
            let name = match ep.link_names.get(&l) {
                Some(&n) => n,
                None => match jw.new_links.iter().position(|&x| x == l) {
                    Some(i) => (ep.link_names.len() + i) as u64,
                    None => {
                        let p = &self.ports[l as usize];
                        let from = jw.node_name(&ep.node_names, p.from);
                        let to = jw.node_name(&ep.node_names, p.to);
                        jw.records.extend([from, to]);
                        jw.records.extend(link_attrs(p));
                        jw.new_links.push(l);
                        (ep.link_names.len() + jw.new_links.len() - 1) as u64
                    }
                },
            };
            jw.words.push(name);
        }
        Some(jw)
    }

    /// Adds flow `f` to episode `id` as its next join, with the words [`Engine::join_words`]
    /// gave, and claims its links for the episode.
    fn memo_add_join(&mut self, id: u32, f: u32, links: &[u32], jw: JoinWords) {
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        let Some(ep) = m.episodes.get_mut(id as usize) else {
            return;
        };
        m.index[f as usize] = ep.flows.len() as u32;
        m.flow_episode[f as usize] = id;
        ep.flows.push(f);
        ep.left += 1;
        ep.join_at.push((ep.joins.len(), ep.new_links.len()));
        ep.joins.extend(jw.words);
        ep.new_links.extend(jw.records);
        for l in jw.new_links {
            let k = ep.link_names.len() as u64;
            ep.link_names.insert(l, k);
        }
        for n in jw.new_nodes {
            let k = ep.node_names.len() as u64;
            ep.node_names.insert(n, k);
        }
        for &l in links {
            m.link_episode[l as usize] = id;
        }
    }

    /// Flow `f`, released now, would join mirror `id`: it is taken if its leader's next
    /// join, released at this same instant, has the same words and new links (it then
    /// finishes when that flow does). Otherwise the two groups are no longer alike: the
    /// mirror is broken and `f` is simulated. Returns whether `f` was taken.
    fn memo_mirror_join(&mut self, id: u32, f: u32, links: &[u32]) -> bool {
        let Some(jw) = self.join_words(id, f, links) else {
            return false;
        };
        let matched = self.memo.as_ref().and_then(|m| {
            let ep = m.episodes.get(id as usize)?;
            let leader = m.episodes.get(ep.leader as usize)?;
            let j = ep.flows.len().checked_sub(ep.initial)?;
            let h = *leader.flows.get(leader.initial + j)?;
            let (w, r) = *leader.join_at.get(j)?;
            let (w_end, r_end) = leader
                .join_at
                .get(j + 1)
                .copied()
                .unwrap_or((leader.joins.len(), leader.new_links.len()));
            let alike = leader.joins.get(w..w_end)? == jw.words.as_slice()
                && leader.new_links.get(r..r_end)? == jw.records.as_slice()
                && self.flows[h as usize].start == self.flows[f as usize].start;
            alike.then_some(h)
        });
        let Some(h) = matched else {
            self.memo_break_mirror(id);
            return false;
        };
        self.memo_add_join(id, f, links, jw);
        if self.flows[h as usize].finish.is_some() {
            self.memo_mirror_finish(f);
        }
        true
    }

    /// Flow `f` of a mirror finishes now, as its leader's matching flow just did.
    fn memo_mirror_finish(&mut self, f: u32) {
        let now = self.now;
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        if m.finish_at[f as usize].is_some() || self.flows[f as usize].finish.is_some() {
            return;
        }
        let key = self.q.schedule(now, Ev::MemoFinish(f));
        m.finish_at[f as usize] = Some((now, key));
        m.owned += 1;
    }

    /// Mirror `id` stops mirroring. Up to now it was isolated and isomorphic to its leader,
    /// so its exact state is the leader's carried over through the isomorphism: each
    /// unfinished flow takes its leader flow's sender, receiver and DCQCN state and timers,
    /// and every packet of the leader flow in flight or queued is copied onto the mirror's
    /// links with the same pending times (ports busy, paused or waking likewise), with
    /// switch buffer accounting redone as the copies enter their queues
    /// ([`Engine::capture`]; the engine keeps its event ledger whenever mirrors
    /// are on). Counted in [`super::PacketStats::memo_mirror_breaks`].
    fn memo_break_mirror(&mut self, id: u32) {
        let per_packet = self.run_events_per_packet();
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        let Some(ep) = m.episodes.get_mut(id as usize) else {
            return;
        };
        let leader = ep.leader;
        if leader == NONE {
            return;
        }
        ep.leader = NONE;
        ep.hit = false;
        ep.intruded = true;
        ep.cert = Vec::new();
        let flows = ep.flows.clone();
        let by_name: HashMap<u64, u32> = ep.link_names.iter().map(|(&l, &k)| (k, l)).collect();
        let Some(l) = m.episodes.get_mut(leader as usize) else {
            return;
        };
        l.followers.retain(|&x| x != id);
        let leader_flows = l.flows.clone();
        // The isomorphism on links: leader link to the mirror link of the same name.
        let phi: HashMap<u32, u32> = l
            .link_names
            .iter()
            .filter_map(|(&ll, k)| by_name.get(k).map(|&fl| (ll, fl)))
            .collect();
        self.stats.memo_mirror_breaks += 1;
        let mut pairs = Vec::new();
        for (k, g) in flows.into_iter().enumerate() {
            let scheduled = self
                .memo
                .as_ref()
                .is_some_and(|m| m.finish_at[g as usize].is_some());
            if scheduled || self.flows[g as usize].finish.is_some() {
                continue;
            }
            // Every flow of a live mirror has its leader's flow at the same index.
            let Some(&h) = leader_flows.get(k) else {
                self.start_qp(g);
                continue;
            };
            pairs.push((h, g));
            let credited = self.flows[h as usize].rcv_nxt;
            self.stats.memo_skipped_events += (credited as f64 * per_packet).round() as u64;
        }
        if !pairs.is_empty() {
            let img = self.capture(&pairs, &|l| phi.get(&l).copied());
            let credited = self.apply_image(img);
            self.stats.memo_skipped_packets += credited;
        }
    }

    /// Leader flow `f` finished: the matching flow of each of its mirrors finishes now too;
    /// a mirror without one is broken.
    fn memo_mirror_leader_finish(&mut self, f: u32) {
        let Some(m) = self.memo.as_ref() else {
            return;
        };
        let id = m.flow_episode[f as usize];
        let Some(ep) = m.episodes.get(id as usize) else {
            return;
        };
        if ep.followers.is_empty() {
            return;
        }
        let k = m.index[f as usize] as usize;
        let pairs: Vec<(u32, Option<u32>)> = ep
            .followers
            .iter()
            .map(|&b| (b, m.episodes[b as usize].flows.get(k).copied()))
            .collect();
        for (b, g) in pairs {
            match g {
                Some(g) => self.memo_mirror_finish(g),
                None => self.memo_break_mirror(b),
            }
        }
    }

    /// The unfinished flows `flows` of a collective going periodic (see the `periodic`
    /// module) leave their live episodes' care: a mirror is broken (it takes its leader's
    /// exact state), a recording is marked intruded (its joins will not be simulated) and
    /// its mirrors broken; a memoized episode keeps its stored times.
    pub(super) fn memo_settle_episodes(&mut self, flows: &[u32]) {
        let Some(m) = self.memo.as_ref() else {
            return;
        };
        let mut ids: Vec<u32> = flows
            .iter()
            .map(|&f| m.flow_episode[f as usize])
            .filter(|&id| id != NONE)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            let Some(ep) = self
                .memo
                .as_mut()
                .and_then(|m| m.episodes.get_mut(id as usize))
            else {
                continue;
            };
            if ep.left == 0 || (ep.hit && ep.leader == NONE) {
                continue;
            }
            if ep.leader != NONE {
                self.memo_break_mirror(id);
            } else {
                ep.intruded = true;
                self.memo_break_followers(id);
            }
        }
    }

    /// Breaks every mirror of leader `id` (it was intruded, so they no longer match it).
    fn memo_break_followers(&mut self, id: u32) {
        let followers = self
            .memo
            .as_ref()
            .and_then(|m| m.episodes.get(id as usize))
            .map(|e| e.followers.clone())
            .unwrap_or_default();
        for b in followers {
            self.memo_break_mirror(b);
        }
    }

    /// The decision event's check of this instant's leader joins: a mirror that did not
    /// match one (its own counterpart was not released with it) is broken.
    fn memo_check_mirrors(&mut self, checks: Vec<(u32, usize)>) {
        for (leader, at) in checks {
            let unmatched: Vec<u32> = self
                .memo
                .as_ref()
                .and_then(|m| m.episodes.get(leader as usize).map(|l| (m, l)))
                .map(|(m, l)| {
                    l.followers
                        .iter()
                        .copied()
                        .filter(|&b| m.episodes[b as usize].flows.len() <= at)
                        .collect()
                })
                .unwrap_or_default();
            for b in unmatched {
                self.memo_break_mirror(b);
            }
        }
    }

    /// Events per simulated data packet so far (the skipped-events estimate's rate).
    pub(super) fn run_events_per_packet(&self) -> f64 {
        if self.data_packets > 0 {
            self.events as f64 / self.data_packets as f64
        } else {
            0.0
        }
    }

    /// Flow `f`, released now, is an expected join of memoized episode `id`: it finishes
    /// at its stored offset from the episode's start without sending a packet.
    fn memo_own_join(&mut self, id: u32, f: u32) {
        let now = self.now;
        let offset = self.offset;
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        let Some(ep) = m.episodes.get(id as usize) else {
            return;
        };
        let k = m.index[f as usize] as usize;
        let start_local = ep.start.0.saturating_sub(offset.0);
        let at = Picos(
            start_local
                .saturating_add(ep.finish.get(k).copied().unwrap_or(0))
                .max(now.0),
        );
        let key = self.q.schedule(at, Ev::MemoFinish(f));
        m.finish_at[f as usize] = Some((at, key));
        m.owned += 1;
    }

    /// A memoized or virtual flow reaches its scheduled completion: account its bytes and
    /// finish it.
    pub(super) fn memo_finish(&mut self, f: u32) {
        let run_rate = self.run_events_per_packet();
        let periodic = self.periodic.as_ref().is_some_and(|p| p.is_virtual(f));
        let repeated = self.periodic.as_ref().is_some_and(|p| p.is_repeated(f));
        let per_packet = match self.memo.as_mut() {
            Some(m) => {
                m.finish_at[f as usize] = None;
                m.owned -= 1;
                match m.episodes.get(m.flow_episode[f as usize] as usize) {
                    // Virtual and mirrored flows never had a recording of their own.
                    _ if periodic => run_rate,
                    Some(e) if e.mirror => run_rate,
                    Some(e) => e.events_per_packet,
                    None => 0.0,
                }
            }
            None => return,
        };
        let (npkts, from) = {
            let fl = &self.flows[f as usize];
            (fl.npkts, fl.snd_nxt)
        };
        let packets = npkts - from;
        self.credit_packets(f, packets);
        let events = (packets as f64 * per_packet).round() as u64;
        if periodic {
            let [_, skipped_packets, skipped_events, _] = self.stats.virtual_counters(repeated);
            *skipped_packets += packets;
            *skipped_events += events;
        } else {
            self.stats.memo_skipped_packets += packets;
            self.stats.memo_skipped_events += events;
        }
        let fl = &mut self.flows[f as usize];
        fl.sender_done = true;
        self.finish_flow(f);
    }

    /// Moves flow `f` to packet `to` (from its current position) without simulating:
    /// sequence numbers, byte counters of the flow, the run and its data path, its ACKs.
    pub(super) fn credit_packets(&mut self, f: u32, packets: u64) {
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
            + u64::from(to == fl.npkts && !to.is_multiple_of(ack_every));
        fl.snd_nxt = to;
        fl.snd_una = to;
        fl.high = to;
        fl.rcv_nxt = to;
        fl.delivered += bytes;
        self.bytes_sent += bytes;
        self.bytes_delivered += bytes;
        self.stats.acks += acks;
        let (start, len) = fl.fwd;
        for h in start..start + len {
            self.link_bytes[self.paths[h as usize] as usize] += bytes;
        }
    }

    /// A release touched the links of memoized episode `id`: the hit is rolled back. The
    /// episode is replayed alone from its start up to now ([`Engine::replay`]), and each
    /// unfinished flow takes its replayed state ([`Engine::capture`]). A flow the replay
    /// has not released yet (released at this very instant) starts afresh; one the replay
    /// already finished keeps its stored completion. The replay's events are counted in
    /// the run's events and in [`super::PacketStats::memo_replayed_events`]. The replay
    /// releases each flow at its global release time less the current offset: with
    /// fast-forwarding over the whole network (`accel.partitioning` off), a jump taken
    /// while the hit ran moves those releases earlier than they were (an approximation of
    /// that configuration only; with partitioning the offset stays zero).
    fn memo_abort(&mut self, id: u32) {
        if self
            .memo
            .as_ref()
            .and_then(|m| m.episodes.get(id as usize))
            .is_some_and(|e| e.leader != NONE)
        {
            self.memo_break_mirror(id);
            return;
        }
        let Some(m) = self.memo.as_mut() else {
            return;
        };
        let Some(ep) = m.episodes.get_mut(id as usize) else {
            return;
        };
        ep.hit = false;
        ep.cert = Vec::new();
        ep.intruded = true;
        let flows = ep.flows.clone();
        self.stats.memo_aborts += 1;
        let cfg = PacketConfig {
            accel: super::AccelConfig::off(),
            ..self.cfg.clone()
        };
        let trace = super::TraceRequest::default();
        let mut replay = self.replay(&cfg, &trace, &flows);
        replay.run_until(self.now);
        let mut pairs = Vec::new();
        let mut fresh = Vec::new();
        for (k, &f) in flows.iter().enumerate() {
            let r = &replay.flows[k];
            let Some(m) = self.memo.as_mut() else {
                return;
            };
            if r.finish.is_some() || m.finish_at[f as usize].is_none() {
                continue; // finished in the replay, or here: the stored time stands
            }
            if let Some((_, key)) = m.finish_at[f as usize].take() {
                m.owned -= 1;
                self.q.cancel(key);
            }
            if r.released {
                pairs.push((k as u32, f));
            } else {
                fresh.push(f);
            }
        }
        let img = replay.capture(&pairs, &Some);
        // The replay's packets count with its events, so the run's events per packet (the
        // skipped-events estimate) stays a ratio of like to like.
        self.events += replay.events;
        self.data_packets += replay.data_packets;
        self.stats.memo_replayed_events += replay.events;
        drop(replay);
        self.apply_image(img);
        for f in fresh {
            self.start_qp(f);
        }
    }

    /// Bookkeeping when flow `f` finishes: its episode may be complete (and stored).
    pub(super) fn memo_on_finish(&mut self, f: u32) {
        let per_packet = self.run_events_per_packet();
        self.memo_mirror_leader_finish(f);
        let mut store = None;
        if let Some(m) = self.memo.as_mut() {
            let id = m.flow_episode[f as usize];
            if let Some(ep) = m.episodes.get_mut(id as usize) {
                ep.left -= 1;
                if ep.left == 0 {
                    if !ep.hit && !ep.intruded {
                        store = Some(id);
                    } else {
                        if !ep.hit && !ep.cert.is_empty() {
                            self.stats.memo_spoiled += 1;
                        }
                        ep.cert = Vec::new();
                    }
                }
            }
        }
        if let Some(id) = store {
            let flows = self
                .memo
                .as_ref()
                .map(|m| m.episodes[id as usize].flows.clone())
                .unwrap_or_default();
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
                let mut shape = vec![(ep.flows.len() - ep.initial) as u64];
                shape.append(&mut ep.joins);
                shape.push(ep.new_links.len() as u64 / 7);
                shape.append(&mut ep.new_links);
                ep.link_names = HashMap::new();
                ep.node_names = HashMap::new();
                m.cache.get_mut().insert(Entry {
                    cert,
                    finish,
                    events: (packets as f64 * per_packet).round() as u64,
                    shape,
                });
                self.stats.memo_recorded += 1;
            }
        }
        // A completed episode no longer owns its links.
        let Some(m) = self.memo.as_ref() else {
            return;
        };
        let id = m.flow_episode[f as usize];
        let Some(ep) = m.episodes.get(id as usize).filter(|e| e.left == 0) else {
            return;
        };
        let links: Vec<u32> = ep.flows.iter().flat_map(|&g| self.flow_links(g)).collect();
        if let Some(m) = self.memo.as_mut() {
            for l in links {
                if m.link_episode[l as usize] == id {
                    m.link_episode[l as usize] = NONE;
                }
            }
        }
    }

    /// The certificate of a group of flows (see the module essay) and the flows in
    /// certificate order.
    /// Also returns the links and nodes in the order the certificate names them.
    #[allow(clippy::type_complexity)]
    fn certificate(&self, flows: &[u32]) -> (Vec<u32>, Vec<u64>, Vec<u32>, Vec<u32>) {
        let hop = |l: u32| hash_words(&link_attrs(&self.ports[l as usize]));
        let n = flows.len();
        let links: Vec<Vec<u32>> = flows.iter().map(|&f| self.links_of(f)).collect();
        // Queue pairs that join a port together are served in the order of their tie keys
        // (`Engine::start_qp`), so each flow's place in that order among the group's flows
        // on its port is part of the shape: a group whose flows share a port in another
        // order would run otherwise.
        let mut by_port: Vec<(u32, u64, u32, usize)> = flows
            .iter()
            .enumerate()
            .map(|(i, &f)| {
                let fl = &self.flows[f as usize];
                (fl.src_port, fl.tie, f, i)
            })
            .collect();
        by_port.sort_unstable();
        let mut place = vec![0u64; n];
        for k in 1..by_port.len() {
            if by_port[k].0 == by_port[k - 1].0 {
                place[by_port[k].3] = place[by_port[k - 1].3] + 1;
            }
        }
        let mut colour: Vec<u64> = flows
            .iter()
            .zip(&links)
            .zip(&place)
            .map(|((&f, ls), &place)| {
                let fl = &self.flows[f as usize];
                let mut w = vec![
                    fl.npkts,
                    u64::from(fl.last_payload),
                    u64::from(fl.fwd.1),
                    place,
                ];
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
            cert.extend([
                fl.npkts,
                u64::from(fl.last_payload),
                u64::from(fl.fwd.1),
                place[i],
            ]);
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
        (order, cert, link_order, node_order)
    }
}

/// The links and nodes an episode has named so far while a stored entry is mapped onto
/// this run (names are positions).
struct Naming {
    links: Vec<u32>,
    link_set: HashSet<u32>,
    nodes: Vec<u32>,
    node_set: HashSet<u32>,
    /// Names below this come from the initial group's certificate.
    base: usize,
}

impl Naming {
    fn commit(&mut self, (links, nodes): (Vec<u32>, Vec<u32>)) {
        self.link_set.extend(&links);
        self.links.extend(links);
        self.node_set.extend(&nodes);
        self.nodes.extend(nodes);
    }
}

/// The live episode a released flow joins (see [`Engine::memo_join_target`]).
#[derive(Debug, Clone, Copy)]
enum JoinTarget {
    /// An expected join of a memoized episode (a hit).
    Memoized(u32),
    /// A recording episode.
    Recording(u32),
    /// A mirror, which takes the flow only if its leader has the same join.
    Mirror(u32),
}

/// A join as an episode records it (see [`Engine::join_words`]).
#[derive(Debug, Default)]
struct JoinWords {
    words: Vec<u64>,
    /// `(from node, to node, link attributes..)` of each link the join names first.
    records: Vec<u64>,
    new_links: Vec<u32>,
    new_nodes: Vec<u32>,
}

impl JoinWords {
    /// The name of `node`: the episode's, else the next new one.
    fn node_name(&mut self, named: &HashMap<u32, u64>, node: u32) -> u64 {
        if let Some(&k) = named.get(&node) {
            return k;
        }
        let i = match self.new_nodes.iter().position(|&x| x == node) {
            Some(i) => i,
            None => {
                self.new_nodes.push(node);
                self.new_nodes.len() - 1
            }
        };
        (named.len() + i) as u64
    }
}

/// What the certificate records of a link besides its endpoints.
pub(super) fn link_attrs(p: &super::engine::Port) -> [u64; 5] {
    [
        p.bw.to_bits(),
        p.delay.0,
        u64::from(p.from_switch),
        u64::from(p.to_switch),
        p.headroom,
    ]
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
            shape: vec![0, 0],
        });
        c.insert(Entry {
            cert: vec![4, 5],
            finish: vec![30],
            events: 9,
            shape: vec![1, 1, 0, 5, 3, 1000, 1, 4, 0],
        });
        c
    }

    #[test]
    fn a_group_keeps_its_newest_shapes_only() {
        let mut c = sample();
        let entry = |k: u64| Entry {
            cert: vec![1, 2, 3],
            finish: vec![10, 20 + k],
            events: 7,
            shape: vec![0, k],
        };
        for k in 1..=MAX_SHAPES as u64 + 2 {
            c.insert(entry(k));
            c.insert(entry(k)); // the same shape again is not stored twice
        }
        assert_eq!(c.len(), MAX_SHAPES + 1);
        let shapes: Vec<u64> = c.lookup(&[1, 2, 3]).map(|e| e.shape[1]).collect();
        let newest: Vec<u64> = (3..=MAX_SHAPES as u64 + 2).collect();
        assert_eq!(shapes, newest);
        // A shape that is used (a hit) outlives shapes stored after it.
        let oldest = c.lookup(&[1, 2, 3]).next().cloned().unwrap();
        c.touch(&oldest);
        c.insert(entry(1000));
        let shapes: Vec<u64> = c.lookup(&[1, 2, 3]).map(|e| e.shape[1]).collect();
        assert_eq!(shapes.len(), MAX_SHAPES);
        assert!(shapes.contains(&3) && !shapes.contains(&4), "{shapes:?}");
        assert_eq!(shapes.last(), Some(&1000));
        // The other group is untouched, and the file image keeps what is stored.
        assert_eq!(c.lookup(&[4, 5]).count(), 1);
        assert_eq!(MemoCache::from_bytes(&c.to_bytes()).unwrap(), c);
    }

    #[test]
    fn the_file_image_round_trips() {
        let c = sample();
        let back = MemoCache::from_bytes(&c.to_bytes()).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.len(), 2);
        assert_eq!(back.lookup(&[1, 2, 3]).count(), 1);
        assert_eq!(back.lookup(&[1, 2]).count(), 0);
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

    proptest::proptest! {
        /// A body that passes the frame's checks (a file with a valid header and checksum
        /// but any contents: written by another program, or by a bug) is read or refused,
        /// never a panic, and what is read writes back to the same cache. Bodies are
        /// well-formed entry lists and kept-collective lists (at most three, so never more
        /// than a shape may keep), then perhaps one word overwritten and perhaps cut
        /// short, so both outcomes occur; untouched lists of distinct entries are read
        /// whole. The fuzz target `memo_cache` does the same with coverage guidance.
        #[test]
        fn any_framed_body_is_read_or_refused(
            entries in proptest::collection::vec(
                (
                    proptest::collection::vec(0u64..3, 0..3),
                    proptest::collection::vec(proptest::num::u64::ANY, 0..3),
                    proptest::num::u64::ANY,
                    proptest::collection::vec(proptest::num::u64::ANY, 0..3),
                ),
                0..4,
            ),
            kept in proptest::collection::vec(
                (0u64..2, proptest::collection::vec((0u64..3, proptest::num::u64::ANY), 0..3)),
                0..4,
            ),
            poke in proptest::option::of((proptest::num::usize::ANY, 0u64..40)),
            cut in 0usize..12,
        ) {
            let mut words = vec![entries.len() as u64];
            for (cert, finish, events, shape) in &entries {
                for part in [cert, finish] {
                    words.push(part.len() as u64);
                    words.extend_from_slice(part);
                }
                words.push(*events);
                words.push(shape.len() as u64);
                words.extend_from_slice(shape);
            }
            words.push(kept.len() as u64);
            for (key, flows) in &kept {
                words.extend_from_slice(&[0, *key, flows.len() as u64]);
                words.extend(flows.iter().map(|f| f.0));
                words.push(flows.len() as u64);
                words.extend(flows.iter().map(|f| f.1));
            }
            if let Some((at, value)) = poke {
                let at = at % words.len();
                words[at] = value;
            }
            let mut body: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            // Cuts of 8 bytes or more are left out: a cut of whole words can still be a
            // well-formed shorter list.
            let cut = if cut < 8 { cut } else { 0 };
            body.truncate(body.len() - cut.min(body.len()));
            let file = orrery_units::frame::frame(FILE_MAGIC, FILE_VERSION, &body);
            match MemoCache::from_bytes(&file) {
                Ok(cache) => {
                    let again = MemoCache::from_bytes(&cache.to_bytes()).unwrap();
                    proptest::prop_assert_eq!(again, cache);
                }
                Err(_) => {
                    let mut certs: Vec<&Vec<u64>> = entries.iter().map(|e| &e.0).collect();
                    certs.sort();
                    certs.dedup();
                    let mut outcomes = kept.clone();
                    outcomes.sort();
                    outcomes.dedup();
                    let distinct = certs.len() == entries.len() && outcomes.len() == kept.len();
                    let untouched = poke.is_none() && cut == 0;
                    proptest::prop_assert!(
                        !(untouched && distinct),
                        "a well-formed list of distinct entries was refused"
                    );
                }
            }
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

    /// A cache path naming a FIFO (or `/dev/null`) is written through, not renamed over.
    #[cfg(unix)]
    #[test]
    fn save_writes_through_a_fifo_instead_of_replacing_it() {
        use std::os::unix::fs::FileTypeExt;
        let dir = std::env::temp_dir().join(format!("orrery-memo-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("cache.bin");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            return; // no mkfifo here: nothing to check
        }
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        sample().save(&fifo).unwrap();
        let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(kind.is_fifo(), "the FIFO was replaced: {kind:?}");
        let bytes = reader.join().unwrap();
        assert_eq!(MemoCache::from_bytes(&bytes).unwrap(), sample());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
