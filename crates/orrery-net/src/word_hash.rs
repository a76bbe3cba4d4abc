//! [`WordMap`] and [`WordSet`]: hash maps keyed by the network models' own ids and labels,
//! under a fixed multiply-rotate hash of machine words instead of the standard library's
//! SipHash.
//!
//! Why: the packet model's symmetry search builds maps of links, nodes and flow labels for
//! every shift it tries, and the predictor's job traffic maps ranks and groups to flows;
//! under callgrind SipHash took 13.7% of the instructions of `orrery netsim` on the
//! accelerated GPT 350M step at 128 GPUs. The keys are the models' own (integers,
//! short vectors of them), never an adversary's, so collision resistance buys nothing.
//!
//! The hash is fixed, where SipHash's keys are drawn per process, so a map's layout no
//! longer varies between runs; nothing may depend on it anyway, since no code of the
//! models iterates a hash map where the order could reach an output.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// An odd 64-bit multiplier whose bits are well mixed (from the digits of pi's fraction,
/// forced odd), so each word's bits spread over the high half of the state.
const MULTIPLIER: u64 = 0x243f_6a88_85a3_08d3;

/// The hasher: each word is folded in by `rotate, xor, multiply`; `finish` mixes the high
/// half, where the multiplies leave the entropy, into the low bits the table indexes by.
#[derive(Debug, Default, Clone, Copy)]
pub struct WordHasher(u64);

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(MULTIPLIER);
    }
}

impl Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The length tells a short tail from the same bytes followed by zeros.
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        // One more multiply between two folds of the high half: a plain fold leaves keys
        // in steps of a power of two (whose low bits the multiply keeps zero) in a
        // fraction of the buckets (the test below).
        let x = (self.0 ^ (self.0 >> 32)).wrapping_mul(MULTIPLIER);
        x ^ (x >> 32)
    }
}

/// A hash map under [`WordHasher`].
pub type WordMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

/// A hash set under [`WordHasher`].
pub type WordSet<K> = HashSet<K, BuildHasherDefault<WordHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash>(value: &T) -> u64 {
        BuildHasherDefault::<WordHasher>::default().hash_one(value)
    }

    #[test]
    fn equal_keys_hash_alike_and_near_keys_apart() {
        assert_eq!(hash(&(3u32, vec![1u32, 2])), hash(&(3u32, vec![1u32, 2])));
        assert_ne!(hash(&1u64), hash(&2u64));
        assert_ne!(hash(&vec![1u32, 2]), hash(&vec![2u32, 1]));
        // A short tail is not the same bytes padded with zeros.
        let mut a = WordHasher::default();
        a.write(&[1, 2, 3]);
        let mut b = WordHasher::default();
        b.write(&[1, 2, 3, 0, 0, 0, 0, 0]);
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn consecutive_ids_spread_over_the_low_bits() {
        // A table of 1,024 buckets indexes by the low 10 bits: 4,096 consecutive ids
        // (and ids in steps of powers of two, a worst case for a plain multiply) must fill
        // most of them. (A single fold of the high half filled 499 at a step of 1,024.)
        for step in [1u64, 2, 1024, 1 << 20, 1 << 32] {
            let mut seen = WordSet::default();
            for i in 0..4096u64 {
                seen.insert(hash(&(i * step)) & 1023);
            }
            assert!(seen.len() > 900, "step {step}: {} buckets", seen.len());
        }
    }

    #[test]
    fn maps_work_as_maps() {
        let mut m: WordMap<(u32, u32), Vec<u32>> = WordMap::default();
        for i in 0..1000u32 {
            m.entry((i % 7, i % 11)).or_default().push(i);
        }
        assert_eq!(m.len(), 77);
        assert_eq!(m.values().map(Vec::len).sum::<usize>(), 1000);
        assert_eq!(
            m[&(0, 0)],
            (0..1000).filter(|i| i % 77 == 0).collect::<Vec<_>>()
        );
    }
}
