//! The MPI backend of [`Communicator`] (feature `mpi`): one rank per process, over the system's
//! MPI library (OpenMPI or MPICH), within one host or across several.
//!
//! Start a run with an MPI launcher (`mpirun -n 2 orrery train --comm mpi`); each process calls
//! [`MpiComm::init`] once and hands the communicator to the trainer. Every collective of the
//! trait maps onto MPI collectives on `MPI_COMM_WORLD`:
//!
//! - `all_reduce_sum_f32` is *not* `MPI_Allreduce`: MPI lets the library associate the sum as
//!   it likes (tree, ring or recursive doubling, chosen by message size), so its result may
//!   differ from the trait's rank-order sum `((x0 + x1) + x2) + ...` and from [`ThreadComm`].
//!   Instead the buffer is cut into one contiguous slice per rank; `MPI_Alltoallv` sends slice
//!   `j` of every rank to rank `j`, which sums the pieces in rank order, and `MPI_Allgatherv`
//!   returns the summed slices to everyone. That is the reduce-scatter + all-gather shape of a
//!   ring all-reduce (each rank sends and receives about twice the buffer, independent of the
//!   world size), every element is summed by exactly one rank in the trait's order, and all
//!   ranks receive the same bits — the same bits [`ThreadComm`] computes.
//! - `broadcast_f32`, `broadcast_bytes`: `MPI_Bcast` (the byte variant sends the length first).
//! - `all_gather_bytes`: the lengths with `MPI_Allgather`, then the bytes with `MPI_Allgatherv`.
//! - `barrier`: `MPI_Barrier`.
//! - `send_f32`, `recv_f32`: `MPI_Send` and `MPI_Recv` on `MPI_COMM_WORLD` (MPI keeps the
//!   messages of one pair in order). A message is a header with its length, then the data in
//!   segments, so a receiver with the wrong buffer length drains the message and reports
//!   `LengthMismatch` instead of MPI aborting on truncation. `MPI_Send` may wait for the
//!   receiver, so `send_recv_f32` posts the sends as `MPI_Isend`, receives, then waits for
//!   the sends: two ranks exchanging with each other cannot deadlock.
//! - The group collectives use the trait's defaults, pairwise `send_recv_f32` exchanges
//!   summed in group order. No MPI sub-communicators are created: a group is only a rank list,
//!   so forming one costs nothing and every rank can use any number of groups.
//!
//! Argument checks that need the other ranks' view (equal lengths) exchange the lengths first,
//! so every rank reaches the same verdict and no rank enters a collective its peers skip.
//! Failures inside MPI are not returned: MPI's default error handler aborts the whole job, and a
//! process that dies makes the launcher end the others, so there is no `PeerGone` here.
//!
//! MPI counts are 32-bit, so long buffers travel in segments of at most [`SEGMENT`] elements.
//!
//! ## Waiting
//!
//! MPI libraries wait by polling: a rank blocked in a receive or a collective keeps its core
//! busy. With a core per rank that costs nothing and answers fastest ([`Waiting::Spin`]: the
//! calls above). With more ranks on a host than CPUs they may run on, the waiting ranks take
//! cores from the ranks that compute (on two cores, in about half of the runs of a four-rank
//! pipeline, every rank's compute took about 155 ms instead of 80 ms). There
//! ([`Waiting::Nap`]) every operation is started as MPI's non-blocking call and tested, for
//! [`SPIN_FIRST`] in a loop that yields the CPU between tests (so that the peer it waits for,
//! if it shares the core, can run and make progress) and then with a sleep of [`NAP`] between
//! tests. A rank then notices a completion up to a nap late (the sleep can take twice
//! [`NAP`] with Linux's timer slack; on a busy core a yield or a wake-up can also wait for
//! another process's time slice), and a long operation that advances only inside tests
//! may take several naps. Either way the same bytes move in the same order, so results are
//! identical.
//!
//! [`MpiComm::init`] chooses: it gathers the CPU sets of the ranks sharing each host
//! (`MPI_Comm_split_type`, and Linux's `/proc/thread-self/status`; a process pinned to one
//! core counts that core only, and a CPU set that cannot be read counts as every CPU) and
//! any cgroup quota they see, and naps where the ranks outnumber the smaller of the union
//! and the quota. Hyperthreads count as CPUs. `ORRERY_MPI_WAIT=spin` or `nap` overrides the
//! choice (a launcher passes it to other hosts only when told, as with `mpirun -x`). The whole job then takes one policy, napping if any rank would: a blocking
//! collective never matches a non-blocking one (MPI-3, section 5.12), so ranks that waited
//! differently would hang.
//!
//! [`ThreadComm`]: crate::ThreadComm

