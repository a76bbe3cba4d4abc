//! # orrery-units: the quantities every other crate speaks in
//!
//! orrery moves numbers between very different layers: a job spec written by a person, an
//! execution graph with millions of ops, a discrete-event replay and a report. Mixing up
//! bytes and bits, seconds and picoseconds, or a rank id with an op id is the classic way
//! such a tool goes quietly wrong, so every quantity that crosses a crate boundary has a
//! newtype here.
//!
//! Key types:
//! - [`Picos`]: simulated time and durations, integer picoseconds. Events are ordered by
//!   integers, never by floats, so replays are deterministic; `u64` picoseconds last
//!   about 213 days of simulated time, far beyond any training step.
//! - [`Bytes`]: sizes of tensors, messages and memory, as `u64`.
//! - [`Flops`], [`FlopRate`], [`Bandwidth`]: counts and rates that are naturally real
//!   numbers (a 405B model's step is ~1e19 FLOPs, beyond exact `u64` arithmetic anyway).
//! - Dense id newtypes ([`RankId`], [`OpId`], [`GroupId`], [`ClassId`], [`NodeId`],
//!   [`LinkId`], [`FlowId`]) that index arenas.
//!
//! - [`frame`]: the checksummed frame (magic, version, length, CRC32) around every file
//!   orrery writes for itself and reads back.
//! - [`trace_text`]: exact microseconds and JSON strings for the trace files written by hand.
//!
//! What this crate deliberately does not do: parse units from strings (that is the spec's
//! job, where errors can name the field), or know anything about LLMs or networks.

pub mod frame;
pub mod trace_text;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// Picoseconds per second, the conversion every rate-to-time computation goes through.
pub const PICOS_PER_SEC: f64 = 1e12;

/// A point in simulated time or a duration, in integer picoseconds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Picos(pub u64);

impl Picos {
    pub const ZERO: Picos = Picos(0);

    /// Rounds a non-negative number of seconds to the nearest picosecond. Negative or
    /// non-finite inputs saturate to zero or `u64::MAX` so a cost model can never make
    /// time run backwards.
    pub fn from_secs_f64(secs: f64) -> Picos {
        if secs.is_nan() || secs <= 0.0 {
            return Picos::ZERO;
        }
        let ps = (secs * PICOS_PER_SEC).round();
        if ps >= u64::MAX as f64 {
            Picos(u64::MAX)
        } else {
            Picos(ps as u64)
        }
    }

    pub fn from_micros(us: u64) -> Picos {
        Picos(us.saturating_mul(1_000_000))
    }

    pub fn from_nanos(ns: u64) -> Picos {
        Picos(ns.saturating_mul(1_000))
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / PICOS_PER_SEC
    }

    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    pub fn as_micros_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    pub fn saturating_sub(self, other: Picos) -> Picos {
        Picos(self.0.saturating_sub(other.0))
    }
}

impl Add for Picos {
    type Output = Picos;
    fn add(self, rhs: Picos) -> Picos {
        Picos(self.0.saturating_add(rhs.0))
    }
}

impl AddAssign for Picos {
    fn add_assign(&mut self, rhs: Picos) {
        *self = *self + rhs;
    }
}

impl Sub for Picos {
    type Output = Picos;
    /// Saturating: a duration is never negative.
    fn sub(self, rhs: Picos) -> Picos {
        self.saturating_sub(rhs)
    }
}

impl std::iter::Sum for Picos {
    fn sum<I: Iterator<Item = Picos>>(iter: I) -> Picos {
        iter.fold(Picos::ZERO, |a, b| a + b)
    }
}

impl fmt::Display for Picos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.as_secs_f64();
        if s >= 1.0 {
            write!(f, "{s:.3} s")
        } else if s >= 1e-3 {
            write!(f, "{:.3} ms", s * 1e3)
        } else {
            write!(f, "{:.3} us", s * 1e6)
        }
    }
}

/// A size in bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Bytes(pub u64);

impl Bytes {
    pub const ZERO: Bytes = Bytes(0);

    /// Bytes from a real-valued size, rounded to the nearest byte (negative saturates to 0).
    pub fn from_f64(b: f64) -> Bytes {
        if b.is_nan() || b <= 0.0 {
            Bytes(0)
        } else if b >= u64::MAX as f64 {
            Bytes(u64::MAX)
        } else {
            Bytes(b.round() as u64)
        }
    }

    pub fn from_gib(gib: f64) -> Bytes {
        Bytes::from_f64(gib * GIB)
    }

    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }

    pub fn as_gib(self) -> f64 {
        self.0 as f64 / GIB
    }

    /// Decimal gigabytes (1e9), the unit of published memory tables.
    pub fn as_gb(self) -> f64 {
        self.0 as f64 / 1e9
    }

    pub fn saturating_sub(self, other: Bytes) -> Bytes {
        Bytes(self.0.saturating_sub(other.0))
    }
}

/// Bytes in a gibibyte.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, rhs: Bytes) -> Bytes {
        Bytes(self.0.saturating_add(rhs.0))
    }
}

impl AddAssign for Bytes {
    fn add_assign(&mut self, rhs: Bytes) {
        *self = *self + rhs;
    }
}

impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        iter.fold(Bytes::ZERO, |a, b| a + b)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if b >= GIB {
            write!(f, "{:.2} GiB", b / GIB)
        } else if b >= 1024.0 * 1024.0 {
            write!(f, "{:.2} MiB", b / (1024.0 * 1024.0))
        } else if b >= 1024.0 {
            write!(f, "{:.2} KiB", b / 1024.0)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

/// A count of floating-point operations.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
pub struct Flops(pub f64);

impl Add for Flops {
    type Output = Flops;
    fn add(self, rhs: Flops) -> Flops {
        Flops(self.0 + rhs.0)
    }
}

impl AddAssign for Flops {
    fn add_assign(&mut self, rhs: Flops) {
        self.0 += rhs.0;
    }
}

/// A compute rate in FLOP per second.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
pub struct FlopRate(pub f64);

impl FlopRate {
    pub fn from_tflops(t: f64) -> FlopRate {
        FlopRate(t * 1e12)
    }
    pub fn as_tflops(self) -> f64 {
        self.0 / 1e12
    }
    /// Time to execute `flops` at this rate; a zero or negative rate gives zero time
    /// only for zero work and saturates otherwise.
    pub fn time_for(self, flops: Flops) -> Picos {
        if flops.0 <= 0.0 {
            return Picos::ZERO;
        }
        if self.0 <= 0.0 {
            return Picos(u64::MAX);
        }
        Picos::from_secs_f64(flops.0 / self.0)
    }
}

/// A data rate in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default, Serialize, Deserialize)]
pub struct Bandwidth(pub f64);

impl Bandwidth {
    /// Decimal gigabytes per second (1e9 B/s), the unit of datasheets.
    pub fn from_gbytes_per_sec(gb: f64) -> Bandwidth {
        Bandwidth(gb * 1e9)
    }
    /// Gigabits per second, the unit of NIC names (HDR 200 Gb/s = 25 GB/s).
    pub fn from_gbits_per_sec(gbit: f64) -> Bandwidth {
        Bandwidth(gbit * 1e9 / 8.0)
    }
    pub fn as_gbytes_per_sec(self) -> f64 {
        self.0 / 1e9
    }
    pub fn scale(self, factor: f64) -> Bandwidth {
        Bandwidth(self.0 * factor)
    }
    /// Time to move `bytes` at this rate.
    pub fn time_for(self, bytes: f64) -> Picos {
        if bytes <= 0.0 {
            return Picos::ZERO;
        }
        if self.0 <= 0.0 {
            return Picos(u64::MAX);
        }
        Picos::from_secs_f64(bytes / self.0)
    }
}

macro_rules! dense_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
        )]
        pub struct $name(pub u32);

        impl $name {
            /// The arena index this id stands for.
            pub fn index(self) -> usize {
                self.0 as usize
            }
            /// The id of arena slot `i`. Arenas are bounded well below `u32::MAX` by
            /// construction (validated job sizes), so this never truncates in practice.
            pub fn from_index(i: usize) -> Self {
                $name(u32::try_from(i).unwrap_or(u32::MAX))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

dense_id!(
    /// A global rank (one GPU) of a job, `0..world_size`.
    RankId
);
dense_id!(
    /// An op in one execution graph's op arena.
    OpId
);
dense_id!(
    /// A communication group in a job's group table.
    GroupId
);
dense_id!(
    /// A symmetry class of ranks: ranks of one class execute identical graphs.
    ClassId
);
dense_id!(
    /// A vertex of a network topology (a GPU/NIC endpoint or a switch).
    NodeId
);
dense_id!(
    /// A directed link of a network topology.
    LinkId
);
dense_id!(
    /// A flow (one message from one endpoint to another) in a network simulation.
    FlowId
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn picos_round_trip_and_display() {
        assert_eq!(Picos::from_secs_f64(1.5).0, 1_500_000_000_000);
        assert_eq!(Picos::from_secs_f64(-1.0), Picos::ZERO);
        assert_eq!(Picos::from_secs_f64(f64::NAN), Picos::ZERO);
        assert_eq!(Picos::from_micros(3).0, 3_000_000);
        assert_eq!(format!("{}", Picos::from_secs_f64(0.0125)), "12.500 ms");
        assert_eq!(Picos(5) - Picos(9), Picos::ZERO);
    }

    #[test]
    fn bandwidth_units() {
        let hdr = Bandwidth::from_gbits_per_sec(200.0);
        assert_eq!(hdr.as_gbytes_per_sec(), 25.0);
        // 25 GB at 25 GB/s takes one second.
        assert_eq!(hdr.time_for(25e9), Picos::from_secs_f64(1.0));
        assert_eq!(Bandwidth(0.0).time_for(1.0), Picos(u64::MAX));
    }

    #[test]
    fn flop_rate_time() {
        let r = FlopRate::from_tflops(312.0);
        assert_eq!(r.time_for(Flops(312e12)), Picos::from_secs_f64(1.0));
        assert_eq!(r.time_for(Flops(0.0)), Picos::ZERO);
    }

    proptest! {
        #[test]
        fn picos_add_is_monotone(a in 0u64..u64::MAX / 2, b in 0u64..u64::MAX / 2) {
            prop_assert!(Picos(a) + Picos(b) >= Picos(a));
            prop_assert_eq!((Picos(a) + Picos(b)) - Picos(b), Picos(a));
        }

        #[test]
        fn secs_round_trip_within_a_picosecond(ps in 0u64..1_000_000_000_000_000u64) {
            let back = Picos::from_secs_f64(Picos(ps).as_secs_f64());
            // f64 carries 53 bits, so round trips are exact below 2^53 ps (~2.5 hours).
            prop_assert!(back.0.abs_diff(ps) <= 1);
        }
    }
}
