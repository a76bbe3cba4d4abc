//! A network model calibrated on a real run's measured collectives.
//!
//! An emulation models its virtual ranks' communication, by default on a cluster the user
//! names. When the comparison is with a real run on another interconnect (the process-per-rank
//! run of `orrery collect --comm mpi`, over whatever transport MPI chose), the emulated step
//! is off by the difference between the two networks, not by anything the emulation got
//! wrong. [`MeasuredNetwork`] answers with what the real run measured instead.
//!
//! Every rank of an all-real collection records how long it spent in each collective. That
//! is its wait for the last member to arrive plus the transfer; the last member to arrive
//! waits for no one, so the shortest time among the members of one instance is the
//! transfer's. Instances are told apart by their group, kind and size and by their place
//! among the rank's collectives of that group, kind and size. The model keeps, per kind,
//! size and group size, the median over instances of that shortest time.
//!
//! Point-to-point transfers are calibrated alike. A transfer is the `n`-th send from one
//! rank to another with a tag, matched with the `n`-th receive of that tag at the other rank
//! from the first. Whichever side arrived second waits for no one: a receive posted after
//! its send only takes the data in; a send posted after its receive only moves the data
//! (MPI's rendezvous, for messages above its eager limit). So the shorter of the two times is
//! the transfer's, and the model keeps, per size, the median over transfers. For a message
//! small enough to go eagerly while its receive already waited, the send's time is only the
//! hand-over of the buffer, so such a transfer reads somewhat short. Sizes it did not see,
//! and every other collective, are a fallback model's.
//!
//! On two cores, four MPI ranks that nap while they wait (`orrery_train::comm_mpi`) took 0.2
//! to 8 ms to move 512 KB to each other; the H100 model says microseconds, and the real
//! run's step paid them on its critical path.
//!
//! A send-and-receive records a send and a receive, each with the time of the whole
//! exchange; the trainer's exchanges have one peer, so the shorter side is still one
//! message's transfer (with two peers it would include the other message), and each
//! exchange gives two samples.
//!
//! What it does not do: interpolate between sizes it has not seen; tell a transfer within
//! a host from one between hosts (each size has one time, as the run measured it); or
//! calibrate all-to-alls (each member records the bytes it sends, which differ within one
//! exchange, so the members of an instance cannot be matched). Records without measured
//! durations (ranks among virtual peers, whose communication takes no time) give it
//! nothing. Nor does it change how the replay uses a transfer's time: the replay sends
//! eagerly (the sender is done after the transfer, and a receive posted later completes at
//! once), while above MPI's eager limit a real sender waits for its receiver and a late
//! receiver pays the whole transfer.

use orrery_graph::collect::{RankRecord, RecordedOp};
use orrery_net::{Algorithm, CollectiveCost, CollectiveKind, CollectiveRequest, NetworkModel};
use orrery_predict::replay::net_kind;
use orrery_units::{Bytes, Picos};
use std::collections::HashMap;

/// Collective and point-to-point times measured in a real run, over a fallback model (see
/// the module docs).
#[derive(Debug, Clone)]
pub struct MeasuredNetwork<N> {
    /// Per (kind, bytes, group size): the median transfer time.
    table: HashMap<(CollectiveKind, u64, u32), Picos>,
    /// Per size of a point-to-point message: the median transfer time.
    transfers: HashMap<u64, Picos>,
    fallback: N,
}

