//! The communication of one training step as network flows, for `orrery netsim`.
//!
//! The predictor replays the step with the analytical network, which says when every rank
//! issues every collective and transfer and how long its compute takes. Each collective
//! instance (one per concrete group and position in that group's order) becomes the flows of
//! the algorithm the replay's analytical model chose for it (ring, tree or hierarchical; see
//! `flow_algorithm`) among the group's ranks, so the simulated network carries the traffic
//! whose timing the replay assumed; each pipeline send becomes one flow. The
//! result runs on a topology built from the job's cluster, so the packet- or flow-level
//! simulator sees the step's traffic with its timing and overlaps.
//!
//! ## When the flows are released ([`Release`])
//!
//! - [`Release::Replay`]: every flow at the time the replay issued it (open loop). A
//!   collective the simulated network finds slower than the analytical model then overlaps
//!   what the replay put after it, which the program could not do: on the GPT 13B step at
//!   1,024 GPUs the parameter all-gathers start while the embedding all-reduce they follow
//!   is still running (docs/benchmarks.md).
//! - [`Release::Dependencies`]: a rank's communication waits for the communication it
//!   depends on *in the simulation*. For every collective and send of a rank, the *gate* is
//!   the communication op of that rank it waits for that ended last in the replay: found by
//!   walking the rank's graph back (dependencies and stream order) through everything that
//!   is not simulated as flows (compute, memory, unselected communication), a receive
//!   counting only when it waited for its data. The rank's first flows of the op then
//!   depend on the gate's last flows at that rank (those of the gate that touch the rank and
//!   that no other such flow waits for), delayed by what separated the gate's end from the
//!   op's start in the replay (the compute between them, and any wait for the group's other
//!   members). So an op never starts on a rank before its gate has finished there, however
//!   long the simulated network takes; with the analytical network's times every flow would
//!   be released when the replay issued it. An op without a gate is released at the
//!   replay's time.
//!
//! - [`Release::Rendezvous`] (the default): as [`Release::Dependencies`], but a collective's
//!   first flows on every member wait for the last flows of *all* its members' gates,
//!   followed by the replay's gap after the gate that ended last in the replay (or, when no
//!   member has a gate, start at the replay's time). A collective then starts on all its
//!   members at once, as the replay's rendezvous has it. Under the dependency rule early
//!   members send their first chunks sooner; the difference is at most the spread of the
//!   members' gates, and in exchange consecutive collectives on one group never overlap,
//!   which the replay did not let them do either. The price is in the flow set: each of a
//!   collective's first flows lists every member's gate flows, so a collective's
//!   dependencies grow with the square of its members (a ring of `n` members on `c`
//!   channels: about `(n c)^2`). It is the default because it keeps the step causal (no
//!   op before what it waits for) with the replay's own rule for collectives, and because
//!   steps released so repeat themselves on idle links, where the accelerated packet model
//!   skips most of their events (docs/benchmarks.md).
//!
//! What this deliberately does not do: move compute, or honour more than one gate. The gaps
//! are the replay's, an op waits for its latest gate only (one that ended earlier in the
//! replay and runs late in the simulation is not waited for), and under the dependency rule
//! the members of a collective start their own first flows when each is ready (a ring's
//! later steps wait for their neighbours through the ring's own dependencies). It is the
//! traffic of a step with its causality along each rank's latest dependency, not a
//! co-simulation of compute and network.

use crate::replay::ReplayMode;
use crate::{fabric_for, predict_with, PredictError};
use orrery_graph::materialize::{materialize, Concrete};
use orrery_graph::{GroupRole, OpKind};
use orrery_net::flows::{collective_flows, Deps, FlowAlgorithm, FlowError, FlowSet};
use orrery_net::topology::{FatTreeSpec, NetGraph, RailOptimizedSpec, TopologyError};
use orrery_net::word_hash::WordMap;
use orrery_net::{
    Algorithm, AlgorithmChoice, AnalyticalNetwork, CollectiveKind, CollectiveRequest,
    GroupPlacement, NetworkModel,
};
use orrery_spec::{Job, TopologyKind};
use orrery_units::{FlowId, Picos, RankId};
use serde::Serialize;

