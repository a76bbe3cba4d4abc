//! The analytical alpha-beta network model.
//!
//! Every collective is costed as a number of latency-bound algorithm steps (alpha, the
//! [`latency`](crate::LinkClass::latency) of the link class the step crosses) plus the bytes
//! each rank moves divided by the bandwidth of the bottleneck link (beta, from
//! [`achievable`](crate::LinkClass::achievable) bandwidth). The algorithms follow NCCL:
//!
//! - Ring: all-reduce costs `2(n-1)` steps and moves `2(n-1)/n * S` per rank, all-gather and
//!   reduce-scatter cost `n-1` steps and move `(n-1)/n * S`, broadcast and reduce are a
//!   pipelined ring that costs `n-1` steps and moves `S`. Inside one node the bus bandwidth is
//!   the intra-node achievable bandwidth. Across nodes NCCL runs several channels whose rings
//!   leave each node through different NICs, so the inter-node hop gets one NIC per member GPU
//!   on the node: the bus bandwidth is `min(intra, max_per_node * nic)`. Every step of a
//!   multi-node ring is charged the inter-node latency, because the ring's steps are
//!   synchronised by its slowest hop. This is pessimistic next to NCCL's own tuner, which
//!   weights the latency by the share of hops that cross nodes; its consequence is that on
//!   many nodes the tree wins all-reduce at almost every size, which NCCL also tends to pick
//!   at scale, and the two differ little on large messages anyway.
//! - Tree (all-reduce across nodes only): a double binary tree across nodes and a chain inside
//!   each node, costing `2 * ceil(log2(nodes))` inter-node steps and `2(max_per_node - 1)`
//!   intra-node steps. In a double binary tree every rank is an interior node of one tree and
//!   a leaf of the other, so it sends and receives about `S` in the reduce phase and `S` again
//!   in the broadcast phase: we charge `2S` at the ring's bottleneck bandwidth. This is the
//!   same as NCCL's tuner, which gives the tree an algorithm bandwidth of half its bus
//!   bandwidth, and it is why the ring (`2(n-1)/n * S`) wins on large messages while the tree's
//!   logarithmic latency wins on small ones.
//! - Hierarchical (all-reduce, all-gather, reduce-scatter across nodes with more than one
//!   member per node): a ring reduce-scatter over the `max_per_node` members of each node on
//!   intra-node links, then the collective across the `nodes` nodes on `S / max_per_node`
//!   bytes, where every GPU runs its own slice over its own NIC (so `max_per_node` NICs work in
//!   parallel), then a ring all-gather inside the node. All-gather runs the inter-node phase
//!   first and the intra-node phase second, reduce-scatter the reverse; both cost one
//!   intra-node phase and one inter-node phase. The inter-node phase is a ring.
//! - All-to-all (Direct): each rank sends `(n-1)/n * S`. The share addressed to members on
//!   other nodes, estimated from the placement as `(size - max_per_node) / (size - 1)` (the
//!   view of a rank on the busiest node), goes over the rank's NIC while the rest goes over
//!   intra-node links at the same time, so the bandwidth term is the larger of the two. The
//!   latency is one step of the slowest link class involved, paid once because all transfers
//!   are in flight together, plus [`AnalyticalNetwork::ALLTOALL_PER_PEER_LATENCY`] for each of
//!   the `n-1` peers, the cost of posting one more send/receive pair.
//!
//! Fat-tree oversubscription: when a group spans more nodes than fit under one leaf switch
//! (`nodes > nodes_per_leaf`), its inter-node bandwidth is divided by the oversubscription
//! factor. The placement does not say how the nodes are spread over leaves, so a group that
//! fits under one leaf is assumed to be placed under one. Factors below one (or not finite)
//! are treated as one, because upper tiers never add bandwidth beyond the leaf links.
//!
//! Algorithm choice: [`AlgorithmChoice::Auto`] takes the fastest applicable algorithm, ties
//! broken in the fixed order Ring, Tree, Hierarchical so the answer is deterministic.
//! [`AlgorithmChoice::Fixed`] uses the named algorithm where it applies and falls back to Ring
//! where it does not (for example Tree for an all-gather, or any tree on a single node).
//! All-to-all has a single algorithm, Direct, which every choice resolves to.
//!
//! Degenerate inputs: a group of at most one member, or a collective of zero bytes, costs
//! zero time (nothing is sent, so a real library returns without synchronising), and so does
//! a zero-byte point-to-point transfer. Inconsistent placements are clamped to the nearest
//! consistent one (`1 <= nodes <= size`, `ceil(size / nodes) <= max_per_node <=
//! size - nodes + 1`). Bandwidths that are zero, negative or NaN give a saturated time of
//! `u64::MAX` picoseconds rather than a panic; all step counts multiply with saturation.
//!
//! What the model leaves out: contention between concurrent collectives, protocol choice
//! (LL, LL128, Simple), NVLink SHARP and in-network reduction, and uneven placements beyond
//! the busiest node.

use crate::{
    Algorithm, AlgorithmChoice, CollectiveCost, CollectiveKind, CollectiveRequest, Fabric,
    GroupPlacement, NetworkModel, Topology,
};
use orrery_units::{Bandwidth, Bytes, Picos};

/// The analytical alpha-beta model of NCCL-like collectives on a [`Fabric`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnalyticalNetwork {
    fabric: Fabric,
    choice: AlgorithmChoice,
}

