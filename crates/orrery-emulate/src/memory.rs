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
//! A block is charged to the thread that allocated it, whichever thread frees it: each
//! block carries its owner in a small header (8 bytes before the block, or the block's
//! alignment where that is larger), and a free lowers the owner's count. burn's autodiff
//! keeps one graph registry for the whole process, so a rank's thread now and then frees
//! nodes another thread allocated (another rank's, or another test's); counted by the
//! freeing thread, as this allocator did before, such a free drove a rank's count below
//! what it held, and once a rank measured a peak of 0 B. A thread's figures are the bytes
//! of the blocks it allocated that nobody has freed yet.
//!
//! What a communicator allocates is not the program's memory: the emulation's and the
//! recording's communicators run every call in [`uncounted`], so the messages and records
//! they make belong to no thread (a message allocated by one rank's thread and freed by
//! its receiver's counts for neither). A block that was counted stays counted when it is
//! resized there (a program's buffer a broadcast grows is the program's). What a call
//! returns newly allocated is not counted either: only `all_gather_bytes` does, which the
//! trainer uses for checkpoints and for single scalars, and every other call fills buffers
//! the program allocated itself.
//!
//! Owners are kept in a table of [`OWNER_SLOTS`] counters, a thread taking slot `id %
//! OWNER_SLOTS` on its first allocation (ids count up from 1, never reused). A free whose
//! owner no longer holds its slot (the thread ended and a later one took the slot) goes
//! uncounted, and so do the allocations of a thread whose slot a later thread took while
//! it still ran, which takes more than [`OWNER_SLOTS`] threads alive at once.
//!
//! What it does not do: count what the CUDA driver itself holds on the device (its
//! context, cuBLAS' workspace). Without the allocator installed every host figure stays
//! zero.

use orrery_graph::collect::MemorySample;
use orrery_units::Bytes;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Threads whose counts can be kept at once (see the module docs).
pub const OWNER_SLOTS: usize = 4096;

/// The owner recorded for a block that belongs to no thread.
const NO_OWNER: u64 = 0;

/// One thread's counts, readable and lowered by every thread.
struct OwnerSlot {
    /// The id of the thread that holds the slot ([`NO_OWNER`]: none yet).
    owner: AtomicU64,
    /// Bytes of the owner's blocks not yet freed.
    live: AtomicI64,
    /// The most `live` has been since the owner started or last reset it.
    peak: AtomicI64,
}

static SLOTS: [OwnerSlot; OWNER_SLOTS] = [const {
    OwnerSlot {
        owner: AtomicU64::new(NO_OWNER),
        live: AtomicI64::new(0),
        peak: AtomicI64::new(0),
    }
}; OWNER_SLOTS];

/// The next thread id to hand out.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's id ([`NO_OWNER`] until its first allocation).
    static THREAD: Cell<u64> = const { Cell::new(NO_OWNER) };
    /// How many [`uncounted`] calls this thread is inside.
    static UNCOUNTED: Cell<u32> = const { Cell::new(0) };
    static SOURCE: Cell<MemorySource> = const { Cell::new(MemorySource::HostAllocator) };
}

/// This thread's slot, taken on first use; `None` where a later thread took it.
fn my_slot() -> Option<(u64, &'static OwnerSlot)> {
    let id = THREAD.with(|t| {
        if t.get() == NO_OWNER {
            let id = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            let slot = &SLOTS[(id % OWNER_SLOTS as u64) as usize];
            // The slot's earlier owner, if any, has ended (or runs among more threads than
            // there are slots, and loses its counts): its blocks' frees find another owner
            // here and go uncounted. The owner changes first, so that such a free stops
            // matching before the counts restart; one that matched just before can still
            // land on the new counts, a race only a slot's reuse opens.
            slot.owner.store(id, Ordering::Relaxed);
            slot.live.store(0, Ordering::Relaxed);
            slot.peak.store(0, Ordering::Relaxed);
            t.set(id);
        }
        t.get()
    });
    owned_slot(id).map(|s| (id, s))
}

/// The slot of thread `id`, if it still holds one.
fn owned_slot(id: u64) -> Option<&'static OwnerSlot> {
    if id == NO_OWNER {
        return None;
    }
    let slot = &SLOTS[(id % OWNER_SLOTS as u64) as usize];
    (slot.owner.load(Ordering::Relaxed) == id).then_some(slot)
}

/// Runs `f` with what it allocates on this thread belonging to no thread (see the module
/// docs): a communicator's messages and records.
pub fn uncounted<T>(f: impl FnOnce() -> T) -> T {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            UNCOUNTED.with(|u| u.set(u.get() - 1));
        }
    }
    UNCOUNTED.with(|u| u.set(u.get() + 1));
    let _leave = Leave;
    f()
}

/// The owner a block allocated now gets, with its slot (`None`: no thread's).
fn new_owner() -> Option<(u64, &'static OwnerSlot)> {
    if UNCOUNTED.with(Cell::get) > 0 {
        return None;
    }
    my_slot()
}

/// Adds `delta` bytes to `owner`'s count (nothing for a block of no thread's).
fn charge(owner: u64, delta: i64) {
    if let Some(slot) = owned_slot(owner) {
        charge_slot(slot, delta);
    }
}

