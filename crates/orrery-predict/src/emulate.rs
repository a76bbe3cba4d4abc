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
//!   live ranks live). Its cost grows with the world size.
//! - [`Pruning::Classes`]: one participant per *timeline class*: a set of ranks that
//!   provably run identical timelines. The live ranks and every rank a perturbation names
//!   are singled out (each is a class of its own). Then the classes are refined until
//!   stable (colour refinement, as in graph isomorphism testing): two ranks stay together
//!   only if they are in the same class and, for every role, their groups have the same
//!   placement and the same multiset of member classes, and their pipeline neighbours are
//!   in the same classes. Without singled-out ranks this gives the pipeline stages (the
//!   predictor's symmetry classes). With them, it gives the ranks that relate to them
//!   alike: their tensor-parallel peers, their data-parallel peers, the rest of their
//!   pipeline, everyone else. The number of classes depends on the layout's shape and
//!   on how many ranks are singled out, not on the world size: a 70B job with one real
//!   rank has 16 from 1,024 to 8,192 GPUs (`orrery bench --emulate`).
//!
//!   Why the ranks of a class run identical timelines: a rank's timeline follows from its
//!   own graph (its stage's), its perturbations and the arrivals of its group members and
//!   pipeline peers, which is a message-passing computation over the layout; ranks that
//!   colour refinement cannot tell apart see, round after round, the same messages.
//!
//!   Each class is replayed once, from its lowest rank. A collective waits for every class
//!   among its group's members: all ranks of a class arrive together, so this is exact. A
//!   send goes to the class of the receiving rank. Pruned emulation is therefore not an
//!   approximation: every rank's timeline equals the unpruned one, with perturbations too
//!   (`tests/emulate.rs`, over random layouts, real ranks, slow ranks and degraded links).
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
use orrery_graph::{GroupRole, JobGraphs, Layout, Op, OpKind, PeerStage};
use orrery_net::{GroupPlacement, NetworkModel};
use orrery_units::{Bytes, ClassId, Picos, RankId};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Which ranks are replayed one by one (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pruning {
    /// Every rank is its own participant.
    None,
    /// One participant per class of ranks with identical timelines; real and perturbed
    /// ranks are classes of their own.
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

/// A rank whose network link is slower: every collective whose group holds it, and every
/// send from it, takes `factor` times as long.
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
    /// Every problem found, one per line as the other specs list theirs.
    #[error("the emulation has {} problem(s):\n  {}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    Many(Vec<EmulateError>),
    #[error("op {op} of participant {participant} is not waiting for a duration")]
    NotWaiting { participant: u32, op: u32 },
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// The duration supplied to each live compute op, by (participant, op).
pub type Supplied = HashMap<(u32, u32), Picos>;

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
    /// The rank it replays (the lowest rank of its timeline class).
    pub rank: RankId,
    pub class: ClassId,
    pub live: bool,
    /// How many ranks it stands for (its timeline class's size).
    pub stands_for: u32,
}

/// A replay with live participants (see the module docs).
pub struct Emulation<'a, N: NetworkModel> {
    engine: Engine<'a, N>,
    info: Vec<ParticipantInfo>,
    /// Each rank's colour (its participant), when pruned.
    colour: Option<Vec<u32>>,
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
        let colour = match pruning {
            Pruning::Classes => Some(colours(&graphs.layout, &materialized)),
            Pruning::None => None,
        };
        let (mut participants, info) = match &colour {
            Some(colour) => build_pruned(graphs, colour, live),
            None => build_unpruned(graphs, live),
        };
        if let Some(m) = measured {
            for p in &mut participants {
                p.measured = m.get(p.class.index()).cloned();
            }
        }
        let mut engine = Engine::new(participants, cost, net, ReplayMode::AllRanks);
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
                degrade(&mut engine, graphs, &info, p, l.rank, l.factor);
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
            colour,
            seeded: false,
        })
    }

    /// The participants, by index.
    pub fn participants(&self) -> &[ParticipantInfo] {
        &self.info
    }

    /// The rank whose participant's timeline is `rank`'s (itself unless pruned).
    pub fn stands_for(&self, rank: RankId) -> RankId {
        match &self.colour {
            Some(c) => c
                .get(rank.index())
                .and_then(|&k| self.info.get(k as usize))
                .map_or(rank, |i| i.rank),
            None => rank,
        }
    }

    /// Whether ranks share timelines ([`Pruning::Classes`]).
    pub fn pruned(&self) -> bool {
        self.colour.is_some()
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

    /// The next all-to-all after compute op `op` of live participant `participant` moves
    /// `bytes` this step (its real router's choices) instead of what its graph says.
    ///
    /// The virtual participants replaying the same graph (the same pipeline stage, so the
    /// same layer's router) follow it: their copy of that all-to-all moves the largest size
    /// the live participants of the graph reported for it this step, whatever the
    /// collection saw. Ranks route alike because they share the router's weights; what
    /// their own tokens would choose is not known. The report comes with the live
    /// participant's segment before the all-to-all, while the engine holds at that
    /// segment's start: a virtual participant whose all-to-all started before it (in
    /// simulated time) keeps the graph's size. An exchange lasts as long as its largest
    /// member's size takes. Nothing happens if the next communication op is not an
    /// all-to-all.
    pub fn size_next_all_to_all(&mut self, participant: u32, op: u32, bytes: u64) {
        let next = (op + 1..)
            .map_while(|i| self.engine.op_of(participant, i).map(|(_, o)| (i, o.kind)))
            .find(|(_, k)| {
                matches!(
                    k,
                    OpKind::Collective { .. } | OpKind::Send { .. } | OpKind::Recv { .. }
                )
            });
        if let Some((i, OpKind::Collective { op: c, .. })) = next {
            if c == orrery_graph::CollectiveOp::AllToAll {
                let bytes = Bytes(bytes);
                self.engine.hybrid.bytes.insert((participant, i), bytes);
                let Some((class, _)) = self.engine.class_of(participant) else {
                    return;
                };
                for q in 0.. {
                    let Some((c, live)) = self.engine.class_of(q) else {
                        break;
                    };
                    let all_to_all = matches!(
                        self.engine.op_of(q, i).map(|(_, o)| o.kind),
                        Some(OpKind::Collective {
                            op: orrery_graph::CollectiveOp::AllToAll,
                            ..
                        })
                    );
                    if c == class && !live && all_to_all {
                        let size = self.engine.hybrid.bytes.entry((q, i)).or_insert(bytes);
                        *size = (*size).max(bytes);
                    }
                }
            }
        }
    }

    /// Runs the emulation to the end, asking `measure` for each live compute op's
    /// duration (given the rank, the op and the modelled duration).
    pub fn run_with(
        self,
        mut measure: impl FnMut(RankId, &Op, Picos) -> Picos,
    ) -> Result<Timeline, EmulateError> {
        self.run_supplying(|_, _, rank, op, modelled| measure(rank, op, modelled))
    }

    /// Runs the emulation to the end with the live ranks' compute at the models' durations
    /// (a dry run of the machinery, or perturbations of a modelled job). Returns the
    /// timeline and each live compute op's duration, by (participant, op).
    pub fn run_modelled(self) -> Result<(Timeline, Supplied), EmulateError> {
        let mut supplied = HashMap::new();
        let timeline = self.run_supplying(|participant, op, _, _, modelled| {
            supplied.insert((participant, op), modelled);
            modelled
        })?;
        Ok((timeline, supplied))
    }

    /// Runs to the end, asking `measure` (participant, op index, rank, op, modelled
    /// duration) for each live compute op's duration.
    fn run_supplying(
        mut self,
        mut measure: impl FnMut(u32, u32, RankId, &Op, Picos) -> Picos,
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
                        Some(o) => measure(participant, op, rank, o, modelled),
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

/// The timeline classes of a world in which `materialized` ranks are singled out: ranks
/// that provably run identical timelines share a colour (see the module docs). Colours are
/// dense, numbered in order of their lowest rank.
///
/// Each round costs O(world x roles) with no allocation per rank or group (fixed-size rank
/// signatures, one reused buffer for a group's): this runs once per emulation but over every
/// rank, and at 65,536 ranks it was most of an emulation's set-up. A group's role and
/// placement do not depend on colours, so they are worked out once.
fn colours(layout: &Layout, materialized: &BTreeSet<u32>) -> Vec<u32> {
    const ROLES: usize = GroupRole::ALL.len();
    let world = layout.world_size();
    let mut colour = dense((0..world).map(|r| {
        let rank = RankId(r);
        [
            u64::from(layout.class_of(rank).0),
            if materialized.contains(&r) {
                u64::from(r)
            } else {
                u64::MAX
            },
        ]
    }));
    // Per group, in id order (`all_groups` numbers them densely): its members, and its role
    // and placement, which open its signature.
    let groups: Vec<(&[RankId], [u64; 4])> = layout
        .all_groups()
        .map(|(_, role, members)| {
            let pl = layout.placement_of(members);
            let head = [
                role.index() as u64,
                u64::from(pl.size),
                u64::from(pl.nodes),
                u64::from(pl.max_per_node),
            ];
            (members, head)
        })
        .collect();
    let mut group_sig = vec![0u64; groups.len()];
    let mut key: Vec<u64> = Vec::new();
    loop {
        let count = colour.iter().max().map_or(0, |&c| c + 1);
        // Each group's signature: role, placement and the multiset of its members' colours.
        let mut sig_ids: HashMap<Vec<u64>, u64> = HashMap::new();
        for ((members, head), sig) in groups.iter().zip(&mut group_sig) {
            key.clear();
            key.extend_from_slice(head);
            key.extend(members.iter().map(|m| u64::from(colour[m.index()])));
            key[head.len()..].sort_unstable();
            let next = sig_ids.len() as u64;
            *sig = match sig_ids.get(key.as_slice()) {
                Some(&id) => id,
                None => {
                    sig_ids.insert(key.clone(), next);
                    next
                }
            };
        }
        let refined = dense((0..world).map(|r| {
            let rank = RankId(r);
            let mut sig = [0u64; 1 + ROLES + 4];
            sig[0] = u64::from(colour[rank.index()]);
            for (slot, role) in sig[1..=ROLES].iter_mut().zip(GroupRole::ALL) {
                *slot = group_sig[layout.group_id(rank, role).index()];
            }
            for (i, dir) in [PeerStage::Next, PeerStage::Prev].into_iter().enumerate() {
                let peer = layout.peer(rank, dir);
                sig[1 + ROLES + 2 * i] = u64::from(colour[peer.index()]);
                // Whether the link to that neighbour stays inside a node: it sets the
                // transfer's time, and it differs between ranks of one stage when a stage
                // does not fill whole nodes.
                sig[2 + ROLES + 2 * i] = u64::from(layout.same_node(rank, peer));
            }
            sig
        }));
        let refined_count = refined.iter().max().map_or(0, |&c| c + 1);
        // Refinement only ever splits colours: the same count means nothing changed.
        if refined_count == count {
            return refined;
        }
        colour = refined;
    }
}

/// Dense ids for keys, in order of first appearance.
fn dense<K: std::hash::Hash + Eq>(keys: impl Iterator<Item = K>) -> Vec<u32> {
    let mut ids: HashMap<K, u32> = HashMap::new();
    keys.map(|k| {
        let next = ids.len() as u32;
        *ids.entry(k).or_insert(next)
    })
    .collect()
}

type Built<'g> = (Vec<Participant<'g>>, Vec<ParticipantInfo>);

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
    (participants, info)
}

