//! The replay engine: advances execution graphs in simulated time.
//!
//! A *participant* is one graph being replayed: a whole symmetry class (class mode, the
//! default) or a single rank (all-rank mode, the reference the class mode is tested
//! against). The engine is a discrete-event loop ordered by `(picoseconds, sequence)`:
//!
//! - an op starts when its dependencies are done and, if it lives on a stream, when it is
//!   at the head of that stream and the stream is idle (streams run in issue order, one op
//!   at a time, like CUDA streams);
//! - compute ops take the cost model's duration;
//! - a collective starts when every member has reached it (in class mode every member is
//!   the class itself, since all ranks of a class run identical timelines) and takes the
//!   network model's duration;
//! - sends are eager: the sender's stream is busy for the transfer and the data arrives
//!   when it ends; a receive is not on a stream and completes when its data has arrived and
//!   its dependencies are done;
//! - allocations and frees take no time; the memory ledger reads their times afterwards.

use crate::cost::CostModel;
use orrery_graph::{CollectiveOp, ExecGraph, JobGraphs, OpKind, Stream};
use orrery_net::{CollectiveKind, CollectiveRequest, GroupPlacement, NetworkModel};
use orrery_units::{Bytes, ClassId, GroupId, Picos, RankId};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Replay one participant per symmetry class, or every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ReplayMode {
    Classes,
    AllRanks,
}

/// When one op ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct OpTiming {
    pub start: Picos,
    pub end: Picos,
}

/// The replayed timeline of one participant.
#[derive(Debug, Clone, Serialize)]
pub struct ParticipantTimeline {
    /// The rank replayed (the class representative in class mode).
    pub rank: RankId,
    pub class: ClassId,
    /// Timing of each op of the participant's graph, by op index.
    pub ops: Vec<OpTiming>,
}

impl ParticipantTimeline {
    pub fn end(&self) -> Picos {
        self.ops.iter().map(|o| o.end).max().unwrap_or(Picos::ZERO)
    }
}

/// The result of a replay.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    pub mode: ReplayMode,
    pub participants: Vec<ParticipantTimeline>,
    /// Events processed (op completions).
    pub events: u64,
}

impl Timeline {
    /// The step time: when the last op of any participant ends.
    pub fn step_time(&self) -> Picos {
        self.participants
            .iter()
            .map(ParticipantTimeline::end)
            .max()
            .unwrap_or(Picos::ZERO)
    }
}

/// Why a replay could not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("replay deadlocked: {stuck} ops never ran (first: rank {rank} op {op} `{name}`)")]
    Deadlock {
        stuck: usize,
        rank: u32,
        op: u32,
        name: String,
    },
    #[error("collective mismatch on group {group}: rank {rank} issued {got} where another member issued {expected}")]
    CollectiveMismatch {
        group: u32,
        rank: u32,
        got: String,
        expected: String,
    },
    #[error("malformed graph for class {class}: {source}")]
    Graph {
        class: u32,
        source: orrery_graph::GraphError,
    },
}

/// Maps the graph's collective ops to the network's.
pub fn net_kind(op: CollectiveOp) -> CollectiveKind {
    match op {
        CollectiveOp::AllReduce => CollectiveKind::AllReduce,
        CollectiveOp::AllGather => CollectiveKind::AllGather,
        CollectiveOp::ReduceScatter => CollectiveKind::ReduceScatter,
        CollectiveOp::AllToAll => CollectiveKind::AllToAll,
        CollectiveOp::Broadcast => CollectiveKind::Broadcast,
    }
}

/// Per-participant replay state. Dependents are stored as a compressed adjacency list.
struct State<'g> {
    graph: &'g ExecGraph,
    rank: RankId,
    class: ClassId,
    pending_deps: Vec<u32>,
    dependents_start: Vec<u32>,
    dependents: Vec<u32>,
    stream_queue: [Vec<u32>; 6],
    stream_head: [usize; 6],
    stream_busy: [bool; 6],
    timing: Vec<OpTiming>,
    links: Vec<Link>,
    measured: Option<Vec<Option<Picos>>>,
    done: usize,
    /// A live participant (a real rank of hybrid emulation): its compute ops wait for
    /// their measured duration ([`crate::emulate`]).
    pub(crate) live: bool,
}

