//! Memory a real rank allocates on the CPU, counted per thread.
//!
//! Hybrid emulation reports each real rank's peak memory as measured, not modelled. On a
//! GPU that is the backend's memory statistics; on the CPU it is this counting allocator:
//! [`CountingAlloc`] wraps the system allocator and keeps, per thread, the bytes allocated
//! and not yet freed and their peak. A program installs it as its global allocator
//! (`#[global_allocator] static A: CountingAlloc = CountingAlloc;`); a real rank running on
//! a thread reads its own figures with [`thread_live`] and [`thread_peak`] and starts a new
//! peak with [`reset_thread_peak`].
//!
//! What it does not do: follow memory across threads. A block freed by another thread
//! than the one that allocated it lowers the freeing thread's count (which may go below
//! zero), so a rank whose tensors are freed by worker threads reads too much. orrery's
//! trainer allocates and frees on the rank's own thread (burn's ndarray backend without
//! its parallel feature). Without the allocator installed every figure stays zero.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
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
