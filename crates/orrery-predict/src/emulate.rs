//! Hybrid emulation's engine: a few live ranks among virtual ones (issue 6, part 3).
//!
//! In hybrid emulation some ranks run as the real training program and every other rank is
//! replayed from its execution graph. This module is the replay side of that contract: an
//! [`Emulation`] is the replay engine with some participants *live*. A live participant's
//! compute ops do not take the cost model's duration: when one starts, the emulation stops
//! and hands it to the caller ([`EmulationStep::Compute`]), which runs the real work,
//! measures it and supplies the duration ([`Emulation::supply`]). Its collectives, sends
//! and receives are simulated like everyone else's, so the real rank is released from a
//! collective exactly when the virtual members would have delivered. Nothing later than a
//! waiting op runs before its duration is known, and its completion keeps the place among
//! equal times that its start reserved, so supplying the cost model's own durations
//! reproduces the plain replay op for op (tested).
//!
//! ## Who is replayed one by one ([`Pruning`])
//!
//! - [`Pruning::None`]: every rank is its own participant (the all-rank replay, with the
//!   live ranks live). Exact, and its cost grows with the world size.
//! - [`Pruning::Classes`]: only the *materialized* ranks (the live ones and those a
//!   perturbation names) are participants of their own. Every other rank is stood for by
//!   its symmetry class's *shared* participant, which replays the class once, unperturbed,
//!   as the predictor's class mode does. The cost grows with the number of materialized
//!   ranks and classes, not with the world size.
//!
//!   Shared participants never wait for materialized ones: they are the virtual world as
//!   it would run without them. A materialized rank's collective waits for its materialized
//!   members and for the *arrival* of the shared participants standing for its other
//!   members (their `k`-th collective of the same role), and a materialized rank's
//!   receive from a virtual peer completes when the peer's class sends. The approximation:
//!   a virtual rank that shares a group with a slow materialized rank would itself be held
//!   back by it, and through it the ranks it meets later; pruning ignores that second-hand
//!   effect (the materialized ranks still wait for the slow one). Without perturbations the
//!   materialized ranks' timelines equal the all-rank replay's exactly (tested).
//!
//!   Shared participants stand for one *column* of the pipeline (the same tensor, context
//!   and data-parallel coordinates on every stage) that holds no materialized rank, so that
//!   their groups and pipeline peers line up as in class mode. If every column holds a
//!   materialized rank the emulation is not pruned.
//!
//! ## Perturbations ([`Perturbations`])
//!
//! - [`SlowRanks`]: compute of the named ranks takes `factor` times as long in a window of
//!   simulated time (a straggler, thermal throttling). For a live rank the measured
//!   durations are scaled.
//! - [`DegradedLink`]: every collective whose group contains the named rank and every
//!   send from it takes `factor` times as long (its network link is slower).
//!
//! What this module deliberately does not do: run the real program, measure anything or
//! synthesise tensors. That is the emulated communicator's job, on top of this API.

use crate::cost::CostModel;
use crate::replay::{
    job_participants, Engine, Link, Participant, ReplayError, ReplayMode, SlowWindow, Timeline,
};
use orrery_graph::collect::Collected;
use orrery_graph::{JobGraphs, Op, OpKind};
use orrery_net::{GroupPlacement, NetworkModel};
use orrery_units::{Bytes, ClassId, Picos, RankId};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};

/// Which virtual ranks are replayed one by one (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pruning {
    /// Every rank is its own participant.
    None,
    /// Materialized ranks are their own participants; every other rank shares its class's.
    Classes,
}

/// Ranks whose compute is slower in a window of simulated time.
#[derive(Debug, Clone, PartialEq)]
pub struct SlowRanks {
    pub ranks: Vec<RankId>,
    /// Compute takes this many times as long (greater than zero).
    pub factor: f64,
    pub from: Picos,
    /// End of the window (exclusive); `None` for the rest of the step.
    pub until: Option<Picos>,
}

