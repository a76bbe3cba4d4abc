//! Running the real training program for graph collection and hybrid emulation.
//!
//! - [`collect`] (`orrery collect`): runs one representative rank of each timeline class of
//!   the program's world (its pipeline stages), `slots` of them at a time, each as the only
//!   real rank of its world ([`VirtualPeers`]); after `warmup` steps it records one step and
//!   stitches the records into the world's graphs with their measured durations.
//! - [`emulate`] (`orrery emulate --train`): runs the chosen real ranks live, each among
//!   virtual peers, reporting their segments to a [`Coordinator`] that replays every other
//!   rank from the collected graphs.
//! - [`record_real_rank`]: one rank of a world where every rank is real, recorded the same
//!   way; [`run_all_real`] runs a whole world so, as threads over `orrery_train::ThreadComm`.
//!   With one process per rank (an MPI job) it is the reference an emulation is compared
//!   with.
//!
//! Every real rank runs on its own thread with its own burn backend, the CPU's or (feature
//! `cuda`, `device = "cuda"`) the GPU's. On the CPU, with [`crate::memory::CountingAlloc`]
//! installed, its measured peak memory is its thread's; on a GPU it is its stream's pool's
//! ([`crate::memory`]).
//! That is exact only while the rank is the one thread of its process using burn: burn's
//! autodiff keeps one graph registry per process, and a thread that cleans it frees what
//! other threads allocated. The allocator charges each block to its owner whoever frees it,
//! but the owner's count then drops when the other thread gets to it, not when the owner
//! would have. An emulation's single real rank is such a thread (its own frees of blocks
//! other threads allocated, such as those of tests beside it, no longer lower its count
//! below what it holds); ranks run side by side in one process (collection with several slots, [`run_all_real`],
//! several real ranks in one emulation) measure their peaks to within some kilobytes.