impl<'g> State<'g> {
    fn new(p: Participant<'g>) -> State<'g> {
        let Participant {
            graph,
            rank,
            class,
            links,
            measured,
        } = p;
        let n = graph.len();
        let mut pending_deps = vec![0u32; n];
        let mut counts = vec![0u32; n + 1];
        for (i, op) in graph.ops().iter().enumerate() {
            pending_deps[i] = op.deps.len() as u32;
            for d in &op.deps {
                counts[d.index() + 1] += 1;
            }
        }
        for i in 0..n {
            counts[i + 1] += counts[i];
        }
        let mut fill = counts.clone();
        let mut dependents = vec![0u32; counts[n] as usize];
        for (i, op) in graph.ops().iter().enumerate() {
            for d in &op.deps {
                dependents[fill[d.index()] as usize] = i as u32;
                fill[d.index()] += 1;
            }
        }
        let mut stream_queue: [Vec<u32>; 6] = Default::default();
        for (i, op) in graph.ops().iter().enumerate() {
            if op.kind.occupies_stream() {
                stream_queue[op.stream.index()].push(i as u32);
            }
        }
        State {
            graph,
            rank,
            class,
            pending_deps,
            dependents_start: counts,
            dependents,
            stream_queue,
            stream_head: [0; 6],
            stream_busy: [false; 6],
            timing: vec![OpTiming::default(); n],
            links,
            measured,
            done: 0,
            live: false,
        }
    }
}

/// What one op of a participant refers to outside the participant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    None,
    /// A collective: the rendezvous it joins (`None`: it starts as soon as this participant
    /// reaches it, because the participant stands for every member), how many participants
    /// must arrive, and where the group sits on the fabric.
    Collective {
        rendezvous: Option<(u32, u32)>,
        members: u32,
        placement: GroupPlacement,
    },
    /// A send: the participant that receives it and whether it stays inside a node.
    Send {
        target: u32,
        same_node: bool,
    },
}

/// One graph to replay, with everything it refers to resolved.
#[derive(Debug, Clone)]
pub struct Participant<'g> {
    pub graph: &'g ExecGraph,
    pub rank: RankId,
    pub class: ClassId,
    /// By op index.
    pub links: Vec<Link>,
    /// Measured durations that replace the cost model's, by op (traces with timings).
    pub measured: Option<Vec<Option<Picos>>>,
}

/// The participants of a job's replay: one per class, or one per rank.
pub fn job_participants(graphs: &JobGraphs, mode: ReplayMode) -> Vec<Participant<'_>> {
    let layout = &graphs.layout;
    let ranks: Vec<RankId> = match mode {
        ReplayMode::Classes => (0..layout.num_classes())
            .map(|c| layout.representative(ClassId(c)))
            .collect(),
        ReplayMode::AllRanks => (0..layout.world_size()).map(RankId).collect(),
    };
    ranks
        .into_iter()
        .map(|rank| {
            let class = layout.class_of(rank);
            let graph = graphs.class(class);
            let mut seq_on_group: HashMap<GroupId, u32> = HashMap::new();
            let links = graph
                .ops()
                .iter()
                .map(|op| match op.kind {
                    OpKind::Send { peer, .. } => {
                        let peer_rank = layout.peer(rank, peer);
                        let target = match mode {
                            ReplayMode::Classes => layout.class_of(peer_rank).0,
                            ReplayMode::AllRanks => peer_rank.0,
                        };
                        Link::Send {
                            target,
                            same_node: layout.same_node(rank, peer_rank),
                        }
                    }
                    OpKind::Collective { group, .. } => {
                        let pl = layout.placement(rank, group);
                        let placement = GroupPlacement {
                            size: pl.size,
                            nodes: pl.nodes,
                            max_per_node: pl.max_per_node,
                        };
                        // In class mode a collective waits for every class among its
                        // members (a class stands for all of its ranks): usually only its
                        // own, so it starts at once; the embedding group joins the first
                        // and the last stage.
                        let classes = {
                            let mut c: Vec<ClassId> = layout
                                .group_members(rank, group)
                                .iter()
                                .map(|&m| layout.class_of(m))
                                .collect();
                            c.sort_unstable();
                            c.dedup();
                            c.len() as u32
                        };
                        match mode {
                            ReplayMode::Classes if classes <= 1 => Link::Collective {
                                rendezvous: None,
                                members: 1,
                                placement,
                            },
                            ReplayMode::Classes => {
                                let gid = layout.group_id(rank, group);
                                let seq = seq_on_group.entry(gid).or_insert(0);
                                let key = (gid.0, *seq);
                                *seq += 1;
                                Link::Collective {
                                    rendezvous: Some(key),
                                    members: classes,
                                    placement,
                                }
                            }
                            ReplayMode::AllRanks => {
                                let gid = layout.group_id(rank, group);
                                let seq = seq_on_group.entry(gid).or_insert(0);
                                let key = (gid.0, *seq);
                                *seq += 1;
                                Link::Collective {
                                    rendezvous: Some(key),
                                    members: layout.group_size(group),
                                    placement,
                                }
                            }
                        }
                    }
                    _ => Link::None,
                })
                .collect();
            Participant {
                graph,
                rank,
                class,
                links,
                measured: None,
            }
        })
        .collect()
}