/// A group placement made consistent, for groups of at least two members.
#[derive(Debug, Clone, Copy)]
struct Shape {
    size: u32,
    nodes: u32,
    max_per_node: u32,
}

impl Shape {
    /// `None` for groups of at most one member, which never communicate.
    fn of(placement: GroupPlacement) -> Option<Shape> {
        let size = placement.size;
        if size <= 1 {
            return None;
        }
        let nodes = placement.nodes.clamp(1, size);
        // The busiest node holds at least the average and leaves at least one member for
        // every other node; `lo <= hi` always holds for `1 <= nodes <= size`, and max/min
        // (rather than clamp) keeps this panic-free regardless.
        let lo = size.div_ceil(nodes);
        let hi = size - (nodes - 1);
        let max_per_node = placement.max_per_node.max(lo).min(hi);
        Some(Shape {
            size,
            nodes,
            max_per_node,
        })
    }

    fn multi_node(self) -> bool {
        self.nodes > 1
    }
}

/// Bandwidth usable in arithmetic: zero, negative and NaN become zero (infinite time).
fn sane(bw: Bandwidth) -> Bandwidth {
    if bw.0 > 0.0 {
        bw
    } else {
        Bandwidth(0.0)
    }
}

/// `steps` latency-bound steps of `alpha` each, saturating.
fn steps(count: u64, alpha: Picos) -> Picos {
    Picos(alpha.0.saturating_mul(count))
}

/// `ceil(log2(x))` for `x >= 1`: the depth of a binary tree over `x` nodes.
fn ceil_log2(x: u32) -> u64 {
    u64::from(u32::BITS - x.saturating_sub(1).leading_zeros())
}

impl AnalyticalNetwork {
    /// Per-peer cost of posting one more send/receive pair in an all-to-all. NCCL issues the
    /// pairs of a grouped all-to-all from one kernel, but each peer still needs its own
    /// connection handshake (FIFO slot, flag writes). This is an order-of-magnitude estimate
    /// (a few hundred nanoseconds), not a fitted value; it only matters for small messages
    /// over large groups.
    pub const ALLTOALL_PER_PEER_LATENCY: Picos = Picos(500_000);

    /// A model of `fabric` that picks algorithms according to `choice`.
    pub fn new(fabric: Fabric, choice: AlgorithmChoice) -> AnalyticalNetwork {
        AnalyticalNetwork { fabric, choice }
    }

    /// The fabric this model costs collectives on.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The algorithm choice this model applies.
    pub fn choice(&self) -> AlgorithmChoice {
        self.choice
    }

    /// Whether `algorithm` can run a collective of `kind` over a group placed like this.
    ///
    /// Ring runs everything except all-to-all; Tree only all-reduce across nodes;
    /// Hierarchical all-reduce, all-gather and reduce-scatter across nodes with more than one
    /// member on a node; Direct only all-to-all, which it always runs.
    pub fn is_applicable(
        algorithm: Algorithm,
        kind: CollectiveKind,
        placement: GroupPlacement,
    ) -> bool {
        let shape = Shape::of(placement);
        let multi = shape.is_some_and(Shape::multi_node);
        match (algorithm, kind) {
            (Algorithm::Measured, _) => false,
            (Algorithm::Direct, CollectiveKind::AllToAll) => true,
            (_, CollectiveKind::AllToAll) | (Algorithm::Direct, _) => false,
            (Algorithm::Ring, _) => true,
            (Algorithm::Tree, CollectiveKind::AllReduce) => multi,
            (Algorithm::Tree, _) => false,
            (
                Algorithm::Hierarchical,
                CollectiveKind::AllReduce
                | CollectiveKind::AllGather
                | CollectiveKind::ReduceScatter,
            ) => multi && shape.is_some_and(|s| s.max_per_node > 1),
            (Algorithm::Hierarchical, _) => false,
        }
    }

    /// Intra-node achievable bandwidth per GPU.
    fn intra_bw(&self) -> Bandwidth {
        sane(self.fabric.intra_node.achievable())
    }

    /// Achievable bandwidth of one NIC for a group spanning `nodes` nodes, reduced by the
    /// fat-tree's oversubscription when the group cannot sit under one leaf.
    fn nic_bw(&self, nodes: u32) -> Bandwidth {
        let nic = sane(self.fabric.inter_node.achievable());
        match self.fabric.topology {
            Topology::RailOptimized => nic,
            Topology::FatTree {
                oversubscription,
                nodes_per_leaf,
            } => {
                if nodes > nodes_per_leaf {
                    // `max` also maps NaN to 1: an unknown factor reduces nothing.
                    sane(Bandwidth(nic.0 / oversubscription.max(1.0)))
                } else {
                    nic
                }
            }
        }
    }

    /// Bus bandwidth of a ring over the group: intra-node links on one node, otherwise the
    /// lesser of those and one NIC per member GPU on the busiest node.
    fn ring_bus_bw(&self, shape: Shape) -> Bandwidth {
        let intra = self.intra_bw();
        if !shape.multi_node() {
            return intra;
        }
        let nics = self.nic_bw(shape.nodes).0 * f64::from(shape.max_per_node);
        sane(Bandwidth(intra.0.min(nics)))
    }

    /// Latency of one ring step: the inter-node latency once any hop leaves the node.
    fn step_latency(&self, shape: Shape) -> Picos {
        if shape.multi_node() {
            self.fabric.inter_node.latency
        } else {
            self.fabric.intra_node.latency
        }
    }