impl<N> MeasuredNetwork<N> {
    /// Calibrates on `records`, ranks of a world of `world` ranks whose communication was
    /// timed; what they did not measure is `fallback`'s.
    pub fn from_records(records: &[RankRecord], world: u32, fallback: N) -> MeasuredNetwork<N> {
        // One instance: its kind, members (empty: the whole world), bytes and place.
        type Instance = (CollectiveKind, Vec<u32>, u64, u32);
        let mut shortest: HashMap<Instance, Picos> = HashMap::new();
        for record in records {
            let mut seen: HashMap<(CollectiveKind, Vec<u32>, u64), u32> = HashMap::new();
            for op in &record.ops {
                let RecordedOp::Collective {
                    op,
                    group,
                    bytes,
                    duration,
                    ..
                } = op
                else {
                    continue;
                };
                let kind = net_kind(*op);
                // An all-to-all's members move different amounts (each records its own),
                // so its instances cannot be matched by size; the fallback answers them.
                if kind == CollectiveKind::AllToAll {
                    continue;
                }
                let mut members = group.clone();
                members.sort_unstable();
                let place = seen.entry((kind, members.clone(), bytes.0)).or_insert(0);
                let instance = (kind, members, bytes.0, *place);
                *place += 1;
                if *duration == Picos::ZERO {
                    continue;
                }
                let t = shortest.entry(instance).or_insert(*duration);
                *t = (*t).min(*duration);
            }
        }
        let mut samples: HashMap<(CollectiveKind, u64, u32), Vec<Picos>> = HashMap::new();
        for ((kind, members, bytes, _), t) in shortest {
            let size = if members.is_empty() {
                world
            } else {
                members.len() as u32
            };
            samples.entry((kind, bytes, size)).or_default().push(t);
        }
        MeasuredNetwork {
            table: medians(samples),
            transfers: medians(transfer_samples(records)),
            fallback,
        }
    }

    /// How many (kind, size, group size) combinations of collectives were measured.
    pub fn calibrated(&self) -> usize {
        self.table.len()
    }

    /// How many sizes of point-to-point transfers were measured.
    pub fn calibrated_transfers(&self) -> usize {
        self.transfers.len()
    }
}

impl<N: NetworkModel> NetworkModel for MeasuredNetwork<N> {
    fn name(&self) -> &'static str {
        "measured"
    }

    fn collective(&self, request: &CollectiveRequest) -> CollectiveCost {
        let key = (request.kind, request.bytes.0, request.placement.size);
        match self.table.get(&key) {
            Some(&time) => CollectiveCost {
                time,
                algorithm: Algorithm::Measured,
            },
            None => self.fallback.collective(request),
        }
    }

    fn point_to_point(&self, bytes: Bytes, same_node: bool) -> Picos {
        match self.transfers.get(&bytes.0) {
            Some(&time) => time,
            None => self.fallback.point_to_point(bytes, same_node),
        }
    }
}

/// Each key's median sample (the upper one of an even count).
fn medians<K: std::hash::Hash + Eq>(samples: HashMap<K, Vec<Picos>>) -> HashMap<K, Picos> {
    samples
        .into_iter()
        .map(|(key, mut ts)| {
            ts.sort_unstable();
            (key, ts[ts.len() / 2])
        })
        .collect()
}

/// Per message size, each measured transfer's time: the shorter of its send's and its
/// receive's (see the module docs). A send without its receive in `records` is left out.
fn transfer_samples(records: &[RankRecord]) -> HashMap<u64, Vec<Picos>> {
    // One side of a transfer: (sender, receiver, tag, place among that triple's messages).
    type Side = (u32, u32, u64, u32);
    let mut sends: HashMap<Side, (u64, Picos)> = HashMap::new();
    let mut receives: HashMap<Side, Picos> = HashMap::new();
    for record in records {
        let mut places: HashMap<(bool, u32, u64), u32> = HashMap::new();
        for op in &record.ops {
            let (sending, peer, bytes, tag, duration) = match op {
                RecordedOp::Send {
                    peer,
                    bytes,
                    tag,
                    duration,
                } => (true, *peer, *bytes, *tag, *duration),
                RecordedOp::Recv {
                    peer,
                    bytes,
                    tag,
                    duration,
                } => (false, *peer, *bytes, *tag, *duration),
                _ => continue,
            };
            let place = places.entry((sending, peer, tag)).or_insert(0);
            let n = *place;
            *place += 1;
            if sending {
                sends.insert((record.rank, peer, tag, n), (bytes.0, duration));
            } else {
                receives.insert((peer, record.rank, tag, n), duration);
            }
        }
    }
    let mut samples: HashMap<u64, Vec<Picos>> = HashMap::new();
    for (side, (bytes, sent)) in sends {
        let Some(&received) = receives.get(&side) else {
            continue;
        };
        let t = sent.min(received);
        if t > Picos::ZERO {
            samples.entry(bytes).or_default().push(t);
        }
    }
    samples
}

