//! Execution graphs collected from a real training program (issue 6, graph collection).
//!
//! `orrery collect` runs the real program with a recording communicator: each recorded rank
//! writes, in issue order, the compute it did between communication calls (with its
//! measured duration), every allocation and free, and every collective and transfer with
//! its group, peer and bytes ([`RankRecord`]). This module stitches such records into the
//! same [`JobGraphs`] the predictor builds from a job spec: one graph per symmetry class
//! (pipeline stage), built from a recorded rank of that class, plus the measured duration of
//! each op ([`Collected::measured`]) for the replay to use instead of the cost model.
//!
//! The records name concrete ranks; the graph names roles and pipeline directions (a class
//! graph never names concrete ranks). Each collective's group is matched to the recording
//! rank's group of some role in the [`Layout`] (the role the program reports if it does,
//! else the first role in [`ROLE_PRIORITY`] whose group has exactly those members), and each
//! transfer's peer to the previous or next pipeline stage. Anything that does not fit the
//! layout is an error naming the rank and the op; every rank of a class that was recorded
//! must have the same sequence of op kinds, groups' roles and sizes as the class's graph
//! (ranks of a class are symmetric; a rank that is not is reported).
//!
//! The real program is blocking: each call returns before the next op is issued, so every
//! op depends on the one before it, and communication runs on its role's stream.
//!
//! What this module does not do: record anything (the training program does), or guess
//! durations (an op without a measured one is left to the cost model, which for collected
//! compute has no shape to read, so recorded compute should always carry its duration).

use crate::build::JobGraphs;
use crate::ir::{
    CollectiveOp, ComputeKind, ExecGraph, GroupRole, MemoryCategory, Op, OpKind, PeerStage, Phase,
    Stream,
};
use crate::layout::Layout;
use orrery_units::{Bytes, ClassId, Flops, OpId, Picos, RankId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use thiserror::Error;

/// Roles tried, in order, for a collective whose record does not say its role: groups of
/// different roles can have the same members (data-parallel with and without context
/// parallelism when `cp` is 1, say), and the first wins.
pub const ROLE_PRIORITY: [GroupRole; 8] = [
    GroupRole::Tp,
    GroupRole::Dp,
    GroupRole::Ep,
    GroupRole::ExpertDp,
    GroupRole::Cp,
    GroupRole::DpCp,
    GroupRole::Embedding,
    GroupRole::World,
];

/// One recorded op of a rank, in issue order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RecordedOp {
    /// Real work between two communication calls, with how long it took and, where the
    /// program measures memory, the bytes it held at the end and its peak during the work.
    Compute {
        name: String,
        phase: Phase,
        duration: Picos,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        memory: Option<MemorySample>,
    },
    /// An allocation; `id` names it for its free.
    Alloc {
        id: u64,
        bytes: Bytes,
        category: MemoryCategory,
    },
    Free {
        id: u64,
    },
    /// A collective over `group` (world ranks; empty with the role `world` for every
    /// rank), with the time the call took.
    Collective {
        op: CollectiveOp,
        group: Vec<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        role: Option<GroupRole>,
        bytes: Bytes,
        duration: Picos,
    },
    Send {
        peer: u32,
        bytes: Bytes,
        tag: u64,
        duration: Picos,
    },
    Recv {
        peer: u32,
        bytes: Bytes,
        tag: u64,
        duration: Picos,
    },
}

impl RecordedOp {
    /// The time a communication op took (a collective, a send or a receive), to read or set;
    /// `None` for compute and memory ops.
    pub fn communication_time_mut(&mut self) -> Option<&mut Picos> {
        match self {
            RecordedOp::Collective { duration, .. }
            | RecordedOp::Send { duration, .. }
            | RecordedOp::Recv { duration, .. } => Some(duration),
            RecordedOp::Compute { .. } | RecordedOp::Alloc { .. } | RecordedOp::Free { .. } => None,
        }
    }
}