/// A rank whose network link is slower: its collectives and sends take `factor` times as
/// long.
#[derive(Debug, Clone, PartialEq)]
pub struct DegradedLink {
    pub rank: RankId,
    pub factor: f64,
}

/// What to perturb in an emulation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Perturbations {
    pub slow: Vec<SlowRanks>,
    pub links: Vec<DegradedLink>,
}

/// Why an emulation could not be set up or go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EmulateError {
    #[error("{field}: rank {rank} is outside a world of {world}")]
    RankOutOfRange {
        field: &'static str,
        rank: u32,
        world: u32,
    },
    #[error("{field}: factor {factor} must be finite and greater than zero")]
    BadFactor { field: &'static str, factor: f64 },
    #[error("{field}: the window ends ({until} ps) before it starts ({from} ps)")]
    BadWindow {
        field: &'static str,
        from: u64,
        until: u64,
    },
    #[error("real ranks: none given")]
    NoLiveRank,
    #[error("{} problems: {}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Many(Vec<EmulateError>),
    #[error("op {op} of participant {participant} is not waiting for a duration")]
    NotWaiting { participant: u32, op: u32 },
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// What the emulation needs from its caller next.
#[derive(Debug, Clone)]
pub enum EmulationStep {
    /// Live participant `participant` (rank `rank`) started compute op `op` at `start`:
    /// run it for real and [`Emulation::supply`] its duration. `modelled` is what the
    /// cost model would give it (with the communication running beside it), for the
    /// comparison with the prediction.
    Compute {
        participant: u32,
        rank: RankId,
        op: u32,
        start: Picos,
        modelled: Picos,
    },
    /// Every op of every participant has run.
    Done(Timeline),
}

/// Who each participant of an emulation is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParticipantInfo {
    /// The rank it replays (a shared participant's representative).
    pub rank: RankId,
    pub class: ClassId,
    pub live: bool,
    /// How many ranks it stands for (1 unless shared).
    pub stands_for: u32,
}

/// A replay with live participants (see the module docs).
pub struct Emulation<'a, N: NetworkModel> {
    engine: Engine<'a, N>,
    info: Vec<ParticipantInfo>,
    pruned: bool,
    seeded: bool,
}

impl<N: NetworkModel> std::fmt::Debug for Emulation<'_, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulation")
            .field("participants", &self.info.len())
            .finish()
    }
}

