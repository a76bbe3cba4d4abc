//! # orrery-emulate: real ranks among virtual ones
//!
//! Hybrid emulation runs the ranks a user cares about as the real training program and
//! replays every other rank from an execution graph, so that a step of an 8,192-GPU job can
//! be observed with real compute and real memory on a handful of devices. The replay side
//! (live participants, pruning, perturbations) is `orrery_predict::emulate`; this crate is
//! the bridge between it and the running program.
//!
//! Key types:
//! - [`comm::VirtualPeers`] is the communicator of a real rank whose peers do not exist:
//!   every operation returns at once with synthesised data (a virtual replica contributes
//!   the rank's own gradient, a virtual neighbour sends small deterministic values), and
//!   the rank's compute segments, memory and operations are recorded.
//!   [`comm::Recorded`] records the same way around a real communicator.
//! - [`drive`] runs the real program: [`drive::collect`] (`orrery collect`) records one
//!   step of each pipeline stage's representative and stitches the world's graphs;
//!   [`drive::emulate`] (`orrery emulate --train`) runs the chosen ranks live against them;
//!   [`drive::run_all_real`] is the all-real reference.
//! - [`Coordinator`] drives an `Emulation` from the real ranks' reports: each real rank
//!   reports, in order, how long each compute segment between two communication calls took
//!   ([`Report`]), and the coordinator hands those durations to the engine as it reaches
//!   the rank's compute ops. A rank that stops reporting (hung) is an error after a
//!   timeout, a rank whose program ended early (crashed) is an error at once, and a rank
//!   that reports more or fewer segments than its graph has is an error naming the rank.
//! - [`file::CollectionFile`]: a collection on disk (magic, version, length, CRC32).
//! - [`calibrate::MeasuredNetwork`]: a network model calibrated on the collectives a real
//!   run measured, to compare an emulation with that run on the run's own interconnect.
//!
//! The real ranks never wait for the coordinator: a rank reports a segment when it enters
//! its next communication call and goes on. Simulated time only follows from the reports,
//! so the program may run as fast as the machine lets it, and the coordinator never holds a
//! rank that another real rank is waiting for.
//!
//! - [`memory::CountingAlloc`] counts the bytes each thread allocates (a block stays its
//!   allocating thread's whoever frees it), so that a real rank on the CPU reports its
//!   measured peak memory (the only unsafe code in orrery: a `GlobalAlloc` that forwards to
//!   the system allocator, with an owner header in front of each block).
//!
//! Real ranks of one emulation exchange real data with each other (over threads). A real
//! rank's expert all-to-all follows its router's choices of the step, with the virtual
//! members of its group taken to route as it does (their rows and the exchange's size,
//! reported with the segment before it); the engine sizes every virtual rank's copy of that
//! exchange in the real rank's stage the same way.
//!
//! What this crate deliberately does not do: decide durations of virtual ranks (the replay
//! does, from collected graphs or the cost model), or make a real rank's wall time follow
//! simulated time. The real ranks' segments are timed on a caller-supplied
//! `orrery_train::Clock`; the coordinator itself reads the wall clock for its timeout and
//! to time its own engine.

pub mod calibrate;
pub mod comm;
pub mod coordinator;
pub mod drive;
pub mod file;
pub mod memory;

pub use coordinator::{Coordinator, CoordinatorError, RankReporter, Report};
