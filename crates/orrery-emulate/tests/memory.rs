//! The counting allocator, installed in this test binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_emulate::memory::{
    reset_thread_peak, thread_live, thread_peak, uncounted, CountingAlloc,
};
use std::alloc::{GlobalAlloc, Layout};
use std::sync::mpsc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn a_thread_counts_its_own_allocations_and_peak() {
    std::thread::spawn(|| {
        reset_thread_peak();
        let base = thread_live();
        let a = vec![0u8; 1 << 20];
        assert_eq!(thread_live() - base, 1 << 20);
        let b = vec![0u8; 1 << 19];
        assert_eq!(thread_peak() - base, (1 << 20) + (1 << 19));
        drop(a);
        drop(b);
        assert_eq!(thread_live(), base);
        // The peak stays until reset.
        assert_eq!(thread_peak() - base, (1 << 20) + (1 << 19));
        reset_thread_peak();
        assert_eq!(thread_peak(), base);
        // Growing a vector counts the difference.
        let mut v: Vec<u8> = Vec::with_capacity(1000);
        v.reserve_exact(3000);
        assert_eq!(thread_live() - base, v.capacity() as i64);
    })
    .join()
    .unwrap();
}

#[test]
fn other_threads_do_not_count() {
    std::thread::spawn(|| {
        reset_thread_peak();
        let base = thread_live();
        let other = std::thread::spawn(|| vec![1u8; 1 << 22]).join().unwrap();
        assert!(thread_peak() - base < 1 << 16, "{}", thread_peak() - base);
        // Freeing another thread's block is not this thread's business either (it once
        // drove this count 4 MiB below what the thread held).
        drop(other);
        assert_eq!(thread_live(), base);
    })
    .join()
    .unwrap();
}

#[test]
fn a_block_freed_by_another_thread_leaves_its_owners_count() {
    std::thread::spawn(|| {
        let base = thread_live();
        let block = vec![7u8; 1 << 20];
        assert_eq!(thread_live() - base, 1 << 20);
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let freer = std::thread::spawn(move || {
            let freer_base = thread_live();
            drop(block);
            // The freeing thread's count does not move.
            assert_eq!(thread_live(), freer_base);
            done_tx.send(()).unwrap();
        });
        done_rx.recv().unwrap();
        freer.join().unwrap();
        // The owner's does. What may be left is what this thread allocated for the channel
        // and the spawned thread's handle (under the 4 KiB allowed).
        assert!(
            (thread_live() - base).abs() < 1 << 12,
            "{}",
            thread_live() - base
        );
    })
    .join()
    .unwrap();
}

#[test]
fn what_an_uncounted_call_allocates_belongs_to_no_thread() {
    std::thread::spawn(|| {
        let base = thread_live();
        let mut programs = vec![0u8; 1000];
        let message = uncounted(|| {
            // A counted block resized here stays counted: the program's buffer grew.
            programs.resize(5000, 1);
            vec![3u8; 1 << 20]
        });
        assert_eq!(thread_live() - base, programs.capacity() as i64);
        // Wherever the message is freed, no count moves.
        let before = thread_live();
        std::thread::spawn(move || drop(message)).join().unwrap();
        assert_eq!(thread_live(), before);
        drop(programs);
        assert_eq!(thread_live(), base);
    })
    .join()
    .unwrap();
}

#[test]
fn blocks_keep_their_alignment_and_contents_through_resizes() {
    let a = CountingAlloc;
    for align in [1usize, 2, 8, 16, 64, 4096] {
        let layout = Layout::from_size_align(24, align).unwrap();
        // SAFETY: a non-zero layout, then the block with the layout it was allocated with.
        #[allow(unsafe_code)]
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            assert_eq!(p as usize % align, 0, "align {align}");
            for i in 0..24 {
                p.add(i).write(i as u8);
            }
            let q = a.realloc(p, layout, 10_000);
            assert_eq!(q as usize % align, 0, "align {align} after growing");
            for i in 0..24 {
                assert_eq!(q.add(i).read(), i as u8);
            }
            let grown = Layout::from_size_align(10_000, align).unwrap();
            let z = a.alloc_zeroed(grown);
            assert!((0..10_000).all(|i| z.add(i).read() == 0));
            a.dealloc(z, grown);
            a.dealloc(q, grown);
        }
    }
}