/// Memory a rank held around a compute segment: `live` at its end, `peak` during it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySample {
    pub live: Bytes,
    pub peak: Bytes,
}

/// Everything one rank recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    pub rank: u32,
    pub ops: Vec<RecordedOp>,
}

/// The stitched graphs and, per class and op, the measured duration.
#[derive(Debug, Clone)]
pub struct Collected {
    pub graphs: JobGraphs,
    /// Indexed by class, then by op: the measured duration of each compute op (`None`
    /// for the others: a replay times communication with its network model).
    pub measured: Vec<Vec<Option<Picos>>>,
    /// The rank each class's graph was built from.
    pub recorded_from: Vec<RankId>,
}

/// Why records could not be stitched. Every problem is reported ([`StitchErrors`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StitchError {
    #[error("rank {rank} is outside a world of {world}")]
    RankOutOfRange { rank: u32, world: u32 },
    #[error("rank {rank} was recorded twice")]
    Duplicate { rank: u32 },
    #[error("stage {class} has no recorded rank")]
    MissingClass { class: u32 },
    #[error("rank {rank} op {op}: group {group:?} is none of the rank's groups in the layout")]
    UnknownGroup {
        rank: u32,
        op: usize,
        group: Vec<u32>,
    },
    #[error("rank {rank} op {op}: group {group:?} is not the rank's {role} group")]
    WrongRole {
        rank: u32,
        op: usize,
        group: Vec<u32>,
        role: &'static str,
    },
    #[error("rank {rank} op {op}: peer {peer} is not a neighbouring pipeline stage")]
    NotAPeer { rank: u32, op: usize, peer: u32 },
    #[error("rank {rank} op {op}: free of allocation {id}, which is not live")]
    BadFree { rank: u32, op: usize, id: u64 },
    #[error("rank {rank} differs from rank {reference} of its stage at its compute or communication op {op}: {what}")]
    Asymmetric {
        rank: u32,
        reference: u32,
        op: usize,
        what: String,
    },
}

/// Every problem found while stitching.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{} problem(s) stitching the records:\n  {}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
pub struct StitchErrors(pub Vec<StitchError>);

/// What a recorded op becomes, before it is pushed: its graph body, stream and duration.
type Lowered = (OpKind, Stream, Phase, Option<Picos>, String);