use crate::comm::{Recorded, VirtualPeers, VirtualPeersHandle};
use crate::coordinator::{CoordinatedStep, Coordinator, CoordinatorError, RankReporter};
use orrery_graph::collect::{stitch, Collected, RankRecord, RecordedOp, StitchErrors};
use orrery_graph::Layout;
use orrery_net::NetworkModel;
use orrery_predict::emulate::{EmulateError, Emulation, Perturbations, Pruning};
use orrery_predict::CostModel;
use orrery_train::{
    load_corpus, make_optimizer, Clock, Communicator, CpuBackend, DeviceKind, ThreadComm,
    TrainConfig, TrainError, Trainer,
};
#[cfg(not(feature = "cuda"))]
use orrery_train::{ConfigErrors, ConfigProblem};
use orrery_units::{ClassId, Picos, RankId};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Why a collection or an emulation failed.
#[derive(Debug, Error)]
pub enum DriveError {
    #[error("{field}: {message}")]
    Config {
        field: &'static str,
        message: String,
    },
    #[error("rank {rank}: {source}")]
    Train { rank: u32, source: TrainError },
    #[error("rank {rank}'s thread panicked")]
    Panicked { rank: u32 },
    #[error("rank {rank} did not finish its step within {seconds} s (hung?)")]
    Hung { rank: u32, seconds: f64 },
    #[error(transparent)]
    Stitch(#[from] StitchErrors),
    #[error(transparent)]
    Emulate(#[from] EmulateError),
    #[error(transparent)]
    Coordinator(#[from] CoordinatorError),
}

impl DriveError {
    /// Whether the input is at fault (the configuration, its data, the layout, a collection
    /// that does not fit), rather than the run: the CLI's exit status 2.
    pub fn is_input(&self) -> bool {
        match self {
            DriveError::Config { .. } | DriveError::Stitch(_) | DriveError::Emulate(_) => true,
            DriveError::Train { source, .. } => source.is_input(),
            DriveError::Panicked { .. } | DriveError::Hung { .. } | DriveError::Coordinator(_) => {
                false
            }
        }
    }
}

/// The world of a training configuration run on `ranks` ranks: its `[parallel]` layout, or
/// pure data parallelism over the ranks.
pub fn layout_of(config: &TrainConfig, ranks: usize) -> Result<Layout, DriveError> {
    let (tp, pp, dp, ep) = match &config.parallel {
        Some(p) => {
            if p.world_size() != ranks {
                return Err(DriveError::Config {
                    field: "ranks",
                    message: format!(
                        "the [parallel] layout has {} ranks (tp {} x pp {} x dp {}), not {ranks}",
                        p.world_size(),
                        p.tp,
                        p.pp,
                        p.dp
                    ),
                });
            }
            (p.tp, p.pp, p.dp, p.ep)
        }
        None => (1, 1, ranks, 1),
    };
    if ranks == 0 {
        return Err(DriveError::Config {
            field: "ranks",
            message: "must be at least 1".into(),
        });
    }
    Ok(world_layout(tp as u32, dp as u32, pp as u32, ep as u32))
}

/// GPUs per node of the cluster an emulation of the real program is modelled on.
pub const GPUS_PER_NODE: u32 = 8;

/// The layout of a TP x DP x PP (x EP) world of the real program, on nodes of
/// [`GPUS_PER_NODE`] (or one node, for a smaller world), as the cluster its communication
/// is modelled on.
pub fn world_layout(tp: u32, dp: u32, pp: u32, ep: u32) -> Layout {
    let world = tp.max(1) * dp.max(1) * pp.max(1);
    Layout::from_dims(tp, 1, dp, pp, ep, world.min(GPUS_PER_NODE))
}

/// One real rank's recorded step and how long the step took on the wall clock.
#[derive(Debug, Clone)]
pub struct RankStep {
    pub record: RankRecord,
    pub wall: Picos,
    /// The step's training loss, as the rank computed it.
    pub loss: f32,
}

/// What a real rank does: `warmup` untimed steps, then one recorded step, on the device
/// its configuration names. On a GPU its memory is read from the backend's pool
/// ([`crate::memory::MemorySource::CudaPool`]).
fn run_rank(
    config: &TrainConfig,
    comm: Box<dyn Communicator>,
    handle: &VirtualPeersHandle,
    clock: &Arc<dyn Clock>,
    warmup: u64,
) -> Result<RankStep, TrainError> {
    match config.device {
        DeviceKind::Cpu => run_rank_on::<CpuBackend>(config, comm, handle, clock, warmup),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            crate::memory::measure_from(crate::memory::MemorySource::CudaPool);
            let step =
                run_rank_on::<orrery_train::CudaBackend>(config, comm, handle, clock, warmup);
            // The trainer and its tensors are gone; the pool of this thread's stream would
            // keep their pages for good.
            crate::memory::release_device();
            step
        }
        // Checked here and not left to the trainer: `orrery-train` may have been built with
        // its `cuda` feature while this crate was not, and a rank must not run on the CPU
        // and measure host memory while its configuration says GPU.
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(TrainError::Config(ConfigErrors {
            problems: vec![ConfigProblem {
                path: "device".into(),
                message: "real ranks on cuda need orrery-emulate built with its `cuda` \
                          feature: cargo build --release -p orrery-cli --features cuda"
                    .into(),
            }],
        })),
    }
}

/// [`run_rank`] on backend `B`'s default device.
fn run_rank_on<B: burn::tensor::backend::AutodiffBackend>(
    config: &TrainConfig,
    comm: Box<dyn Communicator>,
    handle: &VirtualPeersHandle,
    clock: &Arc<dyn Clock>,
    warmup: u64,
) -> Result<RankStep, TrainError> {
    let corpus = load_corpus(config)?;
    let optimizer = make_optimizer(config)?;
    let mut trainer =
        Trainer::<B>::new(config.clone(), corpus, optimizer, comm, Default::default())?;
    for _ in 0..warmup {
        trainer.step(clock.as_ref())?;
    }
    handle.start();
    let t0 = clock.now_seconds();
    let metrics = trainer.step(clock.as_ref())?;
    let wall = Picos::from_secs_f64((clock.now_seconds() - t0).max(0.0));
    Ok(RankStep {
        record: handle.finish(),
        wall,
        loss: metrics.loss,
    })
}

/// The configuration a driven rank runs: no evaluation, no files, enough steps.
fn driven(config: &TrainConfig, warmup: u64) -> TrainConfig {
    let mut c = config.clone();
    c.eval_every = 0;
    c.out_dir = None;
    c.steps = c.steps.max(warmup + 1);
    c
}

/// Runs `work` for each rank in `ranks`, `slots` at a time, each on a thread of its own.
///
/// A rank that has not finished `timeout` after its slot started is an error naming it. The
/// threads are not scoped, so that a rank that hangs cannot keep that error from reaching
/// the caller; the hung thread is left behind (the process ends it when it exits).
fn in_slots<T: Send + 'static>(
    ranks: &[u32],
    slots: usize,
    timeout: Duration,
    work: Arc<dyn Fn(u32) -> Result<T, DriveError> + Send + Sync>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<T>, DriveError> {
    let mut out = Vec::with_capacity(ranks.len());
    for chunk in ranks.chunks(slots.max(1)) {
        let (done, finished) = std::sync::mpsc::channel();
        for &r in chunk {
            let (work, done) = (work.clone(), done.clone());
            std::thread::spawn(move || {
                // A panic is caught and reported as such: a thread that died without a
                // word would otherwise look hung, and its slot would wait out the timeout.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(r)))
                    .unwrap_or(Err(DriveError::Panicked { rank: r }));
                // The receiver is gone only once the collection has given up on this slot.
                let _ = done.send((r, result));
            });
        }
        let deadline = std::time::Instant::now() + timeout;
        let mut results: Vec<(u32, Result<T, DriveError>)> = Vec::with_capacity(chunk.len());
        while results.len() < chunk.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let pending = || {
                chunk
                    .iter()
                    .copied()
                    .find(|r| results.iter().all(|(d, _)| d != r))
                    .unwrap_or(chunk[0])
            };
            match finished.recv_timeout(left) {
                Ok(r) => results.push(r),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err(DriveError::Hung {
                        rank: pending(),
                        seconds: timeout.as_secs_f64(),
                    });
                }
                // Every thread sends before it ends, panicking or not, and this function
                // holds a sender of its own; should that ever change, a thread that ended
                // without a word has failed.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(DriveError::Panicked { rank: pending() });
                }
            }
        }
        // In the order of `ranks`, whatever order they finished in.
        results.sort_by_key(|(r, _)| chunk.iter().position(|c| c == r));
        for (_, r) in results {
            out.push(r?);
        }
        progress(out.len(), ranks.len());
    }
    Ok(out)
}

