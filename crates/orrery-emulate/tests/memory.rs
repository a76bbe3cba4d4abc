//! The counting allocator, installed in this test binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_emulate::memory::{reset_thread_peak, thread_live, thread_peak, CountingAlloc};

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
        let base = thread_peak();
        let other = std::thread::spawn(|| vec![1u8; 1 << 22]).join().unwrap();
        assert!(thread_peak() - base < 1 << 16, "{}", thread_peak() - base);
        drop(other);
    })
    .join()
    .unwrap();
}
