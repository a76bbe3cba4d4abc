//! Communication between the ranks of a training run: collectives over the whole world,
//! point-to-point messages, and collectives over groups of ranks.
//!
//! [`Communicator`] is the small blocking, rank-ordered interface the trainer needs: every rank
//! calls the same collectives in the same order, each call returns when the collective is
//! complete on that rank. That is the MPI model, so the MPI backend maps onto MPI collectives
//! (`MPI_Bcast`, `MPI_Allgather`, `MPI_Barrier`; the all-reduce is an `MPI_Alltoallv` and an
//! `MPI_Allgatherv` rather than `MPI_Allreduce`, whose summation order is the library's
//! choice); an emulated backend (real ranks among virtual ones) fits the same shape.
//!
//! Model parallelism adds two kinds of operation:
//!
//! - **Point-to-point** ([`Communicator::send_f32`], [`Communicator::recv_f32`],
//!   [`Communicator::send_recv_f32`]): pipeline stages pass activations forward and gradients
//!   backward. Messages from one rank to another arrive in the order they were sent.
//! - **Group collectives** over a [`Group`], an ordered list of distinct ranks:
//!   [`Communicator::group_all_reduce_sum_f32`] (tensor-parallel partial sums, data-parallel
//!   gradient averaging inside one pipeline stage), [`Communicator::group_reduce_scatter_sum_f32`]
//!   and [`Communicator::group_all_gather_f32`] (sequence parallelism's halves of that
//!   all-reduce), and [`Communicator::group_all_to_all_v_f32`] (expert-parallel token
//!   dispatch). Sums are taken in group order, so every member gets the same bits whatever the
//!   timing.
//!
//! Every operation is a named trait method, even where a default implementation built on
//! point-to-point messages serves (the group collectives), so that a communicator wrapping
//! another — one that records what a rank does, one that emulates absent peers — sees each
//! operation with its kind, group, peer and size instead of the messages it is made of. Such a
//! wrapper must forward every method to the wrapped communicator; a method it leaves at the
//! default would be carried out as point-to-point messages through the wrapper itself.
//!
//! Two backends live here: [`SingleRank`] (world of one; every collective is the identity, and
//! there is no peer to message) and [`ThreadComm`] (ranks are threads of one process sharing a
//! mutex-protected exchange area and one mailbox per ordered pair of ranks). The third,
//! `MpiComm` (one rank per process, over MPI), is in `comm_mpi` behind the `mpi` feature. Sums
//! are always taken in rank (or group) order `((x0 + x1) + x2) + ...` and every rank computes
//! the same sum, so results never depend on thread timing or on the backend and are identical
//! on all ranks.
//!
//! What this module does not do: no non-blocking operations (a pipeline schedule that needs a
//! send and a receive at once uses [`Communicator::send_recv_f32`]), no sub-communicator
//! objects (a group is a plain rank list, validated by [`Group::new`]), and no reductions other
//! than the sum.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use thiserror::Error;

/// Errors of a collective.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CommError {
    #[error("a peer rank left the communicator before finishing the collective")]
    PeerGone,
    #[error("rank {rank} contributed {found} elements, rank 0 contributed {expected}")]
    LengthMismatch {
        rank: usize,
        expected: usize,
        found: usize,
    },
    #[error("root rank {root} is outside a world of {world}")]
    BadRoot { root: usize, world: usize },
    #[error("a peer rank panicked while holding the communicator")]
    Poisoned,
    #[error("a message of {elements} elements is too long for the communicator")]
    TooLarge { elements: usize },
    #[error("peer rank {peer} is this rank or outside a world of {world}")]
    BadPeer { peer: usize, world: usize },
    #[error("rank {rank} is not a member of the group {group:?}")]
    NotInGroup { rank: usize, group: Vec<usize> },
    #[error("{what} has {found} entries, the group has {members} members")]
    GroupShape {
        what: &'static str,
        found: usize,
        members: usize,
    },
    #[error("{what} covers {counted} elements, the buffer holds {len}")]
    CountMismatch {
        what: &'static str,
        counted: usize,
        len: usize,
    },
    #[error("this communicator does not support {what}")]
    Unsupported { what: &'static str },
}

/// Why a list of ranks is not a group.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum GroupError {
    #[error("a group needs at least one rank")]
    Empty,
    #[error("rank {rank} is outside a world of {world}")]
    OutOfRange { rank: usize, world: usize },
    #[error("rank {rank} appears twice")]
    Duplicate { rank: usize },
}

/// An ordered list of distinct ranks of one world: the members of a group collective. The
/// order is the summation order of [`Communicator::group_all_reduce_sum_f32`] and the order of
/// the pieces of [`Communicator::group_all_gather_f32`]; a member's index in the list is its
/// position in the group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Group {
    ranks: Vec<usize>,
}

