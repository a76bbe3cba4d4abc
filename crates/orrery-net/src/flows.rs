//! Traffic as flows: collectives become dependency graphs of point-to-point flows.
//!
//! Both simulators take their traffic in one form, a [`FlowSet`]: messages ([`FlowSpec`],
//! `bytes` from one endpoint to another) that each wait for earlier messages ([`Deps`])
//! and then for a release delay, grouped into named collectives. A ring step waits for its
//! own previous send and for what it received; a tree chunk for its children; a relayed
//! all-to-all block for nothing but the collective's start. [`collective_flows`] expands
//! one collective over a group of endpoints by a [`FlowAlgorithm`] modelled on what NCCL
//! does (rotated ring channels, double binary trees over ranks or hosts, the hierarchical
//! scheme, direct or PXN-relayed all-to-all); its docs state each algorithm's flows and
//! dependencies exactly, and the tests hold them to the algorithms' byte and step counts.
//!
//! What this module does not do: route (flows name endpoints; the topology picks the
//! links), time anything (a flow's start and finish are what a simulator computes), or
//! decide which algorithm a collective runs (the job traffic builder and the scenario file
//! do).

use crate::CollectiveKind;
use orrery_units::{Bytes, FlowId, Picos};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// A flow's dependencies: up to four stored inline, in the flow itself. A ring step
/// waits for one or two flows, and a collective of 128 GPUs is a quarter of a million
/// flows, so a heap vector per flow (one allocation each to build, one free each to drop)
/// cost the 64 MiB ring over 128 GPUs about a seventh of its `orrery netsim` run.
pub type Deps = SmallVec<[FlowId; 4]>;

/// One message: `bytes` from endpoint `src` to endpoint `dst`, released `delay` after the
/// last of its dependencies completes (or at `delay` if it has none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowSpec {
    pub src: u32,
    pub dst: u32,
    pub bytes: Bytes,
    /// Flows that must complete before this one is released (earlier ids only).
    pub deps: Deps,
    /// Release delay after the dependencies (per-step send latency, or an arrival time).
    pub delay: Picos,
    /// The collective (index into [`FlowSet::collectives`]) this flow belongs to.
    pub collective: u32,
}

/// How a collective is turned into flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FlowAlgorithm {
    /// Ring with `channels` parallel rings, each carrying `1/channels` of the data.
    Ring { channels: u32 },
    /// Two complementary binary trees, each carrying half the data (all-reduce).
    DoubleBinaryTree,
    /// NCCL's tree across hosts: a double binary tree over the hosts, each host's ranks a
    /// chain that the tree enters and leaves at its first rank (all-reduce).
    HostTree,
    /// Recursive halving then doubling (all-reduce, reduce-scatter, all-gather).
    HalvingDoubling,
    /// Every rank sends to every other rank directly (all-to-all).
    Direct,
    /// All-to-all as NCCL runs it on a rail-optimised fabric (PXN, on by default since
    /// NCCL 2.12): a message between GPUs of different hosts and different rails is relayed
    /// over NVLink by the group's member on the source's host that sits on the
    /// destination's rail, so the fabric carries it on one rail and no spine.
    DirectPxn,
    /// Inside each host, then across hosts among one rank per host, then inside again.
    Hierarchical,
}

impl FlowAlgorithm {
    /// How an all-to-all runs: relayed onto the destination's rail where `pxn` (NCCL's
    /// PXN), otherwise directly.
    pub fn all_to_all(pxn: bool) -> FlowAlgorithm {
        if pxn {
            FlowAlgorithm::DirectPxn
        } else {
            FlowAlgorithm::Direct
        }
    }
}

/// A named collective within a flow set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveInfo {
    pub name: String,
    pub kind: Option<CollectiveKind>,
    pub ranks: Vec<u32>,
    pub bytes: Bytes,
}

/// A set of flows with dependencies: the input of every flow and packet simulation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowSet {
    pub flows: Vec<FlowSpec>,
    pub collectives: Vec<CollectiveInfo>,
}

/// Why flows could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FlowError {
    #[error("flow {flow} depends on flow {dep}, which is not an earlier flow")]
    BadDependency { flow: usize, dep: u32 },
    #[error("flow {flow} goes from endpoint {src} to itself")]
    SelfLoop { flow: usize, src: u32 },
    #[error("a collective needs at least one rank")]
    NoRanks,
    #[error("{algorithm:?} cannot run {kind:?}")]
    Unsupported {
        algorithm: FlowAlgorithm,
        kind: CollectiveKind,
    },
    #[error("rank {rank} appears more than once in the collective's group")]
    DuplicateRank { rank: u32 },
    #[error("a ring needs at least one channel")]
    NoChannels,
    #[error("the collective would need {flows} flows, more than the limit of {limit}")]
    TooManyFlows { flows: u64, limit: u64 },
}

impl FlowSet {
    /// Each flow's predecessor in a chain of flows between the same two endpoints: its
    /// first dependency `d` of the same collective, source and destination, with
    /// `alike(d, flow)`, that no earlier flow continues already; `None` where the flow
    /// starts a chain. A ring's steps on one channel between two ranks form such a chain,
    /// as do a pipelined chain's chunks over one hop. ECMP connections
    /// ([`crate::flow_model::connection_numbers`]) and the periodic model's lanes (which
    /// also want sizes within a byte) are these chains. A dependency on a later flow
    /// (which [`FlowSet::check`] rejects) continues nothing.
    pub fn chain_predecessors(
        &self,
        alike: impl Fn(&FlowSpec, &FlowSpec) -> bool,
    ) -> Vec<Option<usize>> {
        let mut continued = vec![false; self.flows.len()];
        let mut predecessor = Vec::with_capacity(self.flows.len());
        for (i, f) in self.flows.iter().enumerate() {
            let prev = f.deps.iter().map(|d| d.index()).find(|&d| {
                let Some(g) = self.flows.get(d).filter(|_| d < i) else {
                    return false;
                };
                !continued[d]
                    && g.collective == f.collective
                    && g.src == f.src
                    && g.dst == f.dst
                    && alike(g, f)
            });
            if let Some(d) = prev {
                continued[d] = true;
            }
            predecessor.push(prev);
        }
        predecessor
    }