impl<'a, N: NetworkModel> Emulation<'a, N> {
    /// Sets up the emulation of `graphs` with `live` ranks, replayed per `pruning`, under
    /// `perturb`. Every problem with the input is reported at once.
    pub fn new(
        graphs: &'a JobGraphs,
        cost: &'a CostModel,
        net: &'a N,
        live: &[RankId],
        pruning: Pruning,
        perturb: &Perturbations,
    ) -> Result<Emulation<'a, N>, EmulateError> {
        Self::build(graphs, None, cost, net, live, pruning, perturb)
    }

    /// [`Emulation::new`] on graphs collected from the real program
    /// ([`orrery_graph::collect`]): virtual ranks take the recorded durations.
    pub fn collected(
        collected: &'a Collected,
        cost: &'a CostModel,
        net: &'a N,
        live: &[RankId],
        pruning: Pruning,
        perturb: &Perturbations,
    ) -> Result<Emulation<'a, N>, EmulateError> {
        Self::build(
            &collected.graphs,
            Some(&collected.measured),
            cost,
            net,
            live,
            pruning,
            perturb,
        )
    }

    fn build(
        graphs: &'a JobGraphs,
        measured: Option<&[Vec<Option<Picos>>]>,
        cost: &'a CostModel,
        net: &'a N,
        live: &[RankId],
        pruning: Pruning,
        perturb: &Perturbations,
    ) -> Result<Emulation<'a, N>, EmulateError> {
        check_inputs(graphs, live, perturb)?;
        for (c, g) in graphs.classes.iter().enumerate() {
            g.check().map_err(|source| ReplayError::Graph {
                class: c as u32,
                source,
            })?;
        }
        let mut materialized: BTreeSet<u32> = live.iter().map(|r| r.0).collect();
        for s in &perturb.slow {
            materialized.extend(s.ranks.iter().map(|r| r.0));
        }
        materialized.extend(perturb.links.iter().map(|l| l.rank.0));
        let plan = match pruning {
            Pruning::Classes => pruned_plan(graphs, &materialized),
            Pruning::None => None,
        };
        let pruned = plan.is_some();
        let (mut participants, info, hybrid) = match plan {
            Some(plan) => build_pruned(graphs, &plan, live),
            None => build_unpruned(graphs, live),
        };
        if let Some(m) = measured {
            for p in &mut participants {
                p.measured = m.get(p.class.index()).cloned();
            }
        }
        let mut engine = Engine::new(participants, cost, net, ReplayMode::AllRanks);
        engine.hybrid = hybrid;
        let of_rank: HashMap<u32, u32> = info
            .iter()
            .enumerate()
            .filter(|(_, i)| i.stands_for == 1)
            .map(|(p, i)| (i.rank.0, p as u32))
            .collect();
        for s in &perturb.slow {
            for r in &s.ranks {
                if let Some(&p) = of_rank.get(&r.0) {
                    engine.hybrid.slow.entry(p).or_default().push(SlowWindow {
                        from: s.from,
                        until: s.until,
                        factor: s.factor,
                    });
                }
            }
        }
        for l in &perturb.links {
            if let Some(&p) = of_rank.get(&l.rank.0) {
                degrade(&mut engine, graphs, &info, p, l.factor);
            }
        }
        for (p, i) in info.iter().enumerate() {
            if i.live {
                engine.set_live(p as u32);
            }
        }
        Ok(Emulation {
            engine,
            info,
            pruned,
            seeded: false,
        })
    }

    /// The participants, by index.
    pub fn participants(&self) -> &[ParticipantInfo] {
        &self.info
    }

    /// Whether virtual ranks share class timelines ([`Pruning::Classes`] asked for and a
    /// pipeline column free of materialized ranks found).
    pub fn pruned(&self) -> bool {
        self.pruned
    }

    /// Runs the virtual ranks until a live rank's compute op needs its duration, or to
    /// the end of the step. While ops wait, the earliest (by start, then by issue) is
    /// returned, again and again until it is supplied: nothing runs before every waiting op
    /// has its duration.
    pub fn advance(&mut self) -> Result<EmulationStep, EmulateError> {
        if !self.seeded {
            self.seeded = true;
            self.engine.seed();
        }
        if self.engine.parked.is_empty() {
            self.engine.pump()?;
        }
        let waiting = self
            .engine
            .parked
            .iter()
            .map(|&(p, op, seq, modelled)| (self.engine.start_of(p, op), seq, p, op, modelled))
            .min();
        match waiting {
            Some((start, _, participant, op, modelled)) => Ok(EmulationStep::Compute {
                participant,
                rank: self.info[participant as usize].rank,
                op,
                start,
                modelled,
            }),
            None => Ok(EmulationStep::Done(self.engine.finish()?)),
        }
    }

    /// The op a [`EmulationStep::Compute`] named, for the caller to run.
    pub fn op(&self, participant: u32, op: u32) -> Option<&Op> {
        self.engine.op_of(participant, op).map(|(_, o)| o)
    }

    /// The measured duration of a waiting compute op (scaled by any slowdown of its rank).
    pub fn supply(
        &mut self,
        participant: u32,
        op: u32,
        measured: Picos,
    ) -> Result<(), EmulateError> {
        let waiting = self
            .engine
            .parked
            .iter()
            .any(|&(p, o, _, _)| p == participant && o == op);
        if !waiting {
            return Err(EmulateError::NotWaiting { participant, op });
        }
        let start = self.engine.start_of(participant, op);
        let d = self.engine.slowed(participant, start, measured);
        self.engine.unpark(participant, op, start + d);
        Ok(())
    }

    /// Runs the emulation to the end, asking `measure` for each live compute op's
    /// duration (given the rank, the op and the modelled duration).
    pub fn run_with(
        mut self,
        mut measure: impl FnMut(RankId, &Op, Picos) -> Picos,
    ) -> Result<Timeline, EmulateError> {
        loop {
            match self.advance()? {
                EmulationStep::Done(t) => return Ok(t),
                EmulationStep::Compute {
                    participant,
                    rank,
                    op,
                    modelled,
                    ..
                } => {
                    let d = match self.op(participant, op) {
                        Some(o) => measure(rank, o, modelled),
                        None => return Err(EmulateError::NotWaiting { participant, op }),
                    };
                    self.supply(participant, op, d)?;
                }
            }
        }
    }
}

