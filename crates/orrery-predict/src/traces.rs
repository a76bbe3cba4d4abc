//! Replay of Chakra execution traces: per-rank ET files, orrery's own or converted from
//! PyTorch by the Chakra tools, replayed on orrery's cost and network models.
//!
//! Each imported rank becomes one participant of the replay engine. Collectives are matched
//! across ranks by their process group (the trace's `pg_name`, whose members come from the
//! comm-group JSON side file; an empty or `"0"` group means every rank) and by their order
//! on that group; sends are matched to receives by peer rank and tag. Durations measured in
//! the trace can replace the cost model's (`use_measured`).
//!
//! What this module deliberately does not do: replay a partial set of ranks. Every rank a
//! trace talks to must be present; emulating the missing ones is hybrid emulation's job.

use crate::breakdown::{breakdown, Breakdown};
use crate::memory::{ledger, LedgerError};
use crate::replay::{replay_participants, Link, Participant, ReplayError, ReplayMode, Timeline};
use crate::{fabric_of, CostModel};
use orrery_graph::chakra::ImportedRank;
use orrery_graph::OpKind;
use orrery_net::{AlgorithmChoice, AnalyticalNetwork, GroupPlacement};
use orrery_spec::Cluster;
use orrery_units::{Bytes, ClassId, Picos, RankId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// Why a set of traces cannot be replayed.
#[derive(Debug, thiserror::Error)]
pub enum TraceReplayError {
    #[error("no traces to replay")]
    Empty,
    #[error("two traces claim rank {rank}")]
    DuplicateRank { rank: u32 },
    #[error("rank {rank} op {op}: process group `{group}` is not in the comm-group file")]
    UnknownGroup { rank: u32, op: usize, group: String },
    #[error("rank {rank} op {op}: group `{group}` has member {member}, whose trace is missing")]
    MissingMember {
        rank: u32,
        op: usize,
        group: String,
        member: u32,
    },
    #[error("rank {rank} op {op}: {what} names rank {peer}, whose trace is missing")]
    MissingPeer {
        rank: u32,
        op: usize,
        what: &'static str,
        peer: u32,
    },
    #[error("rank {rank} op {op}: a send or receive without a peer rank")]
    NoPeer { rank: u32, op: usize },
    #[error("rank {rank}: {source}")]
    Graph {
        rank: u32,
        source: orrery_graph::GraphError,
    },
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("rank {rank}: {source}")]
    Ledger { rank: u32, source: LedgerError },
}

/// One replayed rank.
#[derive(Debug, Clone, Serialize)]
pub struct RankSummary {
    pub rank: u32,
    pub end: Picos,
    pub peak_memory: Bytes,
}

/// What replaying a set of traces gives.
#[derive(Debug, Clone, Serialize)]
pub struct TraceReport {
    pub ranks: usize,
    pub step_time: Picos,
    /// The rank that finishes last, which the breakdown describes.
    pub critical_rank: u32,
    pub breakdown: Breakdown,
    pub per_rank: Vec<RankSummary>,
    /// Ops whose duration came from the trace rather than the cost model.
    pub measured_ops: usize,
    pub events: u64,
}

/// The rank of each trace: its own claim, else its position in the list.
fn rank_ids(traces: &[ImportedRank]) -> Result<Vec<u32>, TraceReplayError> {
    let ids: Vec<u32> = traces
        .iter()
        .enumerate()
        .map(|(i, t)| t.rank.map_or(i as u32, |r| r.0))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for &r in &ids {
        if !seen.insert(r) {
            return Err(TraceReplayError::DuplicateRank { rank: r });
        }
    }
    Ok(ids)
}

fn placement(members: &[u32], gpus_per_node: u64) -> GroupPlacement {
    let mut per_node: BTreeMap<u64, u32> = BTreeMap::new();
    for &m in members {
        *per_node
            .entry(u64::from(m) / gpus_per_node.max(1))
            .or_default() += 1;
    }
    GroupPlacement {
        size: members.len() as u32,
        nodes: per_node.len() as u32,
        max_per_node: per_node.values().copied().max().unwrap_or(0),
    }
}

