//! Memory a real rank holds, as measured: counted per thread on the CPU, read from the
//! backend's pool on a GPU.
//!
//! Hybrid emulation reports each real rank's peak memory as measured, not modelled. On the
//! CPU it is this counting allocator: [`CountingAlloc`] wraps the system allocator and
//! keeps, per thread, the bytes allocated and not yet freed and their peak. A program
//! installs it as its global allocator (`#[global_allocator] static A: CountingAlloc =
//! CountingAlloc;`); a real rank running on a thread reads its own figures with
//! [`thread_live`] and [`thread_peak`] and starts a new peak with [`reset_thread_peak`].
//!
//! On a CUDA GPU (feature `cuda`) a rank's thread says so with [`measure_from`]
//! ([`MemorySource::CudaPool`]) and its figures come from burn's CUDA backend: the memory
//! pool of the thread's stream (cubecl keeps one per stream, and gives each new thread the
//! next of its 128 streams, so a rank's own unless a process starts more threads than that),
//! its bytes in use as the live figure and its reservation as the peak. The pool reports no
//! peak of its own. It reserves whole pages (up to a quarter of the device each) and keeps
//! them, so the reservation at a segment's end is the most the rank's stream has held since
//! it began, warm-up steps included: an upper bound on what the segment's tensors used at
//! once, possibly by several times, and what the device gave away. Reading the pool waits
//! for the device; a device that fails there panics the rank's thread, which the driver
//! reports as a panicked rank. A finished rank's pool is handed back ([`release_device`]),
//! so ranks that run one after another on one GPU do not add up. CI type-checks this path
//! (`cargo clippy --workspace --features orrery-cli/cuda --all-targets`); its test
//! (`tests/gpu.rs`, ignored without a GPU) has not run on one yet.
//!
//! What it does not do: follow memory across threads. A block freed by another thread
//! than the one that allocated it lowers the freeing thread's count (which may go below
//! zero), so a rank whose tensors are freed by worker threads reads too much. orrery's
//! trainer allocates and frees on the rank's own thread (burn's ndarray backend without
//! its parallel feature). Without the allocator installed every host figure stays zero.
//! Nor does it count what the CUDA driver itself holds on the device (its context, cuBLAS'
//! workspace).

use orrery_graph::collect::MemorySample;
use orrery_units::Bytes;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
    static SOURCE: Cell<MemorySource> = const { Cell::new(MemorySource::HostAllocator) };
}

/// Where a thread's memory figures come from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemorySource {
    /// [`CountingAlloc`]'s per-thread counts: a rank on the CPU.
    #[default]
    HostAllocator,
    /// The CUDA backend's memory pool for the thread's stream: a rank on a GPU.
    #[cfg(feature = "cuda")]
    CudaPool,
}

/// From now on, this thread's memory samples come from `source` (a new thread starts with
/// [`MemorySource::HostAllocator`]).
pub fn measure_from(source: MemorySource) {
    let _ = SOURCE.try_with(|s| s.set(source));
}

/// Where this thread's memory samples come from.
pub fn source() -> MemorySource {
    SOURCE
        .try_with(Cell::get)
        .unwrap_or(MemorySource::HostAllocator)
}

/// This thread's memory now, from its [`source`]: what it holds and its peak since the last
/// [`reset_thread_peak`] (the GPU pool's reservation is read afresh at every sample, so
/// nothing restarts there). Host figures leave out `not_the_programs` bytes (a
/// communicator's own buffers). `None` where the source could not be read.
pub fn sample(not_the_programs: i64) -> Option<MemorySample> {
    match source() {
        MemorySource::HostAllocator => Some(MemorySample {
            live: Bytes((thread_live() - not_the_programs).max(0) as u64),
            peak: Bytes((thread_peak() - not_the_programs).max(0) as u64),
        }),
        #[cfg(feature = "cuda")]
        MemorySource::CudaPool => cuda_pool(),
    }
}

/// Hands the memory the device pool of this thread's stream holds but no longer uses back to
/// the device (nothing on the host): a rank on a GPU calls it when it is done.
pub fn release_device() {
    #[cfg(feature = "cuda")]
    if source() == MemorySource::CudaPool {
        use burn::cubecl::Runtime;
        burn::cubecl::cuda::CudaRuntime::client(&Default::default()).memory_cleanup();
    }
}

/// The CUDA pool of this thread's stream on the default device (the trainer's): bytes in
/// use, and the reservation as the peak.
#[cfg(feature = "cuda")]
fn cuda_pool() -> Option<MemorySample> {
    use burn::cubecl::Runtime;
    let client = burn::cubecl::cuda::CudaRuntime::client(&Default::default());
    let usage = client.memory_usage().ok()?;
    Some(MemorySample {
        live: Bytes(usage.bytes_in_use),
        peak: Bytes(usage.bytes_reserved.max(usage.bytes_in_use)),
    })
}

/// The system allocator, counting bytes per thread (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

fn add(delta: i64) {
    // `try_with`: a thread being torn down has no counters left; its last frees go
    // uncounted rather than aborting.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| {
            if now > peak.get() {
                peak.set(now);
            }
        });
    });
}

#[allow(unsafe_code)]
// SAFETY (for the whole impl): every call is forwarded unchanged to `System`, which upholds
// the `GlobalAlloc` contract; the counters are plain thread-local cells that never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout, as the contract requires.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (through this allocator).
        unsafe { System.dealloc(ptr, layout) };
        add(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `dealloc`, with the caller's new size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            add(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

/// Bytes this thread has allocated and not freed (since it started).
pub fn thread_live() -> i64 {
    LIVE.try_with(Cell::get).unwrap_or(0)
}

/// The most bytes this thread has held at once since it started or since the last
/// [`reset_thread_peak`].
pub fn thread_peak() -> i64 {
    PEAK.try_with(Cell::get).unwrap_or(0)
}

/// Starts a new peak from what the thread holds now.
pub fn reset_thread_peak() {
    let live = thread_live();
    let _ = PEAK.try_with(|p| p.set(live));
}