fn check_inputs(
    graphs: &JobGraphs,
    live: &[RankId],
    perturb: &Perturbations,
) -> Result<(), EmulateError> {
    let world = graphs.layout.world_size();
    let mut problems = Vec::new();
    if live.is_empty() {
        problems.push(EmulateError::NoLiveRank);
    }
    let rank = |field: &'static str, r: RankId, problems: &mut Vec<EmulateError>| {
        if r.0 >= world {
            problems.push(EmulateError::RankOutOfRange {
                field,
                rank: r.0,
                world,
            });
        }
    };
    for &r in live {
        rank("real ranks", r, &mut problems);
    }
    let factor = |field: &'static str, f: f64, problems: &mut Vec<EmulateError>| {
        if !(f.is_finite() && f > 0.0) {
            problems.push(EmulateError::BadFactor { field, factor: f });
        }
    };
    for s in &perturb.slow {
        for &r in &s.ranks {
            rank("slow.ranks", r, &mut problems);
        }
        factor("slow.factor", s.factor, &mut problems);
        if let Some(u) = s.until.filter(|u| *u < s.from) {
            problems.push(EmulateError::BadWindow {
                field: "slow.until",
                from: s.from.0,
                until: u.0,
            });
        }
    }
    for l in &perturb.links {
        rank("links.rank", l.rank, &mut problems);
        factor("links.factor", l.factor, &mut problems);
    }
    match problems.len() {
        0 => Ok(()),
        1 => Err(problems.remove(0)),
        _ => Err(EmulateError::Many(problems)),
    }
}

/// Which ranks a pruned emulation replays one by one, and the column its shared
/// participants stand for.
struct PrunedPlan {
    materialized: Vec<u32>,
    /// Shared participant representative of each class.
    representative: Vec<RankId>,
}

/// The plan, or `None` if every pipeline column holds a materialized rank.
fn pruned_plan(graphs: &JobGraphs, materialized: &BTreeSet<u32>) -> Option<PrunedPlan> {
    let layout = &graphs.layout;
    let classes = layout.num_classes();
    // Columns in rank order of their stage-0 rank; a column is free when none of its
    // stages' ranks is materialized.
    let column = (0..layout.world_size()).map(RankId).find(|&r| {
        layout.class_of(r) == ClassId(0)
            && (0..classes).all(|c| {
                let mut k = layout.coords(r);
                k.pp = c;
                !materialized.contains(&layout.rank(k).0)
            })
    })?;
    let representative = (0..classes)
        .map(|c| {
            let mut k = layout.coords(column);
            k.pp = c;
            layout.rank(k)
        })
        .collect();
    Some(PrunedPlan {
        materialized: materialized.iter().copied().collect(),
        representative,
    })
}

type Built<'g> = (
    Vec<Participant<'g>>,
    Vec<ParticipantInfo>,
    crate::replay::Hybrid,
);