impl Group {
    /// The group of `ranks` (in this order) within a world of `world` ranks.
    pub fn new(ranks: Vec<usize>, world: usize) -> Result<Self, GroupError> {
        if ranks.is_empty() {
            return Err(GroupError::Empty);
        }
        let mut seen = vec![false; world];
        for &rank in &ranks {
            let slot = seen
                .get_mut(rank)
                .ok_or(GroupError::OutOfRange { rank, world })?;
            if std::mem::replace(slot, true) {
                return Err(GroupError::Duplicate { rank });
            }
        }
        Ok(Self { ranks })
    }

    /// Every rank of a world of `world` (at least one), in rank order.
    pub fn world(world: usize) -> Self {
        Self {
            ranks: (0..world.max(1)).collect(),
        }
    }

    /// The members, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Number of members (never 0).
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Always false: a group has at least one member.
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// The position of `rank` in the group, if it is a member.
    pub fn position(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }

    /// This rank's position, or the error every group collective reports for a non-member.
    pub fn position_of(&self, rank: usize) -> Result<usize, CommError> {
        self.position(rank).ok_or_else(|| CommError::NotInGroup {
            rank,
            group: self.ranks.clone(),
        })
    }
}

/// Blocking, rank-ordered collectives over a fixed group of ranks.
pub trait Communicator: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Replaces `buf` on every rank by the element-wise sum over ranks, summed in rank order.
    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError>;
    /// Copies `root`'s `buf` into every rank's `buf` (all the same length).
    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError>;
    /// Copies `root`'s bytes to every rank (lengths may differ before the call).
    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError>;
    /// Every rank's bytes, indexed by rank, on every rank.
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// Sends `buf` to rank `dest` (not this rank). Messages from one rank to another are
    /// received in the order they were sent. Whether the call waits for the receiver is the
    /// backend's choice (threads never wait; MPI may, for long messages), so two ranks must not
    /// both send to each other before receiving: use [`Self::send_recv_f32`] for that.
    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError>;

    /// Whether [`Self::send_f32`] always returns without waiting for the receiver (the message
    /// is buffered), so that a schedule may post sends in any order. Schedules that rely on it
    /// (interleaved 1F1B) refuse communicators that answer `false`, the default; `ThreadComm`
    /// and `SingleRank` answer `true`, MPI `false` (`MPI_Send` may wait for long messages).
    fn sends_never_wait(&self) -> bool {
        false
    }

    /// Receives the next message from rank `src` (not this rank) into `buf`, whose length must
    /// be the message's ([`CommError::LengthMismatch`] otherwise; the message is consumed).
    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError>;

    /// Sends `buf` to `dest` as the message `tag` of this pair of ranks. The receiver takes it
    /// with [`Self::recv_f32_tagged`] under the same tag, in whatever order it wants the pair's
    /// tagged messages: interleaved 1F1B, where two stages exchange activations one way and
    /// gradients the other, names each message by what it carries instead of relying on
    /// arrival order. A tag must not be reused for a pair while its message is in flight.
    /// Tagged and untagged messages do not overtake each other's kind: each has its own order.
    ///
    /// The default refuses ([`CommError::Unsupported`]). Schedules that use tags also need
    /// [`Self::sends_never_wait`]; `ThreadComm` offers both, MPI neither (`SingleRank` has no
    /// peer to send to).
    fn send_f32_tagged(&mut self, dest: usize, tag: u64, buf: &[f32]) -> Result<(), CommError> {
        let _ = (dest, tag, buf);
        Err(CommError::Unsupported {
            what: "tagged messages",
        })
    }

    /// Receives the message `tag` from rank `src` into `buf`, whose length must be the
    /// message's (see [`Self::send_f32_tagged`]). The default refuses.
    fn recv_f32_tagged(&mut self, src: usize, tag: u64, buf: &mut [f32]) -> Result<(), CommError> {
        let _ = (src, tag, buf);
        Err(CommError::Unsupported {
            what: "tagged messages",
        })
    }

    /// Sends `send` to `dest` and receives the next message from `src` into `recv`, as one
    /// operation that cannot deadlock against a peer doing the mirror-image call (MPI's
    /// `MPI_Sendrecv`). The default sends first, which is right only for backends whose sends
    /// never wait for the receiver; backends whose sends can wait must override it.
    fn send_recv_f32(
        &mut self,
        dest: usize,
        send: &[f32],
        src: usize,
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        self.send_f32(dest, send)?;
        self.recv_f32(src, recv)
    }

    /// Replaces `buf` on every member of `group` by the element-wise sum over the members,
    /// summed in group order, identical on every member. Every member passes the same group
    /// and the same length; ranks outside the group do not call it.
    ///
    /// The default is a reduce-scatter and an all-gather of pairwise exchanges
    /// ([`Self::send_recv_f32`]): member `j` sums slice `j` of everyone's buffer, front to
    /// back, and hands the sum to the others.
    fn group_all_reduce_sum_f32(
        &mut self,
        group: &Group,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        default_group_all_reduce(self, group, buf)
    }

    /// Sums `buf` element-wise over the members of `group`, in group order, and leaves in `out`
    /// this member's piece of the sum: `buf` is cut into `group.len()` contiguous pieces of
    /// `out.len()` elements, and the member at position `j` gets piece `j`. Every member passes
    /// the same group and the same lengths; `buf.len()` must be `group.len() * out.len()`. Each
    /// element is summed in the same order as by [`Self::group_all_reduce_sum_f32`], so the
    /// pieces are the all-reduce's bits.
    ///
    /// The default is the first half of the default all-reduce: member `j` receives piece `j`
    /// of everyone's buffer through pairwise exchanges and sums them front to back.
    fn group_reduce_scatter_sum_f32(
        &mut self,
        group: &Group,
        buf: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        default_group_reduce_scatter(self, group, buf, out)
    }

    /// Concatenates every member's `mine` (all the same length) in group order into `out`
    /// (`group.len() * mine.len()` elements) on every member.
    fn group_all_gather_f32(
        &mut self,
        group: &Group,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        default_group_all_gather(self, group, mine, out)
    }

    /// Personalised exchange with variable sizes (`MPI_Alltoallv`): `send` holds one piece per
    /// member, in group order, of `send_counts[j]` elements for member `j`; `recv` receives
    /// one piece from each member, in group order, of `recv_counts[j]` elements from member
    /// `j`. Counts must agree pairwise (what `i` sends to `j` is what `j` expects from `i`);
    /// callers that do not know them exchange them first (with this call, one count each).
    fn group_all_to_all_v_f32(
        &mut self,
        group: &Group,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        default_group_all_to_all_v(self, group, send, send_counts, recv, recv_counts)
    }
}

