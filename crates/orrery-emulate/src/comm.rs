//! A real rank among virtual peers: the communicator the real program runs on during graph
//! collection and hybrid emulation.
//!
//! [`VirtualPeers`] implements `orrery_train::Communicator` for one rank of a world whose
//! other ranks do not exist. Every operation returns at once, with data that keeps the
//! program's numbers sane:
//!
//! - an all-reduce over a group sums, in group order, the rank's own contribution once per
//!   member (a virtual data-parallel replica contributes the real rank's own gradient; a
//!   virtual tensor-parallel peer its partial sum);
//! - a reduce-scatter is that all-reduce's piece for the rank (so every member contributing
//!   the rank's own data gives it `group.len()` times its own piece);
//! - an all-gather fills every member's part with the rank's own;
//! - an all-to-all receives from each member what the rank sends itself: every member is
//!   taken to route as the rank's own router does, so a rank whose experts the router
//!   favours receives that share from every member, and the load imbalance and its memory
//!   spike show on the real rank (the exchange's size follows the same model, see
//!   `busiest_member_elements`);
//! - a broadcast keeps the rank's own data (the roots' copies are equal at initialisation);
//! - a send is dropped; a receive is filled with small deterministic values (a virtual
//!   pipeline neighbour's activations or gradients), seeded by the pair and the message's
//!   place in their order.
//!
//! While it runs, it measures: the time between the end of one operation and the start of
//! the next is a compute segment (read from a caller-supplied `orrery_train::Clock`), and
//! with [`crate::memory::CountingAlloc`] installed (or on a GPU, from the backend's pool:
//! [`crate::memory::sample`]), the bytes the thread held at the end of the segment and its
//! peak during it. Between [`VirtualPeersHandle::start`] and
//! [`VirtualPeersHandle::finish`] it records every segment and operation as a
//! [`RankRecord`] (graph collection) and reports every segment to a [`RankReporter`] if it
//! has one (hybrid emulation).
//!
//! Messages to and from pipeline neighbours carry a tag, the message's place among those
//! from its sender to its receiver (twice, plus one when the sender is not the receiver's
//! previous stage), so that in the stitched graph each receive meets its send.
//!
//! With other real ranks in the same emulation ([`VirtualPeers::with_real_peers`], a
//! communicator over the real ranks), operations among real ranks carry real data: a
//! group's real members exchange their contributions over it, and its virtual members
//! contribute the first real member's (so every real member computes the same sum); sends
//! and receives between real ranks go over it.
//!
//! Tagged messages (`Communicator::send_f32_tagged`, interleaved 1F1B's) are recorded with
//! the program's own tag, marked as such, so that a receive meets the send of the same tag
//! rather than the send of the same place in the pair's order; a tagged receive from a
//! virtual neighbour is synthesised like an untagged one.