use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::CommunicatorCollectives as _;
use mpi::collective::SystemOperation;
use mpi::datatype::{Buffer, BufferMut, Partition, PartitionMut};
use mpi::environment::{Threading, Universe};
use mpi::point_to_point::{Destination as _, Source as _};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator as _, Process, SimpleCommunicator};
use mpi::traits::Root as _;
use mpi::{Count, Rank};
use thiserror::Error;

use crate::comm::{CommError, Communicator};

/// Elements per MPI call. Far below `i32::MAX`, so every count and displacement of a segment
/// (including a gather of one segment-sized piece per rank) fits MPI's `int`.
pub const SEGMENT: usize = 1 << 26;

/// Environment variables that MPI launchers set in the processes they start: Open MPI's
/// `mpirun`, MPICH/Intel MPI's Hydra `mpiexec` and Slurm's PMI-2 plugin (`PMI_SIZE`), and
/// PMIx-based launchers such as `srun --mpi=pmix` and PRRTE (`PMIX_RANK`).
const LAUNCHER_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"];

/// Overrides how a waiting rank waits: `spin` or `nap` (see the module docs).
pub const WAIT_VAR: &str = "ORRERY_MPI_WAIT";

/// How long a napping rank keeps testing (yielding the CPU between tests) before its first
/// nap: exchanges between ranks that reach them together finish within it.
pub const SPIN_FIRST: Duration = Duration::from_micros(50);

/// The sleep between two tests of a napping rank, once [`SPIN_FIRST`] has passed.
pub const NAP: Duration = Duration::from_micros(50);

/// How a rank waits for MPI operations to complete (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// MPI's blocking calls, which poll: a CPU per rank.
    Spin,
    /// Non-blocking calls, tested with naps between: more ranks than CPUs.
    Nap,
}

impl Waiting {
    /// What [`WAIT_VAR`] asks for: nothing when unset or empty (the hosts decide), else the
    /// policy it names; another value is an error naming the variable.
    pub fn requested(value: Option<&str>) -> Result<Option<Waiting>, MpiInitError> {
        match value {
            None | Some("") => Ok(None),
            Some("spin") => Ok(Some(Waiting::Spin)),
            Some("nap") => Ok(Some(Waiting::Nap)),
            Some(other) => Err(MpiInitError::BadWaiting {
                found: other.to_string(),
            }),
        }
    }

    /// The policy for `ranks_here` ranks sharing a host whose CPU sets cover `cpus` CPUs,
    /// unless one was `requested`.
    pub fn choose(requested: Option<Waiting>, ranks_here: usize, cpus: usize) -> Waiting {
        requested.unwrap_or(if ranks_here > cpus {
            Waiting::Nap
        } else {
            Waiting::Spin
        })
    }

    /// Completes `request`: MPI's blocking wait, or [`nap_until_complete`].
    fn complete<'a, D: ?Sized, S: Scope<'a>>(self, request: Request<'a, D, S>) {
        match self {
            Waiting::Spin => request.wait_without_status(),
            Waiting::Nap => nap_until_complete(request),
        }
    }
}

/// Tests `request` until it completes, in a loop for [`SPIN_FIRST`] and then with naps.
fn nap_until_complete<'a, D: ?Sized, S: Scope<'a>>(request: Request<'a, D, S>) {
    let started = Instant::now();
    let mut request = request;
    loop {
        match request.test() {
            Ok(_) => return,
            Err(pending) => request = pending,
        }
        nap_after(started);
    }
}