    /// Checks that dependencies point to earlier flows and no flow is a self-loop.
    pub fn check(&self) -> Result<(), FlowError> {
        for (i, f) in self.flows.iter().enumerate() {
            if f.src == f.dst {
                return Err(FlowError::SelfLoop {
                    flow: i,
                    src: f.src,
                });
            }
            if let Some(d) = f.deps.iter().find(|d| d.index() >= i) {
                return Err(FlowError::BadDependency { flow: i, dep: d.0 });
            }
        }
        Ok(())
    }

    /// The same flows numbered anew: new flow `k` is old flow `order[k]`, its dependencies
    /// renamed. `order` must be a permutation that keeps dependencies first, such as
    /// [`dependency_order`] gives.
    pub fn reordered(&self, order: &[usize]) -> FlowSet {
        let mut new_of = vec![0u32; self.flows.len()];
        for (k, &i) in order.iter().enumerate() {
            new_of[i] = k as u32;
        }
        FlowSet {
            flows: order
                .iter()
                .map(|&i| FlowSpec {
                    deps: self.flows[i]
                        .deps
                        .iter()
                        .map(|d| FlowId(new_of[d.index()]))
                        .collect(),
                    ..self.flows[i].clone()
                })
                .collect(),
            collectives: self.collectives.clone(),
        }
    }

    /// Adds a single point-to-point flow as its own collective; returns its id.
    pub fn push_p2p(
        &mut self,
        name: &str,
        src: u32,
        dst: u32,
        bytes: Bytes,
        delay: Picos,
    ) -> FlowId {
        let collective = self.collectives.len() as u32;
        self.collectives.push(CollectiveInfo {
            name: name.to_string(),
            kind: None,
            ranks: vec![src, dst],
            bytes,
        });
        let id = FlowId::from_index(self.flows.len());
        self.flows.push(FlowSpec {
            src,
            dst,
            bytes,
            deps: Deps::new(),
            delay,
            collective,
        });
        id
    }
}

/// Bytes per pipeline chunk for chained and tree algorithms (broadcast, reduce, double
/// binary tree): NCCL's default 4 MiB buffer split into its 8 step slots.
pub const PIPELINE_CHUNK: Bytes = Bytes(512 * 1024);
/// The most pipeline chunks one chain or tree is cut into (bounds the flow count of large
/// messages; larger messages get larger chunks).
pub const MAX_PIPELINE_CHUNKS: u64 = 64;
/// The most flows one call of [`collective_flows`] may add (bad input must not exhaust
/// memory).
pub const MAX_COLLECTIVE_FLOWS: u64 = 1 << 24;