/// Every rank its own participant (all-rank replay links), live ranks marked.
fn build_unpruned<'g>(graphs: &'g JobGraphs, live: &[RankId]) -> Built<'g> {
    let participants = job_participants(graphs, ReplayMode::AllRanks);
    let info = participants
        .iter()
        .map(|p| ParticipantInfo {
            rank: p.rank,
            class: p.class,
            live: live.contains(&p.rank),
            stands_for: 1,
        })
        .collect();
    (participants, info, crate::replay::Hybrid::default())
}

/// Materialized ranks first (in rank order), then one shared participant per class.
fn build_pruned<'g>(graphs: &'g JobGraphs, plan: &PrunedPlan, live: &[RankId]) -> Built<'g> {
    let layout = &graphs.layout;
    let world = layout.world_size();
    let m = plan.materialized.len() as u32;
    let mut of_rank: HashMap<u32, u32> = HashMap::new();
    for (i, &r) in plan.materialized.iter().enumerate() {
        of_rank.insert(r, i as u32);
    }
    let shared_of = |class: ClassId| m + class.0;
    let participant_of = |r: RankId| -> u32 {
        of_rank
            .get(&r.0)
            .copied()
            .unwrap_or_else(|| shared_of(layout.class_of(r)))
    };
    let mut class_sizes = vec![0u32; layout.num_classes() as usize];
    for r in 0..world {
        if !of_rank.contains_key(&r) {
            class_sizes[layout.class_of(RankId(r)).index()] += 1;
        }
    }
    let mut hybrid = crate::replay::Hybrid::default();
    let mut participants = Vec::new();
    let mut info = Vec::new();
    let ranks: Vec<(RankId, bool)> = plan
        .materialized
        .iter()
        .map(|&r| (RankId(r), true))
        .chain(plan.representative.iter().map(|&r| (r, false)))
        .collect();
    for (p, &(rank, materialized)) in ranks.iter().enumerate() {
        let p = p as u32;
        let class = layout.class_of(rank);
        let graph = graphs.class(class);
        // The k-th collective of each role, counted along the graph.
        let mut seq_on_role: HashMap<u8, u32> = HashMap::new();
        let mut links = Vec::with_capacity(graph.len());
        for (op_index, op) in graph.ops().iter().enumerate() {
            let op_index = op_index as u32;
            let link = match op.kind {
                OpKind::Send { peer, .. } => {
                    let q = layout.peer(rank, peer);
                    let target = participant_of(q);
                    // Shared participants wait for no materialized one: a materialized
                    // rank's data for a virtual peer is delivered to nobody.
                    let target = if materialized && target >= m {
                        u32::MAX
                    } else {
                        target
                    };
                    Link::Send {
                        target,
                        same_node: layout.same_node(rank, q),
                    }
                }
                OpKind::Collective { group, .. } => {
                    let role = group.index() as u8;
                    let seq = seq_on_role.entry(role).or_insert(0);
                    let k = *seq;
                    *seq += 1;
                    let members = layout.group_members(rank, group);
                    let pl = layout.placement(rank, group);
                    let placement = GroupPlacement {
                        size: pl.size,
                        nodes: pl.nodes,
                        max_per_node: pl.max_per_node,
                    };
                    let gid = layout.group_id(rank, group);
                    if materialized {
                        let mut mat: Vec<u32> = members
                            .iter()
                            .filter_map(|r| of_rank.get(&r.0).copied())
                            .collect();
                        mat.sort_unstable();
                        mat.dedup();
                        let mut shared: Vec<u32> = members
                            .iter()
                            .filter(|r| !of_rank.contains_key(&r.0))
                            .map(|&r| shared_of(layout.class_of(r)))
                            .collect();
                        shared.sort_unstable();
                        shared.dedup();
                        if !shared.is_empty() {
                            let watch: Vec<crate::replay::Arrival> =
                                shared.iter().map(|&s| (s, role, k)).collect();
                            for &(s, role, k) in &watch {
                                if let Some(sop) =
                                    nth_collective(graphs, layout, s, m, plan, role, k)
                                {
                                    hybrid.observe.insert((s, sop), (role, k));
                                }
                            }
                            hybrid.watch.insert((p, op_index), watch);
                        }
                        Link::Collective {
                            rendezvous: Some((gid.0, k)),
                            members: mat.len() as u32,
                            placement,
                        }
                    } else {
                        let mut shared: Vec<u32> = members
                            .iter()
                            .filter(|r| !of_rank.contains_key(&r.0))
                            .map(|&r| shared_of(layout.class_of(r)))
                            .collect();
                        shared.sort_unstable();
                        shared.dedup();
                        if shared.len() <= 1 {
                            Link::Collective {
                                rendezvous: None,
                                members: 1,
                                placement,
                            }
                        } else {
                            // Offset so that it never meets a materialized rendezvous of
                            // the same group (shared ones do not wait for those).
                            Link::Collective {
                                rendezvous: Some((gid.0, k | 1 << 31)),
                                members: shared.len() as u32,
                                placement,
                            }
                        }
                    }
                }
                OpKind::Recv { peer, tag, .. } if materialized => {
                    let q = layout.peer(rank, peer);
                    let source = participant_of(q);
                    if source >= m {
                        // A virtual peer: its class's send delivers here too.
                        if let Some(sop) = send_with_tag(graphs, layout, plan, source - m, tag) {
                            hybrid
                                .extra_targets
                                .entry((source, sop))
                                .or_default()
                                .push(p);
                        }
                    }
                    Link::None
                }
                _ => Link::None,
            };
            links.push(link);
        }
        participants.push(Participant {
            graph,
            rank,
            class,
            links,
            measured: None,
        });
        info.push(ParticipantInfo {
            rank,
            class,
            live: materialized && live.contains(&rank),
            stands_for: if materialized {
                1
            } else {
                class_sizes[class.index()]
            },
        });
    }
    (participants, info, hybrid)
}