/// Which kinds of communication to include.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TrafficSelection {
    pub tp: bool,
    pub cp: bool,
    pub ep: bool,
    pub dp: bool,
    pub pp: bool,
}

impl TrafficSelection {
    pub const ALL: TrafficSelection = TrafficSelection {
        tp: true,
        cp: true,
        ep: true,
        dp: true,
        pp: true,
    };

    /// Parses names like `["dp", "pp"]`; returns the unknown names as the error.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<TrafficSelection, Vec<String>> {
        let mut s = TrafficSelection {
            tp: false,
            cp: false,
            ep: false,
            dp: false,
            pp: false,
        };
        let mut unknown = Vec::new();
        for n in names {
            match n.as_ref() {
                "tp" => s.tp = true,
                "cp" => s.cp = true,
                "ep" => s.ep = true,
                "dp" => s.dp = true,
                "pp" => s.pp = true,
                other => unknown.push(other.to_string()),
            }
        }
        if unknown.is_empty() {
            Ok(s)
        } else {
            Err(unknown)
        }
    }

    fn role(&self, role: GroupRole) -> bool {
        match role {
            GroupRole::Tp => self.tp,
            GroupRole::Cp => self.cp,
            GroupRole::Ep => self.ep,
            GroupRole::Dp
            | GroupRole::DpCp
            | GroupRole::ExpertDp
            | GroupRole::Embedding
            | GroupRole::World => self.dp,
        }
    }
}

/// Why a job's traffic could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TrafficError {
    #[error(transparent)]
    Predict(#[from] PredictError),
    #[error("building the cluster topology: {0}")]
    Topology(#[from] TopologyError),
    #[error("expanding a collective into flows: {0}")]
    Flows(#[from] FlowError),
    /// The flows outgrew the memory allowed for them (see [`job_traffic_limited`]).
    #[error(
        "the step's traffic outgrew {limit} of flows after {done} of its {instances} \
         collectives and sends ({flows} flows, {dependencies} dependencies, about \
         {size}), and simulating it would need several times that: select fewer kinds \
         of traffic (tensor-parallel traffic is the most numerous), or allow more",
        limit = human_bytes(*.limit_bytes),
        size = human_bytes(*.bytes)
    )]
    TooLarge {
        limit_bytes: u64,
        done: usize,
        instances: usize,
        flows: usize,
        dependencies: u64,
        bytes: u64,
    },
}

/// `bytes` in the largest binary unit it reaches, with two decimals.
fn human_bytes(bytes: u64) -> String {
    let units = [(30, "GiB"), (20, "MiB"), (10, "KiB")];
    match units.iter().find(|&&(shift, _)| bytes >= 1 << shift) {
        Some(&(shift, unit)) => format!("{:.2} {unit}", bytes as f64 / (1u64 << shift) as f64),
        None => format!("{bytes} bytes"),
    }
}

/// The memory [`job_traffic_with`] lets a step's flows take: 4 GiB, about 47 million
/// flows. The simulators need more than the flows' own records (routes, per-flow state:
/// the accelerated packet model's whole process held 337 MB for the 1.6 million flows of
/// the Llama-3 70B step's data- and pipeline-parallel traffic at 1,024 GPUs, about 210
/// bytes a flow), so a flow set of this size already asks for ten gigabytes or more. The same step with its tensor-parallel traffic is over a
/// hundred million flows with more than a billion dependencies, which used to end with
/// the process killed for memory.
pub const DEFAULT_MAX_TRAFFIC_BYTES: u64 = 4 << 30;