/// Appends the flows of one collective over `ranks` (endpoint indices, in the order the
/// algorithm uses them) to `set`, as a new [`CollectiveInfo`] named `name`; returns the
/// index range of the added flows.
///
/// `bytes` is the full per-rank buffer `S` (the all-reduce buffer, the all-gather output,
/// the reduce-scatter input, the all-to-all send buffer, the broadcast/reduce buffer), as
/// in [`crate::CollectiveRequest`]. `endpoints_per_host` tells which ranks share a host
/// (`rank / endpoints_per_host`; 0 counts as 1); only [`FlowAlgorithm::Hierarchical`]
/// uses it. Every flow is released `step_latency` after its dependencies (the per-step
/// send latency). Dependencies always point to earlier flows of the same call. Buffers are
/// split into chunks exactly (sizes differ by at most one byte), so byte totals match the
/// algorithm's theory exactly when `S` divides evenly and are off by rounding otherwise;
/// tiny buffers give zero-byte flows, which still carry the step's latency and ordering.
///
/// Algorithms and what they support:
/// - [`FlowAlgorithm::Ring`] `{ channels }`: `channels` independent rings over `ranks` in
///   order (rank `i` sends to rank `i + 1`), each carrying an exact share of `S`; the
///   channel count is capped at `max(1, S / n)` so no chunk is empty when `S >= n`.
///   All-reduce: `2(n-1)` steps, reduce-scatter then all-gather, each rank sending one
///   chunk of `S / (n * channels)` per step; reduce-scatter and all-gather: the `n-1`
///   steps of one phase. A rank's step depends on its own previous step and on the
///   receipt from its predecessor's previous step. Rank `i` ends reduce-scatter owning
///   chunk `i`. Broadcast (root `ranks[0]`) and reduce (root `ranks[0]`, chain from the
///   last rank back to it): a pipelined chain of chunks of [`PIPELINE_CHUNK`] (at most
///   [`MAX_PIPELINE_CHUNKS`] per channel); a chunk moves on once received, and a link
///   carries its chunks in order.
/// - [`FlowAlgorithm::DoubleBinaryTree`]: all-reduce only. NCCL's double binary tree
///   ([`double_binary_tree`]) over rank positions, each tree carrying half of `S`, pipelined
///   in chunks as for broadcast: a node sends chunk `k` up once it has chunk `k` from all its
///   children; the root sends chunk `k` down once it has it from all its children, and every
///   other node forwards it down once received from its parent.
/// - [`FlowAlgorithm::HostTree`]: all-reduce only. NCCL's tree as it runs across hosts
///   (and as the analytical model costs it): hosts ordered by first appearance in
///   `ranks`, each host's ranks a chain in that order whose first rank is the host's
///   *head*; the double binary tree ([`double_binary_tree`]) runs over the hosts, between
///   heads, each tree carrying half of `S` in pipelined chunks. Per chunk, every host
///   reduces along its chain towards its head (a rank sends once it has the chunk from the
///   rank after it), a head sends up once it has its chain's and its child hosts' chunks,
///   the root host's head holds the sum once it has its chain's and its children's, and
///   every head forwards the sum down to its child hosts' heads and along its chain. Heads
///   of alike groups sit at the same local index of their hosts, so the hosts' links are
///   those of one rail. On one host it is a chain there and back.
/// - [`FlowAlgorithm::HalvingDoubling`]: all-reduce, reduce-scatter, all-gather.
///   Recursive halving reduce-scatter (partner at distance `n/2`, then `n/4`, ...,
///   exchanging half of the remaining data) and recursive doubling all-gather (distance 1,
///   2, ...). Each rank sends `(n-1)/n * S` per phase. For all-reduce on `n` not a power of
///   two, the classic fold (Rabenseifner/MPICH): with `p` the largest power of two below
///   `n` and `r = n - p`, each odd position `2j+1 < 2r` first sends its whole buffer to
///   `2j`, the `p` remaining ranks run halving-doubling, then `2j` sends the result back
///   (in total `2rS + 2(p-1)S`). All-gather and reduce-scatter on a non-power-of-two group
///   return [`FlowError::Unsupported`].
/// - [`FlowAlgorithm::Direct`]: all-to-all only; every rank sends block `j` (`S / n`) to
///   rank `j`, `n(n-1)` flows, no dependencies.
/// - [`FlowAlgorithm::DirectPxn`]: all-to-all only; as `Direct`, except that a block from
///   rank `i` to rank `j` on another host and another rail (local index, `endpoint %
///   endpoints_per_host`) goes through the *relay* `p`: the member on `i`'s host at `j`'s
///   local index, if the group has one (NCCL relays only through ranks of the
///   communicator; without one the block goes directly). It is two flows, `i -> p` over
///   NVLink and `p -> j` on `j`'s rail, released together with no dependency between
///   them: NCCL's relay forwards chunk by chunk as they arrive, so the rail flow trails
///   its NVLink feed by one chunk, not by the whole block. That chunk is what this
///   approximates away: the rail flow may send a byte before its NVLink flow has carried
///   it, which is right to within a chunk's NVLink time (128 KiB at 450 GB/s: 0.3 us)
///   wherever the relay's NVLink share outpaces its NIC share, as on DGX-class hosts. The
///   collective still ends when every flow has, so a slow feed shows in its end. Flows
///   name only their two ends, so whatever reads a rank's flows as its part of the
///   collective (the job traffic's per-rank gates) counts a relayed block as the relay's
///   and the destination's, where NCCL's source waits for it too; the collective's end
///   and a rendezvous, which wait for every member, do not depend on that.
/// - [`FlowAlgorithm::Hierarchical`]: all-reduce, all-gather, reduce-scatter, on groups
///   with the same number `L` of ranks on each of their `H` hosts (otherwise
///   [`FlowError::Unsupported`]). Hosts are ordered by first appearance in `ranks`, and a
///   rank's local index is its order among its host's ranks. All-reduce: a single-channel
///   ring reduce-scatter inside each host (local `j` ends with block `j`, `S / L`), a ring
///   all-reduce of block `j` among the `H` ranks of local index `j` (one per host), a ring
///   all-gather inside each host. All-gather: ring all-gather across hosts among equal local
///   indices (each then holds block `j`), then inside each host. Reduce-scatter: inside each
///   host, then across hosts. A rank's first step of a phase waits for its last send and its
///   last receipt of the previous phase.
///
/// Other combinations return [`FlowError::Unsupported`]. A single rank gives no flows (the
/// collective is still recorded). Nothing is added to `set` on error.
#[allow(clippy::too_many_arguments)]
pub fn collective_flows(
    set: &mut FlowSet,
    name: &str,
    kind: CollectiveKind,
    algorithm: FlowAlgorithm,
    ranks: &[u32],
    bytes: Bytes,
    endpoints_per_host: usize,
    step_latency: Picos,
) -> Result<std::ops::Range<usize>, FlowError> {
    let n = ranks.len();
    if n == 0 {
        return Err(FlowError::NoRanks);
    }
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(FlowError::DuplicateRank { rank: w[0] });
    }
    let unsupported = FlowError::Unsupported { algorithm, kind };
    let s = bytes.0;
    use CollectiveKind as K;
    // Validate and size the plan before touching `set`.
    let planned: u128 = {
        let n128 = n as u128;
        let steps_ring = (n128 - 1) * n128;
        match (algorithm, kind) {
            (FlowAlgorithm::Ring { channels: 0 }, _) => return Err(FlowError::NoChannels),
            (FlowAlgorithm::Ring { channels }, K::AllReduce) => {
                ring_channels(channels, s, n) as u128 * 2 * steps_ring
            }
            (FlowAlgorithm::Ring { channels }, K::AllGather | K::ReduceScatter) => {
                ring_channels(channels, s, n) as u128 * steps_ring
            }
            (FlowAlgorithm::Ring { channels }, K::Broadcast | K::Reduce) => {
                ring_channels(channels, s, n) as u128 * u128::from(MAX_PIPELINE_CHUNKS) * (n128 - 1)
            }
            (FlowAlgorithm::DoubleBinaryTree | FlowAlgorithm::HostTree, K::AllReduce) => {
                2 * u128::from(MAX_PIPELINE_CHUNKS) * 2 * (n128 - 1)
            }
            (FlowAlgorithm::HalvingDoubling, K::AllReduce) => 2 * n128 * 64 + 2 * n128,
            (FlowAlgorithm::HalvingDoubling, K::AllGather | K::ReduceScatter) => {
                if !n.is_power_of_two() {
                    return Err(unsupported);
                }
                n128 * 64
            }
            (FlowAlgorithm::Direct, K::AllToAll) => steps_ring,
            (FlowAlgorithm::DirectPxn, K::AllToAll) => 2 * steps_ring,
            (FlowAlgorithm::Hierarchical, K::AllReduce | K::AllGather | K::ReduceScatter) => {
                if host_groups(ranks, endpoints_per_host).is_none() {
                    return Err(unsupported);
                }
                2 * steps_ring
            }
            _ => return Err(unsupported),
        }
    };
    if planned > u128::from(MAX_COLLECTIVE_FLOWS) {
        return Err(FlowError::TooManyFlows {
            flows: u64::try_from(planned).unwrap_or(u64::MAX),
            limit: MAX_COLLECTIVE_FLOWS,
        });
    }

    let start = set.flows.len();
    let collective = u32::try_from(set.collectives.len()).unwrap_or(u32::MAX);
    set.collectives.push(CollectiveInfo {
        name: name.to_string(),
        kind: Some(kind),
        ranks: ranks.to_vec(),
        bytes,
    });
    if n == 1 {
        return Ok(start..start);
    }
    let mut b = Builder {
        set,
        collective,
        delay: step_latency,
        ranks,
    };
    match (algorithm, kind) {
        (FlowAlgorithm::Ring { channels }, _) => {
            let c = ring_channels(channels, s, n);
            for (channel, share) in split(s, c).into_iter().enumerate() {
                let all = channel_order(ranks, endpoints_per_host, channel);
                let mut front = vec![Vec::new(); n];
                match kind {
                    K::AllReduce => {
                        let chunks = split(share, n);
                        b.ring(&all, &chunks, RingPhase::ReduceScatter, &mut front);
                        b.ring(&all, &chunks, RingPhase::AllGather, &mut front);
                    }
                    K::ReduceScatter => {
                        b.ring(&all, &split(share, n), RingPhase::ReduceScatter, &mut front)
                    }
                    K::AllGather => {
                        b.ring(&all, &split(share, n), RingPhase::AllGather, &mut front)
                    }
                    // A broadcast chain starts at the root whatever the channel.
                    K::Broadcast => {
                        let order: Vec<usize> = (0..n).collect();
                        b.chain(&order, &split(share, pipeline_chunks(share)));
                    }
                    K::Reduce => {
                        let order: Vec<usize> = (0..n).rev().collect();
                        b.chain(&order, &split(share, pipeline_chunks(share)));
                    }
                    K::AllToAll => {}
                }
            }
        }
        (FlowAlgorithm::DoubleBinaryTree, _) => {
            for (tree, half) in double_binary_tree(n).iter().zip(split(s, 2)) {
                b.tree_all_reduce(tree, &split(half, pipeline_chunks(half)));
            }
        }
        (FlowAlgorithm::HostTree, _) => {
            let hosts = hosts_in_order(ranks, endpoints_per_host);
            for (tree, half) in double_binary_tree(hosts.len()).iter().zip(split(s, 2)) {
                b.host_tree_all_reduce(tree, &hosts, &split(half, pipeline_chunks(half)));
            }
        }
        (FlowAlgorithm::HalvingDoubling, _) => b.halving_doubling(kind, s),
        (FlowAlgorithm::Direct, _) => {
            let blocks = split(s, n);
            for i in 0..n {
                for (j, &block) in blocks.iter().enumerate() {
                    if i != j {
                        b.push(i, j, block, Deps::new());
                    }
                }
            }
        }
        (FlowAlgorithm::DirectPxn, _) => {
            let blocks = split(s, n);
            let relays = PxnRelays::new(ranks, endpoints_per_host);
            for i in 0..n {
                for (j, &block) in blocks.iter().enumerate() {
                    if i == j {
                        continue;
                    }
                    match relays.relay(i, j) {
                        Some(p) => {
                            b.push(i, p, block, Deps::new());
                            b.push(p, j, block, Deps::new());
                        }
                        None => {
                            b.push(i, j, block, Deps::new());
                        }
                    }
                }
            }
        }
        (FlowAlgorithm::Hierarchical, _) => {
            // Checked above; an empty grouping cannot happen here.
            let hosts = host_groups(ranks, endpoints_per_host).unwrap_or_default();
            b.hierarchical(kind, s, &hosts);
        }
    }
    Ok(start..b.set.flows.len())
}