use crate::coordinator::RankReporter;
use crate::memory;
use orrery_graph::collect::{RankRecord, RecordedOp};
use orrery_graph::{CollectiveOp, GroupRole, Layout, PeerStage, Phase};
use orrery_train::comm::{all_to_all_v_offsets, check_all_gather, check_reduce_scatter};
use orrery_train::{Clock, CommError, Communicator, Group};
use orrery_units::{Bytes, Picos, RankId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The state shared by a [`VirtualPeers`] communicator and its handle.
struct State {
    rank: usize,
    world: usize,
    layout: Layout,
    clock: Arc<dyn Clock>,
    /// When the last operation ended (seconds on `clock`).
    since: f64,
    recording: bool,
    ops: Vec<RecordedOp>,
    segments: usize,
    reporter: Option<RankReporter>,
    /// Messages sent to and received from each peer so far.
    sent: HashMap<usize, u64>,
    received: HashMap<usize, u64>,
    error: Option<String>,
}

impl State {
    /// A compute segment ends now: record and report it.
    fn segment_ends(&mut self) -> Result<(), CommError> {
        self.segment_ends_before(None)
    }

    /// A compute segment ends now, before an operation moving `bytes` (if known): record
    /// and report it.
    ///
    /// Fails once the emulation has stopped (its coordinator no longer takes reports), so
    /// that the rank's program stops at its next communication call instead of running on.
    fn segment_ends_before(&mut self, bytes: Option<u64>) -> Result<(), CommError> {
        let now = self.clock.now_seconds();
        let took = Picos::from_secs_f64((now - self.since).max(0.0));
        if !self.recording {
            return Ok(());
        }
        let sample = memory::sample();
        memory::reset_thread_peak();
        self.ops.push(RecordedOp::Compute {
            name: format!("segment {}", self.segments),
            phase: Phase::Forward,
            duration: took,
            memory: sample,
        });
        self.segments += 1;
        if let Some(r) = &self.reporter {
            let sent = match bytes {
                Some(b) => r.segment_before(took, b),
                None => r.segment(took),
            };
            if sent.is_err() {
                self.error = Some("the emulation stopped".into());
            }
        }
        if self.error.is_some() {
            return Err(CommError::PeerGone);
        }
        Ok(())
    }

    /// An operation ends now: the next segment starts, its peak from what the thread
    /// holds now (the operation's own transient buffers are not the program's).
    fn op_ends(&mut self, op: RecordedOp) {
        self.ops_end([op]);
    }

    /// Like [`State::op_ends`], for an operation recorded as several (a send-and-receive).
    fn ops_end(&mut self, ops: impl IntoIterator<Item = RecordedOp>) {
        if self.recording {
            self.ops.extend(ops);
        }
        memory::reset_thread_peak();
        self.since = self.clock.now_seconds();
    }

    /// The place of the next message to `dest` among this rank's messages to it.
    fn next_sent(&mut self, dest: usize) -> u64 {
        let n = self.sent.entry(dest).or_insert(0);
        *n += 1;
        *n - 1
    }

    /// The place of the next message from `src` among its messages to this rank.
    fn next_received(&mut self, src: usize) -> u64 {
        let n = self.received.entry(src).or_insert(0);
        *n += 1;
        *n - 1
    }

    /// The tag of the `seq`-th message from `src` to `dst` (see the module docs).
    fn tag(&self, src: usize, dst: usize, seq: u64) -> u64 {
        let prev = self.layout.peer(RankId(dst as u32), PeerStage::Prev).0 as usize;
        2 * seq + u64::from(prev != src)
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.world || peer == self.rank {
            Err(CommError::BadPeer {
                peer,
                world: self.world,
            })
        } else {
            Ok(())
        }
    }

    fn members(group: &Group) -> Vec<u32> {
        group.ranks().iter().map(|&r| r as u32).collect()
    }
}

/// The communicator of a real rank among virtual peers (see the module docs).
pub struct VirtualPeers {
    state: Arc<Mutex<State>>,
    rank: usize,
    world: usize,
    /// The other real ranks of the emulation, if any.
    real: Option<RealPeers>,
}

impl std::fmt::Debug for VirtualPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualPeers")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// The driver's side of a [`VirtualPeers`] communicator: starts and ends the recorded step.
#[derive(Clone)]
pub struct VirtualPeersHandle {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for VirtualPeersHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualPeersHandle").finish_non_exhaustive()
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock leaves plain data behind; keep going with it.
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl VirtualPeers {
    /// Rank `rank` of the world `layout` describes, timing segments on `clock`, reporting
    /// them to `reporter` if given.
    pub fn new(
        rank: usize,
        layout: Layout,
        clock: Arc<dyn Clock>,
        reporter: Option<RankReporter>,
    ) -> (VirtualPeers, VirtualPeersHandle) {
        let world = layout.world_size() as usize;
        let since = clock.now_seconds();
        let state = Arc::new(Mutex::new(State {
            rank,
            world,
            layout,
            clock,
            since,
            recording: false,
            ops: Vec::new(),
            segments: 0,
            reporter,
            sent: HashMap::new(),
            received: HashMap::new(),
            error: None,
        }));
        (
            VirtualPeers {
                state: Arc::clone(&state),
                rank,
                world,
                real: None,
            },
            VirtualPeersHandle { state },
        )
    }
}

impl VirtualPeersHandle {
    /// From now on, segments and operations are recorded (and reported). Message counts
    /// restart, so tags number the step's own messages.
    pub fn start(&self) {
        let mut s = lock(&self.state);
        s.recording = true;
        s.ops.clear();
        s.segments = 0;
        s.sent.clear();
        s.received.clear();
        s.since = s.clock.now_seconds();
        memory::reset_thread_peak();
    }

    /// The step is over: records its last segment and returns the record. Must be called
    /// on the rank's thread (the memory figures are the calling thread's).
    pub fn finish(&self) -> RankRecord {
        // The last segment's record and the report are the communicator's memory.
        memory::uncounted(|| {
            let mut s = lock(&self.state);
            // A stopped emulation has nothing more to take; the record is still the rank's.
            let _ = s.segment_ends();
            s.recording = false;
            if let Some(r) = &s.reporter {
                let _ = r.done();
            }
            RankRecord {
                rank: s.rank as u32,
                ops: std::mem::take(&mut s.ops),
            }
        })
    }

    /// Why reporting failed, if it did (the coordinator stopped).
    pub fn error(&self) -> Option<String> {
        lock(&self.state).error.clone()
    }
}

/// Small deterministic values for a synthesised message (splitmix64 of the seed, mapped to
/// [-0.02, 0.02)).
fn synthesise(buf: &mut [f32], seed: u64) {
    let mut z = seed;
    for v in buf {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        *v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04;
    }
}

/// Set in the recorded tag of a tagged message (`Communicator::send_f32_tagged`): the program's
/// own tag below it. The tags of untagged messages (their place in the pair's order) stay far
/// below, so the two kinds never meet in the stitched graph.
const PROGRAM_TAG: u64 = 1 << 63;

/// Which message of a pair: its place in the pair's order (untagged), or its tag.
#[derive(Debug, Clone, Copy)]
enum Message {
    Place(u64),
    Tag(u64),
}

/// A tagged message as recorded: a send to `peer` or a receive from it, of `len` floats.
fn tagged_message(send: bool, peer: usize, len: usize, tag: u64) -> RecordedOp {
    let (peer, bytes, tag) = (peer as u32, Bytes(4 * len as u64), PROGRAM_TAG | tag);
    if send {
        RecordedOp::Send {
            peer,
            bytes,
            tag,
            duration: Picos::ZERO,
        }
    } else {
        RecordedOp::Recv {
            peer,
            bytes,
            tag,
            duration: Picos::ZERO,
        }
    }
}

/// The other real ranks of an emulation and the communicator that reaches them.
struct RealPeers {
    comm: Box<dyn Communicator>,
    /// World ranks of the real ranks, ascending; a real rank's index here is its rank on
    /// `comm`.
    ranks: Vec<usize>,
}

impl RealPeers {
    fn index(&self, world_rank: usize) -> Option<usize> {
        self.ranks.binary_search(&world_rank).ok()
    }
}

/// How a group's members split between real ranks (with their index on the real
/// communicator) and virtual ones.
struct Split {
    /// For each member, in group order, its index among the real members (`None`:
    /// virtual).
    real_pos: Vec<Option<usize>>,
    /// The real members' indices on the real communicator, in group order.
    inner: Vec<usize>,
}

impl Split {
    /// Whether other real ranks are in the group (this one is, if it is real).
    fn has_real_peers(&self) -> bool {
        self.inner.len() > 1
    }

    /// The real members as a group of the real communicator.
    fn inner_group(&self, real: &RealPeers) -> Result<Group, CommError> {
        Group::new(self.inner.clone(), real.ranks.len()).map_err(|_| CommError::BadPeer {
            peer: self.inner.iter().copied().max().unwrap_or(0),
            world: real.ranks.len(),
        })
    }

    /// Member `k`'s contribution among `parts` (one `len`-long piece per real member): its
    /// own if real, else the first real member's.
    fn contribution<'b>(&self, parts: &'b [f32], len: usize, k: usize) -> &'b [f32] {
        let at = self.real_pos[k].unwrap_or(0);
        &parts[at * len..(at + 1) * len]
    }
}