/// The op index of the `k`-th collective of `role` in shared participant `s`'s graph.
fn nth_collective(
    graphs: &JobGraphs,
    layout: &orrery_graph::Layout,
    s: u32,
    m: u32,
    plan: &PrunedPlan,
    role: u8,
    k: u32,
) -> Option<u32> {
    let rep = *plan.representative.get((s - m) as usize)?;
    let graph = graphs.class(layout.class_of(rep));
    graph
        .ops()
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o.kind, OpKind::Collective { group, .. } if group.index() as u8 == role))
        .nth(k as usize)
        .map(|(i, _)| i as u32)
}

/// The op index of class `class`'s send with `tag`.
fn send_with_tag(
    graphs: &JobGraphs,
    layout: &orrery_graph::Layout,
    plan: &PrunedPlan,
    class: u32,
    tag: u64,
) -> Option<u32> {
    let rep = *plan.representative.get(class as usize)?;
    graphs
        .class(layout.class_of(rep))
        .ops()
        .iter()
        .position(|o| matches!(o.kind, OpKind::Send { tag: t, .. } if t == tag))
        .map(|i| i as u32)
}

/// Every collective of participant `p` whose group holds a rank of `p`, and every send of
/// `p`, takes `factor` times as long; so does every collective of another materialized
/// participant whose group holds `p`'s rank.
fn degrade<N: NetworkModel>(
    engine: &mut Engine<'_, N>,
    graphs: &JobGraphs,
    info: &[ParticipantInfo],
    p: u32,
    factor: f64,
) {
    let layout = &graphs.layout;
    let rank = info[p as usize].rank;
    for (q, i) in info.iter().enumerate() {
        if i.stands_for != 1 {
            continue;
        }
        let graph = graphs.class(i.class);
        for (op, o) in graph.ops().iter().enumerate() {
            let hit = match o.kind {
                OpKind::Collective { group, .. } => {
                    layout.group_members(i.rank, group).contains(&rank)
                }
                OpKind::Send { .. } => q as u32 == p,
                _ => false,
            };
            if hit {
                engine
                    .hybrid
                    .net_scale
                    .insert((q as u32, op as u32), factor);
            }
        }
    }
}