/// The nodes `0..n` of a dependency graph (`deps(i)`: the nodes `i` waits for, each below
/// `n`) in an order that puts every node after all it waits for, taking among the nodes
/// ready the lowest id first (the highest with `highest_first`); `None` if the graph has a
/// cycle. A [`FlowSet`]'s own order is one such order; the packet model's symmetry
/// reduction orders its quotient with this, and `orrery bench --accel --label-spread`
/// renumbers a reference's flows with it.
pub fn dependency_order(
    n: usize,
    deps: impl Fn(usize) -> Vec<usize>,
    highest_first: bool,
) -> Option<Vec<usize>> {
    let mut waiting = vec![0usize; n];
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, wait) in waiting.iter_mut().enumerate() {
        let mut on = deps(i);
        on.sort_unstable();
        on.dedup();
        *wait = on.len();
        for d in on {
            dependents.get_mut(d)?.push(i);
        }
    }
    // A max-heap of keys: the id itself, or its mirror for lowest first.
    let key = |i: usize| if highest_first { i } else { n - 1 - i };
    let mut ready: std::collections::BinaryHeap<usize> =
        (0..n).filter(|&i| waiting[i] == 0).map(key).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(k) = ready.pop() {
        let i = key(k);
        order.push(i);
        for &g in &dependents[i] {
            waiting[g] -= 1;
            if waiting[g] == 0 {
                ready.push(key(g));
            }
        }
    }
    (order.len() == n).then_some(order)
}