impl VirtualPeers {
    /// Like [`VirtualPeers::new`], with the other real ranks of the emulation reachable
    /// through `real` (a communicator over the real ranks `real_ranks`, ascending, this
    /// rank among them): operations among real ranks carry real data.
    pub fn with_real_peers(
        rank: usize,
        layout: Layout,
        clock: Arc<dyn Clock>,
        reporter: Option<RankReporter>,
        real: Box<dyn Communicator>,
        real_ranks: Vec<usize>,
    ) -> (VirtualPeers, VirtualPeersHandle) {
        let (mut v, h) = VirtualPeers::new(rank, layout, clock, reporter);
        v.real = Some(RealPeers {
            comm: real,
            ranks: real_ranks,
        });
        (v, h)
    }

    fn split(&self, members: &[usize]) -> Split {
        let mut real_pos = Vec::with_capacity(members.len());
        let mut inner = Vec::new();
        for &m in members {
            match self.real.as_ref().and_then(|r| r.index(m)) {
                Some(i) => {
                    real_pos.push(Some(inner.len()));
                    inner.push(i);
                }
                None => real_pos.push(None),
            }
        }
        Split { real_pos, inner }
    }

    /// Runs `f` on the real peers, if there are any (inside an operation, so what it
    /// allocates is not counted as the program's).
    fn on_real<T>(
        &mut self,
        f: impl FnOnce(&mut RealPeers) -> Result<T, CommError>,
    ) -> Result<Option<T>, CommError> {
        let Some(real) = self.real.as_mut() else {
            return Ok(None);
        };
        f(real).map(Some)
    }

    /// Runs `f` on the real communicator with `world_rank`'s index there, if that rank is
    /// real (nothing otherwise), with [`VirtualPeers::on_real`]'s accounting.
    fn with_real_rank(
        &mut self,
        world_rank: usize,
        f: impl FnOnce(&mut dyn Communicator, usize) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        self.on_real(|r| match r.index(world_rank) {
            Some(i) => f(r.comm.as_mut(), i),
            None => Ok(()),
        })
        .map(drop)
    }

    /// Ends the segment (before an operation of `bytes_before`, if known), runs the
    /// operation `f`, and records `op` (given what `f` returned) as its end.
    fn operation<T>(
        &mut self,
        bytes_before: Option<u64>,
        f: impl FnOnce(&mut Self) -> Result<T, CommError>,
        op: impl FnOnce(&State, &T) -> RecordedOp,
    ) -> Result<T, CommError> {
        memory::uncounted(|| {
            lock(&self.state).segment_ends_before(bytes_before)?;
            let out = f(self)?;
            let mut s = lock(&self.state);
            let op = op(&s, &out);
            s.op_ends(op);
            Ok(out)
        })
    }

    /// The all-reduce over `members` (group order) of `buf`.
    fn reduce(&mut self, members: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        let split = self.split(members);
        if !split.has_real_peers() {
            // Every member contributes this rank's values: sum them in place, in order.
            for v in buf.iter_mut() {
                let x = *v;
                for _ in 1..members.len() {
                    *v += x;
                }
            }
            return Ok(());
        }
        let len = buf.len();
        let mut parts = vec![0.0; len * split.inner.len()];
        let group = self
            .real
            .as_ref()
            .map(|r| split.inner_group(r))
            .transpose()?;
        if let Some(group) = group {
            self.on_real(|r| r.comm.group_all_gather_f32(&group, buf, &mut parts))?;
        }
        let mut acc = split.contribution(&parts, len, 0).to_vec();
        for k in 1..members.len() {
            for (a, x) in acc.iter_mut().zip(split.contribution(&parts, len, k)) {
                *a += *x;
            }
        }
        buf.copy_from_slice(&acc);
        Ok(())
    }

    /// A receive from `src` (the `seq`-th from it): real if `src` is real, else synthesised.
    /// The message `which` from `src` into `buf`: over the real peers when `src` is real,
    /// otherwise small deterministic values seeded by the pair and the message's place or tag.
    fn receive(&mut self, src: usize, which: Message, buf: &mut [f32]) -> Result<(), CommError> {
        let real_src = self.real.as_ref().and_then(|r| r.index(src));
        match (real_src, which) {
            (Some(i), Message::Place(_)) => {
                self.on_real(|r| r.comm.recv_f32(i, buf))?;
            }
            (Some(i), Message::Tag(tag)) => {
                self.on_real(|r| r.comm.recv_f32_tagged(i, tag, buf))?;
            }
            (None, which) => {
                let key = match which {
                    Message::Place(seq) => seq,
                    Message::Tag(tag) => tag ^ PROGRAM_TAG,
                };
                synthesise(buf, ((src as u64) << 40) ^ ((self.rank as u64) << 20) ^ key);
            }
        }
        Ok(())
    }
}