struct Waiting {
    arrived: u32,
    members: Vec<(u32, u32)>,
    signature: (CollectiveOp, Bytes),
}

/// The perturbations of hybrid emulation ([`crate::emulate`]); empty for a plain replay.
#[derive(Debug, Clone, Default)]
pub(crate) struct Hybrid {
    /// (participant, op) -> factor on the network time of that collective or send.
    pub net_scale: HashMap<(u32, u32), f64>,
    /// participant -> windows of simulated time in which its compute is slower.
    pub slow: HashMap<u32, Vec<SlowWindow>>,
    /// (participant, op) -> the bytes a live rank's all-to-all moves this step (its
    /// router's choices), instead of the graph's.
    pub bytes: HashMap<(u32, u32), Bytes>,
}

/// A window of simulated time in which a participant's compute ops take `factor` times as
/// long (an op counts in the window its start falls in).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowWindow {
    pub from: Picos,
    pub until: Option<Picos>,
    pub factor: f64,
}

impl SlowWindow {
    fn covers(&self, t: Picos) -> bool {
        t >= self.from && self.until.is_none_or(|u| t < u)
    }
}

/// A duration times a factor, rounded to the picosecond.
pub(crate) fn scaled(d: Picos, factor: f64) -> Picos {
    if factor == 1.0 {
        d
    } else {
        Picos((d.0 as f64 * factor).round() as u64)
    }
}

/// The replay engine over a set of participants.
pub struct Engine<'a, N: NetworkModel> {
    cost: &'a CostModel,
    net: &'a N,
    mode: ReplayMode,
    states: Vec<State<'a>>,
    queue: BinaryHeap<Reverse<(Picos, u64, u32, u32)>>,
    seq: u64,
    /// Arrived data not yet received: (participant, tag) -> arrival time.
    arrivals: HashMap<(u32, u64), Picos>,
    /// Receives waiting for data: (participant, tag) -> op.
    waiting_recv: HashMap<(u32, u64), u32>,
    rendezvous: HashMap<(u32, u32), Waiting>,
    collective_cache: HashMap<(CollectiveKind, Bytes, GroupPlacement), Picos>,
    error: Option<ReplayError>,
    events: u64,
    pub(crate) hybrid: Hybrid,
    /// Compute ops of live participants waiting for their duration: (participant, op,
    /// the sequence number reserved for their completion, so that ties at equal times
    /// resolve as in a replay with the duration known, and the duration the models give).
    pub(crate) parked: Vec<(u32, u32, u64, Picos)>,
}

impl<N: NetworkModel> std::fmt::Debug for Engine<'_, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("mode", &self.mode)
            .field("events", &self.events)
            .finish()
    }
}

/// Replays a job's graphs. See the module docs for the semantics.
pub fn replay<N: NetworkModel>(
    graphs: &JobGraphs,
    cost: &CostModel,
    net: &N,
    mode: ReplayMode,
) -> Result<Timeline, ReplayError> {
    for (c, g) in graphs.classes.iter().enumerate() {
        g.check().map_err(|source| ReplayError::Graph {
            class: c as u32,
            source,
        })?;
    }
    replay_participants(job_participants(graphs, mode), cost, net, mode)
}

/// Replays resolved participants (a job's, or ranks imported from traces). Each graph must
/// pass [`ExecGraph::check`] and `links` must have one entry per op.
pub fn replay_participants<N: NetworkModel>(
    participants: Vec<Participant<'_>>,
    cost: &CostModel,
    net: &N,
    mode: ReplayMode,
) -> Result<Timeline, ReplayError> {
    Engine::new(participants, cost, net, mode).run()
}