/// One participant per colour, replaying the colour's lowest rank (see the module docs).
fn build_pruned<'g>(graphs: &'g JobGraphs, colour: &[u32], live: &[RankId]) -> Built<'g> {
    let layout = &graphs.layout;
    let colours = colour.iter().max().map_or(0, |&c| c as usize + 1);
    let mut representative = vec![RankId(u32::MAX); colours];
    let mut size = vec![0u32; colours];
    for (r, &c) in colour.iter().enumerate() {
        if size[c as usize] == 0 {
            representative[c as usize] = RankId(r as u32);
        }
        size[c as usize] += 1;
    }
    // Rendezvous ids: one per (role, set of member colours).
    let mut rendezvous_ids: BTreeMap<Vec<u32>, u32> = BTreeMap::new();
    let mut participants = Vec::with_capacity(colours);
    let mut info = Vec::with_capacity(colours);
    for (p, &rank) in representative.iter().enumerate() {
        let class = layout.class_of(rank);
        let graph = graphs.class(class);
        let mut seq_on_role: HashMap<GroupRole, u32> = HashMap::new();
        let mut of_role: HashMap<GroupRole, (GroupPlacement, u32, Option<u32>)> = HashMap::new();
        let links = graph
            .ops()
            .iter()
            .map(|op| match op.kind {
                OpKind::Send { peer, .. } => {
                    let q = layout.peer(rank, peer);
                    Link::Send {
                        target: colour[q.index()],
                        same_node: layout.same_node(rank, q),
                    }
                }
                OpKind::Collective { group, .. } => {
                    let seq = seq_on_role.entry(group).or_insert(0);
                    let k = *seq;
                    *seq += 1;
                    // The rank's group of a role is the same for all of its collectives of
                    // that role, so its placement and rendezvous are worked out once: a
                    // data-parallel group spans thousands of ranks in large worlds.
                    let (placement, members, rendezvous) =
                        *of_role.entry(group).or_insert_with(|| {
                            let members = layout.group_members(rank, group);
                            let pl = layout.placement_of(members);
                            let placement = GroupPlacement {
                                size: pl.size,
                                nodes: pl.nodes,
                                max_per_node: pl.max_per_node,
                            };
                            let mut set: Vec<u32> =
                                members.iter().map(|m| colour[m.index()]).collect();
                            set.sort_unstable();
                            set.dedup();
                            if set.len() <= 1 {
                                // Every member runs this participant's timeline.
                                (placement, 1, None)
                            } else {
                                let members = set.len() as u32;
                                let mut key = vec![group.index() as u32];
                                key.extend(set);
                                let next = rendezvous_ids.len() as u32;
                                let id = *rendezvous_ids.entry(key).or_insert(next);
                                (placement, members, Some(id))
                            }
                        });
                    Link::Collective {
                        rendezvous: rendezvous.map(|id| (id, k)),
                        members,
                        placement,
                    }
                }
                _ => Link::None,
            })
            .collect();
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
            live: size[p] == 1 && live.contains(&rank),
            stands_for: size[p],
        });
    }
    (participants, info)
}