impl Communicator for VirtualPeers {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let members: Vec<usize> = (0..self.world).collect();
        let bytes = 4 * buf.len() as u64;
        self.operation(
            None,
            |v| v.reduce(&members, buf),
            |_, _| world_collective(CollectiveOp::AllReduce, bytes),
        )
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        check_root(root, self.world)?;
        let bytes = 4 * buf.len() as u64;
        // A real root sends its data to the real ranks; a virtual root's copy is each
        // rank's own (equal at initialisation).
        self.operation(
            None,
            |v| v.with_real_rank(root, |c, i| c.broadcast_f32(i, buf)),
            |_, _| world_collective(CollectiveOp::Broadcast, bytes),
        )
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        check_root(root, self.world)?;
        self.operation(
            None,
            |v| {
                v.with_real_rank(root, |c, i| c.broadcast_bytes(i, buf))?;
                Ok(buf.len() as u64)
            },
            |_, &bytes| world_collective(CollectiveOp::Broadcast, bytes),
        )
        .map(drop)
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let world = self.world;
        self.operation(
            None,
            |v| {
                let real = v.on_real(|r| Ok((r.comm.all_gather_bytes(mine)?, r.ranks.clone())))?;
                // Real ranks' parts are theirs; a virtual rank's is the first real rank's
                // (this rank's own without real peers), the same on every real rank.
                Ok((0..world)
                    .map(|m| {
                        real.as_ref()
                            .and_then(|(parts, ranks)| {
                                parts.get(ranks.binary_search(&m).unwrap_or(0))
                            })
                            .cloned()
                            .unwrap_or_else(|| mine.to_vec())
                    })
                    .collect())
            },
            |_, _| world_collective(CollectiveOp::AllGather, (mine.len() * world) as u64),
        )
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.operation(
            None,
            |v| v.on_real(|r| r.comm.barrier()).map(drop),
            |_, _| world_collective(CollectiveOp::AllReduce, 0),
        )
    }

    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError> {
        lock(&self.state).check_peer(dest)?;
        // The pair's counters are the communicator's memory, not the program's.
        let seq = memory::uncounted(|| lock(&self.state).next_sent(dest));
        self.operation(
            None,
            |v| v.with_real_rank(dest, |c, d| c.send_f32(d, buf)),
            |s, _| RecordedOp::Send {
                peer: dest as u32,
                bytes: Bytes(4 * buf.len() as u64),
                tag: s.tag(s.rank, dest, seq),
                duration: Picos::ZERO,
            },
        )
    }

    fn sends_never_wait(&self) -> bool {
        self.real.as_ref().is_none_or(|r| r.comm.sends_never_wait())
    }

    fn send_f32_tagged(&mut self, dest: usize, tag: u64, buf: &[f32]) -> Result<(), CommError> {
        lock(&self.state).check_peer(dest)?;
        self.operation(
            None,
            |v| v.with_real_rank(dest, |c, d| c.send_f32_tagged(d, tag, buf)),
            |_, _| tagged_message(true, dest, buf.len(), tag),
        )
    }

    fn recv_f32_tagged(&mut self, src: usize, tag: u64, buf: &mut [f32]) -> Result<(), CommError> {
        lock(&self.state).check_peer(src)?;
        let len = buf.len();
        self.operation(
            None,
            |v| v.receive(src, Message::Tag(tag), buf),
            |_, _| tagged_message(false, src, len, tag),
        )
    }

    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError> {
        lock(&self.state).check_peer(src)?;
        let seq = memory::uncounted(|| lock(&self.state).next_received(src));
        let bytes = 4 * buf.len() as u64;
        self.operation(
            None,
            |v| v.receive(src, Message::Place(seq), buf),
            |s, _| RecordedOp::Recv {
                peer: src as u32,
                bytes: Bytes(bytes),
                tag: s.tag(src, s.rank, seq),
                duration: Picos::ZERO,
            },
        )
    }

    fn send_recv_f32(
        &mut self,
        dest: usize,
        send: &[f32],
        src: usize,
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        // The pair's counters and the records are the communicator's memory.
        memory::uncounted(|| {
            let (sseq, rseq) = {
                let mut s = lock(&self.state);
                s.check_peer(dest)?;
                s.check_peer(src)?;
                (s.next_sent(dest), s.next_received(src))
            };
            let (real_dest, real_src) = match self.real.as_ref() {
                Some(r) => (r.index(dest), r.index(src)),
                None => (None, None),
            };
            // One segment ends; the send and the receive are recorded back to back, as
            // [`Recorded`] records them.
            lock(&self.state).segment_ends()?;
            match (real_dest, real_src) {
                (Some(d), Some(r)) => {
                    self.on_real(|p| p.comm.send_recv_f32(d, send, r, recv))?;
                }
                (Some(d), None) => {
                    self.on_real(|p| p.comm.send_f32(d, send))?;
                    self.receive(src, Message::Place(rseq), recv)?;
                }
                (None, _) => self.receive(src, Message::Place(rseq), recv)?,
            }
            let mut s = lock(&self.state);
            let ops = send_recv_ops(&s, dest, send.len(), sseq, src, recv.len(), rseq);
            s.ops_end(ops);
            Ok(())
        })
    }

    fn group_all_reduce_sum_f32(
        &mut self,
        group: &Group,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        group.position_of(self.rank)?;
        let bytes = 4 * buf.len() as u64;
        self.operation(
            None,
            |v| v.reduce(group.ranks(), buf),
            |_, _| collective(CollectiveOp::AllReduce, State::members(group), bytes),
        )
    }

    fn group_reduce_scatter_sum_f32(
        &mut self,
        group: &Group,
        buf: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let me = group.position_of(self.rank)?;
        check_reduce_scatter(group, buf, out)?;
        // Recorded at the size of the whole buffer, as the graph builder sizes its
        // reduce-scatters (the network model takes each member's share of it).
        let bytes = 4 * buf.len() as u64;
        self.operation(
            None,
            |v| {
                // The all-reduce's sum, of which the rank keeps its piece: the same
                // contributions (real members' own, virtual members' the first real one's),
                // summed in group order, as every real member computes it.
                let mut sum = buf.to_vec();
                v.reduce(group.ranks(), &mut sum)?;
                let m = out.len();
                out.copy_from_slice(&sum[me * m..(me + 1) * m]);
                Ok(())
            },
            |_, _| collective(CollectiveOp::ReduceScatter, State::members(group), bytes),
        )
    }

    fn group_all_gather_f32(
        &mut self,
        group: &Group,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        group.position_of(self.rank)?;
        check_all_gather(group, mine, out)?;
        let bytes = 4 * out.len() as u64;
        self.operation(
            None,
            |v| {
                let split = v.split(group.ranks());
                let len = mine.len();
                let mut parts = mine.to_vec();
                if split.has_real_peers() {
                    parts = vec![0.0; len * split.inner.len()];
                    let inner = v.real.as_ref().map(|r| split.inner_group(r)).transpose()?;
                    if let Some(inner) = inner {
                        v.on_real(|r| r.comm.group_all_gather_f32(&inner, mine, &mut parts))?;
                    }
                }
                for (k, part) in out.chunks_mut(len.max(1)).enumerate().take(group.len()) {
                    part.copy_from_slice(split.contribution(&parts, len, k));
                }
                Ok(())
            },
            |_, _| collective(CollectiveOp::AllGather, State::members(group), bytes),
        )
    }

    fn group_all_to_all_v_f32(
        &mut self,
        group: &Group,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let me = group.position_of(self.rank)?;
        let (so, ro) = all_to_all_v_offsets(group, send, send_counts, recv, recv_counts)?;
        let routed_like_me = self
            .split(group.ranks())
            .real_pos
            .iter()
            .any(Option::is_none);
        let bytes = 4 * busiest_member_elements(send_counts, recv_counts, routed_like_me) as u64;
        // The router's choices size this exchange: the engine replays it at this size.
        self.operation(
            Some(bytes),
            |v| {
                let split = v.split(group.ranks());
                // Virtual members send what this rank sends itself: every member routes as
                // this rank's router does (see the module docs). The rank's own share is
                // repeated (or cut) to the count expected from each; if the rank sends
                // itself nothing, virtual members send zeros (a token routed to a virtual
                // member's expert then gets a zero output: finite, and the shapes hold).
                let own = &send[so[me]..so[me + 1]];
                for j in 0..group.len() {
                    if split.real_pos[j].is_some() && j != me {
                        continue;
                    }
                    let into = &mut recv[ro[j]..ro[j + 1]];
                    if own.is_empty() {
                        into.fill(0.0);
                    } else {
                        for (x, y) in into.iter_mut().zip(own.iter().cycle()) {
                            *x = *y;
                        }
                    }
                }
                if !split.has_real_peers() {
                    return Ok(());
                }
                // Real members: a real exchange among them.
                let members: Vec<usize> = (0..group.len())
                    .filter(|&j| split.real_pos[j].is_some())
                    .collect();
                let sub_send: Vec<f32> = members
                    .iter()
                    .flat_map(|&j| send[so[j]..so[j + 1]].iter().copied())
                    .collect();
                let sub_sc: Vec<usize> = members.iter().map(|&j| send_counts[j]).collect();
                let sub_rc: Vec<usize> = members.iter().map(|&j| recv_counts[j]).collect();
                let mut sub_recv = vec![0.0; sub_rc.iter().sum()];
                let inner = v.real.as_ref().map(|r| split.inner_group(r)).transpose()?;
                if let Some(inner) = inner {
                    v.on_real(|r| {
                        r.comm.group_all_to_all_v_f32(
                            &inner,
                            &sub_send,
                            &sub_sc,
                            &mut sub_recv,
                            &sub_rc,
                        )
                    })?;
                }
                let mut at = 0;
                for (&j, &rc) in members.iter().zip(&sub_rc) {
                    recv[ro[j]..ro[j] + rc].copy_from_slice(&sub_recv[at..at + rc]);
                    at += rc;
                }
                Ok(())
            },
            |_, _| collective(CollectiveOp::AllToAll, State::members(group), bytes),
        )
    }
}