    /// Fraction of a rank's all-to-all traffic that leaves its node (for a rank on the
    /// busiest node).
    fn off_node_fraction(shape: Shape) -> f64 {
        f64::from(shape.size - shape.max_per_node) / f64::from(shape.size - 1)
    }

    /// The bus bandwidth a large collective of `kind` reaches over a group placed like this:
    /// the rate at which each rank's bus-factor share of the buffer (see
    /// [`CollectiveKind::bus_factor`]) moves, latency ignored. For every kind but all-to-all
    /// this is the ring's bottleneck bandwidth; for all-to-all it is the combined rate of the
    /// intra-node and NIC shares. A group of at most one member reports the intra-node
    /// achievable bandwidth.
    pub fn bus_bandwidth(&self, kind: CollectiveKind, placement: GroupPlacement) -> Bandwidth {
        let Some(shape) = Shape::of(placement) else {
            return self.intra_bw();
        };
        match kind {
            CollectiveKind::AllToAll => {
                let off = Self::off_node_fraction(shape);
                let per_byte = |part: f64, bw: Bandwidth| {
                    if part <= 0.0 {
                        0.0
                    } else {
                        part / bw.0
                    }
                };
                let secs_per_byte = per_byte(1.0 - off, self.intra_bw())
                    .max(per_byte(off, self.nic_bw(shape.nodes)));
                sane(Bandwidth(1.0 / secs_per_byte))
            }
            _ => self.ring_bus_bw(shape),
        }
    }

    /// The time `algorithm` takes for `request`, or `None` when it does not apply (see
    /// [`AnalyticalNetwork::is_applicable`]). Groups of at most one member and zero-byte
    /// requests take zero time under every applicable algorithm.
    pub fn algorithm_time(
        &self,
        algorithm: Algorithm,
        request: &CollectiveRequest,
    ) -> Option<Picos> {
        if !Self::is_applicable(algorithm, request.kind, request.placement) {
            return None;
        }
        let Some(shape) = Shape::of(request.placement) else {
            return Some(Picos::ZERO);
        };
        if request.bytes.0 == 0 {
            return Some(Picos::ZERO);
        }
        let s = request.bytes.as_f64();
        let kind = request.kind;
        let time = match algorithm {
            Algorithm::Ring => self.ring_time(kind, s, shape),
            Algorithm::Tree => self.tree_time(s, shape),
            Algorithm::Hierarchical => self.hierarchical_time(kind, s, shape),
            Algorithm::Direct => self.all_to_all_time(s, shape),
            // Never applicable (above).
            Algorithm::Measured => return None,
        };
        Some(time)
    }

    fn ring_time(&self, kind: CollectiveKind, s: f64, shape: Shape) -> Picos {
        let n = u64::from(shape.size);
        let count = match kind {
            CollectiveKind::AllReduce => 2 * (n - 1),
            _ => n - 1,
        };
        let volume = kind.bus_factor(shape.size) * s;
        steps(count, self.step_latency(shape)) + self.ring_bus_bw(shape).time_for(volume)
    }

    fn tree_time(&self, s: f64, shape: Shape) -> Picos {
        let inter = steps(2 * ceil_log2(shape.nodes), self.fabric.inter_node.latency);
        let intra = steps(
            2 * u64::from(shape.max_per_node - 1),
            self.fabric.intra_node.latency,
        );
        // About S in the reduce phase and S in the broadcast phase per rank (see module docs).
        inter + intra + self.ring_bus_bw(shape).time_for(2.0 * s)
    }

    fn hierarchical_time(&self, kind: CollectiveKind, s: f64, shape: Shape) -> Picos {
        let m = shape.max_per_node;
        // One ring reduce-scatter or all-gather over the node's members (equal costs).
        let intra_phase = steps(u64::from(m - 1), self.fabric.intra_node.latency)
            + self
                .intra_bw()
                .time_for(CollectiveKind::ReduceScatter.bus_factor(m) * s);
        // The same collective across nodes on each GPU's slice, over each GPU's own NIC.
        let nodes = u64::from(shape.nodes);
        let inter_steps = match kind {
            CollectiveKind::AllReduce => 2 * (nodes - 1),
            _ => nodes - 1,
        };
        let slice = s / f64::from(m);
        let inter_phase = steps(inter_steps, self.fabric.inter_node.latency)
            + self
                .nic_bw(shape.nodes)
                .time_for(kind.bus_factor(shape.nodes) * slice);
        match kind {
            CollectiveKind::AllReduce => intra_phase + inter_phase + intra_phase,
            _ => intra_phase + inter_phase,
        }
    }

    fn all_to_all_time(&self, s: f64, shape: Shape) -> Picos {
        let sent = CollectiveKind::AllToAll.bus_factor(shape.size) * s;
        let off = Self::off_node_fraction(shape);
        let inter_bytes = sent * off;
        let intra_bytes = sent - inter_bytes;
        let transfer = self
            .intra_bw()
            .time_for(intra_bytes)
            .max(self.nic_bw(shape.nodes).time_for(inter_bytes));
        let wire = if shape.multi_node() {
            self.fabric
                .inter_node
                .latency
                .max(self.fabric.intra_node.latency)
        } else {
            self.fabric.intra_node.latency
        };
        transfer + wire + steps(u64::from(shape.size - 1), Self::ALLTOALL_PER_PEER_LATENCY)
    }