/// Offsets of consecutive pieces of `counts`, with the total last.
fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut at = 0;
    let mut v = Vec::with_capacity(counts.len() + 1);
    for &c in counts {
        v.push(at);
        at += c;
    }
    v.push(at);
    v
}

/// `n` elements cut into `parts` contiguous pieces whose sizes differ by at most one.
fn even_counts(n: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|j| n / parts + usize::from(j < n % parts))
        .collect()
}

/// Checks the shapes of an all-to-all-v over `group` (one count per member, counts that add
/// up to the buffers) and returns the pieces' offsets in `send` and `recv`, each with the
/// total last. Every implementation of [`Communicator::group_all_to_all_v_f32`] reports
/// bad shapes with these errors.
pub fn all_to_all_v_offsets(
    group: &Group,
    send: &[f32],
    send_counts: &[usize],
    recv: &[f32],
    recv_counts: &[usize],
) -> Result<(Vec<usize>, Vec<usize>), CommError> {
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
    let so = offsets(send_counts);
    let ro = offsets(recv_counts);
    for (what, o, len) in [
        ("send_counts", &so, send.len()),
        ("recv_counts", &ro, recv.len()),
    ] {
        if o[n] != len {
            return Err(CommError::CountMismatch {
                what,
                counted: o[n],
                len,
            });
        }
    }
    Ok((so, ro))
}

/// Checks that `out` holds one piece of `mine`'s length per member of `group`, as every
/// implementation of [`Communicator::group_all_gather_f32`] requires.
pub fn check_all_gather(group: &Group, mine: &[f32], out: &[f32]) -> Result<(), CommError> {
    let counted = group.len() * mine.len();
    if out.len() == counted {
        Ok(())
    } else {
        Err(CommError::CountMismatch {
            what: "the gathered pieces",
            counted,
            len: out.len(),
        })
    }
}

/// Checks that `buf` holds one piece of `out`'s length per member of `group`, as every
/// implementation of [`Communicator::group_reduce_scatter_sum_f32`] requires.
pub fn check_reduce_scatter(group: &Group, buf: &[f32], out: &[f32]) -> Result<(), CommError> {
    let counted = group.len() * out.len();
    if buf.len() == counted {
        Ok(())
    } else {
        Err(CommError::CountMismatch {
            what: "the scattered pieces",
            counted,
            len: buf.len(),
        })
    }
}

/// [`Communicator::group_all_to_all_v_f32`] from pairwise exchanges: in round `k` member `p`
/// sends to member `p + k` and receives from member `p - k` (mod the group size), so every
/// round pairs each sender with a receiver doing the mirror-image call.
pub fn default_group_all_to_all_v<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    send: &[f32],
    send_counts: &[usize],
    recv: &mut [f32],
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let n = group.len();
    let p = group.position_of(comm.rank())?;
    let (so, ro) = all_to_all_v_offsets(group, send, send_counts, recv, recv_counts)?;
    if send_counts[p] != recv_counts[p] {
        return Err(CommError::LengthMismatch {
            rank: comm.rank(),
            expected: recv_counts[p],
            found: send_counts[p],
        });
    }
    recv[ro[p]..ro[p + 1]].copy_from_slice(&send[so[p]..so[p + 1]]);
    for k in 1..n {
        let to = (p + k) % n;
        let from = (p + n - k) % n;
        comm.send_recv_f32(
            group.ranks()[to],
            &send[so[to]..so[to + 1]],
            group.ranks()[from],
            &mut recv[ro[from]..ro[from + 1]],
        )?;
    }
    Ok(())
}