/// The elements an all-to-all moves through its busiest member, as far as one member can
/// tell from its own counts: the larger of what it sends and what it receives, so that the
/// replay, which lets an exchange last as long as its largest member's size takes, sees a
/// member flooded by the others.
///
/// With `routed_like_me` (some members are virtual, and every member is taken to route as
/// this one does), the member this one sends the most to receives that share from every
/// member, and the member it receives the most from sends that much to every member (as
/// when the results of a favoured expert go back): `members` times the largest share
/// either way. A router that favours one expert thus
/// slows the exchange as a real world's would; an even one changes nothing (`members`
/// times an even share is the whole). An approximation: members' routers differ in a real
/// world, and the network model sees one size per member, not the pattern of shares.
fn busiest_member_elements(
    send_counts: &[usize],
    recv_counts: &[usize],
    routed_like_me: bool,
) -> usize {
    let own = send_counts
        .iter()
        .sum::<usize>()
        .max(recv_counts.iter().sum::<usize>());
    if !routed_like_me {
        return own;
    }
    let widest = send_counts
        .iter()
        .chain(recv_counts)
        .copied()
        .max()
        .unwrap_or(0);
    own.max(widest * send_counts.len())
}

/// A send to `dest` followed at once by a receive from `src` (the `sseq`-th and `rseq`-th
/// message of their pairs), as both communicators record a send-and-receive.
fn send_recv_ops(
    s: &State,
    dest: usize,
    send_len: usize,
    sseq: u64,
    src: usize,
    recv_len: usize,
    rseq: u64,
) -> [RecordedOp; 2] {
    [
        RecordedOp::Send {
            peer: dest as u32,
            bytes: Bytes(4 * send_len as u64),
            tag: s.tag(s.rank, dest, sseq),
            duration: Picos::ZERO,
        },
        RecordedOp::Recv {
            peer: src as u32,
            bytes: Bytes(4 * recv_len as u64),
            tag: s.tag(src, s.rank, rseq),
            duration: Picos::ZERO,
        },
    ]
}