/// Participant `p` (standing for `rank`, or for its colour) has a slower link: every
/// collective whose group holds `rank`, of every participant, and every send of `p`, takes
/// `factor` times as long.
fn degrade<N: NetworkModel>(
    engine: &mut Engine<'_, N>,
    graphs: &JobGraphs,
    info: &[ParticipantInfo],
    p: u32,
    rank: RankId,
    factor: f64,
) {
    let layout = &graphs.layout;
    for (q, i) in info.iter().enumerate() {
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
                // Two degraded links in one group: the slower sets the pace.
                engine
                    .hybrid
                    .net_scale
                    .entry((q as u32, op as u32))
                    .and_modify(|f| *f = f.max(factor))
                    .or_insert(factor);
            }
        }
    }
}

/// One rank replayed on its own in an emulated step (a real rank, a perturbed one, or one
/// whose timeline class has no other member).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankReport {
    pub rank: u32,
    pub stage: u32,
    /// A live (real) rank, rather than a virtual one.
    pub real: bool,
    /// When its last op ended.
    pub end: Picos,
    /// Time its compute ops took, in all.
    pub compute: Picos,
    /// The cost model's time for the same compute ops (what the prediction assumes).
    pub modelled_compute: Picos,
    pub peak_memory: Bytes,
}