/// One binary tree over positions `0..n`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BinaryTree {
    /// The root position.
    pub root: usize,
    /// Each position's parent (`None` for the root).
    pub parent: Vec<Option<usize>>,
    /// Each position's children (at most two), smaller first.
    pub children: Vec<Vec<usize>>,
}

impl BinaryTree {
    /// Positions in breadth-first order from the root (parents before children).
    pub fn top_down(&self) -> Vec<usize> {
        let mut order = Vec::with_capacity(self.parent.len());
        if self.parent.is_empty() {
            return order;
        }
        order.push(self.root);
        let mut i = 0;
        while i < order.len() {
            order.extend(self.children[order[i]].iter().copied());
            i += 1;
        }
        order
    }
}

/// NCCL's double binary tree over positions `0..n` (`ncclGetDtree`).
///
/// The first tree is NCCL's in-order binary tree rooted at 0: position `r > 0` with lowest
/// set bit `b` has children `r - b/2` and `r + b/2` (the latter shrunk by halving until it
/// is below `n`), and the root's single child is half the smallest power of two `>= n`.
/// Leaves are the odd positions. The second tree is the first mirrored (`n-1-r`, for even
/// `n`) or shifted by one (`r+1 mod n`, for odd `n`), so that the first tree's leaves are
/// mostly the second's inner nodes and each position sends and receives about the same in
/// total. `n = 0` gives two empty trees.
pub fn double_binary_tree(n: usize) -> [BinaryTree; 2] {
    let first: Vec<Vec<usize>> = (0..n).map(|r| btree_children(n, r)).collect();
    let map = |r: usize| {
        if n.is_multiple_of(2) {
            n - 1 - r
        } else {
            (r + 1) % n
        }
    };
    // Position `map(r)` in the second tree plays the role of `r` in the first.
    let mut second = vec![Vec::new(); n];
    for (r, kids) in first.iter().enumerate() {
        let mut mapped: Vec<usize> = kids.iter().map(|&c| map(c)).collect();
        mapped.sort_unstable();
        second[map(r)] = mapped;
    }
    let root1 = if n == 0 { 0 } else { map(0) };
    [
        tree_from_children(0, first),
        tree_from_children(root1, second),
    ]
}

/// Children of position `r` in NCCL's binary tree over `n` positions (`ncclGetBtree`).
fn btree_children(n: usize, r: usize) -> Vec<usize> {
    if r == 0 {
        return if n > 1 {
            vec![n.next_power_of_two() >> 1]
        } else {
            Vec::new()
        };
    }
    let low = (r & r.wrapping_neg()) >> 1;
    if low == 0 {
        return Vec::new();
    }
    let mut kids = vec![r - low];
    let mut step = low;
    while step > 0 && r + step >= n {
        step >>= 1;
    }
    if step > 0 {
        kids.push(r + step);
    }
    kids
}

fn tree_from_children(root: usize, children: Vec<Vec<usize>>) -> BinaryTree {
    let mut parent = vec![None; children.len()];
    for (p, kids) in children.iter().enumerate() {
        for &c in kids {
            parent[c] = Some(p);
        }
    }
    BinaryTree {
        root,
        parent,
        children,
    }
}

/// Channels a ring actually uses: as asked, but no more than `max(1, S / n)`.
/// The ring order of channel `channel`: ranks grouped by host in order of first appearance,
/// each host's ranks rotated by the channel index (and the host's position). Like NCCL's
/// channels, different channels then leave and enter each host through different GPUs, so on
/// a multi-host ring the channels use different NICs instead of all crossing through one.
fn channel_order(ranks: &[u32], endpoints_per_host: usize, channel: usize) -> Vec<usize> {
    let per = endpoints_per_host.max(1) as u32;
    let mut hosts: Vec<(u32, Vec<usize>)> = Vec::new();
    for (pos, &r) in ranks.iter().enumerate() {
        match hosts.iter_mut().find(|(h, _)| *h == r / per) {
            Some((_, members)) => members.push(pos),
            None => hosts.push((r / per, vec![pos])),
        }
    }
    if hosts.len() < 2 {
        // One host: the given order (rotating a single ring changes nothing).
        return (0..ranks.len()).collect();
    }
    // Host `h` starts its part of the ring one local index lower than host `h-1` did, so the
    // GPU that leaves host `h-1` and the GPU that enters host `h` share a local index: the
    // hop stays on one rail (leaf only) instead of crossing the spine.
    hosts
        .into_iter()
        .enumerate()
        .flat_map(|(h, (_, mut members))| {
            let m = members.len();
            let k = (channel % m + m - h % m) % m;
            members.rotate_left(k);
            members
        })
        .collect()
}