/// [`Communicator::group_all_gather_f32`] from pairwise exchanges.
pub fn default_group_all_gather<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    mine: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    let n = group.len();
    let p = group.position_of(comm.rank())?;
    let m = mine.len();
    check_all_gather(group, mine, out)?;
    out[p * m..(p + 1) * m].copy_from_slice(mine);
    for k in 1..n {
        let to = (p + k) % n;
        let from = (p + n - k) % n;
        comm.send_recv_f32(
            group.ranks()[to],
            mine,
            group.ranks()[from],
            &mut out[from * m..(from + 1) * m],
        )?;
    }
    Ok(())
}

/// The reduce-scatter under both [`default_group_reduce_scatter`] and
/// [`default_group_all_reduce`]: `buf` is cut into pieces of `counts[j]` elements for member
/// `j`; this member (position `p`) receives its piece from every member and returns their sum,
/// taken in group order.
fn reduce_scatter_pieces<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    p: usize,
    buf: &[f32],
    counts: &[usize],
) -> Result<Vec<f32>, CommError> {
    let n = group.len();
    let mine = counts[p];
    // Slice `p` of every member, in group order.
    let mut pieces = vec![0.0f32; mine * n];
    default_group_all_to_all_v(comm, group, buf, counts, &mut pieces, &vec![mine; n])?;
    let (acc, rest) = pieces.split_at_mut(mine);
    if mine > 0 {
        for piece in rest.chunks_exact(mine) {
            for (a, x) in acc.iter_mut().zip(piece) {
                *a += *x;
            }
        }
    }
    pieces.truncate(mine);
    Ok(pieces)
}

/// [`Communicator::group_reduce_scatter_sum_f32`] from pairwise exchanges.
pub fn default_group_reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    buf: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    let n = group.len();
    let p = group.position_of(comm.rank())?;
    check_reduce_scatter(group, buf, out)?;
    if n == 1 {
        out.copy_from_slice(buf);
        return Ok(());
    }
    let acc = reduce_scatter_pieces(comm, group, p, buf, &vec![out.len(); n])?;
    out.copy_from_slice(&acc);
    Ok(())
}

/// [`Communicator::group_all_reduce_sum_f32`] as a reduce-scatter and an all-gather.
pub fn default_group_all_reduce<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let n = group.len();
    let p = group.position_of(comm.rank())?;
    if n == 1 {
        return Ok(());
    }
    // Pieces as even as the length allows, so that any length reduces.
    let counts = even_counts(buf.len(), n);
    let acc = reduce_scatter_pieces(comm, group, p, buf, &counts)?;
    // Pieces differ in length by one, so gather them one exchange at a time rather than
    // through the equal-length all-gather.
    let o = offsets(&counts);
    buf[o[p]..o[p + 1]].copy_from_slice(&acc);
    for k in 1..n {
        let to = (p + k) % n;
        let from = (p + n - k) % n;
        comm.send_recv_f32(
            group.ranks()[to],
            &acc,
            group.ranks()[from],
            &mut buf[o[from]..o[from + 1]],
        )?;
    }
    Ok(())
}

/// The communicator of a run with one rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum_f32(&mut self, _buf: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast_f32(&mut self, root: usize, _buf: &mut [f32]) -> Result<(), CommError> {
        check_root(root, 1)
    }
    fn broadcast_bytes(&mut self, root: usize, _buf: &mut Vec<u8>) -> Result<(), CommError> {
        check_root(root, 1)
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        Ok(vec![mine.to_vec()])
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    fn sends_never_wait(&self) -> bool {
        true
    }
    fn send_f32(&mut self, dest: usize, _buf: &[f32]) -> Result<(), CommError> {
        Err(CommError::BadPeer {
            peer: dest,
            world: 1,
        })
    }
    fn recv_f32(&mut self, src: usize, _buf: &mut [f32]) -> Result<(), CommError> {
        Err(CommError::BadPeer {
            peer: src,
            world: 1,
        })
    }
}

fn check_root(root: usize, world: usize) -> Result<(), CommError> {
    if root < world {
        Ok(())
    } else {
        Err(CommError::BadRoot { root, world })
    }
}

#[derive(Debug)]
struct State {
    /// Incremented each time every rank has arrived at a barrier.
    generation: u64,
    arrived: usize,
    /// Set for a rank when it drops its communicator; peers waiting for it then fail instead
    /// of hanging (a collective fails when any rank left, a receive when its sender did).
    departed: Vec<bool>,
    floats: Vec<Vec<f32>>,
    bytes: Vec<Vec<u8>>,
    /// Point-to-point messages in flight, one queue per ordered pair: `mail[src * world +
    /// dst]`. Unbounded, so a send never waits.
    mail: Vec<VecDeque<Vec<f32>>>,
    /// Tagged messages in flight, per ordered pair as `mail`, with their tags (few at a time:
    /// a linear search finds one).
    tagged: Vec<Vec<(u64, Vec<f32>)>>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group; create the group with [`ThreadComm::group`] and move each
/// member to its own thread.
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadComm {
    /// `world` connected ranks (`world >= 1`), indexed by rank.
    pub fn group(world: usize) -> Vec<ThreadComm> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                departed: vec![false; world],
                floats: vec![Vec::new(); world],
                bytes: vec![Vec::new(); world],
                mail: vec![VecDeque::new(); world * world],
                tagged: vec![Vec::new(); world * world],
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, CommError> {
        self.shared.state.lock().map_err(|_| CommError::Poisoned)
    }

    /// Waits until every rank has arrived; returns the guard re-acquired after the wait.
    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer == self.rank || peer >= self.shared.world {
            Err(CommError::BadPeer {
                peer,
                world: self.shared.world,
            })
        } else {
            Ok(())
        }
    }