/// One participant standing for several virtual ranks (a timeline class) of an emulated
/// step.
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
    /// Whether ranks shared timelines (see [`Pruning`]).
    pub pruned: bool,
    pub participants: usize,
    /// The emulated step: when the last op of any participant ended.
    pub step_time: Picos,
    /// `orrery predict`'s step time for the same job, unperturbed.
    pub predicted_step_time: Picos,
    pub ranks: Vec<RankReport>,
    pub shared: Vec<SharedReport>,
}

/// Reads an emulated timeline back per participant. `modelled` holds the cost model's
/// duration of each live compute op, keyed by (participant, op), as
/// [`EmulationStep::Compute`] gave it.
pub fn report(
    graphs: &JobGraphs,
    info: &[ParticipantInfo],
    pruned: bool,
    timeline: &Timeline,
    modelled: &Supplied,
    predicted_step_time: Picos,
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
                    // Saturating: durations may come from a file.
                    compute = compute.saturating_add(took);
                    model = model
                        .saturating_add(modelled.get(&(p as u32, k as u32)).map_or(took, |d| d.0));
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The colour refinement as it was first written (a sorted map of vectors per rank and
    /// group, placements recomputed every round): the reference for [`colours`].
    fn colours_reference(layout: &Layout, materialized: &BTreeSet<u32>) -> Vec<u32> {
        fn dense(keys: impl Iterator<Item = Vec<u64>>) -> Vec<u32> {
            let mut ids: BTreeMap<Vec<u64>, u32> = BTreeMap::new();
            keys.map(|k| {
                let next = ids.len() as u32;
                *ids.entry(k).or_insert(next)
            })
            .collect()
        }
        let world = layout.world_size();
        let mut colour = dense((0..world).map(|r| {
            let rank = RankId(r);
            vec![
                u64::from(layout.class_of(rank).0),
                if materialized.contains(&r) {
                    u64::from(r)
                } else {
                    u64::MAX
                },
            ]
        }));
        let groups: Vec<(orrery_units::GroupId, GroupRole, Vec<RankId>)> = layout
            .all_groups()
            .map(|(g, role, m)| (g, role, m.to_vec()))
            .collect();
        loop {
            let count = colour.iter().max().map_or(0, |&c| c + 1);
            let mut group_sig: HashMap<orrery_units::GroupId, u64> = HashMap::new();
            let mut sig_ids: BTreeMap<Vec<u64>, u64> = BTreeMap::new();
            for (g, role, members) in &groups {
                let pl = layout.placement_of(members);
                let mut key = vec![
                    role.index() as u64,
                    u64::from(pl.size),
                    u64::from(pl.nodes),
                    u64::from(pl.max_per_node),
                ];
                let mut cs: Vec<u64> = members
                    .iter()
                    .map(|m| u64::from(colour[m.index()]))
                    .collect();
                cs.sort_unstable();
                key.extend(cs);
                let next = sig_ids.len() as u64;
                let id = *sig_ids.entry(key).or_insert(next);
                group_sig.insert(*g, id);
            }
            let refined = dense((0..world).map(|r| {
                let rank = RankId(r);
                let mut sig = vec![u64::from(colour[r as usize])];
                for role in GroupRole::ALL {
                    sig.push(group_sig[&layout.group_id(rank, role)]);
                }
                for dir in [PeerStage::Next, PeerStage::Prev] {
                    let peer = layout.peer(rank, dir);
                    sig.push(u64::from(colour[peer.index()]));
                    sig.push(u64::from(layout.same_node(rank, peer)));
                }
                sig
            }));
            let refined_count = refined.iter().max().map_or(0, |&c| c + 1);
            if refined_count == count {
                return refined;
            }
            colour = refined;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// The colouring equals the reference's, colour for colour, on layouts whose stages
        /// fill nodes and on layouts that straddle them, with any ranks singled out.
        #[test]
        fn colours_equal_the_reference(
            tp in 1u32..4,
            cp in 1u32..3,
            dp in 1u32..5,
            pp in 1u32..5,
            ep_pick in 0u32..4,
            gpus_per_node in 1u32..9,
            picks in proptest::collection::vec(0u32..256, 0..4),
        ) {
            // ep divides dp * cp.
            let x = dp * cp;
            let divisors: Vec<u32> = (1..=x).filter(|d| x % d == 0).collect();
            let ep = divisors[ep_pick as usize % divisors.len()];
            let layout = Layout::from_dims(tp, cp, dp, pp, ep, gpus_per_node);
            let world = layout.world_size();
            let materialized: BTreeSet<u32> = picks.iter().map(|p| p % world).collect();
            prop_assert_eq!(
                colours(&layout, &materialized),
                colours_reference(&layout, &materialized)
            );
        }
    }
}