fn ring_channels(channels: u32, s: u64, n: usize) -> u64 {
    u64::from(channels).min((s / n as u64).max(1))
}

/// Where [`FlowAlgorithm::DirectPxn`] relays: members by (host, local index).
struct PxnRelays<'a> {
    per_host: u32,
    /// (host, local index, position), sorted, for binary search.
    by_place: Vec<(u32, u32, usize)>,
    ranks: &'a [u32],
}

impl PxnRelays<'_> {
    fn new(ranks: &[u32], endpoints_per_host: usize) -> PxnRelays<'_> {
        let per_host = u32::try_from(endpoints_per_host.max(1)).unwrap_or(u32::MAX);
        let mut by_place: Vec<(u32, u32, usize)> = ranks
            .iter()
            .enumerate()
            .map(|(pos, &r)| (r / per_host, r % per_host, pos))
            .collect();
        by_place.sort_unstable();
        PxnRelays {
            per_host,
            by_place,
            ranks,
        }
    }

    /// The relay position for a block from position `i` to position `j`: the member on
    /// `i`'s host at `j`'s local index, when `i` and `j` differ in both host and rail.
    fn relay(&self, i: usize, j: usize) -> Option<usize> {
        let (src, dst) = (self.ranks[i], self.ranks[j]);
        let (src_host, dst_host) = (src / self.per_host, dst / self.per_host);
        let dst_rail = dst % self.per_host;
        if src_host == dst_host || src % self.per_host == dst_rail {
            return None;
        }
        let at = self
            .by_place
            .binary_search_by(|&(h, l, _)| (h, l).cmp(&(src_host, dst_rail)))
            .ok()?;
        Some(self.by_place[at].2)
    }
}

/// Pipeline chunks for `bytes`: one per [`PIPELINE_CHUNK`], between 1 and
/// [`MAX_PIPELINE_CHUNKS`].
fn pipeline_chunks(bytes: u64) -> u64 {
    bytes
        .div_ceil(PIPELINE_CHUNK.0)
        .clamp(1, MAX_PIPELINE_CHUNKS)
}

/// `total` split into `parts` sizes that differ by at most one and sum to `total` (the
/// first `total % parts` are one larger).
fn split(total: u64, parts: impl TryInto<u64>) -> Vec<u64> {
    let parts = parts.try_into().unwrap_or(u64::MAX).max(1);
    let (q, r) = (total / parts, total % parts);
    (0..parts).map(|i| q + u64::from(i < r)).collect()
}

/// Group positions by host (order of first appearance; within a host, order in `ranks`).
/// `None` when hosts hold different numbers of ranks.
fn host_groups(ranks: &[u32], endpoints_per_host: usize) -> Option<Vec<Vec<usize>>> {
    let hosts = hosts_in_order(ranks, endpoints_per_host);
    let l = hosts.first().map_or(0, Vec::len);
    hosts.iter().all(|h| h.len() == l).then_some(hosts)
}

/// The positions in `ranks` of each host's ranks, hosts in order of first appearance.
fn hosts_in_order(ranks: &[u32], endpoints_per_host: usize) -> Vec<Vec<usize>> {
    let eph = endpoints_per_host.max(1) as u64;
    let mut hosts: Vec<(u64, Vec<usize>)> = Vec::new();
    for (pos, &r) in ranks.iter().enumerate() {
        let h = u64::from(r) / eph;
        match hosts.iter_mut().find(|(id, _)| *id == h) {
            Some((_, members)) => members.push(pos),
            None => hosts.push((h, vec![pos])),
        }
    }
    hosts.into_iter().map(|h| h.1).collect()
}

/// After a step in which member `i` of `members` sent `sent[i]`, each member's next send
/// waits for its own send and for what it received, `sent[from(i)]`. The front's vectors
/// are refilled in place: a ring takes a step per member, and allocating a new front (and
/// a vector of the step's sends) every step made the 64 MiB ring over 128 GPUs take 200M
/// instructions to build instead of 117M.
fn settle_front(
    front: &mut [Vec<FlowId>],
    members: &[usize],
    sent: &[FlowId],
    from: impl Fn(usize) -> usize,
) {
    for (i, &member) in members.iter().enumerate() {
        let waits = &mut front[member];
        waits.clear();
        waits.extend([sent[i], sent[from(i)]]);
    }
}

/// Which half of a ring all-reduce a ring pass is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RingPhase {
    /// `m-1` steps; member `i` sends chunk `i-1-t` at step `t` and ends owning chunk `i`.
    ReduceScatter,
    /// `m-1` steps; member `i` starts with chunk `i` and sends chunk `i-t` at step `t`.
    AllGather,
}

/// Appends flows to a set for one collective; ranks are addressed by position.
#[derive(Debug)]
struct Builder<'a> {
    set: &'a mut FlowSet,
    collective: u32,
    delay: Picos,
    ranks: &'a [u32],
}