/// CPUs the masks that ranks exchange can name: 1,024, as 16 words.
const CPU_WORDS: usize = 16;

/// What a rank tells the others on its host: the mask of the CPUs it may run on (Linux:
/// `Cpus_allowed_list` of the calling thread), then the cgroup quota it sees (see
/// [`quota_seen`]). A mask that cannot be read counts as every CPU, so such a host naps
/// only when told.
fn cpu_report() -> [u64; CPU_WORDS + 1] {
    let mask = ["/proc/thread-self/status", "/proc/self/status"]
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
                .and_then(|list| cpu_mask(list.trim()))
        })
        .unwrap_or([u64::MAX; CPU_WORDS]);
    let usable = std::thread::available_parallelism().map_or(u64::MAX, |n| n.get() as u64);
    let mut report = [0u64; CPU_WORDS + 1];
    report[..CPU_WORDS].copy_from_slice(&mask);
    report[CPU_WORDS] = quota_seen(&mask, usable);
    report
}

/// The CPU quota a rank whose CPU set is `mask` sees, given the standard library's count of
/// the CPUs it may use (`usable`, the smaller of the set and a cgroup quota): that count
/// where it is below the set's size, since only a quota makes it so, and no limit otherwise
/// (a rank pinned to one core says nothing of the container's quota).
fn quota_seen(mask: &[u64; CPU_WORDS], usable: u64) -> u64 {
    let in_set: u64 = mask.iter().map(|w| u64::from(w.count_ones())).sum();
    if usable < in_set {
        usable
    } else {
        u64::MAX
    }
}

/// The mask of a CPU list such as `0-3,8,10-11`; none if it does not parse or names a CPU
/// beyond the mask.
fn cpu_mask(list: &str) -> Option<[u64; CPU_WORDS]> {
    let mut mask = [0u64; CPU_WORDS];
    for part in list.split(',') {
        let (low, high) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>().ok()?, b.trim().parse().ok()?),
            None => {
                let cpu = part.trim().parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        if low > high || high >= 64 * CPU_WORDS {
            return None;
        }
        for cpu in low..=high {
            mask[cpu / 64] |= 1 << (cpu % 64);
        }
    }
    Some(mask)
}

/// The CPUs a host's ranks may use, from their [`cpu_report`]s (one after another): the
/// union of their masks, but no more than the smallest quota any of them sees (a quota
/// holds for every rank of its container).
fn host_cpus(reports: &[u64]) -> usize {
    let union: usize = (0..CPU_WORDS)
        .map(|word| {
            reports
                .iter()
                .skip(word)
                .step_by(CPU_WORDS + 1)
                .fold(0u64, |union, m| union | m)
                .count_ones() as usize
        })
        .sum();
    let quota = reports
        .iter()
        .skip(CPU_WORDS)
        .step_by(CPU_WORDS + 1)
        .copied()
        .min()
        .unwrap_or(u64::MAX);
    union.min(usize::try_from(quota).unwrap_or(usize::MAX))
}

/// A napping rank's pause between two tests begun at `started`: within [`SPIN_FIRST`] it
/// only yields the CPU to whatever else may run there, then it sleeps for [`NAP`].
fn nap_after(started: Instant) {
    if started.elapsed() < SPIN_FIRST {
        std::thread::yield_now();
    } else {
        std::thread::sleep(NAP);
    }
}

/// Why MPI could not be set up in this process.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MpiInitError {
    /// Started without a launcher. MPI would fall back to a "singleton" world of one process
    /// (or abort, depending on the library), which is never what `--comm mpi` means.
    #[error(
        "not started by an MPI launcher (none of OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK is \
         set); run the program under `mpirun -n N` (or mpiexec, srun)"
    )]
    NotLaunched,
    /// MPI may be initialised once per process, and never again after it was finalised.
    #[error("MPI was already initialised in this process; MpiComm::init may be called only once")]
    AlreadyInitialized,
    /// The communicator may be moved to another thread (it is `Send`), so MPI must accept calls
    /// from any one thread at a time.
    #[error(
        "the MPI library offers thread support {provided:?}; MpiComm needs at least \
         MPI_THREAD_SERIALIZED"
    )]
    ThreadSupport { provided: Threading },
    /// [`WAIT_VAR`] holds neither `spin` nor `nap`.
    #[error(
        "{var} is {found:?}; it must be \"spin\" or \"nap\", or unset (chosen from the \
         ranks and CPUs of each host)",
        var = WAIT_VAR
    )]
    BadWaiting { found: String },
}