/// Adds `delta` bytes to the count in `slot`, and raises its peak.
fn charge_slot(slot: &OwnerSlot, delta: i64) {
    let now = slot.live.fetch_add(delta, Ordering::Relaxed) + delta;
    if delta > 0 && now > slot.peak.load(Ordering::Relaxed) {
        slot.peak.fetch_max(now, Ordering::Relaxed);
    }
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
/// nothing restarts there). `None` where the source could not be read.
pub fn sample() -> Option<MemorySample> {
    match source() {
        MemorySource::HostAllocator => Some(MemorySample {
            live: Bytes(thread_live().max(0) as u64),
            peak: Bytes(thread_peak().max(0) as u64),
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

/// The system allocator, counting bytes per owning thread (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

/// Where a block of `layout` starts after its header, and the layout the system allocator
/// sees (header included); `None` where the size overflows.
fn with_header(layout: Layout) -> Option<(usize, Layout)> {
    // The header is the owner id, in the 8 bytes just before the block; the offset keeps
    // the block at its alignment.
    let offset = layout.align().max(8);
    let size = layout.size().checked_add(offset)?;
    Layout::from_size_align(size, offset)
        .ok()
        .map(|l| (offset, l))
}

#[allow(unsafe_code)]
// SAFETY (for the whole impl): every block is a `System` block of the header-extended
// layout (`with_header`), which is at least 8-aligned and holds the owner id in the 8
// bytes before the pointer handed out, which is `offset` bytes in and so aligned as the
// caller asked; the counters are atomics and plain thread-local cells that never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some((offset, full)) = with_header(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `full` has a non-zero size (it holds the header).
        let base = unsafe { System.alloc(full) };
        // SAFETY: as in `alloc_zeroed` below.
        unsafe { finish_alloc(base, offset, layout.size()) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let Some((offset, full)) = with_header(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: as in `alloc`.
        let base = unsafe { System.alloc_zeroed(full) };
        // SAFETY: `base` is null or a block of `full`, `offset` >= 8 bytes into which the
        // caller's block starts.
        unsafe { finish_alloc(base, offset, layout.size()) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some((offset, full)) = with_header(layout) else {
            return;
        };
        // SAFETY: `ptr` came from `alloc` with `layout`, so its header is 8 bytes before it
        // and its block starts `offset` bytes before it, allocated with `full`.
        unsafe {
            charge(header(ptr).read(), -(layout.size() as i64));
            System.dealloc(ptr.sub(offset), full);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // The new size with its header must itself be a valid layout (no overflow of
        // `isize` once rounded to the alignment), as `System.realloc` requires.
        let new_layout = Layout::from_size_align(new_size, layout.align()).ok();
        let (Some((offset, full)), Some((_, new_full))) =
            (with_header(layout), new_layout.and_then(with_header))
        else {
            return std::ptr::null_mut();
        };
        // SAFETY: as in `dealloc`; `System.realloc` keeps the first bytes of the block, so
        // the header stays where it was relative to the caller's pointer, and its owner
        // keeps the block (a block is its first allocator's).
        unsafe {
            let owner = header(ptr).read();
            let base = System.realloc(ptr.sub(offset), full, new_full.size());
            if base.is_null() {
                return base;
            }
            charge(owner, new_size as i64 - layout.size() as i64);
            base.add(offset)
        }
    }
}

/// The owner id's place, just before the block at `ptr`.
///
/// # Safety
/// `ptr` must be a block this allocator handed out.
#[allow(unsafe_code)]
unsafe fn header(ptr: *mut u8) -> *mut u64 {
    // SAFETY: the header's 8 bytes lie inside the `System` block, before `ptr`, and are
    // 8-aligned because `ptr` is (the offset is a multiple of 8 from an 8-aligned base).
    unsafe { ptr.sub(8).cast::<u64>() }
}

/// Writes the new block's owner into its header and charges it; returns the caller's
/// pointer (null where the system allocator failed).
///
/// # Safety
/// `base` must be null or a fresh `System` block with at least `offset` bytes before the
/// caller's, `offset` >= 8 and a multiple of 8.
#[allow(unsafe_code)]
unsafe fn finish_alloc(base: *mut u8, offset: usize, size: usize) -> *mut u8 {
    if base.is_null() {
        return base;
    }
    let owner = new_owner();
    // SAFETY: per the contract, the block's caller part starts `offset` bytes in, and its
    // header is the 8 bytes before that, inside the block.
    unsafe {
        let ptr = base.add(offset);
        header(ptr).write(owner.map_or(NO_OWNER, |(id, _)| id));
        if let Some((_, slot)) = owner {
            charge_slot(slot, size as i64);
        }
        ptr
    }
}

/// Bytes of this thread's blocks not yet freed, by whichever thread (since it started).
pub fn thread_live() -> i64 {
    my_slot().map_or(0, |(_, s)| s.live.load(Ordering::Relaxed))
}

/// The most bytes this thread's blocks have held at once since it started or since the last
/// [`reset_thread_peak`].
pub fn thread_peak() -> i64 {
    my_slot().map_or(0, |(_, s)| s.peak.load(Ordering::Relaxed))
}

/// Starts a new peak from what the thread holds now.
pub fn reset_thread_peak() {
    if let Some((_, s)) = my_slot() {
        s.peak
            .store(s.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}
