//! # orrery-emulate: real ranks among virtual ones
//!
//! Hybrid emulation runs the ranks a user cares about as the real training program and
//! replays every other rank from an execution graph, so that a step of an 8,192-GPU job can
//! be observed with real compute and real memory on a handful of devices. The replay side
//! (live participants, pruning, perturbations) is `orrery_predict::emulate`; this crate is
//! the bridge between it and the running program.
//!
//! Key types:
//! - [`Coordinator`] drives an `Emulation` from the real ranks' reports: each real rank
//!   reports, in order, how long each compute segment between two communication calls took
//!   ([`Report`]), and the coordinator hands those durations to the engine as it reaches
//!   the rank's compute ops. A rank that stops reporting (hung) is an error after a
//!   timeout, a rank whose program ended early (crashed) is an error at once, and a rank
//!   that reports more or fewer segments than its graph has is an error naming the rank.
//!
//! The real ranks never wait for the coordinator: a rank reports a segment when it enters
//! its next communication call and goes on (its data exchange with other real ranks is
//! real, with virtual ranks synthesised by its communicator). Simulated time only follows
//! from the reports, so the program may run as fast as the machine lets it, and the
//! coordinator never holds a rank that another real rank is waiting for.
//!
//! - [`memory::CountingAlloc`] counts the bytes each thread allocates, so that a real rank
//!   on the CPU reports its measured peak memory (the only unsafe code in orrery: a
//!   `GlobalAlloc` that forwards to the system allocator).
//!
//! What this crate deliberately does not do: decide durations of virtual ranks (the replay
//! does, from collected graphs or the cost model) or make a real rank's wall time follow
//! simulated time. It reads the wall clock only for its timeouts.

pub mod coordinator;
pub mod memory;

pub use coordinator::{Coordinator, CoordinatorError, RankReporter, Report};