/// Keeps MPI initialised; the last clone to go finalises it (`MPI_Finalize`). The universe is
/// held only for that drop: collectives reach `MPI_COMM_WORLD` through [`comm_world`].
#[derive(Clone)]
struct Env {
    _universe: Arc<Universe>,
}

/// One rank of `MPI_COMM_WORLD`. Dropping the communicator and every [`MpiAbort`] made from
/// it finalises MPI, which waits for the other ranks to finalise too.
pub struct MpiComm {
    env: Env,
    rank: usize,
    world: usize,
    waiting: Waiting,
    /// Receive space of the all-reduce, kept between steps so the gradient exchange does not
    /// allocate.
    scratch: Vec<f32>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("waiting", &self.waiting)
            .finish_non_exhaustive()
    }
}

/// Ends the whole MPI job (`MPI_Abort`). A rank that fails alone cannot simply return: its
/// peers would wait for it in the next collective, and finalising MPI would wait for them, so
/// the run would hang. Take this handle before giving the communicator away.
#[derive(Clone)]
pub struct MpiAbort {
    _env: Env,
}

impl std::fmt::Debug for MpiAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiAbort").finish_non_exhaustive()
    }
}

impl MpiAbort {
    /// Terminates every process of the job; the launcher exits with `code` (Open MPI does).
    pub fn abort(&self, code: i32) -> ! {
        comm_world().abort(code)
    }
}

/// The world communicator. It is a predefined handle, so fetching it per call costs nothing,
/// and `MpiComm` itself then holds no raw MPI handle and can be `Send`.
fn comm_world() -> SimpleCommunicator {
    SimpleCommunicator::world()
}

/// `n` as an MPI count. Callers split their buffers into segments first, so this only fails on
/// a broken invariant; the error is still the same on every rank because every rank derives
/// its counts from the same exchanged lengths.
fn count(n: usize) -> Result<Count, CommError> {
    Count::try_from(n).map_err(|_| CommError::TooLarge { elements: n })
}

/// Splits `n` elements into `parts` contiguous pieces whose sizes differ by at most one:
/// counts and displacements.
fn split(n: usize, parts: usize) -> Result<(Vec<Count>, Vec<Count>), CommError> {
    let (base, extra) = (n / parts, n % parts);
    let mut counts = Vec::with_capacity(parts);
    let mut displs = Vec::with_capacity(parts);
    let mut at = 0;
    for j in 0..parts {
        let c = base + usize::from(j < extra);
        counts.push(count(c)?);
        displs.push(count(at)?);
        at += c;
    }
    Ok((counts, displs))
}

/// Running offsets of `counts`.
fn displacements(counts: &[Count]) -> Vec<Count> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect()
}