/// The topology a job's cluster describes, at datasheet link rates, routed as its
/// `routing` says.
pub fn cluster_topology(job: &Job) -> Result<NetGraph, TopologyError> {
    let c = job.cluster();
    let hosts = c.nodes as usize;
    let gpus = c.gpus_per_node as usize;
    let graph = match c.topology {
        TopologyKind::RailOptimized => NetGraph::rail_optimized(&RailOptimizedSpec {
            gpus_per_host: gpus,
            nvlink: c.gpu.nvlink_bandwidth,
            nic: c.nic_bandwidth,
            ..RailOptimizedSpec::dgx_h100(hosts)
        }),
        TopologyKind::FatTree => NetGraph::fat_tree(&FatTreeSpec {
            gpus_per_host: gpus,
            nvlink: c.gpu.nvlink_bandwidth,
            nic: c.nic_bandwidth,
            hosts_per_leaf: c.nodes_per_leaf as usize,
            oversubscription: c.oversubscription,
            ..FatTreeSpec::two_tier(hosts)
        }),
    };
    graph.map(|g| g.with_routing(crate::routing_of(c)))
}

/// When the flows of a step are released (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Release {
    /// At the analytical replay's times (open loop).
    Replay,
    /// After the communication each rank's op waits for, as simulated (closed loop along
    /// each op's latest gate).
    Dependencies,
    /// As [`Release::Dependencies`], but a collective starts on all its members at once,
    /// when the last of their gates has finished (the replay's own rendezvous).
    #[default]
    Rendezvous,
}

impl Release {
    /// Every rule, the default first.
    pub const ALL: [Release; 3] = [Release::Rendezvous, Release::Dependencies, Release::Replay];

