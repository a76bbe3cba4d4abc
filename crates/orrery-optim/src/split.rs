//! Preconditioner refreshes split across data-parallel ranks, shared by SOAP (a basis per
//! rotated parameter) and Shampoo (the inverse roots of each block).
//!
//! Data-parallel ranks hold identical gradients and optimizer state, so refreshing every
//! preconditioner on every rank repeats the same work `world` times. With a split, every
//! refresh that may fall due is named by a [`Key`] and has one owner ([`assign_owners`], a pure
//! function of the keys and their costs, so every rank computes the same owners without
//! talking). Only the owner computes a refresh; it then decides ([`should_send`]) whether the
//! result is worth sending or whether every rank should keep the preconditioner in use, and
//! all decisions of a step travel in one all-gather ([`exchange`]). Every rank applies every
//! decision in rank order ([`apply_all`]), so the ranks' states never diverge. The optimizer
//! supplies only what is specific to it: what a refresh result is on the wire ([`Payload`]),
//! how far a refresh moved its preconditioner, and how to install one.

use std::collections::BTreeSet;

use crate::state::{Reader, Writer};
use crate::{OptimError, RankGroup, StepReport};

/// How an optimizer shares preconditioner refreshes among data-parallel ranks: SOAP's basis
/// refreshes ([`crate::SoapConfig::split`]) or Shampoo's inverse roots
/// ([`crate::ShampooConfig::split`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitRefresh {
    /// The owner keeps the preconditioner in use when the refresh moved it by at most this
    /// (SOAP: [`crate::basis_change`]; Shampoo: [`crate::root_change`]); 0 (or less) sends
    /// every refresh, which is bit-identical to every rank refreshing everything.
    pub threshold: f32,
    /// The owner sends a refresh, however small the change, once the preconditioner in use
    /// has been kept over this many consecutive refreshes (0: always send).
    pub max_kept: u64,
}

impl Default for SplitRefresh {
    fn default() -> Self {
        Self {
            threshold: 0.0,
            max_kept: 4,
        }
    }
}

/// Which rank refreshes each item: `costs[i]` is item `i`'s work, and the result is each
/// item's owner in `0..world`. Largest items first (ties by index), each to the rank with the
/// least work so far (ties to the lower rank) — the classic longest-processing-time rule, whose
/// busiest rank has at most 4/3 of the optimal makespan. It is a pure function of its inputs,
/// so every rank computes the same assignment without talking to the others.
pub fn assign_owners(costs: &[u64], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; world];
    let mut owner = vec![0usize; costs.len()];
    for i in order {
        let mut best = 0;
        for r in 1..world {
            if load[r] < load[best] {
                best = r;
            }
        }
        owner[i] = best;
        load[best] = load[best].saturating_add(costs[i]);
    }
    owner
}

/// Names one refresh: the parameter and the index of its preconditioner (always 0 for SOAP,
/// which has one basis pair per parameter; the block for Shampoo).
pub(crate) type Key = (String, usize);

/// The cost of decomposing an `n×n` side (0 for a side that is not preconditioned): the
/// decompositions are cubic, and that is what the owners' loads balance.
pub(crate) fn side_cost(n: usize, on: bool) -> u64 {
    if on {
        (n as u64).saturating_pow(3)
    } else {
        0
    }
}

/// The refreshes this rank owns among `items`: every refresh that may fall due this step with
/// its cost, listed in the same order on every rank.
pub(crate) fn owned(items: Vec<(Key, u64)>, group: &dyn RankGroup) -> BTreeSet<Key> {
    let costs: Vec<u64> = items.iter().map(|(_, c)| *c).collect();
    let owners = assign_owners(&costs, group.world_size());
    let rank = group.rank();
    items
        .into_iter()
        .zip(owners)
        .filter(|&(_, o)| o == rank)
        .map(|((key, _), _)| key)
        .collect()
}