/// A finished collection.
#[derive(Debug)]
pub struct Collection {
    pub collected: Collected,
    /// The records stitched, by rank.
    pub records: Vec<RankRecord>,
}

/// Collects the world's graphs from its pipeline stages' representatives (see the module
/// docs). `progress` hears (ranks done, ranks to run).
/// A representative that has not finished `timeout` after it started is an error naming it.
pub fn collect(
    config: &TrainConfig,
    ranks: usize,
    slots: usize,
    warmup: u64,
    timeout: Duration,
    clock: Arc<dyn Clock>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Collection, DriveError> {
    let layout = layout_of(config, ranks)?;
    let config = driven(config, warmup);
    let representatives: Vec<u32> = (0..layout.num_classes())
        .map(|c| layout.representative(ClassId(c)).0)
        .collect();
    let world = layout.clone();
    let records = in_slots(
        &representatives,
        slots,
        timeout,
        Arc::new(move |r| {
            let (comm, handle) = VirtualPeers::new(r as usize, world.clone(), clock.clone(), None);
            run_rank(&config, Box::new(comm), &handle, &clock, warmup)
                .map(|s| s.record)
                .map_err(|source| DriveError::Train { rank: r, source })
        }),
        progress,
    )?;
    let collected = stitch(layout, &records)?;
    Ok(Collection { collected, records })
}

/// A finished emulation.
#[derive(Debug)]
pub struct Emulated {
    pub step: CoordinatedStep,
    /// Each real rank's record of the emulated step (its segments and operations) and its
    /// wall time.
    pub records: Vec<RankStep>,
}

/// Emulates one step with `live` ranks real among virtual ones replayed from `collected`
/// (see the module docs). A real rank that reports nothing for `timeout` is an error.
#[allow(clippy::too_many_arguments)]
pub fn emulate<N: NetworkModel + Sync>(
    config: &TrainConfig,
    collected: &Collected,
    cost: &CostModel,
    net: &N,
    live: &[RankId],
    perturb: &Perturbations,
    warmup: u64,
    timeout: Duration,
    clock: Arc<dyn Clock>,
) -> Result<Emulated, DriveError> {
    let layout = collected.graphs.layout.clone();
    let config = driven(config, warmup);
    let emulation = Emulation::collected(collected, cost, net, live, Pruning::Classes, perturb)?;
    let (coordinator, reporters) = Coordinator::new(emulation, timeout);
    // Real ranks reach each other over threads: their exchanges carry real data.
    let mut real_ranks: Vec<usize> = reporters.iter().map(|r| r.rank().index()).collect();
    real_ranks.sort_unstable();
    let mut inner: Vec<Option<ThreadComm>> = ThreadComm::group(real_ranks.len())
        .into_iter()
        .map(Some)
        .collect();
    // The ranks run on threads of their own (not scoped): a rank that hangs must not keep
    // the coordinator's error from reaching the caller.
    let threads: Vec<_> = reporters
        .into_iter()
        .map(|reporter: RankReporter| {
            let (layout, config, clock) = (layout.clone(), config.clone(), clock.clone());
            let rank = reporter.rank();
            let real = real_ranks
                .binary_search(&rank.index())
                .ok()
                .and_then(|i| inner.get_mut(i))
                .and_then(Option::take);
            let real_ranks = real_ranks.clone();
            std::thread::spawn(move || {
                let (comm, handle) = match real {
                    Some(real) if real_ranks.len() > 1 => VirtualPeers::with_real_peers(
                        rank.index(),
                        layout,
                        clock.clone(),
                        Some(reporter.clone()),
                        Box::new(real),
                        real_ranks,
                    ),
                    _ => VirtualPeers::new(
                        rank.index(),
                        layout,
                        clock.clone(),
                        Some(reporter.clone()),
                    ),
                };
                match run_rank(&config, Box::new(comm), &handle, &clock, warmup) {
                    Ok(rec) => Ok(rec),
                    Err(e) => {
                        let _ = reporter.failed(e.to_string());
                        Err(DriveError::Train {
                            rank: rank.0,
                            source: e,
                        })
                    }
                }
            })
        })
        .collect();
    // The coordinator's error names the rank that stopped the step (with its reason, when
    // the rank failed); the other ranks stop at their next communication call, or are left
    // behind if they hang.
    let step = coordinator.run()?;
    let mut records = Vec::new();
    for (t, rank) in threads.into_iter().zip(real_ranks) {
        match t.join() {
            Ok(Ok(rec)) => records.push(rec),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(DriveError::Panicked { rank: rank as u32 }),
        }
    }
    records.sort_by_key(|r| r.record.rank);
    Ok(Emulated { step, records })
}

/// One rank of a world where every rank is real, over `comm` (a thread of a `ThreadComm`
/// group, or a process of an MPI job): runs `warmup` steps and records the next, as
/// collection records a rank among virtual peers. The all-real reference of an emulation,
/// and, one process per rank, a collection of the whole world (`orrery collect --comm mpi`).
pub fn record_real_rank<C: Communicator + 'static>(
    config: &TrainConfig,
    ranks: usize,
    comm: C,
    warmup: u64,
    clock: Arc<dyn Clock>,
) -> Result<RankStep, DriveError> {
    let layout = layout_of(config, ranks)?;
    if comm.world_size() != ranks {
        return Err(DriveError::Config {
            field: "ranks",
            message: format!(
                "{ranks} ranks, but the communicator has {}",
                comm.world_size()
            ),
        });
    }
    let config = driven(config, warmup);
    let rank = comm.rank() as u32;
    // The rank runs on a thread of its own, with its configuration and layout made here, as
    // an emulation's real rank does: its thread's memory is then the rank's alone, not also
    // what the caller's thread held before (an MPI rank's main thread holds its arguments
    // and set-up), so the two measure alike.
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let (comm, handle) = Recorded::new(comm, layout, clock.clone());
                run_rank(&config, Box::new(comm), &handle, &clock, warmup)
                    .map_err(|source| DriveError::Train { rank, source })
            })
            .join()
            .unwrap_or(Err(DriveError::Panicked { rank }))
    })
}