    /// The rule's name in scenario files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Release::Replay => "replay",
            Release::Dependencies => "dependencies",
            Release::Rendezvous => "rendezvous",
        }
    }

    /// Parses a rule's [`Release::name`].
    pub fn from_name(name: &str) -> Option<Release> {
        Release::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// The flows of one training step of `job`, with the topology they run on, released by the
/// default rule ([`Release::Rendezvous`]).
pub fn job_traffic(
    job: &Job,
    select: TrafficSelection,
) -> Result<(NetGraph, FlowSet), TrafficError> {
    job_traffic_with(job, select, Release::default())
}

/// One simulated communication op of a rank: its index in the rank's graph, when the replay
/// started it there, and its gate (op index and replay end), if any.
#[derive(Debug, Clone, Copy)]
struct Member {
    op: u32,
    start: Picos,
    gate: Option<(u32, Picos)>,
}

/// A collective instance or a send, in the order the ranks first reach it.
#[derive(Debug)]
enum Instance {
    Collective {
        name: String,
        kind: orrery_net::CollectiveKind,
        algorithm: FlowAlgorithm,
        ranks: Vec<u32>,
        bytes: orrery_units::Bytes,
        /// Each member's op, by member (the order of `ranks`).
        members: Vec<Option<Member>>,
    },
    Send {
        name: String,
        src: u32,
        dst: u32,
        tag: u64,
        bytes: orrery_units::Bytes,
        member: Member,
    },
}

impl Instance {
    /// When the replay started it: a collective when its last member arrived (the members'
    /// ops start when each reaches it, then wait for the others), a send when it was sent.
    fn start(&self) -> Picos {
        match self {
            Instance::Collective { members, .. } => members
                .iter()
                .flatten()
                .map(|m| m.start)
                .max()
                .unwrap_or(Picos::ZERO),
            Instance::Send { member, .. } => member.start,
        }
    }
}

/// The flows' algorithm for a collective: the one the replay's analytical model chose for
/// it, so that the simulated network carries the traffic whose timing the replay assumed
/// (a ring where the replay costed a tree would run the ring's `2(n-1)` latency-bound steps
/// where the replay had budgeted the tree's few, and overlap what the replay put after it).
///
/// - Ring: `max_per_node` channels, as NCCL runs one ring per GPU of a node so that the
///   inter-node hop gets every member's NIC (the bandwidth the analytical ring assumes).
/// - Tree: NCCL's tree across hosts, as the analytical model costs it: a double binary tree
///   across nodes with a chain inside each ([`FlowAlgorithm::HostTree`]). Its inter-node
///   edges join the first member of each node, so alike groups keep to one rail.
/// - Hierarchical: inside each node, across nodes, inside again, exactly as costed. It needs
///   the same number of members on every node; on an uneven placement (which the analytical
///   model costs by its busiest node) the flows fall back to the ring.
/// - All-to-all: direct, relayed through the GPU on the destination's rail where `pxn`
///   (NCCL's PXN, [`FlowAlgorithm::DirectPxn`]).
/// - Anything else: the ring.
fn flow_algorithm(
    net: &AnalyticalNetwork,
    kind: CollectiveKind,
    bytes: orrery_units::Bytes,
    placement: GroupPlacement,
    pxn: bool,
) -> FlowAlgorithm {
    let ring = FlowAlgorithm::Ring {
        channels: placement.max_per_node.max(1),
    };
    if kind == CollectiveKind::AllToAll {
        return FlowAlgorithm::all_to_all(pxn);
    }
    let chosen = net
        .collective(&CollectiveRequest {
            kind,
            bytes,
            placement,
        })
        .algorithm;
    match (chosen, kind) {
        (Algorithm::Tree, CollectiveKind::AllReduce) => FlowAlgorithm::HostTree,
        (
            Algorithm::Hierarchical,
            CollectiveKind::AllReduce | CollectiveKind::AllGather | CollectiveKind::ReduceScatter,
        ) if placement.size == placement.nodes * placement.max_per_node => {
            FlowAlgorithm::Hierarchical
        }
        _ => ring,
    }
}

/// [`job_traffic`] with the release rule chosen, within [`DEFAULT_MAX_TRAFFIC_BYTES`].
pub fn job_traffic_with(
    job: &Job,
    select: TrafficSelection,
    release: Release,
) -> Result<(NetGraph, FlowSet), TrafficError> {
    job_traffic_limited(job, select, release, DEFAULT_MAX_TRAFFIC_BYTES)
}

/// [`job_traffic_with`], failing with [`TrafficError::TooLarge`] as soon as the flows
/// built so far take more than `max_bytes` (each flow's record, and the dependencies that
/// do not fit in it), so a step too large to simulate is refused with its size instead of
/// exhausting the memory.
pub fn job_traffic_limited(
    job: &Job,
    select: TrafficSelection,
    release: Release,
    max_bytes: u64,
) -> Result<(NetGraph, FlowSet), TrafficError> {
    let net = AnalyticalNetwork::new(fabric_for(job), AlgorithmChoice::Auto);
    let out = predict_with(job, &net, ReplayMode::Classes)?;
    let graph = cluster_topology(job)?;
    let layout = &out.graphs.layout;
    let per_host = job.cluster().gpus_per_node as usize;
    let pxn = job.cluster().pxn;
    let step = Picos::from_nanos(crate::NIC_LATENCY_NS);

    let mut instances: Vec<Instance> = Vec::new();
    let mut collective_of: WordMap<(u32, u32), usize> = WordMap::default();
    // Receives that waited for their data, by (receiver, sender, tag): their op index.
    let mut waiting_recvs: WordMap<(u32, u32, u64), u32> = WordMap::default();
    for r in 0..layout.world_size() {
        let rank = RankId(r);
        let rg = materialize(&out.graphs, rank);
        // In class mode every rank of a class has its class's timeline.
        let timing = &out.timeline.participants[layout.class_of(rank).index()].ops;
        let ops = rg.graph.ops();
        // The gate walk: the latest-ending simulated communication each op waits for (the
        // replay's times need none).
        let walk = release != Release::Replay;
        let mut gate: Vec<Option<u32>> = vec![None; ops.len()];
        let mut marker = vec![false; ops.len()];
        let mut last_on_stream: [Option<u32>; 6] = [None; 6];
        let mut seq_on_group = WordMap::default();
        for (i, (op, resolved)) in ops.iter().zip(&rg.resolved).enumerate() {
            let stream_pred = if op.kind.occupies_stream() {
                last_on_stream[op.stream.index()].replace(i as u32)
            } else {
                None
            };
            let mut best: Option<u32> = None;
            if walk {
                let preds = op.deps.iter().map(|d| d.index());
                for p in preds.chain(stream_pred.map(|p| p as usize)) {
                    let Some(c) = (if marker[p] { Some(p as u32) } else { gate[p] }) else {
                        continue;
                    };
                    let later = |b: u32| (timing[c as usize].end, c) > (timing[b as usize].end, b);
                    if best.is_none_or(later) {
                        best = Some(c);
                    }
                }
            }
            gate[i] = best;
            let member = Member {
                op: i as u32,
                start: timing[i].start,
                gate: best.map(|g| (g, timing[g as usize].end)),
            };
            match (op.kind, *resolved) {
                (
                    OpKind::Collective {
                        op: cop,
                        group,
                        bytes,
                    },
                    Concrete::Group(g),
                ) => {
                    let seq = seq_on_group.entry(g).or_insert(0u32);
                    let key = (g.0, *seq);
                    *seq += 1;
                    if !select.role(group) {
                        continue;
                    }
                    marker[i] = true;
                    let x = *collective_of.entry(key).or_insert_with(|| {
                        let ranks: Vec<u32> = layout
                            .group_members(rank, group)
                            .iter()
                            .map(|m| m.0)
                            .collect();
                        debug_assert!(ranks.windows(2).all(|w| w[0] < w[1]), "rank order");
                        let placement = layout.placement(rank, group);
                        let placement = GroupPlacement {
                            size: placement.size,
                            nodes: placement.nodes,
                            max_per_node: placement.max_per_node,
                        };
                        let kind = crate::replay::net_kind(cop);
                        let algorithm = flow_algorithm(&net, kind, bytes, placement, pxn);
                        instances.push(Instance::Collective {
                            name: format!("{} {} g{}", group.name(), rg.graph.name_of(op), g.0),
                            kind,
                            algorithm,
                            members: vec![None; ranks.len()],
                            ranks,
                            bytes,
                        });
                        instances.len() - 1
                    });
                    // Group members are listed in rank order.
                    if let Instance::Collective { ranks, members, .. } = &mut instances[x] {
                        if let Ok(k) = ranks.binary_search(&r) {
                            members[k] = Some(member);
                        }
                    }
                }
                (OpKind::Send { bytes, tag, .. }, Concrete::Peer(peer)) if select.pp => {
                    marker[i] = true;
                    instances.push(Instance::Send {
                        name: rg.graph.name_of(op).to_string(),
                        src: r,
                        dst: peer.0,
                        tag,
                        bytes,
                        member,
                    });
                }
                // A receive whose data was there when it was reached waited for nothing
                // simulated (what it waited for is its own gate), so only one that waited
                // for its data is a gate.
                (OpKind::Recv { tag, .. }, Concrete::Peer(peer))
                    if select.pp && timing[i].end > timing[i].start =>
                {
                    marker[i] = true;
                    waiting_recvs.insert((r, peer.0, tag), i as u32);
                }
                _ => {}
            }
        }
    }

    // Dependencies point to earlier flows, so with gates the instances are expanded in the
    // order the replay started them (a gate ends before what it gates starts); the sort is
    // stable, so ties keep the order the ranks reached them, as the replay rule does.
    let mut order: Vec<usize> = (0..instances.len()).collect();
    if release != Release::Replay {
        let starts: Vec<Picos> = instances.iter().map(Instance::start).collect();
        order.sort_by_key(|&x| starts[x]);
    }
    // The last flows of each rank's simulated op, once expanded: what its dependents wait for.
    let mut last_flows: WordMap<(u32, u32), Vec<FlowId>> = WordMap::default();
    // What a rank's op that the replay started at `start` waits for: its gate's last flows
    // at the rank (borrowed: each caller copies them into what it builds), and the time
    // from the gate's end to `start`.
    fn gated<'a>(
        release: Release,
        rank: u32,
        m: &Member,
        start: Picos,
        last_flows: &'a WordMap<(u32, u32), Vec<FlowId>>,
    ) -> Option<(&'a [FlowId], Picos)> {
        if release == Release::Replay {
            return None;
        }
        let (g, end) = m.gate?;
        let deps = last_flows.get(&(rank, g))?;
        Some((deps, Picos(start.0.saturating_sub(end.0))))
    }
    let mut set = FlowSet::default();
    // Dependencies in all, and those stored outside their flow's record.
    let (mut dependencies, mut spilled) = (0u64, 0u64);
    let total = order.len();
    for (done, x) in order.into_iter().enumerate() {
        let start = instances[x].start();
        let first = set.flows.len();
        match &instances[x] {
            Instance::Collective {
                name,
                kind,
                algorithm,
                ranks,
                bytes,
                members,
            } => {
                let range = collective_flows(
                    &mut set, name, *kind, *algorithm, ranks, *bytes, per_host, step,
                )?;
                // The rendezvous: every member's gate, and the replay's gap after the one
                // that ended last there (the smallest gap, all being measured to `start`).
                let together = if release == Release::Rendezvous {
                    let mut deps = Deps::new();
                    let mut gap: Option<Picos> = None;
                    for (&rank, m) in ranks.iter().zip(members) {
                        if let Some((d, g)) =
                            m.and_then(|m| gated(release, rank, &m, start, &last_flows))
                        {
                            deps.extend_from_slice(d);
                            gap = Some(gap.map_or(g, |x| x.min(g)));
                        }
                    }
                    deps.sort_unstable();
                    deps.dedup();
                    gap.map(|gap| (deps, gap))
                } else {
                    None
                };
                for f in &mut set.flows[range.clone()] {
                    if !f.deps.is_empty() {
                        continue;
                    }
                    if let Some((deps, gap)) = &together {
                        f.deps = deps.clone();
                        f.delay += *gap;
                        continue;
                    }
                    let member = ranks.binary_search(&f.src).ok().and_then(|k| members[k]);
                    match member.and_then(|m| gated(release, f.src, &m, start, &last_flows)) {
                        Some((deps, gap)) => {
                            f.deps = Deps::from_slice(deps);
                            f.delay += gap;
                        }
                        None => f.delay += start,
                    }
                }
                let mut last = last_flows_by_rank(&set, range);
                for (&rank, m) in ranks.iter().zip(members) {
                    if let (Some(m), Some(flows)) = (m, last.remove(&rank)) {
                        last_flows.insert((rank, m.op), flows);
                    }
                }
            }
            Instance::Send {
                name,
                src,
                dst,
                tag,
                bytes,
                member,
            } => {
                let id = set.push_p2p(name, *src, *dst, *bytes, start);
                if let Some((deps, gap)) = gated(release, *src, member, start, &last_flows) {
                    let f = &mut set.flows[id.index()];
                    f.deps = Deps::from_slice(deps);
                    f.delay = gap;
                }
                last_flows.insert((*src, member.op), vec![id]);
                if let Some(&op) = waiting_recvs.get(&(*dst, *src, *tag)) {
                    last_flows.insert((*dst, op), vec![id]);
                }
            }
        }
        for f in &set.flows[first..] {
            dependencies += f.deps.len() as u64;
            if f.deps.spilled() {
                spilled += f.deps.capacity() as u64;
            }
        }
        let bytes = (set.flows.len() * std::mem::size_of::<orrery_net::flows::FlowSpec>()) as u64
            + spilled * std::mem::size_of::<FlowId>() as u64;
        if bytes > max_bytes {
            return Err(TrafficError::TooLarge {
                limit_bytes: max_bytes,
                done: done + 1,
                instances: total,
                flows: set.flows.len(),
                dependencies,
                bytes,
            });
        }
    }
    set.check()?;
    Ok((graph, set))
}