/// Resolves every trace's collectives and transfers into replay participants.
pub fn participants<'t>(
    traces: &'t [ImportedRank],
    groups: &BTreeMap<String, Vec<u32>>,
    gpus_per_node: u64,
    use_measured: bool,
) -> Result<Vec<Participant<'t>>, TraceReplayError> {
    if traces.is_empty() {
        return Err(TraceReplayError::Empty);
    }
    let ids = rank_ids(traces)?;
    let index: HashMap<u32, u32> = ids
        .iter()
        .enumerate()
        .map(|(i, &r)| (r, i as u32))
        .collect();
    let mut all: Vec<u32> = ids.clone();
    all.sort_unstable();
    // Rendezvous keys: groups numbered in name order, the world group last.
    let group_index: HashMap<&str, u32> = groups
        .keys()
        .enumerate()
        .map(|(i, k)| (k.as_str(), i as u32))
        .collect();
    let world_key = groups.len() as u32;
    let mut out = Vec::with_capacity(traces.len());
    for (t, trace) in traces.iter().enumerate() {
        let rank = ids[t];
        trace
            .graph
            .check()
            .map_err(|source| TraceReplayError::Graph { rank, source })?;
        let mut seq: HashMap<u32, u32> = HashMap::new();
        let mut links = Vec::with_capacity(trace.graph.len());
        for (i, (op, node)) in trace.graph.ops().iter().zip(&trace.nodes).enumerate() {
            let link = match op.kind {
                OpKind::Collective { .. } => {
                    let name = node.comm_group.as_deref().unwrap_or("");
                    let (key, members): (u32, &[u32]) = if name.is_empty() || name == "0" {
                        (world_key, &all)
                    } else {
                        match (group_index.get(name), groups.get(name)) {
                            (Some(&k), Some(m)) => (k, m.as_slice()),
                            _ => {
                                return Err(TraceReplayError::UnknownGroup {
                                    rank,
                                    op: i,
                                    group: name.to_string(),
                                })
                            }
                        }
                    };
                    if let Some(&missing) = members.iter().find(|m| !index.contains_key(m)) {
                        return Err(TraceReplayError::MissingMember {
                            rank,
                            op: i,
                            group: name.to_string(),
                            member: missing,
                        });
                    }
                    let s = seq.entry(key).or_insert(0);
                    let rendezvous = Some((key, *s));
                    *s += 1;
                    Link::Collective {
                        rendezvous,
                        members: members.len() as u32,
                        placement: placement(members, gpus_per_node),
                    }
                }
                OpKind::Send { .. } | OpKind::Recv { .. } => {
                    let what = if matches!(op.kind, OpKind::Send { .. }) {
                        "send"
                    } else {
                        "receive"
                    };
                    let peer = node.peer.ok_or(TraceReplayError::NoPeer { rank, op: i })?;
                    let target = *index.get(&peer.0).ok_or(TraceReplayError::MissingPeer {
                        rank,
                        op: i,
                        what,
                        peer: peer.0,
                    })?;
                    let same_node = u64::from(rank) / gpus_per_node.max(1)
                        == u64::from(peer.0) / gpus_per_node.max(1);
                    // Receives are matched by tag when their data arrives; only sends
                    // need to know where the data goes.
                    match op.kind {
                        OpKind::Send { .. } => Link::Send { target, same_node },
                        _ => Link::None,
                    }
                }
                _ => Link::None,
            };
            links.push(link);
        }
        let measured = use_measured.then(|| trace.nodes.iter().map(|n| n.duration).collect());
        out.push(Participant {
            graph: &trace.graph,
            rank: RankId(rank),
            class: ClassId(t as u32),
            links,
            measured,
        });
    }
    Ok(out)
}

/// Replays traces on a cluster with the analytical network.
pub fn replay_traces(
    traces: &[ImportedRank],
    groups: &BTreeMap<String, Vec<u32>>,
    cluster: &Cluster,
    use_measured: bool,
) -> Result<(TraceReport, Timeline), TraceReplayError> {
    let parts = participants(traces, groups, cluster.gpus_per_node, use_measured)?;
    let measured_ops = parts
        .iter()
        .filter_map(|p| p.measured.as_ref())
        .map(|m| m.iter().filter(|d| d.is_some()).count())
        .sum();
    let cost = CostModel::for_gpu(&cluster.gpu);
    let net = AnalyticalNetwork::new(fabric_of(cluster), AlgorithmChoice::Auto);
    let timeline = replay_participants(parts, &cost, &net, ReplayMode::AllRanks)?;
    let step = timeline.step_time();
    let mut per_rank = Vec::with_capacity(traces.len());
    for (t, p) in timeline.participants.iter().enumerate() {
        let l = ledger(&traces[t].graph, p).map_err(|source| TraceReplayError::Ledger {
            rank: p.rank.0,
            source,
        })?;
        per_rank.push(RankSummary {
            rank: p.rank.0,
            end: p.end(),
            peak_memory: l.peak,
        });
    }
    let critical = timeline
        .participants
        .iter()
        .enumerate()
        .max_by_key(|(i, p)| (p.end(), std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    let crit = &timeline.participants[critical];
    let report = TraceReport {
        ranks: traces.len(),
        step_time: step,
        critical_rank: crit.rank.0,
        breakdown: breakdown(&traces[critical].graph, crit, step),
        per_rank,
        measured_ops,
        events: timeline.events,
    };
    Ok((report, timeline))
}