    fn wait_all<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.shared.world {
            st.arrived = 0;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(st);
        }
        // `departed` is checked before every wait: a peer that left before we arrived has
        // already sent its notification.
        while st.generation == gen {
            if st.departed.iter().any(|&d| d) {
                return Err(CommError::PeerGone);
            }
            st = self.shared.cv.wait(st).map_err(|_| CommError::Poisoned)?;
        }
        Ok(st)
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.departed[self.rank] = true;
        }
        self.shared.cv.notify_all();
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let mut st = self.lock()?;
        st.floats[self.rank].clear();
        st.floats[self.rank].extend_from_slice(buf);
        let st = self.wait_all(st)?;
        let expected = st.floats[0].len();
        for (rank, f) in st.floats.iter().enumerate() {
            if f.len() != expected {
                // Every rank sees the same mismatch, so all fail the same way; still pass the
                // second barrier so nobody is left waiting.
                let err = CommError::LengthMismatch {
                    rank,
                    expected,
                    found: f.len(),
                };
                drop(self.wait_all(st)?);
                return Err(err);
            }
        }
        buf.copy_from_slice(&st.floats[0]);
        for f in &st.floats[1..] {
            for (acc, x) in buf.iter_mut().zip(f) {
                *acc += *x;
            }
        }
        // The second barrier keeps a fast rank from overwriting its slot for the next
        // collective while a slow one is still reading this one.
        let _st = self.wait_all(st)?;
        Ok(())
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        check_root(root, self.shared.world)?;
        let mut st = self.lock()?;
        if self.rank == root {
            st.floats[root].clear();
            st.floats[root].extend_from_slice(buf);
        }
        let st = self.wait_all(st)?;
        let src = &st.floats[root];
        let result = if src.len() == buf.len() {
            if self.rank != root {
                buf.copy_from_slice(src);
            }
            Ok(())
        } else {
            Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: src.len(),
                found: buf.len(),
            })
        };
        let _st = self.wait_all(st)?;
        result
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        check_root(root, self.shared.world)?;
        let mut st = self.lock()?;
        if self.rank == root {
            st.bytes[root].clear();
            st.bytes[root].extend_from_slice(buf);
        }
        let st = self.wait_all(st)?;
        if self.rank != root {
            buf.clear();
            buf.extend_from_slice(&st.bytes[root]);
        }
        let _st = self.wait_all(st)?;
        Ok(())
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let mut st = self.lock()?;
        st.bytes[self.rank].clear();
        st.bytes[self.rank].extend_from_slice(mine);
        let st = self.wait_all(st)?;
        let all = st.bytes.clone();
        let _st = self.wait_all(st)?;
        Ok(all)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let st = self.lock()?;
        let _st = self.wait_all(st)?;
        Ok(())
    }

    fn sends_never_wait(&self) -> bool {
        true
    }

    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError> {
        self.post(dest, |st, slot| st.mail[slot].push_back(buf.to_vec()))
    }

    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.take(src, buf, |st, slot| st.mail[slot].pop_front())
    }

    fn send_f32_tagged(&mut self, dest: usize, tag: u64, buf: &[f32]) -> Result<(), CommError> {
        self.post(dest, |st, slot| st.tagged[slot].push((tag, buf.to_vec())))
    }

    fn recv_f32_tagged(&mut self, src: usize, tag: u64, buf: &mut [f32]) -> Result<(), CommError> {
        self.take(src, buf, |st, slot| {
            let at = st.tagged[slot].iter().position(|(t, _)| *t == tag)?;
            Some(st.tagged[slot].remove(at).1)
        })
    }
}

impl ThreadComm {
    /// Posts a message to `dest` with `put`, which gets the state and the pair's slot.
    fn post(&mut self, dest: usize, put: impl FnOnce(&mut State, usize)) -> Result<(), CommError> {
        self.check_peer(dest)?;
        let mut st = self.lock()?;
        put(&mut st, self.rank * self.shared.world + dest);
        drop(st);
        self.shared.cv.notify_all();
        Ok(())
    }