/// For every rank the flows of `range` touch: those that touch it (as source or
/// destination) and that no other flow of the range touching it depends on. When they have
/// finished, the collective is done at that rank.
fn last_flows_by_rank(set: &FlowSet, range: std::ops::Range<usize>) -> WordMap<u32, Vec<FlowId>> {
    // Per flow of the range, whether a flow of the range touching its source (then its
    // destination) depends on it. A flow only ever asks about its own two ends, so two
    // flags per flow say what a set of (flow, rank) pairs would, without hashing each
    // dependency twice (half a million inserts on the GPT step over 128 GPUs).
    let base = range.start;
    let mut waited_on = vec![[false; 2]; range.len()];
    for f in &set.flows[range.clone()] {
        for &d in &f.deps {
            let Some(mark) = d
                .index()
                .checked_sub(base)
                .and_then(|k| waited_on.get_mut(k))
            else {
                continue;
            };
            let g = &set.flows[d.index()];
            mark[0] |= g.src == f.src || g.src == f.dst;
            mark[1] |= g.dst == f.src || g.dst == f.dst;
        }
    }
    let mut last: WordMap<u32, Vec<FlowId>> = WordMap::default();
    for (k, i) in range.enumerate() {
        let id = FlowId::from_index(i);
        let f = &set.flows[i];
        for (end, rank) in [f.src, f.dst].into_iter().enumerate() {
            if !waited_on[k][end] {
                last.entry(rank).or_default().push(id);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use orrery_net::flows::{Deps, FlowSpec};
    use orrery_units::{Bytes, Picos};
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// The definition [`last_flows_by_rank`] implements, with a set of (flow, rank)
    /// pairs: a flow of the range is last at each of its ends that no flow of the range
    /// depending on it touches.
    fn by_set(set: &FlowSet, range: std::ops::Range<usize>) -> Vec<(u32, Vec<FlowId>)> {
        let mut waited_on = HashSet::new();
        for f in &set.flows[range.clone()] {
            for &d in &f.deps {
                waited_on.insert((d, f.src));
                waited_on.insert((d, f.dst));
            }
        }
        let mut last: std::collections::BTreeMap<u32, Vec<FlowId>> = Default::default();
        for i in range {
            let f = &set.flows[i];
            for rank in [f.src, f.dst] {
                if !waited_on.contains(&(FlowId::from_index(i), rank)) {
                    last.entry(rank).or_default().push(FlowId::from_index(i));
                }
            }
        }
        last.into_iter().collect()
    }

    proptest! {
        /// Random flows over five ranks (self-sends included), each depending on up to
        /// three earlier ones (some before the range), against the set-based definition.
        #[test]
        fn last_flows_by_rank_agrees_with_its_definition(
            flows in proptest::collection::vec(
                (0u32..5, 0u32..5, proptest::collection::vec(0usize..64, 0..4)),
                1..40,
            ),
            start in 0usize..8,
        ) {
            let mut set = FlowSet::default();
            for (i, (src, dst, deps)) in flows.iter().enumerate() {
                let deps: Deps = deps.iter().filter(|_| i > 0).map(|&d| FlowId::from_index(d % i.max(1))).collect();
                set.flows.push(FlowSpec {
                    src: *src,
                    dst: *dst,
                    bytes: Bytes(1),
                    deps,
                    delay: Picos::ZERO,
                    collective: 0,
                });
            }
            let range = start.min(set.flows.len())..set.flows.len();
            let mut fast: Vec<(u32, Vec<FlowId>)> =
                last_flows_by_rank(&set, range.clone()).into_iter().collect();
            fast.sort_unstable();
            prop_assert_eq!(fast, by_set(&set, range));
        }
    }
}