/// A world root outside the world is refused, as by every communicator.
fn check_root(root: usize, world: usize) -> Result<(), CommError> {
    if root < world {
        Ok(())
    } else {
        Err(CommError::BadRoot { root, world })
    }
}

/// A real communicator that records like [`VirtualPeers`]: every operation is carried out by
/// the wrapped communicator (real data between real ranks) and recorded with its segment,
/// so that a run with every rank real can be compared with its emulation. What the wrapped
/// communicator's calls allocate (the backend's buffers, messages one thread allocates and
/// another frees) is [`memory::uncounted`], as in [`VirtualPeers`], so that both runs
/// measure the program's own memory.
pub struct Recorded<C: Communicator> {
    inner: C,
    state: Arc<Mutex<State>>,
}

impl<C: Communicator> std::fmt::Debug for Recorded<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorded")
            .field("rank", &self.inner.rank())
            .finish_non_exhaustive()
    }
}

impl<C: Communicator> Recorded<C> {
    /// Wraps `inner`, a rank of the world `layout` describes, timing segments on `clock`.
    pub fn new(
        inner: C,
        layout: Layout,
        clock: Arc<dyn Clock>,
    ) -> (Recorded<C>, VirtualPeersHandle) {
        let (v, handle) = VirtualPeers::new(inner.rank(), layout, clock, None);
        (
            Recorded {
                inner,
                state: v.state,
            },
            handle,
        )
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Runs `f` on the inner communicator between the end of a segment and the records
    /// `ops` makes. What the call allocates (the backend's buffers and messages, the
    /// records) is not the program's: it is [`memory::uncounted`].
    fn around<T, R: IntoIterator<Item = RecordedOp>>(
        &mut self,
        ops: impl FnOnce(&mut State) -> R,
        f: impl FnOnce(&mut C) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        memory::uncounted(|| {
            let clock = {
                let mut s = self.state();
                s.segment_ends()?;
                s.clock.clone()
            };
            let started = clock.now_seconds();
            let out = f(&mut self.inner)?;
            let took = Picos::from_secs_f64((clock.now_seconds() - started).max(0.0));
            let mut s = self.state();
            let ops = ops(&mut s);
            s.ops_end(ops.into_iter().map(|o| timed(o, took)));
            Ok(out)
        })
    }
}

impl<C: Communicator> Recorded<C> {
    /// Runs the group collective `f` on the inner communicator, recorded as `op` over
    /// `group` moving `bytes`.
    fn group_collective(
        &mut self,
        op: CollectiveOp,
        group: &Group,
        bytes: u64,
        f: impl FnOnce(&mut C) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let members = State::members(group);
        self.around(|_| [collective(op, members, bytes)], f)
    }
}

/// `op` with the time the rank spent in it: waiting for its peers and the transfer (a
/// send-and-receive's two halves each get the pair's time).
fn timed(mut op: RecordedOp, took: Picos) -> RecordedOp {
    if let Some(d) = op.communication_time_mut() {
        *d = took;
    }
    op
}

/// A collective over every rank, recorded by its role alone (no member list), as
/// [`VirtualPeers`] records one.
fn world_collective(op: CollectiveOp, bytes: u64) -> RecordedOp {
    RecordedOp::Collective {
        op,
        group: Vec::new(),
        role: Some(GroupRole::World),
        bytes: Bytes(bytes),
        duration: Picos::ZERO,
    }
}

fn collective(op: CollectiveOp, group: Vec<u32>, bytes: u64) -> RecordedOp {
    RecordedOp::Collective {
        op,
        group,
        role: None,
        bytes: Bytes(bytes),
        duration: Picos::ZERO,
    }
}

impl<C: Communicator> Communicator for Recorded<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |_| [world_collective(CollectiveOp::AllReduce, bytes)],
            |c| c.all_reduce_sum_f32(buf),
        )
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |_| [world_collective(CollectiveOp::Broadcast, bytes)],
            |c| c.broadcast_f32(root, buf),
        )
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        let bytes = buf.len() as u64;
        self.around(
            |_| [world_collective(CollectiveOp::Broadcast, bytes)],
            |c| c.broadcast_bytes(root, buf),
        )
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let bytes = (mine.len() * self.inner.world_size()) as u64;
        self.around(
            |_| [world_collective(CollectiveOp::AllGather, bytes)],
            |c| c.all_gather_bytes(mine),
        )
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.around(
            |_| [world_collective(CollectiveOp::AllReduce, 0)],
            |c| c.barrier(),
        )
    }

    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |s| {
                let seq = s.next_sent(dest);
                [RecordedOp::Send {
                    peer: dest as u32,
                    bytes: Bytes(bytes),
                    tag: s.tag(s.rank, dest, seq),
                    duration: Picos::ZERO,
                }]
            },
            |c| c.send_f32(dest, buf),
        )
    }

    fn sends_never_wait(&self) -> bool {
        self.inner.sends_never_wait()
    }

    fn send_f32_tagged(&mut self, dest: usize, tag: u64, buf: &[f32]) -> Result<(), CommError> {
        let len = buf.len();
        self.around(
            |_| [tagged_message(true, dest, len, tag)],
            |c| c.send_f32_tagged(dest, tag, buf),
        )
    }

    fn recv_f32_tagged(&mut self, src: usize, tag: u64, buf: &mut [f32]) -> Result<(), CommError> {
        let len = buf.len();
        self.around(
            |_| [tagged_message(false, src, len, tag)],
            |c| c.recv_f32_tagged(src, tag, buf),
        )
    }

    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |s| {
                let seq = s.next_received(src);
                [RecordedOp::Recv {
                    peer: src as u32,
                    bytes: Bytes(bytes),
                    tag: s.tag(src, s.rank, seq),
                    duration: Picos::ZERO,
                }]
            },
            |c| c.recv_f32(src, buf),
        )
    }

    fn send_recv_f32(
        &mut self,
        dest: usize,
        send: &[f32],
        src: usize,
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        // Recorded as the send and the receive it is, carried out together (so that the
        // inner communicator may overlap them).
        let (send_len, recv_len) = (send.len(), recv.len());
        self.around(
            |s| {
                let (sseq, rseq) = (s.next_sent(dest), s.next_received(src));
                send_recv_ops(s, dest, send_len, sseq, src, recv_len, rseq)
            },
            |c| c.send_recv_f32(dest, send, src, recv),
        )
    }

    fn group_all_reduce_sum_f32(
        &mut self,
        group: &Group,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.group_collective(CollectiveOp::AllReduce, group, bytes, |c| {
            c.group_all_reduce_sum_f32(group, buf)
        })
    }

    fn group_reduce_scatter_sum_f32(
        &mut self,
        group: &Group,
        buf: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.group_collective(CollectiveOp::ReduceScatter, group, bytes, |c| {
            c.group_reduce_scatter_sum_f32(group, buf, out)
        })
    }

    fn group_all_gather_f32(
        &mut self,
        group: &Group,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let bytes = 4 * out.len() as u64;
        self.group_collective(CollectiveOp::AllGather, group, bytes, |c| {
            c.group_all_gather_f32(group, mine, out)
        })
    }

    fn group_all_to_all_v_f32(
        &mut self,
        group: &Group,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let bytes = 4 * busiest_member_elements(send_counts, recv_counts, false) as u64;
        self.group_collective(CollectiveOp::AllToAll, group, bytes, |c| {
            c.group_all_to_all_v_f32(group, send, send_counts, recv, recv_counts)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orrery_graph::collect::stitch;
    use orrery_graph::OpKind;
    use orrery_train::{FixedClock, ThreadComm};

    /// TP 2 × PP 2 on one node of 4.
    fn layout() -> Layout {
        Layout::from_dims(2, 1, 1, 2, 1, 4)
    }

    fn tp_group(rank: usize) -> Group {
        let members = layout()
            .group_members(RankId(rank as u32), GroupRole::Tp)
            .iter()
            .map(|r| r.0 as usize)
            .collect();
        Group::new(members, 4).unwrap()
    }

    /// The recorded collectives: kind, group and bytes.
    fn collectives(record: &RankRecord) -> Vec<(CollectiveOp, Vec<u32>, u64)> {
        record
            .ops
            .iter()
            .filter_map(|op| match op {
                RecordedOp::Collective {
                    op, group, bytes, ..
                } => Some((*op, group.clone(), bytes.0)),
                _ => None,
            })
            .collect()
    }

    /// Alone among virtual peers, a member of a group of two gets twice its own piece (both
    /// members contribute its data), and the operation is recorded as a reduce-scatter of the
    /// whole buffer over the group.
    #[test]
    fn virtual_reduce_scatter_is_the_synthesised_all_reduce_s_piece() {
        let (mut v, handle) = VirtualPeers::new(1, layout(), Arc::new(FixedClock), None);
        handle.start();
        let group = tp_group(1);
        assert_eq!(group.ranks(), &[0, 1]);
        let buf = [1.0f32, 2.0, 3.0, 4.0];
        let mut out = [0.0f32; 2];
        v.group_reduce_scatter_sum_f32(&group, &buf, &mut out)
            .unwrap();
        assert_eq!(out, [6.0, 8.0]);
        // Consistent with the all-reduce it synthesises: the same sum, this member's piece.
        let mut all = buf;
        v.group_all_reduce_sum_f32(&group, &mut all).unwrap();
        assert_eq!(&all[2..], &out);
        assert!(matches!(
            v.group_reduce_scatter_sum_f32(&group, &buf, &mut [0.0; 3]),
            Err(CommError::CountMismatch { .. })
        ));
        let outside = Group::new(vec![2, 3], 4).unwrap();
        assert!(matches!(
            v.group_reduce_scatter_sum_f32(&outside, &buf, &mut out),
            Err(CommError::NotInGroup { rank: 1, .. })
        ));
        let record = handle.finish();
        assert_eq!(
            collectives(&record),
            vec![
                (CollectiveOp::ReduceScatter, vec![0, 1], 16),
                (CollectiveOp::AllReduce, vec![0, 1], 16),
            ]
        );
    }

    /// Data parallelism 4 with expert parallelism over all four ranks, on one node.
    fn ep_layout() -> Layout {
        Layout::from_dims(1, 1, 4, 1, 4, 4)
    }

    /// Alone among virtual peers, an expert all-to-all receives from every member what the
    /// rank routes to itself, as if every member's router chose as this one did: a rank
    /// whose own expert is favoured receives that share four times over, and the exchange
    /// is sized by the busiest member under the same model.
    #[test]
    fn virtual_all_to_all_members_route_as_the_real_rank_does() {
        let (mut v, handle) = VirtualPeers::new(1, ep_layout(), Arc::new(FixedClock), None);
        handle.start();
        let group = Group::new(vec![0, 1, 2, 3], 4).unwrap();
        // Row counts (width 1): 1 row to member 0, 5 to itself, none to 2, 2 to 3.
        let counts = [1.0f32, 5.0, 0.0, 2.0];
        let mut got = [0.0f32; 4];
        v.group_all_to_all_v_f32(&group, &counts, &[1; 4], &mut got, &[1; 4])
            .unwrap();
        assert_eq!(got, [5.0; 4]);
        // The rows themselves (width 2): every member sends the rank's own five rows.
        let send: Vec<f32> = (0..16).map(|k| k as f32).collect();
        let own = &send[2..12];
        let mut recv = vec![-1.0f32; 40];
        v.group_all_to_all_v_f32(&group, &send, &[2, 10, 0, 4], &mut recv, &[10; 4])
            .unwrap();
        for piece in recv.chunks(10) {
            assert_eq!(piece, own);
        }
        // The results back: each member returns as many rows as it was sent, the rank's own
        // results repeated; a member sent nothing returns nothing.
        let results: Vec<f32> = (0..40).map(|k| 100.0 + k as f32).collect();
        let mut back = vec![-1.0f32; 16];
        v.group_all_to_all_v_f32(&group, &results, &[10; 4], &mut back, &[2, 10, 0, 4])
            .unwrap();
        assert_eq!(&back[..2], &results[10..12]);
        assert_eq!(&back[2..12], &results[10..20]);
        assert_eq!(&back[12..], &results[10..14]);
        let record = handle.finish();
        // Counts: one element each way per member. Rows: the rank sends 16 elements and
        // receives 40; under the model member 1 (itself) receives 4 x 10. Results: the
        // same exchange the other way.
        let sizes: Vec<u64> = collectives(&record).iter().map(|c| c.2).collect();
        assert_eq!(sizes, vec![4 * 4, 4 * 40, 4 * 40]);
    }

    /// The exchange's size: the busier direction of the member, and with virtual members
    /// `members` times the largest share; an even router changes nothing.
    #[test]
    fn busiest_member_follows_the_largest_share() {
        assert_eq!(
            busiest_member_elements(&[3, 3, 3, 3], &[3, 3, 3, 3], true),
            12
        );
        assert_eq!(
            busiest_member_elements(&[3, 3, 3, 3], &[3, 3, 3, 3], false),
            12
        );
        // A favoured member: it receives 9 from each of 4.
        assert_eq!(
            busiest_member_elements(&[9, 1, 1, 1], &[3, 3, 3, 3], true),
            36
        );
        // Every member real: only what this member moves itself.
        assert_eq!(
            busiest_member_elements(&[9, 1, 1, 1], &[3, 3, 3, 3], false),
            12
        );
        assert_eq!(busiest_member_elements(&[1, 1], &[5, 9], false), 14);
        assert_eq!(busiest_member_elements(&[], &[], true), 0);
    }

    /// With another real member, the reduce-scatter carries real data: each member gets its
    /// piece of the real sum.
    #[test]
    fn virtual_reduce_scatter_among_real_ranks_sums_their_data() {
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = ThreadComm::group(2)
                .into_iter()
                .enumerate()
                .map(|(i, real)| {
                    s.spawn(move || {
                        let (mut v, _handle) = VirtualPeers::with_real_peers(
                            i,
                            layout(),
                            Arc::new(FixedClock),
                            None,
                            Box::new(real),
                            vec![0, 1],
                        );
                        let buf: Vec<f32> = (0..4).map(|k| (10 * i + k) as f32).collect();
                        let mut out = vec![0.0f32; 2];
                        v.group_reduce_scatter_sum_f32(&tp_group(i), &buf, &mut out)
                            .unwrap();
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(outs, vec![vec![10.0, 12.0], vec![14.0, 16.0]]);
    }

    /// Around real communicators, a reduce-scatter and an all-gather in the tensor-parallel
    /// group carry the real data and are recorded so that the records stitch into class
    /// graphs with tensor-parallel collectives of the whole buffer.
    #[test]
    fn recorded_reduce_scatter_and_all_gather_stitch_as_tensor_parallel_collectives() {
        let runs: Vec<(Vec<f32>, RankRecord)> = std::thread::scope(|s| {
            let handles: Vec<_> = ThreadComm::group(4)
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
                        let rank = comm.rank();
                        let (mut c, handle) = Recorded::new(comm, layout(), Arc::new(FixedClock));
                        handle.start();
                        let group = tp_group(rank);
                        let buf: Vec<f32> = (0..4).map(|k| (10 * rank + k) as f32).collect();
                        let mut piece = vec![0.0f32; 2];
                        c.group_reduce_scatter_sum_f32(&group, &buf, &mut piece)
                            .unwrap();
                        let mut whole = vec![0.0f32; 4];
                        c.group_all_gather_f32(&group, &piece, &mut whole).unwrap();
                        (whole, handle.finish())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Ranks 0 and 1: [0, 1, 2, 3] + [10, 11, 12, 13]; ranks 2 and 3 likewise.
        assert_eq!(runs[0].0, vec![10.0, 12.0, 14.0, 16.0]);
        assert_eq!(runs[1].0, runs[0].0);
        assert_eq!(runs[2].0, vec![50.0, 52.0, 54.0, 56.0]);
        assert_eq!(
            collectives(&runs[3].1),
            vec![
                (CollectiveOp::ReduceScatter, vec![2, 3], 16),
                (CollectiveOp::AllGather, vec![2, 3], 16),
            ]
        );
        let records: Vec<RankRecord> = runs.into_iter().map(|(_, r)| r).collect();
        let collected = stitch(layout(), &records).unwrap();
        for graph in &collected.graphs.classes {
            let ops: Vec<(CollectiveOp, GroupRole, u64)> = graph
                .ops()
                .iter()
                .filter_map(|op| match op.kind {
                    OpKind::Collective { op, group, bytes } => Some((op, group, bytes.0)),
                    _ => None,
                })
                .collect();
            assert_eq!(
                ops,
                vec![
                    (CollectiveOp::ReduceScatter, GroupRole::Tp, 16),
                    (CollectiveOp::AllGather, GroupRole::Tp, 16),
                ]
            );
        }
    }
}