/// One materialized rank of an emulated step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankReport {
    pub rank: u32,
    pub stage: u32,
    /// A live (real) rank, rather than a virtual one materialized for a perturbation.
    pub real: bool,
    /// When its last op ended.
    pub end: Picos,
    /// Time its compute ops took, in all.
    pub compute: Picos,
    /// The cost model's time for the same compute ops (what the prediction assumes).
    pub modelled_compute: Picos,
    pub peak_memory: Bytes,
}

/// One shared participant (a class of virtual ranks) of an emulated step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SharedReport {
    pub stage: u32,
    pub representative: u32,
    /// Virtual ranks it stands for.
    pub ranks: u32,
    pub end: Picos,
    pub peak_memory: Bytes,
}

/// An emulated step, next to the prediction for the same job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmulationReport {
    pub world_size: u32,
    /// Whether virtual ranks shared class timelines (see [`Pruning`]).
    pub pruned: bool,
    pub participants: usize,
    /// The emulated step: when the last op of any participant ended.
    pub step_time: Picos,
    /// `orrery predict`'s step time for the same job, unperturbed.
    pub predicted_step_time: Picos,
    pub ranks: Vec<RankReport>,
    pub shared: Vec<SharedReport>,
    pub warnings: Vec<String>,
}

/// Reads an emulated timeline back per participant. `modelled` holds the cost model's
/// duration of each live compute op, keyed by (participant, op), as
/// [`EmulationStep::Compute`] gave it.
pub fn report(
    graphs: &JobGraphs,
    info: &[ParticipantInfo],
    pruned: bool,
    timeline: &Timeline,
    modelled: &HashMap<(u32, u32), Picos>,
    predicted_step_time: Picos,
    perturbed: bool,
) -> Result<EmulationReport, crate::memory::LedgerError> {
    let mut ranks = Vec::new();
    let mut shared = Vec::new();
    for (p, (i, t)) in info.iter().zip(&timeline.participants).enumerate() {
        let graph = graphs.class(i.class);
        let ledger = crate::memory::ledger(graph, t)?;
        let stage = graphs.layout.coords(i.rank).pp;
        if i.stands_for == 1 {
            let mut compute = 0u64;
            let mut model = 0u64;
            for (k, (op, timing)) in graph.ops().iter().zip(&t.ops).enumerate() {
                if matches!(op.kind, OpKind::Compute { .. }) {
                    let took = timing.end.0 - timing.start.0;
                    compute += took;
                    model += modelled.get(&(p as u32, k as u32)).map_or(took, |d| d.0);
                }
            }
            ranks.push(RankReport {
                rank: i.rank.0,
                stage,
                real: i.live,
                end: t.end(),
                compute: Picos(compute),
                modelled_compute: Picos(model),
                peak_memory: ledger.peak,
            });
        } else {
            shared.push(SharedReport {
                stage,
                representative: i.rank.0,
                ranks: i.stands_for,
                end: t.end(),
                peak_memory: ledger.peak,
            });
        }
    }
    Ok(EmulationReport {
        world_size: graphs.layout.world_size(),
        pruned,
        participants: info.len(),
        step_time: timeline.step_time(),
        predicted_step_time,
        ranks,
        shared,
        warnings: if pruned && perturbed {
            vec!["pruned: a perturbation reaches the tracked ranks that share a group with the perturbed ones, but not the virtual ranks behind them (the shared timelines run unperturbed); --no-prune for its full effect".to_string()]
        } else {
            Vec::new()
        },
    })
}