impl<'a, N: NetworkModel> Engine<'a, N> {
    pub(crate) fn new(
        participants: Vec<Participant<'a>>,
        cost: &'a CostModel,
        net: &'a N,
        mode: ReplayMode,
    ) -> Engine<'a, N> {
        Engine {
            cost,
            net,
            mode,
            states: participants.into_iter().map(State::new).collect(),
            queue: BinaryHeap::new(),
            seq: 0,
            arrivals: HashMap::new(),
            waiting_recv: HashMap::new(),
            rendezvous: HashMap::new(),
            collective_cache: HashMap::new(),
            error: None,
            events: 0,
            hybrid: Hybrid::default(),
            parked: Vec::new(),
        }
    }

    /// Marks participant `p` live (see [`State::live`]).
    pub(crate) fn set_live(&mut self, p: u32) {
        if let Some(st) = self.states.get_mut(p as usize) {
            st.live = true;
        }
    }

    /// The participant's rank and the op, for callers outside the engine.
    pub(crate) fn op_of(&self, p: u32, op: u32) -> Option<(RankId, &orrery_graph::Op)> {
        let st = self.states.get(p as usize)?;
        Some((st.rank, st.graph.ops().get(op as usize)?))
    }

    /// The class participant `p` replays the graph of (`None` past the last participant),
    /// and whether it is live.
    pub(crate) fn class_of(&self, p: u32) -> Option<(ClassId, bool)> {
        self.states.get(p as usize).map(|st| (st.class, st.live))
    }

    /// When op `op` of participant `p` started.
    pub(crate) fn start_of(&self, p: u32, op: u32) -> Picos {
        self.states[p as usize].timing[op as usize].start
    }

    fn schedule(&mut self, at: Picos, p: u32, op: u32) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, p, op)));
    }

    /// Completes parked op `op` of participant `p` at `at`, in the place among equal
    /// times its start reserved.
    pub(crate) fn unpark(&mut self, p: u32, op: u32, at: Picos) -> bool {
        let Some(i) = self
            .parked
            .iter()
            .position(|&(q, o, _, _)| q == p && o == op)
        else {
            return false;
        };
        let (_, _, seq, _) = self.parked.swap_remove(i);
        self.queue.push(Reverse((at, seq, p, op)));
        true
    }

    fn run(&mut self) -> Result<Timeline, ReplayError> {
        self.seed();
        self.pump()?;
        self.finish()
    }

    /// Releases every op with no dependencies, in participant then issue order.
    pub(crate) fn seed(&mut self) {
        for p in 0..self.states.len() as u32 {
            let n = self.states[p as usize].graph.len();
            for op in 0..n as u32 {
                if self.states[p as usize].pending_deps[op as usize] == 0 {
                    self.ready(Picos::ZERO, p, op);
                }
            }
        }
    }

    /// Processes events until none is left or a live participant's op waits for its
    /// duration (nothing later may run before it is known).
    pub(crate) fn pump(&mut self) -> Result<(), ReplayError> {
        while self.parked.is_empty() {
            let Some(Reverse((now, _, p, op))) = self.queue.pop() else {
                break;
            };
            self.complete(now, p, op);
            if let Some(e) = self.error.take() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// The timeline, once every op has run.
    pub(crate) fn finish(&mut self) -> Result<Timeline, ReplayError> {
        self.check_finished()?;
        let participants = self
            .states
            .iter()
            .map(|s| ParticipantTimeline {
                rank: s.rank,
                class: s.class,
                ops: s.timing.clone(),
            })
            .collect();
        Ok(Timeline {
            mode: self.mode,
            participants,
            events: self.events,
        })
    }

    fn check_finished(&self) -> Result<(), ReplayError> {
        let stuck: usize = self.states.iter().map(|s| s.graph.len() - s.done).sum();
        if stuck == 0 {
            return Ok(());
        }
        for s in &self.states {
            if s.done < s.graph.len() {
                // The first op that never ended.
                let first = s
                    .timing
                    .iter()
                    .zip(s.graph.ops())
                    .enumerate()
                    .find(|(_, (t, _))| t.end == Picos::ZERO && t.start == Picos::ZERO);
                let (op, name) = first.map_or((0, "?".to_string()), |(i, (_, o))| {
                    (i as u32, s.graph.name_of(o).to_string())
                });
                return Err(ReplayError::Deadlock {
                    stuck,
                    rank: s.rank.0,
                    op,
                    name,
                });
            }
        }
        Ok(())
    }

    /// An op's dependencies are done at `now`.
    fn ready(&mut self, now: Picos, p: u32, op: u32) {
        let kind = self.states[p as usize].graph.ops()[op as usize].kind;
        if !kind.occupies_stream() {
            self.start_streamless(now, p, op, kind);
            return;
        }
        let stream = self.states[p as usize].graph.ops()[op as usize]
            .stream
            .index();
        let st = &self.states[p as usize];
        let head = st.stream_queue[stream].get(st.stream_head[stream]).copied();
        if head == Some(op) && !st.stream_busy[stream] {
            self.start_on_stream(now, p, op, kind, stream);
        }
    }

    fn start_streamless(&mut self, now: Picos, p: u32, op: u32, kind: OpKind) {
        self.states[p as usize].timing[op as usize].start = now;
        match kind {
            OpKind::Recv { tag, .. } => match self.arrivals.remove(&(p, tag)) {
                Some(arrival) => self.schedule(now.max(arrival), p, op),
                None => {
                    self.waiting_recv.insert((p, tag), op);
                }
            },
            _ => self.schedule(now, p, op),
        }
    }

    fn start_on_stream(&mut self, now: Picos, p: u32, op: u32, kind: OpKind, stream: usize) {
        let st = &mut self.states[p as usize];
        st.stream_busy[stream] = true;
        st.timing[op as usize].start = now;
        let link = st.links.get(op as usize).copied().unwrap_or(Link::None);
        let measured = st
            .measured
            .as_ref()
            .and_then(|m| m.get(op as usize).copied().flatten());
        match (kind, link) {
            (OpKind::Compute { kind, flops, bytes }, _) => {
                // Communication kernels running right now take SMs from this kernel.
                let comm_running = [
                    Stream::TpComm,
                    Stream::CpComm,
                    Stream::EpComm,
                    Stream::DpComm,
                ]
                .iter()
                .any(|s| st.stream_busy[s.index()]);
                let live = st.live;
                let d = match measured {
                    Some(d) => d,
                    None if comm_running => self.cost.duration_overlapped(&kind, flops, bytes),
                    None => self.cost.duration(&kind, flops, bytes),
                };
                if live {
                    // Its duration is measured by the real program: wait for it.
                    self.seq += 1;
                    self.parked.push((p, op, self.seq, d));
                    return;
                }
                let d = self.slowed(p, now, d);
                self.schedule(now + d, p, op);
            }
            (OpKind::Send { bytes, .. }, Link::Send { same_node, .. }) => {
                let d = measured.unwrap_or_else(|| self.net.point_to_point(bytes, same_node));
                let d = self.net_scaled(p, op, d);
                self.schedule(now + d, p, op);
            }
            (
                OpKind::Collective { op: cop, bytes, .. },
                Link::Collective {
                    rendezvous,
                    members,
                    placement,
                },
            ) => {
                let bytes = if self.hybrid.bytes.is_empty() {
                    bytes
                } else {
                    self.hybrid.bytes.get(&(p, op)).copied().unwrap_or(bytes)
                };
                match rendezvous {
                    None => {
                        let d = self.collective_time(cop, bytes, placement);
                        let d = self.net_scaled(p, op, d);
                        self.schedule(now + d, p, op);
                    }
                    Some(key) => self.arrive(now, p, op, key, members, (cop, bytes, placement)),
                }
            }
            // An unresolved send or collective (a participant built without links) takes
            // no time rather than hanging the replay.
            _ => self.schedule(now, p, op),
        }
    }

    fn collective_time(
        &mut self,
        op: CollectiveOp,
        bytes: Bytes,
        placement: GroupPlacement,
    ) -> Picos {
        let kind = net_kind(op);
        let net = self.net;
        *self
            .collective_cache
            .entry((kind, bytes, placement))
            .or_insert_with(|| {
                net.collective(&CollectiveRequest {
                    kind,
                    bytes,
                    placement,
                })
                .time
            })
    }

    /// A member reached a collective with a rendezvous; start it when all members have.
    fn arrive(
        &mut self,
        now: Picos,
        p: u32,
        op: u32,
        key: (u32, u32),
        members: u32,
        (cop, bytes, placement): (CollectiveOp, Bytes, GroupPlacement),
    ) {
        let w = self.rendezvous.entry(key).or_insert_with(|| Waiting {
            arrived: 0,
            members: Vec::new(),
            signature: (cop, bytes),
        });
        // Members of an all-to-all may move different amounts (a router's choices); the
        // exchange lasts as long as its largest share takes.
        if cop == CollectiveOp::AllToAll && w.signature.0 == cop {
            w.signature.1 = w.signature.1.max(bytes);
        }
        if w.signature.0 != cop || (cop != CollectiveOp::AllToAll && w.signature.1 != bytes) {
            self.error = Some(ReplayError::CollectiveMismatch {
                group: key.0,
                rank: self.states[p as usize].rank.0,
                got: format!("{cop:?} of {} B", bytes.0),
                expected: format!("{:?} of {} B", w.signature.0, w.signature.1 .0),
            });
            return;
        }
        w.arrived += 1;
        w.members.push((p, op));
        if w.arrived >= members {
            if let Some(w) = self.rendezvous.remove(&key) {
                let d = self.collective_time(cop, w.signature.1, placement);
                // Every member of a degraded group carries the same factor.
                let d = self.net_scaled(p, op, d);
                for (mp, mop) in w.members {
                    self.schedule(now + d, mp, mop);
                }
            }
        }
    }

    /// A compute duration of participant `p` starting at `now`, slowed by the windows
    /// that cover `now`.
    pub(crate) fn slowed(&self, p: u32, now: Picos, d: Picos) -> Picos {
        if self.hybrid.slow.is_empty() {
            return d;
        }
        match self.hybrid.slow.get(&p) {
            None => d,
            Some(ws) => ws
                .iter()
                .filter(|w| w.covers(now))
                .fold(d, |d, w| scaled(d, w.factor)),
        }
    }

    fn net_scaled(&self, p: u32, op: u32, d: Picos) -> Picos {
        if self.hybrid.net_scale.is_empty() {
            return d;
        }
        match self.hybrid.net_scale.get(&(p, op)) {
            Some(&f) => scaled(d, f),
            None => d,
        }
    }

    fn complete(&mut self, now: Picos, p: u32, op: u32) {
        self.events += 1;
        let kind;
        {
            let st = &mut self.states[p as usize];
            st.timing[op as usize].end = now;
            st.done += 1;
            let o = &st.graph.ops()[op as usize];
            kind = o.kind;
            if kind.occupies_stream() {
                let s = o.stream.index();
                st.stream_busy[s] = false;
                st.stream_head[s] += 1;
            }
        }
        if let (OpKind::Send { tag, .. }, Some(Link::Send { target, .. })) = (
            kind,
            self.states[p as usize].links.get(op as usize).copied(),
        ) {
            match self.waiting_recv.remove(&(target, tag)) {
                Some(recv) => self.schedule(now, target, recv),
                None => {
                    self.arrivals.insert((target, tag), now);
                }
            }
        }
        // Release dependents.
        let (a, b) = {
            let st = &self.states[p as usize];
            (
                st.dependents_start[op as usize] as usize,
                st.dependents_start[op as usize + 1] as usize,
            )
        };
        for i in a..b {
            let d = self.states[p as usize].dependents[i];
            let st = &mut self.states[p as usize];
            st.pending_deps[d as usize] -= 1;
            if st.pending_deps[d as usize] == 0 {
                self.ready(now, p, d);
            }
        }
        // The stream's next op may now start.
        if kind.occupies_stream() {
            let st = &self.states[p as usize];
            let s = st.graph.ops()[op as usize].stream;
            self.try_stream_head(now, p, s);
        }
    }

    fn try_stream_head(&mut self, now: Picos, p: u32, s: Stream) {
        let st = &self.states[p as usize];
        let si = s.index();
        if st.stream_busy[si] {
            return;
        }
        if let Some(&next) = st.stream_queue[si].get(st.stream_head[si]) {
            if st.pending_deps[next as usize] == 0 {
                let kind = st.graph.ops()[next as usize].kind;
                self.start_on_stream(now, p, next, kind, si);
            }
        }
    }
}