/// A refresh result as it travels between ranks.
pub(crate) trait Payload: Sized {
    fn write(&self, w: &mut Writer);
    fn read(r: &mut Reader<'_>) -> Result<Self, OptimError>;
}

/// What the owner of a refresh decided, as sent to every rank.
#[derive(Debug)]
pub(crate) enum Decision<P> {
    /// Install this refreshed preconditioner.
    Send(P),
    /// Keep the preconditioner in use: the refresh changed it too little.
    Keep,
    /// The refresh failed on the owner; every rank reports this error.
    Failed(String),
}

/// The owner's rule: send when splitting has no threshold, when the preconditioner in use has
/// been kept `max_kept` times in a row, or when `change` (computed only if needed) exceeds the
/// threshold. A change that is not a number is sent: keeping is only for refreshes known to
/// be small.
pub(crate) fn should_send(split: SplitRefresh, kept: u64, change: impl FnOnce() -> f64) -> bool {
    if split.threshold <= 0.0 || kept >= split.max_kept {
        return true;
    }
    let c = change();
    c.is_nan() || c > f64::from(split.threshold)
}

/// Tags the exchange message; bump when its layout changes (ranks of one job run one build,
/// so no older layout needs to be read).
const SPLIT_TAG: &[u8; 8] = b"ORSPLIT2";

fn encode<P: Payload>(decisions: &[(Key, Decision<P>)]) -> Vec<u8> {
    let mut w = Writer::new(SPLIT_TAG);
    w.u64(decisions.len() as u64);
    for ((name, index), d) in decisions {
        w.str(name);
        w.u64(*index as u64);
        match d {
            Decision::Keep => w.u8(0),
            Decision::Send(p) => {
                w.u8(1);
                p.write(&mut w);
            }
            Decision::Failed(msg) => {
                w.u8(2);
                w.str(msg);
            }
        }
    }
    w.finish()
}

fn decode<P: Payload>(bytes: &[u8]) -> Result<Vec<(Key, Decision<P>)>, OptimError> {
    // A malformed message is an exchange failure, not bad saved state.
    let exchange = |e: OptimError| match e {
        OptimError::BadState(m) => OptimError::Exchange(format!("malformed message: {m}")),
        other => other,
    };
    let mut r = Reader::new(bytes, SPLIT_TAG).map_err(exchange)?;
    let n = r.len().map_err(exchange)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str().map_err(exchange)?;
        let index = usize::try_from(r.u64().map_err(exchange)?)
            .map_err(|_| OptimError::Exchange(format!("parameter `{name}`: index overflows")))?;
        let d = match r.u8().map_err(exchange)? {
            0 => Decision::Keep,
            1 => Decision::Send(P::read(&mut r).map_err(exchange)?),
            2 => Decision::Failed(r.str().map_err(exchange)?),
            x => {
                return Err(OptimError::Exchange(format!(
                    "parameter `{name}`: invalid decision {x}"
                )))
            }
        };
        out.push(((name, index), d));
    }
    r.end().map_err(exchange)?;
    Ok(out)
}

/// Sends this rank's decisions to every rank; returns every rank's decisions, in rank order.
pub(crate) fn exchange<P: Payload>(
    group: &mut dyn RankGroup,
    mine: &[(Key, Decision<P>)],
) -> Result<Vec<(Key, Decision<P>)>, OptimError> {
    let world = group.world_size();
    let all = group
        .all_gather_bytes(&encode(mine))
        .map_err(OptimError::Exchange)?;
    if all.len() != world {
        return Err(OptimError::Exchange(format!(
            "{} messages from a group of {world}",
            all.len()
        )));
    }
    let mut out = Vec::new();
    for bytes in &all {
        out.extend(decode(bytes)?);
    }
    Ok(out)
}