/// Every rank real: `ranks` threads over a `ThreadComm`, each recorded; returns the records
/// (by rank) of the step after `warmup`.
///
/// The threads share one process, and burn's autodiff keeps one graph registry for the
/// whole process, so a rank's thread now and then frees what another allocated. The
/// allocator charges such a free to the block's owner ([`crate::memory`]), but at the time
/// the other thread frees it, so the peaks measured here move by some kilobytes. The memory
/// reference is a run with a process per rank (`orrery collect --comm mpi`).
pub fn run_all_real(
    config: &TrainConfig,
    ranks: usize,
    warmup: u64,
    clock: Arc<dyn Clock>,
) -> Result<Vec<RankStep>, DriveError> {
    layout_of(config, ranks)?;
    let comms = ThreadComm::group(ranks);
    std::thread::scope(|scope| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let clock = clock.clone();
                scope.spawn(move || record_real_rank(config, ranks, comm, warmup, clock))
            })
            .collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                t.join()
                    .unwrap_or(Err(DriveError::Panicked { rank: r as u32 }))
            })
            .collect()
    })
}

/// A record's communication, without its segments and without the time spent in each
/// operation: what "the same collective order" compares (ranks among virtual peers spend
/// none, real ones wait for their peers).
pub fn communication(record: &RankRecord) -> Vec<RecordedOp> {
    record
        .ops
        .iter()
        .filter(|o| !matches!(o, RecordedOp::Compute { .. }))
        .map(|o| {
            let mut o = o.clone();
            if let Some(d) = o.communication_time_mut() {
                *d = Picos::ZERO;
            }
            o
        })
        .collect()
}

