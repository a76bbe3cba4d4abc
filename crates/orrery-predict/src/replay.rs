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
use orrery_graph::{CollectiveOp, ExecGraph, GroupRole, JobGraphs, OpKind, Stream};
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
    /// Participant index each Send's data goes to.
    send_target: Vec<u32>,
    /// Rendezvous key of each collective in all-rank mode (group, sequence on group).
    rendezvous: Vec<(GroupId, u32)>,
    done: usize,
}

impl<'g> State<'g> {
    fn new(graph: &'g ExecGraph, rank: RankId, class: ClassId) -> State<'g> {
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
            send_target: vec![u32::MAX; n],
            rendezvous: Vec::new(),
            done: 0,
        }
    }
}

struct Waiting {
    arrived: u32,
    members: Vec<(u32, u32)>,
    signature: (CollectiveOp, Bytes),
}

/// The replay engine over one job's graphs.
pub struct Engine<'a, N: NetworkModel> {
    graphs: &'a JobGraphs,
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
    rendezvous: HashMap<(GroupId, u32), Waiting>,
    collective_cache: HashMap<(CollectiveKind, Bytes, GroupPlacement), Picos>,
    error: Option<ReplayError>,
    events: u64,
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
    let mut engine = Engine::new(graphs, cost, net, mode);
    engine.run()
}

impl<'a, N: NetworkModel> Engine<'a, N> {
    fn new(graphs: &'a JobGraphs, cost: &'a CostModel, net: &'a N, mode: ReplayMode) -> Self {
        let layout = &graphs.layout;
        let mut states: Vec<State<'a>> = match mode {
            ReplayMode::Classes => (0..layout.num_classes())
                .map(|c| {
                    let class = ClassId(c);
                    State::new(graphs.class(class), layout.representative(class), class)
                })
                .collect(),
            ReplayMode::AllRanks => (0..layout.world_size())
                .map(|r| {
                    let class = layout.class_of(RankId(r));
                    State::new(graphs.class(class), RankId(r), class)
                })
                .collect(),
        };
        for st in &mut states {
            let mut seq_on_group: HashMap<GroupId, u32> = HashMap::new();
            if mode == ReplayMode::AllRanks {
                st.rendezvous = vec![(GroupId(u32::MAX), 0); st.graph.len()];
            }
            for (i, op) in st.graph.ops().iter().enumerate() {
                match op.kind {
                    OpKind::Send { peer, .. } => {
                        let peer_rank = layout.peer(st.rank, peer);
                        st.send_target[i] = match mode {
                            ReplayMode::Classes => layout.class_of(peer_rank).0,
                            ReplayMode::AllRanks => peer_rank.0,
                        };
                    }
                    OpKind::Collective { group, .. } if mode == ReplayMode::AllRanks => {
                        let gid = layout.group_id(st.rank, group);
                        let seq = seq_on_group.entry(gid).or_insert(0);
                        st.rendezvous[i] = (gid, *seq);
                        *seq += 1;
                    }
                    _ => {}
                }
            }
        }
        Engine {
            graphs,
            cost,
            net,
            mode,
            states,
            queue: BinaryHeap::new(),
            seq: 0,
            arrivals: HashMap::new(),
            waiting_recv: HashMap::new(),
            rendezvous: HashMap::new(),
            collective_cache: HashMap::new(),
            error: None,
            events: 0,
        }
    }

    fn schedule(&mut self, at: Picos, p: u32, op: u32) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, p, op)));
    }

    fn run(&mut self) -> Result<Timeline, ReplayError> {
        // Release every op with no dependencies, in participant then issue order.
        for p in 0..self.states.len() as u32 {
            let n = self.states[p as usize].graph.len();
            for op in 0..n as u32 {
                if self.states[p as usize].pending_deps[op as usize] == 0 {
                    self.ready(Picos::ZERO, p, op);
                }
            }
        }
        while let Some(Reverse((now, _, p, op))) = self.queue.pop() {
            self.complete(now, p, op);
            if let Some(e) = self.error.take() {
                return Err(e);
            }
        }
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
        match kind {
            OpKind::Compute { kind, flops, bytes } => {
                // Communication kernels running right now take SMs from this kernel.
                let comm_running = [
                    Stream::TpComm,
                    Stream::CpComm,
                    Stream::EpComm,
                    Stream::DpComm,
                ]
                .iter()
                .any(|s| self.states[p as usize].stream_busy[s.index()]);
                let d = if comm_running {
                    self.cost.duration_overlapped(&kind, flops, bytes)
                } else {
                    self.cost.duration(&kind, flops, bytes)
                };
                self.schedule(now + d, p, op);
            }
            OpKind::Send { bytes, peer, .. } => {
                let layout = &self.graphs.layout;
                let rank = self.states[p as usize].rank;
                let same = layout.same_node(rank, layout.peer(rank, peer));
                let d = self.net.point_to_point(bytes, same);
                self.schedule(now + d, p, op);
            }
            OpKind::Collective {
                op: cop,
                group,
                bytes,
            } => match self.mode {
                ReplayMode::Classes => {
                    let d = self.collective_time(p, cop, group, bytes);
                    self.schedule(now + d, p, op);
                }
                ReplayMode::AllRanks => self.arrive(now, p, op, cop, group, bytes),
            },
            OpKind::Recv { .. } | OpKind::Alloc { .. } | OpKind::Free { .. } => {}
        }
    }

    fn collective_time(
        &mut self,
        p: u32,
        op: CollectiveOp,
        group: GroupRole,
        bytes: Bytes,
    ) -> Picos {
        let layout = &self.graphs.layout;
        let pl = layout.placement(self.states[p as usize].rank, group);
        let placement = GroupPlacement {
            size: pl.size,
            nodes: pl.nodes,
            max_per_node: pl.max_per_node,
        };
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

    /// All-rank mode: a member reached a collective; start it when all members have.
    fn arrive(
        &mut self,
        now: Picos,
        p: u32,
        op: u32,
        cop: CollectiveOp,
        group: GroupRole,
        bytes: Bytes,
    ) {
        let key = self.states[p as usize].rendezvous[op as usize];
        let size = self.graphs.layout.group_size(group);
        let w = self.rendezvous.entry(key).or_insert_with(|| Waiting {
            arrived: 0,
            members: Vec::new(),
            signature: (cop, bytes),
        });
        if w.signature != (cop, bytes) {
            self.error = Some(ReplayError::CollectiveMismatch {
                group: key.0 .0,
                rank: self.states[p as usize].rank.0,
                got: format!("{cop:?} of {} B", bytes.0),
                expected: format!("{:?} of {} B", w.signature.0, w.signature.1 .0),
            });
            return;
        }
        w.arrived += 1;
        w.members.push((p, op));
        if w.arrived == size {
            if let Some(w) = self.rendezvous.remove(&key) {
                let d = self.collective_time(p, cop, group, bytes);
                for (mp, mop) in w.members {
                    self.schedule(now + d, mp, mop);
                }
            }
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
        if let OpKind::Send { tag, .. } = kind {
            let target = self.states[p as usize].send_target[op as usize];
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