    /// Waits until `find` takes a message from `src`'s slot to this rank, and copies it into
    /// `buf`.
    fn take(
        &mut self,
        src: usize,
        buf: &mut [f32],
        mut find: impl FnMut(&mut State, usize) -> Option<Vec<f32>>,
    ) -> Result<(), CommError> {
        self.check_peer(src)?;
        let slot = src * self.shared.world + self.rank;
        let mut st = self.lock()?;
        // A message already sent is delivered even when its sender has left since.
        let msg = loop {
            if let Some(m) = find(&mut st, slot) {
                break m;
            }
            if st.departed[src] {
                return Err(CommError::PeerGone);
            }
            st = self.shared.cv.wait(st).map_err(|_| CommError::Poisoned)?;
        };
        if msg.len() != buf.len() {
            return Err(CommError::LengthMismatch {
                rank: src,
                expected: buf.len(),
                found: msg.len(),
            });
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(world: usize, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
        let comms = ThreadComm::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let f = &f;
                    s.spawn(move || f(c))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        let out = run(4, |mut c| {
            let r = c.rank() as f32;
            let mut results = Vec::new();
            for round in 0..50 {
                let mut buf = vec![r + round as f32, 1e8 * (r - 1.5), 0.1 * r];
                c.all_reduce_sum_f32(&mut buf).unwrap();
                results.push(buf);
            }
            results
        });
        for round in 0..50 {
            let f = round as f32;
            let expected0 = ((f + (1.0 + f)) + (2.0 + f)) + (3.0 + f);
            assert_eq!(out[0][round][0], expected0);
            let e1 = ((1e8f32 * -1.5 + 1e8 * -0.5) + 1e8 * 0.5) + 1e8 * 1.5;
            assert_eq!(out[0][round][1], e1);
            for rank in &out {
                assert_eq!(rank[round], out[0][round], "identical on every rank");
            }
        }
    }

    #[test]
    fn tagged_messages_are_received_by_tag_in_any_order() {
        let out = run(2, |mut c| {
            if c.rank() == 0 {
                for tag in [5u64, 9, 1 << 48] {
                    c.send_f32_tagged(1, tag, &[tag as f32, 1.0]).unwrap();
                }
                // An untagged message keeps its own order beside the tagged ones.
                c.send_f32(1, &[42.0]).unwrap();
                Vec::new()
            } else {
                let mut got = Vec::new();
                let mut one = [0.0f32];
                c.recv_f32(0, &mut one).unwrap();
                got.push(one[0]);
                for tag in [1u64 << 48, 5, 9] {
                    let mut buf = [0.0f32; 2];
                    c.recv_f32_tagged(0, tag, &mut buf).unwrap();
                    got.push(buf[0]);
                }
                got
            }
        });
        assert_eq!(out[1], vec![42.0, (1u64 << 48) as f32, 5.0, 9.0]);
    }

    #[test]
    fn a_tagged_receive_fails_once_its_sender_has_left() {
        let out = run(2, |mut c| {
            if c.rank() == 0 {
                c.send_f32_tagged(1, 7, &[1.0]).unwrap();
                drop(c);
                None
            } else {
                let mut buf = [0.0f32];
                // Sent before the sender left: delivered. Never sent: the peer is gone.
                let first = c.recv_f32_tagged(0, 7, &mut buf);
                let second = c.recv_f32_tagged(0, 8, &mut buf);
                Some((first, second))
            }
        });
        assert_eq!(out[1], Some((Ok(()), Err(CommError::PeerGone))));
    }

    #[test]
    fn communicators_without_tagged_messages_refuse_them() {
        let mut c = SingleRank;
        assert_eq!(
            c.send_f32_tagged(0, 1, &[0.0]),
            Err(CommError::Unsupported {
                what: "tagged messages"
            })
        );
    }

    #[test]
    fn broadcast_gather_and_barrier() {
        let out = run(3, |mut c| {
            let mut f = vec![c.rank() as f32; 2];
            c.broadcast_f32(2, &mut f).unwrap();
            let mut b = if c.rank() == 1 {
                b"hello".to_vec()
            } else {
                Vec::new()
            };
            c.broadcast_bytes(1, &mut b).unwrap();
            let all = c.all_gather_bytes(&[c.rank() as u8]).unwrap();
            c.barrier().unwrap();
            (f, b, all)
        });
        for (f, b, all) in out {
            assert_eq!(f, vec![2.0, 2.0]);
            assert_eq!(b, b"hello");
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_departed_peer_fails_the_collective_instead_of_hanging() {
        let out = run(2, |mut c| {
            if c.rank() == 1 {
                drop(c);
                return Ok(());
            }
            let mut buf = [1.0f32];
            c.all_reduce_sum_f32(&mut buf)
        });
        assert_eq!(out[0], Err(CommError::PeerGone));
    }

    #[test]
    fn mismatched_lengths_are_reported_by_all() {
        let out = run(2, |mut c| {
            let mut buf = vec![0.0f32; 1 + c.rank()];
            c.all_reduce_sum_f32(&mut buf)
        });
        assert!(out
            .iter()
            .all(|r| matches!(r, Err(CommError::LengthMismatch { .. }))));
    }

    #[test]
    fn point_to_point_messages_arrive_in_order() {
        let out = run(3, |mut c| {
            match c.rank() {
                0 => {
                    for i in 0..20 {
                        c.send_f32(2, &[i as f32, -(i as f32)]).unwrap();
                    }
                    Vec::new()
                }
                1 => {
                    for i in 0..20 {
                        c.send_f32(2, &[100.0 + i as f32]).unwrap();
                    }
                    Vec::new()
                }
                _ => {
                    let mut got = Vec::new();
                    let (mut a, mut b) = ([0.0f32; 2], [0.0f32; 1]);
                    for _ in 0..20 {
                        // Interleaving the two senders does not reorder either's messages.
                        c.recv_f32(1, &mut b).unwrap();
                        c.recv_f32(0, &mut a).unwrap();
                        got.push((a[0], b[0]));
                    }
                    got
                }
            }
        });
        assert_eq!(out[2].len(), 20);
        for (i, &(a, b)) in out[2].iter().enumerate() {
            assert_eq!((a, b), (i as f32, 100.0 + i as f32));
        }
    }

    #[test]
    fn receive_with_the_wrong_length_is_reported() {
        let out = run(2, |mut c| {
            if c.rank() == 0 {
                c.send_f32(1, &[1.0, 2.0, 3.0]).unwrap();
                Ok(())
            } else {
                let mut buf = [0.0f32; 2];
                c.recv_f32(0, &mut buf)
            }
        });
        assert_eq!(
            out[1],
            Err(CommError::LengthMismatch {
                rank: 0,
                expected: 2,
                found: 3
            })
        );
    }

    #[test]
    fn a_departed_sender_fails_the_receive_after_its_messages() {
        let out = run(2, |mut c| {
            if c.rank() == 0 {
                c.send_f32(1, &[7.0]).unwrap();
                drop(c);
                return (Ok(()), Ok(()));
            }
            let mut buf = [0.0f32];
            let first = c.recv_f32(0, &mut buf).map(|()| assert_eq!(buf, [7.0]));
            (first, c.recv_f32(0, &mut buf))
        });
        assert_eq!(out[1], (Ok(()), Err(CommError::PeerGone)));
    }

    #[test]
    fn a_departed_member_fails_the_group_collective_instead_of_hanging() {
        let out = run(3, |mut c| {
            let g = Group::new(vec![0, 1], 3).unwrap();
            if c.rank() == 1 {
                drop(c);
                return Ok(());
            }
            if c.rank() == 2 {
                return Ok(());
            }
            let mut buf = [1.0f32; 4];
            c.group_all_reduce_sum_f32(&g, &mut buf)
        });
        assert_eq!(out[0], Err(CommError::PeerGone));
    }

    #[test]
    fn peers_are_checked() {
        let mut comms = ThreadComm::group(2);
        let c = &mut comms[0];
        assert_eq!(
            c.send_f32(0, &[1.0]),
            Err(CommError::BadPeer { peer: 0, world: 2 })
        );
        assert_eq!(
            c.recv_f32(5, &mut [0.0]),
            Err(CommError::BadPeer { peer: 5, world: 2 })
        );
        assert!(SingleRank.send_f32(0, &[1.0]).is_err());
    }

    #[test]
    fn groups_are_validated() {
        assert_eq!(Group::new(vec![], 4), Err(GroupError::Empty));
        assert_eq!(
            Group::new(vec![1, 4], 4),
            Err(GroupError::OutOfRange { rank: 4, world: 4 })
        );
        assert_eq!(
            Group::new(vec![2, 1, 2], 4),
            Err(GroupError::Duplicate { rank: 2 })
        );
        let g = Group::new(vec![3, 1], 4).unwrap();
        assert_eq!((g.len(), g.position(1), g.position(0)), (2, Some(1), None));
        assert_eq!(Group::world(3).ranks(), &[0, 1, 2]);
    }

    /// Rank `r`'s group in a world of 5 cut into two disjoint groups, neither in rank order:
    /// [4, 0, 2] and [3, 1].
    fn two_groups_of_five(r: usize) -> Group {
        if r.is_multiple_of(2) {
            Group::new(vec![4, 0, 2], 5).unwrap()
        } else {
            Group::new(vec![3, 1], 5).unwrap()
        }
    }

    /// Two disjoint groups of a world of 5 reduce concurrently; each member's sum is taken in
    /// the group's order (not rank order) and is the same bits on every member.
    #[test]
    fn group_all_reduce_sums_in_group_order() {
        let values = [1e8f32, 1.0, -1e8, 3.0, 0.5];
        let out = run(5, |mut c| {
            let group = two_groups_of_five(c.rank());
            let r = c.rank();
            let mut results = Vec::new();
            for len in [0usize, 1, 2, 7] {
                let mut buf: Vec<f32> = (0..len).map(|i| values[r] + i as f32 * 0.25).collect();
                c.group_all_reduce_sum_f32(&group, &mut buf).unwrap();
                results.push(buf);
            }
            results
        });
        for (li, len) in [0usize, 1, 2, 7].into_iter().enumerate() {
            let expect = |order: &[usize]| -> Vec<f32> {
                (0..len)
                    .map(|i| {
                        let mut acc = values[order[0]] + i as f32 * 0.25;
                        for &r in &order[1..] {
                            acc += values[r] + i as f32 * 0.25;
                        }
                        acc
                    })
                    .collect()
            };
            for r in [0, 2, 4] {
                assert_eq!(out[r][li], expect(&[4, 0, 2]), "rank {r} len {len}");
            }
            for r in [1, 3] {
                assert_eq!(out[r][li], expect(&[3, 1]), "rank {r} len {len}");
            }
        }
    }

    /// A reduce-scatter leaves each member its piece of the all-reduce, bit for bit, over two
    /// disjoint groups at once; a buffer that is not one piece per member is refused.
    #[test]
    fn group_reduce_scatter_is_the_all_reduce_s_pieces() {
        let values = [1e8f32, 1.0, -1e8, 3.0, 0.5];
        let out = run(5, |mut c| {
            let group = two_groups_of_five(c.rank());
            let r = c.rank();
            let buf: Vec<f32> = (0..3 * group.len())
                .map(|i| values[r] + i as f32 * 0.25)
                .collect();
            let mut piece = vec![0.0f32; 3];
            c.group_reduce_scatter_sum_f32(&group, &buf, &mut piece)
                .unwrap();
            let mut all = buf.clone();
            c.group_all_reduce_sum_f32(&group, &mut all).unwrap();
            let p = group.position(r).unwrap();
            let bad = c.group_reduce_scatter_sum_f32(&group, &buf, &mut [0.0; 2]);
            (piece, all[3 * p..3 * p + 3].to_vec(), bad)
        });
        for (r, (piece, expect, bad)) in out.into_iter().enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&piece), bits(&expect), "rank {r}");
            assert!(
                matches!(bad, Err(CommError::CountMismatch { .. })),
                "rank {r}"
            );
        }
        let mut one = [0.0f32; 2];
        SingleRank
            .group_reduce_scatter_sum_f32(&Group::world(1), &[1.0, 2.0], &mut one)
            .unwrap();
        assert_eq!(one, [1.0, 2.0]);
    }

    #[test]
    fn group_all_gather_and_all_to_all_v() {
        let out = run(3, |mut c| {
            let g = Group::new(vec![2, 0, 1], 3).unwrap();
            let r = c.rank();
            let mut gathered = vec![0.0f32; 6];
            c.group_all_gather_f32(&g, &[r as f32, 10.0 * r as f32], &mut gathered)
                .unwrap();
            // Member at position p sends p + q + 1 copies of (10 r + q) to member q.
            let p = g.position(r).unwrap();
            let send_counts: Vec<usize> = (0..3).map(|q| p + q + 1).collect();
            let send: Vec<f32> = (0..3)
                .flat_map(|q| std::iter::repeat_n((10 * r + q) as f32, p + q + 1))
                .collect();
            let recv_counts: Vec<usize> = (0..3).map(|q| q + p + 1).collect();
            let mut recv = vec![0.0f32; recv_counts.iter().sum()];
            c.group_all_to_all_v_f32(&g, &send, &send_counts, &mut recv, &recv_counts)
                .unwrap();
            (gathered, recv)
        });
        let order = [2usize, 0, 1];
        for (r, (gathered, recv)) in out.iter().enumerate() {
            assert_eq!(gathered, &vec![2.0, 20.0, 0.0, 0.0, 1.0, 10.0]);
            let p = order.iter().position(|&x| x == r).unwrap();
            let expect: Vec<f32> = order
                .iter()
                .enumerate()
                .flat_map(|(q, &src)| std::iter::repeat_n((10 * src + p) as f32, q + p + 1))
                .collect();
            assert_eq!(recv, &expect, "rank {r}");
        }
    }

    #[test]
    fn group_collectives_check_membership_and_counts() {
        let mut c = SingleRank;
        let g = Group::new(vec![0], 1).unwrap();
        let mut buf = [1.0f32, 2.0];
        c.group_all_reduce_sum_f32(&g, &mut buf).unwrap();
        assert_eq!(buf, [1.0, 2.0]);
        let mut out = [0.0f32; 2];
        c.group_all_gather_f32(&g, &buf, &mut out).unwrap();
        assert_eq!(out, buf);
        assert!(matches!(
            c.group_all_to_all_v_f32(&g, &buf, &[1, 1], &mut out, &[2]),
            Err(CommError::GroupShape { .. })
        ));
        let mut comms = ThreadComm::group(3);
        let outside = Group::new(vec![1, 2], 3).unwrap();
        assert!(matches!(
            comms[0].group_all_reduce_sum_f32(&outside, &mut buf),
            Err(CommError::NotInGroup { rank: 0, .. })
        ));
    }

    #[test]
    fn single_rank_is_identity() {
        let mut c = SingleRank;
        let mut buf = [1.0f32, 2.0];
        c.all_reduce_sum_f32(&mut buf).unwrap();
        assert_eq!(buf, [1.0, 2.0]);
        assert!(c.broadcast_f32(1, &mut buf).is_err());
    }
}