/// Applies every decision in order through `apply`, which installs a sent refresh
/// (`Some(result)`) or records that the preconditioner in use was kept (`None`), and counts
/// them in `report`. An owner's failure is reported after all other decisions are applied (so
/// every rank ends in the same state); an error of `apply` (a decision that does not fit this
/// optimizer's state) is returned at once.
pub(crate) fn apply_all<P>(
    all: Vec<(Key, Decision<P>)>,
    report: &mut StepReport,
    mut apply: impl FnMut(&Key, Option<P>) -> Result<(), OptimError>,
) -> Result<(), OptimError> {
    let mut failure = None;
    for (key, d) in all {
        match d {
            Decision::Keep => {
                apply(&key, None)?;
                report.bases_kept += 1;
            }
            Decision::Send(p) => {
                apply(&key, Some(p))?;
                report.bases_sent += 1;
            }
            Decision::Failed(msg) => {
                failure.get_or_insert(OptimError::Exchange(format!(
                    "parameter `{}`: the owner's refresh failed: {msg}",
                    key.0
                )));
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_item_has_one_owner_and_the_work_is_balanced() {
        let costs: Vec<u64> = (0..23u64).map(|i| (i * 37 % 11 + 1).pow(3)).collect();
        for world in 1..=6 {
            let owners = assign_owners(&costs, world);
            assert_eq!(owners.len(), costs.len());
            assert!(owners.iter().all(|&o| o < world));
            let mut load = vec![0u64; world];
            for (&o, &c) in owners.iter().zip(&costs) {
                load[o] += c;
            }
            let (max, min) = (load.iter().max().unwrap(), load.iter().min().unwrap());
            // Greedy assignment to the least-loaded rank: the spread is at most one item.
            assert!(max - min <= *costs.iter().max().unwrap(), "{load:?}");
            assert_eq!(owners, assign_owners(&costs, world), "deterministic");
        }
        assert_eq!(assign_owners(&[5, 5, 5], 0), vec![0, 0, 0], "world 0 is 1");
        assert_eq!(assign_owners(&[1, 9, 4], 5), vec![2, 0, 1], "largest first");
        assert!(assign_owners(&[], 3).is_empty());
    }

    #[test]
    fn the_owner_sends_past_the_threshold_or_the_keep_bound() {
        let split = SplitRefresh {
            threshold: 0.1,
            max_kept: 2,
        };
        assert!(!should_send(split, 0, || 0.1), "at the threshold: keep");
        assert!(should_send(split, 0, || 0.11));
        assert!(should_send(split, 2, || 0.0), "kept twice already");
        assert!(should_send(split, 0, || f64::NAN), "unknown change: send");
        let always = SplitRefresh {
            threshold: 0.0,
            max_kept: 9,
        };
        assert!(should_send(always, 0, || unreachable!("not measured")));
    }

    /// A payload of one number, for the wire format.
    #[derive(Debug, PartialEq)]
    struct One(f32);

    impl Payload for One {
        fn write(&self, w: &mut Writer) {
            w.f32s(&[self.0]);
        }
        fn read(r: &mut Reader<'_>) -> Result<Self, OptimError> {
            Ok(One(r.f32s()?.first().copied().unwrap_or(f32::NAN)))
        }
    }

    #[test]
    fn decisions_survive_the_wire_and_garbage_is_an_exchange_error() {
        let mine = vec![
            (("a".to_string(), 0), Decision::Keep),
            (("b".to_string(), 3), Decision::Failed("no".into())),
            (("c".to_string(), 1), Decision::Send(One(2.5))),
        ];
        let back: Vec<(Key, Decision<One>)> = decode(&encode::<One>(&mine)).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[1].0, ("b".to_string(), 3));
        assert!(matches!(back[0].1, Decision::Keep));
        assert!(matches!(&back[1].1, Decision::Failed(m) if m == "no"));
        assert!(matches!(back[2].1, Decision::Send(One(x)) if x == 2.5));
        let mut bytes = encode::<One>(&mine);
        bytes[13] ^= 1;
        assert!(matches!(
            decode::<One>(&bytes),
            Err(OptimError::Exchange(_))
        ));
    }
}