    /// The algorithms `choice` considers for `kind`, in tie-break order.
    fn candidates(&self, kind: CollectiveKind) -> &'static [Algorithm] {
        if kind == CollectiveKind::AllToAll {
            return &[Algorithm::Direct];
        }
        match self.choice {
            AlgorithmChoice::Auto => &[Algorithm::Ring, Algorithm::Tree, Algorithm::Hierarchical],
            AlgorithmChoice::Fixed(Algorithm::Ring) => &[Algorithm::Ring],
            AlgorithmChoice::Fixed(Algorithm::Tree) => &[Algorithm::Tree],
            AlgorithmChoice::Fixed(Algorithm::Hierarchical) => &[Algorithm::Hierarchical],
            AlgorithmChoice::Fixed(Algorithm::Direct) => &[Algorithm::Direct],
            // Nothing to model: the fallback below answers (Ring).
            AlgorithmChoice::Fixed(Algorithm::Measured) => &[],
        }
    }
}

impl NetworkModel for AnalyticalNetwork {
    fn name(&self) -> &'static str {
        "analytical"
    }

    fn collective(&self, request: &CollectiveRequest) -> CollectiveCost {
        let mut best: Option<CollectiveCost> = None;
        for &algorithm in self.candidates(request.kind) {
            if let Some(time) = self.algorithm_time(algorithm, request) {
                // Strictly less: earlier candidates win ties.
                if best.is_none_or(|b| time < b.time) {
                    best = Some(CollectiveCost { time, algorithm });
                }
            }
        }
        if let Some(cost) = best {
            return cost;
        }
        // A fixed algorithm that does not apply falls back to Ring, which runs every kind
        // that reaches here (all-to-all always has Direct among its candidates).
        let time = self
            .algorithm_time(Algorithm::Ring, request)
            .unwrap_or(Picos::ZERO);
        CollectiveCost {
            time,
            algorithm: Algorithm::Ring,
        }
    }

    fn point_to_point(&self, bytes: Bytes, same_node: bool) -> Picos {
        if bytes.0 == 0 {
            return Picos::ZERO;
        }
        let link = if same_node {
            self.fabric.intra_node
        } else {
            self.fabric.inter_node
        };
        link.latency + sane(link.achievable()).time_for(bytes.as_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LinkClass;
    use proptest::prelude::*;

    const ALL_KINDS: [CollectiveKind; 6] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
        CollectiveKind::Reduce,
    ];

    const ALL_ALGORITHMS: [Algorithm; 4] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::Hierarchical,
        Algorithm::Direct,
    ];

    /// An H100-like cluster: NVLink 450 GB/s per direction at 82 %, NDR 400 NICs at 80 %.
    fn h100(topology: Topology) -> Fabric {
        Fabric {
            gpus_per_node: 8,
            nodes: 1024,
            intra_node: LinkClass {
                bandwidth: Bandwidth::from_gbytes_per_sec(450.0),
                efficiency: 0.82,
                latency: Picos::from_nanos(1_000),
            },
            inter_node: LinkClass {
                bandwidth: Bandwidth::from_gbits_per_sec(400.0),
                efficiency: 0.8,
                latency: Picos::from_nanos(5_000),
            },
            topology,
        }
    }

    /// Round numbers that make closed forms exact: 100 GB/s intra, 10 GB/s inter.
    fn round_fabric() -> Fabric {
        Fabric {
            gpus_per_node: 8,
            nodes: 64,
            intra_node: LinkClass {
                bandwidth: Bandwidth(200e9),
                efficiency: 0.5,
                latency: Picos::from_micros(1),
            },
            inter_node: LinkClass {
                bandwidth: Bandwidth(20e9),
                efficiency: 0.5,
                latency: Picos::from_micros(4),
            },
            topology: Topology::RailOptimized,
        }
    }

    fn request(kind: CollectiveKind, bytes: u64, placement: GroupPlacement) -> CollectiveRequest {
        CollectiveRequest {
            kind,
            bytes: Bytes(bytes),
            placement,
        }
    }

    fn spread(nodes: u32, per_node: u32) -> GroupPlacement {
        GroupPlacement {
            size: nodes * per_node,
            nodes,
            max_per_node: per_node,
        }
    }

    fn auto(fabric: Fabric) -> AnalyticalNetwork {
        AnalyticalNetwork::new(fabric, AlgorithmChoice::Auto)
    }

    fn fixed(fabric: Fabric, algorithm: Algorithm) -> AnalyticalNetwork {
        AnalyticalNetwork::new(fabric, AlgorithmChoice::Fixed(algorithm))
    }

    /// `2(n-1)*alpha + 2(n-1)/n * S / bw` in exact integer arithmetic, rounded to the
    /// nearest picosecond; `bw` in bytes per second.
    fn ring_all_reduce_expected(n: u64, s: u64, alpha_ps: u64, bw: u64) -> u64 {
        let num = 2 * u128::from(n - 1) * u128::from(s) * 1_000_000_000_000;
        let den = u128::from(n) * u128::from(bw);
        let beta = ((num + den / 2) / den) as u64;
        2 * (n - 1) * alpha_ps + beta
    }

    #[test]
    fn ring_all_reduce_on_one_node_matches_the_closed_form() {
        let net = fixed(round_fabric(), Algorithm::Ring);
        let cost = net.collective(&request(
            CollectiveKind::AllReduce,
            8_000_000,
            GroupPlacement::single_node(8),
        ));
        assert_eq!(cost.algorithm, Algorithm::Ring);
        // 14 steps of 1 us plus 14e6 bytes at 100 GB/s (140 us).
        assert_eq!(cost.time.0, 14_000_000 + 140_000_000);
        assert_eq!(
            cost.time.0,
            ring_all_reduce_expected(8, 8_000_000, 1_000_000, 100_000_000_000)
        );
    }

    #[test]
    fn measured_is_no_algorithm_to_model() {
        // It names answers a calibrated model measured; chosen here, Ring answers.
        let p = GroupPlacement::single_node(8);
        assert!(!AnalyticalNetwork::is_applicable(
            Algorithm::Measured,
            CollectiveKind::AllReduce,
            p
        ));
        let measured = fixed(round_fabric(), Algorithm::Measured).collective(&request(
            CollectiveKind::AllReduce,
            8_000_000,
            p,
        ));
        let ring = fixed(round_fabric(), Algorithm::Ring).collective(&request(
            CollectiveKind::AllReduce,
            8_000_000,
            p,
        ));
        assert_eq!(measured, ring);
    }

    #[test]
    fn ring_all_gather_and_reduce_scatter_closed_form() {
        let net = fixed(round_fabric(), Algorithm::Ring);
        for kind in [CollectiveKind::AllGather, CollectiveKind::ReduceScatter] {
            let cost = net.collective(&request(kind, 4_000_000, GroupPlacement::single_node(4)));
            // 3 steps of 1 us plus 3e6 bytes at 100 GB/s (30 us).
            assert_eq!(cost.time, Picos::from_micros(3 + 30));
        }
    }

    #[test]
    fn broadcast_is_a_pipelined_ring() {
        let net = auto(round_fabric());
        for kind in [CollectiveKind::Broadcast, CollectiveKind::Reduce] {
            let cost = net.collective(&request(kind, 1_000_000, GroupPlacement::single_node(8)));
            assert_eq!(cost.algorithm, Algorithm::Ring);
            // 7 steps of 1 us plus 1e6 bytes at 100 GB/s (10 us).
            assert_eq!(cost.time, Picos::from_micros(7 + 10));
        }
    }

    #[test]
    fn ring_across_nodes_is_bounded_by_the_nics() {
        let fabric = h100(Topology::RailOptimized);
        let net = auto(fabric);
        let nic = fabric.inter_node.achievable();
        let intra = fabric.intra_node.achievable();
        let one_per_node = spread(16, 1);
        assert_eq!(
            net.bus_bandwidth(CollectiveKind::AllReduce, one_per_node),
            nic
        );
        let eight_per_node = spread(16, 8);
        let expected = Bandwidth(intra.0.min(8.0 * nic.0));
        assert_eq!(
            net.bus_bandwidth(CollectiveKind::AllReduce, eight_per_node),
            expected
        );
        // 8 x 40 GB/s = 320 GB/s is below NVLink's 369 GB/s here: the NICs are the bottleneck.
        assert_eq!(expected, nic.scale(8.0));
        // A single node reports NVLink.
        assert_eq!(
            net.bus_bandwidth(CollectiveKind::AllReduce, GroupPlacement::single_node(8)),
            intra
        );

        // And the ring's time uses that bus bandwidth and the inter-node latency.
        let s = 1u64 << 30;
        let ring = fixed(fabric, Algorithm::Ring).collective(&request(
            CollectiveKind::AllReduce,
            s,
            one_per_node,
        ));
        let expected_time = steps(30, fabric.inter_node.latency)
            + nic.time_for(CollectiveKind::AllReduce.bus_factor(16) * s as f64);
        assert_eq!(ring.time, expected_time);
    }

    #[test]
    fn nics_never_lift_the_bus_bandwidth_above_nvlink() {
        let mut fabric = h100(Topology::RailOptimized);
        fabric.inter_node.bandwidth = Bandwidth::from_gbits_per_sec(3200.0);
        let net = auto(fabric);
        assert_eq!(
            net.bus_bandwidth(CollectiveKind::AllReduce, spread(4, 8)),
            fabric.intra_node.achievable()
        );
    }

    #[test]
    fn tree_wins_small_messages_on_many_nodes_and_ring_wins_large_ones() {
        let net = auto(h100(Topology::RailOptimized));
        for nodes in [2, 4, 16, 64] {
            let placement = spread(nodes, 8);
            let small = request(CollectiveKind::AllReduce, 1024, placement);
            let cost = net.collective(&small);
            assert_eq!(cost.algorithm, Algorithm::Tree, "{nodes} nodes");
            let ring = net.algorithm_time(Algorithm::Ring, &small).unwrap();
            assert!(
                cost.time < ring,
                "{nodes} nodes: tree {} vs ring {ring}",
                cost.time
            );
        }
        // On a few nodes the ring's smaller data volume (2(n-1)/n * S against the tree's 2S)
        // outweighs its extra latency for large messages.
        for nodes in [2, 4] {
            let large = request(CollectiveKind::AllReduce, 4 << 30, spread(nodes, 8));
            let ring = net.algorithm_time(Algorithm::Ring, &large).unwrap();
            let tree = net.algorithm_time(Algorithm::Tree, &large).unwrap();
            assert!(ring <= tree, "{nodes} nodes: ring {ring} vs tree {tree}");
            assert_eq!(net.collective(&large).algorithm, Algorithm::Ring);
        }
        // On many nodes the ring's linear latency keeps the tree ahead at any practical size,
        // but each extra byte still costs the tree at least as much as the ring.
        let placement = spread(64, 8);
        let at = |alg, bytes| {
            net.algorithm_time(alg, &request(CollectiveKind::AllReduce, bytes, placement))
                .unwrap()
        };
        let ring_slope = at(Algorithm::Ring, 4 << 30) - at(Algorithm::Ring, 1 << 30);
        let tree_slope = at(Algorithm::Tree, 4 << 30) - at(Algorithm::Tree, 1 << 30);
        assert!(
            ring_slope <= tree_slope,
            "ring {ring_slope} vs tree {tree_slope}"
        );
    }

    #[test]
    fn hierarchical_closed_form() {
        let fabric = round_fabric();
        let net = fixed(fabric, Algorithm::Hierarchical);
        // 4 nodes x 4 GPUs, 16 MB all-reduce.
        let cost = net.collective(&request(
            CollectiveKind::AllReduce,
            16_000_000,
            spread(4, 4),
        ));
        assert_eq!(cost.algorithm, Algorithm::Hierarchical);
        // Intra RS and AG: 3 steps of 1 us + 12e6 B at 100 GB/s (120 us) each.
        // Inter AR on 4e6 B per GPU: 6 steps of 4 us + 6e6 B at 10 GB/s (600 us).
        assert_eq!(cost.time, Picos::from_micros(2 * (3 + 120) + 24 + 600));

        let ag = net.collective(&request(
            CollectiveKind::AllGather,
            16_000_000,
            spread(4, 4),
        ));
        assert_eq!(ag.algorithm, Algorithm::Hierarchical);
        // Inter AG on 4e6 B: 3 steps of 4 us + 3e6 B at 10 GB/s; intra AG as above.
        assert_eq!(ag.time, Picos::from_micros(3 + 120 + 12 + 300));
    }

    #[test]
    fn tree_closed_form() {
        let fabric = round_fabric();
        let net = fixed(fabric, Algorithm::Tree);
        // 5 nodes x 2 GPUs: ceil(log2 5) = 3, bus bandwidth min(100, 2 x 10) = 20 GB/s.
        let cost = net.collective(&request(
            CollectiveKind::AllReduce,
            10_000_000,
            spread(5, 2),
        ));
        assert_eq!(cost.algorithm, Algorithm::Tree);
        // 6 inter steps of 4 us, 2 intra steps of 1 us, 2 x 10e6 B at 20 GB/s (1000 us).
        assert_eq!(cost.time, Picos::from_micros(24 + 2 + 1000));
    }

    #[test]
    fn fixed_falls_back_to_ring_where_it_does_not_apply() {
        let fabric = h100(Topology::RailOptimized);
        let one_node = GroupPlacement::single_node(8);
        for alg in [Algorithm::Tree, Algorithm::Hierarchical, Algorithm::Direct] {
            let cost = fixed(fabric, alg).collective(&request(
                CollectiveKind::AllReduce,
                1 << 20,
                one_node,
            ));
            assert_eq!(cost.algorithm, Algorithm::Ring);
            let ring = fixed(fabric, Algorithm::Ring).collective(&request(
                CollectiveKind::AllReduce,
                1 << 20,
                one_node,
            ));
            assert_eq!(cost, ring);
        }
        // Tree never runs an all-gather; hierarchical never runs a broadcast.
        let ag = fixed(fabric, Algorithm::Tree).collective(&request(
            CollectiveKind::AllGather,
            1 << 20,
            spread(4, 8),
        ));
        assert_eq!(ag.algorithm, Algorithm::Ring);
        let bc = fixed(fabric, Algorithm::Hierarchical).collective(&request(
            CollectiveKind::Broadcast,
            1 << 20,
            spread(4, 8),
        ));
        assert_eq!(bc.algorithm, Algorithm::Ring);
        // Hierarchical needs more than one member per node.
        let hi = fixed(fabric, Algorithm::Hierarchical).collective(&request(
            CollectiveKind::AllReduce,
            1 << 20,
            spread(4, 1),
        ));
        assert_eq!(hi.algorithm, Algorithm::Ring);
        // All-to-all always runs Direct.
        for choice in [
            AlgorithmChoice::Auto,
            AlgorithmChoice::Fixed(Algorithm::Ring),
        ] {
            let a2a = AnalyticalNetwork::new(fabric, choice).collective(&request(
                CollectiveKind::AllToAll,
                1 << 20,
                spread(2, 8),
            ));
            assert_eq!(a2a.algorithm, Algorithm::Direct);
        }
    }

    #[test]
    fn all_to_all_closed_form() {
        let fabric = round_fabric();
        let net = auto(fabric);
        // One node of 4: 3e6 of 4e6 bytes over NVLink (30 us), one intra latency, 3 peers.
        let one = net.collective(&request(
            CollectiveKind::AllToAll,
            4_000_000,
            GroupPlacement::single_node(4),
        ));
        assert_eq!(
            one.time,
            Picos::from_micros(30 + 1) + steps(3, AnalyticalNetwork::ALLTOALL_PER_PEER_LATENCY)
        );
        // 2 nodes x 4: 7e6 of 8e6 bytes sent, 4/7 of it (4e6) over the NIC at 10 GB/s
        // (400 us), 3e6 over NVLink in parallel (30 us); one inter latency, 7 peers.
        let two = net.collective(&request(CollectiveKind::AllToAll, 8_000_000, spread(2, 4)));
        assert_eq!(
            two.time,
            Picos::from_micros(400 + 4) + steps(7, AnalyticalNetwork::ALLTOALL_PER_PEER_LATENCY)
        );
        // Its bus bandwidth: 7e6 bytes in 400 us = 17.5 GB/s.
        let bw = net.bus_bandwidth(CollectiveKind::AllToAll, spread(2, 4));
        assert!((bw.as_gbytes_per_sec() - 17.5).abs() < 1e-9, "{bw:?}");
    }

    #[test]
    fn group_of_one_and_zero_bytes_cost_nothing() {
        let net = auto(h100(Topology::RailOptimized));
        for kind in ALL_KINDS {
            let one = net.collective(&request(kind, 1 << 30, GroupPlacement::single_node(1)));
            assert_eq!(one.time, Picos::ZERO);
            let empty = net.collective(&request(kind, 0, spread(4, 8)));
            assert_eq!(empty.time, Picos::ZERO);
        }
        assert_eq!(net.point_to_point(Bytes(0), false), Picos::ZERO);
    }

    #[test]
    fn oversubscribed_fat_tree_is_slower_than_rail_optimised_across_leaves() {
        let rail = auto(h100(Topology::RailOptimized));
        let tree = auto(h100(Topology::FatTree {
            oversubscription: 2.0,
            nodes_per_leaf: 4,
        }));
        for kind in ALL_KINDS {
            let across = request(kind, 1 << 30, spread(16, 1));
            assert!(
                tree.collective(&across).time > rail.collective(&across).time,
                "{kind:?} across leaves"
            );
            // A group that fits under one leaf sees the full leaf bandwidth.
            let under = request(kind, 1 << 30, spread(4, 1));
            assert_eq!(
                tree.collective(&under),
                rail.collective(&under),
                "{kind:?} under one leaf"
            );
        }
        let nic = h100(Topology::RailOptimized).inter_node.achievable();
        assert_eq!(
            tree.bus_bandwidth(CollectiveKind::AllReduce, spread(16, 1)),
            nic.scale(0.5)
        );
    }

    #[test]
    fn point_to_point_closed_form() {
        let net = auto(round_fabric());
        // 1 us + 5e6 B at 100 GB/s (50 us); 4 us + 5e6 B at 10 GB/s (500 us).
        assert_eq!(
            net.point_to_point(Bytes(5_000_000), true),
            Picos::from_micros(51)
        );
        assert_eq!(
            net.point_to_point(Bytes(5_000_000), false),
            Picos::from_micros(504)
        );
    }

    #[test]
    fn accessors_and_name() {
        let fabric = h100(Topology::RailOptimized);
        let net = fixed(fabric, Algorithm::Tree);
        assert_eq!(net.fabric(), &fabric);
        assert_eq!(net.choice(), AlgorithmChoice::Fixed(Algorithm::Tree));
        assert_eq!(net.name(), "analytical");
    }

    #[test]
    fn broken_fabric_saturates_instead_of_panicking() {
        let mut fabric = round_fabric();
        fabric.inter_node.efficiency = f64::NAN;
        fabric.intra_node.bandwidth = Bandwidth(0.0);
        let net = auto(fabric);
        let cost = net.collective(&request(CollectiveKind::AllReduce, 1 << 20, spread(4, 8)));
        assert_eq!(cost.time, Picos(u64::MAX));
        assert_eq!(net.point_to_point(Bytes(1), false), Picos(u64::MAX));
    }

    fn any_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            Just(0.0),
            Just(-1.0),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(f64::MIN_POSITIVE),
            0.0f64..2.0,
            0.0f64..1e13,
            any::<f64>(),
        ]
    }

    fn any_link() -> impl Strategy<Value = LinkClass> {
        (any_f64(), any_f64(), any::<u64>()).prop_map(|(bw, eff, lat)| LinkClass {
            bandwidth: Bandwidth(bw),
            efficiency: eff,
            latency: Picos(lat),
        })
    }

    fn any_fabric() -> impl Strategy<Value = Fabric> {
        let topology = prop_oneof![
            Just(Topology::RailOptimized),
            (any_f64(), any::<u32>()).prop_map(|(oversubscription, nodes_per_leaf)| {
                Topology::FatTree {
                    oversubscription,
                    nodes_per_leaf,
                }
            }),
        ];
        (any::<u32>(), any::<u32>(), any_link(), any_link(), topology).prop_map(
            |(gpus_per_node, nodes, intra_node, inter_node, topology)| Fabric {
                gpus_per_node,
                nodes,
                intra_node,
                inter_node,
                topology,
            },
        )
    }

    fn any_placement() -> impl Strategy<Value = GroupPlacement> {
        let small = 0u32..20;
        prop_oneof![
            (small.clone(), small.clone(), small).prop_map(|(size, nodes, max_per_node)| {
                GroupPlacement {
                    size,
                    nodes,
                    max_per_node,
                }
            }),
            (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(size, nodes, max_per_node)| {
                GroupPlacement {
                    size,
                    nodes,
                    max_per_node,
                }
            }),
        ]
    }

    /// Realistic placements: `nodes` nodes with up to `per_node` members each.
    fn real_placement() -> impl Strategy<Value = GroupPlacement> {
        (1u32..256, 1u32..=8).prop_map(|(nodes, per_node)| spread(nodes, per_node))
    }

    fn any_kind() -> impl Strategy<Value = CollectiveKind> {
        prop::sample::select(ALL_KINDS.to_vec())
    }

    fn any_choice() -> impl Strategy<Value = AlgorithmChoice> {
        prop_oneof![
            Just(AlgorithmChoice::Auto),
            prop::sample::select(ALL_ALGORITHMS.to_vec()).prop_map(AlgorithmChoice::Fixed),
        ]
    }

    fn real_fabric() -> impl Strategy<Value = Fabric> {
        (
            1.0f64..1000.0,
            1.0f64..100.0,
            0u64..10_000_000,
            0u64..20_000_000,
            prop_oneof![
                Just(Topology::RailOptimized),
                (1.0f64..4.0, 1u32..32).prop_map(|(oversubscription, nodes_per_leaf)| {
                    Topology::FatTree {
                        oversubscription,
                        nodes_per_leaf,
                    }
                }),
            ],
        )
            .prop_map(|(intra, inter, intra_lat, inter_lat, topology)| Fabric {
                gpus_per_node: 8,
                nodes: 1024,
                intra_node: LinkClass {
                    bandwidth: Bandwidth::from_gbytes_per_sec(intra),
                    efficiency: 0.8,
                    latency: Picos(intra_lat),
                },
                inter_node: LinkClass {
                    bandwidth: Bandwidth::from_gbytes_per_sec(inter),
                    efficiency: 0.8,
                    latency: Picos(inter_lat),
                },
                topology,
            })
    }

    proptest! {
        #[test]
        fn never_panics_and_is_deterministic(
            fabric in any_fabric(),
            choice in any_choice(),
            kind in any_kind(),
            placement in any_placement(),
            bytes in any::<u64>(),
            same_node in any::<bool>(),
        ) {
            let net = AnalyticalNetwork::new(fabric, choice);
            let req = request(kind, bytes, placement);
            let a = net.collective(&req);
            prop_assert_eq!(a, net.collective(&req));
            for alg in ALL_ALGORITHMS {
                let _ = net.algorithm_time(alg, &req);
            }
            let _ = net.bus_bandwidth(kind, placement);
            prop_assert_eq!(
                net.point_to_point(Bytes(bytes), same_node),
                net.point_to_point(Bytes(bytes), same_node)
            );
        }

        #[test]
        fn group_of_one_costs_zero(
            fabric in any_fabric(),
            choice in any_choice(),
            kind in any_kind(),
            size in 0u32..=1,
            nodes in any::<u32>(),
            max_per_node in any::<u32>(),
            bytes in any::<u64>(),
        ) {
            let net = AnalyticalNetwork::new(fabric, choice);
            let placement = GroupPlacement { size, nodes, max_per_node };
            prop_assert_eq!(net.collective(&request(kind, bytes, placement)).time, Picos::ZERO);
        }

        #[test]
        fn monotonic_in_bytes(
            fabric in real_fabric(),
            choice in any_choice(),
            kind in any_kind(),
            placement in real_placement(),
            a in 0u64..(1 << 40),
            b in 0u64..(1 << 40),
        ) {
            let (lo, hi) = (a.min(b), a.max(b));
            let net = AnalyticalNetwork::new(fabric, choice);
            let t_lo = net.collective(&request(kind, lo, placement)).time;
            let t_hi = net.collective(&request(kind, hi, placement)).time;
            prop_assert!(t_lo <= t_hi, "{} B: {}, {} B: {}", lo, t_lo, hi, t_hi);
        }

        #[test]
        fn auto_is_never_slower_than_a_fixed_algorithm(
            fabric in real_fabric(),
            kind in any_kind(),
            placement in real_placement(),
            bytes in 0u64..(1 << 40),
        ) {
            let req = request(kind, bytes, placement);
            let best = auto(fabric).collective(&req);
            for alg in ALL_ALGORITHMS {
                let forced = fixed(fabric, alg).collective(&req);
                prop_assert!(best.time <= forced.time, "{:?}: auto {:?}, fixed {:?}", alg, best, forced);
            }
        }

        #[test]
        fn ring_all_reduce_closed_form_on_one_node(
            n in 2u64..1024,
            s in 0u64..(1 << 40),
            alpha in 0u64..10_000_000,
            bw_gb in 1u64..1000,
        ) {
            let bw = bw_gb * 1_000_000_000;
            let fabric = Fabric {
                intra_node: LinkClass {
                    bandwidth: Bandwidth(bw as f64),
                    efficiency: 1.0,
                    latency: Picos(alpha),
                },
                ..round_fabric()
            };
            let placement = GroupPlacement::single_node(n as u32);
            let t = fixed(fabric, Algorithm::Ring)
                .collective(&request(CollectiveKind::AllReduce, s, placement))
                .time
                .0;
            let expected = if s == 0 { 0 } else { ring_all_reduce_expected(n, s, alpha, bw) };
            // Floating-point rounding may differ from exact integer arithmetic by a picosecond.
            prop_assert!(t.abs_diff(expected) <= 1, "got {}, expected {}", t, expected);
        }
    }
}