/// Stitches records of the ranks of `layout` into class graphs (see the module docs).
pub fn stitch(layout: Layout, records: &[RankRecord]) -> Result<Collected, StitchErrors> {
    let world = layout.world_size();
    let mut problems = Vec::new();
    let mut by_rank: HashMap<u32, &RankRecord> = HashMap::new();
    for r in records {
        if r.rank >= world {
            problems.push(StitchError::RankOutOfRange {
                rank: r.rank,
                world,
            });
        } else if by_rank.insert(r.rank, r).is_some() {
            problems.push(StitchError::Duplicate { rank: r.rank });
        }
    }
    // Each class's graph comes from its representative if it was recorded, else from the
    // lowest recorded rank of the class.
    let mut chosen = Vec::new();
    for c in 0..layout.num_classes() {
        let class = ClassId(c);
        let rep = layout.representative(class);
        let pick = if by_rank.contains_key(&rep.0) {
            Some(rep.0)
        } else {
            let mut of_class: Vec<u32> = by_rank
                .keys()
                .copied()
                .filter(|&r| layout.class_of(RankId(r)) == class)
                .collect();
            of_class.sort_unstable();
            of_class.first().copied()
        };
        match pick {
            Some(r) => chosen.push(r),
            None => problems.push(StitchError::MissingClass { class: c }),
        }
    }
    let mut lowered: HashMap<u32, Vec<Lowered>> = HashMap::new();
    let mut ranks: Vec<u32> = by_rank.keys().copied().collect();
    ranks.sort_unstable();
    for r in ranks {
        match lower(&layout, by_rank[&r]) {
            Ok(ops) => {
                lowered.insert(r, ops);
            }
            Err(mut e) => problems.append(&mut e),
        }
    }
    // Symmetry: every recorded rank of a class lowers to the same ops as the chosen one.
    for (c, &reference) in chosen.iter().enumerate() {
        let Some(want) = lowered.get(&reference) else {
            continue;
        };
        let mut others: Vec<u32> = lowered
            .keys()
            .copied()
            .filter(|&r| r != reference && layout.class_of(RankId(r)) == ClassId(c as u32))
            .collect();
        others.sort_unstable();
        for r in others {
            if let Some(what) = difference(want, &lowered[&r]) {
                problems.push(StitchError::Asymmetric {
                    rank: r,
                    reference,
                    op: what.0,
                    what: what.1,
                });
            }
        }
    }
    if !problems.is_empty() {
        return Err(StitchErrors(problems));
    }
    let mut classes = Vec::new();
    let mut measured = Vec::new();
    for &r in &chosen {
        let mut g = ExecGraph::new();
        let mut durations = Vec::new();
        for (i, (kind, stream, phase, d, name)) in lowered[&r].iter().enumerate() {
            let name = g.intern(name);
            let deps = if i == 0 {
                Vec::new()
            } else {
                vec![OpId::from_index(i - 1)]
            };
            g.push(Op {
                kind: *kind,
                stream: *stream,
                phase: *phase,
                deps,
                name,
                microbatch: None,
            });
            durations.push(*d);
        }
        classes.push(g);
        measured.push(durations);
    }
    Ok(Collected {
        graphs: JobGraphs { layout, classes },
        measured,
        recorded_from: chosen.into_iter().map(RankId).collect(),
    })
}

/// The first difference between two lowered op lists in what ranks of one class must
/// share: their compute and communication, in order (as (index among those ops,
/// description)). Allocations and frees are left out: measured memory differs a little
/// from rank to rank without making the ranks' timelines differ.
fn difference(a: &[Lowered], b: &[Lowered]) -> Option<(usize, String)> {
    let shared = |ops: &[Lowered]| -> Vec<OpKind> {
        ops.iter()
            .map(|o| o.0)
            .filter(|k| !matches!(k, OpKind::Alloc { .. } | OpKind::Free { .. }))
            .collect()
    };
    let (a, b) = (shared(a), shared(b));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if x != y {
            return Some((i, format!("{y:?} against {x:?}")));
        }
    }
    (a.len() != b.len()).then(|| {
        (
            a.len().min(b.len()),
            format!("{} ops against {}", b.len(), a.len()),
        )
    })
}

