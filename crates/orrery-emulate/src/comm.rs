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
//! - an all-gather fills every member's part with the rank's own;
//! - an all-to-all receives from each member what the rank sends it (so expert traffic is
//!   as large both ways as the real router makes it);
//! - a broadcast keeps the rank's own data (the roots' copies are equal at initialisation);
//! - a send is dropped; a receive is filled with small deterministic values (a virtual
//!   pipeline neighbour's activations or gradients), seeded by the pair and the message's
//!   place in their order.
//!
//! While it runs, it measures: the time between the end of one operation and the start of
//! the next is a compute segment (read from a caller-supplied `orrery_train::Clock`), and
//! with [`crate::memory::CountingAlloc`] installed, the bytes the thread held at the end of
//! the segment and its peak during it. Between [`VirtualPeersHandle::start`] and
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
//! What it does not do: emulate interleaved 1F1B, whose messages carry routing tags in
//! their payload that synthetic data cannot provide (refused by the drivers).

use crate::coordinator::RankReporter;
use crate::memory;
use orrery_graph::collect::{MemorySample, RankRecord, RecordedOp};
use orrery_graph::{CollectiveOp, GroupRole, Layout, PeerStage, Phase};
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
    /// Bytes the wrapped communicator's calls left this thread holding (its own buffers,
    /// and messages allocated here but freed by a peer thread, or the reverse): not the
    /// program's memory, so memory samples leave them out ([`Recorded`] only).
    comm_bytes: i64,
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
        let sample = MemorySample {
            live: Bytes((memory::thread_live() - self.comm_bytes).max(0) as u64),
            peak: Bytes((memory::thread_peak() - self.comm_bytes).max(0) as u64),
        };
        memory::reset_thread_peak();
        self.ops.push(RecordedOp::Compute {
            name: format!("segment {}", self.segments),
            phase: Phase::Forward,
            duration: took,
            memory: Some(sample),
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
        if self.recording {
            self.ops.push(op);
        }
        memory::reset_thread_peak();
        self.since = self.clock.now_seconds();
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

    /// A world collective's member list as recorded: empty, with the role saying "every
    /// rank" (a list of every rank would make records grow with the world).
    fn world_group(&self) -> Vec<u32> {
        Vec::new()
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
            comm_bytes: 0,
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

/// What a call of the real communicator left this thread holding (`before`: the thread's
/// bytes before the call) is the backend's, not the program's: memory samples leave it out.
fn held_by_comm(state: &Mutex<State>, before: i64) {
    let retained = memory::thread_live() - before;
    lock(state).comm_bytes += retained;
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

    /// Every real member's `mine`, gathered over the real communicator (in group order);
    /// just `mine` when this rank is the group's only real member.
    fn gather_real(&mut self, split: &Split, mine: &[f32]) -> Result<Vec<f32>, CommError> {
        if split.inner.len() <= 1 {
            return Ok(mine.to_vec());
        }
        let Some(real) = self.real.as_mut() else {
            return Ok(mine.to_vec());
        };
        let group = Group::new(split.inner.clone(), real.ranks.len()).map_err(|_| {
            CommError::NotInGroup {
                rank: self.rank,
                group: split.inner.clone(),
            }
        })?;
        let mut out = vec![0.0; mine.len() * split.inner.len()];
        let before = memory::thread_live();
        real.comm.group_all_gather_f32(&group, mine, &mut out)?;
        held_by_comm(&self.state, before);
        Ok(out)
    }

    /// Member `k`'s contribution: its own if real, else the first real member's.
    fn contribution<'b>(split: &Split, parts: &'b [f32], len: usize, k: usize) -> &'b [f32] {
        let at = split.real_pos[k].unwrap_or(0);
        &parts[at * len..(at + 1) * len]
    }

    /// The all-reduce over `members` (group order) of `buf`.
    fn reduce(&mut self, members: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        let split = self.split(members);
        let parts = self.gather_real(&split, buf)?;
        let len = buf.len();
        let mut acc = Self::contribution(&split, &parts, len, 0).to_vec();
        for k in 1..members.len() {
            for (a, x) in acc
                .iter_mut()
                .zip(Self::contribution(&split, &parts, len, k))
            {
                *a += *x;
            }
        }
        buf.copy_from_slice(&acc);
        Ok(())
    }

    fn world_members(&self) -> Vec<usize> {
        (0..self.world).collect()
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
        lock(&self.state).segment_ends()?;
        let members = self.world_members();
        self.reduce(&members, buf)?;
        let mut s = lock(&self.state);
        let group = s.world_group();
        s.op_ends(RecordedOp::Collective {
            op: CollectiveOp::AllReduce,
            group,
            role: Some(GroupRole::World),
            bytes: Bytes(4 * buf.len() as u64),
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::BadRoot {
                root,
                world: self.world,
            });
        }
        lock(&self.state).segment_ends()?;
        if let Some(real) = self.real.as_mut() {
            // A real root sends its data to the real ranks; a virtual root's copy is each
            // rank's own (equal at initialisation).
            if let Some(r) = real.index(root) {
                let before = memory::thread_live();
                real.comm.broadcast_f32(r, buf)?;
                held_by_comm(&self.state, before);
            }
        }
        let mut s = lock(&self.state);
        let group = s.world_group();
        s.op_ends(RecordedOp::Collective {
            op: CollectiveOp::Broadcast,
            group,
            role: Some(GroupRole::World),
            bytes: Bytes(4 * buf.len() as u64),
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::BadRoot {
                root,
                world: self.world,
            });
        }
        lock(&self.state).segment_ends()?;
        if let Some(real) = self.real.as_mut() {
            if let Some(r) = real.index(root) {
                let before = memory::thread_live();
                real.comm.broadcast_bytes(r, buf)?;
                held_by_comm(&self.state, before);
            }
        }
        let mut s = lock(&self.state);
        let group = s.world_group();
        s.op_ends(RecordedOp::Collective {
            op: CollectiveOp::Broadcast,
            group,
            role: Some(GroupRole::World),
            bytes: Bytes(buf.len() as u64),
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        lock(&self.state).segment_ends()?;
        let real_parts = match self.real.as_mut() {
            Some(real) => {
                let before = memory::thread_live();
                let parts = real.comm.all_gather_bytes(mine)?;
                held_by_comm(&self.state, before);
                Some((parts, real.ranks.clone()))
            }
            None => None,
        };
        let out: Vec<Vec<u8>> = (0..self.world)
            .map(|m| match &real_parts {
                Some((parts, ranks)) => {
                    let at = ranks.binary_search(&m).unwrap_or(0);
                    parts.get(at).cloned().unwrap_or_else(|| mine.to_vec())
                }
                None => mine.to_vec(),
            })
            .collect();
        let mut s = lock(&self.state);
        let group = s.world_group();
        s.op_ends(RecordedOp::Collective {
            op: CollectiveOp::AllGather,
            group,
            role: Some(GroupRole::World),
            bytes: Bytes((mine.len() * self.world) as u64),
            duration: Picos::ZERO,
        });
        Ok(out)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        lock(&self.state).segment_ends()?;
        if let Some(real) = self.real.as_mut() {
            let before = memory::thread_live();
            real.comm.barrier()?;
            held_by_comm(&self.state, before);
        }
        let mut s = lock(&self.state);
        let group = s.world_group();
        s.op_ends(RecordedOp::Collective {
            op: CollectiveOp::AllReduce,
            group,
            role: Some(GroupRole::World),
            bytes: Bytes(0),
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError> {
        lock(&self.state).check_peer(dest)?;
        lock(&self.state).segment_ends()?;
        if let Some(real) = self.real.as_mut() {
            if let Some(d) = real.index(dest) {
                let before = memory::thread_live();
                real.comm.send_f32(d, buf)?;
                held_by_comm(&self.state, before);
            }
        }
        let mut s = lock(&self.state);
        let src = s.rank;
        let seq = {
            let n = s.sent.entry(dest).or_insert(0);
            *n += 1;
            *n - 1
        };
        let tag = s.tag(src, dest, seq);
        s.op_ends(RecordedOp::Send {
            peer: dest as u32,
            bytes: Bytes(4 * buf.len() as u64),
            tag,
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn sends_never_wait(&self) -> bool {
        self.real.as_ref().is_none_or(|r| r.comm.sends_never_wait())
    }

    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError> {
        lock(&self.state).check_peer(src)?;
        lock(&self.state).segment_ends()?;
        let real_src = self.real.as_ref().and_then(|r| r.index(src));
        let mut s = lock(&self.state);
        let dst = s.rank;
        let seq = {
            let n = s.received.entry(src).or_insert(0);
            *n += 1;
            *n - 1
        };
        let tag = s.tag(src, dst, seq);
        drop(s);
        let before = memory::thread_live();
        match (real_src, self.real.as_mut()) {
            (Some(i), Some(real)) => real.comm.recv_f32(i, buf)?,
            _ => synthesise(buf, ((src as u64) << 40) ^ ((dst as u64) << 20) ^ seq),
        }
        held_by_comm(&self.state, before);
        lock(&self.state).op_ends(RecordedOp::Recv {
            peer: src as u32,
            bytes: Bytes(4 * buf.len() as u64),
            tag,
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn send_recv_f32(
        &mut self,
        dest: usize,
        send: &[f32],
        src: usize,
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        // One segment ends; the send and the receive are recorded back to back, as
        // [`Recorded`] records them.
        {
            let mut s = lock(&self.state);
            s.check_peer(dest)?;
            s.check_peer(src)?;
            s.segment_ends()?;
        }
        let me = self.rank;
        let (real_dest, real_src) = match self.real.as_ref() {
            Some(r) => (r.index(dest), r.index(src)),
            None => (None, None),
        };
        let (sseq, rseq) = {
            let mut s = lock(&self.state);
            let sseq = {
                let n = s.sent.entry(dest).or_insert(0);
                *n += 1;
                *n - 1
            };
            let rseq = {
                let n = s.received.entry(src).or_insert(0);
                *n += 1;
                *n - 1
            };
            (sseq, rseq)
        };
        let before = memory::thread_live();
        if let Some(real) = self.real.as_mut() {
            match (real_dest, real_src) {
                (Some(d), Some(r)) => real.comm.send_recv_f32(d, send, r, recv)?,
                (Some(d), None) => real.comm.send_f32(d, send)?,
                (None, Some(r)) => real.comm.recv_f32(r, recv)?,
                (None, None) => {}
            }
        }
        held_by_comm(&self.state, before);
        if real_src.is_none() {
            synthesise(recv, ((src as u64) << 40) ^ ((me as u64) << 20) ^ rseq);
        }
        let mut s = lock(&self.state);
        let (stag, rtag) = (s.tag(me, dest, sseq), s.tag(src, me, rseq));
        if s.recording {
            s.ops.push(RecordedOp::Send {
                peer: dest as u32,
                bytes: Bytes(4 * send.len() as u64),
                tag: stag,
                duration: Picos::ZERO,
            });
        }
        s.op_ends(RecordedOp::Recv {
            peer: src as u32,
            bytes: Bytes(4 * recv.len() as u64),
            tag: rtag,
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn group_all_reduce_sum_f32(
        &mut self,
        group: &Group,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        if group.position(self.rank).is_none() {
            return Err(CommError::NotInGroup {
                rank: self.rank,
                group: group.ranks().to_vec(),
            });
        }
        lock(&self.state).segment_ends()?;
        self.reduce(group.ranks(), buf)?;
        lock(&self.state).op_ends(RecordedOp::Collective {
            op: CollectiveOp::AllReduce,
            group: State::members(group),
            role: None,
            bytes: Bytes(4 * buf.len() as u64),
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn group_all_gather_f32(
        &mut self,
        group: &Group,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        if group.position(self.rank).is_none() {
            return Err(CommError::NotInGroup {
                rank: self.rank,
                group: group.ranks().to_vec(),
            });
        }
        if out.len() != mine.len() * group.len() {
            return Err(CommError::CountMismatch {
                what: "out",
                counted: mine.len() * group.len(),
                len: out.len(),
            });
        }
        lock(&self.state).segment_ends()?;
        let split = self.split(group.ranks());
        let parts = self.gather_real(&split, mine)?;
        let len = mine.len();
        for (k, part) in out.chunks_mut(len.max(1)).enumerate().take(group.len()) {
            part.copy_from_slice(Self::contribution(&split, &parts, len, k));
        }
        lock(&self.state).op_ends(RecordedOp::Collective {
            op: CollectiveOp::AllGather,
            group: State::members(group),
            role: None,
            bytes: Bytes(4 * out.len() as u64),
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn group_all_to_all_v_f32(
        &mut self,
        group: &Group,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let Some(me) = group.position(self.rank) else {
            return Err(CommError::NotInGroup {
                rank: self.rank,
                group: group.ranks().to_vec(),
            });
        };
        let n = group.len();
        for (what, counts) in [("send_counts", send_counts), ("recv_counts", recv_counts)] {
            if counts.len() != n {
                return Err(CommError::GroupShape {
                    what,
                    found: counts.len(),
                    members: n,
                });
            }
        }
        for (what, counts, len) in [
            ("send_counts", send_counts, send.len()),
            ("recv_counts", recv_counts, recv.len()),
        ] {
            let counted: usize = counts.iter().sum();
            if counted != len {
                return Err(CommError::CountMismatch { what, counted, len });
            }
        }
        // The router's choices size this exchange: the engine replays it at this size.
        lock(&self.state).segment_ends_before(Some(4 * send.len() as u64))?;
        let offsets = |counts: &[usize]| -> Vec<usize> {
            let mut at = 0;
            counts
                .iter()
                .map(|&c| {
                    let o = at;
                    at += c;
                    o
                })
                .collect()
        };
        let (so, ro) = (offsets(send_counts), offsets(recv_counts));
        // Virtual members (and this rank itself): what this rank sends them, cut or
        // zero-padded to the expected count.
        let split = self.split(group.ranks());
        for j in 0..n {
            if split.real_pos[j].is_some() && j != me {
                continue;
            }
            let (sc, rc) = (send_counts[j], recv_counts[j]);
            let k = sc.min(rc);
            recv[ro[j]..ro[j] + k].copy_from_slice(&send[so[j]..so[j] + k]);
            recv[ro[j] + k..ro[j] + rc].fill(0.0);
        }
        // Real members: a real exchange among them.
        if split.inner.len() > 1 {
            if let Some(real) = self.real.as_mut() {
                let members: Vec<usize> = (0..n).filter(|&j| split.real_pos[j].is_some()).collect();
                let inner_group =
                    Group::new(split.inner.clone(), real.ranks.len()).map_err(|_| {
                        CommError::NotInGroup {
                            rank: self.rank,
                            group: split.inner.clone(),
                        }
                    })?;
                let sub_send: Vec<f32> = members
                    .iter()
                    .flat_map(|&j| send[so[j]..so[j] + send_counts[j]].iter().copied())
                    .collect();
                let sub_sc: Vec<usize> = members.iter().map(|&j| send_counts[j]).collect();
                let sub_rc: Vec<usize> = members.iter().map(|&j| recv_counts[j]).collect();
                let mut sub_recv = vec![0.0; sub_rc.iter().sum()];
                let before = memory::thread_live();
                real.comm.group_all_to_all_v_f32(
                    &inner_group,
                    &sub_send,
                    &sub_sc,
                    &mut sub_recv,
                    &sub_rc,
                )?;
                held_by_comm(&self.state, before);
                let mut at = 0;
                for (&j, &rc) in members.iter().zip(&sub_rc) {
                    recv[ro[j]..ro[j] + rc].copy_from_slice(&sub_recv[at..at + rc]);
                    at += rc;
                }
            }
        }
        lock(&self.state).op_ends(RecordedOp::Collective {
            op: CollectiveOp::AllToAll,
            group: State::members(group),
            role: None,
            bytes: Bytes(4 * send.len() as u64),
            duration: Picos::ZERO,
        });
        Ok(())
    }
}

/// A real communicator that records like [`VirtualPeers`]: every operation is carried out by
/// the wrapped communicator (real data between real ranks) and recorded with its segment,
/// so that a run with every rank real can be compared with its emulation. Its memory
/// samples leave out what the wrapped communicator's calls leave the thread holding (the
/// backend's buffers, messages allocated by one thread and freed by another), so that both
/// runs measure the program's own memory.
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

    /// Runs `f` on the inner communicator between the end of a segment and the record of
    /// `op`.
    fn around<T>(
        &mut self,
        op: impl FnOnce(&State) -> RecordedOp,
        f: impl FnOnce(&mut C) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.state().segment_ends()?;
        let before = memory::thread_live();
        let out = f(&mut self.inner)?;
        let retained = memory::thread_live() - before;
        let mut s = self.state();
        s.comm_bytes += retained;
        let op = op(&s);
        s.op_ends(op);
        // The call's transient buffers are not the program's peak either.
        memory::reset_thread_peak();
        Ok(out)
    }
}

/// A collective over every rank, recorded as [`State::world_group`] does.
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
            |_| world_collective(CollectiveOp::AllReduce, bytes),
            |c| c.all_reduce_sum_f32(buf),
        )
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |_| world_collective(CollectiveOp::Broadcast, bytes),
            |c| c.broadcast_f32(root, buf),
        )
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        let bytes = buf.len() as u64;
        self.around(
            |_| world_collective(CollectiveOp::Broadcast, bytes),
            |c| c.broadcast_bytes(root, buf),
        )
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let bytes = (mine.len() * self.inner.world_size()) as u64;
        self.around(
            |_| world_collective(CollectiveOp::AllGather, bytes),
            |c| c.all_gather_bytes(mine),
        )
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.around(
            |_| world_collective(CollectiveOp::AllReduce, 0),
            |c| c.barrier(),
        )
    }

    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |s| {
                let seq = s.sent.get(&dest).copied().unwrap_or(0);
                RecordedOp::Send {
                    peer: dest as u32,
                    bytes: Bytes(bytes),
                    tag: s.tag(s.rank, dest, seq),
                    duration: Picos::ZERO,
                }
            },
            |c| c.send_f32(dest, buf),
        )?;
        *self.state().sent.entry(dest).or_insert(0) += 1;
        Ok(())
    }

    fn sends_never_wait(&self) -> bool {
        self.inner.sends_never_wait()
    }

    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        self.around(
            |s| {
                let seq = s.received.get(&src).copied().unwrap_or(0);
                RecordedOp::Recv {
                    peer: src as u32,
                    bytes: Bytes(bytes),
                    tag: s.tag(src, s.rank, seq),
                    duration: Picos::ZERO,
                }
            },
            |c| c.recv_f32(src, buf),
        )?;
        *self.state().received.entry(src).or_insert(0) += 1;
        Ok(())
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
        let (sb, rb) = (4 * send.len() as u64, 4 * recv.len() as u64);
        self.state().segment_ends()?;
        let before = memory::thread_live();
        self.inner.send_recv_f32(dest, send, src, recv)?;
        let retained = memory::thread_live() - before;
        memory::reset_thread_peak();
        let mut s = self.state();
        s.comm_bytes += retained;
        let (sseq, rseq) = (
            s.sent.get(&dest).copied().unwrap_or(0),
            s.received.get(&src).copied().unwrap_or(0),
        );
        let (stag, rtag) = (s.tag(s.rank, dest, sseq), s.tag(src, s.rank, rseq));
        *s.sent.entry(dest).or_insert(0) += 1;
        *s.received.entry(src).or_insert(0) += 1;
        // No segment between the two: the receive follows the send at once.
        if s.recording {
            s.ops.push(RecordedOp::Send {
                peer: dest as u32,
                bytes: Bytes(sb),
                tag: stag,
                duration: Picos::ZERO,
            });
        }
        s.op_ends(RecordedOp::Recv {
            peer: src as u32,
            bytes: Bytes(rb),
            tag: rtag,
            duration: Picos::ZERO,
        });
        Ok(())
    }

    fn group_all_reduce_sum_f32(
        &mut self,
        group: &Group,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        let bytes = 4 * buf.len() as u64;
        let members = State::members(group);
        self.around(
            |_| collective(CollectiveOp::AllReduce, members, bytes),
            |c| c.group_all_reduce_sum_f32(group, buf),
        )
    }

    fn group_all_gather_f32(
        &mut self,
        group: &Group,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let bytes = 4 * out.len() as u64;
        let members = State::members(group);
        self.around(
            |_| collective(CollectiveOp::AllGather, members, bytes),
            |c| c.group_all_gather_f32(group, mine, out),
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
        let bytes = 4 * send.len() as u64;
        let members = State::members(group);
        self.around(
            |_| collective(CollectiveOp::AllToAll, members, bytes),
            |c| c.group_all_to_all_v_f32(group, send, send_counts, recv, recv_counts),
        )
    }
}