#[cfg(test)]
mod tests {
    use super::*;
    use orrery_graph::CollectiveOp;
    use orrery_net::GroupPlacement;

    fn all_reduce(group: Vec<u32>, bytes: u64, us: u64) -> RecordedOp {
        RecordedOp::Collective {
            op: CollectiveOp::AllReduce,
            group,
            role: None,
            bytes: Bytes(bytes),
            duration: Picos::from_micros(us),
        }
    }

    /// Answers every request with 1 s, so a fallback answer is recognisable.
    struct Slow;
    impl NetworkModel for Slow {
        fn name(&self) -> &'static str {
            "slow"
        }
        fn collective(&self, _: &CollectiveRequest) -> CollectiveCost {
            CollectiveCost {
                time: Picos::from_micros(1_000_000),
                algorithm: Algorithm::Ring,
            }
        }
        fn point_to_point(&self, _: Bytes, _: bool) -> Picos {
            Picos::from_micros(1_000_000)
        }
    }

    fn request(bytes: u64, size: u32) -> CollectiveRequest {
        CollectiveRequest {
            kind: CollectiveKind::AllReduce,
            bytes: Bytes(bytes),
            placement: GroupPlacement::single_node(size),
        }
    }

    #[test]
    fn an_instance_takes_its_fastest_member_and_a_size_the_median_instance() {
        // Three all-reduces of 64 B over ranks 0 and 1: rank 0 waited in the first two.
        let records = [
            RankRecord {
                rank: 0,
                ops: vec![
                    all_reduce(vec![0, 1], 64, 50),
                    all_reduce(vec![0, 1], 64, 40),
                    all_reduce(vec![0, 1], 64, 7),
                ],
            },
            RankRecord {
                rank: 1,
                ops: vec![
                    all_reduce(vec![1, 0], 64, 5),
                    all_reduce(vec![1, 0], 64, 6),
                    all_reduce(vec![1, 0], 64, 30),
                ],
            },
        ];
        let net = MeasuredNetwork::from_records(&records, 2, Slow);
        assert_eq!(net.calibrated(), 1);
        // Instances: 5, 6 and 7 us; the median is 6.
        assert_eq!(net.collective(&request(64, 2)).time, Picos::from_micros(6));
        assert_eq!(
            net.collective(&request(64, 2)).algorithm,
            Algorithm::Measured
        );
        // Another size, another group size and point-to-point are the fallback's.
        for r in [request(128, 2), request(64, 4)] {
            assert_eq!(net.collective(&r).time, Picos::from_micros(1_000_000));
        }
        assert_eq!(
            net.point_to_point(Bytes(64), true),
            Picos::from_micros(1_000_000)
        );
    }

    fn send(peer: u32, bytes: u64, tag: u64, us: u64) -> RecordedOp {
        RecordedOp::Send {
            peer,
            bytes: Bytes(bytes),
            tag,
            duration: Picos::from_micros(us),
        }
    }

    fn recv(peer: u32, bytes: u64, tag: u64, us: u64) -> RecordedOp {
        RecordedOp::Recv {
            peer,
            bytes: Bytes(bytes),
            tag,
            duration: Picos::from_micros(us),
        }
    }

    #[test]
    fn a_transfer_takes_its_shorter_side_and_a_size_the_median_transfer() {
        // Rank 0 sends rank 1 three messages of 64 B with tag 7: the receive waited for
        // the first (3 us against 40), the send for the second (4 against 50), neither for
        // the third (5 and 5). A fourth send has no receive in the records, and one
        // message of 128 B goes the other way with tag 9.
        let records = [
            RankRecord {
                rank: 0,
                ops: vec![
                    send(1, 64, 7, 3),
                    send(1, 64, 7, 50),
                    send(1, 64, 7, 5),
                    send(1, 64, 7, 1),
                    recv(1, 128, 9, 600),
                ],
            },
            RankRecord {
                rank: 1,
                ops: vec![
                    recv(0, 64, 7, 40),
                    send(0, 128, 9, 11),
                    recv(0, 64, 7, 4),
                    recv(0, 64, 7, 5),
                ],
            },
        ];
        let net = MeasuredNetwork::from_records(&records, 2, Slow);
        assert_eq!(net.calibrated(), 0);
        assert_eq!(net.calibrated_transfers(), 2);
        // Transfers of 3, 4 and 5 us (the unmatched 1 us send is not one): the median is 4.
        assert_eq!(net.point_to_point(Bytes(64), true), Picos::from_micros(4));
        assert_eq!(net.point_to_point(Bytes(64), false), Picos::from_micros(4));
        assert_eq!(net.point_to_point(Bytes(128), true), Picos::from_micros(11));
        // A size no transfer had, and every collective, are the fallback's.
        assert_eq!(
            net.point_to_point(Bytes(32), true),
            Picos::from_micros(1_000_000)
        );
        assert_eq!(
            net.collective(&request(64, 2)).time,
            Picos::from_micros(1_000_000)
        );
    }

    proptest::proptest! {
        /// Transfers drawn at random among four ranks, with repeated tags, recorded in the
        /// order they happened: the model pairs each send with its own receive (known here
        /// from the drawing, rediscovered there from the records alone), whatever order the
        /// records come in.
        #[test]
        fn transfers_pair_with_their_own_receives(
            drawn in proptest::collection::vec(
                (0u32..4, 1u32..4, 0u64..2, 0u64..2, 1u64..100, 1u64..100),
                1..40,
            ),
            rotate in 0usize..4,
        ) {
            let mut ops: Vec<Vec<RecordedOp>> = vec![Vec::new(); 4];
            let mut shorter: HashMap<u64, Vec<Picos>> = HashMap::new();
            for &(from, step, tag, size, sent_us, received_us) in &drawn {
                let to = (from + step) % 4;
                let bytes = 64 << size;
                ops[from as usize].push(send(to, bytes, tag, sent_us));
                ops[to as usize].push(recv(from, bytes, tag, received_us));
                shorter
                    .entry(bytes)
                    .or_default()
                    .push(Picos::from_micros(sent_us.min(received_us)));
            }
            let mut records: Vec<RankRecord> = ops
                .into_iter()
                .enumerate()
                .map(|(rank, ops)| RankRecord { rank: rank as u32, ops })
                .collect();
            records.rotate_left(rotate);
            let net = MeasuredNetwork::from_records(&records, 4, Slow);
            proptest::prop_assert_eq!(net.calibrated_transfers(), shorter.len());
            for (bytes, mut times) in shorter {
                times.sort_unstable();
                proptest::prop_assert_eq!(
                    net.point_to_point(Bytes(bytes), true),
                    times[times.len() / 2]
                );
            }
        }
    }

    #[test]
    fn unmeasured_records_and_world_groups() {
        // Durations of zero were not measured (ranks among virtual peers); a world
        // collective lists no members and counts the whole world.
        let records = [RankRecord {
            rank: 0,
            ops: vec![all_reduce(vec![0, 1], 64, 0), all_reduce(vec![], 4, 9)],
        }];
        let net = MeasuredNetwork::from_records(&records, 8, Slow);
        assert_eq!(net.calibrated(), 1);
        assert_eq!(net.collective(&request(4, 8)).time, Picos::from_micros(9));
        assert_eq!(
            net.collective(&request(64, 2)).time,
            Picos::from_micros(1_000_000)
        );
    }
}