/// One rank's record as graph ops (frees pointing at their allocation's index).
///
/// Memory samples become allocations and frees of [`MemoryCategory::Activations`] around
/// their compute op: before it, the rank's level rises to the sample's peak; after it, it
/// falls to the sample's live bytes (freeing the newest blocks first, and allocating any
/// remainder), so the ledger sees the peak during the segment and the level after it.
fn lower(layout: &Layout, rec: &RankRecord) -> Result<Vec<Lowered>, Vec<StitchError>> {
    let rank = RankId(rec.rank);
    let mut out: Vec<Lowered> = Vec::with_capacity(rec.ops.len());
    let mut problems = Vec::new();
    // Recorded allocations by id -> index in `out`.
    let mut live: HashMap<u64, usize> = HashMap::new();
    // Blocks standing for sampled memory, newest last: (index in `out`, bytes).
    let mut sampled: Vec<(usize, u64)> = Vec::new();
    let mut level: u64 = 0;
    let alloc = |out: &mut Vec<Lowered>, bytes: u64, category: MemoryCategory| {
        out.push((
            OpKind::Alloc {
                bytes: Bytes(bytes),
                category,
            },
            Stream::Compute,
            Phase::Forward,
            None,
            format!("alloc {}", category.name()),
        ));
        out.len() - 1
    };
    let free = |out: &mut Vec<Lowered>, at: usize| {
        out.push((
            OpKind::Free {
                alloc: OpId::from_index(at),
            },
            Stream::Compute,
            Phase::Forward,
            None,
            "free".to_string(),
        ));
    };
    for (i, op) in rec.ops.iter().enumerate() {
        match op {
            RecordedOp::Compute {
                name,
                phase,
                duration,
                memory,
            } => {
                if let Some(m) = memory {
                    if m.peak.0 > level {
                        let at = alloc(&mut out, m.peak.0 - level, MemoryCategory::Activations);
                        sampled.push((at, m.peak.0 - level));
                        level = m.peak.0;
                    }
                }
                out.push((
                    OpKind::Compute {
                        kind: ComputeKind::MemoryBound,
                        flops: Flops(0.0),
                        bytes: Bytes(0),
                    },
                    Stream::Compute,
                    *phase,
                    Some(*duration),
                    name.clone(),
                ));
                if let Some(m) = memory {
                    while level > m.live.0 {
                        let Some((at, bytes)) = sampled.pop() else {
                            break;
                        };
                        free(&mut out, at);
                        level -= bytes;
                    }
                    if m.live.0 > level {
                        let at = alloc(&mut out, m.live.0 - level, MemoryCategory::Activations);
                        sampled.push((at, m.live.0 - level));
                        level = m.live.0;
                    }
                }
            }
            RecordedOp::Alloc {
                id,
                bytes,
                category,
            } => {
                let at = alloc(&mut out, bytes.0, *category);
                live.insert(*id, at);
            }
            RecordedOp::Free { id } => match live.remove(id) {
                Some(at) => free(&mut out, at),
                None => problems.push(StitchError::BadFree {
                    rank: rec.rank,
                    op: i,
                    id: *id,
                }),
            },
            RecordedOp::Collective {
                op: cop,
                group,
                role,
                bytes,
                ..
            } => match resolve_role(layout, rank, group, *role) {
                Ok(role) => out.push((
                    OpKind::Collective {
                        op: *cop,
                        group: role,
                        bytes: *bytes,
                    },
                    role.stream(),
                    Phase::Backward,
                    None,
                    format!("{} {:?}", role.name(), cop).to_lowercase(),
                )),
                Err(e) => problems.push(e(rec.rank, i)),
            },
            RecordedOp::Send {
                peer, bytes, tag, ..
            }
            | RecordedOp::Recv {
                peer, bytes, tag, ..
            } => {
                // With two stages both directions reach the same rank: a send is taken as
                // going to the next stage and a receive as coming from the previous one
                // (the replay resolves either to the same rank).
                let send = matches!(op, RecordedOp::Send { .. });
                let order = if send {
                    [PeerStage::Next, PeerStage::Prev]
                } else {
                    [PeerStage::Prev, PeerStage::Next]
                };
                match order.into_iter().find(|&d| layout.peer(rank, d).0 == *peer) {
                    Some(peer) => {
                        let kind = if send {
                            OpKind::Send {
                                peer,
                                bytes: *bytes,
                                tag: *tag,
                            }
                        } else {
                            OpKind::Recv {
                                peer,
                                bytes: *bytes,
                                tag: *tag,
                            }
                        };
                        out.push((
                            kind,
                            Stream::PpComm,
                            Phase::Forward,
                            None,
                            if send { "send" } else { "recv" }.to_string(),
                        ));
                    }
                    None => problems.push(StitchError::NotAPeer {
                        rank: rec.rank,
                        op: i,
                        peer: *peer,
                    }),
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

type RoleError = Box<dyn Fn(u32, usize) -> StitchError>;

/// The role of `rank`'s group with exactly `group`'s members: `hint` if given (checked),
/// else the first of [`ROLE_PRIORITY`] that fits.
fn resolve_role(
    layout: &Layout,
    rank: RankId,
    group: &[u32],
    hint: Option<GroupRole>,
) -> Result<GroupRole, RoleError> {
    let mut want: Vec<u32> = group.to_vec();
    want.sort_unstable();
    let fits = |role: GroupRole| {
        let mut have: Vec<u32> = layout
            .group_members(rank, role)
            .iter()
            .map(|r| r.0)
            .collect();
        have.sort_unstable();
        have == want
    };
    match hint {
        // Every rank, recorded without listing them.
        Some(GroupRole::World) if want.is_empty() => Ok(GroupRole::World),
        Some(role) if fits(role) => Ok(role),
        Some(role) => Err(Box::new(move |rank, op| StitchError::WrongRole {
            rank,
            op,
            group: want.clone(),
            role: role.name(),
        })),
        None => ROLE_PRIORITY
            .iter()
            .copied()
            .find(|&r| fits(r))
            .ok_or_else(|| {
                Box::new(move |rank, op| StitchError::UnknownGroup {
                    rank,
                    op,
                    group: want.clone(),
                }) as RoleError
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compute(ms: u64) -> RecordedOp {
        RecordedOp::Compute {
            name: "fwd".into(),
            phase: Phase::Forward,
            duration: Picos::from_micros(1000 * ms),
            memory: None,
        }
    }

    /// A rank of a TP 2 x PP 2 layout: compute, TP all-reduce, a send or a receive, a
    /// temporary buffer.
    fn record(layout: &Layout, rank: u32) -> RankRecord {
        let c = layout.coords(RankId(rank));
        let tp: Vec<u32> = layout
            .group_members(RankId(rank), GroupRole::Tp)
            .iter()
            .map(|r| r.0)
            .collect();
        let peer = if c.pp == 0 {
            RecordedOp::Send {
                peer: layout.peer(RankId(rank), PeerStage::Next).0,
                bytes: Bytes(64),
                tag: 7,
                duration: Picos(5),
            }
        } else {
            RecordedOp::Recv {
                peer: layout.peer(RankId(rank), PeerStage::Prev).0,
                bytes: Bytes(64),
                tag: 7,
                duration: Picos(5),
            }
        };
        RankRecord {
            rank,
            ops: vec![
                RecordedOp::Alloc {
                    id: 1,
                    bytes: Bytes(1024),
                    category: MemoryCategory::Activations,
                },
                compute(3),
                RecordedOp::Collective {
                    op: CollectiveOp::AllReduce,
                    group: tp,
                    role: None,
                    bytes: Bytes(256),
                    duration: Picos(9),
                },
                peer,
                RecordedOp::Free { id: 1 },
            ],
        }
    }

    #[test]
    fn records_become_class_graphs_with_roles_peers_and_durations() {
        let layout = Layout::from_dims(2, 1, 1, 2, 1, 4);
        let records: Vec<RankRecord> = (0..4).map(|r| record(&layout, r)).collect();
        let c = stitch(layout, &records).unwrap();
        assert_eq!(c.graphs.classes.len(), 2);
        assert_eq!(c.recorded_from, vec![RankId(0), RankId(2)]);
        let g0 = &c.graphs.classes[0];
        g0.check().unwrap();
        assert!(matches!(
            g0.ops()[2].kind,
            OpKind::Collective {
                group: GroupRole::Tp,
                ..
            }
        ));
        assert_eq!(g0.ops()[2].stream, Stream::TpComm);
        assert!(matches!(
            g0.ops()[3].kind,
            OpKind::Send {
                peer: PeerStage::Next,
                tag: 7,
                ..
            }
        ));
        assert!(matches!(
            c.graphs.classes[1].ops()[3].kind,
            OpKind::Recv {
                peer: PeerStage::Prev,
                ..
            }
        ));
        assert!(matches!(g0.ops()[4].kind, OpKind::Free { alloc } if alloc.index() == 0));
        assert_eq!(c.measured[0][1], Some(Picos::from_micros(1000 * 3)));
        assert_eq!(c.measured[0][2], None);
        // Issue order is a dependency chain.
        assert_eq!(g0.ops()[3].deps, vec![OpId::from_index(2)]);
    }

    #[test]
    fn every_problem_is_reported() {
        let layout = Layout::from_dims(2, 1, 1, 2, 1, 4);
        let mut bad_group = record(&layout, 0);
        if let RecordedOp::Collective { group, .. } = &mut bad_group.ops[2] {
            *group = vec![0, 3];
        }
        bad_group.ops.push(RecordedOp::Free { id: 9 });
        let mut odd = record(&layout, 1);
        odd.ops.push(compute(1));
        let outside = RankRecord {
            rank: 9,
            ops: vec![compute(1)],
        };
        let records = vec![bad_group, odd, record(&layout, 1), outside];
        let e = stitch(layout, &records).unwrap_err();
        let text = e.to_string();
        for needle in [
            "rank 9 is outside a world of 4",
            "rank 1 was recorded twice",
            "stage 1 has no recorded rank",
            "rank 0 op 2: group [0, 3] is none of the rank's groups",
            "rank 0 op 5: free of allocation 9",
        ] {
            assert!(text.contains(needle), "{needle} not in {text}");
        }
    }

    #[test]
    fn asymmetric_ranks_and_wrong_role_hints_are_reported() {
        let layout = Layout::from_dims(2, 1, 1, 2, 1, 4);
        let mut records: Vec<RankRecord> = (0..4).map(|r| record(&layout, r)).collect();
        records[1].ops.push(compute(1));
        if let RecordedOp::Collective { role, .. } = &mut records[3].ops[2] {
            *role = Some(GroupRole::Dp);
        }
        let text = stitch(layout, &records).unwrap_err().to_string();
        assert!(
            text.contains(
                "rank 1 differs from rank 0 of its stage at its compute or communication op 3"
            ),
            "{text}"
        );
        assert!(
            text.contains("rank 3 op 2: group [2, 3] is not the rank's dp group"),
            "{text}"
        );
    }

    #[test]
    fn memory_samples_become_the_peak_during_a_segment_and_the_level_after_it() {
        let layout = Layout::from_dims(1, 1, 1, 1, 1, 1);
        let seg = |live: u64, peak: u64| RecordedOp::Compute {
            name: "s".into(),
            phase: Phase::Forward,
            duration: Picos(10),
            memory: Some(MemorySample {
                live: Bytes(live),
                peak: Bytes(peak),
            }),
        };
        let rec = RankRecord {
            rank: 0,
            ops: vec![seg(100, 150), seg(40, 120), seg(90, 90)],
        };
        let c = stitch(layout, &[rec]).unwrap();
        let g = &c.graphs.classes[0];
        g.check().unwrap();
        // Replay the level op by op (allocs and frees in issue order).
        let mut level: i64 = 0;
        let mut levels = Vec::new();
        for op in g.ops() {
            match op.kind {
                OpKind::Alloc { bytes, .. } => level += bytes.0 as i64,
                OpKind::Free { alloc } => {
                    if let OpKind::Alloc { bytes, .. } = g.op(alloc).kind {
                        level -= bytes.0 as i64;
                    }
                }
                OpKind::Compute { .. } => levels.push(level),
                _ => {}
            }
        }
        // During each segment the level is its peak; the final level is the last live.
        assert_eq!(levels, vec![150, 120, 90]);
        assert_eq!(level, 90);
    }

    #[test]
    fn records_round_trip_through_json() {
        let layout = Layout::from_dims(2, 1, 1, 2, 1, 4);
        let r = record(&layout, 2);
        let text = serde_json::to_string(&r).unwrap();
        let back: RankRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
    }
}