/// A record's measured peak memory (the highest sampled peak), and the sum of its
/// segments.
pub fn peak_and_compute(record: &RankRecord) -> (u64, Picos) {
    let mut peak = 0;
    let mut compute: u64 = 0;
    for o in &record.ops {
        if let RecordedOp::Compute {
            duration, memory, ..
        } = o
        {
            compute = compute.saturating_add(duration.0);
            if let Some(m) = memory {
                peak = peak.max(m.peak.0);
            }
        }
    }
    (peak, Picos(compute))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    use std::time::Instant;

    #[test]
    fn a_hung_rank_stops_its_slot_with_an_error_naming_it() {
        // Rank 7 blocks until the test lets it go (after `in_slots` returned, so reaching
        // the asserts proves the timeout fired); rank 3 of the same slot finishes.
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let blocked = Arc::new(Mutex::new(blocked));
        let ran_9 = Arc::new(AtomicBool::new(false));
        let flag = ran_9.clone();
        let started = Instant::now();
        let result = in_slots(
            &[3, 7, 9],
            2,
            Duration::from_millis(300),
            Arc::new(move |r| {
                if r == 7 {
                    let _ = blocked.lock().map(|b| b.recv());
                }
                if r == 9 {
                    flag.store(true, Ordering::SeqCst);
                }
                Ok(r)
            }),
            &mut |_, _| {},
        );
        assert!(
            matches!(result, Err(DriveError::Hung { rank: 7, .. })),
            "{result:?}"
        );
        // It waited the timeout out, and the next slot never started.
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(!ran_9.load(Ordering::SeqCst));
        drop(release);
    }

    #[test]
    fn slots_keep_the_ranks_order_and_name_a_panicking_rank() {
        let mut seen = Vec::new();
        let out = in_slots(
            &[5, 1, 4, 2],
            3,
            Duration::from_secs(60),
            Arc::new(|r| {
                // Later ranks of a slot finish first.
                std::thread::sleep(Duration::from_millis(u64::from(10 - r) * 5));
                Ok(r * 10)
            }),
            &mut |done, of| seen.push((done, of)),
        )
        .unwrap();
        assert_eq!(out, vec![50, 10, 40, 20]);
        assert_eq!(seen, vec![(3, 4), (4, 4)]);
        let panicked = in_slots(
            &[0, 1],
            2,
            Duration::from_secs(60),
            Arc::new(|r| {
                assert!(r != 1, "rank 1 fails");
                Ok(r)
            }),
            &mut |_, _| {},
        );
        assert!(
            matches!(panicked, Err(DriveError::Panicked { rank: 1 })),
            "{panicked:?}"
        );
    }
}
