//! [`Rng`]: xoshiro256** seeded through SplitMix64, written here so that the sequence for a
//! seed is fixed by this file and not by a dependency's version.

/// SplitMix64's increment, the golden-ratio constant `2^64 / φ` rounded to odd.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// One step of SplitMix64 (Steele, Lea & Flood, 2014): advances `state` and returns the next
/// output. Used only to expand seeds: its outputs are a bijection of its counter, so four
/// consecutive ones are never all zero, which is the one state xoshiro must avoid.
#[inline]
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN_GAMMA);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform number in `[0, 1)` that is a fixed function of `seed` and `key`: a
/// counter-based draw, with no state to advance.
///
/// Use it where the draw belongs to an identifiable thing (one packet leaving one queue)
/// rather than to a position in a sequence, so that what one part of a simulation draws
/// cannot shift another part's numbers however the events of the two interleave. Each key
/// word goes through its own SplitMix64 step, chained, so keys differing in any one word
/// give independent-looking outputs.
#[inline]
pub fn keyed_unit(seed: u64, key: [u64; 3]) -> f64 {
    let mut h = seed;
    for k in key {
        let mut state = h ^ k;
        h = splitmix64(&mut state);
    }
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A deterministic pseudo-random number generator: xoshiro256** (Blackman & Vigna, 2018).
///
/// 256 bits of state, period 2^256 − 1, fast, and good enough for every statistical use a
/// simulator has (jitter, ECMP hash seeds, random drops, workload sampling); it is not
/// cryptographic. The same seed gives the same sequence on every platform: everything is
/// integer arithmetic on `u64`, and the float conversion is exact.
///
/// Give each component its own stream with [`fork`](Rng::fork) rather than sharing one
/// generator, so that adding a draw in one component does not shift every other component's
/// numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    pub(crate) s: [u64; 4],
}

impl Rng {
    /// A generator whose state is the first four SplitMix64 outputs from `seed`, the seeding
    /// the xoshiro authors recommend. Every seed, zero included, is fine.
    pub fn seed_from_u64(seed: u64) -> Rng {
        let mut sm = seed;
        Rng {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }

    /// The next 64 uniformly distributed bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform float in `[0, 1)`: the top 53 bits scaled by 2^-53, so every value is a
    /// multiple of 2^-53 and the conversion is exact on every platform.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `[lo, hi)`, without bias (Lemire's multiply-and-reject: the
    /// rejection loop runs with probability below `(hi − lo) / 2^64`). An empty range
    /// (`hi <= lo`) returns `lo` without drawing, rather than panicking.
    #[inline]
    pub fn gen_range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        let range = hi - lo;
        let mut m = u128::from(self.next_u64()) * u128::from(range);
        if (m as u64) < range {
            // 2^64 mod range: the number of low products that would over-represent some
            // outputs; reject them.
            let threshold = range.wrapping_neg() % range;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(range);
            }
        }
        lo + (m >> 64) as u64
    }

    /// `true` with probability `p`. `p <= 0` or NaN is always false and `p >= 1` always true;
    /// those draw nothing, the rest draw one `next_f64`.
    #[inline]
    pub fn bernoulli(&mut self, p: f64) -> bool {
        if p.is_nan() || p <= 0.0 {
            false
        } else if p >= 1.0 {
            true
        } else {
            self.next_f64() < p
        }
    }

    /// A child generator for stream `stream`, statistically independent of this one and of
    /// children for other streams.
    ///
    /// The child is seeded (through SplitMix64) from one draw of this generator mixed with the
    /// stream number, so the parent advances by one draw: forking the same streams in the same
    /// order from the same seed always gives the same children, and forking the same stream
    /// number twice gives two different children, never two copies of one sequence.
    pub fn fork(&mut self, stream: u64) -> Rng {
        let mut stream_state = stream;
        let mixed_stream = splitmix64(&mut stream_state);
        let mut sm = self.next_u64() ^ mixed_stream;
        Rng {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }
}