impl Builder<'_> {
    /// Adds a flow from position `src` to position `dst`.
    fn push(&mut self, src: usize, dst: usize, bytes: u64, mut deps: Deps) -> FlowId {
        deps.sort_unstable();
        deps.dedup();
        let id = FlowId::from_index(self.set.flows.len());
        self.set.flows.push(FlowSpec {
            src: self.ranks[src],
            dst: self.ranks[dst],
            bytes: Bytes(bytes),
            deps,
            delay: self.delay,
            collective: self.collective,
        });
        id
    }

    /// One ring phase over `members` (positions; member `i` sends to member `i+1`) with
    /// `chunks` (one per member). `front[pos]` holds what position `pos` waits for before its
    /// next send; after each step it is its own send and its receipt.
    fn ring(
        &mut self,
        members: &[usize],
        chunks: &[u64],
        phase: RingPhase,
        front: &mut [Vec<FlowId>],
    ) {
        let m = members.len();
        if m < 2 {
            return;
        }
        self.set.flows.reserve(m * (m - 1));
        let mut sent = Vec::with_capacity(m);
        for t in 0..m - 1 {
            sent.clear();
            for i in 0..m {
                let chunk = match phase {
                    RingPhase::ReduceScatter => (i + 2 * m - 1 - t) % m,
                    RingPhase::AllGather => (i + m - t) % m,
                };
                let deps = Deps::from_slice(&front[members[i]]);
                sent.push(self.push(members[i], members[(i + 1) % m], chunks[chunk], deps));
            }
            settle_front(front, members, &sent, |i| (i + m - 1) % m);
        }
    }

    /// A pipelined chain along `order` (positions, the first is the source): chunk `k`
    /// leaves position `j` once it has arrived there and chunk `k-1` has left.
    fn chain(&mut self, order: &[usize], chunks: &[u64]) {
        let mut last_on_link: Vec<Option<FlowId>> = vec![None; order.len()];
        for &size in chunks {
            let mut received: Option<FlowId> = None;
            for j in 0..order.len() - 1 {
                let deps = received.into_iter().chain(last_on_link[j]).collect();
                let id = self.push(order[j], order[j + 1], size, deps);
                last_on_link[j] = Some(id);
                received = Some(id);
            }
        }
    }

    /// Pipelined reduce up `tree` then broadcast down it, chunk by chunk.
    fn tree_all_reduce(&mut self, tree: &BinaryTree, chunks: &[u64]) {
        let n = tree.parent.len();
        let top_down = tree.top_down();
        let mut prev_up: Vec<Option<FlowId>> = vec![None; n];
        let mut prev_down: Vec<Option<FlowId>> = vec![None; n];
        for &size in chunks {
            // Up: children before parents.
            let mut up: Vec<Option<FlowId>> = vec![None; n];
            for &v in top_down.iter().rev() {
                if let Some(p) = tree.parent[v] {
                    let deps = tree.children[v]
                        .iter()
                        .filter_map(|&c| up[c])
                        .chain(prev_up[v])
                        .collect();
                    up[v] = Some(self.push(v, p, size, deps));
                }
            }
            // Down: parents before children; `down[u]` is the flow into `u`.
            let mut down: Vec<Option<FlowId>> = vec![None; n];
            for &v in &top_down {
                let have: Vec<FlowId> = if v == tree.root {
                    tree.children[v].iter().filter_map(|&c| up[c]).collect()
                } else {
                    down[v].into_iter().collect()
                };
                for &u in &tree.children[v] {
                    let deps = have.iter().copied().chain(prev_down[u]).collect();
                    down[u] = Some(self.push(v, u, size, deps));
                }
            }
            prev_up = up;
            prev_down = down;
        }
    }

    /// Pipelined reduce up `tree` (over hosts) then broadcast down it, chunk by chunk,
    /// each host entered and left at the first of its ranks (`hosts[h]`, positions) and
    /// its ranks a chain (see [`collective_flows`]).
    fn host_tree_all_reduce(&mut self, tree: &BinaryTree, hosts: &[Vec<usize>], chunks: &[u64]) {
        let top_down = tree.top_down();
        let h = hosts.len();
        // The previous chunk's flow on each edge: a link carries its chunks in order.
        let mut prev_chain_up: Vec<Vec<Option<FlowId>>> =
            hosts.iter().map(|c| vec![None; c.len()]).collect();
        let mut prev_chain_down = prev_chain_up.clone();
        let mut prev_up: Vec<Option<FlowId>> = vec![None; h];
        let mut prev_down: Vec<Option<FlowId>> = vec![None; h];
        for &size in chunks {
            // Up: each chain towards its head, then heads towards the root, children first.
            let mut into_head: Vec<Vec<FlowId>> = vec![Vec::new(); h];
            let mut up: Vec<Option<FlowId>> = vec![None; h];
            for &v in top_down.iter().rev() {
                let chain = &hosts[v];
                let mut received: Option<FlowId> = None;
                for k in (1..chain.len()).rev() {
                    let deps = received.into_iter().chain(prev_chain_up[v][k]).collect();
                    let id = self.push(chain[k], chain[k - 1], size, deps);
                    prev_chain_up[v][k] = Some(id);
                    received = Some(id);
                }
                into_head[v].extend(received);
                into_head[v].extend(tree.children[v].iter().filter_map(|&c| up[c]));
                if let Some(p) = tree.parent[v] {
                    let deps = into_head[v].iter().copied().chain(prev_up[v]).collect();
                    up[v] = Some(self.push(chain[0], hosts[p][0], size, deps));
                }
            }
            // Down: the root's head has the sum; every head passes it to its child hosts'
            // heads and along its chain.
            let mut down: Vec<Option<FlowId>> = vec![None; h];
            for &v in &top_down {
                let have: Vec<FlowId> = if v == tree.root {
                    into_head[v].clone()
                } else {
                    down[v].into_iter().collect()
                };
                for &c in &tree.children[v] {
                    let deps = have.iter().copied().chain(prev_down[c]).collect();
                    down[c] = Some(self.push(hosts[v][0], hosts[c][0], size, deps));
                }
                let chain = &hosts[v];
                let mut received = have;
                for k in 1..chain.len() {
                    let deps = received
                        .iter()
                        .copied()
                        .chain(prev_chain_down[v][k])
                        .collect();
                    let id = self.push(chain[k - 1], chain[k], size, deps);
                    prev_chain_down[v][k] = Some(id);
                    received = vec![id];
                }
            }
            prev_up = up;
            prev_down = down;
        }
    }

    /// Recursive halving / doubling (see [`collective_flows`]).
    fn halving_doubling(&mut self, kind: CollectiveKind, s: u64) {
        let n = self.ranks.len();
        let mut front: Vec<Vec<FlowId>> = vec![Vec::new(); n];
        if kind != CollectiveKind::AllReduce || n.is_power_of_two() {
            let members: Vec<usize> = (0..n).collect();
            let blocks = split(s, n);
            if kind != CollectiveKind::AllGather {
                self.recursive_halving(&members, &blocks, &mut front);
            }
            if kind != CollectiveKind::ReduceScatter {
                self.recursive_doubling(&members, &blocks, &mut front);
            }
            return;
        }
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let r = n - p;
        for j in 0..r {
            let id = self.push(2 * j + 1, 2 * j, s, Deps::new());
            front[2 * j].push(id);
        }
        let members: Vec<usize> = (0..r).map(|j| 2 * j).chain(2 * r..n).collect();
        let blocks = split(s, p);
        self.recursive_halving(&members, &blocks, &mut front);
        self.recursive_doubling(&members, &blocks, &mut front);
        for j in 0..r {
            let deps = Deps::from_slice(&front[2 * j]);
            self.push(2 * j, 2 * j + 1, s, deps);
        }
    }

    /// Recursive halving reduce-scatter among `members` (a power of two of them): at
    /// distance `d = m/2, m/4, ..., 1`, member `i` keeps the half of its block range on its
    /// side of bit `d` and sends the other half to member `i ^ d`; member `i` ends with
    /// block `i`.
    fn recursive_halving(&mut self, members: &[usize], blocks: &[u64], front: &mut [Vec<FlowId>]) {
        let m = members.len();
        let mut lo = vec![0usize; m];
        let mut d = m / 2;
        while d > 0 {
            let sent: Vec<FlowId> = (0..m)
                .map(|i| {
                    let (keep, give) = if i & d == 0 {
                        (lo[i], lo[i] + d)
                    } else {
                        (lo[i] + d, lo[i])
                    };
                    lo[i] = keep;
                    let bytes = blocks[give..give + d].iter().sum();
                    let deps = Deps::from_slice(&front[members[i]]);
                    self.push(members[i], members[i ^ d], bytes, deps)
                })
                .collect();
            settle_front(front, members, &sent, |i| i ^ d);
            d /= 2;
        }
    }

    /// Recursive doubling all-gather among `members`: at distance `d = 1, 2, ...`, member
    /// `i` sends its `d` blocks (those of its aligned group) to member `i ^ d`.
    fn recursive_doubling(&mut self, members: &[usize], blocks: &[u64], front: &mut [Vec<FlowId>]) {
        let m = members.len();
        let mut d = 1;
        while d < m {
            let sent: Vec<FlowId> = (0..m)
                .map(|i| {
                    let lo = i & !(d - 1);
                    let bytes = blocks[lo..lo + d].iter().sum();
                    let deps = Deps::from_slice(&front[members[i]]);
                    self.push(members[i], members[i ^ d], bytes, deps)
                })
                .collect();
            settle_front(front, members, &sent, |i| i ^ d);
            d *= 2;
        }
    }

    /// Intra-host and inter-host ring phases (see [`collective_flows`]); `hosts[h][j]` is
    /// the position of local index `j` on host `h`.
    fn hierarchical(&mut self, kind: CollectiveKind, s: u64, hosts: &[Vec<usize>]) {
        let l = hosts.first().map_or(0, Vec::len);
        let across: Vec<Vec<usize>> = (0..l)
            .map(|j| hosts.iter().map(|h| h[j]).collect())
            .collect();
        let blocks = split(s, l);
        let mut front: Vec<Vec<FlowId>> = vec![Vec::new(); self.ranks.len()];
        match kind {
            CollectiveKind::AllReduce => {
                for host in hosts {
                    self.ring(host, &blocks, RingPhase::ReduceScatter, &mut front);
                }
                for (j, group) in across.iter().enumerate() {
                    let chunks = split(blocks[j], group.len());
                    self.ring(group, &chunks, RingPhase::ReduceScatter, &mut front);
                    self.ring(group, &chunks, RingPhase::AllGather, &mut front);
                }
                for host in hosts {
                    self.ring(host, &blocks, RingPhase::AllGather, &mut front);
                }
            }
            CollectiveKind::AllGather => {
                for (j, group) in across.iter().enumerate() {
                    let chunks = split(blocks[j], group.len());
                    self.ring(group, &chunks, RingPhase::AllGather, &mut front);
                }
                for host in hosts {
                    self.ring(host, &blocks, RingPhase::AllGather, &mut front);
                }
            }
            CollectiveKind::ReduceScatter => {
                for host in hosts {
                    self.ring(host, &blocks, RingPhase::ReduceScatter, &mut front);
                }
                for (j, group) in across.iter().enumerate() {
                    let chunks = split(blocks[j], group.len());
                    self.ring(group, &chunks, RingPhase::ReduceScatter, &mut front);
                }
            }
            _ => {}
        }
    }
}