impl MpiComm {
    /// Initialises MPI for this process (with `MPI_THREAD_SERIALIZED`) and returns its rank of
    /// `MPI_COMM_WORLD`, waiting as the module docs say (which takes three collectives, on
    /// every rank). Fails without a launcher, with an [`WAIT_VAR`] that names no policy, on a
    /// second call, or when the library cannot serve calls from a thread other than the one
    /// that initialised it.
    pub fn init() -> Result<MpiComm, MpiInitError> {
        if !LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some()) {
            return Err(MpiInitError::NotLaunched);
        }
        // Read before MPI starts, so a bad value fails as a missing launcher does.
        let requested = match std::env::var(WAIT_VAR) {
            Ok(value) => Waiting::requested(Some(&value))?,
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(value)) => {
                return Err(MpiInitError::BadWaiting {
                    found: value.to_string_lossy().into_owned(),
                })
            }
        };
        let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or(MpiInitError::AlreadyInitialized)?;
        // Held from here on, so an early return below still finalises MPI.
        let env = Env {
            _universe: Arc::new(universe),
        };
        if matches!(provided, Threading::Single | Threading::Funneled) {
            return Err(MpiInitError::ThreadSupport { provided });
        }
        let w = comm_world();
        // MPI ranks and sizes are non-negative `int`s.
        let rank = usize::try_from(w.rank()).unwrap_or(0);
        let size = usize::try_from(w.size()).unwrap_or(1);
        // Collectives: every rank takes part whatever the variable says, so none is left
        // waiting in them.
        let host = w.split_shared(0);
        let ranks_here = usize::try_from(host.size()).unwrap_or(1);
        let mut reports = vec![0u64; (CPU_WORDS + 1) * ranks_here];
        host.all_gather_into(&cpu_report()[..], &mut reports[..]);
        let mine = Waiting::choose(requested, ranks_here, host_cpus(&reports));
        let mut naps = 0u8;
        w.all_reduce_into(
            &u8::from(mine == Waiting::Nap),
            &mut naps,
            SystemOperation::max(),
        );
        let waiting = if naps > 0 {
            Waiting::Nap
        } else {
            Waiting::Spin
        };
        Ok(MpiComm {
            env,
            rank,
            world: size,
            waiting,
            scratch: Vec::new(),
        })
    }

    /// How this rank waits for MPI (chosen at [`MpiComm::init`]).
    pub fn waiting(&self) -> Waiting {
        self.waiting
    }

    /// A second handle on this rank of `MPI_COMM_WORLD` (not a new communicator, as
    /// `MPI_Comm_dup` would make), for a caller that gives the first away (to a trainer, say)
    /// and still has to talk to the other ranks afterwards. MPI stays initialised until every
    /// handle is gone. Calls from the two must not overlap (the library was initialised
    /// `MPI_THREAD_SERIALIZED`).
    pub fn second_handle(&self) -> MpiComm {
        MpiComm {
            env: self.env.clone(),
            rank: self.rank,
            world: self.world,
            waiting: self.waiting,
            scratch: Vec::new(),
        }
    }

    /// A handle that can end the job when this rank fails (see [`MpiAbort`]).
    pub fn abort_handle(&self) -> MpiAbort {
        MpiAbort {
            _env: self.env.clone(),
        }
    }

    fn root(&self, root: usize) -> Result<Rank, CommError> {
        let bad = CommError::BadRoot {
            root,
            world: self.world,
        };
        if root >= self.world {
            return Err(bad);
        }
        Rank::try_from(root).map_err(|_| bad)
    }

    /// Every rank's `len`, indexed by rank.
    fn all_lengths(&self, len: usize) -> Vec<usize> {
        let mine = len as u64;
        let mut all = vec![0u64; self.world];
        let w = comm_world();
        match self.waiting {
            Waiting::Spin => w.all_gather_into(&mine, &mut all[..]),
            Waiting::Nap => mpi::request::scope(|scope| {
                nap_until_complete(w.immediate_all_gather_into(scope, &mine, &mut all[..]));
            }),
        }
        // Lengths come from processes of the same program; a value beyond `usize` cannot
        // occur, and saturating keeps the comparison below meaningful if it did.
        all.into_iter()
            .map(|l| usize::try_from(l).unwrap_or(usize::MAX))
            .collect()
    }

    /// One `MPI_Bcast` of `buf` from `root`, waited for as this rank waits.
    fn broadcast_piece<B: BufferMut + ?Sized>(&self, root: &Process<'_>, buf: &mut B) {
        match self.waiting {
            Waiting::Spin => root.broadcast_into(buf),
            Waiting::Nap => mpi::request::scope(|scope| {
                nap_until_complete(root.immediate_broadcast_into(scope, buf));
            }),
        }
    }

    /// One receive into `buf` from `from`, waited for as this rank waits.
    fn receive_piece<B: BufferMut + ?Sized>(&self, from: &Process<'_>, buf: &mut B) {
        match self.waiting {
            Waiting::Spin => {
                from.receive_into(buf);
            }
            Waiting::Nap => mpi::request::scope(|scope| {
                nap_until_complete(from.immediate_receive_into(scope, buf));
            }),
        }
    }

    /// One send of `buf` to `to`, waited for as this rank waits.
    fn send_piece<B: Buffer + ?Sized>(&self, to: &Process<'_>, buf: &B) {
        match self.waiting {
            Waiting::Spin => to.send(buf),
            Waiting::Nap => mpi::request::scope(|scope| {
                nap_until_complete(to.immediate_send(scope, buf));
            }),
        }
    }

    /// The first rank whose length differs from `expected`, as the trait's error.
    fn first_mismatch(lengths: &[usize], expected: usize) -> Result<(), CommError> {
        match lengths.iter().position(|&l| l != expected) {
            Some(rank) => Err(CommError::LengthMismatch {
                rank,
                expected,
                found: lengths[rank],
            }),
            None => Ok(()),
        }
    }

    /// The MPI rank of a point-to-point peer: any other rank of the world.
    fn peer(&self, peer: usize) -> Result<Rank, CommError> {
        let bad = CommError::BadPeer {
            peer,
            world: self.world,
        };
        if peer >= self.world || peer == self.rank {
            return Err(bad);
        }
        Rank::try_from(peer).map_err(|_| bad)
    }

    /// Receives one message (header, then segments) from `src` into `buf`. A message of
    /// another length is received in full and dropped, so the pair's next message still lines
    /// up, and reported.
    fn receive_message(&self, src: Rank, peer: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let w = comm_world();
        let process = w.process_at_rank(src);
        let mut header = 0u64;
        self.receive_piece(&process, &mut header);
        let found = usize::try_from(header).unwrap_or(usize::MAX);
        if found == buf.len() {
            for seg in buf.chunks_mut(SEGMENT) {
                self.receive_piece(&process, seg);
            }
            return Ok(());
        }
        let mut rest = found;
        while rest > 0 {
            if self.waiting == Waiting::Nap {
                // A piece's length is unknown until it is there: probe, then receive it.
                let started = Instant::now();
                while process.immediate_probe().is_none() {
                    nap_after(started);
                }
            }
            let (piece, _status) = process.receive_vec::<f32>();
            rest = rest.saturating_sub(piece.len().max(1));
        }
        Err(CommError::LengthMismatch {
            rank: peer,
            expected: buf.len(),
            found,
        })
    }

    /// Rank-order sum of one segment (see the module documentation for the scheme).
    fn all_reduce_segment(&mut self, seg: &mut [f32]) -> Result<(), CommError> {
        let world = self.world;
        let (counts, displs) = split(seg.len(), world)?;
        let mine = seg.len() / world + usize::from(self.rank < seg.len() % world);
        let mine_count = count(mine)?;
        let recv_counts = vec![mine_count; world];
        let recv_displs = displacements(&recv_counts);
        self.scratch.clear();
        self.scratch.resize(mine * world, 0.0);
        {
            let send = Partition::new(&seg[..], &counts[..], &displs[..]);
            let mut recv =
                PartitionMut::new(&mut self.scratch[..], &recv_counts[..], &recv_displs[..]);
            let w = comm_world();
            match self.waiting {
                Waiting::Spin => w.all_to_all_varcount_into(&send, &mut recv),
                Waiting::Nap => mpi::request::scope(|scope| {
                    nap_until_complete(
                        w.immediate_all_to_all_varcount_into(scope, &send, &mut recv),
                    );
                }),
            }
        }
        // Piece i came from rank i: adding them front to back is the rank-order sum.
        let (acc, rest) = self.scratch.split_at_mut(mine);
        if mine > 0 {
            for piece in rest.chunks_exact(mine) {
                for (a, x) in acc.iter_mut().zip(piece) {
                    *a += *x;
                }
            }
        }
        let mut out = PartitionMut::new(seg, &counts[..], &displs[..]);
        let w = comm_world();
        match self.waiting {
            Waiting::Spin => w.all_gather_varcount_into(&acc[..], &mut out),
            Waiting::Nap => mpi::request::scope(|scope| {
                nap_until_complete(w.immediate_all_gather_varcount_into(scope, &acc[..], &mut out));
            }),
        }
        Ok(())
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let lengths = self.all_lengths(buf.len());
        Self::first_mismatch(&lengths, lengths[0])?;
        if self.world == 1 {
            return Ok(());
        }
        for seg in buf.chunks_mut(SEGMENT) {
            self.all_reduce_segment(seg)?;
        }
        Ok(())
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let root_rank = self.root(root)?;
        // MPI requires matching counts; a mismatch would truncate or abort, so check first and
        // fail on every rank alike.
        let lengths = self.all_lengths(buf.len());
        Self::first_mismatch(&lengths, lengths[root])?;
        let w = comm_world();
        let process = w.process_at_rank(root_rank);
        for seg in buf.chunks_mut(SEGMENT) {
            self.broadcast_piece(&process, seg);
        }
        Ok(())
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        let root_rank = self.root(root)?;
        let w = comm_world();
        let process = w.process_at_rank(root_rank);
        let mut len = buf.len() as u64;
        self.broadcast_piece(&process, &mut len);
        // Only a 32-bit rank receiving more than it can address from a 64-bit root fails here
        // (the length is then reported saturated); ranks of one architecture never do.
        let len = usize::try_from(len).map_err(|_| CommError::TooLarge {
            elements: usize::MAX,
        })?;
        if self.rank != root {
            buf.clear();
            buf.resize(len, 0);
        }
        for seg in buf.chunks_mut(SEGMENT) {
            self.broadcast_piece(&process, seg);
        }
        Ok(())
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let lengths = self.all_lengths(mine.len());
        let mut all: Vec<Vec<u8>> = lengths.iter().map(|&l| Vec::with_capacity(l)).collect();
        // Round k moves bytes [k*piece, (k+1)*piece) of every rank's message, so one round's
        // receive buffer holds at most SEGMENT bytes whatever the world size.
        let piece = (SEGMENT / self.world).max(1);
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let mut recv = Vec::new();
        for k in 0..longest.div_ceil(piece) {
            let from = k * piece;
            let part = |len: usize| len.saturating_sub(from).min(piece);
            let counts = lengths
                .iter()
                .map(|&l| count(part(l)))
                .collect::<Result<Vec<_>, _>>()?;
            let displs = displacements(&counts);
            let total = lengths.iter().map(|&l| part(l)).sum();
            recv.clear();
            recv.resize(total, 0u8);
            let send = &mine[from.min(mine.len())..from.min(mine.len()) + part(mine.len())];
            {
                let mut out = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
                let w = comm_world();
                match self.waiting {
                    Waiting::Spin => w.all_gather_varcount_into(send, &mut out),
                    Waiting::Nap => mpi::request::scope(|scope| {
                        nap_until_complete(
                            w.immediate_all_gather_varcount_into(scope, send, &mut out),
                        );
                    }),
                }
            }
            let mut at = 0;
            for (dst, &l) in all.iter_mut().zip(&lengths) {
                let n = part(l);
                dst.extend_from_slice(&recv[at..at + n]);
                at += n;
            }
        }
        Ok(all)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        match self.waiting {
            Waiting::Spin => comm_world().barrier(),
            Waiting::Nap => nap_until_complete(comm_world().immediate_barrier()),
        }
        Ok(())
    }

    fn send_f32(&mut self, dest: usize, buf: &[f32]) -> Result<(), CommError> {
        let dest = self.peer(dest)?;
        let w = comm_world();
        let process = w.process_at_rank(dest);
        self.send_piece(&process, &(buf.len() as u64));
        for seg in buf.chunks(SEGMENT) {
            self.send_piece(&process, seg);
        }
        Ok(())
    }

    fn recv_f32(&mut self, src: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let rank = self.peer(src)?;
        self.receive_message(rank, src, buf)
    }

    fn send_recv_f32(
        &mut self,
        dest: usize,
        send: &[f32],
        src: usize,
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        let dest_rank = self.peer(dest)?;
        let src_rank = self.peer(src)?;
        let w = comm_world();
        let to = w.process_at_rank(dest_rank);
        let header = send.len() as u64;
        mpi::request::scope(|scope| {
            // Post every send first, then receive: the peer doing the mirror-image call can
            // always make progress, whatever MPI's eager limit.
            let mut requests = vec![to.immediate_send(scope, &header)];
            let mut segments = Vec::new();
            for seg in send.chunks(SEGMENT) {
                segments.push(to.immediate_send(scope, seg));
            }
            let received = self.receive_message(src_rank, src, recv);
            for r in requests.drain(..) {
                self.waiting.complete(r);
            }
            for r in segments {
                self.waiting.complete(r);
            }
            received
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_buffer_and_differ_by_at_most_one() {
        let (counts, displs) = split(10, 4).unwrap();
        assert_eq!(counts, vec![3, 3, 2, 2]);
        assert_eq!(displs, vec![0, 3, 6, 8]);
        let (counts, displs) = split(1, 3).unwrap();
        assert_eq!(counts, vec![1, 0, 0]);
        assert_eq!(displs, vec![0, 1, 1]);
        assert_eq!(displacements(&[2, 0, 5]), vec![0, 2, 2]);
    }

    #[test]
    fn ranks_nap_only_where_they_outnumber_their_cpus_unless_told() {
        assert_eq!(Waiting::choose(None, 2, 2), Waiting::Spin);
        assert_eq!(Waiting::choose(None, 3, 2), Waiting::Nap);
        assert_eq!(Waiting::choose(Some(Waiting::Nap), 1, 8), Waiting::Nap);
        assert_eq!(Waiting::choose(Some(Waiting::Spin), 16, 2), Waiting::Spin);
        assert_eq!(Waiting::requested(None), Ok(None));
        assert_eq!(Waiting::requested(Some("")), Ok(None));
        assert_eq!(Waiting::requested(Some("nap")), Ok(Some(Waiting::Nap)));
        assert_eq!(Waiting::requested(Some("spin")), Ok(Some(Waiting::Spin)));
        let bad = Waiting::requested(Some("sleep")).unwrap_err();
        assert_eq!(
            bad,
            MpiInitError::BadWaiting {
                found: "sleep".into()
            }
        );
        assert!(
            bad.to_string().starts_with("ORRERY_MPI_WAIT is \"sleep\""),
            "{bad}"
        );
    }

    #[test]
    fn cpu_lists_become_masks_and_hosts_count_each_cpu_once_within_quotas() {
        let report = |list: &str, usable: u64| {
            let mask = cpu_mask(list).unwrap();
            let mut r = mask.to_vec();
            r.push(quota_seen(&mask, usable));
            r
        };
        // Two ranks pinned to one core each: two CPUs; both pinned to core 0: one.
        assert_eq!(host_cpus(&[report("0", 1), report("1", 1)].concat()), 2);
        assert_eq!(host_cpus(&[report("0", 1), report("0", 1)].concat()), 1);
        // Unpinned on 16 CPUs under a quota of 2 (a container): 2.
        assert_eq!(
            host_cpus(&[report("0-15", 2), report("0-15", 2)].concat()),
            2
        );
        let spread = cpu_mask("0-3, 8,10-11,1023").unwrap();
        assert_eq!(spread[0], 0b1101_0000_1111);
        assert_eq!(spread[15], 1 << 63);
        assert_eq!(host_cpus(&report("0-3, 8,10-11,1023", u64::MAX)), 8);
        assert_eq!(cpu_mask("1024"), None);
        assert_eq!(cpu_mask("3-1"), None);
        assert_eq!(cpu_mask("x"), None);
        // Nothing known: as many CPUs as a mask can name.
        let unknown = [u64::MAX; CPU_WORDS + 1];
        assert_eq!(host_cpus(&unknown), 64 * CPU_WORDS);
        // This process's own report counts at least one CPU.
        assert!(host_cpus(&cpu_report()) >= 1);
    }

    /// Unit tests do not run under a launcher (tests/mpi.rs launches real ranks), so the one
    /// thing to check here is the refusal, which must come before MPI is touched.
    #[test]
    fn init_without_a_launcher_is_refused() {
        if LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some()) {
            return;
        }
        assert_eq!(MpiComm::init().err(), Some(MpiInitError::NotLaunched));
    }
}
